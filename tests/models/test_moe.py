"""The mixture-of-experts MLP (jaxrl/models/moe.py) against a dense reference that runs every expert
on every token and keeps the top-k (values and gradients), and the MoE train step on a mesh of 8
CPU devices against one device. Parity with Hugging Face's Qwen3-MoE is in test_hf.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.models import ModelConfig, abstract_model, split_params
from jaxrl.models import moe_parallel
from jaxrl.models.moe import moe_mlp
from jaxrl.optim_config import OptimConfig
from jaxrl.train.optim import make_optimizer
from jaxrl.train.state import init_state, state_shardings
from jaxrl.train.step import loss_and_grads, split_microbatches
from sharding.mesh import MeshConfig, batch_sharding, make_mesh

CFG = ModelConfig(family="qwen3_moe", vocab_size=32, embed_dim=32, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, qk_norm=True, num_experts=4, experts_per_token=2,
                  moe_mlp_dim=16)


def _dense_reference(cfg, w, x_BTD):
    """Every expert on every token ([B, T, E, D]), combined with the top-k softmax weights."""
    probs_BTE = jax.nn.softmax((x_BTD @ w["router"]).astype(jnp.float32), axis=-1)
    top_BTK, idx_BTK = jax.lax.top_k(probs_BTE, cfg.experts_per_token)
    if cfg.norm_topk_prob:
        top_BTK = top_BTK / top_BTK.sum(-1, keepdims=True)
    weight_BTE = jnp.sum(jax.nn.one_hot(idx_BTK, cfg.num_experts) * top_BTK[..., None], axis=-2)
    gate = jnp.einsum("btd,edf->btef", x_BTD, w["experts_gate"])
    up = jnp.einsum("btd,edf->btef", x_BTD, w["experts_up"])
    out_BTED = jnp.einsum("btef,efd->bted", jax.nn.silu(gate) * up, w["experts_down"])
    return jnp.einsum("bted,bte->btd", out_BTED, weight_BTE)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_grouped_experts_equal_every_expert_on_every_token(norm_topk_prob):
    cfg = dataclasses.replace(CFG, norm_topk_prob=norm_topk_prob)
    rng = np.random.default_rng(0)
    d, e, f = cfg.embed_dim, cfg.num_experts, cfg.moe_mlp_dim
    w = {"router": rng.normal(size=(d, e)), "experts_gate": rng.normal(size=(e, d, f)) * 0.3,
         "experts_up": rng.normal(size=(e, d, f)) * 0.3,
         "experts_down": rng.normal(size=(e, f, d)) * 0.3}
    w = {k: jnp.asarray(v, jnp.float32) for k, v in w.items()}
    x = jnp.asarray(rng.normal(size=(3, 5, d)), jnp.float32)
    np.testing.assert_allclose(moe_mlp(cfg, w, x), _dense_reference(cfg, w, x), atol=1e-5)

    def loss(fn):
        return lambda w, x: jnp.sum(jnp.sin(fn(cfg, w, x)))

    got = jax.grad(loss(moe_mlp), argnums=(0, 1))(w, x)
    want = jax.grad(loss(_dense_reference), argnums=(0, 1))(w, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, atol=1e-4)


@pytest.mark.multi_device
@pytest.mark.parametrize("sizes", [dict(data=2, fsdp=2, tensor=2), dict(fsdp=2, expert=2, tensor=2),
                                   dict(fsdp=1, expert=4, tensor=2)],
                         ids=["fsdp", "expert2", "expert4"])
def test_moe_train_step_on_a_mesh_equals_one_device(sizes, monkeypatch):
    """Experts stored split over `expert` (all-to-all dispatch: jaxrl/models/moe_parallel.py)
    and fsdp, their hidden size over tensor, rows over data, fsdp and expert: the loss, the
    load-balancing loss and every gradient as on one device."""
    cfg = dataclasses.replace(CFG, router_aux_loss_coef=0.1)
    tx = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=0), total_steps=10)
    graphdef, _ = split_params(abstract_model(cfg))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, size=(8, 9)).astype(np.int32)
    batch = {"input_ids": ids[:, :-1], "targets": ids[:, 1:],
             "loss_mask": (rng.random((8, 8)) < 0.7).astype(np.float32)}
    exchanges = []        # layers traced through the all-to-all path
    exchange = moe_parallel._exchange
    monkeypatch.setattr(moe_parallel, "_exchange",
                        lambda *a: exchanges.append(1) or exchange(*a))
    results, params = [], None
    for mesh in (make_mesh(MeshConfig(fsdp=1), devices=jax.devices()[:1]),
                 make_mesh(MeshConfig(**sizes))):
        shardings = state_shardings(cfg, tx, mesh)
        state = init_state(cfg, tx, shardings, seed=0, params=params)
        params = jax.device_get(state["params"])
        experts = state["params"]["layers"]["experts_gate"]      # [L, E, D, F]
        mb = jax.device_put(split_microbatches(batch, 1), batch_sharding(mesh, 3, leading=1))
        fn = jax.jit(lambda p, b: loss_and_grads(graphdef, p, b))
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):   # as the train step does
            results.append((experts.sharding.spec, jax.device_get(fn(state["params"], mb))))
    (_, (loss1, grads1, aux1)), (spec8, (loss8, grads8, aux8)) = results
    split = tuple(a for a in ("expert", "fsdp") if sizes.get(a, 1) > 1)
    assert tuple(spec8)[1] in (split, split[0]) and "tensor" in tuple(spec8)
    assert bool(exchanges) == ("expert" in sizes)
    np.testing.assert_allclose(loss8, loss1, rtol=1e-5)
    np.testing.assert_allclose(aux8["router_aux_loss"], aux1["router_aux_loss"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads8), jax.tree.leaves(grads1)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_experts_must_divide_over_the_expert_axis():
    class Mesh:
        shape = {"expert": 3}

    w = {"experts_gate": np.zeros((4, 2, 2))}
    with pytest.raises(ValueError, match="model.num_experts=4 is not divisible by mesh.expert=3"):
        moe_parallel.parallel_experts(None, w, np.zeros((6, 2)), None, Mesh())
