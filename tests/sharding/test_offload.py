"""Remat policies: same gradients as keeping everything; `offload` really moves the named
activations to host memory."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.config import ConfigError, load_run_config
from jaxrl.models import ModelConfig, Transformer
from jaxrl.models.transformer import split_params
from jaxrl.train.step import Layout, loss_and_grads
from sharding.offload import REMAT_POLICIES, remat_policy

pytestmark = pytest.mark.multi_device

CFG = ModelConfig(vocab_size=32, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, mlp_dim=64, max_seq_len=16)
M, B, T = 2, 4, 8


@pytest.fixture(scope="module")
def setup():
    graphdef, params = split_params(Transformer(CFG, rngs=nnx.Rngs(0)))
    ids = np.random.default_rng(0).integers(0, CFG.vocab_size, (M, B, T)).astype(np.int32)
    batch = {"input_ids": ids, "targets": np.roll(ids, -1, -1),
             "loss_mask": np.ones(ids.shape, np.float32)}
    return graphdef, params, batch


def grads_of(setup, remat):
    graphdef, params, batch = setup
    return jax.jit(lambda p, b: loss_and_grads(graphdef, p, b, layout=Layout(remat=remat))[:2])(params, batch)


@pytest.mark.parametrize("remat", [r for r in REMAT_POLICIES if r != "none"])
def test_every_policy_gives_the_gradients_of_none(setup, remat):
    loss, grads = grads_of(setup, remat)
    ref_loss, ref_grads = grads_of(setup, "none")
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-6)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        scale = float(jnp.max(jnp.abs(r))) + 1e-12
        assert float(jnp.max(jnp.abs(g - r))) / scale <= 1e-5


def host_residuals(setup, remat) -> list[str]:
    """Shapes of the values the backward pass's residuals put in host memory."""
    graphdef, params, batch = setup
    jaxpr = str(jax.make_jaxpr(lambda p, b: loss_and_grads(graphdef, p, b, layout=Layout(remat=remat))[:2])(
        params, batch))
    return sorted(re.findall(r"f32<host>\[([\d,]+)\] = device_put", jaxpr))


def test_offload_moves_the_named_activations_to_host(setup):
    n, g, h, d = CFG.num_heads, CFG.num_kv_heads, CFG.head_dim, CFG.embed_dim
    # q, k, v, the attention output and the MLP input of every layer (stacked by the scan).
    expected = sorted([f"{B},{T},{n},{h}", f"{B},{T},{g},{h}", f"{B},{T},{g},{h}",
                       f"{B},{T},{n},{h}", f"{B},{T},{d}"])
    assert host_residuals(setup, "offload") == expected
    assert host_residuals(setup, "none") == [] and host_residuals(setup, "full") == []


def test_unknown_policy_is_refused_at_config_time():
    with pytest.raises(ConfigError, match=r"train.remat='bogus' is not allowed; choose one of: "
                                          r"'none', 'full', 'minimal', 'offload'"):
        load_run_config(None, ["train.remat=bogus"])
    with pytest.raises(ValueError, match="train.remat='bogus' is not a remat policy"):
        remat_policy("bogus")


def test_optimizer_offload_keeps_the_state_on_host_and_gives_the_same_steps(setup):
    from jaxrl.optim_config import OptimConfig
    from jaxrl.train.optim import make_optimizer
    from jaxrl.train.state import init_state, state_shardings
    from jaxrl.train.step import Layout, jit_train_step
    from sharding import mesh as shd

    graphdef, _, batch = setup
    mesh = shd.make_mesh(shd.MeshConfig(fsdp=4), jax.devices()[:4])
    tx = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=0), 10)
    states = {}
    for offload in (False, True):
        shardings = state_shardings(CFG, tx, mesh, offload_optimizer=offload)
        state = init_state(CFG, tx, shardings, seed=0)
        step = jit_train_step(graphdef, tx, shardings, Layout(mesh))
        for _ in range(3):
            state, _ = step(state, batch)
        states[offload] = state
    kinds = {a.sharding.memory_kind for a in jax.tree.leaves(states[True]["opt_state"])}
    assert kinds == {"pinned_host"}
    assert {a.sharding.memory_kind for a in jax.tree.leaves(states[True]["params"])} == {"device"}
    for a, b in zip(jax.tree.leaves(states[True]), jax.tree.leaves(states[False])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_lora_trains_with_activations_and_optimizer_state_on_host(setup):
    """LoRA beside both host offloads: train.remat=offload gives the adapters the gradients
    of keeping everything (the layers' named activations still go to host), and the
    optimizer state, the adapters' alone, lives on host and gives the same steps."""
    import dataclasses

    from jaxrl.models import lora
    from jaxrl.models.lora import LoraConfig
    from jaxrl.optim_config import OptimConfig
    from jaxrl.train.optim import make_optimizer
    from jaxrl.train.state import init_state, state_shardings
    from jaxrl.train.step import Layout, jit_train_step
    from sharding import mesh as shd

    cfg = dataclasses.replace(CFG, lora=LoraConfig(rank=4, targets=("q_proj", "up_proj")))
    graphdef, params = split_params(Transformer(cfg, rngs=nnx.Rngs(0)))
    params = lora.with_trainable(params, {"layers": {   # B random: A gets a gradient too
        k: v + k.endswith("_lora_b") * jax.random.normal(jax.random.key(1), v.shape)
        for k, v in lora.trainable(params)["layers"].items()}})
    lora_setup = (graphdef, params, setup[2])
    (loss, grads), (ref_loss, ref_grads) = grads_of(lora_setup, "offload"), grads_of(
        lora_setup, "none")
    assert sorted(grads["layers"]) == sorted(lora.trainable(params)["layers"])
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-6)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        assert float(jnp.max(jnp.abs(g - r))) <= 1e-5 * float(jnp.max(jnp.abs(r)))
    assert len(host_residuals(lora_setup, "offload")) == 5
    mesh = shd.make_mesh(shd.MeshConfig(fsdp=4), jax.devices()[:4])
    tx = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=0), 10)
    states = {}
    for offload in (False, True):
        shardings = state_shardings(cfg, tx, mesh, offload_optimizer=offload)
        state = init_state(cfg, tx, shardings, seed=0)
        step = jit_train_step(graphdef, tx, shardings, Layout(mesh))
        for _ in range(3):
            state, _ = step(state, setup[2])
        states[offload] = state
    assert {a.sharding.memory_kind for a in jax.tree.leaves(states[True]["opt_state"])} == {
        "pinned_host"}
    moments = jax.tree.leaves(states[True]["opt_state"])
    assert sum(a.size for a in moments) < 3 * sum(
        a.size for a in jax.tree.leaves(lora.trainable(params))) + 10
    for a, b in zip(jax.tree.leaves(states[True]), jax.tree.leaves(states[False])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
