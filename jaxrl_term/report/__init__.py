"""One report per run: ``python -m jaxrl_term.report RUN_DIR`` writes ``RUN_DIR/report.html`` (one
self-contained page: the settings, scores, charts and every transcript, browsable and searchable; no server,
no network) and ``RUN_DIR/report.md`` (the numbers). ``python -m jaxrl_term.report compare RUN_A RUN_B`` prints
per-task differences of two evaluations. The trainer and the evaluator call :func:`write_report` at the end.

Charts use matplotlib because it is the well-kept standard, already a dependency, and its static SVG needs no
JavaScript or network, unlike plotly/bokeh, which would inline megabytes of JS in every page.

Reads the files of ``docs/run_dir.md``: ``load`` (a run dir, partial ones included), ``tables`` (the numbers;
``report.md``), ``charts`` (SVG), ``html`` (the page), ``browser`` (headless Chromium, for tests and screenshots).
"""

from __future__ import annotations

import os
from pathlib import Path

from jaxrl_term.report.load import NotARunDir, Run, as_dict, as_float, load_run

__all__ = ["NotARunDir", "Run", "compare", "load_run", "write_report"]


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
