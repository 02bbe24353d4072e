"""Generation behind one interface, in-process or remote.

The actor and the weight publisher talk to generation through these operations only, so a
rollout does not depend on where it was generated:

- `submit(prompt, sampling, *, carry=None, predicted_len=None, session=None) -> RequestStream`:
  one group (n samples of one prompt); every token arrives with its log-prob and its weights
  version. `carry`: the group as far as another engine got (`RequestStream.snapshot`),
  continued here. `session`: a turn of a multi-turn episode, continued from the KV pages its
  previous turn kept (serving/core/sessions.py); `end_session(key)` frees them.
- `update_params(params, version, timeout=None) -> UpdateResult`: new weights, swapped in between
  two decode steps once complete and checked; versions only go up (StaleVersion otherwise),
  except with `resume` (a trainer resumed from a checkpoint brings the engine back to it).
- `metrics() -> dict`: serving counters; `version` and `slots` among them.
- `newest_version`: the newest weights version served or accepted.

Implementations: `serving.core.orchestrator.Orchestrator` (this process's devices) and
`serving.fleet.client.RemoteGeneration` (a `jaxrl serve` process over gRPC).
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

from serving.core.orchestrator import UpdateResult
from serving.core.stream import RequestStream, Sample
from serving.runner.sampling import SamplingParams


@runtime_checkable
class Generation(Protocol):
    def submit(self, prompt: Sequence[int], sampling: SamplingParams, *,
               predicted_len: float | None = None, carry: Sequence[Sample] | None = None,
               session: str | Sequence[str] | None = None) -> RequestStream: ...

    def end_session(self, key: str) -> None: ...

    def update_params(self, params, version: int, timeout: float | None = None, *,
                      resume: bool = False) -> UpdateResult: ...

    def metrics(self) -> dict: ...

    @property
    def newest_version(self) -> int: ...
