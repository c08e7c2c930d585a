"""The rollout producer: tasks in, scored groups tagged with their policy version out.

Groups are numbered in the order their tasks are drawn (a seeded permutation per epoch, resumable from one
integer cursor), run as G concurrent episodes each (bounded by ``max_concurrent_episodes``), verified,
scored, and handed to the trainer *in sequence order* (so a run is reproducible). Invalid episodes (engine
or sandbox failures) and verifier errors are retried, then the group is dropped; zero-variance groups are
dropped and more tasks drawn ("active sampling"); every drop is counted. Attempts the verifier finds
``tampered`` or ``verifier_sabotaged`` score 0 and are never retried (``pipeline/tampered``,
``pipeline/verifier_sabotaged``): breaking the verifier must not be a way out of a bad outcome.
Each dropped group says why (its first failed episode's last attempt). ``max_consecutive_failed_groups``
dropped groups in a row raise ``RolloutStalled``: infrastructure that fails every episode (a wedged Docker
daemon times out every call) stops the run with the reasons, rather than retrying new groups for ever.
Rewards are computed once per group, after its episodes are verified and outside the episode slots: a
``reward_fn`` with ``score_group`` (``RewardMixer``) gets the whole group, so one judge scores all of it and
a missing judgement is missing for all of it; a group whose rewards are missing (``wait`` ran out) is
dropped (``pipeline/groups_reward_missing``), never re-run.

Staleness: the trainer asks for the batch of step ``t``; a group may serve it only if its policy version
(the oldest weights any of its turns used) is ``>= t - max_off_policy_steps``. New groups start only when
the engine's weights are recent enough for the step they will serve, and at most
``groups_per_step * (1 + max_off_policy_steps)`` are started ahead of the trainer: with 0 the loop is
synchronous; with k > 0 rollouts for the next steps overlap the update.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from jaxrl_term.agent.loop import AgentLimits, run_episode
from jaxrl_term.agent.trajectory import Trajectory
from jaxrl_term.reward.verifier import ZERO_OUTCOMES, verify
from jaxrl_term.rollout.engine import RolloutEngine, SamplingParams
from jaxrl_term.tasks.env import open_task_sandbox
from jaxrl_term.tasks.task import Task

log = logging.getLogger(__name__)

# (task, trajectory, verifier result) -> (reward, reward parts); the default is the verifier's score. An object
# that also has ``score_group(task, trajectories, results) -> [(reward, parts)]`` is called once per group.
RewardFn = Callable[[Task, Trajectory, Any], Awaitable[tuple[float | None, dict]]]


class RolloutStalled(RuntimeError):
    """Too many groups in a row were dropped on errors (sandbox, engine, verifier): the run stops, to resume."""


class TaskSampler:
    """Group ``seq`` -> task: a seeded permutation of the tasks per epoch. The state is one integer."""

    def __init__(self, tasks: Sequence[Task], seed: int = 0):
        if not tasks:
            raise ValueError("TaskSampler: no tasks")
        self.tasks, self.seed = list(tasks), seed
        self._perms: dict[int, list[int]] = {}

    def task(self, seq: int) -> Task:
        epoch, i = divmod(seq, len(self.tasks))
        if epoch not in self._perms:
            order = list(range(len(self.tasks)))
            random.Random(f"{self.seed}/{epoch}").shuffle(order)
            self._perms = {epoch: order}
        return self.tasks[self._perms[epoch][i]]


@dataclasses.dataclass
class Group:
    seq: int
    task: Task
    trajectories: list[Trajectory]
    rewards: list[float]
    version: int  # the oldest policy version used by any turn of any trajectory
    started: float
    finished: float
    error: str | None = None

    @property
    def zero_variance(self) -> bool:
        return len(set(self.rewards)) <= 1


def group_version(trajectories: Sequence[Trajectory]) -> int | None:
    """The oldest weight version any turn of the group used (each turn is tagged with the older of the version
    at submission and the one the engine reported); None if some turn is untagged (its staleness is unknown).
    A group with no model turn at all (every episode ended before its first generation) has version None too."""
    versions = []
    for t in trajectories:
        for turn in t.turns:
            if turn.weight_version is None:
                return None
            versions.append(turn.weight_version)
    return min(versions) if versions else None


async def default_reward(task: Task, traj: Trajectory, result) -> tuple[float | None, dict]:
    return result.score, {"tests": result.score}


ATTEMPT_MARGIN_S = 600.0  # an attempt's deadline beyond the sum of its parts' limits (attempt_deadline_s)


def attempt_deadline_s(task: Task, trajectory_timeout_s: float, *, opened: bool = False) -> float:
    """Wall clock an episode attempt may take: the task image's build (until its sandbox is open; waiting for a
    sandbox slot included), then the agent's time (``trajectory_timeout_s``, capped by the task's own), three
    verifier runs (the tests, a re-check on a fresh sandbox, a network confirmation) and ATTEMPT_MARGIN_S for
    sandboxes starting and closing; ``opened``: the clock restarted once the sandbox is open (no build).
    Every part has its own limit; this one only turns a hang that escaped them (an engine API call that never
    answers, a bug) into a dropped, retried attempt that says where it hung. Training rollouts
    (RolloutPipeline) and evaluation attempts (jaxrl_term.eval) share it."""
    agent_s = min(trajectory_timeout_s, task.agent_timeout_s or float("inf"))
    rest = agent_s + 3 * task.test_timeout_s + ATTEMPT_MARGIN_S
    return rest if opened else task.environment.build_timeout_s + rest


class RolloutPipeline:
    def __init__(
        self,
        tasks: Sequence[Task],
        *,
        engine: RolloutEngine,
        tokenizer,
        scaffold_factory: Callable[[], Any],
        group_size: int,
        groups_per_step: int,
        sampling: SamplingParams,
        limits: AgentLimits,
        backend: str = "docker",
        builder=None,
        pool=None,
        sandbox_limits: dict | None = None,
        scoring: str = "weighted",
        reward_fn: RewardFn | None = None,
        max_concurrent_episodes: int = 16,
        max_episode_retries: int = 2,
        drop_zero_variance: bool = True,
        max_filtered_per_step: int | None = None,
        max_off_policy_steps: int = 0,
        enable_thinking: bool | None = None,
        seed: int = 0,
        start_seq: int = 0,
        policy_version: int = 0,
        sampler=None,
        progress_every_s: float = 30.0,
        attempt_deadline_s: float | None = None,
        max_consecutive_failed_groups: int = 8,
    ):
        if group_size < 2:
            raise ValueError("algo.group_size must be >= 2 for group-relative advantages")
        if max_consecutive_failed_groups < 1:
            raise ValueError(f"trainer.max_consecutive_failed_groups={max_consecutive_failed_groups}: must be >= 1")
        # ``sampler``: TaskSampler (default) or tasks.curriculum.CurriculumSampler (observes consumed groups)
        self.sampler = sampler or TaskSampler(tasks, seed)
        self.engine, self.tok, self.scaffold_factory = engine, tokenizer, scaffold_factory
        self.G, self.n = group_size, groups_per_step
        self.sampling, self.limits = sampling, limits
        self.backend, self.builder, self.pool = backend, builder, pool
        self.sandbox_limits = dict(sandbox_limits or {})
        self.scoring = scoring
        self.reward_fn = reward_fn or default_reward
        self.max_retries, self.drop_zero_variance = max_episode_retries, drop_zero_variance
        self.max_filtered = max_filtered_per_step if max_filtered_per_step is not None else 4 * groups_per_step
        self.max_off = max_off_policy_steps
        self.enable_thinking, self.seed = enable_thinking, seed
        self._episode_sem = asyncio.Semaphore(max_concurrent_episodes)
        self.next_seq = start_seq  # next group to start
        self.consumed = start_seq  # next group the trainer takes
        self.train_step = 0
        self.collecting = True
        self.taken = 0
        self.policy_version = policy_version
        self._results: dict[int, Group] = {}
        self._tasks: dict[int, asyncio.Task] = {}
        self._changed = asyncio.Condition()
        self._producer: asyncio.Task | None = None
        self.counters: Counter = Counter()
        self.needs_network: set[str] = set()  # tasks whose verifier needs network it does not have
        self.end_reasons: Counter = Counter()
        self._active = 0
        self._busy_s = 0.0
        self._busy_mark = time.monotonic()
        self.progress_every_s = progress_every_s  # a log line while the trainer waits longer than this
        self._attempt_deadline_s = attempt_deadline_s  # None: from each task's limits (attempt_deadline)
        # the stall guard: groups dropped on errors in a row (in the order the trainer takes them) stop the run
        self.max_failed_in_row = max_consecutive_failed_groups
        self._failed_in_row: list[str] = []
        self._why: dict[tuple[int, int], str] = {}  # (seq, k): why the episode's last attempt failed

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        self._producer = asyncio.create_task(self._produce())

    async def stop(self) -> None:
        if self._producer is not None:
            self._producer.cancel()
        for t in list(self._tasks.values()):
            t.cancel()
        await asyncio.gather(*([self._producer] if self._producer else []), *self._tasks.values(),
                             return_exceptions=True)

    async def set_policy_version(self, version: int) -> None:
        self.policy_version = version
        async with self._changed:
            self._changed.notify_all()

    def busy_seconds(self) -> float:
        """Seconds during which at least one episode was running (for the rollout / update overlap)."""
        now = time.monotonic()
        return self._busy_s + (now - self._busy_mark if self._active else 0.0)

    def _episode_started(self) -> None:
        if self._active == 0:
            self._busy_mark = time.monotonic()
        self._active += 1

    def _episode_done(self) -> None:
        self._active -= 1
        if self._active == 0:
            self._busy_s += time.monotonic() - self._busy_mark

    # -- producer ---------------------------------------------------------------------------------
    def _may_start(self) -> bool:
        """Start a group only if some step it could serve still needs one: with weights of version v, groups
        may serve steps up to v + max_off; the current step still needs ``n - taken``."""
        step = self.train_step if self.collecting else self.train_step + 1
        taken = self.taken if self.collecting else 0
        budget = self.n * (self.policy_version + self.max_off - step + 1) - taken
        return self.next_seq - self.consumed < budget

    async def _produce(self) -> None:
        while True:
            async with self._changed:
                await self._changed.wait_for(self._may_start)
            seq = self.next_seq
            self.next_seq += 1
            self.counters["groups_started"] += 1
            self._tasks[seq] = asyncio.create_task(self._run_group(seq))

    async def _run_group(self, seq: int) -> None:
        ready = getattr(self.sampler, "ready", None)
        if ready is not None and not ready(seq):  # a curriculum draws from the groups consumed before seq - L
            async with self._changed:
                await self._changed.wait_for(lambda: ready(seq))
        task = self.sampler.task(seq)
        t0 = time.monotonic()
        try:
            outcomes = await asyncio.gather(*(self._episode(task, seq, k) for k in range(self.G)))
            failed = [k for k, o in enumerate(outcomes) if o is None]
            if failed:
                why = self._why.pop((seq, failed[0]), "unknown")
                group = Group(seq, task, [], [], -1, t0, time.monotonic(),
                              f"{len(failed)}/{self.G} episodes failed after their retries (episode {failed[0]}'s "
                              f"last attempt: {why})")
            else:
                trajs = [o[0] for o in outcomes]
                version = group_version(trajs)
                if version is None:
                    self.counters["groups_untagged"] += 1
                    log.error("group %d (%s): a turn has no weight version; the engine must tag every generation "
                              "(the group is dropped: its staleness is unknown)", seq, task.id)
                    group = Group(seq, task, [], [], -1, t0, time.monotonic(), "untagged weight version")
                else:
                    rewards = await self._score_group(task, trajs, [o[1] for o in outcomes])
                    group = Group(seq, task, trajs, rewards or [], version, t0, time.monotonic(),
                                  None if rewards is not None else "the group's reward is missing")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a broken group is dropped and counted, the run goes on
            log.exception("group %d (%s) failed", seq, task.id)
            group = Group(seq, task, [], [], -1, t0, time.monotonic(), f"{type(e).__name__}: {e}")
        finally:
            for k in range(self.G):
                self._why.pop((seq, k), None)
        async with self._changed:
            self._results[seq] = group
            self._tasks.pop(seq, None)
            self._changed.notify_all()

    def _episode_seed(self, seq: int, k: int, attempt: int) -> int:
        h = hashlib.sha256(f"{self.seed}/{seq}/{k}/{attempt}".encode()).digest()
        return int.from_bytes(h[:4], "little") % 2**31

    async def _episode(self, task: Task, seq: int, k: int) -> tuple[Trajectory, Any] | None:
        """One episode with retries: (trajectory, verifier result), or None when every attempt failed."""
        for attempt in range(self.max_retries + 1):
            if task.id in self.needs_network:  # excluded: its verifier cannot run here; no retry can change that
                self._why[(seq, k)] = "the task's verifier needs network the sandbox does not have (excluded)"
                break
            async with self._episode_sem:
                self._episode_started()
                try:
                    res = await self._attempt(task, seq, k, attempt)
                finally:
                    self._episode_done()
            if res is not None:
                return res
        self.counters["episodes_failed"] += 1
        return None

    def attempt_deadline(self, task: Task, opened: bool = False) -> float:
        """An attempt's wall clock (module-level ``attempt_deadline_s``), or the pipeline's
        ``attempt_deadline_s`` for each part when it was given."""
        if self._attempt_deadline_s is not None:
            return self._attempt_deadline_s
        return attempt_deadline_s(task, self.limits.trajectory_timeout_s, opened=opened)

    async def _attempt(self, task: Task, seq: int, k: int, attempt: int):
        where = {"at": "opening the sandbox (the image build included)", "deadline": self.attempt_deadline(task)}
        try:
            async with asyncio.timeout(where["deadline"]) as clock:
                where["clock"] = clock
                return await self._attempt_within(task, seq, k, attempt, where)
        except TimeoutError:
            self.counters["retry_attempt_deadline"] += 1
            self._why[(seq, k)] = f"passed its deadline of {where['deadline']:.0f} s while {where['at']}"
            log.error("episode %d/%d of %s (attempt %d) passed its deadline of %.0f s while %s: dropped, and "
                      "retried while retries are left (pipeline/retry_attempt_deadline)", seq, k, task.id, attempt,
                      where["deadline"], where["at"])
            return None

    async def _attempt_within(self, task: Task, seq: int, k: int, attempt: int, where: dict):
        sampling = self.sampling.replace(seed=self._episode_seed(seq, k, attempt))
        try:
            async with open_task_sandbox(task, backend=self.backend, builder=self.builder, pool=self.pool,
                                         labels={"jaxrl_term.group": str(seq)}, **self.sandbox_limits) as sb:
                where["deadline"] = self.attempt_deadline(task, opened=True)  # the clock restarts without the build
                where["clock"].reschedule(asyncio.get_running_loop().time() + where["deadline"])
                try:
                    where["at"] = "running the agent"
                    traj = await run_episode(task, self.engine, sb, self.tok, self.scaffold_factory(),
                                             sampling=sampling, limits=self.limits,
                                             enable_thinking=self.enable_thinking)
                    self.end_reasons[traj.end_reason] += 1
                    if not traj.valid:
                        self.counters[f"retry_{traj.end_reason}"] += 1
                        self._why[(seq, k)] = f"the episode ended invalid ({traj.end_reason})"
                        return None
                    # a verifier error is re-checked on a fresh sandbox of the task (outside the pool: this one is
                    # held) (a sandbox of the same task with this one's settings, pool defaults included: sb.reopen)
                    where["at"] = "running the verifier"
                    result = await verify(task, sb, scoring=self.scoring)
                finally:
                    if not asyncio.current_task().cancelling():  # a cancelled attempt says where it hung
                        where["at"] = "closing the sandbox"
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - sandbox / build failures: retried, then dropped
            log.warning("episode %d/%d of %s failed: %s: %s", seq, k, task.id, type(e).__name__, e)
            self.counters["retry_sandbox_exception"] += 1
            self._why[(seq, k)] = f"{type(e).__name__}: {str(e)[:300]}"
            return None
        if result.outcome == "verifier_needs_network":  # never a 0 for the agent: dropped, and said loudly
            if task.id not in self.needs_network:
                self.needs_network.add(task.id)
                log.error("task %s: %s; its episodes are dropped, not scored", task.id, result.error)
            self.counters["verifier_needs_network"] += 1
            self._why[(seq, k)] = f"the verifier needs network: {result.error}"
            return None
        if not result.ok:
            self.counters["retry_verifier_error"] += 1
            self._why[(seq, k)] = f"verifier error ({result.outcome}): {str(result.error)[:300]}"
            return None
        if result.toolchain and result.toolchain != "pristine":
            self.counters["verifier_toolchain_fallback"] += 1
        if result.outcome in ZERO_OUTCOMES:  # tampered / verifier_sabotaged: 0, never retried, whatever else rewards
            self.counters[result.outcome] += 1
        traj.meta.update(seq=seq, k=k, attempt=attempt, policy_version_started=self.policy_version)
        self.counters["episodes"] += 1
        if result.outcome == "test_timeout":
            self.counters["test_timeouts"] += 1
        return traj, result

    async def _score_group(self, task: Task, trajs: list[Trajectory], results: list) -> list[float] | None:
        """The group's rewards (set on each trajectory too), or None when they are missing. Runs outside the
        episode slots; a judge behind ``reward_fn.score_group`` scores the whole group on one endpoint."""
        group_fn = getattr(self.reward_fn, "score_group", None)
        if group_fn is not None:
            scored = list(await group_fn(task, trajs, results))
        else:
            scored = [None if r.outcome in ZERO_OUTCOMES else await self.reward_fn(task, t, r)
                      for t, r in zip(trajs, results)]
        # tampered / verifier_sabotaged: 0 whatever the reward function says
        scored = [(0.0, {"tests": 0.0}) if r.outcome in ZERO_OUTCOMES else s for s, r in zip(scored, results)]
        if any(reward is None for reward, _ in scored):
            self.counters["groups_reward_missing"] += 1
            return None
        for traj, result, (reward, parts) in zip(trajs, results, scored):
            traj.reward = float(reward)
            traj.reward_parts = {**parts, "outcome": result.outcome, "tests_passed": result.passed}
        return [float(reward) for reward, _ in scored]

    # -- consumer ---------------------------------------------------------------------------------
    async def get_batch(self, step: int) -> list[Group]:
        """The ``groups_per_step`` groups for training step ``step``, in sequence order."""
        self.train_step, self.collecting, self.taken = step, True, 0
        async with self._changed:
            self._changed.notify_all()
        out: list[Group] = []
        filtered = 0
        reporter = asyncio.create_task(self._report_wait(step)) if self.progress_every_s > 0 else None
        try:
            await self._collect(step, out, filtered)
        finally:
            if reporter is not None:
                reporter.cancel()
        self.collecting = False
        async with self._changed:
            self._changed.notify_all()
        return out

    async def _report_wait(self, step: int) -> None:
        """While the trainer waits for step ``step``'s groups: a line every ``progress_every_s`` seconds."""
        t0 = time.monotonic()
        while True:
            await asyncio.sleep(self.progress_every_s)
            log.info("step %d: waiting for rollouts for %.0fs: %d/%d groups taken, %d finished ahead, %d running "
                     "(%d episodes in sandboxes now, %d finished since the last step)", step, time.monotonic() - t0,
                     self.taken, self.n, len(self._results), len(self._tasks), self._active,
                     self.counters["episodes"])

    async def _collect(self, step: int, out: list, filtered: int) -> None:
        while len(out) < self.n:
            async with self._changed:  # decide under the lock: the producer's budget depends on `taken`
                await self._changed.wait_for(lambda: self.consumed in self._results)
                g = self._results.pop(self.consumed)
                observe = getattr(self.sampler, "observe", None)
                if observe is not None:
                    observe(self.consumed, None if g.error else g)
                self.consumed += 1
                if not g.error:  # a group that ran (stale, filtered or taken) ends a run of failures
                    self._failed_in_row.clear()
                if g.error:
                    self.counters["groups_dropped_errors"] += 1
                    self._failed_in_row.append(f"group {g.seq} ({g.task.id}): {g.error}")
                    if len(self._failed_in_row) >= self.max_failed_in_row:
                        raise RolloutStalled(self._stall_message(step))
                elif g.version < step - self.max_off:
                    self.counters["groups_stale"] += 1
                elif self.drop_zero_variance and g.zero_variance and filtered < self.max_filtered:
                    filtered += 1
                    self.counters["groups_filtered_zero_variance"] += 1
                else:
                    if g.zero_variance:
                        self.counters["groups_zero_variance_used"] += 1
                    out.append(g)
                    self.taken += 1
                self._changed.notify_all()

    def _stall_message(self, step: int) -> str:
        retries = {k: v for k, v in self.counters.items() if k.startswith("retry_")}
        last = "\n  ".join(self._failed_in_row[-3:])
        return (f"step {step}: {len(self._failed_in_row)} groups in a row were dropped because their episodes failed "
                f"after {self.max_retries} retries each (trainer.max_consecutive_failed_groups="
                f"{self.max_failed_in_row}); the run stops instead of waiting on infrastructure that does not work. "
                f"The last ones:\n  {last}\nAttempt failures since the last step: {retries or 'none'}. Check the "
                "sandbox backend (`docker info` must answer at once; a wedged dockerd times out every call: restart "
                "it, then `python -m jaxrl_term.sandbox.docker reap --all`), the policy engine and the verifier, "
                "then run the same command again: it resumes from the last checkpoint.")

    def take_counters(self) -> dict[str, int]:
        out = {f"pipeline/{k}": v for k, v in self.counters.items()}
        out.update({f"episode/end_{k}": v for k, v in self.end_reasons.items()})
        if hasattr(self.sampler, "take_metrics"):
            out.update(self.sampler.take_metrics())
        engines = getattr(self.pool, "engines", None)
        if engines is not None:  # per Docker engine: open sandboxes, creations, failures, latencies
            out.update(engines.metrics())
        self.counters.clear()
        self.end_reasons.clear()
        return out
