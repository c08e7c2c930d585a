"""Policy losses, importance weights, KL estimators and aggregation: pure functions of arrays.

All per-token arrays are [B, T] and aligned with the token they score; masked positions return 0.
Notation (shared/reference/rl-objectives.md): ``logp`` the trainer's log-prob (fp32), ``old_logp`` the
behaviour policy for PPO ratios, ``rollout_logp`` (mu) what the engine reported when sampling, ``A`` the
advantage broadcast over the trajectory's tokens.

Algorithms are registered by name (``algo.loss``); each entry maps a dict of [B, T] inputs and the algo
config to ``(per_token_loss, per_token_metrics)``, metrics summed over masked tokens by the step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

LOG_RATIO_CLAMP = 20.0
LOGP_FLOOR = -30.0


def _ratio(logp, ref):
    return jnp.exp(jnp.clip(logp - ref, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


# ------------------------------------------------------------------------------------------ PPO / GRPO


def ppo_clip_loss(logp, old_logp, advantages, mask, eps_low=0.2, eps_high=0.2, dual_clip=None):
    """-min(r A, clip(r, 1-eps_low, 1+eps_high) A), with optional dual clip min(., -c A) for A < 0. -> [B, T]"""
    r = _ratio(logp, old_logp)
    unclipped = r * advantages
    clipped = jnp.clip(r, 1.0 - eps_low, 1.0 + eps_high) * advantages
    loss = -jnp.minimum(unclipped, clipped)
    if dual_clip is not None:
        loss = jnp.where(advantages < 0, jnp.minimum(loss, -dual_clip * advantages), loss)
    return loss * mask


def ppo_clip_fraction(logp, old_logp, advantages, eps_low=0.2, eps_high=0.2, dual_clip=None):
    """1 where a clipped branch is the active one (the token gives no gradient), else 0: the PPO clip, and with
    ``dual_clip`` also A < 0 tokens whose ratio exceeds it (the loss is the constant -c A there)."""
    r = _ratio(logp, old_logp)
    out = ((advantages > 0) & (r > 1 + eps_high)) | ((advantages < 0) & (r < 1 - eps_low))
    if dual_clip is not None:
        out = out | ((advantages < 0) & (r > dual_clip))
    return out


# ------------------------------------------------------------------------------------------------ DPPO


def binary_divergence(logp, rollout_logp, divergence: str = "binary_tv"):
    """Per-token divergence between the sampled token's rollout prob p = e^mu and trainer prob q = e^logp."""
    p = jnp.exp(jnp.clip(rollout_logp, LOGP_FLOOR, 0.0))
    q = jnp.exp(jnp.clip(logp, LOGP_FLOOR, 0.0))
    if divergence == "binary_tv":
        return jnp.abs(p - q)
    if divergence == "binary_kl":
        tiny = 1e-7
        p, q = jnp.clip(p, tiny, 1 - tiny), jnp.clip(q, tiny, 1 - tiny)
        return p * jnp.log(p / q) + (1 - p) * jnp.log((1 - p) / (1 - q))
    raise ValueError(f"algo.divergence={divergence!r}; use binary_tv or binary_kl")


def dppo_trust_mask(logp, rollout_logp, advantages, delta, divergence="binary_tv"):
    """M' (float, no gradient): 0 for tokens that moved more than ``delta`` in the direction of the update.

    Masked: (A > 0 and r > 1 and D > delta) or (A < 0 and r < 1 and D > delta). A token whose update would
    move r back toward 1 (A > 0 with r < 1, A < 0 with r > 1) is never masked.
    """
    logp, rollout_logp = jax.lax.stop_gradient(logp), jax.lax.stop_gradient(rollout_logp)
    r = _ratio(logp, rollout_logp)
    d = binary_divergence(logp, rollout_logp, divergence)
    out = ((advantages > 0) & (r > 1) & (d > delta)) | ((advantages < 0) & (r < 1) & (d > delta))
    return 1.0 - out.astype(jnp.float32)


def dppo_loss(logp, rollout_logp, advantages, mask, delta=0.1, divergence="binary_tv", ratio_cap=10.0):
    """-M' r A with r = exp(logp - mu) against the rollout policy; no ratio clipping. -> [B, T]

    As in the reference implementation the gradient is -M' A sg(min(r, cap)) d logp (same as d(-M' r A)
    for r <= cap), and the value reported is -M' A min(r, cap).
    """
    r = _ratio(logp, rollout_logp)
    if ratio_cap is not None:
        r = jnp.minimum(r, ratio_cap)
    weight = jax.lax.stop_gradient(r)
    # value: weight; derivative wrt logp: weight (exp(logp - sg(logp)) is 1 with derivative 1)
    surrogate = weight * jnp.exp(logp - jax.lax.stop_gradient(logp))
    m = dppo_trust_mask(logp, rollout_logp, advantages, delta, divergence)
    return -m * surrogate * advantages * mask


# ------------------------------------------------------------------------------ TIS and KL to reference


def tis_weights(old_logp, rollout_logp, cap=2.0):
    """Truncated importance weights min(exp(old - mu), C), detached. [B, T]"""
    return jax.lax.stop_gradient(jnp.minimum(_ratio(old_logp, rollout_logp), cap))


def kl_penalty(logp, ref_logp, kind: str = "k3"):
    """Per-token KL estimate to a reference policy: k1 = logp - ref, k2 = (logp - ref)^2 / 2,
    k3 = exp(ref - logp) - (ref - logp) - 1 (non-negative)."""
    diff = jnp.clip(logp - ref_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff**2
    if kind == "k3":
        return jnp.exp(-diff) + diff - 1.0
    raise ValueError(f"algo.kl_estimator={kind!r}; use k1, k2 or k3")


# ------------------------------------------------------------------------------------------ aggregation

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _per_sequence(x, mask, segment_ids):
    """Sums over each sequence: rows, or (row, segment) pairs when packed. -> ([S] sums, [S] token counts)."""
    if segment_ids is None:
        return (x * mask).sum(-1), mask.sum(-1)
    b, t = mask.shape
    ids = (jnp.arange(b)[:, None] * (t + 1) + segment_ids).reshape(-1)
    n = b * (t + 1)
    sums = jax.ops.segment_sum((x * mask).reshape(-1), ids, num_segments=n)
    counts = jax.ops.segment_sum(mask.reshape(-1), ids, num_segments=n)
    return sums, counts


def aggregate(per_token, mask, mode="token-mean", *, segment_ids=None, norm_len=None):
    """(numerator, denominator) whose ratio is the batch loss; sum both over microbatches, divide once.

    token-mean:               sum(L M) / sum(M)
    seq-mean-token-mean:      sum_s [sum_t L M / sum_t M] / #sequences   (sequences with >= 1 loss token)
    seq-mean-token-sum-norm:  sum(L M) / (#sequences * norm_len)          (Dr. GRPO; norm_len a constant)
    """
    mask = mask.astype(jnp.float32)
    per_token = per_token.astype(jnp.float32)
    if mode == "token-mean":
        return (per_token * mask).sum(), mask.sum()
    sums, counts = _per_sequence(per_token, mask, segment_ids)
    present = (counts > 0).astype(jnp.float32)
    if mode == "seq-mean-token-mean":
        return (sums / jnp.maximum(counts, 1.0)).sum(), present.sum()
    if mode == "seq-mean-token-sum-norm":
        if not norm_len:
            raise ValueError("algo.aggregation=seq-mean-token-sum-norm needs algo.norm_len (a constant length)")
        return sums.sum(), present.sum() * float(norm_len)
    raise ValueError(f"algo.aggregation={mode!r}; use one of {AGG_MODES}")


# --------------------------------------------------------------------------------------------- registry

PolicyLoss = Callable[[Mapping[str, jax.Array], Any], tuple[jax.Array, dict[str, jax.Array]]]
POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_loss(name: str):
    def deco(fn: PolicyLoss) -> PolicyLoss:
        POLICY_LOSSES[name] = fn
        return fn

    return deco


def _common_metrics(x, mask) -> dict[str, jax.Array]:
    """Engine-vs-trainer numerics on *fresh* tokens only (``x["fresh"]``: sampled by the weights being trained,
    lag 0): on older rows the difference is policy drift, not numeric mismatch. ``mismatch_kl`` is the k3
    estimate of KL(engine || trainer) from the engine's samples: exp(logp - mu) - 1 - (logp - mu)."""
    fresh = mask * x.get("fresh", jnp.ones_like(mask))
    diff = jnp.clip(x["logp"] - x["rollout_logp"], -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    gap = jnp.abs(diff) * fresh
    return {
        "logp_gap_mean": gap,  # engine vs trainer, summed over fresh tokens (the step divides by their count)
        "logp_gap_max": gap,  # reduced with max
        "mismatch_kl": (jnp.exp(diff) - 1.0 - diff) * fresh,
        "fresh_tokens": fresh,
        "entropy": x["entropy"] * mask,
    }


@register_loss("ppo_clip")
def _ppo(x, cfg):
    mask = x["loss_mask"]
    old = x["old_logp"] if cfg.use_old_logp else x["rollout_logp"]
    loss = ppo_clip_loss(x["logp"], old, x["advantages"], mask, cfg.eps_low, cfg.eps_high, cfg.dual_clip)
    m = _common_metrics(x, mask)
    if cfg.tis_cap:
        w = tis_weights(old, x["rollout_logp"], cfg.tis_cap)
        loss = loss * w
        m["tis_weight"] = w * mask
    m["clip_frac"] = ppo_clip_fraction(x["logp"], old, x["advantages"], cfg.eps_low, cfg.eps_high,
                                       cfg.dual_clip) * mask
    m["ratio"] = _ratio(x["logp"], old) * mask
    return loss, m


@register_loss("dppo")
def _dppo(x, cfg):
    mask = x["loss_mask"]
    loss = dppo_loss(x["logp"], x["rollout_logp"], x["advantages"], mask, cfg.delta, cfg.divergence, cfg.ratio_cap)
    m = _common_metrics(x, mask)
    trust = dppo_trust_mask(x["logp"], x["rollout_logp"], x["advantages"], cfg.delta, cfg.divergence)
    m["masked_frac"] = (1.0 - trust) * mask
    m["ratio"] = _ratio(x["logp"], x["rollout_logp"]) * mask
    return loss, m


@register_loss("nll")
def _nll(x, cfg):
    """Negative log-likelihood of the masked tokens (supervised warm start on demonstrations)."""
    mask = x["loss_mask"]
    return -x["logp"] * mask, {**_common_metrics(x, mask)}
