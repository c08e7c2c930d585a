"""The report's charts: matplotlib figures rendered to inline SVG strings (None when there is nothing to draw).

Figures are built with ``matplotlib.figure.Figure`` and saved as SVG, never through pyplot: no GUI backend is
touched and nothing global changes (the process's backend stays Agg/headless). Text stays text
(``svg.fonttype: none``), and each chart gets its own ``svg.hashsalt`` so the clip-path and marker ids of
several inlined SVGs never collide.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

from jaxrl_term.report.load import Run, as_dict, as_float
from jaxrl_term.report.tables import group_order

TIME_KEYS = ("rollout_wait_s", "update_s", "weight_sync_s", "eval_s", "checkpoint_s")


def _label(text: object) -> str:
    """Data as a matplotlib label: ``$`` would start mathtext."""
    return str(text).replace("$", r"\$")


def _figure(w: float, h: float, integer_x: bool = False):
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(w, h), layout="constrained")
    ax = fig.subplots()
    if integer_x:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig, ax


def _svg(fig, name: str) -> str:
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": name}):
        fig.savefig(buf, format="svg", metadata={"Creator": None, "Date": None, "Format": None, "Type": None})
    text = buf.getvalue()
    return text[text.index("<svg"):]  # no XML prolog or DOCTYPE inside HTML


def reward_curves(run: Run) -> str | None:
    """Training reward (mean), pass rate and held-out pass@1 vs step."""
    steps, evals = run.steps, [m for m in run.eval_points if as_float(m.get("eval/pass@1")) is not None]
    if not steps and not evals:
        return None
    fig, ax = _figure(6.4, 3.4, integer_x=True)
    if steps:
        xs = [m["step"] for m in steps]
        for key, style in (("reward/mean", {"marker": "o", "label": "train reward (mean)"}),
                           ("reward/pass_rate", {"marker": ".", "ls": "--", "label": "train pass rate"})):
            pts = [(x, as_float(m.get(key))) for x, m in zip(xs, steps) if as_float(m.get(key)) is not None]
            if pts:
                ax.plot(*zip(*pts), **style)
    if evals:
        ax.plot([m["step"] for m in evals], [m["eval/pass@1"] for m in evals], marker="s", lw=2,
                label="held-out pass@1")
    ax.set_xlabel("step (updates applied)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title("Reward and held-out pass@1 vs step")
    return _svg(fig, "reward_curves")


def warm_start_loss(run: Run) -> str | None:
    raw = run.warm_start.get("losses")
    losses = [f for x in raw if (f := as_float(x)) is not None] if isinstance(raw, list) else []
    if not losses:
        return None
    fig, ax = _figure(6.4, 2.8, integer_x=True)
    ax.plot(range(1, len(losses) + 1), losses)
    ax.set_xlabel("SFT step")
    ax.set_ylabel("loss")
    if min(losses) > 0:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.set_title("Warm start loss (SFT on demonstrations)")
    return _svg(fig, "warm_start_loss")


def step_times(run: Run) -> str | None:
    """Stacked bars per step: rollout wait, update, weight sync, held-out eval, checkpoint, the rest."""
    steps = [m for m in run.steps if any(as_float(m.get(f"time/{k}")) is not None for k in TIME_KEYS)]
    if not steps:
        return None
    fig, ax = _figure(6.4, 3.4, integer_x=True)
    xs = [m["step"] for m in steps]
    bottom = [0.0] * len(steps)
    for k in TIME_KEYS:
        vals = [as_float(m.get(f"time/{k}")) or 0.0 for m in steps]
        if any(vals):
            ax.bar(xs, vals, bottom=bottom, label=k.removesuffix("_s").replace("_", " "))
            bottom = [b + v for b, v in zip(bottom, vals)]
    rest = [max(0.0, (as_float(m.get("time/step_s")) or 0.0) - b) for m, b in zip(steps, bottom)]
    if any(r > 1e-3 for r in rest):
        ax.bar(xs, rest, bottom=bottom, label="other", color="#bbbbbb")
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title("Step time breakdown")
    return _svg(fig, "step_times")


def pass_by(summary: dict, axis: str, title: str) -> str | None:
    """Horizontal bars of pass@1 (and pass@k behind it) per group of ``summary[axis]``."""
    groups = dict(sorted(((name, g) for name, g in as_dict(summary.get(axis)).items()
                          if isinstance(g, dict) and as_float(g.get("pass@1")) is not None), key=group_order))
    if not groups:
        return None
    names = list(groups)
    fig, ax = _figure(6.4, max(1.8, 0.4 * len(names) + 1.0))
    ys = range(len(names))
    ax.barh(ys, [as_float(groups[n].get("pass@k")) or 0.0 for n in names], color="#c6dbef", label="pass@k")
    ax.barh(ys, [groups[n]["pass@1"] for n in names], height=0.5, color="#2171b5", label="pass@1")
    for y, n in zip(ys, names):
        ax.text(groups[n]["pass@1"] + 0.01, y, f"{groups[n]['pass@1']:.0%}", va="center", fontsize=8)
    ax.set_yticks(list(ys), [_label(n if n != "None" else "(none)") for n in names])
    ax.set_xlim(0, 1.1)
    ax.invert_yaxis()
    ax.set_xlabel("pass rate")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(title)
    return _svg(fig, f"pass_by_{axis}")


def histogram(values: Sequence[object], title: str, xlabel: str, name: str) -> str | None:
    vals = [f for v in values if (f := as_float(v)) is not None]
    if not vals:
        return None
    lo, hi = min(vals), max(vals)
    integral = all(v.is_integer() for v in vals) and hi - lo <= 40
    fig, ax = _figure(3.4, 2.6, integer_x=integral)
    if integral:  # turns, small token counts: one bar per value
        ax.hist(vals, bins=[lo - 0.5 + i for i in range(int(hi - lo) + 2)], rwidth=0.9)
        if hi - lo < 10:
            ax.set_xticks(range(int(lo), int(hi) + 1))
    else:
        ax.hist(vals, bins=20)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("count")
    ax.set_title(title, fontsize=10)
    return _svg(fig, name)


def all_charts(run: Run) -> list[str]:
    """Every chart the run has data for, in page order."""
    if run.kind == "eval":
        where, episodes, what = "", run.attempts or run.transcripts, "attempt"
    else:
        where = f" (held-out, step {max(run.evals)})" if run.evals else ""
        episodes = [t for t in run.transcripts if t["source"].startswith("train")] or run.transcripts
        what = "episode"
    turns = [e.get("turns") if not isinstance(e.get("turns"), list) else len(e["turns"]) for e in episodes]
    charts = [reward_curves(run), step_times(run),
              pass_by(run.headline, "by_category", "Pass rate by category" + where),
              pass_by(run.headline, "by_difficulty", "Pass rate by difficulty" + where),
              histogram(turns, f"Turns per {what}", "turns", "hist_turns"),
              histogram([e.get("tokens") for e in episodes], f"Tokens per {what}", "tokens", "hist_tokens")]
    return [c for c in charts if c]
