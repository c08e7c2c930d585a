"""The report's HTML page (inline SVG charts, tables, the transcript browser) and its markdown summary."""

from __future__ import annotations

import html
import io
import json
from collections.abc import Sequence
from typing import Any

from jaxrl_term.report.load import Run

MAX_TEXT = 20_000  # characters of one output / reply kept in the page (head and tail)
TIME_KEYS = ("rollout_wait_s", "update_s", "weight_sync_s", "eval_s", "checkpoint_s")


# ------------------------------------------------------------------------------------------------ charts


def _svg(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]  # drop the XML prolog and DOCTYPE: inline SVG


def _fig(w: float = 6.4, h: float = 3.2):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.fonttype"] = "none"  # text stays text (searchable, small)
    return plt.subplots(figsize=(w, h))


def chart_curves(run: Run) -> str | None:
    steps, evals = run.steps, run.eval_points
    if not steps and not evals:
        return None
    fig, ax = _fig()
    if steps:
        xs = [m["step"] for m in steps]
        ax.plot(xs, [m.get("reward/mean") for m in steps], marker="o", label="train reward (mean)")
        ax.plot(xs, [m.get("reward/pass_rate") for m in steps], marker=".", ls="--", label="train pass rate")
    if evals:
        ax.plot([m["step"] for m in evals], [m.get("eval/pass@1") for m in evals], marker="s", lw=2,
                label="held-out pass@1")
    ax.set_xlabel("step (updates applied)")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    ax.set_title("Reward and held-out pass@1 vs step")
    return _svg(fig)


def chart_warm_start(run: Run) -> str | None:
    losses = run.warm_start.get("losses")
    if not isinstance(losses, list) or not losses:
        return None
    fig, ax = _fig(6.4, 2.6)
    ax.plot(range(1, len(losses) + 1), losses)
    ax.set_xlabel("SFT step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.set_title("Warm start (SFT on oracle demonstrations)")
    return _svg(fig)


def chart_step_times(run: Run) -> str | None:
    steps = [m for m in run.steps if any(f"time/{k}" in m for k in TIME_KEYS)]
    if not steps:
        return None
    fig, ax = _fig()
    xs = [m["step"] for m in steps]
    bottom = [0.0] * len(steps)
    for k in TIME_KEYS:
        vals = [float(m.get(f"time/{k}") or 0.0) for m in steps]
        if any(vals):
            ax.bar(xs, vals, bottom=bottom, label=k.removesuffix("_s").replace("_", " "))
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=8)
    ax.set_title("Step time breakdown")
    return _svg(fig)


def chart_groups(summary: dict, axis: str, title: str) -> str | None:
    groups = {k: v for k, v in (summary.get(axis) or {}).items() if k != "None" and v.get("pass@1") is not None}
    if not groups:
        return None
    fig, ax = _fig(6.4, max(1.6, 0.35 * len(groups) + 0.8))
    names = list(groups)
    ax.barh(names, [groups[n]["pass@1"] for n in names])
    for i, n in enumerate(names):
        ax.text(groups[n]["pass@1"] + 0.01, i, f"{groups[n]['pass@1']:.0%} ({groups[n]['tasks']})", va="center",
                fontsize=8)
    ax.set_xlim(0, 1.15)
    ax.invert_yaxis()
    ax.set_xlabel("pass@1")
    ax.set_title(title)
    return _svg(fig)


def chart_hist(values: Sequence[float], title: str, xlabel: str) -> str | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    fig, ax = _fig(3.2, 2.6)
    ax.hist(values, bins=min(20, max(1, len(set(values)))))
    ax.set_xlabel(xlabel)
    ax.set_ylabel("episodes")
    ax.set_title(title, fontsize=10)
    return _svg(fig)


# -------------------------------------------------------------------------------------------- numbers


def pct(x: Any) -> str:
    return "-" if x is None else f"{float(x):.1%}"


def num(x: Any, fmt: str = ".4g") -> str:
    if x is None:
        return "-"
    try:
        return format(float(x), fmt)
    except (TypeError, ValueError):
        return str(x)


def score_rows(s: dict) -> list[tuple[str, str]]:
    rows = [("pass@1", f"{pct(s.get('pass@1'))} ± {pct(s.get('pass@1_std'))}")]
    for k, v in (s.get("pass_at") or {}).items():
        if k != "1":
            rows.append((f"pass@{k}", pct(v)))
    rows += [("tasks", str(s.get("tasks", "-"))), ("attempts", str(s.get("attempts", "-"))),
             ("invalid attempts (re-run or dropped, never scored)", str(s.get("attempts_invalid", 0))),
             ("mean reward", num(s.get("reward_mean"), ".3f")), ("turns (mean)", num(s.get("turns_mean"), ".2f")),
             ("tokens (mean)", num(s.get("tokens_mean"), ".0f"))]
    return rows


def group_rows(s: dict, axis: str) -> list[list[str]]:
    return [[name, str(g.get("tasks")), pct(g.get("pass@1")), pct(g.get("pass@k"))]
            for name, g in (s.get(axis) or {}).items() if name != "None"]


def step_rows(run: Run) -> list[list[str]]:
    return [[str(m["step"]), num(m.get("reward/mean"), ".3f"), pct(m.get("reward/pass_rate")),
             num(m.get("train/loss")), num(m.get("train/grad_norm"), ".3g"), num(m.get("episode/turns_mean"), ".2f"),
             num(m.get("time/step_s"), ".1f")] for m in run.steps]


STEP_HEAD = ["step", "reward", "pass rate", "loss", "grad norm", "turns", "step s"]
EVAL_HEAD = ["step", "held-out pass@1", "pass@k", "k", "tasks"]


def eval_rows(run: Run) -> list[list[str]]:
    return [[str(m["step"]), pct(m.get("eval/pass@1")), pct(m.get("eval/pass@k")), str(m.get("eval/k", "-")),
             str(m.get("eval/tasks", "-"))] for m in run.eval_points]


def config_rows(run: Run) -> list[tuple[str, str]]:
    c = run.config or {}

    def get(path: str):
        cur: Any = c
        for part in path.split("."):
            if not isinstance(cur, dict) or part not in cur:
                return None
            cur = cur[part]
        return cur

    keys = ["policy.kind", "policy.path", "model.name", "model.path", "algo.name", "algo.group_size", "data.source",
            "data.split", "agent.scaffold", "sandbox.backend", "rollout.engine", "rollout.temperature",
            "eval.attempts", "trainer.steps", "seed"]
    return [(k, str(get(k))) for k in keys if get(k) is not None]


def headline(run: Run) -> dict:
    """The main numbers (markdown and HTML share them)."""
    if run.kind == "eval":
        return run.summary
    return run.evals[max(run.evals)] if run.evals else {}


# ------------------------------------------------------------------------------------------- markdown


def md_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(out)


def render_markdown(run: Run) -> str:
    lines = [f"# jaxrl_term {run.kind} report: `{run.dir}`", ""]
    if run.config:
        lines += [md_table(["setting", "value"], config_rows(run)), ""]
    if run.kind == "eval":
        s = run.summary
        if s:
            lines += ["## Score", "", md_table(["", "value"], score_rows(s)), ""]
            for axis, title in (("by_difficulty", "By difficulty"), ("by_category", "By category")):
                rows = group_rows(s, axis)
                if rows:
                    lines += [f"## {title}", "", md_table(["", "tasks", "pass@1", "pass@k"], rows), ""]
            if s.get("failure_modes"):
                lines += ["## Failure modes", "", md_table(["mode", "attempts"],
                                                             [[k, str(v)] for k, v in s["failure_modes"].items()]), ""]
    else:
        ws = run.warm_start
        if ws:
            lines += ["## Warm start", "", md_table(["", "value"], [[k, num(v) if not isinstance(v, (list, bool, str))
                                                                        else str(v)] for k, v in ws.items()
                                                                    if k != "losses"]), ""]
        if run.eval_points:
            lines += ["## Held-out evaluation", "", md_table(EVAL_HEAD, eval_rows(run)), ""]
        if run.steps:
            lines += ["## Steps", "", md_table(STEP_HEAD, step_rows(run)), ""]
        last = headline(run)
        if last.get("by_difficulty"):
            lines += ["## Latest held-out evaluation by difficulty", "",
                      md_table(["", "tasks", "pass@1", "pass@k"], group_rows(last, "by_difficulty")), ""]
    lines += [f"{len(run.transcripts)} transcripts: see report.html."]
    if run.missing:
        lines += ["", "Missing (the run did not finish?): " + ", ".join(run.missing)]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------- html


def _cut(text: Any) -> Any:
    if isinstance(text, str) and len(text) > MAX_TEXT:
        return text[: MAX_TEXT // 2] + f"\n[... {len(text) - MAX_TEXT} characters cut in the report ...]\n" + \
            text[-MAX_TEXT // 2:]
    return text


def _slim(t: dict) -> dict:
    """A transcript for the page: long texts cut."""
    turns = []
    for u in t.get("turns") or []:
        turns.append({**u, "reply": _cut(u.get("reply")),
                      "results": [{**r, "text": _cut(r.get("text"))} for r in u.get("results") or []]})
    return {**t, "instruction": _cut(t.get("instruction")), "turns": turns}


def _table(head: Sequence[str] | None, rows: Sequence[Sequence[str]], cls: str = "") -> str:
    e = html.escape
    out = [f'<table class="{cls}">']
    if head:
        out.append("<tr>" + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr>")
    out += ["<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in r) + "</tr>" for r in rows]
    return "".join(out) + "</table>"


def _section(title: str, body: str, sid: str) -> str:
    return f'<section id="{sid}"><h2>{html.escape(title)}</h2>{body}</section>'


def render_html(run: Run) -> str:
    e = html.escape
    parts: list[str] = []
    if run.missing:
        parts.append(f'<p class="warn">Missing from this run dir (the run did not finish?): '
                     f'{e(", ".join(run.missing))}</p>')
    if run.config:
        parts.append(_section("Run", _table(None, config_rows(run), "kv"), "run"))
    charts: list[str] = []
    if run.kind == "eval":
        s = run.summary
        if s:
            body = _table(None, score_rows(s), "kv")
            for axis, title in (("by_difficulty", "by difficulty"), ("by_category", "by category")):
                rows = group_rows(s, axis)
                if rows:
                    body += f"<h3>{e(title)}</h3>" + _table(["", "tasks", "pass@1", "pass@k"], rows)
            if s.get("failure_modes"):
                body += "<h3>failure modes</h3>" + _table(["mode", "attempts"],
                                                           [[k, str(v)] for k, v in s["failure_modes"].items()])
            parts.append(_section("Score", body, "score"))
        charts += [chart_groups(s, "by_category", "pass@1 by category"),
                   chart_groups(s, "by_difficulty", "pass@1 by difficulty")]
        hist_src = run.attempts or run.transcripts
    else:
        ws = run.warm_start
        if ws:
            rows = [[k, num(v) if not isinstance(v, (list, bool, str)) else str(v)] for k, v in ws.items()
                    if k != "losses"]
            parts.append(_section("Warm start", _table(None, rows, "kv") + (chart_warm_start(run) or ""), "warm"))
        if run.eval_points:
            parts.append(_section("Held-out evaluation", _table(EVAL_HEAD, eval_rows(run)), "heldout"))
        if run.steps:
            parts.append(_section("Steps", _table(STEP_HEAD, step_rows(run)), "steps"))
        last = headline(run)
        charts += [chart_curves(run), chart_step_times(run),
                   chart_groups(last, "by_category", "latest held-out pass@1 by category"),
                   chart_groups(last, "by_difficulty", "latest held-out pass@1 by difficulty")]
        hist_src = run.transcripts
    charts += [chart_hist([t.get("turns") if isinstance(t.get("turns"), (int, float)) else len(t.get("turns") or [])
                           for t in hist_src], "turns per episode", "turns"),
               chart_hist([t.get("tokens") for t in hist_src], "tokens per episode", "tokens")]
    charts = [c for c in charts if c]
    if charts:
        parts.append(_section("Charts", "".join(f'<div class="chart">{c}</div>' for c in charts), "charts"))
    data = json.dumps([_slim(t) for t in run.transcripts], ensure_ascii=False, default=str)
    data = data.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    browser = ('<div class="browser"><div class="list-pane"><input id="transcript-search" type="search" '
               'placeholder="search task, instruction, commands, outputs..." autocomplete="off">'
               '<select id="transcript-filter"><option value="all">all</option><option value="pass">passed'
               '</option><option value="fail">failed</option></select><div id="transcript-count"></div>'
               '<div id="transcript-list"></div></div><div id="transcript-view" class="view-pane">'
               '<p class="hint">Click a transcript.</p></div></div>')
    parts.append(_section(f"Transcripts ({len(run.transcripts)})", browser, "transcripts"))
    title = f"jaxrl_term {run.kind} report: {run.dir.name}"
    return (f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{e(title)}</title>"
            f"<style>{CSS}</style></head><body><h1>{e(title)}</h1><p class=\"path\">{e(str(run.dir))}</p>"
            + "".join(parts) +
            f'<script type="application/json" id="transcripts-data">{data}</script><script>{JS}</script>'
            "</body></html>")


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:1.5em;color:#222;max-width:1400px}
h1{font-size:1.4em}h2{font-size:1.15em;border-bottom:1px solid #ddd;padding-bottom:.2em}h3{font-size:1em}
.path{color:#666;font-family:monospace}.warn{background:#fff3cd;padding:.5em}
table{border-collapse:collapse;margin:.4em 0}td,th{border:1px solid #ddd;padding:.2em .6em;text-align:left;
font-size:.9em}th{background:#f4f4f4}.kv td:first-child{color:#555}
.chart{display:inline-block;vertical-align:top;margin:.3em}.chart svg{max-width:100%;height:auto}
.browser{display:flex;gap:1em;align-items:flex-start}.list-pane{width:36%;min-width:280px}
#transcript-search{width:70%;padding:.3em}#transcript-list{max-height:80vh;overflow:auto;border:1px solid #ddd}
.transcript-item{padding:.3em .5em;border-bottom:1px solid #eee;cursor:pointer;font-size:.85em}
.transcript-item:hover,.transcript-item.selected{background:#eef4ff}.ok{color:#137333}.bad{color:#b3261e}
.view-pane{flex:1;min-width:0}pre{background:#f7f7f7;padding:.5em;white-space:pre-wrap;word-break:break-word;
max-height:40em;overflow:auto;font-size:.85em}.cmd{background:#eef6ee}.out{background:#f5f5fa}
.turn{border-left:3px solid #9ab;padding-left:.7em;margin:.8em 0}.err{color:#b3261e}.meta{color:#555;font-size:.85em}
"""

JS = r"""
(function(){
const data = JSON.parse(document.getElementById('transcripts-data').textContent);
const list = document.getElementById('transcript-list'), view = document.getElementById('transcript-view');
const search = document.getElementById('transcript-search'), filt = document.getElementById('transcript-filter');
const count = document.getElementById('transcript-count');
const hay = data.map(t => JSON.stringify(t).toLowerCase());
function el(tag, text, cls){ const x = document.createElement(tag); if (text !== undefined && text !== null)
  x.textContent = String(text); if (cls) x.className = cls; return x; }
function fmt(x){ return (typeof x === 'number') ? (Math.round(x * 1000) / 1000) : (x === null || x === undefined ? '-' : x); }
function show(i, item){
  for (const s of list.querySelectorAll('.selected')) s.classList.remove('selected');
  if (item) item.classList.add('selected');
  const t = data[i]; view.replaceChildren();
  view.appendChild(el('h3', t.task + ' - ' + (t.source || '') + ' #' + fmt(t.attempt)));
  view.appendChild(el('p', 'reward ' + fmt(t.reward) + ' | ' + (t.pass ? 'PASS' : 'fail') + ' | end ' + t.end_reason +
    ' | outcome ' + fmt(t.outcome) + ' | ' + fmt(t.tokens) + ' tokens | ' + fmt(t.duration_s) + ' s' +
    (t.advantage !== undefined ? ' | advantage ' + fmt(t.advantage) : ''), 'meta'));
  if (t.error) view.appendChild(el('p', 'error: ' + t.error, 'err'));
  view.appendChild(el('h4', 'Instruction')); view.appendChild(el('pre', t.instruction));
  for (const u of (t.turns || [])) {
    const d = el('div', undefined, 'turn'); d.appendChild(el('h4', 'Turn ' + u.index + ' (' + u.finish_reason + ', ' +
      fmt(u.gen_s) + ' s generating, ' + fmt(u.tool_s) + ' s in tools)'));
    d.appendChild(el('pre', u.reply, 'reply'));
    for (const m of (u.errors || [])) d.appendChild(el('p', 'parse error: ' + m, 'err'));
    (u.actions || []).forEach((a, j) => {
      const args = a.args || {}; const c = (typeof args.cmd === 'string') ? args.cmd : args.command;
      const cmd = (typeof c === 'string') ? c : JSON.stringify(args, null, 1);
      d.appendChild(el('div', a.tool, 'meta')); d.appendChild(el('pre', cmd, 'cmd'));
      const r = (u.results || [])[j];
      if (r) { d.appendChild(el('div', 'exit ' + fmt(r.exit_code) + (r.timed_out ? ' (timed out)' : '') + ', ' +
        fmt(r.duration_s) + ' s', 'meta')); d.appendChild(el('pre', r.text, 'out')); }
    });
    view.appendChild(d);
  }
  const tests = Object.entries(t.tests || {});
  view.appendChild(el('h4', 'Verifier'));
  if (tests.length) { const tb = el('table'); for (const [n, ok] of tests) { const tr = el('tr');
    tr.appendChild(el('td', n)); tr.appendChild(el('td', ok ? 'pass' : 'FAIL', ok ? 'ok' : 'bad')); tb.appendChild(tr); }
    view.appendChild(tb); }
  view.appendChild(el('pre', 'reward parts: ' + JSON.stringify(t.reward_parts || {}, null, 1) +
    (t.verifier_rewards && Object.keys(t.verifier_rewards).length ? '\nverifier rewards: ' +
    JSON.stringify(t.verifier_rewards) : '')));
}
function render(){
  const q = search.value.toLowerCase().trim(), f = filt.value; list.replaceChildren(); let n = 0;
  data.forEach((t, i) => {
    if (q && !hay[i].includes(q)) return;
    if (f === 'pass' && !t.pass) return; if (f === 'fail' && t.pass) return;
    n++; const item = el('div', undefined, 'transcript-item'); item.dataset.id = t.id;
    item.appendChild(el('span', t.pass ? 'PASS ' : 'fail ', t.pass ? 'ok' : 'bad'));
    item.appendChild(el('span', (t.source || '') + ' | ' + t.task + ' #' + fmt(t.attempt) + ' | reward ' + fmt(t.reward) +
      ' | ' + t.end_reason + ' | ' + (t.turns || []).length + ' turns'));
    item.addEventListener('click', () => show(i, item)); list.appendChild(item);
  });
  count.textContent = n + ' of ' + data.length + ' transcripts';
}
search.addEventListener('input', render); filt.addEventListener('change', render); render();
})();
"""
