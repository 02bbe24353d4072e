"""What a Tinker service holds and does, apart from HTTP: sessions, training clients (models),
sampling sessions, futures, and the thread that runs training requests.

The SDK numbers each training client's requests (`seq_id`) and expects them applied in that
order, though it sends them concurrently (a forward_backward's chunks all at once, the first
last). Each model keeps the requests that arrived ahead of their turn and runs them when it
comes. The training thread takes every request whose turn it is, across models, and runs the
forward_backward ones that can share a program (same adapter shape, loss, direction) as one
batch (jaxrl/tinker/training.py); the rest one at a time. Results wait in futures the SDK
polls (`retrieve_future`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from jaxrl.tinker import losses, state
from jaxrl.tinker.errors import NotFound, UserFault
from jaxrl.tinker.training import Client, Trainer, lora_config
from jaxrl.tinker.wire import ForwardBackward, encode_forward_backward, forward_backward_json

POLL_S = 20.0                   # a retrieve_future waits this long before "try again"


@dataclasses.dataclass
class Future:
    request_id: str
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    json: dict | None = None
    # forward_backward and sample results: (protobuf, JSON) renderings, made when asked for
    render: tuple[Callable[[], bytes], Callable[[], dict]] | None = None
    error: str | None = None
    category: str = "user"

    def succeed(self, json: dict | None = None,
                render: tuple[Callable[[], bytes], Callable[[], dict]] | None = None) -> None:
        self.json, self.render = json, render
        self.done.set()

    def fail(self, error: str, category: str = "user") -> None:
        self.error, self.category = error, category
        self.done.set()


@dataclasses.dataclass
class Op:
    """A training client's request, waiting for its turn."""

    kind: str                           # forward_backward, optim_step, save_for_sampler, ...
    future: Future
    body: Any                           # ForwardBackward, AdamParams dict, ...


@dataclasses.dataclass
class Model:
    client: Client
    next_seq: int = 1                   # the seq_id whose turn it is
    waiting: dict[int, Op] = dataclasses.field(default_factory=dict)
    by_seq: dict[int, Future] = dataclasses.field(default_factory=dict)   # retried requests


class Service:
    """The state behind `jaxrl tinker`'s routes; thread-safe (one lock, `_lock`)."""

    def __init__(self, trainer: Trainer, sampler, base_name: str, base_path: str,
                 state_dir: str | Path, max_rank: int, log: Callable[[str], None] = print):
        self.trainer, self.sampler = trainer, sampler
        self.base_name, self.base_path = base_name, base_path
        self.state_dir = Path(state_dir)
        self.max_rank, self.log = max_rank, log
        self._lock = threading.Lock()            # guards everything below
        self._wake = threading.Condition(self._lock)
        self.sessions: dict[str, float] = {}     # session id -> last heartbeat (monotonic)
        self.models: dict[str, Model] = {}
        self.futures: dict[str, Future] = {}
        self.sampling_sessions: dict[str, str] = {}   # sampling session id -> weights key
        self._ids = itertools.count(1)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="tinker-trainer", daemon=True)
        self._thread.start()
        sampler.publish(self.base_key, None, None)

    base_key = "base"

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._wake.notify_all()
        self._thread.join(30.0)
        self.sampler.stop()

    # -- ids and lookups -----------------------------------------------------------------------
    def new_future(self) -> Future:
        with self._lock:
            f = Future(f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}")
            self.futures[f.request_id] = f
            return f

    def future(self, request_id: str) -> Future:
        with self._lock:
            if request_id not in self.futures:
                raise NotFound(f"no future {request_id!r} (never created, or already expired)")
            return self.futures[request_id]

    def model(self, model_id: str) -> Model:
        with self._lock:
            if model_id not in self.models:
                raise NotFound(f"no training model {model_id!r}; create one with "
                               f"create_lora_training_client")
            return self.models[model_id]

    def check_base(self, name: str | None) -> None:
        if name not in (self.base_name, self.base_path, Path(self.base_path).name):
            raise UserFault(f"base_model {name!r}: this service trains {self.base_name!r} "
                            f"(from {self.base_path})")

    # -- sessions and models ---------------------------------------------------------------------
    def create_session(self) -> str:
        sid = f"session-{uuid.uuid4().hex[:12]}"
        with self._lock:
            self.sessions[sid] = time.monotonic()
        return sid

    def heartbeat(self, sid: str) -> None:
        with self._lock:
            if sid not in self.sessions:
                raise NotFound(f"no session {sid!r}")
            self.sessions[sid] = time.monotonic()

    def finish_session(self, sid: str) -> None:
        """The client closed its session: its training clients are dropped (their adapters
        and Adam state freed; a request still waiting fails), as are the samplers made from
        them without a name. Weights saved under a name, and checkpoints, stay."""
        with self._lock:
            if self.sessions.pop(sid, None) is None:
                raise NotFound(f"no session {sid!r}")
            prefix = f"{sid}:train:"
            dropped = [mid for mid in self.models if mid.startswith(prefix)]
            for mid in dropped:
                for op in self.models.pop(mid).waiting.values():
                    op.future.fail(f"the session {sid} was closed before this request ran")
            keys = {k for k in self.sampling_sessions.values()
                    if k.startswith(("inflight:", "snapshot:")) and
                    k.split(":", 1)[1].startswith(prefix)}
            for k, v in list(self.sampling_sessions.items()):
                if v in keys:
                    del self.sampling_sessions[k]
        self.sampler.forget(keys)
        self.log(f"tinker: session {sid} closed, {len(dropped)} training client(s) dropped")

    def create_model(self, session_id: str, model_seq_id: int, base_model: str,
                     lora: dict | None, first_seq: int = 1) -> str:
        """A training client, named as the SDK names it (SESSION:train:N); the same one again
        when the SDK retries. `first_seq`: its first request's seq_id (0 when a load_weights
        creates it)."""
        self.check_base(base_model)
        with self._lock:
            if session_id not in self.sessions:
                raise NotFound(f"no session {session_id!r}")
            model_id = f"{session_id}:train:{model_seq_id}"
            if model_id in self.models:
                return model_id
        lora = lora or {}
        rank = int(lora.get("rank", 32))
        if not 1 <= rank <= self.max_rank:
            raise UserFault(f"lora rank {rank}: this service holds adapters up to rank "
                            f"{self.max_rank} (jaxrl tinker --max-lora-rank)")
        lo = lora_config(rank, bool(lora.get("train_attn", True)),
                         bool(lora.get("train_mlp", True)))
        seed = lora.get("seed")
        client = self.trainer.new_client(model_id, base_model, lo,
                                         int(seed) if seed is not None else
                                         uuid.uuid4().int % 2**31)
        with self._lock:
            self.models.setdefault(model_id, Model(client, next_seq=first_seq))
        self.log(f"tinker: {model_id} on {base_model}, LoRA rank {lo.rank} on "
                 f"{','.join(lo.modules()) or 'nothing'}")
        return model_id

    def info(self, model_id: str) -> dict:
        c = self.model(model_id).client
        return {"type": "get_info", "model_id": model_id, "is_lora": True,
                "lora_rank": c.lora.rank, "model_name": c.base_model,
                "model_data": {"arch": self.trainer.cfg.family, "model_name": c.base_model,
                               "tokenizer_id": self.base_path}}

    # -- training requests, in each model's order -----------------------------------------------
    def enqueue(self, model_id: str, seq_id: int | None, kind: str, body: Any,
                check: Callable[[Model], None] | None = None) -> Future:
        """Queues a training request at its turn; returns its future (the one already made,
        when the SDK sends the same seq_id again). `check` runs first: a UserFault from it
        fails the request at once (its seq_id is spent: the requests after it still run)."""
        m = self.model(model_id)
        with self._lock:
            if seq_id is None:
                seq_id = max([m.next_seq - 1, *m.waiting]) + 1
            if seq_id in m.by_seq:
                return m.by_seq[seq_id]
            if seq_id < m.next_seq:
                raise UserFault(f"seq_id {seq_id} of {model_id} has run already (the next is "
                                f"{m.next_seq})")
        future = self.new_future()
        try:
            if check is not None:
                check(m)
            op = Op(kind, future, body)
        except UserFault as e:
            future.fail(str(e))
            op = Op("skip", future, None)
        with self._lock:
            m.by_seq[seq_id] = future
            m.waiting[seq_id] = op
            self._wake.notify_all()
        return future

    def check_forward_backward(self, fb: ForwardBackward) -> Callable[[Model], None]:
        def check(m: Model) -> None:
            try:
                losses.check(fb.loss_fn, fb.config, fb.data)
            except ValueError as e:
                raise UserFault(str(e)) from None
            if not fb.data:
                raise UserFault("forward_backward with no data")
            longest = max(len(d.tokens) for d in fb.data)
            if longest > self.trainer.max_len:
                raise UserFault(f"a datum of {longest} tokens; this service's context is "
                                f"{self.trainer.max_len} tokens")
            vocab = self.trainer.cfg.vocab_size
            for i, d in enumerate(fb.data):
                for name, ids in (("model_input", d.tokens),
                                  ("target_tokens", d.inputs["target_tokens"])):
                    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
                        raise UserFault(f"datum {i}: {name} has ids outside [0, {vocab})")
        return check

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not (ready := self._ready()):
                    self._wake.wait(1.0)
                if self._stop:
                    return
            self._execute(ready)

    def _ready(self) -> list[tuple[Model, Op]]:
        """Every model's op whose turn it is, taken off its queue (call under the lock)."""
        out = []
        for m in self.models.values():
            op = m.waiting.pop(m.next_seq, None)
            if op is not None:
                m.next_seq += 1
                out.append((m, op))
        return out

    def _execute(self, ready: list[tuple[Model, Op]]) -> None:
        groups: dict[tuple, list[tuple[Model, Op]]] = {}
        for m, op in ready:
            if op.kind == "forward_backward":
                fb = op.body
                key = (m.client.lora.rank, m.client.lora.modules(), fb.loss_fn, fb.forward_only)
                groups.setdefault(key, []).append((m, op))
            else:
                self._one(m, op)
        for batch in groups.values():
            self._forward_backward(batch)

    def _forward_backward(self, batch: list[tuple[Model, Op]]) -> None:
        fb0 = batch[0][1].body
        try:
            results = self.trainer.forward_backward(
                [m.client for m, _ in batch], fb0.loss_fn, [op.body.config for _, op in batch],
                [op.body.data for _, op in batch], backward=not fb0.forward_only)
        except Exception as e:  # noqa: BLE001 - each client hears it; the service goes on
            self.log(f"tinker: forward_backward failed: {type(e).__name__}: {e}")
            for _, op in batch:
                op.future.fail(f"{type(e).__name__}: {e}", "server")
            return
        for (_, op), (outputs, metrics) in zip(batch, results):
            op.future.succeed(render=(
                functools.partial(encode_forward_backward, outputs, metrics),
                functools.partial(forward_backward_json, outputs, metrics)))

    def _one(self, m: Model, op: Op) -> None:
        try:
            if op.kind == "skip":
                return
            op.future.succeed(json=self._apply(m, op))
        except UserFault as e:
            op.future.fail(str(e))
        except Exception as e:  # noqa: BLE001
            self.log(f"tinker: {op.kind} failed: {type(e).__name__}: {e}")
            op.future.fail(f"{type(e).__name__}: {e}", "server")

    def _apply(self, m: Model, op: Op) -> dict:
        c = m.client
        if op.kind == "optim_step":
            metrics = self.trainer.optim_step(c, op.body)
            return {"type": "optim_step", "metrics": metrics}
        if op.kind == "save_for_sampler":
            name, kind = op.body
            if name is None:
                key = f"inflight:{c.model_id}" if kind == "inflight" else \
                    f"snapshot:{c.model_id}:{c.step}:{uuid.uuid4().hex[:6]}"
                self.sampler.publish(key, c.lora, c.adapters)
                sid = self._new_sampling_session(key)
                return {"type": "save_weights_for_sampler", "sampling_session_id": sid}
            path = f"tinker://{c.model_id}/sampler_weights/{name}"
            self.sampler.publish(path, c.lora, c.adapters)
            return {"type": "save_weights_for_sampler", "path": path}
        if op.kind == "save_state":
            path = state.save(self.state_dir, c, op.body)
            return {"type": "save_weights", "path": path}
        if op.kind == "load_state":
            path, optimizer = op.body
            state.load(self.state_dir, c, path, optimizer)
            return {"type": "load_weights", "path": path, "model_id": c.model_id}
        raise UserFault(f"unknown request kind {op.kind!r}")

    # -- sampling ----------------------------------------------------------------------------
    def _new_sampling_session(self, key: str) -> str:
        sid = f"sampler-{uuid.uuid4().hex[:12]}"
        with self._lock:
            self.sampling_sessions[sid] = key
        return sid

    def create_sampling_session(self, model_path: str | None, base_model: str | None) -> str:
        return self._new_sampling_session(self.weights_key(model_path, base_model))

    def weights_key(self, model_path: str | None, base_model: str | None) -> str:
        if model_path:
            if not self.sampler.has(model_path):
                raise NotFound(f"no sampler weights at {model_path!r} (save_weights_for_sampler "
                               f"makes them)")
            return model_path
        self.check_base(base_model)
        return self.base_key

    def sampling_key(self, sid: str) -> str:
        with self._lock:
            if sid not in self.sampling_sessions:
                raise NotFound(f"no sampling session {sid!r}")
            return self.sampling_sessions[sid]

    # -- waiting for futures -------------------------------------------------------------------
    def wait(self, request_id: str, timeout: float = POLL_S) -> Future | None:
        f = self.future(request_id)
        return f if f.done.wait(timeout) else None
