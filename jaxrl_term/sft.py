"""Warm start: supervised fine-tuning on expert trajectories before RL.

Expert trajectories come from the real agent loop driven by a ``ReplayEngine`` that answers with each task's
oracle solution in the scaffold's action format, in real sandboxes; only those the verifier scores 1 are
kept. Training maximises the log-likelihood of the policy tokens (loss mask 1) with the same jitted step as
RL (loss ``nll``), so a warm-started policy writes well-formed actions from its first RL step. The embedded
default uses it: a random tiny model never produces a command, so RL would see no signal at all.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Sequence

from jaxrl_term.agent.actions import make_scaffold
from jaxrl_term.agent.loop import AgentLimits, run_episode
from jaxrl_term.agent.trajectory import Trajectory
from jaxrl_term.reward.verifier import verify
from jaxrl_term.rollout.oracle import ReplayEngine, oracle_replies
from jaxrl_term.tasks.env import open_task_sandbox

log = logging.getLogger(__name__)


async def collect_demonstrations(tasks: Sequence, *, scaffold: str, tokenizer, limits: AgentLimits,
                                 backend: str = "docker", builder=None, sandbox_limits: dict | None = None,
                                 concurrency: int = 4, enable_thinking: bool | None = None) -> list[Trajectory]:
    """Oracle episodes through the real loop and sandboxes; the ones the verifier scores 1."""
    from jaxrl_term.utils.metrics import ProgressLog

    sem = asyncio.Semaphore(concurrency)
    progress = ProgressLog("demonstrations (oracle episodes)", len(tasks))
    kept = [0]

    async def one(task):
        traj = await _one(task)
        kept[0] += traj is not None
        progress.update(kept=kept[0])
        return traj

    async def _one(task):
        if task.solution is None:
            return None
        async with sem:
            try:
                async with open_task_sandbox(task, backend=backend, builder=builder, **(sandbox_limits or {})) as sb:
                    engine = ReplayEngine(tokenizer, oracle_replies(task, scaffold))
                    traj = await run_episode(task, engine, sb, tokenizer, make_scaffold(scaffold), limits=limits,
                                             enable_thinking=enable_thinking)
                    res = await verify(task, sb)
            except Exception as e:  # noqa: BLE001 - a task that cannot demonstrate is skipped, and said
                log.warning("no demonstration for %s: %s: %s", task.id, type(e).__name__, e)
                return None
        if traj.end_reason == "finished" and res.score == 1.0:
            traj.reward = 1.0
            return traj
        log.warning("oracle demonstration of %s did not score 1 (%s, %s)", task.id, traj.end_reason, res.score)
        return None

    return [t for t in await asyncio.gather(*(one(t) for t in tasks)) if t is not None]


def finetune(ts, state, trajectories: Sequence[Trajectory], *, steps: int, batch_size: int, seed: int = 0,
             buckets: Sequence[int] = (1024, 2048, 4096, 8192)):
    """``steps`` updates of ``ts`` (a TrainStep built with ``algo.loss=nll``) on random batches of the
    trajectories. Returns the new state and the loss per step."""
    from jaxrl_term.rl.batch import Sample, make_batch

    if not trajectories:
        raise ValueError("warm start: no demonstration trajectories (did every oracle fail?)")
    from jaxrl_term.utils.metrics import ProgressLog

    samples = [Sample(t.token_ids, t.loss_mask, [0.0] * len(t.token_ids), 1.0) for t in trajectories]
    rng = random.Random(seed)
    losses = []
    progress = ProgressLog(f"SFT steps ({len(samples)} demonstrations, batch {batch_size})", steps)
    for _ in range(steps):
        picked = [samples[rng.randrange(len(samples))] for _ in range(batch_size)]
        batch = make_batch(picked, buckets=buckets, row_multiple=ts.shards)
        state, metrics = ts(state, batch)
        losses.append(metrics["loss"])
        progress.update(loss=lambda m=metrics: float(m["loss"]))
    return state, losses


# ------------------------------------------------------------------------------------------- warm start


def demos_to_arrays(demos: Sequence[Trajectory]) -> dict:
    """Token ids and loss masks of demonstrations, concatenated (for the multi-host channel)."""
    import numpy as np

    lengths = np.array([len(t.token_ids) for t in demos], np.int64)
    return {"tokens": np.concatenate([np.asarray(t.token_ids, np.int32) for t in demos]) if demos else
            np.zeros(0, np.int32),
            "mask": np.concatenate([np.asarray(t.loss_mask, np.int8) for t in demos]) if demos else np.zeros(0, np.int8),
            "lengths": lengths}


def arrays_to_demos(arrays: dict) -> list:
    """Inverse of ``demos_to_arrays``: light objects with ``token_ids`` and ``loss_mask`` (all ``finetune`` reads)."""
    import types


    out, at = [], 0
    for n in arrays["lengths"].tolist():
        out.append(types.SimpleNamespace(token_ids=arrays["tokens"][at:at + n].tolist(),
                                         loss_mask=arrays["mask"][at:at + n].astype(int).tolist()))
        at += n
    return out


def warm_start_key(cfg, arch, opts, task_ids: Sequence[str]) -> str:
    """Cache key of the fine-tuned weights: model, tasks, scaffold and the SFT settings."""
    import dataclasses
    import hashlib
    import json

    ws, agent = cfg.trainer.warm_start, cfg.agent
    return hashlib.sha256(json.dumps([dataclasses.asdict(arch), dataclasses.asdict(opts), cfg.seed, sorted(task_ids),
                                      agent.scaffold, ws.steps, ws.lr, ws.batch_size, agent.max_context_tokens],
                                     default=str).encode()).hexdigest()[:16]


async def warm_start(cfg, *, tokenizer, arch, opts, mesh, rules, init_params, tasks, channel, backend: str,
                     builder=None, microbatches: int = 1):
    """SFT on oracle demonstrations, cached in ``cache_dir``; RL then starts from the fine-tuned weights.

    Every process runs this (the SFT steps are collective): process 0 collects the demonstrations in sandboxes
    and sends them to the others. Returns (params placed like ``init_params``, metrics).
    """
    import os
    from pathlib import Path

    from flax import nnx
    from omegaconf import OmegaConf

    from jaxrl_term.model.hf import load_pretrained, save_pretrained
    from jaxrl_term.rl.step import AlgoConfig, OptimConfig, make_train_step

    ws = cfg.trainer.warm_start
    key = channel.broadcast_json("warm_start/key",
                                 warm_start_key(cfg, arch, opts, [t.id for t in tasks]) if channel.lead else None)
    cache = Path(os.path.expanduser(cfg.cache_dir)) / "warm_start" / key
    # the cache is used only if every process can read it (cache_dir may be node-local)
    if all(channel.gather_json("warm_start/cached", (cache / "config.json").is_file())):
        log.info("warm start: cached fine-tuned weights %s", cache)
        model = load_pretrained(cache, param_dtype=opts.param_dtype, compute_dtype=opts.compute_dtype, mesh=mesh,
                                rules=rules, options=opts)
        info = {"warm_start/cached": True, "warm_start/cache": str(cache)}
        if (cache / "warm_start.json").is_file():  # what the run that filled the cache measured
            info.update({k: v for k, v in json.loads((cache / "warm_start.json").read_text()).items()
                         if k != "warm_start/cached"})
        return nnx.to_pure_dict(nnx.state(model, nnx.Param)), info
    t0 = time.monotonic()
    arrays = None
    if channel.lead:
        agent = OmegaConf.to_object(cfg.agent)
        sb = OmegaConf.to_object(cfg.sandbox)
        demos = await collect_demonstrations(tasks, scaffold=agent.scaffold, tokenizer=tokenizer,
                                             limits=agent.limits(), backend=backend, builder=builder,
                                             sandbox_limits=sb.limits(), enable_thinking=agent.enable_thinking)
        log.info("warm start: %d demonstrations from %d tasks; %d SFT steps", len(demos), len(tasks), ws.steps)
        arrays = demos_to_arrays(demos)
    arrays, _ = channel.broadcast_arrays("warm_start/demos", arrays)
    demos = arrays_to_demos(arrays)
    sft_ts = make_train_step(arch, AlgoConfig(name="sft", loss="nll", microbatches=microbatches),
                             OptimConfig(lr=ws.lr, weight_decay=0.0, grad_clip=1.0), mesh, options=opts, rules=rules)
    state = sft_ts.init_state(init_params, seed=cfg.seed)
    state, losses = await asyncio.to_thread(finetune, sft_ts, state, demos, steps=ws.steps, batch_size=ws.batch_size,
                                            seed=cfg.seed, buckets=tuple(cfg.trainer.buckets))
    await asyncio.to_thread(save_pretrained, sft_ts.model(state.params), cache, "float32")  # collective
    info = {"warm_start/cached": False, "warm_start/demonstrations": len(demos), "warm_start/steps": ws.steps,
            "warm_start/loss_first": losses[0], "warm_start/loss_last": losses[-1],
            "warm_start/losses": [float(x) for x in losses], "warm_start/seconds": time.monotonic() - t0}
    if channel.lead:
        (cache / "warm_start.json").write_text(json.dumps(info))
    return state.params, info


# ------------------------------------------------------------------------------- python -m jaxrl_term.sft


def episodes_from(source: str, *, min_reward: float = 1.0) -> list:
    """Demonstrations (``token_ids`` + ``loss_mask``) from a run dir or a JSONL file:

    - an evaluation run dir (``tokens.jsonl`` + ``attempts.jsonl``): the attempts with reward >= ``min_reward``;
    - a training run dir (``trajectories/step_N.tokens.jsonl`` + ``step_N.jsonl``): the episodes with reward >=
      ``min_reward`` (held-out evaluations under ``eval/`` are never used);
    - a ``.jsonl`` file of ``{"token_ids", "loss_mask"}`` records (a teacher's trajectories): all of them.
    The loss is on the policy's tokens (``loss_mask`` 1) only."""
    import types
    from pathlib import Path

    from jaxrl_term.agent.transcript import read_jsonl

    p = Path(source).expanduser()

    def demo(r: dict):
        if len(r.get("token_ids") or []) != len(r.get("loss_mask") or []) or not any(r.get("loss_mask") or []):
            return None
        return types.SimpleNamespace(token_ids=list(r["token_ids"]), loss_mask=list(r["loss_mask"]))

    if p.is_file():
        found = [demo(r) for r in read_jsonl(p)]
    elif (p / "tokens.jsonl").is_file() or (p / "attempts.jsonl").is_file():
        good = {a["id"] for a in read_jsonl(p / "attempts.jsonl") if (a.get("reward") or 0.0) >= min_reward}
        found = [demo(r) for r in read_jsonl(p / "tokens.jsonl") if r.get("id") in good]
    elif (p / "trajectories").is_dir():
        found = []
        for f in sorted((p / "trajectories").glob("step_*.tokens.jsonl")):
            good = {t["id"] for t in read_jsonl(str(f).replace(".tokens.jsonl", ".jsonl"))
                    if (t.get("reward") or 0.0) >= min_reward}
            found += [demo(r) for r in read_jsonl(f) if r.get("id") in good]
    else:
        raise FileNotFoundError(f"sft.source={source}: not a run dir of jaxrl_term.eval (tokens.jsonl) or "
                                "jaxrl_term.train (trajectories/), nor a .jsonl of token_ids + loss_mask records")
    out = [d for d in found if d is not None]
    if not out:
        raise ValueError(f"sft.source={source}: no episode with reward >= sft.min_reward={min_reward} and policy "
                         "tokens (oracle / nop evaluations keep no tokens: use sft.source=oracle)")
    return out


async def run_sft(cfg) -> dict:
    """Fine-tune the model config's weights on demonstrations (``sft.source``); write ``run_dir/hf_final``."""
    import os
    from pathlib import Path

    from flax import nnx
    from omegaconf import OmegaConf

    from jaxrl_term.agent.transcript import dumps
    from jaxrl_term.model.hf import save_pretrained
    from jaxrl_term.parallel.mesh import LogicalRules, make_mesh
    from jaxrl_term.rl.step import AlgoConfig, OptimConfig, make_train_step
    from jaxrl_term.train import build_model, build_tokenizer, sandbox_backend

    s, run_dir = cfg.sft, Path(cfg.run_dir)
    mesh = make_mesh(OmegaConf.to_container(cfg.mesh.shape))
    rules = LogicalRules.from_mapping(OmegaConf.to_container(cfg.mesh.rules) if cfg.mesh.rules else None)
    tok, tok_path = build_tokenizer(cfg.model, Path(os.path.expanduser(cfg.cache_dir)))
    model = build_model(cfg, mesh, rules)
    t0 = time.monotonic()
    if s.source == "oracle":
        from jaxrl_term.tasks.dataset import load_from_config

        tasks = load_from_config(cfg.data)
        backend, builder = sandbox_backend(cfg.sandbox)
        agent, sb = OmegaConf.to_object(cfg.agent), OmegaConf.to_object(cfg.sandbox)
        demos = await collect_demonstrations(tasks, scaffold=agent.scaffold, tokenizer=tok, limits=agent.limits(),
                                             backend=backend, builder=builder, sandbox_limits=sb.limits(),
                                             enable_thinking=agent.enable_thinking)
        log.info("sft: %d oracle demonstrations from %d training tasks", len(demos), len(tasks))
    else:
        demos = episodes_from(s.source, min_reward=s.min_reward)
        log.info("sft: %d episodes from %s", len(demos), s.source)
    if not demos:
        raise ValueError("sft: no demonstrations (did every oracle fail?)")
    top = max(max(d.token_ids) for d in demos)
    if top >= model.config.vocab_size:
        raise ValueError(f"sft.source={s.source}: token id {top} >= model.vocab_size={model.config.vocab_size}: "
                         "the episodes were tokenized for another model")
    ts = make_train_step(model.config, AlgoConfig(name="sft", loss="nll", microbatches=cfg.algo.microbatches),
                         OptimConfig(lr=s.lr, schedule=s.schedule, warmup_steps=s.warmup_steps, total_steps=s.steps,
                                     weight_decay=0.0, grad_clip=1.0), mesh, options=model.options,
                         rules=rules)
    state = ts.init_state(nnx.to_pure_dict(nnx.state(model, nnx.Param)), seed=cfg.seed)
    state, losses = await asyncio.to_thread(finetune, ts, state, demos, steps=s.steps, batch_size=s.batch_size,
                                            seed=cfg.seed, buckets=tuple(cfg.trainer.buckets))
    dtype = "float32" if model.options.param_dtype == "float32" else "bfloat16"
    out = save_pretrained(ts.model(state.params), run_dir / "hf_final", dtype, tokenizer_dir=tok_path)
    info = {"source": s.source, "demonstrations": len(demos), "steps": s.steps, "schedule": s.schedule,
            "loss_first": float(losses[0]),
            "loss_last": float(losses[-1]), "seconds": time.monotonic() - t0, "hf_final": str(out)}
    (run_dir / "metrics.jsonl").write_text(dumps({"step": -1, **{f"warm_start/{k}": v for k, v in info.items()},
                                                  "warm_start/losses": [float(x) for x in losses]}) + "\n")
    (run_dir / "summary.json").write_text(json.dumps(json.loads(dumps(info)), indent=2, allow_nan=False))
    return info


def main() -> None:
    import sys

    import hydra
    from omegaconf import OmegaConf

    from jaxrl_term.config import format_problems, preflight, register
    from jaxrl_term.train import CONF_DIR

    register()

    @hydra.main(config_path=CONF_DIR, config_name="sft_config", version_base="1.3")
    def _main(cfg) -> None:
        from pathlib import Path

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        problems = [p for p in preflight(cfg, training=False) if cfg.sft.source == "oracle" or
                    not p[0].startswith("data.")]
        if cfg.sft.steps < 1:
            problems.append(("sft.steps", f"{cfg.sft.steps} must be >= 1", ""))
        if cfg.sft.schedule not in ("constant", "warmup_cosine"):
            problems.append(("sft.schedule", f"{cfg.sft.schedule!r} is not a schedule", "constant or warmup_cosine"))
        if not 0 <= cfg.sft.warmup_steps < cfg.sft.steps:
            problems.append(("sft.warmup_steps", f"{cfg.sft.warmup_steps} must be in [0, sft.steps)", ""))
        if cfg.sft.source != "oracle" and not Path(cfg.sft.source).expanduser().exists():
            problems.append(("sft.source", f"{cfg.sft.source} does not exist", "oracle, a run dir of train / eval, "
                             "or a .jsonl of token_ids + loss_mask"))
        if problems:
            print(format_problems(problems), file=sys.stderr)
            sys.exit(2)
        from jaxrl_term.rollout.colocation import config_env
        from jaxrl_term.runtime_env import apply_env

        apply_env(config_env(cfg), who="sft")  # before anything touches a backend (runtime_env.py)
        Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.run_dir) / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        info = asyncio.run(run_sft(cfg))
        print(json.dumps(info, indent=2))
        print(f"fine-tuned policy: {info['hf_final']} (train: model.path=..., eval: policy=checkpoint "
              "policy.path=...)")

    _main()


if __name__ == "__main__":
    from jaxrl_term.utils.cli import guard

    sys_exit = guard(main)()
    raise SystemExit(sys_exit)
