"""8-bit projections (model.quantize=int8|fp8, jaxrl/models/quant.py): per-channel symmetric
int8 within half a step of the weights, fp8 (e4m3) within its rounding, a quantized model computing
exactly what the float model with the dequantized weights computes (in training and in the engine),
LoRA training on top with the int8 base untouched, and updates that must keep each weight's
dtype."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrl.config import ConfigError, load_run_config
from jaxrl.models import ModelConfig, Transformer, lora, merge_params, param_axes, quant
from jaxrl.models.generate import greedy_generate
from jaxrl.models.lora import LoraConfig
from jaxrl.models.transformer import split_params
from jaxrl.train.state import init_state, state_shardings
from jaxrl.train.step import make_train_step
from serving.core.orchestrator import Orchestrator
from serving.runner.engine import Engine, EngineConfig
from serving.runner.sampling import SamplingParams
from sharding import mesh as shd
from sharding.reshard import WeightUpdateError

FLOAT = ModelConfig(vocab_size=32, embed_dim=16, num_layers=2, num_heads=2, num_kv_heads=1,
                    head_dim=8, mlp_dim=40, max_seq_len=32)
INT8 = dataclasses.replace(FLOAT, quantize="int8")
FP8 = dataclasses.replace(FLOAT, quantize="fp8")
IDS = np.random.default_rng(0).integers(0, 32, (3, 16)).astype(np.int32)


def test_int8_is_within_half_a_step_of_each_channel():
    w = jax.random.normal(jax.random.key(0), (2, 16, 4, 8)) * np.arange(1, 9)   # q_proj-like
    w = w.at[1, :, 3, 5].set(0.0)                                              # a zero channel
    q, scale = quant.quantize(w, "q_proj")
    assert q.dtype == np.int8 and scale.shape == (2, 4, 8)
    np.testing.assert_allclose(scale, np.abs(np.asarray(w)).max(axis=1) / 127 + (
        np.abs(np.asarray(w)).max(axis=1) == 0), rtol=1e-6)
    back = quant.dequantize(q, scale, np.float32, "q_proj")
    assert np.all(np.abs(np.asarray(back - w)) <= np.asarray(scale)[:, None] / 2 + 1e-7)
    assert not np.asarray(back[1, :, 3, 5]).any()
    o = jax.random.normal(jax.random.key(1), (2, 4, 8, 16))                    # o_proj: 2 in
    q, scale = quant.quantize(o, "o_proj")
    assert scale.shape == (2, 16)
    np.testing.assert_allclose(quant.dequantize(q[0], scale[0], np.float32, "o_proj"),
                               quant.dequantize(q, scale, np.float32, "o_proj")[0])


def test_fp8_is_within_e4m3_rounding_of_each_channel():
    w = jax.random.normal(jax.random.key(0), (2, 16, 4, 8)) * np.arange(1, 9)
    q, scale = quant.quantize(w, "q_proj", "fp8")
    assert q.dtype == jnp.float8_e4m3fn and scale.shape == (2, 4, 8)
    np.testing.assert_allclose(scale, np.abs(np.asarray(w)).max(axis=1) / 448, rtol=1e-6)
    back = np.asarray(quant.dequantize(q, scale, np.float32, "q_proj"))
    # e4m3: 3 mantissa bits, a relative error of at most 2^-4 for normal values; the smallest
    # (subnormal) ones within half of their 2^-9 spacing, scaled.
    err = np.abs(back - np.asarray(w))
    assert np.all(err <= np.abs(np.asarray(w)) / 16 + np.asarray(scale)[:, None] * 2.0 ** -10)


@pytest.mark.parametrize("cfg", [INT8, FP8], ids=["int8", "fp8"])
def test_a_quantized_model_computes_what_its_dequantized_float_model_does(cfg):
    held = quant.FORMATS[cfg.quantize][0]
    _, floats = split_params(Transformer(FLOAT, rngs=nnx.Rngs(0)))
    graphdef, params = split_params(Transformer(cfg, rngs=nnx.Rngs(0)))
    assert params["layers"]["q_proj"].dtype == held
    assert param_axes(cfg)["layers"]["q_proj_scale"] == ("layers", "q_heads", "head_dim")
    assert param_axes(cfg)["layers"]["down_proj_scale"] == ("layers", "embed")
    model = merge_params(graphdef, params)
    float_graph, _ = split_params(Transformer(FLOAT, rngs=nnx.Rngs(0)))
    dequantized = merge_params(float_graph, quant.dequantized(params, cfg))
    np.testing.assert_array_equal(np.asarray(model(IDS)), np.asarray(dequantized(IDS)))
    assert quant.quantized(quant.dequantized(params, cfg), cfg)["layers"]["q_proj"].dtype \
        == held
    assert float(np.abs(np.asarray(model(IDS)) - np.asarray(
        merge_params(float_graph, floats)(IDS))).max()) < 0.1      # 8 bits' error, not more
    # The engine serves the 8-bit weights as they are and decodes as the model does.
    engine = Engine(cfg, EngineConfig(max_concurrent_decodes=2, max_len=32,
                                      max_prefill_length=16, prefill_chunk=8))
    assert engine.param_target["layers"]["q_proj"].dtype == held
    prompt = IDS[0, :6].tolist()
    name = np.dtype(held).name
    with Orchestrator(engine, params) as o:
        got = o.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8))[0].tokens
        with pytest.raises(WeightUpdateError, match=r"layers/q_proj has dtype float32; the "
                                                    rf"served model holds it as {name}"):
            o.update_params({**params, "layers": {**params["layers"], "q_proj": np.asarray(
                params["layers"]["q_proj"], np.float32)}}, 1)
    assert got == greedy_generate(model, [prompt], 8, eos_id=-1)[0]
    with pytest.raises(WeightUpdateError, match=rf"layers/q_proj has dtype {name}; a floating "
                                                r"dtype of 16 or 32 bits"):
        Engine(FLOAT, engine.cfg).prepare_params(quant.dequantized(params, cfg) | {
            "layers": {**quant.dequantized(params, cfg)["layers"],
                       "q_proj": params["layers"]["q_proj"]}})


def test_lora_trains_on_an_int8_base_and_leaves_it_as_it_was():
    cfg = dataclasses.replace(INT8, lora=LoraConfig(rank=4))
    graphdef, _ = split_params(Transformer(cfg, rngs=nnx.Rngs(0)))
    _, floats = split_params(Transformer(FLOAT, rngs=nnx.Rngs(0)))
    mesh = shd.make_mesh(shd.MeshConfig(), jax.devices()[:1])
    tx = optax.adam(1e-2)
    state = init_state(cfg, tx, state_shardings(cfg, tx, mesh), 0, params=floats)
    before = jax.device_get(state["params"])
    want = quant.quantized(floats, cfg)["layers"]
    for name in quant.QUANTIZED:           # the full-precision base quantized by init_state
        np.testing.assert_array_equal(before["layers"][name], want[name])
        np.testing.assert_array_equal(before["layers"][name + "_scale"], want[name + "_scale"])
    batch = {"input_ids": IDS[None], "targets": np.roll(IDS, -1, -1)[None],
             "loss_mask": np.ones((1, *IDS.shape), np.float32)}
    step = jax.jit(make_train_step(graphdef, tx))
    losses = []
    for _ in range(10):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] - 0.05
    after = jax.device_get(state["params"])
    for path, frozen in jax.tree_util.tree_leaves_with_path(lora.frozen(before)):
        got = lora.frozen(after)
        for key in path:
            got = got[key.key]
        np.testing.assert_array_equal(got, frozen)
        assert got.dtype == frozen.dtype


def test_int8_without_adapters_is_not_trained():
    with pytest.raises(ConfigError, match=r"model.quantize=int8 holds the projections frozen: "
                                          r"train LoRA adapters"):
        load_run_config("configs/demo_cpu.yaml", ["model.quantize=int8"])
    cfg = load_run_config("configs/demo_cpu.yaml", ["model.quantize=int8", "model.lora.rank=8"])
    assert cfg.model.quantize == "int8"


@pytest.mark.parametrize("cfg,transfer", [(INT8, "grpc"), (FP8, "tcp")], ids=["int8", "fp8"])
def test_a_server_takes_8_bit_weights_over_the_wire(cfg, transfer):
    """The 8-bit projections and their scales cross the gRPC stream (or a tcp pull) as they
    are, and the server decodes as the trainer's quantized model; a float sent for an 8-bit
    weight is refused."""
    from serving.fleet.client import RemoteGeneration
    from serving.frontends.server import Server

    graphdef, params = split_params(Transformer(cfg, rngs=nnx.Rngs(0)))
    _, other = split_params(Transformer(cfg, rngs=nnx.Rngs(1)))
    engine = Engine(cfg, EngineConfig(max_concurrent_decodes=2, max_len=32,
                                      max_prefill_length=16, prefill_chunk=8))
    server = Server(Orchestrator(engine, params).start(), port=0, update_token="t").start()
    remote = RemoteGeneration(server.address, token="t", transfer=transfer)
    prompt = IDS[1, :5].tolist()
    try:
        remote.update_params(other, 1, timeout=60)
        got = remote.submit(prompt, SamplingParams(temperature=0.0, max_tokens=6)).result()
        assert got[0].tokens == greedy_generate(merge_params(graphdef, other), [prompt], 6,
                                                eos_id=-1)[0]
        floats = {**other, "layers": {**other["layers"], "v_proj": np.asarray(
            other["layers"]["v_proj"], np.float32)}}
        held = np.dtype(quant.FORMATS[cfg.quantize][0]).name
        with pytest.raises(WeightUpdateError, match=r"layers/v_proj: dtype 'float32'; the "
                                                    rf"served model holds it as {held}"):
            remote.update_params(floats, 2, timeout=60)
    finally:
        remote.close()
        server.stop(grace=0)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_8_bit_rollouts_serve_the_trainers_float_weights_quantized(kind):
    """rl.generation.weights=int8|fp8: the publisher quantizes each version of the trainer's
    float weights for an engine holding the 8-bit model, which then decodes as the quantized
    model does; the trainer's own weights stay float."""
    from jaxrl.rollout.fleet import Fleet, Member, MemberState
    from jaxrl.rollout.generation import rollout_model, rollout_weights
    from jaxrl.rollout.publisher import WeightPublisher

    cfg = {"int8": INT8, "fp8": FP8}[kind]
    assert rollout_model(FLOAT, kind) == cfg and rollout_model(FLOAT, "model") == FLOAT
    assert rollout_weights(FLOAT, "model") is None
    served = rollout_weights(FLOAT, kind)
    _, start = split_params(Transformer(FLOAT, rngs=nnx.Rngs(0)))
    _, trained = split_params(Transformer(FLOAT, rngs=nnx.Rngs(1)))
    engine = Engine(cfg, EngineConfig(max_concurrent_decodes=2, max_len=32,
                                       max_prefill_length=16, prefill_chunk=8))
    with Orchestrator(engine, served(start)) as local:
        fleet = Fleet([Member("local", local, 2, remote=False, state=MemberState.READY)],
                      eos_id=None, warn=lambda _: None)
        publisher = WeightPublisher(fleet, served=served, warn=lambda _: None)
        publisher.publish(trained, 1)
        want = quant.quantized(trained, cfg)
        for name in quant.QUANTIZED:
            assert local.params["layers"][name].dtype == quant.FORMATS[kind][0]
            assert trained["layers"][name].dtype == np.float32
        for got, expected in zip(jax.tree.leaves(local.params), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
        prompt = IDS[2, :5].tolist()
        got = local.submit(prompt, SamplingParams(temperature=0.0, max_tokens=6)).result()
        graphdef = split_params(Transformer(cfg, rngs=nnx.Rngs(0)))[0]
        assert got[0].tokens == greedy_generate(merge_params(graphdef, want), [prompt], 6,
                                                eos_id=-1)[0]
        publisher.close()
        fleet.close()


@pytest.mark.parametrize("held,weights,says", [
    ("none", "int8", "holds none weights .* needs int8 ones: start it with jaxrl serve "
                     "--quantize int8"),
    ("int8", "model", "holds int8 weights .* start it without --quantize, or set "
                      "rl.generation.weights=int8"),
    ("int8", "int8", None),
    ("none", "model", None),
])
def test_a_server_holding_other_weights_is_refused_up_front(held, weights, says):
    from jaxrl.models.tokenizer import CharTokenizer
    from jaxrl.rollout.generation import check_server

    cfg = load_run_config(None, [f"rl.generation.weights={weights}"])
    tokenizer = CharTokenizer("0123456789+=")
    metrics = {"eos_id": tokenizer.eos_id, "vocab_size": cfg.model.vocab_size, "max_len": 999,
               "max_prefill_length": 999, "slots": 64, "quantize": held}
    if says is None:
        check_server(cfg, tokenizer, "127.0.0.1:9", metrics)
    else:
        with pytest.raises(ConfigError, match=says):
            check_server(cfg, tokenizer, "127.0.0.1:9", metrics)


def test_serve_quantize_holds_the_projections_int8():
    from jaxrl.commands.serve import quantized_model

    model = Transformer(FLOAT, rngs=nnx.Rngs(0))
    held = quantized_model(model)
    assert held.cfg.quantize == "int8"
    params = split_params(held)[1]
    want = quant.quantized(split_params(model)[1], INT8)
    for got, expected in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
