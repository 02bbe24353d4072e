"""Context parallelism on eight CPU devices: the load-balanced layout, attention across the
`context` axis against the XLA path on rows in their own order, and whole train steps (the
supervised loss and the RL policy loss, packed rows) against the same steps on one device."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl.models import ModelConfig, abstract_model, split_params
from jaxrl.models import context_attention as cp
from jaxrl.models import layers as ops
from jaxrl.optim_config import OptimConfig
from jaxrl.train.objectives import PolicyGradientLoss, SupervisedLoss
from jaxrl.train.optim import lr_schedule, make_optimizer
from jaxrl.train.state import init_state, state_shardings
from jaxrl.train.step import Layout, jit_train_step, split_microbatches
from sharding.mesh import MeshConfig, batch_sharding, make_mesh

pytestmark = pytest.mark.multi_device


def test_each_device_holds_two_chunks_with_equal_causal_work():
    """4 devices, 32 tokens: chunks of 4; device i holds chunks i and 7 - i, and the pairs
    of (query, key) a causal mask keeps are the same on every device."""
    index = cp.stored_index(32, 4)
    assert sorted(index.tolist()) == list(range(32))
    parts = index.reshape(4, 8)
    assert parts[1].tolist() == [4, 5, 6, 7, 24, 25, 26, 27]
    kept = [int(np.sum(part[:, None] >= np.arange(32)[None, :])) for part in parts]
    assert len(set(kept)) == 1
    with pytest.raises(ValueError, match=r"the sequence length=30 must be a multiple of "
                                         r"2 x mesh.context = 8"):
        cp.stored_index(30, 4)


def _packed_segments(rng, b, t):
    """Rows of 1-3 samples one after another, padding (0) at the end of some."""
    rows = []
    for _ in range(b):
        cuts = np.sort(rng.choice(np.arange(2, t - 1), rng.integers(1, 3), replace=False))
        row = np.searchsorted(cuts, np.arange(t), side="right") + 1
        end = rng.integers(t - 6, t + 1)
        rows.append(np.where(np.arange(t) < end, row, 0))
    return np.stack(rows).astype(np.int32)


def _qkvw(rng, b, t, n, g, h, spread=1.0):
    """Queries, keys, values and a cotangent to weigh the output by, float32."""
    return [jnp.asarray(rng.normal(size=shape) * spread, jnp.float32)
            for shape in ((b, t, n, h), (b, t, g, h), (b, t, g, h), (b, t, n, h))]


def _assert_split_equals_unsplit(mesh, q, k, v, w, seg, *, scale, softcap=None, grad_atol=1e-5,
                                 **how):
    """Attention over rows stored in the load-balanced order and split over `mesh`'s context
    axis (`how`: impl, method) against layers.attention on the rows in their own order with
    the per-segment causal mask: outputs, and the gradients of sum(out * w) in q, k and v."""
    t = q.shape[1]
    index = cp.stored_index(t, mesh.shape["context"])
    undo = np.argsort(index)
    q, k, v = (jax.device_put(x, NamedSharding(mesh, P())) for x in (q, k, v))

    def split(q, k, v):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            out = cp.attention(q[:, index], k[:, index], v[:, index],
                               None if seg is None else seg[:, index], scale=scale,
                               softcap=softcap, **how)
        return jnp.sum(out[:, undo] * w), out[:, undo]

    def unsplit(q, k, v):
        out = ops.attention(q, k, v, ops.causal_mask(seg, t),
                                scoring=ops.Scoring(scale, softcap))
        return jnp.sum(out * w), out

    grad = functools.partial(jax.value_and_grad, argnums=(0, 1, 2), has_aux=True)
    (_, got), got_grads = jax.jit(grad(split))(q, k, v)
    (_, want), want_grads = grad(unsplit)(q, k, v)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    for got_g, want_g in zip(got_grads, want_grads):
        np.testing.assert_allclose(got_g, want_g, atol=grad_atol, rtol=1e-5)


@pytest.mark.parametrize("method", ["all-gather", "ring"])
@pytest.mark.parametrize("mesh_cfg", [MeshConfig(context=2, fsdp=2, tensor=2),
                                      MeshConfig(context=4, data=2, fsdp=1),
                                      MeshConfig(context=8, fsdp=1)],
                         ids=["context2-fsdp2-tensor2", "context4-data2", "context8"])
def test_attention_across_the_context_axis_equals_the_unsplit_rows(mesh_cfg, method):
    """Packed rows, GQA 4:2; keys and values gathered, or passed round a ring (its own
    backward: the gradients travel with the pairs)."""
    mesh = make_mesh(mesh_cfg)
    rng = np.random.default_rng(mesh.shape["context"])
    b, t = 4, 32
    q, k, v, w = _qkvw(rng, b, t, 4, 2, 8)
    _assert_split_equals_unsplit(mesh, q, k, v, w, _packed_segments(rng, b, t),
                                 scale=8 ** -0.5, method=method)


@pytest.mark.parametrize("method", ["all-gather", "ring"])
def test_soft_capped_scores_across_the_context_axis(method):
    """Gemma 2's attention soft-cap (scores = cap * tanh(scores / cap)) in both methods,
    context 4, unpacked rows."""
    mesh = make_mesh(MeshConfig(context=4, data=2, fsdp=1))
    q, k, v, w = _qkvw(np.random.default_rng(11), 2, 16, 4, 2, 8, spread=2.0)
    _assert_split_equals_unsplit(mesh, q, k, v, w, None, scale=0.5, softcap=3.0,
                                 grad_atol=2e-5, method=method)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_splash_across_the_context_axis_equals_the_unsplit_rows(packed):
    """The splash kernel (Pallas interpret mode) on context=2 x fsdp=2 x tensor=2: each device's
    queries against the gathered keys, the kernel's block tables split by query shard, its
    mask by original index (two 128-token chunks a device: the kernel's smallest block)."""
    mesh = make_mesh(MeshConfig(context=2, fsdp=2, tensor=2))
    rng = np.random.default_rng(7)
    b, t, h = 4, 512, 16
    q, k, v, w = _qkvw(rng, b, t, 4, 2, h)
    seg = (np.where(np.arange(t)[None] < rng.integers(20, 480, b)[:, None], 1, 2)
           .astype(np.int32) if packed else None)
    _assert_split_equals_unsplit(mesh, q, k, v, w, seg, scale=h ** -0.5, grad_atol=2e-5,
                                 impl="splash")


CFG = ModelConfig(vocab_size=64, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, mlp_dim=64, qk_norm=True)
OPTIM = OptimConfig(lr=1e-2, warmup_steps=0)
TX = make_optimizer(OPTIM, total_steps=10)


def _rl_batch(seed: int, b: int = 8, t: int = 32) -> dict:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, CFG.vocab_size, size=(b, t + 1)).astype(np.int32)
    seg = _packed_segments(rng, b, t)
    starts = np.concatenate([np.ones((b, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    positions = np.arange(t)[None] - np.maximum.accumulate(
        np.where(starts, np.arange(t)[None], 0), axis=1)
    mask = ((rng.random((b, t)) < 0.7) & (seg > 0)).astype(np.float32)
    return {"input_ids": ids[:, :-1], "targets": ids[:, 1:], "loss_mask": mask,
            "segment_ids": seg, "positions": positions.astype(np.int32),
            "behaviour_logp": (-rng.random((b, t)) * 4).astype(np.float32),
            "advantages": (rng.normal(size=(b, t)) * mask).astype(np.float32)}


MOE_CFG = dataclasses.replace(CFG, family="qwen3_moe", num_experts=4, experts_per_token=2,
                              moe_mlp_dim=32)


@pytest.mark.parametrize("model,objective,mesh_cfg,method", [
    (CFG, SupervisedLoss(logits_chunk=8), MeshConfig(context=2, fsdp=2, tensor=2),
     "all-gather"),
    (CFG, PolicyGradientLoss(kind="ppo", logits_chunk=8), MeshConfig(context=4, data=2, fsdp=1),
     "all-gather"),
    (CFG, PolicyGradientLoss(kind="gspo", logits_chunk=8), MeshConfig(context=4, fsdp=2),
     "ring"),
    (MOE_CFG, SupervisedLoss(logits_chunk=8), MeshConfig(context=2, expert=2, fsdp=2),
     "all-gather"),
], ids=["supervised-context2-fsdp2-tensor2", "ppo-context4-data2", "gspo-ring-context4-fsdp2",
        "moe-context2-expert2-fsdp2"])
def test_train_steps_on_a_context_axis_match_one_device(model, objective, mesh_cfg, method):
    """Two steps (two microbatches each) of packed rows with explicit positions: metrics and
    updated parameters against the same steps on one device (a mixture-of-experts model's
    tokens sent to their experts across the expert axis from rows split over context)."""
    cfg = dataclasses.replace(model, context_attention=method)
    graphdef, _ = split_params(abstract_model(cfg))
    schedule = lr_schedule(OPTIM, 10)
    params = None
    results = []
    for mesh in (make_mesh(MeshConfig(fsdp=1), jax.devices()[:1]), make_mesh(mesh_cfg)):
        shardings = state_shardings(cfg, TX, mesh)
        state = init_state(cfg, TX, shardings, seed=0, params=params)
        params = jax.device_get(state["params"])
        step = jit_train_step(graphdef, TX, shardings, Layout(mesh), schedule, objective)
        metrics = []
        for k in range(2):
            mb = jax.device_put(split_microbatches(_rl_batch(seed=k), 2),
                                batch_sharding(mesh, 3, leading=1))
            state, m = step(state, mb)
            metrics.append(jax.device_get(m))
        results.append((metrics, jax.device_get(state["params"])))
    (m1, p1), (mc, pc) = results
    for one, split in zip(m1, mc):
        for key in one:
            np.testing.assert_allclose(split[key], one[key], rtol=2e-5, atol=1e-6, err_msg=key)
    for a, b in zip(jax.tree.leaves(pc), jax.tree.leaves(p1)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)   # Adam near 0: see test_step
