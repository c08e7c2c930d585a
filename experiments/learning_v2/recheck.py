"""Recompute the learning_v2 results independently of analyze.py (its own statistics, nothing imported from it):

    .venv/bin/python experiments/learning_v2/recheck.py --results experiments/results

reads RESULTS/learning_v2/attempts.jsonl and RESULTS/learning_v2.json and checks

- every pass@1 in ``arms`` (per run and step: the mean over tasks of the task's pass rate) and in ``curves``, and
  the SFT pass@k curve: k = 1 .. the most attempts of a task, the unbiased estimator (as a product) only over
  the tasks with >= k attempts, and ``sft_pass_at_k_tasks`` (tasks used and excluded per k);
- final steps, with no fallback: an RL arm's final step is the settings' ``steps`` (else its largest step), its
  runs the settings' ``sft_seeds`` x ``rl_seeds``; every run with no attempts at the final step must be listed in
  ``final_step_check[arm]["problems"]``, and then the arm has no final step, its failure modes and every
  comparison with it must be ``available: false`` with a reason (so must X-sft without attempts of an SFT seed X
  starts from, and X-Y with different final steps). An evaluation that did not finish (no summary.json) cannot
  be seen in attempts.jsonl: an arm unavailable for that reason only is accepted with a warning;
- every available comparison (all seven must be recorded): its tasks, mean (to 1e-9) and, each with its own
  code and seeds (10,000 resamples drawn as multinomial counts): the task bootstrap ``ci95``/``lo``/``hi``
  (to 0.02), ``ci95_runs_tasks`` (runs redrawn within each SFT seed of each RL side, the SFT side's per-seed
  evaluation fixed, then tasks; to 0.03) and ``ci95_instruction_clusters`` (whole instructions drawn; to 0.03);
  per SFT seed the same (without clusters), ``sign_agrees_per_sft_seed``, and ``per_run`` (each A run's pass@1
  minus its SFT seed's SFT pass@1, or minus B's run with the same seeds, on the tasks both have; to 1e-9);
  ``goal_met``, ``goal_met_strict`` and ``goal_met_instruction_clusters`` against the pre-registered rule applied
  to the json's ``ci95``, ``ci95_runs_tasks`` and ``ci95_instruction_clusters``;
- the go/no-go numbers (pass@1, pass@n over the tasks with n attempts, their difference, the share of tasks with
  0 < rate < 1, the verdict) from the SFT attempts;
- the failure-mode counts and inspected counts of ``failure_modes`` (per grade too) and its lift totals;
- disjointness against the tasks the code generates (``data.generate`` with the json's settings): no held-out
  instruction equals or shares a word n-gram (n = family.NGRAM, whitespace words by its own code) with any
  SFT/RL instruction, no held-out frame phrasing (intro, ask) occurs in any training instruction's frame, the json's
  overlap counts equal these, and the held-out task ids of attempts.jsonl are exactly ``family.task_id`` of the
  generated held-out specs (with their instructions);
- the near-duplicate report ``disjointness_nearest`` on the generated instructions, with this file's own words:
  the histogram of each held-out instruction's longest run of words shared with a training instruction, the
  min / median / max of its best word-3-gram Jaccard similarity, and the closest pair's normalised Levenshtein
  distance (plain dynamic programme) equal to the reported minimum.

Exits 1 with every mismatch listed, else prints a short OK summary.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import data  # noqa: E402
import family  # noqa: E402

EXACT, INTERVAL, INTERVAL_NEW = 1e-9, 0.02, 0.03
RESAMPLES, SEED = 10_000, 20_240_917
MODES = ("passed", "wrong_format", "gave_up", "turn_limit", "other")
COMPARISONS = ("grpo-sft", "dppo-sft", "grpo-rft", "dppo-rft", "placebo-sft", "rft-sft", "grpo-placebo")


class Checker:
    def __init__(self):
        self.errors: list[str] = []
        self.warnings: list[str] = []
        self.checked = defaultdict(int)

    def close(self, what: str, got, want, tol: float = EXACT, kind: str = "values") -> None:
        self.checked[kind] += 1
        if got is None or want is None:
            if got is not want:
                self.errors.append(f"{what}: json {want!r}, recomputed {got!r}")
            return
        if abs(got - want) > tol:
            self.errors.append(f"{what}: json {want!r}, recomputed {got!r} (tolerance {tol})")

    def same(self, what: str, got, want, kind: str = "values") -> None:
        self.checked[kind] += 1
        if got != want:
            self.errors.append(f"{what}: json {want!r}, recomputed {got!r}")


# --------------------------------------------------------------------------------------- statistics


def per_task(rows) -> dict[str, list[int]]:
    """task -> [passes, attempts]"""
    out: dict[str, list[int]] = {}
    for r in rows:
        c = out.setdefault(r["task_id"], [0, 0])
        c[0] += int(bool(r["passed"]))
        c[1] += 1
    return out


def mean_rate(rows) -> float | None:
    t = per_task(rows)
    if not t:
        return None
    return float(np.mean([p / n for p, n in t.values()]))


def unbiased(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k) as a product (k <= n)."""
    if k > n:
        raise ValueError(f"pass@{k} from {n} attempts")
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod([1.0 - k / i for i in range(n - c + 1, n + 1)]))


def interval(diffs: np.ndarray, seed: int) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    n = len(diffs)
    counts = rng.multinomial(n, np.full(n, 1.0 / n), size=RESAMPLES)
    means = counts @ diffs / n
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


# ------------------------------------------------------------------------------------------- checks


def group(rows):
    g = defaultdict(list)
    for r in rows:
        g[(r["arm"], r["sft_seed"], r["seed"], r["step"])].append(r)
    return g


class Runs:
    """The runs each arm should have and its final step, from the json's settings (else from the attempts)."""

    def __init__(self, res: dict, groups):
        self.st, self.groups = res.get("settings") or {}, groups

    def expected(self, arm: str) -> list[tuple[int, int]]:
        st = self.st
        if arm in (st.get("arms") or []) and "sft_seeds" in st and "rl_seeds" in st:
            return [(s, r) for s in st["sft_seeds"] for r in st["rl_seeds"]]
        return sorted({(s, r) for (a, s, r, n) in self.groups if a == arm})

    def sft_seeds(self, arm: str) -> set[int]:
        return {s for s, r in self.expected(arm)}

    def final(self, arm: str) -> int | None:
        if arm == "sft":
            return 0
        if isinstance(self.st.get("steps"), int):
            return self.st["steps"]
        steps = [n for (a, s, r, n) in self.groups if a == arm]
        return max(steps) if steps else None

    def lacking(self, arm: str) -> list[str]:
        """Runs of ``arm`` with no attempts at its final step."""
        n = self.final(arm)
        return [f"s{s}_r{r}" for s, r in self.expected(arm) if not self.groups.get((arm, s, r, n))]

    def side(self, arm: str, step: int, seeds=None, runs=None) -> dict[int, dict[str, dict]]:
        """{SFT seed: {run key: per_task counts}}"""
        out: dict[int, dict[str, dict]] = defaultdict(dict)
        for (a, s, r, n), v in self.groups.items():
            if a == arm and n == step and (seeds is None or s in seeds) and (runs is None or (s, r) in runs):
                out[s][f"s{s}" if r is None else f"s{s}_r{r}"] = per_task(v)
        return dict(out)


def arm_rows(groups, arm: str, step: int, seeds=None):
    return [x for (a, s, r, n), v in groups.items() if a == arm and n == step and (seeds is None or s in seeds)
            for x in v]


def check_arms(ck: Checker, res: dict, groups, runs: Runs) -> None:
    seen = set()
    for (a, s, r, n), v in groups.items():
        key = f"s{s}" if a == "sft" else f"s{s}_r{r}"
        want = res.get("arms", {}).get(a, {}).get(key, {}).get(str(n), "missing")
        seen.add((a, key, str(n)))
        if want == "missing":
            ck.errors.append(f"arms[{a}][{key}][{n}] missing from the json ({len(v)} attempts)")
            continue
        ck.close(f"arms[{a}][{key}][{n}] pass@1", mean_rate(v), want, kind="pass@1")
    for a, by_run in res.get("arms", {}).items():
        for key, by in by_run.items():
            for n in by:
                if (a, key, n) not in seen:
                    ck.errors.append(f"arms[{a}][{key}][{n}] has no attempts in attempts.jsonl")
    for a, curve in res.get("curves", {}).items():
        for n, c in curve.items():
            v = arm_rows(groups, "sft", 0, runs.sft_seeds(a)) if n == "0" else arm_rows(groups, a, int(n))
            ck.close(f"curves[{a}][{n}] pass@1", mean_rate(v), c["pass@1"], kind="pass@1")
            ck.same(f"curves[{a}][{n}] attempts", len(v), c["attempts"])
    sft = arm_rows(groups, "sft", 0)
    pak, pak_tasks = res.get("sft_pass_at_k", {}), res.get("sft_pass_at_k_tasks", {})
    for key, curve in pak.items():
        rows = sft if key == "all" else [x for x in sft if f"s{x['sft_seed']}" == key]
        t = per_task(rows)
        ck.same(f"sft_pass_at_k[{key}] k values", sorted(map(int, curve)),
                list(range(1, max((n for p, n in t.values()), default=0) + 1)), kind="pass@k")
        for k, want in curve.items():
            use = [(p, n) for p, n in t.values() if n >= int(k)]  # the estimator needs k <= n
            got = float(np.mean([unbiased(n, p, int(k)) for p, n in use])) if use else None
            ck.close(f"sft_pass_at_k[{key}][{k}]", got, want, kind="pass@k")
            ck.same(f"sft_pass_at_k_tasks[{key}][{k}]", {"tasks": len(use), "excluded": len(t) - len(use)},
                    pak_tasks.get(key, {}).get(k), kind="pass@k")


def check_final_steps(ck: Checker, res: dict, groups, runs: Runs) -> dict[str, bool]:
    """Each RL arm's final step and runs; an arm with a run lacking attempts there must have no final step.
    Returns arm -> available (as the json has it, once consistent)."""
    avail = {}
    fsc = res.get("final_step_check", {})
    for arm in sorted({a for (a, s, r, n) in groups if a != "sft"}):
        c = fsc.get(arm)
        if c is None:
            ck.errors.append(f"final_step_check has no entry for {arm}")
            continue
        ck.same(f"final_step_check[{arm}] step", runs.final(arm), c["step"], kind="final steps")
        ck.same(f"final_step_check[{arm}] runs", [f"s{s}_r{r}" for s, r in runs.expected(arm)], c["runs"],
                kind="final steps")
        lack = runs.lacking(arm)
        for key in lack:
            if not any(p.startswith(f"{arm} {key} ") for p in c["problems"]):
                ck.errors.append(f"final_step_check[{arm}]: run {key} has no attempts at step {c['step']} but is "
                                 f"not listed as a problem")
        if c["available"] != (not c["problems"]):
            ck.errors.append(f"final_step_check[{arm}]: available {c['available']} with problems {c['problems']}")
        if c["problems"] and not lack:
            ck.warnings.append(f"{arm}: unavailable for reasons attempts.jsonl cannot show ({c['problems']})")
        ck.same(f"final_steps[{arm}]", runs.final(arm) if c["available"] else None,
                res.get("final_steps", {}).get(arm), kind="final steps")
        avail[arm] = c["available"] and not lack
    return avail


def runs_tasks_interval(a: dict, b: dict, b_fixed: bool, tasks: list[str], seed: int) -> tuple[float, float]:
    """Runs redrawn (multinomial counts) within each SFT seed of each RL side, the SFT side fixed, then tasks."""
    rng = np.random.default_rng(seed)
    T = len(tasks)

    def rates(side: dict, fixed: bool) -> np.ndarray:
        P, N = np.zeros((RESAMPLES, T)), np.zeros((RESAMPLES, T))
        for s in sorted(side):
            runs = [side[s][k] for k in sorted(side[s])]
            m = len(runs)
            p = np.array([[c[t][0] if t in c else 0 for t in tasks] for c in runs], dtype=float)
            n = np.array([[c[t][1] if t in c else 0 for t in tasks] for c in runs], dtype=float)
            w = np.ones((RESAMPLES, m)) if fixed else rng.multinomial(m, np.full(m, 1.0 / m), size=RESAMPLES)
            P += w @ p
            N += w @ n
        with np.errstate(invalid="ignore", divide="ignore"):
            return P / N

    diff = rates(a, False) - rates(b, b_fixed)
    w = rng.multinomial(T, np.full(T, 1.0 / T), size=RESAMPLES)
    ok = ~np.isnan(diff)
    means = (w * np.where(ok, diff, 0.0)).sum(axis=1) / (w * ok).sum(axis=1)
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def cluster_interval(d: np.ndarray, labels: list[str], seed: int) -> tuple[float, float]:
    """Whole clusters drawn (multinomial counts): the mean of d over the drawn clusters' tasks."""
    uniq = sorted(set(labels))
    sums = np.array([sum(x for x, lab in zip(d, labels) if lab == u) for u in uniq])
    sizes = np.array([sum(lab == u for lab in labels) for u in uniq], dtype=float)
    w = np.random.default_rng(seed).multinomial(len(uniq), np.full(len(uniq), 1.0 / len(uniq)), size=RESAMPLES)
    means = (w @ sums) / (w @ sizes)
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def pooled(side: dict) -> dict[str, float]:
    tot: dict[str, list[int]] = {}
    for by_run in side.values():
        for c in by_run.values():
            for t, (p, n) in c.items():
                x = tot.setdefault(t, [0, 0])
                x[0] += p
                x[1] += n
    return {t: p / n for t, (p, n) in tot.items()}


def compare(ck: Checker, what: str, want: dict, A: dict, B: dict, b_fixed: bool, seed: int,
            instruction: dict | None) -> float | None:
    ra, rb = pooled(A), pooled(B)
    common = sorted(set(ra) & set(rb))
    ck.same(f"{what} tasks", len(common), want["tasks"])
    if not common:
        return None
    d = np.array([ra[t] - rb[t] for t in common])
    ck.close(f"{what} mean", float(d.mean()), want["mean"], kind="comparison means")
    lo, hi = interval(d, seed)
    ck.close(f"{what} lower end", lo, want["lo"], INTERVAL, kind="interval ends")
    ck.close(f"{what} upper end", hi, want["hi"], INTERVAL, kind="interval ends")
    ck.same(f"{what} ci95", [want["lo"], want["hi"]], want.get("ci95"))
    rt = runs_tasks_interval(A, B, b_fixed, common, seed + 7)
    for end, got, w in zip(("lower", "upper"), rt, want.get("ci95_runs_tasks") or [None, None]):
        ck.close(f"{what} runs x tasks {end} end", got, w, INTERVAL_NEW, kind="runs x tasks interval ends")
    if instruction is not None:
        labels = [instruction[t] for t in common]
        ck.same(f"{what} instruction clusters", len(set(labels)), want.get("instruction_clusters"))
        ci = cluster_interval(d, labels, seed + 13)
        for end, got, w in zip(("lower", "upper"), ci, want.get("ci95_instruction_clusters") or [None, None]):
            ck.close(f"{what} instruction-cluster {end} end", got, w, INTERVAL_NEW,
                     kind="instruction-cluster interval ends")
    return lo


def check_comparisons(ck: Checker, res: dict, groups, runs: Runs, avail: dict[str, bool], rows) -> list[str]:
    flips = []
    instruction = {r["task_id"]: r["instruction"] for r in rows}
    comp = res.get("comparisons", {})
    ck.same("comparisons recorded", sorted(comp), sorted(COMPARISONS))
    for i, (name, c) in enumerate(comp.items()):
        a, b = name.split("-")
        ok = avail.get(a, False) and (b == "sft" or (avail.get(b, False) and runs.final(a) == runs.final(b)))
        seeds = runs.sft_seeds(a)
        if ok and b == "sft":
            ok = all(groups.get(("sft", s, None, 0)) for s in seeds)
        if not ok:
            ck.same(f"{name} available", False, c.get("available"), kind="availability")
            if not c.get("reason"):
                ck.errors.append(f"{name}: unavailable without a reason")
            continue
        ck.same(f"{name} available", True, c.get("available"), kind="availability")
        if not c.get("available"):
            continue
        ck.same(f"{name} steps", (runs.final(a), runs.final(b)), (c["a_step"], c["b_step"]))
        A = runs.side(a, runs.final(a), runs=set(runs.expected(a)))
        B = (runs.side("sft", 0, seeds) if b == "sft" else runs.side(b, runs.final(b), runs=set(runs.expected(b))))
        lo = compare(ck, name, c, A, B, b == "sft", SEED + i, instruction)
        both = sorted(set(A) & set(B))
        ck.same(f"{name} per-SFT-seed keys", [f"s{s}" for s in both], list(c.get("per_sft_seed", {})))
        means = []
        for j, s in enumerate(both):
            v = c["per_sft_seed"].get(f"s{s}", {})
            compare(ck, f"{name} s{s}", v, {s: A[s]}, {s: B[s]}, b == "sft", SEED + 100 * (i + 1) + j, None)
            means.append(v.get("mean"))
        agrees = bool(means) and None not in means and (all(m > 0 for m in means) or all(m < 0 for m in means))
        ck.same(f"{name} sign_agrees_per_sft_seed", agrees, c.get("sign_agrees_per_sft_seed"))
        per_run = {}
        for s in both:
            for key, ca in A[s].items():
                cb = B[s].get(f"s{s}" if b == "sft" else key)
                common = sorted(set(ca) & set(cb or {}))
                if common:
                    per_run[key] = float(np.mean([ca[t][0] / ca[t][1] - cb[t][0] / cb[t][1] for t in common]))
        want_runs = c.get("per_run", {})
        ck.same(f"{name} per_run runs", sorted(per_run), sorted(want_runs))
        for key, got in per_run.items():
            ck.close(f"{name} per_run[{key}]", got, want_runs.get(key), kind="per-run differences")
        if lo is not None and c.get("lo") is not None and (lo > 0) != (c["lo"] > 0):
            flips.append(name)

    def goal_met(key: str) -> bool:
        def lo_of(n):
            c = comp.get(n) or {}
            return (c.get(key) or [None])[0] if c.get("available") else None

        above = all(lo_of(n) is not None and lo_of(n) > 0 for n in ("grpo-sft", "dppo-sft", "grpo-rft", "dppo-rft"))
        return above and lo_of("placebo-sft") is not None and lo_of("placebo-sft") <= 0

    ck.same("goal_met", goal_met("ci95"), res.get("goal_met"))
    ck.same("goal_met_strict", goal_met("ci95_runs_tasks"), res.get("goal_met_strict"))
    ck.same("goal_met_instruction_clusters", goal_met("ci95_instruction_clusters"),
            res.get("goal_met_instruction_clusters"))
    return flips


def check_gates(ck: Checker, res: dict, groups) -> None:
    gng = res.get("go_no_go", {})
    gates = gng.get("gates", [])
    for g in gates:
        rows = arm_rows(groups, "sft", 0, {g["sft_seed"]})
        t = per_task(rows)
        if not t:
            ck.errors.append(f"go/no-go of SFT seed {g['sft_seed']}: no SFT attempts in attempts.jsonl")
            continue
        rates = [p / n for p, n in t.values()]
        p1 = sum(rates) / len(rates)
        full = [(p, n) for p, n in t.values() if n >= g["samples"]]  # pass@n needs n attempts
        pn = sum(p > 0 for p, n in full) / max(1, len(full))
        mixed = sum(0 < x < 1 for x in rates) / len(rates)
        w = f"go/no-go seed {g['sft_seed']}"
        ck.same(f"{w} tasks", len(t), g["tasks"], kind="go/no-go")
        ck.close(f"{w} pass@1", p1, g["pass@1"], kind="go/no-go")
        ck.close(f"{w} pass@{g['samples']}", pn, g[f"pass@{g['samples']}"], kind="go/no-go")
        ck.close(f"{w} pass@k - pass@1", pn - p1, g["pass@k_minus_pass@1"], kind="go/no-go")
        ck.close(f"{w} mixed share", mixed, g["mixed_frac"], kind="go/no-go")
        ck.same(f"{w} verdict", verdict(p1, pn, mixed), g["verdict"], kind="go/no-go")
        ck.same(f"{w} criteria (the pre-registered ones)", g.get("criteria"), GO, kind="go/no-go")
    overall = "not run" if not gates else ("go" if all(g["verdict"] == "go" for g in gates) else "no-go")
    ck.same("go/no-go overall verdict", overall, gng.get("verdict"), kind="go/no-go")


def rate(rows, inspected: bool | None = None) -> float:
    """Passes (among attempts that inspected / did not, when given) over all attempts."""
    if not rows:
        return 0.0
    return sum(bool(x["passed"]) and (inspected is None or bool(x["inspected"]) == inspected) for x in rows) / len(rows)


def check_failure_modes(ck: Checker, res: dict, groups, rows, runs: Runs, avail: dict[str, bool]) -> None:
    for r in rows:
        if r["failure_mode"] not in MODES or (r["failure_mode"] == "passed") != bool(r["passed"]):
            ck.errors.append(f"attempt {r['arm']} s{r['sft_seed']} r{r['seed']} step {r['step']} {r['task_id']}/"
                             f"{r['sample']}: failure_mode {r['failure_mode']!r} with passed={r['passed']}")
            break
    for arm, fm in res.get("failure_modes", {}).items():
        if arm != "sft":
            ck.same(f"failure_modes[{arm}] available", avail.get(arm, False), fm.get("available"),
                    kind="availability")
            if not fm.get("available"):
                continue
        fin = runs.final(arm)
        base = None if arm == "sft" else runs.sft_seeds(arm)
        want = set(runs.expected(arm)) if arm != "sft" else None
        if arm != "sft":
            ck.same(f"failure_modes[{arm}] final step", fin, fm["final_step"])
            ck.same(f"failure_modes[{arm}] SFT seeds", sorted(base), fm["sft_seeds"])
        sides = {}
        for n, blk in fm["steps"].items():
            v = (arm_rows(groups, "sft", 0, base) if n == "0" else
                 [x for x in arm_rows(groups, arm, int(n)) if want is None or (x["sft_seed"], x["seed"]) in want])
            sides[n] = v
            ck.same(f"failure_modes[{arm}][{n}] attempts", len(v), blk["attempts"], kind="failure-mode counts")
            for m in MODES:
                ck.same(f"failure_modes[{arm}][{n}] {m}", sum(x["failure_mode"] == m for x in v), blk["counts"][m],
                        kind="failure-mode counts")
            ck.same(f"failure_modes[{arm}][{n}] inspected", sum(bool(x["inspected"]) for x in v), blk["inspected"],
                    kind="failure-mode counts")
        for g, by in fm.get("by_grade", {}).items():
            for n, blk in by.items():
                v = [x for x in sides[n] if str(x["grade"]) == g]
                ck.same(f"failure_modes[{arm}] grade {g} [{n}] counts", [sum(x["failure_mode"] == m for x in v)
                                                                         for m in MODES],
                        [blk["counts"][m] for m in MODES], kind="failure-mode counts")
                ck.same(f"failure_modes[{arm}] grade {g} [{n}] inspected", sum(bool(x["inspected"]) for x in v),
                        blk["inspected"], kind="failure-mode counts")
        if "lift" in fm:
            old, new = sides["0"], sides[str(fin)]

            lf = fm["lift"]
            ck.close(f"failure_modes[{arm}] lift total", rate(new) - rate(old), lf["total_change"], kind="lift")
            for key, want in (("inspected", True), ("not_inspected", False)):
                got = rate(new, want) - rate(old, want)
                ck.close(f"failure_modes[{arm}] lift {key}", got, lf[key], kind="lift")


def tokens(text: str) -> list[str]:
    """Whitespace words, lower-cased, with leading/trailing punctuation removed (a path is one word)."""
    out = []
    for w in text.lower().split():
        w = re.sub(r"^[^a-z0-9/]+|[^a-z0-9]+$", "", w)
        if w:
            out.append(w)
    return out


def grams(text: str, n: int) -> set[tuple]:
    t = tokens(text)
    return set(zip(*(t[i:] for i in range(n))))


def check_disjointness(ck: Checker, res: dict, rows, dev_rows: list[dict] | None = None) -> str:
    st = res.get("settings") or {}
    keys = ("sft_seeds", "n_sft", "look_frac", "n_rl", "n_heldout")
    if any(k not in st for k in keys):
        ck.errors.append(f"the json's settings lack {[k for k in keys if k not in st]}: cannot regenerate the tasks")
        return ""
    # every SFT seed's data (the candidates, chosen on the dev tasks or not) is in the 8-gram filter's input
    gen = {**{k: st[k] for k in keys}, "sft_seeds": st.get("sft_candidates", st["sft_seeds"])}
    specs, _ = data.generate(**gen, heldout_seed=st.get("heldout_seed", 0), n_dev=st.get("n_dev", 0))
    dev = specs.pop("dev", None)  # the validation split: never trained on; checked like the held-out tasks below
    if dev is not None:
        check_dev(ck, res, dev, specs, dev_rows or [])
    held = specs["heldout"]
    n = family.NGRAM
    dj = res.get("disjointness") or {}
    ck.same("disjointness n-gram size", n, dj.get("ngram_n"), kind="disjointness")
    ck.same("disjointness all_zero", True, dj.get("all_zero"), kind="disjointness")
    ck.same("held-out tasks generated", len(held), st["n_heldout"], kind="disjointness")
    norm = {" ".join(tokens(s.instruction)) for s in held}
    hgrams = [grams(s.instruction, n) for s in held]
    htemplates = [s.template for s in held]
    for src, v in specs.items():
        if src == "heldout":
            continue
        texts = [s.instruction for s in v]
        tnorm = {" ".join(tokens(t)) for t in texts}
        tg = set().union(*(grams(t, n) for t in texts))
        exact = sum(" ".join(tokens(s.instruction)) in tnorm for s in held)
        shared = sum(bool(g & tg) for g in hgrams)
        slots = [{s.template[i] for s in v} for i in range(2)]  # the frame (intro, ask); key phrases are shared
        reused = sum(any(t[i] in slots[i] for i in range(2)) for t in htemplates)
        for what, got in (("exact", exact), ("ngram", shared), ("template_slot", reused)):
            ck.same(f"disjointness {src} {what} (must be 0)", got, 0, kind="disjointness")
            if isinstance(dj.get(src), dict):
                ck.same(f"disjointness[{src}][{what}]", got, dj[src].get(what), kind="disjointness")
            else:
                ck.errors.append(f"disjointness: the json has no entry for {src}")
                break
    # no parameter of a held-out cell is determined by its other two in the training cells (its own loop)
    cell = lambda s: (s.op, s.k, s.src.rsplit(".", 1)[-1])  # noqa: E731
    seen = {cell(s) for src, v in specs.items() if src != "heldout" for s in v}
    guessable = 0
    for c in {cell(s) for s in held}:
        for i in range(3):
            others = {t[i] for t in seen if all(t[j] == c[j] for j in range(3) if j != i)}
            guessable += c[0] != "count" and len(others) < 2
    ck.same("disjointness shortcuts (must be 0)", guessable, 0, kind="disjointness")
    ck.same("disjointness[shortcuts]", guessable, dj.get("shortcuts"), kind="disjointness")
    if len(norm) != len(held):
        ck.warnings.append(f"{len(held) - len(norm)} held-out instructions repeat (with other data files)")
    ids = {family.task_id(s): s for s in held}
    seen = {r["task_id"] for r in rows}
    if seen != set(ids):
        ck.errors.append(f"held-out task ids in attempts.jsonl != the generated held-out tasks': "
                         f"{len(seen - set(ids))} unknown, {len(set(ids) - seen)} never evaluated")
    ck.checked["disjointness"] += 1
    bad = sum(r["instruction"] != ids[r["task_id"]].instruction for r in rows if r["task_id"] in ids)
    ck.same("attempts whose instruction differs from the generated task's", bad, 0, kind="disjointness")
    check_nearest(ck, res.get("disjointness_nearest") or {}, specs)
    return f"{len(held)} held-out tasks vs " + ", ".join(f"{k} {len(v)}" for k, v in specs.items() if k != "heldout")


GO = {"pass1_min": 0.2, "pass1_max": 0.6, "pass8_minus_pass1_min": 0.2, "mixed_frac_min": 0.4}  # pre-registered


def verdict(p1: float, pn: float, mixed: float) -> str:
    """The go/no-go criteria of PREREGISTRATION.md, as written there (not as the json states them)."""
    ok = GO["pass1_min"] <= p1 <= GO["pass1_max"] and pn - p1 >= GO["pass8_minus_pass1_min"] and mixed >= GO[
        "mixed_frac_min"]
    return "go" if ok else "no-go"


def check_dev(ck: Checker, res: dict, dev: list, specs: dict, dev_rows: list[dict]) -> None:
    """The three-way split: the dev tasks share no instruction, word n-gram or sentence frame with SFT/RL data
    (own loop); each SFT seed's dev numbers, recomputed from dev_attempts.jsonl on the generated dev tasks; and
    the SFT seeds are those the pre-registered rule picks from them."""
    n, dj, st = family.NGRAM, res.get("dev_disjointness") or {}, res["settings"]
    ck.same("dev tasks generated", len(dev), st["n_dev"], kind="dev split")
    for src, v in specs.items():
        if src == "heldout":
            continue
        tnorm = {" ".join(tokens(s.instruction)) for s in v}
        tg = set().union(*(grams(s.instruction, n) for s in v))
        slots = [{s.template[i] for s in v} for i in range(2)]
        got = {"exact": sum(" ".join(tokens(s.instruction)) in tnorm for s in dev),
               "ngram": sum(bool(grams(s.instruction, n) & tg) for s in dev),
               "template_slot": sum(any(s.template[i] in slots[i] for i in range(2)) for s in dev)}
        for what, x in got.items():
            ck.same(f"dev disjointness {src} {what} (must be 0)", x, 0, kind="dev split")
            ck.same(f"dev_disjointness[{src}][{what}]", x, (dj.get(src) or {}).get(what), kind="dev split")
    sel, ids = res.get("sft_selection") or {}, {family.task_id(s) for s in dev}
    keep, tried, chosen = st.get("sft_keep"), sel.get("tried", []), []
    ck.same("sft_selection keep = the settings' sft_keep", sel.get("keep"), keep, kind="dev split")
    for g in tried:
        s, w = g["sft_seed"], f"dev check of SFT seed {g['sft_seed']}"
        by: dict[str, list[bool]] = {}
        for r in dev_rows:
            if r["sft_seed"] == s:
                by.setdefault(r["task_id"], []).append(bool(r["passed"]))
        ck.same(f"{w}: its tasks are the generated dev tasks", set(by) == ids, True, kind="dev split")
        if not by:
            continue
        rates = [sum(v) / len(v) for v in by.values()]
        p1 = sum(rates) / len(rates)
        full = [v for v in by.values() if len(v) >= g["samples"]]
        pn = sum(any(v) for v in full) / max(1, len(full))
        mixed = sum(0 < x < 1 for x in rates) / len(rates)
        for key, got in (("pass@1", p1), ("pass@k_minus_pass@1", pn - p1), ("mixed_frac", mixed)):
            ck.close(f"{w}: {key}", got, g[key], kind="dev split")
        ck.same(f"{w}: verdict", verdict(p1, pn, mixed), g["verdict"], kind="dev split")
        if verdict(p1, pn, mixed) == "go" and keep and len(chosen) < keep:
            chosen.append(s)
    cands = st.get("sft_candidates", [])
    ck.same("SFT seeds tried (in order, from the first)", [g["sft_seed"] for g in tried], cands[: len(tried)],
            kind="dev split")
    stopped = len(tried) == len(cands) or (len(chosen) == keep and tried and tried[-1]["sft_seed"] == chosen[-1])
    ck.same("seeds were tried until the rule's stop (the keep-th pass, or no seed left)", bool(stopped), True,
            kind="dev split")
    ck.same("SFT seeds chosen: the first that pass", chosen, sel.get("chosen"), kind="dev split")
    ck.same("SFT seeds of the runs = the chosen ones", sel.get("chosen"), st.get("sft_seeds"), kind="dev split")


def levenshtein(a: str, b: str) -> int:
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i]
        for j, y in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
        prev = cur
    return prev[-1]


def check_nearest(ck: Checker, nd: dict, specs: dict) -> None:
    """The near-duplicate report, with this file's own words: the longest shared word runs (histogram), the
    word-3-gram Jaccard summary, and the edit distance of the json's closest pair."""
    if not nd.get("available"):
        ck.warnings.append(f"no near-duplicate report: {nd.get('reason')}")
        return
    held = sorted({x.instruction for x in specs["heldout"]})
    train = sorted({x.instruction for k, v in specs.items() if k != "heldout" for x in v})
    ck.same("disjointness_nearest instructions", (len(held), len(train)),
            (nd["heldout_instructions"], nd["training_instructions"]), kind="near duplicates")
    tt = [tokens(t) for t in train]
    t3 = [grams(t, 3) for t in train]
    by_n: dict[int, set] = {}
    runs, jac = [], []
    for h in held:
        w = tokens(h)
        run = 0
        while True:
            n = run + 1
            if n not in by_n:
                by_n[n] = {tuple(x[i:i + n]) for x in tt for i in range(len(x) - n + 1)}
            if n > len(w) or not {tuple(w[i:i + n]) for i in range(len(w) - n + 1)} & by_n[n]:
                break
            run = n
        runs.append(run)
        g = grams(h, 3)
        jac.append(max(len(g & x) / len(g | x) if g | x else 0.0 for x in t3))
    hist = {str(n): runs.count(n) for n in range(max(runs) + 1)}
    ck.same("disjointness_nearest longest shared word runs", hist, nd["longest_shared_words"]["histogram"],
            kind="near duplicates")
    for key, got in (("min", min(jac)), ("median", float(np.median(jac))), ("max", max(jac))):
        ck.close(f"disjointness_nearest jaccard_word3 {key}", got, nd["jaccard_word3"][key], kind="near duplicates")
    c = nd["closest"]["char_edit"]
    got = levenshtein(c["heldout"], c["training"]) / max(len(c["heldout"]), len(c["training"]))
    ck.close("disjointness_nearest closest char_edit", got, c["value"], kind="near duplicates")
    ck.same("disjointness_nearest char_edit min", c["value"], nd["char_edit"]["min"], kind="near duplicates")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="recompute learning_v2.json from attempts.jsonl (module docstring)")
    ap.add_argument("--results", required=True, help="the directory with learning_v2.json and learning_v2/")
    args = ap.parse_args(argv)
    d = Path(args.results)
    res = json.loads((d / "learning_v2.json").read_text())
    rows = [json.loads(x) for x in (d / "learning_v2" / "attempts.jsonl").read_text().splitlines() if x.strip()]
    ck = Checker()
    ck.same("attempts", len(rows), res.get("attempts"))
    dup = len(rows) - len({(r["arm"], r["sft_seed"], r["seed"], r["step"], r["task_id"], r["sample"]) for r in rows})
    ck.same("duplicate attempts", dup, 0)
    groups = group(rows)
    runs = Runs(res, groups)
    check_arms(ck, res, groups, runs)
    avail = check_final_steps(ck, res, groups, runs)
    flips = check_comparisons(ck, res, groups, runs, avail, rows)
    check_gates(ck, res, groups)
    check_failure_modes(ck, res, groups, rows, runs, avail)
    dev_path = d / "learning_v2" / "dev_attempts.jsonl"
    dev_rows = [json.loads(x) for x in dev_path.read_text().splitlines() if x.strip()] if dev_path.is_file() else []
    chosen = (res.get("sft_selection") or {}).get("chosen")
    if chosen is not None:  # no held-out attempt of an SFT seed that the dev tasks did not choose
        ck.same("SFT seeds in attempts.jsonl (all arms) within the chosen ones",
                sorted({r["sft_seed"] for r in rows} - set(chosen)), [], kind="dev split")
    dis = check_disjointness(ck, res, rows, dev_rows)
    if flips:
        ck.warnings.append("own intervals put the lower end on the other side of 0 for " + ", ".join(flips)
                           + " (within tolerance): the goal verdict is that close")
    for w in ck.warnings:
        print("warning:", w)
    if ck.errors:
        print(f"recheck FAILED: {len(ck.errors)} mismatch(es)", file=sys.stderr)
        for e in ck.errors:
            print("  -", e, file=sys.stderr)
        return 1
    print(f"recheck OK: {len(rows)} attempts; " + ", ".join(f"{v} {k}" for k, v in ck.checked.items())
          + f" checked; goal_met {res.get('goal_met')}; disjointness: {dis}, all overlaps 0")
    return 0


if __name__ == "__main__":
    sys.exit(main())
