"""OpenAI's presence and frequency penalties in the engine, against an independent reference:
a full forward of the same weights with the penalties applied in NumPy to counts kept on the
host. Greedy and sampled draws follow it token for token with the model's own log-probs, a
sample carried over with more tokens than one insert counts goes on exactly as if it had never
stopped, and bad penalties are refused by name."""

from functools import partial

import jax
import numpy as np
import pytest

from jaxrl.models import merge_params, split_params
from serving.core.stream import Sample
from serving.runner.engine import SlotBatch
from serving.runner.sampling import Draws, SamplingParams, sample, slot_keys
from serving.runner.steps import HISTORY_CHUNK
from tests.serving.common import CFG, ENGINE, prompts


@partial(jax.jit, static_argnums=0)
def _logits(graphdef, params, ids_T):
    """The model's logits [T, V] at every position (causal: padding after changes nothing)."""
    return merge_params(graphdef, params)(ids_T[None])[0].astype(np.float32)


@jax.jit
def _draw(penalized_V, logits_V, temperature, top_k, top_p, keys):
    """The engine's sampler on one row of penalized logits, and the unpenalized log-probs
    (jitted: run eagerly, its small ops cost most of a test's time)."""
    token, _ = sample(penalized_V[None], Draws(temperature, top_k, top_p, keys))
    greedy_as_one = jax.numpy.where(temperature[0] > 0, temperature[0], 1.0)
    return token[0], jax.nn.log_softmax(logits_V / greedy_as_one)


def _reference(model, prompt, sampling, index=0):
    """(tokens, log-probs) of one sample, each token drawn from the logits less the penalties
    of the tokens before it, with the engine's keys; the log-probs are the unpenalized ones."""
    graphdef, params = split_params(model)
    counts = np.zeros(CFG.vocab_size, np.float32)
    ids, tokens, logprobs = list(prompt), [], []
    for j in range(sampling.max_tokens):
        grid = np.zeros(ENGINE.max_len, np.int32)
        grid[: len(ids)] = ids
        logits = np.asarray(_logits(graphdef, params, grid))[len(ids) - 1]
        penalized = (logits - sampling.frequency_penalty * counts
                     - sampling.presence_penalty * (counts > 0))
        token, logp = _draw(penalized, logits, np.float32([sampling.temperature]),
                            np.int32([sampling.top_k]), np.float32([sampling.top_p]),
                            slot_keys(np.uint32([sampling.seed]), np.int32([index]),
                                      np.int32([j])))
        token = int(token)
        tokens.append(token)
        logprobs.append(float(logp[token]))
        counts[token] += 1
        ids.append(token)
    return tokens, logprobs


def test_greedy_penalized_tokens_follow_the_reference(model, orchestrator):
    prompt = prompts(6, seed=11)[0]
    plain = SamplingParams(temperature=0.0, max_tokens=24, stop_at_eos=False)
    penalized = SamplingParams(temperature=0.0, max_tokens=24, stop_at_eos=False,
                               frequency_penalty=1.5, presence_penalty=0.5)
    [got] = orchestrator.generate(prompt, penalized)
    want_tokens, want_logprobs = _reference(model, prompt, penalized)
    assert got.tokens == want_tokens
    np.testing.assert_allclose(got.logprobs, want_logprobs, atol=2e-5)
    # The penalties changed the output (a greedy tiny model repeats itself).
    [free] = orchestrator.generate(prompt, plain)
    assert free.tokens != got.tokens
    assert len(set(got.tokens)) > len(set(free.tokens))


def test_sampled_penalized_draws_follow_the_reference(model, orchestrator):
    prompt = prompts(9, seed=12)[0]
    sampling = SamplingParams(temperature=0.8, top_k=12, max_tokens=20, n=3, seed=21,
                              stop_at_eos=False, frequency_penalty=2.0, presence_penalty=-0.5)
    for i, got in enumerate(orchestrator.generate(prompt, sampling)):
        want_tokens, want_logprobs = _reference(model, prompt, sampling, index=i)
        assert got.tokens == want_tokens
        np.testing.assert_allclose(got.logprobs, want_logprobs, atol=2e-5)


def test_a_carried_sample_is_counted_from_all_its_tokens(model, orchestrator):
    """40 tokens carried over (more than one insert counts): the resumed sample decodes on as
    the reference does, penalizing what it drew before it stopped."""
    prompt = prompts(5, seed=13)[0]
    sampling = SamplingParams(temperature=0.0, max_tokens=50, stop_at_eos=False,
                              frequency_penalty=1.0)
    want_tokens, want_logprobs = _reference(model, prompt, sampling)
    carried = 40
    assert carried > HISTORY_CHUNK
    [got] = orchestrator.submit(prompt, sampling, carry=[Sample(
        want_tokens[:carried], want_logprobs[:carried], [0] * carried)]).result()
    assert got.tokens == want_tokens


def test_insert_counts_a_long_history_and_resets_a_reused_slot(engine):
    sampling = SamplingParams(frequency_penalty=0.5)
    history = np.random.default_rng(0).integers(0, CFG.vocab_size, 2 * HISTORY_CHUNK + 5)
    state = engine.init_decode_state()
    state = engine.insert(state, SlotBatch([2], [10], [int(history[-1])], [len(history)],
                                            [sampling], [0], [history.tolist()]))
    np.testing.assert_array_equal(np.asarray(state.seen)[2],
                                  np.bincount(history, minlength=CFG.vocab_size))
    state = engine.insert(state, SlotBatch([2], [4], [7], [1], [sampling], [0], [[7]]))
    want = np.zeros(CFG.vocab_size, np.int32)
    want[7] = 1
    np.testing.assert_array_equal(np.asarray(state.seen)[2], want)
    with pytest.raises(ValueError, match="needs the 3 tokens it has sampled"):
        engine.insert(state, SlotBatch([1], [4], [7], [3], [sampling], [0], [[7]]))


@pytest.mark.parametrize("name", ["presence_penalty", "frequency_penalty"])
def test_penalties_out_of_range_are_refused_by_name(name):
    with pytest.raises(ValueError, match=rf"{name}=2.5 must be in \[-2.0, 2.0\]"):
        SamplingParams(**{name: 2.5})
