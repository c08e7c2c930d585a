"""Sandboxes over Docker engines, side by side in one run: N episodes' command mix on 1 engine vs 2 engines.

Each episode: a built-in task's sandbox (its image built on first use on every engine that needs it, the base
image copied to a new engine), a command mix like an agent's (listing, reading, writing, a short Python
computation, a grep over a generated file, a failing command), then the verifier. The same N episodes, with the
same total concurrency ``--concurrency``, run through ``open_task_sandbox`` with an ``EnginePool`` of one engine
(the machine's own, capacity C) and of two (plus a second daemon this script starts on its own socket and data
root, like ``tests/test_engines.py``; capacity C/2 each). A warm-up round builds the images on both engines first, so the table compares
placement and engine throughput, not image builds.

On one machine the two daemons share its cores, disk and kernel: the ratio shows the pool's overhead and the
gain from a second daemon's own API/containerd queue, not a second node's hardware.

Failover, in the same run: the two-engine pool again with a fault on the second engine, each episode retried
like the rollout's (a ``SandboxError`` reruns it, ``--retries`` times, then it is dropped): a second engine
that never answers (a socket that does not exist); one stopped (SIGSTOP) ``--fault-at`` s into the run for
``--fault-for`` s, then resumed (SIGCONT); one killed (SIGKILL) ``--fault-at`` s in, then restarted after
``--fault-for`` s. Rows: episodes dropped and retried, seconds from the fault until the engine left the rotation,
its seconds out of rotation, whether it rejoined, and wall time against the healthy two-engine row.

    .venv/bin/python experiments/bench/sandbox_pool.py [--episodes 16] [--concurrency 8] [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import signal
import statistics
import time
from pathlib import Path

from jaxrl_term.reward.verifier import verify
from jaxrl_term.sandbox.base import SandboxError
from jaxrl_term.sandbox.engines import EnginePool, local_daemon, restart
from jaxrl_term.sandbox.images import ImageBuilder
from jaxrl_term.tasks.builtin import generate
from jaxrl_term.tasks.env import open_task_sandbox

MIX = ["ls -la /app", "cat /etc/os-release | head -3", "echo 'some text' > /app/notes.txt && wc -c /app/notes.txt",
       "python3 -c 'print(sum(i * i for i in range(200000)))'", "seq 1 20000 > /tmp/n && grep -c 7 /tmp/n",
       "false || echo failed-as-expected", "cd /app && ls && pwd", "head -c 20000 /dev/urandom | sha256sum"]


async def episode(task, engines, builder, commands: list[float], retries: int = 0) -> tuple[bool, int]:
    """(scored, attempts that failed): a SandboxError reruns it up to ``retries`` times, as the rollout does."""
    for attempt in range(retries + 1):
        try:
            async with open_task_sandbox(task, builder=builder, engines=engines) as sb:
                for cmd in MIX:
                    r = await sb.run(cmd, 60)
                    commands.append(r.duration_s)
                    if r.exit_code != 0:
                        raise SandboxError(f"{cmd}: {r}")  # (a lost shell: an infrastructure failure here)
                res = await verify(task, sb)
                if res.outcome != "scored":
                    raise SandboxError(f"verifier: {res.outcome}")
            return True, attempt
        except SandboxError:
            if attempt == retries:
                return False, attempt + 1


async def run(tasks, hosts, concurrency: int, builder, *, retries: int = 0, fault=None, **pool_kw) -> dict:
    per_engine = max(1, concurrency // len(hosts))
    engines = EnginePool([{"url": u, "capacity": per_engine, "name": f"e{i}"} for i, u in enumerate(hosts)],
                         **pool_kw)
    commands: list[float] = []
    t0 = time.monotonic()
    side = asyncio.create_task(fault(engines)) if fault else None
    done = await asyncio.gather(*(episode(t, engines, builder, commands, retries) for t in tasks))
    wall = time.monotonic() - t0
    detected, rejoin = await side if side else (None, None)
    m = engines.metrics()
    engines.close()
    out = {"wall_s": wall, "episodes_per_s": len(tasks) / wall, "command_p50_ms": 1e3 * statistics.median(commands),
           "placed": {e.name: int(m[f"engine/{e.name}/created"]) for e in engines.engines},
           "create_ms": {e.name: m[f"engine/{e.name}/create_ms"] for e in engines.engines},
           "dropped": sum(not ok for ok, _ in done), "retried": sum(n for _, n in done),
           "detect_s": detected, "rejoin_s": rejoin, "hang_bound_s": engines.hang_bound_s}
    last = engines.engines[-1]
    out.update(out_s=last.out_total_s(), rejoined=last.rejoined, up_at_end=last.healthy)
    return out


def stop_for(state: dict, at_s: float, for_s: float, kill: bool):
    """A fault on the second engine ``at_s`` into the run: SIGSTOP then SIGCONT after ``for_s`` (a hang), or
    SIGKILL then a restart after ``for_s``. Returns (seconds from the fault until it left the rotation, seconds from
    its return until it was back in rotation)."""

    async def fault(engines) -> float | None:
        await asyncio.sleep(at_s)
        e = engines.engines[-1]
        pid = state["proc"].pid
        os.kill(pid, signal.SIGKILL if kill else signal.SIGSTOP)
        t0 = time.monotonic()
        detected = None
        while time.monotonic() - t0 < for_s:
            if detected is None and not e.healthy:
                detected = time.monotonic() - t0
            await asyncio.sleep(0.05)
        if kill:
            await asyncio.to_thread(state["proc"].wait)
            await asyncio.to_thread(restart, state)
        else:
            os.kill(pid, signal.SIGCONT)
        t1 = time.monotonic()
        while not e.healthy and time.monotonic() - t1 < 300:  # a probe after its cool-down puts it back
            await asyncio.sleep(0.05)
        return detected, (time.monotonic() - t1 if e.healthy else None)

    return fault


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8, help="sandboxes at once, over all engines")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--retries", type=int, default=2, help="failover rows: reruns of an episode (the rollout's 2)")
    ap.add_argument("--fault-at", type=float, default=4.0, help="failover rows: seconds into the run")
    ap.add_argument("--fault-for", type=float, default=30.0, help="failover rows: seconds stopped / down")
    ap.add_argument("--cooldown", type=float, default=5.0, help="failover rows: sandbox.docker.cooldown_s")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "sandbox_pool.md"))
    args = ap.parse_args()
    families = ["create_file", "count_matches", "sort_uniq", "permissions"]
    tasks = [generate(families[i % len(families)], "easy", seed=100 + i) for i in range(args.episodes)]
    default = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    builder = ImageBuilder()
    with local_daemon() as second:
        both = [default, second["url"]]
        # warm-up: every task image on each engine (and the base image copied to the new one)
        for host in both:
            asyncio.run(run(tasks, [host], args.concurrency, builder))
        rows = {"1 engine": [], "2 engines": []}
        for _ in range(args.repeats):  # interleaved, so drift on this machine hits both alike
            rows["1 engine"].append(asyncio.run(run(tasks, [default], args.concurrency, builder)))
            rows["2 engines"].append(asyncio.run(run(tasks, both, args.concurrency, builder)))
        kw = dict(retries=args.retries, cooldown_s=args.cooldown)
        faults = {
            "2 engines, healthy": asyncio.run(run(tasks, both, args.concurrency, builder, **kw)),
            "second never answers": asyncio.run(run(tasks, [default, "unix:///nonexistent/jrt-gone.sock"],
                                                    args.concurrency, builder, **kw)),
            f"second stopped (SIGSTOP) at {args.fault_at:g} s for {args.fault_for:g} s": asyncio.run(run(
                tasks, both, args.concurrency, builder, fault=stop_for(second, args.fault_at, args.fault_for, False),
                **kw)),
            f"second killed (SIGKILL) at {args.fault_at:g} s, restarted {args.fault_for:g} s later": asyncio.run(run(
                tasks, both, args.concurrency, builder, fault=stop_for(second, args.fault_at, args.fault_for, True),
                **kw)),
        }
    best = {k: min(v, key=lambda r: r["wall_s"]) for k, v in rows.items()}
    ratio = best["2 engines"]["episodes_per_s"] / best["1 engine"]["episodes_per_s"]
    lines = [
        "# Sandboxes over Docker engines: 1 vs 2 engines",
        "",
        f"`python experiments/bench/sandbox_pool.py --episodes {args.episodes} --concurrency {args.concurrency} "
        f"--repeats {args.repeats}` on {platform.node()} ({os.cpu_count()} CPUs), {time.strftime('%Y-%m-%d')}.",
        f"{args.episodes} episodes of a built-in task, each: sandbox up, {len(MIX)} commands (an agent's mix), the "
        f"verifier, sandbox removed; {args.concurrency} sandboxes at once in both rows (one engine: capacity "
        f"{args.concurrency}; two: {args.concurrency // 2} each); images already built on both engines (warm-up "
        f"round); best of {args.repeats}.",
        "",
        "| engines | wall s | episodes/s | command p50 ms | placed per engine | create ms per engine |",
        "|---|---|---|---|---|---|",
    ]
    for k, r in best.items():
        lines.append(f"| {k} | {r['wall_s']:.1f} | {r['episodes_per_s']:.3f} | {r['command_p50_ms']:.0f} | "
                     f"{r['placed']} | {', '.join(f'{n}: {v:.0f}' for n, v in r['create_ms'].items())} |")
    lines += ["", f"**2 engines / 1 engine throughput: {ratio:.2f}x.** Both daemons run on this one machine and "
              "share its cores: the ratio measures the pool's placement overhead and the second daemon's own "
              "request queue, not a second node. On a cluster each engine brings its node's cores, so episode "
              "throughput scales with the engines until the agent loop's host saturates.", ""]
    healthy = faults["2 engines, healthy"]["wall_s"]
    bound = faults["2 engines, healthy"]["hang_bound_s"]
    lines += [
        "## Failover: a fault on the second engine",
        "",
        f"The same {args.episodes} episodes and pool (capacity {args.concurrency // 2} per engine), each episode "
        f"rerun up to {args.retries} times after a sandbox error (the rollout's retries), `cooldown_s` "
        f"{args.cooldown:g}, liveness probes every 5 s bounded by 5 s, 2 misses (a hung engine out within "
        f"{bound:g} s). *Left after*: seconds from the fault until the engine was out of rotation; *back after*: "
        "seconds from its return (SIGCONT, restart) until a probe put it back.",
        "",
        "| second engine | dropped | attempts retried | left after s | back after s | out of rotation s | "
        "placed per engine | wall s | wall / healthy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def num(x):
        return "-" if x is None else f"{x:.1f}"

    for k, r in faults.items():
        lines.append(f"| {k} | {r['dropped']} of {args.episodes} | {r['retried']} | {num(r['detect_s'])} | "
                     f"{num(r['rejoin_s'])} | {r['out_s']:.1f} | {r['placed']} | {r['wall_s']:.1f} | "
                     f"{r['wall_s'] / healthy:.2f} |")
    lines.append("")
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
