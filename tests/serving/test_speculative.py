"""Speculative decoding against references that share none of its machinery: the model's own
sequence probabilities by full forwards (a chi-square test over thousands of samples), greedy
decoding by full recompute, and drafts checked against the texts they come from."""

import collections
import dataclasses
import itertools
import threading

import jax
import numpy as np
import openai
import pytest
from flax import nnx
from scipy import stats

from jaxrl.models import ModelConfig, Transformer, lora, merge_params, split_params
from jaxrl.models.lora import LoraConfig
from jaxrl.models.generate import greedy_generate
from serving.core.drafts import DRAFTERS, NgramDrafter, SuffixDrafter, SuffixIndex
from serving.core.orchestrator import Orchestrator
from serving.core.sequence import Request, Sequence
from serving.core.speculation import Speculator
from serving.core.stream import RequestStream, TokenEvent
from serving.fleet.client import RemoteGeneration
from serving.frontends.openai_api import OpenAIApp, start_http
from serving.frontends.prometheus import exposition
from serving.frontends.server import Server
from serving.runner.engine import Engine
from serving.runner.engine_config import SPECULATIVE
from serving.runner.sampling import SamplingParams
from tests.serving.common import CFG, ENGINE, prompts
from tests.serving.test_openai_api import tokenizer  # noqa: F401 (a fixture)

K = 4
SPEC = dataclasses.replace(ENGINE, speculative="suffix", speculative_tokens=K)


def _seq(prompt, tokens=(), index=0):
    seq = Sequence(Request(list(prompt), SamplingParams(max_tokens=64), RequestStream(0, 1)),
                   index)
    seq.tokens = list(tokens)
    return seq


# -- drafts ----------------------------------------------------------------------------------------
def test_a_suffix_index_proposes_what_most_often_followed_the_longest_match():
    index = SuffixIndex(depth=4)
    for text in ([1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [9, 3, 4, 7, 8]):
        index.add_text(text)
    assert index.propose([0, 2, 3, 4], 3) == [5]      # "2 3 4" -> 5 (the longest match wins)
    assert index.propose([0, 9, 3, 4], 3) == [7, 8]   # "9 3 4" -> 7 8, then nothing follows
    assert index.propose([3, 4], 3) == [5]            # "3 4": 5 twice, 7 once
    assert index.propose([6], 3) == []                # never seen
    assert index.propose([0, 3, 4], 3, min_match=3) == []


def test_the_suffix_drafter_drafts_from_siblings_and_earlier_rollouts_within_its_bound():
    drafter = SuffixDrafter(depth=6, max_entries=200)
    prompt = [7, 7, 1]
    sibling, tail = _seq(prompt, index=0), _seq(prompt, index=1)
    for token in [2, 3, 4, 5, 6, 8]:                  # a sibling writes its answer
        sibling.tokens.append(token)
        drafter.observe(sibling, token)
    tail.tokens = [2, 3]
    assert drafter.draft(tail, 3) == [4, 5, 6]
    # the same prompt in a later step: its earlier rollouts still draft
    drafter.finished(sibling)
    drafter.finished(tail)
    assert not drafter._live                          # none running
    later = _seq(prompt, [9, 2, 3], index=0)
    assert drafter.draft(later, 2) == [4, 5]          # indexed now, as it is drafted from
    assert not drafter._ended
    # finished and never drafted from: kept unindexed up to max_entries / depth tokens
    for p in range(40):
        other = _seq([p + 100] * 3)
        for t in range(10):
            other.tokens.append(t)
            drafter.observe(other, t)
        drafter.finished(other)
    assert drafter._ended_tokens <= 200 // 6 and len(drafter._ended) == 3
    # other prompts drafted from fill the bound: the least recently drafted is forgotten
    for p in range(37, 40):
        drafter.draft(_seq([p + 100] * 3, [0]), 2)
    for p in range(40, 60):
        drafter.draft(_seq([p + 100] * 9, [0]), 2)
    assert drafter.entries <= 200 and tuple(prompt) not in drafter.indexes
    assert drafter.draft(later, 2) == []


def test_the_ngram_drafter_looks_the_sequence_up_in_itself():
    seq = _seq([5, 1, 2, 3, 9, 9], [1, 2])
    assert NgramDrafter().draft(seq, 3) == [3, 9, 9]
    assert NgramDrafter().draft(_seq([1, 2, 3], [4]), 3) == []


def test_the_engine_and_the_drafters_name_the_same_kinds():
    assert set(SPECULATIVE) == {"off", *DRAFTERS}


def test_the_load_rule_picks_the_fewer_seconds_per_token_and_probes_the_other_way():
    spec = Speculator(NgramDrafter(), 4, costs={4: (0.010, 0.012), 32: (0.010, 0.040)})
    assert spec.wanted(4) == 4 and spec.wanted(32) == 0    # prior: 3 tokens a row
    assert spec.estimate(4) == pytest.approx({0: 0.010 / 4, 4: 0.012 / (4 * 3)})  # a token's
    assert spec.estimate(2) == pytest.approx({0: 0.010 / 2, 4: 0.012 / (2 * 3)})  # 4 rows'
    for _ in range(100):
        spec.stepped(4, [1, 1])                            # nothing accepted
    assert spec.tokens_per_row[4] == pytest.approx(1.0, abs=0.02)
    picks = [spec.wanted(4) for _ in range(8 + 20 + 40 + 3)]
    # probes of two dispatches, further and further apart: doubling, and at least as far as
    # keeps a way 1.2x slower to 2% of the time (2 x 0.2 / 0.02 = 20 dispatches)
    assert [i for i, p in enumerate(picks) if p] == [7, 8, 28, 29, 69, 70]
    # measured while serving: what the dispatches took wins over the start-up costs
    for _ in range(50):
        spec.timed(0, 4, 0.010, 4)                         # 2.5 ms a token
        spec.timed(4, 4, 0.012, 4)                         # 3 ms a sequence ...
        spec.stepped(4, [3, 3, 3, 3])                      # ... keeping 3 tokens: 1 ms each
    assert spec.estimate(4) == pytest.approx({0: 0.0025, 4: 0.001})
    assert spec.wanted(4) == 4 and spec.wanted(32) == 0
    # the median of the last dispatches: an outlier (a page fault, a busy core) moves nothing
    spec.timed(0, 8, 0.100, 8)
    for _ in range(2):
        spec.timed(0, 8, 0.010, 8)
    assert spec.measured[(0, 8)] == pytest.approx(0.010 / 8)
    assert not Speculator(NgramDrafter(), 4).wanted(4)     # nothing measured: no
    assert Speculator(NgramDrafter(), 4, always=True).wanted(32) == 4


def test_the_thinner_the_batch_the_longer_the_drafts():
    """FastGRPO's concurrency-aware rule from the engine's own costs: drafts of 4 at 4 rows,
    of 2 at 32 (a wider verify step costs more there than it saves), none at 128; probes try
    the other ways in turn, further apart the slower the way probed."""
    spec = Speculator(NgramDrafter(), 4, lengths=(2, 4), costs={
        4: {0: 0.010, 2: 0.011, 4: 0.012}, 32: {0: 0.010, 2: 0.015, 4: 0.040},
        128: {0: 0.010, 2: 0.030, 4: 0.080}})
    assert [spec.wanted(r) for r in (4, 32, 128)] == [4, 2, 0]
    picks = [spec.wanted(4) for _ in range(8 + 150 + 3)]
    # decoding 2.5x slower a token: the next probe waits until 2 x 1.5 / 0.02 = 150 have run
    assert [(i, p) for i, p in enumerate(picks) if p != 4] == [(6, 0), (7, 0), (157, 2),
                                                               (158, 2)]


# -- the engine --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def spec_engine():
    return Engine(CFG, SPEC)


class Planted:
    """Drafts that are right or wrong on purpose: a greedy reference's continuation for even
    samples, fixed tokens (mostly rejected) for odd ones."""

    def __init__(self, continuation=None):
        self.continuation = continuation or {}

    def draft(self, seq, k):
        if seq.index % 2:
            return [(len(seq.tokens) + i) % 5 for i in range(k)]
        done = len(seq.tokens)
        return self.continuation.get(tuple(seq.request.prompt), [])[done:done + k]

    def observe(self, seq, token):
        pass

    def finished(self, seq):
        pass


@pytest.mark.parametrize("drafter", ["suffix", "ngram", "planted"])
def test_greedy_speculation_is_token_identical_and_gives_back_every_page(model, params,
                                                                        spec_engine, drafter):
    ps = prompts(5, 21, 9, 37, 3, 12, 7, 18)
    want = greedy_generate(model, ps, 20, eos_id=-1)
    made = Planted({tuple(p): w for p, w in zip(ps, want)}) if drafter == "planted" else \
        DRAFTERS[drafter]()
    greedy = SamplingParams(temperature=0.0, max_tokens=20, n=2)
    with Orchestrator(spec_engine, params, speculator=Speculator(made, K, always=True)) as o:
        got = [s.result() for s in [o.submit(p, greedy) for p in ps]]
        metrics = o.metrics()
        assert o.scheduler.pool.free == o.scheduler.pool.capacity    # no page kept
    assert [[s.tokens for s in group] for group in got] == [[w, w] for w in want]
    assert 0 < metrics["spec_decode_verify_steps"] <= metrics["steps"]   # no draft: decode
    if drafter == "planted":       # even samples' drafts are the answer: all accepted
        assert metrics["spec_decode_num_accepted_tokens"] >= 8 * 12
        assert metrics["spec_decode_mean_acceptance_length"] > 1.5
    assert "jaxrl_spec_decode_num_drafts_total" in exposition(metrics)


def test_speculative_log_probs_are_the_model_s_own(model, params, spec_engine):
    """Every kept token reports the log-prob the engine without speculation reports: the
    model's under temperature (the trainer's behaviour log-probs), within float32 rounding."""
    ps = prompts(9, 21)
    sampling = SamplingParams(temperature=0.8, max_tokens=16, seed=3)
    with Orchestrator(spec_engine, params,
                      speculator=Speculator(SuffixDrafter(min_match=1), K, always=True)) as o:
        got = [s.result()[0] for s in [o.submit(p, sampling) for p in ps]]
    for p, sample in zip(ps, got):
        logits = np.asarray(model(np.asarray([p + sample.tokens]))[0], np.float64)
        logp = jax.nn.log_softmax(logits[len(p) - 1:-1] / 0.8, axis=-1)
        want = np.take_along_axis(np.asarray(logp), np.asarray(sample.tokens)[:, None], 1)
        np.testing.assert_allclose(sample.logprobs, want[:, 0], atol=1e-5)


class HoldAt(SuffixDrafter):
    """Drafts as SuffixDrafter, and asks the engine loop to hold (it does from its next
    dispatch) when a sequence reaches `at` tokens: a weight update lands there, whatever the
    machine's speed."""

    def __init__(self, at: int):
        super().__init__(min_match=1)
        self.at, self.loop, self.reached = at, None, threading.Event()

    def draft(self, seq, k):
        if len(seq.tokens) >= self.at and not self.reached.is_set():
            self.loop.hold()
            self.reached.set()
        return super().draft(seq, k)


def test_a_weight_update_mid_speculation_serves_the_new_weights_from_the_next_step(
        model, params, spec_engine):
    """In flight: the tokens before the swap are the old model's greedy ones, every token
    after it the new model's (here all logits 0: token 0, log-prob -log V), the versions
    never go back, and nothing is prefilled again."""
    silent = jax.tree.map(lambda x: x, params)
    silent["final_norm"] = jax.numpy.zeros_like(params["final_norm"])
    prompt, n = prompts(8, seed=7)[0], 24
    greedy = SamplingParams(temperature=0.0, max_tokens=n)
    drafter = HoldAt(4)
    with Orchestrator(spec_engine, params, speculator=Speculator(drafter, K, always=True)) as o:
        drafter.loop = o._loop
        chunks = o.metrics()["prefill_chunks"]
        stream = o.submit(prompt, greedy)
        assert drafter.reached.wait(60)
        o.pause()                                # held by the drafter's ask: returns at once
        o.update_params(silent, 1)
        o.resume()
        events = list(stream)
        assert o.metrics()["prefill_chunks"] == chunks + 1
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    versions = [t.version for t in tokens]
    k = versions.index(1)
    assert 4 <= k < n and versions == [0] * k + [1] * (n - k)
    assert [t.token for t in tokens[:k]] == greedy_generate(model, [prompt], k, -1)[0]
    assert all(t.token == 0 for t in tokens[k:])
    np.testing.assert_allclose([t.logprob for t in tokens[k:]], -np.log(CFG.vocab_size),
                               rtol=1e-5)


def test_each_sample_says_what_speculation_did_for_it_in_process_over_grpc_and_openai(
        model, params, spec_engine, tokenizer):
    """Per sample: the verify steps it took part in, its draft tokens and the accepted ones,
    the engine's totals summed over samples; the same counts come back over gRPC (fleet
    client) and as OpenAI's prediction tokens in a completion's usage (the `openai` package).
    Planted drafts: sample 0's are its greedy continuation (every token accepted), sample 1's
    fixed tokens (mostly rejected)."""
    prompt, n = prompts(11, seed=5)[0], 16
    made = Planted({tuple(prompt): greedy_generate(model, [prompt], n, eos_id=-1)[0]})
    greedy = SamplingParams(temperature=0.0, max_tokens=n, n=2)
    o = Orchestrator(spec_engine, params, speculator=Speculator(made, K, always=True)).start()
    server = Server(o, port=0).start()
    http, port = start_http(OpenAIApp(o, tokenizer, "tiny", SPEC.max_len).app, "127.0.0.1", 0)
    try:
        before = o.metrics()
        local = o.submit(prompt, greedy).result()
        after = o.metrics()
        remote = RemoteGeneration(server.address)
        try:
            over_grpc = remote.submit(prompt, greedy).result()
        finally:
            remote.close()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               max_retries=0, timeout=60)
        usage = client.completions.create(model="tiny", prompt=prompt, max_tokens=n, n=2,
                                          temperature=0).usage
    finally:
        http.should_exit = True
        server.stop(0)
    spec = [s.speculation for s in local]
    assert spec[0].verify_steps > 0 and spec[0].rejected_tokens == 0
    assert spec[0].accepted_tokens == spec[0].draft_tokens >= n // 2
    assert spec[1].rejected_tokens > 0
    for counter, field in [("spec_decode_num_drafts", "verify_steps"),
                           ("spec_decode_num_draft_tokens", "draft_tokens"),
                           ("spec_decode_num_accepted_tokens", "accepted_tokens")]:
        assert after[counter] - before[counter] == sum(getattr(x, field) for x in spec)
    assert [s.speculation for s in over_grpc] == spec
    assert [s.tokens for s in over_grpc] == [s.tokens for s in local]
    details = usage.completion_tokens_details
    assert details.accepted_prediction_tokens == sum(x.accepted_tokens for x in spec)
    assert details.rejected_prediction_tokens == sum(x.rejected_tokens for x in spec)


LORA = dataclasses.replace(CFG, lora=LoraConfig(rank=4, targets=("q_proj", "down_proj")))


def _variant(name, model, params):
    """(model config, engine config, weights, what each turn submits) of an engine variant."""
    cfg, engine, weights = CFG, ENGINE, params
    if name == "fp8-kv":
        engine = dataclasses.replace(ENGINE, kv_cache_dtype="fp8")
    if name == "lora":
        cfg, weights = LORA, split_params(Transformer(LORA, rngs=nnx.Rngs(0)))[1]
        keys = iter(jax.random.split(jax.random.key(1), 16))
        weights = lora.with_trainable(weights, {"layers": {
            k: jax.random.normal(next(keys), v.shape) * 0.5
            for k, v in lora.trainable(weights)["layers"].items()}})
    return cfg, engine, weights


@pytest.mark.parametrize("name", ["fp8-kv", "lora", "sessions", "stop tokens"])
def test_greedy_speculation_is_token_identical_on_every_engine_variant(model, params, name):
    """Against the same engine without speculation: an fp8 KV cache, LoRA adapters held apart
    from the base, a multi-turn session (its second turn continues from the pages the first
    kept after its verify steps trimmed them), stop tokens inside an accepted draft. The
    drafts are the plain engine's own continuations (most accepted) for even samples, wrong
    for odd ones."""
    cfg, engine_cfg, weights = _variant(name, model, params)
    prompt, n = prompts(9, seed=13)[0], 18
    free = SamplingParams(temperature=0.0, max_tokens=n, n=2)
    with Orchestrator(Engine(cfg, engine_cfg), weights) as o:
        long = o.submit(prompt, free).result()[0].tokens
        stops = (long[n // 2],) if name == "stop tokens" else ()
        greedy = dataclasses.replace(free, stop_token_ids=stops)
        keys = ["s0", "s1"] if name == "sessions" else None
        runs = [_turns(o, prompt, greedy, keys)]
    planted = Planted({tuple(prompt): long})
    if keys:        # the second turn's drafts: its own plain continuation
        history = prompt + runs[0][0][0] + [5, 6]
        planted.continuation[tuple(history)] = runs[0][1][0]
    spec_cfg = dataclasses.replace(engine_cfg, speculative="suffix", speculative_tokens=K)
    with Orchestrator(Engine(cfg, spec_cfg), weights,
                      speculator=Speculator(planted, K, always=True)) as o:
        runs.append(_turns(o, prompt, greedy, keys))
        assert o.metrics()["spec_decode_num_accepted_tokens"] > 0
        if keys:
            o.end_session("s0")
            o.end_session("s1")
            o.generate(prompt, SamplingParams(max_tokens=1))    # the loop drops them
        assert o.scheduler.pool.free == o.scheduler.pool.capacity   # nothing kept or leaked
    assert runs[1] == runs[0]
    if keys:                # the second turn prefilled the answer's last token and [5, 6]
        assert runs[0][2] == 3
    if stops:
        assert all(tokens[-1] == stops[0] and len(tokens) <= n // 2 + 1 for tokens in runs[0][0])


def _turns(o, prompt, sampling, keys):
    """Each turn's samples' tokens, and the prompt tokens the second turn prefilled: one turn,
    or (keys: a group opening a session per sample) a second turn of sample 0's session."""
    first = [s.tokens for s in o.submit(prompt, sampling, session=keys).result()]
    if not keys:
        return [first]
    before = o.metrics()["prefill_tokens"]
    history = prompt + first[0] + [5, 6]
    one = dataclasses.replace(sampling, n=1)
    second = [s.tokens for s in o.submit(history, one, session=keys[0]).result()]
    return [first, second, o.metrics()["prefill_tokens"] - before]


def test_same_seeds_same_tokens(params, spec_engine):
    sampling = SamplingParams(temperature=1.0, max_tokens=12, seed=11, n=3)
    runs = []
    for _ in range(2):
        with Orchestrator(spec_engine, params,
                          speculator=Speculator(Planted(), K, always=True)) as o:
            runs.append([[s.tokens for s in o.submit(p, sampling).result()]
                         for p in prompts(7, 12)])
    assert runs[0] == runs[1]


# -- the sampled distribution --------------------------------------------------------------------
SMALL = ModelConfig(vocab_size=8, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=8, mlp_dim=64)
PROMPT = [3, 1, 4, 1, 5]
LENGTH = 4            # tokens a sample writes: the first by the prefill, then verify steps


@pytest.fixture(scope="module")
def sharp():
    """A model over 8 tokens whose distributions are far from uniform (its head scaled)."""
    model = Transformer(SMALL, rngs=nnx.Rngs(1))
    graphdef, params = split_params(model)
    params = {**params, "lm_head": params["lm_head"] * 6}
    return merge_params(graphdef, params), params


def test_greedy_speculation_follows_every_sampling_setting(sharp):
    """Penalties counted over the draft's tokens before each position, logit bias, min_tokens'
    ban at each position's count: greedy decoding with all of them is token for token the
    engine's without speculation, whether the drafts are right (the plain run's own tokens,
    all accepted) or wrong."""
    model, params = sharp
    sampling = SamplingParams(temperature=0.0, max_tokens=14, n=2, frequency_penalty=2.0,
                              presence_penalty=0.5, logit_bias=((3, 1.5),), min_tokens=8)
    plain = Engine(SMALL, dataclasses.replace(ENGINE, max_concurrent_decodes=8))
    with Orchestrator(plain, params, eos_id=7) as o:
        want = [[(x.tokens, x.logprobs) for x in o.submit(p, sampling).result()]
                for p in (PROMPT, PROMPT[:3])]
    engine = Engine(SMALL, dataclasses.replace(SPEC, max_concurrent_decodes=8))
    drafts = Planted({tuple(PROMPT): want[0][0][0], tuple(PROMPT[:3]): want[1][0][0]})
    with Orchestrator(engine, params, eos_id=7,
                      speculator=Speculator(drafts, K, always=True)) as o:
        got = [[(x.tokens, x.logprobs) for x in o.submit(p, sampling).result()]
               for p in (PROMPT, PROMPT[:3])]
        assert o.metrics()["spec_decode_num_accepted_tokens"] >= 2 * 8
    assert [[t for t, _ in g] for g in got] == [[t for t, _ in w] for w in want]
    assert len(set(want[0][0][0])) < len(want[0][0][0])     # the penalties had work to do
    for g, w in zip(got, want):
        for (_, lp), (_, wlp) in zip(g, w):
            np.testing.assert_allclose(lp, wlp, atol=1e-5)


@pytest.fixture(scope="module")
def small_engine():
    return Engine(SMALL, dataclasses.replace(SPEC, max_concurrent_decodes=32))


def _reference(model, temperature, top_p, frequency):
    """{sequence: probability} over every LENGTH-token continuation of PROMPT, each position's
    distribution as the engine's sampler defines it (frequency penalty over the tokens drawn
    before, temperature, top-p), from full forwards of every prefix."""
    v = SMALL.vocab_size
    seqs = list(itertools.product(range(v), repeat=LENGTH - 1))
    logits = np.asarray(model(np.asarray([PROMPT + list(s) for s in seqs]))[:, len(PROMPT) - 1:],
                        np.float64)                                     # [v^3, LENGTH, v]
    probs = {}
    for row, s in enumerate(seqs):
        for last in range(v):
            full, p = s + (last,), 1.0
            for j, token in enumerate(full):
                z = logits[row, j] - frequency * np.bincount(full[:j], minlength=v)
                q = np.exp((z - z.max()) / temperature)
                q /= q.sum()
                order, kept, cum = np.argsort(-q), np.zeros(v, bool), 0.0
                for i in order:
                    if cum >= top_p:
                        break
                    kept[i], cum = True, cum + q[i]
                q = np.where(kept, q, 0) / q[kept].sum()
                p *= q[token]
            probs[full] = p
    return probs


def _chi_square(counts: dict, probs: dict, n: int) -> float:
    """p-value of the counts against the probabilities, cells expected fewer than 5 times
    pooled into one."""
    big = [s for s, p in probs.items() if p * n >= 5]
    small = [s for s in probs if s not in set(big)]
    observed = [counts.get(s, 0) for s in big] + [sum(counts.get(s, 0) for s in small)]
    expected = [probs[s] * n for s in big] + [sum(probs[s] for s in small) * n]
    return stats.chisquare(observed, np.asarray(expected) * sum(observed) / sum(expected)).pvalue


@pytest.mark.slow
@pytest.mark.parametrize("temperature, top_p, frequency", [(1.0, 1.0, 0.0), (1.0, 0.9, 0.0),
                                                           (1.0, 1.0, 2.0)])
def test_speculation_keeps_the_sampled_distribution_exactly(sharp, small_engine, temperature,
                                                            top_p, frequency):
    """4,096 samples with every draft verified (half of them the greedy continuation, mostly
    accepted; half fixed tokens, mostly rejected) against the model's own sequence
    probabilities: the chi-square test does not reject at the 0.1% level. A lenient rule
    (accepting any drafted token in the top 3) fails it."""
    model, params = sharp
    probs = _reference(model, temperature, top_p, frequency)
    greedy = max(probs, key=probs.get)
    engine = small_engine
    sampling = [SamplingParams(temperature=temperature, top_p=top_p, max_tokens=LENGTH,
                               frequency_penalty=frequency, seed=seed, n=32)
                for seed in range(128)]
    speculator = Speculator(Planted({tuple(PROMPT): list(greedy)}), K, always=True)
    with Orchestrator(engine, params, speculator=speculator) as o:
        streams = [o.submit(PROMPT, s) for s in sampling]
        samples = [tuple(x.tokens) for s in streams for x in s.result()]
        metrics = o.metrics()
    assert metrics["spec_decode_num_draft_tokens"] > 4096
    assert 0 < metrics["spec_decode_num_accepted_tokens"] < metrics[
        "spec_decode_num_draft_tokens"]
    assert _chi_square(collections.Counter(samples), probs, len(samples)) > 1e-3
