"""Sandbox costs, side by side in one run: our persistent shell vs one ``docker exec`` per command.

The peer is what Terminal-Bench-RL did: ``docker exec <container> bash -c <cmd>`` for every command (here
through the same docker SDK, ``exec_run``; and through the CLI). Measured:

1. command round trip on a warm sandbox (``echo hi``), p50 / p99;
2. container create -> ready -> remove: ``open_sandbox`` (container + shell ready + first command + remove)
   vs a bare ``docker run --rm --network none IMAGE true``;
3. N = 1, 8, 16, 32 sandboxes running 20 commands each concurrently: wall time, commands/s, failures.

    .venv/bin/python experiments/bench/sandbox.py [--image jaxrl-term/base:trixie] [--repeats 200]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

from jaxrl_term.sandbox.base import open_sandbox
from jaxrl_term.sandbox.docker import _call, client


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def ms(x):
    return f"{x * 1000:.1f}"


async def round_trips(image: str, n: int):
    ours, sdk, cli = [], [], []
    async with open_sandbox("docker", image, memory_mb=512) as sb:
        cid = sb.container.id
        for _ in range(10):  # warm up all three paths
            await sb.run("echo hi")
            sb.container.exec_run(["bash", "-c", "echo hi"])
        for _ in range(n):  # interleaved
            t0 = time.perf_counter()
            r = await sb.run("echo hi")
            ours.append(time.perf_counter() - t0)
            assert r.output == "hi\n"
            t0 = time.perf_counter()
            res = await _call(sb.container.exec_run, ["bash", "-c", "echo hi"])
            sdk.append(time.perf_counter() - t0)
            assert res.output == b"hi\n"
            if len(cli) < n // 4:
                t0 = time.perf_counter()
                subprocess.run(["docker", "exec", cid, "bash", "-c", "echo hi"], capture_output=True, check=True)
                cli.append(time.perf_counter() - t0)
    return ours, sdk, cli


async def lifecycles(image: str, n: int):
    ours, bare = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        async with open_sandbox("docker", image, memory_mb=512) as sb:
            await sb.run("true")
        ours.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        subprocess.run(["docker", "run", "--rm", "--network", "none", image, "true"], capture_output=True, check=True)
        bare.append(time.perf_counter() - t0)
    return ours, bare


async def concurrent(image: str, n: int, cmds: int, mode: str):
    failures = 0

    async def one(i):
        nonlocal failures
        async with open_sandbox("docker", image, memory_mb=256) as sb:
            for j in range(cmds):
                if mode == "ours":
                    r = await sb.run(f"echo {i}-{j}", timeout_s=60)
                    ok = r.exit_code == 0 and r.output == f"{i}-{j}\n"
                else:
                    res = await _call(sb.container.exec_run, ["bash", "-c", f"echo {i}-{j}"])
                    ok = res.exit_code == 0 and res.output == f"{i}-{j}\n".encode()
                failures += not ok

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
    failures += sum(isinstance(r, BaseException) for r in results)
    return time.perf_counter() - t0, failures


async def main(args):
    client().ping()
    lines = [
        "# Sandbox: persistent shell (ours) vs one `docker exec` per command (Terminal-Bench-RL's way)\n",
        f"Docker {client().version()['Version']}, image `{args.image}`, {platform.machine()}, "
        f"{os.cpu_count()} CPUs. Reproduce: `.venv/bin/python experiments/bench/sandbox.py`\n",
    ]
    ours, sdk, cli = await round_trips(args.image, args.repeats)
    lines += [
        "## Command round trip on a warm sandbox (`echo hi`)\n",
        "| method | n | p50 ms | p99 ms | p50 ratio vs ours |",
        "| --- | --- | --- | --- | --- |",
        f"| ours: persistent shell | {len(ours)} | {ms(pct(ours, 50))} | {ms(pct(ours, 99))} | 1.00 |",
        f"| docker exec per command (SDK) | {len(sdk)} | {ms(pct(sdk, 50))} | {ms(pct(sdk, 99))} | "
        f"{pct(sdk, 50) / pct(ours, 50):.1f} |",
        f"| docker exec per command (CLI) | {len(cli)} | {ms(pct(cli, 50))} | {ms(pct(cli, 99))} | "
        f"{pct(cli, 50) / pct(ours, 50):.1f} |",
        "",
    ]
    print("\n".join(lines[-6:]), flush=True)
    life, bare = await lifecycles(args.image, args.lifecycles)
    lines += [
        "## Container create -> ready -> remove\n",
        "| method | n | p50 ms | p99 ms |",
        "| --- | --- | --- | --- |",
        f"| ours: open_sandbox + shell ready + first command + close | {len(life)} | {ms(pct(life, 50))} | "
        f"{ms(pct(life, 99))} |",
        f"| bare `docker run --rm --network none IMAGE true` | {len(bare)} | {ms(pct(bare, 50))} | "
        f"{ms(pct(bare, 99))} |",
        "",
    ]
    print("\n".join(lines[-5:]), flush=True)
    lines += [
        f"## N sandboxes x {args.cmds} commands, concurrently (includes creating and removing the containers)\n",
        "| N | ours wall s | ours cmds/s | ours failures | exec-per-command wall s | exec cmds/s | exec failures "
        "| throughput ratio ours/exec |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for n in (1, 8, 16, 32):
        runs = {"ours": [], "exec": []}
        fails = {"ours": 0, "exec": 0}
        for _ in range(args.concurrency_repeats):
            for mode in ("ours", "exec"):
                wall, f = await concurrent(args.image, n, args.cmds, mode)
                runs[mode].append(wall)
                fails[mode] += f
        w = {k: statistics.median(v) for k, v in runs.items()}
        tput = {k: n * args.cmds / w[k] for k in w}
        row = (f"| {n} | {w['ours']:.2f} | {tput['ours']:.0f} | {fails['ours']} | {w['exec']:.2f} | "
               f"{tput['exec']:.0f} | {fails['exec']} | {tput['ours'] / tput['exec']:.2f} |")
        lines.append(row)
        print(row, flush=True)
    lines.append(f"\nWall times are medians of {args.concurrency_repeats} runs.")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--image", default="jaxrl-term/base:trixie")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--lifecycles", type=int, default=10)
    ap.add_argument("--cmds", type=int, default=20)
    ap.add_argument("--concurrency-repeats", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "sandbox.md"))
    asyncio.run(main(ap.parse_args()))
