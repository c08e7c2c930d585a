"""YaRN RoPE (model/rope.py) against transformers: cos/sin tables, a tiny Qwen3's logits, HF config round trips."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import TINY, hf_checkpoint, hf_logits, padded_batch
from jaxrl_term.model.hf import load_pretrained, read_config, save_pretrained
from jaxrl_term.model.qwen3 import ModelConfigError, Qwen3Config, RopeScaling, rope_tables

QWEN_64K = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32768}


def _hf_cos_sin(head_dim, theta, scaling, positions, mpe):
    import torch
    from transformers import Qwen3Config as HFConfig
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    cfg = HFConfig(hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=4, head_dim=head_dim,
                   rope_theta=theta, rope_scaling=dict(scaling) if scaling else None, max_position_embeddings=mpe)
    rot = Qwen3RotaryEmbedding(cfg)
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rot(x, torch.tensor(positions, dtype=torch.long))
    return cos.numpy(), sin.numpy()


@pytest.mark.parametrize("head_dim,theta,scaling,start", [
    # Qwen3-8B's numbers at 64k (the tmax preset): positions from 30k to the end of the YaRN range
    (128, 1e6, QWEN_64K, 30_000),
    (128, 1e6, {**QWEN_64K, "factor": 4.0}, 120_000),
    # tiny range, every optional key transformers reads: betas, mscale pair, truncate off, explicit factor
    (16, 10_000.0, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, 0),
    (16, 500.0, {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 48, "beta_fast": 16,
                 "beta_slow": 2, "mscale": 0.8, "mscale_all_dim": 0.5, "truncate": False}, 40),
    (16, 1e6, {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "attention_factor": 0.9}, 0),
])
def test_yarn_cos_sin_match_transformers_beyond_the_original_range(head_dim, theta, scaling, start):
    ys = RopeScaling.from_hf(scaling, max_position_embeddings=scaling["original_max_position_embeddings"])
    end = ys.max_context
    positions = np.concatenate([np.arange(start, min(start + 2048, end)), np.arange(max(end - 2048, start), end)])
    positions = positions[None, :].astype(np.int32)
    ref_cos, ref_sin = _hf_cos_sin(head_dim, theta, scaling, positions, end)
    cos, sin = rope_tables(jnp.asarray(positions), head_dim, theta, jnp.float32, ys)
    assert positions.max() >= ys.original_max_position_embeddings  # the extended range is covered
    assert np.abs(np.asarray(cos) - ref_cos).max() <= 1e-5
    assert np.abs(np.asarray(sin) - ref_sin).max() <= 1e-5
    # and YaRN is really in use: plain RoPE differs there
    plain, _ = rope_tables(jnp.asarray(positions), head_dim, theta, jnp.float32)
    assert np.abs(np.asarray(plain) - ref_cos).max() > 1e-2


TINY_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


def test_yarn_logits_match_transformers_past_the_original_range(tmp_path):
    ref_model = hf_checkpoint(tmp_path, rope_theta=10_000.0, rope_scaling=dict(TINY_YARN), max_position_embeddings=256)
    ids, mask, pos = padded_batch(TINY["vocab_size"], seed=2)
    pos = pos + 200 * mask  # positions 200..211: past 64, inside 64 x 4
    ref = hf_logits(ref_model, ids, mask, pos)
    model = load_pretrained(tmp_path)
    assert model.config.rope_scaling == RopeScaling(4.0, 64) and model.config.max_context == 256
    out = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask), positions=jnp.asarray(pos)))
    assert np.abs(out - ref)[mask.astype(bool)].max() <= 1e-5
    # the engine's cached forward (two prefill chunks) equals the full forward past position 64 (jitted: faster
    # than op-by-op here)
    row = jnp.asarray(np.random.RandomState(0).randint(0, TINY["vocab_size"], (1, 80)), jnp.int32)
    full = np.asarray(nnx.jit(lambda m, r: m.hidden_states(r))(model, row))
    cached = nnx.jit(lambda m, r, p, k, v: m.forward_cached(r, p, k, v))
    kshape, vshape = model.kv_cache_shapes(1, 128)
    kc, vc, parts = jnp.zeros(kshape), jnp.zeros(vshape), []
    for lo, hi in ((0, 40), (40, 80)):
        h, kc, vc = cached(model, row[:, lo:hi], jnp.asarray([lo]), kc, vc)
        parts.append(np.asarray(h))
    np.testing.assert_allclose(np.concatenate(parts, 1), full, atol=1e-5)


def test_rope_scaling_override_and_save_round_trip_through_transformers(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    hf_checkpoint(tmp_path / "src", rope_theta=10_000.0)  # saved without scaling, as Qwen3-8B is
    assert read_config(tmp_path / "src").rope_scaling is None
    model = load_pretrained(tmp_path / "src", overrides={"rope_scaling": dict(TINY_YARN)})
    assert model.config.max_context == 256
    save_pretrained(model, tmp_path / "out", dtype="float32")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["rope_scaling"] == TINY_YARN and written["rope_parameters"] == {**TINY_YARN, "rope_theta": 1e4}
    assert written["max_position_embeddings"] == 256  # original x factor: every transformers version agrees
    assert read_config(tmp_path / "out") == dataclasses.replace(model.config, max_position_embeddings=256)
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    ids, mask, pos = padded_batch(TINY["vocab_size"], seed=3)
    pos = pos + 100 * mask
    ref = hf_logits(reloaded, ids, mask, pos)
    ours = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask), positions=jnp.asarray(pos)))
    assert np.abs(ours - ref)[mask.astype(bool)].max() <= 1e-5


def test_hydra_style_dict_is_parsed_and_bad_scaling_is_refused():
    cfg = Qwen3Config(**TINY, rope_scaling=dict(QWEN_64K))
    assert cfg.rope_scaling == RopeScaling(2.0, 32768) and cfg.max_context == 65536
    assert Qwen3Config(**TINY, rope_scaling={"rope_type": "default"}).rope_scaling is None
    assert Qwen3Config(**TINY).max_context == 40960
    with pytest.raises(ModelConfigError, match="model.rope_scaling: .*'attn_factor'.*SGLang"):
        Qwen3Config(**TINY, rope_scaling={**QWEN_64K, "attn_factor": 0.9})
