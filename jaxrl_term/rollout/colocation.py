"""How the trainer and the SGLang servers share a node's GPUs: one set of numbers for the planner, the launcher and
the trainer's allocator settings (``runtime_env.config_env``).

Modes (``rollout.sglang.colocation.mode``):

* ``static``: the servers start *before* the trainer touches a GPU and keep ``mem_fraction_static`` of each of
  their GPUs (weights + KV cache) for the whole run, plus ``sglang_reserve_gb`` beyond it (activations, CUDA
  graphs) and their CUDA context. XLA's allocator is capped at what is left (``XLA_PYTHON_CLIENT_MEM_FRACTION``)
  and does not preallocate it: it grows to the step's peak and keeps that (the BFC allocator never shrinks), so
  the device holds SGLang + the trainer's real peak, not SGLang + the whole cap. Works with asynchronous rollouts.
* ``time_share``: synchronous runs only. The servers run with ``--enable-memory-saver``; before each update the
  trainer asks them to release their weights and KV cache (``/release_memory_occupation``), trains with the
  whole GPU (XLA's platform allocator, so its temporaries are returned after the step), then asks them to take
  the memory back (``/resume_memory_occupation``) and loads the new weights. Between updates the trainer keeps
  only its state (parameters + optimizer) next to the servers.
* ``none``: the servers do not share GPUs with the trainer (remote URLs, or GPUs outside the trainer's mesh).

SGLang's KV budget (``profile_max_num_token``; ``mem_cache/kv_cache_configurator.py`` in 0.5.23): the free memory
after loading the weights, less ``(1 - mem_fraction_static)`` of the free memory measured before loading them (after
its CUDA context and NCCL set-up), so the KV pool per GPU is ``mem_fraction_static x (total - CUDA context - NCCL -
other processes) - weights``. Memory another process holds when a server starts shrinks the KV pool (negative:
"Not enough memory"), which is why servers start first.

Phases (:meth:`ColocationPlan.phases`): what one GPU holds, per process, in each phase of a step. The planner
refuses a plan whose total leaves less than 10% of any GPU free in any phase:

* ``update``: the train step at its peak (XLA's buffer assignment) + the trainer's runtime overheads, next to the
  servers (static: everything they keep; time_share: what a released server still holds);
* ``rollout`` (between updates): the trainer's state (time_share: temporaries returned; static: the allocator
  keeps its peak) next to serving servers;
* ``weight sync``: as ``rollout`` plus the export's on-device chunks (``save_pretrained``: one chunk and its
  local shard per device). In time_share the export runs before the servers resume; it is counted next to serving
  servers all the same (the safe side).

Runtime overheads the compiled step does not show, per GPU and process (``colocation.*``, stated defaults;
``experiments/bench/gpu_first_run.py`` measures the first two on a real GPU):

* ``cuda_context_gb`` (1.0): the CUDA context with cuBLAS / cuDNN handles, per process (trainer, each server rank).
  A bare CUDA 12 context with lazy module loading is a few hundred MB; the libraries' kernels and workspaces add
  to it.
* ``nccl_gb`` (1.0): NCCL communicators' buffers of a process that runs collectives (the trainer with more than one
  device; a server with TP > 1). NCCL keeps ``NCCL_BUFFSIZE`` (4 MiB by default) per channel and peer and
  protocol, and NVLink SHARP on H100 nodes adds its own buffers.
* ``xla_runtime_gb`` (1.0): the trainer's memory outside XLA's buffer assignment: the allocator's fragmentation,
  cuBLAS workspaces, autotuning scratch while compiling.
* ``sglang_reserve_gb`` (6.0): SGLang beyond ``mem_fraction_static`` (activations of a forward, CUDA graphs).
* ``released_residual_gb`` (3.0): what a server still holds after ``/release_memory_occupation`` of every tag:
  its CUDA context, communicators and allocator cache. SGLang's author measured 1.1 GB for a 1B model on one
  GPU with everything released (sglang issue 2542); TP groups keep their NCCL and custom all-reduce buffers.
"""

from __future__ import annotations

import dataclasses
import math

from jaxrl_term.runtime_env import merge_xla_flags

GB = 1e9
EXPORT_CHUNK_GB = 512 * 1024**2 / GB  # save_pretrained's default max_chunk_bytes (model/hf.py)


@dataclasses.dataclass(frozen=True)
class Overheads:
    """Per GPU, per process (see the module docstring)."""

    cuda_context_gb: float = 1.0
    nccl_gb: float = 1.0
    xla_runtime_gb: float = 1.0
    sglang_reserve_gb: float = 6.0
    released_residual_gb: float = 3.0

    @classmethod
    def from_cfg(cls, co) -> Overheads:
        return cls(**{f.name: float(getattr(co, f.name)) for f in dataclasses.fields(cls)})


@dataclasses.dataclass
class Phase:
    """What one GPU holds in one phase: term -> GB."""

    name: str
    terms: dict[str, float]
    gpu_gb: float

    @property
    def total_gb(self) -> float:
        return sum(self.terms.values())

    @property
    def slack(self) -> float:
        return 1.0 - self.total_gb / self.gpu_gb if self.gpu_gb else 0.0


@dataclasses.dataclass
class ColocationPlan:
    mode: str  # cpu | static | time_share | none
    gpu_gb: float
    trainer_budget_gb: float  # the most the train step may use (static / none: XLA's cap)
    sglang_static_gb: float  # per GPU, on GPUs that hold a server: mem_fraction_static x GPU memory
    sglang_serving_gb: float  # per GPU: static + reserve + its CUDA context (+ NCCL with TP > 1)
    sglang_released_gb: float  # per GPU: what a released server still holds (time_share)
    trainer_overheads_gb: float  # per GPU: the trainer's CUDA context (+ NCCL with several devices)
    xla_mem_fraction: float | None  # XLA_PYTHON_CLIENT_MEM_FRACTION the trainer runs with (static / none)
    overheads: Overheads = dataclasses.field(default_factory=Overheads)

    def describe_trainer(self) -> str:
        if self.mode == "cpu":
            return "host memory"
        if self.mode in ("static", "none"):
            return f"XLA_PYTHON_CLIENT_MEM_FRACTION={self.xla_mem_fraction:.3f} of {self.gpu_gb:.0f} GB"
        return f"{self.gpu_gb:.0f} GB minus a released server and the trainer's runtime"

    def describe_sglang(self) -> str:
        return f"mem_fraction_static x {self.gpu_gb:.0f} GB = {self.sglang_static_gb:.1f} GB static per GPU"

    def trainer_env(self) -> dict[str, str]:
        """The XLA allocator settings the trainer must start with (set by ``runtime_env.apply_env`` before JAX
        touches a GPU)."""
        if self.mode == "time_share":
            return {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}
        if self.mode == "static":  # a cap, grown into as needed: the device holds the real peak, not the cap
            return {"XLA_PYTHON_CLIENT_PREALLOCATE": "false",
                    "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{self.xla_mem_fraction:.3f}"}
        if self.xla_mem_fraction is not None:
            return {"XLA_PYTHON_CLIENT_MEM_FRACTION": f"{self.xla_mem_fraction:.3f}"}
        return {}

    def phases(self, peak_gb: float, resident_gb: float, export_gb: float = 2 * EXPORT_CHUNK_GB) -> list[Phase]:
        """Per GPU (one that also holds a server rank, when servers share the GPUs), each phase of a step."""
        if self.mode == "cpu":
            return []
        o = self.overheads
        trainer = {"trainer CUDA context + NCCL": self.trainer_overheads_gb, "trainer runtime (XLA)": o.xla_runtime_gb}
        serving = {"SGLang serving": self.sglang_serving_gb} if self.mode in ("static", "time_share") else {}
        released = {"SGLang released": self.sglang_released_gb} if self.mode == "time_share" else serving
        # between updates: time_share returns the step's temporaries (platform allocator); the BFC keeps its peak
        kept = resident_gb if self.mode == "time_share" else peak_gb
        sync = max(kept, resident_gb + export_gb) if self.mode != "time_share" else resident_gb + export_gb
        return [
            Phase("update", {**released, "train step peak": peak_gb, **trainer}, self.gpu_gb),
            Phase("rollout", {**serving, ("trainer state" if self.mode == "time_share" else "trainer allocator (peak)"):
                              kept, **trainer}, self.gpu_gb),
            Phase("weight sync", {**serving, "trainer state + export chunks": sync, **trainer}, self.gpu_gb),
        ]


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

    @property
    def full_contexts(self) -> int:
        return self.kv_tokens // max(self.context, 1)


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


def _sglang_nccl(o: Overheads, tp: int) -> float:
    return o.nccl_gb if tp > 1 else 0.0


def server_plans(cfg) -> list[ServerPlan]:
    """Per launched server: weights and KV cache per GPU at the configured ``mem_fraction_static``."""
    if not _launched(cfg) or cfg.trainer.cluster.gpus_per_node <= 0:
        return []
    la, o = cfg.rollout.sglang.launch, Overheads.from_cfg(cfg.rollout.sglang.colocation)
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
        # profile_max_num_token: the fraction of what was free before the weights, less the weights
        kv = la.mem_fraction_static * (gpu - o.cuda_context_gb - _sglang_nccl(o, tp)) - weights
        kv_heads = max(1, arch.num_key_value_heads // tp)  # fewer KV heads than ranks: each rank keeps one
        per_token = 2 * arch.num_hidden_layers * kv_heads * arch.head_dim * 2  # K and V, bf16, per GPU
        out.append(ServerPlan(f":{s.port}", tp, weights, static, kv, max(0, int(kv * GB // per_token)), context,
                              concurrency))
    return out


def colocation_plan(cfg) -> ColocationPlan:
    """The trainer's memory budget per device and the settings it runs with, from the preset."""
    cl = cfg.trainer.cluster
    if cl.gpus_per_node <= 0:
        mem = float(cl.gpu_memory_gb) or _host_memory_gb()
        return ColocationPlan("cpu", mem, mem, 0.0, 0.0, 0.0, 0.0, None)
    gpu = float(cl.gpu_memory_gb)
    co = cfg.rollout.sglang.colocation
    o = Overheads.from_cfg(co)
    mode = co.mode if _launched(cfg) else "none"
    devices = int(cl.nodes) * int(cl.gpus_per_node)
    trainer_oh = o.cuda_context_gb + (o.nccl_gb if devices > 1 else 0.0)
    if mode == "none":
        frac = float(co.trainer_fraction_alone)
        return ColocationPlan("none", gpu, frac * gpu, 0.0, 0.0, 0.0, trainer_oh, frac, o)
    if mode not in ("static", "time_share"):
        raise ValueError(f"rollout.sglang.colocation.mode={mode!r}; use static, time_share or none")
    static = cfg.rollout.sglang.launch.mem_fraction_static * gpu
    tp = max((int(s.tp_size) for s in cfg.rollout.sglang.launch.servers), default=1)
    serving = static + o.sglang_reserve_gb + o.cuda_context_gb + _sglang_nccl(o, tp)
    if mode == "static":
        cap = max(gpu - serving - trainer_oh, 0.0)  # the BFC allocator may grow up to what the servers leave
        return ColocationPlan("static", gpu, cap, static, serving, serving, trainer_oh, cap / gpu, o)
    budget = gpu - o.released_residual_gb - trainer_oh
    return ColocationPlan("time_share", gpu, budget, static, serving, o.released_residual_gb, trainer_oh, None, o)


def config_env(cfg) -> dict[str, str]:
    """The variables a train / sft / eval config needs before the backend: the colocation plan's XLA allocator
    settings (GPU presets) and ``trainer.cluster.env``."""
    env: dict[str, str] = {}
    cl = cfg.trainer.cluster
    if int(cl.gpus_per_node) > 0:
        env.update(colocation_plan(cfg).trainer_env())
    for k, v in dict(getattr(cl, "env", None) or {}).items():
        if k == "XLA_FLAGS" and "XLA_FLAGS" in env:
            env[k] = merge_xla_flags(env[k], str(v))
        else:
            env[str(k)] = str(v)
    return env
