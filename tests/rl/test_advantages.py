from collections import Counter

import numpy as np
import pytest

from jaxrl.rl.advantages import group_advantages, keep_group, turn_advantages


def test_leave_one_out_advantages_by_hand():
    adv = group_advantages(np.array([[1.0, 0.0, 0.0, 1.0]]))
    assert adv.dtype == np.float32 and adv.shape == (1, 4)
    np.testing.assert_allclose(adv, [[2 / 3, -2 / 3, -2 / 3, 2 / 3]], rtol=1e-6)


def test_groups_are_independent():
    adv = group_advantages(np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 3.0], [5.0, 5.0, 5.0]]))
    np.testing.assert_allclose(adv, [[-1.5, 0.0, 1.5], [-1.5, -1.5, 3.0], [0.0, 0.0, 0.0]],
                               rtol=1e-6)
    np.testing.assert_allclose(group_advantages([[3.0, 1.0]]), [[2.0, -2.0]])


def test_std_normalisation_divides_by_population_std():
    # std([1, 0, 0, 1]) = 0.5; std([1, 2, 3]) = sqrt(2/3), and 1.5 / sqrt(2/3) = 1.8371173.
    adv = group_advantages(np.array([[1.0, 0.0, 0.0, 1.0]]), normalize_std=True, eps=0.0)
    np.testing.assert_allclose(adv, [[4 / 3, -4 / 3, -4 / 3, 4 / 3]], rtol=1e-6)
    adv = group_advantages(np.array([[1.0, 2.0, 3.0]]), normalize_std=True, eps=0.0)
    np.testing.assert_allclose(adv, [[-1.8371173, 0.0, 1.8371173]], rtol=1e-6)
    # A constant group has zero std: eps keeps it at zero instead of 0/0.
    adv = group_advantages(np.array([[1.0, 1.0, 1.0]]), normalize_std=True)
    np.testing.assert_array_equal(adv, np.zeros((1, 3), np.float32))


def test_rejects_groups_of_one_and_bad_shapes():
    with pytest.raises(ValueError, match="n=1"):
        group_advantages(np.ones((3, 1)))
    with pytest.raises(ValueError, match=r"\[groups, n\]"):
        group_advantages(np.ones(4))


def test_keep_group_drops_groups_without_signal():
    assert not keep_group(np.array([1.0, 1.0, 1.0]))
    assert not keep_group(np.array([0.0, 0.0]))
    assert keep_group(np.array([1.0, 0.0, 1.0]))
    assert keep_group([0.0, 0.0, 0.5])


def test_turn_advantages_by_hand():
    """Three episodes of one group, with per-turn rewards: returns from each turn on (gamma
    0.5), less the mean over the other episodes that reached the turn."""
    adv = turn_advantages([[0.0, 1.0], [1.0], [0.5, 0.0, 1.0]], discount=0.5)
    g = [[0.5, 1.0], [1.0], [0.5 + 0.5 * 0.0 + 0.25 * 1.0, 0.0 + 0.5 * 1.0, 1.0]]
    np.testing.assert_allclose(adv[0], [g[0][0] - (g[1][0] + g[2][0]) / 2, g[0][1] - g[2][1]])
    np.testing.assert_allclose(adv[1], [g[1][0] - (g[0][0] + g[2][0]) / 2])
    # Turn 2 only episode 2 reached: baseline is the others' whole returns.
    np.testing.assert_allclose(adv[2], [g[2][0] - (g[0][0] + g[1][0]) / 2, g[2][1] - g[0][1],
                                        g[2][2] - (g[0][0] + g[1][0]) / 2], rtol=1e-6)
    assert all(a.dtype == np.float32 for a in adv)


def test_turn_advantages_of_one_final_reward_are_the_episode_advantage():
    """With gamma 1 and every episode as long, with one reward at the end, every turn gets the
    episode's leave-one-out advantage: per_turn reduces to episode."""
    rewards = np.random.default_rng(0).random(5)
    adv = turn_advantages([[0.0, 0.0, r] for r in rewards])
    episode = group_advantages(rewards[None])[0]
    for a, e in zip(adv, episode):
        np.testing.assert_allclose(a, [e] * 3, rtol=1e-5)
    with pytest.raises(ValueError, match="n >= 2"):
        turn_advantages([[1.0]])


def test_each_turn_s_tokens_carry_its_advantage_into_the_packed_features():
    from jaxrl.data.pipeline import features
    from jaxrl.rl.env import Reply, Trajectory

    t = Trajectory(prompt=[1, 2])
    t.add_model([10, 11], [-0.1, -0.2], [0, 0], "a")
    t.add_reply(Reply(observation="x", reward=0.0), [20])
    t.add_model([12], [-0.3], [0], "b")
    t.add_reply(Reply(reward=1.0, done=True))
    assert t.turn_rewards == [0.0, 1.0] and t.turn_of_tokens() == [0, 0, -1, 1]
    f = features(t.to_rollout(0, 0.25, [0.5, -1.5]))
    # Next-token rows: the prompt's last token predicts the first completion token.
    np.testing.assert_allclose(f["advantages"], [0.0, 0.5, 0.5, 0.0, -1.5])
    np.testing.assert_allclose(f["loss_mask"], [0, 1, 1, 0, 1])
    np.testing.assert_allclose(features(t.to_rollout(0, 0.25))["advantages"],
                               [0.0, 0.25, 0.25, 0.0, 0.25])


@pytest.mark.parametrize("mode", ["episode", "per_turn"])
def test_the_actor_gives_each_episode_s_turns_their_advantages(mode):
    """A group of two episodes with per-turn rewards through the actor's scoring: episode mode
    gives every model token the episode's advantage, per_turn each turn's own."""
    from jaxrl.data.rollouts import RolloutLog
    from jaxrl.rl.config import RLConfig
    from jaxrl.rl.env import Reply, Trajectory
    from jaxrl.rollout.actor import Actor
    from jaxrl.rollout.sources import EnvEpisodes

    def episode(rewards):
        t = Trajectory(prompt=[1])
        for k, r in enumerate(rewards):
            t.add_model([10 + k, 11 + k], [-0.5, -0.5], [0, 0], f"turn {k}")
            t.add_reply(Reply(observation="o", reward=r, done=k == len(rewards) - 1), [30])
        t.finish = "done"
        return t
    cfg = RLConfig(turn_advantage=mode, turn_discount=0.5, filter_overlong=False)
    source = EnvEpisodes(None, None, None, cfg)
    actor = Actor(source, RolloutLog(), cfg, seed=0)
    try:
        scored = source.score(0, [episode([1.0, 0.0]), episode([0.0, 2.0])], Counter())
        a, b = actor._kept(scored)
    finally:
        actor.stop()
    if mode == "episode":
        assert a.token_advantages is None and b.token_advantages is None
        assert (a.advantage, b.advantage) == (-1.0, 1.0)      # returns 1 and 2
        return
    # Returns from each turn on: a (1.0, 0.0), b (1.0, 2.0); per-turn baselines: the other's.
    assert a.token_advantages == [0.0, 0.0, 0.0, -2.0, -2.0, 0.0]
    assert b.token_advantages == [0.0, 0.0, 0.0, 2.0, 2.0, 0.0]
