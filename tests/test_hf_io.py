"""save_pretrained / load_pretrained: bit-exact round trips, transformers reads what we write, bad input."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import TINY, hf_checkpoint, hf_logits, padded_batch
from jaxrl_term.model.hf import CheckpointError, load_pretrained, save_pretrained


def _params(model):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tied", [False, True])
def test_save_then_load_is_bit_exact(tmp_path, dtype, tied):
    hf_checkpoint(tmp_path / "src", tied=tied)
    model = load_pretrained(tmp_path / "src", param_dtype=dtype, compute_dtype=dtype)
    # a small shard limit forces several files and an index
    save_pretrained(model, tmp_path / "out", dtype=dtype, max_shard_bytes=40_000)
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert "model.safetensors.index.json" in files and "config.json" in files
    assert sum(f.endswith(".safetensors") for f in files) > 1
    again = load_pretrained(tmp_path / "out", param_dtype=dtype, compute_dtype=dtype)
    for a, b in zip(_params(model), _params(again), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()


def test_saved_directory_loads_in_transformers_with_equal_logits(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    hf_checkpoint(tmp_path / "src", rope_theta=10_000.0)
    model = load_pretrained(tmp_path / "src")
    save_pretrained(model, tmp_path / "out", dtype="float32", max_shard_bytes=100_000)
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    ids, mask, pos = padded_batch(TINY["vocab_size"])
    ref = hf_logits(reloaded, ids, mask, pos)
    ours = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)))
    assert np.abs(ours - ref)[mask.astype(bool)].max() <= 1e-4


def test_bf16_export_loads_in_transformers(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    hf_checkpoint(tmp_path / "src")
    model = load_pretrained(tmp_path / "src")
    save_pretrained(model, tmp_path / "out", dtype="bfloat16")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16" and cfg["architectures"] == ["Qwen3ForCausalLM"]
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    w = hf.model.layers[1].self_attn.q_proj.weight
    assert w.dtype == torch.bfloat16
    # q_proj of layer 1, HF layout [heads*head_dim, hidden] == ours [hidden, heads, head_dim] transposed
    ours = np.asarray(model.layers.q_proj[...][1], np.float32).reshape(TINY["hidden_size"], -1).T
    np.testing.assert_allclose(w.detach().float().numpy(), ours, rtol=1e-2, atol=1e-2)


def test_missing_shard_names_the_shard_and_a_tensor(tmp_path):
    hf_checkpoint(tmp_path / "src")
    save_pretrained(load_pretrained(tmp_path / "src"), tmp_path / "out", dtype="float32", max_shard_bytes=40_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / "out" / victim).unlink()
    with pytest.raises(CheckpointError, match=victim) as e:
        load_pretrained(tmp_path / "out")
    assert "tensor '" in str(e.value)


def test_shape_mismatch_names_the_tensor_and_the_file(tmp_path):
    hf_checkpoint(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.(down|gate|up)_proj"
                       r"\.weight' has shape \[(128, 64|64, 128)\] but config\.json implies \[(96, 64|64, 96)\]"):
        load_pretrained(tmp_path)


def test_missing_tensor_names_the_tensor(tmp_path):
    from safetensors.numpy import load_file, save_file

    hf_checkpoint(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight"):
        load_pretrained(tmp_path)


def test_unknown_architecture_names_the_config_file(tmp_path):
    hf_checkpoint(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "llama", ["LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json: unknown architecture .*llama"):
        load_pretrained(tmp_path)


def test_unsupported_rope_scaling_is_refused(tmp_path):
    hf_checkpoint(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="rope_type 'yarn'"):
        load_pretrained(tmp_path)


def test_legacy_rope_theta_field_is_read(tmp_path):
    hf_checkpoint(tmp_path, rope_theta=12345.0)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_theta"] = 12345.0
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_pretrained(tmp_path).config.rope_theta == 12345.0


def test_save_overwrites_atomically_and_copies_tokenizer(tmp_path, tiny_tokenizer_dir):
    hf_checkpoint(tmp_path / "src")
    model = load_pretrained(tmp_path / "src")
    out = tmp_path / "out"
    save_pretrained(model, out, dtype="float32")
    (out / "stale.txt").write_text("from an older export")
    save_pretrained(model, out, dtype="float32", tokenizer_dir=tiny_tokenizer_dir)
    names = {p.name for p in out.iterdir()}
    assert "stale.txt" not in names and "tokenizer.json" in names
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]
    shutil.rmtree(out)
