"""The report (jaxrl_term.report) on synthetic run dirs written as docs/run_dir.md specifies them: numbers in
report.md against hand-computed values, a self-contained page, partial run dirs, compare, the CLI's errors,
and the page in a real headless Chromium (search, click, adversarial output shown as text)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import need

from jaxrl_term.eval.core import summarize
from jaxrl_term.report import compare, summarize_runs, write_report
from jaxrl_term.report.__main__ import main
from jaxrl_term.report.html import MAX_TEXT

EVIL = "</script><script>window.__pwned=1</script> and <b>bold</b> <!-- x"
EVIL_CMD = "cat /data/evil.txt"
# task: (difficulty, category, passes of 2 attempts)
TASKS = {"count-lines-easy-0": ("easy", "text", 2), "sort-words-medium-0": ("medium", "text", 1),
         "fix-perms-hard-0": ("hard", "files", 0), "plain-task-0": (None, None, 2)}
PASS1, PASS2 = 5 / 8, 3 / 4  # (2 + 1 + 0 + 2) / 8; mean over tasks of pass@2 = (1 + 1 + 0 + 1) / 4


def jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def transcript(task: str, attempt: int, ok: bool, *, command: str = "wc -l /data/in.txt", output: str = "3 x\n",
               errors: tuple[str, ...] = (), **extra) -> dict:
    difficulty, category, _ = TASKS[task]
    end = "parse_errors" if errors else "finished"
    return {"id": f"{task}/attempt-{attempt}", "task": task, "attempt": attempt, "policy": "checkpoint",
            "scaffold": "bash", "instruction": f"Solve {task}: count the lines of /data/in.txt",
            "difficulty": difficulty, "category": category, "end_reason": end, "error": None,
            "reward": 1.0 if ok else 0.0, "reward_parts": {"tests": 1.0 if ok else 0.0, "outcome": "scored"},
            "tests": {"test_count": ok, "test_format": True}, "outcome": "scored", "pass": ok, "tokens": 100 + attempt,
            "policy_tokens": 40, "duration_s": 1.5,
            "turns": [{"index": 0, "reply": f"I will run it.\n```bash\n{command}\n```",
                       "actions": [{"tool": "bash", "args": {"command": command}}], "errors": list(errors),
                       "results": [{"tool": "bash", "ok": True, "text": output, "exit_code": 0, "timed_out": False,
                                    "duration_s": 0.01}],
                       "finish_reason": "stop", "gen_s": 0.4, "tool_s": 0.01, "weight_version": 3}], **extra}


def attempt_record(t: dict) -> dict:
    failure = None if t["pass"] else ("parse_errors" if t["end_reason"] == "parse_errors" else "tests_failed")
    return {"task": t["task"], "attempt": t["attempt"], "pass": t["pass"], "reward": t["reward"],
            "reward_parts": t["reward_parts"], "score": t["reward"], "outcome": "scored", "end_reason": t["end_reason"],
            "failure": failure, "turns": len(t["turns"]), "tokens": t["tokens"], "policy_tokens": 40,
            "parse_errors": sum(len(u["errors"]) for u in t["turns"]), "wall_s": 2.0,
            "difficulty": t["difficulty"], "category": t["category"], "error": None,
            "unknown_future_key": {"x": 1}}


def make_eval_dir(d: Path, passes: dict[str, int] | None = None, step: int | None = None) -> list[dict]:
    """An evaluation run dir: 4 tasks x 2 attempts; the failed attempt of sort-words has a parse error and the
    adversarial output. Returns the transcripts."""
    trs = []
    for task, (_, _, c) in TASKS.items():
        c = (passes or {}).get(task, c)
        for j in range(2):
            extra = {"step": step} if step is not None else {}
            if task == "sort-words-medium-0" and j == 1:
                trs.append(transcript(task, j, False, command=EVIL_CMD, output=EVIL,
                                      errors=("no ```bash block in the reply",), **extra))
            else:
                trs.append(transcript(task, j, j < c, **extra))
    records = [attempt_record(t) for t in trs]
    jsonl(d / "attempts.jsonl", records)
    jsonl(d / "transcripts.jsonl", trs)
    summary = {**summarize(records, 2), "policy": "checkpoint", "source": "builtin", "scaffold": "bash",
               "wall_s": 42.0, **({"step": step} if step is not None else {})}
    (d / "summary.json").write_text(json.dumps(summary))
    (d / "fingerprint.json").write_text(json.dumps({"policy": "checkpoint", "source": "builtin"}))
    return trs


@pytest.fixture
def eval_dir(tmp_path: Path) -> Path:
    d = tmp_path / "eval_run"
    make_eval_dir(d)
    (d / "eval_config.yaml").write_text("policy:\n  kind: checkpoint\nmodel:\n  name: tiny\ndata:\n  source: builtin\n"
                                        "agent:\n  scaffold: bash\neval:\n  attempts: 2\n")
    return d


def step_line(step: int, reward: float) -> dict:
    return {"step": step, "reward/mean": reward, "reward/pass_rate": reward / 2, "train/loss": 0.5 - 0.1 * step,
            "episode/turns_mean": 2.0, "episode/tokens_mean": 300.0, "time/rollout_wait_s": 3.0,
            "time/update_s": 2.0, "time/weight_sync_s": 0.5, "time/eval_s": 0.0, "time/checkpoint_s": 0.25,
            "time/step_s": 6.0, "task_ids": ["count-lines-easy-0"], "some/new_metric": None}


@pytest.fixture
def train_dir(tmp_path: Path) -> Path:
    """A training run: warm start, held-out evaluations at steps 0 and 3, steps 0-2 with trajectories."""
    d = tmp_path / "train_run"
    make_eval_dir(d / "eval" / "step_000000", passes={"count-lines-easy-0": 0, "plain-task-0": 1}, step=0)
    make_eval_dir(d / "eval" / "step_000003", step=3)
    e0 = json.loads((d / "eval" / "step_000000" / "summary.json").read_text())
    lines = [{"step": -1, "warm_start/cached": False, "warm_start/demonstrations": 12, "warm_start/steps": 4,
              "warm_start/loss_first": 2.0, "warm_start/loss_last": 0.7, "warm_start/losses": [2.0, 1.5, 1.0, 0.7],
              "warm_start/seconds": 9.5},
             {"step": 0, "eval/pass@1": e0["pass@1"], "eval/pass@k": e0["pass@k"], "eval/k": 2, "eval/tasks": 4}]
    lines += [step_line(s, r) for s, r in ((0, 0.25), (1, 0.5), (2, 0.75))]
    lines += [{"step": 3, "eval/pass@1": PASS1, "eval/pass@k": PASS2, "eval/k": 2, "eval/tasks": 4}]
    jsonl(d / "metrics.jsonl", lines)
    for s in range(3):
        trs = [transcript("count-lines-easy-0", i, i == 0, command=f"echo train-step-{s}-episode-{i}", step=s,
                          group=s, advantage=0.5 if i == 0 else -0.5, id=f"step-{s}/group-{s}/{i}") for i in range(2)]
        jsonl(d / "trajectories" / f"step_{s:06d}.jsonl", trs)
        jsonl(d / "trajectories" / f"step_{s:06d}.tokens.jsonl",
              [{"id": t["id"], "token_ids": [7, 8, 9], "loss_mask": [0, 1, 1], "logprobs": [0.0, -1.0, -2.0]}
               for t in trs])
    (d / "config.yaml").write_text("model:\n  name: tiny\nalgo:\n  name: grpo\ndata:\n  source: builtin\n"
                                   "agent:\n  scaffold: bash\ntrainer:\n  steps: 3\n")
    return d


def embedded(html: str) -> list[dict]:
    m = re.search(r'<script type="application/json" id="transcripts-data">(.*?)</script>', html, re.DOTALL)
    assert m is not None
    return json.loads(m.group(1))


def assert_self_contained(html: str) -> None:
    """No resource outside the page: every src/href is an anchor, no http(s) URL but SVG namespace names."""
    markup = re.sub(r"<script\b[^>]*>.*?</script>", "", html, flags=re.DOTALL)
    refs = re.findall(r"""\b(?:src|href|xlink:href|action|srcset|data)\s*=\s*["']?([^"'\s>]*)""", markup)
    assert all(r.startswith("#") for r in refs), [r for r in refs if not r.startswith("#")]
    assert all(f'id="{r[1:]}"' in html for r in refs)  # nav links and SVG references land in the page
    assert not re.search(r"url\((?!#)", markup) and "@import" not in markup and "<link" not in markup
    assert not re.search(r"<script[^>]*\bsrc=", html) and "<iframe" not in html
    assert not re.search(r"https?://", re.sub(r'\bxmlns(:\w+)?="[^"]*"', "", html))
    assert not re.search(r"\bfetch\(|XMLHttpRequest|\bimport\(", html)


def test_eval_report_has_scores_charts_and_every_transcript_inert(eval_dir: Path):
    out = write_report(eval_dir)
    assert out == eval_dir / "report.html"
    html, md = out.read_text(), (eval_dir / "report.md").read_text()
    assert_self_contained(html)
    assert html.count("<svg") >= 4  # pass rate by category and by difficulty, turns and tokens histograms
    # the adversarial output never appears as markup: only the two script elements of the page close
    assert html.count("</script>") == 2 and "window.__pwned" not in html.split("<script>")[-1]
    assert "<b>bold</b>" not in html and "<!-- x" not in html
    trs = embedded(html)
    assert len(trs) == 8 and {t["id"] for t in trs} == {f"{k}/attempt-{j}" for k in TASKS for j in range(2)}
    evil = next(t for t in trs if t["turns"][0]["actions"][0]["args"]["command"] == EVIL_CMD)
    assert evil["turns"][0]["results"][0]["text"] == EVIL and evil["turns"][0]["errors"]
    assert f"{PASS1:.1%} ±" in md and f"| pass@2 | {PASS2:.1%} |" in md
    assert "| easy | 1 | 2 | 100.0% | 100.0% |" in md and "| hard | 1 | 2 | 0.0% | 0.0% |" in md
    assert "| text | 2 | 4 | 75.0% | 100.0% |" in md and "| parse_errors | 1 |" in md
    assert "| tests_failed | 2 |" in md and "| model.name | tiny |" in md and "42.0 s" in md
    assert "window.__pwned" not in md and "Turn 0" not in md  # no transcripts in the markdown


def test_training_report_has_warm_start_steps_heldout_and_all_transcripts(train_dir: Path):
    html = write_report(train_dir).read_text()
    md = (train_dir / "report.md").read_text()
    assert_self_contained(html)
    assert 'id="warm"' in html and "Warm start loss" in html and "loss_last" in md
    assert 'id="notes"' not in html  # complete: summary.json comes after the report, all trainer.steps logged
    # charts: warm start loss, reward curves, step times, by category, by difficulty, turns, tokens
    assert html.count("<svg") >= 7 and "Step time breakdown" in html and "held-out pass@1" in html
    for s, r in ((0, 0.25), (1, 0.5), (2, 0.75)):
        assert f"| {s} | {r:.3f} | {r / 2:.1%} |" in md
    assert f"| 3 | {PASS1:.1%} |" in md and "| 0 | 25.0% |" in md  # held-out at step 0: (0 + 1 + 0 + 1) / 8
    assert "Latest held-out evaluation (step 3)" in md
    trs = embedded(html)
    sources = [t["source"] for t in trs]
    assert sources.count("train step 1") == 2 and sources.count("eval step 0") == 8
    assert sources.count("eval step 3") == 8 and len(trs) == 22  # 3 steps x 2 episodes + 2 evaluations x 8
    assert len({t["uid"] for t in trs}) == 22 and "token_ids" not in html
    assert any(t["turns"][0]["actions"][0]["args"]["command"] == "echo train-step-2-episode-1" for t in trs)


def test_long_outputs_are_cut_with_a_marker(eval_dir: Path):
    trs = [json.loads(line) for line in (eval_dir / "transcripts.jsonl").read_text().splitlines()]
    trs[0]["turns"][0]["results"][0]["text"] = "head" + "x" * 100_000 + "tail"
    jsonl(eval_dir / "transcripts.jsonl", trs)
    text = next(t for t in embedded(write_report(eval_dir).read_text()) if t["id"] == trs[0]["id"])
    out = text["turns"][0]["results"][0]["text"]
    assert len(out) < MAX_TEXT + 100 and out.startswith("head") and out.endswith("tail") and "characters cut" in out


def test_partial_and_corrupt_run_dirs_still_render(tmp_path: Path, train_dir: Path, eval_dir: Path):
    # an evaluation killed mid-way: no summary.json, a cut last line, an empty transcripts file
    (eval_dir / "summary.json").unlink()
    with open(eval_dir / "attempts.jsonl", "a") as f:
        f.write('{"task": "plain-task-0", "attempt": 1, "pa')
    (eval_dir / "transcripts.jsonl").write_text("")
    (eval_dir / "eval_config.yaml").write_text("model: [unclosed")
    md = (write_report(eval_dir).with_suffix(".md")).read_text()
    assert f"{PASS1:.1%} ±" in md  # computed from attempts.jsonl by the evaluator's formula
    assert "computed from the 8 attempt(s)" in md and "attempts.jsonl: 1 line(s) skipped" in md
    assert "eval_config.yaml: not valid YAML" in md
    # a training run killed mid-way: cut metrics line, a step line with odd values, an eval dir without summary
    with open(train_dir / "metrics.jsonl", "a") as f:
        f.write('[1, 2]\n{"step": 3, "reward/mean": "n/a", "time/step_s": null, "new": {"a": 1}}\n{"step": 4, "rew')
    (train_dir / "eval" / "step_000003" / "summary.json").write_text('{"pass@1": ')
    (train_dir / "trajectories" / "step_000002.jsonl").write_text("")
    (train_dir / "config.yaml").write_text("trainer:\n  steps: 10\n")
    html = write_report(train_dir).read_text()
    assert "summary.json missing: 4 of 10 steps logged" in html and "metrics.jsonl: 2 line(s) skipped" in html and "step_000003: summary.json: not valid JSON" in html
    assert len(embedded(html)) == 20
    # the bare minimum: only a metrics file with nothing in it; only an empty attempts file
    for name in ("metrics.jsonl", "attempts.jsonl"):
        d = tmp_path / f"bare_{name}"
        d.mkdir()
        (d / name).write_text("")
        html = write_report(d).read_text()
        assert 'id="transcript-search"' in html and "Transcripts (0)" in html


def test_compare_gives_per_task_deltas_sorted(tmp_path: Path, train_dir: Path):
    a, b = tmp_path / "a", tmp_path / "b"
    make_eval_dir(a)
    make_eval_dir(b, passes={"count-lines-easy-0": 0, "fix-perms-hard-0": 2, "sort-words-medium-0": 1})
    out = compare(a, b)
    assert [(r["task"], r["delta"]) for r in out["tasks"]] == [
        ("fix-perms-hard-0", 1.0), ("plain-task-0", 0.0), ("sort-words-medium-0", 0.0), ("count-lines-easy-0", -1.0)]
    assert out["a"]["pass@1"] == pytest.approx(PASS1) and out["b"]["pass@1"] == pytest.approx(PASS1)
    assert out["better"] == 1 and out["worse"] == 1
    # a training run: its latest held-out evaluation (step 3, the same passes as the default)
    out = compare(train_dir, b)
    assert out["a"]["step"] == 3 and out["a"]["pass_at"]["2"] == pytest.approx(PASS2)


def test_cli_compare_prints_json_and_a_table(tmp_path: Path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    make_eval_dir(a)
    make_eval_dir(b, passes={"fix-perms-hard-0": 1})
    assert main(["compare", str(a), str(b), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tasks"][0] == {"task": "fix-perms-hard-0", "a": 0.0, "b": 0.5, "delta": 0.5}
    assert main(["compare", str(a), str(b)]) == 0
    text = capsys.readouterr().out
    assert "fix-perms-hard-0" in text and "+50.0%" in text and "pass@2" in text


def test_cli_writes_report_to_out(eval_dir: Path, tmp_path: Path, capsys):
    out = tmp_path / "site" / "r.html"
    assert main([str(eval_dir), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out) and out.is_file() and out.with_suffix(".md").is_file()


@pytest.mark.parametrize("kind", ["missing", "empty", "file"])
def test_cli_exits_2_with_one_line_when_the_dir_is_not_a_run(tmp_path: Path, kind: str):
    path = tmp_path / kind
    if kind == "empty":
        path.mkdir()
    elif kind == "file":
        path.write_text("x")
    r = subprocess.run([sys.executable, "-m", "jaxrl_term.report", str(path)], capture_output=True, text=True,
                       timeout=60, check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and str(path) in r.stderr and "run dir" in r.stderr
    r = subprocess.run([sys.executable, "-m", "jaxrl_term.report", "compare", str(path), str(path)],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr and str(path) in r.stderr


def test_report_in_headless_chromium_searches_opens_and_shows_output_as_text(train_dir: Path, tmp_path: Path):
    from jaxrl_term.report.browser import SETUP_HINT, chromium_path

    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        need(False, f"Playwright (the report's browser test): {SETUP_HINT}")
    need(chromium_path() is not None, f"Chromium (the report's browser test): {SETUP_HINT}")
    from jaxrl_term.report.browser import open_page, open_transcript, screenshot

    html = write_report(train_dir)
    with open_page(html) as (page, errors):
        assert page.locator(".transcript-item").count() == 22
        text = open_transcript(page, EVIL_CMD)  # the command: in two evaluations
        assert page.locator(".transcript-item").count() == 2
        assert EVIL_CMD in text and EVIL in text and "parse error: no ```bash block" in text
        assert "test_count" in text and "FAIL" in text
        assert page.evaluate("typeof window.__pwned") == "undefined"
        assert page.locator("#transcript-view b").count() == 0  # <b>bold</b> stayed text
        item = page.locator(".transcript-item").first
        assert item.get_attribute("data-id").startswith("eval step 0: sort-words-medium-0/attempt-1")
        page.fill("#transcript-search", "train-step-2-episode-1")
        assert page.locator(".transcript-item").count() == 1
        page.select_option("#transcript-filter", "pass")
        assert page.locator(".transcript-item").count() == 0  # that episode failed
        page.fill("#transcript-search", "")
        page.select_option("#transcript-source", "eval step 3")
        assert page.locator(".transcript-item").count() == 5  # 5 of its 8 attempts passed
        assert errors == []
    png = screenshot(html, tmp_path / "shot.png", EVIL_CMD)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_summary_of_a_sweep_has_one_row_per_job_with_its_overrides(tmp_path: Path, train_dir: Path, capsys):
    import shutil

    sweep = tmp_path / "multirun"
    for n, ov in enumerate((["algo=grpo", "algo.group_size=4"], ["algo=dppo", "algo.group_size=8"])):
        job = sweep / str(n)
        shutil.copytree(train_dir, job)
        (job / ".hydra").mkdir()
        (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in [*ov, "trainer.steps=3",
                                                                                       f"run_dir={job}"]))
    lines = (sweep / "1" / "metrics.jsonl").read_text().replace(f'"eval/pass@1": {PASS1}', '"eval/pass@1": 0.9')
    (sweep / "1" / "metrics.jsonl").write_text(lines)
    rows = summarize_runs([sweep])
    assert [r["overrides"] for r in rows] == [["algo=grpo", "algo.group_size=4", "trainer.steps=3"],
                                              ["algo=dppo", "algo.group_size=8", "trainer.steps=3"]]
    assert [r["steps"] for r in rows] == [3, 3] and [r["eval_last_step"] for r in rows] == [3, 3]
    assert rows[0]["eval_last"] == pytest.approx(PASS1) and rows[1]["eval_last"] == pytest.approx(0.9)
    assert rows[0]["reward_last"] == pytest.approx(0.75)
    out = tmp_path / "table.md"
    assert main(["summary", str(sweep), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert text == out.read_text() and "→ 90.0%" in text
    # the sweep's axes are columns; what every run shares is said once
    assert "| run | algo | algo.group_size | steps |" in text and "| 1 | dppo | 8 | 3 |" in text
    assert "shared by every run: `trainer.steps=3`" in text and text.count("trainer.steps=3") == 1
    assert main(["summary", str(tmp_path / "nothing")]) == 2
