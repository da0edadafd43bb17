"""/metrics in Prometheus text format."""

from __future__ import annotations

from specd.daemon.serving.service import Service


def render_metrics(svc: Service) -> str:
    sch = svc.scheduler
    t = sch.totals
    busy = sum(1 for s in sch.slots if s.request is not None)
    lines = [
        "# HELP specd_requests_total Requests finished (any outcome).",
        "# TYPE specd_requests_total counter",
        f"specd_requests_total {sch.requests_total}",
        "# HELP specd_requests_failed_total Requests that ended in an error.",
        "# TYPE specd_requests_failed_total counter",
        f"specd_requests_failed_total {sch.requests_failed}",
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
        "# TYPE specd_queue_length gauge",
        f"specd_queue_length {sch.queue_length}",
        "# TYPE specd_slots_busy gauge",
        f"specd_slots_busy {busy}",
        "# TYPE specd_slots_total gauge",
        f"specd_slots_total {len(sch.slots)}",
    ]
    return "\n".join(lines) + "\n"
