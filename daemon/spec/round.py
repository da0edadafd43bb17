"""One step of a batch of generations, in phases: plan → propose → forward → verify and
commit → observe.

    plan      each sequence's round: how many tokens to draft, and from which source
              (the step's plan, batch_policy.py, where several sequences decode; else the
              sequence's own policy). A sequence still reading its prompt takes its next
              chunk instead, within the step's prefill budget.
    propose   the free offers are taken as planned; the model drafts are proposed one
              call per draft source for all the sequences drafting with it (a draft
              model steps them together, a pass per draft step for those still drafting;
              a head runs their blocks in one pass).
    forward   one target pass over every sequence's call: decode rows, verify blocks
              [last, *draft], prompt chunks.
    verify, commit, observe
              each sequence verifies its block (greedy, rejection sampling against q, or
              the target's own draw for coupled drafts), emits the accepted tokens and
              the target's own, and rolls its drafter forward; what the drafter computes
              from the verified tokens (a head's injections) runs in one pass for all the
              sequences completed here (`Drafter.batched_updates`). Each sequence's policy
              and the step planner learn from what the round cost and brought.

Where the step is planned as a whole, the planner's forecast (tokens, draft and target
seconds) and what the step measured are logged at debug level (logger `specd.round`).

The Scheduler runs a step for its active slots, `Generation.step()` for one sequence
alone, the trainer's distillation for its batch of replies: one round for all.

Invariants:
- A sequence's tokens do not depend on what shares its passes: every verified row equals
  the single step at its position (a round drafts at most `invariant_block_limit(pos) - 1`
  tokens; ort_models/runner.py), and prompt chunks end on attention-bucket boundaries.
  Greedy output is target-only decoding's; sampled output has the target's distribution
  (rejection sampling), and a seeded request's is target-only decoding's for its seed
  whatever is drafted (coupled drafts, coupling.py).
- A failure stays with its sequence: a failing pass is retried call by call; a drafter's
  exception drops the drafter of the sequences it failed (logged and counted, they go on
  target-only); an exception in a sequence's own phase is its result, not the step's.
- Rejected drafts need no rollback in the target: the next round overwrites their KV rows.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from specd.ort_models.runner import Call, ModelRunner

from .batch_policy import BatchDraftPlanner, Outlook
from .drafter import Drafter, DraftRequest, Proposal
from .policy import RoundPlan

if TYPE_CHECKING:
    from .generation import Generation

log = logging.getLogger("specd.round")

# what a sequence's step gave: the tokens it emitted, or the exception that failed it
StepResult = list[int] | Exception


@dataclass(frozen=True)
class DraftJob:
    """A round's model draft: the source that proposes it, and what it is asked."""

    source: Drafter
    request: DraftRequest


@dataclass
class StepReport:
    """What a step did: each sequence's result, in the order given, and the target pass."""

    results: list[StepResult]
    target_calls: int = 0  # sequences' calls in the step's target pass (0: no pass)


class BatchRound:
    """Steps a batch of generations on one target (module doc). `planner`: plans the
    drafts of a step several decoding sequences share, and learns the passes' costs
    (None: each sequence's own policy plans its round)."""

    def __init__(self, target: ModelRunner, planner: BatchDraftPlanner | None = None):
        self.target = target
        self.planner = planner

    def step(self, gens: Sequence[Generation], prefill_budget: int | None = None,
             on_planned: Callable[[], None] | None = None) -> StepReport:
        """One step of each generation (not yet done): its next prompt chunk (the chunks
        of all within `prefill_budget` tokens; a chunk beyond it waits) or its round;
        `on_planned` runs once the step is planned, before its passes."""
        results: list[StepResult] = [[] for _ in gens]
        calls: dict[int, Call] = {}
        t_plan = time.perf_counter()
        jobs = self._plan(gens, prefill_budget, calls, results)
        if on_planned is not None:
            on_planned()
        t_propose = time.perf_counter()
        self._propose(gens, jobs, calls, results)
        if not calls:
            return StepReport(results)
        order = sorted(calls)
        # a free offer's tokens are a windfall, not the pace the batch keeps
        steady = not any(gens[i].verifies_offer for i in order)
        t0 = time.perf_counter()
        outputs = forward_each(self.target, [calls[i] for i in order])
        with _batched_updates(gens[i] for i in order):
            for i, out in zip(order, outputs, strict=True):
                try:
                    if isinstance(out, Exception):
                        raise out
                    results[i] = gens[i].complete(out)
                except Exception as exc:
                    results[i] = exc
        t_end = time.perf_counter()
        if self.planner is not None and all(calls[i].rows is not None for i in order):
            experts = sum(o.pass_experts_share for o in outputs if not isinstance(o, Exception))
            self.planner.costs.observe_verify(sum(len(calls[i].tokens) for i in order),
                                              t_end - t0, experts)
            if steady:
                self.planner.costs.observe_pace(
                    len(order), sum(len(r) for r in results if isinstance(r, list)),
                    t_end - t_plan)
            if log.isEnabledFor(logging.DEBUG):
                self._log_step(gens, calls, results, (t_plan, t_propose, t0, t_end))
        return StepReport(results, len(order))

    def _log_step(self, gens: Sequence[Generation], calls: dict[int, Call],
                  results: list[StepResult], times: tuple[float, float, float, float]
                  ) -> None:
        """The step's plan and the planner's forecast beside what it measured: each
        sequence's verified drafts and tokens emitted, the phases' seconds."""
        t_plan, t_propose, t_forward, t_end = times
        assert self.planner is not None
        f = self.planner.forecast
        drafts = " ".join(f"{len(calls[i].tokens) - 1}>{len(r) if isinstance(r, list) else 'x'}"
                          for i, r in enumerate(results) if i in calls)
        emitted = sum(len(r) for r in results if isinstance(r, list))
        plan = " ".join(f"{n}L" if lookup else str(n) for n, lookup in f.drafts) if f else ""
        predicted = ("own plans" if f is None else
                     f"plan {plan} "
                     f"predicted {f.tokens:.2f} tok in {f.draft_s * 1e3:.1f}+"
                     f"{f.verify_s * 1e3:.1f} ms")
        log.debug("step of %d: %s; drafted>emitted %s = %d tok in %.1f+%.1f+%.1f ms "
                  "(plan+propose, forward+verify)", len(gens), predicted, drafts, emitted,
                  (t_propose - t_plan) * 1e3, (t_forward - t_propose) * 1e3,
                  (t_end - t_forward) * 1e3)

    def _plan(self, gens: Sequence[Generation], prefill_budget: int | None,
              calls: dict[int, Call], results: list[StepResult]) -> dict[int, DraftJob]:
        """Each sequence's prompt chunk (into `calls`) or round plan; the model drafts the
        rounds ask for."""
        plans = self._step_plans(gens)
        jobs: dict[int, DraftJob] = {}
        budget = prefill_budget
        for i, gen in enumerate(gens):
            try:
                if not gen.prefilled:
                    if budget is not None and budget <= 0:
                        continue  # its chunk waits a step
                    call = gen.prefill_call(budget)
                    if call is not None:
                        calls[i] = call
                        if budget is not None:
                            budget -= len(call.tokens)
                    continue
                job = gen.plan_round(plans.get(i))
                if job is not None:
                    jobs[i] = job
            except Exception as exc:
                results[i] = exc
        return jobs

    def _step_plans(self, gens: Sequence[Generation]) -> dict[int, RoundPlan]:
        """Each decoding sequence's round, where the step is planned as a whole (several
        sequences decoding, each with an estimate of what its draft brings)."""
        if self.planner is None:
            return {}
        indices: list[int] = []
        outlooks: list[Outlook] = []
        for i, gen in enumerate(gens):
            if gen.done or not gen.prefilled:
                continue
            o = gen.outlook()
            if o is None:
                return {}
            indices.append(i)
            outlooks.append(o)
        plans = self.planner.plans(outlooks)
        return {} if plans is None else dict(zip(indices, plans, strict=True))

    def _propose(self, gens: Sequence[Generation], jobs: dict[int, DraftJob],
                 calls: dict[int, Call], results: list[StepResult]) -> None:
        """The model drafts, one batch per source; then each planned round's target call."""
        drafted: dict[int, Proposal | Exception] = {}
        for source, members in _by_source(jobs):
            proposals = self._propose_batch(source, [jobs[i].request for i in members])
            drafted.update(zip(members, proposals, strict=True))
        for i, gen in enumerate(gens):
            if not gen.round_planned:
                continue
            try:
                call = gen.round_call(drafted.get(i))
            except Exception as exc:
                results[i] = exc
                continue
            if call is not None:
                calls[i] = call

    def _propose_batch(self, source: Drafter, requests: list[DraftRequest]
                       ) -> list[Proposal | Exception]:
        """The source's proposals for the batch; where it fails, each request alone, so
        that only the sequences whose drafts fail lose their drafter."""
        def observe(rows: int, seconds: float) -> None:
            if self.planner is not None:
                self.planner.costs.observe_draft(source, rows, seconds)

        try:
            return list(source.propose(requests, observe))
        except Exception as exc:
            if len(requests) == 1:
                return [exc]
            return [self._propose_batch(source, [r])[0] for r in requests]


def forward_each(runner: ModelRunner, calls: list[Call]) -> list[Any]:
    """The calls through `runner` in one pass; where it fails, each call alone, so that
    only the sequence whose call fails gets the error (its output: the exception)."""
    try:
        return list(runner.forward_batch(calls))
    except Exception as exc:
        if len(calls) == 1:
            return [exc]
        return [forward_each(runner, [c])[0] for c in calls]


def _by_source(jobs: dict[int, DraftJob]) -> list[tuple[Drafter, list[int]]]:
    """The sequences drafting with each source, in order."""
    groups: dict[int, tuple[Drafter, list[int]]] = {}
    for i, job in sorted(jobs.items()):
        groups.setdefault(id(job.source), (job.source, []))[1].append(i)
    return list(groups.values())


@contextmanager
def _batched_updates(gens: Iterator[Generation]) -> Iterator[None]:
    """Each distinct drafter of these generations batches what `process` computes."""
    with ExitStack() as stack:
        seen: set[int] = set()
        for gen in gens:
            d = gen.drafter
            if d is not None and id(d) not in seen:
                seen.add(id(d))
                stack.enter_context(d.batched_updates())
        yield
