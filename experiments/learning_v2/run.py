"""Does RL improve how a terminal agent solves tasks it never saw? The pre-registered CPU experiment of
experiments/results/learning_v2.md, end to end and resumable:

    .venv/bin/python experiments/learning_v2/run.py [--pilot] [--root runs/learning_v2] [--jobs 2]

1. data (``data.prepare``): RL training tasks, held-out tasks (disjoint by construction and checked: exact
   instructions, word n-grams, (op, field, extension) cells, templates: all 0 or the run stops), and per
   SFT seed template demonstrations in which the teacher mostly assumes the default file format;
2. SFT per SFT seed (``jaxrl_term.sft``); at the full scale (the three-way split, change 12), SFT seeds are tried
   in order, each checked on the dev tasks with the go/no-go criteria, until 2 pass (``select_sft``);
3. go/no-go, before any RL: the SFT policy on the held-out tasks x 8 samples (``jaxrl_term.eval``): pass@1 in
   [0.2, 0.6], pass@8 - pass@1 >= 0.2, >= 40% of tasks with a success rate strictly between 0 and 1, else the run
   stops (change the SFT mix on the training split, never the held-out set). This evaluation is also the SFT arm
   (step 0 of every curve) and its pass@k curve;
4. arms, same episode budget (``jaxrl_term.train``, held-out evaluation every ``trainer.eval_every`` steps):
   ``grpo``, ``dppo``, ``rft`` (the policy-gradient step on the policy's own successes only: advantage = reward,
   all-success groups kept) and ``placebo`` (GRPO with each batch's rewards shuffled), per SFT seed x RL seed;
5. ``analyze.py``: attempts.jsonl, learning_v2.json, the curve and learning_v2.md.

Every stage skips what is finished; a killed train run resumes from its checkpoint (``trainer.resume=auto``), a
killed evaluation re-runs only unfinished attempts. ``--pilot`` is the same pipeline at a small scale under
``ROOT/pilot`` (results there, never in experiments/results). ``--dev`` is the dev check under ``ROOT/dev``:
SFT without the dev cells and phrasings, then the go/no-go numbers on tasks built from them (``family.cell_split``):
a held-out construction inside the training split, for choosing the SFT mix or model without held-out tasks.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
PRESET = "+experiment=learning_v2"
ARMS = {  # Hydra overrides of each arm (on top of the preset, whose algo is GRPO)
    "grpo": ["algo=grpo"],
    "dppo": ["algo=dppo"],
    "rft": ["algo=grpo", "algo.advantage=rft"],
    "placebo": ["algo=grpo", "algo.shuffle_rewards=true"],
}
# The pre-registered scales. Full: 2 SFT seeds x 3 RL seeds x 4 arms, 200 held-out tasks x 4 samples at 5 points.
SCALES = {
    "full": dict(sft_seeds=[0, 1, 2, 3, 4, 5], sft_keep=2, n_dev=64, rl_seeds=[0, 1, 2], arms=list(ARMS), n_sft=4000,
                 look_frac=0.25, n_rl=256, n_heldout=200, heldout_seed=2, steps=20, eval_every=4, gonogo_samples=8),
    # change 12 of PREREGISTRATION.md: the three-way split (SFT/RL data without the dev cells and phrasings; 64 dev
    # tasks validate SFT seeds): SFT seeds are tried in order and the first ``sft_keep`` that pass the go/no-go
    # criteria on the dev tasks are the experiment's; held-out seed 2 (0 was the first full run's, 1 the pilots')
    "pilot": dict(sft_seeds=[0], rl_seeds=[0], arms=list(ARMS), n_sft=4000, look_frac=0.25, n_rl=256,
                  n_heldout=64, heldout_seed=1, steps=8, eval_every=4, gonogo_samples=8),
    # the pilot's held-out tasks are drawn with another seed: none of them is a task of the full run
    "dev": dict(sft_seeds=[0], rl_seeds=[], arms=[], n_sft=4000, look_frac=0.25, n_rl=256, n_heldout=64,
                heldout_seed=2, steps=0, eval_every=0, gonogo_samples=8, dev=True),
    # the dev check: SFT without the dev cells, its go/no-go on dev-cell tasks (training split only); dev tasks
    # drawn as the full run's (seed 2): with seed 0, no task fell on one of the 16 dev cells
}
SFT = ["sft.steps=600", "sft.lr=0.003", "sft.batch_size=16"]  # the SFT command's settings (not in the preset:
                                                                # train and eval configs have no sft group)
GO = {"pass1_min": 0.2, "pass1_max": 0.6, "pass8_minus_pass1_min": 0.2, "mixed_frac_min": 0.4}


def sh(cmd: list[str], log: Path) -> None:
    print("$", shlex.join(cmd), flush=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        rc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc:
        raise SystemExit(f"failed (exit {rc}): {shlex.join(cmd)}; its output: {log}")


def data_args(root: Path) -> list[str]:
    d = root / "data"
    return [f"data.source={d / 'train.parquet'}", f"eval.data.source={d / 'heldout.parquet'}"]


def prepare(root: Path, sc: dict) -> dict:
    import os

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import data
    from jaxrl_term.config import register
    from jaxrl_term.train import CONF_DIR, build_tokenizer

    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("sft_config", overrides=[PRESET])
    tok, _ = build_tokenizer(cfg.model, Path(os.path.expanduser(cfg.cache_dir)))
    return data.prepare(root / "data", sft_seeds=sc["sft_seeds"], n_sft=sc["n_sft"], look_frac=sc["look_frac"],
                        n_rl=sc["n_rl"], n_heldout=sc["n_heldout"], heldout_seed=sc["heldout_seed"], tokenizer=tok,
                        agent_cfg=OmegaConf.to_object(cfg.agent), dev=sc.get("dev", False), n_dev=sc.get("n_dev", 0),
                        restate=sc.get("restate", False))


def sft(root: Path, seed: int, extra: list[str]) -> Path:
    out = root / f"sft_{seed}"
    if not (out / "hf_final" / "config.json").exists():
        sh([sys.executable, "-m", "jaxrl_term.sft", PRESET, *SFT, *extra, f"run_dir={out}", f"seed={seed}",
            f"sft.source={root / 'data' / f'sft_{seed}.jsonl'}", *data_args(root)], root / "logs" / f"sft_{seed}.log")
    return out / "hf_final"


def go_no_go(root: Path, seed: int, samples: int, split: str = "heldout") -> dict:
    """The SFT policy on the ``split`` tasks (held-out, or dev: the validation split) x ``samples``: the three
    pre-registered numbers and the verdict."""
    out = root / (f"sft_{seed}_eval" if split == "heldout" else f"sft_{seed}_{split}")
    if not (out / "summary.json").exists():
        tasks = root / "data" / f"{split}.parquet"
        sh([sys.executable, "-m", "jaxrl_term.eval", PRESET, "policy=checkpoint",
            f"policy.path={root / f'sft_{seed}' / 'hf_final'}", f"data.source={tasks}",
            f"eval.data.source={tasks}", f"eval.attempts={samples}", f"eval.seed={seed}",
            f"run_dir={out}", "eval.concurrency=32"], root / "logs" / f"{out.name}.log")
    rows = [json.loads(x) for x in (out / "attempts.jsonl").read_text().splitlines() if x.strip()]
    by: dict[str, list[bool]] = {}
    for r in rows:
        by.setdefault(r["task"], []).append(bool(r["pass"]))
    rates = [sum(v) / len(v) for v in by.values()]
    pass1 = sum(rates) / len(rates)
    full = [v for v in by.values() if len(v) >= samples]  # pass@k needs k attempts (dropped ones are re-run)
    pass8 = sum(any(v) for v in full) / max(1, len(full))
    mixed = sum(0 < p < 1 for p in rates) / len(rates)
    verdict = (GO["pass1_min"] <= pass1 <= GO["pass1_max"] and pass8 - pass1 >= GO["pass8_minus_pass1_min"]
               and mixed >= GO["mixed_frac_min"])
    return {"sft_seed": seed, "split": split, "tasks": len(by), "tasks_with_all_samples": len(full), "samples": samples,
            "pass@1": pass1, f"pass@{samples}": pass8,
            "pass@k_minus_pass@1": pass8 - pass1, "mixed_frac": mixed, "criteria": GO,
            "verdict": "go" if verdict else "no-go"}


def train(root: Path, arm: str, sft_seed: int, rl_seed: int, sc: dict) -> Path:
    out = root / "runs" / f"{arm}_s{sft_seed}_r{rl_seed}"
    if (out / "summary.json").exists():
        return out
    sh([sys.executable, "-m", "jaxrl_term.train", PRESET, *ARMS[arm], f"run_dir={out}", f"seed={rl_seed}",
        f"eval.seed={sft_seed}", f"model.path={root / f'sft_{sft_seed}' / 'hf_final'}", *data_args(root),
        f"trainer.steps={sc['steps']}", f"trainer.eval_every={sc['eval_every']}", "trainer.eval_before_train=false",
        "trainer.resume=auto"], root / "logs" / f"{out.name}.log")
    return out


def select_sft(root: Path, sc: dict, sft_set: list[str], stage) -> list[int]:
    """The three-way split's SFT seeds: each of ``sft_seeds`` in order is fine-tuned and checked on the dev tasks
    (the go/no-go criteria, ``gonogo_samples`` each) until ``sft_keep`` have passed; those are the experiment's.
    Every seed tried is reported (ROOT/sft_selection.json, then learning_v2.json). The held-out tasks play no
    part: they are evaluated only afterwards, on the chosen seeds (the pre-registered go/no-go)."""
    keep, tried, chosen = sc["sft_keep"], [], []
    for s in sc["sft_seeds"]:
        if len(chosen) == keep:
            break
        stage(f"sft_{s}", sft, root, s, sft_set)
        g = stage(f"dev_{s}", go_no_go, root, s, sc["gonogo_samples"], "dev")
        tried.append(g)
        print(f"dev check, SFT seed {s}: pass@1 {g['pass@1']:.3f}, pass@{g['samples']} - pass@1 "
              f"{g['pass@k_minus_pass@1']:.3f}, mixed tasks {g['mixed_frac']:.2f}: {g['verdict']}", flush=True)
        if g["verdict"] == "go":
            chosen.append(s)
    (root / "sft_selection.json").write_text(json.dumps(
        {"rule": f"the first {keep} of sft_seeds {sc['sft_seeds']} whose dev check is go", "keep": keep,
         "tried": tried, "chosen": chosen}, indent=1))
    if len(chosen) < keep:
        raise SystemExit(f"only {len(chosen)} of the {len(tried)} SFT seeds tried pass the dev check "
                         f"({root / 'sft_selection.json'}): change the SFT recipe on the training split")
    return chosen


def keep_settings(saved: Path, now: dict) -> None:
    """Write ``now`` (run.py's settings, SFT recipe and criteria) to ``saved`` on a new root; on an existing one,
    refuse unless they are the same: every finished stage there is reused as it is."""
    if not saved.exists():
        saved.write_text(json.dumps(now, indent=1))
        return
    old, now = json.loads(saved.read_text()), json.loads(json.dumps(now))
    if [old["settings"], old.get("sft", now["sft"]), old.get("go", now["go"])] != [now[k] for k in
                                                                                  ("settings", "sft", "go")]:
        raise SystemExit(f"{saved.parent} holds a run with other settings, SFT recipe or go/no-go criteria ({saved}); "
                         "every stage there would be reused as it is. Give a new --root for new settings (e.g. "
                         "another SFT mix after a no-go)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pilot", action="store_true", help="the small-scale pilot (results under ROOT/pilot)")
    ap.add_argument("--dev", action="store_true",
                    help="the dev check (training split only): SFT without the dev cells, go/no-go on dev-cell tasks "
                         "(results under ROOT/dev); for choosing the SFT mix or model after a no-go")
    ap.add_argument("--sft-set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="extra Hydra overrides of the SFT command (e.g. model.num_hidden_layers=6 sft.steps=1200); "
                         "recorded in settings.json")
    ap.add_argument("--look-frac", type=float, default=None,
                    help="the SFT mix's look share (default: the scale's); recorded in settings.json")
    ap.add_argument("--restate", action="store_true",
                    help="the teacher's reasoning repeats the instruction's parameters (family.demo; change 14); "
                         "recorded in settings.json")
    ap.add_argument("--sft-seeds", type=int, nargs="+", default=None,
                    help="the SFT seeds (default: the scale's); recorded in settings.json")
    ap.add_argument("--root", default="runs/learning_v2")
    ap.add_argument("--jobs", type=int, default=2, help="train runs at once")
    ap.add_argument("--force", action="store_true", help="go on after a no-go (the result then says so)")
    ap.add_argument("--stage", choices=["data", "sft", "gonogo", "rl", "all"], default="all",
                    help="stop after this stage")
    args = ap.parse_args()
    if args.pilot and args.dev:
        raise SystemExit("--pilot and --dev are different scales: give one")
    scale = "pilot" if args.pilot else "dev" if args.dev else "full"
    sc = {**SCALES[scale], **({"sft_set": args.sft_set} if args.sft_set else {}),
          **({"look_frac": args.look_frac} if args.look_frac is not None else {}),
          **({"sft_seeds": args.sft_seeds} if args.sft_seeds else {}), **({"restate": True} if args.restate else {})}
    root = (REPO / args.root / ("" if scale == "full" else scale)).resolve()
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    command = "python experiments/learning_v2/run.py " + shlex.join(sys.argv[1:])
    keep_settings(root / "settings.json", {"command": command, "scale": scale, "settings": sc, "sft": SFT, "go": GO})
    timing = json.loads((root / "timing.json").read_text()) if (root / "timing.json").exists() else {}

    def stage(name: str, fn, *a):
        t = time.monotonic()
        out = fn(*a)
        timing[name] = timing.get(name, 0.0) + time.monotonic() - t
        (root / "timing.json").write_text(json.dumps(timing, indent=1))
        return out

    info = stage("data", prepare, root, sc)
    print(f"data: {info['rl_tasks']} RL tasks, {info['heldout_tasks']} held-out tasks; disjointness all zero: "
          f"{info['disjointness']['all_zero']}", flush=True)
    if args.stage == "data":
        return
    seeds = select_sft(root, sc, args.sft_set, stage) if "n_dev" in sc else sc["sft_seeds"]
    if "n_dev" not in sc:
        for s in seeds:
            stage(f"sft_{s}", sft, root, s, args.sft_set)
    if args.stage == "sft":
        return
    gates = [stage(f"gonogo_{s}", go_no_go, root, s, sc["gonogo_samples"]) for s in seeds]
    (root / "go_no_go.json").write_text(json.dumps(gates, indent=1))
    for g in gates:
        print(f"go/no-go, SFT seed {g['sft_seed']}: pass@1 {g['pass@1']:.3f}, pass@{g['samples']} - pass@1 "
              f"{g['pass@k_minus_pass@1']:.3f}, mixed tasks {g['mixed_frac']:.2f}: {g['verdict']}", flush=True)
    if any(g["verdict"] != "go" for g in gates) and not (args.force or args.dev):
        raise SystemExit("no-go: change the SFT mix on the training split (look_frac, n_sft, SFT steps), never the "
                         "held-out set; --force runs the arms anyway")
    if args.stage == "gonogo" or args.dev:
        return
    jobs = [(a, s, r) for s in seeds for r in sc["rl_seeds"] for a in sc["arms"]]
    t_rl = time.monotonic()
    with ThreadPoolExecutor(args.jobs) as ex:
        futures = [ex.submit(train, root, a, s, r, sc) for a, s, r in jobs]
        try:
            for fut in futures:
                fut.result()
        except BaseException:
            ex.shutdown(cancel_futures=True)  # report the failure now, not after every queued run
            raise
    timing["rl"] = timing.get("rl", 0.0) + time.monotonic() - t_rl  # all runs, --jobs at once
    timing["total"] = timing.get("total", 0.0) + time.monotonic() - t0  # this invocation (resumed ones add up)
    (root / "timing.json").write_text(json.dumps(timing, indent=1))
    if args.stage == "rl":
        return
    import analyze

    results = REPO / "experiments" / "results" if not args.pilot else root / "results"
    analyze.main(root, results, command=command, scale=scale, settings=sc, gates=gates, data_info=info,
                 timing=timing)


if __name__ == "__main__":
    main()
