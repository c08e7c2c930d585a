"""Fit planner: ``python -m jaxrl_term.plan +experiment=NAME [key=value ...]``.

Same Hydra config as ``train``; needs no weights, no data and no GPU. It fakes the preset's cluster as that
many CPU devices (``--xla_force_host_platform_device_count``), builds the preset's mesh and the *real*
jitted train step, AOT-compiles it for the preset's largest batch (``jit(...).lower(abstract state, abstract
batch).compile()``) and reads XLA's own buffer assignment (``memory_analysis()``): per device parameters,
optimizer state, gradient buffers, temporaries and peak, against the trainer's share of the GPU. It then
sizes every SGLang server from the same colocation numbers the launcher uses (``rollout.colocation``):
weights and KV-cache tokens per GPU against the context length times the concurrency the server must serve.
The verdict is FITS only with >= 10% headroom, and names the largest term when it does not fit.

The compile runs on CPU, so GPU-only kernels are planned with their CPU stand-in of the same memory order:
``attention: cudnn`` (fused flash attention) is compiled as ``blockwise`` (our flash attention in JAX).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
import time
from pathlib import Path

GB = 1e9
HEADROOM = 0.10  # FITS needs peak <= (1 - HEADROOM) x budget


# ------------------------------------------------------------------------------------------- config


def compose(overrides: list[str]):
    """The train config for ``overrides`` (Hydra's compose API: no output dir, no logging set-up)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from jaxrl_term.config import register

    register()
    conf_dir = str(Path(__file__).resolve().parents[1] / "conf")
    with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
        return hydra_compose("config", overrides=list(overrides))


def cluster_devices(cfg) -> int:
    """Devices the preset runs on: nodes x GPUs per node, or the mesh's fixed size on CPU presets."""
    cl = cfg.trainer.cluster
    if cl.gpus_per_node > 0:
        return int(cl.nodes * cl.gpus_per_node)
    sizes = [int(v) for v in cfg.mesh.shape.values()]
    return max(1, math.prod(s for s in sizes if s > 0))


def fake_devices(n: int) -> None:
    """Ask XLA for ``n`` CPU devices (``runtime_env.apply_env``: refused once a backend exists)."""
    from jaxrl_term.runtime_env import apply_env

    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    apply_env({"XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={n}".strip(), "JAX_PLATFORMS": "cpu"},
              who="plan", override=True)


# ------------------------------------------------------------------------------------------ training


@dataclasses.dataclass
class TrainPlan:
    devices: int
    mesh: dict[str, int]
    batch: tuple[int, int, int]  # [M, b, T]
    rows: int  # trajectories per step
    attention: str  # as compiled
    params_gb: float
    optimizer_gb: float
    grad_accumulator_gb: float
    microbatch_grads_gb: float
    temporaries_gb: float  # XLA temp buffers (activations, gradient buffers, gathered weights, ...)
    peak_gb: float  # arguments + outputs - donated aliases + temporaries
    flops: float | None  # per device per step, from the compiled cost analysis
    model_flops: float  # per device per step, 6 N T + attention (the MFU convention)
    compile_s: float
    host_gb: float = 0.0  # per node, host memory the optimizer needs (optim.offload)

    def terms(self) -> dict[str, float]:
        other = self.temporaries_gb - self.grad_accumulator_gb - self.microbatch_grads_gb
        return {"parameters": self.params_gb, "optimizer state": self.optimizer_gb,
                "gradient accumulator": self.grad_accumulator_gb, "microbatch gradients": self.microbatch_grads_gb,
                "activations and other temporaries": max(other, 0.0)}


def _per_device_bytes(tree) -> float:
    """Bytes one device holds of a pytree of ShapeDtypeStructs / arrays with shardings (max over devices)."""
    import jax
    import numpy as np

    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
        total += int(np.prod(shape)) * np.dtype(leaf.dtype).itemsize
    return float(total)


def planned_options(opts):
    """The options compiled on CPU: GPU-only kernels replaced by their CPU stand-in of the same memory order."""
    if opts.attention == "cudnn":
        return dataclasses.replace(opts, attention="blockwise")
    return opts


def step_batch_shape(cfg, shards: int, microbatches: int) -> tuple[int, int, int, int]:
    """(M, b, T, rows): the largest batch the preset's step sees. T is the length bucket of a full context."""
    from jaxrl_term.rl.batch import microbatch_layout, pick_bucket

    rows = int(cfg.trainer.groups_per_step) * int(cfg.algo.group_size)
    t = pick_bucket(int(cfg.agent.max_context_tokens), list(cfg.trainer.buckets))
    m, b = microbatch_layout(rows, shards, microbatches)
    return m, b, t, rows


def abstract_batch(ts, m: int, b: int, t: int):
    import jax
    import jax.numpy as jnp

    from jaxrl_term.rl.batch import Batch

    def sds(dtype):
        return jax.ShapeDtypeStruct((m, b, t), dtype, sharding=ts.batch_sharding)

    ints = ("tokens", "positions", "segment_ids")
    return Batch(**{f.name: sds(jnp.int32 if f.name in ints else jnp.float32) for f in dataclasses.fields(Batch)})


def compile_step(ts, m: int, b: int, t: int):
    """AOT-compile the real jitted update for [M, b, T] (abstract state and batch: nothing is allocated)."""
    return ts._step.lower(ts.abstract_state(), abstract_batch(ts, m, b, t)).compile()


def memory_of(compiled) -> dict[str, float]:
    """XLA's per-device buffer assignment of a compiled step, in bytes."""
    ma = compiled.memory_analysis()
    out = {k: float(getattr(ma, f"{k}_size_in_bytes")) for k in ("argument", "output", "alias", "temp")}
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


def _cost_flops(compiled) -> float:
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    return float(ca.get("flops", 0.0))


def compiled_flops(arch, opts, algo, optim, mesh, rules, m: int, b: int, t: int) -> float:
    """Per-device FLOPs of one step from XLA's cost analysis.

    XLA counts a while-loop body once, whatever its trip count, and the step is loops all the way down
    (microbatches, layers, logit chunks, attention blocks). So the step is compiled four more times with every
    loop unrolled (remat recomputation included), at 1 or 2 layers and 1 or 2 microbatches, with dense attention
    (the FLOPs of the full score matrix: an upper bound for a causal flash kernel), and the per-layer /
    per-microbatch / per-optimizer-layer costs are solved from the four totals:
    f(L, M) = opt0 + L opt1 + M (head + L layer).
    """
    from jaxrl_term.rl.step import make_train_step

    flat = dataclasses.replace(opts, attention="xla", unroll=True)

    def f(layers: int, micro: int) -> float:
        a = dataclasses.replace(arch, num_hidden_layers=layers)
        o = dataclasses.replace(flat, remat_groups=layers if opts.remat_groups else 0)  # groups of one layer
        ts = make_train_step(a, dataclasses.replace(algo, microbatches=micro), optim, mesh, options=o, rules=rules)
        return _cost_flops(compile_step(ts, micro, b, t))

    f11, f21, f12, f22 = f(1, 1), f(2, 1), f(1, 2), f(2, 2)
    layer = (f22 - f21) - (f12 - f11)
    micro1 = f12 - f11  # head + one layer
    opt1 = (f21 - f11) - layer
    opt0 = f11 - opt1 - micro1
    return opt0 + arch.num_hidden_layers * opt1 + m * (micro1 - layer + arch.num_hidden_layers * layer)


def model_flops(arch, tokens_per_device: float, t: int) -> float:
    """6 N T for the dense weights plus causal attention (12 L T H_attn per token / 2), per device."""
    # matmul weights: the layers and the LM head (the embedding lookup is a gather, not a matmul)
    n = arch.num_params() - (0 if arch.tie_word_embeddings else arch.vocab_size * arch.hidden_size)
    attn = 6 * arch.num_hidden_layers * arch.num_attention_heads * arch.head_dim * t  # fwd+bwd, causal half
    return tokens_per_device * (6 * n + attn)


def plan_training(cfg, *, flops: bool = True) -> TrainPlan:
    import jax

    from jaxrl_term.config import model_arch
    from jaxrl_term.parallel.mesh import LogicalRules, make_mesh
    from jaxrl_term.rl.step import make_train_step
    from omegaconf import OmegaConf

    n = cluster_devices(cfg)
    if jax.device_count() < n:
        raise RuntimeError(f"the planner needs {n} devices but JAX has {jax.device_count()}; it must set "
                           "XLA_FLAGS before JAX starts (run it as `python -m jaxrl_term.plan`)")
    arch, opts = model_arch(cfg)
    opts = planned_options(opts)
    mesh = make_mesh(OmegaConf.to_container(cfg.mesh.shape), devices=jax.devices()[:n])
    rules = LogicalRules.from_mapping(OmegaConf.to_container(cfg.mesh.rules) if cfg.mesh.rules else None)
    algo, optim = OmegaConf.to_object(cfg.algo), OmegaConf.to_object(cfg.optim)
    algo = dataclasses.replace(algo, temperature=cfg.rollout.temperature)
    host_gb = 0.0
    if optim.offload:
        # fp32 master + AdamW on the host: the devices run the gradient program, one microbatch per call
        # (microbatch gradients are summed on the host), and hold the compute-dtype copy of the parameters
        from jaxrl_term.rl.offload import make_offload_train_step

        ots = make_offload_train_step(arch, algo, optim, mesh, options=opts, rules=rules)
        ts = ots.inner
        m, b, t, rows = step_batch_shape(cfg, ts.shards, algo.microbatches)
        t0 = time.monotonic()
        compiled = ts._grad_step.lower(ts.abstract_state().params, abstract_batch(ts, 1, b, t)).compile()
        compile_s = time.monotonic() - t0
        mem = memory_of(compiled)
        params, optimizer, acc = ots.device_param_bytes_per_device(), 0.0, 0.0
        micro_grads = _per_device_bytes(jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s.shape, "float32", sharding=s.sharding), ts.abstract_state().params))
        host_gb = (ots.host_bytes() + (4 * ots.num_params() if m > 1 else 0)) / GB  # + the host accumulator
    else:
        ts = make_train_step(arch, algo, optim, mesh, options=opts, rules=rules)
        m, b, t, rows = step_batch_shape(cfg, ts.shards, algo.microbatches)
        t0 = time.monotonic()
        compiled = compile_step(ts, m, b, t)
        compile_s = time.monotonic() - t0
        mem = memory_of(compiled)
        state = ts.abstract_state()
        params = _per_device_bytes(state.params)
        optimizer = _per_device_bytes(state.opt_state)
        acc = _per_device_bytes(jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, "float32", sharding=s.sharding),
                                             state.params)) if m > 1 else 0.0
        micro_grads = ts.grad_bytes_per_device()
    fl = compiled_flops(arch, opts, algo, optim, mesh, rules, m, b, t) if flops else None
    tokens = m * b * t / n
    return TrainPlan(devices=n, mesh=dict(mesh.shape), batch=(m, b, t), rows=rows, attention=opts.attention,
                     params_gb=params / GB, optimizer_gb=optimizer / GB, grad_accumulator_gb=acc / GB,
                     microbatch_grads_gb=micro_grads / GB, temporaries_gb=mem["temp"] / GB,
                     peak_gb=mem["peak"] / GB, flops=fl, model_flops=model_flops(arch, tokens, t),
                     compile_s=compile_s, host_gb=host_gb)


# ------------------------------------------------------------------------------------------- verdict


def verdict(train: TrainPlan, colo, servers, cfg_host_memory_gb: float = 0.0) -> tuple[bool, list[str]]:
    """(fits, reasons). On GPUs: the step within its budget (XLA's cap, or what a released server leaves), and
    >= 10% of every GPU free in every phase of a step (update, rollout, weight sync), runtime overheads counted;
    every server with room for its weights and at least one full context of KV cache. On CPU presets: 10%
    headroom under the host memory."""
    reasons = []
    budget = colo.trainer_budget_gb
    largest = max(train.terms().items(), key=lambda kv: kv[1])
    if colo.mode == "cpu":
        if train.peak_gb > (1 - HEADROOM) * budget:
            reasons.append(f"training peak {train.peak_gb:.1f} GB > {(1 - HEADROOM) * budget:.1f} GB (90% of "
                           f"{budget:.1f} GB); largest term: {largest[0]} {largest[1]:.1f} GB")
    else:
        need = train.peak_gb + colo.overheads.xla_runtime_gb
        if need > budget:
            reasons.append(f"training peak {train.peak_gb:.1f} GB + XLA runtime {colo.overheads.xla_runtime_gb:.1f} GB "
                           f"> the trainer's budget {budget:.1f} GB ({colo.describe_trainer()}); largest term: "
                           f"{largest[0]} {largest[1]:.1f} GB")
        for ph in colo.phases(train.peak_gb, train.params_gb + train.optimizer_gb):
            if ph.slack < HEADROOM:
                big = max(ph.terms.items(), key=lambda kv: kv[1])
                reasons.append(f"{ph.name}: {ph.total_gb:.1f} of {ph.gpu_gb:.0f} GB per GPU ({ph.slack:.0%} free, "
                               f"needs >= {HEADROOM:.0%}); largest term: {big[0]} {big[1]:.1f} GB"
                               + (f" (of which {largest[0]} {largest[1]:.1f} GB)" if big[0] == "train step peak"
                                  else ""))
    host_mem = cfg_host_memory_gb
    if train.host_gb and host_mem and train.host_gb > (1 - HEADROOM) * host_mem:
        reasons.append(f"the host optimizer needs {train.host_gb:.0f} GB of host memory per node, more than 90% of "
                       f"trainer.cluster.host_memory_gb={host_mem:.0f}")
    for s in servers:
        if s.kv_tokens < s.context:
            reasons.append(f"SGLang server {s.name}: KV cache holds {s.kv_tokens:,} tokens, less than one "
                           f"{s.context:,}-token context (weights {s.weights_gb:.1f} GB of a {s.static_gb:.1f} GB "
                           "static budget per GPU)")
    return not reasons, reasons


# ---------------------------------------------------------------------------------------------- main


def run(overrides: list[str], *, flops: bool = True, as_json: str | None = None) -> dict:
    from jaxrl_term.config import format_problems, preflight
    from jaxrl_term.rollout.colocation import colocation_plan, server_plans

    cfg = compose(overrides)
    problems = preflight(cfg, need_paths=False, training=False)
    if problems:
        print(format_problems(problems), file=sys.stderr)
        raise SystemExit(2)
    n = cluster_devices(cfg)
    fake_devices(n)
    train = plan_training(cfg, flops=flops)
    colo = colocation_plan(cfg)
    servers = server_plans(cfg)
    fits, reasons = verdict(train, colo, servers, float(cfg.trainer.cluster.host_memory_gb))
    phases = colo.phases(train.peak_gb, train.params_gb + train.optimizer_gb)
    out = {"train": dataclasses.asdict(train), "colocation": dataclasses.asdict(colo),
           "phases": [{"name": p.name, "terms": p.terms, "total_gb": p.total_gb, "slack": p.slack} for p in phases],
           "servers": [{**dataclasses.asdict(s), "full_contexts": s.full_contexts} for s in servers],
           "fits": fits, "reasons": reasons}
    report(cfg, train, colo, servers, fits, reasons)
    if as_json:
        Path(as_json).write_text(json.dumps(out, indent=2))
    return out


def report(cfg, train: TrainPlan, colo, servers, fits: bool, reasons: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=120)
    cl = cfg.trainer.cluster
    m, b, t = train.batch
    con.print(f"[bold]plan[/bold] model {cfg.model.name} on {train.devices} devices "
              f"({cl.nodes} x {cl.gpus_per_node} {cl.gpu}), mesh {train.mesh}, attention {train.attention}")
    con.print(f"batch [{m}, {b}, {t}] (microbatches, rows per microbatch, tokens): {train.rows} trajectories "
              f"padded to {m * b} rows; compiled in {train.compile_s:.1f} s")
    if train.host_gb and m > 1:
        con.print(f"  (optim.offload: each microbatch is one device call, compiled as [1, {b}, {t}]; the host sums "
                  "their gradients)")
    table = Table(title="training, per device (XLA memory_analysis of the compiled step)")
    table.add_column("term")
    table.add_column("GB", justify="right")
    table.add_row("parameters", f"{train.params_gb:.2f}")
    table.add_row("optimizer state", f"{train.optimizer_gb:.2f}")
    table.add_row("gradient buffers (accumulator + microbatch, inside temporaries)",
                  f"{train.grad_accumulator_gb + train.microbatch_grads_gb:.2f}")
    table.add_row("temporaries (XLA temp: activations, gradients, gathered weights)", f"{train.temporaries_gb:.2f}")
    table.add_row("[bold]peak[/bold] (arguments + outputs - donated + temporaries)", f"[bold]{train.peak_gb:.2f}[/bold]")
    table.add_row(f"budget: {colo.describe_trainer()}", f"{colo.trainer_budget_gb:.2f}")
    head = (1 - train.peak_gb / colo.trainer_budget_gb) * 100 if colo.trainer_budget_gb else -100.0
    table.add_row("headroom under the budget", f"{head:.0f}%")
    con.print(table)
    if train.host_gb:
        con.print(f"optimizer offloaded to the host (optim.offload): {train.host_gb:.0f} GB of host memory per node "
                  f"(fp32 master, AdamW moments, gradient accumulator); trainer.cluster.host_memory_gb="
                  f"{cfg.trainer.cluster.host_memory_gb:g}")
    if train.flops is not None:
        con.print(f"step FLOPs per device: {train.flops:.3e} (compiled cost analysis, loops multiplied out); "
                  f"model FLOPs 6NT+attention: {train.model_flops:.3e}")
    else:
        con.print(f"model FLOPs per device per step 6NT+attention: {train.model_flops:.3e}")
    phases = colo.phases(train.peak_gb, train.params_gb + train.optimizer_gb)
    if phases:
        o = colo.overheads
        con.print(f"runtime overheads per GPU (colocation.*): CUDA context {o.cuda_context_gb:g} GB per process, NCCL "
                  f"{o.nccl_gb:g} GB per process with collectives, XLA runtime {o.xla_runtime_gb:g} GB, SGLang reserve "
                  f"{o.sglang_reserve_gb:g} GB" + (f", released server {o.released_residual_gb:g} GB"
                                                    if colo.mode == "time_share" else ""))
        pt = Table(title=f"one GPU, each phase of a step ({colo.mode}; >= {HEADROOM:.0%} free needed)")
        for c in ("phase", "what the GPU holds (GB)", "total GB", "free"):
            pt.add_column(c, justify="left" if c.startswith(("phase", "what")) else "right")
        for ph in phases:
            pt.add_row(ph.name, " + ".join(f"{k} {v:.1f}" for k, v in ph.terms.items()),
                       f"{ph.total_gb:.1f} / {ph.gpu_gb:.0f}", f"{ph.slack:.0%}")
        con.print(pt)
    if servers:
        st = Table(title=f"SGLang servers ({colo.mode}; {colo.describe_sglang()})")
        for c in ("server", "TP", "weights GB/GPU", "KV GB/GPU", "KV tokens", "context", "full contexts in KV",
                  "concurrent episodes"):
            st.add_column(c, justify="right")
        for s in servers:
            st.add_row(s.name, str(s.tp_size), f"{s.weights_gb:.1f}", f"{s.kv_gb:.1f}", f"{s.kv_tokens:,}",
                       f"{s.context:,}", str(s.full_contexts), str(s.concurrency))
        con.print(st)
        for s in servers:
            if s.context <= s.kv_tokens and s.full_contexts < s.concurrency:
                con.print(f"note: server {s.name} holds {s.full_contexts} of its {s.concurrency} concurrent episodes at "
                          "full context; past that SGLang queues new requests and retracts running ones (the radix "
                          "cache keeps shared prefixes)")
    if fits:
        worst = min((ph.slack for ph in phases), default=head / 100)
        con.print(f"[bold green]FITS[/bold green] ({worst:.0%} of the GPU free in the tightest phase; "
                  f"{head:.0f}% headroom under the step's budget)")
    else:
        con.print("[bold red]DOES NOT FIT[/bold red]")
        for r in reasons:
            con.print(f"  - {r}")


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m jaxrl_term.plan",
                                 description="Compile the preset's train step on fake CPU devices and check "
                                             "that training and the SGLang servers fit the preset's GPUs.")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. +experiment=qwen32b_h100")
    ap.add_argument("--no-flops", action="store_true", help="skip the four extra compiles that count FLOPs")
    ap.add_argument("--json", default=None, help="also write the plan as JSON here")
    args = ap.parse_args(argv)
    out = run(args.overrides, flops=not args.no_flops, as_json=args.json)
    return 0 if out["fits"] else 1


if __name__ == "__main__":
    from jaxrl_term.utils.cli import guard

    sys.exit(guard(main)())
