"""Which instruction parameters the policy carried into its command: the diagnostic behind PREREGISTRATION.md's
changes 7-9 (a policy that recalls parameter combinations instead of composing them fails on held-out cells).

    .venv/bin/python experiments/learning_v2/params.py RUN_ROOT/sft_0_eval RUN_ROOT/data/heldout.parquet [--json OUT]

For each evaluated attempt (the last transcript per task and attempt), the *command* is the last one that writes
the task's output path, else the last awk command, and:

- ``field``: the command's awk program refers to the asked field (``$k``; ``cut -f k``) and to no other field
  (ops other than ``count``);
- ``file``: a shell word of the command is the data file (``names_file`` of analyze.py without the globs and the
  other-extension stems: the exact name, as ``/app/data.EXT``, ``./data.EXT`` or ``data.EXT``);
- ``op``: the command's shape is the op's as the teacher writes it (``family.command``): ``n++``/``print NR``/``wc -l``
  = count, ``+=`` = sum, ``sort -n`` and ``tail`` = max, ``sort -u``/``uniq`` = distinct, else values.

Attempts with no such command count as wrong on every parameter (``no_command``). Also counted: attempts that
read the data file before writing (``inspected``, and of those, ``inspected_passed``) and ``analyze.classify``'s
failure modes (``mode_*``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from analyze import classify, commands, episodes, is_write, shell_words  # noqa: E402


def op_of(cmd: str) -> str:
    if re.search(r"n\+\+|wc\s+-l|print\s+NR\b", cmd):  # NR>1 alone skips a header: not a count
        return "count"
    if "+=" in cmd:
        return "sum"
    if re.search(r"sort\s+-\w*n", cmd) and "tail" in cmd:
        return "max"
    if re.search(r"sort\s+-\w*u|\buniq\b", cmd):
        return "distinct"
    return "values"


def fields_of(cmd: str) -> set[int]:
    return {int(x) for x in re.findall(r"\$(\d+)", cmd)} | {int(x) for x in re.findall(r"cut\b.*?-f\s*(\d+)", cmd)}


def names_exactly(cmd: str, src: str) -> bool:
    folder, name = src.rsplit("/", 1)
    return any(w in (src, f"./{name}", name) for w in shell_words(cmd))


def check(tr: dict, meta: dict) -> dict[str, bool] | None:
    cmds = commands(tr)
    writes = [c for c in cmds if is_write(c, meta["dst"])] or [c for c in cmds if "awk" in c]
    if not writes:
        return None
    cmd = writes[-1]
    out = {"file": names_exactly(cmd, meta["src"]), "op": op_of(cmd) == meta["op"]}
    if meta["op"] != "count":
        out["field"] = fields_of(cmd) == {int(meta["k"])}
    return out


def summarize(eval_dir: Path, heldout: Path) -> dict:
    from jaxrl_term.tasks.formats import load_parquet

    meta = {t.id: t.metadata for t in load_parquet(heldout)}
    tally: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for tr in episodes(eval_dir):
        m = meta.get(tr.get("task"))
        if m is None:
            continue
        res, (mode, inspected) = check(tr, m), classify(tr, m, None)
        for key in ("all", m["op"]):
            t = tally[key]
            t["attempts"] += 1
            t["passed"] += bool(tr.get("pass"))
            t["inspected"] += inspected  # read the data file before writing the answer (analyze.classify)
            t["inspected_passed"] += inspected and bool(tr.get("pass"))
            t[f"mode_{mode}"] += 1
            if res is None:
                t["no_command"] += 1
                continue
            for p, ok in res.items():
                t[f"{p}_asked"] += 1
                t[f"{p}_right"] += ok
    return {k: dict(v) for k, v in sorted(tally.items())}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("eval_dir", type=Path)
    ap.add_argument("heldout", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    out = summarize(args.eval_dir, args.heldout)
    for key, t in out.items():
        rates = ", ".join(f"{p} {t.get(p + '_right', 0)}/{t.get(p + '_asked', 0)}" for p in ("field", "file", "op")
                          if t.get(p + "_asked"))
        print(f"{key:9s} attempts {t['attempts']:4d}, passed {t['passed']:4d}, no command {t.get('no_command', 0):3d}; "
              f"right: {rates}; inspected {t['inspected']} (passed {t['inspected_passed']})")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
