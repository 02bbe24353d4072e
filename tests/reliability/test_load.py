"""`jaxrl serve` under load, as JetStream's own clients drive it: 1,000 Decode streams open at
once, 10,000 requests of which 10% are malformed, and storms of clients that disconnect
mid-stream. Every malformed request is refused with INVALID_ARGUMENT, every good one is
answered, the server keeps no slot, page or queue entry of a client that left, and its memory
returns to where it was."""

import asyncio
import json
import random
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from serving.proto import generation_pb2 as gen
from serving.proto import generation_pb2_grpc as gen_grpc
from serving.proto import jetstream_pb2 as js
from serving.proto import jetstream_pb2_grpc as js_grpc
from tests.xla import running_env

pytestmark = pytest.mark.slow

STREAMS, REQUESTS, MALFORMED, STORMS = 1000, 10_000, 0.1, 3


def _text(text, max_tokens=3):
    return js.DecodeRequest(max_tokens=max_tokens,
                            text_content=js.DecodeRequest.TextContent(text=text))


def _tokens(ids, max_tokens=3, n=0):
    return js.DecodeRequest(max_tokens=max_tokens, num_samples=n,
                            token_content=js.DecodeRequest.TokenContent(token_ids=ids))


MALFORMED_KINDS = [
    js.DecodeRequest(max_tokens=3),                      # no content at all
    _tokens([5, 10**6]),                                 # a token id outside the vocabulary
    _tokens([5, -3]),
    _tokens([]),                                         # an empty prompt
    _tokens([5] * 500),                                  # a prompt over --max-prefill-length
    _tokens([5, 6], max_tokens=10**6),                   # more tokens than the context holds
    _tokens([5, 6], max_tokens=0),
    _tokens([5, 6], n=10**4),                            # more samples than slots
    _text("12+34=\u00e9"),                               # a character the tokenizer lacks
]


def request(rng: random.Random) -> tuple[js.DecodeRequest, bool]:
    if rng.random() < MALFORMED:
        return rng.choice(MALFORMED_KINDS), False
    a, b = rng.randrange(100), rng.randrange(100)
    if rng.random() < 0.5:
        return _text(f"{a}+{b}=", max_tokens=rng.randint(1, 4)), True
    return _tokens([rng.randrange(3, 32) for _ in range(rng.randint(1, 12))],
                   max_tokens=rng.randint(1, 4)), True


async def decode(stub, req, cancel_after: int | None = None) -> str:
    """The status a client sees: OK, a gRPC code's name, or "left" when it went away."""
    call = stub.Decode(req, timeout=300)
    seen = 0
    try:
        async for _ in call:
            seen += 1
            if cancel_after is not None and seen >= cancel_after:
                call.cancel()
                return "left"
        return "OK"
    except grpc.aio.AioRpcError as e:
        return e.code().name


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("serve")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxrl.cli", "serve", "--port", "0", "--checkpoint",
         str(cwd / "none"), "--slots", "64", "--max-len", "40", "--max-prefill-length", "16",
         "--page-size", "4",
         "--max-queued", "4096", "--max-concurrent-rpcs", "2048"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
        env=running_env())
    try:
        for line in proc.stdout:
            if "ready on" in line:
                break
        else:
            raise AssertionError("jaxrl serve did not start")
        yield proc, line.split("ready on ")[1].split(": ")[0]
    finally:
        proc.kill()
        proc.communicate(timeout=60)


async def _load(address: str, pid: int) -> dict:
    rng = random.Random(0)
    out = {}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = js_grpc.OrchestratorStub(channel)
        metrics = gen_grpc.GenerationStub(channel)

        async def idle() -> dict:
            """The server's counters once nothing is in flight any more."""
            for _ in range(600):
                m = json.loads((await metrics.GetMetrics(gen.MetricsRequest())).json)
                if m["queued"] == 0 and m["pages_free"] == m["pages_total"]:
                    return m
                await asyncio.sleep(0.05)
            raise AssertionError(f"the server did not drain: {m}")

        # 1,000 streams open at once (the engine has 64 slots: most wait in its queue).
        first = [request(rng) for _ in range(STREAMS)]
        statuses = await asyncio.gather(*(decode(stub, r) for r, _ in first))
        # The rest of the 10,000, at most 1,000 in flight.
        rest = [request(rng) for _ in range(REQUESTS - STREAMS)]
        gate = asyncio.Semaphore(STREAMS)

        async def gated(req):
            async with gate:
                return await decode(stub, req)

        statuses += await asyncio.gather(*(gated(r) for r, _ in rest))
        out["results"] = list(zip([ok for _, ok in first + rest], statuses))

        def storm_requests():
            return [_tokens([rng.randrange(3, 32) for _ in range(6)], max_tokens=20)
                    for _ in range(STREAMS)]

        # 1,000 longer streams to the end, so that every program the storms need (longer page
        # tables) is compiled before the memory is measured.
        assert set(await asyncio.gather(*(decode(stub, r) for r in storm_requests()))) == {"OK"}
        await idle()
        out["rss_start"] = rss_kib(pid)      # serving 1,000 streams at a time: its working size
        # Disconnect storms: 1,000 clients each, gone after their first token or before any.
        for _ in range(STORMS):
            left = await asyncio.gather(*(decode(stub, r, cancel_after=1) if k % 2 else
                                          _gone(stub, r) for k, r in enumerate(storm_requests())))
            assert set(left) <= {"left", "OK", "CANCELLED"}, set(left)
            out.setdefault("storm_metrics", []).append(await idle())
            out.setdefault("rss_after_storm", []).append(rss_kib(pid))
        out["after"] = await decode(stub, _text("1+1=", 2))
        out["live"] = (await stub.HealthCheck(js.HealthCheckRequest())).is_live
    return out


async def _gone(stub, req) -> str:
    """A client that sends its request and disconnects before any answer."""
    call = stub.Decode(req, timeout=300)
    await asyncio.sleep(0.01)
    call.cancel()
    return "left"


def test_a_thousand_streams_malformed_requests_and_disconnect_storms(server):
    proc, address = server
    out = asyncio.run(_load(address, proc.pid))
    results = out["results"]
    assert len(results) == REQUESTS
    bad = [status for ok, status in results if not ok]
    good = [status for ok, status in results if ok]
    assert len(bad) >= 0.08 * REQUESTS
    assert set(bad) == {"INVALID_ARGUMENT"}                 # every malformed one refused
    assert set(good) == {"OK"}                              # every good one answered
    assert out["after"] == "OK" and out["live"]
    # Nothing of the clients that left is kept, and memory returns to where it was.
    for m in out["storm_metrics"]:
        assert m["queued"] == 0 and m["pages_free"] == m["pages_total"]
    assert max(out["rss_after_storm"]) <= 1.10 * out["rss_start"], out
