"""LoRA inside the pipelines on 8 CPU devices: the loss and the adapters' gradients (the only
gradients formed: no base weight, embedding or head gets one) equal the unpipelined LoRA
model's, for the scan schedules and the table schedules (whose B/W split then recomputes),
alone and beside fsdp / tensor axes, and in the pipeline's layer order."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl.config import ConfigError, load_run_config
from jaxrl.models import Transformer, lora
from jaxrl.models.lora import LoraConfig
from jaxrl.models.transformer import split_params
from sharding.pipeline import PipelineConfig
from tests.sharding.test_pipeline import (CFG, _mesh_cfg, assert_close, pipelined,
                                         with_reference)

pytestmark = pytest.mark.multi_device

LORA = dataclasses.replace(CFG, lora=LoraConfig(rank=4, alpha=8,
                                                targets=("q_proj", "o_proj", "down_proj")))


@pytest.fixture(scope="module")
def setup():
    graphdef, params = split_params(Transformer(LORA, rngs=nnx.Rngs(0)))
    keys = iter(jax.random.split(jax.random.key(1), 8))
    params = lora.with_trainable(params, {"layers": {   # B random: every adapter has a gradient
        k: v + k.endswith("_lora_b") * 0.3 * jax.random.normal(next(keys), v.shape)
        for k, v in lora.trainable(params)["layers"].items()}})
    return with_reference(graphdef, params)


@pytest.mark.parametrize("schedule,stages,microbatches,axes,order", [
    ("gpipe", 4, 4, {"fsdp": 2}, False), ("1f1b", 2, 4, {"tensor": 2}, False),
    ("zb-h1", 2, 8, {"fsdp": 2}, False), ("v-half", 2, 8, {}, True)])
def test_adapters_gradients_through_a_pipeline_equal_the_plain_models(setup, schedule, stages,
                                                                      microbatches, axes, order):
    pipe = PipelineConfig(stages=stages, microbatches=microbatches, schedule=schedule)
    loss, grads = pipelined(setup, pipe, _mesh_cfg(stages, axes), pipeline_order=order)
    assert set(grads) == {"layers"} and sorted(grads["layers"]) == sorted(
        lora.trainable(setup[1])["layers"])
    assert all(float(np.abs(np.asarray(g)).max()) > 0 for g in jax.tree.leaves(grads))
    assert_close((loss, grads), setup[3])


def test_lora_with_helix_or_dropout_in_a_pipeline_is_refused():
    for extra, what in (("sharding.pipeline.schedule=helix", "schedule=helix"),
                        ("model.lora.dropout=0.1", "model.lora.dropout=0.1")):
        with pytest.raises(ConfigError, match=rf"model.lora.rank=4 with .*{what} inside a "
                                              rf"pipeline"):
            load_run_config("configs/demo_cpu.yaml", [
                "model.lora.rank=4", "sharding.pipeline.stages=2", extra])
