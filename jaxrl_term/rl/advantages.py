"""Group-relative advantage estimators: rewards [N groups, G rollouts] -> advantages [N, G].

Formulas (shared/reference/rl-objectives.md):
  grpo     (R_i - mean R) / (std R + eps)
  drgrpo   R_i - mean R                         ("centered", Tmax)
  rloo     R_i - mean_{j != i} R_j = G/(G-1) (R_i - mean R)   (alias: loop, the Terminal-Bench-RL run)
  rft      R_i (no baseline): with a 0/1 outcome reward and on-policy samples the policy-gradient loss is the
           NLL of the successful episodes, i.e. rejection-sampling fine-tuning on the policy's own successes
           (keep all-success groups: trainer.drop_zero_variance=false)
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

ESTIMATORS: dict[str, Callable] = {}


def register_estimator(*names: str):
    def deco(fn):
        for n in names:
            ESTIMATORS[n] = fn
        return fn

    return deco


@register_estimator("grpo")
def grpo(rewards, eps: float = 1e-6, std_ddof: int = 0):
    mean = rewards.mean(axis=-1, keepdims=True)
    std = rewards.std(axis=-1, keepdims=True, ddof=std_ddof)
    return (rewards - mean) / (std + eps)


@register_estimator("drgrpo", "centered")
def centered(rewards, **_):
    return rewards - rewards.mean(axis=-1, keepdims=True)


@register_estimator("rloo", "loop")
def leave_one_out(rewards, **_):
    g = rewards.shape[-1]
    if g < 2:
        raise ValueError("rloo/loop advantages need at least 2 rollouts per group (algo.group_size >= 2)")
    return (rewards - rewards.mean(axis=-1, keepdims=True)) * (g / (g - 1))


@register_estimator("rft")
def rejection_sampling(rewards, **_):
    return rewards


def shuffled_rewards(rewards, seed: int):
    """The placebo control (``algo.shuffle_rewards``): the batch's rewards permuted across all its episodes
    (groups included), so advantages keep their distribution but lose their link to what each episode did."""
    flat = np.asarray(rewards, np.float32).reshape(-1)
    return np.random.default_rng(seed).permutation(flat).reshape(np.shape(rewards))


def group_advantages(rewards, estimator: str = "grpo", *, eps: float = 1e-6, std_ddof: int = 0,
                     negative_weight: float = 1.0):
    """rewards: [N, G] float -> advantages [N, G] float32 (numpy in, numpy out; jax in, jax out).

    ``std_ddof`` = 0 uses the population std (as most JAX GRPO code); 1 the sample std (TRL/verl).
    ``negative_weight`` (``algo.negative_weight``) scales the negative advantages after the estimator: 1 leaves
    them, 0 learns from the better-than-average episodes only, 0.1 is W-REINFORCE's weighting of negative samples.
    """
    if not 0.0 <= negative_weight <= 1.0:
        raise ValueError(f"algo.negative_weight={negative_weight}: must be in [0, 1]")
    if estimator not in ESTIMATORS:
        raise ValueError(f"algo.advantage={estimator!r}; known estimators: {sorted(ESTIMATORS)}")
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [groups, group_size], got shape {tuple(rewards.shape)}")
    xp = np if isinstance(rewards, np.ndarray) else jnp
    rewards = rewards.astype(xp.float32)
    adv = ESTIMATORS[estimator](rewards, eps=eps, std_ddof=std_ddof)
    if negative_weight != 1.0:
        adv = xp.where(adv < 0, adv * xp.float32(negative_weight), adv).astype(xp.float32)
    return adv


def zero_variance_groups(rewards, atol: float = 0.0):
    """[N] bool: groups whose rewards are all equal (no learning signal; drop and refill)."""
    return (rewards.max(axis=-1) - rewards.min(axis=-1)) <= atol


def check_rewards(rewards: np.ndarray) -> np.ndarray:
    """Host-side validation before anything reaches the jitted step: NaN/inf rewards are an error."""
    rewards = np.asarray(rewards, np.float32)
    bad = ~np.isfinite(rewards)
    if bad.any():
        g, i = np.argwhere(bad)[0]
        raise ValueError(
            f"reward of group {g}, rollout {i} is {rewards[g, i]}; rewards must be finite. A crashed verifier "
            "or judge must drop or retry the trajectory, never pass NaN on"
        )
    return rewards
