"""The embedded rollout engine: the policy's own nnx model, a KV cache, continuous batching.

One engine thread owns the device work. ``generate`` calls (from any asyncio task) queue requests; the
thread admits them into free cache slots as soon as one frees up (prefilling only the part of the prompt a
slot does not already hold: the turns of one episode share their prefix), runs one jitted decode step for
every active slot, and resolves each request when it stops. Shapes are bucketed (prefill chunk length,
attended cache length) so a handful of programs are compiled. The per-layer caches follow the attended length
(grown and shrunk by power-of-two buckets, never below a prefix a free slot keeps for reuse), so a full-width
decode step reads them in place instead of copying out the attended rows and positions. Sampling: temperature,
top-p, top-k, a per-request seed (a request's randomness does not depend on what it is batched with); the
log-prob of each sampled token is the fp32 log-softmax of logits / temperature, what the trainer recomputes.

Pause modes follow SGLang's ``/pause_generation`` (>= 0.5.6): ``abort`` ends every request (running, waiting
and queued) with finish ``abort``; ``in_place`` keeps running requests in their slots with their K/V;
``retract`` frees their slots and puts them back at the head of the waiting list, so after ``resume`` they are
prefilled again (prompt + the tokens generated so far) under whatever weights are then loaded. ``pause``
returns once the engine thread has done this.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_term.model.qwen3 import WEIGHT_PRODUCTS, forward_cached_layers, fuse_projections, lm_logits
from jaxrl_term.rollout.engine import EngineError, Generation, SamplingParams

log = logging.getLogger(__name__)
PAUSE_MODES = ("abort", "in_place", "retract")
MATMUL_DTYPES = (None, "bfloat16")  # the measured and tested modes of JaxEngineConfig.matmul_dtype
TOP_WINDOW = 64  # the largest logits where top-k / top-p look for their cut first (truncation_mask)


@dataclasses.dataclass(frozen=True)
class JaxEngineConfig:
    max_batch: int = 16  # cache slots = sequences decoded together
    max_seq_len: int = 4096  # per slot (prompt + output)
    prefill_chunk: int = 512  # longest prefill piece (longer prompts go in several)
    min_bucket: int = 64  # smallest attended-length bucket
    param_dtype: str | None = None  # engine weights; None = as given
    share_params: bool = False  # use live params as they are (no copy): only when the trainer never donates them;
    # with unstack_layers the per-layer arrays are copies anyway (only embed / norm are shared)
    prefix_reuse: bool = True
    contiguous_head: bool = True  # tied embeddings: keep a [H, V] copy for the LM head (+V*H params of memory)
    unstack_layers: bool = True  # one array per layer and weight, the layer loop unrolled (see forward_cached_layers);
    # and one K/V cache per layer, as long as the attended window (JaxEngine._fit_cache), not max_seq_len
    fuse_projections: bool = True  # with unstack_layers: q/k/v and gate/up weights concatenated (2 matmuls, not 5)
    # with unstack_layers and fuse_projections: the product weights (and the LM head) stored [out, in] and multiplied
    # from the left (model.qwen3.weight_product_nk): XLA's CPU GEMM runs a decode step's few rows ~2x faster so
    out_major_weights: bool = True
    decode_steps: int = 16  # decode steps per program call (>= 1): fewer dispatches; a request that stops early
    # waits for the call to end (up to n - 1 steps computed for nothing in its row)
    deterministic: bool = False  # fixed shapes, no prefix reuse: samples independent of batching (slower)
    # bfloat16: the weight products (layers, and the LM head unless model.options.lm_head_fp32) take bf16 inputs and
    # accumulate in fp32, the weights kept in bf16; norms, attention, sampling and log-probs stay fp32. What an
    # SGLang server does on a GPU (bf16 weights), and about 4x XLA's fp32 GEMM on a CPU with AMX. The log-probs then
    # differ from the trainer's fp32 recomputation (train/logp_gap_*; DPPO's ratio and TIS are built for that
    # mismatch). None: as the model computes.
    matmul_dtype: str | None = None

    def __post_init__(self):
        if self.out_major_weights and not (self.unstack_layers and self.fuse_projections):
            raise ValueError("JaxEngineConfig.out_major_weights needs unstack_layers and fuse_projections (it lays "
                             "out the fused per-layer weights); set out_major_weights=False with either off")
        if self.matmul_dtype not in MATMUL_DTYPES:
            raise ValueError(f"rollout.jax.matmul_dtype={self.matmul_dtype!r}; use null (the model's compute dtype) or "
                             f"one of {[d for d in MATMUL_DTYPES if d]}")


def _bucket(n: int, lo: int, hi: int) -> int:
    b = lo
    while b < n:
        b *= 2
    return min(b, hi)


def _cache_len(kc) -> int:
    return (kc[0] if isinstance(kc, list) else kc).shape[-1]


@functools.partial(jax.jit, static_argnames=("size",))
def _resize(k, v, *, size: int):
    """One layer's K [R, Nkv, D, S] and V [R, Nkv, S, D] with ``size`` positions: the first ``size`` of S (a
    shrink) or S then zeros (a growth)."""
    def fit(c, axis):
        n = c.shape[axis]
        if size <= n:
            return jax.lax.slice_in_dim(c, 0, size, axis=axis)
        pad = [(0, 0)] * c.ndim
        pad[axis] = (0, size - n)
        return jnp.pad(c, pad)

    return fit(k, 3), fit(v, 2)


def _cast_products(p: dict[str, Any], dtype: str) -> dict[str, Any]:
    return {k: v.astype(dtype) if k in WEIGHT_PRODUCTS else v for k, v in p.items()}


def _hidden(w, kc, vc, ids, pos, write_ok, rows, attn_len, cfg, opts, mm):
    return forward_cached_layers(cfg, opts, w["embed"], w["norm"], w["layers"], ids, pos, kc, vc, write_ok,
                                 attn_len, rows, matmul_dtype=mm)


def _logits(w, h, opts, mm):
    if w.get("head_nk") is not None:  # [V, H] (out_major_weights)
        return lm_logits(h, w["head_nk"], opts.lm_head_fp32, matmul_dtype=mm, out_major=True)
    head = w["embed"].T if w["head"] is None else w["head"]
    return lm_logits(h, head, opts.lm_head_fp32, matmul_dtype=mm)


@functools.partial(jax.jit, static_argnames=("cfg", "opts", "attn_len", "mm"), donate_argnames=("kc", "vc"))
def _prefill(w, kc, vc, ids, rows, start, n_valid, write_ok, *, cfg, opts, attn_len: int, mm: str | None = None):
    """Prefill chunks of several requests at once: ids [N, T] for cache rows ``rows`` [N] from positions
    ``start`` [N], ``n_valid`` [N] real tokens each (the rest is padding, written past the row's end and never
    attended before decode overwrites it); the logits after each row's last real token."""
    h, kc, vc = _hidden(w, kc, vc, ids, start, write_ok, rows, attn_len, cfg, opts, mm)
    last = jnp.take_along_axis(h, jnp.maximum(n_valid - 1, 0)[:, None, None], axis=1)
    return _logits(w, last, opts, mm)[:, 0], kc, vc


@functools.partial(jax.jit, static_argnames=("cfg", "opts", "attn_len", "n_steps", "mm", "all_rows"),
                   donate_argnames=("kc", "vc"))
def _decode(w, kc, vc, tokens, pos, active, rows, temps, top_ps, top_ks, seeds, counters, *, cfg, opts,
            attn_len: int, n_steps: int, mm: str | None = None, all_rows: bool = False):
    """``n_steps`` decode steps in one program: each feeds the token it sampled to the next, so Python (and
    the dispatch of a few hundred small kernels) is paid once per ``n_steps`` tokens. Rows keep going after
    their own stop; the caller discards those tokens, and their K/V lie past the row's end (positions past the
    cache are dropped). ``all_rows``: row j of the batch is cache row j, for every cache row (``rows`` is
    ignored; no gather of the attended K/V). Returns tokens [n, B], log-probs [n, B] and the caches."""
    s = _cache_len(kc)
    rows = None if all_rows else rows

    def step(carry, i):
        tok, kc, vc = carry
        p = pos + i
        h, kc, vc = _hidden(w, kc, vc, tok[:, None], p, active & (p < s), rows, attn_len, cfg, opts, mm)
        nxt, lp = sample_tokens(_logits(w, h, opts, mm)[:, 0], temps, top_ps, top_ks, seeds, counters + i)
        return (nxt, kc, vc), (nxt, lp)

    (_, kc, vc), (toks, lps) = jax.lax.scan(step, (tokens, kc, vc), jnp.arange(n_steps, dtype=counters.dtype))
    return toks, lps, kc, vc


def first_true(mask):
    """Index of the first True along the last axis (its length where none): a min-reduce, several times faster
    on a CPU than XLA's argmax over a 150k vocabulary."""
    n = mask.shape[-1]
    return jnp.min(jnp.where(mask, jnp.arange(n, dtype=jnp.int32), n), axis=-1)


def first_max(x, top=None):
    """``argmax`` (the first index of the maximum), as max + min-reduce; a NaN row gives the last index. ``top``:
    the row maxima (keepdims) where the caller already has them."""
    top = jnp.max(x, axis=-1, keepdims=True) if top is None else top
    return jnp.minimum(first_true(x == top), x.shape[-1] - 1)


def inverse_cdf(w, u, block: int = 256):
    """Draw index i with probability w[b, i] / sum(w[b]) given one uniform u[b] in [0, 1) per row.

    One uniform per row instead of one Gumbel per vocabulary entry (which cost more than the rest of a 100M
    model's decode step at batch 32 on a CPU), and the running sum in two levels (blocks, then inside the chosen
    block) rather than one long cumsum. The drawn index always has w > 0: the first entry whose running sum
    exceeds u * total, capped at the last non-zero entry against rounding."""
    b, v = w.shape
    nb = -(-v // block)
    w3 = jnp.pad(w, ((0, 0), (0, nb * block - v))).reshape(b, nb, block)
    bsum = w3.sum(-1)
    bcdf = jnp.cumsum(bsum, axis=-1)
    r = u * bcdf[:, -1]
    last_b = nb - 1 - first_true(bsum[:, ::-1] > 0)
    j = jnp.minimum(jnp.sum(bcdf <= r[:, None], axis=-1), last_b)
    before = jnp.where(j > 0, jnp.take_along_axis(bcdf, jnp.maximum(j - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
    inner = jnp.take_along_axis(w3, j[:, None, None], axis=1)[:, 0]
    last_i = block - 1 - first_true(inner[:, ::-1] > 0)
    i = jnp.minimum(jnp.sum(jnp.cumsum(inner, axis=-1) <= (r - before)[:, None], axis=-1), last_i)
    return j * block + i


@jax.jit
def truncation_mask(z, e, lse, top_ps, top_ks, greedy):
    """Which entries of z [B, V] (logits / T) top-k and top-p keep: the ``top_ks`` largest (<= 0: all), and the
    smallest set of the largest whose probability mass reaches ``top_ps`` (>= 1: all); ties at a cut are kept.
    ``e`` = exp(z - max z) and ``lse`` = logsumexp(z) per row, as ``sample_tokens`` has them; ``greedy`` rows
    are not sampled (any mask does for them).

    Both cuts need the largest logits in order. A full sort of the vocabulary costs 40-1100 ms per decode step
    on a CPU (batch 8-32, 32k-152k entries), so the top TOP_WINDOW come from lax.top_k (25-60x faster than the
    sort) and decide the cut whenever it falls among them: top_k <= TOP_WINDOW, or the top-p mass reached within
    them. When a row's cut lies further out (a flat distribution, a large top_k), every row of that call takes
    the bisection of ``far_cut`` instead (32 passes over the logits, 6-8x faster than the sort)."""
    v = z.shape[-1]
    k = jnp.where(top_ks > 0, jnp.minimum(top_ks, v), v)

    def near_cut(srt):
        """The smallest logit kept per row, from the largest ones in descending order, and the top-p count."""
        pr = jnp.exp(srt - lse[:, None])  # probabilities under the untruncated softmax(z)
        n_p = jnp.maximum(jnp.sum((jnp.cumsum(pr, axis=-1) - pr) < top_ps[:, None], axis=-1), 1)
        thr_k = jnp.take_along_axis(srt, (jnp.minimum(k, srt.shape[-1]) - 1)[:, None], axis=-1)[:, 0]
        thr_p = jnp.take_along_axis(srt, (n_p - 1)[:, None], axis=-1)[:, 0]
        return jnp.maximum(jnp.where(k < v, thr_k, -jnp.inf), jnp.where(top_ps < 1.0, thr_p, -jnp.inf)), n_p

    def far_cut():
        """The mask without sorting: a bisection on the logits' order (their float bits as ordered integers),
        32 halvings of the int32 range, for the top-k cut (count at or above it >= k) and the top-p cut (mass
        at or above it >= top_p) at once."""
        bits = jax.lax.bitcast_convert_type(jnp.where(z == 0, 0.0, z), jnp.int32)  # -0.0 ties with 0.0
        key = jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # ordered like the floats
        total = jnp.sum(e, axis=-1)
        lo0 = jnp.min(key, axis=-1)  # at the lowest key every entry is kept: the invariant holds at the start
        hi0 = jnp.max(key, axis=-1) + 1  # and at one past the highest none is

        def halve(_, c):
            lo_k, hi_k, lo_p, hi_p = c
            mid_k = (lo_k >> 1) + (hi_k >> 1) + (lo_k & hi_k & 1)  # no int32 overflow
            mid_p = (lo_p >> 1) + (hi_p >> 1) + (lo_p & hi_p & 1)
            ok_k = jnp.sum(key >= mid_k[:, None], axis=-1) >= k
            ok_p = jnp.sum(jnp.where(key >= mid_p[:, None], e, 0.0), axis=-1) >= top_ps * total
            return (jnp.where(ok_k, mid_k, lo_k), jnp.where(ok_k, hi_k, mid_k),
                    jnp.where(ok_p, mid_p, lo_p), jnp.where(ok_p, hi_p, mid_p))

        lo_k, _, lo_p, _ = jax.lax.fori_loop(0, 32, halve, (lo0, hi0, lo0, hi0))
        cut = jnp.maximum(jnp.where(k < v, lo_k, lo0), jnp.where(top_ps < 1.0, lo_p, lo0))
        return key >= cut[:, None]

    kw = min(v, TOP_WINDOW)
    thr, n_p = near_cut(jax.lax.top_k(z, kw)[0])
    decided = (k <= kw) | ((top_ps < 1.0) & (n_p < kw)) | ((top_ps >= 1.0) & (k >= v)) | greedy
    return jax.lax.cond(jnp.all(decided), lambda: z >= thr[:, None], far_cut)


@jax.jit
def sample_tokens(logits, temps, top_ps, top_ks, seeds, counters):
    """logits [B, V] -> (tokens [B] int32, log-probs [B] fp32). temperature 0 = greedy (log-prob at T = 1).
    Top-k / top-p truncate what is sampled; the log-prob is under the untruncated softmax(logits / T).

    One max and one exp over the vocabulary serve the greedy pick, the draw and the log-prob (the sampler read its
    [B, V] logits seven times per decode step before: 1.3x its time at batch 8, V = 32k), and top-k / top-p sort
    only the largest TOP_WINDOW logits when the cut falls among them (``truncation_mask``)."""
    logits = logits.astype(jnp.float32)
    greedy = temps <= 0
    z = logits / jnp.where(greedy, 1.0, temps)[:, None]  # greedy rows: z is the logits
    top = jnp.max(z, axis=-1, keepdims=True)
    e = jnp.exp(z - top)
    lse = top[:, 0] + jnp.log(jnp.sum(e, axis=-1))

    needs = jnp.any((top_ps < 1.0) | (top_ks > 0))
    e_s = jax.lax.cond(needs, lambda: jnp.where(truncation_mask(z, e, lse, top_ps, top_ks, greedy), e, 0.0),
                       lambda: e)
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.PRNGKey(s), c))(seeds, counters)
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)
    sampled = inverse_cdf(e_s, u)
    tokens = jnp.where(greedy, first_max(z, top), sampled).astype(jnp.int32)
    logp = jnp.take_along_axis(z, tokens[:, None], axis=-1)[:, 0] - lse
    return tokens, logp


@dataclasses.dataclass
class _Request:
    ids: list[int]
    sampling: SamplingParams
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    seed: int
    t_submit: float
    out: list[int] = dataclasses.field(default_factory=list)
    lps: list[float] = dataclasses.field(default_factory=list)
    cached: int = 0
    t_first: float | None = None
    version: int | None = None  # the weights' version when its first token was computed


class JaxEngine:
    """``RolloutEngine`` on an nnx ``Qwen3`` in this process."""

    def __init__(self, model, tokenizer=None, config: JaxEngineConfig | None = None, *, weight_version: int = 0):
        self.cfg = config or JaxEngineConfig()
        self.tok = tokenizer
        params = nnx.to_pure_dict(nnx.state(model))
        self.model_cfg, self.options = model.config, model.options
        self.tied = model.lm_head is None
        self._treedef = jax.tree.structure(params)
        self._shapes = [x.shape for x in jax.tree.leaves(params)]
        # its own copy from the start (unless share_params): the trainer that built it from its live params
        # donates them in its first update while the next step's rollouts still decode with these
        self.w = self._weights(params)
        b, s = self.cfg.max_batch, self.cfg.max_seq_len
        cache_dtype = model.options.cdtype
        # per-layer weights get per-layer caches of a resizable length (``_fit_cache``): as long as the attended
        # window, so a decode step over every row attends the cache buffers themselves (no copy of them); the
        # stacked path keeps one [L, ...] cache of max_seq_len positions
        self.resizable = self.cfg.unstack_layers
        if self.resizable:
            s = s if self.cfg.deterministic else min(self.cfg.min_bucket, s)
            k_shape, v_shape = model.kv_cache_shapes(b, s)
            self.kc = [jnp.zeros(k_shape[1:], cache_dtype) for _ in range(k_shape[0])]
            self.vc = [jnp.zeros(v_shape[1:], cache_dtype) for _ in range(v_shape[0])]
        else:
            k_shape, v_shape = model.kv_cache_shapes(b, s)
            self.kc, self.vc = jnp.zeros(k_shape, cache_dtype), jnp.zeros(v_shape, cache_dtype)
        self.weight_version = weight_version
        self.slots: list[_Request | None] = [None] * b
        self.slot_cache: list[list[int]] = [[] for _ in range(b)]  # tokens whose K/V a free slot still holds
        self._queue: queue.Queue[_Request] = queue.Queue()
        self._waiting: list[_Request] = []
        self._lock = threading.Lock()
        self._pending: tuple[Any, int] | None = None
        self._control: queue.Queue[tuple[str, threading.Event]] = queue.Queue()  # pause requests for the thread
        self._paused = threading.Event()
        self._stop = threading.Event()
        self._seed_counter = 0
        self.stats = {"prefill_tokens": 0, "reused_tokens": 0, "decode_steps": 0, "generated": 0, "cache_resizes": 0}
        self._thread = threading.Thread(target=self._run, name="jax-engine", daemon=True)
        self._thread.start()

    # -- weights ----------------------------------------------------------------------------------
    def _prepare(self, params, copy: bool = True):
        """The engine's own copy (cast to ``param_dtype``), finished before returning: the trainer may donate
        its buffers in the very next step."""
        dtype = self.cfg.param_dtype
        if dtype is not None:
            return jax.block_until_ready(jax.tree.map(lambda x: jnp.asarray(x, dtype).copy(), params))
        if copy and not self.cfg.share_params:
            return jax.block_until_ready(jax.tree.map(jnp.copy, params))
        return params

    def _weights(self, params, copy: bool = True) -> dict[str, Any]:
        """The weights as the engine's programs take them: ``embed``, ``norm``, ``head`` [H, V] (the model's
        lm_head; for tied embeddings the transpose kept contiguous when ``contiguous_head``: ``embed.T`` in
        the program transposes [V, H] on every decode step, 2x the head's time at V = 32k on a CPU; else None),
        or instead ``head_nk`` [V, H] with ``out_major_weights`` (the tied embedding itself, no copy, unless the
        head is cast to ``matmul_dtype``), and ``layers`` (one dict per layer when ``unstack_layers``, else the
        stacked dict)."""
        params = self._prepare(params, copy=copy)
        layers = params["layers"]
        if self.cfg.unstack_layers:
            n = self.model_cfg.num_hidden_layers
            layers = [jax.tree.map(lambda x, i=i: x[i], layers) for i in range(n)]
            if self.cfg.fuse_projections:
                layers = [fuse_projections(p, out_major=self.cfg.out_major_weights) for p in layers]
        head, head_nk = None, None
        if self.cfg.out_major_weights:  # [V, H]: a tied embedding as it is
            head_nk = params["embed_tokens"] if self.tied else jnp.transpose(params["lm_head"]).copy()
        elif not self.tied:
            head = params["lm_head"]
        elif self.cfg.contiguous_head:
            head = jnp.transpose(params["embed_tokens"]).copy()
        mm = self.cfg.matmul_dtype
        if mm is not None:  # the product weights stored in the product dtype (half the bytes each step reads)
            cast = functools.partial(_cast_products, dtype=mm)
            layers = [cast(p) for p in layers] if isinstance(layers, list) else cast(layers)
            if not self.options.lm_head_fp32:  # an fp32 LM head keeps fp32 weights
                head = None if head is None else head.astype(mm)
                head_nk = None if head_nk is None else head_nk.astype(mm)
        return jax.block_until_ready({"embed": params["embed_tokens"], "norm": params["norm"], "head": head,
                                      "head_nk": head_nk, "layers": layers})

    async def update_weights(self, source: Any, version: int) -> None:
        """``source``: an HF directory, or a pure dict of params with the model's structure. The new weights
        replace the old between two decode steps; on any error the old ones keep serving."""
        try:
            if isinstance(source, (str, bytes)) or hasattr(source, "__fspath__"):
                from jaxrl_term.model.hf import load_pretrained

                loaded = await asyncio.to_thread(load_pretrained, source, param_dtype=self.options.param_dtype,
                                                 compute_dtype=self.options.compute_dtype, options=self.options)
                params = nnx.to_pure_dict(nnx.state(loaded))
            else:
                params = source
            if jax.tree.structure(params) != self._treedef:
                raise EngineError("update_weights: the params do not have this model's structure", retryable=False)
            for a, shape in zip(jax.tree.leaves(params), self._shapes):
                if a.shape != shape:
                    raise EngineError(f"update_weights: shape {a.shape} != {shape}", retryable=False)
            w = await asyncio.to_thread(self._weights, params)
        except EngineError:
            raise
        except Exception as e:  # noqa: BLE001 - a failed load keeps the previous weights serving
            raise EngineError(f"update_weights failed, version {self.weight_version} keeps serving: {e}",
                              retryable=False) from e
        with self._lock:
            self._pending = (w, version)
        # Only the engine thread swaps the weights, between two of its own steps (here, the event loop could swap
        # them in the middle of a prefill and mix two policies in one turn). It does so as soon as nothing is
        # running or the engine is paused; new requests wait meanwhile, as in SGLang's update without a pause.
        while self._pending is not None and self._thread.is_alive():
            await asyncio.sleep(0.002)

    def _apply_pending(self) -> None:
        with self._lock:
            if self._pending is None:
                return
            self.w, self.weight_version = self._pending
            self._pending = None
            self.slot_cache = [[] for _ in self.slot_cache]  # cached K/V came from the old weights

    async def health(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    @property
    def pending_update(self) -> bool:
        """New weights are loaded but wait for the running requests to finish (not paused)."""
        return self._pending is not None

    def request_counts(self) -> tuple[int, int]:
        """(running: requests holding a slot, waiting: requests queued for one)."""
        return sum(r is not None for r in self.slots), len(self._waiting) + self._queue.qsize()

    def pause(self, mode: str = "in_place", timeout_s: float = 60.0) -> None:
        """Stop decoding; ``mode`` (SGLang's): ``in_place`` holds running requests where they are, ``abort``
        ends every request with finish ``abort``, ``retract`` frees their slots and requeues them. Returns when
        the engine thread has done it. New requests queue until ``resume``."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r}; use one of {PAUSE_MODES}")
        done = threading.Event()
        self._control.put((mode, done))
        self._paused.set()
        if threading.current_thread() is not self._thread and self._thread.is_alive():
            if not done.wait(timeout_s):
                raise EngineError(f"pause({mode!r}): the engine thread did not answer within {timeout_s:.0f}s")

    def abort_all(self, timeout_s: float = 60.0) -> None:
        """End every request with finish ``abort`` without pausing (SGLang's ``abort_all_requests``)."""
        was_paused = self._paused.is_set()
        self.pause("abort", timeout_s)
        if not was_paused:
            self.resume()

    def resume(self) -> None:
        self._paused.clear()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    # -- requests ---------------------------------------------------------------------------------
    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, *, session: str | None = None
                       ) -> Generation:
        ids = [int(x) for x in input_ids]
        if not ids:
            raise EngineError("empty prompt", retryable=False)
        if len(ids) >= self.cfg.max_seq_len - 1:
            raise EngineError(f"prompt of {len(ids)} tokens does not fit the engine's {self.cfg.max_seq_len}-token "
                              "cache; raise rollout.jax.max_seq_len or lower the context", retryable=False)
        if self._stop.is_set():
            raise EngineError("engine is closed")
        loop = asyncio.get_running_loop()
        if sampling.seed is not None:
            seed = sampling.seed
        else:
            self._seed_counter += 1
            seed = (self._seed_counter * 2654435761) % 2**31
        req = _Request(ids, sampling, loop.create_future(), loop, seed, time.monotonic())
        self._queue.put(req)
        return await req.future

    def _finish(self, req: _Request, reason: str, matched=None) -> None:
        # tagged with the oldest weights that produced any of its tokens (an in-place pause can update the weights
        # in the middle of a request)
        version = self.weight_version if req.version is None else min(req.version, self.weight_version)
        gen = Generation(list(req.out), list(req.lps), reason, version, matched, len(req.ids), req.cached)
        req.loop.call_soon_threadsafe(lambda: req.future.done() or req.future.set_result(gen))

    def _fail(self, req: _Request, exc: Exception) -> None:
        req.loop.call_soon_threadsafe(lambda: req.future.done() or req.future.set_exception(exc))

    # -- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._step()
            except Exception as e:  # noqa: BLE001 - fail the requests in flight, keep serving new ones
                log.exception("engine step failed")
                for i, r in enumerate(self.slots):
                    if r is not None:
                        self._fail(r, EngineError(f"engine error: {e}"))
                        self.slots[i] = None
                self.slot_cache = [[] for _ in self.slot_cache]

    def _apply_control(self) -> None:
        while True:
            try:
                mode, done = self._control.get_nowait()
            except queue.Empty:
                return
            if mode == "abort":
                self._drain_queue()
                for r in self._waiting:
                    self._finish(r, "abort")
                self._waiting.clear()
                for i, r in enumerate(self.slots):
                    if r is not None:
                        self._finish(r, "abort")
                        self.slots[i] = None
            elif mode == "retract":  # first in line after resume, re-prefilled with their output so far
                self._waiting[:0] = [r for r in self.slots if r is not None]
                self.slots = [None] * len(self.slots)
            done.set()

    def _drain_queue(self) -> None:
        while True:
            try:
                self._waiting.append(self._queue.get_nowait())
            except queue.Empty:
                return

    def _step(self) -> None:
        self._apply_control()
        if self._paused.is_set():
            self._apply_pending()
            time.sleep(0.005)
            return
        if self._pending is not None and not any(self.slots):
            self._apply_pending()
        self._drain_queue()
        claimed = []
        while self._waiting and None in self.slots and self._pending is None:
            claimed.append(self._claim(self._waiting.pop(0)))
        if claimed:
            self._admit(claimed)
        if not any(self.slots):
            try:
                self._waiting.append(self._queue.get(timeout=0.05))
            except queue.Empty:
                pass
            return
        self._decode_all()

    def _claim(self, req: _Request) -> tuple[_Request, int, list[int], int]:
        """Give ``req`` a free slot: the one holding the longest prefix of its tokens, else the one holding the
        fewest cached tokens (what other slots keep stays reusable); (req, slot, seq, cached)."""
        seq = req.ids + req.out  # a retracted request resumes from what it has generated so far
        if req.version is None:
            req.version = self.weight_version
        free = [i for i, r in enumerate(self.slots) if r is None]
        slot, common = min(free, key=lambda i: len(self.slot_cache[i])), 0
        if self.cfg.prefix_reuse and not self.cfg.deterministic:
            for i in free:
                c = _common_prefix(self.slot_cache[i], seq)
                if c > common:
                    slot, common = i, c
        common = min(common, len(seq) - 1)  # prefill at least one token to get the next-token logits
        if not req.out:
            req.cached = common
        self.slot_cache[slot] = []
        self.slots[slot] = req
        self.stats["prefill_tokens"] += len(seq) - common
        self.stats["reused_tokens"] += common
        return req, slot, seq, common

    def _admit(self, claimed: list[tuple[_Request, int, list[int], int]]) -> None:
        """Prefill the claimed requests together, in rounds of at most ``prefill_chunk`` tokens per request
        (one program call per round, rows padded to a power of two), and sample each one's first token.
        Deterministic engines prefill one request at a time at fixed shapes."""
        if self.cfg.deterministic and len(claimed) > 1:
            for c in claimed:
                self._admit([c])
            return
        pos = {slot: common for _, slot, _, common in claimed}
        todo = [(slot, seq) for _, slot, seq, _ in claimed]
        chunk = self.cfg.prefill_chunk
        while todo:
            width = _bucket(len(todo), 1, self.cfg.max_batch)
            t = _bucket(min(max(len(seq) - pos[slot] for slot, seq in todo), chunk), 16, chunk)
            top = max(pos[slot] for slot, _ in todo)
            attn = self.cfg.max_seq_len if self.cfg.deterministic else _bucket(top + t, self.cfg.min_bucket,
                                                                               self.cfg.max_seq_len)
            t = min(t, attn - top)  # every padded chunk must fit in the attended window
            self._fit_cache(attn, shrink=False)
            ids, rows = np.zeros((width, t), np.int32), np.full(width, todo[0][0], np.int32)
            start, n_valid, ok = np.zeros(width, np.int32), np.ones(width, np.int32), np.zeros(width, bool)
            for j, (slot, seq) in enumerate(todo):
                piece = seq[pos[slot]: pos[slot] + t]
                ids[j, : len(piece)] = piece
                rows[j], start[j], n_valid[j], ok[j] = slot, pos[slot], len(piece), True
            logits, self.kc, self.vc = _prefill(self.w, self.kc, self.vc, jnp.asarray(ids), jnp.asarray(rows),
                                                jnp.asarray(start), jnp.asarray(n_valid), jnp.asarray(ok),
                                                cfg=self.model_cfg, opts=self.options, attn_len=attn,
                                                mm=self.cfg.matmul_dtype)
            done, left = [], []
            for j, (slot, seq) in enumerate(todo):
                pos[slot] += int(n_valid[j])
                (done if pos[slot] >= len(seq) else left).append(slot)
            if done:
                self._emit(done, logits, [slot if slot in done else None for slot, _ in todo]
                           + [None] * (width - len(todo)))
            todo = [(slot, seq) for slot, seq in todo if slot in left]

    def _sampling_arrays(self, slots: Sequence[int | None]):
        """Per-row sampling parameters for a fixed-width batch (``None`` rows get greedy filler), so the
        sampler compiles once per width."""
        n = len(slots)
        temps, top_ps = np.zeros(n, np.float32), np.ones(n, np.float32)
        top_ks, seeds, counters = np.full(n, -1, np.int32), np.zeros(n, np.uint32), np.zeros(n, np.uint32)
        for j, i in enumerate(slots):
            if i is None:
                continue
            r = self.slots[i]
            temps[j], top_ps[j], top_ks[j] = r.sampling.temperature, r.sampling.top_p, r.sampling.top_k
            seeds[j], counters[j] = r.seed % 2**31, len(r.out)
        return temps, top_ps, top_ks, seeds, counters

    def _emit(self, rows: Sequence[int], logits, width_rows: Sequence[int | None] | None = None) -> None:
        """Sample one token for each of ``rows`` and handle stops. ``logits``: [len(width_rows), V] where
        ``width_rows[j]`` is the slot of row j (None = unused); default: one row per entry of ``rows``."""
        width_rows = list(rows) if width_rows is None else list(width_rows)
        toks, lps = sample_tokens(logits, *(jnp.asarray(a) for a in self._sampling_arrays(width_rows)))
        self._take(rows, width_rows, np.asarray(toks)[None], np.asarray(lps)[None])

    def _take(self, rows: Sequence[int], width_rows: Sequence[int | None], toks: np.ndarray, lps: np.ndarray):
        """Append tokens [n, width] (n steps) to the requests of ``rows``, each up to its stop: what a request
        would have generated after it is dropped."""
        where = {slot: j for j, slot in enumerate(width_rows) if slot is not None}
        now = time.monotonic()
        for i in rows:
            j = where[i]
            r = self.slots[i]
            for t in range(toks.shape[0]):
                r.out.append(int(toks[t, j]))
                r.lps.append(float(lps[t, j]))
                if r.t_first is None:
                    r.t_first = now
                self.stats["generated"] += 1
                reason, matched = self._stop_reason(r)
                if reason:
                    self._finish(r, reason, matched)
                    self.slot_cache[i] = r.ids + r.out[:-1]  # the last token's K/V was never written
                    self.slots[i] = None
                    break

    def _stop_reason(self, r: _Request):
        tok = r.out[-1]
        if tok in r.sampling.stop_token_ids:
            return "stop", tok
        if r.sampling.stop and self.tok is not None:
            tail = self.tok.decode(r.out[-64:], skip_special_tokens=False)
            for s in r.sampling.stop:
                if s in tail:
                    return "stop", s
        if len(r.out) >= r.sampling.max_new_tokens or len(r.ids) + len(r.out) >= self.cfg.max_seq_len - 1:
            return "length", None
        return None, None

    def _decode_all(self) -> None:
        """Decode steps for the active slots, compacted to a power-of-two batch (1, 2, 4, ... max_batch):
        ``decode_steps`` of them per call, halved while that is more than the most tokens any row has left."""
        live = [i for i, r in enumerate(self.slots) if r is not None]
        b = self.cfg.max_batch if self.cfg.deterministic else _bucket(len(live), 1, self.cfg.max_batch)
        # a full-width batch puts slot j in row j (free slots ride along inactive): every cache row in order, so
        # no row gather of the attended K/V
        all_rows = b == self.cfg.max_batch
        width_rows = ([i if self.slots[i] is not None else None for i in range(b)] if all_rows
                      else live + [None] * (b - len(live)))
        tokens, pos = np.zeros(b, np.int32), np.zeros(b, np.int32)
        active, rows = np.zeros(b, bool), np.zeros(b, np.int32)
        left = 1
        for j, i in enumerate(width_rows):
            if i is None:
                continue
            r = self.slots[i]
            tokens[j], pos[j], active[j], rows[j] = r.out[-1], len(r.ids) + len(r.out) - 1, True, i
            left = max(left, min(r.sampling.max_new_tokens - len(r.out),
                                 self.cfg.max_seq_len - 1 - len(r.ids) - len(r.out)))
        n = max(1, self.cfg.decode_steps)
        if not self.cfg.deterministic:
            while n > left:  # halve: about log2(decode_steps) program shapes per batch width, not one per
                n //= 2  # remaining length, and 15 tokens left take 4 calls (8 + 4 + 2 + 1), not 15
        attn = _bucket(int(pos[active].max()) + n, self.cfg.min_bucket, self.cfg.max_seq_len)
        if self.cfg.deterministic:
            attn = self.cfg.max_seq_len
        # the per-layer caches as long as what they must hold: the attended window, or a longer prefix a free slot
        # keeps for reuse (then the window is a slice of them, copied on each step, as with a row gather)
        kept = max((len(c) for i, c in enumerate(self.slot_cache) if self.slots[i] is None), default=0)
        self._fit_cache(max(attn, _bucket(kept, self.cfg.min_bucket, self.cfg.max_seq_len)), shrink=True)
        samp = self._sampling_arrays(width_rows)
        toks, lps, self.kc, self.vc = _decode(self.w, self.kc, self.vc, jnp.asarray(tokens), jnp.asarray(pos),
                                              jnp.asarray(active), jnp.asarray(rows),
                                              *(jnp.asarray(a) for a in samp), cfg=self.model_cfg,
                                              opts=self.options, attn_len=attn, n_steps=n,
                                              mm=self.cfg.matmul_dtype, all_rows=all_rows)
        self.stats["decode_steps"] += n
        self._take(live, width_rows, np.asarray(toks), np.asarray(lps))

    def _fit_cache(self, size: int, shrink: bool) -> None:
        """Resize the per-layer caches to ``size`` positions: grow (zeros after the current length) when it is
        longer; when ``shrink`` and it is shorter, drop positions >= size (the caller keeps every running request
        and every reusable prefix below it). One layer at a time, so the old and new copies of only one layer
        coexist; a resize costs about one decode step's copy of the cache, and sizes are power-of-two buckets."""
        if not self.resizable or self.cfg.deterministic:
            return
        cur = _cache_len(self.kc)
        if size == cur or (size < cur and not shrink):
            return
        for i in range(len(self.kc)):
            self.kc[i], self.vc[i] = _resize(self.kc[i], self.vc[i], size=size)
        if size < cur:  # K/V past the new end is gone (none is expected: see _decode_all)
            self.slot_cache = [c[:size] for c in self.slot_cache]
        self.stats["cache_resizes"] += 1


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
