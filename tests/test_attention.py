"""Blockwise (flash) attention against the model's dense path: values, gradients, memory, scan/remat, mesh.

The reference is ``qwen3.make_attention_mask`` + ``qwen3.dot_attention`` (via ``reference_attention``).
Padding queries differ on purpose (dense: mean of v over the row; blockwise: zeros), so values are compared
on real queries only and gradients come from a loss whose weights are zero on padding queries, as a
training loss's are.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_term.model.attention import blockwise_attention, reference_attention

FP32_TOL = 1e-5
# bf16 inputs against the fp32 reference on the same bf16-rounded inputs: the error is bf16 rounding of
# the probabilities and the output (measured max ≈ 0.008 on outputs of magnitude ≈ 1).
BF16_TOL = 3e-2
HIGHEST = "highest"  # so fp32 comparisons stay exact on accelerators that default to TF32


def _causal(b, t):
    return np.ones((b, t), np.int32)


def _right_padded(b, t):
    lengths = np.linspace(t, t // 3, b).astype(int)  # first row full, the others padded
    return (np.arange(t)[None] < lengths[:, None]).astype(np.int32)


def _packed(b, t):
    """Several contiguous segments per row, then padding; the last row is padding only."""
    rng = np.random.RandomState(1)
    seg = np.zeros((b, t), np.int32)
    for r in range(b - 1):
        cuts = np.sort(rng.choice(np.arange(1, t - 5), 3, replace=False))
        for s, (a, z) in enumerate(zip([0, *cuts[:-1]], cuts)):
            seg[r, a:z] = s + 1  # cuts[-1]: start of the row's padding tail
    return seg


# name: (batch, T, Nq, Nkv, D, segment ids, block_q, block_k)
CASES = {
    "causal_mha": (2, 64, 4, 4, 16, _causal, 16, 16),
    "right_padded_gqa_T_not_multiple": (3, 50, 4, 2, 16, _right_padded, 16, 16),
    "packed_gqa_bq32_bk16": (3, 130, 4, 2, 16, _packed, 32, 16),
    "packed_mha_bq16_bk32": (3, 97, 2, 2, 8, _packed, 16, 32),
    "block_larger_than_T": (2, 50, 4, 2, 16, _right_padded, 512, 512),
}


def _inputs(b, t, nq, nkv, d, seg_fn, dtype=jnp.float32, seed=0):
    rng = np.random.RandomState(seed)
    q, k, v = (jnp.asarray(rng.randn(b, t, n, d), dtype) for n in (nq, nkv, nkv))
    seg = jnp.asarray(seg_fn(b, t))
    # a random cotangent, zero on padding queries (what a masked training loss sends back)
    w = jnp.asarray(rng.randn(b, t, nq, d), jnp.float32) * (seg != 0)[:, :, None, None]
    return q, k, v, seg, w


def _fns(seg, scale, bq, bk, precision=HIGHEST):
    def blockwise(q, k, v):
        return blockwise_attention(q, k, v, segment_ids=seg, scale=scale, block_q=bq, block_k=bk,
                                   precision=precision)

    def dense(q, k, v):
        return reference_attention(q, k, v, segment_ids=seg, scale=scale, precision=precision)

    return blockwise, dense


def _grads(fn, w, q, k, v):
    return jax.jit(jax.grad(lambda q, k, v: (fn(q, k, v).astype(jnp.float32) * w).sum(), argnums=(0, 1, 2)))(
        q, k, v)


@pytest.mark.parametrize("case", list(CASES))
def test_values_equal_dense_reference_on_real_queries(case):
    b, t, nq, nkv, d, seg_fn, bq, bk = CASES[case]
    q, k, v, seg, _ = _inputs(b, t, nq, nkv, d, seg_fn)
    blockwise, dense = _fns(seg, d**-0.5, bq, bk)
    out, ref = np.asarray(jax.jit(blockwise)(q, k, v)), np.asarray(dense(q, k, v))
    assert out.shape == (b, t, nq, d) and out.dtype == np.float32
    real = np.asarray(seg) != 0
    np.testing.assert_allclose(out[real], ref[real], atol=FP32_TOL, rtol=0)


@pytest.mark.parametrize("case", list(CASES))
def test_gradients_equal_dense_reference(case):
    b, t, nq, nkv, d, seg_fn, bq, bk = CASES[case]
    q, k, v, seg, w = _inputs(b, t, nq, nkv, d, seg_fn)
    blockwise, dense = _fns(seg, d**-0.5, bq, bk)
    for name, got, want in zip("qkv", _grads(blockwise, w, q, k, v), _grads(dense, w, q, k, v)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=FP32_TOL, rtol=0, err_msg=f"d{name}")


def test_padding_queries_give_zero_outputs_and_finite_zero_gradients():
    b, t, nq, nkv, d, seg_fn, bq, bk = CASES["packed_gqa_bq32_bk16"]
    q, k, v, seg, _ = _inputs(b, t, nq, nkv, d, seg_fn)
    assert not np.asarray(seg[-1]).any()  # one row is all padding
    blockwise, _ = _fns(seg, d**-0.5, bq, bk)
    pad = np.asarray(seg) == 0
    out = np.asarray(blockwise(q, k, v))
    assert np.isfinite(out).all() and (out[pad] == 0).all()
    # a cotangent that is nonzero on padding queries too: they must pass back nothing, and no NaN
    w_all = jnp.asarray(np.random.RandomState(2).randn(*out.shape), jnp.float32)
    dq, dk, dv = (np.asarray(g) for g in _grads(blockwise, w_all, q, k, v))
    assert all(np.isfinite(g).all() for g in (dq, dk, dv))
    assert (dq[pad] == 0).all() and (dk[pad] == 0).all() and (dv[pad] == 0).all()


def test_bf16_inputs_within_stated_tolerance_of_fp32_reference():
    b, t, nq, nkv, d, seg_fn, bq, bk = CASES["packed_gqa_bq32_bk16"]
    q, k, v, seg, w = _inputs(b, t, nq, nkv, d, seg_fn, dtype=jnp.bfloat16)
    blockwise, _ = _fns(seg, d**-0.5, bq, bk, precision=None)
    _, dense = _fns(seg, d**-0.5, bq, bk)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    out = blockwise(q, k, v)
    assert out.dtype == jnp.bfloat16
    real = np.asarray(seg) != 0
    err = np.abs(np.asarray(out, np.float32) - np.asarray(dense(*f32)))[real].max()
    assert 1e-5 < err <= BF16_TOL, err  # bf16 is really in use, and close
    for name, got, want in zip("qkv", _grads(blockwise, w, q, k, v), _grads(dense, w, *f32)):
        assert got.dtype == jnp.bfloat16, name
        scale = np.abs(np.asarray(want)).max()
        assert np.abs(np.asarray(got, np.float32) - np.asarray(want)).max() <= BF16_TOL * scale, f"d{name}"


def test_gradient_temp_memory_is_far_below_dense():
    """Compiled (not run) temp memory of grad(sum(attention)) at B=1, T=8192, N=4, D=64, fp32, blocks of 512.

    Measured on CPU (jax 0.10.2): blockwise 39.8 MiB (a few [1, 4, 512, 512] fp32 tiles, dq's fp32
    accumulator, padded copies of q/k/v/dO); dense 3088 MiB ([1, 4, 8192, 8192] fp32 scores and
    probabilities kept for the backward, plus the [1, 8192, 8192] mask).
    """
    b, t, n, d = 1, 8192, 4, 64
    x = jax.ShapeDtypeStruct((b, t, n, d), jnp.float32)
    seg = jax.ShapeDtypeStruct((b, t), jnp.int32)

    def temp_bytes(attn):
        loss = lambda q, k, v, s: attn(q, k, v, segment_ids=s, scale=d**-0.5).sum()  # noqa: E731
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x, seg).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    blockwise, dense = temp_bytes(blockwise_attention), temp_bytes(reference_attention)
    assert blockwise < 64 * 2**20, blockwise
    assert blockwise < dense / 8, (blockwise, dense)


@pytest.mark.parametrize("policy", [None, jax.checkpoint_policies.dots_with_no_batch_dims_saveable])
def test_inside_scan_with_remat_gradient_equals_dense(policy):
    """Two "layers" (q/k/v/o projections + residual) run by lax.scan under jax.checkpoint, as qwen3 runs them."""
    b, t, h, nq, nkv, d = 2, 45, 16, 4, 2, 8
    rng = np.random.RandomState(3)
    x = jnp.asarray(rng.randn(b, t, h), jnp.float32)
    params = {
        "wq": jnp.asarray(rng.randn(2, h, nq, d) * 0.3, jnp.float32),
        "wk": jnp.asarray(rng.randn(2, h, nkv, d) * 0.3, jnp.float32),
        "wv": jnp.asarray(rng.randn(2, h, nkv, d) * 0.3, jnp.float32),
        "wo": jnp.asarray(rng.randn(2, nq, d, h) * 0.3, jnp.float32),
    }
    seg = jnp.asarray(_packed(b + 1, t)[:b])
    w = jnp.asarray(rng.randn(b, t, h), jnp.float32) * (seg != 0)[:, :, None]

    def loss(params, attn):
        def layer(x, p):
            q, k, v = (jnp.einsum("bth,hnd->btnd", x, p[n], precision=HIGHEST) for n in ("wq", "wk", "wv"))
            o = attn(q, k, v)
            return x + jnp.einsum("btnd,ndh->bth", o, p["wo"], precision=HIGHEST), None

        out, _ = jax.lax.scan(jax.checkpoint(layer, policy=policy, prevent_cse=False), x, params)
        return (out * w).sum()

    blockwise, dense = _fns(seg, d**-0.5, 16, 16)
    got = jax.jit(jax.grad(loss), static_argnums=1)(params, blockwise)
    want = jax.jit(jax.grad(loss), static_argnums=1)(params, dense)
    for name in params:
        np.testing.assert_allclose(np.asarray(got[name]), np.asarray(want[name]), atol=1e-4, rtol=1e-5,
                                   err_msg=name)


def test_batch_sharded_on_mesh_equals_unsharded_and_stays_sharded():
    b, t, nq, nkv, d = 8, 40, 4, 2, 8
    q, k, v, seg, w = _inputs(b, t, nq, nkv, d, _packed)
    blockwise, _ = _fns(seg, d**-0.5, 16, 16)
    want_o, want_g = blockwise(q, k, v), _grads(blockwise, w, q, k, v)

    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    batch = NamedSharding(mesh, P("data"))
    qs, ks, vs, segs, ws = (jax.device_put(a, batch) for a in (q, k, v, seg, w))

    def step(q, k, v, seg, w):
        attn, _ = _fns(seg, d**-0.5, 16, 16)
        o = attn(q, k, v)
        return o, jax.grad(lambda q, k, v: (attn(q, k, v) * w).sum(), argnums=(0, 1, 2))(q, k, v)

    compiled = jax.jit(step).lower(qs, ks, vs, segs, ws).compile()
    assert "all-gather" not in compiled.as_text()  # each device works on its own rows only
    o, g = compiled(qs, ks, vs, segs, ws)
    assert o.sharding.is_equivalent_to(batch, o.ndim)
    assert all(x.sharding.is_equivalent_to(batch, x.ndim) for x in g)
    np.testing.assert_allclose(np.asarray(o), np.asarray(want_o), atol=FP32_TOL, rtol=0)
    for got, want in zip(g, want_g):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=FP32_TOL, rtol=0)


def test_rejects_query_heads_not_a_multiple_of_kv_heads():
    q, k = jnp.zeros((1, 8, 3, 4)), jnp.zeros((1, 8, 2, 4))
    with pytest.raises(ValueError, match="multiple of Nkv"):
        blockwise_attention(q, k, k, segment_ids=jnp.ones((1, 8), jnp.int32), scale=0.5)
