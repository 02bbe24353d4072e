"""The sharded train step against the same step on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxrl.models import ModelConfig, abstract_model, split_params
from jaxrl.optim_config import OptimConfig
from jaxrl.train.optim import lr_schedule, make_optimizer
from jaxrl.train.state import init_state, state_shardings
from jaxrl.train.step import Layout, jit_train_step, loss_and_grads, split_microbatches
from sharding.mesh import MeshConfig, batch_sharding, make_mesh

pytestmark = pytest.mark.multi_device

CFG = ModelConfig(vocab_size=32, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, mlp_dim=64, qkv_bias=True, qk_norm=True)
TX = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=0), total_steps=10)
SCHEDULE = lr_schedule(OptimConfig(lr=1e-2, warmup_steps=0), 10)


def _batch(seed=0, b=8, t=8):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, CFG.vocab_size, size=(b, t + 1)).astype(np.int32)
    mask = (rng.random((b, t)) < 0.7).astype(np.float32)
    return {"input_ids": ids[:, :-1], "targets": ids[:, 1:], "loss_mask": mask}


@pytest.fixture(scope="module")
def single():
    mesh = make_mesh(MeshConfig(fsdp=1), devices=jax.devices()[:1])
    shardings = state_shardings(CFG, TX, mesh)
    return mesh, shardings, init_state(CFG, TX, shardings, seed=0)


@pytest.fixture(scope="module")
def sharded(single):
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    shardings = state_shardings(CFG, TX, mesh)
    params = jax.device_get(single[2]["params"])
    return mesh, shardings, init_state(CFG, TX, shardings, seed=0, params=params)


def _rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _grads(mesh, state, batch, microbatches):
    graphdef, _ = split_params(abstract_model(CFG))
    fn = jax.jit(lambda p, b: loss_and_grads(graphdef, p, b))
    mb = jax.device_put(split_microbatches(batch, microbatches),
                        batch_sharding(mesh, 3, leading=1))
    return jax.device_get(fn(state["params"], mb)[:2])


def test_parameters_are_created_sharded(sharded):
    mesh, shardings, state = sharded
    q = state["params"]["layers"]["q_proj"]  # [L, D, N, H]: embed on fsdp, heads on tensor
    assert q.sharding.spec == P(None, "fsdp", "tensor", None)
    assert q.addressable_shards[0].data.shape == (2, 16, 2, 8)
    mu = state["opt_state"][1][0].mu["layers"]["q_proj"]
    assert mu.sharding.spec == q.sharding.spec
    embed = state["params"]["embed"]  # [V, D]: vocab on tensor, embed on fsdp
    assert embed.sharding.spec == P("tensor", "fsdp")
    assert all(s.data.shape == (16, 16) for s in embed.addressable_shards)


def test_loss_and_grads_match_one_device(single, sharded):
    batch = _batch()
    loss_1, grads_1 = _grads(single[0], single[2], batch, 1)
    loss_8, grads_8 = _grads(sharded[0], sharded[2], batch, 1)
    assert _rel_err(loss_8, loss_1) <= 1e-5
    errs = jax.tree.map(_rel_err, grads_8, grads_1)
    assert max(jax.tree.leaves(errs)) <= 1e-5, errs


def test_gradient_accumulation_matches_one_shot(sharded):
    batch = _batch(seed=1, b=16)
    loss_1, grads_1 = _grads(sharded[0], sharded[2], batch, 1)
    loss_4, grads_4 = _grads(sharded[0], sharded[2], batch, 4)
    assert _rel_err(loss_4, loss_1) <= 1e-5
    assert max(jax.tree.leaves(jax.tree.map(_rel_err, grads_4, grads_1))) <= 1e-5


def test_train_steps_match_one_device(single, sharded):
    graphdef, _ = split_params(abstract_model(CFG))
    results = []
    for mesh, shardings, state in (single, sharded):
        state = jax.tree.map(jnp.copy, state)  # the step donates its input
        step = jit_train_step(graphdef, TX, shardings, Layout(mesh), SCHEDULE)
        losses = []
        for k in range(3):
            mb = jax.device_put(split_microbatches(_batch(seed=10 + k, b=16), 2),
                                batch_sharding(mesh, 3, leading=1))
            state, metrics = step(state, mb)
            losses.append(float(metrics["loss"]))
        results.append((losses, jax.device_get(state["params"]), int(state["step"])))
    (l1, p1, s1), (l8, p8, s8) = results
    assert s1 == s8 == 3
    assert l1[2] < l1[0]  # it learns
    np.testing.assert_allclose(l8, l1, rtol=1e-5)
    # Adam divides by sqrt(v): for near-zero gradients a last-bit difference moves a weight by up
    # to ~lr, so parameters are compared in absolute terms against lr = 1e-2.
    for a, b in zip(jax.tree.leaves(p8), jax.tree.leaves(p1)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)
