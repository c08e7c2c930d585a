"""The dense Qwen3 decoder in flax.nnx.

Layers are stacked (every per-layer parameter has a leading ``layers`` axis) and run with ``lax.scan``,
so compile time does not grow with depth. Parameters are stored in ``param_dtype`` and cast to
``compute_dtype`` where used; RMSNorm statistics, softmax and (optionally) the LM head run in fp32.
Every parameter carries ``logical_axes`` metadata that ``parallel.mesh`` turns into shardings.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_term.model.rope import RopeScaling, apply_rope, rope_tables  # noqa: F401 (re-exported)
from jaxrl_term.parallel.mesh import ShardingCtx

ACT = ("activation_batch", "activation_length", "activation_embed")


class ModelConfigError(ValueError):
    """A model config that this implementation cannot run (names the field and the fix)."""


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    """Architecture numbers, named as in HF's ``config.json``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960
    # YaRN beyond the pre-training length (model/rope.py); an HF-style dict is accepted and parsed
    rope_scaling: RopeScaling | None = None

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            try:
                parsed = RopeScaling.from_hf(self.rope_scaling, max_position_embeddings=self.max_position_embeddings)
            except ValueError as e:
                raise ModelConfigError(f"model.rope_scaling: {e}; or model.rope_scaling=null (plain RoPE)") from e
            object.__setattr__(self, "rope_scaling", parsed)

    @property
    def max_context(self) -> int:
        """Positions the model is meant to see: max_position_embeddings, or original x factor with YaRN."""
        return self.rope_scaling.max_context if self.rope_scaling else self.max_position_embeddings

    @classmethod
    def from_hf(cls, d: Mapping[str, Any], source: str = "config.json") -> Qwen3Config:
        """From an HF config dict (transformers v4 ``rope_theta`` or v5 ``rope_parameters``)."""
        archs = d.get("architectures") or []
        model_type = d.get("model_type")
        if model_type != "qwen3" and "Qwen3ForCausalLM" not in archs:
            raise ModelConfigError(
                f"{source}: unknown architecture (model_type={model_type!r}, architectures={archs}); "
                "jaxrl_term implements the dense Qwen3 decoder (model_type 'qwen3', Qwen3ForCausalLM)"
            )
        if d.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"{source}: hidden_act={d['hidden_act']!r}; Qwen3 uses 'silu'")
        if d.get("attention_bias", False):
            raise ModelConfigError(f"{source}: attention_bias=true is not supported (Qwen3 has no attention bias)")
        if d.get("use_sliding_window", False):
            raise ModelConfigError(f"{source}: use_sliding_window=true is not supported; set it to false")
        # transformers v5 reads `rope_scaling or rope_parameters` (the v4 name wins when set); v4 reads rope_scaling
        rope = d.get("rope_parameters") or {}
        scaling = d.get("rope_scaling") or rope
        theta = rope.get("rope_theta", d.get("rope_theta", scaling.get("rope_theta", 10_000.0)))
        mpe = int(d.get("max_position_embeddings", 40960))
        try:
            yarn = RopeScaling.from_hf(scaling, max_position_embeddings=mpe)
        except ValueError as e:
            raise ModelConfigError(
                f"{source}: rope_scaling / rope_parameters: {e}; or remove the scaling to train at the native "
                f"context length ({mpe})"
            ) from e
        missing = [
            k
            for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
            if k not in d
        ]
        if missing:
            raise ModelConfigError(f"{source}: missing fields {missing}")
        heads = int(d["num_attention_heads"])
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=mpe,
            rope_scaling=yarn,
        )

    def to_hf(self, dtype: str = "bfloat16", *, bos_token_id: int | None = None,
              eos_token_id: int | None = None) -> dict[str, Any]:
        """An HF ``config.json`` dict that transformers (v4 and v5) and SGLang read. Special-token ids: the ones
        given (from the tokenizer saved alongside), else Qwen's (151643 / 151645) when the vocabulary holds them;
        an id outside the vocabulary is never written (it would be a dangling id for a small vocabulary).
        With YaRN, ``rope_scaling`` (v4, SGLang) and ``rope_parameters`` (v5) both carry it and
        max_position_embeddings is written as original x factor: transformers 4.51.3 takes that ratio as the
        factor, v5 warns when they differ, SGLang derives its context length from it."""
        if bos_token_id is None and eos_token_id is None and self.vocab_size > 151645:
            bos_token_id, eos_token_id = 151643, 151645
        ids = {k: v for k, v in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id))
               if v is not None and 0 <= v < self.vocab_size}
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling.to_hf() if self.rope_scaling else None,
            "rope_parameters": {**(self.rope_scaling.to_hf() if self.rope_scaling else {"rope_type": "default"}),
                                "rope_theta": self.rope_theta},
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_context,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "initializer_range": 0.02,
            "use_cache": True,
            "torch_dtype": dtype,
            "dtype": dtype,
            **ids,
        }

    def num_params(self) -> int:
        h, i, d, L = self.hidden_size, self.intermediate_size, self.head_dim, self.num_hidden_layers
        nq, nkv = self.num_attention_heads, self.num_key_value_heads
        per_layer = h * d * (2 * nq + 2 * nkv) + 3 * h * i + 2 * h + 2 * d
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + L * per_layer + h + head


REMAT_POLICIES: dict[str, Callable | None] = {
    "full": None,  # save nothing, recompute the layer
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "dots_all": jax.checkpoint_policies.checkpoint_dots,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
}


ATTENTION_KINDS = ("dot_product_attention", "xla", "blockwise", "cudnn")


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """How to run the architecture: dtypes, rematerialisation, attention kernel, LM head precision."""

    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    remat: str = "none"  # none | full | dots | dots_all | nothing_saveable
    # dot_product_attention: jax.nn.dot_product_attention, XLA path with a dense [B, T, T] mask (short rows, CPU)
    # xla: our einsum with the same dense mask | blockwise: our flash attention in JAX, O(T x block) memory
    # cudnn: cuDNN's fused flash attention (GPU; causal + right-padding lengths; no packing)
    attention: str = "dot_product_attention"
    attention_block: int = 512  # query/key block of the blockwise kernel
    mlp_chunk: int = 0  # tokens per MLP chunk (bounds [T, intermediate] activations at long T); 0 = whole rows
    remat_groups: int = 0  # G >= 1: nested remat, G groups of L/G layers (saves G + L/G layer inputs, not L)
    lm_head_fp32: bool = True  # fp32 logits from fp32-cast hidden states (engine and trainer alike)
    logits_chunk: int = 0  # sequence chunk for lm_head_map; 0 = whole sequence at once
    precision: str = "default"  # matmul precision of the body: default | high | highest
    unroll: bool = False  # unroll the layer / logit-chunk / microbatch loops (the planner's FLOP count)
    # True: the layer loop is a lax.scan over the stacked weights (compile time independent of depth: deep models,
    # GPU presets). False: unrolled into straight-line code, so there is no while loop whose per-layer residuals
    # XLA zero-fills and copies into stacked buffers every step (CPU presets: 14% of the tiny update step, 6% of
    # the 100M one; experiments/results/train_step.md). Same numbers either way. Refused with remat, which
    # unrolled layers defeat.
    scan_layers: bool = True
    flat_matmuls: bool = True  # [B, T] merged into one token axis for the layers' matmuls (decoder_layer.proj)

    def __post_init__(self):
        if self.remat != "none" and self.remat not in REMAT_POLICIES:
            raise ModelConfigError(f"model.remat={self.remat!r}; use none or one of {sorted(REMAT_POLICIES)}")
        if self.attention not in ATTENTION_KINDS:
            raise ModelConfigError(f"model.attention={self.attention!r}; use one of {ATTENTION_KINDS}")
        if self.mlp_chunk < 0 or self.remat_groups < 0:
            raise ModelConfigError("model.mlp_chunk and model.remat_groups must be >= 0")
        if self.remat != "none" and not self.scan_layers:
            # measured (XLA:CPU, 6 layers): remat=full 97 MiB of temporaries with the scan, 469 unrolled (492
            # without remat); optimization barriers on the recomputation did not change it
            raise ModelConfigError(f"model.remat={self.remat} with model.scan_layers=false: unrolled layers keep "
                                   "nearly every activation despite remat; keep scan_layers=true with remat")
        if self.remat_groups and self.remat == "none":
            raise ModelConfigError("model.remat_groups needs a remat policy (e.g. model.remat=full)")
        if self.attention_block < 8:
            raise ModelConfigError(f"model.attention_block={self.attention_block}; use a block of >= 8 tokens")
        for f in ("param_dtype", "compute_dtype"):
            if getattr(self, f) not in ("float32", "bfloat16", "float16"):
                raise ModelConfigError(f"model.{f}={getattr(self, f)!r}; use float32, bfloat16 or float16")

    @property
    def pdtype(self):
        return jnp.dtype(self.param_dtype)

    @property
    def cdtype(self):
        return jnp.dtype(self.compute_dtype)


# ----------------------------------------------------------------------------------------------- maths


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF Qwen3RMSNorm: statistics in fp32, result cast back before scaling by the weight."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * xf.astype(x.dtype)


def make_attention_mask(attention_mask: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """[B, T, T] bool: causal, key not padding, and (with packing) same segment."""
    t = attention_mask.shape[1]
    causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    mask = causal[None] & attention_mask.astype(bool)[:, None, :]
    if segment_ids is not None:
        mask &= segment_ids[:, :, None] == segment_ids[:, None, :]
    return mask


def dot_attention(q, k, v, mask, scale: float, precision=None) -> jax.Array:
    """Grouped-query attention. q: [B,T,Nq,D], k/v: [B,S,Nkv,D], mask: [B,T,S] bool -> [B,T,Nq,D].

    Scores and softmax in fp32; fully masked rows (padding queries) give finite values.
    """
    b, t, nq, d = q.shape
    nkv = k.shape[2]
    qg = q.reshape(b, t, nkv, nq // nkv, d)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32, precision=precision)
    s = s * scale
    s = jnp.where(mask[:, None, None], s, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    o = jnp.einsum("bkgts,bskd->btkgd", p, v, precision=precision)
    return o.reshape(b, t, nq, d)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def embed_lookup(table: jax.Array, ids: jax.Array, shard: ShardingCtx) -> jax.Array:
    """table [V, H], ids [B, T] -> [B, T, H] (table's dtype), without ever gathering the table.

    The table stays sharded on its hidden dimension (as stored, FSDP over ``embed``): every device looks up all
    rows' ids in its own hidden slice ([B, T, H/n]; ids are tiny), and the caller's batch constraint turns that
    into batch-sharded rows (an all-to-all). The backward pass mirrors it, scatter-adding into the local
    [V, H/n] slice, so no device ever holds a whole [V, H] gradient (XLA's default: a full-table all-reduce).
    """
    return _embed_lookup(table, ids, shard)


def _embed_lookup(table, ids, shard):
    ids = shard.constrain(ids, (None, None))
    table = shard.constrain(table, (None, "embed"))
    return shard.constrain(jnp.take(table, ids, axis=0), (None, None, "embed"))


def _embed_fwd(table, ids, shard):
    return _embed_lookup(table, ids, shard), (table, ids)


def _embed_bwd(shard, res, g):
    table, ids = res
    g = shard.constrain(g.astype(table.dtype), (None, None, "embed"))
    ids = shard.constrain(ids, (None, None))
    dt = shard.constrain(jnp.zeros(table.shape, table.dtype), (None, "embed")).at[ids].add(g)
    return shard.constrain(dt, (None, "embed")), None


embed_lookup.defvjp(_embed_fwd, _embed_bwd)


def remat_saving_bits(fn: Callable) -> Callable:
    """``jax.checkpoint`` (save nothing but the input) for ``fn(x, p, ctx) -> y``, where a 16-bit ``x`` is saved
    as its raw bits. ``ctx`` (rope tables, attention masks) gets no gradient.

    A scan over rematerialised layers keeps every layer's input for the backward pass: [L, B, T, H], the largest
    activation at long context. Saved as bf16, XLA may still widen the whole stack to fp32 before the backward
    loop (XLA:CPU does: convert hoisting, 2x the bytes, plus the bf16 original); saved as uint16 bits nothing can
    be widened, and the backward pass bitcasts each layer's input back. fp32 inputs are saved as they are.
    """

    @jax.custom_vjp
    def f(x, p, ctx):
        return fn(x, p, ctx)

    def fwd(x, p, ctx):
        bits = jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype.itemsize == 2 else x
        return fn(x, p, ctx), (bits, p, ctx)

    def bwd(res, dy):
        bits, p, ctx = res
        x = jax.lax.bitcast_convert_type(bits, dy.dtype) if bits.dtype == jnp.uint16 else bits
        _, vjp = jax.vjp(lambda x, p: fn(x, p, ctx), x, p)
        dx, dp = vjp(dy)
        return dx, dp, jax.tree.map(_zero_cotangent, ctx)

    f.defvjp(fwd, bwd)
    return f


def _zero_cotangent(a):
    if jnp.issubdtype(a.dtype, jnp.inexact):
        return jnp.zeros_like(a)
    return np.zeros(a.shape, dtype=jax.dtypes.float0)


# ---------------------------------------------------------------------------------------------- modules


def _normal(rngs: nnx.Rngs, shape, dtype, std=0.02):
    return (jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(dtype)


LAYER_PARAMS = (
    "input_layernorm",
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "q_norm",
    "k_norm",
    "post_attention_layernorm",
    "gate_proj",
    "up_proj",
    "down_proj",
)


class DecoderLayers(nnx.Module):
    """All decoder layers, each parameter stacked on a leading ``layers`` axis."""

    def __init__(self, cfg: Qwen3Config, opts: ModelOptions, *, rngs: nnx.Rngs):
        L, h, i, d = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        nq, nkv, pd = cfg.num_attention_heads, cfg.num_key_value_heads, opts.pdtype

        def w(shape, axes):
            return nnx.Param(_normal(rngs, (L, *shape), pd), logical_axes=("layers", *axes))

        def ones(n, axes):
            return nnx.Param(jnp.ones((L, n), pd), logical_axes=("layers", *axes))

        self.input_layernorm = ones(h, ("norm",))
        self.q_proj = w((h, nq, d), ("embed", "q_heads", "head_dim"))
        self.k_proj = w((h, nkv, d), ("embed", "kv_heads", "head_dim"))
        self.v_proj = w((h, nkv, d), ("embed", "kv_heads", "head_dim"))
        self.o_proj = w((nq, d, h), ("q_heads", "head_dim", "embed"))
        self.q_norm = ones(d, ("head_dim",))
        self.k_norm = ones(d, ("head_dim",))
        self.post_attention_layernorm = ones(h, ("norm",))
        self.gate_proj = w((h, i), ("embed", "mlp"))
        self.up_proj = w((h, i), ("embed", "mlp"))
        self.down_proj = w((i, h), ("mlp", "embed"))

    def stacked(self) -> dict[str, jax.Array]:
        return {name: getattr(self, name)[...] for name in LAYER_PARAMS}


@flax.struct.dataclass
class AttentionInputs:
    """What the attention kernels need to mask, built once per forward: the dense kernels take ``mask``
    [B, T, T] bool; ``blockwise`` takes ``segment_ids`` [B, T] (0 = padding, equal ids attend, causal by index);
    ``cudnn`` takes ``lengths`` [B] (right-padded rows). Unused fields cost nothing (XLA drops them)."""

    mask: jax.Array | None
    segment_ids: jax.Array
    lengths: jax.Array


def attention_inputs(attention_mask: jax.Array, segment_ids: jax.Array | None, kind: str) -> AttentionInputs:
    seg = attention_mask.astype(jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    dense = kind in ("xla", "dot_product_attention")
    return AttentionInputs(make_attention_mask(attention_mask, segment_ids) if dense else None, seg,
                           jnp.sum(attention_mask.astype(jnp.int32), axis=-1))


def attend(q, k, v, a: AttentionInputs, opts: ModelOptions, scale: float, precision=None) -> jax.Array:
    """q: [B, T, Nq, D], k/v: [B, T, Nkv, D] -> [B, T, Nq, D] with the configured kernel."""
    if opts.attention == "xla":
        return dot_attention(q, k, v, a.mask, scale, precision)
    if opts.attention == "dot_product_attention":
        return jax.nn.dot_product_attention(q, k, v, mask=a.mask[:, None], scale=scale)
    if opts.attention == "blockwise":
        from jaxrl_term.model.attention import blockwise_attention

        return blockwise_attention(q, k, v, segment_ids=a.segment_ids, scale=scale, block_q=opts.attention_block,
                                   block_k=opts.attention_block)
    # cuDNN flash attention: causal by index, padding by length (rows are right-padded; packing is refused)
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, query_seq_lengths=a.lengths,
                                        key_value_seq_lengths=a.lengths, implementation="cudnn")


def decoder_layer(
    x: jax.Array,
    p: Mapping[str, jax.Array],
    cos: jax.Array,
    sin: jax.Array,
    attn: AttentionInputs,
    cfg: Qwen3Config,
    opts: ModelOptions,
    shard: ShardingCtx,
) -> jax.Array:
    """One pre-norm block: x + attn(norm(x)); x + mlp(norm(x)). x: [B, T, H] in compute dtype."""
    cd, eps = opts.cdtype, cfg.rms_norm_eps
    prec = None if opts.precision == "default" else opts.precision
    # FSDP: this layer's weights, cast to the compute dtype, are gathered over the data axes once here (the
    # parameter keeps its fully sharded layout); sequence-chunked blocks below reuse the gathered copy.
    pc = {k: shard.constrain(v.astype(cd), _gathered_axes(k)) for k, v in p.items()}

    def proj(a: jax.Array, w: jax.Array, spec: str) -> jax.Array:
        """``einsum(spec)`` of activations [B, T, ...] with a weight. ``flat_matmuls``: the batch and time axes
        merged into one token axis first, so every matmul and its two backward matmuls are plain 2-D GEMMs; with
        [B, T] kept apart, XLA:CPU lays the weight gradient's operand out with a 3-D transpose fused into the
        elementwise producer (strided reads: ~20% of the 100M update step on CPU, experiments/results/
        train_step.md). Same numbers either way."""
        if not opts.flat_matmuls:
            return jnp.einsum(spec, a, w, precision=prec)
        lhs, rest = spec.split(",")
        rhs, out = rest.split("->")
        b_, t_ = a.shape[:2]
        y = jnp.einsum(f"s{lhs[2:]},{rhs}->s{out[2:]}", a.reshape(b_ * t_, *a.shape[2:]), w, precision=prec)
        return y.reshape(b_, t_, *y.shape[1:])

    h = rms_norm(x, pc["input_layernorm"], eps)
    q = proj(h, pc["q_proj"], "bth,hnd->btnd")
    k = proj(h, pc["k_proj"], "bth,hnd->btnd")
    v = proj(h, pc["v_proj"], "bth,hnd->btnd")
    q = shard.constrain(q, ("activation_batch", "activation_length", "activation_heads", None))
    k = shard.constrain(k, ("activation_batch", "activation_length", "activation_kv_heads", None))
    q = apply_rope(rms_norm(q, pc["q_norm"], eps), cos, sin)
    k = apply_rope(rms_norm(k, pc["k_norm"], eps), cos, sin)
    o = attend(q, k, v, attn, opts, 1.0 / math.sqrt(cfg.head_dim), prec)
    x = x + proj(o, pc["o_proj"], "btnd,ndh->bth")
    x = shard.constrain(x, ACT)

    def mlp(xc):
        h = rms_norm(xc, pc["post_attention_layernorm"], eps)
        gate = proj(h, pc["gate_proj"], "bth,hi->bti")
        up = proj(h, pc["up_proj"], "bth,hi->bti")
        act = shard.constrain(jax.nn.silu(gate) * up, ("activation_batch", "activation_length", "activation_mlp"))
        return proj(act, pc["down_proj"], "bti,ih->bth")

    x = x + sequence_chunked(mlp, x, opts.mlp_chunk, opts.unroll)
    return shard.constrain(x, ACT)


# Logical axes of one layer's weights once gathered for use: the FSDP axis ("embed") is dropped, tensor
# parallel axes stay (indexing LAYER_PARAMS' shapes without the leading "layers" axis).
_LAYER_AXES = {
    "input_layernorm": ("norm",),
    "q_proj": ("embed", "q_heads", "head_dim"),
    "k_proj": ("embed", "kv_heads", "head_dim"),
    "v_proj": ("embed", "kv_heads", "head_dim"),
    "o_proj": ("q_heads", "head_dim", "embed"),
    "q_norm": ("head_dim",),
    "k_norm": ("head_dim",),
    "post_attention_layernorm": ("norm",),
    "gate_proj": ("embed", "mlp"),
    "up_proj": ("embed", "mlp"),
    "down_proj": ("mlp", "embed"),
}


def _gathered_axes(name: str) -> tuple[str | None, ...]:
    return tuple(None if a == "embed" else a for a in _LAYER_AXES[name])


def sequence_chunked(fn: Callable, x: jax.Array, chunk: int, unroll: bool = False) -> jax.Array:
    """``fn`` applied to sequence chunks of ``x`` [B, T, H] -> [B, T, H'], one chunk alive at a time.

    For token-wise blocks (the MLP): at T = 32k the MLP's [T, intermediate] activations are gigabytes per layer;
    chunks of ``chunk`` tokens bound them, and each chunk is rematerialised in the backward pass. 0 = no chunks.
    """
    b, t = x.shape[:2]
    if not chunk or chunk >= t:
        return fn(x)
    n = -(-t // chunk)
    xp = jnp.pad(x, [(0, 0), (0, n * chunk - t)] + [(0, 0)] * (x.ndim - 2))
    xs = jnp.moveaxis(xp.reshape(b, n, chunk, *x.shape[2:]), 1, 0)
    _, ys = jax.lax.scan(lambda _, xc: (None, jax.checkpoint(fn)(xc)), None, xs, unroll=unroll or 1)
    return jnp.moveaxis(ys, 0, 1).reshape(b, n * chunk, *ys.shape[3:])[:, :t]


# the weights of the cached path's products (separate or fused): what ``matmul_dtype`` applies to
WEIGHT_PRODUCTS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                             "qkv_proj", "gate_up_proj", "qkv_proj_nk", "o_proj_nk", "gate_up_proj_nk", "down_proj_nk"})


def decoder_layer_cached(
    x: jax.Array,
    p: Mapping[str, jax.Array],
    cos: jax.Array,
    sin: jax.Array,
    kc: jax.Array,
    vc: jax.Array,
    layer: jax.Array | int | None,
    rows: jax.Array | None,
    write_pos: jax.Array,
    write_ok: jax.Array,
    attn_len: int,
    cfg: Qwen3Config,
    opts: ModelOptions,
    matmul_dtype: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``decoder_layer`` for generation. x [B, T, H]: new tokens of cache rows ``rows`` [B] at positions
    write_pos + t. Their K/V are scattered into the full caches (``kv_cache_shapes``: kc [L, R, Nkv, D, S],
    vc [L, R, Nkv, S, D]; or one layer's [R, Nkv, D, S] / [R, Nkv, S, D] with ``layer`` None) at (layer, row,
    position) in place (inputs with ``write_ok`` False write nothing); queries attend to cached positions
    < ``attn_len`` up to their own. ``rows`` None: x holds cache rows 0..B-1 in order; with B = R, a per-layer
    cache and ``attn_len`` = S the attention products read the cache buffers themselves. A row gather, layer
    index or length slice is a copy of the attended K/V on every call (XLA on a CPU materialises it): measured,
    0.2 of the tiny model's batch-32 decode step, which takes 0.7 ms with the copies and 0.5 ms without; on the
    100M model the copies took 8.5 of 48 ms, and without them the products, now reading the cache from memory,
    take as long (48 ms). The layouts are the ones the two attention products read without a transpose (keys
    as [D, S] and values as [S, D] per row and head): with the position-major layout [R, S, Nkv, D], XLA on a
    CPU transposed a copy of every layer's attended K and V on each decode step, 15% of a 100M model's step at
    batch 32. ``p`` may hold fused ``qkv_proj`` [H, (Nq + 2 Nkv) D],
    ``gate_up_proj`` [H, 2 I] and a flat ``o_proj`` [Nq D, H] (``fuse_projections``) instead of the separate
    weights. ``matmul_dtype`` (e.g. bfloat16): the weight products take their inputs in that dtype and accumulate
    in fp32 (``weight_product``); norms, rope, attention (and its cache) and the residual stay in the compute
    dtype (measured on a CPU: a bf16 cache, or bf16 attention products, made the 100M decode step 4x slower)."""
    cd, eps = opts.cdtype, cfg.rms_norm_eps
    pc = {k: v if matmul_dtype is not None and k in WEIGHT_PRODUCTS else v.astype(cd) for k, v in p.items()}

    def mm(spec, a, w):
        return weight_product(spec, a, w, matmul_dtype)

    def fused(name, spec, a):  # a fused 2-D product weight, stored [K, N] under name or [N, K] under name_nk
        if name + "_nk" in pc:
            return weight_product_nk(a, pc[name + "_nk"], matmul_dtype)
        return mm(spec, a, pc[name])

    b, t, _ = x.shape
    nq, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    h = rms_norm(x, pc["input_layernorm"], eps)
    if "qkv_proj" in pc or "qkv_proj_nk" in pc:  # fused (fuse_projections): one matmul for q, k and v
        qkv = fused("qkv_proj", "bth,hf->btf", h)
        q = qkv[..., : nq * d].reshape(b, t, nq, d)
        k = qkv[..., nq * d: (nq + nkv) * d].reshape(b, t, nkv, d)
        v = qkv[..., (nq + nkv) * d:].reshape(b, t, nkv, d)
    else:
        q = mm("bth,hnd->btnd", h, pc["q_proj"])
        k = mm("bth,hnd->btnd", h, pc["k_proj"])
        v = mm("bth,hnd->btnd", h, pc["v_proj"])
    q = apply_rope(rms_norm(q, pc["q_norm"], eps), cos, sin)
    k = apply_rope(rms_norm(k, pc["k_norm"], eps), cos, sin)
    qpos = write_pos[:, None] + jnp.arange(t)[None, :]  # [B, T]
    # out-of-range positions are dropped by the scatter: that is how inactive rows write nothing
    s_len = kc.shape[-1]
    wpos = jnp.where(write_ok[:, None], qpos, s_len)[:, None, :]  # [B, 1, T]
    r3, h3 = (jnp.arange(b) if rows is None else rows)[:, None, None], jnp.arange(nkv)[None, :, None]
    lead = () if layer is None else (layer,)
    # index (layer, row, head, :, pos) -> [B, Nkv, T, D]: the updates in the same order for both caches
    kc = kc.at[(*lead, r3, h3, slice(None), wpos)].set(jnp.swapaxes(k, 1, 2).astype(kc.dtype), mode="drop")
    vc = vc.at[(*lead, r3, h3, wpos)].set(jnp.swapaxes(v, 1, 2).astype(vc.dtype), mode="drop")

    def attended(c, s_axis):  # this layer's rows, positions < attn_len
        if layer is not None:
            c = jax.lax.dynamic_index_in_dim(c, layer, 0, keepdims=False)
        if rows is not None:
            c = c[rows]
        elif c.shape[0] != b:  # rows 0..B-1 of a larger cache
            c = c[:b]
        if attn_len < s_len:
            c = jax.lax.slice_in_dim(c, 0, attn_len, axis=s_axis)
        return c.astype(cd)

    keys, vals = attended(kc, 3), attended(vc, 2)
    g = nq // nkv
    # [B, Nkv, G*T, D]: batch dimensions leading, so both products are plain batched matmuls (XLA's CPU backend
    # sends other dimension orders to a generic dot several times slower)
    qg = jnp.transpose(q.reshape(b, t, nkv, g, d), (0, 2, 3, 1, 4)).reshape(b, nkv, g * t, d)
    sc = jnp.einsum("bkmd,bkds->bkms", qg, keys, preferred_element_type=jnp.float32) / math.sqrt(d)
    mask = jnp.arange(attn_len)[None, :] <= jnp.tile(qpos, (1, g))[:, :, None]  # [B, G*T, S], g-major rows
    sc = jnp.where(mask[:, None], sc, jnp.finfo(jnp.float32).min)  # as dot_attention
    pr = jax.nn.softmax(sc, axis=-1).astype(vals.dtype)
    o = jnp.einsum("bkms,bksd->bkmd", pr, vals).reshape(b, nkv, g, t, d)
    o = jnp.transpose(o, (0, 3, 1, 2, 4)).reshape(b, t, nq * d)
    if "o_proj_nk" in pc or pc["o_proj"].ndim == 2:  # flat (fuse_projections)
        x = x + fused("o_proj", "btf,fh->bth", o)
    else:
        x = x + mm("btf,fh->bth", o, pc["o_proj"].reshape(nq * d, -1))
    h = rms_norm(x, pc["post_attention_layernorm"], eps)
    if "gate_up_proj" in pc or "gate_up_proj_nk" in pc:
        gu = fused("gate_up_proj", "bth,hi->bti", h)
        act = jax.nn.silu(gu[..., : cfg.intermediate_size]) * gu[..., cfg.intermediate_size:]
    else:
        act = jax.nn.silu(mm("bth,hi->bti", h, pc["gate_proj"])) * mm("bth,hi->bti", h, pc["up_proj"])
    return x + fused("down_proj", "bti,ih->bth", act), kc, vc


def forward_cached_layers(
    cfg: Qwen3Config,
    opts: ModelOptions,
    embed: jax.Array,
    norm: jax.Array,
    layers: Mapping[str, jax.Array] | Sequence[Mapping[str, jax.Array]],
    input_ids: jax.Array,
    write_pos: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    write_ok: jax.Array | None = None,
    attn_len: int | None = None,
    rows: jax.Array | None = None,
    matmul_dtype: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array] | tuple[jax.Array, list[jax.Array], list[jax.Array]]:
    """``Qwen3.forward_cached`` on explicit weights. ``layers``: the stacked dict (a scan over layers), or one
    dict per layer (the loop unrolled: no per-layer slice of stacked weights, which XLA on a CPU copies out of
    the stack on every call, the whole model's weights per decode step). With per-layer weights the caches may
    be per-layer too (lists of [R, ...] arrays, returned as lists). ``rows`` None: the batch is every cache row
    in order (see ``decoder_layer_cached``)."""
    b, t = input_ids.shape
    if write_ok is None:
        write_ok = jnp.ones((b,), bool)
    per_layer = isinstance(k_cache, (list, tuple))
    attn_len = attn_len or (k_cache[0] if per_layer else k_cache).shape[-1]
    positions = write_pos[:, None] + jnp.arange(t)[None, :]
    x = jnp.take(embed, input_ids, axis=0).astype(opts.cdtype)
    cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta, opts.cdtype, cfg.rope_scaling)

    def layer(x, kc, vc, p, i):
        return decoder_layer_cached(x, p, cos, sin, kc, vc, i, rows, write_pos, write_ok, attn_len, cfg, opts,
                                    matmul_dtype)

    if isinstance(layers, Mapping):
        if per_layer:
            raise ValueError("per-layer K/V caches need per-layer weights (a list of layer dicts)")

        def body(carry, xs):
            return layer(*carry, *xs), None

        idx = jnp.arange(cfg.num_hidden_layers)
        (x, k_cache, v_cache), _ = jax.lax.scan(body, (x, k_cache, v_cache), (layers, idx))
    elif per_layer:
        k_cache, v_cache = list(k_cache), list(v_cache)
        for i, p in enumerate(layers):
            x, k_cache[i], v_cache[i] = layer(x, k_cache[i], v_cache[i], p, None)
    else:
        for i, p in enumerate(layers):
            x, k_cache, v_cache = layer(x, k_cache, v_cache, p, i)
    return rms_norm(x, norm, cfg.rms_norm_eps), k_cache, v_cache


def fuse_projections(p: Mapping[str, jax.Array], out_major: bool = False) -> dict[str, jax.Array]:
    """One layer's weights with q/k/v and gate/up concatenated (two matmuls instead of five: on a CPU a decode
    step's small matmuls are dominated by per-kernel cost, not arithmetic), and ``o_proj`` flattened to
    [Nq D, H] once (reshaped inside the program, XLA on a CPU copied it on every decode step). ``out_major``:
    the four 2-D product weights stored [N, K] (output features first, torch's Linear layout) under
    ``qkv_proj_nk``, ``o_proj_nk``, ``gate_up_proj_nk`` and ``down_proj_nk``, for ``weight_product_nk``."""
    out = {k: v for k, v in p.items() if k not in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")}
    h = p["q_proj"].shape[0]
    out["o_proj"] = p["o_proj"].reshape(-1, p["o_proj"].shape[-1])
    out["qkv_proj"] = jnp.concatenate([p[n].reshape(h, -1) for n in ("q_proj", "k_proj", "v_proj")], axis=1)
    out["gate_up_proj"] = jnp.concatenate([p["gate_proj"], p["up_proj"]], axis=1)
    if out_major:
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            out[name + "_nk"] = jnp.transpose(out.pop(name)).copy()
    return out


def weight_product(spec: str, a: jax.Array, w: jax.Array, matmul_dtype: str | None) -> jax.Array:
    """``einsum(spec, a, w)``; with ``matmul_dtype`` both inputs in that dtype and the sum in fp32, returned in
    ``a``'s dtype. On a CPU with AMX (Sapphire Rapids) XLA runs bf16 x bf16 -> fp32 products through oneDNN at
    about 4x its fp32 GEMM (bf16 -> bf16 products are slower than fp32 there); on a GPU it is the usual bf16
    tensor-core product."""
    if matmul_dtype is None:
        return jnp.einsum(spec, a, w)
    return jnp.einsum(spec, a.astype(matmul_dtype), w.astype(matmul_dtype),
                      preferred_element_type=jnp.float32).astype(a.dtype)


def weight_product_nk(a: jax.Array, w: jax.Array, matmul_dtype: str | None, precision=None) -> jax.Array:
    """``a`` [..., K] times the weight ``w`` stored [N, K] (output features first), computed with the weight on
    the left, w @ a^T ([N, M], then transposed: M = the rows of ``a``). For the few rows of a decode step XLA's
    CPU GEMM (YNNPACK) runs this about 2x faster than a @ w with w stored [K, N] (measured, K = 768, N = 4096,
    12 distinct weights: bf16 3.2 against 6.4 ms at M = 32, 2.6 against 5.0 ms at M = 8; fp32 14 against 31 ms
    at M = 32) and as fast at M = 2048 (a prefill). ``matmul_dtype`` as in ``weight_product``."""
    lead, rows = a.shape[:-1], a.reshape(-1, a.shape[-1])
    if matmul_dtype is None:
        out = jnp.einsum("nk,mk->nm", w.astype(a.dtype), rows, precision=precision)
    else:
        out = jnp.einsum("nk,mk->nm", w.astype(matmul_dtype), rows.astype(matmul_dtype),
                         preferred_element_type=jnp.float32)
    return jnp.transpose(out).reshape(*lead, w.shape[0]).astype(a.dtype)


def lm_logits(hidden: jax.Array, w: jax.Array, fp32: bool, matmul_dtype: str | None = None,
              out_major: bool = False) -> jax.Array:
    """[B, T, H] @ [H, V]: fp32 (HIGHEST precision matmul on fp32-cast inputs) when ``fp32`` (it wins over
    ``matmul_dtype``, as SGLang's --enable-fp32-lm-head over bf16 weights); else with ``matmul_dtype``, inputs in
    that dtype and fp32 logits (``weight_product``). ``out_major``: ``w`` is [V, H] (a tied embedding as it is),
    multiplied from the left (``weight_product_nk``)."""
    if fp32:
        if out_major:
            return weight_product_nk(hidden.astype(jnp.float32), w, None, precision=jax.lax.Precision.HIGHEST)
        return jnp.einsum("bth,hv->btv", hidden.astype(jnp.float32), w.astype(jnp.float32),
                          precision=jax.lax.Precision.HIGHEST)
    if out_major:
        return weight_product_nk(hidden, w, matmul_dtype).astype(jnp.float32 if matmul_dtype else hidden.dtype)
    if matmul_dtype is not None:
        return weight_product("bth,hv->btv", hidden, w, matmul_dtype).astype(jnp.float32)
    return jnp.einsum("bth,hv->btv", hidden, w.astype(hidden.dtype))


class Qwen3(nnx.Module):
    """Qwen3ForCausalLM. ``model(input_ids [B,T] int32, attention_mask [B,T]) -> logits [B,T,V]``."""

    def __init__(
        self,
        cfg: Qwen3Config,
        options: ModelOptions | None = None,
        *,
        rngs: nnx.Rngs,
        shard: ShardingCtx | None = None,
    ):
        opts = options or ModelOptions()
        self.config = cfg
        self.options = opts
        self.shard = shard or ShardingCtx()
        self.embed_tokens = nnx.Param(
            _normal(rngs, (cfg.vocab_size, cfg.hidden_size), opts.pdtype), logical_axes=("vocab", "embed")
        )
        self.layers = DecoderLayers(cfg, opts, rngs=rngs)
        self.norm = nnx.Param(jnp.ones((cfg.hidden_size,), opts.pdtype), logical_axes=("norm",))
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Param(
                _normal(rngs, (cfg.hidden_size, cfg.vocab_size), opts.pdtype), logical_axes=("embed", "vocab")
            )
        else:
            self.lm_head = None

    # -- body -------------------------------------------------------------------------------------
    def hidden_states(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        """Final-normed hidden states [B, T, H] in compute dtype.

        ``positions`` default to ``cumsum(attention_mask) - 1`` (correct for left and right padding);
        ``segment_ids`` restrict attention to equal ids (sequence packing).
        """
        cfg, opts = self.config, self.options
        if attention_mask is None:
            attention_mask = jnp.ones(input_ids.shape, jnp.int32)
        if positions is None:
            positions = jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1, 0)
        attn = attention_inputs(attention_mask, segment_ids, opts.attention)
        x = embed_lookup(self.embed_tokens[...], input_ids, self.shard).astype(opts.cdtype)
        x = self.shard.constrain(x, ACT)
        cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta, opts.cdtype, cfg.rope_scaling)

        ctx = (cos, sin, attn)

        def layer(x, p, ctx):
            return decoder_layer(x, p, *ctx, cfg, opts, self.shard)

        if opts.remat == "full":
            layer = remat_saving_bits(layer)
        elif opts.remat != "none":
            layer = jax.checkpoint(layer, policy=REMAT_POLICIES[opts.remat], prevent_cse=False)
        stacked, unroll = self.layers.stacked(), (opts.unroll or not opts.scan_layers) or 1

        def layers(x, ps, ctx):
            return jax.lax.scan(lambda c, p: (layer(c, p, ctx), None), x, ps, unroll=unroll)[0]

        groups = opts.remat_groups
        if groups >= 1:
            # Nested remat: the outer scan saves only each group's input; a group's backward recomputes its
            # forward, saving its L/G layer inputs, and each layer's backward recomputes the layer.
            if cfg.num_hidden_layers % groups:
                raise ModelConfigError(f"model.remat_groups={groups} must divide num_hidden_layers "
                                       f"({cfg.num_hidden_layers})")
            grouped = jax.tree.map(lambda a: a.reshape(groups, a.shape[0] // groups, *a.shape[1:]), stacked)
            group = remat_saving_bits(layers)
            x = jax.lax.scan(lambda c, gp: (group(c, gp, ctx), None), x, grouped, unroll=unroll)[0]
        else:
            x = layers(x, stacked, ctx)
        return rms_norm(x, self.norm[...], cfg.rms_norm_eps)

    # -- head -------------------------------------------------------------------------------------
    def head_weight(self) -> jax.Array:
        """[H, V] (the transposed embedding when tied)."""
        return self.embed_tokens[...].T if self.lm_head is None else self.lm_head[...]

    def logits(self, hidden: jax.Array) -> jax.Array:
        """[B, T, H] -> [B, T, V]; fp32 (HIGHEST precision matmul on fp32-cast inputs) when lm_head_fp32."""
        out = lm_logits(hidden, self.head_weight(), self.options.lm_head_fp32)
        return self.shard.constrain(out, ("activation_batch", "activation_length", "activation_vocab"))

    def lm_head_map(self, hidden: jax.Array, fn: Callable, *xs: jax.Array, chunk: int | None = None):
        """Apply ``fn(logits [B,C,V], *x_chunks)`` over sequence chunks of C tokens; outputs join along T.

        Only one [B, C, V] block of logits exists at a time, and it is recomputed in the backward pass
        (``jax.checkpoint``), so a 151k vocabulary never materialises [B, T, V]. ``xs`` are [B, T, ...]
        arrays chunked alongside (e.g. target ids); ``fn`` returns a pytree of [B, C, ...] arrays.
        """
        chunk = self.options.logits_chunk if chunk is None else chunk
        b, t, _ = hidden.shape
        if not chunk or chunk >= t:
            return fn(self.logits(hidden), *xs)
        n = -(-t // chunk)
        pad = n * chunk - t

        def split(a):
            a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
            return jnp.moveaxis(a.reshape(b, n, chunk, *a.shape[2:]), 1, 0)

        @jax.checkpoint
        def body(_, inp):
            h, rest = inp
            return None, fn(self.logits(h), *rest)

        _, ys = jax.lax.scan(body, None, (split(hidden), tuple(split(x) for x in xs)),
                             unroll=self.options.unroll or 1)
        return jax.tree.map(lambda y: jnp.moveaxis(y, 0, 1).reshape(b, n * chunk, *y.shape[3:])[:, :t], ys)

    def forward_cached(
        self,
        input_ids: jax.Array,
        write_pos: jax.Array,
        k_cache: jax.Array,
        v_cache: jax.Array,
        write_ok: jax.Array | None = None,
        attn_len: int | None = None,
        rows: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Run new tokens against a KV cache (prefill chunks and decode steps).

        input_ids: [B, T] for cache rows ``rows`` [B] (default 0..B-1) at positions ``write_pos[b] + t``;
        k_cache [L, R, Nkv, D, S] / v_cache [L, R, Nkv, S, D] (``kv_cache_shapes``), updated in place (donate
        them). Only cache positions < ``attn_len``
        (static; default S) are attended. Inputs with ``write_ok`` False leave the cache untouched.
        Returns final-normed hidden [B, T, H] and the caches.
        """
        return forward_cached_layers(self.config, self.options, self.embed_tokens[...], self.norm[...],
                                     self.layers.stacked(), input_ids, write_pos, k_cache, v_cache, write_ok,
                                     attn_len, rows)

    def kv_cache_shapes(self, batch: int, length: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(K cache [L, R, Nkv, D, S], V cache [L, R, Nkv, S, D]) for ``batch`` rows of ``length`` positions: each
        in the layout its attention product reads (see ``decoder_layer_cached``)."""
        c = self.config
        lead = (c.num_hidden_layers, batch, c.num_key_value_heads)
        return lead + (c.head_dim, length), lead + (length, c.head_dim)

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        return self.logits(self.hidden_states(input_ids, attention_mask, positions, segment_ids))



def create_model(
    cfg: Qwen3Config,
    options: ModelOptions | None = None,
    *,
    seed: int = 0,
    shard: ShardingCtx | None = None,
) -> Qwen3:
    """A randomly initialised model; with a mesh, each parameter is created directly in its sharding."""
    shard = shard or ShardingCtx()
    if shard.mesh is None:
        return Qwen3(cfg, options, rngs=nnx.Rngs(seed), shard=shard)
    from jaxrl_term.parallel.mesh import state_shardings

    abstract = nnx.eval_shape(lambda: Qwen3(cfg, options, rngs=nnx.Rngs(seed), shard=shard))
    graphdef, state = nnx.split(abstract)
    shardings = state_shardings(state, shard)

    def init():
        return nnx.state(Qwen3(cfg, options, rngs=nnx.Rngs(seed), shard=shard))

    state = jax.jit(init, out_shardings=shardings)()
    return nnx.merge(graphdef, state)
