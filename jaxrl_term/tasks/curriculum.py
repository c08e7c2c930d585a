"""A training-task sampler that prefers tasks whose recent pass rate lies inside a band.

GRPO learns nothing from a group whose episodes all pass or all fail (zero variance). The curriculum keeps, per
task, the pass rates of its last ``window`` groups (pass rate of a group: the share of its episodes whose tests
all passed) and draws the task of each new group with weight 1 if the task's recent pass rate is inside
``[lo, hi]`` (or the task has not been seen yet) and ``out_of_band_weight`` otherwise (> 0, so a task that left
the band is still seen now and then and can come back).

**Reproducible and exactly resumable.** The choice for group ``seq`` is a function of the seed, ``seq`` and the
outcomes of the groups ``< seq - lookahead`` only, observed in group order as the trainer consumes them
(``lookahead`` = the most groups the pipeline starts ahead of the trainer: ``groups_per_step x (1 +
max_off_policy_steps)``). So it does not depend on which groups happen to finish first, and the state saved with
a checkpoint (the observations that can still matter) gives the same next tasks after a resume. The pipeline waits
(in the rare case it must) until those groups are consumed before choosing.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping, Sequence
from typing import Any

from jaxrl_term.tasks.task import Task


@dataclasses.dataclass(frozen=True)
class CurriculumSettings:
    band: tuple[float, float] = (0.2, 0.8)
    window: int = 4  # groups per task that make its recent pass rate
    out_of_band_weight: float = 0.1

    def __post_init__(self):
        lo, hi = self.band
        if not 0.0 <= lo <= hi <= 1.0:
            raise ValueError(f"data.curriculum.band={list(self.band)}: need 0 <= lo <= hi <= 1")
        if self.window < 1:
            raise ValueError(f"data.curriculum.window={self.window}: must be >= 1")
        if not 0.0 < self.out_of_band_weight <= 1.0:
            raise ValueError(f"data.curriculum.out_of_band_weight={self.out_of_band_weight}: must be in (0, 1] "
                             "(0 would never show a task again once it left the band)")


def group_pass_rate(group) -> float | None:
    """Share of the group's episodes whose tests all passed (the ``tests`` part of the reward, else the
    reward); None for a group without episodes (dropped for errors)."""
    if not group.trajectories:
        return None
    ok = []
    for traj, reward in zip(group.trajectories, group.rewards):
        tests = (traj.reward_parts or {}).get("tests", reward)
        ok.append(float(tests) >= 1.0 - 1e-9)
    return sum(ok) / len(ok)


class CurriculumSampler:
    """``task(seq)``, ``observe(seq, group)``, ``state()`` / ``load_state()``: see the module docstring."""

    def __init__(self, tasks: Sequence[Task], seed: int = 0, settings: CurriculumSettings | None = None, *,
                 lookahead: int = 1, state: Mapping[str, Any] | None = None):
        if not tasks:
            raise ValueError("CurriculumSampler: no tasks")
        self.tasks, self.seed = list(tasks), seed
        self.s = settings or CurriculumSettings()
        self.lookahead = max(1, int(lookahead))
        self.index = {t.id: i for i, t in enumerate(self.tasks)}
        self.log: list[tuple[int, int, float]] = []  # (seq, task index, pass rate), in seq order
        self.cursor = 0  # groups consumed (observed or dropped) so far
        self._window: dict[int, float] | None = None
        self.sampled: list[bool] = []  # in band at the time of drawing, for the draws since the last take_metrics
        if state:
            self.load_state(state)

    # -- drawing ----------------------------------------------------------------------------------------------
    def ready(self, seq: int) -> bool:
        """True when every group the choice for ``seq`` depends on has been consumed."""
        return self.cursor >= seq - self.lookahead

    def rates(self, cutoff: int) -> dict[int, float]:
        """Task index -> mean pass rate of its last ``window`` groups with seq < ``cutoff``."""
        recent: dict[int, list[float]] = {}
        for seq, ti, r in self.log:
            if seq >= cutoff:
                break
            recent.setdefault(ti, []).append(r)
        w = self.s.window
        return {ti: sum(v[-w:]) / len(v[-w:]) for ti, v in recent.items()}

    def in_band(self, rate: float | None) -> bool:
        lo, hi = self.s.band
        return rate is None or lo <= rate <= hi

    def task(self, seq: int) -> Task:
        if not self.ready(seq):
            raise RuntimeError(f"curriculum: the task of group {seq} depends on groups up to {seq - self.lookahead}, "
                               f"but only {self.cursor} are consumed (wait for ready(seq))")
        rates = self.rates(seq - self.lookahead)
        weights = [1.0 if self.in_band(rates.get(i)) else self.s.out_of_band_weight for i in range(len(self.tasks))]
        rng = random.Random(f"{self.seed}/curriculum/{seq}")
        i = rng.choices(range(len(self.tasks)), weights=weights)[0]
        self.sampled.append(self.in_band(rates.get(i)))
        return self.tasks[i]

    # -- observing ------------------------------------------------------------------------------------------
    def observe(self, seq: int, group) -> None:
        """Called for every consumed group, in seq order (also for dropped ones: they advance the cursor)."""
        if seq != self.cursor:
            raise RuntimeError(f"curriculum: observed group {seq}, expected {self.cursor} (groups must be observed "
                               "in order)")
        self.cursor = seq + 1
        rate = group_pass_rate(group) if group is not None else None
        if rate is not None and group.task.id in self.index:
            self.log.append((seq, self.index[group.task.id], rate))
        self._compact()

    def _compact(self) -> None:
        """Drop observations that can no longer matter: older than the last ``window`` of their task among those
        every future choice sees (seq < cursor - lookahead)."""
        settled = self.cursor - self.lookahead
        keep, seen = [], {}
        for seq, ti, r in reversed(self.log):
            if seq < settled:
                seen[ti] = seen.get(ti, 0) + 1
                if seen[ti] > self.s.window:
                    continue
            keep.append((seq, ti, r))
        self.log = keep[::-1]

    # -- state ----------------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {"cursor": self.cursor, "lookahead": self.lookahead,
                "log": [[seq, self.tasks[ti].id, r] for seq, ti, r in self.log]}

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.cursor = int(state["cursor"])
        self.log = [(int(seq), self.index[tid], float(r)) for seq, tid, r in state.get("log", ())
                    if tid in self.index]

    def take_metrics(self) -> dict[str, float]:
        rates = self.rates(self.cursor)
        lo, hi = self.s.band
        out = {"curriculum/tasks_seen": len(rates),
               "curriculum/tasks_in_band": sum(lo <= r <= hi for r in rates.values()),
               "curriculum/band_occupancy": (sum(lo <= r <= hi for r in rates.values()) / len(rates)) if rates else 0.0}
        if self.sampled:
            out["curriculum/sampled_in_band_frac"] = sum(self.sampled) / len(self.sampled)
        self.sampled = []
        return out
