"""The speculative round: one request's generation, verification, sampling,
the draft-length policy and the drafter interface."""
