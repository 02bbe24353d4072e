"""RequestStream.batches, what a gRPC Generate with stream_interval_ms reads: every event once,
in order, in lists that each hold what arrived within the interval of their first event; the
last list comes as soon as every sample is done, not at the interval's end."""

import threading
import time

from serving.core.stream import DoneEvent, RequestStream, TokenEvent


def _produce(stream: RequestStream, tokens: int, pause_s: float) -> threading.Thread:
    def run():
        for t in range(tokens):
            stream.put(TokenEvent(t % stream.n, t, -0.5, 0))
            time.sleep(pause_s)
        for i in range(stream.n):
            stream.put(DoneEvent(i, "length"))
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_batches_hold_every_event_in_order():
    stream = RequestStream(0, n=3)
    producer = _produce(stream, 60, 0.001)
    batches = list(stream.batches(0.02))
    producer.join()
    events = [e for b in batches for e in b]
    assert [e.token for e in events if isinstance(e, TokenEvent)] == list(range(60))
    assert [e.sample_index for e in events if isinstance(e, DoneEvent)] == [0, 1, 2]
    assert isinstance(events[-1], DoneEvent) and all(batches)
    assert len(batches) < 60          # gathered, not one list per token


def test_the_last_batch_comes_once_every_sample_is_done():
    stream = RequestStream(0, n=2)
    producer = _produce(stream, 4, 0.0)
    t0 = time.monotonic()
    batches = list(stream.batches(30.0))
    producer.join()
    assert time.monotonic() - t0 < 10.0          # not the 30 s interval
    assert sum(len(b) for b in batches) == 6


def test_interval_zero_sends_each_event_as_it_comes():
    stream = RequestStream(0, n=1)
    for t in range(3):
        stream.put(TokenEvent(0, t, -0.1, 0))
    stream.put(DoneEvent(0, "eos"))
    batches = list(stream.batches(0.0))
    assert [[getattr(e, "token", None) for e in b] for b in batches] == [[0], [1], [2], [None]]


def test_result_is_every_sample_once_all_are_done_and_leaves_the_events():
    """`result` returns each sample whole, built from every event put, only after the last
    sample's DoneEvent; it takes no event from the queue iteration reads."""
    stream = RequestStream(0, n=3)
    got = []
    reader = threading.Thread(target=lambda: got.append(stream.result()))
    reader.start()
    for t in range(30):
        stream.put(TokenEvent(t % 3, t, -0.25 * t, t // 10))
    stream.put(DoneEvent(0, "eos"))
    stream.put(DoneEvent(2, "length"))
    reader.join(0.2)
    assert reader.is_alive() and not got        # sample 1 is not done yet
    stream.put(DoneEvent(1, "stop"))
    reader.join(10.0)
    assert not reader.is_alive()
    samples = got[0]
    for i, s in enumerate(samples):
        assert s.tokens == list(range(i, 30, 3))
        assert s.logprobs == [-0.25 * t for t in range(i, 30, 3)]
        assert s.versions == [t // 10 for t in range(i, 30, 3)]
    assert [s.finish_reason for s in samples] == ["eos", "stop", "length"]
    events = list(stream)                        # iteration still reads every event
    assert len(events) == 33 and [e.token for e in events[:30]] == list(range(30))
    samples[0].tokens.append(99)                 # a copy: the stream's own record is unchanged
    assert stream.result()[0].tokens == list(range(0, 30, 3))
