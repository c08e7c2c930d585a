"""Losses, estimators and aggregation against independent numpy implementations of the reference formulas.

Written from shared/reference/rl-objectives.md before the JAX code; values and gradients (jax.grad against
the analytic derivative of the formula, branch by branch).
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_term.rl.advantages import check_rewards, group_advantages, zero_variance_groups
from jaxrl_term.rl.losses import (
    aggregate,
    binary_divergence,
    dppo_loss,
    dppo_trust_mask,
    kl_penalty,
    ppo_clip_fraction,
    ppo_clip_loss,
    tis_weights,
)

# Ratios on every side of every boundary, advantages of both signs, masked and unmasked tokens.
RATIOS = [0.05, 0.5, 0.79, 0.9, 1.05, 1.15, 1.25, 1.27, 1.3, 1.5, 2.5, 8.0]  # none on a clip boundary
ADVS = [1.0, -1.0, 0.3, -2.0]


def grid(seed=0):
    rng = np.random.RandomState(seed)
    combos = list(itertools.product(RATIOS, ADVS, [0.0, 1.0]))
    r = np.array([c[0] for c in combos])
    adv = np.array([c[1] for c in combos])
    mask = np.array([c[2] for c in combos])
    old = np.log(rng.uniform(0.01, 0.95, len(combos)))  # a behaviour prob per token
    logp = np.minimum(old + np.log(r), -1e-4)  # trainer log-prob with the chosen ratio (kept <= 0)
    f = lambda a: a.reshape(4, -1).astype(np.float32)  # noqa: E731
    return f(logp), f(old), f(adv), f(mask)


# ------------------------------------------------------------------------------------------- numpy refs


def np_ppo(logp, old, a, m, el, eh, c=None):
    r = np.exp(np.clip(logp - old, -20, 20))
    loss = -np.minimum(r * a, np.clip(r, 1 - el, 1 + eh) * a)
    if c is not None:
        loss = np.where(a < 0, np.minimum(loss, -c * a), loss)
    return loss * m


def np_ppo_grad(logp, old, a, m, el, eh, c=None):
    r = np.exp(logp - old)
    clipped_active = ((a > 0) & (r > 1 + eh)) | ((a < 0) & (r < 1 - el))
    g = np.where(clipped_active, 0.0, -a * r)
    if c is not None:
        loss = np_ppo(logp, old, a, 1.0, el, eh)
        g = np.where((a < 0) & (loss > -c * a), 0.0, g)
    return g * m


def np_dppo(logp, mu, a, m, delta, div, cap=10.0):
    p, q = np.exp(np.clip(mu, -30, 0)), np.exp(np.clip(logp, -30, 0))
    if div == "binary_tv":
        d = np.abs(p - q)
    else:
        d = p * np.log(p / q) + (1 - p) * np.log((1 - p) / (1 - q))
    r = np.exp(logp - mu)
    masked = ((a > 0) & (r > 1) & (d > delta)) | ((a < 0) & (r < 1) & (d > delta))
    keep = 1.0 - masked
    w = np.minimum(r, cap)
    return -keep * w * a * m, -keep * w * a * m, keep  # value, d value / d logp, trust mask


# ---------------------------------------------------------------------------------------------- PPO clip


@pytest.mark.parametrize("el,eh,c", [(0.2, 0.2, None), (0.2, 0.28, None), (0.2, 0.28, 3.0)])
def test_ppo_clip_values_and_gradients_match_formula(el, eh, c):
    logp, old, a, m = grid()
    out = ppo_clip_loss(jnp.asarray(logp), old, a, m, el, eh, c)
    np.testing.assert_allclose(np.asarray(out), np_ppo(logp, old, a, m, el, eh, c), rtol=1e-5, atol=1e-6)
    g = jax.grad(lambda lp: ppo_clip_loss(lp, old, a, m, el, eh, c).sum())(jnp.asarray(logp))
    np.testing.assert_allclose(np.asarray(g), np_ppo_grad(logp, old, a, m, el, eh, c), rtol=1e-5, atol=1e-6)
    # every branch is exercised on unmasked tokens
    r = np.exp(logp - old)
    live = m > 0
    assert (live & (a > 0) & (r > 1 + eh)).any() and (live & (a < 0) & (r < 1 - el)).any()
    assert (live & (a > 0) & (r < 1 - el)).any() and (live & (a < 0) & (r > 1 + eh)).any()
    if c is not None:
        assert (live & (a < 0) & (np_ppo(logp, old, a, 1.0, el, eh) > -c * a)).any()


def test_ppo_negative_advantage_is_not_inverted():
    # A < 0 and the ratio already far below 1 - eps: the clip stops the gradient (EasyDeL had this inverted);
    # A < 0 and r far above 1 + eps: still pushed down with full gradient -A r.
    a = jnp.asarray([[-1.0, -1.0]])
    old = jnp.log(jnp.asarray([[0.5, 0.5]]))
    logp = jnp.log(jnp.asarray([[0.2, 0.9]]))  # r = 0.4, 1.8
    g = jax.grad(lambda lp: ppo_clip_loss(lp, old, a, 1.0).sum())(logp)
    np.testing.assert_allclose(np.asarray(g), [[0.0, 1.8]], rtol=1e-6)
    assert np.asarray(ppo_clip_fraction(logp, old, a)).tolist() == [[True, False]]


def test_ppo_clip_fraction_matches_inactive_gradient():
    logp, old, a, m = grid(1)
    frac = np.asarray(ppo_clip_fraction(logp, old, a, 0.2, 0.28))
    g = np_ppo_grad(logp, old, a, 1.0, 0.2, 0.28)
    np.testing.assert_array_equal(frac, g == 0)


# -------------------------------------------------------------------------------------------------- DPPO


@pytest.mark.parametrize("div,delta", [("binary_tv", 0.1), ("binary_tv", 0.15), ("binary_kl", 0.05)])
def test_dppo_values_gradients_and_mask_match_formula(div, delta):
    logp, mu, a, m = grid(2)
    val, grad, keep = np_dppo(logp, mu, a, m, delta, div)
    out = dppo_loss(jnp.asarray(logp), mu, a, m, delta, div)
    np.testing.assert_allclose(np.asarray(out), val, rtol=1e-5, atol=1e-6)
    g = jax.grad(lambda lp: dppo_loss(lp, mu, a, m, delta, div).sum())(jnp.asarray(logp))
    np.testing.assert_allclose(np.asarray(g), grad, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(dppo_trust_mask(logp, mu, a, delta, div)), keep)
    # both masked and kept tokens occur
    assert (keep == 0).any() and (keep == 1).sum() > keep.size // 2


def test_dppo_never_masks_tokens_moving_back_toward_ratio_one():
    rng = np.random.RandomState(3)
    mu = np.log(rng.uniform(0.001, 0.999, 4000)).astype(np.float32)
    logp = np.log(rng.uniform(0.001, 0.999, 4000)).astype(np.float32)  # arbitrary, large divergences
    a = rng.choice([-1.0, 1.0], 4000).astype(np.float32)
    r = np.exp(logp - mu)
    for div in ("binary_tv", "binary_kl"):
        keep = np.asarray(dppo_trust_mask(logp, mu, a, 0.0, div))
        toward_one = ((a > 0) & (r < 1)) | ((a < 0) & (r > 1))
        assert keep[toward_one].min() == 1.0
        assert keep[~toward_one].mean() < 0.01  # with delta = 0 everything moving away is masked


def test_binary_kl_formula():
    p, q = 0.7, 0.4
    d = float(binary_divergence(jnp.log(q), jnp.log(p), "binary_kl"))
    assert d == pytest.approx(p * np.log(p / q) + (1 - p) * np.log((1 - p) / (1 - q)), rel=1e-5)


def test_dppo_ratio_cap_limits_the_weight():
    logp, mu, a = jnp.asarray([[0.0]]), jnp.log(jnp.asarray([[0.05]])), jnp.asarray([[-1.0]])  # r = 20, A < 0
    g = jax.grad(lambda lp: dppo_loss(lp, mu, a, 1.0, 0.1, ratio_cap=10.0).sum())(logp)
    assert float(g[0, 0]) == pytest.approx(10.0)


# ----------------------------------------------------------------------------------------------- TIS, KL


def test_tis_weights_are_truncated_and_detached():
    old = jnp.log(jnp.asarray([0.5, 0.9, 0.1]))
    mu = jnp.log(jnp.asarray([0.5, 0.3, 0.2]))
    w = tis_weights(old, mu, cap=2.0)
    np.testing.assert_allclose(np.asarray(w), [1.0, 2.0, 0.5], rtol=1e-6)
    assert float(jnp.abs(jax.grad(lambda o: tis_weights(o, mu, 2.0).sum())(old)).sum()) == 0.0


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimators_values_and_gradients(kind):
    rng = np.random.RandomState(4)
    logp = np.log(rng.uniform(0.01, 1, 50)).astype(np.float32)
    ref = np.log(rng.uniform(0.01, 1, 50)).astype(np.float32)
    d = logp - ref
    val = {"k1": d, "k2": 0.5 * d**2, "k3": np.exp(-d) + d - 1}[kind]
    grad = {"k1": np.ones_like(d), "k2": d, "k3": 1 - np.exp(-d)}[kind]
    np.testing.assert_allclose(np.asarray(kl_penalty(jnp.asarray(logp), ref, kind)), val, rtol=1e-5, atol=1e-6)
    g = jax.grad(lambda lp: kl_penalty(lp, ref, kind).sum())(jnp.asarray(logp))
    np.testing.assert_allclose(np.asarray(g), grad, rtol=1e-5, atol=1e-6)
    if kind == "k3":
        assert val.min() >= 0


# ----------------------------------------------------------------------------------------------- aggregate


def test_aggregation_modes_match_numpy():
    rng = np.random.RandomState(5)
    x = rng.randn(3, 6).astype(np.float32)
    m = np.array([[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0]], np.float32)
    n, d = aggregate(x, m, "token-mean")
    assert float(n / d) == pytest.approx((x * m).sum() / m.sum(), rel=1e-6)
    n, d = aggregate(x, m, "seq-mean-token-mean")
    ref = np.mean([(x[i] * m[i]).sum() / m[i].sum() for i in range(2)])  # the empty row is not a sequence
    assert float(n / d) == pytest.approx(ref, rel=1e-6)
    n, d = aggregate(x, m, "seq-mean-token-sum-norm", norm_len=10)
    assert float(n / d) == pytest.approx((x * m).sum() / (2 * 10), rel=1e-6)
    with pytest.raises(ValueError, match="norm_len"):
        aggregate(x, m, "seq-mean-token-sum-norm")


def test_sequence_aggregation_counts_packed_segments_as_sequences():
    x = np.arange(8, dtype=np.float32)[None]
    m = np.array([[0, 1, 1, 0, 1, 1, 1, 0]], np.float32)
    seg = np.array([[1, 1, 1, 2, 2, 2, 2, 0]])
    n, d = aggregate(x, m, "seq-mean-token-mean", segment_ids=jnp.asarray(seg))
    assert float(n / d) == pytest.approx(((1 + 2) / 2 + (4 + 5 + 6) / 3) / 2)


# ------------------------------------------------------------------------------------------- advantages


def np_rloo(r):
    g = r.shape[1]
    return np.stack([[r[n, i] - np.delete(r[n], i).mean() for i in range(g)] for n in range(r.shape[0])])


def test_estimators_match_formulas():
    rng = np.random.RandomState(6)
    r = rng.uniform(0, 1, (5, 8)).astype(np.float32)
    mean, std = r.mean(1, keepdims=True), r.std(1, keepdims=True)
    np.testing.assert_allclose(group_advantages(r, "grpo"), (r - mean) / (std + 1e-6), rtol=1e-5)
    np.testing.assert_allclose(group_advantages(r, "grpo", std_ddof=1),
                               (r - mean) / (r.std(1, ddof=1, keepdims=True) + 1e-6), rtol=1e-5)
    np.testing.assert_allclose(group_advantages(r, "drgrpo"), r - mean, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(group_advantages(r, "rloo"), np_rloo(r), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(group_advantages(r, "loop"), np_rloo(r), rtol=1e-5, atol=1e-6)
    # the jax path gives the same numbers
    np.testing.assert_allclose(np.asarray(group_advantages(jnp.asarray(r), "rloo")), np_rloo(r), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("w", [0.0, 0.1, 1.0])
def test_negative_weight_scales_only_the_negative_advantages(w):
    """algo.negative_weight: A < 0 becomes w A after the estimator; A >= 0 is untouched (numpy and jax alike)."""
    rng = np.random.RandomState(7)
    r = rng.uniform(0, 1, (4, 6)).astype(np.float32)
    base = group_advantages(r, "grpo")
    want = np.where(base < 0, w * base, base)
    np.testing.assert_allclose(group_advantages(r, "grpo", negative_weight=w), want, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(group_advantages(jnp.asarray(r), "drgrpo", negative_weight=w)),
                               np.where(r - r.mean(1, keepdims=True) < 0, w, 1.0) * (r - r.mean(1, keepdims=True)),
                               rtol=1e-5, atol=1e-7)
    assert group_advantages(r, "grpo", negative_weight=w).dtype == np.float32
    with pytest.raises(ValueError, match="algo.negative_weight"):
        group_advantages(r, "grpo", negative_weight=-0.5)


def test_zero_variance_groups_are_flagged_and_get_zero_advantage():
    r = np.array([[1, 1, 1, 1], [0, 1, 0, 0], [0.35, 0.35, 0.35, 0.35]], np.float32)
    assert zero_variance_groups(r).tolist() == [True, False, True]
    adv = group_advantages(r, "grpo")
    assert np.isfinite(adv).all() and (adv[[0, 2]] == 0).all()


def test_nan_rewards_are_refused_with_their_position():
    with pytest.raises(ValueError, match="group 1, rollout 2 is nan"):
        check_rewards(np.array([[0, 1, 0], [1, 0, np.nan]]))
    with pytest.raises(ValueError, match="at least 2 rollouts"):
        group_advantages(np.ones((2, 1), np.float32), "rloo")
    with pytest.raises(ValueError, match="known estimators"):
        group_advantages(np.ones((2, 2), np.float32), "ppo")


def test_rft_advantage_makes_the_on_policy_ppo_gradient_the_nll_gradient_of_the_successes():
    """algo.advantage=rft: A = R (0/1), so at ratio 1 the clipped surrogate's gradient is the gradient of the
    successes' negative log-likelihood (the failures contribute nothing): RFT on the policy's own samples."""
    rewards = np.array([[1.0, 0.0, 1.0, 0.0]], np.float32)
    adv = group_advantages(rewards, "rft")
    np.testing.assert_array_equal(adv, rewards)
    rng = np.random.RandomState(3)
    old = np.log(rng.uniform(0.05, 0.9, (4, 6))).astype(np.float32)
    mask = (rng.uniform(size=(4, 6)) < 0.8).astype(np.float32)
    a_tok = np.repeat(adv.reshape(4, 1), 6, axis=1)

    def surrogate(logp):
        return aggregate(ppo_clip_loss(logp, old, a_tok, mask, 0.2, 0.28), mask, "seq-mean-token-mean")[0]

    def nll_of_successes(logp):
        per_seq = (-logp * mask).sum(1) / np.maximum(mask.sum(1), 1.0)
        return (per_seq * rewards.reshape(4)).sum()

    np.testing.assert_allclose(np.asarray(jax.grad(surrogate)(jnp.asarray(old))),
                               np.asarray(jax.grad(nll_of_successes)(jnp.asarray(old))), rtol=1e-5, atol=1e-7)


def test_placebo_shuffle_permutes_the_whole_batch_and_is_seeded():
    from jaxrl_term.rl.advantages import shuffled_rewards

    r = np.arange(12, dtype=np.float32).reshape(3, 4)
    a, b = shuffled_rewards(r, seed=1), shuffled_rewards(r, seed=1)
    np.testing.assert_array_equal(a, b)
    assert a.shape == r.shape and sorted(a.ravel()) == sorted(r.ravel()) and not np.array_equal(a, r)
    assert any(set(row) != set(orig) for row, orig in zip(a, r))  # episodes move across groups too
    assert not np.array_equal(shuffled_rewards(r, seed=2), a)
