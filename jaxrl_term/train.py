"""Hydra entry point: ``python -m jaxrl_term.train [+experiment=NAME] [key=value ...]``.

One RL step: pull a batch of scored groups from the rollout pipeline -> advantages -> ``rl.batch`` arrays ->
the jitted update (in a worker thread, so rollouts for the next step keep running) -> weight sync to the
engine (in-process for the embedded engine; ``save_pretrained`` + SGLang update for servers) -> metrics ->
checkpoint. Multi-host: every process runs this same loop over one global mesh (``jax.distributed``); process
0 drives the rollouts and sends each batch over the coordination service's key-value store; every collective
(update, export, checkpoint, resume, final export) is called by every process; only process 0 writes logs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path

import hydra
from omegaconf import OmegaConf

from jaxrl_term.config import Config, format_problems, model_from_cfg, model_overrides, preflight, register

log = logging.getLogger("jaxrl_term.train")
CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")
register()


# --------------------------------------------------------------------------------------------- building


def build_tokenizer(model_cfg, cache_dir: Path):
    from jaxrl_term.model.tokenizer import ensure_tokenizer, load_tokenizer

    spec = model_cfg.tokenizer
    if spec in ("tiny", "qwen3"):
        path = ensure_tokenizer(spec, cache_dir / f"tokenizer-{spec}")
    else:
        path = Path(spec).expanduser()
    return load_tokenizer(path), path


def build_model(cfg: Config, mesh, rules):
    from jaxrl_term.model.hf import load_pretrained
    from jaxrl_term.model.qwen3 import create_model
    from jaxrl_term.parallel.mesh import ShardingCtx

    arch, opts = model_from_cfg(cfg.model)
    if cfg.model.path:
        return load_pretrained(cfg.model.path, param_dtype=opts.param_dtype, compute_dtype=opts.compute_dtype,
                               mesh=mesh, rules=rules, options=opts, overrides=model_overrides(cfg.model))
    return create_model(arch, opts, seed=cfg.seed, shard=ShardingCtx(mesh, rules))


def resolve_backend(name: str) -> str:
    if name != "auto":
        return name
    from jaxrl_term.sandbox.images import DockerUnavailable, docker_client

    try:
        docker_client()
        return "docker"
    except DockerUnavailable as e:
        log.warning("sandbox.backend=auto: no Docker engine (%s); using the local (bubblewrap) backend", e)
        return "local"


def sandbox_backend(sb) -> tuple[str, object | None]:
    """(backend, image builder) for ``sandbox.*``, after reaping what earlier (killed) runs left behind."""
    backend, builder = resolve_backend(sb.backend), None
    if backend == "local":
        from jaxrl_term.sandbox.local import reap as reap_local

        reap_local()
    if backend == "docker":
        from jaxrl_term.sandbox.docker import RUN_ID, reap

        log.info("sandbox containers carry run id %s (python -m jaxrl_term.sandbox.docker reap --run %s "
                 "[--all-hosts -- ...] removes them)", RUN_ID, RUN_ID)
        from jaxrl_term.sandbox.images import DEFAULT_IMAGE_MAP, ImageBuilder

        obj = OmegaConf.to_object(sb) if OmegaConf.is_config(sb) else sb
        pool = obj.engines() if hasattr(obj, "engines") else None
        try:
            reap()
        except Exception as e:  # noqa: BLE001 - with sandbox.docker.hosts the trainer's node may run no engine
            if pool is None:
                raise
            log.info("no default Docker engine to reap on this node (%s); reaping sandbox.docker.hosts", e)
        for engine in (pool.engines if pool is not None else ()):
            try:  # every engine the run places sandboxes on: what killed runs left there
                reap(client_=engine.client())
            except Exception as e:  # noqa: BLE001 - a down engine is found out again at placement
                log.warning("could not reap on Docker engine %s: %s", engine.name, e)
        image_map = [tuple(x) for x in sb.image_map] or DEFAULT_IMAGE_MAP
        builder = ImageBuilder(image_map=image_map, ca_bundle=sb.extra_ca_bundle,
                               max_parallel_builds=sb.max_parallel_builds)
    return backend, builder


def params_digest(params) -> str:
    """A hash of every parameter's bytes. Collective in multi-process runs (every process must call it)."""
    import jax
    import numpy as np

    h = hashlib.sha256()
    for x in jax.tree.leaves(params):
        if not getattr(x, "is_fully_addressable", True):
            from jax.experimental import multihost_utils

            x = multihost_utils.process_allgather(x, tiled=True)
        h.update(np.ascontiguousarray(jax.device_get(x)).tobytes())
    return h.hexdigest()[:16]


def batch_arrays(batch) -> dict:
    return {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}


# ------------------------------------------------------------------------------------------------ run


class Trainer:
    """Everything one run holds. ``run()`` is the training loop, and every JAX process runs it: only process 0
    talks to engines, sandboxes and judges; every collective (update, weight export, checkpoint, resume,
    final export) is on the shared path, and the others wait for process 0's batches on the host."""

    def __init__(self, cfg: Config):
        from jaxrl_term.parallel.mesh import initialize_distributed
        from jaxrl_term.parallel.multihost import HostChannel
        from jaxrl_term.rollout.setup import launch_local_servers
        from jaxrl_term.rollout.colocation import config_env
        from jaxrl_term.runtime_env import apply_env

        self.cfg = cfg
        # First, before anything touches a backend: the XLA allocator settings of the colocation plan and
        # trainer.cluster.env (main() applied them already; a library caller gets the same order here).
        apply_env(config_env(cfg), who="train")
        d = cfg.mesh.distributed
        initialize_distributed(enabled=d.enabled, coordinator_address=d.coordinator_address,
                               num_processes=d.num_processes, process_id=d.process_id,
                               local_device_ids=d.local_device_ids, initialization_timeout_s=d.initialization_timeout_s)
        self.channel = HostChannel("jaxrl_term")
        self.lead = self.channel.lead
        if cfg.rollout.engine == "jax" and self.channel.count > 1:
            raise ValueError("rollout.engine=jax is a single-process engine; multi-host runs use rollout=sglang")
        self.run_dir = Path(cfg.run_dir)
        # Still before anything touches a GPU: this node's SGLang servers, started and ready (SGLang sizes its KV
        # cache from the memory free when it starts).
        self.launcher = launch_local_servers(cfg, self.run_dir)
        if self.launcher is not None:
            try:
                asyncio.run(self.launcher.wait_ready(cfg.rollout.sglang.launch.ready_timeout_s))
            except BaseException:
                self.launcher.stop()
                raise
        try:
            self._build()
        except BaseException:
            if self.launcher is not None:
                self.launcher.stop()
            raise

    def _build(self) -> None:
        from flax import nnx

        from jaxrl_term.parallel.mesh import LogicalRules, make_mesh
        from jaxrl_term.rl.step import make_train_step
        from jaxrl_term.utils.checkpoint import Checkpointer
        from jaxrl_term.utils.metrics import MetricsLogger

        cfg = self.cfg
        self.mesh = make_mesh(OmegaConf.to_container(cfg.mesh.shape))
        self.rules = LogicalRules.from_mapping(OmegaConf.to_container(cfg.mesh.rules) if cfg.mesh.rules else None)
        self.tok, self.tok_path = build_tokenizer(cfg.model, Path(os.path.expanduser(cfg.cache_dir)))
        model = build_model(cfg, self.mesh, self.rules)
        if len(self.tok) > model.config.vocab_size:
            raise ValueError(f"model.vocab_size={model.config.vocab_size} is smaller than the tokenizer "
                             f"({len(self.tok)} tokens in {self.tok_path}); pick a matching model/tokenizer pair")
        self.arch, self.opts = model.config, model.options
        algo, optim = OmegaConf.to_object(cfg.algo), OmegaConf.to_object(cfg.optim)
        # log-probs are recomputed under the distribution the engine sampled from: one temperature
        self.algo = dataclasses.replace(algo, temperature=cfg.rollout.temperature)
        if optim.offload:  # fp32 master + AdamW on the host, a compute-dtype copy on the devices
            from jaxrl_term.rl.offload import make_offload_train_step

            self.ts = make_offload_train_step(self.arch, self.algo, optim, self.mesh, options=self.opts,
                                              rules=self.rules)
        else:
            self.ts = make_train_step(self.arch, self.algo, optim, self.mesh, options=self.opts, rules=self.rules)
        self.ckpt = Checkpointer(self.run_dir / "checkpoints", max_to_keep=cfg.trainer.keep_checkpoints)
        self.metrics = MetricsLogger(self.run_dir, tensorboard=cfg.logging.tensorboard, enabled=self.lead,
                                     console=cfg.logging.console, wandb={**OmegaConf.to_container(cfg.logging.wandb),
                                            "name": cfg.run_name},
                                     config=OmegaConf.to_container(cfg, resolve=True))
        self._init_params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        del model
        self.ref_params = None
        self.start_step, self.start_seq = 0, 0
        self.curriculum_state = None  # the curriculum sampler's state from the checkpoint
        resume, latest = cfg.trainer.resume, self.ckpt.latest_step()
        if resume == "true" and latest is None:
            raise FileNotFoundError(f"trainer.resume=true but {self.run_dir / 'checkpoints'} has no checkpoint")
        self.state = None  # after the warm start (run()), or restored here
        if latest is not None and resume in ("auto", "true"):
            self.state, meta = self.ckpt.restore(self.ts.abstract_state())  # collective: every process
            self.start_step, self.start_seq = int(meta["step"]), int(meta["seq"])
            self.curriculum_state = meta.get("curriculum")
            log.info("resumed from %s at step %d (data cursor %d)", self.run_dir / "checkpoints", self.start_step,
                     self.start_seq)
        self.engine = self.backend = self.builder = self.reward = None
        self.heldout: list = []  # eval.data's tasks (process 0)
        self.evals: dict[int, dict] = {}  # step -> held-out summary

    # -- weights -------------------------------------------------------------------------------------
    def reference_params(self, params):
        """The KL reference policy's params, placed for the no-grad pass."""
        import jax

        if self.cfg.optim.offload:
            return self.ts.device_params(params)
        return jax.device_put(params, self.ts.param_shardings)

    async def sync_weights(self, version: int) -> None:
        """New weights to the engine. Servers: every process joins the export (it gathers sharded parameters
        chunk by chunk); process 0 then has every server take back what it released for the update (time-sharing
        the GPUs; only what it released: ``rollout/memory.py``) and load it."""
        if self.cfg.rollout.engine == "jax":
            await self.engine.update_weights(self.state.params, version)
            return
        from jaxrl_term.model.hf import save_pretrained

        s = self.cfg.rollout.sglang
        out = Path(s.export_dir or (self.run_dir / "hf_export")) / "policy"
        write = True if not s.export_shared else self.lead
        await asyncio.to_thread(save_pretrained, self.ts.model(self.state.params), out, s.export_dtype,
                                tokenizer_dir=self.tok_path, write=write)
        self.channel.barrier(f"export/{version}")
        if self.lead:
            await self.cycle.load(out, version)

    async def start_engine(self) -> None:
        """The engine on process 0; server URLs from every node's launcher."""
        from jaxrl_term.rollout.memory import WeightCycle
        from jaxrl_term.rollout.setup import make_jax_engine, make_sglang_engine

        t0 = time.monotonic()
        if self.cfg.rollout.engine == "jax":
            log.info("rollout engine: the embedded JAX engine (its programs compile on the first requests)")
            self.engine = make_jax_engine(self.cfg, self.ts.model(self.state.params), self.tok, self.start_step)
            return
        if self.lead:
            log.info("rollout engine: waiting for SGLang servers to answer /health_generate (up to %.0fs)",
                     self.cfg.rollout.sglang.launch.ready_timeout_s)
        local = self.launcher.urls if self.launcher is not None else []
        urls = [u for node in self.channel.gather_json("servers", local) for u in node]
        if self.lead:
            # servers launched here start at version 0 (model.path); servers given by URL have an unknown version
            # until the first sync
            version = 0 if self.launcher is not None and not self.cfg.rollout.sglang.urls else None
            self.engine = make_sglang_engine(self.cfg, list(self.cfg.rollout.sglang.urls) + urls, version)
            s = self.cfg.rollout.sglang
            self.cycle = WeightCycle(self.engine, time_share=s.launch.enabled and s.colocation.mode == "time_share")
            # what a killed trainer left (released, paused) is undone before the first /health_generate
            await self.cycle.attach(s.launch.ready_timeout_s)
            log.info("rollout engine: %d server(s) ready after %.0fs", len(self.engine.urls)
                     if hasattr(self.engine, "urls") else 0, time.monotonic() - t0)
        self.channel.barrier("engine_ready")

    def make_pipeline(self, tasks):
        from jaxrl_term.rollout.engine import SamplingParams
        from jaxrl_term.rollout.pipeline import RolloutPipeline
        from jaxrl_term.sandbox.base import SandboxPool

        cfg = self.cfg
        agent = OmegaConf.to_object(cfg.agent)
        sb = OmegaConf.to_object(cfg.sandbox)
        pool = SandboxPool(self.backend, max_concurrent=sb.max_concurrent, **sb.limits())  # engines included
        sampling = SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                  top_k=cfg.rollout.top_k, max_new_tokens=agent.max_tokens_per_turn)
        self.reward = OmegaConf.to_object(cfg.reward).mixer()
        sampler = None
        if cfg.data.curriculum.enabled:
            from jaxrl_term.tasks.curriculum import CurriculumSampler, CurriculumSettings

            cur = cfg.data.curriculum
            sampler = CurriculumSampler(tasks, cfg.seed, CurriculumSettings(tuple(cur.band), cur.window,
                                                                            cur.out_of_band_weight),
                                        lookahead=cfg.trainer.groups_per_step * (1 + cfg.trainer.max_off_policy_steps),
                                        state=self.curriculum_state)
            if self.curriculum_state is None and self.start_seq:
                log.warning("resumed at data cursor %d without a curriculum state in the checkpoint (written "
                            "without data.curriculum): the curriculum starts from no observations", self.start_seq)
                sampler.cursor = self.start_seq
        return RolloutPipeline(
            tasks, engine=self.engine, tokenizer=self.tok, scaffold_factory=agent.scaffold_obj,
            group_size=self.algo.group_size, groups_per_step=cfg.trainer.groups_per_step, sampling=sampling,
            limits=agent.limits(), backend=self.backend, builder=self.builder, pool=pool, scoring=cfg.reward.scoring,
            reward_fn=self.reward,
            max_concurrent_episodes=cfg.trainer.max_concurrent_episodes,
            max_episode_retries=cfg.trainer.max_episode_retries, drop_zero_variance=cfg.trainer.drop_zero_variance,
            max_filtered_per_step=cfg.trainer.max_filtered_per_step,
            max_consecutive_failed_groups=cfg.trainer.max_consecutive_failed_groups,
            max_off_policy_steps=cfg.trainer.max_off_policy_steps, enable_thinking=agent.enable_thinking,
            seed=cfg.seed, start_seq=self.start_seq, policy_version=self.start_step, sampler=sampler)

    def make_builder(self):
        """Process 0's sandbox backend and image builder (reaping leftovers of earlier runs first)."""
        self.backend, self.builder = sandbox_backend(self.cfg.sandbox)

    # -- held-out evaluation -------------------------------------------------------------------------
    def load_heldout(self, train_tasks) -> list:
        """``eval.data``'s tasks, when an evaluation is asked for; none of them may be a training task nor have a
        training task's instruction (byte-identical prompts)."""
        from jaxrl_term.tasks.dataset import load_from_config

        tcfg = self.cfg.trainer
        if not (tcfg.eval_every or tcfg.eval_before_train):
            return []
        tasks = load_from_config(self.cfg.eval.data)
        overlap = {t.id for t in tasks} & {t.id for t in train_tasks}
        if overlap:
            raise ValueError(f"eval.data: {len(overlap)} held-out task(s) are also training tasks (e.g. "
                             f"{sorted(overlap)[0]}); exclude them (eval.data.exclude_ids / data.exclude_ids) or "
                             "use a disjoint split (builtin: data.split=train, eval.data.split=heldout)")
        train_by_text: dict[str, list[str]] = {}  # a held-out prompt the policy was trained on is not held out
        for t in train_tasks:
            train_by_text.setdefault(t.instruction, []).append(t.id)
        same = [t for t in tasks if t.instruction in train_by_text]
        if same:
            text = same[0].instruction
            held, trained = sorted(t.id for t in same if t.instruction == text), sorted(train_by_text[text])
            raise ValueError(
                f"eval.data: {len(same)} held-out task(s) have an instruction byte-identical to a training task's "
                f"(e.g. held-out {', '.join(held[:3])}{' ...' if len(held) > 3 else ''} and training "
                f"{', '.join(trained[:3])}{' ...' if len(trained) > 3 else ''}: {text[:80]!r}); exclude them "
                "(eval.data.exclude_ids / data.exclude_ids) or split by instruction (builtin: data.split=train, "
                "eval.data.split=heldout, whose split is a hash of the instruction)")
        return tasks

    def set_aside_later_evals(self) -> None:
        """A resumed run's evaluations after its checkpoint were made with weights it no longer has (killed
        between an evaluation and its checkpoint): move them to eval/stale/ so none of their attempts is reused."""
        root = self.run_dir / "eval"
        if not root.is_dir():
            return
        for d in sorted(root.glob("step_*")):
            if d.is_dir() and d.name[5:].isdigit() and int(d.name[5:]) > self.start_step:
                dest = root / "stale" / f"{d.name}.{int(time.time())}"
                dest.parent.mkdir(exist_ok=True)
                d.rename(dest)
                log.warning("%s was evaluated with weights past the checkpoint at step %d: moved to %s", d,
                            self.start_step, dest)

    _eval_reward = None

    def eval_mixer(self):
        """The held-out evaluation's reward mixer: its own judge client, so its calls and costs stay out of the
        training metrics."""
        if self._eval_reward is None:
            self._eval_reward = OmegaConf.to_object(self.cfg.reward).mixer(evaluation=True)
        return self._eval_reward

    async def evaluate(self, step: int) -> dict:
        """Held-out evaluation of the engine's current weights (``step`` updates applied): results in
        run_dir/eval/step_N/ (resumable), ``eval/*`` in the metrics sinks, a few transcripts as text."""
        from jaxrl_term.agent.transcript import read_jsonl
        from jaxrl_term.eval.run import held_out

        out = self.run_dir / "eval" / f"step_{step:06d}"
        log.info("held-out evaluation at step %d: %d task(s) x %d attempt(s) -> %s", step, len(self.heldout),
                 self.cfg.eval.attempts, out)
        t0 = time.monotonic()
        s = await held_out(self.cfg, self.heldout, out, engine=self.engine, tokenizer=self.tok, backend=self.backend,
                           builder=self.builder, reward_fn=self.eval_mixer(), step=step)
        m = {f"eval/{k}": s[k] for k in ("pass@1", "pass@1_std", "pass@k", "k", "tasks", "attempts",
                                          "attempts_invalid", "reward_mean", "turns_mean", "tokens_mean")}
        m.update({f"eval/failure/{k}": v for k, v in s["failure_modes"].items()})
        m.update({f"eval/pass@1/{d}": g["pass@1"] for d, g in s["by_difficulty"].items() if d != "None"})
        m.update({f"eval/{k}": v for k, v in self._eval_reward.take_stats().items()})  # its own judge stats
        m["eval/seconds"] = time.monotonic() - t0
        self._eval_pending = (step, m, read_jsonl(out / "transcripts.jsonl"))
        log.info("held-out pass@1 at step %d: %.3f (pass@%d %.3f) over %d task(s)", step, s["pass@1"] or 0.0,
                 s["k"], s["pass@k"] or 0.0, s["tasks"])
        self.evals[step] = s
        return s

    _eval_pending = None

    def flush_eval(self) -> None:
        """Log the last evaluation's metrics: after the step that produced its weights has logged its own, so
        every sink (wandb's steps only move forward) sees steps in order."""
        if self._eval_pending is not None:
            step, m, transcripts = self._eval_pending
            self._eval_pending = None
            self.metrics.log(step, m)
            self.log_text(step, "eval", transcripts)

    # -- one step ---------------------------------------------------------------------------------
    _skips = 0

    def count_skips(self, hist) -> int:
        """Call once per step: consecutive steps whose every update was skipped."""
        self._skips = self._skips + 1 if all(h.get("skipped", 0.0) for h in hist) else 0
        return self._skips

    @staticmethod
    def skip_reason(m: dict) -> str:
        if m.get("tokens", 1.0) == 0:
            return "the batch has no loss tokens"
        if m.get("no_signal"):
            return "no token has a non-zero advantage (all rewards in every group equal)"
        return f"the gradient is not finite (grad_norm={m.get('grad_norm')})"

    def build_batch(self, groups, step: int):
        import numpy as np

        from jaxrl_term.rl.advantages import check_rewards, group_advantages, shuffled_rewards
        from jaxrl_term.rl.batch import Sample, make_batch

        rewards = check_rewards(np.array([g.rewards for g in groups], np.float32))
        scored = rewards
        if self.algo.shuffle_rewards:  # placebo: the same update with rewards unlinked from the episodes
            scored = shuffled_rewards(rewards, seed=self.cfg.seed * 1_000_003 + step)
        adv = group_advantages(scored, self.algo.advantage, std_ddof=self.algo.std_ddof,
                               negative_weight=self.algo.negative_weight)
        # fresh: sampled by the weights this step trains (lag 0); the engine/trainer gap is measured on those only
        samples = [Sample(t.token_ids, t.train_mask(self.algo.mask_turns), t.logprobs, float(a),
                          fresh=g.version >= step)
                   for g, row in zip(groups, adv) for t, a in zip(g.trajectories, row)]
        batch = make_batch(samples, buckets=self.cfg.trainer.buckets, row_multiple=self.ts.shards,
                           pack=self.cfg.trainer.pack, vocab_size=self.arch.vocab_size)
        return batch, rewards, adv

    def write_samples(self, step: int, groups, advantages) -> None:
        """The step's episodes as transcripts (``trainer.trajectory_samples`` of them, -1 = all) and their token
        ids in a separate file; the first ``logging.text_samples`` also as text to TensorBoard / wandb."""
        from jaxrl_term.agent.transcript import Verdict, tokens_record, transcript, write_jsonl

        k = self.cfg.trainer.trajectory_samples
        if k == 0 or not self.lead:
            return
        rows = [(g, i, t, float(a)) for g, adv in zip(groups, advantages)
                for i, (t, a) in enumerate(zip(g.trajectories, adv))]
        rows = rows if k < 0 else rows[:k]
        out = self.run_dir / "trajectories" / f"step_{step:06d}"
        trs, toks = [], []
        for g, i, t, a in rows:
            rid = f"step-{step}/group-{g.seq}/{i}"
            trs.append(transcript(t, g.task, id=rid, attempt=i, step=step, group=g.seq, policy="train", advantage=a,
                                  result=Verdict(t.reward_parts)))
            toks.append(tokens_record(rid, t))
        write_jsonl(f"{out}.jsonl", trs)
        write_jsonl(f"{out}.tokens.jsonl", toks)
        self.log_text(step, "episodes", trs)

    def log_text(self, step: int, tag: str, transcripts) -> None:
        from jaxrl_term.agent.transcript import to_markdown

        for i, tr in enumerate(transcripts[: self.cfg.logging.text_samples]):
            self.metrics.log_text(step, f"{tag}/{i}", to_markdown(tr))

    def step_metrics(self, step, groups, rewards, hist, times, pipeline) -> dict:
        import numpy as np

        from jaxrl_term.utils.metrics import summarize

        trajs = [t for g in groups for t in g.trajectories]
        m: dict = {"policy_version": step + 1, "data/cursor": pipeline.consumed}
        m["reward/mean"], m["reward/std"] = float(rewards.mean()), float(rewards.std())
        m["reward/max"] = float(rewards.max())
        m["reward/pass_rate"] = float((rewards >= 1.0 - 1e-9).mean())
        m["batch/zero_variance_groups"] = sum(g.zero_variance for g in groups)
        lag = [step - g.version for g in groups]
        m["batch/version_lag_max"], m["batch/version_lag_mean"] = max(lag), float(np.mean(lag))
        m.update({k.replace("turns", "episode/turns"): v for k, v in summarize([len(t.turns) for t in trajs], "turns").items()})
        m["episode/tokens_mean"] = float(np.mean([len(t.token_ids) for t in trajs]))
        m["episode/policy_tokens_mean"] = float(np.mean([t.num_policy_tokens for t in trajs]))
        if self.algo.mask_turns != "none":  # the share of the policy's tokens algo.mask_turns took out of the loss
            kept = sum(sum(t.train_mask(self.algo.mask_turns)) for t in trajs)
            m["batch/turn_masked_frac"] = 1.0 - kept / max(1, sum(t.num_policy_tokens for t in trajs))
        m["episode/duration_s_mean"] = float(np.mean([t.duration_s for t in trajs]))
        for k, v in hist[-1].items():
            m[f"train/{k}"] = v
        # engine vs trainer numerics from the first update's forward pass (the weights that sampled the fresh
        # rows), not after epochs of updates
        for k in ("logp_gap_mean", "logp_gap_max", "mismatch_kl", "fresh_tokens"):
            if k in hist[0]:
                m[f"train/{k}"] = hist[0][k]
        m["train/updates"] = len(hist)
        m["train/skipped_updates"] = sum(h.get("skipped", 0.0) for h in hist)
        m.update(pipeline.take_counters())
        m.update(self.reward.take_stats())
        judged = [t.reward_parts.get("judge") for t in trajs if "judge" in t.reward_parts]
        if judged:
            present = [j for j in judged if j is not None]
            m["reward/judge_mean"] = float(np.mean(present)) if present else None
            m["reward/judge_missing"] = len(judged) - len(present)
        tests = [t.reward_parts.get("tests") for t in trajs if t.reward_parts.get("tests") is not None]
        if tests:
            m["reward/tests_mean"] = float(np.mean(tests))
        m.update({f"time/{k}": v for k, v in times.items()})
        m["task_ids"] = [g.task.id for g in groups]
        return m

    async def run(self) -> dict:
        from jaxrl_term.rl.batch import Batch
        from jaxrl_term.sft import warm_start
        from jaxrl_term.tasks.dataset import load_from_config

        cfg, tcfg, ch = self.cfg, self.cfg.trainer, self.channel
        tasks = None
        if self.lead:
            tasks = load_from_config(cfg.data)
            self.heldout = self.load_heldout(tasks)
            self.set_aside_later_evals()
            self.make_builder()
            from jaxrl_term.tasks.env import check_tasks_open

            check_tasks_open(tasks, OmegaConf.to_object(cfg.sandbox).limits(), self.backend)
        warm = {}
        resumed = self.state is not None
        # The starting policy: the warm start's result (cached), else the loaded weights. It is the RL start and
        # the KL reference, so a resumed run with a KL term recomputes it too (from the cache).
        if not resumed or self.algo.kl_coef:
            params = self._init_params
            if tcfg.warm_start.enabled:
                params, warm = await warm_start(cfg, tokenizer=self.tok, arch=self.arch, opts=self.opts,
                                                mesh=self.mesh, rules=self.rules, init_params=params, tasks=tasks,
                                                channel=ch, backend=self.backend, builder=self.builder,
                                                microbatches=self.algo.microbatches)
                if not resumed:
                    self.metrics.log_warm_start(warm)
            if self.algo.kl_coef:
                self.ref_params = self.reference_params(params)
            if not resumed:
                self.state = self.ts.init_state(params, seed=cfg.seed)
        if resumed and tcfg.log_param_digest:  # every process: the digest gathers sharded parameters
            self.metrics.log(self.start_step - 1, {"resume/params_digest": params_digest(self.state.params)})
        self._init_params = None
        await self.start_engine()
        # launched servers start from model.path; servers given by URL hold what their last client left there
        if cfg.rollout.engine == "sglang" and (self.start_step > 0 or cfg.rollout.sglang.urls):
            await self.sync_weights(self.start_step)
        pipeline = self.make_pipeline(tasks) if self.lead else None
        if self.lead:
            log.info("run dir %s: %d tasks, %s sandboxes, engine %s, %d process(es), steps %d..%d", self.run_dir,
                     len(tasks), self.backend, cfg.rollout.engine, ch.count, self.start_step, tcfg.steps)
            pipeline.start()
            if tcfg.eval_before_train and self.start_step == 0:
                await self.evaluate(0)
                self.flush_eval()
        t_run = time.monotonic()
        history: list[dict] = []
        step, done = self.start_step, False
        time_share = (cfg.rollout.engine == "sglang" and cfg.rollout.sglang.launch.enabled
                      and cfg.rollout.sglang.colocation.mode == "time_share")
        try:
            for step in range(self.start_step, tcfg.steps):
                t0 = time.monotonic()
                arrays = meta = groups = rewards = adv = None
                if self.lead:
                    groups = await pipeline.get_batch(step)
                    batch, rewards, adv = self.build_batch(groups, step)
                    arrays, meta = batch_arrays(batch), {"seq": pipeline.consumed}
                    if hasattr(pipeline.sampler, "state"):  # the curriculum as of this cursor, for the checkpoint
                        meta["curriculum"] = pipeline.sampler.state()
                    if time_share:  # the servers are idle (synchronous run): free their memory for the update
                        await self.cycle.release()
                t1 = time.monotonic()
                arrays, meta = await asyncio.to_thread(ch.broadcast_arrays, f"batch/{step}", arrays, meta)
                if arrays is None:
                    raise RuntimeError(f"process 0 stopped before step {step}; see its log")
                busy0 = pipeline.busy_seconds() if self.lead else 0.0
                self.state, hist = await asyncio.to_thread(self.ts.update, self.state, Batch(**arrays),
                                                           self.ref_params)
                ch.delete(f"batch/{step}")  # the update was collective: every process has read it
                t2 = time.monotonic()
                overlap = (pipeline.busy_seconds() - busy0) if self.lead else 0.0
                await self.sync_weights(step + 1)
                if self.lead:
                    await pipeline.set_policy_version(step + 1)
                t3 = time.monotonic()
                if self.lead and tcfg.eval_every and ((step + 1) % tcfg.eval_every == 0 or step + 1 == tcfg.steps):
                    await self.evaluate(step + 1)  # the weights after step + 1 updates, before the checkpoint
                t3e = time.monotonic()
                if tcfg.checkpoint_every and (step + 1) % tcfg.checkpoint_every == 0:
                    self.ckpt.save(step + 1, self.state, {"step": step + 1, "seq": int(meta["seq"]),
                                                          "policy_version": step + 1,
                                                          **({"curriculum": meta["curriculum"]}
                                                             if meta.get("curriculum") else {})})
                skips = self.count_skips(hist)  # the same metrics on every process: all stop together
                if skips >= tcfg.max_consecutive_skips:
                    raise RuntimeError(
                        f"no update was applied in {skips} consecutive steps (trainer.max_consecutive_skips="
                        f"{tcfg.max_consecutive_skips}): last reason: {self.skip_reason(hist[-1])}. Check the "
                        "rewards (every group equal?), algo.advantage, and the loss mask")
                t4 = time.monotonic()
                digest = params_digest(self.state.params) if tcfg.log_param_digest else None  # collective
                if self.lead:
                    self.write_samples(step, groups, adv)
                    times = {"rollout_wait_s": t1 - t0, "update_s": t2 - t1, "weight_sync_s": t3 - t2,
                             "eval_s": t3e - t3, "checkpoint_s": t4 - t3e, "step_s": time.monotonic() - t0, "overlap_s": overlap,
                             "overlap_frac": overlap / max(t2 - t1, 1e-9)}
                    m = self.step_metrics(step, groups, rewards, hist, times, pipeline)
                    m["train/consecutive_skips"] = skips
                    if digest is not None:
                        m["params_digest"] = digest
                    self.metrics.log(step, m)
                    history.append(m)
                    self.flush_eval()
            done = True
        finally:
            if self.lead:
                self.flush_eval()  # an evaluation that finished before a failure still reaches the sinks
            if self.lead and not done:  # followers may be waiting for this step's batch: tell them to stop
                ch.broadcast_arrays(f"batch/{step}", None, {"stop": True})
            await self.close(pipeline)
        out = {"run_dir": str(self.run_dir), "steps": tcfg.steps, "start_step": self.start_step,
               **{k: v for k, v in warm.items() if not isinstance(v, list)},
               "seconds": time.monotonic() - t_run, "metrics": str(self.run_dir / "metrics.jsonl"),
               "trajectories": str(self.run_dir / "trajectories"), "checkpoints": self.ckpt.all_steps(),
               "processes": ch.count}
        if tcfg.export_final and self.start_step < tcfg.steps:
            from jaxrl_term.model.hf import save_pretrained

            dtype = "float32" if self.opts.param_dtype == "float32" else "bfloat16"
            params = self.ts.master_params(self.state) if cfg.optim.offload else self.state.params
            out["hf_final"] = str(save_pretrained(self.ts.model(params), self.run_dir / "hf_final", dtype,
                                                  tokenizer_dir=self.tok_path))  # collective
        if history:
            out["reward_first"], out["reward_last"] = history[0]["reward/mean"], history[-1]["reward/mean"]
        if self.evals:
            out["heldout_pass@1"] = {s: e["pass@1"] for s, e in sorted(self.evals.items())}
        self.ckpt.close()
        self.metrics.close()
        return out

    async def close(self, pipeline) -> None:
        if pipeline is not None:
            await pipeline.stop()
        for mixer in (self.reward, self._eval_reward):
            if mixer is not None and mixer.judge is not None:
                await mixer.judge.aclose()
        self.ckpt.wait()
        if self.engine is not None:
            if self.cfg.rollout.engine == "jax":
                self.engine.close()
            else:
                await self.engine.aclose()
        if self.launcher is not None:
            self.launcher.stop()


def print_summary(summary: dict, log_file: Path | None = None) -> None:
    """The run's summary table (and its report's path) on the console, and the same text in ``log_file``
    (the run's train.log: it holds every console line, not only the logging ones)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="jaxrl_term run summary", show_header=False)
    for k, v in summary.items():
        table.add_row(k, str(v))
    console = Console(record=True)
    console.print(table)
    if "report" in summary:
        console.print(f"report: {summary['report']}", markup=False, highlight=False)
    if log_file is not None and log_file.parent.is_dir():
        with open(log_file, "a") as f:
            f.write(console.export_text())


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def main(cfg: Config) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from jaxrl_term.sandbox.base import unwind_on_sigterm

    unwind_on_sigterm()  # SIGTERM closes sandboxes and servers like an exception would
    for noisy in ("httpx", "absl", "jax._src.xla_bridge", "orbax", "tensorboardX"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    problems = preflight(cfg)  # a sweep's jobs, and anything the early check could not see
    if problems:
        print(format_problems(problems), file=sys.stderr)
        sys.exit(2)
    if cfg.trainer.dry_run:
        print("preflight: ok")
        return
    from jaxrl_term.rollout.colocation import config_env
    from jaxrl_term.runtime_env import apply_env

    apply_env(config_env(cfg), who="train")  # before anything touches a backend (runtime_env.py)
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    (Path(cfg.run_dir) / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    trainer = Trainer(cfg)
    summary = asyncio.run(trainer.run())
    if trainer.lead:
        if cfg.trainer.report:
            summary["report"] = str(Path(cfg.run_dir) / "report.html")
        (Path(cfg.run_dir) / "summary.json").write_text(json.dumps(summary, indent=2))
        if cfg.trainer.report:  # after summary.json: the report reads it
            from jaxrl_term.report import write_report

            write_report(cfg.run_dir)
        print_summary(summary, Path(cfg.run_dir) / "train.log")


HYDRA_FLAGS = ("-m", "--multirun", "--cfg", "-c", "--help", "-h", "--hydra-help", "--info", "-i", "--resolve",
               "--shell-completion", "-sc", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
               "--config-dir", "-cd", "--version")


def early_preflight(argv: list[str]) -> list[str]:
    """Check the config before Hydra creates a run directory (it does so before calling ``main``): compose the
    same config with Hydra's compose API, print every problem as ``config error: KEY: what; fix`` and exit 2.
    ``--preflight`` runs only this. Sweeps and Hydra's own flags go straight to Hydra (``main`` checks each job).
    Returns argv without ``--preflight``."""
    dry = "--preflight" in argv
    argv = [a for a in argv if a != "--preflight"]
    if any(a.split("=")[0] in HYDRA_FLAGS for a in argv):
        return argv
    try:
        from jaxrl_term.plan import compose

        cfg = compose([a for a in argv if not a.startswith("-")])
    except Exception as e:  # noqa: BLE001 - Hydra's own composition errors: unknown keys, types, groups
        msg = str(e).strip() or type(e).__name__
        if e.__cause__ is not None and str(e.__cause__).strip() not in msg:
            msg += "\n" + str(e.__cause__).strip()
        print(f"config error: {msg}", file=sys.stderr)
        sys.exit(2)
    problems = preflight(cfg)
    if problems:
        print(format_problems(problems), file=sys.stderr)
        sys.exit(2)
    if dry or cfg.trainer.dry_run:
        print("preflight: ok (nothing was built)")
        sys.exit(0)
    return argv


def route_run_dir(argv: list[str]) -> list[str]:
    """Point Hydra's own output dir (``.hydra/``, ``train.log``) at the run's dir: ``run_dir=DIR`` ->
    ``hydra.run.dir=DIR`` (a resumed run left a stray ``runs/<time>/`` otherwise); ``run_name=NAME`` ->
    ``runs/NAME`` (``runs/multirun/NAME`` for a sweep's dir). Explicit ``hydra.run.dir`` / ``hydra.sweep.dir``
    win."""
    kv = {a.split("=", 1)[0].lstrip("+"): a.split("=", 1)[1] for a in argv if "=" in a and not a.startswith("-")}
    multirun = any(a in ("-m", "--multirun") for a in argv)
    name = kv.get("run_name")
    if name in ("null", "None", ""):
        name = None
    if name is not None and ("/" in name or name in (".", "..")):
        print(f"config error: run_name: {name!r} must be a plain name (no '/'); use run_dir=PATH for a path",
              file=sys.stderr)
        sys.exit(2)
    out = list(argv)
    if multirun:
        if name and "hydra.sweep.dir" not in kv:
            out.append(f"hydra.sweep.dir=runs/multirun/{name}")
    elif "hydra.run.dir" not in kv:
        if kv.get("run_dir"):
            out.append(f"hydra.run.dir={kv['run_dir']}")
        elif name:
            out.append(f"hydra.run.dir=runs/{name}")
    return out


if __name__ == "__main__":
    sys.argv[1:] = route_run_dir(early_preflight(sys.argv[1:]))
    main()
