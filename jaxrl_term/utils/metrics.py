"""Per-step metrics: JSONL (always), TensorBoard (default), wandb (optional); a rich console line per step;
sampled trajectories per step as JSONL for inspection."""

from __future__ import annotations

import html
import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def _scalar(v) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


class MetricsLogger:
    def __init__(self, run_dir: str | os.PathLike, *, tensorboard: bool = True, wandb: Mapping | None = None,
                 console: bool = True, enabled: bool = True, config: Mapping | None = None):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.console = console and enabled
        self.path = self.run_dir / "metrics.jsonl"
        self._tb = self._wandb = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter

                self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
            except ImportError:
                log.warning("tensorboardX is not installed: TensorBoard logging is off (pip install tensorboardX)")
        if wandb and wandb.get("enabled"):
            import wandb as wb  # optional dependency: pip install wandb

            self._wandb = wb.init(project=wandb.get("project", "jaxrl_term"), entity=wandb.get("entity"),
                                  name=wandb.get("name") or self.run_dir.name,
                                  mode=wandb.get("mode", "online"), config=dict(config or {}),
                                  dir=str(self.run_dir))

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        from jaxrl_term.agent.transcript import dumps

        with open(self.path, "a") as f:  # strict JSON: a non-finite number is null
            f.write(dumps({"step": step, **metrics}) + "\n")
        scalars = {k: s for k, v in metrics.items() if (s := _scalar(v)) is not None and not isinstance(v, bool)}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)
        if self.console:
            self._print(step, metrics)

    def log_text(self, step: int, tag: str, text: str) -> None:
        """A transcript (markdown) for TensorBoard's text tab and wandb; nothing when neither is on."""
        if not self.enabled:
            return
        if self._tb is not None:
            self._tb.add_text(tag, text, step)
        if self._wandb is not None:
            import wandb as wb

            self._wandb.log({tag: wb.Html(f"<pre>{html.escape(text)}</pre>")}, step=step)

    def _print(self, step: int, m: Mapping[str, Any]) -> None:
        from rich.console import Console

        keys = [("reward/mean", "reward"), ("reward/pass_rate", "pass"), ("train/loss", "loss"),
                ("train/grad_norm", "|g|"), ("train/logp_gap_max", "gap"), ("episode/turns_mean", "turns"),
                ("time/step_s", "step s"), ("time/overlap_frac", "overlap"), ("eval/pass@1", "held-out pass@1"),
                ("eval/pass@k", "pass@k"), ("eval/tasks", "tasks"), ("eval/seconds", "eval s"),
                ("warm_start/loss_first", "SFT loss first"), ("warm_start/loss_last", "last"),
                ("warm_start/seconds", "seconds")]
        label = "warm start" if any(k.startswith("warm_start/") for k in m) else \
            "held-out eval, step" if "eval/pass@1" in m else "step"
        parts = [f"[bold]{label}{'' if label == 'warm start' else f' {step}'}[/bold]"]
        for k, short in keys:
            if k in m and _scalar(m[k]) is not None:
                parts.append(f"{short} {float(m[k]):.4g}")
        Console(highlight=False).print("  ".join(parts))

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: str | os.PathLike) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def summarize(values: Sequence[float], prefix: str) -> dict[str, float]:
    if not values:
        return {}
    n = len(values)
    mean = sum(values) / n
    std = (sum((v - mean) ** 2 for v in values) / n) ** 0.5
    return {f"{prefix}_mean": mean, f"{prefix}_std": std, f"{prefix}_min": min(values), f"{prefix}_max": max(values)}
