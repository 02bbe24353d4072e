"""Who pulls from whom along a tcp push's relay chain (jaxrl/rollout/relay_chain.py)."""

import time

from jaxrl.rollout.relay_chain import RelayChains


def test_each_push_pulls_from_the_one_before_and_a_failure_cuts_the_chain():
    chains = RelayChains(deadline_s=60)
    a = chains.join((1, False), "a:1")
    b = chains.join((1, False), "b:1")
    c = chains.join((1, False), "c:1")
    assert a.pull_from is None                          # the trainer
    assert b.pull_from == ("a:1", a.relay_as) and c.pull_from == ("b:1", b.relay_as)
    assert len({a.relay_as, b.relay_as, c.relay_as}) == 3 and a.relay_as != 0
    other = chains.join((1, True), "d:1")               # another update: a chain of its own
    assert other.pull_from is None
    chains.failed((1, False), b)                        # not the tail: c is
    chains.failed((1, False), c)                        # the tail fails: the chain is cut
    assert chains.join((1, False), "e:1").pull_from is None


def test_a_server_without_a_bulk_address_pulls_but_does_not_relay():
    chains = RelayChains(deadline_s=60)
    first = chains.join((2, False), None)
    assert first.relay_as == 0 and first.route() == {"pull_from": None, "relay_as": 0}
    assert chains.join((2, False), "x:1").pull_from is None


def test_a_relay_past_its_deadline_is_not_pulled_from():
    chains = RelayChains(deadline_s=0.01)
    chains.join((3, False), "a:1")
    time.sleep(0.05)       # the relay's offer has expired: the next pulls from the trainer
    assert chains.join((3, False), "b:1").pull_from is None
