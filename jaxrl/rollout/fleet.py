"""The rollout fleet: any number of generation engines (serving/fleet/generation.py: this process's
orchestrator, `jaxrl serve` processes) behind one `submit`, so the actor neither knows nor cares
where a group is generated.

- Dispatch by load: each group goes to the ready member with the fewest samples outstanding per
  slot (ties: the one that waited longest). A multi-turn episode's later turns go where its
  first went, where its KV pages are kept, while that member is ready.
- A member is ready when it answers and serves the newest weights published when it (re)joined;
  the weight publisher (jaxrl/rollout/publisher.py) brings it there. Only weights this trainer gave
  it count: a server's start-up weights, or a newer version left by a trainer that crashed and
  resumed from an older checkpoint, are replaced first.
- A member that fails (its stream is lost, a heartbeat passes its deadline, a weight push fails)
  is set aside: each of its unfinished groups continues on another ready member from the tokens
  it had reached (`carry`), with the same random draws, so nothing generated is lost or
  generated twice. Remote members are heartbeaten while set aside and rejoin once they answer
  and have the current weights.
- With no ready member for `wait_s` the run fails with the members' last errors, rather than
  hang.
- Multiplexing (SeamlessFlow; rl.multiplex): a member tagged "train" runs on the trainer's own
  devices. The trainer `lend`s it while it waits for a batch, and `withdraw`s it when the batch
  is ready: its unfinished groups continue on the other members from the tokens they reached
  (`carry`, as a failed member's do), and its engine pauses while the devices train.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Callable, Sequence

from jaxrl.errors import UserError
from jaxrl.rollout.member import Member, MemberState
from serving.core import threads
from serving.core.orchestrator import QueueFull
from serving.core.stream import FINISHED, RequestStream, Sample
from serving.fleet.router import Router, session_keys
from serving.runner.sampling import SamplingParams

__all__ = ["Fleet", "FleetStream", "Member", "MemberState", "NoGeneration"]

_MAX_HOMES = 1 << 16     # sessions whose member is remembered (the least recent forgotten)


class NoGeneration(UserError):
    """No member of the fleet could take work for `wait_s` seconds (the servers given are not
    serving): one line naming each server's last error."""


class Fleet:
    """The members (`members`: replaced, never changed in place, so a reader may iterate a
    list it took without the lock) and what is dispatched to them. Servers may `join` and
    `leave` at any time; with none ready, work waits up to `wait_s` for one."""

    def __init__(self, members: Sequence[Member], *, eos_id: int | None,
                 heartbeat_s: float = 5.0, heartbeat_timeout_s: float = 10.0,
                 wait_s: float = 600.0, warn: Callable[[str], None] = print):
        self.members = list(members)
        self._departed: list[Member] = []      # left: their counters still count
        self.eos_id = eos_id
        self.wait_s = wait_s
        self._warn = warn
        self._heartbeat = (heartbeat_s, heartbeat_timeout_s)
        self._lock = threading.Condition()
        self._closed = threading.Event()
        self.latest_version = max((m.version for m in self.members if m.version is not None),
                                  default=-1)
        self.stats = {"groups_moved": 0, "members_set_aside": 0, "groups_withdrawn": 0}
        self._withdrawn: set[RequestStream] = set()   # cancelled by `withdraw`: to be moved
        self._router = Router(lambda m: m.outstanding / m.slots, _MAX_HOMES)
        self._monitor = None
        self._start_heartbeats()

    def _start_heartbeats(self) -> None:
        with self._lock:
            if self._monitor is None and any(m.remote for m in self.members):
                self._monitor = threading.Thread(target=self._watch, name="fleet-heartbeat",
                                                 daemon=True)
                self._monitor.start()

    # -- dispatch --------------------------------------------------------------------------------
    def submit(self, prompt: Sequence[int], sampling: SamplingParams, *,
               predicted_len: float | None = None, carry: Sequence[Sample] | None = None,
               session: str | Sequence[str] | None = None) -> "FleetStream":
        """Places the group on the least-loaded ready member (waiting up to `wait_s` for one),
        or a session's turn on the member holding its pages."""
        return FleetStream(self, list(prompt), sampling, predicted_len, carry, session)

    @property
    def slots(self) -> int:
        """Sequences the ready members decode at once (all members' while none is ready)."""
        with self._lock:
            ready = [m.slots for m in self.members if m.ready]
            return sum(ready) or sum(m.slots for m in self.members)

    def end_session(self, key: str) -> None:
        with self._lock:
            home = self._router.forget(key)
        if home is not None:
            try:
                home.generation.end_session(key)
            except ConnectionError:
                pass            # a member that is gone holds nothing

    def place(self, prompt, sampling, predicted_len, carry, session=None
              ) -> tuple[Member, RequestStream]:
        """Submits a group to the member the router chooses among the ready ones, waiting up to
        `wait_s` for one; (member, its stream). `release` gives its samples back."""
        keys = session_keys(session)
        deadline = time.monotonic() + self.wait_s
        while True:
            with self._lock:
                ready = [m for m in self.members if m.ready]
                if self._closed.is_set():
                    raise QueueFull("the fleet is closed")
                if not ready:
                    if not self._lock.wait(timeout=max(0.0, deadline - time.monotonic())) \
                            and time.monotonic() >= deadline:
                        raise NoGeneration(self._no_member_message())
                    continue
                member = self._router.choose(ready, keys)
                member.outstanding += sampling.n
            try:
                stream = member.generation.submit(prompt, sampling, predicted_len=predicted_len,
                                                  carry=carry, session=session)
            except QueueFull:
                self.release(member, sampling.n)
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)     # its queue is full: wait for one to drain
                continue
            except Exception:
                self.release(member, sampling.n)
                if member.alive:
                    raise
                continue             # it left or failed while we submitted: place it elsewhere
            except BaseException:
                self.release(member, sampling.n)
                raise
            with self._lock:
                member.streams.add(stream)
                gone = not member.ready     # set aside or withdrawn meanwhile: move it at once
                if gone and member.state is MemberState.RESTING:
                    self._withdrawn.add(stream)
            if gone:
                stream.cancel()
            return member, stream

    def release(self, member: Member, n: int, stream: RequestStream | None = None) -> bool:
        """`n` samples of `member` (and its `stream`) have finished or moved; whether `withdraw`
        cut the stream short (its group is to continue elsewhere)."""
        with self._lock:
            member.outstanding -= n
            member.streams.discard(stream)
            self._lock.notify_all()
            if stream in self._withdrawn:
                self._withdrawn.discard(stream)
                return True
            return False

    def _no_member_message(self) -> str:
        states = "; ".join(f"{m.name}: {m.why_down or m.state.value}"
                           for m in self.members) or "no server has joined"
        return f"no generation member could take work for {self.wait_s:.0f} s ({states})"

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    # -- membership ------------------------------------------------------------------------------
    def join(self, member: Member) -> bool:
        """Adds `member` (a server that registered itself), in the state it was built in; False
        if a member of that name is already in the fleet."""
        with self._lock:
            if any(m.name == member.name for m in self.members):
                return False
            self.members = [*self.members, member]
            self._lock.notify_all()
        self._start_heartbeats()
        self._warn(f"generation: {member.name} joined ({member.slots} slots, "
                   f"{len(self.members)} members)")
        return True

    @property
    def departed(self) -> list[Member]:
        """Members that left (their connections are closed with the fleet's)."""
        with self._lock:
            return list(self._departed)

    def leave(self, member: Member, why: str) -> None:
        """`member` leaves the fleet: set aside (its groups move to the others) and dropped."""
        self.set_aside(member, why)
        with self._lock:
            if member not in self.members:
                return
            self.members = [m for m in self.members if m is not member]
            self._departed.append(member)
            self._lock.notify_all()
        self._warn(f"generation: {member.name} left ({why}); {len(self.members)} members")

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Waits (up to `timeout`) until `predicate()`, evaluated under the fleet's lock each
        time the members change (`notify`), holds; what it last returned."""
        with self._lock:
            return self._lock.wait_for(predicate, timeout=timeout)

    def notify(self) -> None:
        """Wakes whoever waits in `wait_for`: something they wait on has changed."""
        with self._lock:
            self._lock.notify_all()

    def replaced(self, member: Member) -> None:
        """`member` serves weights this trainer did not give it (someone pushed it newer ones):
        it is to be brought to the trainer's again, whatever their version."""
        with self._lock:
            member.version = None

    def set_aside(self, member: Member, why: str) -> None:
        """`member` failed: no new work goes to it, and its groups move to the others."""
        with self._lock:
            if not member.alive:
                return
            member.state, member.why_down = MemberState.SET_ASIDE, why
            member.failures += 1
            self.stats["members_set_aside"] += 1
            streams = list(member.streams)
            self._lock.notify_all()
        for stream in streams:     # a hung member never ends them: end them here
            stream.cancel()
        self._warn(f"generation: {member.name} set aside ({why}); its groups continue on "
                   f"the other members")

    def advanced(self, member: Member, version: int) -> None:
        """The publisher brought `member` to weights `version`."""
        with self._lock:
            member.version = version
            if member.state is MemberState.JOINING and version >= self.latest_version:
                member.state = MemberState.READY
                if member.failures:
                    self._warn(f"generation: {member.name} rejoined at version {version}")
            self._lock.notify_all()

    def published(self, version: int) -> None:
        """The trainer's newest version (lower than before only when it resumed)."""
        with self._lock:
            self.latest_version = version

    def _watch(self) -> None:
        """Heartbeats the remote members: one that does not answer within the timeout is set
        aside; one set aside that answers again may rejoin (once it has the weights)."""
        every, timeout = self._heartbeat
        while not self._closed.wait(every):
            for m in [m for m in self.members if m.remote]:
                try:
                    self._record(m, m.generation.metrics(timeout=timeout))
                except ConnectionError as e:
                    self.set_aside(m, f"no heartbeat: {e}")
                    continue
                self._answered(m)

    def _answered(self, m: Member) -> None:
        """`m` answered a heartbeat: one set aside is back, and rejoins once it has the newest
        weights (at once if it kept them)."""
        with self._lock:
            if m.alive:
                return
            m.why_down = None
            m.slots = int(m.last_metrics.get("slots", m.slots))
            if m.last_metrics.get("version") != m.version:
                m.version = None       # restarted, or changed by someone else
            current = m.version is not None and m.version >= self.latest_version
            m.state = MemberState.READY if current else MemberState.JOINING
            self._lock.notify_all()

    def wait_ready(self, version: int, timeout: float) -> list[Member]:
        """Waits until every alive member serves `version` or newer; those that do not within
        `timeout` are set aside. Returns the members serving it."""
        with self._lock:
            self._lock.wait_for(lambda: not any(self._behind(m, version) for m in self.members),
                                timeout=timeout)
            late = [m for m in self.members if self._behind(m, version)]
        for m in late:
            self.set_aside(m, f"still at version {m.version} {timeout:.0f} s after version "
                              f"{version} was published")
        with self._lock:
            return [m for m in self.members if m.ready and not self._behind(m, version)]

    @staticmethod
    def _behind(m: Member, version: int) -> bool:
        return m.alive and (m.version is None or m.version < version)

    # -- multiplexing: the trainer's devices ------------------------------------------------------
    def lend(self, member: Member) -> None:
        """The trainer waits for data: `member` (on its devices) takes work until `withdraw`."""
        member.generation.resume()
        with self._lock:
            if member.state is MemberState.RESTING:
                member.state = MemberState.READY
                self._lock.notify_all()

    def withdraw(self, member: Member, timeout: float = 60.0) -> None:
        """The trainer has its batch: `member` takes no more work, its unfinished groups
        continue on the other members from the tokens they reached, and it returns once its
        engine is idle (its devices are the trainer's again)."""
        with self._lock:
            if member.state is not MemberState.READY:
                return
            member.state = MemberState.RESTING
            streams = list(member.streams)
            self._withdrawn.update(streams)
            self._lock.notify_all()
        for stream in streams:
            stream.cancel()
        member.generation.pause(timeout=timeout)

    # -- partial rollouts ------------------------------------------------------------------------
    def pause(self, lease_s: float, timeout: float = 60.0) -> None:
        """Pauses every member that answers (all at once) and returns once each is idle; a
        server resumes by itself after `lease_s` unless `resume` comes first. A member that
        cannot be paused is said and left generating (its samples are still correct, only
        generated beside the step); heartbeats deal with members that are gone."""
        self._each("pause", lambda m: m.generation.pause(
            timeout=timeout, lease_s=lease_s if m.remote else None))

    def resume(self) -> None:
        """Resumes every member that answers (one set aside since the pause resumes when its
        lease ends)."""
        self._each("resume", lambda m: m.generation.resume())

    def _each(self, what: str, call: Callable[[Member], None]) -> None:
        with self._lock:        # a resting member is paused already, and stays so
            members = [m for m in self.members
                       if m.alive and m.state is not MemberState.RESTING]
        if not members:
            return
        with concurrent.futures.ThreadPoolExecutor(len(members),
                                                   thread_name_prefix=f"fleet-{what}") as pool:
            futures = {pool.submit(call, m): m for m in members}
        for future, m in futures.items():
            if (e := future.exception()) is not None:
                self._warn(f"generation: could not {what} {m.name} ({e})")

    # -- counters --------------------------------------------------------------------------------
    _COUNTERS = ("steps", "busy_slot_steps", "generated_tokens", "held_tokens", "carried_tokens",
                 "preemptions", "requests_done", "spec_decode_verify_steps",
                 "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                 "spec_decode_num_accepted_tokens")

    def _record(self, m: Member, fresh: dict) -> None:
        """Keeps `m`'s newest counters; a counter that went down means the server restarted,
        so what it had counted before is kept as a base (the fleet's totals never go back)."""
        with self._lock:
            for key in self._COUNTERS:
                if fresh.get(key, 0) < m.last_metrics.get(key, 0):
                    m.counted[key] = m.counted.get(key, 0) + m.last_metrics[key]
            m.last_metrics = fresh

    def count(self, stat: str) -> None:
        with self._lock:
            self.stats[stat] += 1

    def metrics(self) -> dict:
        """The members' counters summed over the run (a member that does not answer within 2 s
        counts with the last it said), with `slot_steps` = sum of steps x slots."""
        for m in self.members:
            if not m.remote or m.alive:
                try:
                    self._record(m, m.generation.metrics() if not m.remote else
                                 m.generation.metrics(timeout=2.0))
                except ConnectionError:
                    pass
        total: dict = dict.fromkeys(self._COUNTERS, 0)
        total["slot_steps"] = 0
        with self._lock:
            for m in self.members + self._departed:
                for key in self._COUNTERS:
                    total[key] += m.counted.get(key, 0) + m.last_metrics.get(key, 0)
                steps = m.counted.get("steps", 0) + m.last_metrics.get("steps", 0)
                total["slot_steps"] += steps * m.slots
            # what the trainer's devices generated while it waited (rl.multiplex)
            total["trainer_generated_tokens"] = sum(
                m.counted.get("generated_tokens", 0) + m.last_metrics.get("generated_tokens", 0)
                for m in self.members + self._departed if m.trains)
            total["members_ready"] = sum(m.ready for m in self.members)
            total["slots_ready"] = sum(m.slots for m in self.members if m.ready)
            total.update(self.stats)
        return total

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            self._lock.notify_all()
        threads.join(self._monitor, 30)


class FleetStream:
    """A group placed on the fleet. `result()` follows it across members: when its member is
    lost, the group continues on another from where it got."""

    def __init__(self, fleet: Fleet, prompt, sampling: SamplingParams, predicted_len, carry,
                 session=None):
        self._fleet = fleet
        self._args = (prompt, sampling, predicted_len)
        self._session = session
        self._cancelled = False
        self.member, self._stream = fleet.place(prompt, sampling, predicted_len, carry,
                                                 session)

    def result(self) -> list[Sample]:
        fleet = self._fleet
        while True:
            samples = self._stream.result()
            withdrawn = fleet.release(self.member, len(samples), self._stream)
            reasons = {s.finish_reason for s in samples}
            if reasons <= set(FINISHED) or self._cancelled or fleet.closed:
                return samples
            if "refused" in reasons:
                raise RuntimeError(f"generation: {self.member.name} refused a group: "
                                   f"{self._stream.error}")
            if withdrawn:                # its devices went back to training: move it
                fleet.count("groups_withdrawn")
            elif self.member.remote:
                fleet.set_aside(self.member, self._stream.error or "its stream ended early")
            elif self.member.alive:      # the in-process engine stopped: nothing to wait for
                return samples
            carry = self._stream.snapshot()
            fleet.count("groups_moved")
            self.member, self._stream = fleet.place(*self._args, carry, self._session)

    def snapshot(self) -> list[Sample]:
        return self._stream.snapshot()

    def cancel(self) -> None:
        self._cancelled = True
        self._stream.cancel()
