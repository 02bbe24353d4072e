"""The serving runtime's contracts: every program is compiled before the loop serves (none after,
under a workload that crosses every shape), engines share their programs and are freed when
dropped, and a dead engine loop fails every client at once."""

import collections
import dataclasses
import gc
import random
import threading
import time
import weakref

import grpc
import httpx
import jax
import numpy as np
import pytest
from flax import nnx
from grpc_health.v1 import health_pb2, health_pb2_grpc
from jax import monitoring

from jaxrl import executables
from jaxrl.models import Transformer, split_params
from jaxrl.models.tokenizer import CharTokenizer
from serving.core.orchestrator import EngineStopped, Orchestrator
from serving.core.stream import DoneEvent, Sample
from serving.frontends.openai_api import OpenAIApp, start_http
from serving.frontends.server import Server
from serving.proto import generation_pb2 as gen
from serving.proto import generation_pb2_grpc as gen_grpc
from serving.proto import jetstream_pb2 as js_pb2
from serving.proto import jetstream_pb2_grpc as js_grpc
from serving.runner.engine import Engine
from serving.runner.programs import ROWS_FIRST, Programs
from serving.runner.sampling import SamplingParams
from tests.serving.common import CFG, ENGINE, contiguous_decode, prompts, until

# 16 slots (decode batches of 1, 4 or 16 rows), two table widths per doubling.
RUNTIME = dataclasses.replace(ENGINE, max_concurrent_decodes=16, page_buckets=2)

_compiles = collections.Counter()


def _on_event(event: str, duration: float, **_) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _compiles["backend"] += 1


monitoring.register_event_duration_secs_listener(_on_event)


def _workload(o: Orchestrator, noisy) -> list:
    """Prompt lengths across every prefill bucket and chunk count, groups of 1-4 samples, greedy
    and sampled with top-k/top-p, a weight update in flight, cancellations, a carried request
    (a long prefix prefilled again) and a multi-turn session."""
    lengths = [1, 3, 4, 5, 8, 9, 15, 16, 17, 24, 33, 40]
    streams = []
    for i, p in enumerate(prompts(*lengths, seed=40)):
        sampling = SamplingParams(max_tokens=min(64 - len(p), 8 + 5 * i), n=1 + i % 4,
                                  temperature=0.0 if i % 3 == 0 else 0.9, top_k=(i % 2) * 5,
                                  top_p=0.8 if i % 5 == 0 else 1.0, seed=i, stop_at_eos=False)
        streams.append(o.submit(p, sampling))
    for s in streams[1::5]:
        s.cancel()
    until(lambda: o.metrics()["generated_tokens"] >= 40, what="40 tokens generated")
    o.update_params(noisy, 1)
    results = [s.result() for s in streams]
    done = results[10][0]            # a 33-token prompt's sample, carried 20 tokens in
    assert done.finish_reason == "length" and len(done.tokens) > 20
    carry = [Sample(done.tokens[:20], done.logprobs[:20], done.versions[:20])]
    again = o.submit(prompts(*lengths, seed=40)[10],
                     SamplingParams(max_tokens=len(done.tokens), n=1, temperature=0.0,
                                    stop_at_eos=False), carry=carry).result()
    first = o.submit(prompts(6, seed=41)[0], SamplingParams(max_tokens=5, temperature=0.0),
                     session="turns").result()[0]
    o.submit(prompts(6, seed=41)[0] + first.tokens + [4, 5], SamplingParams(max_tokens=5),
             session="turns").result()
    o.end_session("turns")
    return results + [again]


@pytest.mark.parametrize("attention,programs", [("native", 19), ("reference", 52)])
def test_nothing_compiles_after_start_whatever_the_requests(params, attention, programs):
    """Attention through the native kernel, the CPU default (one decode and one prefill
    program per row count and chunk bucket, for every table width, as for the loop) and the
    reference path (one per width: 2 per doubling for decode, 1 for prefill)."""
    noisy = jax.tree.map(lambda x: x * 1.01, params)
    engine = Engine(CFG, dataclasses.replace(RUNTIME, attention=attention))
    o = Orchestrator(engine, params, eos_id=2)
    o.start()
    try:
        assert o.compiled_at_start == len(engine.programs.shapes()) == programs
        before = _compiles["backend"]
        results = _workload(o, noisy)
        assert _compiles["backend"] == before
        metrics = o.metrics()
        assert metrics["late_compiles"] == 0 and metrics["updates"] == 1
    finally:
        o.stop()
    reasons = {s.finish_reason for r in results for s in r}
    assert {"length", "cancelled"} <= reasons
    assert {v for r in results for s in r for v in s.versions} == {0, 1}

    # A second engine of the same shapes compiles nothing; a dropped one is freed.
    second = Engine(CFG, dataclasses.replace(RUNTIME, attention=attention))
    assert second.compile() == 0 and second.programs is engine.programs
    dropped = weakref.ref(engine)
    del engine, o, second
    gc.collect()
    assert dropped() is None


def test_smaller_batches_compile_beside_generation_once_asked_for(params, monkeypatch):
    """start(compile_later=True): the programs of the largest batches and prefill chunks
    compile before the loop starts. A call for a smaller batch or chunk runs padded to those
    (nothing compiles on the loop's thread), generates what the contiguous reference does,
    and asks for its own (here at once), which a thread beside the loop compiles; later calls
    use them."""
    monkeypatch.setattr(Programs, "ASK_AFTER", 1)
    cfg = dataclasses.replace(RUNTIME, attention="loop", prefill_chunk=8)  # a spec of its own
    gc.collect()                                  # no engine of that spec is left alive
    engine = Engine(CFG, cfg)
    largest, sizes, buckets = cfg.row_sizes[-1], cfg.row_sizes, cfg.buckets
    assert sizes == (1, 4, 16) and buckets == (4, 8)
    gate = threading.Event()
    wanted = engine.compile_wanted
    engine.compile_wanted = lambda stop: gate.wait(60) and wanted(stop)   # held at the gate
    # One row, then two (rows 1 and 4), prompts of 7, 3 and 12 tokens (chunks of 8 and 4).
    requests = [(prompts(7, seed=50)[0], SamplingParams(temperature=0.0, max_tokens=9)),
                (prompts(3, seed=52)[0], SamplingParams(temperature=0.0, max_tokens=5)),
                (prompts(12, seed=51)[0], SamplingParams(temperature=0.9, seed=3, n=2,
                                                         max_tokens=7, stop_at_eos=False))]
    o = Orchestrator(engine, params).start(compile_later=True)
    try:
        assert o.compiled_at_start == sum(
            1 for name, key in engine.programs.shapes()
            if (name in ROWS_FIRST and key[0] == largest) or name == "init"
            or (name == "prefill" and key[1] == buckets[-1]))
        padded = [o.submit(p, sampling).result() for p, sampling in requests]
        assert engine.programs.compiled == o.compiled_at_start       # held at the gate
        assert [engine.programs.rows_now("decode", n) for n in sizes] == [largest] * 3
        assert [engine.bucket(n) for n in buckets] == [8, 8]
        assert engine.programs.wanted == {("decode", 1), ("decode", 4), ("prefill", 4),
                                          ("sample_first", 1), ("sample_first", 4),
                                          ("insert", 1), ("insert", 4)}
        gate.set()
        deadline = time.monotonic() + 120
        while engine.programs.wanted:
            assert time.monotonic() < deadline, "what was asked for did not compile in 120 s"
            time.sleep(0.05)
        assert engine.programs.compiled < len(engine.programs.shapes())  # no page copy asked
        assert [engine.programs.rows_now("decode", n) for n in sizes] == list(sizes)
        assert [engine.bucket(n) for n in buckets] == list(buckets)
        ready = [o.submit(p, sampling).result() for p, sampling in requests]
        assert o.metrics()["late_compiles"] == 0
    finally:
        gate.set()
        o.stop()
    assert not o._compiling.is_alive()
    for (prompt, sampling), *runs in zip(requests, padded, ready):
        for samples in runs:
            for i, s in enumerate(samples):
                tokens, logprobs = contiguous_decode(engine.graphdef, {0: params}, prompt,
                                                     sampling, i, [0] * len(s.tokens))
                assert s.tokens == tokens
                np.testing.assert_allclose(s.logprobs, logprobs, atol=1e-5)


def test_a_program_compiled_while_serving_is_counted(params):
    """`late_compiles` counts a call for a program the engine did not compile before serving
    (compiled on the spot, logged): the counter the other tests assert to be 0 does count."""
    cfg = dataclasses.replace(RUNTIME, attention="loop", prefill_chunk=8, max_prefill_length=28)
    gc.collect()
    engine = Engine(CFG, cfg)                                # a spec of its own
    engine.compile(largest_only=True)
    programs = engine.programs
    name, key = next(s for s in programs.shapes() if not programs.is_compiled(*s))
    before = programs.compiled
    with pytest.raises(TypeError):      # called without its arguments: compiled, then refused
        programs(name, key)
    assert programs.late_compiles == 1 and programs.compiled == before + 1
    assert programs.is_compiled(name, key)


def test_programs_no_call_asks_for_are_never_compiled(params):
    """A group that fills every slot and ends at once never shrinks its batches: with
    compile_later, nothing beyond the largest batches' and chunks' programs is compiled; a
    smaller one is asked for after ASK_AFTER padded calls; stop ends the compiling thread."""
    cfg = dataclasses.replace(RUNTIME, attention="loop", prefill_chunk=8,
                              max_prefill_length=36)              # a spec of its own
    gc.collect()
    engine = Engine(CFG, cfg)
    o = Orchestrator(engine, params).start(compile_later=True)
    try:
        before = engine.programs.compiled
        samples = o.submit(prompts(8, seed=53)[0], SamplingParams(
            temperature=0.9, seed=4, n=cfg.max_concurrent_decodes, max_tokens=6,
            stop_at_eos=False)).result()
        assert [len(s.tokens) for s in samples] == [6] * cfg.max_concurrent_decodes
        # Nothing was asked for, and the compiling thread compiles only what is asked for.
        assert engine.programs.wanted == set()
        assert engine.programs.compiled == before < len(engine.programs.shapes())
        # A row count is asked for once ASK_AFTER calls were padded for want of it.
        for _ in range(Programs.ASK_AFTER - 1):
            assert engine.programs.row_bucket("insert", 1) == cfg.row_sizes[-1]
        assert engine.programs.wanted == set()
        engine.programs.row_bucket("insert", 1)
        assert engine.programs.wanted == {("insert", 1)}
    finally:
        o.stop()
    assert not o._compiling.is_alive()


def test_a_later_engine_loads_its_programs_without_tracing_them(tmp_path, monkeypatch):
    """jaxrl/executables.py: an engine compiled once is kept on disk; the next Programs of
    that spec (a second run) loads every program without tracing or lowering it, and
    generates what the contiguous reference does."""
    monkeypatch.setattr(executables, "directory", lambda: tmp_path)
    # Shapes no other test or run compiles (a vocabulary, an MLP and a pool of their own), so
    # that nothing comes from JAX's persistent cache, which `make test` shares between tests:
    # an executable JAX's cache loaded is never kept (jaxrl/executables.py).
    rng = random.Random()
    model_cfg = dataclasses.replace(CFG, vocab_size=rng.randrange(33, 1000), mlp_dim=48)
    cfg = dataclasses.replace(RUNTIME, num_pages=rng.randrange(100, 10_000))
    params = split_params(Transformer(model_cfg, rngs=nnx.Rngs(1)))[1]
    gc.collect()
    engine = Engine(model_cfg, cfg)
    compiled = engine.compile()
    assert len(list(tmp_path.glob("*.exe"))) == compiled == len(engine.programs.shapes())
    dropped = weakref.ref(engine.programs)
    del engine
    gc.collect()
    assert dropped() is None                            # the next engine starts from disk
    monkeypatch.setattr(Programs, "lower", lambda *_: pytest.fail("a program was lowered"))
    engine = Engine(model_cfg, cfg)
    prompt, sampling = prompts(9, seed=60)[0], SamplingParams(temperature=0.8, seed=2, n=3,
                                                              max_tokens=10, stop_at_eos=False)
    with Orchestrator(engine, params) as o:
        assert o.compiled_at_start == compiled
        samples = o.submit(prompt, sampling).result()
    for i, s in enumerate(samples):
        tokens, logprobs = contiguous_decode(engine.graphdef, {0: params}, prompt, sampling, i,
                                             [0] * len(s.tokens))
        assert s.tokens == tokens
        np.testing.assert_allclose(s.logprobs, logprobs, atol=1e-5)


class FailingOrchestrator(Orchestrator):
    """Its loop raises in the decode step once `fail` is set: a bug in the engine loop."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fail = threading.Event()
        decode = self._loop._decode

        def failing(state):
            if self.fail.is_set():
                raise RuntimeError("injected failure")
            return decode(state)

        self._loop._decode = failing


def test_a_dead_engine_loop_fails_every_client(engine, params):
    """The loop's death ends every stream with an error (its failure path ends them: the
    readers are joined with a deadline, not left to a timeout), refuses new work in each
    protocol's words, and leaves the servers answering."""
    o = FailingOrchestrator(engine, params, eos_id=None).start()
    tokenizer = CharTokenizer("0123456789+-*=")
    server = Server(o, tokenizer, port=0).start()
    http, port = start_http(OpenAIApp(o, tokenizer, "tiny", ENGINE.max_len).app,
                            "127.0.0.1", 0)
    try:
        # Running, queued (8 samples for 4 slots) and every one read by a client thread.
        streams = [o.submit(p, SamplingParams(max_tokens=50, n=2, stop_at_eos=False))
                   for p in prompts(5, 6, 7, 8, seed=42)]
        ended = {}

        def read(i, stream):
            ended[i] = [e.reason for e in stream if isinstance(e, DoneEvent)]

        readers = [threading.Thread(target=read, args=(i, s)) for i, s in enumerate(streams)]
        for r in readers:
            r.start()
        until(lambda: o.metrics()["generated_tokens"] >= 8, what="8 tokens generated")
        o.fail.set()
        for r in readers:
            r.join(30)
        assert sorted(ended) == [0, 1, 2, 3]
        assert all(reasons == ["error", "error"] for reasons in ended.values())
        assert "injected failure" in str(o.error)
        o.stop(timeout=1)         # a dead loop's thread ends at once: stop returns
        assert not o.running

        # New work is refused at once, in each protocol's words.
        with pytest.raises(EngineStopped, match="injected failure"):
            o.submit([3, 4], SamplingParams())
        with pytest.raises(EngineStopped):
            o.update_params(params, 5)
        stub = gen_grpc.GenerationStub(grpc.insecure_channel(server.address))
        with pytest.raises(grpc.RpcError) as rpc:
            list(stub.Generate(gen.GenerateRequest(token_ids=gen.TokenIds(ids=[3, 4]),
                                                   sampling=gen.SamplingOptions(max_tokens=2)),
                               timeout=5))
        assert rpc.value.code() == grpc.StatusCode.UNAVAILABLE

        # Probes see it at once: gRPC's health service and JetStream's HealthCheck.
        channel = grpc.insecure_channel(server.address)
        for service in ("", "jetstream_proto.Orchestrator", "jaxrl.serving.Generation"):
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING, service
        live = js_grpc.OrchestratorStub(channel).HealthCheck(js_pb2.HealthCheckRequest(),
                                                               timeout=5)
        assert not live.is_live
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=5,
                           json={"model": "tiny", "prompt": "1+1=", "max_tokens": 2})
        assert reply.status_code == 503 and "engine loop has stopped" in reply.text
    finally:
        http.should_exit = True
        server.stop(0)
