"""Typed configuration: dataclasses registered in Hydra's ConfigStore.

``conf/config.yaml`` starts from the ``config_schema`` node stored here, so a misspelt key or a wrong type
fails at start-up with the key's full path (``model.options.remat``) instead of deep inside a run. Library
code never sees these objects; the entry points turn them into plain arguments.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore

from jaxrl_term.rl.step import AlgoConfig, OptimConfig


@dataclasses.dataclass
class ModelOptionsCfg:
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    remat: str = "none"
    attention: str = "dot_product_attention"  # dot_product_attention | xla | blockwise | cudnn
    attention_block: int = 512
    mlp_chunk: int = 0
    remat_groups: int = 0
    lm_head_fp32: bool = True
    logits_chunk: int = 0
    precision: str = "default"
    flat_matmuls: bool = True  # [B, T] merged for the layers' matmuls (2-D GEMMs; see model/qwen3.decoder_layer)
    scan_layers: bool = True  # false: the layer loop unrolled (faster on CPU; compile time grows with depth)


@dataclasses.dataclass
class ModelCfg:
    name: str = "tiny"
    # An HF directory to load (config.json + safetensors); null = random init from the numbers below.
    path: Optional[str] = None
    random_init: bool = False  # with no path: seeded random weights (tiny / benchmark models only)
    # Tokenizer: an HF directory, or `tiny` / `qwen3` to build one offline into cache_dir.
    tokenizer: str = "tiny"
    vocab_size: int = 1024
    hidden_size: int = 64
    intermediate_size: int = 192
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 40960
    # YaRN past the pre-training length, as HF's rope_scaling: {rope_type: yarn, factor: 2.0,
    # original_max_position_embeddings: 32768} (Qwen3 at 64k). Set, it replaces config.json's scaling (trainer, embedded
    # engine and launched SGLang servers alike); null = the model's own (model.path's config.json, else none).
    # (typed Any: OmegaConf 2.3 cannot merge a dict override into a null Optional[Dict] node in struct mode)
    rope_scaling: Any = None
    options: ModelOptionsCfg = field(default_factory=ModelOptionsCfg)


@dataclasses.dataclass
class DistributedCfg:
    enabled: bool = False
    coordinator_address: Optional[str] = None
    num_processes: Optional[int] = None
    process_id: Optional[int] = None
    local_device_ids: Optional[list[int]] = None
    initialization_timeout_s: int = 300


@dataclasses.dataclass
class MeshCfg:
    shape: dict[str, int] = field(default_factory=lambda: {"data": 1, "fsdp": -1, "tensor": 1})
    rules: dict[str, Any] = field(default_factory=dict)
    distributed: DistributedCfg = field(default_factory=DistributedCfg)


@dataclasses.dataclass
class DockerEnginesCfg:
    """Several Docker engines (sandbox/engines.py): ``hosts`` as [{url, capacity, tls_verify, ca_cert,
    client_cert, client_key, name}]; empty = the one default engine (DOCKER_HOST or the local socket)."""

    hosts: list[Any] = field(default_factory=list)
    cooldown_s: float = 60.0  # an engine out of rotation is probed after this (doubled per failed probe, up to 8x)
    # liveness: every engine is pinged every probe_interval_s (each ping bounded by probe_timeout_s); probe_misses
    # missed in a row take it out of rotation and fail its sandboxes (retried elsewhere): a hung engine is out
    # within probe_misses x (probe_interval_s + probe_timeout_s)
    probe_interval_s: float = 5.0
    probe_timeout_s: float = 5.0
    probe_misses: int = 2


@dataclasses.dataclass
class SandboxCfg:
    backend: str = "docker"
    max_concurrent: int = 16
    cpus: float = 1.0
    memory_mb: int = 2048
    pids: int = 512
    # Network per phase (Harbor's [environment]/[agent]/[verifier] network_mode): "task" follows each task's own
    # policy, "none" never, "public" always; "public" means the Docker network public_network.
    agent_network: str = "task"
    verifier_network: str = "task"
    public_network: str = "jaxrl-public"
    workdir: str = "/app"
    max_output_bytes: int = 32768
    command_timeout_s: float = 120.0
    image_map: list[Any] = field(default_factory=list)
    extra_ca_bundle: str = "auto"
    build_timeout_s: float = 1800.0
    max_parallel_builds: int = 2
    docker: DockerEnginesCfg = field(default_factory=DockerEnginesCfg)

    def engines(self):
        """The ``EnginePool`` over ``docker.hosts`` (one per process for the same hosts: rollouts and an in-training
        evaluation share the engines' capacity and health), or None for the one default engine."""
        if not self.docker.hosts:
            return None
        from jaxrl_term.sandbox.engines import shared_pool

        d = self.docker
        return shared_pool([dict(h) if isinstance(h, dict) else h for h in d.hosts], cooldown_s=d.cooldown_s,
                           probe_interval_s=d.probe_interval_s, probe_timeout_s=d.probe_timeout_s,
                           probe_misses=d.probe_misses)

    def limits(self) -> dict[str, Any]:
        """Keyword arguments for ``open_sandbox`` / ``SandboxPool``."""
        out = dict(cpus=self.cpus, memory_mb=self.memory_mb, pids=self.pids, agent_network=self.agent_network,
                   verifier_network=self.verifier_network, public_network=self.public_network,
                   workdir=self.workdir, max_output_bytes=self.max_output_bytes)
        if self.docker.hosts and self.backend != "local":  # the process's one EnginePool for these hosts
            out["engines"] = self.engines()
        return out


@dataclasses.dataclass
class CurriculumCfg:
    """Training-task sampling that prefers tasks whose recent pass rate is inside ``band`` (tasks/curriculum.py)."""

    enabled: bool = False
    band: list[float] = field(default_factory=lambda: [0.2, 0.8])
    window: int = 4  # groups per task that make its recent pass rate
    out_of_band_weight: float = 0.1  # relative weight of a task outside the band (> 0: it can come back)


@dataclasses.dataclass
class DataCfg:
    source: Optional[str] = "builtin"
    split: str = "train"
    n_per_cell: int = 4
    families: Optional[list[str]] = None
    difficulties: Optional[list[str]] = None
    ids: Optional[list[str]] = None
    exclude_ids: Optional[list[str]] = None
    limit: Optional[int] = None
    skip_bad: bool = True
    seed: int = 0
    curriculum: CurriculumCfg = field(default_factory=CurriculumCfg)


@dataclasses.dataclass
class AgentCfg:
    scaffold: str = "bash"
    max_turns: int = 30
    max_tokens_per_turn: int = 2048
    max_context_tokens: int = 32768
    command_timeout_s: float = 30.0
    trajectory_timeout_s: float = 1800.0
    max_parse_error_turns: int = 3
    max_actions_per_turn: int = 10
    max_observation_chars: int = 16000
    max_observation_tokens: Optional[int] = None  # per turn, all results together; None: max_context_tokens / 4
    enable_thinking: Optional[bool] = None
    prompt: Optional[str] = None  # a file replacing the scaffold's system prompt (same $variables as its built-in)

    def limits(self):
        from jaxrl_term.agent.loop import AgentLimits

        return AgentLimits(self.max_turns, self.max_tokens_per_turn, self.max_context_tokens, self.command_timeout_s,
                           self.trajectory_timeout_s, self.max_parse_error_turns,
                           max_observation_tokens=self.max_observation_tokens)

    def scaffold_obj(self):
        from jaxrl_term.agent.actions import make_scaffold

        return make_scaffold(self.scaffold, max_actions_per_turn=self.max_actions_per_turn,
                             max_observation_chars=self.max_observation_chars, command_timeout_s=self.command_timeout_s,
                             prompt=self.prompt)


@dataclasses.dataclass
class JaxEngineCfg:
    max_batch: int = 16
    max_seq_len: int = 8192
    prefill_chunk: int = 512
    param_dtype: Optional[str] = None
    prefix_reuse: bool = True
    decode_steps: int = 16
    matmul_dtype: Optional[str] = None


@dataclasses.dataclass
class ServerCfg:
    port: int = 30000
    gpus: Optional[str] = None
    tp_size: int = 1


@dataclasses.dataclass
class LaunchCfg:
    enabled: bool = False
    python: str = "python"
    module: str = "sglang.launch_server"
    model_path: Optional[str] = None
    host: str = "0.0.0.0"  # bind address; other nodes' trainer process 0 sends the requests
    advertise_host: Optional[str] = None  # how others reach this node (default: its FQDN; 127.0.0.1 for loopback)
    fp32_lm_head: bool = True  # --enable-fp32-lm-head (SGLang >= 0.5.3) when model.options.lm_head_fp32
    servers: list[ServerCfg] = field(default_factory=list)
    mem_fraction_static: float = 0.7
    context_length: Optional[int] = None
    extra_args: list[str] = field(default_factory=list)
    ready_timeout_s: float = 900.0


@dataclasses.dataclass
class ColocationCfg:
    """How launched servers share GPUs with the trainer (see ``rollout.colocation``)."""

    mode: str = "static"  # static | time_share | none
    # runtime overheads per GPU and process that no compile shows (sources: rollout/colocation.py's docstring)
    sglang_reserve_gb: float = 6.0  # SGLang's memory beyond mem_fraction_static (activations, CUDA graphs)
    cuda_context_gb: float = 1.0  # per process per GPU
    nccl_gb: float = 1.0  # communicator buffers of a process that runs collectives (trainer; a TP > 1 server)
    xla_runtime_gb: float = 1.0  # the trainer outside XLA's buffer assignment (fragmentation, workspaces)
    released_residual_gb: float = 3.0  # time_share: what a released server still holds
    trainer_fraction_alone: float = 0.9  # mode none: XLA_PYTHON_CLIENT_MEM_FRACTION


@dataclasses.dataclass
class RouterLaunchCfg:
    """The ``sglang-router`` process trainer process 0 starts in front of every server (``rollout.router``)."""

    python: Optional[str] = None  # an interpreter with sglang-router installed; null = the trainer's
    module: str = "sglang_router.launch_router"
    host: str = "127.0.0.1"  # only process 0 sends requests
    port: Optional[int] = None  # null = a free port
    policy: str = "manual"  # manual: X-SMG-Routing-Key (the episode) -> one server | cache_aware | round_robin | ...
    assignment_mode: str = "min_load"  # manual: where a new episode goes (random | min_load | min_group)
    health_check_endpoint: str = "/v1/models"  # not /health: it waits while a weight sync pauses the server
    health_check_interval_s: int = 10
    health_failure_threshold: int = 3
    log_level: str = "warn"  # info logs two lines per request
    extra_args: list[str] = field(default_factory=list)
    ready_timeout_s: float = 300.0


@dataclasses.dataclass
class SGLangCfg:
    urls: list[str] = field(default_factory=list)
    router: str = "auto"  # auto: through sglang-router when there is more than one server in all | true | false
    router_url: Optional[str] = None  # a router run elsewhere, in front of urls (+ launched servers)
    request_timeout_s: float = 3600.0
    max_retries: int = 3
    backoff_s: float = 0.5
    pause_mode: str = "abort"
    context_length: Optional[int] = None  # the servers' context; None = learn it from each server
    abort_retries: int = 3  # a turn aborted by a weight-sync pause is re-sent up to this many times
    idle_timeout_s: float = 60.0  # abort-mode sync: how long to wait for a server to become idle
    export_dir: Optional[str] = None
    export_shared: bool = True  # export_dir is on a filesystem every node sees (else every node writes its own)
    export_dtype: str = "bfloat16"
    launch: LaunchCfg = field(default_factory=LaunchCfg)
    router_launch: RouterLaunchCfg = field(default_factory=RouterLaunchCfg)
    colocation: ColocationCfg = field(default_factory=ColocationCfg)


@dataclasses.dataclass
class RolloutCfg:
    engine: str = "jax"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    jax: JaxEngineCfg = field(default_factory=JaxEngineCfg)
    sglang: SGLangCfg = field(default_factory=SGLangCfg)


@dataclasses.dataclass
class JudgeEndpointCfg:
    name: str = "judge"
    base_url: str = "http://127.0.0.1:31000/v1"
    model: str = "judge"
    api_key_env: Optional[str] = None
    timeout_s: float = 60.0
    max_concurrency: int = 4
    max_tokens: int = 4096  # room for judges that reason before the JSON
    temperature: float = 0.0
    context_tokens: int = 32768  # the judge model's context: the transcript is rendered for what is left
    bytes_per_token: float = 3.0  # the prompt's size estimate
    usd_per_mtok_in: float = 0.0  # prices for judge/cost_usd
    usd_per_mtok_out: float = 0.0


@dataclasses.dataclass
class JudgeCfg:
    endpoints: list[JudgeEndpointCfg] = field(default_factory=list)
    failure_threshold: int = 2
    cooldown_s: float = 60.0
    rounds: int = 2
    backoff_s: float = 2.0
    cache_size: int = 10000
    max_transcript_chars: int = 24000
    max_wait_s: float = 600.0
    retries: int = 1  # per endpoint, for infrastructure failures (Retry-After honoured up to max_retry_after_s)
    max_retry_after_s: float = 30.0
    shrink: float = 0.4  # a trajectory that breaks the judge is asked again at this fraction of the budget
    poll_s: float = 10.0  # on_judge_missing=wait: how often the stored group is judged again


@dataclasses.dataclass
class RewardCfg:
    scoring: str = "weighted"  # weighted (TB-RL) | binary (Tmax)
    tests_weight: float = 1.0
    judge_weight: float = 0.0
    on_judge_missing: str = "renormalize"  # renormalize | wait
    unfinished: str = "score"  # score | zero: an episode that never declared the task done scores its tests, or 0
    judge: JudgeCfg = field(default_factory=JudgeCfg)

    def mixer(self, *, evaluation: bool = False):
        """The pipeline's reward function (a ``RewardMixer``, with a ``JudgeClient`` when judged). ``evaluation``:
        the held-out evaluation's, which scores what the episode achieved (``unfinished`` is a training rule)."""
        from jaxrl_term.reward.combine import RewardMixer

        judge = None
        if self.judge_weight > 0:
            from jaxrl_term.reward.judge import JudgeClient, endpoints_from_config

            j = self.judge
            judge = JudgeClient(endpoints_from_config([dataclasses.asdict(e) for e in j.endpoints]),
                                failure_threshold=j.failure_threshold, cooldown_s=j.cooldown_s, rounds=j.rounds,
                                backoff_s=j.backoff_s, cache_size=j.cache_size,
                                max_transcript_chars=j.max_transcript_chars, retries=j.retries,
                                max_retry_after_s=j.max_retry_after_s, shrink=j.shrink)
        return RewardMixer(self.tests_weight, self.judge_weight, judge, self.on_judge_missing, self.judge.max_wait_s,
                           self.judge.poll_s, unfinished="score" if evaluation else self.unfinished)


@dataclasses.dataclass
class ClusterCfg:
    """What the preset is sized for (checked by the tests, printed at start-up)."""

    nodes: int = 1
    gpus_per_node: int = 0  # 0 = CPU
    gpu: str = "cpu"
    gpu_memory_gb: float = 0.0
    host_memory_gb: float = 0.0  # per node; the planner checks optim.offload's host memory against it (0 = unchecked)
    # variables JAX / XLA / NCCL read when the backend is created (e.g. NCCL_IB_HCA, XLA_FLAGS), set by
    # runtime_env.apply_env before anything touches a device, next to the colocation plan's allocator settings
    env: dict[str, str] = field(default_factory=dict)


@dataclasses.dataclass
class WarmStartCfg:
    """Supervised fine-tuning on the training tasks' oracle demonstrations before RL (cached)."""

    enabled: bool = False
    steps: int = 150
    lr: float = 1e-3
    batch_size: int = 8


@dataclasses.dataclass
class TrainerCfg:
    steps: int = 4
    groups_per_step: int = 2  # tasks per step; each yields algo.group_size trajectories
    max_off_policy_steps: int = 0  # 0 = synchronous; k = rollouts may lag the policy by k updates
    max_concurrent_episodes: int = 8
    max_episode_retries: int = 2
    drop_zero_variance: bool = True  # active sampling
    max_filtered_per_step: Optional[int] = None  # then zero-variance groups are used (default 4 x groups)
    max_consecutive_failed_groups: int = 8  # stop the run when this many groups in a row failed after retries
    checkpoint_every: int = 1
    keep_checkpoints: int = 3
    resume: str = "auto"  # auto (if the run dir has checkpoints) | true | false
    export_final: bool = True  # write the final policy as an HF directory
    trajectory_samples: int = -1  # episodes per step saved as transcripts (trajectories/step_N.jsonl); -1 = all
    eval_every: int = 0  # held-out evaluation (eval.*) every N steps; 0 = never
    eval_before_train: bool = False  # also evaluate the starting policy (after the warm start), as step 0
    report: bool = True  # write run_dir/report.html and report.md at the end
    buckets: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192, 16384, 32768, 65536])
    pack: bool = False
    log_param_digest: bool = False
    deterministic_engine: bool = False  # reproducible sampling regardless of batching (slower)
    max_consecutive_skips: int = 5  # abort when this many updates in a row had nothing to learn from
    dry_run: bool = False  # check the config (preflight) and exit
    warm_start: WarmStartCfg = field(default_factory=WarmStartCfg)
    cluster: ClusterCfg = field(default_factory=ClusterCfg)


@dataclasses.dataclass
class EvalCfg:
    """Evaluation: ``python -m jaxrl_term.eval`` (tasks from ``data.*``) and the held-out evaluation during
    training (tasks from ``eval.data``)."""

    attempts: int = 1  # k attempts per task (pass@1 over them, unbiased pass@k)
    concurrency: int = 4  # attempts in flight
    max_retries: int = 2  # an attempt the infrastructure broke (engine, sandbox, verifier) is re-run, then dropped
    temperature: Optional[float] = None  # null: rollout.temperature
    top_p: Optional[float] = None  # null: rollout.top_p
    seed: int = 0  # attempt j of task t samples with a seed derived from (seed, t, j): reruns are identical
    progress: bool = True  # a progress bar (tasks done, pass rate so far, ETA)
    report: bool = True  # write run_dir/report.html and report.md at the end
    attempt_deadline_s: Optional[float] = None  # a try's wall clock; null: the image build + the agent's time +
                                                # 3 verifier runs + a margin (as training rollouts)
    data: DataCfg = field(default_factory=lambda: DataCfg(source="builtin", split="heldout", n_per_cell=1))


@dataclasses.dataclass
class PolicyCfg:
    """What ``python -m jaxrl_term.eval`` evaluates (``policy=NAME``, conf/policy/)."""

    kind: str = "checkpoint"  # oracle | nop | checkpoint | sglang | openai
    path: Optional[str] = None  # checkpoint: a run dir, its checkpoints/ dir or a step dir (orbax), or an HF dir;
    #                             null = the model config's weights (model.path, or random init)
    step: Optional[int] = None  # orbax step; null = the latest
    base_url: Optional[str] = None  # openai: e.g. https://api.openai.com/v1 (…/v1 of any compatible server)
    model: Optional[str] = None  # openai: the model name sent with each request
    api_key_env: Optional[str] = "OPENAI_API_KEY"  # openai: the environment variable holding the key (null: none)
    request_timeout_s: float = 300.0
    max_retries: int = 4  # openai: 429 / 5xx / connection errors, with backoff (Retry-After honoured)


@dataclasses.dataclass
class WandbCfg:
    enabled: bool = False
    project: str = "jaxrl_term"
    entity: Optional[str] = None
    mode: str = "online"


@dataclasses.dataclass
class LoggingCfg:
    tensorboard: bool = True
    console: bool = True
    text_samples: int = 2  # episodes per step also logged as text (TensorBoard / wandb)
    wandb: WandbCfg = field(default_factory=WandbCfg)


@dataclasses.dataclass
class Config:
    model: ModelCfg = field(default_factory=ModelCfg)
    mesh: MeshCfg = field(default_factory=MeshCfg)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sandbox: SandboxCfg = field(default_factory=SandboxCfg)
    data: DataCfg = field(default_factory=DataCfg)
    agent: AgentCfg = field(default_factory=AgentCfg)
    rollout: RolloutCfg = field(default_factory=RolloutCfg)
    reward: RewardCfg = field(default_factory=RewardCfg)
    trainer: TrainerCfg = field(default_factory=TrainerCfg)
    logging: LoggingCfg = field(default_factory=LoggingCfg)
    eval: EvalCfg = field(default_factory=EvalCfg)
    seed: int = 0
    cache_dir: str = "~/.cache/jaxrl_term"
    run_name: Optional[str] = None  # runs/<run_name> instead of runs/<time> (see train.route_run_dir)
    run_dir: str = "runs/${now:%Y%m%d-%H%M%S}"


@dataclasses.dataclass
class SFTCfg:
    """``python -m jaxrl_term.sft``: supervised fine-tuning on demonstrations; writes run_dir/hf_final."""

    source: str = "oracle"  # oracle (the training tasks' solutions, data.*) | a train / eval run dir | a .jsonl
    min_reward: float = 1.0  # run dirs: episodes with at least this reward
    steps: int = 150
    lr: float = 1e-3
    batch_size: int = 8
    # the learning rate over the steps: constant, or warmup_cosine (linear from 0 over warmup_steps, then a cosine
    # decay to 0 at the last step: the weights written are not one noisy step of a still-high rate)
    schedule: str = "constant"
    warmup_steps: int = 0


@dataclasses.dataclass
class SFTRunConfig(Config):
    sft: SFTCfg = field(default_factory=SFTCfg)


@dataclasses.dataclass
class EvalRunConfig(Config):
    """``python -m jaxrl_term.eval``: the training config groups plus the policy under evaluation."""

    policy: PolicyCfg = field(default_factory=PolicyCfg)


@dataclasses.dataclass
class DatagenPassRateCfg:
    """Optional policy rollouts on validated tasks (``jaxrl_term.eval`` with ``eval_overrides``)."""

    enabled: bool = False
    attempts: int = 4
    band: list[float] = field(default_factory=lambda: [0.1, 0.9])  # keep tasks with pass@1 inside [lo, hi]
    eval_overrides: list[str] = field(default_factory=lambda: ["policy=nop"])  # e.g. policy=checkpoint policy.path=...


@dataclasses.dataclass
class DatagenCfg:
    """``python -m jaxrl_term.datagen run +datagen=NAME``: Tmax-style task generation (``jaxrl_term.datagen``)."""

    name: str = "datagen"
    taxonomy: Optional[str] = None  # a taxonomy YAML; None = ../shared/datasets/tmax-taxonomy/taxonomy.yaml
    n: int = 100  # specs to draw (spec i of a seed is always the same spec)
    seed: int = 0
    mix: Optional[str] = None  # corpus-kind mix (a section of the taxonomy with parts); null = tmax_15k unless corpus
    corpus: Optional[str] = None  # legacy | sft_v2 | rl_v2 (then mix must be null)
    specs: Optional[str] = None  # a specs.jsonl (``datagen sample --out``) instead of drawing
    out_dir: str = "datagen/${datagen.name}"
    base_image: str = "jaxrl-term/base:trixie"  # FROM line every generated Dockerfile must use
    jobs: int = 2
    max_repairs: int = 2  # per spec, format + build + test repairs together
    dedup_threshold: float = 0.8  # MinHash-LSH Jaccard threshold over instruction word 5-grams
    ngram: int = 13  # decontamination: word n-grams shared with an evaluation task
    decontaminate: list[str] = field(default_factory=lambda: ["builtin:heldout"])  # evaluation task sources
    scoring: str = "weighted"  # how nop / oracle are scored (weighted: no test may pass initially)
    teacher: JudgeCfg = field(default_factory=JudgeCfg)  # endpoints, fallback, breakers: the judge's client
    pass_rate: DatagenPassRateCfg = field(default_factory=DatagenPassRateCfg)


@dataclasses.dataclass
class DatagenRunConfig:
    datagen: DatagenCfg = field(default_factory=DatagenCfg)
    sandbox: SandboxCfg = field(default_factory=SandboxCfg)


class ConfigError(ValueError):
    """A config that composes but cannot run; the message names the key and the fix."""


def preflight(cfg, *, need_paths: bool = True, training: bool = True) -> list[tuple[str, str, str]]:
    """Every problem with a composed config, before any model, engine or sandbox is built: (key, what is wrong,
    how to fix it). Choices (registry names, enums), paths (model dir, tokenizer, tasks), and combinations that
    cannot run or silently do nothing. ``need_paths=False`` (the planner) skips weights and tasks; ``training``
    adds what only training needs (a sampling distribution the trainer can score). The same function backs
    ``train`` (also alone: ``--preflight`` / ``trainer.dry_run=true``), ``plan`` and the other entry points."""
    import os
    from pathlib import Path

    out: list[tuple[str, str, str]] = []

    def bad(key, what, fix=""):
        out.append((key, what, fix))

    # -- algorithm ------------------------------------------------------------------------------------
    from jaxrl_term.rl.step import AlgoConfig

    algo = {k: cfg.algo[k] for k in cfg.algo}
    algo["temperature"] = cfg.rollout.temperature
    a = object.__new__(AlgoConfig)
    a.__dict__.update(algo)
    for key, msg in a.problems():
        key = "rollout.temperature" if key == "temperature" else f"algo.{key}"
        what, _, fix = msg.partition("; ")
        bad(key, what, fix)
    if training and (cfg.rollout.top_p < 1.0 or cfg.rollout.top_k not in (-1, 0)):
        bad("rollout.top_p" if cfg.rollout.top_p < 1.0 else "rollout.top_k",
            f"top_p={cfg.rollout.top_p}, top_k={cfg.rollout.top_k}: tokens are sampled from the truncated "
            "distribution but SGLang (and our engine, to match it) report log-probs of the untruncated one, so the "
            "importance ratio is biased (0.105 nats per token on average at top_p 0.9)",
            "train with rollout.top_p=1.0 rollout.top_k=-1 (truncation is fine for evaluation)")
    # -- optimizer and model --------------------------------------------------------------------------
    if cfg.optim.schedule not in ("constant", "warmup_constant", "warmup_cosine"):
        bad("optim.schedule", f"{cfg.optim.schedule!r}", "use constant, warmup_constant or warmup_cosine")
    if not cfg.optim.lr > 0:
        bad("optim.lr", f"{cfg.optim.lr} must be > 0")
    o = cfg.model.options
    if o.param_dtype != "float32" and cfg.optim.lr < 1e-4:
        bad("model.options.param_dtype",
            f"{o.param_dtype} with optim.lr={cfg.optim.lr:g}: a {o.param_dtype} weight has an 8-bit mantissa, so an "
            "Adam update of ~lr rounds away unless lr > ~2^-8 of the weight; at lr < 1e-4 most weights never "
            "change while loss and grad norm look healthy",
            "use model.options.param_dtype=float32 (fp32 master weights, bf16 compute via compute_dtype)")
    from jaxrl_term.model.qwen3 import ATTENTION_KINDS

    if o.attention not in ATTENTION_KINDS:
        bad("model.options.attention", f"{o.attention!r}", f"use one of {ATTENTION_KINDS}")
    if training and o.attention == "cudnn" and o.compute_dtype == "float32":
        bad("model.options.attention", "cudnn with compute_dtype=float32: cuDNN's flash attention takes only "
            "bfloat16 / float16 (JAX refuses it when the model is first traced)",
            "use compute_dtype=bfloat16, or attention=blockwise for fp32")
    if cfg.optim.offload:
        d = cfg.mesh.distributed
        if d.enabled and (d.num_processes or 0) != 1:
            bad("optim.offload", "keeps the optimizer in one process's host memory; it cannot run with "
                "mesh.distributed.enabled (several processes)",
                "drive the node's GPUs from one process, or set optim.offload=false")
        if o.param_dtype != "float32":
            bad("optim.offload", f"keeps fp32 master weights on the host, but model.options.param_dtype="
                f"{o.param_dtype}", "set model.options.param_dtype=float32")
    if o.attention == "cudnn" and cfg.trainer.pack:
        bad("model.options.attention", "cudnn with trainer.pack=true: cuDNN's fused attention masks by row length "
            "only", "use attention=blockwise for packed rows, or trainer.pack=false")
    # -- rollout and colocation -----------------------------------------------------------------------
    if cfg.rollout.engine not in ("jax", "sglang"):
        bad("rollout.engine", f"{cfg.rollout.engine!r}", "use jax or sglang")
    from jaxrl_term.rollout.jax_engine import MATMUL_DTYPES

    if cfg.rollout.jax.matmul_dtype not in MATMUL_DTYPES:  # the engine's own list (its config refuses the rest)
        bad("rollout.jax.matmul_dtype", f"{cfg.rollout.jax.matmul_dtype!r}",
            "use null (the model's compute dtype) or bfloat16 (bf16 products, fp32 sums)")
    la = cfg.rollout.sglang.launch
    if cfg.rollout.engine == "sglang" and la.enabled and la.context_length and \
            cfg.agent.max_context_tokens > la.context_length:
        bad("agent.max_context_tokens", f"{cfg.agent.max_context_tokens} is longer than the servers' "
            f"rollout.sglang.launch.context_length={la.context_length}", "lower the agent's context or raise the servers'")
    context_problems(cfg, bad)
    co = cfg.rollout.sglang.colocation
    if co.mode not in ("static", "time_share", "none"):
        bad("rollout.sglang.colocation.mode", f"{co.mode!r}", "use static, time_share or none")
    if co.mode == "time_share" and cfg.rollout.engine == "sglang" and la.enabled and cfg.trainer.max_off_policy_steps > 0:
        bad("rollout.sglang.colocation.mode", "time_share with trainer.max_off_policy_steps > 0: servers release "
            "their memory during each update, so rollouts cannot overlap it",
            "use colocation.mode=static for asynchronous runs (python -m jaxrl_term.plan sizes both)")
    if cfg.rollout.sglang.pause_mode not in ("abort", "in_place", "retract"):
        bad("rollout.sglang.pause_mode", f"{cfg.rollout.sglang.pause_mode!r}", "use abort, in_place or retract")
    from jaxrl_term.rollout.router import ASSIGNMENT_MODES, POLICIES

    sg = cfg.rollout.sglang
    if str(sg.router).lower() not in ("auto", "true", "false"):
        bad("rollout.sglang.router", f"{sg.router!r}", "use auto (a router when there are several servers), true or "
            "false (the client's own per-episode affinity)")
    if sg.router_url and cfg.rollout.sglang.colocation.mode == "time_share" and sg.launch.enabled:
        bad("rollout.sglang.router_url", f"{sg.router_url!r} with colocation.mode=time_share: a router started "
            "elsewhere probes its servers on /health by default, a generation that kills a server whose memory is "
            "released", "leave router_url unset (the trainer starts one probing /v1/models), or use mode static")
    if str(sg.router).lower() == "false" and sg.router_url:
        bad("rollout.sglang.router_url", f"{sg.router_url!r} with rollout.sglang.router=false",
            "set router to auto or true to use it, or drop router_url")
    if sg.router_launch.policy not in POLICIES:
        bad("rollout.sglang.router_launch.policy", f"{sg.router_launch.policy!r}", f"use one of {list(POLICIES)}")
    if sg.router_launch.assignment_mode not in ASSIGNMENT_MODES:
        bad("rollout.sglang.router_launch.assignment_mode", f"{sg.router_launch.assignment_mode!r}",
            f"use one of {list(ASSIGNMENT_MODES)}")
    # -- agent, sandbox, reward, trainer --------------------------------------------------------------
    from jaxrl_term.agent.actions import SCAFFOLDS

    if cfg.agent.scaffold not in SCAFFOLDS:
        bad("agent.scaffold", f"{cfg.agent.scaffold!r}", f"use one of {sorted(SCAFFOLDS)}")
    mot = cfg.agent.max_observation_tokens
    if mot is not None and not 0 < mot < cfg.agent.max_context_tokens:
        bad("agent.max_observation_tokens", f"{mot}", f"use a positive number below agent.max_context_tokens "
            f"({cfg.agent.max_context_tokens}), or null for a quarter of it")
    if training and max(cfg.trainer.buckets, default=0) < cfg.agent.max_context_tokens:
        bad("trainer.buckets", f"the largest length bucket ({max(cfg.trainer.buckets, default=0)}) is shorter than "
            f"an episode may grow (agent.max_context_tokens={cfg.agent.max_context_tokens})",
            "add a bucket of at least agent.max_context_tokens, or lower agent.max_context_tokens")
    if cfg.sandbox.backend not in ("docker", "local", "auto"):
        bad("sandbox.backend", f"{cfg.sandbox.backend!r}", "use docker, local or auto")
    for key in ("agent_network", "verifier_network"):
        if cfg.sandbox.get(key, "task") not in ("task", "none", "public"):
            bad(f"sandbox.{key}", f"{cfg.sandbox[key]!r}", "use task (each task's own policy), none or public")
    hosts = cfg.sandbox.get("docker", {}).get("hosts") or []
    if hosts:  # several Docker engines: every entry checked before anything connects (sandbox/engines.py)
        from omegaconf import OmegaConf

        from jaxrl_term.sandbox.engines import EnginePool

        d = cfg.sandbox.docker
        settings = {k: d.get(k, v) for k, v in (("cooldown_s", 60.0), ("probe_interval_s", 5.0),
                                                ("probe_timeout_s", 5.0), ("probe_misses", 2))}
        try:
            EnginePool(OmegaConf.to_container(hosts, resolve=True) if OmegaConf.is_config(hosts) else list(hosts),
                       **settings)
        except (ValueError, TypeError) as e:
            key = next((f"sandbox.docker.{k}" for k in settings if f"sandbox.docker.{k}=" in str(e)),
                       "sandbox.docker.hosts")
            bad(key, str(e), "each entry: {url: unix://...|tcp://host:port|ssh://user@host, capacity: N, name, "
                "tls_verify, ca_cert, client_cert, client_key}" if key.endswith("hosts") else "")
    if cfg.reward.scoring not in ("weighted", "binary"):
        bad("reward.scoring", f"{cfg.reward.scoring!r}", "use weighted or binary")
    if cfg.reward.on_judge_missing not in ("renormalize", "wait"):
        bad("reward.on_judge_missing", f"{cfg.reward.on_judge_missing!r}", "use renormalize or wait")
    from jaxrl_term.reward.combine import UNFINISHED

    if cfg.reward.unfinished not in UNFINISHED:
        bad("reward.unfinished", f"{cfg.reward.unfinished!r}", "use score (the tests decide) or zero (an episode that "
            "never declared the task done scores 0)")
    if cfg.reward.judge_weight > 0:
        eps = list(cfg.reward.judge.endpoints)
        if not eps:
            bad("reward.judge.endpoints", "reward.judge_weight > 0 needs at least one judge endpoint")
        elif need_paths and not any(not e.api_key_env or os.environ.get(e.api_key_env) for e in eps):
            keys = ", ".join(sorted({e.api_key_env for e in eps}))
            if cfg.reward.on_judge_missing == "renormalize":
                bad("reward.judge.endpoints", f"no judge in the chain has its API key ({keys} unset), so every "
                    "judgement would be missing and reward.on_judge_missing=renormalize would silently make the "
                    f"{cfg.reward.tests_weight:g} / {cfg.reward.judge_weight:g} reward tests-only for the whole run",
                    f"export {keys.split(', ')[0]} (or add a keyless local endpoint), or set reward.judge_weight=0")
            else:
                import logging

                logging.getLogger(__name__).warning("no judge API key available (%s): every judgement will wait "
                                                    "and then be dropped", keys)
    if cfg.trainer.resume not in ("auto", "true", "false"):
        bad("trainer.resume", f"{cfg.trainer.resume!r}", "use auto, true or false")
    if cfg.trainer.max_consecutive_failed_groups < 1:
        bad("trainer.max_consecutive_failed_groups", f"{cfg.trainer.max_consecutive_failed_groups} must be >= 1 "
            "(groups dropped on errors in a row before the run stops)")
    if cfg.trainer.max_consecutive_skips < 1:
        bad("trainer.max_consecutive_skips", f"{cfg.trainer.max_consecutive_skips} must be >= 1")
    if cfg.trainer.eval_every < 0:
        bad("trainer.eval_every", f"{cfg.trainer.eval_every} must be >= 0", "0 turns the held-out evaluation off")
    if cfg.trainer.trajectory_samples < -1:
        bad("trainer.trajectory_samples", f"{cfg.trainer.trajectory_samples}", "use -1 (all), 0 (none) or a count")
    ev = cfg.eval
    if ev.attempts < 1:
        bad("eval.attempts", f"{ev.attempts} must be >= 1")
    if ev.concurrency < 1:
        bad("eval.concurrency", f"{ev.concurrency} must be >= 1")
    if ev.max_retries < 0:
        bad("eval.max_retries", f"{ev.max_retries} must be >= 0")
    if ev.attempt_deadline_s is not None and not ev.attempt_deadline_s > 0:
        bad("eval.attempt_deadline_s", f"{ev.attempt_deadline_s} must be > 0", "or null for the task's limits")
    if ev.top_p is not None and not 0 < ev.top_p <= 1:
        bad("eval.top_p", f"{ev.top_p} must be in (0, 1]")
    if ev.temperature is not None and ev.temperature < 0:
        bad("eval.temperature", f"{ev.temperature} must be >= 0")
    if cfg.logging.wandb.enabled:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            bad("logging.wandb.enabled", "true, but the wandb package is not installed",
                "pip install -e '.[wandb]' (and `wandb login`, or WANDB_API_KEY), or logging.wandb.enabled=false")
    cur = cfg.data.curriculum
    if cur.enabled:
        from jaxrl_term.tasks.curriculum import CurriculumSettings

        try:
            CurriculumSettings(tuple(cur.band), cur.window, cur.out_of_band_weight)
        except (ValueError, TypeError) as e:
            bad("data.curriculum", str(e))
    if not need_paths:
        return out
    # -- paths ----------------------------------------------------------------------------------------
    if not cfg.model.path and not cfg.model.random_init:
        bad("model.path", f"missing: give the HF directory of {cfg.model.name} (config.json, safetensors, tokenizer)",
            "e.g. model.path=/models/Qwen3-8B; or model.random_init=true")
    elif cfg.model.path:
        mp = Path(os.path.expanduser(str(cfg.model.path)))
        if not mp.is_dir():
            bad("model.path", f"{mp} is not a directory", "give an HF model directory (config.json + safetensors)")
        else:
            if not (mp / "config.json").is_file():
                bad("model.path", f"{mp} has no config.json", "give an HF model directory")
            if not any(mp.glob("*.safetensors")) and not (mp / "model.safetensors.index.json").is_file():
                bad("model.path", f"{mp} has no *.safetensors weights", "convert the checkpoint to safetensors")
    try:
        tok = str(cfg.model.tokenizer) if cfg.model.tokenizer is not None else ""
    except Exception:  # noqa: BLE001 - an interpolation such as ${model.path} with model.path unset
        tok = ""
        if cfg.model.path:
            bad("model.tokenizer", "cannot be resolved", "give model.tokenizer=DIR, tiny or qwen3")
    if tok and tok not in ("tiny", "qwen3") and not (Path(os.path.expanduser(tok)) / "tokenizer.json").is_file():
        bad("model.tokenizer", f"{tok} has no tokenizer.json", "give an HF tokenizer directory, or tiny / qwen3")
    from jaxrl_term.runtime_env import env_problems

    for key, what, fix in env_problems(dict(cfg.trainer.cluster.env or {})):
        bad(key, what, fix)
    data_problems(cfg.data, "data", bad)
    if cfg.trainer.eval_every or cfg.trainer.eval_before_train:
        data_problems(cfg.eval.data, "eval.data", bad)
    return out


def context_problems(cfg, bad) -> None:
    """Contexts past the model's positions: ``max_position_embeddings``, or with YaRN (``model.rope_scaling``, else
    model.path's config.json) original x factor, the range SGLang's cos/sin cache covers. Checked: the agent's
    context (which bounds every training row: positions restart per packed segment, so a longer length bucket adds
    none), the launched servers' ``--context-length``, the servers' stated context, the embedded engine's cache.
    With SGLang, YaRN keys its rotary embedding ignores are refused (servers and trainer would differ)."""
    from pathlib import Path

    from jaxrl_term.model.rope import SGLANG_IGNORED_KEYS

    try:
        arch, _ = model_arch(cfg)
    except ValueError as e:  # ModelConfigError (model.rope_scaling, model.options), CheckpointError (config.json)
        msg = str(e)
        if msg.startswith("model.rope_scaling: "):
            bad("model.rope_scaling", msg.removeprefix("model.rope_scaling: "))
        else:
            bad("model.options" if msg.startswith("model.") else "model.path", msg)
        return
    r = cfg.rollout
    # the positions an episode can reach: the agent's context, cut by the engine's own limit when it is smaller
    # (the embedded engine's cache, the servers' context); a launched server's --context-length past the model's
    # range is refused by SGLang itself, whatever the agent uses
    agent = ("agent.max_context_tokens", int(cfg.agent.max_context_tokens))
    engine: list[tuple[str, int]] = []
    if r.engine == "sglang":
        if r.sglang.launch.enabled and r.sglang.launch.context_length:
            engine.append(("rollout.sglang.launch.context_length", int(r.sglang.launch.context_length)))
        if r.sglang.context_length:
            engine.append(("rollout.sglang.context_length", int(r.sglang.context_length)))
    elif r.engine == "jax" and r.jax.max_seq_len:
        engine.append(("rollout.jax.max_seq_len", int(r.jax.max_seq_len)))
    ctx = [agent] if not engine or agent[1] <= min(v for _, v in engine) else []
    ctx += [(k, v) for k, v in engine if k == "rollout.sglang.launch.context_length" or v < agent[1]]
    limit, ys = arch.max_context, arch.rope_scaling
    over = [(k, int(v)) for k, v in ctx if v and int(v) > limit]
    if over:
        need = max(v for _, v in over)
        names = " and ".join(f"{k}={v}" for k, v in over)
        verb = "is" if len(over) == 1 else "are"
        if ys is None:
            here = cfg.model.path and (Path(str(cfg.model.path)).expanduser() / "config.json").is_file()
            src = (f"max_position_embeddings of {cfg.model.path}/config.json" if here
                   else "model.max_position_embeddings")
            orig = 32768 if limit >= 32768 else limit  # Qwen3's pre-training length (model card)
            factor = max(1.0, -(-need * 2 // orig) / 2)  # rounded up to a multiple of 0.5
            bad(over[0][0], f"{names} {verb} past the model's {limit} positions ({src}, no rope_scaling): the "
                "trainer and the engines would run plain RoPE beyond the trained range",
                f"extend it on purpose with YaRN, model.rope_scaling={{rope_type:yarn,factor:{factor:.1f},"
                f"original_max_position_embeddings:{orig}}} ({orig} x {factor:.1f} >= {need}; 32768 is Qwen3's "
                f"pre-training length), or lower the context to {limit}")
        else:
            orig = ys.original_max_position_embeddings
            bad(over[0][0], f"{names} {verb} past the model's {limit} positions (YaRN: "
                f"original_max_position_embeddings {orig} x factor {ys.factor:g})",
                f"raise model.rope_scaling.factor to {-(-need * 2 // orig) / 2:.1f} or more, or lower the context "
                f"to {limit}")
    ignored = [k for k in SGLANG_IGNORED_KEYS if ys is not None and getattr(ys, k) is not None]
    if ignored and r.engine == "sglang":
        bad("model.rope_scaling", f"YaRN keys {ignored}: SGLang's YaRN rotary embedding does not read them, so the "
            "servers' RoPE would differ from the trainer's", "remove them (attention factor 0.1 ln(factor) + 1)")


def data_problems(data, prefix: str, bad) -> None:
    """Problems of a task source (``data`` or ``eval.data``): a missing source, an unknown split/family/
    difficulty of the built-in tasks, a path that does not exist."""
    import os
    from pathlib import Path

    src = data.source
    if src in (None, ""):
        bad(f"{prefix}.source", "missing: give the tasks", "a task directory, a TB-RL .csv, a .parquet or builtin[:split]")
    elif str(src).startswith("builtin"):
        from jaxrl_term.tasks.builtin import DIFFICULTIES, FAMILIES, SPLITS

        split = str(src).partition(":")[2] or data.split
        if split not in SPLITS:
            bad(f"{prefix}.split" if ":" not in str(src) else f"{prefix}.source", f"split {split!r}",
                f"use one of {SPLITS}")
        for f in data.families or ():
            if f not in FAMILIES:
                bad(f"{prefix}.families", f"{f!r} is not a built-in family", f"use some of {sorted(FAMILIES)}")
        for d in data.difficulties or ():
            if d not in DIFFICULTIES:
                bad(f"{prefix}.difficulties", f"{d!r}", f"use some of {DIFFICULTIES}")
    elif not Path(os.path.expanduser(str(src))).exists():
        bad(f"{prefix}.source", f"{src} does not exist", "a task directory, a TB-RL .csv, a .parquet or builtin[:split]")


def format_problems(problems) -> str:
    return "\n".join(f"config error: {k}: {what}" + (f"; {fix}" if fix else "") for k, what, fix in problems)


def validate(cfg, *, need_paths: bool = True, training: bool = True) -> None:
    """``preflight`` as an exception: every problem at once, one line each."""
    problems = preflight(cfg, need_paths=need_paths, training=training)
    if problems:
        raise ConfigError(format_problems(problems).removeprefix("config error: "))


def register() -> None:
    from omegaconf import OmegaConf

    from jaxrl_term.utils.paths import shared_path

    if not OmegaConf.has_resolver("shared"):  # ${shared:datasets/...}: a path under the project's shared/ folder
        OmegaConf.register_new_resolver("shared", shared_path)
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    cs.store(name="eval_config_schema", node=EvalRunConfig)
    cs.store(name="sft_config_schema", node=SFTRunConfig)
    cs.store(name="datagen_config_schema", node=DatagenRunConfig)


def preflight_for_plan(cfg) -> None:
    """The planner's checks: every config check except those that need weights or data on this machine."""
    validate(cfg, need_paths=False)


def model_arch(cfg):
    """(Qwen3Config, ModelOptions): the architecture from ``model.path``'s config.json when it exists here,
    else from the model config group (the planner needs no weights)."""
    from pathlib import Path

    if cfg.model.path and (Path(cfg.model.path).expanduser() / "config.json").is_file():
        from jaxrl_term.model.hf import read_config

        _, opts = model_from_cfg(cfg.model)
        return read_config(Path(cfg.model.path).expanduser(), model_overrides(cfg.model)), opts
    return model_from_cfg(cfg.model)


def model_overrides(cfg: ModelCfg) -> dict[str, Any]:
    """config.json keys the model config group replaces in an HF directory (``read_config`` / ``load_pretrained``
    ``overrides``; SGLang's ``--json-model-override-args``): ``rope_scaling`` when set."""
    from omegaconf import OmegaConf

    rs = getattr(cfg, "rope_scaling", None)
    if rs is None:
        return {}
    return {"rope_scaling": OmegaConf.to_container(rs, resolve=True) if OmegaConf.is_config(rs) else dict(rs)}


def model_from_cfg(cfg: ModelCfg):
    """(Qwen3Config, ModelOptions) from the model config group."""
    from jaxrl_term.model.qwen3 import ModelOptions, Qwen3Config

    arch = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(Qwen3Config)}
    arch["rope_scaling"] = model_overrides(cfg).get("rope_scaling")
    opts = ModelOptions(**{f.name: getattr(cfg.options, f.name) for f in dataclasses.fields(ModelOptions)
                           if hasattr(cfg.options, f.name)})
    return Qwen3Config(**arch), opts
