import numpy as np
import pytest

from jaxrl.rl.advantages import group_advantages, keep_group


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
