"""The experiment's data, written once per SFT seed: RL training tasks, held-out tasks, SFT demonstrations and
the disjointness check (``prepare``).

The demonstrations are real agent-loop episodes of the teacher's scripted replies (``family.demo``): the chat
template, the scaffold's parser and observation format, the token stream and loss mask the trainer uses. Only
the sandbox is replaced, by ``ScriptedShell``, which prints what the base image prints for those commands
(tests/test_learning_v2.py runs a sample of them on the real sandbox and compares the token streams), so
thousands of them cost seconds.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
from pathlib import Path

import family

from jaxrl_term.sandbox.base import CommandResult


class ScriptedShell:
    """The one sandbox method the ``bash`` tool calls, answering each demonstrated command with its output."""

    def __init__(self, outputs: dict[str, str]):
        self.outputs = outputs

    async def run(self, command: str, timeout_s: float) -> CommandResult:
        return CommandResult(self.outputs[command], 0, False, False, 0.0)


async def episodes(specs, looks, tokenizer, agent_cfg, restate: bool = False) -> list:
    """One demonstration episode per (spec, look); ``restate``: ``family.demo``'s."""
    from jaxrl_term.agent.loop import run_episode
    from jaxrl_term.rollout.oracle import ReplayEngine

    out = []
    cap = agent_cfg.limits().max_tokens_per_turn
    for spec, look in zip(specs, looks):
        replies, outputs = family.demo(spec, look, restate)
        longest = max(len(tokenizer(r, add_special_tokens=False)["input_ids"]) + 1 for r in replies)  # + <|im_end|>
        if longest > cap:  # the sampler would cut it there: a demonstration the policy could not reproduce
            raise RuntimeError(f"a demonstration reply of {family.task_id(spec)} is {longest} tokens, over "
                               f"agent.max_tokens_per_turn={cap}: shorten family.REASON*")
        traj = await run_episode(family.to_task(spec), ReplayEngine(tokenizer, replies), ScriptedShell(outputs),
                                 tokenizer, agent_cfg.scaffold_obj(), limits=agent_cfg.limits(),
                                 enable_thinking=agent_cfg.enable_thinking)
        if traj.end_reason != "finished":
            raise RuntimeError(f"demonstration of {family.task_id(spec)} ended {traj.end_reason}: {traj.error}")
        out.append(traj)
    return out


def prepare(root: Path, *, sft_seeds: list[int], n_sft: int, look_frac: float, n_rl: int, n_heldout: int,
            heldout_seed: int, tokenizer, agent_cfg, dev: bool = False, n_dev: int = 0, restate: bool = False) -> dict:
    """Write ``root``/{train.parquet, heldout.parquet, sft_<seed>.jsonl, data.json}; return data.json's content.

    SFT demonstrations (one set per SFT seed): the teacher looks first in ``look_frac`` of them (on any task);
    the others assume the default format and are made on tasks where that is right (the teacher's
    demonstrations are successes; it simply did not need to look there). RL tasks: fresh training-split tasks,
    the same for every run. Held-out tasks: one set for every run, avoiding every SFT/RL instruction's word
    n-grams; the experiment refuses to go on unless every overlap count is 0. ``dev``: the dev check instead
    (SFT/RL data without the dev cells, "held-out" = tasks on the dev cells; see ``family.cell_split``).
    ``n_dev``: the three-way split (``generate``), the dev tasks in ``dev.parquet``. ``restate``: the teacher's
    reasoning repeats the instruction's parameters (``family.demo``; change 14).
    """
    from jaxrl_term.tasks.formats import save_parquet

    done = root / "data.json"
    args = dict(sft_seeds=sft_seeds, n_sft=n_sft, look_frac=look_frac, n_rl=n_rl, n_heldout=n_heldout,
                heldout_seed=heldout_seed, dev=dev, n_dev=n_dev)
    specs, looks = generate(**args)
    made = tasks_sha256(specs)
    if done.exists():
        info = json.loads(done.read_text())
        if info.get("tasks_sha256", made) != made:
            raise RuntimeError(f"{root} holds other tasks than this code generates (tasks_sha256 "
                               f"{info['tasks_sha256'][:12]}, now {made[:12]}: family.py or data.py changed since): "
                               "give run.py a new --root")
        if info.get("restate", False) != restate:
            raise RuntimeError(f"{root} holds SFT demonstrations made with restate={info.get('restate', False)}, "
                               f"not {restate}: give run.py a new --root")
        return info
    root.mkdir(parents=True, exist_ok=True)
    rl_specs, heldout = specs["rl"], specs["heldout"]
    info: dict = {"sft": {}, "rl_tasks": len(rl_specs), "rl_default_ok": sum(s.default_ok for s in rl_specs),
                  "tasks_sha256": made, "restate": restate}
    # every reserved cell is tested, checked before the demonstrations are made (the 8-gram filter can starve one)
    for name, split in [("heldout", "dev")] if dev else [("heldout", "heldout"), ("dev", "dev")]:
        if name not in specs:
            continue
        missing = set(family.CELLS[split]) - {(s.op, s.k, s.src.rsplit(".", 1)[1]) for s in specs[name]}
        if missing:
            raise RuntimeError(f"no {split} task on the cells {sorted(missing, key=str)}: too few {name} tasks for "
                               f"{len(family.CELLS[split])} cells, or the {family.NGRAM}-gram filter rejected them "
                               f"(family.ASK/INTRO[{split!r}] share words with training frames)")
        info[f"{name}_ops"] = {op: sum(s.op == op for s in specs[name]) for op in family.OPS}
    for seed in sft_seeds:
        trajs = asyncio.run(episodes(specs[f"sft_{seed}"], looks[seed], tokenizer, agent_cfg, restate))
        tmp = root / f"sft_{seed}.jsonl.tmp"
        tmp.write_text("".join(json.dumps({"token_ids": list(t.token_ids), "loss_mask": list(t.loss_mask),
                                           "task": t.task_id, "kind": "look" if look else "assume"}) + "\n"
                               for t, look in zip(trajs, looks[seed])))
        tmp.replace(root / f"sft_{seed}.jsonl")
        info["sft"][seed] = {"demonstrations": len(trajs), "look": sum(looks[seed]),
                             "tokens_max": max(len(t.token_ids) for t in trajs)}
    training = {k: v for k, v in specs.items() if k not in ("heldout", "dev")}
    check = family.disjointness(heldout, training)
    if not check["all_zero"]:
        raise RuntimeError(f"held-out tasks overlap the training data: {check}")
    save_parquet([family.to_task(s) for s in rl_specs], root / "train.parquet")
    save_parquet([family.to_task(s) for s in heldout], root / "heldout.parquet")
    info.update({"heldout_tasks": len(heldout), "heldout_default_ok": sum(s.default_ok for s in heldout),
                 "heldout_grades": {g: sum(s.grade == g for s in heldout) for g in range(3)},
                 "disjointness": check})
    if "dev" in specs:  # the validation split: disjoint from SFT/RL data by the same checks
        info["dev_disjointness"] = family.disjointness(specs["dev"], training)
        if not info["dev_disjointness"]["all_zero"]:
            raise RuntimeError(f"dev tasks overlap the training data: {info['dev_disjointness']}")
        save_parquet([family.to_task(s) for s in specs["dev"]], root / "dev.parquet")
        info["dev_tasks"] = len(specs["dev"])
    (root / "instructions.json").write_text(json.dumps({k: [s.instruction for s in v] for k, v in specs.items()}))
    done.write_text(json.dumps(info, indent=1))
    return info


def tasks_sha256(specs: dict[str, list]) -> str:
    """Every generated task, as ids and instructions per split: a run directory's data are reused only when the
    code still generates them."""
    return hashlib.sha256(json.dumps({k: [(family.task_id(s), s.instruction) for s in v]
                                      for k, v in sorted(specs.items())}).encode()).hexdigest()


def generate(*, sft_seeds: list[int], n_sft: int, look_frac: float, n_rl: int, n_heldout: int,
             heldout_seed: int = 0, dev: bool = False, n_dev: int = 0) -> tuple[dict[str, list], dict[int, list[bool]]]:
    """Every task spec of the experiment, deterministic in its arguments: {"sft_<seed>": .., "rl": ..,
    "heldout": .., "dev": .. (with ``n_dev``)} and, per SFT seed, which demonstrations look first. ``dev``: see
    ``prepare``. ``n_dev``: the three-way split: SFT/RL data without the dev cells and phrasings, held-out tasks,
    and ``n_dev`` tasks on the dev cells and phrasings (the validation split that chooses SFT seeds)."""
    train_only = dev or n_dev > 0
    specs: dict[str, list] = {"rl": family.make_train(n_rl, 10_000, train_only)}
    looks: dict[int, list[bool]] = {}
    for seed in sft_seeds:
        rng = random.Random(f"learning_v2/sft/{seed}")
        pool = family.make_train(8 * n_sft, seed, train_only)
        looks[seed] = [rng.random() < look_frac for _ in range(n_sft)]
        ok_iter, any_iter = iter([s for s in pool if s.default_ok]), iter(pool[::-1])
        specs[f"sft_{seed}"] = [next(any_iter) if look else next(ok_iter) for look in looks[seed]]
    seen = set().union(*(family.ngrams(s.instruction) for v in specs.values() for s in v))
    specs["heldout"] = family.make_heldout(n_heldout, heldout_seed, seen, dev=dev)
    if n_dev:
        specs["dev"] = family.make_heldout(n_dev, heldout_seed, seen, dev=True)
    return specs, looks
