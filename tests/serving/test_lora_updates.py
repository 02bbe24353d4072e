"""Adapter updates: an engine serving a LoRA model takes exactly its adapters as a weight update
(the base kept), by every path that checks updates: the engine's own (in-process), a stream's
assembly, a pull's offer. Anything else short of every weight is refused, naming what is
missing, and the old weights keep serving."""

import dataclasses

import jax
import pytest
from flax import nnx

from jaxrl.models import ModelConfig, Transformer, lora, merge_params, split_params
from jaxrl.models.generate import greedy_generate
from jaxrl.models.lora import LoraConfig
from serving.core.orchestrator import Orchestrator
from serving.runner.engine import Engine, EngineConfig
from serving.runner.sampling import SamplingParams
from serving.weights.transfer import check_specs
from serving.weights.weight_stream import tensor_names
from sharding.reshard import WeightUpdateError, missing_names

CFG = ModelConfig(vocab_size=48, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, mlp_dim=64, max_seq_len=64,
                  lora=LoraConfig(rank=4, targets=("q_proj", "down_proj")))
PROMPT = [3, 9, 1, 30, 12]


def _with_random_adapters(params, seed):
    keys = iter(jax.random.split(jax.random.key(seed), 16))
    adapters = {k: jax.random.normal(next(keys), v.shape) * 0.5
                for k, v in lora.trainable(params)["layers"].items()}
    return lora.with_trainable(params, {"layers": adapters})


def _greedy(graphdef, params):
    return greedy_generate(merge_params(graphdef, params), [PROMPT], 8, eos_id=-1)[0]


def test_the_engine_takes_the_adapters_alone_and_keeps_its_base():
    graphdef, params = split_params(Transformer(CFG, rngs=nnx.Rngs(0)))
    engine = Engine(CFG, EngineConfig(max_concurrent_decodes=2, max_len=32,
                                      max_prefill_length=16, prefill_chunk=8))
    new = _with_random_adapters(params, 1)
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    with Orchestrator(engine, params) as o:
        before = o.generate(PROMPT, greedy)[0].tokens
        assert engine.adapters_only(lora.trainable(new))
        o.update_params(lora.trainable(new), 1)
        after = o.generate(PROMPT, greedy)[0].tokens
        # Refused, old weights kept: an adapter missing, a base tensor beside the adapters.
        short = {"layers": dict(lora.trainable(new)["layers"])}
        del short["layers"]["down_proj_lora_b"]
        with pytest.raises(WeightUpdateError, match=r"missing \['layers/down_proj_lora_b'\]"):
            o.update_params(short, 2)
        mixed = {"layers": {**lora.trainable(new)["layers"], "q_proj": params["layers"]["q_proj"]}}
        with pytest.raises(WeightUpdateError, match=r"missing \['embed'"):
            o.update_params(mixed, 2)
        assert o.generate(PROMPT, greedy)[0].tokens == after and o.newest_version == 1
    assert before == _greedy(graphdef, params)
    assert after == _greedy(graphdef, new) != before


def test_a_model_without_adapters_refuses_an_adapter_tree():
    plain = dataclasses.replace(CFG, lora=LoraConfig())
    engine = Engine(plain, EngineConfig(max_concurrent_decodes=2, max_len=32,
                                        max_prefill_length=16, prefill_chunk=8))
    _, params = split_params(Transformer(CFG, rngs=nnx.Rngs(0)))
    with pytest.raises(WeightUpdateError, match=r"unexpected \['layers/down_proj_lora_a'"):
        engine.prepare_params(lora.trainable(params))


def test_streams_and_pulls_are_complete_with_every_weight_or_every_adapter():
    _, params = split_params(Transformer(CFG, rngs=nnx.Rngs(0)))
    shapes = tensor_names(params)
    adapters = [n for n in shapes if "_lora_" in n]
    assert len(adapters) == 4
    assert missing_names(shapes, shapes) == [] and missing_names(shapes, adapters) == []
    assert missing_names(shapes, adapters[:3]) == adapters[3:]
    assert "layers/q_proj" in missing_names(shapes, [*adapters, "embed"])
    assert missing_names(shapes, []) == list(shapes)
    check_specs([(n, shapes[n], "float32") for n in adapters], shapes)
    with pytest.raises(WeightUpdateError, match=rf"weight pull is incomplete: no "
                                                rf"{adapters[-1]}$"):
        check_specs([(n, shapes[n], "float32") for n in adapters[:-1]], shapes)


def test_an_engine_holding_several_adapter_sets_decodes_each_row_with_its_own():
    """model.lora.adapters=3: rows of one decode batch (and one prefill) use different adapter
    sets, and each request's tokens, log-probs and prompt scores equal those of an engine
    holding that set alone (independent reference: greedy_generate of the single model); an
    adapter the engine does not hold is refused."""
    import numpy as np

    from serving.core.requests import InvalidRequest

    graphdef, params = split_params(Transformer(CFG, rngs=nnx.Rngs(0)))
    singles = [_with_random_adapters(params, seed) for seed in (1, 2, 3)]
    multi_cfg = dataclasses.replace(CFG, lora=dataclasses.replace(CFG.lora, adapters=3))
    stacked = {k: np.stack([np.asarray(s["layers"][k]) for s in singles], axis=1)
               for k in lora.trainable(params)["layers"]}
    multi = lora.with_trainable(params, {"layers": stacked})
    engine = Engine(multi_cfg, EngineConfig(max_concurrent_decodes=4, max_len=32,
                                            max_prefill_length=16, prefill_chunk=8,
                                            score=True))
    order = [2, 0, 1, 2]
    with Orchestrator(engine, multi) as o:
        streams = [o.submit(PROMPT, SamplingParams(temperature=0.0, max_tokens=8, adapter=a))
                   for a in order]
        got = [s.result()[0] for s in streams]
        scores = [o.score(PROMPT + g.tokens, adapter=a)[0] for a, g in zip(order, got)]
        with pytest.raises(InvalidRequest, match="adapter 3: this engine holds 3"):
            o.submit(PROMPT, SamplingParams(adapter=3))
    for a, sample, score in zip(order, got, scores):
        assert sample.tokens == _greedy(graphdef, singles[a])
        np.testing.assert_allclose(score[len(PROMPT) - 1:], sample.logprobs, atol=1e-5)
    assert got[0].tokens != got[1].tokens          # the sets differ, so their outputs do
