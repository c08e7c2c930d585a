"""The evaluator: k attempts per task, each in a fresh sandbox, verified by the same verifier as training.

Policies: an engine (embedded JAX engine, SGLang servers, an OpenAI-compatible chat endpoint) through the agent
loop and a scaffold, or the harness agents ``oracle`` (the task's own solution) and ``nop`` (nothing), which
must score 1 and 0 on every sound task.

An attempt the infrastructure broke (engine or sandbox failure, verifier error, image build) is re-run, then
dropped and recorded in ``invalid.jsonl``, never scored 0. Finished attempts are appended to ``attempts.jsonl``
(fsynced, after their transcript): a killed evaluation restarted on the same run dir re-runs none of them.
Attempt j of task t samples with a seed from (seed, t, j), independent of the other attempts; a rerun draws
the same tokens only with a deterministic engine (``trainer.deterministic_engine``), since batching and prefix
reuse otherwise change the logits in the last bits.

pass@1 is the mean over attempts; its spread is the standard deviation of the pass rates of the k attempt
indices (ddof 1). pass@k is the unbiased estimator of Chen et al. (2021), 1 - C(n-c, k) / C(n, k) per task
(n valid attempts, c passed), averaged over tasks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import math
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jaxrl_term.agent.transcript import append_jsonl, passed, read_jsonl, tokens_record, transcript, write_jsonl
from jaxrl_term.rollout.engine import SamplingParams
from jaxrl_term.tasks.task import Task

log = logging.getLogger(__name__)

POLICIES = ("oracle", "nop", "checkpoint", "sglang", "openai")
HARNESS = ("oracle", "nop")
FAILURE_MODES = ("tests_failed", "agent_timeout", "parse_errors", "context_full", "max_turns", "no_action",
                 "test_timeout", "tampered", "verifier_sabotaged", "engine_error", "sandbox_error", "verifier_error",
                 "verifier_needs_network", "build_error", "no_solution", "judge_error", "attempt_deadline")
INVALID_MODES = ("engine_error", "sandbox_error", "verifier_error", "verifier_needs_network", "build_error",
                 "no_solution", "judge_error", "attempt_deadline")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n attempts with c passes: 1 - C(n-c, k) / C(n, k) (requires k <= n)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def failure_mode(end_reason: str | None, outcome: str | None, ok: bool) -> str | None:
    """Why a valid attempt did not pass (None when it passed)."""
    if ok:
        return None
    if outcome in ("tampered", "verifier_sabotaged", "test_timeout"):
        return outcome
    return {"timeout": "agent_timeout", "parse_errors": "parse_errors", "context_full": "context_full",
            "max_turns": "max_turns", "no_action": "no_action"}.get(end_reason or "", "tests_failed")


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    attempts: int = 1
    concurrency: int = 4
    max_retries: int = 2
    seed: int = 0
    progress: bool = True
    attempt_deadline_s: float | None = None  # None: from the task's limits (Evaluator.attempt_deadline)


def attempt_seed(seed: int, task_id: str, attempt: int, retry: int = 0) -> int:
    h = hashlib.sha256(f"{seed}/{task_id}/{attempt}/{retry}".encode()).digest()
    return int.from_bytes(h[:4], "little") % 2**31


def summarize(records: Sequence[dict], k: int, *, tasks: Sequence[Task] | None = None,
              invalid: Sequence[dict] = ()) -> dict:
    """The summary of finished attempts (``attempts.jsonl`` records) for ``k`` attempts per task."""
    by_task: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_task[r["task"]].append(r)
    meta = {t.id: (t.difficulty, t.category) for t in tasks or ()}
    for tid, rs in by_task.items():
        meta.setdefault(tid, (rs[0].get("difficulty"), rs[0].get("category")))
    ks = sorted({1, k, *(2**i for i in range(1, 12) if 2**i < k)})

    def group_stats(ids: Sequence[str]) -> dict:
        done = [t for t in ids if by_task.get(t)]
        out: dict[str, Any] = {"tasks": len(ids), "tasks_evaluated": len(done),
                               "attempts": sum(len(by_task.get(t, [])) for t in ids)}
        for kk in ks:
            vals = [pass_at_k(len(by_task[t]), sum(r["pass"] for r in by_task[t]), min(kk, len(by_task[t])))
                    for t in done]
            out[f"pass@{kk}"] = sum(vals) / len(vals) if vals else None
        out["pass@k"] = out[f"pass@{k}"]
        return out

    all_ids = list(dict.fromkeys([t.id for t in tasks or ()] + list(by_task)))
    overall = group_stats(all_ids)
    per_index = []
    for j in range(k):
        rs = [r for r in records if r["attempt"] == j]
        if rs:
            per_index.append(sum(r["pass"] for r in rs) / len(rs))
    modes = Counter(r["failure"] for r in records if r.get("failure"))
    modes.update(r.get("failure") or "engine_error" for r in invalid)

    def by(axis: int) -> dict:
        groups: dict[str, list[str]] = defaultdict(list)
        for tid in all_ids:
            groups[str(meta.get(tid, (None, None))[axis])].append(tid)
        return {name: group_stats(ids) for name, ids in sorted(groups.items())}

    per_task = {}
    for tid in all_ids:
        rs = by_task.get(tid, [])
        n, c = len(rs), sum(r["pass"] for r in rs)
        rewards = [r["reward"] for r in rs if r.get("reward") is not None]
        per_task[tid] = {"attempts": n, "passes": c, "pass@1": c / n if n else None,
                         "pass@k": pass_at_k(n, c, min(k, n)) if n else None,
                         "reward_mean": sum(rewards) / len(rewards) if rewards else None,
                         "difficulty": meta.get(tid, (None, None))[0], "category": meta.get(tid, (None, None))[1]}
    incomplete = sorted(t for t in all_ids if len(by_task.get(t, [])) < k)
    return {
        "pass@1": overall["pass@1"], "pass@1_std": statistics.stdev(per_index) if len(per_index) > 1 else 0.0,
        "pass@k": overall["pass@k"], "k": k, "pass_at": {str(kk): overall[f"pass@{kk}"] for kk in ks},
        "pass@1_per_attempt": per_index, "tasks": len(all_ids), "tasks_evaluated": overall["tasks_evaluated"],
        "attempts": len(records), "attempts_invalid": len(invalid), "tasks_incomplete": incomplete,
        "reward_mean": _mean(r.get("reward") for r in records),
        "by_difficulty": by(0), "by_category": by(1),
        "failure_modes": {m: modes[m] for m in FAILURE_MODES if modes[m]} | {m: v for m, v in modes.items()
                                                                             if m not in FAILURE_MODES},
        "turns_mean": _mean(r.get("turns") for r in records), "tokens_mean": _mean(r.get("tokens") for r in records),
        "wall_s_mean": _mean(r.get("wall_s") for r in records), "per_task": per_task,
    }


def _mean(values) -> float | None:
    vals = [float(v) for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


class Evaluator:
    """Run ``attempts`` attempts of every task with one policy; results under ``run_dir``.

    ``engine``/``tokenizer``/``scaffold_factory``/``sampling``/``limits``: an engine policy's agent loop (unused by
    oracle and nop). ``reward_fn``: a ``RewardMixer`` (judge included) for engine policies; pass/fail is always
    the verifier's: every test passed. ``fingerprint``: what the run dir's attempts were made with; a restart
    with a different one is refused."""

    def __init__(self, tasks: Sequence[Task], run_dir: str | Path, *, policy: str, settings: EvalSettings,
                 engine=None, tokenizer=None, scaffold_factory: Callable | None = None,
                 sampling: SamplingParams | None = None, limits=None, enable_thinking: bool | None = None,
                 backend: str = "docker", builder=None, sandbox_limits: dict | None = None,
                 scoring: str = "weighted", reward_fn=None, fingerprint: dict | None = None,
                 extra: dict | None = None, on_attempt: Callable[[dict], None] | None = None):
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r}; use one of {POLICIES}")
        if policy not in HARNESS and (engine is None or tokenizer is None or scaffold_factory is None):
            raise ValueError(f"policy {policy}: an engine, a tokenizer and a scaffold are needed")
        if not tasks:
            raise ValueError("evaluation: no tasks")
        ids = [t.id for t in tasks]
        if len(set(ids)) != len(ids):
            dup = sorted({i for i in ids if ids.count(i) > 1})
            raise ValueError(f"evaluation: task ids must be unique; repeated: {dup[:5]}")
        self.tasks, self.dir, self.policy, self.s = list(tasks), Path(run_dir), policy, settings
        self.engine, self.tok, self.scaffold_factory = engine, tokenizer, scaffold_factory
        self.sampling, self.limits, self.enable_thinking = sampling or SamplingParams(), limits, enable_thinking
        self.backend, self.builder, self.scoring = backend, builder, scoring
        self.sandbox_limits = dict(sandbox_limits or {})
        self.reward_fn = reward_fn
        self.fingerprint = {"policy": policy, **(fingerprint or {})}
        self.extra = dict(extra or {})  # added to every record (e.g. step)
        self.on_attempt = on_attempt
        self.attempts_path = self.dir / "attempts.jsonl"
        self.invalid_path = self.dir / "invalid.jsonl"
        self.records: list[dict] = []
        self.invalid: list[dict] = []
        self.ran = 0  # attempts run by this call (not taken from an earlier one)

    # -- resume -----------------------------------------------------------------------------------
    def check(self) -> None:
        """Refuse a run dir that holds attempts of another evaluation (before anything is written there)."""
        fp_path = self.dir / "fingerprint.json"
        if fp_path.is_file():
            old = json.loads(fp_path.read_text())
            diff = {k: (old.get(k), v) for k, v in self.fingerprint.items() if old.get(k) != v}
            if diff and self.attempts_path.is_file() and self.attempts_path.stat().st_size:
                what = "; ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in diff.items())
                raise ValueError(f"{self.dir} holds attempts of another evaluation ({what}); use a new run_dir, "
                                 "or delete it to start over")

    def _load(self) -> set[tuple[str, int]]:
        """Finished attempts of an earlier run in this dir; transcripts of unfinished ones are dropped."""
        self.check()
        self.dir.mkdir(parents=True, exist_ok=True)
        fp_path = self.dir / "fingerprint.json"
        fp_path.write_text(json.dumps(self.fingerprint, indent=2, default=str))
        wanted = {(t.id, j) for t in self.tasks for j in range(self.s.attempts)}
        every = read_jsonl(self.attempts_path)  # a line cut by a kill is skipped
        kept = list({(r["task"], r["attempt"]): r for r in every if (r.get("task"), r.get("attempt")) in wanted
                     }.values())
        finished_ids = {r.get("id") for r in every}
        # rewrite clean: without the cut line, and without transcripts of attempts that never finished
        write_jsonl(self.attempts_path, every)
        for name in ("transcripts.jsonl", "tokens.jsonl"):
            p = self.dir / name
            if p.exists():
                write_jsonl(p, [r for r in read_jsonl(p) if r.get("id") in finished_ids])
        # an attempt dropped earlier and finished since is no longer invalid; the last record per attempt
        finished = {(r.get("task"), r.get("attempt")) for r in every}
        stale = {(r.get("task"), r.get("attempt")): r for r in read_jsonl(self.invalid_path)
                 if (r.get("task"), r.get("attempt")) not in finished}
        if self.invalid_path.exists():
            write_jsonl(self.invalid_path, stale.values())
        self.invalid = [r for key, r in stale.items() if key in wanted]
        self.records = kept
        return {(r["task"], r["attempt"]) for r in kept}

    # -- run --------------------------------------------------------------------------------------
    async def run(self) -> dict:
        t0 = time.monotonic()
        done = self._load()
        todo = [(t, j) for t in self.tasks for j in range(self.s.attempts) if (t.id, j) not in done]
        if done:
            log.info("%s: %d attempt(s) already finished, %d to run", self.dir, len(done), len(todo))
        sem = asyncio.Semaphore(self.s.concurrency)
        left = Counter(t.id for t, _ in todo)
        with _Progress(self.s.progress, len(self.tasks), len(self.tasks) - len(left), self.records) as bar:
            async def one(task: Task, j: int) -> None:
                async with sem:
                    rec = await self._attempt(task, j)
                if rec is not None:
                    self.records.append(rec)
                    if self.on_attempt is not None:
                        self.on_attempt(rec)
                left[task.id] -= 1
                bar.update(task_done=left[task.id] == 0, record=rec)

            await asyncio.gather(*(one(t, j) for t, j in todo))
        summary = summarize(self.records, self.s.attempts, tasks=self.tasks, invalid=self.invalid)
        summary.update({**self.fingerprint, **self.extra, "wall_s": time.monotonic() - t0, "attempts_run": self.ran})
        (self.dir / "summary.json").write_text(json.dumps(_json_safe(summary), indent=2, allow_nan=False))
        return summary

    async def _attempt(self, task: Task, j: int) -> dict | None:
        """One attempt with retries: its record (written), or None when every try broke (recorded as invalid)."""
        reason, error = "engine_error", ""
        for retry in range(self.s.max_retries + 1):
            t0 = time.monotonic()
            out = await self._try(task, j, retry)
            if out[0] == "ok":
                _, traj, result, reward, parts = out
                return self._record(task, j, traj, result, reward, parts, time.monotonic() - t0, retry)
            _, reason, error = out
            if reason in ("build_error", "no_solution"):
                break  # the same on every try
            log.warning("attempt %d of %s: %s (%s); %s", j, task.id, reason, error[:300],
                        "retrying" if retry < self.s.max_retries else "dropped")
        rec = {"task": task.id, "attempt": j, "failure": reason, "error": error[:2000], **self.extra}
        self.invalid.append(rec)
        append_jsonl(self.invalid_path, [rec], sync=True)
        return None

    def attempt_deadline(self, task: Task) -> float:
        """Wall clock one try of an attempt may take, its sandbox's image build included: the training rollouts'
        formula (``rollout.pipeline.attempt_deadline_s``) with the agent's limits of this policy (the oracle's and
        nop's: the task's agent timeout), or ``EvalSettings.attempt_deadline_s`` when set. A try that passes it
        (an engine call that never answers, a hung sandbox) is retried, then dropped as ``attempt_deadline``."""
        from jaxrl_term.agent.loop import AgentLimits
        from jaxrl_term.rollout.pipeline import attempt_deadline_s

        if self.s.attempt_deadline_s is not None:
            return self.s.attempt_deadline_s
        if self.policy in HARNESS:
            agent_s = task.agent_timeout_s or AgentLimits().trajectory_timeout_s
        else:
            agent_s = (self.limits or AgentLimits()).trajectory_timeout_s
        return attempt_deadline_s(task, agent_s)

    async def _try(self, task: Task, j: int, retry: int) -> tuple:
        if self.policy == "oracle" and task.solution is None:
            return "invalid", "no_solution", "the task has no oracle solution"
        deadline = self.attempt_deadline(task)
        phase = {"at": "opening the sandbox (the image build included)"}
        clock = None
        try:
            async with asyncio.timeout(deadline) as clock:
                out = await self._episode(task, j, retry, phase)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the infrastructure broke: retried, then dropped
            if clock is not None and clock.expired():  # also when closing the sandbox raised after the cancel
                return "invalid", "attempt_deadline", f"passed its deadline of {deadline:.0f} s while {phase['at']}"
            kind = "build_error" if type(e).__name__ == "ImageBuildError" else "sandbox_error"
            return "invalid", kind, f"{type(e).__name__}: {e}"
        if out[0] == "invalid":
            return out
        _, traj, result = out
        if not result.ok:
            return "invalid", result.outcome, result.error or result.outcome
        reward, parts = result.score, {"tests": result.score}
        if self.reward_fn is not None and traj is not None and self.policy not in HARNESS:
            try:  # the judge's failure breaks the reward, not the evaluation: retried, then dropped
                (reward, parts), = await self.reward_fn.score_group(task, [traj], [result])
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001
                return "invalid", "judge_error", f"{type(e).__name__}: {e}"
        parts = {**parts, "outcome": result.outcome, "tests_passed": dict(result.passed)}
        if traj is not None:
            traj.reward, traj.reward_parts = reward, parts
        return "ok", traj, result, reward, parts

    async def _episode(self, task: Task, j: int, retry: int, phase: dict) -> tuple:
        """The sandbox, the policy's episode and the verifier, under the attempt's clock (``phase`` says where
        it is): ("done", trajectory or None, verifier result), or ("invalid", failure, error)."""
        from jaxrl_term.agent.loop import run_episode
        from jaxrl_term.reward.verifier import verify
        from jaxrl_term.tasks.check import run_oracle
        from jaxrl_term.tasks.env import open_task_sandbox

        def fresh():
            return open_task_sandbox(task, backend=self.backend, builder=self.builder, **self.sandbox_limits)

        traj = None
        async with open_task_sandbox(task, backend=self.backend, builder=self.builder,
                                     labels={"jaxrl_term.eval": f"{j}"}, **self.sandbox_limits) as sb:
            phase["at"] = "running the agent" if self.policy != "oracle" else "running the oracle solution"
            if self.policy == "oracle":
                traj = await _oracle_episode(task, sb, run_oracle)
            elif self.policy != "nop":
                sampling = self.sampling.replace(seed=attempt_seed(self.s.seed, task.id, j, retry))
                traj = await run_episode(task, self.engine, sb, self.tok, self.scaffold_factory(),
                                         sampling=sampling, limits=self.limits,
                                         enable_thinking=self.enable_thinking)
                if not traj.valid:
                    phase["at"] = "closing the sandbox"
                    return "invalid", traj.end_reason, traj.error or traj.end_reason
            phase["at"] = "running the verifier"
            result = await verify(task, sb, scoring=self.scoring, fresh=getattr(sb, "reopen", None) or fresh)
            phase["at"] = "closing the sandbox"
        return "done", traj, result

    def _record(self, task, j, traj, result, reward, parts, wall_s: float, retry: int) -> dict:
        rid = f"{task.id}/attempt-{j}"
        ok = passed(result.score, result.outcome)
        end = traj.end_reason if traj is not None else self.policy
        tr = transcript(traj, task, id=rid, result=result, reward=reward, reward_parts=parts, attempt=j,
                        policy=self.policy, end_reason=end, duration_s=wall_s, **self.extra)
        tr["end_reason"] = end
        append_jsonl(self.dir / "transcripts.jsonl", [tr])
        if traj is not None and self.policy not in HARNESS:
            append_jsonl(self.dir / "tokens.jsonl", [tokens_record(rid, traj)])
        rec = {"id": rid, "task": task.id, "attempt": j, "pass": ok, "reward": reward, "reward_parts": parts,
               "score": result.score, "outcome": result.outcome, "end_reason": end,
               "failure": failure_mode(end, result.outcome, ok),
               "turns": len(traj.turns) if traj is not None else 0,
               "tokens": len(traj.token_ids) if traj is not None else 0,
               "policy_tokens": traj.num_policy_tokens if traj is not None else 0,
               "parse_errors": sum(bool(t.errors) for t in traj.turns) if traj is not None else 0,
               "wall_s": round(wall_s, 3), "verify_s": round(result.duration_s, 3), "retries": retry,
               "finished_at": round(time.time(), 3),
               "difficulty": task.difficulty, "category": task.category,
               "error": (traj.error if traj is not None else None) or result.error, **self.extra}
        append_jsonl(self.attempts_path, [rec], sync=True)  # the commit point: a restart skips this attempt
        self.ran += 1
        return rec


async def _oracle_episode(task: Task, sb, run_oracle):
    """The oracle's run as a one-turn trajectory (the solution script and its output), for the transcript."""
    from jaxrl_term.agent.trajectory import Trajectory, TurnRecord

    t0 = time.monotonic()
    script = task.solution.files[task.solution.entry].data.decode(errors="replace")
    res = await run_oracle(task, sb)
    out = {"tool": "bash", "ok": getattr(res, "exit_code", 0) == 0, "text": getattr(res, "output", "") or "",
           "exit_code": getattr(res, "exit_code", None), "timed_out": bool(getattr(res, "timed_out", False)),
           "duration_s": time.monotonic() - t0}
    turn = TurnRecord(0, 0, 0, 0, "(the task's oracle solution)", [{"tool": "bash", "args": {"cmd": script}}],
                      [], [out], "oracle", 0.0, time.monotonic() - t0)
    return Trajectory(task.id, "oracle", [], [], [], 0, [], [turn], "oracle", duration_s=time.monotonic() - t0)


def _json_safe(x):
    from jaxrl_term.agent.transcript import _finite

    return _finite(x)


class _Progress:
    """A rich progress bar: tasks done of all, pass rate so far, ETA. Silent when off."""

    def __init__(self, enabled: bool, total: int, done: int, records: list[dict]):
        self.enabled, self.total, self.done = enabled, total, done
        self.passes = sum(r["pass"] for r in records)
        self.n = len(records)
        self._p = None

    def __enter__(self):
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._p = Progress(TextColumn("eval"), BarColumn(), MofNCompleteColumn(), TextColumn("tasks"),
                               TextColumn("pass {task.fields[rate]}"), TextColumn("ETA"), TimeRemainingColumn())
            self._p.start()
            self._id = self._p.add_task("eval", total=self.total, completed=self.done, rate=self._rate())
        return self

    def _rate(self) -> str:
        return f"{self.passes / self.n:.1%} ({self.passes}/{self.n})" if self.n else "-"

    def update(self, task_done: bool, record: dict | None) -> None:
        if record is not None:
            self.n += 1
            self.passes += bool(record["pass"])
        if self._p is not None:
            self._p.update(self._id, advance=int(task_done), rate=self._rate())

    def __exit__(self, *exc):
        if self._p is not None:
            self._p.stop()
