"""Splash attention (Pallas interpret mode on CPU) inside the per-stage pipeline programs: the
kernel runs in a `shard_map` nested in the stage program's, and the step's loss and gradients
equal the unpipelined model's on the XLA path."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl.models import ModelConfig, Transformer, abstract_model, param_axes
from jaxrl.models.transformer import split_params
from jaxrl.train.step import Layout, loss_and_grads
from sharding import mesh as shd
from sharding.pipeline import PipelineConfig
from tests.sharding.test_pipeline import assert_close

pytestmark = pytest.mark.multi_device

CFG = ModelConfig(vocab_size=32, embed_dim=32, num_layers=4, num_heads=4, num_kv_heads=2,
                  head_dim=8, mlp_dim=64, max_seq_len=128)
B, T = 4, 128


@pytest.fixture(scope="module")
def setup():
    graphdef, params = split_params(Transformer(CFG, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, CFG.vocab_size, (1, B, T)).astype(np.int32)
    batch = {"input_ids": ids, "targets": np.roll(ids, -1, -1),
             "loss_mask": (rng.random(ids.shape) > 0.25).astype(np.float32)}
    want = jax.jit(lambda p, b: loss_and_grads(graphdef, p, b)[:2])(params, batch)
    return params, batch, want


@pytest.mark.parametrize("schedule,folds,axes", [("1f1b", 1, {"fsdp": 2}), ("helix", 1, {})])
def test_splash_inside_the_stage_programs_matches_xla(setup, schedule, folds, axes):
    params, batch, want = setup
    cfg = dataclasses.replace(CFG, attention="splash")
    graphdef, _ = split_params(abstract_model(cfg))
    pipe = PipelineConfig(stages=2, microbatches=4, schedule=schedule, folds=folds)
    mesh = shd.make_mesh(shd.MeshConfig(stage=2, fsdp=axes.get("fsdp", 1)),
                         jax.devices()[:2 * axes.get("fsdp", 1)])
    _, abstract = split_params(abstract_model(cfg))
    param_sh = shd.tree_shardings(param_axes(cfg), abstract, mesh)
    step = jax.jit(lambda p, b: loss_and_grads(graphdef, p, b, layout=Layout(mesh, pipeline=pipe))[:2],
                   in_shardings=(param_sh, shd.batch_sharding(mesh, 3, leading=1)))
    assert_close(step(jax.device_put(params, param_sh), batch), want, rel=1e-4)


def test_splash_is_taken_by_the_per_stage_schedules_only():
    from jaxrl.config import ConfigError, load_run_config

    base = ["model.attention=splash", "train.seq_len=128", "model.max_seq_len=128",
            "rl.pack_len=128", "sharding.pipeline.stages=2", "sharding.pipeline.microbatches=4"]
    for schedule in ("1f1b", "v-half", "helix"):
        load_run_config("configs/demo_cpu.yaml", [*base, f"sharding.pipeline.schedule={schedule}"])
    with pytest.raises(ConfigError, match=r"splash inside a gpipe pipeline is not supported"):
        load_run_config("configs/demo_cpu.yaml", [*base, "sharding.pipeline.schedule=gpipe"])
