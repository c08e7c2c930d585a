"""Reward mixing: tests (the verifier's score) and an optional LLM judge, with weights from config, per group.

Terminal-Bench-RL: 0.65 x tests + 0.35 x judge. Tmax: tests only (binary). ``RewardMixer.score_group`` scores
a whole group: one judge answers for all of it (``JudgeClient.judge_group``), and a trajectory that breaks
the judge scores the judge part 0. When the judge part is *missing* (every judge down: infrastructure only)
it is missing for the whole group, never for one trajectory of it: ``on_missing=renormalize`` gives every
trajectory of the group the tests alone; ``on_missing=wait`` judges the stored trajectories again (episodes
are not re-run) until ``max_wait_s`` has passed, then drops the group (every reward None). Counters say which
happened.

``unfinished="zero"`` (``reward.unfinished``) scores 0 every episode that did not end by the agent declaring the
task done (``end_reason != "finished"``: out of turns, time or context, replies without an action), whatever its
tests say; they are still run and recorded under ``parts["tests"]``. With an outcome-only reward and the default
``"score"``, an episode that solves the task in its first turn and then writes broken replies until the turn
limit earns the full reward, so every token of those replies is reinforced (the CPU learning experiment has
such episodes with a positive advantage at step 7: experiments/results/learning_curve.md). Requiring
completion is the usual rule of agent RL that has a submit/finish action (an episode that never submits
scores 0). Held-out evaluation is unaffected: its pass/fail is the verifier's alone.

The rollout pipeline calls ``score_group`` once per group, after the group's episodes are verified and
outside the episode slots. ``RewardMixer(task, trajectory, result)`` is the older per-trajectory call: a
group of one; with a judge it cannot keep a group on one judge, so it warns once.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import Sequence

from jaxrl_term.reward.verifier import ZERO_OUTCOMES

log = logging.getLogger(__name__)


UNFINISHED = ("score", "zero")


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
    unfinished: str = "score"  # score | zero: what an episode that did not declare the task done gets
    stats: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    _warned: bool = dataclasses.field(default=False, repr=False)

    def __post_init__(self):
        if self.on_missing not in ("renormalize", "wait"):
            raise ValueError(f"reward.on_judge_missing={self.on_missing!r}; use renormalize or wait")
        if self.unfinished not in UNFINISHED:
            raise ValueError(f"reward.unfinished={self.unfinished!r}; use one of {UNFINISHED}")
        if self.judge_weight > 0 and self.judge is None:
            raise ValueError("reward.judge_weight > 0 needs reward.judge.endpoints")

    async def score_group(self, task, trajectories: Sequence, results: Sequence) -> list[tuple[float | None, dict]]:
        """(reward, parts) for each trajectory of one group, from its verifier ``results`` (same order).

        Attempts the verifier found tampered or sabotaged score 0 and are not judged. Every other trajectory
        gets the judge's score from one endpoint, or (judge missing) the tests alone for all of them
        (renormalize), or None for all of them (wait, after ``max_wait_s``)."""
        if len(trajectories) != len(results):
            raise ValueError(f"score_group: {len(trajectories)} trajectories but {len(results)} verifier results")
        parts = [{"tests": r.score} for r in results]
        zero = [getattr(r, "outcome", "scored") in ZERO_OUTCOMES for r in results]
        unfinished = [self.unfinished == "zero" and t.end_reason != "finished" for t in trajectories]
        zero = [z or u for z, u in zip(zero, unfinished)]
        judged = [i for i in range(len(results)) if not zero[i]]
        if self.judge_weight > 0 and judged:
            g = await self._judge(task, [trajectories[i] for i in judged])
            if g.missing and self.on_missing == "wait":
                self.stats["judge_missing_groups_dropped"] += 1
                return [(None, {**p, "judge": None, "judge_missing": True}) for p in parts]
            if g.missing:
                self.stats["judge_missing_groups_renormalized"] += 1
            for i, res in zip(judged, g.results):
                parts[i].update(judge=res.score, judge_endpoint=res.endpoint, judge_missing=res.missing,
                                judge_zeroed=res.zeroed, judge_reasoning=res.reasoning[:500])
                if res.zeroed:
                    self.stats["judge_zeroed"] += 1
        out = []
        for i, p in enumerate(parts):
            if unfinished[i]:
                self.stats["unfinished_zeroed"] += 1
                out.append((0.0, {**p, "unfinished": True}))
            elif zero[i]:
                out.append((0.0, {"tests": 0.0}))
            else:
                out.append((mix(p, {"tests": self.tests_weight, "judge": self.judge_weight}), p))
        self.stats["groups"] += 1
        return out

    async def _judge(self, task, trajectories):
        if self.on_missing != "wait":
            return await self.judge.judge_group(task, trajectories)
        deadline = time.monotonic() + self.max_wait_s
        g = await self.judge.judge_group(task, trajectories, deadline)
        if g.missing:
            self.stats["judge_waited_groups"] += 1
        while g.missing and (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(min(self.poll_s, left))
            if deadline - time.monotonic() <= 0:
                break
            self.stats["judge_rejudged_groups"] += 1  # the stored trajectories, not new episodes
            g = await self.judge.judge_group(task, trajectories, deadline)
        return g

    async def __call__(self, task, trajectory, result) -> tuple[float | None, dict]:
        """One trajectory as a group of one (the per-episode reward_fn API)."""
        if self.judge_weight > 0 and not self._warned:
            self._warned = True
            log.warning("judging one trajectory at a time: a fail-over between judges can then mix judges within a "
                        "group; the rollout pipeline should call RewardMixer.score_group once per group")
        return (await self.score_group(task, [trajectory], [result]))[0]

    def take_stats(self) -> dict[str, float]:
        out = {f"reward/{k}": v for k, v in self.stats.items()}
        self.stats.clear()
        if self.judge is not None:
            out.update(self.judge.take_stats())
        return out
