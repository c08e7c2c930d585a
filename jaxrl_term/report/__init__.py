"""One report per run: ``python -m jaxrl_term.report RUN_DIR`` writes ``report.html`` (self-contained: inline
SVG charts, inline CSS/JS, every transcript browsable and searchable; no server, no network) and ``report.md``
(the numbers). ``python -m jaxrl_term.report compare RUN_A RUN_B`` prints per-task differences.

Charts are drawn with matplotlib: the well-kept standard, already a dependency, and its static SVG needs no
JavaScript or network (plotly or bokeh would inline megabytes of JS per page). The transcript browser is a few
lines of vanilla JS over the transcripts embedded as JSON; text is always set as ``textContent``, never as
HTML, so adversarial command output cannot inject markup or script.

Reads the files of ``docs/run_dir.md``; a partial run dir (killed mid-way, a cut last line, missing files)
renders what is there and says what is missing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from jaxrl_term.report.load import Run, load_run
from jaxrl_term.report.render import render_html, render_markdown

__all__ = ["Run", "compare", "load_run", "write_report"]


def write_report(run_dir: str | os.PathLike) -> Path:
    """Write ``run_dir/report.html`` and ``run_dir/report.md``; returns the HTML path."""
    run = load_run(run_dir)
    out = Path(run_dir) / "report.html"
    out.write_text(render_html(run), encoding="utf-8")
    (Path(run_dir) / "report.md").write_text(render_markdown(run), encoding="utf-8")
    return out


def _eval_summary(run: Run) -> dict:
    if run.kind == "eval":
        return run.summary
    if run.evals:
        return run.evals[max(run.evals)]
    raise ValueError(f"{run.dir}: no evaluation to compare (a training run needs trainer.eval_every)")


def compare(a: str | os.PathLike, b: str | os.PathLike) -> dict:
    """Per-task pass@1 of two evaluations (eval run dirs, or training runs' latest held-out evaluation)."""
    sa, sb = _eval_summary(load_run(a)), _eval_summary(load_run(b))
    ta, tb = sa.get("per_task", {}), sb.get("per_task", {})
    rows = []
    for task in sorted(set(ta) | set(tb)):
        pa, pb = (ta.get(task) or {}).get("pass@1"), (tb.get(task) or {}).get("pass@1")
        delta = None if pa is None or pb is None else pb - pa
        rows.append({"task": task, "a": pa, "b": pb, "delta": delta})
    rows.sort(key=lambda r: (r["delta"] is None, -(r["delta"] or 0.0), r["task"]))
    return {"a": {"run": str(a), "pass@1": sa.get("pass@1"), "pass@k": sa.get("pass@k"), "k": sa.get("k")},
            "b": {"run": str(b), "pass@1": sb.get("pass@1"), "pass@k": sb.get("pass@k"), "k": sb.get("k")},
            "tasks": rows, "only_a": sorted(set(ta) - set(tb)), "only_b": sorted(set(tb) - set(ta)),
            "better": sum(1 for r in rows if (r["delta"] or 0) > 0),
            "worse": sum(1 for r in rows if (r["delta"] or 0) < 0)}


def compare_json(a, b) -> str:
    return json.dumps(compare(a, b), indent=2)
