"""What a request to the engine may be, checked before it is queued (pure functions of the
engine's configuration and the request), and the errors a caller can get back."""

from __future__ import annotations

from typing import Sequence as Seq

from jaxrl.errors import UserError
from serving.core.page_pool import PagePool
from serving.runner.engine import EngineConfig
from serving.runner.sampling import SamplingParams
from sharding.reshard import WeightUpdateError


class InvalidRequest(UserError):
    """A request the engine cannot serve; the message says what is wrong."""


class QueueFull(Exception):
    """Backpressure: the request queue is at its limit; retry later."""


class EngineStopped(RuntimeError):
    """The engine loop is not running (stopped, or ended by an error): nothing more will be
    served (gRPC UNAVAILABLE, HTTP 503)."""


class StaleVersion(WeightUpdateError):
    """A weight update whose version is not newer than the one served."""


def check_adapter(model_cfg, adapter: int) -> None:
    """InvalidRequest for an adapter set the model does not hold (lora.adapters of them)."""
    held = model_cfg.lora.adapters if model_cfg.lora.enabled else 1
    if not 0 <= adapter < held:
        raise InvalidRequest(f"adapter {adapter}: this engine holds {held} LoRA adapter "
                             f"set{'s' if held > 1 else ''} (0 .. {held - 1})")


def validate(cfg: EngineConfig, pool: PagePool, vocab_size: int, prompt: Seq[int],
             sampling: SamplingParams, session: str | Seq[str] | None = None) -> None:
    """Raises InvalidRequest naming what the engine cannot serve: the session keys, a sampling
    feature it did not compile, the prompt's length or tokens, max_tokens, n, or the KV pages
    the request would need at once."""
    if isinstance(session, str):
        if sampling.n != 1:
            raise InvalidRequest(f"a turn of session {session!r} must have n=1, not "
                                 f"n={sampling.n} (start n episodes with one session each)")
    elif session is not None and (len(session) != sampling.n or len(set(session)) != len(
            session) or not all(isinstance(k, str) for k in session)):
        raise InvalidRequest(f"sessions {list(session)!r}: a group's first turn names "
                             f"n={sampling.n} distinct sessions, one per sample")
    missing = [f for f in sampling.features() if f not in cfg.sampling_features]
    if missing:
        raise InvalidRequest(f"this sampling needs {missing}, which this engine's sampling "
                             f"programs leave out (EngineConfig.sampling_features="
                             f"{list(cfg.sampling_features)})")
    if len(prompt) == 0:
        raise InvalidRequest("prompt is empty")
    if len(prompt) > cfg.max_prefill_length:
        raise InvalidRequest(f"prompt has {len(prompt)} tokens; the limit is "
                             f"{cfg.max_prefill_length} (the engine's max_prefill_length: "
                             f"`jaxrl serve --max-prefill-length`)")
    check_tokens(prompt, vocab_size, "")
    check_tokens([t for t, _ in sampling.logit_bias], vocab_size, "logit_bias: ")
    room = cfg.max_len - len(prompt)
    if sampling.max_tokens > room:
        raise InvalidRequest(f"max_tokens={sampling.max_tokens} is over the limit: a "
                             f"{len(prompt)}-token prompt leaves room for {room}")
    if sampling.n > cfg.max_concurrent_decodes:
        raise InvalidRequest(f"n={sampling.n} exceeds the {cfg.max_concurrent_decodes} slots")
    pages = pool.pages_for(len(prompt)) + (sampling.n - 1) * (len(prompt) % cfg.page_size > 0)
    longest = pool.pages_for(len(prompt) + sampling.max_tokens)
    if max(pages, longest) > pool.capacity:
        raise InvalidRequest(f"the request needs {max(pages, longest)} KV pages of "
                             f"{cfg.page_size} tokens at once; the pool has {pool.capacity}")


def check_tokens(tokens: Seq[int], vocab_size: int, where: str) -> None:
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"{where}token id {bad[0]} is outside the vocabulary "
                             f"[0, {vocab_size})")
