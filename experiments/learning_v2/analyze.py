"""The learning_v2 analysis: every held-out attempt of every arm, the curves, the paired comparisons with
bootstrap intervals, the failure modes, the near-duplicate report and the report. ``run.py`` calls :func:`main`;
by hand:

    .venv/bin/python experiments/learning_v2/analyze.py --root runs/learning_v2 --results experiments/results

(reads ROOT/go_no_go.json, ROOT/data/data.json, ROOT/data/instructions.json, ROOT/timing.json, and the command,
scale and settings from ROOT/settings.json, else from an earlier RESULTS/learning_v2.json, else run.py's
``SCALES[--scale]``). ``recheck.py`` recomputes the numbers from the outputs.

Inputs (run.py's layout under ROOT): held-out tasks ROOT/data/heldout.parquet; the SFT arm (step 0) is the
go/no-go evaluation ROOT/sft_{S}_eval/; the RL arms are ROOT/runs/{arm}_s{S}_r{R}/eval/step_{N:06d}/ (eval/stale/
is ignored). An attempt is the last transcript record per (task, attempt) of an evaluation directory, kept only
when attempts.jsonl lists it as finished (invalid attempts, in invalid.jsonl, are not scored). An evaluation
*finished* when its directory holds summary.json (written at its end).

Final step, no fallback. An RL arm's final step is the settings' ``steps`` (the trainer always evaluates after
its last step; without ``steps`` in the settings: the largest step any run of the arm evaluated). Its runs are
the settings' ``sft_seeds`` x ``rl_seeds`` when the arm is in the settings' ``arms`` (else the runs found).
``final_step_check[arm]`` lists every run without a finished evaluation with attempts at that step; an arm with
any such run has no final step (``final_steps[arm]`` None), and every comparison with it is recorded as
``{"available": false, "reason": ...}`` (so is A-sft when an SFT seed that A's runs start from has no finished
SFT evaluation, A-B when the two final steps differ, and a comparison with an arm that has no evaluations).
Only these runs (and these SFT seeds) enter the comparisons and the failure modes at the final step.
Unavailable comparisons fail the goal. Nothing falls back to an earlier step.

Statistics. pass@1 of a run at a step = the mean over tasks of the task's pass rate over its attempts. pass@k of
the SFT policy, k = 1 .. the most valid attempts of a task: the mean of the unbiased 1 - C(n-c, k) / C(n, k) over
the tasks with n >= k valid attempts; tasks with fewer are excluded at that k (``sft_pass_at_k_tasks`` counts
them: ``excluded``; key ``all`` pools the SFT seeds' attempts per task). A comparison "A-B" pairs tasks: per task
the pass rate pooled over every run and sample of arm A at its final step (passes / attempts), minus the same for
B ("sft": the SFT evaluations of the SFT seeds of A's runs, step 0); ``mean`` is the mean of that difference
over the tasks both have. Its intervals (95%, percentile, 10,000 resamples each):

- ``ci95`` (= ``lo``, ``hi``; the pre-registered one, used by ``goal_met``): the paired bootstrap over tasks,
  tasks drawn with replacement (numpy default_rng(0)); runs are pooled, so training-seed variance is not in it;
- ``ci95_runs_tasks`` (hierarchical, default_rng(1)): each resample first draws, within every SFT seed
  separately, that seed's RL runs of each RL side with replacement (as many as it has; the SFT side's per-seed
  evaluation is fixed: one per seed, never redrawn), pools each task's passes / attempts over the drawn runs,
  then draws tasks with replacement and takes the mean difference (a task none of a resample's drawn runs
  attempted is left out of that resample's mean);
- ``ci95_instruction_clusters`` (default_rng(2)): held-out tasks share instructions (other data files), so
  whole instructions are drawn with replacement, each with all of its tasks; the statistic is the sum of the
  drawn tasks' differences over their number (``instruction_clusters`` = how many distinct instructions).

Also per comparison: ``per_sft_seed`` (the same on one SFT seed's runs and its SFT evaluation only, with
``ci95`` and ``ci95_runs_tasks``), ``sign_agrees_per_sft_seed`` (every per-seed mean > 0, or every one < 0),
and ``per_run``: for A-sft, each A run's final-step pass@1 minus its SFT seed's SFT pass@1, both on the tasks
the two have; for A-B of two RL arms, A's run s{S}_r{R} minus B's run s{S}_r{R} (same SFT start, same RL seed),
on the tasks both have. The curve's band: the task bootstrap (2,000 resamples) of one arm's pooled per-task
rates at a step.

Goal (pre-registered): ``goal_met``: the ``ci95`` of GRPO-SFT, DPPO-SFT, GRPO-RFT and DPPO-RFT all above 0
(lower end > 0) and that of placebo-SFT not above 0 (lower end <= 0). ``goal_met_strict``: the same rule with
``ci95_runs_tasks``; ``goal_met_instruction_clusters``: with ``ci95_instruction_clusters`` (``goal_strict`` and
``goal_instruction_clusters`` hold their checks). The stricter two are reported, not pre-registered.

Near duplicates (``disjointness_nearest``, from ROOT/data/instructions.json: keys sft_<seed> and rl are the
training instructions, heldout the held-out ones; both deduplicated first): for every distinct held-out
instruction, its nearest training instruction by (a) the Jaccard similarity of the sets of word 3-grams and
(b) the normalised character edit distance: Levenshtein distance (insert, delete, substitute one character) /
the longer text's length, 0 = identical, computed exactly (``edit_distances``; not difflib), and the
longest run of consecutive words it shares with any training instruction (words: ``family.words``, as the
pre-registered n-gram check, which forbids a shared run of ``family.NGRAM``); min / median / max of each over the
held-out instructions, the histogram of the longest shared run, and the closest pair by each measure.

Failure modes (attempts.jsonl ``failure_mode``), from the bash commands of the episode (every action's
``args.cmd``, in order), the task's metadata and its data file (the ``family.Spec`` is rebuilt from
heldout.parquet and checked against the task id):

- a *write* is a command that redirects into the task's output path (``> DST``, ``>> DST``, ``tee DST``; DST as
  the full path, ``./name`` or the bare file name, the agent's cwd being /app);
- a command *names the data file* when one of its shell words (shlex, operators split off) is a path in /app
  (``/app/x``, ``./x`` or ``x``) whose name is the file's name, a shell glob that matches it (``data.*``,
  ``data*``, ``*.csv``, ``*``), or the file's stem with another extension or none, glob characters allowed
  (``data.csv`` when the file is data.txt, ``data``): all of these show the agent the file or an error about it;
- ``inspected``: a command before the first write (any command when there is none) that names the data file,
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
(``failure_modes[arm]["lift"]``) splits the change in the attempt-level pass rate from the SFT policy (step 0,
the SFT seeds of the arm's runs) to the arm's final step into cells (inspected or not) x grade: a cell's
contribution is its passes divided by all attempts of its side, so the contributions' changes sum to the total.
An arm without a final step gets ``{"available": false, "reason": ...}`` there instead.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import re
import shlex
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
BOOT, BOOT_SEED, RUNS_SEED, CLUSTER_SEED, BAND_BOOT = 10_000, 0, 1, 2, 2_000
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
        records = tuple(family.parse_record(ln.split(m["delim"])) for ln in lines)
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


def shell_words(cmd: str) -> list[str]:
    """The shell words of ``cmd`` (quotes removed, operators such as | ; > split off); whitespace words when
    the quoting does not parse."""
    try:
        lex = shlex.shlex(cmd, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        return list(lex)
    except ValueError:
        return cmd.split()


def names_file(cmd: str, src: str) -> bool:
    """Whether a word of ``cmd`` is ``src`` as seen from its folder (the agent's cwd): its name, a glob matching
    it, or its stem with another extension or none (glob characters allowed)."""
    folder, name = src.rsplit("/", 1)
    stem = re.escape(name.split(".", 1)[0])
    for w in shell_words(cmd):
        head, _, base = w.rpartition("/")
        if not base or (w.count("/") and head not in (folder, ".", folder + "/.")):
            continue
        if fnmatch.fnmatchcase(name, base) or re.fullmatch(stem + r"(?:[.*?\[].*)?", base):
            return True
    return False


def reads(cmd: str, src: str, dst: str) -> bool:
    """Shows the agent the data file (or an error about it): names it (``names_file``), runs a reader,
    redirects its output into no file."""
    return (not is_write(cmd, dst) and not ANY_OUT_RE.search(cmd) and names_file(cmd, src)
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


def collect(root: Path, tasks: dict, specs: dict, sft_seeds=None) -> tuple[list[dict], dict, set]:
    """attempts.jsonl's records of every evaluation under ``root`` (of ``sft_seeds`` when given: the chosen ones;
    others are counted in what was left out), what was left out, and the (arm, SFT seed, RL seed, step) of the
    evaluations that finished (summary.json)."""
    rows, left, complete = [], Counter(), set()
    for arm, s, r, step, d in eval_dirs(root):
        if sft_seeds is not None and s not in sft_seeds:
            left[f"{arm}_of_an_sft_seed_not_chosen"] += len(episodes(d))
            continue
        if (d / "summary.json").is_file():
            complete.add((arm, s, r, step))
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
    return rows, dict(left), complete


# ---------------------------------------------------------------------------------------- statistics


def task_counts(rows: list[dict]) -> dict[str, list[int]]:
    """task -> [passes, attempts]"""
    by: dict[str, list[int]] = {}
    for x in rows:
        c = by.setdefault(x["task_id"], [0, 0])
        c[0] += bool(x["passed"])
        c[1] += 1
    return by


def task_rates(rows: list[dict]) -> dict[str, float]:
    return {t: p / n for t, (p, n) in task_counts(rows).items()}


def pass1(rows: list[dict]) -> float | None:
    r = task_rates(rows)
    return sum(r.values()) / len(r) if r else None


def pass_at_k(rows: list[dict]) -> tuple[dict[str, float], dict[str, dict]]:
    """Unbiased pass@k for k = 1 .. the most attempts of a task, each over the tasks with >= k attempts; and per k
    how many tasks that used and how many it excluded (fewer than k attempts)."""
    by = task_counts(rows)
    vals: dict[str, float] = {}
    used: dict[str, dict] = {}
    for k in range(1, max((n for _, n in by.values()), default=0) + 1):
        v = [1.0 - math.comb(n - c, k) / math.comb(n, k) for c, n in by.values() if n >= k]
        vals[str(k)] = sum(v) / len(v)
        used[str(k)] = {"tasks": len(v), "excluded": len(by) - len(v)}
    return vals, used


def bootstrap(values: np.ndarray, resamples: int, seed: int = BOOT_SEED) -> tuple[float, float]:
    """95% percentile interval of the mean of ``values`` over resamples with replacement."""
    if len(values) == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), (resamples, len(values)))].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(lo), float(hi)


# A side of a comparison: SFT seed -> [(run key, task -> [passes, attempts])], one entry per run (SFT: per seed).
Side = dict[int, list[tuple[str, dict[str, list[int]]]]]


def pooled(side: Side) -> dict[str, float]:
    """task -> passes / attempts over every run of the side."""
    tot: dict[str, list[int]] = {}
    for runs in side.values():
        for _, counts in runs:
            for t, (p, n) in counts.items():
                c = tot.setdefault(t, [0, 0])
                c[0] += p
                c[1] += n
    return {t: p / n for t, (p, n) in tot.items()}


def runs_tasks_interval(a: Side, b: Side, b_fixed: bool, tasks: list[str], resamples: int = BOOT,
                        seed: int = RUNS_SEED) -> list[float | None]:
    """The hierarchical 95% interval of the mean paired difference: runs redrawn within each SFT seed of each
    side (not the fixed SFT side), then tasks (the module docstring)."""
    if not tasks:
        return [None, None]
    rng = np.random.default_rng(seed)

    def rates(side: Side, fixed: bool) -> np.ndarray:
        p = np.zeros((resamples, len(tasks)))
        n = np.zeros((resamples, len(tasks)))
        for s in sorted(side):
            runs = side[s]
            P = np.array([[c.get(t, (0, 0))[0] for t in tasks] for _, c in runs], dtype=float)
            N = np.array([[c.get(t, (0, 0))[1] for t in tasks] for _, c in runs], dtype=float)
            if fixed:
                w = np.ones((resamples, len(runs)))
            else:
                draw = rng.integers(0, len(runs), (resamples, len(runs)))
                w = (draw[:, :, None] == np.arange(len(runs))).sum(axis=1).astype(float)
            p += w @ P
            n += w @ N
        with np.errstate(invalid="ignore", divide="ignore"):
            return p / n

    diff = rates(a, False) - rates(b, b_fixed)
    pick = rng.integers(0, len(tasks), (resamples, len(tasks)))
    with np.errstate(invalid="ignore"):
        means = np.nanmean(np.take_along_axis(diff, pick, axis=1), axis=1)
    lo, hi = np.nanpercentile(means, [2.5, 97.5])
    return [float(lo), float(hi)]


def cluster_interval(d: np.ndarray, clusters: list[str], resamples: int = BOOT,
                     seed: int = CLUSTER_SEED) -> list[float | None]:
    """95% interval of the mean of ``d`` when whole clusters (instructions) are drawn with replacement."""
    if len(d) == 0:
        return [None, None]
    ids = {c: i for i, c in enumerate(sorted(set(clusters)))}
    idx = np.array([ids[c] for c in clusters])
    sums, sizes = np.zeros(len(ids)), np.zeros(len(ids))
    np.add.at(sums, idx, d)
    np.add.at(sizes, idx, 1.0)
    pick = np.random.default_rng(seed).integers(0, len(ids), (resamples, len(ids)))
    lo, hi = np.percentile(sums[pick].sum(axis=1) / sizes[pick].sum(axis=1), [2.5, 97.5])
    return [float(lo), float(hi)]


def _key(s: int, r: int | None) -> str:
    return f"s{s}" if r is None else f"s{s}_r{r}"


class Index:
    """The attempts grouped by arm, SFT seed, RL seed and step; the runs the settings expect; which evaluations
    finished (None: all)."""

    def __init__(self, rows: list[dict], settings: dict | None = None, complete: set | None = None):
        self.rows, self.settings, self.complete = rows, settings or {}, complete
        self.runs: dict[tuple, list[dict]] = defaultdict(list)
        for x in rows:
            self.runs[(x["arm"], x["sft_seed"], x["seed"], x["step"])].append(x)

    def arms(self) -> list[str]:
        return [a for a in ARMS if any(k[0] == a for k in self.runs)]

    def expected_runs(self, arm: str) -> list[tuple[int, int]]:
        st = self.settings
        if arm in (st.get("arms") or ()) and "sft_seeds" in st and "rl_seeds" in st:
            return [(s, r) for s in st["sft_seeds"] for r in st["rl_seeds"]]
        return sorted({(s, r) for (a, s, r, n) in self.runs if a == arm})

    def sft_seeds_of(self, arm: str) -> list[int]:
        return sorted({s for s, _ in self.expected_runs(arm)})

    def target_step(self, arm: str) -> int | None:
        if arm == "sft":
            return 0
        if isinstance(self.settings.get("steps"), int):
            return self.settings["steps"]
        return max((n for (a, s, r, n) in self.runs if a == arm), default=None)

    def _problem(self, arm: str, s: int, r: int | None, step: int) -> str | None:
        key = (arm, s, r, step)
        if not self.runs.get(key):
            last = max((n for (a, s2, r2, n) in self.runs if (a, s2, r2) == (arm, s, r)), default=None)
            return (f"{arm} {_key(s, r)} has no evaluation with attempts at step {step} ("
                    + ("no evaluation at all)" if last is None else f"its last is step {last})"))
        if self.complete is not None and key not in self.complete:
            return f"{arm} {_key(s, r)}: its step-{step} evaluation did not finish (no summary.json)"
        return None

    def check(self, arm: str) -> dict:
        """The arm's final step, its runs, and every run that lacks a finished evaluation there."""
        step, runs = self.target_step(arm), self.expected_runs(arm)
        problems = [p for s, r in runs if (p := self._problem(arm, s, r, step)) is not None]
        if not runs:
            problems.append(f"{arm}: no runs")
        return {"step": step, "runs": [_key(s, r) for s, r in runs], "problems": problems, "available": not problems}

    def sft_problems(self, seeds) -> list[str]:
        return [p for s in seeds if (p := self._problem("sft", s, None, 0)) is not None]

    def select(self, arm: str, step: int, sft_seeds=None) -> list[dict]:
        return [x for (a, s, r, n), v in self.runs.items() if a == arm and n == step
                and (sft_seeds is None or s in sft_seeds) for x in v]

    def side(self, arm: str, step: int, seeds=None, runs=None) -> Side:
        """The attempts of ``arm`` at ``step`` as a comparison side (optionally only ``seeds`` / ``runs``)."""
        out: Side = defaultdict(list)
        for (a, s, r, n), v in sorted(self.runs.items(), key=lambda kv: (kv[0][1], kv[0][2] or 0)):
            if a == arm and n == step and (seeds is None or s in seeds) and (runs is None or (s, r) in runs):
                out[s].append((_key(s, r), task_counts(v)))
        return dict(out)


def _mean_rate(counts: dict[str, list[int]], tasks: list[str]) -> float:
    return sum(counts[t][0] / counts[t][1] for t in tasks) / len(tasks)


def paired(a: Side, b: Side, b_fixed: bool, instruction: dict[str, str] | None = None) -> dict:
    """Mean paired difference over the tasks both sides have, its task bootstrap (``ci95``, also ``lo``/``hi``)
    and hierarchical interval, and (given ``instruction``) the instruction-cluster interval."""
    ra, rb = pooled(a), pooled(b)
    tasks = sorted(set(ra) & set(rb))
    out: dict = {"tasks": len(tasks), "mean": None, "lo": None, "hi": None, "ci95": [None, None],
                 "ci95_runs_tasks": [None, None]}
    if instruction is not None:
        out["ci95_instruction_clusters"] = [None, None]
        out["instruction_clusters"] = len({instruction[t] for t in tasks})
    if not tasks:
        return out
    d = np.array([ra[t] - rb[t] for t in tasks])
    lo, hi = bootstrap(d, BOOT)
    out.update({"a_pass@1": sum(ra[t] for t in tasks) / len(tasks), "b_pass@1": sum(rb[t] for t in tasks) / len(tasks),
                "mean": sum(d.tolist()) / len(tasks), "lo": lo, "hi": hi, "ci95": [lo, hi],
                "ci95_runs_tasks": runs_tasks_interval(a, b, b_fixed, tasks)})
    if instruction is not None:
        out["ci95_instruction_clusters"] = cluster_interval(d, [instruction[t] for t in tasks])
    return out


def comparison(ix: Index, name: str, checks: dict, instruction: dict[str, str]) -> dict:
    """One comparison A-B at the final steps, or ``available: false`` with the reason (module docstring)."""
    a, b = name.split("-")
    c: dict = {"a": a, "b": b, "a_step": None, "b_step": 0 if b == "sft" else None}
    reasons = []
    for arm in (a, b):
        if arm != "sft" and arm not in checks:
            reasons.append(f"arm {arm} has no evaluations")
        elif arm != "sft":
            c[f"{'a' if arm == a else 'b'}_step"] = checks[arm]["step"]
            reasons += checks[arm]["problems"]
    if not reasons and b != "sft" and checks[a]["step"] != checks[b]["step"]:
        reasons.append(f"final steps differ: {a} {checks[a]['step']}, {b} {checks[b]['step']}")
    seeds = ix.sft_seeds_of(a) if a in checks else []
    if not reasons and b == "sft":
        reasons += ix.sft_problems(seeds)
    if reasons:
        return {**c, "available": False, "reason": "; ".join(reasons)}
    A = ix.side(a, c["a_step"], runs=set(ix.expected_runs(a)))
    B = ix.side("sft", 0, set(seeds)) if b == "sft" else ix.side(b, c["b_step"], runs=set(ix.expected_runs(b)))
    c.update({"available": True, **paired(A, B, b == "sft", instruction)})
    c["excludes_0"] = c["lo"] is not None and (c["lo"] > 0 or c["hi"] < 0)
    both = sorted(set(A) & set(B))
    c["per_sft_seed"] = {f"s{s}": paired({s: A[s]}, {s: B[s]}, b == "sft") for s in both}
    means = [v["mean"] for v in c["per_sft_seed"].values()]
    c["sign_agrees_per_sft_seed"] = bool(means) and None not in means and (all(m > 0 for m in means)
                                                                         or all(m < 0 for m in means))
    per_run = {}
    for s in both:
        other = dict(B[s])
        for key, ca in A[s]:
            cb = other.get(f"s{s}") if b == "sft" else other.get(key)
            common = sorted(set(ca) & set(cb or {}))
            if common:
                per_run[key] = _mean_rate(ca, common) - _mean_rate(cb, common)
    c["per_run"] = per_run
    return c


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


def goal(comparisons: dict, key: str = "ci95") -> dict:
    """The pre-registered rule on the comparisons' interval ``key`` (an unavailable comparison fails it)."""
    checks, met = {}, True
    for name in GOAL_ABOVE + GOAL_NOT_ABOVE:
        c = comparisons.get(name) or {}
        lo = (c.get(key) or [None])[0] if c.get("available", True) else None
        ok = lo is not None and not math.isnan(lo) and (lo > 0 if name in GOAL_ABOVE else lo <= 0)
        checks[name] = {"required": "lower end > 0" if name in GOAL_ABOVE else "lower end <= 0", "lo": lo, "ok": ok}
        if not c.get("available", True):
            checks[name]["unavailable"] = c.get("reason")
        met = met and ok
    return {"interval": key, "met": met, "checks": checks}


def summarize(rows: list[dict], settings: dict | None = None, complete: set | None = None) -> dict:
    ix = Index(rows, settings, complete)
    arms: dict = {}
    for (a, s, r, n), v in sorted(ix.runs.items(), key=lambda kv: (ARMS.index(kv[0][0]), kv[0][1:3], kv[0][3])):
        arms.setdefault(a, {}).setdefault(_key(s, r), {})[str(n)] = pass1(v)
    sft_rows = ix.select("sft", 0)
    pak, pak_tasks = {}, {}
    for s in sorted({x["sft_seed"] for x in sft_rows}):
        pak[f"s{s}"], pak_tasks[f"s{s}"] = pass_at_k(ix.select("sft", 0, {s}))
    pak["all"], pak_tasks["all"] = pass_at_k(sft_rows)
    rl = [a for a in ix.arms() if a != "sft"]
    checks = {a: ix.check(a) for a in rl}
    final = {"sft": 0, **{a: checks[a]["step"] if checks[a]["available"] else None for a in rl}}
    curves: dict = {}
    for a in rl:
        steps = sorted({n for (b, s, r, n) in ix.runs if b == a and n != 0})  # step 0: the SFT evaluation
        curve = {}
        for n in [0] + steps:
            v = ix.select("sft", 0, set(ix.sft_seeds_of(a))) if n == 0 else ix.select(a, n)
            rates = np.array(list(task_rates(v).values()))
            lo, hi = bootstrap(rates, BAND_BOOT)
            curve[str(n)] = {"pass@1": pass1(v), "lo": lo, "hi": hi, "tasks": len(rates), "attempts": len(v),
                             "runs": len({(x["sft_seed"], x["seed"]) for x in v})}
        curves[a] = curve
    instruction = {x["task_id"]: x["instruction"] for x in rows}
    comparisons = {name: comparison(ix, name, checks, instruction) for name in COMPARISONS}
    failure: dict = {"sft": {"final_step": 0, "steps": {"0": modes_block(sft_rows)}}}
    for a in rl:
        if not checks[a]["available"]:
            failure[a] = {"available": False, "final_step": None, "reason": "; ".join(checks[a]["problems"])}
            continue
        seeds, want = ix.sft_seeds_of(a), set(ix.expected_runs(a))
        base = ix.select("sft", 0, set(seeds))
        new = [x for x in ix.select(a, final[a]) if (x["sft_seed"], x["seed"]) in want]
        grades = sorted({x["grade"] for x in base + new}, key=lambda g: (g is None, g))
        by_grade = {str(g): {"0": modes_block([x for x in base if x["grade"] == g]),
                             str(final[a]): modes_block([x for x in new if x["grade"] == g])} for g in grades}
        failure[a] = {"available": True, "final_step": final[a], "sft_seeds": seeds,
                      "steps": {"0": modes_block(base), str(final[a]): modes_block(new)}, "by_grade": by_grade,
                      "lift": lift(base, new)}
    return {"arms": arms, "curves": curves, "final_steps": final, "final_step_check": checks,
            "sft_pass_at_k": pak, "sft_pass_at_k_tasks": pak_tasks, "comparisons": comparisons,
            "failure_modes": failure}


# ------------------------------------------------------------------------------------------ near duplicates


def _stats(values: list) -> dict:
    return {"min": min(values), "median": float(np.median(values)), "max": max(values)}


def edit_distances(texts: list[str], others: list[str]) -> np.ndarray:
    """Levenshtein distances (insert, delete, substitute a character: cost 1), ``texts`` x ``others``: the
    dynamic programme over a text's characters, vectorised over every other text and its positions (the
    insertions of a row as a running minimum)."""
    L = max(map(len, others))
    chars = np.full((L, len(others)), -1, dtype=np.int32)  # -1 pads: never equal, never read past a text's end
    for k, t in enumerate(others):
        chars[:len(t), k] = [ord(c) for c in t]
    ends, cols = np.array([len(t) for t in others]), np.arange(len(others))
    differ = {ch: (chars != ord(ch)).astype(np.int16) for ch in set("".join(texts))}
    pos = np.arange(L + 1, dtype=np.int16)[:, None]
    out = np.zeros((len(texts), len(others)), dtype=np.int64)
    for n, h in enumerate(texts):
        D = np.broadcast_to(pos, (L + 1, len(others))).copy()  # D[j, k]: h[:i] vs others[k][:j]
        row = np.empty_like(D)
        for i, ch in enumerate(h, 1):
            row[0] = i
            np.add(D[:-1], differ[ch], out=row[1:])  # substitute or match
            np.minimum(row[1:], D[1:] + 1, out=row[1:])  # delete h's character
            row -= pos
            np.minimum.accumulate(row, axis=0, out=D)  # insert: min over j' <= j of row[j'] + (j - j')
            D += pos
        out[n] = D[ends, cols]
    return out


def nearest(instructions: dict[str, list[str]]) -> dict:
    """Each distinct held-out instruction's nearest training instruction by word-3-gram Jaccard and by
    normalised edit distance, and its longest run of words shared with any training instruction (the module
    docstring)."""
    held = sorted(set(instructions.get("heldout") or ()))
    train = sorted({t for k, v in instructions.items() if k not in ("heldout", "dev") for t in v})  # dev: never
    if not held or not train:                                                                       # trained on
        return {"available": False, "reason": "no held-out or no training instructions in instructions.json"}
    tw = [family.words(t) for t in train]
    tg = [set(zip(w, w[1:], w[2:])) for w in tw]
    dist = edit_distances(held, train) / np.maximum.outer([len(h) for h in held], [len(t) for t in train])
    shared: dict[int, set] = {}

    def grams(n: int) -> set:
        if n not in shared:
            shared[n] = {tuple(w[i:i + n]) for w in tw for i in range(len(w) - n + 1)}
        return shared[n]

    per = []
    for row, h in enumerate(held):
        hw = family.words(h)
        hg = set(zip(hw, hw[1:], hw[2:]))
        jac = [len(hg & g) / len(hg | g) if hg | g else 0.0 for g in tg]
        j, e = int(np.argmax(jac)), int(np.argmin(dist[row]))
        run = 0
        while run < len(hw) and {tuple(hw[i:i + run + 1]) for i in range(len(hw) - run)} & grams(run + 1):
            run += 1
        per.append((h, jac[j], train[j], float(dist[row, e]), train[e], run))
    runs = [p[5] for p in per]
    closest = {}
    for what, i, t, pick in (("jaccard_word3", 1, 2, max), ("char_edit", 3, 4, min),
                             ("longest_shared_words", 5, None, max)):
        p = pick(per, key=lambda x: x[i])
        closest[what] = {"heldout": p[0], "value": p[i], **({"training": p[t]} if t is not None else {})}
    return {"available": True, "heldout_instructions": len(held), "training_instructions": len(train),
            "sources": sorted(k for k in instructions if k != "heldout"),
            "char_measure": "Levenshtein distance / the longer text's length (0 = identical); per held-out "
                            "instruction the smallest over the training instructions",
            "words": "family.words (whitespace words, lower-cased, punctuation around them stripped)",
            "jaccard_word3": _stats([p[1] for p in per]), "char_edit": _stats([p[3] for p in per]),
            "longest_shared_words": {**_stats(runs), "histogram": {str(n): runs.count(n)
                                                                   for n in range(max(runs) + 1)}},
            "ngram_n_forbidden": family.NGRAM, "closest": closest}


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


def _iv(ci) -> str:
    return "n/a" if not ci or ci[0] is None else f"[{ci[0]:+.3f}, {ci[1]:+.3f}]"


def _ci(c: dict) -> str:
    if c.get("mean") is None:
        return "n/a"
    return f"{c['mean']:+.3f} {_iv([c['lo'], c['hi']])}"


def wall_time(timing: dict) -> tuple[float | None, str]:
    if "rl_total" in timing:
        return timing["rl_total"], "timing.json rl_total: run.py's wall time from its start, summed over invocations"
    stages = [v for k, v in timing.items() if not k.startswith("rl/")]
    return (sum(stages), "the sum of timing.json's stages") if stages else (None, "no timing.json")


def _fm_final(fm: dict, a: str) -> dict | None:
    """An arm's failure-mode block at its final step (None when it has none)."""
    f = fm.get(a) or {}
    return f["steps"].get(str(f["final_step"])) if f.get("available", True) and "steps" in f else None


def summary_paragraph(out: dict) -> str:
    comp, g, gates = out["comparisons"], out["goal"], out["go_no_go"]
    sft = out["failure_modes"].get("sft", {}).get("steps", {}).get("0", {})
    sft_p = pass1_of_sft(out)
    parts = [f"**Result ({out['scale']} scale): the pre-registered goal was {'met' if g['met'] else 'NOT met'}** "
             f"(intervals over tasks, runs pooled); with training seeds resampled too (runs x tasks) it was "
             f"{'met' if out.get('goal_met_strict') else 'not met'}, with instructions resampled as clusters "
             f"{'met' if out.get('goal_met_instruction_clusters') else 'not met'}.",
             (f"The SFT policy's held-out pass@1 is {_f(sft_p)} ({sft.get('attempts', 0)} attempts over "
              f"{out['heldout_tasks']} held-out tasks).")]
    finals = [f"{a.upper()} {_f(out['curves'][a][str(out['final_steps'][a])]['pass@1'])}" for a in RL_ARMS
              if a in out["curves"] and out["final_steps"].get(a) is not None]
    if finals:
        parts.append("At each arm's final step: " + ", ".join(finals) + ".")
    missing = [a.upper() for a in RL_ARMS if a in out["curves"] and out["final_steps"].get(a) is None]
    if missing:
        parts.append(f"No final step for {', '.join(missing)}: a run lacks a finished evaluation there (see the "
                     "comparisons).")
    diffs = [f"{n} {_ci(c)}" for n, c in comp.items() if c.get("available")]
    if diffs:
        parts.append("Paired differences of pass@1 (mean [95% bootstrap interval over tasks]): " + "; ".join(diffs)
                     + ".")
    fm = out["failure_modes"]
    insp = [f"{a.upper()} {_f(_fm_final(fm, a)['inspected_share'], 2)}" for a in RL_ARMS if _fm_final(fm, a)]
    if insp and sft.get("inspected_share") is not None:
        parts.append(f"Share of attempts that read the file before writing: SFT {_f(sft['inspected_share'], 2)}; "
                     + ", ".join(insp) + " at the final step.")
    lifts = [f"{a.upper()} {fm[a]['lift']['total_change']:+.3f} ({fm[a]['lift']['inspected']:+.3f} via attempts "
             f"that inspected, {fm[a]['lift']['not_inspected']:+.3f} via the others)" for a in RL_ARMS
             if "lift" in fm.get(a, {})]
    if lifts:
        parts.append("Change of the attempt-level pass rate from SFT: " + "; ".join(lifts) + ".")

    def why(n: str) -> str:
        c = g["checks"][n]
        if c.get("unavailable"):
            return f"{n}: not available ({c['unavailable']})"
        return f"{n}: no results" if c["lo"] is None else f"{n}: lower end {c['lo']:+.3f}, required {c['required']}"

    failed = [n for n, c in g["checks"].items() if not c["ok"]]
    if failed:
        parts.append("Criteria not met: " + "; ".join(why(n) for n in failed) + ".")
    else:
        parts.append("GRPO and DPPO each beat both SFT and RFT with intervals excluding 0, and the placebo's "
                     "interval against SFT is not above 0.")
    sel = out.get("sft_selection") or {}
    if sel.get("tried"):
        parts.append(f"The SFT starts were chosen on the dev tasks (validation split): {len(sel['chosen'])} of the "
                     f"{len(sel['tried'])} SFT seeds tried passed the go/no-go criteria there and are the "
                     "experiment's, so every effect here is conditional on a start that the criteria select (headroom "
                     "and varied samples), and the intervals do not cover the variation between SFT seeds of the "
                     "recipe; all arms share those starts, so no comparison favours an arm.")
    if gates["verdict"] != "go":
        parts.append(f"Go/no-go verdict before RL: {gates['verdict']}" +
                     ("; the arms ran anyway (--force), so read the comparisons with that in mind."
                      if any(c.get("available") for c in comp.values()) else "."))
    return " ".join(parts)


def pass1_of_sft(out: dict) -> float | None:
    vals = [v["0"] for v in out["arms"].get("sft", {}).values()]
    return sum(vals) / len(vals) if vals else None


def _rel(p: Path) -> str:
    p = Path(p).resolve()
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p)


def _near_md(nd: dict) -> list[str]:
    if not nd.get("available"):
        return [f"Nearest training instructions: not available ({nd.get('reason')}).", ""]
    L = [(f"Nearest training instruction of each of the {nd['heldout_instructions']} distinct held-out instructions "
          f"(among {nd['training_instructions']} distinct training instructions of {', '.join(nd['sources'])}; "
          f"`disjointness_nearest`):"), "", "| measure | min | median | max |", "|---|---|---|---|"]
    for key, what in (("jaccard_word3", "word 3-gram Jaccard similarity (highest)"),
                      ("char_edit", "normalised character edit distance (Levenshtein / longer length; lowest)"),
                      ("longest_shared_words", "longest run of shared words (longest)")):
        v = nd[key]
        L.append(f"| {what} | " + " | ".join(f"{v[m]:g}" if key == "longest_shared_words" else _f(v[m])
                                             for m in ("min", "median", "max")) + " |")
    hist = ", ".join(f"{n}: {c}" for n, c in nd["longest_shared_words"]["histogram"].items())
    L += ["", (f"Longest shared word run, held-out instructions per length: {hist} (a run of "
               f"{nd['ngram_n_forbidden']} words is excluded by construction)."), ""]
    for key, what in (("jaccard_word3", "Jaccard"), ("char_edit", "edit distance")):
        c = nd["closest"][key]
        L.append(f"- closest by {what} ({_f(c['value'])}): held-out \"{c['heldout']}\" vs training "
                 f"\"{c['training']}\"")
    return L + [""]


def _cmp_row(name: str, c: dict) -> str:
    if not c.get("available"):
        return f"| {name} | n/a | | | | not available: {c.get('reason')} | | | | |"
    per = "; ".join(f"{s}: {_ci(v)}" for s, v in c["per_sft_seed"].items())
    runs = c["per_run"]
    pos = sum(v > 0 for v in runs.values())
    per_run = ", ".join(f"{k} {v:+.3f}" for k, v in runs.items())
    sign = "same sign" if c["sign_agrees_per_sft_seed"] else "signs differ"
    return (f"| {name} | {c['a_step']} vs {c['b_step']} | {c['tasks']} ({c['instruction_clusters']}) | "
            f"{_f(c.get('a_pass@1'))} | {_f(c.get('b_pass@1'))} | {_ci(c)} | {_iv(c['ci95_runs_tasks'])} | "
            f"{_iv(c['ci95_instruction_clusters'])} | {per} ({sign}) | {pos} of {len(runs)} > 0: {per_run} |")


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
    sel = out.get("sft_selection") or {}
    if sel.get("tried"):
        L += ["## SFT seeds, chosen on the dev tasks (the validation split, before any held-out evaluation)", "",
              f"Rule: {sel['rule']}. Chosen: {sel['chosen']}. Every seed tried:", "",
              "| SFT seed | dev tasks | pass@1 | pass@k - pass@1 | mixed tasks | verdict |",
              "|---|---|---|---|---|---|"]
        L += [f"| {g['sft_seed']} | {g['tasks']} | {_f(g['pass@1'])} | {_f(g['pass@k_minus_pass@1'])} | "
              f"{_f(g['mixed_frac'], 2)} | {g['verdict']} |" for g in sel["tried"]]
        L.append("")
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
    L += [""] + _near_md(out.get("disjointness_nearest") or {})
    L += ["## Held-out pass@1 per arm and step", "", "![curve](learning_v2.png)", "",
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
        ex = {s: {k: u["excluded"] for k, u in v.items() if u["excluded"]}
              for s, v in out.get("sft_pass_at_k_tasks", {}).items()}
        L += ["", "pass@k at k uses only the tasks with at least k valid attempts; excluded tasks per k: "
              + ("; ".join(f"{s}: " + ", ".join(f"k={k}: {n}" for k, n in v.items()) for s, v in ex.items() if v)
                 or "none") + "."]
    L += ["", "## Comparisons (each arm's final step, paired over tasks, 10,000 bootstrap resamples)", "",
          ("Three 95% intervals of A - B: **over tasks** (runs pooled per task; the pre-registered one), **runs x "
           "tasks** (RL runs redrawn within each SFT seed, then tasks: adds training-seed variance) and "
           "**instruction clusters** (held-out tasks that share an instruction drawn together). Per run: each A "
           "run minus its SFT seed's SFT evaluation (A-sft) or minus B's run with the same seeds (two RL arms)."),
          "", ("| comparison | steps | tasks (instructions) | A pass@1 | B pass@1 | A - B [over tasks] | "
               "runs x tasks | instruction clusters | per SFT seed | per run |"), "|---" * 10 + "|"]
    for name, c in out["comparisons"].items():
        L.append(_cmp_row(name, c))

    def checks(g: dict) -> str:
        return ", ".join(f"{n} {v['required']}: " + ("not available" if v.get("unavailable") else
                                                       "ok" if v["ok"] else "no") for n, v in g["checks"].items())

    L += ["", (f"**The pre-registered criterion uses the interval over tasks** (`ci95`): {checks(out['goal'])}; "
               f"goal met: **{out['goal_met']}**."), "",
          (f"Stricter, not pre-registered: with the runs x tasks interval (`goal_met_strict`): "
           f"{checks(out['goal_strict'])}; met: **{out['goal_met_strict']}**. With the instruction-cluster interval "
           f"(`goal_met_instruction_clusters`): {checks(out['goal_instruction_clusters'])}; met: "
           f"**{out['goal_met_instruction_clusters']}**."), ""]
    L += ["## Failure modes", "", ("Shares of attempts (rules: analyze.py's docstring; `inspected` = looked at the "
          "file before the first write)."), "",
          "| arm | step | attempts | " + " | ".join(MODES) + " | inspected |", "|---" * (len(MODES) + 4) + "|"]
    for a, fm in out["failure_modes"].items():
        if not fm.get("available", True):
            L.append(f"| {a} | n/a | not available: {fm['reason']} |" + " |" * (len(MODES) + 1))
            continue
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
        for g, by in fm.get("by_grade", {}).items():  # (none for the SFT arm and an arm without a final step)
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
    sel = root / "sft_selection.json"
    selection = json.loads(sel.read_text()) if sel.is_file() else None
    if selection and "sft_candidates" not in settings:  # the three-way split: the runs are the chosen seeds'
        settings = {**settings, "sft_candidates": settings["sft_seeds"], "sft_seeds": selection["chosen"]}
    tasks = {t.id: t for t in load_tasks(str(root / "data" / "heldout.parquet"))}
    specs = {tid: rebuild(t) for tid, t in tasks.items()}
    rows, left_out, complete = collect(root, tasks, specs, set(settings["sft_seeds"]) if selection else None)
    (results / "learning_v2").mkdir(parents=True, exist_ok=True)
    if selection:  # the dev checks, attempt by attempt (recheck.py recomputes the selection from them)
        dev = [{"sft_seed": g["sft_seed"], "task_id": r["task"], "sample": r["attempt"], "passed": bool(r["pass"])}
               for g in selection["tried"] for r in read_jsonl(root / f"sft_{g['sft_seed']}_dev" / "attempts.jsonl")]
        (results / "learning_v2" / "dev_attempts.jsonl").write_text(
            "".join(json.dumps(x, separators=(",", ":")) + "\n" for x in dev))
    tmp = results / "learning_v2" / "attempts.jsonl.tmp"
    tmp.write_text("".join(json.dumps(x, separators=(",", ":")) + "\n" for x in rows))
    tmp.replace(results / "learning_v2" / "attempts.jsonl")
    s = summarize(rows, settings, complete)
    instr = root / "data" / "instructions.json"
    near = (nearest(json.loads(instr.read_text())) if instr.is_file()
            else {"available": False, "reason": f"no {instr.name} in ROOT/data"})
    out = {"experiment": "learning_v2", "scale": scale, "command": command, "settings": settings,
           "go_no_go": go_no_go(gates), "sft_selection": selection or {"used": False},
           "disjointness": data_info.get("disjointness", {}),
           "dev_disjointness": data_info.get("dev_disjointness", {"used": False}),
           "disjointness_nearest": near, **s,
           "bootstrap": {"resamples": BOOT, "band_resamples": BAND_BOOT, "level": 0.95, "ci95": {
               "seed": BOOT_SEED, "unit": "task (runs pooled)"}, "ci95_runs_tasks": {
               "seed": RUNS_SEED, "unit": "runs within each SFT seed (RL sides; SFT fixed), then tasks"},
               "ci95_instruction_clusters": {"seed": CLUSTER_SEED, "unit": "instruction (all of its tasks)"}},
           "tasks_rebuilt": sum(v is not None for v in specs.values()), "heldout_tasks": len(tasks),
           "attempts": len(rows), "left_out": left_out, "timing": timing}
    for key, name in (("ci95", "goal"), ("ci95_runs_tasks", "goal_strict"),
                      ("ci95_instruction_clusters", "goal_instruction_clusters")):
        g = goal(s["comparisons"], key)
        out[name], out[name.replace("goal", "goal_met")] = g, g["met"]
    out = _clean(out)
    (results / "learning_v2.json").write_text(json.dumps(out, indent=1))
    plot(out, results / "learning_v2.png", scale)
    (results / "learning_v2.md").write_text(markdown(out, _rel(root), _rel(results)))
    print(f"learning_v2: {len(rows)} attempts; goal met: {out['goal_met']} (strict: {out['goal_met_strict']}); "
          f"results in {results}", flush=True)
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
