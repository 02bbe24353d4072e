"""LoRA (jaxrl/models/lora.py): adapters on the projections PEFT names, the adapted model equal
to its base at the start and to the base with merged weights W + s*A@B after, and a train step
that moves only the adapters (no gradient, no optimizer state for the base)."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrl.config import ConfigError, load_run_config
from jaxrl.models import ModelConfig, Transformer, lora
from jaxrl.models.lora import LoraConfig
from jaxrl.models.transformer import split_params
from jaxrl.train.state import init_state, state_shardings
from jaxrl.train.step import loss_and_grads, make_train_step
from sharding import mesh as shd

BASE = ModelConfig(vocab_size=32, embed_dim=16, num_layers=2, num_heads=2, num_kv_heads=1,
                   head_dim=8, mlp_dim=40, max_seq_len=16)
IDS = np.random.default_rng(0).integers(0, 32, (3, 16)).astype(np.int32)


def _model(cfg, seed=0):
    return split_params(Transformer(cfg, rngs=nnx.Rngs(seed)))


def _logits(cfg, params):
    graphdef, _ = _model(cfg)
    return nnx.merge(graphdef, params)(IDS)


def test_targets_and_shapes_follow_peft_names():
    cfg = dataclasses.replace(BASE, lora=LoraConfig(rank=4, targets=("q_proj", "down_proj")))
    shapes = lora.adapter_shapes(cfg)
    assert shapes == {
        "q_proj_lora_a": ((2, 16, 4), ("layers", "embed", "lora_rank")),
        "q_proj_lora_b": ((2, 4, 2, 8), ("layers", "lora_rank", "q_heads", "head_dim")),
        "down_proj_lora_a": ((2, 40, 4), ("layers", "mlp", "lora_rank")),
        "down_proj_lora_b": ((2, 4, 16), ("layers", "lora_rank", "embed"))}
    assert LoraConfig(rank=2).modules() == lora.TARGETS
    assert LoraConfig(rank=2).modules(moe=True) == lora.ATTENTION
    assert LoraConfig(rank=8, alpha=16).scale == 2.0
    assert LoraConfig(rank=16, alpha=16, use_rslora=True).scale == 4.0
    assert lora.adapter_shapes(BASE) == {}


def test_bad_lora_settings_are_refused_by_name():
    with pytest.raises(ValueError, match=r"targets=\['q_proj', 'qkv'\]: \['qkv'\]; allowed: "
                                         r"q_proj, k_proj"):
        LoraConfig(rank=4, targets=("q_proj", "qkv"))
    with pytest.raises(ValueError, match=r"model.lora.rank=-1 must be >= 0"):
        LoraConfig(rank=-1)
    with pytest.raises(ConfigError, match=r"model.lora.rank=4 inside a pipeline"):
        load_run_config("configs/demo_cpu.yaml", ["model.lora.rank=4",
                                                  "sharding.pipeline.stages=2"])
    cfg = load_run_config("configs/demo_cpu.yaml", ["model.lora.rank=4",
                                                    "model.lora.targets=q_proj,v_proj"])
    assert cfg.model.lora.targets == ("q_proj", "v_proj")


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_adapted_model_starts_as_its_base_and_equals_the_merged_weights(family):
    base = dataclasses.replace(BASE, family=family)
    cfg = dataclasses.replace(base, lora=LoraConfig(rank=4, alpha=8, use_rslora=True))
    _, base_params = _model(base)
    _, params = _model(cfg)
    np.testing.assert_allclose(_logits(cfg, params), _logits(base, base_params), atol=1e-6)
    # Random B: the adapted model is the base with W + s * A @ B in every projection.
    keys = iter(jax.random.split(jax.random.key(1), 32))
    layers = {k: (jax.random.normal(next(keys), v.shape) * 0.3 if k.endswith("_lora_b") else v)
              for k, v in params["layers"].items()}
    params = {**params, "layers": layers}
    s = cfg.lora.scale
    assert s == 8 / math.sqrt(4)
    merged = dict(base_params["layers"])
    for t in lora.TARGETS:
        a, b = layers[f"{t}_lora_a"], layers[f"{t}_lora_b"]
        delta = jnp.einsum("lir,lro->lio", a.reshape(a.shape[0], -1, a.shape[-1]),
                           b.reshape(b.shape[0], b.shape[1], -1))
        merged[t] = merged[t] + s * delta.reshape(merged[t].shape)
    want = _logits(base, {**base_params, "layers": merged})
    np.testing.assert_allclose(_logits(cfg, params), want, rtol=1e-5, atol=1e-5)


def test_a_train_step_moves_only_the_adapters():
    cfg = dataclasses.replace(BASE, lora=LoraConfig(rank=4))
    graphdef, _ = _model(cfg)
    batch = {"input_ids": IDS[None], "targets": np.roll(IDS, -1, -1)[None],
             "loss_mask": np.ones((1, *IDS.shape), np.float32)}
    _, grads, _ = loss_and_grads(graphdef, _model(cfg)[1], batch)
    assert set(grads) == {"layers"} and all(lora.is_adapter(k) for k in grads["layers"])
    assert len(grads["layers"]) == 2 * len(lora.TARGETS)
    mesh = shd.make_mesh(shd.MeshConfig(), jax.devices()[:1])
    tx = optax.adam(1e-2)
    state = init_state(cfg, tx, state_shardings(cfg, tx, mesh), 0)
    before = jax.device_get(state["params"])
    moments = jax.tree.leaves(state["opt_state"][0].mu)
    assert sum(m.size for m in moments) == sum(v.size for v in jax.tree.leaves(
        lora.trainable(before)))
    step = jax.jit(make_train_step(graphdef, tx))
    losses = []
    for _ in range(10):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] - 0.05
    after = jax.device_get(state["params"])
    for path, frozen in jax.tree_util.tree_leaves_with_path(lora.frozen(before)):
        np.testing.assert_array_equal(frozen, _at(lora.frozen(after), path))
    assert any(not np.array_equal(a, b) for a, b in zip(
        jax.tree.leaves(lora.trainable(before)), jax.tree.leaves(lora.trainable(after))))


def _at(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


def test_a_base_without_adapters_gets_fresh_ones():
    """A Hugging Face base (no adapter keys) given to `init_state` under LoRA: adapters are
    added (B zero), the base kept as given."""
    cfg = dataclasses.replace(BASE, lora=LoraConfig(rank=2, targets=("v_proj",)))
    _, base_params = _model(BASE, seed=3)
    mesh = shd.make_mesh(shd.MeshConfig(), jax.devices()[:1])
    tx = optax.sgd(0.1)
    state = init_state(cfg, tx, state_shardings(cfg, tx, mesh), 0, params=base_params)
    layers = jax.device_get(state["params"]["layers"])
    assert set(layers) == set(base_params["layers"]) | {"v_proj_lora_a", "v_proj_lora_b"}
    np.testing.assert_array_equal(layers["q_proj"], base_params["layers"]["q_proj"])
    assert not layers["v_proj_lora_b"].any() and layers["v_proj_lora_a"].any()
