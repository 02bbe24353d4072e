"""The scheduler's bookkeeping alone (no model): admission (first come or longest predicted
first), page sharing within a group, page growth, preemption order and page accounting; the
length predictor behind longest-first admission."""

import numpy as np
import pytest

from serving.core.length_predictor import LengthPredictor
from serving.core.page_pool import PagePool, PoolExhausted
from serving.core.scheduler import Scheduler
from serving.core.sequence import Request
from serving.core.stream import RequestStream
from serving.runner.sampling import SamplingParams


def _scheduler(num_pages=17, slots=4, budget=64):
    return Scheduler(slots=slots, num_pages=num_pages, page_size=4, max_len=64,
                     prefill_chunk=16, prefill_budget=budget)


def _request(length, n=1, max_tokens=8):
    return Request(list(range(3, 3 + length)), SamplingParams(n=n, max_tokens=max_tokens),
                   RequestStream(0, n))


def _prefill_all(sched):
    """Runs planned chunks until every admitted prompt is written; returns started sequences."""
    started = []
    while True:
        chunks = sched.plan_prefill()
        if not chunks:
            return started
        for p, _, tokens in chunks:
            if sched.prefilled(p, len(tokens)):
                started += sched.start(p)[0]


def test_a_group_shares_its_full_prompt_pages_and_copies_the_partial_one():
    sched = _scheduler()
    sched.add(_request(10, n=3), max_queued=8)      # pages of 4: two full, one with 2 tokens
    chunks = sched.plan_prefill()
    assert len(chunks) == 1 and chunks[0][2] == list(range(3, 13))
    p = chunks[0][0]
    assert sched.prefilled(p, 10)
    seqs, copies = sched.start(p)
    full, partial = p.pages[:2], p.pages[2]
    assert [s.pages[:2] for s in seqs] == [full] * 3
    own = [s.pages[2] for s in seqs]
    assert own[0] == partial and len(set(own)) == 3
    assert copies == [(partial, own[1]), (partial, own[2])]
    assert sched.pool.free == 16 - 2 - 3
    for s in seqs:
        s.tokens.append(5)
        sched.finish(s)
    assert sched.pool.free == 16


def test_exact_pages_are_shared_without_copies():
    sched = _scheduler()
    sched.add(_request(8, n=2), max_queued=8)
    seqs = _prefill_all(sched)
    assert seqs[0].pages == seqs[1].pages and sched.pool.free == 14


def test_long_prompts_are_chunked_within_the_budget():
    sched = _scheduler(num_pages=40, budget=20)
    sched.add(_request(40), max_queued=8)
    sched.add(_request(6), max_queued=8)
    first = sched.plan_prefill()
    # One chunk of the long prompt (16 tokens) and the short one: 22 >= the budget of 20.
    assert [len(t) for _, _, t in first] == [16, 6]
    for p, _, tokens in first:
        if sched.prefilled(p, len(tokens)):
            sched.start(p)
    assert [(start, len(t)) for _, start, t in sched.plan_prefill()] == [(16, 16)]


def test_growth_preempts_the_youngest_and_resumes_it_first():
    sched = _scheduler(num_pages=9)               # 8 usable pages
    for _ in range(3):
        sched.add(_request(7, max_tokens=40), max_queued=8)
    seqs = _prefill_all(sched)                    # 2 pages each, 6 taken
    assert len(seqs) == 3 and sched.pool.free == 2
    for s in seqs:
        s.tokens.append(1)                        # cached = 7: the next step writes position 7
    preempted = sched.reserve(steps=2)            # each needs positions 7, 8: a third page
    assert preempted == [seqs[2]] and seqs[2].slot is None and seqs[2].pages == []
    assert [len(s.pages) for s in seqs[:2]] == [3, 3] and sched.pool.free == 2
    assert list(sched.resumes) == [seqs[2]]
    # The preempted sequence is recomputed (prompt + its tokens but the last) before anything new.
    sched.add(_request(3), max_queued=8)
    for s in seqs[:2]:
        sched.finish(s)
    chunks = sched.plan_prefill()
    assert chunks[0][0].resumed is seqs[2] and chunks[0][2] == list(range(3, 10))


def test_admission_waits_for_slots_and_pages():
    sched = _scheduler(num_pages=5, slots=2)      # 4 usable pages
    sched.add(_request(16), max_queued=8)         # 4 pages
    sched.add(_request(2), max_queued=8)
    assert len(sched.plan_prefill()) == 1         # the second must wait for a page
    assert sched.queued() == 1


def test_page_pool_accounting():
    pool = PagePool(4, page_size=4)
    a = pool.allocate(2)
    assert 0 not in a and pool.free == 1
    pool.share(a)
    pool.release(a)
    assert pool.free == 1
    pool.release(a)
    assert pool.free == 3
    with pytest.raises(PoolExhausted, match="4 pages asked for, 3 free"):
        pool.allocate(4)


def test_longest_first_admits_the_longest_predicted_request_first():
    sched = Scheduler(slots=1, num_pages=40, page_size=4, max_len=64, prefill_chunk=16,
                      prefill_budget=4, longest_first=True)
    for length, predicted in ((3, 5.0), (4, 50.0), (5, None), (6, 20.0)):
        r = _request(length)
        r.predicted_len = predicted
        sched.add(r, max_queued=8)
    order = []
    while True:
        chunks = sched.plan_prefill()
        if not chunks:
            break
        p, _, tokens = chunks[0]
        order.append(len(p.request.prompt))
        assert sched.prefilled(p, len(tokens))
        for s in sched.start(p)[0]:
            s.tokens.append(1)
            sched.finish(s)
    assert order == [4, 6, 3, 5]    # 50, 20, 5, then unknown


def test_length_predictor_ranks_requests_by_what_it_has_seen():
    rng = np.random.default_rng(0)

    def example():   # the output length is set by the prompt's third token
        prompt = rng.integers(3, 30, 12).tolist()
        return prompt, 10 * prompt[2] + 3

    predictor = LengthPredictor()
    for _ in range(1000):
        predictor.update(*example())
    test = [example() for _ in range(300)]
    predicted = np.argsort(np.argsort([predictor.predict(p) for p, _ in test]))
    actual = np.argsort(np.argsort([n for _, n in test]))
    assert np.corrcoef(predicted, actual)[0, 1] > 0.8    # Spearman's rank correlation


def test_a_long_tail_is_decoded_apart_from_the_short_rows():
    """60 short sequences and 2 long ones: two batches, the long pair alone at its width, the
    short rows at theirs; all rows of similar length stay in one batch."""
    from types import SimpleNamespace

    from serving.core.scheduler import decode_groups
    from serving.runner.engine import EngineConfig

    cfg = EngineConfig(max_concurrent_decodes=64, max_len=2048, page_size=16)

    def running(*lengths):   # (slot, sequence) pairs; grouping reads only the held length
        return [(slot, SimpleNamespace(cached=n)) for slot, n in enumerate(lengths)]

    groups = decode_groups(cfg, running(*[20] * 60, 1000, 1100), k=1)
    assert [[s.cached for _, s in g] for g in groups] == [[20] * 60, [1000, 1100]]
    assert len(decode_groups(cfg, running(*range(100, 164)), k=1)) == 1
    assert len(decode_groups(EngineConfig(max_concurrent_decodes=4, max_len=2048),
                             running(20, 20, 20, 1500), k=1)) == 1   # 4 rows: always one batch
