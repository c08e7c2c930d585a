"""Judging the judges: labelled trajectories with expected score ranges, N attempts per judge, a ranked report.

``python -m jaxrl_term.reward.judge_eval --judges conf/reward/tbrl.yaml [--attempts 3] [--out DIR]``

Every endpoint of ``reward.judge.endpoints`` in the given file is evaluated on its own (no fallback, no
cache) on every case (``reward/data/judge_cases.yaml``: good work, no exploration, no verification, test
gaming, parse-error loops, overthinking, looping, prompt injection, ...). Judges are ranked by the share of
attempts that land in the expected range, then by mean absolute error (distance to the range; 0 inside),
then by median latency. Writes ``report.md``, ``results.json`` and a bar chart ``chart.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.resources
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from jaxrl_term.agent.trajectory import Trajectory, TurnRecord
from jaxrl_term.reward.judge import JudgeClient, JudgeEndpoint, endpoints_from_config, render_prompt
from jaxrl_term.tasks.task import Environment, FileBlob, Task, Tests


@dataclass(frozen=True)
class Case:
    name: str
    category: str
    expected: tuple[float, float]
    task: Task
    trajectory: Trajectory


def load_cases(path: str | None = None) -> list[Case]:
    text = Path(path).read_text() if path else \
        importlib.resources.files("jaxrl_term.reward").joinpath("data/judge_cases.yaml").read_text()
    data = yaml.safe_load(text)
    d = data.get("defaults", {})
    cases = []
    for c in data["cases"]:
        lo, hi = c["expected"]
        if not 0 <= lo <= hi <= 1:
            raise ValueError(f"judge case {c['name']}: expected range {c['expected']} is not within [0, 1]")
        instruction, dockerfile = c.get("instruction", d.get("instruction")), c.get("dockerfile", d.get("dockerfile"))
        task = Task(f"judge-case-{c['name']}", instruction, Environment(dockerfile=dockerfile),
                    Tests("pytest", {"test.py": FileBlob.text("")}, "test.py"))
        turns = [TurnRecord(i, 0, 0, 0, t["text"], [], list(t.get("errors", [])), list(t.get("results", [])),
                            "stop", 0.0, 0.0) for i, t in enumerate(c["turns"])]
        traj = Trajectory(task.id, "tbrl", [], [], [], 0, [], turns, c.get("end_reason", "finished"))
        cases.append(Case(c["name"], c.get("category", ""), (float(lo), float(hi)), task, traj))
    return cases


def distance(score: float, rng: tuple[float, float]) -> float:
    lo, hi = rng
    return 0.0 if lo <= score <= hi else (lo - score if score < lo else score - hi)


async def evaluate(endpoints: list[JudgeEndpoint], cases: list[Case], attempts: int = 3) -> list[dict]:
    rows = []
    for ep in endpoints:
        client = JudgeClient([ep], failure_threshold=10**6, rounds=1, cache_size=0)
        try:
            for case in cases:
                for k in range(attempts):
                    messages = render_prompt(case.task, case.trajectory)
                    t0 = time.monotonic()
                    res = await client.score_messages(messages)
                    rows.append({"judge": ep.name, "model": ep.model, "case": case.name, "category": case.category,
                                 "attempt": k, "score": res.score, "expected": list(case.expected),
                                 "in_range": res.score is not None and distance(res.score, case.expected) == 0,
                                 "abs_error": None if res.score is None else distance(res.score, case.expected),
                                 "latency_s": time.monotonic() - t0,
                                 "failure": None if res.score is not None else res.attempts[-1]["outcome"]})
        finally:
            await client.aclose()
    return rows


def rank(rows: list[dict]) -> list[dict]:
    out = []
    for judge in dict.fromkeys(r["judge"] for r in rows):
        rs = [r for r in rows if r["judge"] == judge]
        scored = [r for r in rs if r["score"] is not None]
        out.append({
            "judge": judge, "model": rs[0]["model"], "attempts": len(rs),
            "in_range_rate": sum(r["in_range"] for r in rs) / len(rs),
            "mae": statistics.mean(r["abs_error"] for r in scored) if scored else float("nan"),
            "mean_score": statistics.mean(r["score"] for r in scored) if scored else float("nan"),
            "failure_rate": 1 - len(scored) / len(rs),
            "latency_p50_s": statistics.median(r["latency_s"] for r in rs),
        })
    out.sort(key=lambda x: (-x["in_range_rate"], x["mae"] if x["mae"] == x["mae"] else 9, x["latency_p50_s"]))
    return out


def write_report(rows: list[dict], ranking: list[dict], out: Path, cases: list[Case]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"ranking": ranking, "rows": rows}, indent=2))
    lines = ["# Judge evaluation", "", f"{len(cases)} labelled cases; attempts per case: "
             f"{max(r['attempt'] for r in rows) + 1}. Ranked by in-range rate, then mean absolute error (distance "
             "to the expected range), then median latency.", "",
             "| rank | judge | model | in range | MAE | mean score | failures | latency p50 s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for i, r in enumerate(ranking, 1):
        lines.append(f"| {i} | {r['judge']} | {r['model']} | {r['in_range_rate']:.0%} | {r['mae']:.3f} | "
                     f"{r['mean_score']:.3f} | {r['failure_rate']:.0%} | {r['latency_p50_s']:.2f} |")
    lines += ["", "## Per case (mean score over attempts; expected range)", "",
              "| case | category | expected | " + " | ".join(r["judge"] for r in ranking) + " |",
              "| --- | --- | --- | " + " | ".join("---" for _ in ranking) + " |"]
    for c in cases:
        cells = []
        for r in ranking:
            s = [x["score"] for x in rows if x["judge"] == r["judge"] and x["case"] == c.name and x["score"] is not None]
            cells.append(f"{statistics.mean(s):.2f}" if s else "failed")
        lines.append(f"| {c.name} | {c.category} | {c.expected[0]:.2f}–{c.expected[1]:.2f} | " + " | ".join(cells) + " |")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
    names = [r["judge"] for r in ranking]
    ax[0].bar(names, [r["in_range_rate"] for r in ranking], color="tab:green")
    ax[0].set_ylim(0, 1)
    ax[0].set_title("in-range rate (higher is better)")
    ax[1].bar(names, [0 if r["mae"] != r["mae"] else r["mae"] for r in ranking], color="tab:red")
    ax[1].set_title("mean absolute error (lower is better)")
    for a in ax:
        a.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(out / "chart.png", dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxrl_term.reward.judge_eval")
    ap.add_argument("--judges", required=True, help="a YAML with reward.judge.endpoints (e.g. conf/reward/tbrl.yaml)")
    ap.add_argument("--attempts", type=int, default=3)
    ap.add_argument("--cases", default=None, help="default: the bundled labelled cases")
    ap.add_argument("--out", default="runs/judge_eval")
    args = ap.parse_args(argv)
    cfg = yaml.safe_load(Path(args.judges).read_text())
    items = (cfg.get("judge") or cfg.get("reward", {}).get("judge") or {}).get("endpoints")
    if not items:
        raise SystemExit(f"{args.judges}: no judge.endpoints")
    cases = load_cases(args.cases)
    rows = asyncio.run(evaluate(endpoints_from_config(items), cases, args.attempts))
    ranking = rank(rows)
    write_report(rows, ranking, Path(args.out), cases)
    for i, r in enumerate(ranking, 1):
        print(f"{i}. {r['judge']}: in range {r['in_range_rate']:.0%}, MAE {r['mae']:.3f}, "
              f"failures {r['failure_rate']:.0%}, p50 {r['latency_p50_s']:.2f}s")
    print(f"report: {Path(args.out) / 'report.md'}, chart: {Path(args.out) / 'chart.png'}")
    return 0


if __name__ == "__main__":
    from jaxrl_term.utils.cli import guard

    raise SystemExit(guard(main)())
