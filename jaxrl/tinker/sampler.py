"""Sampling for the Tinker API on jaxrl's engine (paged KV, chunked prefill, continuous
batching, in-flight adapter updates, speculative decoding where it is on).

The engine holds one set of LoRA adapters of the service's largest rank on every projection;
a client's adapters of a smaller rank or fewer targets are written into it exactly (zero rows
and columns, B scaled by the ratio of the two scales). Requests are served a weights key at a
time: every queued request of one key is submitted and decoded together, then the next key's
adapters are swapped in by the engine's adapter-only update (no reload, no recompile) between
two decode steps.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.models import lora
from jaxrl.models.lora import LoraConfig
from jaxrl.tinker.errors import NotFound
from jaxrl.tinker.training import ALPHA
from jaxrl.tinker.wire import Sequence
from serving.core.orchestrator import Orchestrator
from serving.frontends.detokenize import IncrementalDecoder
from serving.runner.sampling import SamplingParams

JOIN_S = 30.0


@dataclasses.dataclass
class Job:
    weights: str                         # the key of the adapters it samples with
    prompt: list[int]
    sampling: SamplingParams
    stops: list[str]                     # stop strings: each sample is cut after the first
    prompt_logprobs: bool
    done: Callable[[list[Sequence] | None, list[float] | None, Exception | None], None]


class Sampler:
    """The engine, the adapters it can switch to (by key), and the thread that serves Jobs."""

    def __init__(self, orchestrator: Orchestrator, tokenizer, held: LoraConfig):
        self.orchestrator, self.tokenizer, self.held = orchestrator, tokenizer, held
        self._adapters: dict[str, dict] = {}     # key -> engine-shaped adapters
        self._lock = threading.Lock()             # guards _adapters
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._current: str | None = None          # key served now (the sampler thread's)
        self._version = orchestrator.version
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tinker-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._jobs.put(None)
        self._thread.join(JOIN_S)

    # -- adapters ------------------------------------------------------------------------------
    def publish(self, key: str, lo: LoraConfig, adapters: dict | None) -> None:
        """Makes `key` sample with `adapters` (of shape `lo`; None: the base model)."""
        engine_tree = self.engine_adapters(lo, adapters)
        with self._lock:
            self._adapters[key] = engine_tree

    def forget(self, keys) -> None:
        """Drops adapters no session samples with any more (requests queued for them still
        find them: the thread serving them holds its own reference)."""
        with self._lock:
            for key in keys:
                self._adapters.pop(key, None)

    def has(self, key: str) -> bool:
        with self._lock:
            return key in self._adapters

    def engine_adapters(self, lo: LoraConfig, adapters: dict | None) -> dict:
        """A client's adapters as the engine holds them: rank padded to the held rank, B
        scaled by scale(lo) / scale(held), projections it does not adapt zero."""
        target = lora.trainable(self.orchestrator.engine.param_target)["layers"]
        out = {}
        for name, spec in target.items():
            have = None if adapters is None else adapters["layers"].get(name)
            if have is None:
                out[name] = np.zeros(spec.shape, np.float32)
                continue
            have = np.asarray(have, np.float32)
            r = have.shape[-1] if name.endswith("_lora_a") else have.shape[1]
            if name.endswith("_lora_a"):
                pad = [(0, 0)] * (have.ndim - 1) + [(0, spec.shape[-1] - r)]
                out[name] = np.pad(have, pad)
            else:
                pad = [(0, 0), (0, spec.shape[1] - r)] + [(0, 0)] * (have.ndim - 2)
                out[name] = np.pad(have * (lo.scale / self.held.scale), pad)
        return {"layers": out}

    # -- requests ------------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        self.orchestrator.validate(job.prompt, job.sampling)   # InvalidRequest: the client's
        if not self.has(job.weights):
            raise NotFound(f"no sampler weights {job.weights!r}")
        self._jobs.put(job)

    def _run(self) -> None:
        while not self._stop.is_set():
            first = self._jobs.get()
            if first is None:
                return
            pending = [first]
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    self._stop.set()
                    break
                pending.append(job)
            by_key: dict[str, list[Job]] = {}
            for job in pending:
                by_key.setdefault(job.weights, []).append(job)
            # the adapters served now first: no swap for them
            for key in sorted(by_key, key=lambda k: k != self._current):
                self._serve(key, by_key[key])

    def _serve(self, key: str, jobs: list[Job]) -> None:
        try:
            if key != self._current:
                with self._lock:
                    adapters = self._adapters[key]
                self._version += 1
                self.orchestrator.update_params(adapters, self._version)
                self._current = key
            streams = [(job, self.orchestrator.submit(job.prompt, job.sampling))
                       for job in jobs]
        except Exception as e:  # noqa: BLE001 - every job hears why
            for job in jobs:
                job.done(None, None, e)
            return
        for job, stream in streams:
            try:
                samples = stream.result()
                if stream.error:
                    raise RuntimeError(stream.error)
                prompt_lp = self._prompt_logprobs(job.prompt) if job.prompt_logprobs else None
                job.done([self._sequence(s, job.stops) for s in samples], prompt_lp, None)
            except Exception as e:  # noqa: BLE001
                job.done(None, None, e)

    def _prompt_logprobs(self, prompt: list[int]) -> list[float]:
        logprobs = self.orchestrator.score(prompt)[0]
        return [float("nan")] + [float(x) for x in logprobs]

    def _sequence(self, sample, stops: list[str]) -> Sequence:
        tokens, logprobs = list(sample.tokens), list(sample.logprobs)
        stop = sample.finish_reason == "stop"
        if stops:
            decoder, text = IncrementalDecoder(self.tokenizer), ""
            for i, token in enumerate(tokens):
                text += decoder.add(token)
                if any(s in text for s in stops):
                    return Sequence(tokens[:i + 1], logprobs[:i + 1], True)
        return Sequence(tokens, logprobs, stop)


def held_config(max_rank: int) -> LoraConfig:
    return LoraConfig(rank=max_rank, alpha=ALPHA, targets=("all-linear",))


def zero_adapters(param_target) -> dict:
    return jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), lora.trainable(param_target))
