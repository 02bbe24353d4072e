"""The weight publisher: brings every member of the rollout fleet (jaxrl/rollout/fleet.py) to the
trainer's newest weights, without letting a slow or dead member hold the trainer up.

- In-process members get each version at once, device to device (the orchestrator swaps it in
  between two decode steps); `publish` returns when they serve it, as before the fleet existed.
- Remote members get it from a thread each, streamed in pieces with a deadline
  (`deadline_s`), or pulled by the server: with rl.generation.transfer=jax from the device
  copy (serving/weights/transfer.py), with tcp from a host copy over a plain TCP connection, each
  server relaying it to the next along a chain (serving/weights/bulk.py, relay_chain.py). `publish`
  itself only starts a device-side copy in the serving dtype (the trainer's buffers are
  donated to its next step) and returns: the trainer never waits for a remote push. A member still
  pushing when newer weights arrive gets the newest next (versions in between are skipped, never
  sent out of order).
- A member's first push from this trainer says `resume`: it replaces whatever the server had,
  even a newer version left by this run before it crashed and resumed from an older checkpoint.
- A push that fails or passes its deadline leaves that member on its old weights: it is set
  aside (its groups move to the others) and, once it answers heartbeats again, pushed the newest
  weights before it takes work. A refusal (wrong shapes, wrong token) is a configuration error:
  the member stays aside and the reason is logged.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.models import lora, quant
from jaxrl.rollout.fleet import Fleet, Member
from jaxrl.rollout.relay_chain import Link, RelayChains
from serving.core import threads
from serving.core.requests import StaleVersion
from sharding.reshard import WeightUpdateError


def wire_dtype(path, x, serving_dtype):
    """The dtype weight `x` (at tree path `path`) is pushed in: the serving dtype, which the
    server would cast it to anyway, so fewer bytes cross the wire; as it is for what a server
    holds as the trainer does: LoRA adapters and quantization scales (float32), int8 and fp8
    weights."""
    name = str(getattr(path[-1], "key", ""))
    if lora.is_adapter(name) or name.endswith(quant.SCALE) or jnp.dtype(x.dtype).itemsize == 1 \
            or not jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.dtype(x.dtype)
    return jnp.dtype(serving_dtype or x.dtype)


class WeightPublisher:
    def __init__(self, fleet: Fleet, *, deadline_s: float = 60.0, wire_dtype=None,
                 served: Callable | None = None, elastic: bool = False,
                 warn: Callable[[str], None] = print):
        """`served`: what the engines hold of the trainer's weights (rl.generation.weights:
        int8 projections), made of every version before it goes anywhere. `elastic`: remote
        members may join later (`watch`), so every version is kept for them even while the
        fleet has none."""
        self.fleet = fleet
        self.served = served
        self.elastic = elastic
        self.deadline_s = deadline_s
        self.wire_dtype = wire_dtype
        self._warn = warn
        self._latest: tuple[int, object] | None = None    # (version, device copy)
        self._host: dict[tuple[int, bool], object] = {}   # (version, adapters) -> numpy tree
        # Members holding this trainer's base weights: a LoRA model's later pushes carry its
        # adapters alone (bytes in proportion to the rank). A member's first push, and its
        # first after any failure, carries every weight.
        self._based: set[str] = set()
        self._host_lock = threading.Lock()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self.stats = {"pushes": 0, "push_failures": 0, "push_timeouts": 0, "push_bytes": 0,
                      "push_s": 0.0, "update_pause_ms_max": 0.0, "push_relay_retries": 0}
        self.errors: dict[str, str] = {}
        self._chains = RelayChains(deadline_s)
        self._threads: list[threading.Thread] = []
        for m in fleet.members:
            self.watch(m)

    def watch(self, m: Member) -> None:
        """Keeps remote member `m` at the newest weights from a thread of its own, until it
        leaves the fleet or the publisher closes (a member that joined later included)."""
        if m.remote:
            thread = threading.Thread(target=self._serve, args=(m,), daemon=True,
                                      name=f"publish-{m.name}")
            self._threads.append(thread)
            thread.start()

    def publish(self, params, version: int) -> dict:
        """Makes `params` weights `version` everywhere: in-process members before returning,
        remote members in the background. Returns the in-process swap's timings."""
        timings = {"update_pause_ms": 0.0, "update_transfer_ms": 0.0}
        if self.served is not None:
            params = self.served(params)
        remote = self.elastic or any(m.remote for m in self.fleet.members)
        if remote:
            copy = jax.tree_util.tree_map_with_path(self._wire_copy, params)
        self.fleet.published(version)
        for m in self.fleet.members:
            if not m.remote:
                result = m.generation.update_params(self._payload(m, params), version)
                self._based.add(m.name)
                timings = {"update_pause_ms": 1e3 * result.pause_s,
                           "update_transfer_ms": 1e3 * result.transfer_s}
                self.fleet.advanced(m, version)
        if remote:
            self._latest = (version, copy)
            self._chains.expect(collections.Counter(
                (version, self._payload(m, copy) is not copy) for m in self.fleet.members
                if m.remote and m.alive and m.name not in self.errors
                and getattr(m.generation, "transfer", "grpc") == "tcp"))
            self.fleet.notify()
        return timings

    def _wire_copy(self, path, x):
        """A new device buffer (the trainer donates its own to the next step), in the dtype
        it crosses the wire in (`wire_dtype`)."""
        dtype = wire_dtype(path, x, self.wire_dtype)
        if isinstance(x, np.ndarray):    # gathered from several trainer processes: a copy
            return x.astype(dtype, copy=False)
        return jnp.copy(x) if x.dtype == dtype else x.astype(dtype)

    def wait(self, version: int) -> list[Member]:
        """Sync modes: returns once every member still up serves `version`; members that do
        not within the push deadline are set aside (their work goes to the others)."""
        return self.fleet.wait_ready(version, self.deadline_s + 5.0)

    def _payload(self, m: Member, params):
        """What `m` is pushed of `params`: a LoRA model's adapters alone once `m` holds this
        trainer's base, else every weight."""
        if m.name in self._based and any("_lora_" in k for k in params.get("layers", {})):
            return lora.trainable(params)
        return params

    def _host_copy(self, version: int, params, adapters: bool):
        """The numpy tree of `version` (its adapters alone, or every weight), fetched once
        however many members need it."""
        with self._host_lock:
            key = (version, adapters)
            if key not in self._host:
                self._host = {k: v for k, v in self._host.items() if k[0] == version}
                self._host[key] = jax.tree.map(np.asarray, jax.device_get(params))
            return self._host[key]

    def _serve(self, m: Member) -> None:
        fleet, backoff = self.fleet, 0.0
        while not self._closed.is_set() and m in fleet.members:
            if not fleet.wait_for(lambda: self._closed.is_set() or self._due(m), timeout=1.0):
                continue
            job = self._latest
            if self._closed.is_set() or not self._due(m):
                continue
            resume = m.version is None   # first weights from this trainer: any version
            if resume:
                self._based.discard(m.name)
            version, params = job
            try:
                payload, result, seconds = self._push(m, version, params, resume)
            except StaleVersion:     # someone else pushed it newer weights: replace them
                self._based.discard(m.name)
                fleet.replaced(m)
                continue
            except (TimeoutError, ConnectionError) as e:
                self._based.discard(m.name)
                self._count("push_timeouts" if isinstance(e, TimeoutError) else "push_failures")
                fleet.set_aside(m, f"weight push failed: {e}")
                backoff = min(max(2 * backoff, 0.5), 30.0)
                self._closed.wait(backoff)
                continue
            except WeightUpdateError as e:
                self._based.discard(m.name)
                self._count("push_failures")
                self.errors[m.name] = str(e)
                fleet.set_aside(m, f"weights refused: {e}")
                continue
            backoff = 0.0
            self._based.add(m.name)
            with self._lock:
                s = self.stats
                s["pushes"] += 1
                s["push_bytes"] += sum(a.nbytes for a in jax.tree.leaves(payload))
                s["push_s"] += seconds
                s["update_pause_ms_max"] = max(s["update_pause_ms_max"], 1e3 * result.pause_s)
            fleet.advanced(m, version)

    def _push(self, m: Member, version: int, params, resume: bool):
        """One push of weights `version` to `m`: (what it carried, the server's result, its
        seconds). A server that pulls device to device takes the device copy; the others a host
        copy, fetched once for all, and tcp servers along a relay chain."""
        payload = self._payload(m, params)
        adapters = payload is not params
        transfer = getattr(m.generation, "transfer", "grpc")
        if transfer != "jax":
            payload = self._host_copy(version, payload, adapters)
        link = None
        if transfer == "tcp":
            link = self._chains.join((version, adapters), m.last_metrics.get("bulk_address"))
        t0 = time.perf_counter()
        try:
            result = self._update(m, payload, version, resume, (version, adapters), link)
        except ConnectionError:
            if link is None or link.pull_from is None:
                raise
            # The server before it in the chain may have failed rather than it (a relay that
            # dies mid-push cuts off every server after it): once more, from the trainer.
            self._count("push_relay_retries")
            result = self._update(m, payload, version, resume, (version, adapters),
                                  Link(None, 0))
        return payload, result, time.perf_counter() - t0

    def _update(self, m: Member, payload, version: int, resume: bool, update: tuple,
                link: Link | None):
        """`m`'s update call, along `link` of the update's relay chain if it has one."""
        try:
            return m.generation.update_params(payload, version, timeout=self.deadline_s,
                                              resume=resume, **(link.route() if link else {}))
        except BaseException:
            if link is not None:
                self._chains.failed(update, link)
            raise

    def _due(self, m: Member) -> bool:
        """Whether `m` should be pushed the latest weights now (under the fleet's lock)."""
        return (m.alive and m in self.fleet.members and self._latest is not None
                and m.name not in self.errors
                and (m.version is None or m.version < self._latest[0]))

    def _count(self, key: str) -> None:
        with self._lock:
            self.stats[key] += 1

    def metrics(self) -> dict:
        with self._lock:
            s = dict(self.stats)
        s["push_bytes_per_s"] = s["push_bytes"] / s["push_s"] if s["push_s"] else 0.0
        return s

    def close(self) -> None:
        self._closed.set()
        self.fleet.notify()
        for t in self._threads:
            threads.join(t, self.deadline_s + 5)
