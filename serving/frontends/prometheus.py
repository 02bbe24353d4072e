"""The server's metrics (`Orchestrator.metrics()`) in Prometheus' text exposition format, served
as `GET /metrics` on the HTTP port (`jaxrl serve --http-port`), where Prometheus, a GKE
PodMonitoring or vLLM-style dashboards scrape them.

Each numeric metric becomes `jaxrl_<name>`: the counts that only grow are counters (with
`_total`), the rest gauges; booleans are 0 or 1; anything else is left out."""

from __future__ import annotations

import math
import re

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Orchestrator.metrics() keys that only ever grow while the server runs.
COUNTERS = frozenset({
    "steps", "busy_slot_steps", "generated_tokens", "requests_done", "prefill_chunks",
    "prefill_tokens", "held_tokens", "preemptions", "session_evictions", "prefix_reused_tokens",
    "carried_tokens", "updates", "pause_leases_expired", "held_iterations", "process_compiles",
    "late_compiles", "spec_decode_verify_steps", "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"})


def exposition(metrics: dict, prefix: str = "jaxrl_") -> str:
    """`metrics` ({name: value}) as Prometheus text: a TYPE line and a sample per metric."""
    lines = []
    for key, value in sorted(metrics.items()):
        if isinstance(value, bool):
            value = int(value)
        if not isinstance(value, (int, float)) or (isinstance(value, float)
                                                   and math.isnan(value)):
            continue
        name = prefix + re.sub(r"[^a-zA-Z0-9_]", "_", key)
        kind = "counter" if key in COUNTERS else "gauge"
        if kind == "counter":
            name += "_total"
        lines += [f"# TYPE {name} {kind}", f"{name} {_number(value)}"]
    return "\n".join(lines) + "\n"


def _number(value) -> str:
    if isinstance(value, int):
        return str(value)
    return "+Inf" if value == math.inf else "-Inf" if value == -math.inf else repr(value)


def mount(app, generation) -> None:
    """Adds `GET /metrics` to FastAPI app `app`, reading `generation.metrics()` at each scrape."""
    from fastapi.responses import PlainTextResponse

    @app.get("/metrics")
    def metrics() -> PlainTextResponse:
        return PlainTextResponse(exposition(generation.metrics()), media_type=CONTENT_TYPE)
