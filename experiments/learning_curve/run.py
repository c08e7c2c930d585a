"""Does RL lift held-out pass@1 above its SFT start? SFT once, then GRPO and DPPO runs (several seeds) from
the SFT checkpoint, every run evaluated on held-out tasks before training and every ``trainer.eval_every``
steps; then a PNG of held-out pass@1 vs step, a markdown table and a JSON of the final pass@1 per seed.

    .venv/bin/python experiments/learning_curve/run.py [--seeds 0,1,2] [--algos grpo,dppo] [--steps 12]
                                                       [--root runs/learning_curve] [--plot-only]
                                                       [--sft-args 'model.hidden_size=128 ...'] [-- overrides]
                                                       [--teacher-quit-frac 0.4]

Every stage is resumable: a finished SFT or run is skipped, a killed run resumes from its last checkpoint
(``trainer.resume=auto``). The SFT-only arm is the SFT checkpoint's held-out evaluation at step 0 of each
seed's runs (``eval.seed`` = the run's seed, so the seeds sample the evaluation independently); it is run once
per seed, by the first algorithm's run, and shared with the others (same checkpoint, tasks and evaluation
seed). Extra Hydra overrides after ``--`` go to every train command (e.g. ``-- trainer.eval_every=2``).
``--teacher-quit-frac F`` fine-tunes on ``flawed_teacher.py``'s demonstrations instead of the oracle's alone (a
share F of them quit at turn 1), the setting in which RL has a decision to learn (learning_curve.md).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRESET = "+experiment=tiny_learn"


def sh(cmd: list[str], log: Path) -> None:
    print("$", shlex.join(cmd), flush=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        rc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc:
        raise SystemExit(f"failed (exit {rc}): {shlex.join(cmd)}; its output: {log}")


def evals(run: Path) -> dict[int, float]:
    """Held-out pass@1 by step from a run's metrics."""
    out = {}
    path = run / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if "eval/pass@1" in rec:
                out[int(rec["step"])] = float(rec["eval/pass@1"])
    return out


def finished(run: Path) -> bool:
    return (run / "summary.json").exists() and (run / "hf_final").exists()


def spread(xs: list[float]) -> tuple[float, float]:
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--algos", default="grpo,dppo")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--sft-steps", type=int, default=150)
    ap.add_argument("--sft-lr", type=float, default=3e-3)
    ap.add_argument("--root", default="runs/learning_curve")
    ap.add_argument("--results", default=str(REPO / "experiments" / "results"))
    ap.add_argument("--jobs", type=int, default=2, help="train runs at once (a run leaves cores idle while "
                    "sandboxes start and commands run; 2 at once finish sooner on 2 cores)")
    ap.add_argument("--sft-args", default="", help="extra Hydra overrides of the SFT command only, space-separated "
                    "(e.g. a model size: 'model.hidden_size=128 model.num_hidden_layers=4'); the RL runs load that "
                    "checkpoint, shape included")
    ap.add_argument("--teacher-quit-frac", type=float, default=0.0,
                    help="SFT on flawed_teacher.py's demonstrations with this share of records that quit at turn 1 "
                    "(written to ROOT/flawed_demos.jsonl once); 0: the oracle demonstrations of the SFT config")
    ap.add_argument("--plot-only", action="store_true")
    args = ap.parse_args(argv)
    if not 0.0 <= args.teacher_quit_frac < 1.0:
        ap.error(f"--teacher-quit-frac {args.teacher_quit_frac}: must be in [0, 1) (0: the oracle demonstrations)")
    root, py = (REPO / args.root).resolve(), sys.executable
    seeds, algos = [int(s) for s in args.seeds.split(",")], args.algos.split(",")
    t0 = time.time()

    sft = root / "sft"
    sft_cmd = [py, "-m", "jaxrl_term.sft", PRESET, f"run_dir={sft}", f"sft.steps={args.sft_steps}",
               f"sft.lr={args.sft_lr}", *shlex.split(args.sft_args)]
    if args.teacher_quit_frac > 0:
        demos = root / "flawed_demos.jsonl"
        if not args.plot_only and not demos.exists():
            sh([py, str(REPO / "experiments" / "learning_curve" / "flawed_teacher.py"), "--out", str(demos),
                "--quit-frac", str(args.teacher_quit_frac)], root / "logs" / "flawed_teacher.log")
        sft_cmd.append(f"sft.source={demos}")
    if not args.plot_only and not (sft / "hf_final").exists():
        sh(sft_cmd, root / "logs" / "sft.log")
    runs = {(a, s): root / f"{a}_seed{s}" for a in algos for s in seeds}
    train_cmds = {}
    for (algo, seed), run in runs.items():
        train_cmds[algo, seed] = [py, "-m", "jaxrl_term.train", PRESET, f"algo={algo}", f"seed={seed}",
                                  f"eval.seed={seed}", f"model.path={sft / 'hf_final'}", f"run_dir={run}",
                                  f"trainer.steps={args.steps}", *extra]
        if algo != algos[0]:  # step 0 = the same checkpoint, evaluation seed and tasks: evaluated once per seed
            train_cmds[algo, seed].append("trainer.eval_before_train=false")
    todo = [k for k, run in runs.items() if not args.plot_only and not finished(run)]
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for fut in [pool.submit(sh, train_cmds[k], root / "logs" / f"{k[0]}_seed{k[1]}.log") for k in todo]:
            fut.result()
    wall = time.time() - t0

    curves = {k: evals(r) for k, r in runs.items()}
    for (algo, seed), c in curves.items():  # the SFT start's evaluation, shared by the seed's runs
        if algo != algos[0] and 0 in curves[algos[0], seed]:
            c.setdefault(0, curves[algos[0], seed][0])
    missing = [f"{a} seed {s}" for (a, s), c in curves.items() if 0 not in c or args.steps not in c]
    if missing:
        sys.exit(f"no held-out evaluation at step 0 and step {args.steps} for: {', '.join(missing)}")
    first = algos[0]
    final = {"sft": [curves[first, s][0] for s in seeds]}
    for a in algos:
        final[a] = [curves[a, s][args.steps] for s in seeds]
    heldout = json.loads((runs[first, seeds[0]] / "eval" / "step_000000" / "summary.json").read_text())["tasks"]
    # each stage's own time: the SFT's, and each run's training loop (steps and later evaluations; not the start-up
    # and the step-0 evaluation before it)
    seconds = {name: round(json.loads((d / "summary.json").read_text())["seconds"])
               for name, d in [("sft", sft), *((f"{a}_seed{s}", r) for (a, s), r in runs.items())]
               if (d / "summary.json").exists()}
    command = shlex.join([".venv/bin/python", "experiments/learning_curve/run.py", "--seeds", args.seeds,
                          "--algos", args.algos, "--steps", str(args.steps), "--jobs", str(args.jobs),
                          "--sft-steps", str(args.sft_steps),
                          "--sft-lr", str(args.sft_lr), *(["--sft-args", args.sft_args] if args.sft_args else []),
                          *(["--teacher-quit-frac", str(args.teacher_quit_frac)] if args.teacher_quit_frac else []),
                          *(["--", *extra] if extra else [])])
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "learning_curve.json").write_text(json.dumps(
        {**final, "heldout_tasks": heldout, "steps": args.steps, "seeds": seeds, "command": command,
         "seconds": seconds,
         "curves": {f"{a}_seed{s}": {str(k): v for k, v in sorted(c.items())} for (a, s), c in curves.items()}},
        indent=1) + "\n")
    plot(curves, final, seeds, algos, args.steps, out / "learning_curve.png")

    rows = ["| arm | final held-out pass@1 per seed | mean ± std | change vs SFT (mean) |",
            "| --- | --- | --- | --- |"]
    base, _ = spread(final["sft"])
    for arm, xs in final.items():
        m, sd = spread(xs)
        rows.append(f"| {arm} | {', '.join(f'{x:.3f}' for x in xs)} | {m:.3f} ± {sd:.3f} | "
                    f"{'' if arm == 'sft' else f'{m - base:+.3f}'} |")
    table = "\n".join(rows)
    print(table)
    stages = ", ".join(f"{k} {v / 60:.1f}" for k, v in seconds.items())
    print(f"wall time of this invocation: {wall / 60:.1f} min; {heldout} held-out tasks")
    (out / "learning_curve_table.md").write_text(
        f"Generated by `{command}` ({heldout} held-out tasks; "
        + ("re-plotted from the finished runs" if args.plot_only else
           f"wall time of the generating invocation {wall / 60:.1f} min")
        + f"; minutes of the SFT and of each run's training loop after its step-0 evaluation, {args.jobs} runs "
        f"at a time: {stages}).\n\n"
        f"{table}\n\nSFT: `{shlex.join(sft_cmd[1:])}`\n\n"
        + "\n".join(f"{a} seed {s}: `{shlex.join(c[1:])}`" for (a, s), c in train_cmds.items()) + "\n")


def plot(curves, final, seeds, algos, steps, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    m, sd = spread(final["sft"])
    ax.axhline(m, color="gray", ls="--", label=f"SFT only ({m:.2f} ± {sd:.2f})")
    ax.axhspan(m - sd, m + sd, color="gray", alpha=0.15)
    for algo, color in zip(algos, ("tab:blue", "tab:orange", "tab:green", "tab:red")):
        xs = sorted(set.intersection(*(set(curves[algo, s]) for s in seeds)))
        ys = [[curves[algo, s][x] for s in seeds] for x in xs]
        mean = [statistics.mean(y) for y in ys]
        lo, hi = [min(y) for y in ys], [max(y) for y in ys]
        ax.plot(xs, mean, marker="o", color=color, label=f"{algo.upper()} (mean of {len(seeds)} seeds; band: min-max)")
        ax.fill_between(xs, lo, hi, color=color, alpha=0.2)
    ax.set_xlabel("RL step")
    ax.set_ylabel("held-out pass@1")
    ax.set_xlim(0, steps)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
