"""The embedded rollout engine: the policy's own nnx model, a KV cache, continuous batching.

One engine thread owns the device work. ``generate`` calls (from any asyncio task) queue requests; the
thread admits them into free cache slots as soon as one frees up (prefilling only the part of the prompt a
slot does not already hold: the turns of one episode share their prefix), runs one jitted decode step for
every active slot, and resolves each request when it stops. Shapes are bucketed (prefill chunk length,
attended cache length) so a handful of programs are compiled. Sampling: temperature, top-p, top-k, a
per-request seed (a request's randomness does not depend on what it is batched with); the log-prob of each
sampled token is the fp32 log-softmax of logits / temperature, what the trainer recomputes.

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

from jaxrl_term.rollout.engine import EngineError, Generation, SamplingParams

log = logging.getLogger(__name__)
PAUSE_MODES = ("abort", "in_place", "retract")


@dataclasses.dataclass(frozen=True)
class JaxEngineConfig:
    max_batch: int = 16  # cache slots = sequences decoded together
    max_seq_len: int = 4096  # per slot (prompt + output)
    prefill_chunk: int = 512  # longest prefill piece (longer prompts go in several)
    min_bucket: int = 64  # smallest attended-length bucket
    param_dtype: str | None = None  # engine weights; None = as given
    share_params: bool = False  # use live params as they are (no copy): only when the trainer never donates them
    prefix_reuse: bool = True
    deterministic: bool = False  # fixed shapes, no prefix reuse: samples independent of batching (slower)


def _bucket(n: int, lo: int, hi: int) -> int:
    b = lo
    while b < n:
        b *= 2
    return min(b, hi)


@functools.partial(jax.jit, static_argnames=("graphdef", "attn_len"), donate_argnames=("kc", "vc"))
def _prefill(graphdef, params, kc, vc, ids, slot, start, n_valid, attn_len: int):
    model = nnx.merge(graphdef, params)
    h, kc, vc = model.forward_cached(ids, start[None], kc, vc, None, attn_len, slot[None])
    last = jax.lax.dynamic_slice_in_dim(h, n_valid - 1, 1, axis=1)
    return model.logits(last)[:, 0], kc, vc


@functools.partial(jax.jit, static_argnames=("graphdef", "attn_len"), donate_argnames=("kc", "vc"))
def _decode(graphdef, params, kc, vc, tokens, pos, active, rows, attn_len: int):
    model = nnx.merge(graphdef, params)
    h, kc, vc = model.forward_cached(tokens[:, None], pos, kc, vc, active, attn_len, rows)
    return model.logits(h)[:, 0], kc, vc


@jax.jit
def sample_tokens(logits, temps, top_ps, top_ks, seeds, counters):
    """logits [B, V] -> (tokens [B] int32, log-probs [B] fp32). temperature 0 = greedy (log-prob at T = 1).
    Top-k / top-p truncate what is sampled; the log-prob is under the untruncated softmax(logits / T)."""
    logits = logits.astype(jnp.float32)
    v = logits.shape[-1]
    greedy = temps <= 0
    z = logits / jnp.where(greedy, 1.0, temps)[:, None]
    logp_all = jax.nn.log_softmax(z, axis=-1)

    def truncate(z):
        srt = -jnp.sort(-z, axis=-1)  # descending
        k = jnp.where(top_ks > 0, jnp.minimum(top_ks, v), v)
        thr_k = jnp.take_along_axis(srt, (k - 1)[:, None], axis=-1)[:, 0]
        p = jax.nn.softmax(srt, axis=-1)
        n_p = jnp.maximum(jnp.sum((jnp.cumsum(p, axis=-1) - p) < top_ps[:, None], axis=-1), 1)
        thr_p = jnp.take_along_axis(srt, (n_p - 1)[:, None], axis=-1)[:, 0]
        return jnp.where(z >= jnp.maximum(thr_k, thr_p)[:, None], z, -jnp.inf)

    needs = jnp.any((top_ps < 1.0) | (top_ks > 0))
    z_s = jax.lax.cond(needs, truncate, lambda z: z, z)
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.PRNGKey(s), c))(seeds, counters)
    sampled = jax.vmap(jax.random.categorical)(keys, z_s)
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)
    return tokens, jnp.take_along_axis(logp_all, tokens[:, None], axis=-1)[:, 0]


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
        self.graphdef, params = nnx.split(model)
        self.params = self._prepare(nnx.to_pure_dict(params), copy=False)
        self.options = model.options
        b, s = self.cfg.max_batch, self.cfg.max_seq_len
        cache_dtype = model.options.cdtype
        self.kc = jnp.zeros(model.kv_cache_shape(b, s), cache_dtype)
        self.vc = jnp.zeros(model.kv_cache_shape(b, s), cache_dtype)
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
        self.stats = {"prefill_tokens": 0, "reused_tokens": 0, "decode_steps": 0, "generated": 0}
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
            old = jax.tree.structure(self.params)
            if jax.tree.structure(params) != old:
                raise EngineError("update_weights: the params do not have this model's structure", retryable=False)
            for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(self.params)):
                if a.shape != b.shape:
                    raise EngineError(f"update_weights: shape {a.shape} != {b.shape}", retryable=False)
            params = await asyncio.to_thread(self._prepare, params)
        except EngineError:
            raise
        except Exception as e:  # noqa: BLE001 - a failed load keeps the previous weights serving
            raise EngineError(f"update_weights failed, version {self.weight_version} keeps serving: {e}",
                              retryable=False) from e
        with self._lock:
            self._pending = (params, version)
        # Only the engine thread swaps the weights, between two of its own steps (here, the event loop could swap
        # them in the middle of a prefill and mix two policies in one turn). It does so as soon as nothing is
        # running or the engine is paused; new requests wait meanwhile, as in SGLang's update without a pause.
        while self._pending is not None and self._thread.is_alive():
            await asyncio.sleep(0.002)

    def _apply_pending(self) -> None:
        with self._lock:
            if self._pending is None:
                return
            self.params, self.weight_version = self._pending
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
        while self._waiting and None in self.slots and self._pending is None:
            self._admit(self._waiting.pop(0))
        if not any(self.slots):
            try:
                self._waiting.append(self._queue.get(timeout=0.05))
            except queue.Empty:
                pass
            return
        self._decode_all()

    def _admit(self, req: _Request) -> None:
        seq = req.ids + req.out  # a retracted request resumes from what it has generated so far
        if req.version is None:
            req.version = self.weight_version
        free = [i for i, r in enumerate(self.slots) if r is None]
        slot, common = free[0], 0
        if self.cfg.prefix_reuse and not self.cfg.deterministic:
            for i in free:
                c = _common_prefix(self.slot_cache[i], seq)
                if c > common:
                    slot, common = i, c
        common = min(common, len(seq) - 1)  # prefill at least one token to get the next-token logits
        if not req.out:
            req.cached = common
        self.slot_cache[slot] = []
        pos = common
        logits = None
        while pos < len(seq):
            chunk = seq[pos: pos + self.cfg.prefill_chunk]
            t = _bucket(len(chunk), 16, self.cfg.prefill_chunk)
            attn = _bucket(pos + t, self.cfg.min_bucket, self.cfg.max_seq_len)
            if self.cfg.deterministic:
                attn = self.cfg.max_seq_len
            if pos + t > attn:  # the padded chunk must fit in the attended window
                t = attn - pos
            ids = np.zeros((1, t), np.int32)
            ids[0, : len(chunk)] = chunk
            logits, self.kc, self.vc = _prefill(self.graphdef, self.params, self.kc, self.vc, jnp.asarray(ids),
                                                jnp.int32(slot), jnp.int32(pos), jnp.int32(len(chunk)), attn)
            pos += len(chunk)
        self.stats["prefill_tokens"] += len(seq) - common
        self.stats["reused_tokens"] += common
        self.slots[slot] = req
        self._emit([slot], logits)

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
        toks, lps = np.asarray(toks), np.asarray(lps)
        where = {slot: j for j, slot in enumerate(width_rows) if slot is not None}
        now = time.monotonic()
        for i in rows:
            j = where[i]
            r = self.slots[i]
            r.out.append(int(toks[j]))
            r.lps.append(float(lps[j]))
            if r.t_first is None:
                r.t_first = now
            self.stats["generated"] += 1
            reason, matched = self._stop_reason(r)
            if reason:
                self._finish(r, reason, matched)
                self.slot_cache[i] = r.ids + r.out[:-1]  # the last token's K/V was never written
                self.slots[i] = None

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
        """One decode step for the active slots, compacted to a power-of-two batch (1, 2, 4, ... max_batch)."""
        live = [i for i, r in enumerate(self.slots) if r is not None]
        b = self.cfg.max_batch if self.cfg.deterministic else _bucket(len(live), 1, self.cfg.max_batch)
        tokens, pos = np.zeros(b, np.int32), np.zeros(b, np.int32)
        active, rows = np.zeros(b, bool), np.zeros(b, np.int32)
        for j, i in enumerate(live):
            r = self.slots[i]
            tokens[j], pos[j], active[j], rows[j] = r.out[-1], len(r.ids) + len(r.out) - 1, True, i
        attn = _bucket(int(pos.max()) + 1, self.cfg.min_bucket, self.cfg.max_seq_len)
        if self.cfg.deterministic:
            attn = self.cfg.max_seq_len
        logits, self.kc, self.vc = _decode(self.graphdef, self.params, self.kc, self.vc, jnp.asarray(tokens),
                                           jnp.asarray(pos), jnp.asarray(active), jnp.asarray(rows), attn)
        self.stats["decode_steps"] += 1
        self._emit(live, logits, live + [None] * (b - len(live)))


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
