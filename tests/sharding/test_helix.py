"""HelixPipe (sharding/helix.py, sharding/helix_program.py) on 8 CPU devices: its plan (every
boundary once, on its stage; the attention of a wave's offsets on distinct stages; the bubble
the lock-step rounds give) and its step, whose loss and gradients equal the unpipelined
model's (one device, the plain layer scan)."""

import re

import jax
import numpy as np
import pytest

from jaxrl.config import ConfigError, load_run_config
from sharding import mesh as shd
from sharding.helix import HelixPlan
from sharding.layer_order import LayerOrder
from sharding.pipeline import PipelineConfig
from tests.sharding.test_pipeline import (CFG, _mesh_cfg, assert_close, packed,  # noqa: F401
                                          pipelined, setup)

pytestmark = pytest.mark.multi_device


@pytest.mark.parametrize("stages,layers,microbatches,folds",
                         [(2, 4, 4, 2), (4, 8, 8, 2), (4, 16, 16, 1), (4, 8, 48, 2)])
def test_every_boundary_runs_once_on_its_stage(stages, layers, microbatches, folds):
    plan = HelixPlan(stages, layers, microbatches, folds)
    tab = plan.table()
    seen = {}
    for r in range(plan.rounds):
        for s in range(stages):
            g, i = tab["wave"][r, s], tab["boundary"][r, s]
            if g >= 0:
                assert i % stages == s
                assert (g, i) not in seen
                seen[g, i] = r
    assert len(seen) == plan.waves * (layers + 1)
    for (g, i), r in seen.items():        # boundary i+1 runs the round after boundary i
        assert i == layers or seen[g, i + 1] == r + 1


def test_a_waves_offsets_attend_on_every_stage():
    plan = HelixPlan(4, 8, 8, 2)
    for layer in range(8):
        stages = {plan.attention_stage(layer, slot) for slot in range(0, plan.wave, 2)}
        assert stages == {0, 1, 2, 3}
        # Offset 0 attends where the next boundary runs, offset p-1 where this one ran.
        assert plan.attention_stage(layer, 0) == (layer + 1) % 4
        assert plan.attention_stage(layer, plan.wave - 1) == layer % 4


def test_a_lone_wave_pays_p_weighted_parts_and_one_attention_per_layer():
    """One wave (p*f microbatches): each round one stage runs the p*f P ops while every
    stage runs one offset's attention, so the bubble is 1 - ((L+1)P + LA) / ((L+1)pP + LA):
    it shrinks as attention outweighs the weighted parts, as in the paper."""
    p, L = 4, 16
    plan = HelixPlan(p, L, 8, 2)
    _, a_count = plan.busy()
    assert (a_count[:L] == 1).all() and (a_count[L] == 0).all()
    for ratio in (0.5, 1.0, 4.0):
        want = 1 - ((L + 1) + L * ratio) / ((L + 1) * p + L * ratio)
        assert plan.bubble(1.0, ratio) == pytest.approx(want)
    assert plan.bubble(1, 8) < plan.bubble(1, 1) < plan.bubble(1, 0.5)


def test_p_waves_fill_the_stages():
    """p waves in flight leave only the ramps idle: below 1F1B's bubble at the same
    microbatches (16 at 4 stages), with every part of a layer costing the same."""
    helix = PipelineConfig(stages=4, microbatches=16, schedule="helix", folds=1)
    one_f_one_b = PipelineConfig(stages=4, microbatches=16, schedule="1f1b")
    assert helix.helix(16).waves == 4
    assert helix.bubble_fraction(16) < one_f_one_b.bubble_fraction()
    p_busy, _ = helix.helix(16).busy()
    assert p_busy[3:17].all()                  # the steady state: every stage, every round


@pytest.mark.parametrize("stages,microbatches,folds,axes,order", [
    (2, 4, 2, {}, False), (4, 8, 2, {}, True), (4, 16, 1, {"fsdp": 2}, True),
    (2, 8, 1, {"fsdp": 2, "tensor": 2}, False)],
    ids=["p2-one-wave", "p4-pipeline-order", "p4-four-waves-fsdp", "p2-fsdp-tensor"])
def test_helix_matches_the_unpipelined_model(setup, stages, microbatches, folds, axes, order):
    pipe = PipelineConfig(stages=stages, microbatches=microbatches, schedule="helix",
                          folds=folds)
    assert_close(pipelined(setup, pipe, _mesh_cfg(stages, axes), pipeline_order=order),
                 setup[3])


def test_helix_policy_loss_on_packed_segments(setup, packed):  # noqa: F811
    """The RL objective (packed segments, positions, min/max statistics), with a microbatch of
    RL padding whose ops are all skipped."""
    batch, objective, (loss, grads, ref_stats) = packed
    pipe = PipelineConfig(stages=2, microbatches=4, schedule="helix")
    *got, stats = pipelined(setup, pipe, shd.MeshConfig(stage=2, fsdp=2), objective, batch,
                            with_stats=True)
    assert_close(got, (loss, grads))
    for k in ref_stats:
        assert float(stats[k]) == pytest.approx(float(ref_stats[k]), rel=1e-5, abs=1e-6), k


def test_in_pipeline_order_only_activations_and_one_shift_of_weights_move(setup):
    """Stage s keeps layers s, s+P, ... (the input sides, read in place); the output sides
    move one stage by collective permute. No weight is gathered or exchanged all-to-all."""
    pipe = PipelineConfig(stages=4, microbatches=8, schedule="helix")
    order = LayerOrder.for_pipeline(pipe, CFG.num_layers)
    assert order.permutation == (0, 4, 1, 5, 2, 6, 3, 7)
    texts = []
    assert_close(pipelined(setup, pipe, shd.MeshConfig(stage=4), pipeline_order=True,
                           hlo=texts), setup[3])
    assert not re.findall(r"\b(all-gather|all-to-all)(-start)?\(", texts[0])


@pytest.mark.parametrize("overrides,message", [
    (["sharding.pipeline.stages=2", "sharding.pipeline.schedule=helix",
      "sharding.pipeline.microbatches=6"],
     r"waves of stages x folds = 2 x 2: microbatches=6 is not a multiple of 4"),
    (["sharding.pipeline.stages=3", "sharding.pipeline.schedule=helix",
      "sharding.pipeline.microbatches=6", "sharding.pipeline.folds=1", "model.num_layers=4"],
     r"num_layers a multiple of the stages: num_layers=4, stages=3"),
    (["sharding.pipeline.stages=2", "sharding.pipeline.schedule=helix",
      "sharding.pipeline.microbatches=4", "rl.kl_coef=0.1"],
     r"helix does not run the KL term's reference model \(rl.kl_coef=0.1\)"),
])
def test_bad_helix_configs_fail_at_config_time(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config("configs/demo_cpu.yaml", overrides)


def test_mlp_chunks_must_divide_the_sequence():
    with pytest.raises(ConfigError, match=r"model.mlp_chunks=5 x mesh.context=1 does not "
                                          r"divide train.seq_len=12"):
        load_run_config("configs/demo_cpu.yaml", ["model.mlp_chunks=5", "train.steps=1"])
