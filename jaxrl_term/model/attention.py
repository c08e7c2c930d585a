"""Memory-efficient causal attention for training (flash attention in plain ``jnp`` / ``lax``).

The dense path (``qwen3.make_attention_mask`` + ``qwen3.dot_attention``) builds a [B, T, T] mask and
[B, N, T, T] scores, and autodiff keeps the probabilities for the backward pass: O(T^2) memory, which at
T = 8192 is gigabytes per layer. Here the sequence is cut into query blocks of ``block_q`` and key blocks
of ``block_k`` tokens, and only one [B, N, block_q, block_k] tile of scores exists at a time:

* The mask of a tile is computed from ``segment_ids`` and the tile's indices: key index <= query index
  (rows are right-padded, or packed with each segment's tokens contiguous, so index order is causal order),
  equal segment ids (sequence packing), and key segment != 0 (padding).
* Forward (online softmax): for each query block, loop over key blocks up to the diagonal, keeping the
  running max ``m``, normaliser ``l`` and unnormalised output in fp32. Saves only ``o`` and the per-query
  logsumexp ``lse = m + log(l)`` [B, Nkv, G, T] fp32.
* Backward (FlashAttention-2): for each key block, loop over the query blocks at or below the diagonal,
  recompute ``p = exp(s - lse)`` and accumulate ``dv += p^T dO``, ``dk += dS^T q``, ``dq += dS k`` with
  ``dS = p * (dO v^T - rowsum(dO * o))``. A ``jax.custom_vjp`` supplies this backward, so autodiff never
  looks inside the loops (which would store every tile as a residual, the O(T^2) we set out to avoid).

Loops are ``lax.fori_loop``s whose bounds depend only on block indices (not on data), so tiles above the
diagonal are skipped, and the code works under ``jit``, ``lax.scan``, ``jax.checkpoint`` and GSPMD batch
sharding. Queries with no visible key (padding, segment 0) produce zeros and pass no gradient.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp


def blockwise_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    segment_ids: jax.Array,
    positions: jax.Array | None = None,
    scale: float,
    block_q: int = 512,
    block_k: int = 512,
    precision: Any = None,
) -> jax.Array:
    """Causal, segment-masked grouped-query attention without a [T, T] array. Same maths as
    ``dot_attention(q, k, v, make_attention_mask(segment_ids != 0, segment_ids), scale)`` on every query
    that has a visible key; padding queries (segment 0) give zeros instead of the dense path's mean of ``v``.

    q: [B, T, Nq, D]; k, v: [B, T, Nkv, D] with Nq a multiple of Nkv; any float dtype (bf16 or fp32).
    segment_ids: [B, T] int, 0 = padding; a query sees the keys at or before it with its own segment id.
    positions: [B, T] int, not used: causality is by index within the row (each segment is contiguous, so
        index order is position order). Accepted so call sites can pass the model's inputs unchanged.
    scale: score multiplier, usually ``1 / sqrt(D)``.
    block_q, block_k: tile sizes in tokens; clamped to T, and T need not be a multiple of them.
    precision: matmul precision (``None``, ``"high"``, ``"highest"``...), as for ``qwen3.dot_attention``.
    Returns o: [B, T, Nq, D] in q's dtype. Scores, softmax statistics and accumulators are fp32.
    """
    del positions
    b, t, nq, d = q.shape
    nkv = k.shape[2]
    if k.shape != (b, t, nkv, d) or v.shape != k.shape:
        raise ValueError(f"blockwise_attention: q {q.shape}, k {k.shape}, v {v.shape}; want q [B,T,Nq,D], "
                         "k and v [B,T,Nkv,D] with the same B, T, D (self-attention)")
    if nq % nkv:
        raise ValueError(f"blockwise_attention: Nq={nq} must be a multiple of Nkv={nkv}")
    if segment_ids.shape != (b, t):
        raise ValueError(f"blockwise_attention: segment_ids {segment_ids.shape}, want [B, T] = {(b, t)}")
    if block_q < 1 or block_k < 1:
        raise ValueError(f"blockwise_attention: block_q={block_q}, block_k={block_k} must be positive")
    bq, bk = min(block_q, t), min(block_k, t)
    return _flash(q, k, v, segment_ids.astype(jnp.int32), float(scale), bq, bk, precision)


def reference_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, segment_ids: jax.Array,
                        scale: float, precision: Any = None) -> jax.Array:
    """The model's dense path, for tests: [B, T, T] mask (causal, same segment, key not padding) and fp32
    softmax via ``qwen3.dot_attention``. Shapes as ``blockwise_attention``; o in v's dtype."""
    # Imported here, not at the top: qwen3 imports this module to pick its attention kernel.
    from jaxrl_term.model.qwen3 import dot_attention, make_attention_mask

    mask = make_attention_mask(segment_ids != 0, segment_ids)
    return dot_attention(q, k, v, mask, scale, precision)


# ---------------------------------------------------------------------------------------------- kernel
#
# Internal layout: q, dO, o as [B, Tq, Nkv, G, D] (G = Nq // Nkv query heads per key head), k, v as
# [B, Tk, Nkv, D], per-query statistics as [B, Nkv, G, Tq]; tiles of scores as [B, Nkv, G, bq, bk].
# Tq / Tk are T padded up to whole blocks with segment id 0, which the mask treats as padding.


def _pad_to(x: jax.Array, length: int) -> jax.Array:
    """Zero-pad axis 1 of x up to ``length``."""
    return jnp.pad(x, [(0, 0), (0, length - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def _tile(x: jax.Array, i, size: int) -> jax.Array:
    """Block ``i`` (traced) of ``size`` tokens along axis 1."""
    return jax.lax.dynamic_slice_in_dim(x, i * size, size, axis=1)


def _tile_mask(seg_q: jax.Array, seg_k: jax.Array, q0, k0) -> jax.Array:
    """[B, 1, 1, bq, bk] bool for the tile whose first query / key index is q0 / k0.
    seg_q: [B, bq], seg_k: [B, bk] int32."""
    qi = q0 + jnp.arange(seg_q.shape[1])
    ki = k0 + jnp.arange(seg_k.shape[1])
    causal = ki[None, :] <= qi[:, None]
    ok = causal[None] & (seg_q[:, :, None] == seg_k[:, None, :]) & (seg_k[:, None, :] != 0)
    return ok[:, None, None]


def _scores(qi, kj, scale, precision):
    """fp32 scores [B, Nkv, G, bq, bk] of a tile (the same op in forward and backward, so ``p`` from the
    saved logsumexp matches the forward's)."""
    s = jnp.einsum("bqkgd,bskd->bkgqs", qi, kj, preferred_element_type=jnp.float32, precision=precision)
    return s * scale


def _forward(q, k, v, seg, scale, bq, bk, precision):
    """o [B, T, Nq, D] (q's dtype), lse [B, Nkv, G, Tq] fp32 (0 for queries that see no key)."""
    b, t, nq, d = q.shape
    nkv = k.shape[2]
    g = nq // nkv
    n_qb, n_kb = -(-t // bq), -(-t // bk)
    qp = _pad_to(q.reshape(b, t, nkv, g, d), n_qb * bq)
    kp, vp = _pad_to(k, n_kb * bk), _pad_to(v, n_kb * bk)
    seg_q, seg_k = _pad_to(seg, n_qb * bq), _pad_to(seg, n_kb * bk)

    def q_block(i, bufs):
        o_buf, lse_buf = bufs
        qi, sq = _tile(qp, i, bq), _tile(seg_q, i, bq)

        def k_block(j, carry):
            m, l, acc = carry
            kj, vj, sk = _tile(kp, j, bk), _tile(vp, j, bk), _tile(seg_k, j, bk)
            mask = _tile_mask(sq, sk, i * bq, j * bk)
            s = jnp.where(mask, _scores(qi, kj, scale, precision), -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=-1))
            # A row with no visible key yet has m = -inf; subtracting 0 instead keeps exp(-inf) = 0, not NaN.
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.exp(s - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)
            l = alpha * l + p.sum(axis=-1)
            pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), vj,
                            preferred_element_type=jnp.float32, precision=precision)
            return m_new, l, alpha[..., None] * acc + pv

        stats = jnp.full((b, nkv, g, bq), -jnp.inf, jnp.float32)
        init = (stats, jnp.zeros_like(stats), jnp.zeros((b, nkv, g, bq, d), jnp.float32))
        # Key blocks past the diagonal are fully masked by causality: stop at the block holding the last query.
        n_visible = jnp.minimum(n_kb, ((i + 1) * bq - 1) // bk + 1)
        m, l, acc = jax.lax.fori_loop(0, n_visible, k_block, init)
        seen = l > 0
        o = acc / jnp.where(seen, l, 1.0)[..., None]  # zeros for queries that see nothing
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)
        o = jnp.transpose(o, (0, 3, 1, 2, 4)).astype(q.dtype)  # -> [B, bq, Nkv, G, D]
        o_buf = jax.lax.dynamic_update_slice_in_dim(o_buf, o, i * bq, axis=1)
        lse_buf = jax.lax.dynamic_update_slice_in_dim(lse_buf, lse, i * bq, axis=3)
        return o_buf, lse_buf

    bufs = (jnp.zeros_like(qp), jnp.zeros((b, nkv, g, n_qb * bq), jnp.float32))
    o, lse = jax.lax.fori_loop(0, n_qb, q_block, bufs)
    return o[:, :t].reshape(b, t, nq, d), lse


def _backward(q, k, v, seg, o, lse, do, scale, bq, bk, precision):
    """dq, dk, dv in the dtypes of q, k, v (accumulated in fp32). ``lse`` as returned by ``_forward``."""
    b, t, nq, d = q.shape
    nkv = k.shape[2]
    g = nq // nkv
    n_qb, n_kb = -(-t // bq), -(-t // bk)
    qp = _pad_to(q.reshape(b, t, nkv, g, d), n_qb * bq)
    dop = _pad_to(do.reshape(b, t, nkv, g, d), n_qb * bq)
    kp, vp = _pad_to(k, n_kb * bk), _pad_to(v, n_kb * bk)
    seg_q, seg_k = _pad_to(seg, n_qb * bq), _pad_to(seg, n_kb * bk)
    # D_i = rowsum(dO_i * o_i) = sum_j p_ij dp_ij: the softmax Jacobian's correction term, per query.
    delta = jnp.einsum("btkgd,btkgd->bkgt", do.reshape(b, t, nkv, g, d).astype(jnp.float32),
                       o.reshape(b, t, nkv, g, d).astype(jnp.float32))
    delta = jnp.pad(delta, [(0, 0), (0, 0), (0, 0), (0, n_qb * bq - t)])

    def k_block(j, bufs):
        dq_buf, dk_buf, dv_buf = bufs
        kj, vj, sk = _tile(kp, j, bk), _tile(vp, j, bk), _tile(seg_k, j, bk)

        def q_block(i, carry):
            dq_buf, dk, dv = carry
            qi, doi, sq = _tile(qp, i, bq), _tile(dop, i, bq), _tile(seg_q, i, bq)
            lse_i = jax.lax.dynamic_slice_in_dim(lse, i * bq, bq, axis=3)
            delta_i = jax.lax.dynamic_slice_in_dim(delta, i * bq, bq, axis=3)
            mask = _tile_mask(sq, sk, i * bq, j * bk)
            # where() after exp: masked scores may be anything, the selected zeros are exact.
            p = jnp.where(mask, jnp.exp(_scores(qi, kj, scale, precision) - lse_i[..., None]), 0.0)
            dv = dv + jnp.einsum("bkgqs,bqkgd->bskd", p.astype(do.dtype), doi,
                                 preferred_element_type=jnp.float32, precision=precision)
            dp = jnp.einsum("bqkgd,bskd->bkgqs", doi, vj, preferred_element_type=jnp.float32, precision=precision)
            ds = p * (dp - delta_i[..., None]) * scale
            dk = dk + jnp.einsum("bkgqs,bqkgd->bskd", ds.astype(q.dtype), qi,
                                 preferred_element_type=jnp.float32, precision=precision)
            dqi = jnp.einsum("bkgqs,bskd->bqkgd", ds.astype(k.dtype), kj,
                             preferred_element_type=jnp.float32, precision=precision)
            dq_buf = jax.lax.dynamic_update_slice_in_dim(dq_buf, _tile(dq_buf, i, bq) + dqi, i * bq, axis=1)
            return dq_buf, dk, dv

        zeros = jnp.zeros((b, bk, nkv, d), jnp.float32)
        # Query blocks that end before this key block starts cannot see it (causality): start at the diagonal.
        first = (j * bk) // bq
        dq_buf, dk, dv = jax.lax.fori_loop(first, n_qb, q_block, (dq_buf, zeros, zeros))
        dk_buf = jax.lax.dynamic_update_slice_in_dim(dk_buf, dk.astype(k.dtype), j * bk, axis=1)
        dv_buf = jax.lax.dynamic_update_slice_in_dim(dv_buf, dv.astype(v.dtype), j * bk, axis=1)
        return dq_buf, dk_buf, dv_buf

    bufs = (jnp.zeros(qp.shape, jnp.float32), jnp.zeros_like(kp), jnp.zeros_like(vp))
    dq, dk, dv = jax.lax.fori_loop(0, n_kb, k_block, bufs)
    return dq[:, :t].reshape(b, t, nq, d).astype(q.dtype), dk[:, :t], dv[:, :t]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _flash(q, k, v, seg, scale, bq, bk, precision):
    return _forward(q, k, v, seg, scale, bq, bk, precision)[0]


def _flash_fwd(q, k, v, seg, scale, bq, bk, precision):
    o, lse = _forward(q, k, v, seg, scale, bq, bk, precision)
    return o, (q, k, v, seg, o, lse)  # inputs (the caller holds them anyway), o, and the fp32 logsumexp


def _flash_bwd(scale, bq, bk, precision, res, do):
    q, k, v, seg, o, lse = res
    dq, dk, dv = _backward(q, k, v, seg, o, lse, do, scale, bq, bk, precision)
    return dq, dk, dv, None  # segment ids are integers: no cotangent


_flash.defvjp(_flash_fwd, _flash_bwd)
