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
    cfg["rope_parameters"] = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e6}  # YaRN is implemented
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json: rope_scaling / rope_parameters: rope_type 'dynamic' "
                                              r"is not supported.*remove the scaling"):
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


def test_exported_special_token_ids_belong_to_the_vocabulary(tmp_path, tiny_tokenizer_dir):
    """config.json's bos / eos ids come from the tokenizer saved with the weights (the tiny 1,024-token one:
    <|endoftext|> and <|im_end|>), never Qwen's 151643 / 151645 for a vocabulary that does not hold them;
    transformers reads them back; without a tokenizer a small vocabulary gets none, Qwen3's gets Qwen's."""
    import transformers

    from jaxrl_term.model.qwen3 import Qwen3Config
    from jaxrl_term.model.tokenizer import load_tokenizer

    hf_checkpoint(tmp_path / "src", vocab_size=1024)
    model = load_pretrained(tmp_path / "src")
    save_pretrained(model, tmp_path / "out", dtype="float32", tokenizer_dir=tiny_tokenizer_dir)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    tok = load_tokenizer(tiny_tokenizer_dir)
    assert cfg["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>") < cfg["vocab_size"]
    assert cfg["bos_token_id"] == tok.convert_tokens_to_ids("<|endoftext|>") < cfg["vocab_size"]
    assert transformers.AutoConfig.from_pretrained(tmp_path / "out").eos_token_id == cfg["eos_token_id"]
    save_pretrained(model, tmp_path / "bare", dtype="float32")
    bare = json.loads((tmp_path / "bare" / "config.json").read_text())
    assert "eos_token_id" not in bare and "bos_token_id" not in bare
    small = load_pretrained(tmp_path / "bare")  # 1,024 rows; a 512-row model with the same tokenizer drops them
    hf_checkpoint(tmp_path / "src512")
    save_pretrained(load_pretrained(tmp_path / "src512"), tmp_path / "o512", dtype="float32",
                    tokenizer_dir=tiny_tokenizer_dir)
    assert "eos_token_id" not in json.loads((tmp_path / "o512" / "config.json").read_text())
    assert small.config.vocab_size == 1024
    big = Qwen3Config(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16).to_hf()
    assert (big["bos_token_id"], big["eos_token_id"]) == (151643, 151645)


# -- streaming export --------------------------------------------------------------------------------------------

def _tensors(out_dir):
    """HF name -> (dtype, shape, raw bytes) of every tensor in an exported directory."""
    from safetensors import safe_open

    got = {}
    for f in sorted(out_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="numpy") as h:
            for name in h.keys():
                t = h.get_tensor(name)
                got[name] = (t.dtype, t.shape, t.tobytes())
    return got


def _files(out_dir):
    return {p.name: p.read_bytes() for p in sorted(out_dir.iterdir())}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mesh_shape,rules", [
    ({"fsdp": 8}, {}),
    ({"fsdp": 4, "tensor": 2}, {}),
    ({"data": 2, "fsdp": 2, "tensor": 2}, {"embed": ("data", "fsdp")}),  # a dimension over two mesh axes
])
def test_sharded_export_equals_unsharded_and_source_bit_for_bit(tmp_path, dtype, mesh_shape, rules):
    from safetensors.numpy import load_file

    from jaxrl_term.model.hf import NP_DTYPES
    from jaxrl_term.parallel.mesh import DEFAULT_RULES, make_mesh

    hf_checkpoint(tmp_path / "src", tied=False)
    plain = load_pretrained(tmp_path / "src")
    sharded = load_pretrained(tmp_path / "src", mesh=make_mesh(mesh_shape), rules={**DEFAULT_RULES, **rules})
    assert not sharded.layers.gate_proj[...].sharding.is_fully_replicated
    save_pretrained(plain, tmp_path / "plain", dtype=dtype, max_shard_bytes=40_000)
    # a small chunk limit splits every layer and embed_tokens / lm_head into blocks of rows (uneven last block)
    save_pretrained(sharded, tmp_path / "sharded", dtype=dtype, max_shard_bytes=40_000, max_chunk_bytes=12_000)
    assert _files(tmp_path / "plain") == _files(tmp_path / "sharded")
    # The previous export was the fp32 values cast on the host; load is bit-exact, so that is the source
    # checkpoint (written by transformers) cast with ml_dtypes.
    source = load_file(str(tmp_path / "src" / "model.safetensors"))
    got = _tensors(tmp_path / "sharded")
    assert set(got) == set(source)
    for name, ref in source.items():
        ref = ref.astype(NP_DTYPES[dtype])
        assert got[name] == (ref.dtype, ref.shape, ref.tobytes()), name


def test_export_chunks_are_one_layer_and_bounded_rows():
    from jaxrl_term.model.hf import export_chunks, tensor_maps
    from jaxrl_term.model.qwen3 import Qwen3Config

    cfg = Qwen3Config(**{**TINY, "num_hidden_layers": 3})
    maps = tensor_maps(cfg)
    shapes = {m.ours: (3, *m.to_ours(np.zeros(m.hf_shape, np.float32)).shape) if m.stacked
              else m.to_ours(np.zeros(m.hf_shape, np.float32)).shape for m in maps}
    chunks = export_chunks(maps, shapes, 2, max_chunk_bytes=1 << 30)
    assert [(c.hf_name, c.start, c.rows == c.total_rows) for c in chunks] == [
        (m.hf.format(i=i), 0, True) for m in maps for i in (range(3) if m.stacked else [None])]
    small = export_chunks(maps, shapes, 2, max_chunk_bytes=3000)
    embed = [c for c in small if c.hf_name == "model.embed_tokens.weight"]
    h = TINY["hidden_size"]
    assert len(embed) > 1 and all(c.rows * h * 2 <= 3000 for c in embed)
    assert sum(c.rows for c in embed) == TINY["vocab_size"]
    # a row axis sharded 8 ways is cut in multiples of 8 rows, so each block keeps an even sharding
    sharded = export_chunks(maps, shapes, 2, max_chunk_bytes=3000, row_shards={"embed_tokens": 8})
    assert all(c.rows % 8 == 0 for c in sharded if c.hf_name == "model.embed_tokens.weight")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chunk_gather_holds_one_layer_not_the_whole_parameter(tmp_path, dtype):
    """Compiled per-device memory of the gather: the largest parameter's program moves one layer."""
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxrl_term.model.hf import NP_DTYPES, chunk_program, export_chunks, tensor_maps
    from jaxrl_term.parallel.mesh import make_mesh

    n_dev, L = 8, 4
    hf_checkpoint(tmp_path / "src", num_hidden_layers=L)
    model = load_pretrained(tmp_path / "src", mesh=make_mesh({"fsdp": n_dev}))
    maps = tensor_maps(model.config)
    params = {m.ours: getattr(model.layers, m.ours.split(".")[1])[...] for m in maps if m.stacked}
    name, x = max(params.items(), key=lambda kv: kv[1].size)  # gate/up/down_proj: [L, 64, 128] fp32
    itemsize = np.dtype(NP_DTYPES[dtype]).itemsize
    layer_bytes = x.size // L * itemsize  # one layer's slice, in the export dtype
    m = next(m for m in maps if m.ours == name)
    chunks = export_chunks([m], {name: x.shape}, itemsize, 512 * 1024**2)
    assert len(chunks) == L and all(c.rows == c.total_rows for c in chunks)

    def cost(fn, *args):
        ma = fn.lower(*args).compile().memory_analysis()
        return ma.output_size_in_bytes, ma.temp_size_in_bytes

    # across processes: replicated on every device; the local shard of the slice is the only temporary
    out, temp = cost(chunk_program(x, chunks[1], dtype, replicate=True)[0], x, np.int32(1))
    assert out == layer_bytes and temp <= layer_bytes // n_dev
    if dtype == "bfloat16":  # cast before the gather: below one fp32 layer even with the temporary
        assert out + temp <= x.size // L * x.dtype.itemsize
    # in one process: the chunk keeps its sharding, the host assembles it
    out1, temp1 = cost(chunk_program(x, chunks[1], dtype, replicate=False)[0], x, np.int32(1))
    assert out1 + temp1 <= layer_bytes // n_dev
    # every parameter's chunk (embed_tokens [V, H] is sharded on its minor axis): temporary <= its local shard
    for m in maps:
        arr = model
        for part in m.ours.split("."):
            arr = getattr(arr, part)
        arr = arr[...]
        c = export_chunks([m], {m.ours: arr.shape}, itemsize, 512 * 1024**2)[0]
        o, t = cost(chunk_program(arr, c, dtype, replicate=True)[0], arr, np.int32(0))
        assert o == arr.size // (L if m.stacked else 1) * itemsize and t <= o // n_dev, m.ours
    # the previous whole-parameter gather replicated all L layers in the parameter dtype
    old_out, _ = cost(jax.jit(lambda a: a, out_shardings=NamedSharding(x.sharding.mesh, PartitionSpec())), x)
    assert old_out == x.size * x.dtype.itemsize >= L * out


def test_chunk_program_replicated_output_is_the_cast_slice(tmp_path):
    import ml_dtypes

    from jaxrl_term.model.hf import chunk_program, export_chunks, tensor_maps
    from jaxrl_term.parallel.mesh import make_mesh

    hf_checkpoint(tmp_path / "src")
    model = load_pretrained(tmp_path / "src", mesh=make_mesh({"fsdp": 4, "tensor": 2}))
    m = next(m for m in tensor_maps(model.config) if m.ours == "layers.down_proj")
    x = model.layers.down_proj[...]
    c = [c for c in export_chunks([m], {m.ours: x.shape}, 2, 5000) if c.layer == 1][1]  # a middle row block
    assert 0 < c.start and c.rows < c.total_rows
    fn, perm = chunk_program(x, c, "bfloat16", replicate=True)
    out = fn(x, np.int32(c.layer))
    assert out.sharding.is_fully_replicated
    ref = np.asarray(x)[1][:, c.start:c.start + c.rows].astype(ml_dtypes.bfloat16)
    got = np.asarray(out.addressable_data(0)).view(ml_dtypes.bfloat16)
    assert perm == (1, 0)  # down_proj [i (tensor), h (fsdp)]: the fsdp-sharded axis is gathered first
    assert np.transpose(got, np.argsort(perm)).tobytes() == ref.tobytes()


def test_write_false_writes_nothing_and_write_true_writes_everything(tmp_path, tiny_tokenizer_dir):
    hf_checkpoint(tmp_path / "src")
    model = load_pretrained(tmp_path / "src")
    exports = tmp_path / "exports"
    exports.mkdir()
    assert save_pretrained(model, exports / "a", dtype="float32", write=False) == exports / "a"
    assert list(exports.iterdir()) == []
    save_pretrained(model, exports / "b", dtype="float32", write=True, max_shard_bytes=40_000,
                    tokenizer_dir=tiny_tokenizer_dir)
    save_pretrained(model, exports / "c", dtype="float32", max_shard_bytes=40_000, tokenizer_dir=tiny_tokenizer_dir)
    assert sorted(p.name for p in exports.iterdir()) == ["b", "c"]
    assert _files(exports / "b") == _files(exports / "c")
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json"} <= set(_files(exports / "b"))


_TWO_PROCESS = """
import sys
import jax
jax.distributed.initialize(sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
from jaxrl_term.model.hf import load_pretrained, save_pretrained
from jaxrl_term.parallel.mesh import make_mesh
out = sys.argv[3]
model = load_pretrained(out + "/src", mesh=make_mesh({"fsdp": 8}))
assert not model.layers.gate_proj[...].is_fully_addressable
save_pretrained(model, out + "/mine-" + sys.argv[2], "bfloat16", max_shard_bytes=40_000, write=True)
save_pretrained(model, out + "/default", "bfloat16", max_shard_bytes=40_000, max_chunk_bytes=20_000)
save_pretrained(model, out + "/none", "bfloat16", write=False)
"""


def test_two_processes_each_write_a_complete_copy_equal_to_one_process(tmp_path):
    """Two real JAX processes (4 CPU devices each, one fsdp=8 mesh): the gathers cross processes."""
    import os
    import socket
    import subprocess
    import sys

    hf_checkpoint(tmp_path / "src", tied=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "export.py"
    script.write_text(_TWO_PROCESS)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
           "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo"}
    procs = [subprocess.Popen([sys.executable, str(script), f"127.0.0.1:{port}", str(i), str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)[-3000:]

    save_pretrained(load_pretrained(tmp_path / "src"), tmp_path / "one", "bfloat16", max_shard_bytes=40_000)
    ref = _files(tmp_path / "one")
    assert len(ref) > 3
    assert _files(tmp_path / "mine-0") == ref and _files(tmp_path / "mine-1") == ref
    assert _files(tmp_path / "default") == ref  # written once, by process 0
    assert not (tmp_path / "none").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
