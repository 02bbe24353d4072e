"""Generation over gRPC (serving/fleet/client.py's RemoteGeneration against
serving/frontends/server.py) against this process's orchestrator on the same weights: the same
tokens, log-probs and versions; a group carried in continues exactly; refusals, stale versions, bad
tokens and deadlines come back as the errors the Generation interface names."""

import concurrent.futures
import time

import numpy as np
import pytest

from serving.core.orchestrator import Orchestrator
from serving.core.requests import StaleVersion
from serving.core.stream import Sample
from serving.fleet.client import RemoteGeneration
from serving.fleet.generation import Generation
from serving.frontends.server import Server
from serving.runner.engine import Engine
from serving.runner.sampling import SamplingParams
from sharding.reshard import WeightUpdateError
from tests.serving.common import CFG, ENGINE, held_turns, hung_generation_server, prompts, until

TOKEN = "secret"


@pytest.fixture(scope="module")
def server(params):
    engine = Engine(CFG, ENGINE)
    s = Server(Orchestrator(engine, params, eos_id=1).start(), port=0, update_token=TOKEN).start()
    yield s
    s.stop(0)


@pytest.fixture(scope="module")
def remote(server):
    r = RemoteGeneration(server.address, token=TOKEN)
    yield r
    r.close()


@pytest.fixture(scope="module")
def local(params):
    engine = Engine(CFG, ENGINE)
    with Orchestrator(engine, params, eos_id=1) as o:
        yield o


def test_both_implement_the_interface(remote, local):
    assert isinstance(remote, Generation) and isinstance(local, Generation)


@pytest.mark.parametrize("temperature,penalty", [(0.0, 0.0), (0.75, 0.0), (0.75, 1.0)])
def test_remote_equals_local(remote, local, temperature, penalty):
    """Groups of 3 over prompts of several lengths, greedy and sampled (the draws are keyed by
    seed, sample and position), with and without penalties: token for token, log-probs bit for
    bit, versions too."""
    for i, prompt in enumerate(prompts(3, 9, 21, seed=4)):
        sampling = SamplingParams(max_tokens=24, temperature=temperature, seed=11 + i, n=3,
                                  frequency_penalty=penalty, presence_penalty=penalty / 2)
        streams = [local.submit(prompt, sampling), remote.submit(prompt, sampling)]
        want, got = (s.result() for s in streams)
        assert [s.tokens for s in got] == [s.tokens for s in want]
        assert [s.logprobs for s in got] == [s.logprobs for s in want]
        assert [s.versions for s in got] == [s.versions for s in want]
        assert [s.finish_reason for s in got] == [s.finish_reason for s in want]


def test_session_turns_over_grpc(remote, local, server):
    """A two-turn episode through the Generation service: the second turn prefills only its new
    tokens and equals the local engine given the whole history; EndSession frees the pages."""
    first, obs = prompts(9, 3, seed=6)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, stop_at_eos=False)
    [one] = remote.submit(first, greedy, session="remote-episode").result()
    history = first + one.tokens + obs
    before = server.orchestrator.metrics()["prefill_tokens"]
    [two] = remote.submit(history, greedy, session="remote-episode").result()
    assert server.orchestrator.metrics()["prefill_tokens"] - before == 1 + len(obs)
    [want] = local.submit(history, greedy).result()
    assert two.tokens == want.tokens
    np.testing.assert_allclose(two.logprobs, want.logprobs, atol=1e-5)
    assert server.orchestrator.metrics()["sessions_kept"] >= 1
    remote.end_session("remote-episode")
    deadline = time.monotonic() + 30
    while server.orchestrator.metrics()["sessions_kept"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.orchestrator.metrics()["sessions_kept"] == 0


def test_carried_group_continues_remotely(remote, local, server):
    """A group cut part-way (one sample with no token, one finished, one cut) sent with its
    carry ends with the uninterrupted run's samples; the server generates only the rest."""
    prompt = prompts(7, seed=5)[0]
    sampling = SamplingParams(max_tokens=30, temperature=0.9, seed=3, n=3, stop_at_eos=False)
    full = local.submit(prompt, sampling).result()
    cut = [Sample(), full[1], Sample(full[2].tokens[:13], full[2].logprobs[:13],
                                     full[2].versions[:13])]
    before = server.orchestrator.metrics()["generated_tokens"]
    got = remote.submit(prompt, sampling, carry=cut).result()
    assert [s.tokens for s in got] == [s.tokens for s in full]
    # Not bit for bit: the cut sample's re-prefilled prefix makes the batch's longest length,
    # hence the decode attention's length bucket, differ from the uninterrupted run's, and the
    # reduction over a longer (masked) span rounds differently (~1e-7).
    for g, f in zip(got, full):
        np.testing.assert_allclose(g.logprobs, f.logprobs, rtol=1e-5, atol=1e-6)
    generated = server.orchestrator.metrics()["generated_tokens"] - before
    assert generated == 3 * 30 - 30 - 13


def test_refused_request_ends_refused_with_the_reason(remote):
    stream = remote.submit([3, 99], SamplingParams(max_tokens=4))
    [sample] = stream.result()
    assert sample.finish_reason == "refused" and sample.tokens == []
    assert "token id 99 is outside the vocabulary" in stream.error


def test_weight_updates_over_the_interface(remote, server, params):
    version = remote.newest_version + 1
    result = remote.update_params(params, version, timeout=30)
    assert result.version == version == remote.newest_version
    with pytest.raises(StaleVersion, match="not newer"):
        remote.update_params(params, version, timeout=30)
    wrong = RemoteGeneration(server.address, token="not-it")
    with pytest.raises(WeightUpdateError, match="refused"):
        wrong.update_params(params, version + 1, timeout=30)
    wrong.close()
    assert remote.newest_version == version


def _within(seconds: float, fn):
    """fn()'s value, failing the test if it takes longer than `seconds`."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(fn).result(timeout=seconds)


def test_pause_over_grpc_holds_the_engine_until_resume_or_its_lease(remote, server):
    """Partial rollouts with a server (Pause/Resume): a paused server takes a request and
    generates nothing for it until resumed; a lease that runs out resumes it by itself (a
    trainer that died mid-step); pauses need the update token and a lease in (0, 3600]."""
    o = server.orchestrator
    greedy = SamplingParams(max_tokens=30, temperature=0.0, stop_at_eos=False)
    remote.pause(lease_s=120)
    assert o.paused and o.metrics()["paused"]
    before = o.metrics()
    stream = remote.submit(prompts(6, seed=12)[0], greedy)
    until(lambda: o.metrics()["queued"] > 0, what="the request reaching the paused engine")
    held_turns(o)
    during = o.metrics()
    assert (during["generated_tokens"], during["prefill_chunks"]) == \
        (before["generated_tokens"], before["prefill_chunks"])
    remote.resume()
    assert not o.paused
    [sample] = _within(60, stream.result)
    assert len(sample.tokens) == 30

    expired = o.metrics()["pause_leases_expired"]
    remote.pause(lease_s=0.5)
    [sample] = _within(60, remote.submit(prompts(6, seed=13)[0], greedy).result)
    assert len(sample.tokens) == 30 and not o.paused
    assert o.metrics()["pause_leases_expired"] == expired + 1

    wrong = RemoteGeneration(server.address, token="not-it")
    with pytest.raises(ConnectionError, match="UNAUTHENTICATED.*pauses need"):
        wrong.pause(lease_s=10)
    wrong.close()
    for lease in (-1.0, 3601.0):
        with pytest.raises(ConnectionError, match=f"INVALID_ARGUMENT.*lease_s={lease}"):
            remote.pause(lease_s=lease)
    assert not o.paused


@pytest.fixture
def hung_server():
    with hung_generation_server() as address:
        yield address


def test_a_hung_server_fails_by_deadline(hung_server, params):
    address = hung_server
    remote = RemoteGeneration(address, token=TOKEN, rpc_timeout_s=0.5)
    with pytest.raises(ConnectionError, match="DEADLINE_EXCEEDED"):
        remote.metrics()
    with pytest.raises(TimeoutError, match="not done within 0.5 s"):
        remote.update_params(params, 3, timeout=0.5)
    stream = remote.submit([3, 4], SamplingParams(max_tokens=2))
    stream.cancel()
    assert [s.finish_reason for s in stream.result()] == ["cancelled"]
    remote.close()


def test_an_unreachable_server_is_a_connection_error(params):
    remote = RemoteGeneration("127.0.0.1:1", token=TOKEN, rpc_timeout_s=2)
    with pytest.raises(ConnectionError):
        remote.metrics()
    with pytest.raises(ConnectionError):
        remote.update_params(params, 3, timeout=2)
    stream = remote.submit([3, 4], SamplingParams(max_tokens=2))
    [sample] = stream.result()
    assert sample.finish_reason == "lost" and "UNAVAILABLE" in stream.error
    remote.close()


@pytest.mark.parametrize("transfer", ["jax", "tcp"])
def test_pulled_weights_are_served(server, params, transfer):
    """The pull paths (jax: serving/weights/transfer.py, device to device; tcp:
    serving/weights/bulk.py): other weights pulled by the server then generate exactly what a local
    engine holding them generates, at their version; the original weights pulled back (resume) serve
    as before."""
    import jax
    other = jax.tree.map(lambda x: x * 1.5 + 0.01, params)
    puller = RemoteGeneration(server.address, token=TOKEN, transfer=transfer)
    version = puller.newest_version + 1
    result = puller.update_params(other, version, timeout=60)
    assert result.version == version == puller.newest_version
    engine = Engine(CFG, ENGINE)
    sampling = SamplingParams(max_tokens=16, temperature=0.0, n=2)
    with Orchestrator(engine, other, version=version, eos_id=1) as want:
        for prompt in prompts(5, 11, seed=8):
            expected = want.submit(prompt, sampling).result()
            got = puller.submit(prompt, sampling).result()
            assert [s.tokens for s in got] == [s.tokens for s in expected]
            assert {v for s in got for v in s.versions} == {version}
    assert puller.update_params(params, 0, timeout=60, resume=True).version == 0
    # The second pull of the same tensors (tcp: into the first's arrays, reused) serves them.
    with Orchestrator(engine, params, version=0, eos_id=1) as want:
        for prompt in prompts(5, seed=9):
            expected = want.submit(prompt, sampling).result()
            got = puller.submit(prompt, sampling).result()
            assert [s.tokens for s in got] == [s.tokens for s in expected]
    puller.close()


@pytest.mark.parametrize("transfer", ["jax", "tcp"])
def test_a_pull_that_does_not_fit_or_holds_a_nan_is_refused(server, params, transfer):
    import jax
    puller = RemoteGeneration(server.address, token=TOKEN, transfer=transfer)
    version = puller.newest_version
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    (path, first), = flat[:1]
    wrong = jax.tree_util.tree_unflatten(jax.tree.structure(params),
                                         [first[..., :1]] + [x for _, x in flat[1:]])
    with pytest.raises(WeightUpdateError, match=r"has shape .* the served model needs"):
        puller.update_params(wrong, version + 1, timeout=30)
    poisoned = np.array(first, copy=True)
    poisoned.flat[3] = np.nan
    nan = jax.tree_util.tree_unflatten(jax.tree.structure(params),
                                       [poisoned] + [x for _, x in flat[1:]])
    name = "/".join(str(getattr(k, "key", k)) for k in path)
    with pytest.raises(WeightUpdateError, match=f"{name} contains NaN or Inf"):
        puller.update_params(nan, version + 1, timeout=30)
    with pytest.raises(StaleVersion, match="not newer"):
        puller.update_params(params, version, timeout=30)
    stranger = RemoteGeneration(server.address, token="not-it", transfer=transfer)
    with pytest.raises(WeightUpdateError, match="refused"):
        stranger.update_params(params, version + 1, timeout=30)
    stranger.close()
    assert puller.newest_version == version
    puller.close()


def test_a_tcp_pull_cut_short_applies_nothing(server, params):
    """A bulk source that sends half the bytes and goes: the pull is UNAVAILABLE, the server
    keeps its weights and version and goes on serving; an unknown transport is refused."""
    import socket
    import threading

    import grpc
    import jax

    from serving.proto import generation_pb2 as gen
    from serving.proto import generation_pb2_grpc as gen_grpc

    flat = [(("/".join(str(k.key) for k in path)), np.asarray(x))
            for path, x in jax.tree_util.tree_flatten_with_path(params)[0]]
    total = sum(x.nbytes for _, x in flat)
    listener = socket.create_server(("127.0.0.1", 0))

    def half_then_gone():
        sock, _ = listener.accept()
        with sock:
            sock.recv(16)
            sock.sendall(b"\1" + bytes(total // 2))

    threading.Thread(target=half_then_gone, daemon=True).start()
    remote = RemoteGeneration(server.address, token=TOKEN)
    version = remote.newest_version
    stub = gen_grpc.GenerationStub(grpc.insecure_channel(server.address))
    request = gen.PullRequest(
        version=version + 1, address=f"127.0.0.1:{listener.getsockname()[1]}", uuid=1,
        transport="tcp", tensors=[gen.TensorSpec(name=n, shape=list(x.shape),
                                                 dtype=x.dtype.name) for n, x in flat])
    auth = [("authorization", f"Bearer {TOKEN}")]
    with pytest.raises(grpc.RpcError) as cut:
        stub.PullWeights(request, timeout=60, metadata=auth)
    assert cut.value.code() == grpc.StatusCode.UNAVAILABLE and "ended the offer" in \
        cut.value.details()
    request.transport = "carrier-pigeon"
    with pytest.raises(grpc.RpcError) as bogus:
        stub.PullWeights(request, timeout=60, metadata=auth)
    assert bogus.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "carrier-pigeon" in bogus.value.details()
    assert remote.newest_version == version
    [sample] = remote.submit([3, 4], SamplingParams(max_tokens=2, temperature=0.0)).result()
    assert sample.finish_reason == "length" and set(sample.versions) == {version}
    listener.close()
    remote.close()
