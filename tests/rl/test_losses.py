"""Policy losses against values and gradients derived by hand.

The shared row packs two sequences and a padding token:

    token        0       1     2     3       4      5     6
    segment      1       1     1     2       2      2     0
    counted      prompt  yes   yes   prompt  yes    yes   padding
    r = pi/mu    -       1.5   0.5   -       3      4/3   -
    advantage    -       0.5   0.5   -       -1     -1    -

Tokens that do not count hold garbage, which must not reach any output.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.rl.losses import (LOSSES, MAX_STATS, MIN_STATS, LossSettings,
                             effective_sample_size, policy_loss)

LOG_RATIO = np.log([1.0, 1.5, 0.5, 1.0, 3.0, 4 / 3, 1.0])
LOGP = np.array([[-3.0, -0.5, -1.0, -2.0, -0.25, -0.75, -9.0]], np.float32)
MU = (LOGP - LOG_RATIO + np.array([0.7, 0, 0, -0.3, 0, 0, 4.0])).astype(np.float32)
ADV = np.array([[5.0, 0.5, 0.5, 7.0, -1.0, -1.0, 3.0]], np.float32)
MASK = np.array([[0, 1, 1, 0, 1, 1, 0]], np.float32)
SEG = np.array([[1, 1, 1, 2, 2, 2, 0]], np.int32)


def loss_and_grad(kind, logp=LOGP, mu=MU, adv=ADV, mask=MASK, seg=SEG, ref_logp_BT=None,
                  **kw):
    settings = LossSettings(kind=kind, **kw)

    def f(lp):
        loss_sum, weight, stats = policy_loss(lp, jnp.asarray(mu), jnp.asarray(adv),
                                              jnp.asarray(mask), jnp.asarray(seg), settings,
                                              ref_logp_BT)
        return loss_sum, (weight, stats)

    (loss_sum, (weight, stats)), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(logp))
    return float(loss_sum), float(weight), {k: float(v) for k, v in stats.items()}, np.asarray(grad)


# (kind, loss_sum, weight, clipped, dL/dlogp) worked out by hand from the table above.
CASES = [
    # -logp A min(r, 2): grad -A min(r, 2) = -0.5*1.5, -0.5*0.5, 1*2 (capped), 1*4/3.
    ("tis", 0.375 + 0.25 - 0.5 - 1.0, 4.0, 1.0, [0, -0.75, -0.25, 0, 2.0, 4 / 3, 0]),
    # r=1.5 with A>0 is clipped at 1.2 (loss -0.6, no grad); the rest give -rA, grad -rA.
    ("ppo", -0.6 - 0.25 + 3.0 + 4 / 3, 4.0, 1.0, [0, 0, -0.25, 0, 3.0, 4 / 3, 0]),
    # s1 = sqrt(1.5 * 0.5) = 0.8660254, s2 = sqrt(3 * 4/3) = 2, both unclipped; the sequence
    # gradient -s A is spread evenly over its |y| = 2 tokens: -0.8660254*0.5/2, 2/2.
    ("gspo", -0.8660254 * 0.5 + 2.0, 2.0, 0.0,
     [0, -0.21650635, -0.21650635, 0, 1.0, 1.0, 0]),
]


@pytest.mark.parametrize("kind,loss_sum,weight,clipped,grad", CASES)
def test_values_and_gradients_by_hand(kind, loss_sum, weight, clipped, grad):
    got_loss, got_weight, stats, got_grad = loss_and_grad(kind)
    np.testing.assert_allclose(got_loss, loss_sum, rtol=1e-5)
    assert got_weight == weight and stats["clipped"] == clipped
    np.testing.assert_allclose(got_grad, [grad], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", LOSSES)
def test_stats_by_hand(kind):
    _, _, stats, _ = loss_and_grad(kind)
    # r - 1 - log r summed: 1.5, 0.5, 3 and 4/3 give 0.0945349 + 0.1931472 + 0.9013877 + 0.0456513.
    expected = {"tokens": 4.0, "ratio_sum": 19 / 3, "ratio_sq_sum": 239 / 18, "ratio_min": 0.5,
                "ratio_max": 3.0, "kl_new_old_sum": 1.2347210, "kl_ref_sum": 0.0}
    for name, value in expected.items():
        np.testing.assert_allclose(stats[name], value, rtol=1e-5, err_msg=name)
    assert MIN_STATS == ("ratio_min",) and MAX_STATS == ("ratio_max",)
    # ESS = (19/3)^2 / (4 * 239/18) = 361/478.
    np.testing.assert_allclose(
        effective_sample_size(stats["ratio_sum"], stats["ratio_sq_sum"], stats["tokens"]),
        361 / 478, rtol=1e-5)


def test_effective_sample_size_edges():
    assert float(effective_sample_size(5.0, 5.0, 5.0)) == 1.0      # on-policy: every r = 1
    np.testing.assert_allclose(effective_sample_size(4.0, 16.0, 4.0), 0.25)  # r = (4, 0, 0, 0)
    assert float(effective_sample_size(0.0, 0.0, 0.0)) == 0.0      # no tokens: no NaN


def test_ppo_clips_only_on_the_advantages_side():
    # (r, A): (1.5, +1) and (0.5, -1) are clipped: flat loss, zero gradient. (0.5, +1) and
    # (1.5, -1) keep -r A: grads -0.5 and 1.5. The last token is padding.
    logp = np.zeros((1, 5), np.float32)
    mu = -np.log([[1.5, 0.5, 0.5, 1.5, 1.0]]).astype(np.float32)
    adv = np.array([[1.0, -1.0, 1.0, -1.0, 0.0]], np.float32)
    mask = np.array([[1, 1, 1, 1, 0]], np.float32)
    seg = np.array([[1, 2, 3, 4, 0]], np.int32)
    loss_sum, _, stats, grad = loss_and_grad("ppo", logp, mu, adv, mask, seg)
    np.testing.assert_allclose(loss_sum, -1.2 + 0.8 - 0.5 + 1.5, rtol=1e-5)
    np.testing.assert_allclose(grad, [[0, 0, -0.5, 1.5, 0]], rtol=1e-5, atol=1e-7)
    assert stats["clipped"] == 2.0
    # Clip-higher (DAPO): with clip_high 0.6, r = 1.5 is inside the range again.
    loss_sum, _, stats, grad = loss_and_grad("ppo", logp, mu, adv, mask, seg, clip_high=0.6)
    np.testing.assert_allclose(grad, [[-1.5, 0, -0.5, 1.5, 0]], rtol=1e-5, atol=1e-7)
    assert stats["clipped"] == 1.0


def test_gspo_clips_whole_sequences():
    # Sequence 1: r = 1.5, 1.5 -> s = 1.5 with A = 1: clipped at 1.2, no gradient, both tokens
    # counted as clipped. Sequence 2: s = 0.5 with A = 1, unclipped: loss -0.5, grad -0.5.
    # Sequence 3 has no counted token, so it is not a sequence of the loss.
    logp = np.zeros((1, 5), np.float32)
    mu = -np.log([[1.5, 1.5, 0.5, 2.0, 1.0]]).astype(np.float32)
    adv = np.array([[1.0, 1.0, 1.0, 1.0, 0.0]], np.float32)
    mask = np.array([[1, 1, 1, 0, 0]], np.float32)
    seg = np.array([[1, 1, 2, 3, 0]], np.int32)
    loss_sum, weight, stats, grad = loss_and_grad("gspo", logp, mu, adv, mask, seg)
    np.testing.assert_allclose(loss_sum, -1.2 - 0.5, rtol=1e-5)
    assert weight == 2.0 and stats["clipped"] == 2.0
    np.testing.assert_allclose(grad, [[0, 0, -0.5, 0, 0]], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", LOSSES)
def test_padding_and_unmasked_tokens_contribute_nothing(kind):
    # The same two sequences, compacted to their counted tokens, one per segment id...
    compact = loss_and_grad(kind, LOGP[:, [1, 2, 4, 5]], MU[:, [1, 2, 4, 5]],
                            ADV[:, [1, 2, 4, 5]], np.ones((1, 4), np.float32),
                            np.array([[1, 1, 2, 2]], np.int32))
    # ...and padded with non-finite junk and a fully masked segment.
    junk = np.array([[-np.inf, np.nan, np.inf]], np.float32)
    padded = loss_and_grad(
        kind, np.concatenate([LOGP, junk], 1), np.concatenate([MU, junk], 1),
        np.concatenate([ADV, junk], 1), np.concatenate([MASK, [[0, 0, 0]]], 1),
        np.concatenate([SEG, [[3, 3, 0]]], 1),
        ref_logp_BT=jnp.asarray(np.concatenate([LOGP, junk], 1)), kl_coef=0.0)
    np.testing.assert_allclose(padded[0], compact[0], rtol=1e-6)
    assert padded[1] == compact[1]
    for name in compact[2]:
        np.testing.assert_allclose(padded[2][name], compact[2][name], rtol=1e-6, err_msg=name)
    assert np.all(np.isfinite(padded[3]))
    np.testing.assert_allclose(padded[3][:, [1, 2, 4, 5]], compact[3], rtol=1e-6)
    np.testing.assert_array_equal(padded[3][:, [0, 3, 6, 7, 8, 9]], 0.0)


def test_segments_are_per_row_and_microbatches_add_up():
    # The shared row split into two rows, each sequence with segment id 1: same sums as one row.
    rows = dict(logp=LOGP[:, :4].repeat(2, 0), mu=MU[:, :4].repeat(2, 0),
                adv=ADV[:, :4].repeat(2, 0), mask=MASK[:, :4].repeat(2, 0))
    for name, x in (("logp", LOGP), ("mu", MU), ("adv", ADV), ("mask", MASK)):
        rows[name][1, :3] = x[0, 3:6]
        rows[name][1, 3] = x[0, 6]
    seg = np.array([[1, 1, 1, 0], [1, 1, 1, 0]], np.int32)
    loss_sum, weight, stats, grad = loss_and_grad("gspo", seg=seg, **rows)
    np.testing.assert_allclose(loss_sum, -0.8660254 * 0.5 + 2.0, rtol=1e-5)
    assert weight == 2.0
    np.testing.assert_allclose(grad, [[0, -0.21650635, -0.21650635, 0], [0, 1.0, 1.0, 0]],
                               rtol=1e-5, atol=1e-7)
    # Each row as its own microbatch: sums add, min and max combine.
    halves = [loss_and_grad("gspo", seg=seg[i:i + 1], **{k: x[i:i + 1] for k, x in rows.items()})
              for i in (0, 1)]
    np.testing.assert_allclose(halves[0][0] + halves[1][0], loss_sum, rtol=1e-5)
    assert halves[0][1] + halves[1][1] == weight
    for name in stats:
        combine = min if name in MIN_STATS else max if name in MAX_STATS else sum
        np.testing.assert_allclose(combine(h[2][name] for h in halves), stats[name], rtol=1e-5)


# ref - logp per token: log 2, -log 2, 0 (padding last). k3 = e^d - d - 1: 1 - log 2 = 0.3068528,
# log 2 - 0.5 = 0.1931472, 0; their sum is exactly 0.5. d(k3)/dlogp = 1 - e^d: -1, 0.5, 0.
KL_ROW = dict(logp=np.zeros((1, 4), np.float32), mu=np.zeros((1, 4), np.float32),
              adv=np.zeros((1, 4), np.float32), mask=np.array([[1, 1, 1, 0]], np.float32),
              seg=np.array([[1, 1, 2, 0]], np.int32))
REF = jnp.asarray(np.log([[2.0, 0.5, 1.0, 1.0]]).astype(np.float32))


@pytest.mark.parametrize("kind,loss_sum,grad", [
    ("tis", 0.1 * 0.5, [-0.1, 0.05, 0, 0]),
    ("ppo", 0.1 * 0.5, [-0.1, 0.05, 0, 0]),
    # Per-sequence mean: sequence 1 averages 0.3068528 and 0.1931472 to 0.25, sequence 2 is 0.
    ("gspo", 0.1 * 0.25, [-0.05, 0.025, 0, 0]),
])
def test_k3_penalty_to_the_reference(kind, loss_sum, grad):
    got_loss, _, stats, got_grad = loss_and_grad(kind, **KL_ROW, ref_logp_BT=REF, kl_coef=0.1)
    np.testing.assert_allclose(got_loss, loss_sum, rtol=1e-5)
    np.testing.assert_allclose(got_grad, [grad], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(stats["kl_ref_sum"], 0.5, rtol=1e-5)
    # kl_coef = 0: the penalty is off but still reported.
    got_loss, _, stats, got_grad = loss_and_grad(kind, **KL_ROW, ref_logp_BT=REF)
    assert got_loss == 0.0 and not got_grad.any()
    np.testing.assert_allclose(stats["kl_ref_sum"], 0.5, rtol=1e-5)


def test_jits_with_static_settings():
    settings = LossSettings(kind="gspo", max_segments=4)
    f = jax.jit(functools.partial(policy_loss, settings=settings))
    loss_sum, weight, stats = f(*map(jnp.asarray, (LOGP, MU, ADV, MASK, SEG)))
    np.testing.assert_allclose(float(loss_sum), -0.8660254 * 0.5 + 2.0, rtol=1e-5)
    assert float(weight) == 2.0 and stats["ratio_sum"].dtype == jnp.float32


def test_unknown_kind_names_it_and_the_choices():
    with pytest.raises(ValueError, match=r"'a2c'.*\('tis', 'ppo', 'gspo'\)"):
        LossSettings(kind="a2c")


# (correction, bounds, loss_sum, weight, dL/dlogp) of the tis loss, by hand from the table:
# per token r = 1.5, 0.5 | 3, 4/3; per sequence the product 0.75 | 4, the geometric mean
# 0.8660254 | 2. A masked token leaves the loss and the weight.
CORRECTED = [
    ("icepop", (0.6, 2.5), 0.375 - 1.0, 2.0, [0, -0.75, 0, 0, 0, 4 / 3, 0]),
    ("seq_mis", (0.5, 2.5), 0.375 + 0.25, 2.0, [0, -0.75, -0.25, 0, 0, 0, 0]),
    ("geo_mis", (0.9, 2.5), -0.5 - 1.0, 2.0, [0, 0, 0, 0, 2.0, 4 / 3, 0]),
    ("none", (0.6, 2.5), 0.375 + 0.25 - 0.5 - 1.0, 4.0, [0, -0.75, -0.25, 0, 2.0, 4 / 3, 0]),
]


@pytest.mark.parametrize("correction,bounds,loss_sum,weight,grad", CORRECTED)
def test_rollout_corrections_mask_by_hand(correction, bounds, loss_sum, weight, grad):
    got_loss, got_weight, stats, got_grad = loss_and_grad(
        "tis", correction=correction, correction_low=bounds[0], correction_high=bounds[1])
    np.testing.assert_allclose(got_loss, loss_sum, rtol=1e-5)
    np.testing.assert_allclose(got_grad, [grad], rtol=1e-5, atol=1e-7)
    assert got_weight == weight and stats["corrected"] == 4.0 - weight
    # The ratio's stats still describe every counted token, masked or not.
    assert stats["tokens"] == 4.0 and stats["ratio_max"] == pytest.approx(3.0)


def test_a_sequence_correction_drops_whole_gspo_sequences():
    """seq_mis drops sequence 2 (product 4): gspo's weight is the one sequence left."""
    got_loss, weight, stats, grad = loss_and_grad("gspo", correction="seq_mis",
                                                  correction_low=0.5, correction_high=2.5)
    np.testing.assert_allclose(got_loss, -0.8660254 * 0.5, rtol=1e-5)
    assert weight == 1.0 and stats["corrected"] == 2.0
    np.testing.assert_allclose(grad, [[0, -0.21650635, -0.21650635, 0, 0, 0, 0]], rtol=1e-5,
                               atol=1e-7)


@pytest.mark.parametrize("correction,low,high,says", [
    ("clip", 0.5, 5.0, "unknown rollout correction 'clip'"),
    ("icepop", 1.0, 5.0, "[1.0, 5.0] must satisfy 0 <= low < 1 < high"),
    ("icepop", 0.5, 0.9, "[0.5, 0.9] must satisfy"),
])
def test_bad_corrections_name_the_value(correction, low, high, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        LossSettings("tis", correction=correction, correction_low=low, correction_high=high)
