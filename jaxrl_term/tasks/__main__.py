"""``python -m jaxrl_term.tasks ls|convert|check``.

    ls SRC                       table of id, difficulty, category, #tests
    convert SRC DST              DST.parquet (our Parquet) or DST/ (Harbor task directories)
    check SRC --agent oracle|nop [-j N] [--backend docker|local] [--json OUT]
          [--agent-network task|none|public] [--verifier-network task|none|public] [--public-network NET]
          [--network-preflight]   oracle offline first; one that passes only online: "verifier needs network"

SRC: a TB1 or Harbor task dir or folder of them, a TB-RL .csv, a .parquet, or ``builtin[:train|heldout]``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from jaxrl_term.tasks.formats import count_tests, export_harbor, load_tasks, save_parquet
from jaxrl_term.tasks.task import TaskFormatError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxrl_term.tasks")
    sub = ap.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("ls", help="list tasks")
    ls.add_argument("src")
    ls.add_argument("--skip-bad", action="store_true")
    cv = sub.add_parser("convert", help="convert tasks to Parquet (DST.parquet) or Harbor dirs (DST/)")
    cv.add_argument("src")
    cv.add_argument("dst")
    cv.add_argument("--skip-bad", action="store_true")
    ck = sub.add_parser("check", help="run the oracle (or nothing) and verify every task")
    ck.add_argument("src")
    ck.add_argument("--agent", choices=["oracle", "nop"], required=True)
    ck.add_argument("-j", "--jobs", type=int, default=2)
    ck.add_argument("--backend", choices=["docker", "local"], default="docker")
    ck.add_argument("--scoring", choices=["weighted", "binary"], default="weighted")
    ck.add_argument("--limit", type=int, default=None, help="only the first N tasks")
    ck.add_argument("--ids", default=None, help="comma-separated task ids")
    ck.add_argument("--json", default=None, help="write the JSON summary here")
    ck.add_argument("--skip-bad", action="store_true")
    for phase in ("agent", "verifier"):
        ck.add_argument(f"--{phase}-network", choices=["task", "none", "public"], default="task",
                        help=f"the {phase} phase's network: the task's own policy (default), never, or always")
    ck.add_argument("--public-network", default="jaxrl-public", help="the Docker network 'public' means")
    ck.add_argument("--network-preflight", action="store_true",
                    help="with --agent oracle: run each task's verifier offline first; report those that pass only "
                         "online as 'verifier needs network'")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    from jaxrl_term.sandbox.base import unwind_on_sigterm

    unwind_on_sigterm()
    errors: list[str] = []
    try:
        tasks = load_tasks(args.src, skip_bad=args.skip_bad, errors=errors)
    except TaskFormatError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for e in errors:
        print(f"skipped: {e}", file=sys.stderr)
    if args.cmd == "ls":
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"{args.src}: {len(tasks)} tasks")
        for col in ("id", "difficulty", "category", "#tests"):
            table.add_column(col)
        for t in tasks:
            n = count_tests(t)
            # a Harbor verifier (tests/test.sh) may test in any language: no pytest function found is not "0 tests"
            shown = f"test.sh ({n} pytest)" if t.tests.runner == "harbor" and n else \
                "test.sh" if t.tests.runner == "harbor" else str(n)
            table.add_row(t.id, str(t.difficulty or "-"), str(t.category or "-"), shown)
        Console(width=160).print(table)
        return 0
    if args.cmd == "convert":
        from pathlib import Path

        dst = Path(args.dst)
        if not args.dst.endswith(".parquet") and (dst.suffix or (dst.exists() and not dst.is_dir())):
            print(f"error: convert DST {args.dst!r}: give DST.parquet (our Parquet) or a directory for Harbor task "
                  f"directories (no file suffix); {dst.suffix or 'a file'} is neither", file=sys.stderr)
            return 2
        if args.dst.endswith(".parquet"):
            print(f"wrote {len(tasks)} tasks to {save_parquet(tasks, args.dst)}")
        else:
            print(f"wrote {len(tasks)} Harbor task dirs under {export_harbor(tasks, args.dst)}")
        return 0
    from jaxrl_term.tasks.check import check_tasks, dump_json, print_table, summary

    if args.ids:
        wanted = set(args.ids.split(","))
        tasks = [t for t in tasks if t.id in wanted]
    if args.limit:
        tasks = tasks[: args.limit]
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn(f"check --agent {args.agent}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.description}"), TimeElapsedColumn(), transient=True) as bar:
        job = bar.add_task("", total=len(tasks))
        broken = [0]

        def tick(r) -> None:
            broken[0] += r.broken
            bar.update(job, advance=1, description=f"{broken[0]} broken; last: {r.task_id}")

        limits = {"agent_network": args.agent_network, "verifier_network": args.verifier_network,
                  "public_network": args.public_network}
        results = asyncio.run(check_tasks(tasks, args.agent, jobs=args.jobs, backend=args.backend,
                                          scoring=args.scoring, progress=tick, limits=limits,
                                          network_preflight=args.network_preflight))
    print_table(results)
    s = summary(results)
    print(f"{s['ok']}/{s['tasks']} ok, {len(s['broken'])} broken")
    if s["verifier_needs_network"]:
        print(f"verifier needs network: {', '.join(s['verifier_needs_network'])}")
    if args.json:
        dump_json(results, args.json)
    return 0 if not s["broken"] else 1


if __name__ == "__main__":
    from jaxrl_term.utils.cli import guard

    sys.exit(guard(main)())
