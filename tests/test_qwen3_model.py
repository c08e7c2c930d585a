"""Our flax.nnx Qwen3 against transformers' Qwen3ForCausalLM on the same random checkpoints."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import TINY, hf_checkpoint, hf_logits, padded_batch
from jaxrl_term.model.hf import load_pretrained
from jaxrl_term.model.qwen3 import ModelOptions, Qwen3Config, create_model

# bf16 compute (bf16 weights, bf16 activations, fp32 softmax / norms / LM head) against transformers in
# fp32 on the same weights: measured max |Δlogit| ≈ 0.006 on these tiny models (max |logit| ≈ 0.7).
BF16_LOGIT_TOL = 0.02


@pytest.mark.parametrize("tied,theta", [(False, 10_000.0), (True, 1_000_000.0), (False, 1_000_000.0), (True, 500.0)])
def test_fp32_logits_match_transformers_on_padded_batch(tmp_path, tied, theta):
    ref_model = hf_checkpoint(tmp_path, tied=tied, rope_theta=theta)
    ids, mask, pos = padded_batch(TINY["vocab_size"])
    ref = hf_logits(ref_model, ids, mask, pos)
    model = load_pretrained(tmp_path)
    assert (model.lm_head is None) == tied
    out = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)))
    valid = mask.astype(bool)
    assert np.abs(out - ref)[valid].max() <= 1e-4


def test_explicit_positions_equal_default_positions(tmp_path):
    hf_checkpoint(tmp_path)
    model = load_pretrained(tmp_path)
    ids, mask, pos = padded_batch(TINY["vocab_size"])
    a = model(jnp.asarray(ids), jnp.asarray(mask))
    b = model(jnp.asarray(ids), jnp.asarray(mask), positions=jnp.asarray(pos))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bf16_compute_within_stated_tolerance(tmp_path):
    ref_model = hf_checkpoint(tmp_path, rope_theta=10_000.0)
    ids, mask, pos = padded_batch(TINY["vocab_size"], seed=1)
    ref = hf_logits(ref_model, ids, mask, pos)
    model = load_pretrained(tmp_path, param_dtype="bfloat16", compute_dtype="bfloat16")
    assert model.layers.q_proj[...].dtype == jnp.bfloat16
    out = model(jnp.asarray(ids), jnp.asarray(mask))
    assert out.dtype == jnp.float32  # the LM head runs in fp32 on fp32-cast hidden states
    err = np.abs(np.asarray(out) - ref)[mask.astype(bool)].max()
    assert err <= BF16_LOGIT_TOL, err
    # and bf16 is really in use: it is measurably different from fp32
    assert err > 1e-5


def test_fp32_master_params_with_bf16_compute(tmp_path):
    hf_checkpoint(tmp_path)
    ids, mask, _ = padded_batch(TINY["vocab_size"])
    f32 = load_pretrained(tmp_path)
    mixed = load_pretrained(tmp_path, param_dtype="float32", compute_dtype="bfloat16")
    assert mixed.layers.q_proj[...].dtype == jnp.float32
    a, b = f32(jnp.asarray(ids), jnp.asarray(mask)), mixed(jnp.asarray(ids), jnp.asarray(mask))
    err = np.abs(np.asarray(a) - np.asarray(b))[mask.astype(bool)].max()
    assert 1e-5 < err <= BF16_LOGIT_TOL


def _tiny_model(**opts):
    cfg = Qwen3Config(**TINY)
    return create_model(cfg, ModelOptions(**opts), seed=3)


def test_chunked_lm_head_equals_full_log_softmax_and_its_gradient():
    model = _tiny_model(logits_chunk=5)  # 12 tokens -> chunks of 5, 5, 2 (padding path)
    ids, mask, _ = padded_batch(TINY["vocab_size"])
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    targets = jnp.roll(ids, -1, axis=1)

    def target_logp(logits, tgt):
        return jnp.take_along_axis(jax.nn.log_softmax(logits, -1), tgt[..., None], -1)[..., 0]

    def loss(m, chunked):
        h = m.hidden_states(ids, mask)
        lp = m.lm_head_map(h, target_logp, targets) if chunked else target_logp(m.logits(h), targets)
        return (lp * mask).sum(), lp

    from flax import nnx

    (l1, lp1), g1 = nnx.value_and_grad(loss, has_aux=True)(model, True)
    (l2, lp2), g2 = nnx.value_and_grad(loss, has_aux=True)(model, False)
    assert lp1.shape == (3, 12)
    np.testing.assert_allclose(np.asarray(lp1), np.asarray(lp2), atol=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_remat_with_unrolled_layers_is_refused():
    """Unrolled layers defeat remat on XLA (nearly every activation kept): the combination is refused, naming both."""
    from jaxrl_term.model.qwen3 import ModelConfigError

    for remat in ("full", "dots"):
        with pytest.raises(ModelConfigError, match="scan_layers=false"):
            ModelOptions(remat=remat, scan_layers=False)
    ModelOptions(remat="none", scan_layers=False)
    ModelOptions(remat="full", scan_layers=True)


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_changes_memory_not_values(remat):
    from flax import nnx

    base, rem = _tiny_model(), _tiny_model(remat=remat)
    ids, mask, _ = padded_batch(TINY["vocab_size"])

    def loss(m):
        return jnp.mean(m(jnp.asarray(ids), jnp.asarray(mask)) ** 2)

    ga, gb = nnx.grad(loss)(base), nnx.grad(loss)(rem)
    for a, b in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("opts", [
    dict(remat="full", remat_groups=2),  # nested remat: 2 groups of 1 layer
    dict(mlp_chunk=5),  # 12 tokens in MLP chunks of 5 (padded last chunk)
    dict(attention="blockwise", attention_block=8),  # flash attention, 12 tokens in blocks of 8
    dict(attention="blockwise", attention_block=8, remat="full", remat_groups=2, mlp_chunk=4),
], ids=["nested_remat", "mlp_chunk", "blockwise", "all"])
def test_long_context_memory_options_change_memory_not_values(opts):
    """Every option the cluster presets use to fit 32k-64k contexts computes the same loss and gradient."""
    from flax import nnx

    base, other = _tiny_model(), _tiny_model(**opts)
    ids, mask, _ = padded_batch(TINY["vocab_size"])
    valid = jnp.asarray(mask, jnp.float32)[..., None]  # padding queries differ by design (blockwise: zeros)

    def loss(m):
        return jnp.sum((m(jnp.asarray(ids), jnp.asarray(mask)) * valid) ** 2) / valid.sum()

    (la, ga), (lb, gb) = nnx.value_and_grad(loss)(base), nnx.value_and_grad(loss)(other)
    assert float(lb) == pytest.approx(float(la), rel=1e-5)
    for a, b in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_bf16_remat_saves_layer_inputs_as_bits_and_matches_plain_bf16():
    """remat=full with bf16 activations stores each layer's input as uint16 bits: same gradient as no remat."""
    from flax import nnx

    base = _tiny_model(compute_dtype="bfloat16")
    rem = _tiny_model(compute_dtype="bfloat16", remat="full", remat_groups=2)
    ids, mask, _ = padded_batch(TINY["vocab_size"])

    def loss(m):
        return jnp.mean(m(jnp.asarray(ids), jnp.asarray(mask)).astype(jnp.float32) ** 2)

    ga, gb = nnx.grad(loss)(base), nnx.grad(loss)(rem)
    for a, b in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-2, atol=1e-5)
    graph, state = nnx.split(rem)
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda st: loss(nnx.merge(graph, st))))(state))
    assert "u16[" in jaxpr  # the saved layer inputs are raw bits


def test_jax_dot_product_attention_matches_reference_attention():
    a, b = _tiny_model(attention="xla"), _tiny_model(attention="dot_product_attention")
    ids, mask, _ = padded_batch(TINY["vocab_size"])
    la, lb = a(jnp.asarray(ids), jnp.asarray(mask)), b(jnp.asarray(ids), jnp.asarray(mask))
    valid = mask.astype(bool)
    assert np.abs(np.asarray(la) - np.asarray(lb))[valid].max() < 1e-4


def test_packed_segments_equal_separate_sequences():
    model = _tiny_model()
    rng = np.random.RandomState(0)
    s1, s2 = rng.randint(0, 512, 7), rng.randint(0, 512, 5)
    packed = jnp.asarray(np.concatenate([s1, s2])[None], jnp.int32)
    seg = jnp.asarray([[1] * 7 + [2] * 5], jnp.int32)
    pos = jnp.asarray([list(range(7)) + list(range(5))], jnp.int32)
    out = np.asarray(model(packed, jnp.ones_like(packed), positions=pos, segment_ids=seg))[0]
    a = np.asarray(model(jnp.asarray(s1[None], jnp.int32)))[0]
    b = np.asarray(model(jnp.asarray(s2[None], jnp.int32)))[0]
    np.testing.assert_allclose(out[:7], a, atol=1e-5)
    np.testing.assert_allclose(out[7:], b, atol=1e-5)


def test_params_carry_logical_axes():
    from flax import nnx

    model = _tiny_model()
    for path, var in jax.tree_util.tree_flatten_with_path(
        nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable)
    )[0]:
        axes = var.get_metadata().get("logical_axes")
        assert axes is not None and len(axes) == var.shape.__len__(), path


def test_num_params_matches_tree():
    from flax import nnx

    for tied in (True, False):
        cfg = dataclasses.replace(Qwen3Config(**TINY), tie_word_embeddings=tied)
        model = create_model(cfg)
        n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        assert n == cfg.num_params()
