"""``python -m jaxrl_term.report RUN_DIR [--out PATH]``: write the report, print the HTML path.
``python -m jaxrl_term.report compare RUN_A RUN_B [--json]``: per-task pass@1 differences of two evaluations.
``python -m jaxrl_term.report summary DIR... [--json] [--out TABLE.md]``: one row per training run (a sweep's dir:
its jobs), held-out pass@1 first and last, reward, overrides.
``python -m jaxrl_term.report screenshot REPORT.html OUT.png [--search TEXT]``: a PNG from headless Chromium.
A path that holds no run: one line on stderr, exit code 2."""

from __future__ import annotations

import argparse
import json
import sys

from jaxrl_term.report import NotARunDir, compare, summarize_runs, summary_markdown, write_report
from jaxrl_term.report.tables import pct


def overall(side: dict) -> str:
    ks = ", ".join(f"pass@{k} {pct(v)}" for k, v in (side.get("pass_at") or {}).items() if k != "1")
    step = f" (step {side['step']})" if side.get("step") is not None else ""
    return (f"{side['run']}{step}: pass@1 {pct(side.get('pass@1'))} ± {pct(side.get('pass@1_std'))}"
            + (f", {ks}" if ks else "") + f"; {side.get('tasks')} tasks, {side.get('attempts')} attempts")


def print_compare(out: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="per-task pass@1, sorted by delta (B - A)")
    for col, justify in (("task", "left"), ("pass@1 A", "right"), ("pass@1 B", "right"), ("delta", "right")):
        table.add_column(col, justify=justify)
    for r in out["tasks"]:
        d = r["delta"]
        style = "green" if (d or 0) > 0 else "red" if (d or 0) < 0 else None
        table.add_row(r["task"], pct(r["a"]), pct(r["b"]), "-" if d is None else f"{d:+.1%}", style=style)
    console = Console()
    console.print(table)
    console.print(f"A {overall(out['a'])}\nB {overall(out['b'])}\n"
                  f"B better on {out['better']} task(s), worse on {out['worse']}"
                  + (f"; only in A: {len(out['only_a'])}" if out["only_a"] else "")
                  + (f"; only in B: {len(out['only_b'])}" if out["only_b"] else ""), highlight=False)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["compare"]:
            ap = argparse.ArgumentParser(prog="python -m jaxrl_term.report compare")
            ap.add_argument("run_a")
            ap.add_argument("run_b")
            ap.add_argument("--json", action="store_true", help="print the comparison as JSON")
            args = ap.parse_args(argv[1:])
            out = compare(args.run_a, args.run_b)
            if args.json:
                print(json.dumps(out, indent=2))
            else:
                print_compare(out)
        elif argv[:1] == ["summary"]:
            ap = argparse.ArgumentParser(prog="python -m jaxrl_term.report summary")
            ap.add_argument("paths", nargs="+", help="training run dirs, or folders of them (a Hydra multirun dir)")
            ap.add_argument("--json", action="store_true", help="print the rows as JSON")
            ap.add_argument("--out", default=None, help="also write the markdown table to this file")
            args = ap.parse_args(argv[1:])
            rows = summarize_runs(args.paths)
            table = summary_markdown(rows)
            print(json.dumps(rows, indent=2) if args.json else table, end="" if not args.json else "\n")
            if args.out:
                with open(args.out, "w") as f:
                    f.write(table)
        elif argv[:1] == ["screenshot"]:
            ap = argparse.ArgumentParser(prog="python -m jaxrl_term.report screenshot")
            ap.add_argument("html")
            ap.add_argument("png")
            ap.add_argument("--search", default="", help="open the first transcript matching this text")
            args = ap.parse_args(argv[1:])
            from jaxrl_term.report.browser import screenshot

            print(screenshot(args.html, args.png, args.search))
        else:
            ap = argparse.ArgumentParser(prog="python -m jaxrl_term.report",
                                         description="Write RUN_DIR/report.html and report.md.")
            ap.add_argument("run_dir")
            ap.add_argument("--out", default=None, help="the HTML path (default RUN_DIR/report.html; .md beside it)")
            args = ap.parse_args(argv)
            print(write_report(args.run_dir, args.out))
    except (NotARunDir, OSError) as e:
        print(f"jaxrl_term.report: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
