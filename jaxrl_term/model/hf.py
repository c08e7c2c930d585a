"""HF checkpoints <-> our stacked nnx parameters.

``load_pretrained`` reads ``config.json`` and single or sharded safetensors tensor by tensor; each stacked
parameter is assembled on the host once and handed to ``jax.make_array_from_callback`` with its target
sharding, so at most one stacked parameter (plus the device shards) lives in host memory at a time.
``save_pretrained`` writes an HF directory (config.json, sharded safetensors + index) that transformers
and SGLang's ``/update_weights_from_disk`` read.

Export streams. A whole stacked parameter never leaves its sharding: each parameter goes to the host in
chunks (one layer of a stacked parameter, or a block of rows of a big one such as ``embed_tokens``, at most
``max_chunk_bytes``), each sliced and cast to the export dtype on device by one small jitted program. In a
single process the chunk keeps its sharding and the host assembles the shards (extra device memory: a
1/n-th of a chunk per device); across processes the chunk is gathered replicated, so every process gets
it (extra device memory: one chunk per device, where replicating the whole stacked parameter cost e.g.
+33.5 GB per GPU for Qwen3-32B's fp32 ``gate_proj``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
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
# Chunks travel as raw bits: XLA:CPU widens bf16/fp16 collectives to f32, which doubles the traffic and
# adds an f32 temporary the size of the chunk.
_BITS = {2: np.uint16, 4: np.uint32}
DEFAULT_MAX_CHUNK_BYTES = 512 * 1024**2


class CheckpointError(ValueError):
    """A model directory that cannot be loaded; the message names the file and tensor."""


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """One of our parameters and the HF tensor(s) it comes from (one per layer when stacked)."""

    ours: str  # attribute path in the nnx model, e.g. "layers.q_proj"
    hf: str  # HF name; "{i}" is the layer index for stacked parameters
    hf_shape: tuple[int, ...]
    to_ours: Callable[[np.ndarray], np.ndarray]
    # ours (one layer) -> HF; must also map a block of rows along ``row_axis`` to the matching HF rows
    to_hf: Callable[[np.ndarray], np.ndarray]
    row_axis: int = 0  # the axis of ours (one layer) whose blocks become blocks of HF rows (axis 0)

    @property
    def stacked(self) -> bool:
        return "{i}" in self.hf


def tensor_maps(cfg: Qwen3Config) -> list[TensorMap]:
    h, i, d, v = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.vocab_size
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    ident = lambda a: a  # noqa: E731
    T = lambda a: np.ascontiguousarray(a.T)  # noqa: E731

    # to_hf reads sizes from its argument, so a block of heads (or of hidden rows) maps to a block of HF rows
    def heads_in(n):  # HF [n*d, h] <-> ours [h, n, d]; rows = heads
        return (lambda w: np.ascontiguousarray(w.T).reshape(h, n, d), lambda a: T(a.reshape(a.shape[0], -1)), 1)

    o_in = (lambda w: np.ascontiguousarray(w.T).reshape(nq, d, h), lambda a: T(a.reshape(-1, a.shape[-1])), 2)
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
        TensorMap("layers.gate_proj", L + "mlp.gate_proj.weight", (i, h), T, T, 1),
        TensorMap("layers.up_proj", L + "mlp.up_proj.weight", (i, h), T, T, 1),
        TensorMap("layers.down_proj", L + "mlp.down_proj.weight", (h, i), T, T, 1),
        TensorMap("norm", "model.norm.weight", (h,), ident, ident),
    ]
    if not cfg.tie_word_embeddings:
        maps.append(TensorMap("lm_head", "lm_head.weight", (v, h), T, T, 1))
    return maps


def read_config(model_dir: str | os.PathLike, overrides: Mapping[str, Any] | None = None) -> Qwen3Config:
    """``config.json`` of an HF directory; ``overrides`` replace its top-level keys first, as SGLang's
    ``--json-model-override-args`` does (e.g. ``{"rope_scaling": {...}}``: YaRN for a model saved without it)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: not found; a model directory needs an HF config.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON ({e})") from e
    source = str(path) + (f" (with overrides {sorted(overrides)})" if overrides else "")
    try:
        return Qwen3Config.from_hf({**raw, **(overrides or {})}, source=source)
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
    overrides: Mapping[str, Any] | None = None,
) -> Qwen3:
    """Load an HF Qwen3 directory into our model; ``mesh`` places each parameter with its sharding;
    ``overrides``: config.json keys replaced (``read_config``).

    Returns a model callable as ``model(input_ids [B,T] int32, attention_mask [B,T]) -> logits [B,T,V]``.
    """
    model_dir = Path(model_dir)
    cfg = read_config(model_dir, overrides)
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


@dataclasses.dataclass(frozen=True)
class ExportChunk:
    """One device->host transfer: rows ``[start, start + rows)`` along ``tmap.row_axis`` of one layer of a
    parameter (``layer`` is None for a parameter without a layer axis); ``total_rows`` is that axis' size."""

    tmap: TensorMap
    layer: int | None
    start: int
    rows: int
    total_rows: int

    @property
    def hf_name(self) -> str:
        return self.tmap.hf.format(i=self.layer)


def export_chunks(
    maps: list[TensorMap],
    shapes: Mapping[str, tuple[int, ...]],
    itemsize: int,
    max_chunk_bytes: int,
    row_shards: Mapping[str, int] | None = None,
) -> list[ExportChunk]:
    """The transfers of an export in file order: a stacked parameter [L, ...] layer by layer, and each
    layer (or unstacked parameter) in blocks of rows of at most ``max_chunk_bytes`` at ``itemsize`` bytes
    per element. ``shapes``: our parameter path -> its shape. ``row_shards``: path -> how many ways the
    row axis is sharded; a block is a multiple of that many rows (at least one row per shard), so every
    block keeps an even sharding."""
    chunks = []
    for m in maps:
        shape = tuple(shapes[m.ours])
        one = shape[1:] if m.stacked else shape
        total = one[m.row_axis]
        k = (row_shards or {}).get(m.ours, 1)
        row_bytes = math.prod(one) // total * itemsize
        rows = min(total, max(k, max_chunk_bytes // row_bytes // k * k))
        for layer in range(shape[0]) if m.stacked else [None]:
            chunks.extend(ExportChunk(m, layer, r, min(rows, total - r), total) for r in range(0, total, rows))
    return chunks


@functools.lru_cache(maxsize=512)
def _chunk_jit(sharding, ndim: int, stacked: bool, row_axis: int, start: int, rows: int, total: int,
               dtype: str, replicate: bool):
    bits = _BITS[np.dtype(NP_DTYPES[dtype]).itemsize]
    spec: tuple = ()
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
        spec = spec[1:] if stacked else spec
    elif replicate:
        raise ValueError(f"save_pretrained: cannot gather a parameter sharded with {sharding} across processes; "
                         "place the model with a NamedSharding (ShardingCtx / shard_model)")
    n = ndim - 1 if stacked else ndim
    perm = tuple(range(n))
    if replicate:
        # Sharded dimensions first (in mesh-axis order): gathering along leading dimensions needs no
        # chunk-sized temporary for a transpose; the host puts the axes back.
        axes = list(sharding.mesh.axis_names)
        first = lambda d: axes.index(spec[d] if isinstance(spec[d], str) else spec[d][0])  # noqa: E731
        perm = tuple(sorted((d for d in perm if spec[d] is not None), key=first)) + tuple(
            d for d in perm if spec[d] is None)

    def chunk(x, layer):
        c = jax.lax.dynamic_index_in_dim(x, layer, 0, keepdims=False) if stacked else x
        if rows != total:
            c = jax.lax.slice_in_dim(c, start, start + rows, axis=row_axis)
        c = jnp.transpose(jax.lax.bitcast_convert_type(c.astype(dtype), bits), perm)
        if spec:  # cast where the shards live, so only export-dtype bytes are gathered
            moved = PartitionSpec(*(spec[d] for d in perm))
            c = jax.lax.with_sharding_constraint(c, NamedSharding(sharding.mesh, moved))
        return c

    if replicate:
        return jax.jit(chunk, out_shardings=NamedSharding(sharding.mesh, PartitionSpec())), perm
    if spec:
        return jax.jit(chunk, out_shardings=NamedSharding(sharding.mesh, PartitionSpec(*spec))), perm
    return jax.jit(chunk), perm


def chunk_program(x: jax.Array, c: ExportChunk, dtype: str, *, replicate: bool | None = None):
    """``(fn, perm)``: the jitted ``fn(x, layer int32)`` returns chunk c cast to ``dtype`` on device, as raw
    bits (uint16/uint32), with its axes in the order ``perm`` of our per-layer layout. ``replicate``
    (default: when x spans processes) puts the output on every device; otherwise it keeps x's sharding and
    the host assembles the shards."""
    if replicate is None:
        replicate = not x.is_fully_addressable
    return _chunk_jit(x.sharding, x.ndim, c.tmap.stacked, c.tmap.row_axis, c.start, c.rows, c.total_rows,
                      dtype, replicate)


def _row_shards(x: jax.Array, m: TensorMap) -> int:
    """How many ways ``x``'s row axis is split across devices."""
    sh = x.sharding
    axis = m.row_axis + (1 if m.stacked else 0)
    if not isinstance(sh, NamedSharding) or axis >= len(sh.spec) or sh.spec[axis] is None:
        return 1
    names = sh.spec[axis] if isinstance(sh.spec[axis], tuple) else (sh.spec[axis],)
    return math.prod(sh.mesh.shape[a] for a in names)


def _fetch(x: jax.Array, c: ExportChunk, dtype: str, to_host: bool) -> np.ndarray | None:
    replicate = not x.is_fully_addressable
    fn, perm = chunk_program(x, c, dtype, replicate=replicate)
    out = fn(x, np.int32(c.layer or 0))
    if to_host:
        bits = np.asarray(out.addressable_data(0) if replicate else out)
        if perm != tuple(range(len(perm))):
            bits = np.ascontiguousarray(np.transpose(bits, np.argsort(perm)))
    else:  # a process that does not write still takes part in the gather, one chunk at a time
        out.block_until_ready()
    out.delete()  # free the device buffers now, whoever still holds the Python object
    return bits.view(NP_DTYPES[dtype]) if to_host else None


def special_token_ids(tokenizer_dir: str | os.PathLike | None) -> dict[str, int]:
    """bos / eos ids for config.json from the tokenizer saved with the weights (Qwen's convention: bos =
    ``<|endoftext|>``, eos = ``<|im_end|>``); {} when there is no tokenizer or it lacks them."""
    if tokenizer_dir is None or not (Path(tokenizer_dir) / "tokenizer.json").is_file():
        return {}
    try:
        added = json.loads((Path(tokenizer_dir) / "tokenizer.json").read_text()).get("added_tokens") or []
    except (OSError, ValueError):
        return {}
    ids = {t.get("content"): t.get("id") for t in added if isinstance(t, dict)}
    out = {"bos_token_id": ids.get("<|endoftext|>"), "eos_token_id": ids.get("<|im_end|>")}
    return {k: int(v) for k, v in out.items() if isinstance(v, int)}


def save_pretrained(
    model: Qwen3,
    out_dir: str | os.PathLike,
    dtype: str = "bfloat16",
    *,
    max_shard_bytes: int = 4 * 1024**3,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    tokenizer_dir: str | os.PathLike | None = None,
    write: bool | None = None,
) -> Path:
    """Write an HF directory: config.json, ``model-0000k-of-0000n.safetensors`` and the index.

    Parameters stream to the host in chunks cast to ``dtype`` on device: one layer of a stacked parameter
    at a time, split into blocks of rows of at most ``max_chunk_bytes`` (an unstacked ``embed_tokens``
    [V, H] / ``lm_head`` [H, V] by vocab rows). Extra device memory: one chunk per device (plus its local
    shard) when the model spans processes, that chunk's local shard otherwise. Host memory: the tensors of
    the safetensors file being filled (up to ``max_shard_bytes``, or one tensor if larger; safetensors
    copies them once more while writing) plus one chunk. The directory appears atomically (written beside
    it, then renamed), so a reader never sees half a checkpoint. Files are byte-identical to a host-side
    cast of the gathered parameters (the device cast rounds to nearest even, as ml_dtypes does).

    Every process must call this (the gathers are collectives). ``write`` says whether this process
    writes files: default process 0 only; ``write=True`` on every process gives each host its own
    complete copy (for a node-local ``out_dir``; one writer per filesystem).
    """
    if dtype not in NP_DTYPES:
        raise ValueError(f"save_pretrained: dtype={dtype!r}; use one of {sorted(NP_DTYPES)}")
    if max_chunk_bytes <= 0:
        raise ValueError(f"save_pretrained: max_chunk_bytes={max_chunk_bytes} must be positive")
    cfg: Qwen3Config = model.config
    out_dir = Path(out_dir)
    np_dtype = NP_DTYPES[dtype]
    itemsize = np.dtype(np_dtype).itemsize
    maps = tensor_maps(cfg)
    writer = jax.process_index() == 0 if write is None else bool(write)

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

    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{jax.process_index()}-{os.getpid()}")
    if writer:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    params = {m.ours: _get_attr(model, m.ours)[...] for m in maps}
    pending: dict[int, dict[str, np.ndarray]] = {}
    remaining = {k: len(names) for k, names in enumerate(plan)}
    partial: dict[str, np.ndarray] = {}  # HF tensors that arrive in several chunks, being filled
    chunks = export_chunks(maps, {k: v.shape for k, v in params.items()}, itemsize, max_chunk_bytes,
                           {m.ours: _row_shards(params[m.ours], m) for m in maps})
    for c in chunks:
        block = _fetch(params[c.tmap.ours], c, dtype, to_host=writer)
        if block is None:
            continue
        name, rows = c.hf_name, c.tmap.to_hf(block)
        del block
        if c.rows == c.total_rows:
            tensor = rows
        else:
            buf = partial.setdefault(name, np.empty(c.tmap.hf_shape, np_dtype))
            per = c.tmap.hf_shape[0] // c.total_rows  # HF rows per row of ours (head_dim for q/k/v)
            buf[c.start * per:(c.start + c.rows) * per] = rows
            if c.start + c.rows < c.total_rows:
                continue
            tensor = partial.pop(name)
        if tensor.shape != c.tmap.hf_shape:
            raise CheckpointError(f"internal: {c.tmap.ours} -> {name} gave {tensor.shape}, expected {c.tmap.hf_shape}")
        k = shard_of[name]
        pending.setdefault(k, {})[name] = tensor
        remaining[k] -= 1
        if remaining[k] == 0:
            save_file(pending.pop(k), str(tmp / fname(k)), metadata={"format": "pt"})
    if not writer:
        return out_dir
    if n > 1:
        total = sum(int(np.prod(m.hf_shape)) * itemsize * (cfg.num_hidden_layers if m.stacked else 1) for m in maps)
        index = {"metadata": {"total_size": total}, "weight_map": {nm: fname(shard_of[nm]) for nm in shard_of}}
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True))
    (tmp / "config.json").write_text(json.dumps(cfg.to_hf(dtype, **special_token_ids(tokenizer_dir)), indent=2))
    if tokenizer_dir is not None:
        for f in TOKENIZER_FILES:
            src = Path(tokenizer_dir) / f
            if src.is_file():
                shutil.copy2(src, tmp / f)
    old = out_dir.with_name(f".{out_dir.name}.old-{jax.process_index()}-{os.getpid()}")
    if out_dir.exists():
        out_dir.rename(old)
    tmp.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def _get_attr(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj
