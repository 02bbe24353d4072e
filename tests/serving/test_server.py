"""The gRPC server end to end: JetStream's protocol under 64 concurrent streams, every bad
request, client disconnects, weight updates with and without the secret."""

import concurrent.futures
import json
import re

import grpc
import jax
import numpy as np
import pytest

from jaxrl.models.generate import greedy_generate
from jaxrl.models.tokenizer import CharTokenizer
from serving.core.orchestrator import Orchestrator
from serving.fleet.client import push_weights, weight_pieces
from serving.frontends.server import Server
from serving.proto import generation_pb2 as gen
from serving.proto import generation_pb2_grpc as gen_grpc
from serving.proto import jetstream_pb2 as js
from serving.proto import jetstream_pb2_grpc as js_grpc
from tests.serving.common import prompts

TOKENIZER = CharTokenizer("0123456789+-*=")  # 17 ids, inside the model's 32
TOKEN = "test-secret"


@pytest.fixture(scope="module")
def server(engine, params):
    orchestrator = Orchestrator(engine, params, eos_id=TOKENIZER.eos_id).start()
    s = Server(orchestrator, TOKENIZER, port=0, update_token=TOKEN).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.address) as ch:
        yield ch


def _decode(stub, ids, max_tokens, **kw):
    req = js.DecodeRequest(max_tokens=max_tokens,
                           token_content=js.DecodeRequest.TokenContent(token_ids=ids), **kw)
    return [r.stream_content.samples for r in stub.Decode(req, timeout=120)]


def _until_eos(tokens):
    return tokens[: tokens.index(TOKENIZER.eos_id)] if TOKENIZER.eos_id in tokens else tokens


def test_64_concurrent_jetstream_streams(channel, model):
    stub = js_grpc.OrchestratorStub(channel)
    ps = prompts(*[3 + i % 29 for i in range(64)], seed=12)
    expected = [_until_eos(t) for t in greedy_generate(model, ps, 8, eos_id=-1)]
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        outs = list(pool.map(lambda p: _decode(stub, p, 8), ps))
    for out, want in zip(outs, expected):
        assert [s[0].token_ids[0] for s in out] == want
    assert stub.HealthCheck(js.HealthCheckRequest()).is_live


def test_text_content_streams_text(channel, model):
    stub = js_grpc.OrchestratorStub(channel)
    req = js.DecodeRequest(max_tokens=6, text_content=js.DecodeRequest.TextContent(text="12+34="))
    out = [r.stream_content.samples[0] for r in stub.Decode(req, timeout=60)]
    ids = [s.token_ids[0] for s in out]
    prompt = TOKENIZER.encode("12+34=")
    assert ids == _until_eos(greedy_generate(model, [prompt], 6, eos_id=-1)[0])
    assert "".join(s.text for s in out) == TOKENIZER.decode(ids)


def test_wire_format_is_jetstreams():
    # DecodeRequest{max_tokens=5 (field 4), token_content (6) {token_ids (1) = [3, 4]},
    # num_samples (8) = 2}, hand-encoded from JetStream's field numbers.
    raw = bytes([0x20, 5, 0x32, 4, 0x0A, 2, 3, 4, 0x40, 2])
    req = js.DecodeRequest.FromString(raw)
    assert (req.max_tokens, list(req.token_content.token_ids), req.num_samples) == (5, [3, 4], 2)
    sample = js.DecodeResponse.StreamContent.Sample(text="a", token_ids=[7])
    resp = js.DecodeResponse(stream_content=js.DecodeResponse.StreamContent(samples=[sample]))
    assert resp.SerializeToString() == bytes([0x1A, 8, 0x0A, 6, 0x0A, 1, 0x61, 0x12, 1, 7])
    assert js.DESCRIPTOR.services_by_name["Orchestrator"].full_name == "jetstream_proto.Orchestrator"


@pytest.mark.parametrize("request_kwargs, message", [
    ({"max_tokens": 4, "token_content": js.DecodeRequest.TokenContent(token_ids=[])},
     "prompt is empty"),
    ({"max_tokens": 4, "token_content": js.DecodeRequest.TokenContent(token_ids=[3] * 41)},
     "prompt has 41 tokens; the limit is 40"),
    ({"max_tokens": 0, "token_content": js.DecodeRequest.TokenContent(token_ids=[3])},
     "max_tokens=0 must be >= 1"),
    ({"max_tokens": -3, "token_content": js.DecodeRequest.TokenContent(token_ids=[3])},
     "max_tokens=-3 must be >= 1"),
    ({"max_tokens": 500, "token_content": js.DecodeRequest.TokenContent(token_ids=[3])},
     "max_tokens=500 is over the limit"),
    ({"max_tokens": 4, "token_content": js.DecodeRequest.TokenContent(token_ids=[3, 99])},
     r"token id 99 is outside the vocabulary \[0, 32\)"),
    ({"max_tokens": 4, "text_content": js.DecodeRequest.TextContent(text="12+x")},
     "cannot tokenize the text: character 'x'"),
    ({"max_tokens": 4}, "neither text_content nor token_content"),
])
def test_bad_requests_get_invalid_argument(channel, request_kwargs, message):
    stub = js_grpc.OrchestratorStub(channel)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Decode(js.DecodeRequest(**request_kwargs), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == message or __import__("re").search(message, err.value.details())
    assert len(_decode(stub, [3, 4, 5], 2)) >= 1  # still serving


def test_disconnected_client_frees_its_slot(channel, server):
    stub = js_grpc.OrchestratorStub(channel)
    slots = server.orchestrator.engine.max_concurrent_decodes
    calls = []
    for p in prompts(*[5] * slots, seed=13):  # fill every slot with a long request
        call = stub.Decode(js.DecodeRequest(
            max_tokens=50, token_content=js.DecodeRequest.TokenContent(token_ids=p)))
        next(call)
        calls.append(call)
    for call in calls:
        call.cancel()
    # A request needing every slot at once can only run once all of them are back.
    g = gen_grpc.GenerationStub(channel)
    out = list(g.Generate(gen.GenerateRequest(
        token_ids=gen.TokenIds(ids=[3, 4]),
        sampling=gen.SamplingOptions(max_tokens=3, temperature=1.0, n=slots, ignore_eos=True)),
        timeout=60))
    assert sorted(r.finish_reason for r in out if r.finish_reason) == ["length"] * slots


def test_generation_service_reports_logprobs_and_versions(channel, model):
    g = gen_grpc.GenerationStub(channel)
    prompt = prompts(6, seed=14)[0]
    out = list(g.Generate(gen.GenerateRequest(
        token_ids=gen.TokenIds(ids=prompt),
        sampling=gen.SamplingOptions(max_tokens=5, temperature=1.0, seed=3, ignore_eos=True)),
        timeout=60))
    tokens = [r.token_ids[0] for r in out if r.token_ids]
    logprobs = [r.logprobs[0] for r in out if r.token_ids]
    assert out[-1].finish_reason == "length" and len(tokens) == 5
    logp = jax.nn.log_softmax(np.asarray(model(np.asarray([prompt + tokens])))[0], axis=-1)
    np.testing.assert_allclose(logprobs, [logp[len(prompt) - 1 + i, t]
                                          for i, t in enumerate(tokens)], atol=1e-4)
    assert {r.versions[0] for r in out if r.token_ids} == {0}


def test_gathered_streaming_sends_the_same_samples_in_fewer_messages(channel):
    """stream_interval_ms: each sample's tokens gathered into few messages, in order, the
    samples (tokens, log-probs, versions, text, finish reason) those of per-token streaming."""
    g = gen_grpc.GenerationStub(channel)
    sampling = gen.SamplingOptions(max_tokens=24, temperature=1.0, seed=5, n=4, ignore_eos=True)

    def samples(interval_ms):
        out = list(g.Generate(gen.GenerateRequest(
            token_ids=gen.TokenIds(ids=prompts(7, seed=15)[0]), sampling=sampling,
            stream_interval_ms=interval_ms), timeout=60))
        per_sample = {i: [r for r in out if r.sample_index == i] for i in range(4)}
        return len(out), {i: ([t for r in rs for t in r.token_ids],
                              [x for r in rs for x in r.logprobs],
                              [v for r in rs for v in r.versions],
                              "".join(r.text for r in rs), rs[-1].finish_reason)
                          for i, rs in per_sample.items()}

    each, per_token = samples(0)
    gathered, by_interval = samples(60_000)     # everything in one message per sample
    assert by_interval == per_token
    assert each == 4 * 25 and gathered == 4 * 2   # the tokens, then the end, of each sample


def _push(channel, pieces):
    return gen_grpc.GenerationStub(channel).UpdateWeights(
        iter(pieces), timeout=60, metadata=[("authorization", f"Bearer {TOKEN}")])


def test_hostile_weight_updates_are_refused_and_serving_goes_on(channel, server, params, model):
    """Each kind of bad stream gets its status and a message naming the tensor and bytes; none
    changes the served weights or version, and the server keeps generating."""
    good = list(weight_pieces(params, 3, piece_bytes=256))
    embed = [i for i, p in enumerate(good) if p.name == "embed"]
    overlap = good[:]
    overlap.insert(embed[1], gen.WeightPiece(**{**_fields(good[embed[0]]), "offset": 128}))
    huge = gen.WeightPiece(**{**_fields(good[0]), "shape": [2**40]})
    cases = [
        (good[:embed[1]] + good[embed[1] + 1:], grpc.StatusCode.INVALID_ARGUMENT,
         r"embed has no bytes \[256, 512\)"),
        (overlap, grpc.StatusCode.INVALID_ARGUMENT,
         r"embed: piece of bytes \[128, 384\) overlaps the piece of bytes \[0, 256\)"),
        (good[:-1], grpc.StatusCode.INVALID_ARGUMENT, "incomplete"),
        ([huge], grpc.StatusCode.INVALID_ARGUMENT, r"declared shape \(1099511627776,\)"),
        (list(weight_pieces(params, 0)), grpc.StatusCode.FAILED_PRECONDITION,
         "version 0 is not newer than the served version 0"),
    ]
    g = gen_grpc.GenerationStub(channel)
    for stream, code, message in cases:
        with pytest.raises(grpc.RpcError) as err:
            _push(channel, stream)
        assert err.value.code() == code and re.search(message, err.value.details()), \
            err.value.details()
        assert json.loads(g.GetMetrics(gen.MetricsRequest()).json)["version"] == 0
    prompt = prompts(5, seed=12)[0]
    out = list(g.Generate(gen.GenerateRequest(
        token_ids=gen.TokenIds(ids=prompt),
        sampling=gen.SamplingOptions(max_tokens=4, temperature=0.0, ignore_eos=True))))
    assert [t for r in out for t in r.token_ids] == greedy_generate(model, [prompt], 4, -1)[0]


def _fields(piece):
    return {f.name: getattr(piece, f.name) for f in piece.DESCRIPTOR.fields}


def test_weight_updates_need_the_secret(channel, server, params):
    g = gen_grpc.GenerationStub(channel)
    with pytest.raises(grpc.RpcError) as err:
        push_weights(channel, params, 7, token="wrong")
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    bad = dict(params, embed=np.zeros((3, 3), np.float32))
    with pytest.raises(grpc.RpcError) as err:
        push_weights(channel, bad, 7, token=TOKEN)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "embed declared shape (3, 3); the served model needs (32, 32)" in err.value.details()
    assert json.loads(g.GetMetrics(gen.MetricsRequest()).json)["version"] == 0

    reply = push_weights(channel, params, 7, token=TOKEN)
    assert reply.version == 7 and reply.pause_ms < 100
    out = list(g.Generate(gen.GenerateRequest(
        token_ids=gen.TokenIds(ids=[3, 4, 5]),
        sampling=gen.SamplingOptions(max_tokens=3, temperature=0.0, ignore_eos=True))))
    assert {r.versions[0] for r in out if r.token_ids} == {7}
    metrics = json.loads(g.GetMetrics(gen.MetricsRequest()).json)
    assert metrics["version"] == 7 and metrics["updates"] == 1
