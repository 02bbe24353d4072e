"""The engine loop dispatches a decode step before it reads back the one before
(serving/core/engine_loop.py), so the host's work for one step runs while the device computes the
next. Checked on what the loop did, not on timing: the order of its dispatches and read-backs,
and the decode rows it ran, counted from what each sample's tokens and finish reason say they
must have cost (an end by length is known ahead and costs nothing more; an end by a stop token
is learnt one step late and costs exactly one dropped row). That the tokens themselves are
unchanged is what the rest of tests/serving checks against its references."""

from serving.core.orchestrator import Orchestrator
from serving.runner.engine import Decoded
from serving.runner.sampling import SamplingParams
from tests.serving.common import prompts


def _record(engine, monkeypatch) -> list[str]:
    """'d' for each decode dispatch of `engine`, 'f' for each read-back, in order."""
    events = []
    dispatch, fetch = engine.dispatch_steps, Decoded.fetch

    def dispatch_steps(*args, **kwargs):
        events.append("d")
        return dispatch(*args, **kwargs)

    def fetched(self):
        events.append("f")
        return fetch(self)

    monkeypatch.setattr(engine, "dispatch_steps", dispatch_steps)
    monkeypatch.setattr(Decoded, "fetch", fetched)
    return events


def test_each_step_is_dispatched_before_the_one_before_it_is_read(engine, params, monkeypatch):
    """One greedy sample of 12 tokens: the first comes from the prefill, the other 11 from 11
    decode dispatches, each read back after the next is dispatched; the last is read back
    without another (its end by length is known), so none is dropped."""
    events = _record(engine, monkeypatch)
    with Orchestrator(engine, params) as o:
        [sample] = o.generate(prompts(7, seed=3)[0], SamplingParams(temperature=0.0,
                                                                    max_tokens=12))
        metrics = o.metrics()
    assert len(sample.tokens) == 12 and sample.finish_reason == "length"
    assert "".join(events) == "d" + "df" * 10 + "f"
    assert metrics["busy_slot_steps"] == 11 and metrics["generated_tokens"] == 12


def test_an_end_learnt_late_costs_one_dropped_row(engine, params, monkeypatch):
    """Sampled groups that stop at stop tokens 3..9 (about one token in four) or at 10 tokens:
    every decode row the loop ran is a token some sample kept, or the one row past a stop that
    the loop learnt of after it had dispatched the next step."""
    events = _record(engine, monkeypatch)
    max_tokens = 10
    samplings = [SamplingParams(temperature=1.0, seed=i, n=3, max_tokens=max_tokens,
                                stop_token_ids=tuple(range(3, 10))) for i in range(8)]
    with Orchestrator(engine, params) as o:
        streams = [o.submit(p, s) for p, s in
                   zip(prompts(5, 9, 3, 12, 6, 4, 8, 10, seed=11), samplings)]
        samples = [s for stream in streams for s in stream.result()]
        metrics = o.metrics()
    reasons = {s.finish_reason for s in samples}
    assert reasons == {"stop", "length"}
    late = sum(s.finish_reason == "stop" and 1 < len(s.tokens) < max_tokens for s in samples)
    assert late > 0
    kept = sum(len(s.tokens) - 1 for s in samples)       # the first token is the prefill's
    assert metrics["busy_slot_steps"] == kept + late
    assert metrics["generated_tokens"] == kept + len(samples)
    assert events.count("d") == events.count("f")        # every dispatch was read back
