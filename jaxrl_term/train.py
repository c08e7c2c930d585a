"""Hydra entry point: ``python -m jaxrl_term.train [+experiment=NAME] [key=value ...]``.

One RL step: pull a batch of scored groups from the rollout pipeline -> advantages -> ``rl.batch`` arrays ->
the jitted update (in a worker thread, so rollouts for the next step keep running) -> weight sync to the
engine (in-process for the embedded engine; ``save_pretrained`` + SGLang update for servers) -> metrics ->
checkpoint. Multi-host: every process runs this program over one global mesh (``jax.distributed``); process
0 drives the rollouts and broadcasts each batch; only process 0 writes logs and exports.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import time
from pathlib import Path

import hydra
from omegaconf import OmegaConf

from jaxrl_term.config import Config, ConfigError, model_from_cfg, register, validate

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
                               mesh=mesh, rules=rules, options=opts)
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


def params_digest(params) -> str:
    import jax
    import numpy as np

    h = hashlib.sha256()
    for x in jax.tree.leaves(jax.device_get(params)):
        h.update(np.ascontiguousarray(x).tobytes())
    return h.hexdigest()[:16]


def broadcast_batch(batch, lead: bool):
    """Multi-host: process 0's batch (or None = stop) to every process; a no-op with one process."""
    import jax
    import numpy as np

    if jax.process_count() == 1:
        return batch
    from jax.experimental import multihost_utils

    from jaxrl_term.rl.batch import Batch

    header = np.zeros(3, np.int64)
    if lead and batch is not None:
        header[:] = (1, *batch.tokens.shape)
    header = np.asarray(multihost_utils.broadcast_one_to_all(header))
    if header[0] == 0:
        return None
    if not lead:
        shape = tuple(int(x) for x in header[1:])
        batch = Batch(**{f.name: np.zeros(shape, np.int32 if f.name in ("tokens", "positions", "segment_ids")
                                          else np.float32) for f in dataclasses.fields(Batch)})
    return jax.tree.map(np.asarray, multihost_utils.broadcast_one_to_all(batch))


# ------------------------------------------------------------------------------------------------ run


class Trainer:
    """Everything one run holds; ``run()`` is the training loop."""

    def __init__(self, cfg: Config):
        import jax

        from jaxrl_term.parallel.mesh import LogicalRules, initialize_distributed, make_mesh
        from jaxrl_term.rl.step import make_train_step
        from jaxrl_term.utils.checkpoint import Checkpointer
        from jaxrl_term.utils.metrics import MetricsLogger

        self.cfg = cfg
        d = cfg.mesh.distributed
        initialize_distributed(enabled=d.enabled, coordinator_address=d.coordinator_address,
                               num_processes=d.num_processes, process_id=d.process_id,
                               local_device_ids=d.local_device_ids, initialization_timeout_s=d.initialization_timeout_s)
        self.lead = jax.process_index() == 0
        if cfg.rollout.engine == "jax" and jax.process_count() > 1:
            raise ValueError("rollout.engine=jax is a single-process engine; multi-host runs use rollout=sglang")
        self.run_dir = Path(cfg.run_dir)
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
        algo = dataclasses.replace(algo, temperature=cfg.rollout.temperature)
        self.algo = algo
        self.ts = make_train_step(self.arch, algo, optim, self.mesh, options=self.opts, rules=self.rules)
        self.shards = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        self.ckpt = Checkpointer(self.run_dir / "checkpoints", max_to_keep=cfg.trainer.keep_checkpoints)
        self.metrics = MetricsLogger(self.run_dir, tensorboard=cfg.logging.tensorboard, enabled=self.lead,
                                     console=cfg.logging.console,
                                     wandb=OmegaConf.to_container(cfg.logging.wandb),
                                     config=OmegaConf.to_container(cfg, resolve=True))
        from flax import nnx

        init_params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        self.ref_params = None
        self.start_step, self.start_seq = 0, 0
        resume = cfg.trainer.resume
        latest = self.ckpt.latest_step()
        if resume == "true" and latest is None:
            raise FileNotFoundError(f"trainer.resume=true but {self.run_dir / 'checkpoints'} has no checkpoint")
        if latest is not None and resume in ("auto", "true"):
            self.state, meta = self.ckpt.restore(self.ts.abstract_state())
            self.start_step, self.start_seq = int(meta["step"]), int(meta["seq"])
            log.info("resumed from %s at step %d (data cursor %d)", self.run_dir / "checkpoints", self.start_step,
                     self.start_seq)
        else:
            self.state = None  # after the warm start (run()), or from init_params
        self._init_params = init_params
        if algo.kl_coef:
            self.ref_params = jax.device_put(init_params, self.ts.param_shardings)
        del model

    # -- warm start -------------------------------------------------------------------------------
    async def warm_start(self, tasks):
        """SFT on oracle demonstrations (cached by model, tasks, scaffold and settings), then RL starts
        from the fine-tuned weights with a fresh optimizer."""
        import jax

        from jaxrl_term.model.hf import load_pretrained, save_pretrained
        from jaxrl_term.rl.step import AlgoConfig, OptimConfig, make_train_step
        from jaxrl_term.sft import collect_demonstrations, finetune

        cfg, ws = self.cfg, self.cfg.trainer.warm_start
        agent = OmegaConf.to_object(cfg.agent)
        key = hashlib.sha256(json.dumps([dataclasses.asdict(self.arch), dataclasses.asdict(self.opts), cfg.seed,
                                         sorted(t.id for t in tasks), agent.scaffold, ws.steps, ws.lr, ws.batch_size,
                                         agent.max_context_tokens], default=str).encode()).hexdigest()[:16]
        cache = Path(os.path.expanduser(cfg.cache_dir)) / "warm_start" / key
        if (cache / "config.json").is_file():
            log.info("warm start: cached fine-tuned weights %s", cache)
            model = load_pretrained(cache, param_dtype=self.opts.param_dtype, compute_dtype=self.opts.compute_dtype,
                                    mesh=self.mesh, rules=self.rules, options=self.opts)
            from flax import nnx

            return nnx.to_pure_dict(nnx.state(model, nnx.Param)), {"warm_start/cached": True}
        backend = resolve_backend(cfg.sandbox.backend)
        sb = OmegaConf.to_object(cfg.sandbox)
        builder = None
        if backend == "docker":
            from jaxrl_term.sandbox.images import ImageBuilder

            builder = ImageBuilder(ca_bundle=sb.extra_ca_bundle)
        demos = await collect_demonstrations(tasks, scaffold=agent.scaffold, tokenizer=self.tok,
                                             limits=agent.limits(), backend=backend, builder=builder,
                                             sandbox_limits=sb.limits(), enable_thinking=agent.enable_thinking)
        log.info("warm start: %d demonstrations from %d tasks; %d SFT steps", len(demos), len(tasks), ws.steps)
        sft_ts = make_train_step(self.arch, AlgoConfig(name="sft", loss="nll", microbatches=self.algo.microbatches),
                                 OptimConfig(lr=ws.lr, weight_decay=0.0, grad_clip=1.0), self.mesh,
                                 options=self.opts, rules=self.rules)
        state = sft_ts.init_state(self._init_params, seed=cfg.seed)
        state, losses = await asyncio.to_thread(finetune, sft_ts, state, demos, steps=ws.steps,
                                                batch_size=ws.batch_size, seed=cfg.seed,
                                                buckets=tuple(cfg.trainer.buckets))
        params = jax.device_get(state.params)
        if self.lead:
            save_pretrained(sft_ts.model(state.params), cache, "float32")
        return params, {"warm_start/demonstrations": len(demos), "warm_start/loss_first": losses[0],
                        "warm_start/loss_last": losses[-1]}

    # -- engine and pipeline ----------------------------------------------------------------------
    def make_engine(self):
        r = self.cfg.rollout
        if r.engine == "jax":
            from jaxrl_term.rollout.jax_engine import JaxEngine, JaxEngineConfig

            j = r.jax
            return JaxEngine(self.ts.model(self.state.params), self.tok,
                             JaxEngineConfig(max_batch=j.max_batch, max_seq_len=j.max_seq_len,
                                             prefill_chunk=j.prefill_chunk, param_dtype=j.param_dtype,
                                             prefix_reuse=j.prefix_reuse,
                                             deterministic=self.cfg.trainer.deterministic_engine),
                             weight_version=self.start_step), None
        if r.engine == "sglang":
            from jaxrl_term.rollout.sglang import ServerSpec, SGLangEngine, SGLangLauncher

            s = r.sglang
            launcher = None
            urls = list(s.urls)
            if s.launch.enabled:
                la = s.launch
                if not la.model_path:
                    raise ValueError("rollout.sglang.launch.model_path (or model.path) must name the HF model dir")
                launcher = SGLangLauncher(la.model_path, [ServerSpec(x.port, x.gpus, x.tp_size) for x in la.servers],
                                          python=la.python, module=la.module, host=la.host,
                                          mem_fraction_static=la.mem_fraction_static, context_length=la.context_length,
                                          extra_args=la.extra_args, log_dir=str(self.run_dir / "sglang"))
                urls += launcher.start()
            if not urls:
                raise ValueError("rollout.sglang.urls is empty and the launcher is off: nothing to send requests to")
            return SGLangEngine(urls, router=s.router, request_timeout_s=s.request_timeout_s,
                                max_retries=s.max_retries, backoff_s=s.backoff_s, pause_mode=s.pause_mode), launcher
        raise ValueError(f"rollout.engine={r.engine!r}; use jax or sglang")

    async def sync_weights(self, engine, version: int) -> None:
        if self.cfg.rollout.engine == "jax":
            await engine.update_weights(self.state.params, version)
            return
        from jaxrl_term.model.hf import save_pretrained

        s = self.cfg.rollout.sglang
        out = Path(s.export_dir or (self.run_dir / "hf_export")) / "policy"
        await asyncio.to_thread(save_pretrained, self.ts.model(self.state.params), out, s.export_dtype,
                                tokenizer_dir=self.tok_path)
        if self.lead:
            await engine.update_weights(out, version)

    def make_pipeline(self, engine, tasks):
        from jaxrl_term.rollout.engine import SamplingParams
        from jaxrl_term.rollout.pipeline import RolloutPipeline
        from jaxrl_term.sandbox.base import SandboxPool

        cfg = self.cfg
        agent = OmegaConf.to_object(cfg.agent)
        backend = resolve_backend(cfg.sandbox.backend)
        sb = OmegaConf.to_object(cfg.sandbox)
        builder = None
        if backend == "docker":
            from jaxrl_term.sandbox.docker import reap
            from jaxrl_term.sandbox.images import ImageBuilder

            reap()
            from jaxrl_term.sandbox.images import DEFAULT_IMAGE_MAP

            image_map = [tuple(x) for x in sb.image_map] or DEFAULT_IMAGE_MAP
            builder = ImageBuilder(image_map=image_map, ca_bundle=sb.extra_ca_bundle,
                                   max_parallel_builds=sb.max_parallel_builds)
        pool = SandboxPool(backend, max_concurrent=sb.max_concurrent, **sb.limits())
        sampling = SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                  top_k=cfg.rollout.top_k, max_new_tokens=agent.max_tokens_per_turn)
        self.backend = backend
        self.reward = OmegaConf.to_object(cfg.reward).mixer()
        return RolloutPipeline(
            tasks, engine=engine, tokenizer=self.tok, scaffold_factory=agent.scaffold_obj,
            group_size=self.algo.group_size, groups_per_step=cfg.trainer.groups_per_step, sampling=sampling,
            limits=agent.limits(), backend=backend, builder=builder, pool=pool, scoring=cfg.reward.scoring,
            reward_fn=self.reward,
            max_concurrent_episodes=cfg.trainer.max_concurrent_episodes,
            max_episode_retries=cfg.trainer.max_episode_retries, drop_zero_variance=cfg.trainer.drop_zero_variance,
            max_filtered_per_step=cfg.trainer.max_filtered_per_step,
            max_off_policy_steps=cfg.trainer.max_off_policy_steps, enable_thinking=agent.enable_thinking,
            seed=cfg.seed, start_seq=self.start_seq, policy_version=self.start_step)

    # -- one step ---------------------------------------------------------------------------------
    def build_batch(self, groups):
        import numpy as np

        from jaxrl_term.rl.advantages import check_rewards, group_advantages
        from jaxrl_term.rl.batch import Sample, make_batch

        rewards = check_rewards(np.array([g.rewards for g in groups], np.float32))
        adv = group_advantages(rewards, self.algo.advantage, std_ddof=self.algo.std_ddof)
        samples = [Sample(t.token_ids, t.loss_mask, t.logprobs, float(a))
                   for g, row in zip(groups, adv) for t, a in zip(g.trajectories, row)]
        multiple = self.algo.microbatches * self.shards
        batch = make_batch(samples, buckets=self.cfg.trainer.buckets, row_multiple=multiple,
                           pack=self.cfg.trainer.pack, vocab_size=self.arch.vocab_size)
        return batch, rewards, adv

    def write_samples(self, step: int, groups) -> None:
        from jaxrl_term.agent.trajectory import write_jsonl

        k = self.cfg.trainer.trajectory_samples
        if k <= 0 or not self.lead:
            return
        picked = [t for g in groups for t in g.trajectories][:k]
        for t in picked:
            t.meta["decoded"] = self.tok.decode(t.token_ids, skip_special_tokens=False)
        write_jsonl(self.run_dir / "trajectories" / f"step_{step:06d}.jsonl", picked, append=False)

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
        m["episode/duration_s_mean"] = float(np.mean([t.duration_s for t in trajs]))
        for k, v in hist[-1].items():
            m[f"train/{k}"] = v
        m["train/updates"] = len(hist)
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
        if self.cfg.trainer.log_param_digest:
            m["params_digest"] = params_digest(self.state.params)
        return m

    async def follow(self) -> dict:
        """Processes other than 0: take each broadcast batch, update, export and checkpoint in lockstep."""
        cfg, tcfg = self.cfg, self.cfg.trainer
        if self.state is None:
            self.state = self.ts.init_state(self._init_params, seed=cfg.seed)
        engine, launcher = self.make_engine()  # starts this node's servers; only process 0 sends requests
        try:
            for step in range(self.start_step, tcfg.steps):
                batch = broadcast_batch(None, lead=False)
                if batch is None:
                    break
                self.state, _ = await asyncio.to_thread(self.ts.update, self.state, batch, self.ref_params)
                await self.sync_weights(engine, step + 1)
                if tcfg.checkpoint_every and (step + 1) % tcfg.checkpoint_every == 0:
                    self.ckpt.save(step + 1, self.state, {"step": step + 1, "seq": -1, "policy_version": step + 1})
        finally:
            self.ckpt.close()
            if launcher is not None:
                launcher.stop()
        return {}

    async def run(self) -> dict:
        from jaxrl_term.tasks.dataset import load_dataset

        if not self.lead:
            return await self.follow()
        cfg, tcfg = self.cfg, self.cfg.trainer
        data = OmegaConf.to_container(cfg.data)
        tasks = load_dataset(data.pop("source"), **data)
        warm = {}
        if self.state is None:
            params = self._init_params
            if tcfg.warm_start.enabled:
                params, warm = await self.warm_start(tasks)
                self.metrics.log(-1, warm)
            self.state = self.ts.init_state(params, seed=cfg.seed)
        elif tcfg.log_param_digest:
            self.metrics.log(self.start_step - 1, {"resume/params_digest": params_digest(self.state.params)})
        self._init_params = None
        engine, launcher = self.make_engine()
        if launcher is not None:
            await launcher.wait_ready(cfg.rollout.sglang.launch.ready_timeout_s)
        if self.start_step > 0 and cfg.rollout.engine == "sglang":  # servers start from model.path
            await self.sync_weights(engine, self.start_step)
        pipeline = self.make_pipeline(engine, tasks)
        log.info("run dir %s: %d tasks, %s sandboxes, engine %s, steps %d..%d", self.run_dir, len(tasks),
                 self.backend, cfg.rollout.engine, self.start_step, tcfg.steps)
        pipeline.start()
        t_run = time.monotonic()
        history = []
        try:
            for step in range(self.start_step, tcfg.steps):
                t0 = time.monotonic()
                groups = await pipeline.get_batch(step)
                t1 = time.monotonic()
                batch, rewards, _ = self.build_batch(groups)
                batch = broadcast_batch(batch, lead=True)
                busy0 = pipeline.busy_seconds()
                self.state, hist = await asyncio.to_thread(self.ts.update, self.state, batch, self.ref_params)
                t2 = time.monotonic()
                overlap = pipeline.busy_seconds() - busy0
                await self.sync_weights(engine, step + 1)
                await pipeline.set_policy_version(step + 1)
                t3 = time.monotonic()
                if tcfg.checkpoint_every and (step + 1) % tcfg.checkpoint_every == 0:
                    self.ckpt.save(step + 1, self.state, {"step": step + 1, "seq": pipeline.consumed,
                                                          "policy_version": step + 1})
                t4 = time.monotonic()
                self.write_samples(step, groups)
                times = {"rollout_wait_s": t1 - t0, "update_s": t2 - t1, "weight_sync_s": t3 - t2,
                         "checkpoint_s": t4 - t3, "step_s": time.monotonic() - t0, "overlap_s": overlap,
                         "overlap_frac": overlap / max(t2 - t1, 1e-9)}
                m = self.step_metrics(step, groups, rewards, hist, times, pipeline)
                self.metrics.log(step, m)
                history.append(m)
        finally:
            broadcast_batch(None, lead=True)  # multi-host: tell the other processes to stop
            await pipeline.stop()
            if self.reward.judge is not None:
                await self.reward.judge.aclose()
            self.ckpt.close()
            if cfg.rollout.engine == "jax":
                engine.close()
            else:
                await engine.aclose()
            if launcher is not None:
                launcher.stop()
        out = {"run_dir": str(self.run_dir), "steps": tcfg.steps, "start_step": self.start_step, **warm,
               "seconds": time.monotonic() - t_run, "metrics": str(self.run_dir / "metrics.jsonl"),
               "trajectories": str(self.run_dir / "trajectories"), "checkpoints": self.ckpt.all_steps()}
        if tcfg.export_final and history:
            from jaxrl_term.model.hf import save_pretrained

            out["hf_final"] = str(save_pretrained(self.ts.model(self.state.params), self.run_dir / "hf_final",
                                                  "float32" if self.opts.param_dtype == "float32" else "bfloat16",
                                                  tokenizer_dir=self.tok_path))
        if history:
            out["reward_first"], out["reward_last"] = history[0]["reward/mean"], history[-1]["reward/mean"]
        self.metrics.close()
        return out


def print_summary(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="jaxrl_term run summary", show_header=False)
    for k, v in summary.items():
        table.add_row(k, str(v))
    Console().print(table)


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def main(cfg: Config) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "absl", "jax._src.xla_bridge", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        validate(cfg)
    except ConfigError as e:
        raise SystemExit(f"config error: {e}") from None
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    (Path(cfg.run_dir) / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    trainer = Trainer(cfg)
    summary = asyncio.run(trainer.run())
    if trainer.lead:
        (Path(cfg.run_dir) / "summary.json").write_text(json.dumps(summary, indent=2))
        print_summary(summary)


if __name__ == "__main__":
    main()
