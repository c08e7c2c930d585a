"""HF checkpoints <-> our stacked nnx parameters.

``load_pretrained`` reads ``config.json`` and single or sharded safetensors tensor by tensor; each stacked
parameter is assembled on the host once and handed to ``jax.make_array_from_callback`` with its target
sharding, so at most one stacked parameter (plus the device shards) lives in host memory at a time.
``save_pretrained`` writes an HF directory (config.json, sharded safetensors + index) that transformers
and SGLang's ``/update_weights_from_disk`` read.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxrl_term.model.qwen3 import ModelConfigError, ModelOptions, Qwen3, Qwen3Config
from jaxrl_term.parallel.mesh import LogicalRules, ShardingCtx, path_str, state_shardings

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "generation_config.json")

NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


class CheckpointError(ValueError):
    """A model directory that cannot be loaded; the message names the file and tensor."""


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """One of our parameters and the HF tensor(s) it comes from (one per layer when stacked)."""

    ours: str  # attribute path in the nnx model, e.g. "layers.q_proj"
    hf: str  # HF name; "{i}" is the layer index for stacked parameters
    hf_shape: tuple[int, ...]
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]

    @property
    def stacked(self) -> bool:
        return "{i}" in self.hf


def tensor_maps(cfg: Qwen3Config) -> list[TensorMap]:
    h, i, d, v = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.vocab_size
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    ident = lambda a: a  # noqa: E731
    T = lambda a: np.ascontiguousarray(a.T)  # noqa: E731

    def heads_in(n):  # HF [n*d, h] <-> ours [h, n, d]
        return (lambda w: np.ascontiguousarray(w.T).reshape(h, n, d), lambda a: T(a.reshape(h, n * d)))

    o_in = (lambda w: np.ascontiguousarray(w.T).reshape(nq, d, h), lambda a: T(a.reshape(nq * d, h)))
    L = "model.layers.{i}."
    maps = [
        TensorMap("embed_tokens", "model.embed_tokens.weight", (v, h), ident, ident),
        TensorMap("layers.input_layernorm", L + "input_layernorm.weight", (h,), ident, ident),
        TensorMap("layers.q_proj", L + "self_attn.q_proj.weight", (nq * d, h), *heads_in(nq)),
        TensorMap("layers.k_proj", L + "self_attn.k_proj.weight", (nkv * d, h), *heads_in(nkv)),
        TensorMap("layers.v_proj", L + "self_attn.v_proj.weight", (nkv * d, h), *heads_in(nkv)),
        TensorMap("layers.o_proj", L + "self_attn.o_proj.weight", (h, nq * d), *o_in),
        TensorMap("layers.q_norm", L + "self_attn.q_norm.weight", (d,), ident, ident),
        TensorMap("layers.k_norm", L + "self_attn.k_norm.weight", (d,), ident, ident),
        TensorMap("layers.post_attention_layernorm", L + "post_attention_layernorm.weight", (h,), ident, ident),
        TensorMap("layers.gate_proj", L + "mlp.gate_proj.weight", (i, h), T, T),
        TensorMap("layers.up_proj", L + "mlp.up_proj.weight", (i, h), T, T),
        TensorMap("layers.down_proj", L + "mlp.down_proj.weight", (h, i), T, T),
        TensorMap("norm", "model.norm.weight", (h,), ident, ident),
    ]
    if not cfg.tie_word_embeddings:
        maps.append(TensorMap("lm_head", "lm_head.weight", (v, h), T, T))
    return maps


def read_config(model_dir: str | os.PathLike) -> Qwen3Config:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: not found; a model directory needs an HF config.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON ({e})") from e
    try:
        return Qwen3Config.from_hf(raw, source=str(path))
    except ModelConfigError as e:
        raise CheckpointError(str(e)) from e


def weight_map(model_dir: str | os.PathLike) -> dict[str, Path]:
    """HF tensor name -> safetensors file, from the index or from the single file(s)."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_NAME
    if index.is_file():
        wm = json.loads(index.read_text()).get("weight_map")
        if not isinstance(wm, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object")
        files = {}
        for name, fname in wm.items():
            p = model_dir / fname
            if not p.is_file():
                raise CheckpointError(
                    f"{index}: tensor {name!r} is in shard {fname!r}, which is missing from {model_dir}; "
                    "copy the missing shard or re-save the checkpoint"
                )
            files[name] = p
        return files
    singles = sorted(model_dir.glob("*.safetensors"))
    if not singles:
        raise CheckpointError(f"{model_dir}: no {SINGLE_NAME}, {INDEX_NAME} or *.safetensors files")
    files = {}
    for p in singles:
        with safe_open(str(p), framework="numpy") as f:
            for name in f.keys():
                files[name] = p
    return files


class _Reader:
    """Open safetensors files lazily and read one tensor at a time, checking names and shapes."""

    def __init__(self, model_dir: Path, files: Mapping[str, Path]):
        self.model_dir, self.files, self._open = model_dir, files, {}

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        path = self.files.get(name)
        if path is None:
            raise CheckpointError(f"{self.model_dir}: tensor {name!r} is missing (not in any safetensors file)")
        if path not in self._open:
            self._open[path] = safe_open(str(path), framework="numpy")
        f = self._open[path]
        got = tuple(f.get_slice(name).get_shape())
        if got != shape:
            raise CheckpointError(
                f"{path.name}: tensor {name!r} has shape {list(got)} but config.json implies {list(shape)}"
            )
        return f.get_tensor(name)


def _place(arr: np.ndarray, sharding) -> jax.Array:
    if sharding is None:
        return jnp.asarray(arr)
    return jax.make_array_from_callback(arr.shape, sharding, lambda idx: arr[idx])


def load_pretrained(
    model_dir: str | os.PathLike,
    *,
    param_dtype: str = "float32",
    compute_dtype: str = "float32",
    mesh: jax.sharding.Mesh | None = None,
    rules: Mapping | LogicalRules | None = None,
    options: ModelOptions | None = None,
) -> Qwen3:
    """Load an HF Qwen3 directory into our model; ``mesh`` places each parameter with its sharding.

    Returns a model callable as ``model(input_ids [B,T] int32, attention_mask [B,T]) -> logits [B,T,V]``.
    """
    model_dir = Path(model_dir)
    cfg = read_config(model_dir)
    opts = options or ModelOptions()
    opts = dataclasses.replace(opts, param_dtype=param_dtype, compute_dtype=compute_dtype)
    if rules is not None and not isinstance(rules, LogicalRules):
        rules = LogicalRules.from_mapping(rules)
    shard = ShardingCtx(mesh, rules or LogicalRules.from_mapping())
    reader = _Reader(model_dir, weight_map(model_dir))
    maps = tensor_maps(cfg)
    known = {m.hf.format(i=i) for m in maps for i in (range(cfg.num_hidden_layers) if m.stacked else [0])}
    extra = sorted(set(reader.files) - known - {"lm_head.weight"})
    if extra:
        log.warning("%s: ignoring %d tensors this model does not use, e.g. %s", model_dir, len(extra), extra[:3])

    abstract = nnx.eval_shape(lambda: Qwen3(cfg, opts, rngs=nnx.Rngs(0), shard=shard))
    graphdef, state = nnx.split(abstract)
    shardings = state_shardings(state, shard) if mesh is not None else None
    by_path = {m.ours: m for m in maps}
    pdtype = NP_DTYPES[param_dtype]

    def fill(path, var, sh=None):
        name = path_str(path)
        m = by_path.get(name)
        if m is None:
            raise CheckpointError(f"internal: no HF mapping for parameter {name}")
        if m.stacked:
            out = np.empty(var.shape, pdtype)
            for layer in range(cfg.num_hidden_layers):
                out[layer] = m.to_ours(reader.get(m.hf.format(i=layer), m.hf_shape)).astype(pdtype)
        else:
            out = m.to_ours(reader.get(m.hf, m.hf_shape)).astype(pdtype)
        if out.shape != tuple(var.shape):
            raise CheckpointError(f"internal: {m.hf} -> {name} gave {out.shape}, expected {var.shape}")
        placed = _place(out, None if sh is None else sh.get_value())
        del out
        return var.replace(placed)

    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    if shardings is None:
        state = jax.tree_util.tree_map_with_path(fill, state, is_leaf=is_var)
    else:
        state = jax.tree_util.tree_map_with_path(fill, state, shardings, is_leaf=is_var)
    return nnx.merge(graphdef, state)


def _to_host(x: jax.Array) -> np.ndarray:
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def save_pretrained(
    model: Qwen3,
    out_dir: str | os.PathLike,
    dtype: str = "bfloat16",
    *,
    max_shard_bytes: int = 4 * 1024**3,
    tokenizer_dir: str | os.PathLike | None = None,
) -> Path:
    """Write an HF directory: config.json, ``model-0000k-of-0000n.safetensors`` and the index.

    Tensors are written parameter by parameter (all layers of ``q_proj``, then ``k_proj``...), so one
    stacked parameter is on the host at a time. The directory appears atomically (written beside it, then
    renamed), so a reader never sees half a checkpoint. Every process must call this (it gathers sharded
    arrays); only process 0 writes.
    """
    if dtype not in NP_DTYPES:
        raise ValueError(f"save_pretrained: dtype={dtype!r}; use one of {sorted(NP_DTYPES)}")
    cfg: Qwen3Config = model.config
    out_dir = Path(out_dir)
    np_dtype = NP_DTYPES[dtype]
    itemsize = np.dtype(np_dtype).itemsize
    maps = tensor_maps(cfg)
    writer = jax.process_index() == 0

    # Plan shards from shapes alone, so the names carry the total ("-of-0000n") before anything is written.
    plan: list[list[str]] = [[]]
    size = 0
    for m in maps:
        for layer in range(cfg.num_hidden_layers) if m.stacked else [None]:
            nbytes = int(np.prod(m.hf_shape)) * itemsize
            if plan[-1] and size + nbytes > max_shard_bytes:
                plan.append([])
                size = 0
            plan[-1].append(m.hf.format(i=layer))
            size += nbytes
    n = len(plan)
    shard_of = {name: k for k, names in enumerate(plan) for name in names}
    fname = (lambda k: SINGLE_NAME) if n == 1 else (lambda k: f"model-{k + 1:05d}-of-{n:05d}.safetensors")

    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    if writer:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    pending: dict[int, dict[str, np.ndarray]] = {}
    remaining = {k: len(names) for k, names in enumerate(plan)}
    for m in maps:
        value = _to_host(_get_attr(model, m.ours)[...]).astype(np_dtype)
        for layer in range(cfg.num_hidden_layers) if m.stacked else [None]:
            name = m.hf.format(i=layer)
            k = shard_of[name]
            pending.setdefault(k, {})[name] = m.to_hf(value[layer] if m.stacked else value)
            remaining[k] -= 1
            if remaining[k] == 0:
                tensors = pending.pop(k)
                if writer:
                    save_file(tensors, str(tmp / fname(k)), metadata={"format": "pt"})
        del value
    if not writer:
        return out_dir
    if n > 1:
        total = sum(int(np.prod(m.hf_shape)) * itemsize * (cfg.num_hidden_layers if m.stacked else 1) for m in maps)
        index = {"metadata": {"total_size": total}, "weight_map": {nm: fname(shard_of[nm]) for nm in shard_of}}
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True))
    (tmp / "config.json").write_text(json.dumps(cfg.to_hf(dtype), indent=2))
    if tokenizer_dir is not None:
        for f in TOKENIZER_FILES:
            src = Path(tokenizer_dir) / f
            if src.is_file():
                shutil.copy2(src, tmp / f)
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    if out_dir.exists():
        out_dir.rename(old)
    tmp.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def _get_attr(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj
