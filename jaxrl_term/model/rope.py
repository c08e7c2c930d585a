"""Rotary position embeddings: plain RoPE, and YaRN for context beyond the pre-training length.

The numbers follow transformers (``modeling_rope_utils._compute_yarn_parameters`` and
``Qwen3RotaryEmbedding.forward``) operation by operation in fp32, so the tables match it to rounding: a host-side
``inv_freq`` (``theta ** (arange(0, D, 2) / D)`` rounded once to fp32, then fp32 arithmetic), fp32 angles, and the
YaRN attention factor applied to cos and sin. SGLang's ``YaRNScalingRotaryEmbedding`` computes the same for the
keys it reads (factor, original_max_position_embeddings, beta_fast, beta_slow, truncate).

YaRN in one line: each frequency is a blend of its plain value (fast dimensions, which rotate many times within the
pre-training length) and its value divided by ``factor`` (slow dimensions), with a linear ramp between the
dimensions that rotate ``beta_fast`` and ``beta_slow`` times over ``original_max_position_embeddings`` positions;
cos/sin are scaled by ``attention_factor`` (default ``0.1 ln(factor) + 1``). The model then covers
``original_max_position_embeddings * factor`` positions.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# keys of an HF rope_scaling / rope_parameters dict for YaRN (transformers' _validate_yarn_rope_parameters);
# "type" is the v4 spelling of "rope_type", rope_theta / partial_rotary_factor are v5's additions
YARN_KEYS = frozenset({"rope_type", "type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                       "attention_factor", "mscale", "mscale_all_dim", "truncate", "rope_theta",
                       "partial_rotary_factor"})
# YaRN keys SGLang's rotary embedding does not read: it takes factor, original_max_position_embeddings, beta_fast,
# beta_slow, truncate, mscale and mscale_all_dim (layers/rotary_embedding/factory.py, yarn.py in 0.5.23), and its own
# attn_factor instead of attention_factor
SGLANG_IGNORED_KEYS = ("attention_factor",)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention factor (Eq. 21): ``0.1 * mscale * ln(scale) + 1`` (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """YaRN scaling, as an HF ``rope_scaling`` (transformers v4) / ``rope_parameters`` (v5) dict with
    ``rope_type: yarn`` describes it. ``attention_factor`` None: derived from ``factor`` (and ``mscale`` /
    ``mscale_all_dim`` when both are set), as transformers does."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    @classmethod
    def from_hf(cls, d: Mapping[str, Any] | None, *, max_position_embeddings: int) -> RopeScaling | None:
        """None for plain RoPE (no dict, or rope_type ``default``). Raises ValueError (naming the key and the fix)
        for another rope_type, an unknown key or a bad value. Defaults as transformers >= 4.57 and v5:
        ``original_max_position_embeddings`` = ``max_position_embeddings``, beta_fast 32, beta_slow 1 (also for a
        0 / null value), truncate true. (transformers 4.51.3 replaced ``factor`` by max_position_embeddings /
        original_max_position_embeddings when both were given, 4.57.1 no longer; ``Qwen3Config.to_hf`` writes
        configs on which every version agrees.)"""
        if not d:
            return None
        d = dict(d)
        rope_type = d.get("rope_type") or d.get("type") or "default"
        if rope_type == "default":
            return None
        if rope_type != "yarn":
            raise ValueError(f"rope_type {rope_type!r} is not supported (jaxrl_term implements plain RoPE and YaRN); "
                             "use rope_type 'yarn' with factor and original_max_position_embeddings (Qwen3's "
                             "long-context recipe)")
        unknown = sorted(set(d) - YARN_KEYS)
        if unknown:
            hint = " (SGLang's name; transformers ignores it: the two would differ)" if "attn_factor" in unknown else ""
            raise ValueError(f"unknown YaRN keys {unknown}{hint}; use some of {sorted(YARN_KEYS - {'type'})}")
        if d.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"partial_rotary_factor={d['partial_rotary_factor']}: Qwen3 rotates every dimension; "
                             "remove it")
        if d.get("factor") is None:
            raise ValueError("YaRN needs a factor (e.g. 2.0: twice original_max_position_embeddings)")
        factor = float(d["factor"])
        if factor < 1.0:
            raise ValueError(f"YaRN factor {factor} < 1; use a factor >= 1 (the context is original x factor)")
        orig = int(d.get("original_max_position_embeddings") or max_position_embeddings)
        opt = lambda k: None if d.get(k) is None else float(d[k])  # noqa: E731
        return cls(factor=factor, original_max_position_embeddings=orig,
                   beta_fast=float(d.get("beta_fast") or 32.0), beta_slow=float(d.get("beta_slow") or 1.0),
                   attention_factor=opt("attention_factor"), mscale=opt("mscale"),
                   mscale_all_dim=opt("mscale_all_dim"), truncate=bool(d.get("truncate", True)))

    def to_hf(self) -> dict[str, Any]:
        """The ``rope_scaling`` dict (transformers v4 and v5, SGLang): defaults left out."""
        out: dict[str, Any] = {"rope_type": "yarn", "factor": self.factor,
                               "original_max_position_embeddings": self.original_max_position_embeddings}
        if self.beta_fast != 32.0:
            out["beta_fast"] = self.beta_fast
        if self.beta_slow != 1.0:
            out["beta_slow"] = self.beta_slow
        for k in ("attention_factor", "mscale", "mscale_all_dim"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        if not self.truncate:
            out["truncate"] = False
        return out

    @property
    def max_context(self) -> int:
        """Positions the scaled model covers: original x factor (SGLang's cos/sin cache has this many)."""
        return int(self.original_max_position_embeddings * self.factor)

    @property
    def attention_scale(self) -> float:
        """The factor on cos and sin (transformers' ``attention_factor`` / ``attention_scaling``)."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return float(yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim))
        return yarn_mscale(self.factor)


def _pos_freqs(head_dim: int, theta: float) -> np.ndarray:
    # theta ** (arange(0, D, 2) / D): fp32 exponent as torch forms it, the power rounded once to fp32 (torch's own
    # fp32 pow is within an ulp of it: 1 of Qwen3-8B's 64 frequencies differs, by 1.5e-7 relative)
    expo = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    return (np.float64(theta) ** expo.astype(np.float64)).astype(np.float32)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> tuple[np.ndarray, float]:
    """(inv_freq [head_dim // 2] fp32, factor on cos/sin): transformers' default rope init, or its YaRN init."""
    f32 = np.float32
    pos = _pos_freqs(head_dim, theta)
    if scaling is None:
        return f32(1.0) / pos, 1.0
    s = scaling

    def correction_dim(rotations: float) -> float:  # the dimension that rotates `rotations` times over original
        orig = s.original_max_position_embeddings
        return head_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers: prevent a singular ramp
    ramp = np.clip((np.arange(head_dim // 2, dtype=f32) - f32(low)) / f32(high - low), f32(0), f32(1))
    extrapolation = f32(1) - ramp  # 1: keep the plain frequency; 0: divide it by factor
    inv_extra, inv_inter = f32(1) / pos, f32(1) / (f32(s.factor) * pos)
    inv_freq = inv_inter * (f32(1) - extrapolation) + inv_extra * extrapolation
    return inv_freq.astype(f32), s.attention_scale


def rope_tables(positions: jax.Array, head_dim: int, theta: float, dtype,
                scaling: RopeScaling | None = None) -> tuple[jax.Array, jax.Array]:
    """cos, sin: [B, T, head_dim] for integer ``positions`` [B, T] (fp32 angles and scale, cast to ``dtype``)."""
    inv_freq, scale = rope_frequencies(head_dim, theta, scaling)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    emb = jnp.concatenate([angles, angles], axis=-1)
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    if scale != 1.0:
        cos, sin = cos * np.float32(scale), sin * np.float32(scale)
    return cos.astype(dtype), sin.astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [B, T, N, D]; cos/sin: [B, T, D]. Rotate-half convention (HF)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]
