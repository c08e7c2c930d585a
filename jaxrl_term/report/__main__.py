"""``python -m jaxrl_term.report RUN_DIR`` writes RUN_DIR/report.html and report.md and prints the HTML path;
``python -m jaxrl_term.report compare RUN_A RUN_B [--json]`` prints per-task differences;
``python -m jaxrl_term.report screenshot REPORT.html OUT.png [--click]`` renders it in headless Chromium."""

from __future__ import annotations

import argparse
import sys


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from jaxrl_term.report import compare, write_report
    from jaxrl_term.report.load import NotARunDir

    try:
        if argv[:1] == ["compare"]:
            ap = argparse.ArgumentParser(prog="python -m jaxrl_term.report compare")
            ap.add_argument("a")
            ap.add_argument("b")
            ap.add_argument("--json", action="store_true")
            args = ap.parse_args(argv[1:])
            out = compare(args.a, args.b)
            if args.json:
                import json

                print(json.dumps(out, indent=2))
                return 0
            from rich.console import Console
            from rich.table import Table

            t = Table(title=f"A {args.a}: pass@1 {_pct(out['a']['pass@1'])}, pass@k {_pct(out['a']['pass@k'])}  |  "
                            f"B {args.b}: pass@1 {_pct(out['b']['pass@1'])}, pass@k {_pct(out['b']['pass@k'])}")
            for col in ("task", "pass@1 A", "pass@1 B", "delta"):
                t.add_column(col)
            for r in out["tasks"]:
                d = r["delta"]
                t.add_row(r["task"], _pct(r["a"]), _pct(r["b"]), "-" if d is None else f"{d:+.1%}")
            Console().print(t)
            print(f"B better on {out['better']} task(s), worse on {out['worse']}")
            return 0
        if argv[:1] == ["screenshot"]:
            ap = argparse.ArgumentParser(prog="python -m jaxrl_term.report screenshot")
            ap.add_argument("html")
            ap.add_argument("png")
            ap.add_argument("--click", default=None, help="search text; the first matching transcript is opened")
            args = ap.parse_args(argv[1:])
            from jaxrl_term.report.browser import screenshot

            screenshot(args.html, args.png, search=args.click)
            print(args.png)
            return 0
        ap = argparse.ArgumentParser(prog="python -m jaxrl_term.report")
        ap.add_argument("run_dir")
        args = ap.parse_args(argv)
        print(write_report(args.run_dir))
        return 0
    except (NotARunDir, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
