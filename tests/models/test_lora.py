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

from jaxrl.config import load_run_config
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


def test_dropout_drops_the_adapters_input_and_keeps_its_mean():
    """model.lora.dropout as PEFT's inverted dropout on each adapter's input: with A and B the
    identity the adapter's term is the dropped input itself, a share p of it zero and the rest
    x / (1-p); over many keys its mean is the undropped term."""
    r, p = 8, 0.25
    lo = LoraConfig(rank=r, alpha=r, dropout=p)             # scale 1
    x = jax.random.normal(jax.random.key(0), (64, r)) + 3.0   # no feature is zero
    w = {"q_proj": jnp.zeros((r, r)), "q_proj_lora_a": jnp.eye(r), "q_proj_lora_b": jnp.eye(r)}
    keyed = lambda k: {**w, lora.DROPOUT_KEY: jax.random.key_data(k)}  # noqa: E731
    y = lora.project(keyed(jax.random.key(1)), "q_proj", x, "td,de->te", lo)
    dropped = np.asarray(y) == 0
    assert abs(dropped.mean() - p) < 0.06
    np.testing.assert_allclose(np.asarray(y)[~dropped], np.asarray(x / (1 - p))[~dropped],
                               rtol=1e-6)
    # Each target draws its own mask from the layer's key; no key (the engine), no dropout.
    w_k = {**w, "k_proj": w["q_proj"], "k_proj_lora_a": jnp.eye(r), "k_proj_lora_b": jnp.eye(r)}
    y_k = lora.project({**w_k, lora.DROPOUT_KEY: jax.random.key_data(jax.random.key(1))},
                       "k_proj", x, "td,de->te", lo)
    assert not np.array_equal(np.asarray(y_k) == 0, dropped)
    np.testing.assert_allclose(lora.project(w, "q_proj", x, "td,de->te", lo), x, rtol=1e-6)
    ys = jax.vmap(lambda k: lora.project(keyed(k), "q_proj", x, "td,de->te", lo))(
        jax.random.split(jax.random.key(2), 4000))
    stderr = np.abs(np.asarray(x)) * math.sqrt(p / (1 - p) / 4000)
    assert np.all(np.abs(np.asarray(ys.mean(0)) - np.asarray(x)) <= 5 * stderr + 1e-6)


def test_a_train_step_with_dropout_draws_a_mask_per_step_from_the_state():
    """The step's dropout comes from the state's rng and step: the same state gives the same
    step, another step number other masks (another loss), and with dropout 0 the loss is the
    undropped one."""
    batch = {"input_ids": IDS[None], "targets": np.roll(IDS, -1, -1)[None],
             "loss_mask": np.ones((1, *IDS.shape), np.float32)}
    mesh = shd.make_mesh(shd.MeshConfig(), jax.devices()[:1])
    tx = optax.sgd(0.0)
    losses = {}
    for dropout in (0.0, 0.5):
        cfg = dataclasses.replace(BASE, lora=LoraConfig(rank=4, dropout=dropout))
        graphdef, _ = _model(cfg)
        state = init_state(cfg, tx, state_shardings(cfg, tx, mesh), 0)
        # B random, so the adapters' term (and its dropout) shows in the loss.
        state["params"] = lora.with_trainable(state["params"], {"layers": {
            k: v + (k.endswith("_lora_b") * jax.random.normal(jax.random.key(5), v.shape))
            for k, v in lora.trainable(state["params"])["layers"].items()}})
        step = jax.jit(make_train_step(graphdef, tx))
        runs = [float(step(state, batch)[1]["loss"]),
                float(step(state, batch)[1]["loss"]),
                float(step({**state, "step": state["step"] + 1}, batch)[1]["loss"])]
        losses[dropout] = runs
    assert len(set(losses[0.0])) == 1
    same, again, other = losses[0.5]
    assert same == again and other != same and same != losses[0.0][0]
