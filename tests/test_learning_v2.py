"""The learning_v2 experiment's task family and demonstrations against the real thing (bubblewrap sandbox, agent
loop, task tests): the awk emulation that decides ``default_ok`` and the expected outputs, the token streams of
the template demonstrations, the oracle, and the split's disjointness."""

from __future__ import annotations

import asyncio
import random
import shutil
import sys
from pathlib import Path

import pytest
from conftest import need

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments" / "learning_v2"))

import data  # noqa: E402
import family  # noqa: E402


def _specs() -> list:
    """One spec per (op, delimiter kind, header), from both splits."""
    rng, out, seen = random.Random(5), [], set()
    while len(seen) < len(family.OPS) * 4:
        s = family.draw(rng, rng.choice(("train", "heldout")))
        key = (s.op, s.delim == family.DEFAULT_DELIM, s.header)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def test_splits_are_disjoint_and_the_check_sees_an_overlap():
    specs, _ = data.generate(sft_seeds=[0], n_sft=1500, look_frac=0.25, n_rl=64, n_heldout=40)
    check = family.disjointness(specs["heldout"], {k: v for k, v in specs.items() if k != "heldout"})
    assert check["all_zero"] and check["heldout_tasks"] == 40 and check["heldout_instructions"] >= 20
    # a held-out list that contains a training instruction, or a training template, is caught
    leaked = family.disjointness(specs["heldout"][:5] + specs["rl"][:1], {"rl": specs["rl"]})
    assert leaked["rl"]["exact"] == 1 and leaked["rl"]["ngram"] >= 1 and not leaked["all_zero"]
    train_cells = family.CELLS["train"]  # a held-out cell is a new combination of pairs seen in training
    assert family.CELLS["heldout"] and all(
        any(c[:2] == (op, k) for c in train_cells) and any((c[0], c[2]) == (op, ext) for c in train_cells)
        for op, k, ext in family.CELLS["heldout"])
    # no parameter of a held-out (or dev) cell is guessable from the other two as seen in training, even without
    # the dev cells; pilot 3's rotation (one extension per (op, field), fields 3-4 only for sums) was
    old = [(op, k, e) for op, ks in (("sum", (3, 4)), ("values", (1, 2, 3, 4))) for i, k in enumerate(ks)
           for j, e in enumerate(("txt", "csv", "dat")) if j == (i + family.OPS.index(op)) % 3]
    old_train = [(op, k, e) for op, ks in (("sum", (3, 4)), ("values", (1, 2, 3, 4))) for k in ks
                 for e in ("txt", "csv", "dat") if (op, k, e) not in old]
    assert family.shortcuts(old_train, old) > 0 and check["shortcuts"] == 0
    train_only = [c for c in train_cells if c not in family.CELLS["dev"]]
    assert family.shortcuts(train_only, family.CELLS["heldout"] + family.CELLS["dev"]) == 0
    dev, _ = data.generate(sft_seeds=[0], n_sft=1500, look_frac=0.25, n_rl=32, n_heldout=16, dev=True)
    cell = lambda s: (s.op, s.k, s.src.rsplit(".", 1)[1])  # noqa: E731
    assert {cell(s) for s in dev["heldout"]} <= set(family.CELLS["dev"])
    assert not {cell(s) for k in ("sft_0", "rl") for s in dev[k]} & set(family.CELLS["dev"] + family.CELLS["heldout"])
    # the three-way split (the full run, change 12): the dev check's SFT/RL data, real held-out tasks, and dev tasks
    # disjoint from the training data by the same checks
    three, _ = data.generate(sft_seeds=[0], n_sft=1500, look_frac=0.25, n_rl=32, n_heldout=16, n_dev=8)
    assert three["sft_0"] == dev["sft_0"] and three["rl"] == dev["rl"] and len(three["dev"]) == 8
    assert {cell(s) for s in three["dev"]} <= set(family.CELLS["dev"])
    assert {cell(s) for s in three["heldout"]} <= set(family.CELLS["heldout"])
    trained = {k: v for k, v in three.items() if k not in ("heldout", "dev")}
    assert family.disjointness(three["dev"], trained)["all_zero"]
    assert family.disjointness(three["heldout"], trained)["all_zero"]
    train_slots = [{s.template[i] for k, v in specs.items() if k != "heldout" for s in v} for i in range(2)]
    assert not any(s.template[i] in train_slots[i] for s in specs["heldout"] for i in range(2))


def test_emulated_outputs_oracle_and_demonstrations_match_the_real_sandbox(tiny_tokenizer_dir):
    need(shutil.which("bwrap") is not None, "bubblewrap (bwrap) is not installed")
    from jaxrl_term.agent.actions import make_scaffold
    from jaxrl_term.agent.loop import AgentLimits, run_episode
    from jaxrl_term.model.tokenizer import load_tokenizer
    from jaxrl_term.reward.verifier import verify
    from jaxrl_term.rollout.oracle import ReplayEngine
    from jaxrl_term.tasks.env import open_task_sandbox

    tok = load_tokenizer(tiny_tokenizer_dir)
    prompt = str(Path(__file__).resolve().parents[1] / "experiments" / "learning_v2" / "prompt.md")
    limits = AgentLimits(max_turns=4, max_tokens_per_turn=96, max_context_tokens=1024, command_timeout_s=5)
    formats = [(d, h) for d in family.DELIMS for h in (False, True)]

    class Agent:  # the slice of AgentCfg that data.episodes reads
        scaffold_obj = staticmethod(lambda: make_scaffold("bash", prompt=prompt, command_timeout_s=5))
        enable_thinking = None

        @staticmethod
        def limits():
            return limits

    async def check(spec):
        task = family.to_task(spec)
        async with open_task_sandbox(task, backend="local") as sb:
            # every assumed format, in one command: the real awk/sort against the emulation
            outs = []
            for d, h in formats:
                cmd = family.command(spec, d, h)
                r = await sb.run(f"{cmd} && cat {spec.dst}", 10)
                assert r.exit_code == 0, (cmd, r.output)
                outs.append((cmd, r.output, "".join(x + "\n" for x in family.run_awk(spec, d, h))))
            for cmd, real, emulated in outs:
                assert real == emulated, (spec.instruction, spec.lines, cmd)
            default_run = await sb.run(family.command(spec, family.DEFAULT_DELIM, False), 10)
            assert default_run.exit_code == 0
            assert (await verify(task, sb)).score == float(spec.default_ok)
        for look in (True, False):
            if not look and not spec.default_ok:
                continue  # the teacher assumes the default only where it is right
            restate = family.task_id(spec) < "fields-8"  # half the specs: the restating teacher (change 14)
            replies, _ = family.demo(spec, look, restate)
            if restate:  # every command's reasoning names the input, and the act's the key phrase with its field
                assert all(spec.src in r.split("```")[0] for r in replies[:-1])
                assert spec.template[2].format(k=spec.k) in replies[-2].split("```")[0]
            scripted = (await data.episodes([spec], [look], tok, Agent, restate))[0]
            async with open_task_sandbox(task, backend="local") as sb:
                real = await run_episode(task, ReplayEngine(tok, replies), sb, tok, Agent.scaffold_obj(),
                                         limits=limits)
                score = (await verify(task, sb)).score
            assert real.end_reason == "finished" and score == 1.0, (spec.instruction, look, real.error)
            assert real.token_ids == scripted.token_ids and real.loss_mask == scripted.loss_mask

    async def main():
        for spec in _specs():
            await check(spec)

    asyncio.run(main())


def test_prepare_refuses_starved_cells_and_data_the_code_no_longer_generates(tmp_path, monkeypatch):
    """Both refusals come before any demonstration is made (tokenizer and agent config are not needed)."""
    args = dict(sft_seeds=[0], n_sft=1500, look_frac=0.25, n_rl=16, n_heldout=200, heldout_seed=0, n_dev=64,
                tokenizer=None, agent_cfg=None)
    specs, _ = data.generate(**{k: v for k, v in args.items() if k not in ("tokenizer", "agent_cfg")})
    (tmp_path / "data.json").write_text('{"tasks_sha256": "%s", "reused": true}' % data.tasks_sha256(specs))
    assert data.prepare(tmp_path, **args)["reused"]  # what this code generates: reused as it is
    (tmp_path / "data.json").write_text('{"tasks_sha256": "%s"}' % ("0" * 64))
    with pytest.raises(RuntimeError, match="holds other tasks than this code generates"):
        data.prepare(tmp_path, **args)
    # change 12's finding: dev asks that share "{what} to" with a training ask leave the values/distinct dev
    # cells without a task (the 8-gram filter rejects them all)
    monkeypatch.setitem(family.ASK, "dev", ("Produce {dst} with {what} in it.", "Output {what} to {dst}."))
    with pytest.raises(RuntimeError, match=r"no dev task on the cells \[\('distinct'"):
        data.prepare(tmp_path / "fresh", **args)
