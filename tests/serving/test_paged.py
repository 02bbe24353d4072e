"""The paged engine against references that share none of its machinery: a contiguous KV cache
fed one token at a time, and greedy decoding by full recompute. Under continuous batching with
pages reused many times, staggered arrivals, chunked prefill, groups sharing prompt pages,
in-flight weight updates and a pool too small for the demand (preemption)."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxrl.models.generate import greedy_generate
from serving.core.orchestrator import InvalidRequest, Orchestrator, Sample, TokenEvent
from serving.runner.engine import Engine
from serving.runner.sampling import SamplingParams
from tests.serving.common import CFG, ENGINE, contiguous_decode, prompts, run_staggered


def _requests(seed, lengths=(5, 21, 9, 37, 3, 14, 30, 7, 18, 11, 26, 4), max_tokens=20):
    """Prompts of 3 to 37 tokens (beyond 16 they take several prefill chunks), greedy singles,
    greedy groups and sampled groups."""
    samplings = [SamplingParams(temperature=0.0, max_tokens=max_tokens),
                 SamplingParams(temperature=0.0, max_tokens=max_tokens - 4, n=3),
                 SamplingParams(temperature=1.0, top_k=12, seed=seed, max_tokens=max_tokens, n=2)]
    return [(p, samplings[i % 3]) for i, p in enumerate(prompts(*lengths, seed=seed))]


def _check_against_references(engine, params_by_version, requests, results, model):
    for (prompt, sampling), samples in zip(requests, results):
        assert len(samples) == sampling.n
        for i, s in enumerate(samples):
            assert s.finish_reason == "length" and len(s.tokens) == sampling.max_tokens
            tokens, logprobs = contiguous_decode(engine.graphdef, params_by_version, prompt,
                                                 sampling, i, s.versions)
            assert s.tokens == tokens
            np.testing.assert_allclose(s.logprobs, logprobs, atol=1e-5)
            if sampling.temperature == 0 and set(s.versions) == {0}:
                assert s.tokens == greedy_generate(model, [prompt], sampling.max_tokens, -1)[0]


def test_paged_serving_equals_references(engine, params, model):
    requests = _requests(seed=0) + _requests(seed=1)
    with Orchestrator(engine, params) as o:
        pool = o.scheduler.pool
        results = run_staggered(o, requests)
        assert pool.free == pool.capacity                     # every page came back
        assert pool.handed_out > 3 * pool.capacity            # ... and was used again
        assert o.metrics()["preemptions"] == 0
    _check_against_references(engine, {0: params}, requests, results, model)


def test_weight_update_mid_sequence_under_load(engine, params, model):
    """Sequences running when new weights arrive go on under them, on their pages. (Prompts of
    one prefill chunk: a prompt whose chunks straddle an update is written by both versions,
    which the reference cannot know.)"""
    noisy = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(1), x.shape),
                         params)
    requests = _requests(seed=2, lengths=(5, 9, 3, 14, 7, 11, 4, 16), max_tokens=48)
    with Orchestrator(engine, params) as o:
        events = iter(o.submit(*requests[0]))
        seen = [next(events), next(events)]
        rest = [o.submit(*r) for r in requests[1:]]
        o.update_params(noisy, 1)
        seen += list(events)
        first = Sample(tokens=[e.token for e in seen if isinstance(e, TokenEvent)],
                       logprobs=[e.logprob for e in seen if isinstance(e, TokenEvent)],
                       versions=[e.version for e in seen if isinstance(e, TokenEvent)],
                       finish_reason=seen[-1].reason)
        results = [[first]] + [s.result() for s in rest]
    assert {0, 1} <= set(results[0][0].versions)
    _check_against_references(engine, {0: params, 1: noisy}, requests, results, model)


def test_pool_exhaustion_preempts_and_loses_nothing(params, model):
    # 24 pages of 4 tokens: one 60-token sequence fits, four do not.
    tight = Engine(CFG, dataclasses.replace(ENGINE, num_pages=25, page_buckets=4))
    requests = [(p, SamplingParams(temperature=0.0, max_tokens=44)) for p in
                prompts(9, 16, 5, 12, seed=4)]
    requests.append((prompts(10, seed=5)[0],
                     SamplingParams(temperature=1.0, seed=7, max_tokens=40, n=2)))
    with Orchestrator(tight, params) as o:
        results = run_staggered(o, requests)
        metrics = o.metrics()
        assert metrics["preemptions"] > 0
        assert o.scheduler.pool.free == o.scheduler.pool.capacity
    assert metrics["requests_done"] == len(requests)
    _check_against_references(tight, {0: params}, requests, results, model)


def test_prompt_pages_shared_by_a_group(engine, params):
    """While a group of 4 decodes, its prompt's full pages are held once, not four times."""
    prompt = prompts(30, seed=9)[0]       # 7 full pages of 4 and a partial one
    with Orchestrator(engine, params) as o:
        pool = o.scheduler.pool
        stream = o.submit(prompt, SamplingParams(temperature=1.0, n=4, max_tokens=30, seed=1))
        events = iter(stream)
        next(events)
        held = pool.capacity - pool.free
        for _ in events:
            pass
        # 7 shared pages + 4 own partial pages + at most 8 pages of decode growth per sample
        assert 7 + 4 <= held <= 7 + 4 + 4 * 8
        assert held < 4 * 8
        assert pool.free == pool.capacity


def test_only_busy_slots_are_decoded(params, model):
    """16 slots: the decode batch is the busy slots gathered into 1, 4 or 16 rows. As requests
    of different lengths finish, the busy count passes through every size, and every token
    still equals the references."""
    wide = Engine(CFG, dataclasses.replace(ENGINE, max_concurrent_decodes=16))
    busy = []
    dispatch_steps = wide.dispatch_steps

    def record(params, state, table, steps, slots=None, **masks):
        busy.append(len(slots))
        return dispatch_steps(params, state, table, steps, slots, **masks)

    wide.dispatch_steps = record
    requests = [(p, SamplingParams(temperature=0.0, max_tokens=m)) for p, m in
                zip(prompts(5, 9, 3, 14, 7, 11, 4, 6, 8, 10, seed=6),
                    (4, 8, 12, 16, 20, 24, 28, 32, 40, 52))]
    requests.append((prompts(12, seed=8)[0],
                     SamplingParams(temperature=1.0, seed=3, max_tokens=24, n=3)))
    with Orchestrator(wide, params) as o:
        results = [s.result() for s in [o.submit(*r) for r in requests]]
    assert {1, 4, 16} <= {next(b for b in (1, 4, 16) if b >= n) for n in busy}
    _check_against_references(wide, {0: params}, requests, results, model)


def test_carried_samples_continue_where_they_stopped(engine, params):
    """A request resubmitted with what a previous run had generated (a checkpoint's groups in
    flight) ends with exactly the samples of an uninterrupted run, and the engine generates
    only the missing tokens: finished samples are replayed, cut ones recomputed from their
    prefix and decoded on with the same draws, untouched ones start from the prompt."""
    prompt = prompts(13, seed=11)[0]
    sampling = SamplingParams(temperature=1.0, top_k=12, seed=5, max_tokens=30, n=4)
    with Orchestrator(engine, params) as o:
        whole = o.generate(prompt, sampling)
    cut = [whole[0],                                               # finished
           Sample(whole[1].tokens[:7], whole[1].logprobs[:7], whole[1].versions[:7]),
           Sample(whole[2].tokens[:1], whole[2].logprobs[:1], whole[2].versions[:1]),
           Sample()]                                               # not started
    with Orchestrator(engine, params) as o:
        resumed = o.submit(prompt, sampling, carry=cut).result()
        metrics = o.metrics()
    assert [s.tokens for s in resumed] == [s.tokens for s in whole]
    for r, w in zip(resumed, whole):
        np.testing.assert_allclose(r.logprobs, w.logprobs, atol=1e-5)
        assert r.finish_reason == w.finish_reason
    assert metrics["carried_tokens"] == 30 + 7 + 1
    assert metrics["generated_tokens"] == sum(len(s.tokens) for s in whole) - (30 + 7 + 1)

    # The same from a real snapshot: a run stopped while the group was being generated.
    with Orchestrator(engine, params) as o:
        stream = o.submit(prompt, sampling)
        for _ in stream:
            if sum(len(s.tokens) for s in stream.snapshot()) >= 20:
                o.pause()           # no token after this until the loop stops
                break
    saved = stream.snapshot()
    assert any(s.finish_reason == "shutdown" for s in saved)
    with Orchestrator(engine, params) as o:
        assert [s.tokens for s in o.submit(prompt, sampling, carry=saved).result()] == \
            [s.tokens for s in whole]
        assert o.metrics()["generated_tokens"] == sum(len(s.tokens) for s in whole) - \
            sum(len(s.tokens) for s in saved)


def test_min_tokens_bans_eos_until_then(engine, params):
    """vLLM's min_tokens: EOS cannot be drawn before it (first token and decode steps alike),
    the log-probs stay those of the unbanned distribution, and the sample may end after it."""
    prompt = prompts(9, seed=3)[0]
    with Orchestrator(engine, params, eos_id=None) as o:
        free = o.submit(prompt, SamplingParams(temperature=0.0, max_tokens=12,
                                               stop_at_eos=False)).result()[0]
    eos = free.tokens[0]                 # greedy's first token, made the EOS
    requests = [SamplingParams(temperature=0.0, max_tokens=12),
                SamplingParams(temperature=0.0, max_tokens=12, min_tokens=6),
                SamplingParams(temperature=1.0, seed=5, n=4, max_tokens=12, min_tokens=11)]
    with Orchestrator(engine, params, eos_id=eos) as o:
        stopped, banned, sampled = [o.submit(prompt, s).result() for s in requests]
    assert stopped[0].tokens == [eos] and stopped[0].finish_reason == "eos"
    for sampling, samples in zip(requests[1:], (banned, sampled)):
        for i, s in enumerate(samples):
            assert len(s.tokens) >= sampling.min_tokens
            assert eos not in s.tokens[:sampling.min_tokens]
            assert s.finish_reason == ("eos" if s.tokens[-1] == eos else "length")
            tokens, logprobs = contiguous_decode(engine.graphdef, {0: params}, prompt, sampling,
                                                 i, [0] * len(s.tokens), eos_id=eos)
            assert s.tokens == tokens
            np.testing.assert_allclose(s.logprobs, logprobs, atol=1e-5)
    assert banned[0].tokens[0] != free.tokens[0]      # the ban changed the greedy choice


def test_bad_carry_is_refused(engine, params):
    prompt, sampling = prompts(5, seed=3)[0], SamplingParams(max_tokens=8, n=2)
    with Orchestrator(engine, params) as o:
        for carry, message in [([Sample()], "carry holds 1 samples"),
                               ([Sample([3, 4], [0.0]), Sample()], "2 tokens, 1 log-probs"),
                               ([Sample([3] * 9, [0.0] * 9, [0] * 9), Sample()], "max_tokens=8"),
                               ([Sample([99], [0.0], [0]), Sample()], "token id 99")]:
            with pytest.raises(InvalidRequest, match=message):
                o.submit(prompt, sampling, carry=carry)
        assert o.metrics()["queued"] == 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_pool_writes_are_scatters_in_place(dtype):
    """kv_cache.scatter_set (the paged pool's and the contiguous cache's writes) writes what
    `.at[].set` writes, and a 16-bit pool's write compiles without a float32 copy of the pool (what
    XLA:CPU makes of a bf16 scatter: most of a decode step at 64 slots); page copies (groups) go
    through it too."""
    import jax.numpy as jnp

    from jaxrl.models.kv_cache import scatter_set

    rng = np.random.default_rng(0)
    pool = jnp.asarray(rng.standard_normal((2, 50, 4, 4, 8)), dtype)
    index = (1, jnp.asarray([[3, 7], [9, 11]]), jnp.asarray([[0, 1], [2, 3]]))
    values = jnp.asarray(rng.standard_normal((2, 2, 4, 8)), dtype)
    got = jax.jit(scatter_set)(pool, index, values)
    assert got.dtype == pool.dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(pool.at[index].set(values), np.float32))
    pages = (slice(None), jnp.asarray([4, 5]))
    np.testing.assert_array_equal(
        np.asarray(scatter_set(pool, pages, pool[:, jnp.asarray([1, 2])]), np.float32),
        np.asarray(pool.at[pages].set(pool[:, jnp.asarray([1, 2])]), np.float32))
    widened = "f32[2,50,4,4,8]"
    compiled = jax.jit(scatter_set).lower(pool, index, values).compile().as_text()
    assert widened not in compiled or dtype == "float32"
    if dtype == "bfloat16":      # the check can fail: a plain bf16 scatter is widened here
        plain = jax.jit(lambda p, i, v: p.at[i].set(v)).lower(pool, index, values)
        assert widened in plain.compile().as_text()


def test_an_fp8_kv_cache_holds_a_byte_a_value_and_follows_float32(engine, params):
    """kv_cache_dtype=fp8: the pool is float8 e4m3 (a quarter of float32's bytes) and greedy
    decoding follows the float32 cache's: the same first tokens, log-probs within e4m3's
    rounding (one part in 16 of each key and value)."""
    import jax.numpy as jnp

    fp8 = Engine(CFG, dataclasses.replace(ENGINE, kv_cache_dtype="fp8"))
    assert fp8.init_decode_state().kv.dtype == jnp.float8_e4m3fn
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    results = {}
    for name, e in (("float32", engine), ("fp8", fp8)):
        with Orchestrator(e, params) as o:
            results[name] = [o.submit(p, greedy).result()[0] for p in prompts(5, 21, 9, 37)]
    for want, got in zip(results["float32"], results["fp8"]):
        assert got.tokens[0] == want.tokens[0]
        assert abs(got.logprobs[0] - want.logprobs[0]) < 0.05
    gaps = [abs(a - b) for w, g in zip(results["float32"], results["fp8"])
            for a, b, x, y in zip(w.logprobs, g.logprobs, w.tokens, g.tokens) if x == y]
    assert 0 < max(gaps) < 0.02, gaps      # e4m3 moves them, a little


def test_a_bad_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match=r"kv_cache_dtype='int4' is not one of \('auto', "
                                         r"'fp8'\)"):
        dataclasses.replace(ENGINE, kv_cache_dtype="int4")
