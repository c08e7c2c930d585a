"""Reward mixing: tests (the verifier's score) and an optional LLM judge, with weights from config.

Terminal-Bench-RL: 0.65 x tests + 0.35 x judge. Tmax: tests only (binary). When the judge part is missing
(every judge down) it is *missing*, not 0: ``on_missing=renormalize`` mixes what is there with its weights
renormalised (here: the tests alone), ``on_missing=wait`` keeps asking until ``max_wait_s``, then leaves the
reward missing (the trajectory is retried or dropped). Counters say which happened.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time

log = logging.getLogger(__name__)


def mix(parts: dict[str, float | None], weights: dict[str, float]) -> float | None:
    """Weighted mean over the parts that are present (weights renormalised); None if nothing is present."""
    present = {k: w for k, w in weights.items() if w > 0 and parts.get(k) is not None}
    total = sum(present.values())
    if total <= 0:
        return None
    return sum(w * float(parts[k]) for k, w in present.items()) / total


@dataclasses.dataclass
class RewardMixer:
    tests_weight: float = 1.0
    judge_weight: float = 0.0
    judge: object | None = None  # a JudgeClient
    on_missing: str = "renormalize"  # renormalize | wait
    max_wait_s: float = 600.0
    poll_s: float = 10.0
    stats: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def __post_init__(self):
        if self.on_missing not in ("renormalize", "wait"):
            raise ValueError(f"reward.on_judge_missing={self.on_missing!r}; use renormalize or wait")
        if self.judge_weight > 0 and self.judge is None:
            raise ValueError("reward.judge_weight > 0 needs reward.judge.endpoints")

    async def __call__(self, task, trajectory, result) -> tuple[float | None, dict]:
        parts: dict = {"tests": result.score}
        if self.judge_weight > 0:
            judged = await self.judge.score(task, trajectory)
            if judged.missing and self.on_missing == "wait":
                t_end = time.monotonic() + self.max_wait_s
                self.stats["judge_waited"] += 1
                while judged.missing and time.monotonic() < t_end:
                    await asyncio.sleep(self.poll_s)
                    judged = await self.judge.score(task, trajectory)
                if judged.missing:
                    self.stats["judge_missing_dropped"] += 1
                    return None, {**parts, "judge": None, "judge_missing": True}
            if judged.missing:
                self.stats["judge_missing_renormalized"] += 1
            parts.update(judge=judged.score, judge_endpoint=judged.endpoint, judge_missing=judged.missing,
                         judge_reasoning=judged.reasoning[:500])
        reward = mix(parts, {"tests": self.tests_weight, "judge": self.judge_weight})
        return reward, parts

    def take_stats(self) -> dict[str, int]:
        out = {f"reward/{k}": v for k, v in self.stats.items()}
        self.stats.clear()
        if self.judge is not None:
            out.update(self.judge.take_stats())
        return out
