"""Data-parallel replicas of the engine behind one Generation (serving/fleet/generation.py): `jaxrl
serve --replicas R --tensor T` runs R orchestrators, each over its own T devices (tensor
parallel within a replica), and the gRPC services see one engine.

- A group goes to the replica with the least load (sequences wanting a slot, per slot); the
  later turns of a session go where its first went, where its pages are kept.
- A weight update is checked and moved to every replica beside decoding, then each swaps it in
  between two of its decode steps; every replica serves the same versions, in order (one update
  at a time; a refused update changes no replica).
- Counters are summed over the replicas.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Sequence

from serving.core.orchestrator import Orchestrator, UpdateResult
from serving.core.stream import RequestStream, Sample
from serving.fleet.router import Router, session_keys
from serving.runner.sampling import SamplingParams

_SUMMED = ("steps", "busy_slot_steps", "generated_tokens", "requests_done", "prefill_chunks",
           "prefill_tokens", "queued", "slots", "pages_total", "pages_free", "held_tokens",
           "preemptions", "carried_tokens", "updates", "sessions_kept", "session_evictions",
           "prefix_reused_tokens", "spec_decode_verify_steps")
_SPECULATION = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                "spec_decode_num_accepted_tokens")
_MAX_HOMES = 1 << 16     # sessions whose replica is remembered (the least recent forgotten)


class Replicas:
    def __init__(self, replicas: Sequence[Orchestrator]):
        if not replicas:
            raise ValueError("Replicas needs at least one orchestrator")
        self.replicas = list(replicas)
        self.engine = self.replicas[0].engine     # the served model (names and shapes)
        self.eos_id = self.replicas[0].eos_id
        self._update_lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(len(self.replicas),
                                                           thread_name_prefix="replica-update")
        # Each session's turns go to the replica holding its kept pages; other groups to the
        # least loaded (serving/fleet/router.py).
        self._router = Router(lambda o: o.scheduler.load(), _MAX_HOMES)
        self._router_lock = threading.Lock()

    def start(self) -> "Replicas":
        for o in self.replicas:
            o.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        for o in self.replicas:
            o.stop(timeout)
        self._pool.shutdown(wait=True, cancel_futures=True)

    @property
    def error(self) -> BaseException | None:
        return next((o.error for o in self.replicas if o.error is not None), None)

    @property
    def newest_version(self) -> int:
        return self.replicas[0].newest_version

    def validate(self, prompt: Sequence[int], sampling: SamplingParams,
                 session: str | Sequence[str] | None = None) -> None:
        self.replicas[0].validate(prompt, sampling, session)   # every replica: same limits

    def submit(self, prompt: Sequence[int], sampling: SamplingParams, *,
               predicted_len: float | None = None, carry: Sequence[Sample] | None = None,
               session: str | Sequence[str] | None = None) -> RequestStream:
        with self._router_lock:
            replica = self._router.choose(self.replicas, session_keys(session))
        return replica.submit(prompt, sampling, predicted_len=predicted_len, carry=carry,
                              session=session)

    @property
    def can_score(self) -> bool:
        return self.replicas[0].can_score

    def score(self, tokens: Sequence[int], timeout: float | None = None):
        """Orchestrator.score on the replica the router would send a new request to."""
        with self._router_lock:
            replica = self._router.choose(self.replicas, ())
        return replica.score(tokens, timeout)

    def end_session(self, key: str) -> None:
        with self._router_lock:
            home = self._router.forget(key)
        if home is not None:
            home.end_session(key)

    def update_params(self, params, version: int, timeout: float | None = None, *,
                      resume: bool = False, pulled: bool = False) -> UpdateResult:
        """Every replica gets `params` as `version`. The checks (version, shapes, dtypes,
        finite) run on the first replica before any other is touched, so a refused update
        leaves every replica as it was."""
        with self._update_lock:
            first = self.replicas[0].update_params(params, version, timeout, resume=resume,
                                                   pulled=pulled)
            rest = [self._pool.submit(o.update_params, params, version, timeout, resume=resume,
                                      pulled=pulled)
                    for o in self.replicas[1:]]
            results = [first] + [f.result() for f in rest]
        return UpdateResult(version, max(r.transfer_s for r in results),
                            max(r.pause_s for r in results), first.adapters)

    def metrics(self) -> dict:
        each = [o.metrics() for o in self.replicas]
        out = dict(each[0])
        for key in _SUMMED:
            out[key] = sum(m[key] for m in each)
        steps = max(sum(m["steps"] * m["slots"] for m in each), 1)
        out["slots_busy_fraction"] = out["busy_slot_steps"] / steps
        out["held_tokens_mean"] = out["held_tokens"] / max(out["busy_slot_steps"], 1)
        if _SPECULATION[0] in out:
            for key in _SPECULATION:
                out[key] = sum(m[key] for m in each)
            out["spec_decode_mean_acceptance_length"] = 1 + out[_SPECULATION[2]] / max(
                out[_SPECULATION[0]], 1)
        out["update_pause_ms_max"] = max(m["update_pause_ms_max"] for m in each)
        out["replicas"] = len(each)
        out["replica_requests_done"] = [m["requests_done"] for m in each]
        return out
