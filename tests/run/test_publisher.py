"""What the weight publisher (jaxrl/rollout/publisher.py) sends a server of a LoRA run: every
weight on its first push, then the adapters alone, every one of them. Checked against the
adapters PEFT's naming gives for the run's targets (`<target>_lora_a`, `<target>_lora_b`), not
against the publisher's own filter."""

import dataclasses

import jax
import numpy as np
from flax import nnx

from jaxrl.models import Transformer, split_params
from jaxrl.models.lora import LoraConfig
from jaxrl.rollout.fleet import Fleet, Member, MemberState
from jaxrl.rollout.publisher import WeightPublisher
from serving.core.orchestrator import UpdateResult
from tests.serving.common import CFG, until

TARGETS = ("q_proj", "v_proj", "down_proj")
LORA = dataclasses.replace(CFG, lora=LoraConfig(rank=2, targets=TARGETS))


def flat(tree) -> dict[str, np.ndarray]:
    return {"/".join(str(k.key) for k in path): np.asarray(x)
            for path, x in jax.tree_util.tree_leaves_with_path(tree)}


class Recorder:
    """A remote Generation that keeps every payload it is pushed, as host arrays."""

    def __init__(self):
        self.pushes = []             # (version, {path: array})

    def update_params(self, params, version, timeout=None, *, resume=False):
        self.pushes.append((version, flat(params)))
        return UpdateResult(version, 0.0, 0.0)

    def metrics(self, timeout=None):
        return {"version": self.pushes[-1][0] if self.pushes else 0, "slots": 4}


def test_a_lora_run_pushes_every_weight_first_then_every_adapter_alone():
    _, params = split_params(Transformer(LORA, rngs=nnx.Rngs(0)))
    server = Recorder()
    fleet = Fleet([Member("s", server, 4, remote=True, version=0, state=MemberState.READY)],
                  eos_id=1, heartbeat_s=60, warn=lambda _: None)
    publisher = WeightPublisher(fleet, deadline_s=30, warn=lambda _: None)
    try:
        publisher.publish(params, 1)
        until(lambda: len(server.pushes) == 1, 30, "the first push")
        publisher.publish(params, 2)
        until(lambda: len(server.pushes) == 2, 30, "the second push")
    finally:
        publisher.close()
        fleet.close()
    (v1, first), (v2, second) = server.pushes
    adapters = {f"layers/{t}_lora_{ab}" for t in TARGETS for ab in "ab"}
    assert (v1, v2) == (1, 2)
    assert set(first) == set(flat(params)) and adapters < set(first)
    assert set(second) == adapters
    for name in adapters:
        want = np.asarray(params["layers"][name.split("/")[1]])
        assert second[name].shape == want.shape and np.array_equal(second[name], want)
