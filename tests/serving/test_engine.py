"""The engine and orchestrator against references that share none of their machinery: greedy
decoding by full recompute, full-forward log-probabilities, one-request-at-a-time runs."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxrl.models.generate import greedy_generate
from serving.core.orchestrator import InvalidRequest, Orchestrator
from serving.runner.engine import Engine, EngineConfig, SlotBatch
from serving.runner.sampling import Draws, SamplingParams, sample
from tests.serving.common import CFG, ENGINE, prompts, run_staggered

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def test_greedy_matches_no_cache_reference(model, orchestrator):
    ps = prompts(5, 21, 9, 37, 3, 12, 7, 18)  # 21 and 37 need several prefill chunks
    streams = [orchestrator.submit(p, GREEDY) for p in ps]
    got = [s.result()[0].tokens for s in streams]
    assert got == greedy_generate(model, ps, 12, eos_id=-1)


def _prefill_by_hand(engine, params, prompt, chunk, sampling, slot=1):
    """Prefills `prompt` in chunks of `chunk` tokens into pool pages 1, 2, ... and inserts it
    into `slot` (`params` as `engine.prepare_params` returns them): (state, logits after the
    prompt, first token, page table of the slot)."""
    pages = list(range(1, engine.cfg.pages_per_sequence + 1))
    state = engine.init_decode_state()
    for start in range(0, len(prompt), chunk):
        piece = prompt[start: start + chunk]
        padded = np.zeros((1, engine.bucket(len(piece))), np.int32)
        padded[0, : len(piece)] = piece
        state, logits = engine.prefill(params, state, padded, [start], [len(piece)],
                                       [pages])
    first, _ = engine.sample_first(logits, [0], [sampling], [0])
    state = engine.insert(state, SlotBatch([slot], [len(prompt)], [int(first[0])], [1],
                                              [sampling], [0]))
    table = np.zeros((engine.max_concurrent_decodes, len(pages)), np.int32)
    table[slot] = pages
    return state, np.asarray(logits[0]), int(first[0]), table


def test_chunked_prefill_equals_unchunked(params):
    prompt = prompts(37)[0]
    results = []
    for chunk in (4, 8, 64):
        e = Engine(CFG, EngineConfig(max_concurrent_decodes=2, max_len=64, page_size=8,
                                     max_prefill_length=40, prefill_chunk=chunk, min_bucket=4))
        greedy = SamplingParams(temperature=0.0)
        placed = e.prepare_params(params)
        state, logits, first, table = _prefill_by_hand(e, placed, prompt, chunk, greedy)
        tokens = [first]
        for _ in range(8):
            state, t, _ = e.generate(placed, state, table)
            tokens.append(int(t[1]))
        k = np.asarray(state.kv[:, 1:6]).reshape(CFG.num_layers, 40, -1)[:, :len(prompt)]
        results.append((logits, k, tokens))
    for logits, k, tokens in results[:2]:
        np.testing.assert_allclose(logits, results[2][0], atol=1e-5)
        np.testing.assert_allclose(k, results[2][1], atol=1e-5)
        assert tokens == results[2][2]


def test_staggered_arrivals_equal_one_at_a_time(orchestrator):
    ps = prompts(6, 30, 11, 4, 17, 9, 25, 13, seed=1)
    samplings = [SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=s, max_tokens=10)
                 for s in range(len(ps))]
    alone = [orchestrator.generate(p, s)[0] for p, s in zip(ps, samplings)]
    together = run_staggered(orchestrator, list(zip(ps, samplings)))
    for a, [b] in zip(alone, together):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_logprobs_are_those_of_the_full_forward(model, orchestrator):
    prompt = prompts(9, seed=2)[0]
    for temperature in (1.0, 0.7):
        s = orchestrator.generate(prompt, SamplingParams(temperature=temperature, seed=3,
                                                         max_tokens=15))[0]
        seq = np.asarray([prompt + s.tokens], np.int32)
        logp = jax.nn.log_softmax(np.asarray(model(seq))[0] / temperature, axis=-1)
        expected = [logp[len(prompt) - 1 + i, t] for i, t in enumerate(s.tokens)]
        np.testing.assert_allclose(s.logprobs, expected, atol=1e-4)


def test_n_samples_share_one_prefill(orchestrator):
    before = orchestrator.metrics()["prefill_chunks"]
    samples = orchestrator.generate(prompts(10, seed=4)[0],
                                    SamplingParams(temperature=1.0, n=4, seed=9, max_tokens=8))
    assert orchestrator.metrics()["prefill_chunks"] - before == 1
    assert len(samples) == 4 and all(len(s.tokens) == 8 for s in samples)
    assert len({tuple(s.tokens) for s in samples}) == 4


def test_stop_rules(engine, model, params):
    prompt = prompts(7, seed=5)[0]
    ref = greedy_generate(model, [prompt], 12, eos_id=-1)[0]
    stop = ref[3]
    first = ref.index(stop)
    with Orchestrator(engine, params, eos_id=stop) as o:
        s = o.generate(prompt, GREEDY)[0]
        assert (s.tokens, s.finish_reason) == (ref[: first + 1], "eos")
        s = o.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, stop_at_eos=False,
                                              stop_token_ids=(ref[1],)))[0]
        assert (s.tokens, s.finish_reason) == (ref[: ref.index(ref[1]) + 1], "stop")
        s = o.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5,
                                              stop_at_eos=False))[0]
        assert (s.tokens, s.finish_reason) == (ref[:5], "length")


@pytest.mark.parametrize("prompt, sampling, message", [
    ([], SamplingParams(), "prompt is empty"),
    ([3] * 41, SamplingParams(), "prompt has 41 tokens; the limit is 40"),
    ([3, 32], SamplingParams(), r"token id 32 is outside the vocabulary \[0, 32\)"),
    ([3, -1], SamplingParams(), r"token id -1 is outside"),
    ([3] * 10, SamplingParams(max_tokens=55), "max_tokens=55 is over the limit: a 10-token "
                                              "prompt leaves room for 54"),
    ([3], SamplingParams(n=5), "n=5 exceeds the 4 slots"),
])
def test_bad_requests_are_refused(orchestrator, prompt, sampling, message):
    with pytest.raises(InvalidRequest, match=message):
        orchestrator.submit(prompt, sampling)


def test_bad_sampling_params():
    for kwargs, message in (({"max_tokens": 0}, "max_tokens=0 must be >= 1"),
                            ({"temperature": -1}, "temperature=-1 must be >= 0"),
                            ({"top_p": 0}, r"top_p=0 must be in \(0, 1\]")):
        with pytest.raises(ValueError, match=message):
            SamplingParams(**kwargs)


def _reference_probs(logits, temperature, top_k, top_p):
    z = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-z)
    keep = np.zeros_like(z, bool)
    keep[order[: top_k or len(z)]] = True
    p = np.where(keep, np.exp(z - z.max()), 0)
    p /= p.sum()
    cum, kept = 0.0, np.zeros_like(keep)
    for i in order:  # the smallest prefix of the sorted distribution reaching top_p
        if not keep[i] or cum >= top_p:
            break
        kept[i] = True
        cum += p[i]
    p = np.where(kept, p, 0)
    return p / p.sum()


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.5, 0, 1.0),
                                                       (1.0, 3, 1.0), (1.0, 0, 0.7),
                                                       (2.0, 4, 0.8)])
def test_sampling_frequencies_match_reference(temperature, top_k, top_p):
    logits = np.array([2.0, 1.5, 1.0, 0.3, 0.0, -1.0], np.float32)
    n = 20000
    keys = jax.random.split(jax.random.key(0), n)
    draws = Draws(np.full(n, temperature, np.float32), np.full(n, top_k, np.int32),
                  np.full(n, top_p, np.float32), keys)
    tokens, _ = jax.jit(sample)(np.tile(logits, (n, 1)), draws)
    freq = np.bincount(np.asarray(tokens), minlength=6) / n
    want = _reference_probs(logits, temperature, top_k, top_p)
    np.testing.assert_allclose(freq, want, atol=0.015)
    assert not freq[want == 0].any()        # a token cut away is never drawn


def test_multi_step_dispatch_equals_single_steps(params):
    engine = Engine(CFG, dataclasses.replace(ENGINE, steps_per_dispatch=6))
    params = engine.prepare_params(params)
    sampling = SamplingParams(temperature=1.0, seed=2)
    state, _, _, table = _prefill_by_hand(engine, params, prompts(9, seed=15)[0], 16, sampling,
                                          slot=0)
    state_b = jax.tree.map(lambda x: x.copy(), state)
    one = []
    for _ in range(6):
        state, t, lp = engine.generate(params, state, table)
        one.append((int(t[0]), float(lp[0])))
    state_b, t, lp = engine.generate_steps(params, state_b, table, 6)
    assert [x for x, _ in one] == np.asarray(t)[:, 0].tolist()
    np.testing.assert_allclose([y for _, y in one], np.asarray(lp)[:, 0], atol=1e-6)


def test_backpressure_refuses_past_the_queue_limit(engine, params):
    from serving.core.orchestrator import QueueFull

    o = Orchestrator(engine, params, max_queued=2)  # not started: nothing leaves the queue
    o.submit([3, 4], GREEDY)
    o.submit([3, 4], GREEDY)
    with pytest.raises(QueueFull, match=r"2 requests are queued \(max_queued=2\)"):
        o.submit([3, 4], GREEDY)


def test_greedy_completions_wait_for_a_full_queue(engine, model, params):
    """Held-out evaluation submits more prompts than the queue takes: it waits for its oldest
    request instead of failing, and refuses nothing it can serve."""
    from jaxrl.eval.evaluate import greedy_completions

    ps = prompts(5, 9, 3, 12, 7, 4, 11, seed=21)
    with Orchestrator(engine, params, max_queued=2) as o:
        got = greedy_completions(o, ps + [[3] * 41], 6)   # the last is over the prompt limit
    assert got == greedy_generate(model, ps, 6, eos_id=-1) + [None]


def test_longest_first_serves_the_same_tokens(engine, model, params):
    ps = prompts(5, 21, 9, 3, seed=22)
    with Orchestrator(engine, params, longest_first=True) as o:
        streams = [o.submit(p, GREEDY) for p in ps]
        got = [s.result()[0].tokens for s in streams]
        o.generate(ps[0], GREEDY)          # predicted from what the first four taught it
    assert got == greedy_generate(model, ps, 12, eos_id=-1)
    assert o.length_predictor.predict(ps[0]) > 0


def test_a_pool_from_device_memory_counts_the_weights_once_and_fills_the_fraction(engine):
    """memory_fraction as vLLM's gpu_memory_utilization: weights + pool + activations within
    that share of the device. The weights count once whether they are placed yet or not; what
    else is in use comes off the pool; one page more would not fit; too little room is refused
    with the figures."""
    cfg = dataclasses.replace(ENGINE, memory_fraction=0.5)
    c = CFG
    page = c.num_layers * cfg.page_size * 2 * c.num_kv_heads * c.head_dim * 4     # float32
    weights = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(engine.param_target))
    limit = 2**24

    def pages(in_use, limit=limit):
        return engine._pages_from_memory(cfg, [{"bytes_limit": limit, "bytes_in_use": in_use}])

    before = pages(0)                                      # weights not placed yet
    assert pages(weights) == before                        # placed: not counted twice
    assert pages(weights + 10 * page) == before - 10       # anything else comes off the pool
    assert pages(0, limit + 2 * 7 * page) == before + 7    # half of 14 more pages' bytes: 7
    logits = 2 * cfg.max_concurrent_decodes * c.vocab_size * 4
    assert weights + before * page + logits <= 0.5 * limit   # activations kept aside
    with pytest.raises(ValueError, match=r"memory_fraction=0.5 leaves room for -?\d+ KV pages "
                                         r"beside the weights .* needs 17"):
        engine._pages_from_memory(cfg, [{"bytes_limit": 2 * weights, "bytes_in_use": 0}])
    with pytest.raises(ValueError, match="the cpu backend reports no device memory; set "
                                         "num_pages instead"):
        Engine(CFG, cfg)
