"""Pipeline schedules on 8 CPU devices: the loss and gradients of every schedule equal the
unpipelined model's (one device, the plain layer scan), alone and with fsdp / tensor axes."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.config import ConfigError, load_run_config
from jaxrl.models import ModelConfig, Transformer, abstract_model, merge_params, param_axes
from jaxrl.models.transformer import split_params
from jaxrl.train.objectives import PolicyGradientLoss
from jaxrl.train.step import Layout, loss_and_grads
from sharding import mesh as shd
from sharding.layer_order import LayerOrder
from sharding.pipeline import PipelineConfig
from sharding import schedules as sch

pytestmark = pytest.mark.multi_device

CFG = ModelConfig(vocab_size=32, embed_dim=32, num_layers=8, num_heads=4, num_kv_heads=2,
                  head_dim=8, mlp_dim=64, max_seq_len=16)
B, T = 16, 8


def with_reference(graphdef, params):
    """(graphdef, params, a batch of B x T random tokens, the unpipelined loss and gradients)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, CFG.vocab_size, (1, B, T)).astype(np.int32)
    batch = {"input_ids": ids, "targets": np.roll(ids, -1, -1),
             "loss_mask": (rng.random(ids.shape) > 0.25).astype(np.float32)}
    ref = jax.jit(lambda p, b: loss_and_grads(graphdef, p, b)[:2])(params, batch)
    return graphdef, params, batch, ref


@pytest.fixture(scope="module")
def setup():
    return with_reference(*split_params(Transformer(CFG, rngs=nnx.Rngs(0))))


def pipelined(setup, pipe: PipelineConfig, mesh_cfg: shd.MeshConfig, objective=None, batch=None,
              with_stats=False, ref_params=None, pipeline_order=False, hlo=None,
              remat="none"):
    """Loss and gradients (and the objective's statistics `with_stats`) of the pipelined step,
    jitted over a mesh of len(devices) CPUs; `ref_params`: a frozen reference model.
    `pipeline_order`: the step is given the layer stacks in the pipeline's order, as the
    trainers keep them (sharding/layer_order.py); its gradients are put back in canonical
    order here. `hlo`: a list that receives the compiled program's text. `remat`:
    `train.remat`, which says what the stage programs keep for the backward."""
    graphdef, params, default_batch, _ = setup
    batch = default_batch if batch is None else batch
    used = mesh_cfg.data * mesh_cfg.stage * mesh_cfg.fsdp * mesh_cfg.tensor
    mesh = shd.make_mesh(mesh_cfg, jax.devices()[:used])
    cfg = merge_params(graphdef, params).cfg
    _, abstract = split_params(abstract_model(cfg))
    param_sh = shd.tree_shardings(param_axes(cfg), abstract, mesh)
    batch_sh = shd.batch_sharding(mesh, 3, leading=1)
    kwargs = {} if objective is None else {"objective": objective}
    order = LayerOrder.for_pipeline(pipe, cfg.num_layers) if pipeline_order else None
    if order is not None:
        params = order.to_pipeline(params)
        ref_params = None if ref_params is None else order.to_pipeline(ref_params)
    fn = jax.jit(lambda p, b, r: loss_and_grads(graphdef, p, b, ref_params=r,
                                                layout=Layout(mesh, remat, pipe,
                                                              pipeline_order=order is not None),
                                                **kwargs)[:3 if with_stats else 2],
                 in_shardings=(param_sh, batch_sh, None if ref_params is None else param_sh))
    args = jax.device_put(params, param_sh), batch, ref_params
    compiled = fn.lower(*args).compile()
    if hlo is not None:
        hlo.append(compiled.as_text())
    out = compiled(*args)
    if order is None:
        return out
    return (out[0], order.to_canonical(out[1]), *out[2:])


def assert_close(got, want, rel=1e-5):
    (loss, grads), (ref_loss, ref_grads) = got, want
    assert float(loss) == pytest.approx(float(ref_loss), rel=rel)
    flat, _ = jax.tree_util.tree_flatten_with_path(grads)
    for (path, g), r in zip(flat, jax.tree.leaves(ref_grads)):
        err = float(jnp.linalg.norm(g - r) / jnp.linalg.norm(r))
        assert err <= rel, f"{jax.tree_util.keystr(path)}: relative error {err:.2e}"


# (schedule, repeats, stages, microbatches, other mesh axes): every schedule; stages 2 and 4;
# microbatches 4, 8 and 16; alone (only the stage axis) and beside data, fsdp and tensor axes.
# A compile costs ~5 s on 2 CPU cores, so not the whole cross product.
CASES = [("gpipe", 1, 4, 4, {"fsdp": 2}), ("circular", 2, 2, 8, {"fsdp": 2, "tensor": 2}),
         ("1f1b", 1, 2, 4, {}), ("1f1b", 1, 4, 16, {"tensor": 2}),
         ("interleaved", 2, 4, 8, {}), ("interleaved", 2, 2, 4, {"fsdp": 2}),
         ("zb-h1", 1, 2, 8, {"tensor": 2}), ("zb-h1", 1, 4, 16, {"fsdp": 2}),
         ("v-half", 1, 2, 16, {"data": 2}), ("v-min", 1, 4, 4, {"tensor": 2}),
         ("v-zb", 1, 4, 8, {"fsdp": 2})]


def _case_id(case):
    schedule, repeats, p, m, axes = case
    return f"{schedule}-p{p}-m{m}-{'-'.join(axes) or 'alone'}"


def _mesh_cfg(stages, axes):
    return shd.MeshConfig(stage=stages, data=axes.get("data", 1), fsdp=axes.get("fsdp", 1),
                          tensor=axes.get("tensor", 1))


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_schedule_matches_the_unpipelined_model(setup, case):
    schedule, repeats, stages, microbatches, axes = case
    pipe = PipelineConfig(stages=stages, microbatches=microbatches, repeats=repeats,
                          schedule=schedule)
    assert_close(pipelined(setup, pipe, _mesh_cfg(stages, axes)), setup[3])


@pytest.mark.parametrize("schedule,remat,split", [("1f1b", "full", "stash"),
                                                 ("zb-h1", "full", "stash"),
                                                 ("v-min", "minimal", "stash")])
def test_what_the_stages_keep_follows_the_remat_policy(setup, schedule, remat, split):
    """`full` and `offload` keep each layer's input and recompute the layer (B and W split as
    `split_backward` says; the recomputing split below); `none` (most tests here) and
    `minimal` keep the vjp's residuals: the same loss and gradients either way."""
    pipe = PipelineConfig(stages=2, microbatches=4, schedule=schedule, split_backward=split)
    assert_close(pipelined(setup, pipe, _mesh_cfg(2, {}), remat=remat), setup[3])


@pytest.mark.parametrize("schedule,stages,microbatches,axes",
                         [("v-half", 4, 8, {}), ("zb-h1", 2, 4, {"tensor": 2})])
def test_the_recomputing_split_matches_the_unpipelined_model(setup, schedule, stages,
                                                             microbatches, axes):
    pipe = PipelineConfig(stages=stages, microbatches=microbatches, schedule=schedule,
                          split_backward="recompute")
    # The split applies where the stages keep layer inputs (remat full or offload).
    assert_close(pipelined(setup, pipe, _mesh_cfg(stages, axes), remat="offload"), setup[3])


def test_layer_orders_put_each_stages_layers_in_its_own_block():
    def order(schedule, stages, repeats=1, layers=8):
        pipe = PipelineConfig(stages=stages, microbatches=8, schedule=schedule, repeats=repeats)
        found = LayerOrder.for_pipeline(pipe, layers)
        return None if found is None else found.permutation

    assert order("circular", 2, 2) == (0, 1, 4, 5, 2, 3, 6, 7)   # stage 0: blocks 0 and 2
    assert order("interleaved", 4, 2) == (0, 4, 1, 5, 2, 6, 3, 7)
    assert order("v-half", 2) == (0, 1, 6, 7, 2, 3, 4, 5)         # stage 0: chunks 0 and 3
    for canonical in [("gpipe", 2), ("1f1b", 4), ("zb-h1", 2), ("circular", 2, 1)]:
        assert order(*canonical) is None
    pipe = PipelineConfig(stages=2, microbatches=8, schedule="v-zb")
    o = LayerOrder.for_pipeline(pipe, 8)
    tree = {"params": {"layers": {"w": np.arange(16).reshape(8, 2)}, "embed": np.arange(8)},
            "opt_state": ({"mu": {"layers": {"w": np.arange(8)}}},)}
    there = o.to_pipeline(tree)
    np.testing.assert_array_equal(there["params"]["layers"]["w"][:, 0],
                                  2 * np.asarray(o.permutation))
    np.testing.assert_array_equal(there["opt_state"][0]["mu"]["layers"]["w"], o.permutation)
    np.testing.assert_array_equal(there["params"]["embed"], np.arange(8))   # not a layer
    back = o.to_canonical(there)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(tree)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("schedule, repeats, stages", [("circular", 2, 2),
                                                       ("interleaved", 2, 4), ("v-half", 1, 2)])
def test_in_pipeline_order_no_weight_crosses_a_stage(setup, schedule, repeats, stages):
    """With the layer stack in pipeline order, the step equals the unpipelined model and its
    program has no all-gather or all-to-all at all (only activations move, by
    collective-permute); in canonical order the weights are all-gathered (table schedules)
    or exchanged all-to-all (circular) at every step."""
    pipe = PipelineConfig(stages=stages, microbatches=8, schedule=schedule, repeats=repeats)
    mesh_cfg, texts = shd.MeshConfig(stage=stages, fsdp=1), []
    assert_close(pipelined(setup, pipe, mesh_cfg, pipeline_order=True, hlo=texts), setup[3])
    moves = re.compile(r"\b(all-gather|all-to-all)(-start)?\(")
    assert not moves.findall(texts[0])
    if schedule == "circular":      # one canonical compile, for the contrast
        pipelined(setup, pipe, mesh_cfg, hlo=texts)
        assert len(moves.findall(texts[1])) >= len(jax.tree.leaves(setup[1]["layers"]))


@pytest.mark.parametrize("split", ["stash", "recompute"])
def test_no_tick_copies_a_whole_activation_buffer(setup, split):
    """Each op returns only what it produces (sharding/stage_ops.py): the compiled step copies
    at most a slot of the stage's buffers, never the whole inbox, layer-input or stash buffer
    (a `lax.switch` branch that passed a buffer through would copy it at every tick, and so
    did filing a message into the inbox with a read-back of the slot it left alone)."""
    pipe = PipelineConfig(stages=4, microbatches=4, schedule="zb-h1", split_backward=split)
    texts = []
    assert_close(pipelined(setup, pipe, shd.MeshConfig(stage=4), hlo=texts), setup[3])
    slots = sch.as_arrays(pipe.table)["slots"]
    layers, rows = CFG.num_layers // 4, B // 4
    whole = [(slots["inbox"], rows, T), (slots["res"], layers, rows, T),
             (slots["w"], layers, rows, T)]
    # The ticks run in the loop body and the branches; ENTRY copies once per step (the
    # zero-initialised buffers).
    ticks = "\n".join(block for block in re.split(r"\n(?=\S)", texts[0])
                      if not block.startswith("ENTRY"))
    copied = [tuple(int(d) for d in dims.split(",")) for dims in
              re.findall(r"= \w+\[([\d,]+)\]\{[\d,]*\} copy\(", ticks)]
    assert copied, "no copies parsed: the HLO pattern no longer matches"
    assert not [c for c in copied for w in whole if c[:len(w)] == w], copied


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "v-zb"])
def test_table_schedules_beside_fsdp_and_tensor_together(setup, schedule):
    """Beside both axes the head runs data-parallel (XLA's partitioner fails on it sharded
    over both inside a `lax.switch` branch); the step still equals the unpipelined model."""
    pipe = PipelineConfig(stages=2, microbatches=4, schedule=schedule)
    assert_close(pipelined(setup, pipe, _mesh_cfg(2, {"fsdp": 2, "tensor": 2})), setup[3])


def test_circular_with_one_repeat_and_gpipe_agree(setup):
    mesh_cfg = shd.MeshConfig(stage=2, fsdp=1)
    got = pipelined(setup, PipelineConfig(stages=2, microbatches=4, schedule="circular"),
                    mesh_cfg)
    assert_close(got, setup[3])


@pytest.fixture(scope="module")
def packed(setup):
    """A packed RL batch (segments, positions, one microbatch of padding), its objective, and
    the unpipelined model's loss, gradients and statistics."""
    graphdef, params, _, _ = setup
    rng = np.random.default_rng(1)
    shape = (1, B, T)
    segment_ids = np.repeat(np.array([[1, 1, 1, 2, 2, 2, 2, 0]]), B, 0)[None].astype(np.int32)
    positions = np.where(segment_ids == 1, np.arange(T), np.arange(T) - 3).clip(0)
    batch = {"input_ids": rng.integers(0, CFG.vocab_size, shape).astype(np.int32),
             "targets": rng.integers(0, CFG.vocab_size, shape).astype(np.int32),
             "positions": positions.astype(np.int32), "segment_ids": segment_ids,
             # Rows 3, 7, 11, 15 form microbatch 3 of 4: all padding.
             "loss_mask": ((segment_ids > 0) & (np.arange(B) % 4 != 3)[:, None]).astype(
                 np.float32),
             "behaviour_logp": -rng.random(shape).astype(np.float32) * 3,
             "advantages": rng.normal(size=shape).astype(np.float32)}
    objective = PolicyGradientLoss(kind="ppo", max_segments=4)
    want = jax.jit(lambda p, b: loss_and_grads(graphdef, p, b, objective))(params, batch)
    return batch, objective, want


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb-h1", "v-half",
                                      "v-min", "v-zb"])
def test_policy_loss_on_packed_segments(setup, packed, schedule):
    """The RL objective (packed segments, positions, min/max statistics) through a pipeline,
    with one microbatch of RL padding (nothing to learn from: the table schedules skip it)."""
    batch, objective, (loss, grads, ref_stats) = packed
    pipe = PipelineConfig(stages=2, microbatches=4, schedule=schedule,
                          repeats=2 if schedule == "interleaved" else 1)
    *got, stats = pipelined(setup, pipe, shd.MeshConfig(stage=2, fsdp=2), objective, batch,
                            with_stats=True)
    assert_close(got, (loss, grads))
    for k in ref_stats:
        assert float(stats[k]) == pytest.approx(float(ref_stats[k]), rel=1e-5, abs=1e-6), k


@pytest.mark.parametrize("axes", [{"tensor": 2}, {"fsdp": 2, "tensor": 2}],
                         ids=["tensor", "fsdp-tensor"])
def test_kl_term_with_the_reference_model_in_the_bubbles(setup, packed, axes):
    """PipeFill: with a KL term, the reference model runs chunk by chunk in the table's R ops
    (here a reference that differs from the policy, so its log-probs matter) and the loss,
    gradients and KL statistic equal the unpipelined step's, which runs the whole reference
    model in the objective. V-Half: R ops fill idle ticks, and at the V's turn an R message
    stays on its stage (one compile; the R branches are the same code for every table). Both
    models' layer stacks in pipeline order, as the RL trainer keeps them."""
    schedule = "v-half"
    graphdef, params, _, _ = setup
    batch, _, _ = packed
    objective = PolicyGradientLoss(kind="ppo", max_segments=4, kl_coef=0.5)
    ref_params = split_params(Transformer(CFG, rngs=nnx.Rngs(7)))[1]
    loss, grads, want = jax.jit(lambda p, b, r: loss_and_grads(graphdef, p, b, objective, r))(
        params, batch, ref_params)
    assert float(want["kl_ref"]) > 0.01          # the reference is far from the policy
    pipe = PipelineConfig(stages=2, microbatches=4, schedule=schedule)
    assert pipe.reference_table.reference and not pipe.table.reference
    *got, stats = pipelined(setup, pipe, _mesh_cfg(2, axes), objective, batch,
                            with_stats=True, ref_params=ref_params, pipeline_order=True)
    assert_close(got, (loss, grads))
    assert float(stats["kl_ref"]) == pytest.approx(float(want["kl_ref"]), rel=1e-5)


def test_offloaded_stage_inputs_give_the_same_gradients_from_host_memory(setup):
    graphdef, params, batch, ref = setup
    pipe = PipelineConfig(stages=2, microbatches=4, offload_stage_inputs=True)
    assert_close(pipelined(setup, pipe, shd.MeshConfig(stage=2, fsdp=1)), ref)
    jaxpr = str(jax.make_jaxpr(lambda p, b: loss_and_grads(graphdef, p, b, layout=Layout(pipeline=pipe))[:2])(
        params, batch))
    # Inside the pipeline's vmap over stages, the offloaded residual is one stage input
    # ([rows per microbatch, T, D]) per stage.
    assert re.findall(r"f32<host>\[([\d,]+)\] = device_put", jaxpr) == [f"2,{B // 4},{T},32"]


def test_bubble_fractions():
    assert PipelineConfig(stages=4, microbatches=8).bubble_fraction() == pytest.approx(3 / 11)
    assert PipelineConfig(stages=4, microbatches=8, repeats=2,
                          schedule="circular").bubble_fraction() == pytest.approx(3 / 19)
    # 1F1B's table: (p-1) idle ticks of 3 (F, then X of two) per microbatch slot, GPipe's.
    assert PipelineConfig(stages=4, microbatches=8,
                          schedule="1f1b").bubble_fraction() == pytest.approx(3 / 11)


@pytest.mark.parametrize("overrides,message", [
    (["sharding.pipeline.stages=3"],
     r"stages=3 x repeats=1 = 3 blocks do not divide model.num_layers=4"),
    (["sharding.pipeline.stages=2", "sharding.pipeline.microbatches=5"],
     r"microbatches=5 does not divide train.batch_size=64"),
    (["sharding.pipeline.stages=2", "sharding.pipeline.repeats=2"],
     r"repeats=2 needs schedule=circular"),
    (["sharding.pipeline.stages=4", "sharding.pipeline.repeats=2",
      "sharding.pipeline.schedule=circular", "sharding.pipeline.microbatches=2"],
     r"microbatches >= stages: microbatches=2 < stages=4"),
    (["sharding.pipeline.schedule=zb"], r"schedule='zb' is not allowed; choose one of"),
    (["mesh.stage=2"], r"mesh.stage=2 differs from sharding.pipeline.stages=1"),
    (["sharding.pipeline.stages=2", "train.microbatches=2"], r"both split the batch"),
    (["sharding.pipeline.stages=2", "sharding.pipeline.schedule=zb-h1",
      "sharding.pipeline.offload_stage_inputs=true"],
     r"offload_stage_inputs=true works with schedule gpipe or circular, not zb-h1"),
    (["sharding.pipeline.stages=4", "sharding.pipeline.schedule=v-half"],
     r"stages=4 x v-half's 2 chunks per stage = 8 blocks do not divide model.num_layers=4"),
    (["sharding.pipeline.stages=2", "sharding.pipeline.schedule=v-min",
      "sharding.pipeline.repeats=3"], r"v-min places exactly 2 layer chunks per stage"),
    (["sharding.pipeline.stages=2", "sharding.pipeline.schedule=1f1b",
      "sharding.pipeline.split_backward=recompute"],
     r"split_backward=recompute applies to the schedules that split the backward into B and "
     r"W \(zb-h1, v-half, v-min, v-zb\), not 1f1b"),
    (["sharding.pipeline.stages=2", "sharding.pipeline.schedule=zb-h1",
      "sharding.pipeline.split_backward=keep"], r"split_backward='keep' is not allowed"),
    (["sharding.pipeline.stages=2", "sharding.pipeline.schedule=interleaved"],
     r"interleaved needs repeats >= 2 and microbatches a multiple of stages: repeats=1"),
    (["sharding.pipeline.stages=4", "sharding.pipeline.schedule=interleaved",
      "sharding.pipeline.repeats=2", "sharding.pipeline.microbatches=2", "model.num_layers=8"],
     r"microbatches=2, stages=4"),
])
def test_bad_pipeline_configs_fail_at_config_time(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config("configs/demo_cpu.yaml", overrides)


def test_the_mesh_stage_axis_follows_the_pipeline():
    cfg = load_run_config("configs/demo_cpu.yaml", ["sharding.pipeline.stages=2"])
    assert cfg.mesh.stage == 2
    assert shd.make_mesh(cfg.mesh).shape["stage"] == 2


@pytest.mark.parametrize("schedule,stages,microbatches", [("1f1b", 4, 8)])
def test_a_tied_embedding_gets_the_sum_of_its_two_stages_gradients(schedule, stages,
                                                                   microbatches):
    """The first chunk's stage forms the embedding's gradient, the last chunk's the head's
    (stages 0 and 3 here; both stage 0 in a V): a tied table's gradient is their sum."""
    tied = with_reference(*split_params(Transformer(
        ModelConfig(**{**vars(CFG), "tie_embeddings": True}), rngs=nnx.Rngs(1))))
    assert "lm_head" not in tied[1]
    pipe = PipelineConfig(stages=stages, microbatches=microbatches, schedule=schedule)
    assert_close(pipelined(tied, pipe, _mesh_cfg(stages, {})), tied[3])
