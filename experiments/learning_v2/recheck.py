"""Recompute the learning_v2 results independently of analyze.py (its own statistics, nothing imported from it):

    .venv/bin/python experiments/learning_v2/recheck.py --results experiments/results

reads RESULTS/learning_v2/attempts.jsonl and RESULTS/learning_v2.json and checks

- every pass@1 in ``arms`` (per run and step: the mean over tasks of the task's pass rate) and in ``curves``, and
  the SFT pass@k curve (unbiased estimator, as a product);
- each arm's final step (the largest step every run of the arm evaluated), every comparison's mean (to 1e-9) and
  95% interval (its own paired bootstrap over tasks, 10,000 resamples drawn as multinomial counts, another seed;
  to 0.02), per SFT seed too, and ``goal_met`` against the pre-registered rule;
- the go/no-go numbers (pass@1, pass@n, their difference, the share of tasks with 0 < rate < 1, the verdict)
  from the SFT attempts;
- the failure-mode counts and inspected counts of ``failure_modes`` (per grade too) and its lift totals;
- disjointness against the tasks the code generates (``data.generate`` with the json's settings): no held-out
  instruction equals or shares a word n-gram (n = family.NGRAM, whitespace words by its own code) with any
  SFT/RL instruction, no held-out template phrasing occurs in any training instruction's template, the json's
  overlap counts equal these, and the held-out task ids of attempts.jsonl are exactly ``family.task_id`` of the
  generated held-out specs (with their instructions).

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

EXACT, INTERVAL = 1e-9, 0.02
RESAMPLES, SEED = 10_000, 20_240_917
MODES = ("passed", "wrong_format", "gave_up", "turn_limit", "other")


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


def final_step(groups, arm: str) -> int | None:
    if arm == "sft":
        return 0
    runs = defaultdict(set)
    for a, s, r, n in groups:
        if a == arm:
            runs[(s, r)].add(n)
    if not runs:
        return None
    common = set.intersection(*runs.values())
    return max(common) if common else max(max(v) for v in runs.values())


def arm_rows(groups, arm: str, step: int, seeds=None):
    return [x for (a, s, r, n), v in groups.items() if a == arm and n == step and (seeds is None or s in seeds)
            for x in v]


def seeds_of(groups, arm: str, step: int) -> set[int]:
    return {s for (a, s, r, n) in groups if a == arm and n == step}


def check_arms(ck: Checker, res: dict, groups) -> None:
    seen = set()
    for (a, s, r, n), v in groups.items():
        key = f"s{s}" if a == "sft" else f"s{s}_r{r}"
        want = res.get("arms", {}).get(a, {}).get(key, {}).get(str(n), "missing")
        seen.add((a, key, str(n)))
        if want == "missing":
            ck.errors.append(f"arms[{a}][{key}][{n}] missing from the json ({len(v)} attempts)")
            continue
        ck.close(f"arms[{a}][{key}][{n}] pass@1", mean_rate(v), want, kind="pass@1")
    for a, runs in res.get("arms", {}).items():
        for key, by in runs.items():
            for n in by:
                if (a, key, n) not in seen:
                    ck.errors.append(f"arms[{a}][{key}][{n}] has no attempts in attempts.jsonl")
    for a, curve in res.get("curves", {}).items():
        fin = final_step(groups, a)
        base = seeds_of(groups, a, fin)
        for n, c in curve.items():
            v = arm_rows(groups, "sft", 0, base) if n == "0" else arm_rows(groups, a, int(n))
            ck.close(f"curves[{a}][{n}] pass@1", mean_rate(v), c["pass@1"], kind="pass@1")
            ck.same(f"curves[{a}][{n}] attempts", len(v), c["attempts"])
    sft = arm_rows(groups, "sft", 0)
    pak = res.get("sft_pass_at_k", {})
    for key, curve in pak.items():
        rows = sft if key == "all" else [x for x in sft if f"s{x['sft_seed']}" == key]
        t = per_task(rows)
        for k, want in curve.items():
            got = float(np.mean([unbiased(n, p, int(k)) for p, n in t.values()])) if t else None
            ck.close(f"sft_pass_at_k[{key}][{k}]", got, want, kind="pass@k")


def side_rows(groups, a: str, b: str, arm: str, seeds):
    """Attempts of ``arm`` (one side of comparison a-b) at its final step; sft: step 0 of the SFT seeds that a's
    final-step runs start from (when b is sft), restricted to ``seeds``."""
    if arm == "sft":
        base = seeds_of(groups, a, final_step(groups, a)) if b == "sft" else None
        use = base if seeds is None else (set(seeds) if base is None else base & set(seeds))
        return arm_rows(groups, "sft", 0, use)
    return arm_rows(groups, arm, final_step(groups, arm), seeds)


def compare(ck: Checker, groups, a: str, b: str, what: str, want: dict, seeds, seed: int) -> float | None:
    ta = per_task(side_rows(groups, a, b, a, seeds))
    tb = per_task(side_rows(groups, a, b, b, seeds))
    common = sorted(set(ta) & set(tb))
    ck.same(f"{what} tasks", len(common), want["tasks"])
    if not common:
        return None
    d = np.array([ta[t][0] / ta[t][1] - tb[t][0] / tb[t][1] for t in common])
    ck.close(f"{what} mean", float(d.mean()), want["mean"], kind="comparison means")
    lo, hi = interval(d, seed)
    ck.close(f"{what} lower end", lo, want["lo"], INTERVAL, kind="interval ends")
    ck.close(f"{what} upper end", hi, want["hi"], INTERVAL, kind="interval ends")
    return lo


def check_comparisons(ck: Checker, res: dict, groups) -> list[str]:
    flips = []
    for i, (name, c) in enumerate(res.get("comparisons", {}).items()):
        a, b = name.split("-")
        ck.same(f"{name} steps", (final_step(groups, a), final_step(groups, b)), (c["a_step"], c["b_step"]))
        lo = compare(ck, groups, a, b, name, c, None, SEED + i)
        for j, (key, v) in enumerate(c.get("per_sft_seed", {}).items()):
            compare(ck, groups, a, b, f"{name} {key}", v, {int(key[1:])}, SEED + 100 * (i + 1) + j)
        if lo is not None and c.get("lo") is not None and (lo > 0) != (c["lo"] > 0):
            flips.append(name)
    # the goal, from the json's intervals
    comp = res.get("comparisons", {})

    def lo_of(n):
        return (comp.get(n) or {}).get("lo")

    above = all(lo_of(n) is not None and lo_of(n) > 0 for n in ("grpo-sft", "dppo-sft", "grpo-rft", "dppo-rft"))
    met = above and lo_of("placebo-sft") is not None and lo_of("placebo-sft") <= 0
    ck.same("goal_met", met, res.get("goal_met"))
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
        pn = sum(p > 0 for p, n in t.values()) / len(t)
        mixed = sum(0 < x < 1 for x in rates) / len(rates)
        w = f"go/no-go seed {g['sft_seed']}"
        ck.same(f"{w} tasks", len(t), g["tasks"], kind="go/no-go")
        ck.close(f"{w} pass@1", p1, g["pass@1"], kind="go/no-go")
        ck.close(f"{w} pass@{g['samples']}", pn, g[f"pass@{g['samples']}"], kind="go/no-go")
        ck.close(f"{w} pass@k - pass@1", pn - p1, g["pass@k_minus_pass@1"], kind="go/no-go")
        ck.close(f"{w} mixed share", mixed, g["mixed_frac"], kind="go/no-go")
        cr = g["criteria"]
        go = (cr["pass1_min"] <= p1 <= cr["pass1_max"] and pn - p1 >= cr["pass8_minus_pass1_min"]
              and mixed >= cr["mixed_frac_min"])
        ck.same(f"{w} verdict", "go" if go else "no-go", g["verdict"], kind="go/no-go")
    overall = "not run" if not gates else ("go" if all(g["verdict"] == "go" for g in gates) else "no-go")
    ck.same("go/no-go overall verdict", overall, gng.get("verdict"), kind="go/no-go")


def rate(rows, inspected: bool | None = None) -> float:
    """Passes (among attempts that inspected / did not, when given) over all attempts."""
    if not rows:
        return 0.0
    return sum(bool(x["passed"]) and (inspected is None or bool(x["inspected"]) == inspected) for x in rows) / len(rows)


def check_failure_modes(ck: Checker, res: dict, groups, rows) -> None:
    for r in rows:
        if r["failure_mode"] not in MODES or (r["failure_mode"] == "passed") != bool(r["passed"]):
            ck.errors.append(f"attempt {r['arm']} s{r['sft_seed']} r{r['seed']} step {r['step']} {r['task_id']}/"
                             f"{r['sample']}: failure_mode {r['failure_mode']!r} with passed={r['passed']}")
            break
    for arm, fm in res.get("failure_modes", {}).items():
        fin = final_step(groups, arm)
        base = None if arm == "sft" else seeds_of(groups, arm, fin)
        if arm != "sft":
            ck.same(f"failure_modes[{arm}] final step", fin, fm["final_step"])
            ck.same(f"failure_modes[{arm}] SFT seeds", sorted(base), fm["sft_seeds"])
        sides = {}
        for n, blk in fm["steps"].items():
            v = arm_rows(groups, "sft", 0, base) if n == "0" else arm_rows(groups, arm, int(n))
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


def check_disjointness(ck: Checker, res: dict, rows) -> str:
    st = res.get("settings") or {}
    keys = ("sft_seeds", "n_sft", "look_frac", "n_rl", "n_heldout")
    if any(k not in st for k in keys):
        ck.errors.append(f"the json's settings lack {[k for k in keys if k not in st]}: cannot regenerate the tasks")
        return ""
    specs, _ = data.generate(**{k: st[k] for k in keys}, heldout_seed=st.get("heldout_seed", 0))
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
        slots = [{s.template[i] for s in v} for i in range(3)]
        reused = sum(any(t[i] in slots[i] for i in range(3)) for t in htemplates)
        for what, got in (("exact", exact), ("ngram", shared), ("template_slot", reused)):
            ck.same(f"disjointness {src} {what} (must be 0)", got, 0, kind="disjointness")
            if isinstance(dj.get(src), dict):
                ck.same(f"disjointness[{src}][{what}]", got, dj[src].get(what), kind="disjointness")
            else:
                ck.errors.append(f"disjointness: the json has no entry for {src}")
                break
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
    return f"{len(held)} held-out tasks vs " + ", ".join(f"{k} {len(v)}" for k, v in specs.items() if k != "heldout")


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
    check_arms(ck, res, groups)
    flips = check_comparisons(ck, res, groups)
    check_gates(ck, res, groups)
    check_failure_modes(ck, res, groups, rows)
    dis = check_disjointness(ck, res, rows)
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
