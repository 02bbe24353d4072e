"""The actor across a restart: a checkpoint taken while groups are being generated keeps what
they have generated so far, and a resumed actor continues those samples instead of
regenerating them, ending with exactly the samples an uninterrupted run produces."""

import dataclasses
import json

import pytest
from flax import nnx

from jaxrl.config import load_run_config
from jaxrl.data.rollouts import RolloutLog
from jaxrl.models import Transformer, split_params
from jaxrl.recipe import build_task, model_config
from jaxrl.rollout.actor import Actor
from jaxrl.rollout.sources import group_source
from serving.core.orchestrator import Orchestrator
from serving.core.stream import DoneEvent, RequestStream, TokenEvent
from serving.runner.engine import Engine, EngineConfig
from serving.runner.sampling import SamplingParams
from tests.serving.common import until

# An untrained model: samples of up to 24 tokens; no filter, so every sample reaches the log.
CFG = load_run_config(None, ["model.num_layers=2", "model.embed_dim=32", "model.mlp_dim=64",
                             "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=16",
                             "model.max_seq_len=40", "rl.group_size=4",
                             "rl.engine.max_concurrent_decodes=8",
                             "rl.max_prompt_len=8", "rl.max_new_tokens=24",
                             "rl.filter_zero_advantage=false", "rl.filter_overlong=false"])
GROUP = CFG.rl.group_size


@pytest.fixture(scope="module")
def parts():
    model_cfg = model_config(CFG)
    task, tokenizer = build_task(CFG, model_cfg)
    engine = Engine(model_cfg, EngineConfig(max_concurrent_decodes=8, max_len=33,
                                            max_prefill_length=8, prefill_chunk=8,
                                            page_size=4, steps_per_dispatch=2))
    params = split_params(Transformer(model_cfg, rngs=nnx.Rngs(0)))[1]
    return engine, params, task, tokenizer


def actor(orchestrator, task, tokenizer, log, **kwargs):
    source = group_source(orchestrator, task, tokenizer, CFG.rl, warn=lambda _: None)
    return Actor(source, log, CFG.rl, seed=3, warn=lambda _: None, **kwargs)


def test_groups_in_flight_continue_after_a_restart(parts):
    engine, params, task, tokenizer = parts
    # What an uninterrupted run generates for the first two groups.
    with Orchestrator(engine, params, eos_id=tokenizer.eos_id) as o:
        probe = actor(o, task, tokenizer, RolloutLog())
        bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
        expected = [[s.tokens for s in o.generate(
            bos + tokenizer.encode(probe.problem(i).prompt),
            SamplingParams(max_tokens=24, temperature=1.0, n=GROUP,
                           seed=(3 * 1_000_003 + i) % 2**32))] for i in (0, 1)]
        probe.stop()
    total = sum(len(tokens) for group in expected for tokens in group)

    # The first run: the two groups start, and the engine is stopped part-way through them: its
    # loop holds itself after the decode call that reaches half the tokens (on its own thread,
    # so where it stops does not depend on how fast this machine is).
    with Orchestrator(engine, params, eos_id=tokenizer.eos_id) as o:
        decode = o._loop._decode

        def decode_then_hold_at_half(state):
            state, decoded = decode(state)
            if o.metrics()["generated_tokens"] >= total // 2:
                o._loop.hold()
            return state, decoded

        o._loop._decode = decode_then_hold_at_half
        first = actor(o, task, tokenizer, RolloutLog())
        o.pause()
        first._submit_next()
        first._submit_next()
        o.resume()
        until(o._loop.held.is_set, what="the engine holding at half the tokens")
        o.pause()
        saved = json.loads(json.dumps(first.snapshot(0)))   # as a checkpoint stores it
        first.stop()
    carried = sum(len(s["tokens"]) for samples in saved["partial"].values() for s in samples)
    assert saved["redo"] == [0, 1] and saved["next_problem"] == 2
    assert 0 < carried

    # The resumed run redoes them first, from what the checkpoint kept.
    log = RolloutLog()
    with Orchestrator(engine, params, eos_id=tokenizer.eos_id) as o:
        second = actor(o, task, tokenizer, log, resume=saved)
        second.generate(2 * GROUP)
        generated = o.metrics()["generated_tokens"]
        second.stop()
    rollouts = log.tail(0)
    assert [[r.completion for r in rollouts if r.group == i] for i in (0, 1)] == expected
    assert second.stats["carried_tokens"] == carried
    assert 0 < carried < total and generated == total - carried   # nothing generated twice
    # The carried tokens keep the log-probs and versions they were generated with.
    for i, samples in saved["partial"].items():
        mine = [r for r in rollouts if r.group == int(i)]
        for s, r in zip(samples, mine):
            assert r.logprobs[:len(s["tokens"])] == s["logprobs"]


def test_answer_lengths_fix_every_sample(parts):
    """rl.completion_length=answer: an untrained model's samples are each exactly as long as
    their problem's answer, plus the one token where EOS may come, whatever it draws."""
    engine, params, task, tokenizer = parts
    rl = dataclasses.replace(CFG.rl, completion_length="answer")
    log = RolloutLog()
    with Orchestrator(engine, params, eos_id=tokenizer.eos_id) as o:
        a = Actor(group_source(o, task, tokenizer, rl), log, rl, seed=5, warn=lambda _: None)
        a.generate(3 * GROUP)
        a.stop()
    rollouts = log.tail(0)
    assert len(rollouts) >= 3 * GROUP
    lengths = {len(tokenizer.encode(a.problem(r.group).answer)) for r in rollouts}
    assert len(lengths) > 1            # the answers differ in length, and so do the samples
    for r in rollouts:
        answer = tokenizer.encode(a.problem(r.group).answer)
        assert len(r.completion) == len(answer) + 1
        assert tokenizer.eos_id not in r.completion[:-1]


class HeldGeneration:
    """Generation whose groups end only when the test ends them: what the actor has in flight
    is then exactly what it submitted and the test has not finished."""

    def __init__(self, slots: int):
        self.slots, self.streams = slots, []

    def submit(self, prompt, sampling, *, carry=None, predicted_len=None, session=None):
        self.streams.append(RequestStream(len(self.streams), sampling.n))
        return self.streams[-1]

    def finish(self, stream: RequestStream) -> None:
        for i in range(stream.n):
            stream.put(TokenEvent(i, 5, -1.0, 0))
            stream.put(DoneEvent(i, "length"))


def _at_bound(a, count, at_least: int = 0) -> int:
    """count() once it is at least `at_least` and the actor has since turned twice at its
    bound (looked for room and found none): a count it will not pass until a step trains."""
    until(lambda: count() >= at_least, what=f"{at_least} groups submitted")
    turns = a.turns_at_bound
    until(lambda: a.turns_at_bound >= turns + 2, what="two turns of the actor at its bound")
    return count()


@pytest.mark.parametrize("slots", [8, 64])
def test_async_keeps_the_engines_full_beside_the_batch_training(parts, slots):
    """Async mode: samples finished and not trained plus those in flight stay within one batch
    (the one training) and as many as the engines' slots hold, at least one batch and at most
    two: with 64 slots for batches of 32, 24 groups go out at once, not 16, so a long group
    in flight does not hold the batch after up; nothing more until a step trains a batch."""
    _, _, task, tokenizer = parts
    batch = CFG.rl.batch_size
    gen, log = HeldGeneration(slots), RolloutLog()
    a = actor(gen, task, tokenizer, log).start()
    try:
        cap = (batch + max(batch, min(slots, 2 * batch))) // GROUP
        assert cap == {8: 16, 64: 24}[slots]
        streams = lambda: len(gen.streams)  # noqa: E731
        assert _at_bound(a, streams, cap) == cap
        for stream in gen.streams[1:]:          # every group but the first (a long one) ends
            gen.finish(stream)
        until(lambda: log.end >= (cap - 1) * GROUP, what="their rollouts reaching the log")
        assert _at_bound(a, streams) == cap      # the bound holds: nothing more
        a.notify_trained(batch)                 # a step trains a batch: room again
        assert _at_bound(a, streams, cap + 1) == cap + batch // GROUP
    finally:
        a.stop()
        for s in gen.streams:                   # its collectors end with their groups
            if not s.snapshot()[0].finish_reason:
                gen.finish(s)
