"""One report per run: ``python -m jaxrl_term.report RUN_DIR`` writes ``RUN_DIR/report.html`` (one
self-contained page: the settings, scores, charts and every transcript, browsable and searchable; no server,
no network) and ``RUN_DIR/report.md`` (the numbers). ``python -m jaxrl_term.report compare RUN_A RUN_B`` prints
per-task differences of two evaluations; ``python -m jaxrl_term.report summary DIR...`` a results table of
training runs (a Hydra sweep's dir: one row per job, with its overrides). The trainer and the evaluator call :func:`write_report` at the end.

Charts use matplotlib because it is the well-kept standard, already a dependency, and its static SVG needs no
JavaScript or network, unlike plotly/bokeh, which would inline megabytes of JS in every page.

Reads the files of ``docs/run_dir.md``: ``load`` (a run dir, partial ones included), ``tables`` (the numbers;
``report.md``), ``charts`` (SVG), ``html`` (the page), ``browser`` (headless Chromium, for tests and screenshots).
"""

from __future__ import annotations

import os
from pathlib import Path

from jaxrl_term.report.load import NotARunDir, Run, as_dict, as_float, load_run

__all__ = ["NotARunDir", "Run", "compare", "load_run", "summarize_runs", "summary_markdown", "write_report"]


def write_report(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Write the HTML report to ``out`` (default ``run_dir/report.html``) and the markdown beside it
    (``.md``); returns the HTML path. Raises :class:`NotARunDir` when ``run_dir`` holds no run."""
    from jaxrl_term.report.html import render_html
    from jaxrl_term.report.tables import render_markdown

    run = load_run(run_dir)
    path = Path(out) if out is not None else run.dir / "report.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_html(run), encoding="utf-8", errors="replace")
    path.with_suffix(".md").write_text(render_markdown(run), encoding="utf-8", errors="replace")
    return path


def compare(a: str | os.PathLike, b: str | os.PathLike) -> dict:
    """Per-task pass@1 of two evaluations (eval run dirs, or training runs' latest held-out evaluations):
    ``{"a": {...}, "b": {...}, "tasks": [{"task", "a", "b", "delta"}], "only_a", "only_b", "better", "worse"}``;
    tasks sorted by delta (B - A), largest first; tasks evaluated by one side only come last (delta None)."""
    sides, per_task = {}, {}
    for name, path in (("a", a), ("b", b)):
        run = load_run(path)
        s = run.headline
        per_task[name] = {t: as_float(as_dict(v).get("pass@1")) for t, v in as_dict(s.get("per_task")).items()}
        if not per_task[name]:
            raise NotARunDir(f"{run.dir}: no evaluation with per-task results to compare (an eval run dir, or a "
                             "training run with a held-out evaluation: trainer.eval_every)")
        sides[name] = {"run": str(run.dir), "kind": run.kind,
                       "step": max(run.evals) if run.kind == "train" else s.get("step"),
                       **{k: s.get(k) for k in ("pass@1", "pass@1_std", "pass@k", "k", "pass_at", "tasks",
                                                "attempts")}}
    ta, tb = per_task["a"], per_task["b"]
    rows = []
    for task in sorted(set(ta) | set(tb)):
        pa, pb = ta.get(task), tb.get(task)
        rows.append({"task": task, "a": pa, "b": pb, "delta": None if pa is None or pb is None else pb - pa})
    rows.sort(key=lambda r: (r["delta"] is None, -(r["delta"] or 0.0), r["task"]))
    return {**sides, "tasks": rows, "only_a": sorted(set(ta) - set(tb)), "only_b": sorted(set(tb) - set(ta)),
            "better": sum(1 for r in rows if (r["delta"] or 0.0) > 0),
            "worse": sum(1 for r in rows if (r["delta"] or 0.0) < 0)}


def summarize_runs(paths: list[str | os.PathLike]) -> list[dict]:
    """One row per training run for a sweep's results table: each path is a run dir or a folder of run dirs
    (a Hydra multirun dir, ``runs/multirun/<time>``). A row: the run, its command-line overrides (Hydra's
    ``.hydra/overrides.yaml``), steps done, the first and last held-out pass@1 (and their steps), the last
    step's mean reward and the run's wall time from its metrics."""
    import yaml

    dirs: list[Path] = []
    for p in map(Path, paths):
        subs = sorted((c for c in p.iterdir() if c.is_dir() and (c / "metrics.jsonl").exists()),
                      key=lambda c: (not c.name.isdigit(), int(c.name) if c.name.isdigit() else 0, c.name)) \
            if p.is_dir() and not (p / "metrics.jsonl").exists() else []
        dirs += subs or [p]
    rows = []
    for d in dirs:
        run = load_run(d)
        if run.kind != "train":
            raise NotARunDir(f"{d}: an evaluation run dir; summarize_runs takes training runs (or a sweep of them)")
        ov = d / ".hydra" / "overrides.yaml"
        overrides = [o for o in (yaml.safe_load(ov.read_text()) or []) if not o.startswith(("run_dir=", "hydra."))] \
            if ov.is_file() else []
        evals = run.eval_points
        steps = run.steps
        wall = sum(as_float(m.get("time/step_s")) or 0.0 for m in steps)
        rows.append({"run": str(d), "overrides": overrides, "steps": len(steps),
                     "eval_first": as_float(evals[0].get("eval/pass@1")) if evals else None,
                     "eval_first_step": evals[0]["step"] if evals else None,
                     "eval_last": as_float(evals[-1].get("eval/pass@1")) if evals else None,
                     "eval_last_step": evals[-1]["step"] if evals else None,
                     "heldout_tasks": as_float(evals[-1].get("eval/tasks")) if evals else None,
                     "reward_last": as_float(steps[-1].get("reward/mean")) if steps else None,
                     "reward_mean": _mean(as_float(m.get("reward/mean")) for m in steps),
                     "wall_s": wall or None})
    return rows


def _mean(xs) -> float | None:
    vals = [x for x in xs if x is not None]
    return sum(vals) / len(vals) if vals else None


def _override_key(o: str) -> str:
    return o.split("=", 1)[0].lstrip("+~")


def summary_markdown(rows: list[dict]) -> str:
    """The rows as a markdown table: one column per override that differs between runs (the sweep's axes),
    the overrides every run shares listed once above the table."""
    from jaxrl_term.report.tables import num, pct

    by_run = [{_override_key(o): o.split("=", 1)[1] if "=" in o else o for o in r["overrides"]} for r in rows]
    keys = list(dict.fromkeys(k for kv in by_run for k in kv))
    axes = [k for k in keys if len({kv.get(k) for kv in by_run}) > 1]
    shared = [o for o in (rows[0]["overrides"] if rows else []) if _override_key(o) not in axes]
    head = f"Overrides shared by every run: `{' '.join(shared)}`\n\n" if shared and len(rows) > 1 else ""
    cols = axes if len(rows) > 1 else []
    lines = ["| run | " + "".join(f"{k} | " for k in cols) + ("" if cols else "overrides | ")
             + "steps | held-out pass@1 first → last (steps) | change | mean reward | last reward | time in steps s |"]
    lines.append("|" + " --- |" * (len(cols) + (0 if cols else 1) + 7))
    for r, kv in zip(rows, by_run):
        first, last = r["eval_first"], r["eval_last"]
        same_point = r["eval_first_step"] == r["eval_last_step"]
        change = "-" if first is None or last is None or same_point else f"{last - first:+.1%}"
        what = "".join(f"{kv.get(k, '-')} | " for k in cols) if cols else f"{' '.join(r['overrides']) or '-'} | "
        lines.append(f"| {Path(r['run']).name} | {what}{r['steps']} | "
                     f"{pct(first)} → {pct(last)} ({r['eval_first_step']} → {r['eval_last_step']}) | {change} | "
                     f"{num(r.get('reward_mean'), '.3f')} | {num(r['reward_last'], '.3f')} | {num(r['wall_s'], '.0f')} |")
    return head + "\n".join(lines) + "\n"
