"""Slots and continuous batching: one worker thread drives every active generation.

Each slot owns one target KV sequence (and the drafter's sequence of the same index).
Between rounds new requests join free slots and finished or cancelled ones leave. A new
request takes the free slot whose cached tokens share the longest prefix with its prompt
and reuses that KV (with no real match: an empty slot, else the one used longest ago).
Prefill runs in chunks of `prefill_chunk` tokens interleaved with the other slots'
rounds, so a long prompt does not stall running streams.

A step advances every active slot once, in lockstep: one round for all of them
(spec/round.py: plan, propose a batch per draft source, one target pass for every slot's
call, including prompt chunks within the step's `prefill_chunk` budget, then verify and
commit each). An error stays with the request it belongs to. The policies and the step's
planner time the batched passes: what a round costs beside its neighbours.

Rows are computed the same way however they are batched or chunked (see
ort_models/graph_builder/), so a request's output does not depend on what else runs.
On CUDA that holds for decoding and verify blocks (one fixed call shape), not across
prefill chunkings: a prompt whose prefix was reused is prefilled in other chunks than a
fresh one, and ORT's CUDA kernels may round those rows differently (ort_models/runner.py).

The worker also owns whether the engine is loaded. Once nothing has run, waited or been
held for the keep-alive (the latest request's own, else the scheduler's), it unloads the
engine (its sessions, KV caches, drafter) and forgets the slots' cached prefixes; the next
request or hold loads it again before anything runs. Running requests are never cut: the
model unloads only while idle.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field

from specd.daemon.drafters.history import principal_of
from specd.daemon.spec.batch_policy import BatchDraftPlanner
from specd.daemon.spec.generation import (
    Generation,
    GenerationParams,
    PromptProgress,
    RequestError,
)
from specd.daemon.spec.media import PromptImage
from specd.daemon.spec.round import BatchRound
from specd.daemon.spec.stats import SpecStats
from specd.daemon.text.grammar import Grammar
from specd.memory_fit.rss import rss_bytes

from .engine import Engine
from .outbox import Outbox

log = logging.getLogger("specd.scheduler")


# a request waits for a slot still evaluating a prompt that shares this many more tokens
# with its own, to copy that KV rather than evaluate the same prefix twice
SHARED_PREFIX_WAIT = 32
NEVER = -1.0  # a keep-alive under 0: the model stays loaded


@dataclass(frozen=True)
class Residency:
    """Whether the engine is loaded, and until when (Unix time; inf: no unload planned;
    while requests run, the keep-alive counted from now)."""

    loaded: bool
    expires_at: float | None


class QueueFull(Exception):
    pass


@dataclass
class PassCounts:
    """The target's passes, as llama-server's /metrics counts its decode calls."""

    passes: int = 0  # target passes: prompt chunks and rounds, every slot's call in one
    rows: int = 0  # slots' calls those passes carried (busy slots per pass: rows / passes)
    n_tokens_max: int = 0  # the longest sequence a slot has held (prompt + generated)


@dataclass
class Request:
    prompt: list[int]
    params: GenerationParams
    # called from the worker thread with each round's tokens; True: end the request there
    # (its consumer met a stop string or its time limit)
    on_tokens: Callable[[list[int]], bool | None]
    on_done: Callable[[Request], object]  # its result is not used
    cache_prompt: bool = True
    # whose request this is (an OS user, a token, a client's cache key): a slot's cached
    # prefix is reused only by a request of the identity that filled it
    identity: str = ""
    grammar: Grammar | None = None  # compiled constraint; a fresh state per request
    # told the prompt's progress (cached, processed, total tokens) on the worker thread
    on_prompt_progress: PromptProgress | None = None
    # the prompt's images, at their placeholders in `prompt` (spec/media.py): the slots'
    # prefixes tell images apart by their placeholders, derived from each image's bytes
    images: tuple[PromptImage, ...] = ()
    # instead of generating: run this with the slot's index on the worker thread, once;
    # it returns (its result, the tokens the slot's KV then holds) (embeddings)
    task: Callable[[int], tuple[object, list[int]]] | None = None
    result: object = None
    id: int = 0
    gen: Generation | None = None
    slot: int | None = None
    error: str | None = None
    cancelled: bool = False
    t_submit: float = field(default_factory=time.monotonic)
    # how long the model stays loaded once idle after it (seconds; < 0: forever; None:
    # the scheduler's default); the latest request's counts
    keep_alive: float | None = None

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class Slot:
    index: int
    cached: list[int] = field(default_factory=list)  # tokens whose KV the slot holds
    request: Request | None = None
    identity: str = ""  # whose tokens `cached` are
    last_used: int = 0  # when its last request ended (a counter): evict the oldest first


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Scheduler:
    def __init__(self, engine: Engine, *, max_queue: int = 64, prefill_chunk: int = 256,
                 keep_alive: float = NEVER):
        """keep_alive: seconds the engine stays loaded once idle, where a request names
        none (< 0: forever; 0: unloaded as soon as idle)."""
        self.engine = engine
        self.keep_alive = keep_alive
        self._alive_s = keep_alive  # the latest request's keep-alive, or the default
        self._idle_since = time.monotonic()  # when the last request or hold ended
        self._holds = 0  # blocks that need the engine loaded (hold)
        self._load_wanted = False  # a hold waits for a load
        self._loads = 0  # load attempts finished
        self._load_error: str | None = None  # the last attempt's failure
        self._unloading = False
        self._release_wanted = False  # unload once idle whatever the keep-alive (release)
        # held while the engine loads: where several models share the memory, the room
        # for this one is made first (served_models.py)
        self.load_gate: Callable[[], AbstractContextManager[None]] = nullcontext
        self.slots = [Slot(i) for i in range(engine.cfg.slots)]
        self.max_queue = max_queue
        self.prefill_chunk = prefill_chunk
        self.queue: deque[Request] = deque()
        self.totals = SpecStats()
        self.counts = PassCounts()
        self.requests_total = 0
        self.requests_failed = 0
        self._lock = threading.Condition()
        self._next_id = 1
        self._used = 0  # slots' last_used clock
        self._stop = False
        self._last_prompts_only = False  # the last step ran prompt chunks alone
        # plans the drafts of a step several decoding slots share (one slot: its own policy)
        self.planner = BatchDraftPlanner()
        self.round: BatchRound | None = None  # over the engine's runner while loaded
        if engine.loaded:
            self.round = BatchRound(engine.target.runner, self.planner)
        self._thread = threading.Thread(target=self._run, name="specd-scheduler", daemon=True)
        # the readers' wake-ups, held while a step is planned (outbox.py)
        self.outbox = Outbox()
        self.outbox.worker = self._thread
        self._thread.start()

    # -- API (any thread) -----------------------------------------------------------------
    def submit(self, req: Request) -> Request:
        with self._lock:
            self._drop_cancelled()  # requests whose clients left hold no place in the queue
            if len(self.queue) >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting)")
            req.id = self._next_id
            self._next_id += 1
            self._keep_for(req.keep_alive)
            self.queue.append(req)
            self._lock.notify_all()
        return req

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        self._thread.join(timeout=10)
        self.engine.save_history()

    def clear_cache(self, principal: str) -> tuple[int, int]:
        """Forget what `principal` (an identity before any cache key) left behind: its
        history, and the prompts idle slots cache for it. (tokens of history, slots)"""
        with self._lock:
            slots = [s for s in self.slots
                     if s.request is None and s.cached and principal_of(s.identity) == principal]
            for s in slots:
                s.cached, s.identity = [], ""
        return self.engine.history.clear(principal), len(slots)

    def set_keep_alive(self, keep_alive: float | None) -> None:
        """A keep-alive with nothing to run (Ollama's empty request): how long the engine
        stays loaded once idle from now on (0: unloaded as soon as nothing runs)."""
        with self._lock:
            self._keep_for(keep_alive)
            self._lock.notify_all()

    def release(self, timeout: float) -> bool:
        """Unload the engine as soon as nothing runs, and wait for it (at most `timeout`
        seconds): whether it is unloaded. The next request loads it again."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._release_wanted = True  # kept through requests that come meanwhile
            self._lock.notify_all()
            while self.engine.loaded or self._unloading:
                left = deadline - time.monotonic()
                if left <= 0 or self._stop:
                    return False
                self._lock.wait(left)
        return True

    @contextmanager
    def hold(self, keep_alive: float | None = None) -> Iterator[None]:
        """The engine loaded (by the worker, if it was not) and kept loaded for the block:
        work that runs beside the scheduler (an embedding model's requests), or a load
        request. RuntimeError when the load fails or the scheduler stops."""
        with self._lock:
            self._keep_for(keep_alive)
            self._holds += 1
            try:
                start = self._loads
                while not self.engine.loaded or self._unloading:
                    if self._stop:
                        raise RuntimeError("specd is shutting down")
                    if self._loads > start and self._load_error:
                        raise RuntimeError(self._load_error)
                    self._load_wanted = True
                    self._lock.notify_all()
                    self._lock.wait()
            except BaseException:
                self._release()
                raise
        try:
            yield
        finally:
            with self._lock:
                self._release()

    def _release(self) -> None:
        """A hold ends (the caller holds the lock)."""
        self._holds -= 1
        self._idle_since = time.monotonic()
        self._lock.notify_all()

    def _keep_for(self, keep_alive: float | None) -> None:
        """The engine's keep-alive from now on (the caller holds the lock)."""
        self._alive_s = self.keep_alive if keep_alive is None else keep_alive

    def residency(self) -> Residency:
        """Whether the engine is loaded and until when (see Residency)."""
        with self._lock:
            if not self.engine.loaded:
                return Residency(False, None)
            if self._alive_s < 0:
                return Residency(True, math.inf)
            since = time.monotonic() if self._busy() else self._idle_since
            return Residency(True, time.time() + since + self._alive_s - time.monotonic())

    def count_prompts(self, lengths: list[int], seconds: float) -> None:
        """Prompts evaluated outside a Generation (embedding inputs, a pass each) join
        the totals."""
        with self._lock:
            self.totals.merge(SpecStats(prompt_tokens=sum(lengths), prefill_s=seconds))
            self.counts.passes += len(lengths)
            self.counts.rows += len(lengths)
            self.counts.n_tokens_max = max([self.counts.n_tokens_max, *lengths])

    @property
    def queue_length(self) -> int:
        """Requests waiting for a slot (not those cancelled while they waited)."""
        return sum(not r.cancelled for r in list(self.queue))

    def slot_info(self) -> list[dict[str, object]]:
        out: list[dict[str, object]] = []
        for s in self.slots:
            r = s.request
            out.append({
                "id": s.index,
                "state": "idle" if r is None else ("prefill" if r.gen is None
                                                   or not r.gen.prefilled else "generating"),
                "n_cached": len(s.cached),
                "request_id": None if r is None else r.id,
                "n_generated": 0 if r is None or r.gen is None else len(r.gen.tokens),
                # llama-server's
                "is_processing": r is not None, "n_ctx": self.engine.n_ctx,
                "speculative": self.engine.drafter_name is not None,
            })
        return out

    # -- worker ---------------------------------------------------------------------------
    def _drop_cancelled(self) -> None:
        """Finish the queued requests whose clients left (the caller holds the lock)."""
        if any(r.cancelled for r in self.queue):
            gone = [r for r in self.queue if r.cancelled]
            self.queue = deque(r for r in self.queue if not r.cancelled)
            for r in gone:
                self._finish(r, None)

    def _choose_slot(self, free: list[Slot], req: Request) -> Slot:
        """The free slot sharing the longest prefix with the prompt; with no real match (a
        BOS alone is none), an empty slot, else the one used longest ago: another
        conversation's cache is only given up when nothing else is free."""
        def key(s: Slot) -> tuple[int, bool, int]:
            return self._reusable(s, req), not s.cached, -s.last_used

        return max(free, key=key)

    @staticmethod
    def _held(slot: Slot) -> list[int]:
        """The tokens whose KV the slot holds now (a generating slot's grow each step)."""
        r = slot.request
        if r is None:
            return slot.cached
        return [] if r.gen is None else r.gen.evaluated_tokens

    def _reusable(self, slot: Slot, req: Request) -> int:
        """Prompt tokens whose KV the slot holds for this request: a shared prefix of the
        same identity's tokens (another's would leak, by counts and timing, what it
        asked), of more than a BOS."""
        if not req.cache_prompt or slot.identity != req.identity:
            return 0
        shared = common_prefix(self._held(slot), req.prompt)
        return shared if shared > 1 else 0

    def _donor(self, req: Request, slot: Slot) -> tuple[Slot | None, int]:
        """The other slot (idle or generating) holding the longest prefix of the prompt
        for this request, and that prefix's length."""
        best: tuple[Slot | None, int] = (None, 0)
        for other in self.slots:
            if other is not slot:
                shared = min(self._reusable(other, req), len(req.prompt) - 1)
                if shared > best[1]:
                    best = (other, shared)
        return best

    @property
    def _copies_prefixes(self) -> bool:
        """Whether a prompt's prefix may be copied from another slot: not where the
        drafter keeps a context of the target's features per slot (a head's cache), which
        the copy would leave behind."""
        return self.engine.copies_prefixes

    def _waits_for_prefix(self, req: Request) -> bool:
        """Whether the request is better off waiting a step: another slot of its identity
        is still evaluating a prompt sharing SHARED_PREFIX_WAIT more tokens with it than
        any slot holds now (n choices of one prompt: one prefill, then copies)."""
        if not req.cache_prompt or req.task is not None or not self._copies_prefixes:
            return False
        have = max((self._reusable(s, req) for s in self.slots), default=0)
        return any(s.request is not None and s.request.gen is not None
                   and not s.request.gen.prefilled and s.identity == req.identity
                   and common_prefix(s.request.prompt, req.prompt) >= have + SHARED_PREFIX_WAIT
                   for s in self.slots)

    def _next_admissible(self) -> Request | None:
        """The first queued request not waiting for another's prefix, off the queue."""
        for req in self.queue:
            if not self._waits_for_prefix(req):
                self.queue.remove(req)
                return req
        return None

    def _admit(self) -> None:
        with self._lock:
            self._drop_cancelled()
            while self.queue:
                free = [s for s in self.slots if s.request is None]
                if not free:
                    return
                req = self._next_admissible()
                if req is None:
                    return
                slot = self._choose_slot(free, req)
                if req.task is not None:  # runs in _step, outside the lock
                    slot.request, req.slot = req, slot.index
                    slot.identity = req.identity
                    continue
                reuse = self._reusable(slot, req)
                donor, shared = self._donor(req, slot) if self._copies_prefixes else (None, 0)
                if donor is not None and shared > reuse and self.engine.target.runner.copy_prefix(
                        donor.index, slot.index, shared, len(self._held(donor))):
                    reuse = shared  # the prefix's KV copied from the other slot
                try:
                    req.gen = self.engine.start(
                        slot.index, req.prompt, req.params, reuse=reuse,
                        grammar=None if req.grammar is None else req.grammar.start(),
                        on_prompt_progress=req.on_prompt_progress, images=req.images,
                        identity=req.identity)
                except (RequestError, ValueError) as exc:
                    req.error = str(exc)
                    self._finish(req, None)
                    continue
                except Exception as exc:  # off the queue: must still finish
                    log.exception("request %d could not start", req.id)
                    req.error = f"internal error: {exc}"
                    self._finish(req, None)
                    continue
                slot.cached = list(req.prompt[:req.gen.reused])
                slot.identity = req.identity
                slot.request = req
                req.slot = slot.index

    def _busy(self) -> bool:
        """Requests running or queued, or a hold open (the caller holds the lock)."""
        return bool(self.queue) or self._holds > 0 or any(
            s.request is not None for s in self.slots)

    def _has_work(self) -> bool:
        """Requests to run, or a load to do (the caller holds the lock)."""
        return bool(self.queue) or self._load_wanted or any(
            s.request is not None for s in self.slots)

    def _expiry(self) -> float | None:
        """When the idle engine unloads (monotonic; None: not while it is busy or kept
        forever; the caller holds the lock)."""
        if not self.engine.loaded or self._busy():
            return None
        if self._release_wanted:
            return self._idle_since
        if self._alive_s < 0:
            return None
        return self._idle_since + self._alive_s

    def _run(self) -> None:
        while True:
            unload = False
            with self._lock:
                while not self._stop and not self._has_work():
                    expiry = self._expiry()
                    wait = None if expiry is None else expiry - time.monotonic()
                    if wait is not None and wait <= 0:
                        unload = True
                        break
                    self.outbox.flush()
                    self._lock.wait(wait)
                if self._stop:
                    self.outbox.flush()
                    return
            try:
                if unload:
                    self._unload()
                    continue
                if not self.engine.loaded and not self._load():
                    continue
                self._admit()
                self._step()
                self.engine.save_history(only_if_due=True)
            except Exception:  # the worker must outlive any bug
                log.exception("scheduler round failed")

    def _unload(self) -> None:
        """Release the idle engine's sessions; the slots' KV, and so their cached
        prefixes, go with them."""
        before = rss_bytes()
        with self._lock:  # a request or hold may have come since the wait ended
            expiry = self._expiry()
            if expiry is None or expiry > time.monotonic():
                return
            self._unloading = True
            for slot in self.slots:
                slot.cached, slot.identity = [], ""
        try:
            self.round = None
            self.engine.unload()
        finally:
            with self._lock:
                self._unloading = self._release_wanted = False
                self._lock.notify_all()
        log.info("unloaded %s after %.0f s idle (RSS %.0f -> %.0f MB)",
                 self.engine.model_name, time.monotonic() - self._idle_since,
                 before / 1e6, rss_bytes() / 1e6)

    def _load(self) -> bool:
        """Load the engine for the requests or holds waiting (from the graph cache);
        on failure the queued requests fail with its message. Whether it loaded."""
        t0 = time.monotonic()
        with self._lock:
            self._load_wanted = False
        try:
            with self.load_gate():
                self.engine.load()
            self.round = BatchRound(self.engine.target.runner, self.planner)
            error = None
        except Exception as exc:
            log.exception("loading %s failed", self.engine.model_name)
            error = f"the model could not be loaded: {exc}"
        with self._lock:
            self._loads += 1
            self._load_error = error
            self._idle_since = time.monotonic()
            if error is not None:
                failed, self.queue = list(self.queue), deque()
                for req in failed:
                    req.error = error
                    self._finish(req, None)
            self._lock.notify_all()
        if error is None:
            log.info("loaded %s in %.1f s", self.engine.model_name, time.monotonic() - t0)
        return error is None

    def _step(self) -> None:
        """One step of every active slot: its round, or its next prompt chunk within the
        step's prefill budget (spec/round.py).

        While prompts are evaluated, steps alternate: one runs the prompt chunks alone,
        the next every slot. A pass of a chunk's rows is compute-bound, so rows riding
        along would lengthen it as much as a pass of their own: a new request's first
        token comes a decode pass sooner, and running streams still advance every other
        chunk."""
        prompts_only = not self._last_prompts_only and any(
            s.request is not None and s.request.gen is not None and not s.request.cancelled
            and not s.request.gen.prefilled for s in self.slots)
        self._last_prompts_only = prompts_only
        stepping: list[Slot] = []
        for slot in self.slots:
            req = slot.request
            if req is None:
                continue
            if req.task is not None:
                self._run_task(slot, req, req.task)
                continue
            gen = req.gen
            assert gen is not None
            if req.cancelled:
                gen.finish("cancelled")
            elif not (gen.prefilled and prompts_only):  # else it decodes in the next step
                stepping.append(slot)
            self._settle(slot)
        if not stepping:
            self.outbox.flush()
            return
        assert self.round is not None  # loaded: requests run only then
        report = self.round.step([self._gen(s) for s in stepping], self.prefill_chunk,
                                 on_planned=self.outbox.flush)
        if report.target_calls:
            self.counts.passes += 1
            self.counts.rows += report.target_calls
        for slot, result in zip(stepping, report.results, strict=True):
            req = slot.request
            assert req is not None and req.gen is not None
            try:
                if isinstance(result, Exception):
                    raise result
                if result and req.on_tokens(result):
                    req.gen.finish("stop")  # the request's consumer wants no more
            except Exception as exc:  # one bad request never stops the daemon
                self._fail(req, exc)
            self._settle(slot)

    @staticmethod
    def _gen(slot: Slot) -> Generation:
        assert slot.request is not None and slot.request.gen is not None
        return slot.request.gen

    def _fail(self, req: Request, exc: Exception) -> None:
        """The request ends with an error (one bad request never stops the daemon)."""
        log.error("request %d failed", req.id, exc_info=exc)
        req.error = f"internal error: {exc}"
        assert req.gen is not None
        req.gen.finish("error")

    def _settle(self, slot: Slot) -> None:
        """A slot whose generation is done gives its request back."""
        req = slot.request
        if req is None or req.gen is None or not req.gen.done:
            return
        gen = req.gen
        with self._lock:  # _finish also runs from submit() (requests cancelled queued)
            # the KV now holds the prompt and everything evaluated after it
            slot.cached = gen.evaluated_tokens if gen.finish_reason != "error" else []
            self.counts.n_tokens_max = max(self.counts.n_tokens_max, len(slot.cached))
            self._finish(req, slot)

    def _run_task(self, slot: Slot, req: Request,
                  task: Callable[[int], tuple[object, list[int]]]) -> None:
        """A task request on its slot: its KV is the task's to overwrite."""
        self.outbox.flush()  # the streams' last tokens do not wait for the task
        cached: list[int] = []
        if not req.cancelled:
            try:
                req.result, cached = task(slot.index)
            except Exception as exc:  # one bad request never stops the daemon
                log.exception("request %d failed", req.id)
                req.error = f"internal error: {exc}"
                cached = []
        with self._lock:
            slot.cached = cached
            self._finish(req, slot)

    def _finish(self, req: Request, slot: Slot | None) -> None:
        """A request leaves (its slot, if any, is free again); the caller holds the lock."""
        if slot is not None:
            slot.request = None
            self._used += 1
            slot.last_used = self._used
        self._idle_since = time.monotonic()
        if req.gen is not None:
            try:
                req.gen.close()
            except Exception as exc:  # drafter errors raised (the test suite): it fails
                log.error("request %d failed at its end", req.id, exc_info=exc)
                req.error = req.error or f"internal error: {exc}"
            self.totals.merge(req.gen.stats)
            if req.error is None:
                try:
                    self.engine.remember(req.identity, req.gen.all_tokens)
                except Exception as exc:  # the request fails; it still ends (on_done)
                    log.error("request %d failed joining the history", req.id, exc_info=exc)
                    req.error = f"internal error: {exc}"
        self.requests_total += 1
        if req.error:
            self.requests_failed += 1
        try:
            req.on_done(req)
        except Exception:
            log.exception("on_done callback failed")
