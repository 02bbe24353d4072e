"""An engine compiles only the sampling features its requests may use
(EngineConfig.sampling_features): without them its programs draw the same tokens with the same
log-probs for what it does serve (compared with an engine that has every feature, the same
seeds), refuses what it does not serve by name, and an RL run's engine holds what that run's
own requests use."""

import dataclasses

import numpy as np
import pytest

from jaxrl.config import load_run_config
from jaxrl.models import ModelConfig
from jaxrl.rollout.generation import engine_config
from serving.core.orchestrator import InvalidRequest, Orchestrator
from serving.runner.engine import Engine, EngineConfig
from serving.runner.sampling import FEATURES, SamplingParams
from tests.serving.common import CFG, ENGINE, prompts


def test_a_lean_engine_draws_what_the_full_one_draws(engine, params):
    lean = Engine(CFG, dataclasses.replace(ENGINE, sampling_features=()))
    requests = [(p, SamplingParams(temperature=t, max_tokens=12, n=3, seed=i))
                for i, (p, t) in enumerate(zip(prompts(5, 9, 14, 3, seed=21),
                                               (1.0, 0.7, 0.0, 1.3)))]
    results = []
    for e in (engine, lean):
        with Orchestrator(e, params) as o:
            results.append([o.generate(*r) for r in requests])
    for full, mine in zip(*results):
        for a, b in zip(full, mine):
            assert a.tokens == b.tokens
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6)


@pytest.mark.parametrize("sampling, feature", [
    (SamplingParams(top_p=0.9), "top_k_top_p"),
    (SamplingParams(top_k=5), "top_k_top_p"),
    (SamplingParams(min_tokens=3), "min_tokens"),
    (SamplingParams(logit_bias=((4, 2.0),)), "logit_bias"),
    (SamplingParams(presence_penalty=0.5), "penalties"),
])
def test_a_lean_engine_refuses_what_it_left_out_by_name(params, sampling, feature):
    lean = Engine(CFG, dataclasses.replace(ENGINE, sampling_features=("min_tokens",)))
    with Orchestrator(lean, params) as o:
        if feature == "min_tokens":        # compiled in: served
            assert len(o.generate([5, 6, 7], sampling)[0].tokens) == sampling.max_tokens
            return
        with pytest.raises(InvalidRequest, match=rf"needs \['{feature}'\].*sampling_features"):
            o.submit([5, 6, 7], sampling)
        assert o.running                 # nothing lost: it serves the next request
        assert len(o.generate([5, 6, 7], SamplingParams(max_tokens=2))[0].tokens) == 2


def test_unknown_features_are_refused():
    with pytest.raises(ValueError, match=r"\['top_z'\] unknown"):
        EngineConfig(sampling_features=("top_z",))


@pytest.mark.parametrize("overrides, features", [
    ([], ()),
    (["rl.completion_length=answer", "rl.filter_overlong=false"], ("min_tokens",)),
    (["rl.agent.command=[python, agent.py]"], FEATURES),
])
def test_an_rl_engine_holds_what_its_run_samples_with(overrides, features):
    cfg = load_run_config(None, overrides)
    model = ModelConfig(vocab_size=64, embed_dim=32, num_layers=1, num_heads=2,
                        num_kv_heads=1, head_dim=16, mlp_dim=64, max_seq_len=256)
    assert engine_config(cfg, model).sampling_features == features
