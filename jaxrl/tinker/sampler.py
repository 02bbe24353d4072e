"""Sampling for the Tinker API on jaxrl's engine (paged KV, chunked prefill, continuous
batching, in-flight adapter updates, speculative decoding where it is on).

The engine holds N LoRA adapter sets of the service's largest rank on every projection
(model.lora.adapters, vLLM's multi-LoRA): every request names the set it samples with, and
requests of different clients decode in one batch. A client's adapters of a smaller rank or
fewer targets are written into a set exactly (zero rows and columns, B scaled by the ratio of
the two scales). Weights are published under a key (a sampler path, a snapshot, a model's
in-flight weights); a key gets a set when a request needs it, the least recently used set that
no running request holds giving way, and the engine takes the sets by its adapter-only update
(no reload, no recompile) between two decode steps. Re-publishing a key that holds a set
updates it in place: requests running on it go on with the new weights (Tinker's `inflight`
samplers, PipelineRL's in-flight updates).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections import OrderedDict
from typing import Callable

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
POLL_S = 0.005          # how often the sampler thread looks at running requests


@dataclasses.dataclass
class Job:
    weights: str                         # the key of the adapters it samples with
    prompt: list[int]
    sampling: SamplingParams
    stops: list[str]                     # stop strings: each sample is cut after the first
    prompt_logprobs: bool
    done: Callable[[list[Sequence] | None, list[float] | None, Exception | None], None]


class Sampler:
    """The engine, the adapters published by key, and the thread that gives keys their sets
    and serves Jobs."""

    def __init__(self, orchestrator: Orchestrator, tokenizer, held: LoraConfig):
        self.orchestrator, self.tokenizer, self.held = orchestrator, tokenizer, held
        target = lora.trainable(orchestrator.engine.param_target)["layers"]
        # The engine's sets as the host holds them, [L, N, ...] per adapter (the sampler
        # thread's, like everything below but `_published`).
        self._sets = {name: np.zeros(spec.shape, np.float32) for name, spec in target.items()}
        self._resident: OrderedDict[str, int] = OrderedDict()   # key -> set, LRU first
        self._users = [0] * held.adapters                         # running requests per set
        self._published: dict[str, tuple[int, dict]] = {}         # key -> (serial, tree)
        self._loaded: dict[str, int] = {}                         # key -> serial in its set
        self._lock = threading.Lock()                             # guards _published
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._version = orchestrator.version
        self._serial = 0
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
        tree = self.engine_adapters(lo, adapters)
        with self._lock:
            self._serial += 1
            self._published[key] = (self._serial, tree)

    def forget(self, keys) -> None:
        """Drops adapters no session samples with any more (a request already queued for one
        fails)."""
        with self._lock:
            for key in keys:
                self._published.pop(key, None)

    def has(self, key: str) -> bool:
        with self._lock:
            return key in self._published

    def engine_adapters(self, lo: LoraConfig, adapters: dict | None) -> dict:
        """A client's adapters as one of the engine's sets: rank padded to the held rank, B
        scaled by scale(lo) / scale(held), projections it does not adapt zero ([L, ...] per
        adapter, the set axis left out)."""
        out = {}
        for name, held in self._sets.items():
            shape = (held.shape[0], *held.shape[2:])
            have = None if adapters is None else adapters["layers"].get(name)
            if have is None:
                out[name] = np.zeros(shape, np.float32)
                continue
            have = np.asarray(have, np.float32)
            if name.endswith("_lora_a"):
                pad = [(0, 0)] * (have.ndim - 1) + [(0, shape[-1] - have.shape[-1])]
                out[name] = np.pad(have, pad)
            else:
                pad = [(0, 0), (0, shape[1] - have.shape[1])] + [(0, 0)] * (have.ndim - 2)
                out[name] = np.pad(have * (lo.scale / self.held.scale), pad)
        return out

    # -- requests ------------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        self.orchestrator.validate(job.prompt, job.sampling)   # InvalidRequest: the client's
        if not self.has(job.weights):
            raise NotFound(f"no sampler weights {job.weights!r}")
        self._jobs.put(job)

    def _run(self) -> None:
        waiting: list[Job] = []          # jobs whose key has no set yet (all sets busy)
        running: list[tuple[Job, int, object]] = []
        while not self._stop.is_set():
            try:
                job = self._jobs.get(timeout=POLL_S if running or waiting else 1.0)
                if job is None:
                    return
                waiting.append(job)
                while (job := self._jobs.get_nowait()) is not None:
                    waiting.append(job)
            except queue.Empty:
                pass
            self._refresh()
            waiting = [j for j in waiting if not self._start(j, running)]
            running = [r for r in running if not self._finish(*r)]

    def _refresh(self) -> None:
        """Re-published keys that hold a set: their new weights into the engine."""
        with self._lock:
            stale = {k: self._published[k] for k, s in self._loaded.items()
                     if k in self._published and self._published[k][0] != s}
        for key, (serial, tree) in stale.items():
            self._load(key, self._resident[key], serial, tree)

    def _start(self, job: Job, running: list) -> bool:
        """Submits `job` on its key's set (given one if it has none and one is free); False
        while every set is busy."""
        try:
            index = self._set_for(job.weights)
            if index is None:
                return False
            stream = self.orchestrator.submit(
                job.prompt, dataclasses.replace(job.sampling, adapter=index))
        except Exception as e:  # noqa: BLE001 - the job hears why; the sampler goes on
            job.done(None, None, e)
            return True
        self._users[index] += 1
        running.append((job, index, stream))
        return True

    def _set_for(self, key: str) -> int | None:
        if key in self._resident:
            self._resident.move_to_end(key)
            return self._resident[key]
        with self._lock:
            if key not in self._published:
                raise NotFound(f"the sampler weights {key!r} were dropped (session closed)")
            serial, tree = self._published[key]
        taken = set(self._resident.values())
        free = [i for i in range(self.held.adapters) if i not in taken]
        if not free:
            idle = [k for k, i in self._resident.items() if self._users[i] == 0]
            if not idle:
                return None
            free = [self._resident.pop(idle[0])]
            self._loaded.pop(idle[0], None)
        self._resident[key] = free[0]
        self._load(key, free[0], serial, tree)
        return free[0]

    def _load(self, key: str, index: int, serial: int, tree: dict) -> None:
        for name, value in tree.items():
            self._sets[name][:, index] = value
        self._version += 1
        # copies: the engine may alias host arrays, and these change with the next load
        self.orchestrator.update_params({"layers": {n: v.copy() for n, v in self._sets.items()}},
                                        self._version)
        self._loaded[key] = serial

    def _finish(self, job: Job, index: int, stream) -> bool:
        if not stream.done:
            return False
        self._users[index] -= 1
        try:
            samples = stream.result()
            if stream.error:
                raise RuntimeError(stream.error)
            prompt_lp = (self._prompt_logprobs(job.prompt, index) if job.prompt_logprobs
                         else None)
            job.done([self._sequence(s, job.stops) for s in samples], prompt_lp, None)
        except Exception as e:  # noqa: BLE001
            job.done(None, None, e)
        return True

    def _prompt_logprobs(self, prompt: list[int], index: int) -> list[float]:
        logprobs = self.orchestrator.score(prompt, adapter=index)[0]
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


def held_config(max_rank: int, sets: int) -> LoraConfig:
    return LoraConfig(rank=max_rank, alpha=ALPHA, targets=("all-linear",), adapters=sets)
