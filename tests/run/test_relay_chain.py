"""Who pulls from whom along a tcp push's relay chain (jaxrl/rollout/relay_chain.py)."""

import time

from jaxrl.rollout.relay_chain import RelayChains


def test_each_push_pulls_from_the_one_before_and_the_last_relays_nothing():
    chains = RelayChains(deadline_s=60)
    chains.expect({(1, False): 3, (1, True): 1})
    a = chains.join((1, False), "a:1")
    b = chains.join((1, False), "b:1")
    c = chains.join((1, False), "c:1")
    assert a.pull_from is None                          # the trainer
    assert b.pull_from == ("a:1", a.relay_as) and c.pull_from == ("b:1", b.relay_as)
    assert a.relay_as and b.relay_as and a.relay_as != b.relay_as
    assert c.relay_as == 0                              # the last planned: nobody pulls from it
    other = chains.join((1, True), "d:1")               # another update: a chain of its own
    assert other.pull_from is None and other.relay_as == 0


def test_a_failure_cuts_the_chain():
    chains = RelayChains(deadline_s=60)
    chains.expect({(1, False): 4})
    a = chains.join((1, False), "a:1")
    b = chains.join((1, False), "b:1")
    chains.failed((1, False), a)                        # not the tail: b is
    chains.failed((1, False), b)                        # the tail fails: the chain is cut
    assert chains.join((1, False), "c:1").pull_from is None


def test_a_server_without_a_bulk_address_pulls_but_does_not_relay():
    chains = RelayChains(deadline_s=60)
    chains.expect({(2, False): 2})
    first = chains.join((2, False), None)
    assert first.relay_as == 0 and first.route() == {"pull_from": None, "relay_as": 0}
    assert chains.join((2, False), "x:1").pull_from is None


def test_a_relay_past_its_deadline_is_not_pulled_from():
    chains = RelayChains(deadline_s=0.01)
    chains.expect({(3, False): 2})
    assert chains.join((3, False), "a:1").relay_as
    time.sleep(0.05)       # the relay's offer has expired: the next pulls from the trainer
    assert chains.join((3, False), "b:1").pull_from is None
