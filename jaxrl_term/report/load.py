"""A run directory read back (``docs/run_dir.md``): training or evaluation, whatever of it exists."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from jaxrl_term.agent.transcript import read_jsonl


class NotARunDir(ValueError):
    """The path holds no run: the message names it and what was expected."""


@dataclasses.dataclass
class Run:
    dir: Path
    kind: str  # train | eval
    config: dict[str, Any]
    summary: dict[str, Any]  # summary.json (a training run's, or an evaluation's)
    metrics: list[dict]  # training: metrics.jsonl lines
    evals: dict[int, dict]  # training: step -> held-out evaluation summary
    attempts: list[dict]  # evaluation: attempts.jsonl
    transcripts: list[dict]  # every transcript, each with "source"
    missing: list[str]  # files a complete run would have

    @property
    def steps(self) -> list[dict]:
        return [m for m in self.metrics if m.get("step", -1) >= 0 and "reward/mean" in m]

    @property
    def warm_start(self) -> dict:
        for m in self.metrics:
            if m.get("step") == -1 and any(k.startswith("warm_start/") for k in m):
                return {k.removeprefix("warm_start/"): v for k, v in m.items() if k.startswith("warm_start/")}
        return {}

    @property
    def eval_points(self) -> list[dict]:
        """Held-out evaluations of a training run, by step: from the metrics, else the eval dirs."""
        pts = {m["step"]: m for m in self.metrics if "eval/pass@1" in m}
        for step, s in self.evals.items():
            pts.setdefault(step, {"step": step, "eval/pass@1": s.get("pass@1"), "eval/pass@k": s.get("pass@k"),
                                  "eval/k": s.get("k"), "eval/tasks": s.get("tasks")})
        return [pts[k] for k in sorted(pts)]


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return {}


def _yaml(path: Path) -> dict:
    import yaml

    try:
        return yaml.safe_load(path.read_text()) or {}
    except (FileNotFoundError, yaml.YAMLError):
        return {}


def _step_of(name: str) -> int | None:
    digits = name.removeprefix("step_").split(".")[0]
    return int(digits) if digits.isdigit() else None


def load_run(run_dir: str | os.PathLike) -> Run:
    d = Path(run_dir)
    if not d.is_dir():
        raise NotARunDir(f"{d}: no such directory; give a run dir of jaxrl_term.train or jaxrl_term.eval")
    summary = _json(d / "summary.json")
    is_eval = (d / "attempts.jsonl").exists() or "pass@1" in summary
    if not is_eval and not (d / "metrics.jsonl").exists():
        raise NotARunDir(f"{d}: neither a training run (metrics.jsonl) nor an evaluation (attempts.jsonl, "
                         "summary.json); give a run dir of jaxrl_term.train or jaxrl_term.eval")
    missing: list[str] = []
    if is_eval:
        attempts = read_jsonl(d / "attempts.jsonl")
        transcripts = [{**t, "source": "eval"} for t in read_jsonl(d / "transcripts.jsonl")]
        for name in ("summary.json", "attempts.jsonl", "transcripts.jsonl"):
            if not (d / name).exists():
                missing.append(name)
        return Run(d, "eval", _yaml(d / "eval_config.yaml"), summary, [], {}, attempts, transcripts, missing)
    metrics = read_jsonl(d / "metrics.jsonl")
    evals = {}
    for sub in sorted((d / "eval").glob("step_*")) if (d / "eval").is_dir() else ():
        step = _step_of(sub.name)
        if step is not None and (sub / "summary.json").exists():
            evals[step] = _json(sub / "summary.json")
    transcripts = []
    for f in sorted((d / "trajectories").glob("step_*.jsonl")) if (d / "trajectories").is_dir() else ():
        if f.name.endswith(".tokens.jsonl"):
            continue
        step = _step_of(f.name)
        transcripts += [{**t, "source": f"train step {step}"} for t in read_jsonl(f)]
    for sub in sorted((d / "eval").glob("step_*")) if (d / "eval").is_dir() else ():
        step = _step_of(sub.name)
        transcripts += [{**t, "source": f"held-out step {step}"} for t in read_jsonl(sub / "transcripts.jsonl")]
    for name in ("summary.json", "config.yaml"):
        if not (d / name).exists():
            missing.append(name)
    return Run(d, "train", _yaml(d / "config.yaml"), summary, metrics, evals, [], transcripts, missing)
