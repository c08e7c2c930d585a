"""The run report: a self-contained page (no network), the numbers in markdown, per-task comparison, partial
run dirs, adversarial transcript text, and the page in a real headless browser (Chromium via Playwright)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, need
from jaxrl_term.agent.transcript import append_jsonl
from jaxrl_term.report import compare, write_report

EVIL = "</script><script>window.__pwned=1</script><b>bold</b><!--"


def _transcript(tid, task, attempt, ok, cmd, out, source_step=None, **kw):
    return {"id": tid, "task": task, "attempt": attempt, "instruction": f"Do the thing for {task}.",
            "scaffold": "bash", "difficulty": kw.get("difficulty", "easy"), "category": kw.get("category", "text"),
            "end_reason": "finished" if ok else "parse_errors", "error": None, "reward": float(ok),
            "reward_parts": {"tests": float(ok), "outcome": "scored"}, "tests": {"test_a": ok}, "outcome": "scored",
            "pass": ok, "tokens": 300 + attempt, "policy_tokens": 40, "duration_s": 1.5,
            "turns": [{"index": 0, "reply": f"```bash\n{cmd}\n```", "actions": [{"tool": "bash", "args": {"cmd": cmd}}],
                       "errors": [] if ok else ["no command found"], "finish_reason": "stop", "gen_s": 0.1,
                       "tool_s": 0.01, "weight_version": source_step,
                       "results": [{"tool": "bash", "ok": True, "text": out, "exit_code": 0, "timed_out": False,
                                    "duration_s": 0.01}]}], **({"step": source_step} if source_step is not None else {})}


def make_eval_dir(d: Path, passes: dict[str, list[bool]]) -> Path:
    """An evaluation run dir as jaxrl_term.eval writes it (docs/run_dir.md), summary from the real summarizer."""
    from jaxrl_term.eval.core import summarize

    d.mkdir(parents=True)
    records, trs = [], []
    for i, (task, oks) in enumerate(passes.items()):
        diff = "easy" if i % 2 == 0 else "hard"
        for j, ok in enumerate(oks):
            out = EVIL if (i, j) == (0, 0) else f"output of {task} #{j}"
            trs.append(_transcript(f"{task}/attempt-{j}", task, j, ok, f"wc -l /data/{task}.txt", out,
                                   difficulty=diff))
            records.append({"id": f"{task}/attempt-{j}", "task": task, "attempt": j, "pass": ok, "reward": float(ok),
                            "failure": None if ok else "parse_errors", "turns": 1, "tokens": 300 + j,
                            "difficulty": diff, "category": "text"})
    append_jsonl(d / "attempts.jsonl", records)
    append_jsonl(d / "transcripts.jsonl", trs)
    s = summarize(records, max(len(v) for v in passes.values()))
    s.update(policy="checkpoint", source="builtin")
    (d / "summary.json").write_text(json.dumps(s))
    (d / "eval_config.yaml").write_text("policy:\n  kind: checkpoint\ndata:\n  source: builtin\n")
    return d


def make_train_dir(d: Path) -> Path:
    d.mkdir(parents=True)
    lines = [{"step": -1, "warm_start/cached": False, "warm_start/losses": [3.0, 1.0, 0.5], "warm_start/seconds": 9.0}]
    for s in range(3):
        lines.append({"step": s, "reward/mean": 0.2 * s, "reward/pass_rate": 0.1 * s, "train/loss": 0.5 - 0.1 * s,
                      "time/rollout_wait_s": 3.0, "time/update_s": 1.0, "time/weight_sync_s": 0.1,
                      "time/checkpoint_s": 0.2, "time/step_s": 4.3, "episode/turns_mean": 2.0})
        append_jsonl(d / "trajectories" / f"step_{s:06d}.jsonl",
                     [_transcript(f"step-{s}/group-0/0", "train-task", 0, s == 2, f"echo step{s}", f"hello {s}", s)])
        append_jsonl(d / "trajectories" / f"step_{s:06d}.tokens.jsonl", [{"id": f"step-{s}/group-0/0",
                                                                         "token_ids": [1, 2, 3]}])
    for step, oks in ((0, [False, False]), (3, [True, False])):
        make_eval_dir(d / "eval" / f"step_{step:06d}", {"held-a": oks[:1], "held-b": oks[1:]})
        s = json.loads((d / "eval" / f"step_{step:06d}" / "summary.json").read_text())
        lines.append({"step": step, "eval/pass@1": s["pass@1"], "eval/pass@k": s["pass@k"], "eval/k": 1,
                      "eval/tasks": 2})
    append_jsonl(d / "metrics.jsonl", lines)
    (d / "config.yaml").write_text("model:\n  name: tiny\nalgo:\n  name: grpo\n")
    (d / "summary.json").write_text(json.dumps({"steps": 3}))
    return d


def test_eval_report_is_self_contained_with_scores_charts_and_escaped_transcripts(tmp_path):
    d = make_eval_dir(tmp_path / "ev", {"t1": [True, False, True], "t2": [False, False, False], "t3": [True] * 3})
    page = write_report(d).read_text()
    assert page.count("<svg") >= 3  # by category, by difficulty, histograms
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page), "the page loads something from outside"
    assert "@import" not in page and "<link" not in page
    assert "window.__pwned=1</script>" not in page  # the adversarial output cannot close the data script
    md = (d / "report.md").read_text()
    s = json.loads((d / "summary.json").read_text())
    assert f"{s['pass@1']:.1%}" in md and "pass@3" in md and "parse_errors" in md


def test_training_report_shows_warm_start_steps_and_heldout_evaluations(tmp_path):
    d = make_train_dir(tmp_path / "tr")
    page = write_report(d).read_text()
    for section in ('id="warm"', 'id="steps"', 'id="heldout"', 'id="charts"', 'id="transcripts"'):
        assert section in page
    assert page.count("<svg") >= 4  # curves, warm-start loss, step times, histograms
    md = (d / "report.md").read_text()
    assert "## Warm start" in md and "## Held-out evaluation" in md and "## Steps" in md
    assert "| 3 | 50.0% |" in md  # held-out pass@1 at step 3


def test_partial_and_corrupt_run_dirs_render_and_a_non_run_dir_exits_2(tmp_path):
    d = make_train_dir(tmp_path / "tr")
    (d / "summary.json").unlink()
    with open(d / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "reward/mea')  # a line cut by a kill
    (d / "trajectories" / "step_000001.jsonl").write_text("not json\n")
    page = write_report(d).read_text()
    assert "Missing from this run dir" in page and "summary.json" in page
    empty = tmp_path / "empty"
    empty.mkdir()
    for path in (empty, tmp_path / "nowhere"):
        r = subprocess.run([sys.executable, "-m", "jaxrl_term.report", str(path)], capture_output=True, text=True,
                           cwd=REPO)
        assert r.returncode == 2 and str(path) in r.stderr and "Traceback" not in r.stderr


def test_compare_gives_per_task_differences(tmp_path):
    a = make_eval_dir(tmp_path / "a", {"t1": [True, False], "t2": [False, False], "t3": [True, True]})
    b = make_eval_dir(tmp_path / "b", {"t1": [True, True], "t2": [False, False], "t4": [True, False]})
    out = compare(a, b)
    rows = {r["task"]: r for r in out["tasks"]}
    assert rows["t1"]["delta"] == pytest.approx(0.5) and rows["t2"]["delta"] == 0.0
    assert rows["t3"]["b"] is None and rows["t4"]["a"] is None
    assert out["only_a"] == ["t3"] and out["only_b"] == ["t4"] and out["better"] == 1 and out["worse"] == 0
    r = subprocess.run([sys.executable, "-m", "jaxrl_term.report", "compare", str(a), str(b), "--json"],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0 and json.loads(r.stdout)["tasks"][0]["task"] == "t1"


def test_report_in_a_headless_browser_search_click_and_read_a_transcript(tmp_path):
    try:
        import playwright  # noqa: F401

        from jaxrl_term.report.browser import chromium_path, open_page, open_transcript
    except ImportError:
        chromium_path = None
    ok = chromium_path is not None and chromium_path() is not None
    if os.environ.get("CI") == "true":
        assert ok, "Chromium or Playwright is missing: run `make browser` (make test does)"
    need(ok, "Chromium or Playwright is missing (make browser)")
    d = make_train_dir(tmp_path / "tr")
    make_eval_dir(tmp_path / "ev", {"t1": [True, False], "t2": [False, True]})
    for html_path, search, want in ((write_report(d), "echo step2", "hello 2"),
                                    (write_report(tmp_path / "ev"), "wc -l /data/t1.txt", EVIL)):
        with open_page(html_path) as (page, errors):
            text = open_transcript(page, search)
            assert search in text and want in text  # the command and its output, the latter as plain text
            assert page.evaluate("typeof window.__pwned") == "undefined"
            assert page.locator(".transcript-item").count() >= 1
            page.fill("#transcript-search", "")
            page.select_option("#transcript-filter", "pass")
            passed = page.locator(".transcript-item").count()
            page.select_option("#transcript-filter", "fail")
            assert passed >= 1 and page.locator(".transcript-item").count() >= 1
        assert errors == [], errors
