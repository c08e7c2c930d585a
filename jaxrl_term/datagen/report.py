"""The datagen report: ``out/report.md`` and ``out/report.png`` from ``out/records.jsonl``."""

from __future__ import annotations

import collections
from collections.abc import Mapping
from pathlib import Path

from jaxrl_term.datagen.pipeline import REASONS, read_records

AXES = ("corpus_kind", "domain", "task_complexity", "verifier_kind", "fixture_kind", "language")


def summarize(records: list[dict]) -> dict:
    kept = [r for r in records if r["status"] == "kept"]
    rejected = [r for r in records if r["status"] == "rejected"]
    errors = [r for r in records if r["status"] == "error"]
    calls = sum(r.get("calls", 0) for r in records)
    return {
        "specs": len(records), "kept": len(kept), "rejected": len(rejected), "errors": len(errors),
        "reasons": dict(collections.Counter(r["reason"] for r in rejected)),
        "calls": calls, "calls_per_kept": (calls / len(kept)) if kept else None,
        "repairs": sum(r.get("repairs", 0) for r in records),
        "per_axis": {ax: dict(collections.Counter(str(r["spec"].get(ax)) for r in kept)) for ax in AXES},
        "pass_rates": [r["pass_rate"] for r in records if r.get("pass_rate") is not None],
    }


def write_report(out_dir: str | Path, targets: Mapping[str, Mapping[str, float]] | None = None) -> Path:
    out = Path(out_dir)
    s = summarize(read_records(out))
    lines = [f"# Generated tasks: {out}", "",
             f"{s['specs']} specs: **{s['kept']} kept**, {s['rejected']} rejected, {s['errors']} teacher errors "
             f"(retried by the next run). Teacher calls: {s['calls']} ({s['repairs']} repairs); "
             + (f"{s['calls_per_kept']:.2f} calls per kept task." if s["calls_per_kept"] else "no task kept."), "",
             "![report](report.png)", "", "## Rejections", "", "| reason | specs |", "| --- | --- |"]
    lines += [f"| {r} | {s['reasons'].get(r, 0)} |" for r in REASONS if s["reasons"].get(r)] or ["| (none) | 0 |"]
    for ax in AXES:
        counts = s["per_axis"][ax]
        tgt = (targets or {}).get(ax, {})
        lines += ["", f"## Kept tasks per {ax}", "", "| value | kept | share | target share |",
                  "| --- | --- | --- | --- |"]
        for v in sorted(set(counts) | set(tgt)):
            n = counts.get(v, 0)
            share = n / s["kept"] if s["kept"] else 0.0
            lines.append(f"| {v} | {n} | {share:.3f} | {tgt[v]:.3f} |" if v in tgt else f"| {v} | {n} | {share:.3f} | - |")
    lines += ["", "## Pass rates of the policy on kept tasks", ""]
    if s["pass_rates"]:
        hist = collections.Counter(min(int(p * 10), 9) for p in s["pass_rates"])
        lines += ["| pass rate | tasks |", "| --- | --- |"]
        lines += [f"| {b / 10:.1f}–{(b + 1) / 10:.1f} | {hist.get(b, 0)} |" for b in range(10)]
    else:
        lines.append("Not measured (datagen.pass_rate.enabled=false).")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    _chart(out / "report.png", s)
    return out / "report.md"


def _chart(path: Path, s: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    reasons = {k: v for k, v in s["reasons"].items() if v}
    axes[0].bar(["kept", *reasons], [s["kept"], *reasons.values()], color=["tab:green"] + ["tab:red"] * len(reasons))
    axes[0].set_title("specs by outcome")
    axes[0].tick_params(axis="x", rotation=45)
    dom = s["per_axis"]["domain"]
    axes[1].bar(list(dom), list(dom.values()))
    axes[1].set_title("kept tasks per domain")
    axes[1].tick_params(axis="x", rotation=45)
    if s["pass_rates"]:
        axes[2].hist(s["pass_rates"], bins=10, range=(0, 1))
    axes[2].set_title("policy pass rate on kept tasks" + ("" if s["pass_rates"] else " (not measured)"))
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
