"""The report's HTML page: one self-contained file (inline CSS, inline SVG charts, inline JS; nothing fetched).

Every transcript is embedded as JSON in a ``<script type="application/json">`` element and shown by a few
lines of vanilla JS that set transcript text only as ``textContent``, never as HTML. In the embedded JSON every
``<``, ``>`` and ``&`` is written as a ``\\u00XX`` escape, so no output (``</script><script>...``, ``<!--``) can end
the element early; JSON.parse reads the escapes back to the same text.

Stable hooks for browser tests: ``#transcript-search``, ``#transcript-filter`` (all / pass / fail),
``#transcript-source``, ``.transcript-item[data-id]`` in ``#transcript-list``, the detail pane
``#transcript-view``.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from typing import Any

from jaxrl_term.report import charts, tables
from jaxrl_term.report.load import Run, as_float

MAX_TEXT = 20_000  # characters of one string of a transcript kept in the page (head and tail)
Section = tuple[str, str, str]  # (element id, title, body html)


def clean(x: Any) -> Any:
    """A transcript for the page: strings over MAX_TEXT cut in the middle with a marker, NaN/inf as null."""
    if isinstance(x, str):
        if len(x) <= MAX_TEXT:
            return x
        return (x[: MAX_TEXT // 2] + f"\n[... {len(x) - MAX_TEXT} characters cut by the report ...]\n"
                + x[-MAX_TEXT // 2:])
    if isinstance(x, float):
        return as_float(x)
    if isinstance(x, dict):
        return {str(k): clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [clean(v) for v in x]
    return x


def embed_json(data: Any) -> str:
    """JSON that is inert inside a ``<script>`` element: no ``<``, ``>``, ``&`` and only ASCII."""
    text = json.dumps(data, ensure_ascii=True, allow_nan=False, default=str)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def page_transcripts(run: Run) -> list[dict]:
    """Every transcript, cleaned, with ``uid`` (unique in the page: source and id)."""
    out = []
    for i, t in enumerate(run.transcripts):
        tid = t.get("id") if isinstance(t.get("id"), str) else f"#{i}"
        out.append({**clean(t), "uid": f"{t['source']}: {tid}"})
    return out


def table(head: Sequence[str] | None, rows: Sequence[Sequence[str]], cls: str = "") -> str:
    e = html.escape
    out = [f'<table class="{cls}">']
    if head:
        out.append("<tr>" + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr>")
    out += ["<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in r) + "</tr>" for r in rows]
    return "".join(out) + "</table>"


def score_block(s: dict) -> str:
    """An evaluation's score table, by difficulty and category, failure modes, side by side."""
    blocks = [f'<div><h3>score</h3>{table(None, tables.score_rows(s), "kv")}</div>']
    for axis, name in (("by_difficulty", "by difficulty"), ("by_category", "by category")):
        if tables.group_rows(s, axis):
            blocks.append(f'<div><h3>{name}</h3>'
                          f'{table(tables.GROUP_HEAD, tables.group_rows(s, axis))}</div>')
    modes = tables.failure_rows(s)
    blocks.append('<div><h3>failure modes</h3>'
                  + (table(["mode", "attempts"], modes) if modes else "<p>none</p>") + "</div>")
    return '<div class="blocks">' + "".join(blocks) + "</div>"


def sections(run: Run) -> list[Section]:
    """The page's sections in order: run, score (with held-out evaluations), warm start, charts, steps,
    transcripts (those with data)."""
    run_body = table(None, tables.header_rows(run), "kv")
    if run.notes:
        items = "".join(f"<li>{html.escape(n)}</li>" for n in run.notes)
        run_body += (f'<div class="warn" id="notes"><b>Missing from this run dir, or skipped</b> (the report shows what is there)<ul>{items}'
                     "</ul></div>")
    out = [("run", "Run", run_body)]
    if run.kind == "eval":
        out.append(("score", "Score", score_block(run.summary) if "pass@1" in run.summary
                    else "<p>No scores: no summary.json and no finished attempt.</p>"))
    else:
        body = table(None, tables.train_score_rows(run), "kv") if tables.train_score_rows(run) else \
            "<p>No training step and no held-out evaluation yet.</p>"
        if run.eval_points:
            body += '<h3 id="heldout">held-out evaluations</h3>' + table(tables.EVAL_HEAD, tables.eval_rows(run))
        if run.evals:
            body += f"<h3>latest held-out evaluation (step {max(run.evals)})</h3>" + score_block(run.headline)
        out.append(("score", "Score", body))
        if run.warm_start:
            out.append(("warm", "Warm start", table(None, tables.warm_start_rows(run), "kv")
                        + (charts.warm_start_loss(run) or "")))
    svgs = charts.all_charts(run)
    if svgs:
        out.append(("charts", "Charts", "".join(f'<div class="chart">{c}</div>' for c in svgs)))
    if run.kind == "train":
        out.append(("steps", f"Steps ({len(run.steps)})",
                    table(tables.STEP_HEAD, tables.step_rows(run)) if run.steps else "<p>none yet</p>"))
        if tables.engine_rows(run):
            out.append(("engines", "Docker engines", table(tables.ENGINE_HEAD, tables.engine_rows(run))))
    sources = "".join(f'<option value="{html.escape(s)}">{html.escape(s)}</option>'
                      for s in dict.fromkeys(t["source"] for t in run.transcripts))
    browser = ('<div class="browser"><div class="list-pane"><div class="controls">'
               '<input id="transcript-search" type="search" autocomplete="off" '
               'placeholder="search: task, instruction, commands, outputs">'
               '<select id="transcript-filter"><option value="all">pass and fail</option>'
               '<option value="pass">passed</option><option value="fail">failed</option></select>'
               f'<select id="transcript-source"><option value="">all sources</option>{sources}</select></div>'
               '<div id="transcript-count"></div><div id="transcript-list"></div></div>'
               '<div id="transcript-view" class="view-pane"><p class="hint">Click a transcript.</p></div></div>')
    out.append(("transcripts", f"Transcripts ({len(run.transcripts)})", browser))
    return out


def render_html(run: Run) -> str:
    e = html.escape
    kind = "evaluation" if run.kind == "eval" else "training"
    title = f"jaxrl_term {kind} report: {run.dir.name}"
    parts = sections(run)
    nav = " · ".join(f'<a href="#{sid}">{e(name.lower())}</a>' for sid, name, _ in parts)
    body = "".join(f'<section id="{sid}"><h2>{e(name)}</h2>{html_}</section>' for sid, name, html_ in parts)
    return ('<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{e(title)}</title><style>{CSS}</style></head><body>"
            f"<h1>{e(title)}</h1><nav>{nav}</nav>{body}"
            + f'<script type="application/json" id="transcripts-data">{embed_json(page_transcripts(run))}</script>'
            f"<script>{JS}</script></body></html>")


CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:1.2em 1.5em;color:#222;max-width:1500px}
h1{font-size:1.35em;margin:.2em 0}h2{font-size:1.15em;border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.4em}
h3{font-size:.95em;margin:.6em 0 .3em}nav{font-size:.9em;color:#666}a{color:#1a5fb4}
.warn{background:#fff3cd;border:1px solid #f0d98a;padding:.4em .8em;margin:.8em 0}.warn ul{margin:.3em 0}
table{border-collapse:collapse;margin:.3em 0}td,th{border:1px solid #ddd;padding:.15em .55em;text-align:left;
font-size:.88em;vertical-align:top}th{background:#f4f4f4}.kv td:first-child{color:#555}
.blocks{display:flex;flex-wrap:wrap;gap:1.5em;align-items:flex-start}
.chart{display:inline-block;vertical-align:top;margin:.3em}.chart svg{max-width:100%;height:auto}
.browser{display:flex;gap:1em;align-items:flex-start}.list-pane{width:38%;min-width:300px}
.controls{display:flex;gap:.3em;flex-wrap:wrap}#transcript-search{flex:1;min-width:12em;padding:.3em}
#transcript-count{color:#666;font-size:.85em;margin:.3em 0}
#transcript-list{max-height:85vh;overflow:auto;border:1px solid #ddd}
.transcript-item{padding:.3em .5em;border-bottom:1px solid #eee;cursor:pointer;font-size:.84em}
.transcript-item:hover,.transcript-item.selected{background:#eef4ff}.ok{color:#137333;font-weight:600}
.bad{color:#b3261e;font-weight:600}.view-pane{flex:1;min-width:0;position:sticky;top:0;max-height:100vh;overflow:auto}
pre{background:#f7f7f7;padding:.45em;white-space:pre-wrap;word-break:break-word;max-height:36em;overflow:auto;
font-size:.84em;margin:.25em 0}pre.cmd{background:#e8f3e8}pre.out{background:#f1f1f8}pre.reply{background:#fbf8ef}
.turn{border-left:3px solid #9ab;padding-left:.7em;margin:.8em 0}.err{color:#b3261e}.meta{color:#555;font-size:.85em}
.hint{color:#777}
"""

JS = r"""
(function () {
  const data = JSON.parse(document.getElementById('transcripts-data').textContent);
  const $ = (id) => document.getElementById(id);
  const list = $('transcript-list'), view = $('transcript-view'), search = $('transcript-search');
  const filt = $('transcript-filter'), src = $('transcript-source'), count = $('transcript-count');
  const MAX_ITEMS = 1000;
  let hay = null;  // every string inside each transcript, lower case (built on the first search)
  function strings(x, out) {
    if (x === null || x === undefined) return out;
    if (typeof x === 'object') { for (const v of Object.values(x)) strings(v, out); } else out.push(String(x));
    return out;
  }
  function el(tag, text, cls) {
    const x = document.createElement(tag);
    if (text !== undefined && text !== null)
      x.textContent = typeof text === 'object' ? JSON.stringify(text, null, 1) : String(text);
    if (cls) x.className = cls;
    return x;
  }
  function fmt(x) {
    if (typeof x === 'number') return String(Math.round(x * 1000) / 1000);
    return (x === null || x === undefined) ? '-' : String(x);
  }
  const arr = (x) => Array.isArray(x) ? x : [];
  const obj = (x) => (x && typeof x === 'object' && !Array.isArray(x)) ? x : {};
  const verdict = (t) => t.pass === true ? ['PASS', 'ok'] : t.pass === false ? ['fail', 'bad'] : ['?', ''];
  function command(args) {
    for (const k of ['command', 'cmd', 'keystrokes', 'code']) if (typeof args[k] === 'string') return [k, args[k]];
    return null;
  }
  function show(i) {
    const t = data[i];
    for (const s of list.querySelectorAll('.selected')) s.classList.remove('selected');
    const item = list.querySelector('[data-index="' + i + '"]');
    if (item) item.classList.add('selected');
    view.replaceChildren();
    const [v, cls] = verdict(t);
    const h = el('h3'); h.appendChild(el('span', v + ' ', cls));
    h.appendChild(document.createTextNode(fmt(t.task) + ' (' + t.source + ', attempt ' + fmt(t.attempt) + ')'));
    view.appendChild(h);
    const meta = [['id', t.id], ['reward', t.reward], ['end', t.end_reason], ['outcome', t.outcome],
      ['turns', arr(t.turns).length], ['tokens', t.tokens], ['seconds', t.duration_s], ['advantage', t.advantage],
      ['group', t.group], ['policy', t.policy], ['scaffold', t.scaffold], ['difficulty', t.difficulty],
      ['category', t.category]].filter(([, x]) => x !== undefined && x !== null);
    view.appendChild(el('p', meta.map(([k, x]) => k + ' ' + fmt(x)).join(' | '), 'meta'));
    if (t.error) view.appendChild(el('pre', 'error: ' + fmt(t.error), 'err'));
    view.appendChild(el('h4', 'Instruction'));
    view.appendChild(el('pre', t.instruction));
    for (const u of arr(t.turns)) {
      const d = el('div', undefined, 'turn');
      d.appendChild(el('h4', 'Turn ' + fmt(u.index) + ' (finish ' + fmt(u.finish_reason) + ', ' + fmt(u.gen_s) +
        ' s generating, ' + fmt(u.tool_s) + ' s in tools)'));
      d.appendChild(el('pre', u.reply, 'reply'));
      for (const m of arr(u.errors)) d.appendChild(el('pre', 'parse error: ' + fmt(m), 'err'));
      const actions = arr(u.actions), results = arr(u.results);
      for (let j = 0; j < Math.max(actions.length, results.length); j++) {
        const a = obj(actions[j]), r = results[j];
        if (j < actions.length) {
          const args = obj(a.args), c = command(args), rest = Object.assign({}, args);
          if (c) delete rest[c[0]];
          d.appendChild(el('div', 'action ' + (j + 1) + ': ' + fmt(a.tool) +
            (Object.keys(rest).length ? ' ' + JSON.stringify(rest) : ''), 'meta'));
          if (c) d.appendChild(el('pre', c[1], 'cmd'));
        }
        if (r && typeof r === 'object') {
          d.appendChild(el('div', 'result: exit ' + fmt(r.exit_code) + (r.ok === false ? ', not ok' : '') +
            (r.timed_out ? ', timed out' : '') + ', ' + fmt(r.duration_s) + ' s', 'meta'));
          d.appendChild(el('pre', r.text, 'out'));
        }
      }
      view.appendChild(d);
    }
    view.appendChild(el('h4', 'Verifier'));
    const tests = Object.entries(obj(t.tests));
    if (tests.length) {
      const tb = el('table');
      for (const [n, ok] of tests) {
        const tr = el('tr');
        tr.appendChild(el('td', n));
        tr.appendChild(el('td', ok ? 'pass' : 'FAIL', ok ? 'ok' : 'bad'));
        tb.appendChild(tr);
      }
      view.appendChild(tb);
    } else view.appendChild(el('p', 'no per-test results', 'meta'));
    const vr = obj(t.verifier_rewards);
    view.appendChild(el('pre', 'reward parts: ' + JSON.stringify(obj(t.reward_parts), null, 1) +
      (Object.keys(vr).length ? '\nverifier rewards: ' + JSON.stringify(vr) : '')));
    history.replaceState(null, '', '#t=' + encodeURIComponent(t.uid));
  }
  function render() {
    const q = search.value.toLowerCase().trim(), f = filt.value, s = src.value;
    if (q && hay === null) hay = data.map((t) => strings(t, []).join('\n').toLowerCase());
    list.replaceChildren();
    let n = 0;
    data.forEach((t, i) => {
      if ((q && !hay[i].includes(q)) || (f === 'pass' && t.pass !== true) || (f === 'fail' && t.pass === true) ||
          (s && t.source !== s)) return;
      if (++n > MAX_ITEMS) return;
      const item = el('div', undefined, 'transcript-item');
      item.dataset.id = t.uid; item.dataset.index = i;
      const [v, cls] = verdict(t);
      item.appendChild(el('span', v + ' ', cls));
      item.appendChild(el('span', fmt(t.task) + ' | ' + t.source + ' | attempt ' + fmt(t.attempt) + ' | reward ' +
        fmt(t.reward) + ' | ' + fmt(t.end_reason) + ' | ' + arr(t.turns).length + ' turns'));
      item.addEventListener('click', () => show(i));
      list.appendChild(item);
    });
    count.textContent = n + ' of ' + data.length + ' transcripts' + (n > MAX_ITEMS ? ' (first ' + MAX_ITEMS +
      ' listed: refine the search)' : '');
  }
  search.addEventListener('input', render); filt.addEventListener('change', render);
  src.addEventListener('change', render);
  render();
  const m = location.hash.match(/^#t=(.*)$/);
  if (m) { const i = data.findIndex((t) => t.uid === decodeURIComponent(m[1])); if (i >= 0) show(i); }
})();
"""
