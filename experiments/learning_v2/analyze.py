"""The learning_v2 analysis: every held-out attempt of every arm, the curves, the paired comparisons with
bootstrap intervals, the failure modes, and the report. ``run.py`` calls :func:`main`; by hand:

    .venv/bin/python experiments/learning_v2/analyze.py --root runs/learning_v2 --results experiments/results

(reads ROOT/go_no_go.json, ROOT/data/data.json, ROOT/timing.json, and the command, scale and settings from
ROOT/settings.json, else from an earlier RESULTS/learning_v2.json, else run.py's ``SCALES[--scale]``).
``recheck.py`` recomputes every number from the outputs.

Inputs (run.py's layout under ROOT): held-out tasks ROOT/data/heldout.parquet; the SFT arm (step 0) is the
go/no-go evaluation ROOT/sft_{S}_eval/; the RL arms are ROOT/runs/{arm}_s{S}_r{R}/eval/step_{N:06d}/ (eval/stale/
is ignored). An attempt is the last transcript record per (task, attempt) of an evaluation directory, kept only
when attempts.jsonl lists it as finished (invalid attempts, in invalid.jsonl, are not scored).

Statistics. pass@1 of a run at a step = the mean over tasks of the task's pass rate over its attempts. pass@k of
the SFT policy = the mean over tasks of the unbiased 1 - C(n-c, k) / C(n, k). A comparison "A-B" pairs tasks: per
task the pass rate pooled over every seed and sample of arm A at its final step (the largest step every run of the
arm evaluated), minus the same for B ("sft": the SFT evaluations of the SFT seeds that A's final-step runs start
from, step 0); the mean over the tasks both have, and the 2.5 / 97.5 percentiles of that mean over 10,000 resamples
of tasks with replacement (numpy, seed 0). Per SFT seed: the same on that seed's runs and SFT evaluation only.
The curve's band: the same percentile bootstrap (2,000 resamples) of one arm's pooled per-task rates at a step.
goal_met: GRPO-SFT, DPPO-SFT, GRPO-RFT and DPPO-RFT intervals all above 0, and the placebo-SFT interval not above
0 (its lower end <= 0).

Failure modes (attempts.jsonl ``failure_mode``), from the bash commands of the episode (every action's
``args.cmd``, in order), the task's metadata and its data file (the ``family.Spec`` is rebuilt from
heldout.parquet and checked against the task id):

- a *write* is a command that redirects into the task's output path (``> DST``, ``>> DST``, ``tee DST``; DST as
  the full path, ``./name`` or the bare file name, the agent's cwd being /app);
- ``inspected``: a command before the first write (any command when there is none) that names the source file,
  runs a reader (head, cat, sed, less, more, awk, tail, nl, grep, od, xxd, hexdump) and redirects its output into
  no file (so the agent sees it);
- the *assumed format* of the last write: its delimiter is awk's ``-F`` (or ``FS=`` in ``-v``/the program;
  ``\\t``, ``\\x`` and ``[x]`` unescaped to the character; no ``-F``: whitespace), else ``cut``'s ``-d`` (no ``-d``:
  tab); a command with neither awk nor cut has no assumed format. It skips the header when it contains
  ``!/^#/``, ``!~ /^#/``, ``/^#/ {next}``, ``NR>1`` (``NR>=2``, ``NR!=1``), ``grep -v ..#``, ``tail -n +2``,
  ``sed 1d`` or ``sed '/^#/d'``;

and, first match wins:

1. ``passed``: the attempt passed;
2. ``wrong_format``: the last write's assumed format differs from the file's in a way that matters:
   ``family.run_awk(spec, assumed_delim, assumed_skip) != spec.expected`` (the task's op and field under the
   assumed format; e.g. an unskipped header does not change a sum). When the spec cannot be rebuilt:
   (assumed delimiter != the file's and op != count) or (header, not skipped and op in values/distinct/count);
3. ``gave_up``: no write at all (nor any other redirect into a file, /dev/null and ``2>`` aside) and the episode
   ended ``finished`` (the agent declared it done);
4. ``turn_limit``: the episode ended ``max_turns``;
5. ``other``: anything else (right format but wrong field, op or file, parse errors, context_full, timeouts, ...).

``failure_modes[arm]["by_grade"]`` holds the same counts per task grade. The lift decomposition
(``failure_modes[arm]["lift"]``) splits the change in the attempt-level pass rate from
the SFT policy (step 0, same SFT seeds) to the arm's final step into cells (inspected or not) x grade: a cell's
contribution is its passes divided by all attempts of its side, so the contributions' changes sum to the total.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

import family  # noqa: E402

RL_ARMS = ("grpo", "dppo", "rft", "placebo")
ARMS = ("sft",) + RL_ARMS
COMPARISONS = ("grpo-sft", "dppo-sft", "grpo-rft", "dppo-rft", "placebo-sft", "rft-sft", "grpo-placebo")
GOAL_ABOVE = ("grpo-sft", "dppo-sft", "grpo-rft", "dppo-rft")  # lower end > 0
GOAL_NOT_ABOVE = ("placebo-sft",)  # lower end <= 0
MODES = ("passed", "wrong_format", "gave_up", "turn_limit", "other")
BOOT, BOOT_SEED, BAND_BOOT = 10_000, 0, 2_000
READERS = ("head", "cat", "sed", "less", "more", "awk", "tail", "nl", "grep", "od", "xxd", "hexdump")
_QUOTED = r"(?:'([^']*)'|\"([^\"]*)\"|([^\s'\";}|&]+))"
SKIP_RES = tuple(re.compile(p) for p in (
    r"!\s*/\^?\\?#", r"!~\s*/\^?\\?#", r"/\^?\\?#/\s*\{?\s*next", r"\bNR\s*(?:>\s*1|>=\s*2|!=\s*1)(?!\d)",
    r"grep\s+-v\s+\S*#", r"tail\s+-n\s*\+2\b", r"sed\s+['\"]?(?:1d|/\^?\\?#/d)"))
AWK_RE = re.compile(r"(?<![\w-])[gm]?awk(?![\w-])")
CUT_RE = re.compile(r"(?<![\w-])cut(?![\w-])")
FS_RES = (re.compile(r"(?<!\S)-F\s*" + _QUOTED), re.compile(r"(?<!\w)FS\s*=\s*" + _QUOTED))
CUT_D_RE = re.compile(r"(?<!\S)(?:-d\s*|--delimiter=)" + _QUOTED)
ANY_OUT_RE = re.compile(r"(?<![0-9&>])>>?\s*(?!&|\s*/dev/null)[^\s;&|]+|(?<![\w-])tee\s+(?:-a\s+)?[^\s;&|-]")
READER_RE = re.compile(r"(?<![\w-])(?:" + "|".join(READERS) + r")(?![\w-])")


# ------------------------------------------------------------------------------------------ loading


def read_jsonl(path: Path) -> list[dict]:
    """Records of a JSONL file (a line cut by a kill is skipped); [] when it does not exist."""
    out = []
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    return out


def eval_dirs(root: Path) -> list[tuple[str, int, int | None, int, Path]]:
    """(arm, SFT seed, RL seed, step, directory) of every evaluation under ``root``."""
    out = []
    for d in sorted(root.glob("sft_*_eval")):
        m = re.fullmatch(r"sft_(\d+)_eval", d.name)
        if m and d.is_dir():
            out.append(("sft", int(m.group(1)), None, 0, d))
    for run in sorted((root / "runs").glob("*")):
        m = re.fullmatch(r"(" + "|".join(RL_ARMS) + r")_s(\d+)_r(\d+)", run.name)
        if not m:
            continue
        for d in sorted((run / "eval").glob("step_*")):
            if d.is_dir() and re.fullmatch(r"step_\d+", d.name):
                out.append((m.group(1), int(m.group(2)), int(m.group(3)), int(d.name[5:]), d))
    return out


def episodes(d: Path) -> list[dict]:
    """The scored attempts of one evaluation: the last transcript per (task, attempt), kept only when
    attempts.jsonl records the attempt as finished (when that file exists)."""
    last = {(r.get("task"), r.get("attempt")): r for r in read_jsonl(d / "transcripts.jsonl")}
    if (d / "attempts.jsonl").exists():
        done = {(r.get("task"), r.get("attempt")) for r in read_jsonl(d / "attempts.jsonl")}
        last = {k: v for k, v in last.items() if k in done}
    return list(last.values())


def rebuild(task) -> family.Spec | None:
    """The task's ``family.Spec`` from its metadata and data file, or None when that does not give its id back."""
    m = task.metadata
    try:
        name = m["src"].rsplit("/", 1)[1]
        lines = task.environment.files[name].data.decode().splitlines()
        if m["header"]:
            lines = lines[1:]
        records = tuple((a, b, int(c), int(d)) for a, b, c, d in (ln.split(m["delim"]) for ln in lines))
        k = None if m["k"] is None else int(m["k"])
        spec = family.Spec(m.get("split", "heldout"), m["op"], k, m["src"], m["dst"], m["delim"], bool(m["header"]),
                           records, tuple(m["template"]), task.instruction)
    except (KeyError, ValueError, TypeError, IndexError, AttributeError):
        return None
    return spec if family.task_id(spec) == task.id else None


# ------------------------------------------------------------------------------------ failure modes


def commands(tr: dict) -> list[str]:
    """The bash commands of an episode, in order."""
    out = []
    for t in tr.get("turns") or []:
        for a in t.get("actions") or []:
            args = a.get("args")
            cmd = args.get("cmd") if isinstance(args, dict) else args
            if a.get("tool", "bash") == "bash" and isinstance(cmd, str):
                out.append(cmd)
    return out


def _path_re(path: str) -> str:
    """A regex for ``path`` as the agent may name it from /app: full, ./name or bare."""
    folder, name = path.rsplit("/", 1)
    return rf"(?<![\w./-])['\"]?(?:{re.escape(folder)}/|\./)?{re.escape(name)}(?![\w.-])"


def is_write(cmd: str, dst: str) -> bool:
    p = _path_re(dst)
    return bool(re.search(r">>?\s*" + p, cmd) or re.search(r"(?<![\w-])tee\s+(?:-a\s+)?" + p, cmd))


def reads(cmd: str, src: str, dst: str) -> bool:
    """Shows the agent the source file: names it, runs a reader, redirects its output into no file."""
    return (not is_write(cmd, dst) and not ANY_OUT_RE.search(cmd) and bool(re.search(_path_re(src), cmd))
            and bool(READER_RE.search(cmd)))


def _unescape(s: str) -> str:
    if len(s) == 2 and s[0] == "\\":
        return "\t" if s[1] == "t" else s[1]
    m = re.fullmatch(r"\[(.)\]", s)
    return m.group(1) if m else s


def _first(res, cmd: str) -> str | None:
    for r in res:
        m = r.search(cmd)
        if m:
            return _unescape(next(g for g in m.groups() if g is not None))
    return None


def assumed_format(cmd: str) -> tuple[str, bool] | None:
    """(delimiter, skips '#' lines) a command assumes, or None when it uses neither awk nor cut."""
    skip = any(r.search(cmd) for r in SKIP_RES)
    if AWK_RE.search(cmd):
        d = _first(FS_RES, cmd)
        return (" " if d in (None, "", " ") else d), skip
    if CUT_RE.search(cmd):
        d = _first((CUT_D_RE,), cmd)
        return ("\t" if not d else d), skip
    return None


def format_matters(fmt: tuple[str, bool], meta: dict, spec: family.Spec | None) -> bool:
    delim, skip = fmt
    if spec is not None:
        try:
            return family.run_awk(spec, delim, skip) != spec.expected
        except (ValueError, IndexError):
            pass
    op = meta.get("op")
    return (delim != meta.get("delim") and op != "count") or (
        bool(meta.get("header")) and not skip and op in ("values", "distinct", "count"))


def classify(tr: dict, meta: dict, spec: family.Spec | None) -> tuple[str, bool]:
    """(failure mode, inspected) of one attempt (the rules of the module docstring)."""
    cmds = commands(tr)
    src, dst = meta.get("src", ""), meta.get("dst", "")
    writes = [i for i, c in enumerate(cmds) if dst and is_write(c, dst)]
    before = cmds[: writes[0]] if writes else cmds
    inspected = bool(src) and any(reads(c, src, dst) for c in before)
    if tr.get("pass"):
        return "passed", inspected
    fmt = assumed_format(cmds[writes[-1]]) if writes else None
    if fmt is not None and format_matters(fmt, meta, spec):
        return "wrong_format", inspected
    end = tr.get("end_reason")
    if not writes and end == "finished" and not any(ANY_OUT_RE.search(c) for c in cmds):
        return "gave_up", inspected
    if end == "max_turns":
        return "turn_limit", inspected
    return "other", inspected


def collect(root: Path, tasks: dict, specs: dict) -> tuple[list[dict], dict]:
    """attempts.jsonl's records of every evaluation under ``root``, and what was left out."""
    rows, left = [], Counter()
    for arm, s, r, step, d in eval_dirs(root):
        for tr in episodes(d):
            task = tasks.get(tr.get("task"))
            if task is None:
                left["unknown_task"] += 1
                continue
            meta = dict(task.metadata)
            mode, inspected = classify(tr, meta, specs.get(task.id))
            rows.append({"arm": arm, "sft_seed": s, "seed": r, "step": step, "task_id": task.id,
                         "instruction": task.instruction, "sample": tr.get("attempt"), "passed": bool(tr.get("pass")),
                         "failure_mode": mode, "inspected": inspected, "grade": meta.get("grade"),
                         "default_ok": meta.get("default_ok"), "op": meta.get("op"),
                         "end_reason": tr.get("end_reason"), "turns": len(tr.get("turns") or [])})
    order = {a: i for i, a in enumerate(ARMS)}
    rows.sort(key=lambda x: (order[x["arm"]], x["sft_seed"], x["seed"] or 0, x["step"], x["task_id"], x["sample"]))
    return rows, dict(left)


# ---------------------------------------------------------------------------------------- statistics


def task_rates(rows: list[dict]) -> dict[str, float]:
    by: dict[str, list[bool]] = defaultdict(list)
    for x in rows:
        by[x["task_id"]].append(x["passed"])
    return {t: sum(v) / len(v) for t, v in by.items()}


def pass1(rows: list[dict]) -> float | None:
    r = task_rates(rows)
    return sum(r.values()) / len(r) if r else None


def pass_at_k(rows: list[dict]) -> dict[str, float]:
    """Unbiased pass@k, k = 1 .. the smallest number of attempts of a task, averaged over tasks."""
    by: dict[str, list[bool]] = defaultdict(list)
    for x in rows:
        by[x["task_id"]].append(x["passed"])
    if not by:
        return {}
    kmax = min(len(v) for v in by.values())
    out = {}
    for k in range(1, kmax + 1):
        vals = [1.0 - math.comb(len(v) - sum(v), k) / math.comb(len(v), k) for v in by.values()]
        out[str(k)] = sum(vals) / len(vals)
    return out


def bootstrap(values: np.ndarray, resamples: int, seed: int = BOOT_SEED) -> tuple[float, float]:
    """95% percentile interval of the mean of ``values`` over resamples with replacement."""
    if len(values) == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), (resamples, len(values)))].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(lo), float(hi)


def paired(a_rows: list[dict], b_rows: list[dict]) -> dict:
    a, b = task_rates(a_rows), task_rates(b_rows)
    tasks = sorted(set(a) & set(b))
    if not tasks:
        return {"tasks": 0, "mean": None, "lo": None, "hi": None}
    d = np.array([a[t] - b[t] for t in tasks])
    lo, hi = bootstrap(d, BOOT)
    return {"tasks": len(tasks), "a_pass@1": sum(a[t] for t in tasks) / len(tasks),
            "b_pass@1": sum(b[t] for t in tasks) / len(tasks), "mean": sum(d.tolist()) / len(tasks),
            "lo": lo, "hi": hi}


class Index:
    """The attempts grouped by arm, SFT seed, RL seed and step."""

    def __init__(self, rows: list[dict]):
        self.rows = rows
        self.runs: dict[tuple, list[dict]] = defaultdict(list)
        for x in rows:
            self.runs[(x["arm"], x["sft_seed"], x["seed"], x["step"])].append(x)

    def arms(self) -> list[str]:
        return [a for a in ARMS if any(k[0] == a for k in self.runs)]

    def final_step(self, arm: str) -> int | None:
        """The largest step every run of ``arm`` evaluated (0 for sft; else the largest step of any run)."""
        if arm == "sft":
            return 0
        steps: dict[tuple, set[int]] = defaultdict(set)
        for a, s, r, n in self.runs:
            if a == arm:
                steps[(s, r)].add(n)
        if not steps:
            return None
        common = set.intersection(*steps.values())
        return max(common) if common else max(set.union(*steps.values()))

    def select(self, arm: str, step: int, sft_seeds=None) -> list[dict]:
        return [x for (a, s, r, n), v in self.runs.items() if a == arm and n == step
                and (sft_seeds is None or s in sft_seeds) for x in v]

    def sft_seeds(self, arm: str, step: int) -> set[int]:
        return {s for (a, s, r, n) in self.runs if a == arm and n == step}

    def side(self, arm: str, seeds=None, *, base: str | None = None) -> list[dict]:
        """An arm's attempts at its final step; sft: step 0 of the SFT seeds ``base``'s final-step runs use."""
        if arm == "sft":
            use = self.sft_seeds(base, self.final_step(base)) if base not in (None, "sft") else None
            if seeds is not None:
                use = set(seeds) if use is None else use & set(seeds)
            return self.select("sft", 0, use)
        return self.select(arm, self.final_step(arm), seeds)


def modes_block(rows: list[dict]) -> dict:
    n = len(rows)
    counts = Counter(x["failure_mode"] for x in rows)
    insp = sum(x["inspected"] for x in rows)
    return {"attempts": n, "counts": {m: counts.get(m, 0) for m in MODES},
            "shares": {m: counts.get(m, 0) / n if n else None for m in MODES},
            "inspected": insp, "inspected_share": insp / n if n else None,
            "pass_rate": counts.get("passed", 0) / n if n else None}


def lift(base: list[dict], new: list[dict]) -> dict:
    grades = sorted({x["grade"] for x in base + new}, key=lambda g: (g is None, g))
    cells, nb, nn = [], len(base), len(new)
    for insp in (True, False):
        for g in grades:
            b = [x for x in base if x["inspected"] == insp and x["grade"] == g]
            a = [x for x in new if x["inspected"] == insp and x["grade"] == g]
            pb, pa = sum(x["passed"] for x in b), sum(x["passed"] for x in a)
            cells.append({"inspected": insp, "grade": g, "sft_attempts": len(b), "sft_passes": pb,
                          "sft_share": len(b) / nb if nb else None, "sft_pass_rate": pb / len(b) if b else None,
                          "arm_attempts": len(a), "arm_passes": pa, "arm_share": len(a) / nn if nn else None,
                          "arm_pass_rate": pa / len(a) if a else None,
                          "contribution_change": (pa / nn if nn else 0.0) - (pb / nb if nb else 0.0)})
    by_insp = {("inspected" if i else "not_inspected"): sum(c["contribution_change"] for c in cells
                                                            if c["inspected"] == i) for i in (True, False)}
    total = (sum(x["passed"] for x in new) / nn if nn else 0.0) - (sum(x["passed"] for x in base) / nb if nb else 0.0)
    return {"total_change": total, **by_insp, "cells": cells}


def go_no_go(gates: list[dict]) -> dict:
    verdict = "not run" if not gates else ("go" if all(g.get("verdict") == "go" for g in gates) else "no-go")
    return {"gates": gates, "verdict": verdict}


def goal(comparisons: dict) -> dict:
    checks, met = {}, True
    for name in GOAL_ABOVE + GOAL_NOT_ABOVE:
        c = comparisons.get(name) or {}
        lo = c.get("lo")
        ok = lo is not None and not math.isnan(lo) and (lo > 0 if name in GOAL_ABOVE else lo <= 0)
        checks[name] = {"required": "lower end > 0" if name in GOAL_ABOVE else "lower end <= 0", "lo": lo, "ok": ok}
        met = met and ok
    return {"met": met, "checks": checks}


def summarize(rows: list[dict]) -> dict:
    ix = Index(rows)
    arms: dict = {}
    for (a, s, r, n), v in sorted(ix.runs.items(), key=lambda kv: (ARMS.index(kv[0][0]), kv[0][1:3], kv[0][3])):
        key = f"s{s}" if a == "sft" else f"s{s}_r{r}"
        arms.setdefault(a, {}).setdefault(key, {})[str(n)] = pass1(v)
    sft_rows = ix.select("sft", 0)
    pak = {f"s{s}": pass_at_k(ix.select("sft", 0, {s})) for s in sorted({x["sft_seed"] for x in sft_rows})}
    pak["all"] = pass_at_k(sft_rows)
    final = {a: ix.final_step(a) for a in ix.arms()}
    curves: dict = {}
    for a in ix.arms():
        if a == "sft":
            continue
        steps = sorted({n for (b, s, r, n) in ix.runs if b == a and n != 0})  # step 0: the SFT evaluation
        curve = {}
        for n in [0] + steps:
            v = ix.side("sft", base=a) if n == 0 else ix.select(a, n)
            rates = np.array(list(task_rates(v).values()))
            lo, hi = bootstrap(rates, BAND_BOOT)
            curve[str(n)] = {"pass@1": pass1(v), "lo": lo, "hi": hi, "tasks": len(rates), "attempts": len(v),
                             "runs": len({(x["sft_seed"], x["seed"]) for x in v})}
        curves[a] = curve
    comparisons: dict = {}
    for name in COMPARISONS:
        a, b = name.split("-")
        if a not in final or b not in final:
            continue
        base = a if b == "sft" else None
        c = {"a": a, "b": b, "a_step": final[a], "b_step": final[b],
             **paired(ix.side(a), ix.side(b, base=base))}
        c["excludes_0"] = c["lo"] is not None and (c["lo"] > 0 or c["hi"] < 0)
        seeds = sorted(ix.sft_seeds(a, final[a]) & (ix.sft_seeds(b, final[b]) if b != "sft" else
                                                     ix.sft_seeds("sft", 0)))
        c["per_sft_seed"] = {f"s{s}": paired(ix.side(a, {s}), ix.side(b, {s}, base=base)) for s in seeds}
        comparisons[name] = c
    failure: dict = {"sft": {"final_step": 0, "steps": {"0": modes_block(sft_rows)}}}
    for a in ix.arms():
        if a == "sft":
            continue
        base, new = ix.side("sft", base=a), ix.side(a)
        grades = sorted({x["grade"] for x in base + new}, key=lambda g: (g is None, g))
        by_grade = {str(g): {"0": modes_block([x for x in base if x["grade"] == g]),
                             str(final[a]): modes_block([x for x in new if x["grade"] == g])} for g in grades}
        failure[a] = {"final_step": final[a], "sft_seeds": sorted(ix.sft_seeds(a, final[a])),
                      "steps": {"0": modes_block(base), str(final[a]): modes_block(new)}, "by_grade": by_grade,
                      "lift": lift(base, new)}
    return {"arms": arms, "curves": curves, "final_steps": final, "sft_pass_at_k": pak, "comparisons": comparisons,
            "failure_modes": failure}


# ------------------------------------------------------------------------------------------- outputs


def _clean(x):
    """JSON-safe: NaN -> None, tuples -> lists."""
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def plot(out: dict, path: Path, scale: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"grpo": "tab:blue", "dppo": "tab:orange", "rft": "tab:green", "placebo": "tab:gray"}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for a, curve in out["curves"].items():
        steps = sorted(curve, key=int)
        x = [int(n) for n in steps]
        y = [curve[n]["pass@1"] for n in steps]
        lo = [curve[n]["lo"] for n in steps]
        hi = [curve[n]["hi"] for n in steps]
        ax.plot(x, y, marker="o", color=colors.get(a), label=a)
        ax.fill_between(x, lo, hi, color=colors.get(a), alpha=0.15, linewidth=0)
    ax.set_xlabel("RL step (0 = SFT policy)")
    ax.set_ylabel("held-out pass@1")
    ax.set_title(f"learning_v2 ({scale}): held-out pass@1, mean over seeds, 95% bootstrap over tasks")
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _f(x, nd: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{nd}f}"


def _ci(c: dict) -> str:
    if c.get("mean") is None:
        return "n/a"
    return f"{c['mean']:+.3f} [{c['lo']:+.3f}, {c['hi']:+.3f}]"


def wall_time(timing: dict) -> tuple[float | None, str]:
    if "rl_total" in timing:
        return timing["rl_total"], "timing.json rl_total: run.py's wall time from its start, summed over invocations"
    stages = [v for k, v in timing.items() if not k.startswith("rl/")]
    return (sum(stages), "the sum of timing.json's stages") if stages else (None, "no timing.json")


def summary_paragraph(out: dict) -> str:
    comp, g, gates = out["comparisons"], out["goal"], out["go_no_go"]
    sft = out["failure_modes"].get("sft", {}).get("steps", {}).get("0", {})
    sft_p = pass1_of_sft(out)
    parts = [f"**Result ({out['scale']} scale): the pre-registered goal was {'met' if g['met'] else 'NOT met'}.**",
             (f"The SFT policy's held-out pass@1 is {_f(sft_p)} ({sft.get('attempts', 0)} attempts over "
             f"{out['heldout_tasks']} held-out tasks).")]
    finals = [f"{a.upper()} {_f(out['curves'][a][str(out['final_steps'][a])]['pass@1'])}"
              for a in RL_ARMS if a in out["curves"]]
    if finals:
        parts.append("At each arm's final step: " + ", ".join(finals) + ".")
    diffs = [f"{n} {_ci(comp[n])}" for n in COMPARISONS if n in comp]
    if diffs:
        parts.append("Paired differences of pass@1 (mean [95% bootstrap interval over tasks]): " + "; ".join(diffs)
                     + ".")
    fm = out["failure_modes"]
    insp = [f"{a.upper()} {_f(fm[a]['steps'][str(fm[a]['final_step'])]['inspected_share'], 2)}"
            for a in RL_ARMS if a in fm]
    if insp and sft.get("inspected_share") is not None:
        parts.append(f"Share of attempts that read the file before writing: SFT {_f(sft['inspected_share'], 2)}; "
                     + ", ".join(insp) + " at the final step.")
    lifts = [f"{a.upper()} {fm[a]['lift']['total_change']:+.3f} ({fm[a]['lift']['inspected']:+.3f} via attempts "
             f"that inspected, {fm[a]['lift']['not_inspected']:+.3f} via the others)" for a in RL_ARMS if a in fm]
    if lifts:
        parts.append("Change of the attempt-level pass rate from SFT: " + "; ".join(lifts) + ".")

    def why(n: str) -> str:
        c = g["checks"][n]
        return f"{n}: no results" if c["lo"] is None else f"{n}: lower end {c['lo']:+.3f}, required {c['required']}"

    failed = [n for n, c in g["checks"].items() if not c["ok"]]
    if failed:
        parts.append("Criteria not met: " + "; ".join(why(n) for n in failed) + ".")
    else:
        parts.append("GRPO and DPPO each beat both SFT and RFT with intervals excluding 0, and the placebo's "
                     "interval against SFT is not above 0.")
    if gates["verdict"] != "go":
        parts.append(f"Go/no-go verdict before RL: {gates['verdict']}" +
                     ("; the arms ran anyway (--force), so read the comparisons with that in mind." if comp else "."))
    return " ".join(parts)


def pass1_of_sft(out: dict) -> float | None:
    vals = [v["0"] for v in out["arms"].get("sft", {}).values()]
    return sum(vals) / len(vals) if vals else None


def _rel(p: Path) -> str:
    p = Path(p).resolve()
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p)


def markdown(out: dict, root: Path | str = "ROOT", results: Path | str = "DIR") -> str:
    L = ["# learning_v2: does RL improve held-out pass@1 beyond SFT and RFT?", "", summary_paragraph(out), ""]
    L += ["## Go/no-go (the SFT policy on the held-out tasks, before any RL)", "",
          "| SFT seed | tasks | samples | pass@1 | pass@k | pass@k - pass@1 | mixed tasks | verdict |",
          "|---|---|---|---|---|---|---|---|"]
    for gt in out["go_no_go"]["gates"]:
        k = gt.get("samples")
        L.append(f"| {gt.get('sft_seed')} | {gt.get('tasks')} | {k} | {_f(gt.get('pass@1'))} | "
                 f"{_f(gt.get(f'pass@{k}'))} | {_f(gt.get('pass@k_minus_pass@1'))} | {_f(gt.get('mixed_frac'), 2)} | "
                 f"{gt.get('verdict')} |")
    L += ["", f"Overall: **{out['go_no_go']['verdict']}**.", ""]
    dj = out["disjointness"]
    keys = ("instructions", "exact", "ngram", "parameters", "combination", "template", "template_slot")
    L += ["## Disjointness of the held-out tasks", "",
          (f"{dj.get('heldout_tasks')} held-out tasks ({dj.get('heldout_instructions')} distinct instructions); "
          f"overlap counts against each training source ({dj.get('ngram_n')}-word n-grams), all must be 0: "
          f"all zero = **{dj.get('all_zero')}**."), "", "| source | " + " | ".join(keys) + " |",
          "|---" * (len(keys) + 1) + "|"]
    for src, v in dj.items():
        if isinstance(v, dict):
            L.append(f"| {src} | " + " | ".join(str(v.get(k)) for k in keys) + " |")
    L += ["", "## Held-out pass@1 per arm and step", "", "![curve](learning_v2.png)", "",
          ("Mean over seeds (per task pooled over seeds and samples), 95% bootstrap interval over tasks; step 0 is "
          "the SFT policy."), ""]
    steps = sorted({int(n) for c in out["curves"].values() for n in c}
                   | {int(n) for runs in out["arms"].values() for by in runs.values() for n in by})
    arms = list(out["curves"])
    if arms:
        L += ["| step | " + " | ".join(arms) + " |", "|---" * (len(arms) + 1) + "|"]
        for n in steps:
            cells = []
            for a in arms:
                c = out["curves"][a].get(str(n))
                most = max(v["runs"] for k, v in out["curves"][a].items() if k != "0")
                few = "" if c is None or n == 0 or c["runs"] == most else f" ({c['runs']} of {most} runs)"
                cells.append("" if c is None else f"{_f(c['pass@1'])} [{_f(c['lo'])}, {_f(c['hi'])}]{few}")
            L.append(f"| {n} | " + " | ".join(cells) + " |")
    L += ["", "Per run (pass@1 by step):", "", "| arm | run | " + " | ".join(map(str, steps)) + " |",
          "|---" * (len(steps) + 2) + "|"]
    for a, runs in out["arms"].items():
        for key, by in runs.items():
            L.append(f"| {a} | {key} | " + " | ".join(_f(by.get(str(n))) if str(n) in by else "" for n in steps)
                     + " |")
    pak = out["sft_pass_at_k"]
    ks = sorted({int(k) for v in pak.values() for k in v})
    if ks:
        L += ["", "SFT policy pass@k (unbiased estimator):", "", "| SFT seed | " + " | ".join(map(str, ks)) + " |",
              "|---" * (len(ks) + 1) + "|"]
        for s, v in pak.items():
            L.append(f"| {s} | " + " | ".join(_f(v.get(str(k))) for k in ks) + " |")
    L += ["", "## Comparisons (final step, paired over tasks, 10,000 bootstrap resamples)", "",
          "| comparison | steps | tasks | A pass@1 | B pass@1 | A - B [95% CI] | per SFT seed |",
          "|---|---|---|---|---|---|---|"]
    for name, c in out["comparisons"].items():
        per = "; ".join(f"{s}: {_ci(v)}" for s, v in c["per_sft_seed"].items())
        L.append(f"| {name} | {c['a_step']} vs {c['b_step']} | {c['tasks']} | {_f(c.get('a_pass@1'))} | "
                 f"{_f(c.get('b_pass@1'))} | {_ci(c)} | {per} |")
    L += ["", "Goal checks: " + ", ".join(f"{n} {v['required']}: {'ok' if v['ok'] else 'no'}"
                                          for n, v in out["goal"]["checks"].items())
          + f"; goal met: **{out['goal_met']}**.", ""]
    L += ["## Failure modes", "", ("Shares of attempts (rules: analyze.py's docstring; `inspected` = looked at the "
          "file before the first write)."), "",
          "| arm | step | attempts | " + " | ".join(MODES) + " | inspected |", "|---" * (len(MODES) + 4) + "|"]
    for a, fm in out["failure_modes"].items():
        for n, b in fm["steps"].items():
            L.append(f"| {a} | {n} | {b['attempts']} | " + " | ".join(_f(b["shares"][m], 2) for m in MODES)
                     + f" | {_f(b['inspected_share'], 2)} |")
    L += ["", ("Lift decomposition (attempt-level pass rate, arm at its final step minus SFT): contribution "
          "change = passes in the cell / all attempts, arm minus SFT."), "",
          ("| arm | total | via inspected | via not inspected | cells (inspected?, grade: SFT share/rate -> "
          "arm share/rate, change) |"), "|---|---|---|---|---|"]
    for a, fm in out["failure_modes"].items():
        if "lift" not in fm:
            continue
        lf = fm["lift"]
        cells = "; ".join(f"{'I' if c['inspected'] else 'N'} g{c['grade']}: {_f(c['sft_share'], 2)}/"
                          f"{_f(c['sft_pass_rate'], 2)} -> {_f(c['arm_share'], 2)}/{_f(c['arm_pass_rate'], 2)}, "
                          f"{c['contribution_change']:+.3f}" for c in lf["cells"] if c["sft_attempts"] or
                          c["arm_attempts"])
        L.append(f"| {a} | {lf['total_change']:+.3f} | {lf['inspected']:+.3f} | {lf['not_inspected']:+.3f} | "
                 f"{cells} |")
    L += ["", "Change of each failure mode's share (and of the inspected share) from SFT to the arm's final step, "
          "by grade (grade = how many of delimiter and header differ from the default):", "",
          "| arm | grade | attempts SFT / arm | " + " | ".join(MODES) + " | inspected |",
          "|---" * (len(MODES) + 4) + "|"]
    for a, fm in out["failure_modes"].items():
        for g, by in fm.get("by_grade", {}).items():
            b0, b1 = by["0"], by[str(fm["final_step"])]
            if not (b0["attempts"] and b1["attempts"]):
                continue
            L.append(f"| {a} | {g} | {b0['attempts']} / {b1['attempts']} | "
                     + " | ".join(f"{b1['shares'][m] - b0['shares'][m]:+.2f}" for m in MODES)
                     + f" | {b1['inspected_share'] - b0['inspected_share']:+.2f} |")
    wall, how = wall_time(out["timing"])
    L += ["", "## Run", "", f"Command: `{out['command']}`", "", (f"Scale: {out['scale']}; settings: "
          f"`{json.dumps(out['settings'], sort_keys=True)}`"), "",
          f"Wall time: {_f(wall / 3600 if wall is not None else None, 2)} h ({how}). Stages (s): "
          + ", ".join(f"{k} {v:.0f}" for k, v in out["timing"].items() if isinstance(v, (int, float))), "",
          "## Recompute", "",
          ("Every attempt is in `learning_v2/attempts.jsonl` (arm, seeds, step, task, sample, pass, failure mode). "
          "Recompute every number here independently (its own statistics, and the disjointness against freshly "
          "generated tasks):"), "", f"    .venv/bin/python experiments/learning_v2/recheck.py --results {results}", "",
          "and the analysis itself from the run directory:", "",
          f"    .venv/bin/python experiments/learning_v2/analyze.py --root {root} --results {results}", ""]
    return "\n".join(L)


def main(root: Path, results: Path, *, command: str, scale: str, settings: dict, gates: list[dict],
         data_info: dict, timing: dict) -> dict:
    """Write RESULTS/learning_v2/attempts.jsonl, learning_v2.json, learning_v2.png and learning_v2.md; return
    the json's content."""
    from jaxrl_term.tasks.formats import load_tasks

    root, results = Path(root), Path(results)
    tasks = {t.id: t for t in load_tasks(str(root / "data" / "heldout.parquet"))}
    specs = {tid: rebuild(t) for tid, t in tasks.items()}
    rows, left_out = collect(root, tasks, specs)
    (results / "learning_v2").mkdir(parents=True, exist_ok=True)
    tmp = results / "learning_v2" / "attempts.jsonl.tmp"
    tmp.write_text("".join(json.dumps(x, separators=(",", ":")) + "\n" for x in rows))
    tmp.replace(results / "learning_v2" / "attempts.jsonl")
    s = summarize(rows)
    out = {"experiment": "learning_v2", "scale": scale, "command": command, "settings": settings,
           "go_no_go": go_no_go(gates), "disjointness": data_info.get("disjointness", {}), **s,
           "bootstrap": {"resamples": BOOT, "band_resamples": BAND_BOOT, "seed": BOOT_SEED, "level": 0.95,
                         "unit": "task"},
           "tasks_rebuilt": sum(v is not None for v in specs.values()), "heldout_tasks": len(tasks),
           "attempts": len(rows), "left_out": left_out, "timing": timing}
    g = goal(s["comparisons"])
    out["goal"], out["goal_met"] = g, g["met"]
    out = _clean(out)
    (results / "learning_v2.json").write_text(json.dumps(out, indent=1))
    plot(out, results / "learning_v2.png", scale)
    (results / "learning_v2.md").write_text(markdown(out, _rel(root), _rel(results)))
    print(f"learning_v2: {len(rows)} attempts; goal met: {out['goal_met']}; results in {results}", flush=True)
    return out


def cli() -> None:
    ap = argparse.ArgumentParser(description="learning_v2 analysis (see the module docstring)")
    ap.add_argument("--root", required=True, help="run.py's root (with data/, sft_*_eval/, runs/)")
    ap.add_argument("--results", default=None, help="where the results go (default ROOT/results)")
    ap.add_argument("--scale", default=None, help="without ROOT/settings.json: run.py's scale (default: pilot if "
                    "ROOT is named pilot, else full)")
    args = ap.parse_args()
    root = Path(args.root).resolve()

    def load(p: Path, default):
        return json.loads(p.read_text()) if p.is_file() else default

    results = Path(args.results).resolve() if args.results else root / "results"
    sj = load(root / "settings.json", None) or load(results / "learning_v2.json", None)
    if sj is not None:
        settings = sj.get("settings", sj)
        scale = sj.get("scale") or args.scale or ("pilot" if root.name == "pilot" else "full")
        command = sj.get("command") or "python " + " ".join(sys.argv)
    else:
        import importlib.util

        spec = importlib.util.spec_from_file_location("learning_v2_run", HERE / "run.py")
        run = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(run)
        scale = args.scale or ("pilot" if root.name == "pilot" else "full")
        settings, command = run.SCALES[scale], "python " + " ".join(sys.argv)
    main(root, results, command=command, scale=scale, settings=settings, gates=load(root / "go_no_go.json", []),
         data_info=load(root / "data" / "data.json", {}), timing=load(root / "timing.json", {}))


if __name__ == "__main__":
    cli()
