"""Judging the judges: can a judge *rank* trajectories by the quality of the agent's process?

``python -m jaxrl_term.reward.judge_eval --judges conf/reward/tbrl.yaml [--attempts 3] [--out DIR]``

Cases (``reward/data/judge_cases.yaml``): 33 labelled trajectories in three balanced classes (good, mixed,
bad), each with a target score: short runs and long real-style ones (up to 151 turns), prompt injection in
the agent's text and in tool output, forged transcript structure, faked test evidence, test and checker
gaming, loops, parse-error loops, good runs cut off by the turn or time limit.

Every endpoint is evaluated on its own (no fallback, no cache), ``attempts`` times per case with distinct
seeds and a temperature > 0 (``--temperature``, default 0.7 where the endpoint's own is 0), so repeats are
samples rather than duplicates. As in training, a case that breaks the judge (context length, refusal,
unparsable) scores 0; infrastructure failures are counted and leave that attempt out.

Ranking: *pairwise ordering accuracy* over the pairs of cases whose targets differ by at least
``PAIR_MARGIN`` (the share the judge's per-case mean orders like the targets; ties and cases with no score
count one half), then Spearman's rho between per-case means and targets, each with a 95% bootstrap interval
over cases. A constant judge and a uniform random judge go through the same metrics as baselines; a judge
worth using sits clearly above both. Judges that produced no score at all are listed, not ranked; when no
judge produced a score the exit status is 1. Writes ``report.md``, ``results.json`` (strict JSON) and
``chart.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.resources
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml
from scipy.stats import rankdata

from jaxrl_term.agent.trajectory import Trajectory, TurnRecord
from jaxrl_term.reward.judge import JudgeClient, JudgeEndpoint, JudgeFailure, endpoints_from_config
from jaxrl_term.tasks.task import Environment, FileBlob, Task, Tests

LABELS = ("good", "mixed", "bad")
PAIR_MARGIN = 0.2
BASELINES = ("baseline:constant", "baseline:random")


@dataclass(frozen=True)
class Case:
    name: str
    label: str
    target: float
    expected: tuple[float, float]
    task: Task
    trajectory: Trajectory


def _noise(n: int = 2500) -> str:
    return "\n".join(f"test_report.py::test_case_{k} <- plugins/cov.py:{k % 97} DeprecationWarning: "
                     f"datetime.utcnow() is deprecated (collected {k} items)" for k in range(n))


def _expand(items: list, where: str) -> list[dict]:
    out = []
    for t in items:
        if "repeat" in t:
            for i in range(1, int(t["repeat"]) + 1):
                out += _expand(json.loads(json.dumps(t["turns"]).replace("{i}", str(i))), where)
        else:
            out.append(t)
    return out


def _turn(i: int, t: dict) -> TurnRecord:
    actions, results = [], []
    for r in t.get("results", []):
        args = r.get("args") or ({"cmd": r["cmd"]} if "cmd" in r else {})
        actions.append({"tool": r["tool"], "args": args})
        code = r.get("exit_code")
        results.append({"tool": r["tool"], "ok": r.get("ok", code in (None, 0)),
                        "text": str(r.get("text", "")).replace("{noise}", _noise()), "exit_code": code,
                        "timed_out": bool(r.get("timed_out", False)), "duration_s": 0.0})
    return TurnRecord(i, 0, 0, 0, t["text"], actions, list(t.get("errors", [])), results, "stop", 0.0, 0.0)


def load_cases(path: str | None = None) -> list[Case]:
    text = Path(path).read_text() if path else \
        importlib.resources.files("jaxrl_term.reward").joinpath("data/judge_cases.yaml").read_text()
    data = yaml.safe_load(text)
    d = data.get("defaults", {})
    cases = []
    for c in data["cases"]:
        where = f"judge case {c.get('name')}"
        lo, hi = c["expected"]
        if not 0 <= lo <= float(c["target"]) <= hi <= 1:
            raise ValueError(f"{where}: target {c['target']} and expected range {c['expected']} must satisfy "
                             "0 <= lo <= target <= hi <= 1")
        if c.get("label") not in LABELS:
            raise ValueError(f"{where}: label {c.get('label')!r}; use one of {LABELS}")
        instruction, dockerfile = c.get("instruction", d.get("instruction")), c.get("dockerfile", d.get("dockerfile"))
        task = Task(f"judge-case-{c['name']}", instruction, Environment(dockerfile=dockerfile),
                    Tests("pytest", {"test.py": FileBlob.text("")}, "test.py"))
        turns = [_turn(i, t) for i, t in enumerate(_expand(c["turns"], where))]
        traj = Trajectory(task.id, "tbrl", [], [], [], 0, [], turns, c.get("end_reason", "finished"))
        cases.append(Case(c["name"], c["label"], float(c["target"]), (float(lo), float(hi)), task, traj))
    return cases


# ------------------------------------------------------------------------------------------------ scoring


async def evaluate(endpoints: list[JudgeEndpoint], cases: list[Case], attempts: int = 3,
                   temperature: float | None = None) -> tuple[list[dict], dict[str, dict]]:
    """(one row per (judge, case, attempt): score (None on an infrastructure failure), zeroed, failure;
    token usage and estimated cost per judge)."""
    rows: list[dict] = []
    usage: dict[str, dict] = {}
    for ep in endpoints:
        client = JudgeClient([ep], failure_threshold=10**6, rounds=1, retries=1, backoff_s=0.5, cache_size=0)
        temp = temperature if temperature is not None else (ep.temperature if ep.temperature > 0 else 0.7)

        async def one(case: Case, k: int, ep=ep, client=client, temp=temp) -> dict:
            t0 = time.monotonic()
            row = {"judge": ep.name, "model": ep.model, "case": case.name, "label": case.label,
                   "target": case.target, "attempt": k, "score": None, "zeroed": None, "failure": None}
            try:
                res = await client.judge_one(ep, case.task, case.trajectory, seed=k, temperature=temp, use_cache=False)
                row.update(score=res.score, zeroed=res.zeroed)
            except JudgeFailure as f:
                row["failure"] = f.kind
            row["latency_s"] = round(time.monotonic() - t0, 4)
            return row

        try:
            rows += await asyncio.gather(*(one(c, k) for c in cases for k in range(attempts)))
        finally:
            await client.aclose()
        u = client.take_stats()
        usage[ep.name] = {"prompt_tokens": u.get(f"judge/{ep.name}/prompt_tokens", 0),
                          "completion_tokens": u.get(f"judge/{ep.name}/completion_tokens", 0),
                          "cost_usd": u["judge/cost_usd_total"]}
    return rows, usage


def baseline_rows(cases: list[Case], attempts: int, seed: int = 0) -> list[dict]:
    """A constant judge (0.5 everywhere) and a uniform random judge, as rows like ``evaluate``'s."""
    rng = random.Random(seed)
    rows = []
    for name in BASELINES:
        for c in cases:
            for k in range(attempts):
                s = 0.5 if name.endswith("constant") else round(rng.random(), 3)
                rows.append({"judge": name, "model": "-", "case": c.name, "label": c.label, "target": c.target,
                             "attempt": k, "score": s, "zeroed": None, "failure": None, "latency_s": 0.0})
    return rows


def _pair_scores(m: np.ndarray) -> np.ndarray:
    """S[i, j]: 1 if case i is scored above case j, 0.5 for ties or a missing score, 0 below."""
    diff = m[:, None] - m[None, :]
    s = np.where(diff > 1e-9, 1.0, np.where(diff < -1e-9, 0.0, 0.5))
    return np.where(np.isnan(diff), 0.5, s)


def _spearman(m: np.ndarray, t: np.ndarray) -> float | None:
    ok = ~np.isnan(m)
    if ok.sum() < 3 or np.ptp(m[ok]) == 0 or np.ptp(t[ok]) == 0:
        return None
    a, b = rankdata(m[ok]), rankdata(t[ok])
    return float(np.corrcoef(a, b)[0, 1])


def metrics(rows: list[dict], cases: list[Case], n_boot: int = 2000, seed: int = 0) -> dict:
    """Ordering metrics of one judge's rows, with 95% bootstrap intervals over cases."""
    t = np.array([c.target for c in cases])
    per_case = [[r["score"] for r in rows if r["case"] == c.name and r["score"] is not None] for c in cases]
    m = np.array([statistics.fmean(s) if s else np.nan for s in per_case])
    W = (t[:, None] - t[None, :] >= PAIR_MARGIN).astype(float)
    if not W.any():
        raise ValueError(f"judge cases: no two targets differ by {PAIR_MARGIN}; nothing to rank on")
    WS = W * _pair_scores(m)
    pairwise = float(WS.sum() / W.sum())
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(cases), size=(n_boot, len(cases)))
    counts = np.stack([np.bincount(i, minlength=len(cases)) for i in idx]).astype(float)
    den = np.einsum("bi,ij,bj->b", counts, W, counts)
    boot_pw = np.einsum("bi,ij,bj->b", counts, WS, counts)[den > 0] / den[den > 0]
    boot_sp = [x for x in (_spearman(m[i], t[i]) for i in idx) if x is not None]
    scored = [r for r in rows if r["score"] is not None]
    spread = [statistics.pstdev(s) for s in per_case if len(s) > 1]
    by_label = {lab: [r["score"] for r in scored if r["label"] == lab] for lab in LABELS}
    sp = _spearman(m, t)
    return {
        "pairwise_accuracy": pairwise,
        "pairwise_ci95": [float(np.percentile(boot_pw, 2.5)), float(np.percentile(boot_pw, 97.5))]
        if len(boot_pw) else None,
        "spearman": sp,
        "spearman_ci95": [float(np.percentile(boot_sp, 2.5)), float(np.percentile(boot_sp, 97.5))]
        if len(boot_sp) >= n_boot // 2 else None,
        "mean_score": statistics.fmean(r["score"] for r in scored) if scored else None,
        "mean_by_label": {k: (statistics.fmean(v) if v else None) for k, v in by_label.items()},
        "in_range_rate": sum(c.expected[0] <= r["score"] <= c.expected[1] for c in cases for r in scored
                             if r["case"] == c.name) / max(1, len(scored)),
        "attempt_spread": statistics.fmean(spread) if spread else None,  # mean within-case std over attempts
        "attempts": len(rows), "scored": len(scored),
        "failure_rate": 1 - len(scored) / max(1, len(rows)),
        "zeroed_rate": sum(r["zeroed"] is not None for r in scored) / max(1, len(rows)),
        "latency_p50_s": statistics.median(r["latency_s"] for r in rows) if rows else None,
        "failures": sorted({r["failure"] for r in rows if r["failure"]}),
    }


def rank(rows: list[dict], cases: list[Case], usage: dict | None = None) -> tuple[list[dict], list[dict]]:
    """(ranked judges that scored, judges with no score at all)."""
    ranked, unscored = [], []
    for judge in dict.fromkeys(r["judge"] for r in rows):
        rs = [r for r in rows if r["judge"] == judge]
        entry = {"judge": judge, "model": rs[0]["model"], "baseline": judge in BASELINES,
                 "usage": (usage or {}).get(judge)}
        if not any(r["score"] is not None for r in rs):
            failures = sorted({r["failure"] for r in rs if r["failure"]})
            unscored.append({**entry, "attempts": len(rs), "failures": failures})
            continue
        ranked.append({**entry, **metrics(rs, cases)})
    ranked.sort(key=lambda x: (-x["pairwise_accuracy"], -(x["spearman"] or 0.0), x["failure_rate"]))
    return ranked, unscored


# ------------------------------------------------------------------------------------------------ report


def _strict(x):
    """NaN and infinities as null: results.json is strict JSON."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _strict(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_strict(v) for v in x]
    return x


def _f(x, fmt=".3f") -> str:
    return "n/a" if x is None else format(x, fmt)


def _ci(c) -> str:
    return "n/a" if not c else f"[{c[0]:.2f}, {c[1]:.2f}]"


def write_report(rows: list[dict], ranked: list[dict], unscored: list[dict], out: Path, cases: list[Case],
                 attempts: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(_strict({"ranking": ranked, "unscored": unscored, "rows": rows}),
                                                 indent=1, allow_nan=False))
    counts = {lab: sum(c.label == lab for c in cases) for lab in LABELS}
    intro = (f"{len(cases)} labelled cases ({', '.join(f'{v} {k}' for k, v in counts.items())}), {attempts} "
             f"attempts per case (distinct seeds). Ranked by pairwise ordering accuracy over case pairs whose targets "
             f"differ by >= {PAIR_MARGIN} (0.5 = no better than chance), then Spearman's rho with the targets; 95% "
             "bootstrap intervals over cases. Baselines: a constant judge and a uniform random judge.")
    header = ("| rank | judge | model | pairwise acc. | 95% CI | Spearman | 95% CI | mean good / mixed / bad | "
              "attempt spread | failures | zeroed | p50 s | tokens | cost $ |")
    lines = ["# Judge evaluation", "", intro, "", header, "|" + " --- |" * 14]
    for i, r in enumerate(ranked, 1):
        ml, u = r["mean_by_label"], r.get("usage") or {}
        tokens = u.get("prompt_tokens", 0) + u.get("completion_tokens", 0) if u else None
        lines.append(f"| {i} | {r['judge']} | {r['model']} | {r['pairwise_accuracy']:.3f} | "
                     f"{_ci(r['pairwise_ci95'])} | {_f(r['spearman'])} | {_ci(r['spearman_ci95'])} | "
                     f"{_f(ml['good'], '.2f')} / "
                     f"{_f(ml['mixed'], '.2f')} / {_f(ml['bad'], '.2f')} | {_f(r['attempt_spread'])} | "
                     f"{r['failure_rate']:.0%} | {r['zeroed_rate']:.0%} | {_f(r['latency_p50_s'], '.2f')} | "
                     f"{_f(tokens, 'd')} | {_f(u.get('cost_usd'), '.4f')} |")
    if unscored:
        lines += ["", "No score at all (not ranked): " + "; ".join(
            f"{u['judge']} ({', '.join(u['failures']) or 'no answer'})" for u in unscored)]
    judges = [r["judge"] for r in ranked if not r["baseline"]]
    lines += ["", "## Per case (mean score over attempts)", "",
              "| case | class | target | " + " | ".join(judges) + " |", "|" + " --- |" * (3 + len(judges))]
    for c in cases:
        cells = []
        for j in judges:
            s = [x["score"] for x in rows if x["judge"] == j and x["case"] == c.name and x["score"] is not None]
            cells.append(f"{statistics.fmean(s):.2f}" if s else "failed")
        lines.append(f"| {c.name} | {c.label} | {c.target:.2f} | " + " | ".join(cells) + " |")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(ranked)), 3.5))
    names = [r["judge"] for r in ranked]
    acc = [r["pairwise_accuracy"] for r in ranked]
    err = np.array([[a - r["pairwise_ci95"][0], r["pairwise_ci95"][1] - a] for a, r in zip(acc, ranked)]).T
    ax.bar(names, acc, yerr=err, capsize=4, color=["tab:gray" if r["baseline"] else "tab:green" for r in ranked])
    ax.axhline(0.5, color="k", lw=0.8, ls="--")
    ax.set_ylim(0, 1)
    ax.set_title("pairwise ordering accuracy (95% CI); dashed: chance")
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(out / "chart.png", dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxrl_term.reward.judge_eval")
    ap.add_argument("--judges", required=True, help="a YAML with reward.judge.endpoints (e.g. conf/reward/tbrl.yaml)")
    ap.add_argument("--attempts", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=None,
                    help="sampling temperature for the attempts (default: the endpoint's, or 0.7 if that is 0)")
    ap.add_argument("--cases", default=None, help="default: the bundled labelled cases")
    ap.add_argument("--out", default="runs/judge_eval")
    args = ap.parse_args(argv)
    cfg = yaml.safe_load(Path(args.judges).read_text())
    items = (cfg.get("judge") or cfg.get("reward", {}).get("judge") or {}).get("endpoints")
    if not items:
        raise ValueError(f"{args.judges}: no judge.endpoints")
    if args.attempts < 1:
        raise ValueError(f"--attempts {args.attempts}: give at least 1")
    cases = load_cases(args.cases)
    rows, usage = asyncio.run(evaluate(endpoints_from_config(items), cases, args.attempts, args.temperature))
    rows += baseline_rows(cases, args.attempts)
    ranked, unscored = rank(rows, cases, usage)
    write_report(rows, ranked, unscored, Path(args.out), cases, args.attempts)
    for i, r in enumerate(ranked, 1):
        print(f"{i}. {r['judge']}: pairwise {r['pairwise_accuracy']:.3f} {_ci(r['pairwise_ci95'])}, "
              f"Spearman {_f(r['spearman'])} {_ci(r['spearman_ci95'])}, failures {r['failure_rate']:.0%}")
    for u in unscored:
        print(f"-. {u['judge']}: no score ({', '.join(u['failures'])})")
    print(f"report: {Path(args.out) / 'report.md'}, chart: {Path(args.out) / 'chart.png'}")
    if not any(not r["baseline"] for r in ranked):
        print("error: no judge produced a score (see the failures above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from jaxrl_term.utils.cli import guard

    raise SystemExit(guard(main)())
