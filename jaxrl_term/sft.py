"""Warm start: supervised fine-tuning on expert trajectories before RL.

Expert trajectories come from the real agent loop driven by a ``ReplayEngine`` that answers with each task's
oracle solution in the scaffold's action format, in real sandboxes; only those the verifier scores 1 are
kept. Training maximises the log-likelihood of the policy tokens (loss mask 1) with the same jitted step as
RL (loss ``nll``), so a warm-started policy writes well-formed actions from its first RL step. The embedded
default uses it: a random tiny model never produces a command, so RL would see no signal at all.
"""

from __future__ import annotations

import asyncio
import logging
import random
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
    sem = asyncio.Semaphore(concurrency)

    async def one(task):
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
    samples = [Sample(t.token_ids, t.loss_mask, [0.0] * len(t.token_ids), 1.0) for t in trajectories]
    rng = random.Random(seed)
    shards = ts.mesh.shape["data"] * ts.mesh.shape["fsdp"]
    losses = []
    for _ in range(steps):
        picked = [samples[rng.randrange(len(samples))] for _ in range(batch_size)]
        batch = make_batch(picked, buckets=buckets, row_multiple=ts.algo.microbatches * shards)
        state, metrics = ts(state, batch)
        losses.append(metrics["loss"])
    return state, losses
