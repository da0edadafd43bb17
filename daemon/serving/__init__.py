"""The engine (loaded models), the slot scheduler and the request service."""
