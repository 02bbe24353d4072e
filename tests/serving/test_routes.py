"""Router parity for a mixture-of-experts model: the engine records the experts it routed every
fed token to (prefill chunks, decode steps, a preempted sample's recompute), and the trainer's
forward (`Transformer.hidden_aux`, an independent path: the whole sequence at once, no pages)
compares them with its own routers' or replays them.

With routers whose experts nearly tie, the two paths' float32 rounding picks different experts
for some tokens, and the log-probs differ; replaying the engine's experts makes them equal."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.models import ModelConfig, Transformer, split_params
from jaxrl.train.objectives import chunked_token_stats
from serving.core.orchestrator import Orchestrator
from serving.fleet.client import RemoteGeneration
from serving.frontends.server import Server
from serving.runner.engine import Engine
from serving.runner.sampling import SamplingParams
from tests.serving.common import ENGINE, prompts

MOE = ModelConfig(family="qwen3_moe", vocab_size=32, embed_dim=32, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, qk_norm=True, num_experts=4, experts_per_token=2,
                  moe_mlp_dim=16)
ROUTED = dataclasses.replace(ENGINE, record_routes=True)


def _tied_routers(model, spread: float):
    """The model with every layer's router columns equal up to `spread` (relative): which
    experts win is decided by rounding."""
    graphdef, params = split_params(model)
    router = np.asarray(params["layers"]["router"])              # [L, D, E]
    base = router[..., :1]
    rng = np.random.default_rng(1)
    tied = base * (1 + spread * rng.standard_normal(router.shape))
    params["layers"]["router"] = jnp.asarray(tied, router.dtype)
    return nnx.merge(graphdef, params), params


def _trainer_logp(model, sample, prompt, replay: bool):
    """The trainer's log-prob of each sampled token given the engine's routing, and whether
    each fed token's experts differ from the engine's in any layer."""
    ids = jnp.asarray([prompt + sample.tokens[:-1]])
    x, aux = model.hidden_aux(ids, engine_experts_BTLK=jnp.asarray(sample.routes)[None],
                              replay=replay)
    logp, _, _ = chunked_token_stats(x, model.head(), jnp.asarray([prompt[1:] + sample.tokens]))
    return np.asarray(logp[0, len(prompt) - 1:]), np.asarray(aux["mismatch"][:, 0].any(0))


@pytest.fixture(scope="module")
def engine():
    return Engine(MOE, ROUTED)


def test_recorded_routing_is_the_trainer_s_own(engine):
    model = Transformer(MOE, rngs=nnx.Rngs(0))
    prompt = prompts(21, seed=3)[0]         # two prefill chunks of 16
    with Orchestrator(engine, split_params(model)[1]) as o:
        samples = o.generate(prompt, SamplingParams(temperature=1.0, max_tokens=30, n=3,
                                                    seed=4, stop_at_eos=False))
    for s in samples:
        fed = len(prompt) + len(s.tokens) - 1
        assert s.routes.shape == (fed, MOE.num_layers, MOE.experts_per_token)
        logp, mismatch = _trainer_logp(model, s, prompt, replay=False)
        assert not mismatch.any()
        np.testing.assert_allclose(logp, s.logprobs, atol=2e-5)


def test_replay_makes_the_trainer_s_log_probs_the_engine_s(engine):
    model, params = _tied_routers(Transformer(MOE, rngs=nnx.Rngs(0)), spread=1e-7)
    with Orchestrator(engine, params) as o:
        streams = [o.submit(p, SamplingParams(temperature=1.0, max_tokens=30, n=2, seed=i,
                                              stop_at_eos=False))
                   for i, p in enumerate(prompts(9, 14, 21, seed=5))]
        results = [(p, s.result()) for p, s in zip(prompts(9, 14, 21, seed=5), streams)]
    own_gap, replay_gap, mismatched = 0.0, 0.0, 0
    for prompt, samples in results:
        for s in samples:
            own, mismatch = _trainer_logp(model, s, prompt, replay=False)
            replayed, _ = _trainer_logp(model, s, prompt, replay=True)
            mismatched += int(mismatch.sum())
            own_gap = max(own_gap, float(np.abs(own - s.logprobs).max()))
            replay_gap = max(replay_gap, float(np.abs(replayed - s.logprobs).max()))
    print(f"{mismatched} tokens routed differently; largest log-prob gap {own_gap:.3g} on the "
          f"trainer's own routing, {replay_gap:.3g} replaying the engine's")
    assert mismatched > 0 and own_gap > 2e-4      # the premise: rounding picks other experts
    assert replay_gap < 2e-5


def test_a_preempted_sample_keeps_the_routing_it_was_generated_with():
    """A pool too small for four long samples: some are preempted and recomputed; every
    sample's routing still covers each fed token once and matches the trainer's own."""
    model = Transformer(MOE, rngs=nnx.Rngs(0))
    tight = Engine(MOE, dataclasses.replace(ROUTED, num_pages=25, page_buckets=4))
    with Orchestrator(tight, split_params(model)[1]) as o:
        streams = [(p, o.submit(p, SamplingParams(temperature=0.0, max_tokens=44,
                                                  stop_at_eos=False)))
                   for p in prompts(9, 16, 5, 12, seed=4)]
        results = [(p, s.result()[0]) for p, s in streams]
        assert o.metrics()["preemptions"] > 0
    for prompt, s in results:
        assert len(s.routes) == len(prompt) + len(s.tokens) - 1
        assert not _trainer_logp(model, s, prompt, replay=False)[1].any()


def test_routing_travels_over_grpc(engine):
    """`jaxrl serve --record-routes`'s path: the same samples and routing as in process."""
    params = split_params(Transformer(MOE, rngs=nnx.Rngs(0)))[1]
    server = Server(Orchestrator(engine, params).start(), port=0).start()
    remote = RemoteGeneration(server.address)
    try:
        prompt = prompts(13, seed=8)[0]
        sampling = SamplingParams(temperature=1.0, max_tokens=12, n=2, seed=9,
                                  stop_at_eos=False)
        got = remote.submit(prompt, sampling).result()
        want = server.orchestrator.generate(prompt, sampling)
    finally:
        remote.close()
        server.stop(0)
    for g, w in zip(got, want):
        assert g.tokens == w.tokens
        np.testing.assert_array_equal(g.routes, w.routes)
        assert g.routes.dtype == np.int32


def test_record_routes_needs_experts():
    dense = dataclasses.replace(MOE, family="qwen3", num_experts=0)
    with pytest.raises(ValueError, match="record_routes needs a mixture-of-experts model"):
        Engine(dense, ROUTED)
