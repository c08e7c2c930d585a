"""judge_eval against the test judge server, and the within-group skew of judging per trajectory vs per group.

Starts ``tests/judge_server.py`` (a real OpenAI-compatible HTTP server on loopback) with five judges: the
process heuristic (``good``), the same heuristic at two score levels (``harsh`` 0.1 + 0.3 h, ``lenient``
0.5 + 0.5 h: Terminal-Bench-RL's 0.26 vs 0.76 in miniature), a constant and a random judge; runs
``python -m jaxrl_term.reward.judge_eval`` on the bundled cases (its own constant and random baselines
included) and prints the ranking as a markdown table. Then judges 11 groups of three cases (one good, one
mixed, one bad) through the chain lenient -> harsh where lenient fails after its first request of each group,
once per trajectory (the old behaviour) and once per group (``judge_group``), and reports the skew against
harsh alone.

    .venv/bin/python experiments/bench/judge_eval.py [--attempts 3] [--out runs/judge_eval_bench]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from judge_server import JudgeServer

from jaxrl_term.reward.judge import JudgeClient, JudgeEndpoint
from jaxrl_term.reward.judge_eval import load_cases
from jaxrl_term.reward.judge_eval import main as judge_eval_main

JUDGES = [("heuristic", "good"), ("harsh", "harsh"), ("lenient", "lenient"), ("constant", "constant"),
          ("random", "random")]


def ranking(server: JudgeServer, attempts: int, out: Path) -> list[str]:
    with tempfile.TemporaryDirectory() as d:
        cfg = Path(d) / "judges.yaml"
        cfg.write_text("judge:\n  endpoints:\n" + "".join(
            f"    - {{name: {n}, base_url: '{server.url}', model: {m}, max_concurrency: 16, "
            f"usd_per_mtok_in: 3.0, usd_per_mtok_out: 15.0}}\n" for n, m in JUDGES))
        t0 = time.monotonic()
        rc = judge_eval_main(["--judges", str(cfg), "--attempts", str(attempts), "--out", str(out)])
        took = time.monotonic() - t0
    if rc != 0:
        raise SystemExit(f"judge_eval exited with {rc}")
    res = json.loads((out / "results.json").read_text())
    n_cases = len({r["case"] for r in res["rows"]})
    rows = [(f"judge_eval: {n_cases} cases x {attempts} attempts per judge, {took:.1f} s wall; prices "
             "$3 / $15 per million input / output tokens (server-reported usage)"), "",
            ("| rank | judge | pairwise acc. [95% CI] | Spearman [95% CI] | mean good / mixed / bad | "
             "attempt spread | tokens | est. cost $ |"), "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for i, r in enumerate(res["ranking"], 1):
        ci, sci, ml, u = r["pairwise_ci95"], r["spearman_ci95"], r["mean_by_label"], r.get("usage") or {}
        sp = "n/a" if r["spearman"] is None else f"{r['spearman']:.3f} [{sci[0]:.2f}, {sci[1]:.2f}]" if sci \
            else f"{r['spearman']:.3f}"
        tokens = f"{u['prompt_tokens'] + u['completion_tokens']:,}" if u else "-"
        cost = f"{u['cost_usd']:.3f}" if u else "-"
        spread = "n/a" if r["attempt_spread"] is None else f"{r['attempt_spread']:.3f}"
        rows.append(f"| {i} | {r['judge']} | {r['pairwise_accuracy']:.3f} [{ci[0]:.2f}, {ci[1]:.2f}] | {sp} | "
                    f"{ml['good']:.2f} / {ml['mixed']:.2f} / {ml['bad']:.2f} | {spread} | {tokens} | {cost} |")
    return rows


async def skew(server: JudgeServer) -> list[str]:
    cases = load_cases()
    by = {lab: [c for c in cases if c.label == lab] for lab in ("good", "mixed", "bad")}
    groups = [[by["good"][i], by["mixed"][i], by["bad"][i]] for i in range(min(map(len, by.values())))]
    chain = [JudgeEndpoint("lenient-b", server.url, "lenient-b"), JudgeEndpoint("harsh", server.url, "harsh")]
    ref_client = JudgeClient([chain[1]], rounds=1, retries=0, cache_size=0)
    worst = {"per trajectory": [], "per group": []}
    mixed_groups = {"per trajectory": 0, "per group": 0}
    try:
        for g in groups:
            task = g[0].task
            ref = (await ref_client.judge_group(task, [c.trajectory for c in g])).results
            for mode, w in worst.items():
                c = JudgeClient(chain, rounds=1, retries=0, backoff_s=0.01, failure_threshold=10, cache_size=0)
                server.calls["lenient-b"] = 0
                server.modes["lenient-b"] = "fail_after:1:lenient"  # answers the group's first request only
                try:
                    if mode == "per group":
                        got = (await c.judge_group(task, [x.trajectory for x in g])).results
                    else:
                        got = [await c.score(task, x.trajectory) for x in g]
                finally:
                    await c.aclose()
                w.append(max(abs(a.score - b.score) for a, b in zip(got, ref)))
                mixed_groups[mode] += len({r.endpoint for r in got}) > 1
    finally:
        await ref_client.aclose()
    rows = [(f"Within-group skew: {len(groups)} groups (good, mixed, bad), chain lenient -> harsh, lenient fails "
             "after the group's first request; skew = max |judge score - harsh alone| in a group."), "",
            "| judging | groups with two judges | mean skew (judge part) | max skew | max reward skew (x 0.35) |",
            "| --- | --- | --- | --- | --- |"]
    for mode, w in worst.items():
        rows.append(f"| {mode} | {mixed_groups[mode]} / {len(groups)} | {sum(w) / len(w):.3f} | {max(w):.3f} | "
                    f"{0.35 * max(w):.3f} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--attempts", type=int, default=3)
    ap.add_argument("--out", default="runs/judge_eval_bench")
    args = ap.parse_args()
    server = JudgeServer().start()
    try:
        lines = ranking(server, args.attempts, Path(args.out))
        lines += ["", *asyncio.run(skew(server))]
    finally:
        server.stop()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
