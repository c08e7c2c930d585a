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

    def log_warm_start(self, info: Mapping[str, Any]) -> None:
        """The warm start's result: one JSONL record at step -1 (before RL step 0; the report reads it), its SFT
        loss curve as TensorBoard / wandb scalars ``warm_start/loss`` over the SFT steps (not a point at step
        -1), and one console line saying what happened."""
        if not self.enabled:
            return
        from jaxrl_term.agent.transcript import dumps

        with open(self.path, "a") as f:
            f.write(dumps({"step": -1, **info}) + "\n")
        losses = [x for x in (info.get("warm_start/losses") or []) if _scalar(x) is not None]
        for i, loss in enumerate(losses):
            if self._tb is not None:
                self._tb.add_scalar("warm_start/loss", float(loss), i)
        if self._tb is not None:
            self._tb.flush()
        if self._wandb is not None and losses:
            import wandb as wb

            table = wb.Table(data=[[i, float(x)] for i, x in enumerate(losses)], columns=["sft_step", "loss"])
            self._wandb.log({"warm_start/loss": wb.plot.line(table, "sft_step", "loss", title="warm start SFT loss")})
        if self.console:
            if info.get("warm_start/cached"):
                line = f"warm start: cached weights {info.get('warm_start/cache', '')}"
            else:
                line = (f"warm start: {info.get('warm_start/demonstrations')} demonstrations, "
                        f"{info.get('warm_start/steps')} SFT steps, loss {float(info.get('warm_start/loss_first', 0)):.4g}"
                        f" -> {float(info.get('warm_start/loss_last', 0)):.4g}, "
                        f"{float(info.get('warm_start/seconds', 0)):.0f}s")
            log.info(line)

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
        """One line per step through ``logging`` (so Hydra's handlers put it on the console and in train.log)."""
        keys = [("reward/mean", "reward"), ("reward/pass_rate", "pass"), ("train/loss", "loss"),
                ("train/grad_norm", "|g|"), ("train/logp_gap_max", "gap"), ("episode/turns_mean", "turns"),
                ("time/step_s", "step s"), ("time/overlap_frac", "overlap"), ("eval/pass@1", "held-out pass@1"),
                ("eval/pass@k", "pass@k"), ("eval/tasks", "tasks"), ("eval/seconds", "eval s"),
                ("warm_start/loss_first", "SFT loss first"), ("warm_start/loss_last", "last"),
                ("warm_start/seconds", "seconds")]
        label = "warm start" if any(k.startswith("warm_start/") for k in m) else \
            "held-out eval, step" if "eval/pass@1" in m else "step"
        parts = [f"{label}{'' if label == 'warm start' else f' {step}'}"]
        for k, short in keys:
            if k in m and _scalar(m[k]) is not None:
                parts.append(f"{short} {float(m[k]):.4g}")
        log.info("  ".join(parts))

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


class ProgressLog:
    """INFO lines for a long phase (warm-start demonstrations, SFT steps): the first and last item and at most
    one line every ``every_s`` seconds in between, with the count, the rate and the time left (field values may
    be callables, evaluated only for a line that is logged: no device sync per step). Logged through
    ``logging``, so they reach the console and the run's ``train.log`` alike."""

    def __init__(self, label: str, total: int, *, every_s: float = 10.0, logger: logging.Logger | None = None):
        import time

        self.label, self.total, self.every_s = label, max(0, int(total)), every_s
        self.log = logger or log
        self.done = 0
        self.t0 = self._last = time.monotonic()

    def update(self, n: int = 1, **fields) -> None:
        import time

        self.done += n
        now = time.monotonic()
        if self.done not in (1, self.total) and now - self._last < self.every_s:
            return
        self._last = now
        el = now - self.t0
        rate = self.done / el if el > 0 else 0.0
        left = (self.total - self.done) / rate if rate > 0 and self.total else 0.0
        fields = {k: (v() if callable(v) else v) for k, v in fields.items()}  # callables: only when logged
        extra = "".join(f", {k} {v:.4g}" if isinstance(v, float) else f", {k} {v}" for k, v in fields.items())
        self.log.info("%s: %d/%d%s (%.0fs elapsed, ~%.0fs left)", self.label, self.done, self.total, extra, el, left)
