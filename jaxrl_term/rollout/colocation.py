"""How the trainer and the SGLang servers share a node's GPUs: one set of numbers for the planner and the
launcher.

Modes (``rollout.sglang.colocation.mode``):

* ``static``: the servers start *before* the trainer touches a GPU and keep ``mem_fraction_static`` of each
  of their GPUs (weights + KV cache) for the whole run; SGLang also needs ``sglang_reserve_gb`` beyond that for
  its own activations and CUDA graphs. The trainer's XLA allocator is capped at what is left
  (``XLA_PYTHON_CLIENT_MEM_FRACTION``). Works with asynchronous rollouts.
* ``time_share``: synchronous runs only. The servers run with ``--enable-memory-saver``; before each update the
  trainer asks them to release their weights and KV cache (``/release_memory_occupation``), trains with the
  whole GPU (XLA's platform allocator, so its temporaries are returned after the step), then asks them to take
  the memory back (``/resume_memory_occupation``) and loads the new weights. Between updates the trainer keeps
  only its state (parameters + optimizer) next to the servers.
* ``none``: the servers do not share GPUs with the trainer (remote URLs, or GPUs outside the trainer's mesh).

SGLang's KV budget (``ModelRunner.profile_max_num_token``): after loading weights it measures the free memory
and keeps ``total x (1 - mem_fraction_static)`` of it free, so the KV pool per GPU is about
``total x mem_fraction_static - weights - CUDA context``. If another process already holds memory when a server
starts, that memory comes out of the KV pool (negative: "Not enough memory"), which is why servers start first.
"""

from __future__ import annotations

import dataclasses
import math

GB = 1e9


@dataclasses.dataclass
class ColocationPlan:
    mode: str
    gpu_gb: float
    trainer_budget_gb: float  # what the train step may use at its peak
    trainer_resident_gb: float  # parameters + optimizer state, kept between updates
    sglang_static_gb: float  # per GPU, on GPUs that hold a server
    resident_gb: float | None  # time_share: trainer state + SGLang static (+ reserve) between updates
    xla_mem_fraction: float | None  # XLA_PYTHON_CLIENT_MEM_FRACTION the trainer runs with (static / none)

    def describe_trainer(self) -> str:
        if self.mode == "cpu":
            return "host memory"
        if self.mode == "static":
            return f"XLA_PYTHON_CLIENT_MEM_FRACTION={self.xla_mem_fraction:.3f} of {self.gpu_gb:.0f} GB"
        if self.mode == "time_share":
            return f"{self.gpu_gb:.0f} GB minus what SGLang keeps while released"
        return f"XLA_PYTHON_CLIENT_MEM_FRACTION={self.xla_mem_fraction:.3f} of {self.gpu_gb:.0f} GB (no servers)"

    def describe_sglang(self) -> str:
        return f"mem_fraction_static x {self.gpu_gb:.0f} GB = {self.sglang_static_gb:.1f} GB static per GPU"

    def trainer_env(self) -> dict[str, str]:
        """The XLA allocator settings the trainer must start with (set by ``runtime_env.apply_env`` before JAX
        touches a GPU)."""
        if self.mode == "time_share":
            return {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}
        if self.xla_mem_fraction is not None:
            return {"XLA_PYTHON_CLIENT_MEM_FRACTION": f"{self.xla_mem_fraction:.3f}"}
        return {}


@dataclasses.dataclass
class ServerPlan:
    name: str
    tp_size: int
    weights_gb: float  # per GPU
    static_gb: float  # per GPU: mem_fraction_static x GPU memory
    kv_gb: float  # per GPU
    kv_tokens: int
    context: int
    concurrency: int  # episodes this server must serve at once (evenly spread)


def _host_memory_gb() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024 / GB
    except OSError:
        pass
    return 0.0


def _launched(cfg) -> bool:
    return cfg.rollout.engine == "sglang" and bool(cfg.rollout.sglang.launch.enabled)


def serving_params(cfg) -> tuple[int, object]:
    from jaxrl_term.config import model_arch

    arch, _ = model_arch(cfg)
    return arch.num_params(), arch


def server_plans(cfg) -> list[ServerPlan]:
    """Per launched server: weights and KV cache per GPU at the configured ``mem_fraction_static``."""
    if not _launched(cfg) or cfg.trainer.cluster.gpus_per_node <= 0:
        return []
    la, co = cfg.rollout.sglang.launch, cfg.rollout.sglang.colocation
    params, arch = serving_params(cfg)
    gpu = float(cfg.trainer.cluster.gpu_memory_gb)
    n_servers = len(la.servers) * int(cfg.trainer.cluster.nodes)
    concurrency = math.ceil(cfg.trainer.max_concurrent_episodes / max(n_servers, 1))
    context = int(la.context_length or cfg.agent.max_context_tokens)
    out = []
    for s in la.servers:
        tp = int(s.tp_size)
        weights = params * 2 / tp / GB  # bf16 serving weights, split over the TP group
        static = la.mem_fraction_static * gpu
        kv = static - weights - co.cuda_context_gb
        kv_heads = max(1, arch.num_key_value_heads // tp)  # fewer KV heads than ranks: each rank keeps one
        per_token = 2 * arch.num_hidden_layers * kv_heads * arch.head_dim * 2  # K and V, bf16, per GPU
        out.append(ServerPlan(f":{s.port}", tp, weights, static, kv, max(0, int(kv * GB // per_token)), context,
                              concurrency))
    return out


def colocation_plan(cfg, *, train_peak_gb: float = 0.0, train_resident_gb: float = 0.0) -> ColocationPlan:
    """The trainer's memory budget per device and the settings it runs with, from the preset."""
    cl = cfg.trainer.cluster
    if cl.gpus_per_node <= 0:
        mem = float(cl.gpu_memory_gb) or _host_memory_gb()
        return ColocationPlan("cpu", mem, mem, train_resident_gb, 0.0, None, None)
    gpu = float(cl.gpu_memory_gb)
    co = cfg.rollout.sglang.colocation
    mode = co.mode if _launched(cfg) else "none"
    if mode == "none":
        frac = co.trainer_fraction_alone
        return ColocationPlan("none", gpu, frac * gpu, train_resident_gb, 0.0, None, frac)
    static = cfg.rollout.sglang.launch.mem_fraction_static * gpu
    if mode == "static":
        frac = 1.0 - cfg.rollout.sglang.launch.mem_fraction_static - (co.sglang_reserve_gb + co.cuda_context_gb) / gpu
        return ColocationPlan("static", gpu, max(frac, 0.0) * gpu, train_resident_gb, static, None, max(frac, 0.0))
    if mode == "time_share":
        budget = gpu - co.released_residual_gb - co.cuda_context_gb
        resident = train_resident_gb + static + co.sglang_reserve_gb + co.cuda_context_gb
        return ColocationPlan("time_share", gpu, budget, train_resident_gb, static, resident, None)
    raise ValueError(f"rollout.sglang.colocation.mode={mode!r}; use static, time_share or none")

