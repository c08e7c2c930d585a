"""A run directory read back (``docs/run_dir.md``): a training run or an evaluation, whatever of it exists.

Nothing here raises on a partial run: a missing file, an empty one, a line cut by a kill or a value of an
unexpected type is skipped and named in ``Run.notes``, which the report shows. Only a path that holds no run
at all raises :class:`NotARunDir`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

EVAL_FILES = ("attempts.jsonl", "transcripts.jsonl", "fingerprint.json", "eval_config.yaml")
TRAIN_FILES = ("metrics.jsonl", "trajectories/step_*.jsonl", "eval/step_*")


class NotARunDir(ValueError):
    """The path holds no run: the message names it and what was expected."""


@dataclasses.dataclass
class Run:
    dir: Path
    kind: str  # "train" | "eval"
    config: dict[str, Any]  # config.yaml (training) or eval_config.yaml
    summary: dict[str, Any]  # an evaluation's summary; a training run's summary.json
    metrics: list[dict]  # training: metrics.jsonl lines
    evals: dict[int, dict]  # training: held-out evaluation summaries by step (updates applied)
    attempts: list[dict]  # evaluation: attempts.jsonl records
    transcripts: list[dict]  # every transcript, each with "source" ("eval", "train step 3", "eval step 2")
    notes: list[str]  # what is missing or was skipped

    @property
    def steps(self) -> list[dict]:
        """Training steps' metric lines, in order (held-out and warm-start lines excluded)."""
        return sorted((m for m in self.metrics if as_int(m.get("step")) is not None and m["step"] >= 0
                       and "reward/mean" in m), key=lambda m: m["step"])

    @property
    def warm_start(self) -> dict[str, Any]:
        """The ``warm_start/*`` values of the ``step: -1`` line, prefix removed ({} without a warm start)."""
        for m in self.metrics:
            if m.get("step") == -1 and any(k.startswith("warm_start/") for k in m):
                return {k.removeprefix("warm_start/"): v for k, v in m.items() if k.startswith("warm_start/")}
        return {}

    @property
    def eval_points(self) -> list[dict]:
        """Held-out evaluations by step as ``eval/*`` metric dicts: the eval dirs' summaries and the metric lines."""
        pts: dict[int, dict] = {}
        for step, s in self.evals.items():
            pts[step] = {f"eval/{k}": s.get(k) for k in ("pass@1", "pass@1_std", "pass@k", "k", "tasks", "attempts")}
        for m in self.metrics:
            if "eval/pass@1" in m and as_int(m.get("step")) is not None:
                pts.setdefault(m["step"], {}).update({k: v for k, v in m.items() if v is not None})
        return [{**pts[step], "step": step} for step in sorted(pts)]

    @property
    def headline(self) -> dict[str, Any]:
        """The evaluation the report leads with: the run's own, or a training run's latest held-out one."""
        if self.kind == "eval":
            return self.summary
        return self.evals[max(self.evals)] if self.evals else {}


def as_float(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    return float(x) if math.isfinite(x) else None


def as_int(x: Any) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def as_dict(x: Any) -> dict:
    return x if isinstance(x, dict) else {}


def read_records(path: Path, notes: list[str]) -> list[dict]:
    """The JSON objects of a JSONL file ([] when it is missing); lines that do not parse are counted in notes."""
    out, bad = [], 0
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    bad += 1
                    continue
                if isinstance(rec, dict):
                    out.append(rec)
                else:
                    bad += 1
    except (FileNotFoundError, IsADirectoryError):
        return []
    if bad:
        notes.append(f"{path.name}: {bad} line(s) skipped that were not JSON objects (a write cut by a kill?)")
    return out


def read_json(path: Path, notes: list[str]) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except FileNotFoundError:
        return {}
    except (json.JSONDecodeError, IsADirectoryError):
        notes.append(f"{path.name}: not valid JSON; skipped")
        return {}
    if not isinstance(data, dict):
        notes.append(f"{path.name}: not a JSON object; skipped")
        return {}
    return data


def read_yaml(path: Path, notes: list[str]) -> dict:
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8", errors="replace"))
    except FileNotFoundError:
        return {}
    except (yaml.YAMLError, IsADirectoryError):
        notes.append(f"{path.name}: not valid YAML; skipped")
        return {}
    return data if isinstance(data, dict) else {}


def step_of(name: str) -> int | None:
    """``step_000012.jsonl`` / ``step_000012`` -> 12."""
    digits = name.removeprefix("step_").split(".")[0]
    return int(digits) if name.startswith("step_") and digits.isdigit() else None


def scored(attempts: list[dict]) -> list[dict]:
    """The attempt records the evaluator's ``summarize`` can score (task, attempt index, pass)."""
    return [r for r in attempts if isinstance(r.get("task"), str) and as_int(r.get("attempt")) is not None
            and isinstance(r.get("pass"), bool)]


def load_eval_dir(d: Path, source: str, notes: list[str]) -> tuple[dict, list[dict], list[dict]]:
    """(summary, attempts, transcripts) of an evaluation run dir. Without a readable summary.json (an
    evaluation killed mid-way) the summary is computed from attempts.jsonl by the evaluator's own formula."""
    from jaxrl_term.eval.core import summarize

    where = f"{d.parent.name}/{d.name}: " if source != "eval" else ""
    sub: list[str] = []
    summary = read_json(d / "summary.json", sub)
    attempts = read_records(d / "attempts.jsonl", sub)
    transcripts = [{**t, "source": source} for t in read_records(d / "transcripts.jsonl", sub)]
    if "pass@1" not in summary:
        rs = scored(attempts)
        if rs:
            k = max(r["attempt"] for r in rs) + 1
            summary = {**summary, **summarize(rs, k)}
            sub.append(f"summary.json missing or incomplete: the scores are computed from the {len(rs)} attempt(s) "
                       "in attempts.jsonl (the evaluation did not finish?)")
        else:
            sub.append("no summary.json and no scored attempt: no scores")
    for name in ("attempts.jsonl", "transcripts.jsonl"):
        if not (d / name).is_file():
            sub.append(f"{name} missing")
    notes += [where + n for n in sub]
    return summary, attempts, transcripts


def load_run(run_dir: str | os.PathLike) -> Run:
    """Read a run dir; raises :class:`NotARunDir` when it is not one."""
    d = Path(run_dir)
    if not d.is_dir():
        what = "not a directory" if d.exists() else "no such directory"
        raise NotARunDir(f"{d}: {what} (expected a run dir of jaxrl_term.train or jaxrl_term.eval)")
    notes: list[str] = []
    summary = read_json(d / "summary.json", [])
    if "pass@1" in summary or any((d / f).exists() for f in EVAL_FILES):
        summary, attempts, transcripts = load_eval_dir(d, "eval", notes)
        return Run(d, "eval", read_yaml(d / "eval_config.yaml", notes), summary, [], {}, attempts, transcripts,
                   notes)
    if not any(next(d.glob(pattern), None) for pattern in TRAIN_FILES):
        raise NotARunDir(f"{d}: not a run dir: expected metrics.jsonl (a training run) or summary.json / "
                         "attempts.jsonl (an evaluation)")
    metrics = read_records(d / "metrics.jsonl", notes)
    if not (d / "metrics.jsonl").is_file():
        notes.append("metrics.jsonl missing: no steps")
    evals: dict[int, dict] = {}
    transcripts: list[dict] = []
    for f in sorted((d / "trajectories").glob("step_*.jsonl")):
        step = step_of(f.name)
        if step is not None and not f.name.endswith(".tokens.jsonl"):
            sub: list[str] = []
            transcripts += [{**t, "source": f"train step {step}"} for t in read_records(f, sub)]
            notes += [f"trajectories/{n}" for n in sub]
    for ed in sorted((d / "eval").glob("step_*")):
        step = step_of(ed.name)
        if step is not None and ed.is_dir():
            s, _, trs = load_eval_dir(ed, f"eval step {step}", notes)
            transcripts += trs
            if "pass@1" in s:
                evals[step] = s
    run = Run(d, "train", read_yaml(d / "config.yaml", notes), summary, metrics, evals, [], transcripts, notes)
    # summary.json is written after the last step (and after the trainer's own report): missing means
    # unfinished only when the steps say so
    total = as_int(as_dict(run.config.get("trainer")).get("steps"))
    done = max((m["step"] + 1 for m in run.steps), default=0)
    if not (d / "summary.json").is_file() and (total is None or done < total):
        notes.append("summary.json missing" + (f": {done} of {total} steps logged" if total is not None else "")
                     + " (the run did not finish?)")
    return run
