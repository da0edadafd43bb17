"""/metrics in Prometheus text format: specd's own series, then llama-server's
(`llamacpp:*`, same names and meanings) for the dashboards and autoscalers built on it."""

from __future__ import annotations

from dataclasses import dataclass

from specd.daemon.serving.facade import Counters, ServiceFacade
from specd.daemon.spec.stats import SpecStats


@dataclass
class RateWindow:
    """llama-server's throughput gauges: tokens per second over the work done since the
    previous scrape (0 where there was none), so that a dashboard shows what runs now."""

    prompt: tuple[int, float] = (0, 0.0)  # prompt tokens evaluated, and seconds, by then
    predicted: tuple[int, float] = (0, 0.0)  # tokens after each request's first, seconds

    def rates(self, t: SpecStats) -> tuple[float, float]:
        """(prompt, generation) tokens per second since the last call; the window restarts."""
        prompt = (t.prompt_tokens - t.cached_tokens, t.prefill_s)
        predicted = (t.decoded_tokens, t.decode_s)
        out = _rate(prompt, self.prompt), _rate(predicted, self.predicted)
        self.prompt, self.predicted = prompt, predicted
        return out


def _rate(now: tuple[int, float], before: tuple[int, float]) -> float:
    seconds = now[1] - before[1]
    return (now[0] - before[0]) / seconds if seconds > 0 else 0.0


def render_metrics(svc: ServiceFacade, window: RateWindow) -> str:
    """The metrics text; `window`: the scrapes' own, for llama-server's rate gauges."""
    c = svc.counters()
    t = c.totals
    lines = [
        "# HELP specd_requests_total Requests finished (any outcome).",
        "# TYPE specd_requests_total counter",
        f"specd_requests_total {c.requests_total}",
        "# HELP specd_requests_failed_total Requests that ended in an error.",
        "# TYPE specd_requests_failed_total counter",
        f"specd_requests_failed_total {c.requests_failed}",
        "# TYPE specd_prompt_tokens_total counter",
        f"specd_prompt_tokens_total {t.prompt_tokens}",
        "# TYPE specd_tokens_generated_total counter",
        f"specd_tokens_generated_total {t.generated_tokens}",
        "# HELP specd_tokens_per_second Generated tokens per second of decode time.",
        "# TYPE specd_tokens_per_second gauge",
        f"specd_tokens_per_second {t.decode_tps:.3f}",
        "# TYPE specd_prompt_tokens_per_second gauge",
        f"specd_prompt_tokens_per_second {t.prefill_tps:.3f}",
        "# TYPE specd_draft_tokens_total counter",
        f"specd_draft_tokens_total {t.drafted}",
        "# TYPE specd_draft_tokens_accepted_total counter",
        f"specd_draft_tokens_accepted_total {t.accepted}",
        "# TYPE specd_mean_acceptance_length gauge",
        f"specd_mean_acceptance_length {t.mean_acceptance_length:.4f}",
        "# HELP specd_draft_acceptance_rate Acceptance at each draft position.",
        "# TYPE specd_draft_acceptance_rate gauge",
    ]
    for i, rate in enumerate(t.per_position_acceptance()):
        lines.append(f'specd_draft_acceptance_rate{{position="{i}"}} {rate:.4f}')
    lines += [
        "# HELP specd_drafter_failures_total Exceptions drafters raised (each request "
        "went on target-only).",
        "# TYPE specd_drafter_failures_total counter",
    ]
    failures = dict(t.drafter_failures)
    if c.drafter is not None:
        failures.setdefault(c.drafter, 0)
    for name, n in sorted(failures.items()):
        lines.append(f'specd_drafter_failures_total{{drafter="{name}"}} {n}')
    lines += [
        "# TYPE specd_queue_length gauge",
        f"specd_queue_length {c.queue_length}",
        "# TYPE specd_slots_busy gauge",
        f"specd_slots_busy {c.busy_slots}",
        "# TYPE specd_slots_total gauge",
        f"specd_slots_total {c.n_slots}",
        "# HELP specd_history_tokens Tokens the history index holds, every user's.",
        "# TYPE specd_history_tokens gauge",
        f"specd_history_tokens {c.history_tokens}",
        "# HELP specd_history_bytes Bytes of the history index's arrays, every user's.",
        "# TYPE specd_history_bytes gauge",
        f"specd_history_bytes {c.history_bytes}",
        "# HELP specd_history_bound_bytes The most bytes one user's history may take "
        "(0: history off).",
        "# TYPE specd_history_bound_bytes gauge",
        f"specd_history_bound_bytes {c.history_bound_bytes}",
    ]
    return "\n".join(lines + _llamacpp(c, window)) + "\n"


def _llamacpp(counted: Counters, window: RateWindow) -> list[str]:
    """llama-server's series: counters since start, rates since the last scrape."""
    t, c = counted.totals, counted.passes
    prompt_rate, predicted_rate = window.rates(t)
    counters = [
        ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens",
         t.prompt_tokens - t.cached_tokens),
        ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache",
         t.cached_tokens),
        ("prompt_seconds_total", "Total time spent processing prompts", t.prefill_s),
        ("tokens_predicted_total", "Number of generation tokens processed",
         t.generated_tokens),
        ("tokens_predicted_seconds_total", "Total time spent generating tokens", t.decode_s),
        ("n_decode_total", "Total number of target model passes (prompt chunks and "
         "speculative rounds, every slot's in one)", c.passes),
        ("n_tokens_max", "Largest observed sequence length (prompt + generation)",
         c.n_tokens_max),
        ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated",
         t.drafted),
        ("spec_decode_num_accepted_tokens_total",
         "Speculative: Total draft tokens accepted by the target model", t.accepted),
        ("spec_decode_num_drafts_total",
         "Speculative: Total speculative decoding verification steps", t.rounds),
    ]
    gauges = [
        ("prompt_tokens_seconds", "Average prompt throughput in tokens/s", prompt_rate),
        ("predicted_tokens_seconds", "Average generation throughput in tokens/s",
         predicted_rate),
        ("requests_processing", "Number of requests processing",
         counted.busy_slots),
        ("requests_deferred", "Number of requests deferred", counted.queue_length),
        ("n_busy_slots_per_decode", "Average number of busy slots per target pass",
         c.rows / max(c.passes, 1)),
    ]
    out: list[str] = []
    for kind, items in (("counter", counters), ("gauge", gauges)):
        for name, help_text, value in items:
            out += [f"# HELP llamacpp:{name} {help_text}", f"# TYPE llamacpp:{name} {kind}",
                    f"llamacpp:{name} {_number(value)}"]
    if t.accepted_at:
        name = "llamacpp:spec_decode_num_accepted_tokens_per_pos_total"
        out += [f"# HELP {name} Accepted tokens per draft position",
                f"# TYPE {name} counter"]
        out += [f'{name}{{position="{i}"}} {n}' for i, n in enumerate(t.accepted_at)]
    return out


def _number(value: float) -> str:
    """An integer as one, else a float rounded to microseconds' precision."""
    return str(value) if isinstance(value, int) else f"{value:.6f}"
