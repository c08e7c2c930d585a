"""SFT data from a flawed teacher: every training task's oracle demonstration, plus demonstrations in which the
teacher declares the task done at its first turn without running anything (``--quit-frac`` of all records).

Why: a policy fine-tuned on the oracle alone fails by sampling accidents that no update on other tasks can fix
(``transfer_probe.py``, experiments/results/learning_curve.md). A policy fine-tuned on this data also fails by a
decision that recurs on every task, held-out ones included: quitting at once, which the reward punishes. That is
the situation RL is for: premature "done" is a known failure of terminal agents, and a teacher's demonstrations
carry such mistakes.

The records are real episodes: the agent loop, the scaffold's chat template and a sandbox per task, driven by a
replay of the scripted replies (``jaxrl_term.rollout.oracle.ReplayEngine``); the file is an SFT source
(``python -m jaxrl_term.sft sft.source=FILE.jsonl``):

    .venv/bin/python experiments/learning_curve/flawed_teacher.py --out runs/flawed/demos.jsonl \\
        [--quit-frac 0.4] [-- hydra overrides of the SFT config, e.g. data.n_per_cell=6]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path


async def quit_demos(tasks, agent, sb, backend: str, builder, tokenizer, n: int, seed: int) -> list:
    """``n`` episodes (tasks drawn with replacement) whose only reply ends the episode at once."""
    from jaxrl_term.agent.actions import make_scaffold
    from jaxrl_term.agent.loop import run_episode
    from jaxrl_term.reward.verifier import verify
    from jaxrl_term.rollout.oracle import ReplayEngine, oracle_replies
    from jaxrl_term.tasks.env import open_task_sandbox

    rng = random.Random(seed)
    picked = [rng.choice(tasks) for _ in range(n)]
    reply = oracle_replies(tasks[0], agent.scaffold)[-1]  # the oracle's closing reply, given as the first
    sem = asyncio.Semaphore(4)

    async def one(task):
        async with sem, open_task_sandbox(task, backend=backend, builder=builder, **sb.limits()) as box:
            traj = await run_episode(task, ReplayEngine(tokenizer, [reply]), box, tokenizer,
                                     make_scaffold(agent.scaffold), limits=agent.limits(),
                                     enable_thinking=agent.enable_thinking)
            res = await verify(task, box)
        if traj.end_reason != "finished" or res.score != 0.0:
            raise SystemExit(f"{task.id}: the quitting demonstration ended {traj.end_reason} with score {res.score}; "
                             f"it must finish and fail")
        return traj

    return await asyncio.gather(*(one(t) for t in picked))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quit-frac", type=float, default=0.4, help="share of the records that quit at once")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of sft_config (after --)")
    args = ap.parse_args()
    if not 0.0 <= args.quit_frac < 1.0:
        raise SystemExit(f"--quit-frac {args.quit_frac}: must be in [0, 1)")

    import os

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from jaxrl_term.config import register
    from jaxrl_term.sft import collect_demonstrations
    from jaxrl_term.tasks.dataset import load_from_config
    from jaxrl_term.train import CONF_DIR, build_tokenizer, sandbox_backend

    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("sft_config", overrides=["+experiment=tiny_learn", *args.overrides])
    tasks = load_from_config(cfg.data)
    tok, _ = build_tokenizer(cfg.model, Path(os.path.expanduser(cfg.cache_dir)))
    agent, sb = OmegaConf.to_object(cfg.agent), OmegaConf.to_object(cfg.sandbox)
    backend, builder = sandbox_backend(cfg.sandbox)

    async def collect():
        good = await collect_demonstrations(tasks, scaffold=agent.scaffold, tokenizer=tok, limits=agent.limits(),
                                            backend=backend, builder=builder, sandbox_limits=sb.limits(),
                                            enable_thinking=agent.enable_thinking)
        n_quit = round(len(good) * args.quit_frac / (1.0 - args.quit_frac))
        return good, await quit_demos(tasks, agent, sb, backend, builder, tok, n_quit, args.seed)

    good, bad = asyncio.run(collect())
    records = [{"token_ids": list(t.token_ids), "loss_mask": list(t.loss_mask), "task": t.task_id, "kind": kind}
               for kind, ts in (("oracle", good), ("quit", bad)) for t in ts]
    random.Random(args.seed).shuffle(records)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")  # a killed write leaves no half file for a resumed run.py to take
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.replace(out)
    print(f"{out}: {len(good)} oracle and {len(bad)} quitting demonstrations of {len(tasks)} training tasks",
          file=sys.stderr)


if __name__ == "__main__":
    main()
