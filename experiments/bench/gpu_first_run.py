"""The first run on a GPU: one script, one table, under 8 minutes on one H100/H200.

Each check answers one question the CPU test suite cannot:

* ``allocator``: did the colocation allocator settings reach XLA? ``--allocator time_share | static`` takes the
  variables the trainer starts with from ``ColocationPlan.trainer_env`` (time_share: no preallocation, XLA's platform
  allocator; static: a memory-fraction cap) and applies them with ``runtime_env.apply_env`` before JAX creates its
  backend, as the trainer does; every later check, the MFU too, runs under them. Read back from the device: the
  memory the driver reports in use at start (the CUDA context; the default allocator would hold 75% of the GPU),
  ``memory_stats()['bytes_limit']`` against the fraction, and a 1 GiB array's memory returned to the driver
  (platform) or to XLA's pool (BFC) once deleted.
* ``attention``: cuDNN flash attention (``model.options.attention=cudnn``) against our blockwise kernel, outputs and
  gradients w.r.t. q, k, v, on right-padded rows with segment ids as the trainer passes them (bf16: cuDNN takes
  bf16/fp16 only; the fp32 row checks blockwise against the dense reference at HIGHEST precision).
* ``numerics``: the real update's loss, per-token log-probs and gradients (``make_train_step``, PPO-clip) with bf16
  compute on fp32 master weights against all-fp32 (HIGHEST precision), same random weights and batch.
* ``release``: a release/resume cycle of the train state (params, AdamW moments, step, rng): copied to the host
  and its device buffers deleted (device memory must drop by the state's size: to the driver with the platform
  allocator), put back (it must come back), bit-identical.
* ``engine``: the embedded engine (bf16 weight products, as an SGLang server) samples tokens; the trainer
  recomputes their log-probs; the gap with ``model.options.lm_head_fp32`` on and off.
* ``mfu``: ``gpu_step_mfu.py`` (run in this process) on the Qwen3-1.7B shape.
* ``overheads``: what the trainer's process holds outside its arrays (CUDA context, cuBLAS/cuDNN), against
  ``colocation.cuda_context_gb`` / ``xla_runtime_gb`` (``time_share`` only: the BFC pool hides it).

    python experiments/bench/gpu_first_run.py [--allocator time_share|static] [--out FILE.md]

Weights are random (seeded): log-prob gaps and bf16 errors of a trained model differ (sharper distributions).
Refuses to run without a GPU; ``--shape tiny --allow-cpu`` runs every check at a tiny shape on the CPU
(tests/test_gpu_first_run.py), where the GPU-only readings are ``n/a``. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import functools
import io
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import gpu_step_mfu  # no jax at import: the environment goes first

DEFAULT_OUT = BENCH.parent / "results" / "gpu_first_run.md"
GiB = 2**30
TOTAL_BUDGET_S = 480
# seconds per check on one H100/H200 (printed next to each check's wall time; most of it is compilation)
BUDGET_S = {"allocator": 15, "attention": 40, "numerics": 90, "release": 30, "engine": 90, "mfu": 170,
            "overheads": 5}
# Stated tolerances: first guesses, to revise after the first GPU run. Measured on the CPU: the tiny shape's errors (the
# test), and the 1.7B shape's bf16-vs-fp32 log-probs (28 layers, random weights, 72 tokens; forward only): mean 0.029,
# max 0.11 nats. The engine and the trainer round independently, so their gap may be ~1.4x that.
TOL = {
    "attn_bf16": 2e-2,  # max abs diff / max abs reference, outputs and each of dq, dk, dv
    "attn_fp32": 1e-5,
    "loss_rel": 2e-2,  # abs(loss_bf16 - loss_fp32) / max(abs(loss_fp32), 1)
    "logp_max": 0.4,  # nats, per token
    "logp_mean": 0.06,
    "grad_cos": 0.99,  # cosine of the bf16 and fp32 gradients
    "grad_norm": 0.05,  # abs(norm ratio - 1)
    "gap_mean": 0.08,  # engine vs trainer, fp32 LM head
    "gap_max": 0.5,
    "mfu_floor": 20.0,  # % of the stated peak: a sanity floor (a slow fallback path, not a tuning target)
    "start_frac": 0.10,  # device memory in use after the backend starts, without preallocation
    "returned": 0.9,  # share of a freed buffer's bytes that must come back
}


@dataclasses.dataclass(frozen=True)
class Shape:
    model: dict  # Qwen3Config fields (gpu_step_mfu.SHAPES)
    attn: tuple[int, int]  # (B, T) of the kernel comparison
    block: int  # blockwise attention block
    batch: tuple[int, int]  # (B, T) of the numerics batch (the engine check's recomputation pads to it)
    logits_chunk: int
    prompt: int  # engine prompt tokens (B prompts)
    new_tokens: int
    engine_len: int  # engine max_seq_len
    mfu_args: tuple[str, ...]
    probe_bytes: int  # the allocator check's array


SHAPES = {
    "1.7b": Shape(gpu_step_mfu.SHAPES["1.7b"], (2, 2048), 512, (4, 512), 256, 96, 65, 256,
                  ("--attention", "cudnn"), GiB),
    "tiny": Shape(gpu_step_mfu.SHAPES["tiny"], (2, 64), 16, (4, 32), 16, 10, 9, 64,
                  ("--allow-cpu", "--attention", "dot_product_attention", "--batch", "2", "--seq", "64",
                   "--steps", "2"), 1 << 20),
}


@dataclasses.dataclass
class Row:
    check: str
    result: str
    tolerance: str
    ok: bool | None  # None: not applicable here (a GPU reading on the CPU)

    @property
    def verdict(self) -> str:
        return "n/a" if self.ok is None else ("pass" if self.ok else "FAIL")


def allocator_env(mode: str, fraction: float) -> dict[str, str]:
    """The variables the trainer starts with under this colocation mode (``ColocationPlan.trainer_env``)."""
    from jaxrl_term.rollout.colocation import ColocationPlan

    need = {f.name: 0.0 for f in dataclasses.fields(ColocationPlan)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    return ColocationPlan(**{**need, "mode": mode, "xla_mem_fraction": fraction}).trainer_env()


def driver_memory(dev) -> tuple[int, int] | None:
    """(used, total) bytes of the device as its driver reports them (every process's memory; cuMemGetInfo on the
    primary context XLA uses), or nvidia-smi's; None off a GPU."""
    if dev.platform != "gpu":
        return None
    import ctypes

    ordinal = getattr(dev, "local_hardware_id", None) or 0
    try:
        cu = ctypes.CDLL("libcuda.so.1")
        d, ctx, free, total = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_size_t(), ctypes.c_size_t()
        if not (cu.cuInit(0) or cu.cuDeviceGet(ctypes.byref(d), ordinal)
                or cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), d)):
            try:
                if not cu.cuCtxPushCurrent_v2(ctx):
                    rc = cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
                    cu.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
                    if not rc:
                        return total.value - free.value, total.value
            finally:
                cu.cuDevicePrimaryCtxRelease_v2(d)
    except OSError:
        pass
    out = subprocess.run(["nvidia-smi", "-i", str(ordinal), "--query-gpu=memory.used,memory.total",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True, check=True).stdout
    used, total = (int(x) * 2**20 for x in out.split(","))
    return used, total


def settle(read, want_below, tries=20):
    """Poll ``read()`` until it is below ``want_below`` (frees may complete asynchronously), at most ~2 s."""
    value = read()
    for _ in range(tries):
        if value < want_below:
            break
        time.sleep(0.1)
        value = read()
    return value


def parallel(*fns):
    """Call the thunks on threads and return their results: XLA compiles outside the GIL, so a check's independent
    programs compile side by side (most of this script's time, on a GPU as on the CPU)."""
    with ThreadPoolExecutor(len(fns)) as pool:
        return [f.result() for f in [pool.submit(fn) for fn in fns]]


def rel_err(a, ref) -> tuple[float, float]:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    err = float(np.abs(a - ref).max())
    return err, err / max(float(np.abs(ref).max()), 1e-30)


# ------------------------------------------------------------------------------------------------ checks


def check_allocator(c) -> list[Row]:
    import jax.numpy as jnp

    env = " ".join(f"{k}={v}" for k, v in c.env.items())
    rows = [Row("allocator settings before JAX's backend", env or "(none)",
                "in os.environ before the backend existed", c.env_ok)]
    if c.start_mem is None:
        return rows + [Row("device memory: start, limit, return", "n/a on cpu (memory_stats() is None)", "-", None)]
    used0, total = c.start_mem
    if c.env.get("XLA_PYTHON_CLIENT_PREALLOCATE") == "false":
        rows.append(Row("device memory in use after the backend starts", f"{used0 / GiB:.2f} of {total / GiB:.0f} "
                        f"GiB ({100 * used0 / total:.1f}%)", f"< {100 * TOL['start_frac']:.0f}% (no preallocation)",
                        used0 < TOL["start_frac"] * total))
    if "XLA_PYTHON_CLIENT_MEM_FRACTION" in c.env:
        frac, limit = float(c.env["XLA_PYTHON_CLIENT_MEM_FRACTION"]), c.dev.memory_stats()["bytes_limit"]
        rows.append(Row("XLA pool limit / GPU memory", f"{limit / total:.3f} (bytes_limit {limit})",
                        f"{frac:.3f} +- 0.02", abs(limit / total - frac) <= 0.02))
    read, where = memory_reader(c)
    before = read()
    x = jnp.ones((c.shape.probe_bytes // 4,), jnp.float32).block_until_ready()
    held = read() - before
    x.delete()
    back = (before + held - settle(read, before + (1 - TOL["returned"]) * c.shape.probe_bytes)) / c.shape.probe_bytes
    rows.append(Row(f"a {c.shape.probe_bytes / 2**20:,.0f} MiB array's memory back {where} once deleted",
                    f"held {held / GiB:.2f} GiB, returned {100 * back:.0f}%", f">= {100 * TOL['returned']:.0f}%",
                    held >= TOL["returned"] * c.shape.probe_bytes and back >= TOL["returned"]))
    return rows


def memory_reader(c):
    """(read() -> bytes, where): the driver's count with the platform allocator (memory a colocated server can
    use: XLA's ``memory_stats()`` is None then), else XLA's ``bytes_in_use`` (the BFC pool keeps freed memory)."""
    if c.env.get("XLA_PYTHON_CLIENT_ALLOCATOR") == "platform":
        return (lambda: driver_memory(c.dev)[0]), "to the driver"
    return (lambda: c.dev.memory_stats()["bytes_in_use"]), "to XLA's pool (bytes_in_use)"


def check_attention(c) -> list[Row]:
    import jax
    import jax.numpy as jnp

    from jaxrl_term.model.qwen3 import ModelOptions, attend, attention_inputs

    cfg = c.shape.model
    (b, t), nq, nkv, d = c.shape.attn, cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    lengths = np.array([t, (3 * t) // 4 + 3, t // 2, t // 3 + 1][:b])
    mask = (np.arange(t)[None] < lengths[:, None]).astype(np.int32)  # right-padded rows (cuDNN: no packing)
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v = (jax.random.normal(kk, (b, t, n, d), jnp.float32) for kk, n in zip(ks, (nq, nkv, nkv)))
    do = jax.random.normal(ks[3], (b, t, nq, d), jnp.float32) * mask[:, :, None, None]

    def run(kind, dtype):
        opts = ModelOptions(attention=kind, attention_block=c.shape.block, compute_dtype=dtype)
        a = attention_inputs(jnp.asarray(mask), jnp.asarray(mask), kind)  # segment ids as the trainer's: 1 / 0

        @jax.jit
        def f(q, k, v, do):
            o, vjp = jax.vjp(lambda *x: attend(*x, a, opts, d ** -0.5), q, k, v)
            return (o * mask[:, :, None, None],) + vjp(do.astype(dtype))

        with jax.default_matmul_precision("highest") if dtype == "float32" else contextlib.nullcontext():
            return jax.device_get(f(q.astype(dtype), k.astype(dtype), v.astype(dtype), do))

    rows, cases = [], (("bfloat16", c.fast_kind, TOL["attn_bf16"]), ("float32", "xla", TOL["attn_fp32"]))
    outs = parallel(*(lambda kd=kind, dt=dtype: run(kd, dt) for dtype, ref, _ in cases for kind in (ref, "blockwise")))
    for i, (dtype, ref_kind, tol) in enumerate(cases):
        for name, a, r in zip(("output", "dq", "dk", "dv"), outs[2 * i + 1], outs[2 * i]):
            err, rel = rel_err(a, r)
            rows.append(Row(f"attention {dtype}: blockwise vs {ref_kind}, {name}", f"max abs diff {err:.2e}, "
                            f"rel {rel:.2e}", f"rel <= {tol:.0e}", bool(rel <= tol)))
    return rows


def make_batch(c, rollout_logp=None):
    from jaxrl_term.rl.batch import Batch

    (b, t), rng = c.shape.batch, np.random.RandomState(0)
    lengths = np.array([t, (3 * t) // 4, t // 2 + 5, t // 3 + 2][:b])
    seg = (np.arange(t)[None] < lengths[:, None]).astype(np.int32)
    mask = (seg * (np.arange(t)[None] >= t // 4)).astype(np.float32)  # a prompt quarter, then policy tokens
    lp = np.zeros((b, t), np.float32) if rollout_logp is None else (rollout_logp * mask).astype(np.float32)
    return Batch(tokens=rng.randint(0, c.shape.model["vocab_size"], (b, t)).astype(np.int32) * seg,
                 positions=np.tile(np.arange(t, dtype=np.int32), (b, 1)), segment_ids=seg, loss_mask=mask,
                 advantages=np.repeat(rng.randn(b, 1), t, 1).astype(np.float32) * mask, rollout_logp=lp, old_logp=lp,
                 ref_logp=np.zeros_like(lp), fresh=np.ones_like(lp))


def check_numerics(c) -> list[Row]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxrl_term.model.qwen3 import ModelOptions, Qwen3, Qwen3Config
    from jaxrl_term.rl.step import AlgoConfig, OptimConfig, make_train_step

    c.model_cfg = Qwen3Config(**c.shape.model, rope_theta=1e6)
    c.opts = ModelOptions(param_dtype="float32", compute_dtype="bfloat16", remat="full", attention=c.fast_kind,
                          attention_block=c.shape.block, lm_head_fp32=True, logits_chunk=c.shape.logits_chunk)
    ref_opts = dataclasses.replace(c.opts, compute_dtype="float32", attention="xla", precision="highest")
    c.algo, c.optim = AlgoConfig(eps_low=0.2, eps_high=0.28), OptimConfig(lr=1e-6, weight_decay=0.0, grad_clip=1.0)
    c.ts = make_train_step(c.model_cfg, c.algo, c.optim, options=c.opts)
    ts_ref = make_train_step(c.model_cfg, c.algo, c.optim, options=ref_opts)
    # one program for every parameter (eagerly, each shape's random init compiles on its own)
    c.params = jax.jit(lambda: nnx.to_pure_dict(nnx.state(Qwen3(c.model_cfg, c.opts, rngs=nnx.Rngs(0)), nnx.Param)))()
    highest = functools.partial(jax.default_matmul_precision, "highest")

    def logp_and_compile(ts, ctx):  # the log-probs, and the gradient program compiled on a batch of the same shape
        with ctx():
            ts._grad_step(c.params, ts.place_batch(make_batch(c)))
            return ts.logprobs(c.params, make_batch(c))[0]

    lp_ref, lp = parallel(lambda: logp_and_compile(ts_ref, highest),
                          lambda: logp_and_compile(c.ts, contextlib.nullcontext))
    c.batch = make_batch(c, lp_ref)  # on-policy: the ratio is 1 under fp32
    with highest():
        g_ref, _, m_ref = ts_ref._grad_step(c.params, ts_ref.place_batch(c.batch))
    g, _, m = c.ts._grad_step(c.params, c.ts.place_batch(c.batch))
    mask = c.batch.loss_mask > 0
    dlp = np.abs(lp - lp_ref)[mask]
    dot, n1, n2 = jax.device_get(jax.jit(lambda a, b: (
        sum(jnp.sum(x * y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))),  # no dot: no TF32 on a GPU
        sum(jnp.sum(x * x) for x in jax.tree.leaves(a)), sum(jnp.sum(y * y) for y in jax.tree.leaves(b))))(g, g_ref))
    del g, g_ref
    loss, loss_ref = float(m["loss"]), float(m_ref["loss"])
    cos, ratio = float(dot / np.sqrt(n1 * n2)), float(np.sqrt(n1 / n2))
    dloss = abs(loss - loss_ref) / max(abs(loss_ref), 1.0)
    return [Row("bf16 compute / fp32 master vs fp32: loss", f"{loss:.6f} vs {loss_ref:.6f} (rel {dloss:.1e})",
                f"rel <= {TOL['loss_rel']:.0e}", dloss <= TOL["loss_rel"]),
            Row("bf16 vs fp32: per-token log-prob abs diff", f"mean {dlp.mean():.2e}, max {dlp.max():.2e} nats "
                f"({dlp.size} tokens)", f"mean <= {TOL['logp_mean']}, max <= {TOL['logp_max']}",
                bool(dlp.mean() <= TOL["logp_mean"] and dlp.max() <= TOL["logp_max"])),
            Row("bf16 vs fp32: gradients", f"cosine {cos:.5f}, norm ratio {ratio:.4f}",
                f"cos >= {TOL['grad_cos']}, abs(ratio - 1) <= {TOL['grad_norm']}",
                cos >= TOL["grad_cos"] and abs(ratio - 1) <= TOL["grad_norm"])]


def check_release(c) -> list[Row]:
    import jax
    import jax.numpy as jnp

    # params, AdamW moments, step, rng: what stays on the device between updates (its own buffers: jit may forward
    # the params it was given, and those are the engine check's)
    state = c.ts.init_state(jax.tree.map(jnp.copy, c.params))
    leaves = jax.block_until_ready(jax.tree.leaves(state))
    nbytes = sum(x.nbytes for x in leaves)
    read, where = memory_reader(c) if c.start_mem else (lambda: 0, "")
    m0 = read()
    host = [np.array(x) for x in leaves]  # copies (on a CPU, device_get may alias the buffers deleted next)
    for x in leaves:
        x.delete()
    m1 = settle(read, m0 - TOL["returned"] * nbytes + 1) if c.start_mem else 0
    back = jax.block_until_ready(jax.device_put(jax.tree.unflatten(jax.tree.structure(state), host),
                                                c.ts.state_shardings))
    m2 = read()
    same = all(a.dtype == b.dtype and a.shape == b.shape and np.array_equal(
        np.ascontiguousarray(a).reshape(-1).view(np.uint8), np.ascontiguousarray(b).reshape(-1).view(np.uint8))
        for a, b in zip(host, jax.device_get(jax.tree.leaves(back))))
    rows = [Row("release/resume: train state bit-identical after host and back", f"{same} ({nbytes / 2**20:,.1f} MiB)",
                "identical", same)]
    if not c.start_mem:
        return rows + [Row("release/resume: device memory drops and comes back", "n/a on cpu", "-", None)]
    drop, rise = (m0 - m1) / nbytes, (m2 - m1) / nbytes
    return rows + [Row(f"release/resume: device memory drops and comes back ({where})",
                       f"-{(m0 - m1) / GiB:.2f} / +{(m2 - m1) / GiB:.2f} GiB ({100 * drop:.0f}% / {100 * rise:.0f}% "
                       "of the state)", f">= {100 * TOL['returned']:.0f}% each way",
                       drop >= TOL["returned"] and rise >= TOL["returned"])]


def check_engine(c) -> list[Row]:
    from jaxrl_term.rl.step import make_train_step
    from jaxrl_term.rollout.engine import SamplingParams
    from jaxrl_term.rollout.jax_engine import JaxEngine, JaxEngineConfig

    (b, t), s = c.shape.batch, c.shape
    rng = np.random.RandomState(1)
    prompts = [rng.randint(0, s.model["vocab_size"], s.prompt).tolist() for _ in range(b)]
    # the fp32 LM head on (the presets) and off: trainer and engine alike, as model.options.lm_head_fp32 sets both
    trainers = {True: c.ts, False: make_train_step(c.model_cfg, c.algo, c.optim,
                                                   options=dataclasses.replace(c.opts, lm_head_fp32=False))}
    # bf16 weight products as an SGLang server; stacked layers (one scanned program, quick to compile); one prefill
    # and one decode call per request (the first token comes from the prefill)
    cfg = JaxEngineConfig(max_batch=b, max_seq_len=s.engine_len, prefill_chunk=s.engine_len, min_bucket=s.engine_len,
                          decode_steps=s.new_tokens - 1, matmul_dtype="bfloat16", unstack_layers=False,
                          fuse_projections=False, out_major_weights=False)
    engines = {fp32: JaxEngine(ts.model(c.params), config=cfg) for fp32, ts in trainers.items()}

    async def sample():  # both engines at once: each compiles on its own thread
        sp = [SamplingParams(temperature=1.0, max_new_tokens=s.new_tokens, seed=i) for i in range(b)]
        gens = await asyncio.gather(*(e.generate(p, q) for e in engines.values() for p, q in zip(prompts, sp)))
        return {fp32: gens[i * b:(i + 1) * b] for i, fp32 in enumerate(engines)}

    try:
        gens, _ = parallel(lambda: asyncio.run(sample()), lambda: trainers[False].logprobs(c.params, make_batch(c)))
    finally:
        for e in engines.values():
            e.close()
    rows = []
    for fp32, ts in trainers.items():
        seqs = [p + g.output_ids for p, g in zip(prompts, gens[fp32])]
        tokens, seg = np.zeros((b, t), np.int32), np.zeros((b, t), np.int32)
        for k, q in enumerate(seqs):
            tokens[k, :len(q)], seg[k, :len(q)] = q, 1
        lp = ts.logprobs(c.params, make_batch(c).replace(tokens=tokens, segment_ids=seg))[0]  # the trainer's
        gap = np.concatenate([lp[k, s.prompt:len(q)] - np.asarray(g.output_logprobs)
                              for k, (q, g) in enumerate(zip(seqs, gens[fp32]))])
        a = np.abs(gap)
        ok = bool(np.isfinite(gap).all() and (not fp32 or (a.mean() <= TOL["gap_mean"] and a.max() <= TOL["gap_max"])))
        rows.append(Row(f"engine (bf16 products) vs trainer log-prob gap, {'fp32' if fp32 else 'bf16'} LM head",
                        f"mean {a.mean():.2e}, max {a.max():.2e} nats ({a.size} tokens)",
                        f"mean <= {TOL['gap_mean']}, max <= {TOL['gap_max']}" if fp32 else "finite (reported)", ok))
    return rows


def check_mfu(c) -> list[Row]:
    c.params = c.batch = c.ts = None  # the step gets the device to itself
    out = Path(tempfile.mkdtemp()) / "gpu_step_mfu.md"
    argv, sys.argv = sys.argv, ["gpu_step_mfu.py", "--shape", c.args.shape, "--out", str(out), *c.shape.mfu_args]
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            gpu_step_mfu.main()
    finally:
        sys.argv = argv
    lines = [ln for ln in buf.getvalue().splitlines() if ln.startswith("|")]
    c.mfu_text = "\n".join(lines)
    cells = dict(zip([x.strip() for x in lines[0].strip("|").split("|")],
                     [x.strip() for x in lines[2].strip("|").split("|")]))
    mfu, vs_gemm = cells["MFU vs stated peak"], cells["MFU vs measured bf16 GEMM"]
    res = (f"{mfu} of the stated peak, {vs_gemm} of a measured GEMM ({cells['step s']} s/step, "
           f"{cells['tokens/s']} tokens/s, {cells['batch x seq']}, {cells['attention']})")
    if c.dev.platform != "gpu":
        return [Row("update step MFU (gpu_step_mfu.py)", res + "; cpu: numbers mean nothing", "ran", True)]
    return [Row(f"update step MFU (gpu_step_mfu.py, Qwen3-{c.args.shape} shape)", res,
                f">= {TOL['mfu_floor']:.0f}% of the stated peak",
                float(mfu.rstrip("%")) >= TOL["mfu_floor"])]


def check_overheads(c) -> list[Row]:
    """The trainer's memory outside its arrays, after cuBLAS, cuDNN and the compiled programs have loaded."""
    import jax

    mem = driver_memory(c.dev)
    if mem is None:
        return [Row("trainer overheads: CUDA context, libraries", "n/a on cpu", "-", None)]
    if c.env.get("XLA_PYTHON_CLIENT_ALLOCATOR") != "platform":
        return [Row("trainer overheads: CUDA context, libraries", "n/a with the BFC pool (run --allocator "
                    "time_share)", "-", None)]
    from jaxrl_term.rollout.colocation import Overheads

    o, live = Overheads(), sum(x.nbytes for x in jax.live_arrays())
    ctx, rest = c.start_mem[0] / 1e9, (mem[0] - live) / 1e9
    return [Row("trainer CUDA context at backend start (GB)", f"{ctx:.2f}", f"<= cuda_context_gb {o.cuda_context_gb}",
                ctx <= o.cuda_context_gb),
            Row("trainer memory outside its arrays after every check (GB)", f"{rest:.2f} (context + cuBLAS/cuDNN + "
                "runtime)", f"<= cuda_context_gb + xla_runtime_gb = {o.cuda_context_gb + o.xla_runtime_gb}",
                rest <= o.cuda_context_gb + o.xla_runtime_gb)]


CHECKS = {"allocator": check_allocator, "attention": check_attention, "numerics": check_numerics,
          "release": check_release, "engine": check_engine, "mfu": check_mfu, "overheads": check_overheads}
NEEDS = {"release": "numerics", "engine": "numerics"}  # they reuse its model, params and batch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--allocator", choices=("time_share", "static"), default="time_share")
    ap.add_argument("--mem-fraction", type=float, default=0.85, help="static: XLA_PYTHON_CLIENT_MEM_FRACTION")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1.7b")
    ap.add_argument("--allow-cpu", action="store_true", help="run on the CPU (with --shape tiny: checks the script)")
    ap.add_argument("--skip", default="", help=f"comma-separated checks to leave out: {','.join(CHECKS)}")
    ap.add_argument("--out", default=None, help=f"markdown report (default on a GPU: {DEFAULT_OUT})")
    args = ap.parse_args()

    # Environment before backend (ARCHITECTURE.md, principle 12): nothing above touched a device.
    from jaxrl_term.runtime_env import apply_env, backend_exists

    env = allocator_env(args.allocator, args.mem_fraction)
    started = backend_exists()
    apply_env(env, who="gpu_first_run", override=True)  # the flag decides, not a value left in the shell
    env_ok = not started and all(os.environ.get(k) == v for k, v in env.items())

    import jax

    dev = jax.devices()[0]
    if dev.platform != "gpu" and not (args.allow_cpu and args.shape == "tiny"):
        raise SystemExit(f"no GPU: JAX's first device is {dev.platform} ({dev.device_kind}); this script checks a GPU "
                         "(pass --shape tiny --allow-cpu to check the script itself on a CPU)")
    gpu = dev.platform == "gpu"
    c = argparse.Namespace(args=args, env=env, env_ok=env_ok, dev=dev, shape=SHAPES[args.shape],
                           fast_kind="cudnn" if gpu else "dot_product_attention", start_mem=driver_memory(dev),
                           mfu_text="")
    skip = {s for s in args.skip.split(",") if s}
    if skip - set(CHECKS):
        raise SystemExit(f"--skip {args.skip}: unknown checks {sorted(skip - set(CHECKS))}; use {', '.join(CHECKS)}")
    rows, times, t_all = [], {}, time.perf_counter()
    for name, fn in CHECKS.items():
        if name in skip or NEEDS.get(name) in skip:
            continue
        t0, cpu0 = time.perf_counter(), time.process_time()
        try:
            rows += fn(c)
        except Exception as e:  # noqa: BLE001 - one broken check must not hide the others' results
            traceback.print_exc()
            rows.append(Row(name, f"error: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}",
                            "runs", False))
        times[name] = time.perf_counter() - t0
        print(f"[{name}] {times[name]:.1f} s, {time.process_time() - cpu0:.1f} s of CPU (GPU budget "
              f"{BUDGET_S[name]} s)", file=sys.stderr, flush=True)
    total = time.perf_counter() - t_all
    rows.append(Row("total wall time", f"{total:.0f} s", f"< {TOTAL_BUDGET_S} s on one GPU",
                    total < TOTAL_BUDGET_S if gpu else None))

    table = "| check | result | tolerance | pass |\n| --- | --- | --- | --- |\n" + "\n".join(
        "| " + " | ".join(x.replace("|", "\\|") for x in (r.check, r.result, r.tolerance, r.verdict)) + " |"
        for r in rows)
    failed = [r.check for r in rows if r.ok is False]
    timing = ", ".join(f"{k} {v:.1f} s ({BUDGET_S[k]})" for k, v in times.items())
    head = (f"jax {jax.__version__} on {dev.device_kind} ({dev.platform}), {platform.machine()}; "
            f"{datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; shape {args.shape}; allocator "
            f"{args.allocator} ({' '.join(f'{k}={v}' for k, v in env.items())}); random weights (seed 0)")
    text = (f"# First GPU run\n\n{head}\n\nReproduce: `python experiments/bench/gpu_first_run.py --allocator "
            f"{args.allocator}{' --shape tiny --allow-cpu' if not gpu else ''}`\n\n{table}\n\n"
            f"Wall time per check (GPU budget in brackets, s): {timing}.\n\n"
            f"{len(rows) - len(failed)} of {len(rows)} rows pass or do not apply"
            f"{'; FAILED: ' + ', '.join(failed) if failed else ''}.\n")
    if c.mfu_text:
        text += f"\n## gpu_step_mfu.py\n\n{c.mfu_text}\n"
    print(text)
    out = args.out or (DEFAULT_OUT if gpu else None)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
        print(f"written to {out}")
    else:
        print("(CPU check run: nothing written; pass --out to write the report)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
