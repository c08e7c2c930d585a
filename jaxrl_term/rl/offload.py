"""ZeRO-Offload for one process: fp32 master weights and AdamW moments in host memory, a compute-dtype copy on
the devices.

fp32 params + fp32 Adam moments + fp32 gradients are 16 bytes per parameter; for Qwen3-8B on 2 x A100 80GB that
is ~65 GB per GPU before activations. Here the devices keep only the compute copy (bf16: 2 bytes/param) and,
during a step, the fp32 gradients; the 12 bytes/param of optimizer state live on the host. One update:

    devices:  grads, ok, metrics = inner._grad_step(device_params, batch)     (fp32, sharded like the params)
    stream:   for each leaf, and for the stacked [L, ...] layer leaves each layer l:
                grad slice -> host                       (the next slice's copy is issued before this one computes)
                host AdamW (an XLA:CPU jit that donates master, mu, nu: updated in place, multi-threaded)
                new master -> compute dtype -> device    (a donated dynamic_update_slice: the device leaf is
                                                          rewritten in place, one layer at a time)

so neither side ever holds a second copy of more than one layer. The update is optax's, written out per slice:
``clip_by_global_norm(grad_clip)`` scales every slice by the *global* norm (``metrics["grad_norm"]``), then
``adamw(make_schedule(o), b1, b2, eps, weight_decay, mask=_decay_mask)`` with bias correction and the learning
rate at the optimizer's own count, which does not advance on a skipped step (``ok`` false: nothing is touched,
exactly as TrainStep keeps params and opt_state). The host keeps each stacked [L, ...] leaf as a list of L
per-layer arrays: XLA:CPU updates a whole donated array in place at memory speed, while slicing a layer out of
a big [L, ...] array and back in costs extra passes (measured 3x slower as separate slice / update / write-back
calls, 40x as one fused kernel).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax import lax
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from jaxrl_term.model.qwen3 import ModelOptions, Qwen3Config
from jaxrl_term.parallel.mesh import LogicalRules
from jaxrl_term.rl.batch import Batch, to_microbatches
from jaxrl_term.rl.step import (
    AlgoConfig,
    OptimConfig,
    TrainStep,
    _abstract_params,
    _decay_mask,
    make_schedule,
    make_train_step,
)


@struct.dataclass
class OffloadState:
    """The training state of ``HostOffloadTrainStep``. Host trees (master, mu, nu) have the params' dict
    structure, except that each stacked [L, ...] leaf is a list of L per-layer arrays; all fp32 on the CPU
    backend. ``params`` is what the model computes with, so ``ts.model(state.params)`` works as for TrainState."""

    params: Any  # device compute copy: pure dict, compute dtype, sharded like ``param_shardings``
    master: Any  # host fp32 master weights
    mu: Any  # host fp32 AdamW first moment
    nu: Any  # host fp32 AdamW second moment
    count: jax.Array  # int32 scalar (host): updates applied = optax's count (schedule step, bias correction)
    step: jax.Array  # int32 scalar (host): calls, skipped ones included (as TrainState.step)
    rng: jax.Array  # uint32[2] (host)


@dataclasses.dataclass(frozen=True)
class _Leaf:
    shape: tuple[int, ...]
    stacked: bool  # a [L, ...] layer leaf: processed, and kept on the host, layer by layer
    decay: bool  # weight decay applies (``_decay_mask``)
    sharding: NamedSharding  # the device leaf
    layer_sharding: NamedSharding | None  # one layer of a stacked device leaf


def _hyper(o: OptimConfig) -> tuple:
    """The optimizer config as a hashable static argument (its values become constants, as in optax)."""
    return tuple(dataclasses.asdict(o).items())


@functools.partial(jax.jit, static_argnames=("decay", "hyper", "cdtype"), donate_argnums=(0, 1, 2))
def _adamw_slice(p, m, v, g, h, *, decay: bool, hyper: tuple, cdtype: str):
    """One slice of ``make_optimizer(o)``, op for op as optax writes it (bit-identical to optax on the same
    backend). p, m, v, g: fp32, one shape; h: the step's scalars (``_step_scalars``); p, m, v are donated:
    updated in place. Returns (p, m, v, p in the compute dtype)."""
    o = OptimConfig(**dict(hyper))
    g = lax.select(h["trigger"], g, (g / h["grad_norm"]) * o.grad_clip)  # clip_by_global_norm
    m = (1 - o.b1) * g + o.b1 * m  # scale_by_adam
    v = (1 - o.b2) * (g * g) + o.b2 * v
    u = (m / h["bc1"]) / (jnp.sqrt(v / h["bc2"] + 0.0) + o.eps)
    if decay:  # add_decayed_weights under the mask
        u = u + o.weight_decay * p
    u = h["neg_lr"] * u  # scale_by_learning_rate
    p = (p + u).astype(p.dtype)  # apply_updates
    return p, m, v, p.astype(cdtype)


@functools.partial(jax.jit, static_argnames=("hyper",))
def _step_scalars(count, grad_norm, *, hyper: tuple):
    """The scalars of optax's update at optimizer count ``count`` (before the increment); ``grad_norm``: the
    global norm of the whole gradient."""
    o = OptimConfig(**dict(hyper))
    lr = make_schedule(o)(count)
    count_inc = optax.safe_increment(count)
    return {"trigger": jnp.squeeze(grad_norm < o.grad_clip), "grad_norm": grad_norm,
            "bc1": (1 - o.b1**count_inc).astype(jnp.float32), "bc2": (1 - o.b2**count_inc).astype(jnp.float32),
            "neg_lr": jnp.asarray(-1 * lr, jnp.float32), "lr": lr}


# Fresh buffers: the host state is donated every update, so it must alias neither the caller's arrays nor the
# device copy (a device_put to the same device, or an astype to the same dtype, would return its input).
_copy = jax.jit(lambda x, dtype: jnp.array(x, dtype, copy=True), static_argnums=1)
_layers = jax.jit(lambda x: [x[i] for i in range(x.shape[0])])
_stack = jax.jit(jnp.stack)
# One layer of a stacked device leaf out (a gradient) and in (the new compute copy, in place: donated).
_take = jax.jit(lambda x, l: lax.dynamic_index_in_dim(x, l, keepdims=False))
_put = jax.jit(lambda x, y, l: lax.dynamic_update_index_in_dim(x, y, l, 0), donate_argnums=(0,))
# Host gradient accumulation over microbatches (fp32, in place).
_scale = jax.jit(lambda g, a: g.astype(jnp.float32) * a)
_axpy = jax.jit(lambda acc, g, a: acc + g.astype(jnp.float32) * a, donate_argnums=(0,))
_sumsq = jax.jit(lambda a: jnp.sum(a * a))


@dataclasses.dataclass
class HostOffloadTrainStep:
    """TrainStep's API over host-resident fp32 master weights and AdamW moments (see the module docstring).
    ``inner`` is a TrainStep built with ``param_dtype`` = the compute dtype: its ``_grad_step`` is the whole
    device program, its ``_logprobs`` the no-grad pass."""

    inner: TrainStep
    optim: OptimConfig
    host: jax.Device
    leaves: list[_Leaf]
    treedef: Any

    # -- what the trainer and the planner read ----------------------------------------------------
    @property
    def model_cfg(self) -> Qwen3Config:
        return self.inner.model_cfg

    @property
    def algo(self) -> AlgoConfig:
        return self.inner.algo

    @property
    def mesh(self):
        return self.inner.mesh

    @property
    def options(self) -> ModelOptions:
        """The device copy's options (param_dtype = compute dtype)."""
        return self.inner.options

    @property
    def graphdef(self):
        return self.inner.graphdef

    @property
    def param_shardings(self):
        return self.inner.param_shardings

    @property
    def batch_sharding(self):
        return self.inner.batch_sharding

    @property
    def shards(self) -> int:
        return self.inner.shards

    @property
    def compute_dtype(self):
        return self.inner.options.pdtype

    def layout(self, rows: int) -> tuple[int, int]:
        return self.inner.layout(rows)

    def place_batch(self, batch: Batch) -> Batch:
        return self.inner.place_batch(batch)

    def model(self, params):
        """The model over ``params``: the device compute copy (``state.params``), or the fp32 master from
        ``master_params`` for an fp32 export."""
        return self.inner.model(params)

    def num_params(self) -> int:
        return sum(int(np.prod(leaf.shape)) for leaf in self.leaves)

    def host_bytes(self) -> float:
        """Host memory of the state (fp32 master + mu + nu: 12 bytes/param) plus the step's temporaries, at
        most three fp32 gradient copies (the slice being updated, its staging copy, the next slice in flight)
        and one compute-dtype copy of the largest slice (a layer, or an unstacked leaf such as embed_tokens)."""
        slice_elems = max(int(np.prod(leaf.shape[1:] if leaf.stacked else leaf.shape)) for leaf in self.leaves)
        return float(12 * self.num_params() + slice_elems * (3 * 4 + np.dtype(self.compute_dtype).itemsize))

    def device_param_bytes_per_device(self) -> float:
        """Bytes of the compute copy on one device (the largest shard of each leaf)."""
        item = np.dtype(self.compute_dtype).itemsize
        return float(sum(int(np.prod(leaf.sharding.shard_shape(leaf.shape))) * item for leaf in self.leaves))

    # -- state ------------------------------------------------------------------------------------
    def _host_tree(self, per_leaf) -> Any:
        """A host tree from one entry per param leaf (a list of L arrays for a stacked leaf)."""
        return jax.tree.unflatten(self.treedef, per_leaf)

    def _split(self, tree) -> list:
        """A host tree -> one entry per param leaf (lists for stacked leaves)."""
        flat = jax.tree.leaves(tree)
        out, i = [], 0
        for leaf in self.leaves:
            n = leaf.shape[0] if leaf.stacked else 1
            out.append(flat[i:i + n] if leaf.stacked else flat[i])
            i += n
        return out

    def init_state(self, params, seed: int = 0) -> OffloadState:
        """OffloadState from a pure dict of params (jax arrays anywhere, or numpy). The master is an fp32 copy
        on the host; the device copy is the master cast to the compute dtype."""
        hs = SingleDeviceSharding(self.host)
        cdtype = np.dtype(self.compute_dtype).name
        given = jax.tree.leaves(params)
        if len(given) != len(self.leaves):
            raise ValueError(f"init_state: {len(given)} param leaves, the model has {len(self.leaves)}")
        zeros = lambda a: jnp.zeros(a.shape, jnp.float32, device=hs)
        master, mu, nu, device = [], [], [], []
        for x, leaf in zip(given, self.leaves, strict=True):
            if tuple(x.shape) != leaf.shape:
                raise ValueError(f"init_state: a param of shape {tuple(x.shape)} where the model has {leaf.shape}")
            full = _copy(jax.device_put(x, self.host), "float32")
            device.append(jax.device_put(_copy(full, cdtype), leaf.sharding))
            m = _layers(full) if leaf.stacked else full
            master.append(m)
            mu.append([zeros(a) for a in m] if leaf.stacked else zeros(m))
            nu.append([zeros(a) for a in m] if leaf.stacked else zeros(m))
        scalar = lambda x: jax.device_put(x, hs)
        return OffloadState(
            params=jax.tree.unflatten(self.treedef, device), master=self._host_tree(master),
            mu=self._host_tree(mu), nu=self._host_tree(nu), count=scalar(jnp.zeros((), jnp.int32)),
            step=scalar(jnp.zeros((), jnp.int32)), rng=scalar(jax.random.PRNGKey(seed)))

    def abstract_state(self) -> OffloadState:
        """ShapeDtypeStructs with shardings (device copy on the mesh, the rest on the host): the checkpoint
        restore target."""
        hs = SingleDeviceSharding(self.host)

        def host(leaf):
            if leaf.stacked:
                return [jax.ShapeDtypeStruct(leaf.shape[1:], jnp.float32, sharding=hs) for _ in range(leaf.shape[0])]
            return jax.ShapeDtypeStruct(leaf.shape, jnp.float32, sharding=hs)

        params = [jax.ShapeDtypeStruct(leaf.shape, self.compute_dtype, sharding=leaf.sharding) for leaf in self.leaves]
        return OffloadState(
            params=jax.tree.unflatten(self.treedef, params), master=self._host_tree([host(x) for x in self.leaves]),
            mu=self._host_tree([host(x) for x in self.leaves]), nu=self._host_tree([host(x) for x in self.leaves]),
            count=jax.ShapeDtypeStruct((), jnp.int32, sharding=hs), step=jax.ShapeDtypeStruct((), jnp.int32, sharding=hs),
            rng=jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=hs))

    def master_params(self, state: OffloadState) -> dict:
        """The fp32 master as a pure dict in the model's layout (stacked [L, ...] leaves), on the host: for an
        fp32 export, ``save_pretrained(ts.model(ts.master_params(state)), out, "float32")``."""
        return self.model_layout(state.master)

    def model_layout(self, host_tree) -> dict:
        """A host tree (master, mu or nu) -> fresh host arrays with stacked [L, ...] leaves, as in the params.
        Copies, not views: the next update donates the host buffers."""
        out = [_stack(x) if leaf.stacked else _copy(x, "float32")
               for x, leaf in zip(self._split(host_tree), self.leaves, strict=True)]
        return jax.tree.unflatten(self.treedef, out)

    def device_params(self, params) -> Any:
        """Any params (e.g. the fp32 reference policy) -> the compute dtype on the mesh, leaf by leaf; numpy
        leaves are cast on the host (round to nearest even, as on the device)."""

        def put(x, sh):
            x = x.astype(self.compute_dtype) if isinstance(x, jax.Array) else np.asarray(x, self.compute_dtype)
            return jax.device_put(x, sh)

        return jax.tree.map(put, params, self.param_shardings)

    # -- calls ------------------------------------------------------------------------------------
    def __call__(self, state: OffloadState, batch: Batch) -> tuple[OffloadState, dict[str, float]]:
        """One optimizer update on ``batch`` ([B, T], host). Consumes ``state`` (its buffers are updated in
        place), except on a skipped step, which leaves every array untouched.

        One microbatch: the device program returns the batch gradient and it streams through the host update.
        Several: each microbatch is its own device call and its gradient is summed on the host (fp32), so the
        devices never hold an accumulator next to a microbatch's gradient (an fp32 model-sized buffer)."""
        m, _ = self.layout(batch.tokens.shape[0])
        if m == 1:
            grads, ok, metrics = self.inner._grad_step(state.params, self.place_batch(batch))
            # _apply frees each gradient leaf once it is on the host by dropping the last reference (an explicit
            # delete could also free a host slice that aliases it when the host is one of the mesh devices)
            g_leaves = jax.tree.leaves(grads)
            del grads
            ok = bool(ok)  # waits for the device program
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
            source = self._device_slices(g_leaves)
        else:
            source, ok, metrics = self._host_accumulate(state, batch, m)
        scalars = _step_scalars(state.count, jax.device_put(np.float32(metrics["grad_norm"]), self.host),
                                hyper=_hyper(self.optim))
        metrics["lr"] = float(scalars["lr"])
        key, _ = jax.random.split(state.rng)
        if not ok:
            metrics.update({"offload/host_update_s": 0.0, "offload/transfer_s": 0.0})
            return state.replace(step=state.step + 1, rng=key), metrics
        master, mu, nu, device, timing = self._apply(state, source, scalars)
        metrics.update({"offload/host_update_s": timing[0], "offload/transfer_s": timing[1] + metrics.pop(
            "offload/accumulate_s", 0.0)})
        new = OffloadState(params=device, master=master, mu=mu, nu=nu, count=optax.safe_increment(state.count),
                           step=state.step + 1, rng=key)
        return new, metrics

    def _slots(self) -> list[tuple[int, int | None]]:
        return [(i, l) for i, leaf in enumerate(self.leaves) for l in (range(leaf.shape[0]) if leaf.stacked else [None])]

    def _device_slices(self, g_leaves: list):
        """Slice k of device gradients -> host, each copy issued one slice ahead (it overlaps host work);
        a gradient leaf is released once its last slice is on the host."""
        slots = self._slots()

        def fetch(k):
            i, l = slots[k]
            x = g_leaves[i] if l is None else _take(g_leaves[i], l)
            x.copy_to_host_async()
            return x

        state = {"pending": fetch(0)}

        def get(k):
            i, l = slots[k]
            g = jax.device_put(np.asarray(state["pending"]), self.host)
            state["pending"] = fetch(k + 1) if k + 1 < len(slots) else None
            if l is None or l == self.leaves[i].shape[0] - 1:
                g_leaves[i] = None
            return g

        return get

    def _host_accumulate(self, state: OffloadState, batch: Batch, m: int):
        """Microbatch by microbatch: the device gradient of each (normalised by its own denominator) times that
        denominator, summed on the host; then divided by the total. Returns (slice source, ok, metrics)."""
        t0 = time.perf_counter()
        mb = to_microbatches(batch, m)
        slots = self._slots()
        acc: list = [None] * len(slots)
        parts = []
        for j in range(m):
            sub = jax.tree.map(lambda x, j=j: np.asarray(x)[j:j + 1], mb)
            placed = jax.tree.map(lambda x: jax.make_array_from_callback(
                x.shape, self.inner.batch_sharding, lambda idx, x=x: x[idx]), sub)
            grads, _, met = self.inner._grad_step(state.params, placed)
            met = {k: float(v) for k, v in jax.device_get(met).items()}
            parts.append(met)
            weight = jax.device_put(np.float32(met["denominator"]), self.host)
            get = self._device_slices(jax.tree.leaves(grads))
            del grads
            for k in range(len(slots)):
                g = get(k)
                acc[k] = _scale(g, weight) if acc[k] is None else _axpy(acc[k], g, weight)
                del g
        denom = sum(p["denominator"] for p in parts)
        tokens = sum(p["tokens"] for p in parts)
        inv = jax.device_put(np.float32(1.0 / max(denom, 1e-8)), self.host)
        acc = [_scale(a, inv) for a in acc]
        grad_norm = float(np.sqrt(sum(float(_sumsq(a)) for a in acc)))
        ok = denom > 0 and np.isfinite(grad_norm)
        from jaxrl_term.rl.step import COUNT_METRICS, FRESH_METRICS

        fresh = sum(p.get("fresh_tokens", p["tokens"]) for p in parts)
        signal = sum(p.get("signal_tokens", 0.0) for p in parts)
        no_signal = all(p.get("no_signal", 0.0) for p in parts)
        ok = ok and not no_signal
        metrics = {}
        for k in parts[0]:
            if k == "logp_gap_max":
                metrics[k] = max(p[k] for p in parts)
            elif k == "loss":
                metrics[k] = sum(p[k] * p["denominator"] for p in parts) / max(denom, 1e-8)
            elif k in COUNT_METRICS:
                metrics[k] = sum(p[k] for p in parts)
            elif k in FRESH_METRICS:
                metrics[k] = sum(p[k] * p.get("fresh_tokens", p["tokens"]) for p in parts) / max(fresh, 1.0)
            elif k not in ("grad_norm", "tokens", "skipped", "denominator", "no_signal"):
                metrics[k] = sum(p[k] * p["tokens"] for p in parts) / max(tokens, 1.0)
        metrics.update(grad_norm=grad_norm, tokens=tokens, denominator=denom, skipped=0.0 if ok else 1.0,
                       no_signal=1.0 if no_signal else 0.0, signal_tokens=signal,
                       **{"offload/accumulate_s": time.perf_counter() - t0})
        return (lambda k: acc[k]), ok, metrics

    def _apply(self, state: OffloadState, source, scalars):
        """Stream the gradient slices (``source(k)``: slice k on the host) through the host AdamW and the new
        compute copy back, slice by slice. Returns (master, mu, nu, device params, (host s, transfer s))."""
        d_leaves = jax.tree.leaves(state.params)
        ms, mus, nus = self._split(state.master), self._split(state.mu), self._split(state.nu)
        slots = self._slots()
        h_scalars = {k: v for k, v in scalars.items() if k != "lr"}
        hyper, cdtype = _hyper(self.optim), np.dtype(self.compute_dtype).name
        kernel = lambda p, m, v, g, decay: _adamw_slice(p, m, v, g, h_scalars, decay=decay, hyper=hyper,
                                                        cdtype=cdtype)
        host_s = transfer_s = 0.0
        for k, (i, l) in enumerate(slots):
            leaf = self.leaves[i]
            t0 = time.perf_counter()
            g = source(k)
            t1 = time.perf_counter()
            if l is None:
                ms[i], mus[i], nus[i], c = kernel(ms[i], mus[i], nus[i], g, leaf.decay)
            else:
                ms[i][l], mus[i][l], nus[i][l], c = kernel(ms[i][l], mus[i][l], nus[i][l], g, leaf.decay)
            c.block_until_ready()
            t2 = time.perf_counter()
            if l is None:
                d_leaves[i].delete()  # free the old device leaf before placing the new one
                d_leaves[i] = jax.device_put(np.asarray(c), leaf.sharding)
            else:
                d_leaves[i] = _put(d_leaves[i], jax.device_put(np.asarray(c), leaf.layer_sharding), l)
            del g, c
            host_s += t2 - t1
            transfer_s += (t1 - t0) + (time.perf_counter() - t2)
        t0 = time.perf_counter()
        jax.block_until_ready(d_leaves)
        transfer_s += time.perf_counter() - t0
        return (self._host_tree(ms), self._host_tree(mus), self._host_tree(nus),
                jax.tree.unflatten(self.treedef, d_leaves), (host_s, transfer_s))

    def update(self, state: OffloadState, batch: Batch, ref_params=None) -> tuple[OffloadState, list[dict[str, float]]]:
        """TrainStep.update over the offloaded state: the optional old-policy pass, the optional reference pass
        (``ref_params``: the compute copy from ``device_params``, or fp32 params, cast here), then
        ``algo.epochs`` steps. Returns the new state and one metrics dict per step."""
        if self.algo.recompute_old_logp:
            batch = batch.replace(old_logp=self.logprobs(state.params, batch)[0])
        if self.algo.kl_coef:
            if ref_params is None:
                raise ValueError("algo.kl_coef > 0 needs the reference policy's params (ref_params)")
            batch = batch.replace(ref_logp=self.logprobs(ref_params, batch)[0])
        history = []
        for _ in range(self.algo.epochs):
            state, metrics = self(state, batch)
            history.append(metrics)
        return state, history

    def logprobs(self, params, batch: Batch) -> tuple[np.ndarray, np.ndarray]:
        """No-grad (logp, entropy) [B, T] under ``params``, computed on the devices in the compute dtype."""
        if any(x.dtype != self.compute_dtype for x in jax.tree.leaves(params)):
            params = self.device_params(params)
        return self.inner.logprobs(params, batch)


def make_offload_train_step(
    model_cfg: Qwen3Config,
    algo_cfg: AlgoConfig,
    optim_cfg: OptimConfig,
    mesh: jax.sharding.Mesh | None = None,
    *,
    options: ModelOptions | None = None,
    rules: LogicalRules | None = None,
    compute_dtype: str | None = None,
) -> HostOffloadTrainStep:
    """``make_train_step`` with the fp32 master and AdamW on the host. ``options.param_dtype`` is the master's
    dtype (must be float32); the devices hold a ``compute_dtype`` copy (default ``options.compute_dtype``)."""
    if jax.process_count() > 1:
        raise ValueError(f"optim.offload=true runs in a single process; this job has {jax.process_count()} "
                         "processes. Drive all GPUs from one process (one node), or set optim.offload=false")
    options = options or ModelOptions()
    if options.param_dtype != "float32":
        raise ValueError(f"optim.offload=true keeps fp32 master weights on the host; set "
                         f"model.options.param_dtype=float32 (got {options.param_dtype})")
    compute_dtype = compute_dtype or options.compute_dtype
    inner = make_train_step(model_cfg, algo_cfg, optim_cfg, mesh,
                            options=dataclasses.replace(options, param_dtype=compute_dtype), rules=rules)
    _, abstract, _ = _abstract_params(inner)
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    decay = jax.tree.leaves(_decay_mask(abstract))
    leaves = []
    for (path, x), sh, d in zip(flat, jax.tree.leaves(inner.param_shardings), decay, strict=True):
        stacked = getattr(path[0], "key", None) == "layers" and x.ndim >= 1 and x.shape[0] == model_cfg.num_hidden_layers
        layer_sh = None
        if stacked:
            spec = tuple(sh.spec) + (None,) * (x.ndim - len(sh.spec))
            if spec[0] is not None:
                raise ValueError(f"optim.offload: {jax.tree_util.keystr(path)} is sharded over its layer axis "
                                 f"({sh.spec}); the host update streams whole layers. Map the layer axis to None "
                                 "in mesh.rules")
            layer_sh = NamedSharding(sh.mesh, P(*spec[1:]))
        leaves.append(_Leaf(tuple(x.shape), stacked, bool(d), sh, layer_sh))
    return HostOffloadTrainStep(inner, optim_cfg, jax.devices("cpu")[0], leaves, treedef)
