"""Weight pushes to one server and to several, side by side (`jaxrl bench fleet`, section 3):
the rollout fleet's own publisher (jaxrl/rollout/publisher.py) pushing a model to in-process
`Server`s over loopback, by the gRPC stream (each server its own copy of every byte) and by tcp
(the servers along a relay chain: jaxrl/rollout/relay_chain.py). The seconds from `publish` to
every server serving the version, the median over pushes, and the ratio of N servers to one."""

from __future__ import annotations

import time

import numpy as np
from flax import nnx

from jaxrl.models import ModelConfig, Transformer, split_params
from jaxrl.rollout.fleet import Fleet, Member
from jaxrl.rollout.publisher import WeightPublisher
from serving.core.orchestrator import Orchestrator
from serving.fleet.client import RemoteGeneration
from serving.frontends.server import Server
from serving.runner.engine import Engine, EngineConfig

TOKEN = "bench-fanout"


def fanout(embed: int, layers: int, counts: list[int], pushes: int) -> dict:
    """{transfer: {servers: median seconds}} and the model's bytes, the counts of servers
    taking turns on the same servers."""
    cfg = ModelConfig(vocab_size=1024, embed_dim=embed, num_layers=layers, num_heads=8,
                      num_kv_heads=4, head_dim=embed // 8, mlp_dim=4 * embed, max_seq_len=128)
    params = split_params(Transformer(cfg, rngs=nnx.Rngs(0)))[1]
    nbytes = sum(np.asarray(a).nbytes for a in _leaves(params))
    servers = [Server(Orchestrator(Engine(cfg, EngineConfig(max_concurrent_decodes=4,
                                                            max_len=128, max_prefill_length=16,
                                                            prefill_chunk=16)),
                                   params, version=-1, eos_id=None).start(),
                      port=0, update_token=TOKEN).start() for _ in range(max(counts))]
    seconds: dict = {t: {n: [] for n in counts} for t in ("tcp", "grpc")}
    version = 0
    try:
        # A block of pushes per transport, the counts of servers taking turns within it: the
        # gRPC path assembles fresh arrays on every server, whose freeing would otherwise land
        # in the next tcp push. Two rounds warm each block up; the second leaves the servers'
        # receive slabs at their steady count (serving/weights/slabs.py: the head of a chain changes
        # from push to push).
        for transfer, per in seconds.items():
            for round_ in range(pushes + 2):
                for n in counts:
                    version += 1
                    took = _push(servers[:n], transfer, params, version)
                    if round_ >= 2:
                        per[n].append(took)
    finally:
        for s in servers:
            s.stop(0)
    return {"bytes": nbytes, **{t: {n: float(np.median(v)) for n, v in per.items()}
                                for t, per in seconds.items()}}


def _push(servers: list, transfer: str, params, version: int) -> float:
    """Seconds from publishing `version` to every one of `servers` serving it."""
    remotes = [RemoteGeneration(s.address, token=TOKEN, transfer=transfer) for s in servers]
    members = [Member(r.address, r, 4, remote=True, last_metrics=r.metrics(), version=version - 1)
               for r in remotes]
    fleet = Fleet(members, eos_id=None, heartbeat_s=3600, warn=lambda _: None)
    publisher = WeightPublisher(fleet, deadline_s=600, warn=lambda _: None)
    try:
        t0 = time.perf_counter()
        publisher.publish(params, version)
        ready = publisher.wait(version)
        took = time.perf_counter() - t0
        assert len(ready) == len(servers), f"{len(ready)} of {len(servers)} took the push"
        return took
    finally:
        publisher.close()
        fleet.close()
        for r in remotes:
            r.close()


def _leaves(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(tree=v)
    else:
        yield tree
