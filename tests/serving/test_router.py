"""The one router behind `jaxrl serve --replicas` and the RL fleet (serving/fleet/router.py)."""

from serving.fleet.router import Router, session_keys


def test_groups_go_to_the_least_loaded_and_ties_to_the_longest_waiting():
    load = {"a": 0.5, "b": 0.25, "c": 0.25}
    router = Router(load.get)
    assert router.choose(["a", "b", "c"]) == "b"
    assert router.choose(["a", "b", "c"]) == "c"      # b and c tie: c has waited longer
    assert router.choose(["a", "b", "c"]) == "b"
    load["a"] = 0.0
    assert router.choose(["a", "b", "c"]) == "a"


def test_a_session_s_turns_go_home_while_it_can_take_work():
    load = {"a": 0.0, "b": 1.0}
    router = Router(load.get)
    assert router.choose(["a", "b"], ["s1", "s2"]) == "a"     # a group's first turn: n keys
    load.update(a=5.0)
    assert router.choose(["a", "b"], ["s1"]) == "a"           # home, however loaded
    assert router.choose(["b"], ["s2"]) == "b"                # home not ready: elsewhere
    assert router.choose(["a", "b"], ["s2"]) == "b"           # ... which is its home now
    assert router.forget("s1") == "a" and router.forget("s1") is None
    assert router.choose(["a", "b"], ["s1"]) == "b"           # forgotten: least loaded


def test_only_the_newest_homes_are_remembered():
    router = Router(lambda _: 0.0, max_homes=2)
    for key in ("x", "y", "z"):
        router.choose(["a"], [key])
    assert router.forget("x") is None and router.forget("z") == "a"


def test_session_keys():
    assert session_keys(None) == [] and session_keys("k") == ["k"]
    assert session_keys(("k1", "k2")) == ["k1", "k2"]
