"""Multi-turn sessions: a turn continues from the KV pages its session's previous turn kept and
prefills only its new tokens, and every token still equals the contiguous reference decoding
the episode's whole history from scratch."""

import dataclasses

import numpy as np
import pytest

from serving.core.orchestrator import InvalidRequest, Orchestrator
from serving.runner.engine import Engine
from serving.runner.sampling import SamplingParams
from tests.serving.common import CFG, ENGINE, contiguous_decode, prompts


def _turn(o, history, sampling, session):
    before = o.metrics()["prefill_tokens"]
    [sample] = o.submit(history, sampling, session=session).result()
    return sample, o.metrics()["prefill_tokens"] - before


def _check(engine, params, history, sampling, sample):
    tokens, logprobs = contiguous_decode(engine.graphdef, {0: params}, history, sampling, 0,
                                         sample.versions)
    assert sample.tokens == tokens
    np.testing.assert_allclose(sample.logprobs, logprobs, atol=1e-5)


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0, max_tokens=7),
                                      SamplingParams(temperature=1.0, top_k=12, seed=3,
                                                     max_tokens=8)],
                         ids=["greedy", "sampled"])
def test_later_turns_prefill_only_their_new_tokens(engine, params, sampling):
    """Three turns; the observations (5 and 4 tokens) put the continuation point inside a page
    and on a page's edge. Turn k>1 prefills the last answer's final token (sampled, never fed)
    and the observation: nothing of the turns before."""
    first, *observations = prompts(6, 5, 4, seed=21)
    with Orchestrator(engine, params) as o:
        history = first
        sample, prefilled = _turn(o, history, sampling, "episode")
        assert prefilled == len(first)
        _check(engine, params, history, sampling, sample)
        for obs in observations:
            history = history + sample.tokens + obs
            sample, prefilled = _turn(o, history, sampling, "episode")
            assert prefilled == 1 + len(obs)
            _check(engine, params, history, sampling, sample)
        metrics = o.metrics()
        assert metrics["sessions_kept"] == 1
        o.end_session("episode")
        o.generate(first, SamplingParams(max_tokens=1))    # the loop has dropped it since
        assert o.metrics()["sessions_kept"] == 0
        assert o.scheduler.pool.free == o.scheduler.pool.capacity


def test_a_group_starts_episodes_that_continue_apart(engine, params):
    """A group of 3 opens three sessions on one shared prompt prefill; each continues on its
    own, including one whose history was edited inside the shared prompt pages (the agent
    rewrote an early message): it prefills from the edit, and its siblings' shared pages are
    not written."""
    prompt, obs = prompts(10, 3, seed=22)
    group = SamplingParams(temperature=1.0, top_k=12, seed=9, max_tokens=6, n=3)
    with Orchestrator(engine, params) as o:
        samples = o.submit(prompt, group, session=["a", "b", "c"]).result()
        for i, s in enumerate(samples):
            tokens, _ = contiguous_decode(engine.graphdef, {0: params}, prompt, group, i,
                                          s.versions)
            assert s.tokens == tokens
        greedy = SamplingParams(temperature=0.0, max_tokens=6)
        edited = list(prompt)
        edited[5] = (edited[5] + 1) % CFG.vocab_size      # page 1 of 4 tokens, shared by all
        histories = {"a": edited + samples[0].tokens + obs,
                     "b": prompt + samples[1].tokens + obs,
                     "c": prompt + samples[2].tokens + obs}
        for key in ("a", "b", "c"):
            sample, prefilled = _turn(o, histories[key], greedy, key)
            _check(engine, params, histories[key], greedy, sample)
            assert prefilled == (len(histories[key]) - 4 if key == "a" else 1 + len(obs))
        for key in "abc":
            o.end_session(key)
        o.generate(prompt, SamplingParams(max_tokens=1))
        assert o.scheduler.pool.free == o.scheduler.pool.capacity


def test_kept_pages_are_evicted_before_anything_is_preempted(params):
    """A pool of 24 pages: four kept sessions of 4 pages each fill most of it; new work evicts
    the least recent ones rather than preempt, and an evicted session's next turn prefills its
    whole history and still decodes the reference tokens."""
    tight = Engine(CFG, dataclasses.replace(ENGINE, num_pages=25, page_buckets=4))
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    firsts = prompts(*([8] * 4), seed=23)
    with Orchestrator(tight, params) as o:
        answers = [o.submit(p, greedy, session=f"s{i}").result()[0] for i, p in
                   enumerate(firsts)]
        assert o.metrics()["sessions_kept"] == 4
        o.generate(prompts(30, seed=24)[0], SamplingParams(temperature=0.0, max_tokens=30))
        metrics = o.metrics()
        assert metrics["session_evictions"] >= 1 and metrics["preemptions"] == 0
        history = firsts[0] + answers[0].tokens + [5, 6]
        sample, prefilled = _turn(o, history, greedy, "s0")     # the least recent: evicted
        assert prefilled == len(history)
        _check(tight, params, history, greedy, sample)
        for i in range(4):
            o.end_session(f"s{i}")
        o.generate(firsts[0], SamplingParams(max_tokens=1))
        assert o.scheduler.pool.free == o.scheduler.pool.capacity


def test_weight_update_between_turns_applies_mid_episode(params):
    """An update between two turns: the next turn's tokens carry the new version, and the kept
    pages (written by the old weights, as in-flight updates leave them mid-sequence) are used,
    not recomputed. Same weights under a new version: the same tokens as without the update."""
    engine = Engine(CFG, ENGINE)
    first, obs = prompts(7, 4, seed=25)
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    with Orchestrator(engine, params) as o:
        one, _ = _turn(o, first, greedy, "e")
        history = first + one.tokens + obs
        plain, _ = _turn(o, history, greedy, "e2-reference")      # no session: a fresh prefill
        o.update_params(params, 1)
        two, prefilled = _turn(o, history, greedy, "e")
    assert prefilled == 1 + len(obs)
    assert set(two.versions) == {1} and two.tokens == plain.tokens
    np.testing.assert_allclose(two.logprobs, plain.logprobs, atol=1e-5)


def test_bad_sessions_are_refused(engine, params):
    prompt = prompts(5, seed=26)[0]
    with Orchestrator(engine, params) as o:
        with pytest.raises(InvalidRequest, match="session 'x' must have n=1, not n=2"):
            o.submit(prompt, SamplingParams(n=2), session="x")
        with pytest.raises(InvalidRequest, match="names n=2 distinct sessions"):
            o.submit(prompt, SamplingParams(n=2), session=["x", "x"])
        with pytest.raises(InvalidRequest, match="names n=3 distinct sessions"):
            o.submit(prompt, SamplingParams(n=3), session=["x", "y"])
