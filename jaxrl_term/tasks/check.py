"""Task checks: build each task, run the oracle solution (or nothing), verify.

Every task must score 1 with ``--agent oracle`` and 0 with ``--agent nop``; one that does not is reported
broken with the reason. For formats without solutions (TB-RL), ``--agent nop`` reports which tests already
pass in the initial state.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shlex
import time
from collections.abc import Sequence

from jaxrl_term.reward.verifier import verify
from jaxrl_term.tasks.env import open_task_sandbox
from jaxrl_term.tasks.task import Task, resolve_env

AGENTS = ("oracle", "nop")


@dataclasses.dataclass
class CheckResult:
    task_id: str
    agent: str
    score: float | None
    outcome: str  # scored | test_timeout | tampered | verifier_sabotaged | verifier_error | build_error |
    #              sandbox_error | no_solution | verifier_needs_network
    passed: dict[str, bool]
    duration_s: float
    broken: bool
    reason: str = ""

    @property
    def initially_passing(self) -> list[str]:
        return sorted(n for n, ok in self.passed.items() if ok) if self.agent == "nop" else []


async def run_oracle(task: Task, sb):
    """Copy the task's solution into /solution and run its entry script in the agent's shell (its result)."""
    assert task.solution is not None
    for rel, blob in task.solution.files.items():
        await sb.write_file(f"/solution/{rel}", blob.data, blob.mode)
    env = resolve_env(task.solution_env, f"task {task.id}: [solution]") if task.solution_env else {}
    prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in env.items())  # Harbor's [solution] env, for solve.sh only
    return await sb.run(f"{'env ' + prefix if prefix else ''}bash /solution/{task.solution.entry}",
                        timeout_s=task.agent_timeout_s)


async def check_task(task: Task, agent: str, *, backend: str = "docker", builder=None, scoring: str = "weighted",
                     limits: dict | None = None, network_preflight: bool = False) -> CheckResult:
    """Run ``agent`` on ``task`` and verify. ``network_preflight`` (oracle): first with the verifier offline; a
    task that fails there is run again with the verifier online, and one that passes online is reported as
    ``verifier_needs_network`` (broken when the run's own settings give its verifier no network)."""
    if not network_preflight or agent != "oracle" or task.solution is None:
        return await _check(task, agent, backend=backend, builder=builder, scoring=scoring, limits=limits)
    from jaxrl_term.tasks.env import phase_policies

    limits = dict(limits or {})
    own = phase_policies(task, limits.get("agent_network", "task"), limits.get("verifier_network", "task"))
    off = await _check(task, agent, backend=backend, builder=builder, scoring=scoring,
                       limits={**limits, "verifier_network": "none"})
    if not off.broken:
        return off
    on = await _check(task, agent, backend=backend, builder=builder, scoring=scoring,
                      limits={**limits, "verifier_network": "public"})
    took = off.duration_s + on.duration_s
    if on.broken:
        if on.outcome == "verifier_needs_network" or off.outcome == "verifier_needs_network":
            return dataclasses.replace(on, outcome="verifier_needs_network", duration_s=took, reason=(
                "cannot be verified here: verifier needs network, and it fails online too (this machine's "
                f"public network does not reach what it fetches): {on.reason}"))
        return dataclasses.replace(on, duration_s=took)
    broken = not own["verifier"].online
    return dataclasses.replace(on, outcome="verifier_needs_network", duration_s=took, broken=broken, reason=(
        "verifier needs network: the oracle passes with the verifier online and fails offline ("
        f"{off.reason}); " + ("its verifier phase has no network under these settings: set [verifier] "
                              "network_mode = \"public\" in task.toml or sandbox.verifier_network=public" if broken
                              else "its settings grant the verifier network")))


async def _check(task: Task, agent: str, *, backend: str, builder, scoring: str, limits: dict | None) -> CheckResult:
    t0 = time.monotonic()
    if agent not in AGENTS:
        raise ValueError(f"--agent {agent!r}; use one of {AGENTS}")
    if agent == "oracle" and task.solution is None:
        return CheckResult(task.id, agent, None, "no_solution", {}, 0.0, False, "the task has no oracle solution")
    try:
        async with open_task_sandbox(task, backend=backend, builder=builder, **(limits or {})) as sb:
            if agent == "oracle":
                await run_oracle(task, sb)
            # the same verifier as training: tamper checks included (a cheating "oracle" is not "ok"), and a
            # verifier error re-checked on a fresh sandbox of the task
            fresh = getattr(sb, "reopen", None) or (lambda: open_task_sandbox(
                task, backend=backend, builder=builder, **(limits or {})))
            res = await verify(task, sb, scoring=scoring, fresh=fresh)
    except Exception as e:  # noqa: BLE001 - a task that cannot even start is reported, not raised
        kind = "build_error" if type(e).__name__ == "ImageBuildError" else "sandbox_error"
        return CheckResult(task.id, agent, None, kind, {}, time.monotonic() - t0, True, f"{type(e).__name__}: {e}")
    want = 1.0 if agent == "oracle" else 0.0
    reason = ""
    if res.outcome == "verifier_needs_network":
        reason = res.error or "verifier needs network"
    elif res.outcome != "scored":
        reason = f"{res.outcome}: {res.error}"
    elif res.score != want:
        failing = [n for n, ok in res.passed.items() if ok != (agent == "oracle")]
        reason = f"scored {res.score:.3f}, expected {want:.0f}" + (f" (tests: {failing})" if failing else "")
    return CheckResult(task.id, agent, res.score, res.outcome, dict(res.passed), time.monotonic() - t0,
                       bool(reason), reason)


async def check_tasks(tasks: Sequence[Task], agent: str, *, jobs: int = 2, backend: str = "docker", builder=None,
                      scoring: str = "weighted", limits: dict | None = None, progress=None,
                      network_preflight: bool = False) -> list[CheckResult]:
    """Every task checked (``jobs`` at once); ``progress(result)`` is called as each one finishes."""
    if builder is None and backend == "docker":
        from jaxrl_term.sandbox.images import ImageBuilder

        builder = ImageBuilder()
    sem = asyncio.Semaphore(max(1, jobs))

    async def one(t):
        async with sem:
            r = await check_task(t, agent, backend=backend, builder=builder, scoring=scoring, limits=limits,
                                 network_preflight=network_preflight)
        if progress is not None:
            progress(r)
        return r

    return list(await asyncio.gather(*(one(t) for t in tasks)))


def summary(results: Sequence[CheckResult]) -> dict:
    return {
        "agent": results[0].agent if results else None,
        "tasks": len(results),
        "ok": sum(not r.broken for r in results),
        "broken": [{"task": r.task_id, "reason": r.reason} for r in results if r.broken],
        # verifiers that need network (all of them, also those whose settings grant it): fix or set the policy
        "verifier_needs_network": [r.task_id for r in results if r.outcome == "verifier_needs_network"],
        "mean_score": (sum(r.score for r in results if r.score is not None) /
                       max(1, sum(r.score is not None for r in results))),
        "initially_passing": {r.task_id: r.initially_passing for r in results if r.initially_passing},
        "results": [dataclasses.asdict(r) for r in results],
    }


def print_table(results: Sequence[CheckResult]) -> None:
    from rich.console import Console
    from rich.markup import escape  # reasons quote task.toml sections ("[verifier] ..."): text, not markup
    from rich.table import Table

    table = Table(title=f"check --agent {results[0].agent if results else '?'}")
    for col in ("task", "score", "outcome", "tests passed", "seconds", "status"):
        table.add_column(col)
    for r in results:
        npass = sum(r.passed.values())
        # no per-test results (a Harbor test.sh reports only its reward): "-", not "0/0"
        table.add_row(r.task_id, "-" if r.score is None else f"{r.score:.3f}", r.outcome,
                      f"{npass}/{len(r.passed)}" if r.passed else "-", f"{r.duration_s:.1f}",
                      "[red]BROKEN[/red] " + escape(r.reason) if r.broken else "[green]ok[/green]")
    Console().print(table)


def dump_json(results: Sequence[CheckResult], path: str) -> None:
    with open(path, "w") as f:
        json.dump(summary(results), f, indent=2)
