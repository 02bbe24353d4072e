"""The rollout fleet (jaxrl/rollout/fleet.py) and the weight publisher (jaxrl/rollout/publisher.py):
dispatch by load, a lost member's groups continued elsewhere from their tokens (against an
uninterrupted run), members set aside and brought back to the newest weights, pushes that pass
their deadline, and a fleet with no member left failing instead of hanging."""

import threading
import time

import numpy as np
import pytest
from flax import nnx

from jaxrl.models import Transformer, split_params
from jaxrl.rollout.fleet import Fleet, Member, MemberState, NoGeneration
from jaxrl.rollout.publisher import WeightPublisher
from serving.core.orchestrator import Orchestrator, UpdateResult
from serving.core.stream import RequestStream, Sample, TokenEvent
from serving.fleet.client import RemoteGeneration
from serving.frontends.server import Server
from serving.runner.engine import Engine
from serving.runner.sampling import SamplingParams
from tests.serving.common import CFG, ENGINE, hung_generation_server, prompts

pytestmark = pytest.mark.slow


class FakeGeneration:
    """A Generation whose streams the test drives by hand."""

    def __init__(self, version=0):
        self.submitted = []          # (prompt, sampling, carry, stream)
        self.pushed = []             # versions received
        self.version = version
        self.down = False            # metrics and pushes fail while set
        self.push_error = None
        self.sessions, self.ended = [], []

    def submit(self, prompt, sampling, *, predicted_len=None, carry=None, session=None):
        stream = RequestStream(len(self.submitted), sampling.n)
        self.submitted.append((list(prompt), sampling, carry, stream))
        self.sessions.append(session)
        return stream

    def end_session(self, key):
        self.ended.append(key)

    def update_params(self, params, version, timeout=None, *, resume=False):
        if self.push_error is not None:
            raise self.push_error
        self.pushed.append(version)
        self.version = version
        return UpdateResult(version, 0.0, 0.0)

    def metrics(self, timeout=None):
        if self.down:
            raise ConnectionError("UNAVAILABLE: it is down")
        return {"version": self.version, "slots": 4}

    @property
    def newest_version(self):
        return self.version

    def pause(self, timeout=60.0, lease_s=None):
        if self.down:
            raise ConnectionError("UNAVAILABLE: it is down")
        self.paused = lease_s

    def resume(self):
        self.paused = "resumed"


def member(name, gen, slots=4, remote=True, version=0):
    return Member(name, gen, slots, remote=remote, version=version, state=MemberState.READY)


def finish(stream, tokens=(5, 6)):
    for i in range(stream.n):
        for t in tokens:
            stream.put(TokenEvent(i, t, -0.5, 0))
    stream.end("length")


SAMPLING = SamplingParams(max_tokens=8, temperature=1.0, seed=1, n=2)


def test_groups_go_where_there_is_room():
    """Slots 4 and 12: eight groups of two split 4:12 samples, and a member whose groups
    finish takes the next ones."""
    small, big = FakeGeneration(), FakeGeneration()
    fleet = Fleet([member("small", small, 4, remote=False),
                   member("big", big, 12, remote=False)], eos_id=1)
    streams = [fleet.submit([3], SAMPLING) for _ in range(8)]
    assert (len(small.submitted), len(big.submitted)) == (2, 6)
    for s in streams:
        if s.member.name == "big":
            finish(s._stream)
            s.result()
    more = [fleet.submit([3], SAMPLING) for _ in range(3)]
    assert [s.member.name for s in more] == ["big"] * 3
    fleet.close()


def test_partial_rollouts_pause_every_member_that_answers():
    """Servers get the lease, the in-process engine none (nothing to outlive); a member that
    cannot be paused is said and the others still are; a member set aside is not called."""
    local, good, bad, aside = (FakeGeneration() for _ in range(4))
    bad.down = True
    warned = []
    fleet = Fleet([member("local", local, remote=False), member("good", good),
                   member("bad", bad), member("aside", aside)], eos_id=1, heartbeat_s=3600,
                  warn=warned.append)
    fleet.set_aside(fleet.members[3], "down for the test")
    fleet.pause(lease_s=600)
    assert (local.paused, good.paused) == (None, 600) and not hasattr(aside, "paused")
    assert [w for w in warned if "could not pause bad" in w and "it is down" in w]
    fleet.resume()
    assert local.paused == good.paused == "resumed" and not hasattr(aside, "paused")
    fleet.close()


def test_a_session_s_turns_go_where_its_pages_are_kept():
    """An episode's later turns go to the member that ran its first, even when another has
    more room; with that member set aside they go elsewhere (which prefills the history), and
    ending the session reaches the member holding it."""
    a, b = FakeGeneration(), FakeGeneration()
    fleet = Fleet([member("a", a), member("b", b)], eos_id=1, heartbeat_s=30,
                  warn=lambda _: None)
    turn = SamplingParams(max_tokens=8, n=1)
    first = fleet.submit([3], SamplingParams(max_tokens=8, n=2), session=["e0", "e1"])
    assert first.member.name == "a" and a.sessions == [["e0", "e1"]]
    fleet.submit([4], SAMPLING)                             # b is now the less loaded
    again = fleet.submit([3, 5, 6], turn, session="e1")
    assert again.member.name == "a" and a.sessions[-1] == "e1"
    fleet.set_aside(fleet.members[0], "test")
    moved = fleet.submit([3, 5, 6, 7], turn, session="e1")
    assert moved.member.name == "b" and b.sessions[-1] == "e1"
    fleet.end_session("e1")
    assert b.ended == ["e1"] and a.ended == []
    fleet.close()


def test_a_lost_group_continues_elsewhere_from_its_tokens():
    a, b = FakeGeneration(), FakeGeneration()
    warnings = []
    fleet = Fleet([member("a", a), member("b", b)], eos_id=1, heartbeat_s=30,
                  warn=warnings.append)
    stream = fleet.submit([3, 4], SAMPLING)
    assert stream.member.name == "a"
    first = a.submitted[0][3]
    first.put(TokenEvent(0, 7, -0.1, 0))
    first.put(TokenEvent(0, 8, -0.2, 0))
    first.put(TokenEvent(1, 9, -0.3, 0))
    first.error = "UNAVAILABLE: connection reset"
    first.end("lost")
    done = {}
    reader = threading.Thread(target=lambda: done.update(samples=stream.result()))
    reader.start()
    deadline = time.monotonic() + 30
    while not b.submitted and time.monotonic() < deadline:
        time.sleep(0.01)
    prompt, sampling, carry, second = b.submitted[0]
    assert (prompt, sampling) == ([3, 4], SAMPLING)
    assert [(s.tokens, s.logprobs, s.versions) for s in carry] == [
        ([7, 8], [-0.1, -0.2], [0, 0]), ([9], [-0.3], [0])]
    finish(second, tokens=(1,))
    reader.join(30)
    assert [s.finish_reason for s in done["samples"]] == ["length", "length"]
    assert not fleet.members[0].alive and fleet.members[1].ready
    assert fleet.stats["groups_moved"] == 1
    assert "a set aside (UNAVAILABLE: connection reset)" in warnings[0]
    fleet.close()


def test_a_member_back_from_failure_gets_the_newest_weights_before_work():
    """a fails; v6 is published while it is away; it answers again at v5, is pushed v6 and only
    then takes groups again."""
    a, b = FakeGeneration(), FakeGeneration()
    fleet = Fleet([member("a", a), member("b", b)], eos_id=1, heartbeat_s=0.05,
                  warn=lambda _: None)
    publisher = WeightPublisher(fleet, deadline_s=5, warn=lambda _: None)
    params = {"w": np.ones(3, np.float32)}
    publisher.publish(params, 5)
    wait_for(lambda: a.pushed == [5] and b.pushed == [5])
    a.down = True
    wait_for(lambda: not fleet.members[0].alive)
    publisher.publish(params, 6)
    wait_for(lambda: b.pushed == [5, 6])
    assert [fleet.submit([3], SAMPLING).member.name for _ in range(3)] == ["b"] * 3
    a.down = False
    wait_for(lambda: fleet.members[0].ready)
    assert a.pushed == [5, 6]          # pushed v6 before it was ready again
    assert fleet.submit([3], SAMPLING).member.name == "a"
    publisher.close()
    fleet.close()


def test_a_failed_push_sets_the_member_aside_and_is_counted():
    a, b = FakeGeneration(), FakeGeneration()
    a.push_error = TimeoutError("weights version 1 to a: not done within 5 s")
    fleet = Fleet([member("a", a), member("b", b)], eos_id=1, heartbeat_s=30,
                  warn=lambda _: None)
    publisher = WeightPublisher(fleet, deadline_s=5, warn=lambda _: None)
    publisher.publish({"w": np.ones(3, np.float32)}, 1)
    assert [m.name for m in publisher.wait(1)] == ["b"]
    assert publisher.metrics()["push_timeouts"] == 1
    assert "not done within 5 s" in fleet.members[0].why_down
    publisher.close()
    fleet.close()


def test_a_hung_server_push_times_out_within_its_deadline():
    """A real gRPC server that accepts the weight stream and never answers: the push ends at
    its deadline, the member is set aside, the other keeps the run going, the metric says so."""
    good = FakeGeneration()
    with hung_generation_server() as address:
        hung = RemoteGeneration(address, token="t", rpc_timeout_s=60)
        fleet = Fleet([member("hung", hung), member("good", good)], eos_id=1,
                      heartbeat_s=60, warn=lambda _: None)
        publisher = WeightPublisher(fleet, deadline_s=0.5, warn=lambda _: None)
        t0 = time.monotonic()
        publisher.publish({"w": np.ones(3, np.float32)}, 1)
        assert [m.name for m in publisher.wait(1)] == ["good"]
        assert publisher.metrics()["push_timeouts"] == 1
        assert time.monotonic() - t0 < 30      # the deadline (0.5 s) ended it, not a hang
        assert fleet.submit([3], SAMPLING).member.name == "good"
        publisher.close()
        fleet.close()
        hung.close()


def test_no_member_left_fails_instead_of_hanging():
    a = FakeGeneration()
    fleet = Fleet([member("a", a)], eos_id=1, heartbeat_s=30, wait_s=0.2,
                  warn=lambda _: None)
    fleet.set_aside(fleet.members[0], "gone for the test")
    with pytest.raises(NoGeneration, match="a: gone for the test"):
        fleet.submit([3], SAMPLING)
    fleet.close()


def wait_for(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


# -- a real server lost mid-group ------------------------------------------------------------------

class StallingOrchestrator(Orchestrator):
    """Stops its engine loop (inside `_push`) after `after` tokens: the server then dies with
    exactly that much of the group generated."""

    def __init__(self, *args, after: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.after, self.pushed = after, 0
        self.stalled, self.release = threading.Event(), threading.Event()
        push = self._loop._push

        def stalling_push(seq, token, logprob, version):
            if self.pushed == self.after:
                self.stalled.set()
                self.release.wait(60)
                return 0
            self.pushed += 1
            return push(seq, token, logprob, version)

        self._loop._push = stalling_push


def test_a_killed_server_s_group_ends_as_if_uninterrupted():
    """Server a stops after 17 tokens of a sampled group of 3; the fleet continues the group on
    server b from those tokens. The samples equal an uninterrupted run's, token for token (log-
    probs within 1e-5), and b generates only what a had not."""
    params = split_params(Transformer(CFG, rngs=nnx.Rngs(0)))[1]

    def engine():
        return Engine(CFG, ENGINE)

    stalling = StallingOrchestrator(engine(), params, eos_id=1, after=17).start()
    a = Server(stalling, port=0).start()
    b = Server(Orchestrator(engine(), params, eos_id=1).start(), port=0).start()
    prompt = prompts(6, seed=9)[0]
    sampling = SamplingParams(max_tokens=40, temperature=0.9, seed=5, n=3, stop_at_eos=False)
    with Orchestrator(engine(), params, eos_id=1) as reference:
        want = reference.submit(prompt, sampling).result()
    ra, rb = RemoteGeneration(a.address), RemoteGeneration(b.address)
    fleet = Fleet([member("a", ra), member("b", rb)], eos_id=1, heartbeat_s=60,
                  warn=lambda _: None)
    stream = fleet.submit(prompt, sampling)
    assert stream.member.name == "a"
    assert stalling.stalled.wait(60)
    wait_for(lambda: sum(len(s.tokens) for s in stream.snapshot()) == 17)
    a._server.stop(0)                       # the server goes; its engine is stuck
    got = stream.result()
    stalling.release.set()
    assert [s.tokens for s in got] == [s.tokens for s in want]
    for x, y in zip(got, want):   # past the cut, from a recomputed prefix: float rounding
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
    assert fleet.stats["groups_moved"] == 1 and stream.member.name == "b"
    assert b.orchestrator.metrics()["generated_tokens"] == 3 * 40 - 17
    fleet.close()
    for r in (ra, rb):
        r.close()
    b.stop(0)
    stalling.stop()


def test_the_trainers_devices_generate_while_lent_and_their_groups_move_when_withdrawn():
    """rl.multiplex's member: resting until lent; lent, it takes a group beside the server;
    withdrawn after 17 tokens of it, the group continues on the server from those tokens and
    ends as an uninterrupted run's (token for token), nothing generated twice, and the
    trainer's engine is paused (its devices train) and takes no more work until lent again."""
    params = split_params(Transformer(CFG, rngs=nnx.Rngs(0)))[1]
    sampling = SamplingParams(max_tokens=40, temperature=0.9, seed=5, n=3, stop_at_eos=False)
    two = prompts(6, 9, seed=9)
    with Orchestrator(Engine(CFG, ENGINE), params, eos_id=1) as reference:
        want = [reference.submit(p, sampling).result() for p in two]
    server = Orchestrator(Engine(CFG, ENGINE), params, eos_id=1).start()
    trainer = StallingOrchestrator(Engine(CFG, ENGINE), params, eos_id=1, after=17).start()
    trainer.pause()
    lender = Member("trainer", trainer, ENGINE.max_concurrent_decodes, remote=False,
                    version=0, state=MemberState.RESTING, tags=frozenset({"train", "generate"}))
    fleet = Fleet([member("server", server, remote=False), lender], eos_id=1,
                  warn=lambda _: None)
    try:
        assert not lender.ready and fleet.slots == ENGINE.max_concurrent_decodes
        fleet.lend(lender)
        assert lender.ready and not trainer.paused
        streams = [fleet.submit(p, sampling) for p in two]
        assert sorted(s.member.name for s in streams) == ["server", "trainer"]
        assert trainer.stalled.wait(60)
        withdrawing = threading.Thread(target=fleet.withdraw, args=(lender,))
        withdrawing.start()
        lent = next(s for s in streams if s.member is lender)
        wait_for(lambda: lent._stream.cancelled)
        trainer.release.set()
        withdrawing.join(60)
        assert not withdrawing.is_alive() and trainer.paused and not lender.ready
        got = [s.result() for s in streams]
        for g, w in zip(got, want):
            assert [s.tokens for s in g] == [s.tokens for s in w]
            for x, y in zip(g, w):
                np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
        assert fleet.stats["groups_withdrawn"] == 1 and lent.member.name == "server"
        made = {name: m["generated_tokens"] for name, m in
                [("server", server.metrics()), ("trainer", trainer.metrics())]}
        assert made == {"server": 2 * 3 * 40 - 17, "trainer": 17}
        assert fleet.metrics()["trainer_generated_tokens"] == 17
        assert fleet.submit(two[0], sampling).member.name == "server"   # resting: no work
    finally:
        fleet.close()
        server.stop()
        trainer.stop()


def test_sample_snapshot_is_a_copy():
    """What a checkpoint keeps of a fleet group does not change as the group goes on."""
    a = FakeGeneration()
    fleet = Fleet([member("a", a, remote=False)], eos_id=1)
    stream = fleet.submit([3], SAMPLING)
    a.submitted[0][3].put(TokenEvent(0, 4, -1.0, 0))
    snap = stream.snapshot()
    a.submitted[0][3].put(TokenEvent(0, 5, -1.0, 0))
    assert snap == [Sample([4], [-1.0], [0]), Sample()]
    fleet.close()


def test_a_resumed_trainer_brings_a_server_back_to_its_version():
    """A server left at version 7 by a trainer that then crashed; the trainer resumes from its
    checkpoint at 5: the server is given version 5 (a `resume` push) before it takes work, and
    its tokens then carry version 5."""
    params = split_params(Transformer(CFG, rngs=nnx.Rngs(0)))[1]
    engine = Engine(CFG, ENGINE)
    server = Server(Orchestrator(engine, params, version=-1, eos_id=1).start(), port=0,
                    update_token="t").start()
    before = RemoteGeneration(server.address, token="t")
    before.update_params(params, 7, timeout=60)
    before.close()
    remote = RemoteGeneration(server.address, token="t")
    fleet = Fleet([Member("s", remote, 4, remote=True)], eos_id=1, heartbeat_s=60,
                  warn=lambda _: None)
    assert not fleet.members[0].ready          # version 7 is not this trainer's
    publisher = WeightPublisher(fleet, deadline_s=60, warn=lambda _: None)
    publisher.publish(params, 5)
    assert [m.name for m in publisher.wait(5)] == ["s"]
    assert remote.newest_version == 5
    samples = fleet.submit([3, 4], SamplingParams(max_tokens=3, temperature=0.0,
                                                  stop_at_eos=False)).result()
    assert samples[0].versions == [5, 5, 5]
    publisher.close()
    fleet.close()
    remote.close()
    server.stop(0)


def _tcp_servers(params, before, n: int = 3):
    """`n` in-process servers and tcp clients of them, each push to one preceded by
    `before(its address, the push's keyword arguments)` (which may raise, as the push would)."""
    servers = [Server(Orchestrator(Engine(CFG, ENGINE), params, version=-1, eos_id=1).start(),
                      port=0, update_token="t").start() for _ in range(n)]
    remotes = [RemoteGeneration(s.address, token="t", transfer="tcp") for s in servers]
    for r in remotes:
        push = r.update_params

        def watched(*args, push=push, address=r.address, **kwargs):
            before(address, kwargs)
            return push(*args, **kwargs)

        r.update_params = watched
    return servers, remotes


def test_tcp_pushes_travel_a_relay_chain():
    """rl.generation.transfer=tcp with three servers: the first pulls the update from the
    trainer, each of the others from the server before it (which relays what it receives), and
    every one then serves the new weights, generating what an engine holding them generates.
    On this host the second and third serve from the first's slab itself; three updates in a
    row show no server's weights change under it as the slabs are refilled."""
    import jax
    params = split_params(Transformer(CFG, rngs=nnx.Rngs(0)))[1]
    routes = []
    servers, remotes = _tcp_servers(params, lambda address, route: routes.append(
        (address, route.get("pull_from"))))
    members = [Member(r.address, r, 4, remote=True, last_metrics=r.metrics()) for r in remotes]
    fleet = Fleet(members, eos_id=1, heartbeat_s=60, warn=lambda _: None)
    publisher = WeightPublisher(fleet, deadline_s=60, warn=lambda _: None)
    relays = {m.last_metrics["bulk_address"] for m in members}
    sampling = SamplingParams(max_tokens=6, temperature=0.0, stop_at_eos=False)
    for version in (3, 4, 5):
        weights = jax.tree.map(lambda x, v=version: x * (1.0 + v / 10) + 0.01, params)
        routes.clear()
        publisher.publish(weights, version)
        assert sorted(m.name for m in publisher.wait(version)) == \
            sorted(r.address for r in remotes)
        sources = [source for _, source in routes]
        assert sources.count(None) == 1            # the trainer sent the update once
        assert all(source[0] in relays for source in sources if source is not None)
        with Orchestrator(Engine(CFG, ENGINE), weights, version=version, eos_id=1) as want:
            expected = want.submit([3, 4, 5], sampling).result()[0].tokens
        for r in remotes:
            [sample] = r.submit([3, 4, 5], sampling).result()
            assert sample.tokens == expected and set(sample.versions) == {version}
    publisher.close()
    fleet.close()
    for r, s in zip(remotes, servers):
        r.close()
        s.stop(0)


def test_a_relay_dying_mid_push_sends_its_chain_back_to_the_trainer():
    """A tcp push whose upstream relay fails (here: every pull from a relay fails, as when the
    relay's process dies mid-push) is pushed again at once straight from the trainer: the
    servers after it are not set aside, every one serves the version, and the retries are
    counted."""
    params = split_params(Transformer(CFG, rngs=nnx.Rngs(0)))[1]
    cut_off = []

    def cut(address, route):
        if route.get("pull_from") is not None:
            cut_off.append(route["pull_from"])
            raise ConnectionError(f"weight pull from {route['pull_from'][0]} failed: "
                                  "[Errno 104] Connection reset by peer")

    servers, remotes = _tcp_servers(params, cut)
    members = [Member(r.address, r, 4, remote=True, last_metrics=r.metrics()) for r in remotes]
    fleet = Fleet(members, eos_id=1, heartbeat_s=60, warn=lambda _: None)
    publisher = WeightPublisher(fleet, deadline_s=60, warn=lambda _: None)
    try:
        publisher.publish(params, 3)
        assert len(publisher.wait(3)) == 3
        # At least the second server pulled from a relay (the third may have joined after
        # that link was cut, and pulled from the trainer itself).
        assert cut_off and publisher.metrics()["push_relay_retries"] == len(cut_off)
        assert fleet.stats["members_set_aside"] == 0
        assert publisher.metrics()["push_failures"] == 0
    finally:
        publisher.close()
        fleet.close()
        for r, s in zip(remotes, servers):
            r.close()
            s.stop(0)


def test_servers_join_and_leave_a_running_fleet():
    """rl.generation.join: a fleet that starts with no member takes the servers that offer
    themselves (serving/fleet/join.py) once they have the newest weights, logs each join and leave,
    moves a leaving server's group in flight to the other from its tokens, and refuses a
    server with the wrong token."""
    from jaxrl.rollout.registry import Registry
    from serving.fleet.join import Joiner

    params = split_params(Transformer(CFG, rngs=nnx.Rngs(0)))[1]
    servers = [Server(Orchestrator(Engine(CFG, ENGINE), params, version=-1, eos_id=1).start(),
                      port=0, update_token="t").start() for _ in range(2)]
    log = []
    fleet = Fleet([], eos_id=1, heartbeat_s=0.2, wait_s=60, warn=log.append)
    publisher = WeightPublisher(fleet, deadline_s=60, elastic=True, warn=log.append)
    publisher.publish(params, 4)

    def admit(address):
        remote = RemoteGeneration(address, token="t")
        return Member(address, remote, 4, remote=True, last_metrics=remote.metrics())

    registry = Registry(fleet, publisher, admit, "t", "127.0.0.1:0")
    joiners = [Joiner(registry.address, s.address, "t", every_s=0.2).start() for s in servers]
    stranger = Joiner(registry.address, "127.0.0.1:1", "wrong", every_s=0.2).start()
    wait_for(lambda: sum(m.ready for m in fleet.members) == 2)
    assert all(j.joined.is_set() for j in joiners)
    assert sorted(m.name for m in fleet.members) == sorted(s.address for s in servers)
    wait_for(lambda: stranger.last is not None)
    assert "refused" in stranger.last and "UNAUTHENTICATED" in stranger.last
    stranger.stop(leave=False)
    sampling = SamplingParams(max_tokens=40, temperature=1.0, seed=3, n=2, stop_at_eos=False)
    with Orchestrator(Engine(CFG, ENGINE), params, version=4, eos_id=1) as want:
        expected = [s.tokens for s in want.submit([3, 4, 5], sampling).result()]
    stream = fleet.submit([3, 4, 5], sampling)
    leaving = next(j for j, s in zip(joiners, servers) if s.address == stream.member.name)
    leaving.stop(leave=True)                      # its group continues on the other server
    assert [s.tokens for s in stream.result()] == expected
    assert [m.name for m in fleet.members] == [j.advertise for j in joiners if j is not leaving]
    assert any("joined" in line for line in log) and any("left" in line for line in log)
    for j in joiners:
        if j is not leaving:
            j.stop(leave=False)
    registry.close()
    publisher.close()
    fleet.close()
    for m in fleet.members + fleet.departed:
        m.generation.close()
    for s in servers:
        s.stop(0)


def test_a_join_that_cannot_serve_the_run_is_refused_with_the_reason():
    """The registry refuses a server the trainer cannot reach (its --advertise is wrong) or
    that serves another model (the check's own words), and a malformed address; the fleet is
    left as it was, and the joiner says so."""
    from jaxrl.config import ConfigError
    from jaxrl.rollout.registry import Registry
    from serving.fleet.join import Joiner

    fleet = Fleet([], eos_id=1, heartbeat_s=3600, warn=lambda _: None)
    publisher = WeightPublisher(fleet, deadline_s=5, elastic=True, warn=lambda _: None)

    def admit(address):
        if address.endswith(":1"):
            raise ConnectionError("connection refused")
        raise ConfigError(f"generation server {address} has vocab_size=7; this run needs 1024")

    registry = Registry(fleet, publisher, admit, "t", "127.0.0.1:0")
    outcomes = {}
    for address in ("127.0.0.1:1", "127.0.0.1:2", "no-port"):
        joiner = Joiner(registry.address, address, "t", every_s=0.2).start()
        wait_for(lambda j=joiner: j.last is not None)
        outcomes[address] = joiner.last
        joiner.stop(leave=False)
    assert "refused" in outcomes["127.0.0.1:1"] and "--advertise" in outcomes["127.0.0.1:1"]
    assert "refused" in outcomes["127.0.0.1:2"] and "vocab_size=7" in outcomes["127.0.0.1:2"]
    assert "refused" in outcomes["no-port"] and "not host:port" in outcomes["no-port"]
    assert fleet.members == []
    registry.close()
    publisher.close()
    fleet.close()


def test_a_group_placed_on_a_member_that_leaves_meanwhile_goes_elsewhere():
    """The member chosen leaves while the group is being submitted to it (its submit then
    fails): the group goes to another member instead of failing the run."""
    gone, other = FakeGeneration(), FakeGeneration()
    fleet = Fleet([member("gone", gone, 8), member("other", other, 4)], eos_id=1,
                  heartbeat_s=3600, warn=lambda _: None)

    def leaving_submit(*args, **kwargs):
        fleet.leave(fleet.members[0], "it left the fleet")
        raise ValueError("Cannot invoke RPC: Channel closed!")

    gone.submit = leaving_submit
    stream = fleet.submit([3], SAMPLING)         # "gone" has more room: it is chosen first
    assert stream.member.name == "other" and len(other.submitted) == 1
    assert [m.name for m in fleet.members] == ["other"]
    fleet.close()


def test_auto_transfer_is_tcp_on_this_host_and_the_grpc_stream_elsewhere():
    """rl.generation.transfer=auto (the default): a server at a loopback address pulls over
    tcp (it reaches the trainer's bulk server, and shares memory with servers beside it); any
    other gets the gRPC stream, whose port it already has. An explicit choice stands."""
    from jaxrl.rollout.generation import transfer_for

    for address in ("127.0.0.1:9000", "localhost:9000", "[::1]:9000", "127.0.0.2:1"):
        assert transfer_for("auto", address) == "tcp", address
    for address in ("10.1.2.3:9000", "gen-7.cluster:9000", "[2001:db8::1]:9000"):
        assert transfer_for("auto", address) == "grpc", address
    for transfer in ("grpc", "jax", "tcp"):
        assert transfer_for(transfer, "127.0.0.1:9000") == transfer
        assert transfer_for(transfer, "10.1.2.3:9000") == transfer
