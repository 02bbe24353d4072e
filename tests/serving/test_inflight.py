"""In-flight weight updates: tokens after the swap follow the new weights on the kept KV cache,
version tags are exact, a bad update is rejected and serving goes on."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.heap import frozen_heap
from jaxrl.models import merge_params
from jaxrl.models.generate import greedy_generate
from jaxrl.models.kv_cache import ContiguousKV
from serving.core.orchestrator import Orchestrator, TokenEvent
from serving.core.requests import StaleVersion
from serving.runner.sampling import SamplingParams
from sharding.reshard import WeightUpdateError
from tests.serving.common import CFG, held_turns, prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=56)
N = GREEDY.max_tokens  # the 8-token prompt plus these fill the 64-position cache


def _swap_after(orchestrator, prompt, new_params, version, after=4):
    """Generates greedily, swapping in `new_params` once `after` tokens have arrived."""
    stream = orchestrator.submit(prompt, GREEDY)
    events = []
    for e in stream:
        events.append(e)
        if len(events) == after:
            result = orchestrator.update_params(new_params, version)
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    return tokens, result


@jax.jit
def _greedy_extend(model, ids_BT, start_B, cache):
    """The dense model's cached forward (jaxrl.models, not serving's engine) and its greedy
    next token, jitted so that the reference below runs at the engine's pace."""
    x, cache = model.extend(ids_BT, start_B, cache)
    return jnp.argmax(model.logits(x)[0, -1]), cache


def _cached_reference(model_a, model_b, prompt, switch, total):
    """Greedy decode with a KV cache: `switch` tokens from A, then B on the same cache."""
    m = len(prompt) + total + 1
    cache = ContiguousKV.zeros(CFG.num_layers, 1, m, CFG.num_kv_heads, CFG.head_dim)
    token, cache = _greedy_extend(model_a, jnp.asarray([prompt]), jnp.asarray([0]), cache)
    out = [int(token)]
    while len(out) < total:
        model = model_a if len(out) < switch else model_b
        token, cache = _greedy_extend(model, jnp.asarray([[out[-1]]]),
                                      jnp.asarray([len(prompt) + len(out) - 1]), cache)
        out.append(int(token))
    return out


def test_update_mid_generation(engine, params, model):
    graphdef = jax.tree.structure(params)
    noisy = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(1), x.shape),
                         params)
    silent = jax.tree.map(lambda x: x, params)
    silent["final_norm"] = jnp.zeros_like(params["final_norm"])  # all logits 0: argmax is 0
    del graphdef
    prompt = prompts(8, seed=7)[0]
    with Orchestrator(engine, params) as o:
        chunks = o.metrics()["prefill_chunks"]
        # 1. a clearly different model: every token after the swap is 0 with logprob -log(V)
        tokens, result = _swap_after(o, prompt, silent, version=1)
        versions = [t.version for t in tokens]
        k = versions.index(1)
        assert 4 <= k < N and versions == [0] * k + [1] * (N - k)
        assert [t.token for t in tokens[:k]] == greedy_generate(model, [prompt], k, -1)[0]
        assert all(t.token == 0 for t in tokens[k:])
        np.testing.assert_allclose([t.logprob for t in tokens[k:]], -np.log(CFG.vocab_size),
                                   rtol=1e-5)
        assert o.metrics()["prefill_chunks"] == chunks + 1  # nothing was prefilled again
        assert result.version == 1      # (the pause's length is a benchmark's: jaxrl bench engine)

        # 2. a nearby model: the tokens after the swap are B's, decoded on A's cache
        o.update_params(params, 2)
        tokens, _ = _swap_after(o, prompt, noisy, version=3)
        versions = [t.version for t in tokens]
        k = versions.index(3)
        graphdef = engine.graphdef
        expected = _cached_reference(merge_params(graphdef, params),
                                     merge_params(graphdef, noisy), prompt, k, N)
        assert [t.token for t in tokens] == expected
        assert versions == [2] * k + [3] * (N - k)
        assert o.metrics()["updates"] == 3


def _bad_updates(params):
    wrong_shape = jax.tree.map(lambda x: x, params)
    wrong_shape["embed"] = params["embed"][:-1]
    missing = {k: v for k, v in params.items() if k != "final_norm"}
    ints = jax.tree.map(lambda x: x, params)
    ints["final_norm"] = params["final_norm"].astype(jnp.int32)
    nan = jax.tree.map(lambda x: x, params)
    nan["layers"] = dict(params["layers"])
    nan["layers"]["up_proj"] = params["layers"]["up_proj"].at[1, 2, 3].set(jnp.nan)
    return [(wrong_shape, r"embed has shape \(31, 32\), the served model needs \(32, 32\)"),
            (missing, r"missing \['final_norm'\]"),
            (ints, "final_norm has dtype int32; a floating dtype of 16 or 32 bits is required"),
            (nan, "layers/up_proj contains NaN or Inf")]


@pytest.mark.parametrize("case", range(4))
def test_bad_update_is_rejected_and_serving_goes_on(engine, params, model, case):
    bad, message = _bad_updates(params)[case]
    prompt = prompts(6, seed=8)[0]
    with Orchestrator(engine, params) as o:
        version = o.version
        with pytest.raises(WeightUpdateError, match=message):
            o.update_params(bad, 99)
        assert o.version == version
        s = o.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6))[0]
        assert s.tokens == greedy_generate(model, [prompt], 6, -1)[0]
        assert set(s.versions) == {version}


def test_versions_never_go_back(engine, params):
    with Orchestrator(engine, params) as o:
        o.update_params(params, 4)
        for stale in (4, 3, 0):
            with pytest.raises(StaleVersion, match=f"version {stale} is not newer than the "
                                                   f"served version 4"):
                o.update_params(params, stale)
        assert o.version == 4 and o.metrics()["updates"] == 1


def test_update_needs_a_running_orchestrator(engine, params):
    o = Orchestrator(engine, params)
    with pytest.raises(RuntimeError, match="not running: call start"):
        o.update_params(params, 5)
    assert o.version == 0 and o.newest_version == 0


def test_pause_holds_the_engine_and_resume_continues_under_new_weights(engine, params, model):
    """Partial rollouts: a paused engine dispatches nothing (no token, no prefill) while it takes
    a weight update and a new request; after resume the sequence continues on its kept cache
    under the new weights, token for token as a cached decode that switches weights there."""
    noisy = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(2), x.shape),
                         params)
    prompt = prompts(8, seed=9)[0]
    with Orchestrator(engine, params) as o:
        stream = o.submit(prompt, GREEDY)
        events = iter(stream)
        head = [next(events) for _ in range(4)]
        o.pause()
        held = o.metrics()
        o.update_params(noisy, 1)
        late = o.submit(prompts(5, seed=10)[0], SamplingParams(temperature=0.0, max_tokens=3))
        held_turns(o)
        during = o.metrics()
        assert (during["generated_tokens"], during["prefill_chunks"]) == \
            (held["generated_tokens"], held["prefill_chunks"])
        assert during["version"] == 1
        o.resume()
        tokens = [e for e in head + list(events) if isinstance(e, TokenEvent)]
        assert len(late.result()[0].tokens) == 3
    versions = [t.version for t in tokens]
    k = versions.index(1)
    assert k >= 4 and versions == [0] * k + [1] * (N - k)
    graphdef = engine.graphdef
    assert [t.token for t in tokens] == _cached_reference(
        merge_params(graphdef, params), merge_params(graphdef, noisy), prompt, k, N)


def test_weights_an_update_replaces_are_freed_in_a_frozen_heap(engine, params):
    """`jaxrl serve` serves inside `frozen_heap()` (jaxrl/heap.py), which keeps the weights it
    started with out of the collector's passes: they must still go when an update replaces
    them (reference counting), or every server would hold a second copy of the model."""
    first = jax.tree.map(lambda x: x + 1, params)        # arrays only the server will hold
    with Orchestrator(engine, first) as o:
        del first
        with frozen_heap():
            served = len(jax.live_arrays())
            for version in (1, 2):
                o.update_params(jax.tree.map(lambda x: x + version, params), version)
                assert len(jax.live_arrays()) == served
