"""experiments/learning_v2/analyze.py and recheck.py on a small synthetic run directory (hand-written transcripts,
no model; 2 SFT seeds x 2 RL seeds): the outputs exist, the failure modes follow the documented rules, the
intervals (over tasks, runs x tasks, instruction clusters) and per-run differences are there and the independent
recheck agrees (and catches tampered numbers); a run that stops early makes its arm's comparisons unavailable."""

from __future__ import annotations

import importlib.util
import json
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxrl_term.agent.actions import SENTINEL
from jaxrl_term.tasks.formats import save_parquet

EXP = Path(__file__).resolve().parents[1] / "experiments" / "learning_v2"
sys.path.insert(0, str(EXP))

import data  # noqa: E402
import family  # noqa: E402


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"learning_v2_{name}", EXP / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


analyze, recheck, run = _load("analyze"), _load("recheck"), _load("run")
# the three-way split: SFT seeds tried in the order 0, 2, 1 on the dev tasks, 2 kept; seed 2 fails its dev check
SETTINGS = {"sft_seeds": [0, 2, 1], "sft_keep": 2, "n_dev": 8, "rl_seeds": [0, 1], "arms": ["grpo", "rft", "placebo"],
            "n_sft": 1500, "look_frac": 0.25, "n_rl": 10, "n_heldout": 12, "steps": 8, "eval_every": 4,
            "gonogo_samples": 8}
CHOSEN = [0, 1]
P_LOOK = {"sft": 0.3, "grpo": 0.8, "rft": 0.5, "placebo": 0.3, "dev_sft": 0.15, "bad_sft": 0.0}


def episode(spec, kind: str) -> tuple[list[str], bool, str]:
    """(commands, passed, end_reason) of a scripted behaviour."""
    done = f"echo {SENTINEL}"
    if kind == "look":
        return [f"head -n 3 {spec.src}", family.command(spec, spec.delim, spec.header), done], True, "finished"
    if kind == "assume":
        return [family.command(spec, ",", False), done], spec.default_ok, "finished"
    if kind == "give_up":
        return [done], False, "finished"
    if kind == "loop":
        return [f"cat {spec.src}"] * 4, False, "max_turns"
    return [f"echo 0 > {spec.dst}", done], False, "finished"  # a right-format-free wrong answer: "other"


def transcript(spec, j: int, kind: str) -> dict:
    cmds, ok, end = episode(spec, kind)
    turns = [{"index": i, "reply": f"step\n```bash\n{c}\n```", "actions": [{"tool": "bash", "args": {"cmd": c}}],
              "errors": [], "results": [{"text": "", "exit_code": 0}]} for i, c in enumerate(cmds)]
    return {"id": f"{family.task_id(spec)}/attempt-{j}", "task": family.task_id(spec), "attempt": j,
            "instruction": spec.instruction, "pass": ok, "end_reason": end, "turns": turns, "kind": kind}


def write_eval(d: Path, held, arm: str, key: tuple, samples: int) -> list[dict]:
    rng = random.Random(f"{arm}/{key}")
    trs = []
    for spec in held:
        for j in range(samples):
            u = rng.random()
            kind = "look" if u < P_LOOK[arm] else rng.choice(["assume", "assume", "assume", "give_up", "loop",
                                                               "other"])
            kind = "give_up" if arm == "bad_sft" else kind
            trs.append(transcript(spec, j, kind))
    d.mkdir(parents=True)
    stale = dict(trs[0], **{"pass": not trs[0]["pass"]})  # an earlier record of the same attempt: the last wins
    unfinished = transcript(held[0], samples, "look")  # a transcript whose attempt never finished: dropped
    lines = [stale] + trs + [unfinished]
    (d / "transcripts.jsonl").write_text("".join(json.dumps(t) + "\n" for t in lines))
    (d / "attempts.jsonl").write_text("".join(json.dumps({"task": t["task"], "attempt": t["attempt"],
                                                          "pass": t["pass"]}) + "\n" for t in trs))
    (d / "summary.json").write_text("{}")
    return trs


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    root = tmp_path_factory.mktemp("lv2") / "root"
    params = {k: SETTINGS[k] for k in ("sft_seeds", "n_sft", "look_frac", "n_rl", "n_heldout", "n_dev")}
    specs, _ = data.generate(**params)
    held, dev = specs["heldout"], specs.pop("dev")
    (root / "data").mkdir(parents=True)
    save_parquet([family.to_task(s) for s in held], root / "data" / "heldout.parquet")
    trained = {k: v for k, v in specs.items() if k != "heldout"}
    info = {"disjointness": family.disjointness(held, trained), "dev_disjointness": family.disjointness(dev, trained)}
    (root / "data" / "instructions.json").write_text(json.dumps({k: [s.instruction for s in v]
                                                                 for k, v in {**specs, "dev": dev}.items()}))
    for s in SETTINGS["sft_seeds"]:  # run.select_sft on the dev checks' transcripts (SFT itself is done)
        (root / f"sft_{s}" / "hf_final").mkdir(parents=True)
        (root / f"sft_{s}" / "hf_final" / "config.json").write_text("{}")
        write_eval(root / f"sft_{s}_dev", dev, "bad_sft" if s == 2 else "dev_sft", (s, "dev"), 8)
    assert run.select_sft(root, SETTINGS, [], lambda name, fn, *a: fn(*a)) == CHOSEN
    truth = {("sft", s, None, 0): write_eval(root / f"sft_{s}_eval", held, "sft", (s,), 8) for s in CHOSEN}
    for arm in SETTINGS["arms"]:
        for s in CHOSEN:
            for r in SETTINGS["rl_seeds"]:
                for n in (4, 8):
                    d = root / "runs" / f"{arm}_s{s}_r{r}" / "eval" / f"step_{n:06d}"
                    truth[(arm, s, r, n)] = write_eval(d, held, arm, (s, r, n), 4)
    gates = [run.go_no_go(root, s, 8) for s in CHOSEN]
    results, timing = root / "results", {"data": 1.0, "rl_total": 7200.0}
    (root / "go_no_go.json").write_text(json.dumps(gates))
    (root / "data" / "data.json").write_text(json.dumps(info))
    (root / "timing.json").write_text(json.dumps(timing))
    (root / "settings.json").write_text(json.dumps({"command": "cli", "scale": "test", "settings": SETTINGS}))
    out = analyze.main(root, results, command="pytest", scale="test", settings=SETTINGS, gates=gates,
                       data_info=info, timing=timing)
    return root, results, out, truth, held


def test_outputs_and_failure_modes(synthetic):
    _, results, out, truth, held = synthetic
    for p in ("learning_v2.json", "learning_v2.md", "learning_v2.png", "learning_v2/attempts.jsonl"):
        assert (results / p).stat().st_size > 0
    rows = [json.loads(x) for x in (results / "learning_v2" / "attempts.jsonl").read_text().splitlines()]
    assert len(rows) == sum(len(v) for v in truth.values()) == out["attempts"]
    kinds = {(k[0], k[1], k[2], k[3], t["task"], t["attempt"]): t["kind"] for k, v in truth.items() for t in v}
    spec = {family.task_id(s): s for s in held}
    expect = {"look": "passed", "give_up": "gave_up", "loop": "turn_limit", "other": "other"}
    for r in rows:
        kind = kinds[(r["arm"], r["sft_seed"], r["seed"], r["step"], r["task_id"], r["sample"])]
        want = expect.get(kind) or ("passed" if spec[r["task_id"]].default_ok else "wrong_format")
        assert r["failure_mode"] == want, (kind, r)
        assert r["inspected"] == (kind in ("look", "loop")), (kind, r)
        assert set(r) >= {"arm", "sft_seed", "seed", "step", "task_id", "instruction", "sample", "passed", "grade",
                          "default_ok", "op", "end_reason", "turns"}
    assert out["final_steps"] == {"sft": 0, "grpo": 8, "rft": 8, "placebo": 8}
    assert out["tasks_rebuilt"] == out["heldout_tasks"] == len(held)
    assert out["go_no_go"]["gates"][0]["tasks"] == len(held)
    sel = out["sft_selection"]
    assert [g["sft_seed"] for g in sel["tried"]] == [0, 2, 1] and sel["chosen"] == CHOSEN
    assert [g["verdict"] for g in sel["tried"]] == ["go", "no-go", "go"] and sel["tried"][1]["pass@1"] < 0.2
    assert out["settings"]["sft_seeds"] == CHOSEN and out["settings"]["sft_candidates"] == [0, 2, 1]
    assert out["dev_disjointness"]["all_zero"] and out["dev_disjointness"]["heldout_tasks"] == 8
    dev_rows = (results / "learning_v2" / "dev_attempts.jsonl").read_text().splitlines()
    assert len(dev_rows) == 3 * 8 * 8 and {json.loads(x)["sft_seed"] for x in dev_rows} == {0, 1, 2}
    assert set(out["comparisons"]) == set(analyze.COMPARISONS)
    assert not out["comparisons"]["dppo-sft"]["available"] and "dppo" in out["comparisons"]["dppo-sft"]["reason"]
    assert out["goal_met"] is False and out["goal_met_strict"] is False  # no DPPO arm
    assert out["comparisons"]["grpo-sft"]["mean"] > 0
    md = (results / "learning_v2.md").read_text()
    assert "NOT met" in md.split("\n\n")[1] and "pre-registered criterion uses the interval over tasks" in md
    assert "| 2 | 8 | 0.000 |" in md and "Chosen: [0, 1]" in md  # every SFT seed tried, with its dev numbers
    nd = out["disjointness_nearest"]
    assert nd["available"] and nd["heldout_instructions"] == len({s.instruction for s in held})
    assert nd["longest_shared_words"]["max"] < family.NGRAM and 0 <= nd["jaccard_word3"]["max"] < 1
    assert sum(nd["longest_shared_words"]["histogram"].values()) == nd["heldout_instructions"]
    assert 0 < nd["char_edit"]["min"] <= nd["char_edit"]["median"] <= nd["char_edit"]["max"] <= 1


def test_intervals_and_per_run(synthetic):
    _, _, out, truth, held = synthetic
    inst = {family.task_id(s): s.instruction for s in held}
    for name in ("grpo-sft", "rft-sft", "placebo-sft", "grpo-rft", "grpo-placebo"):
        c = out["comparisons"][name]
        assert c["available"] and c["ci95"] == [c["lo"], c["hi"]]
        for key in ("ci95", "ci95_runs_tasks", "ci95_instruction_clusters"):
            assert c[key][0] <= c["mean"] <= c[key][1], (name, key)
        assert c["instruction_clusters"] == len(set(inst.values()))
        assert set(c["per_run"]) == {f"s{s}_r{r}" for s in (0, 1) for r in (0, 1)}
        assert set(c["per_sft_seed"]) == {"s0", "s1"}
        means = [v["mean"] for v in c["per_sft_seed"].values()]
        assert c["sign_agrees_per_sft_seed"] == (all(m > 0 for m in means) or all(m < 0 for m in means))
    # per run, from the transcripts: a run's pass@1 minus its SFT seed's, on the same (all) tasks

    def p1(trs):
        by = {}
        for t in trs:
            by.setdefault(t["task"], []).append(t["pass"])
        return np.mean([np.mean(v) for v in by.values()])

    for s in (0, 1):
        for r in (0, 1):
            want = p1(truth[("grpo", s, r, 8)]) - p1(truth[("sft", s, None, 0)])
            assert out["comparisons"]["grpo-sft"]["per_run"][f"s{s}_r{r}"] == pytest.approx(want, abs=1e-12)
            want = p1(truth[("grpo", s, r, 8)]) - p1(truth[("rft", s, r, 8)])
            assert out["comparisons"]["grpo-rft"]["per_run"][f"s{s}_r{r}"] == pytest.approx(want, abs=1e-12)
    assert out["goal_strict"]["interval"] == "ci95_runs_tasks"


def test_hierarchical_and_cluster_intervals_see_what_the_task_bootstrap_misses():
    tasks = [f"t{i}" for i in range(40)]
    # three RL runs of one SFT seed that disagree completely, against an SFT policy at 0.5 on every task: pooled
    # over runs every task's difference is 0 (the task interval is [0, 0]), the runs x tasks one is wide
    runs = {0: [(f"s0_r{r}", {t: [r, 2] for t in tasks}) for r in range(3)]}
    sft = {0: [("s0", {t: [1, 2] for t in tasks})]}
    c = analyze.paired(runs, sft, True, {t: t for t in tasks})
    assert c["mean"] == 0 and c["ci95"] == [0, 0]
    lo, hi = c["ci95_runs_tasks"]
    assert lo < -0.2 and hi > 0.2
    # identical runs: the runs x tasks interval is the task interval's (up to resampling noise)
    same = {0: [(f"s0_r{r}", {t: [i % 2, 1] for i, t in enumerate(tasks)}) for r in range(3)]}
    c = analyze.paired(same, {0: [("s0", {t: [0, 1] for t in tasks})]}, True)
    assert c["ci95_runs_tasks"] == pytest.approx(c["ci95"], abs=0.03)
    # two instructions with 20 tasks each, differences +1 and -1: whole-instruction draws span [-1, 1]
    d = np.array([1.0] * 20 + [-1.0] * 20)
    lo, hi = analyze.cluster_interval(d, ["a"] * 20 + ["b"] * 20)
    assert lo == -1 and hi == 1
    assert analyze.bootstrap(d, 2000)[1] < 0.5


def test_pass_at_k_excludes_tasks_with_too_few_attempts():
    rows = ([{"task_id": "a", "passed": p} for p in (True, False, False, False)]
            + [{"task_id": "b", "passed": p} for p in (False, True)])
    vals, used = analyze.pass_at_k(rows)
    assert set(vals) == {"1", "2", "3", "4"}
    assert vals["1"] == pytest.approx((0.25 + 0.5) / 2) and vals["2"] == pytest.approx((0.5 + 1.0) / 2)
    assert vals["3"] == pytest.approx(0.75) and vals["4"] == 1.0  # task a only
    assert used["2"] == {"tasks": 2, "excluded": 0} and used["3"] == {"tasks": 1, "excluded": 1}


def test_early_stop_makes_comparisons_unavailable(synthetic, tmp_path):
    root = tmp_path / "root"
    shutil.copytree(synthetic[0], root, ignore=shutil.ignore_patterns("results"))
    shutil.rmtree(root / "runs" / "grpo_s1_r0" / "eval" / "step_000008")  # grpo s1_r0 stops after step 4
    (root / "runs" / "rft_s0_r1" / "eval" / "step_000008" / "summary.json").unlink()  # an unfinished evaluation
    results = tmp_path / "results"
    out = analyze.main(root, results, command="pytest", scale="test", settings=SETTINGS,
                       gates=json.loads((root / "go_no_go.json").read_text()),
                       data_info=json.loads((root / "data" / "data.json").read_text()), timing={})
    assert out["final_steps"] == {"sft": 0, "grpo": None, "rft": None, "placebo": 8}
    assert out["final_step_check"]["grpo"]["problems"] == [
        "grpo s1_r0 has no evaluation with attempts at step 8 (its last is step 4)"]
    comp = out["comparisons"]
    for name in ("grpo-sft", "grpo-rft", "grpo-placebo"):
        assert comp[name]["available"] is False and "grpo s1_r0" in comp[name]["reason"], name
        assert "mean" not in comp[name]
    assert "rft s0_r1: its step-8 evaluation did not finish" in comp["rft-sft"]["reason"]
    assert comp["placebo-sft"]["available"] and comp["placebo-sft"]["a_step"] == 8
    assert out["goal"]["checks"]["grpo-sft"]["unavailable"] and not out["goal_met"]
    assert out["failure_modes"]["grpo"]["available"] is False
    assert out["curves"]["grpo"]["8"]["runs"] == 3  # the curve still shows what there is
    md = (results / "learning_v2.md").read_text()
    assert "not available: grpo s1_r0 has no evaluation" in md and "No final step for GRPO, RFT" in md
    assert recheck.main(["--results", str(results)]) == 0


def test_recheck_agrees_and_catches_tampering(synthetic, tmp_path, capsys):
    results = synthetic[1]
    assert recheck.main(["--results", str(results)]) == 0
    assert "recheck OK" in capsys.readouterr().out
    bad = tmp_path / "bad"
    (bad / "learning_v2").mkdir(parents=True)
    (bad / "learning_v2" / "attempts.jsonl").write_text((results / "learning_v2" / "attempts.jsonl").read_text())
    res = json.loads((results / "learning_v2.json").read_text())
    res["arms"]["grpo"]["s0_r0"]["8"] += 0.01
    res["comparisons"]["grpo-sft"]["lo"] -= 0.05
    res["comparisons"]["grpo-rft"]["ci95_runs_tasks"][0] -= 0.05
    res["comparisons"]["rft-sft"]["ci95_instruction_clusters"][1] += 0.05
    res["comparisons"]["placebo-sft"]["per_run"]["s1_r0"] += 1e-6
    res["failure_modes"]["sft"]["steps"]["0"]["counts"]["gave_up"] += 1
    res["sft_pass_at_k_tasks"]["all"]["8"]["excluded"] += 1
    res["sft_selection"]["tried"][1]["verdict"] = "go"  # seed 2 failed its dev check
    res["sft_selection"]["tried"][0]["pass@1"] += 0.01  # a dev number that its attempts do not give
    (bad / "learning_v2" / "dev_attempts.jsonl").write_text(
        (results / "learning_v2" / "dev_attempts.jsonl").read_text())
    (bad / "learning_v2.json").write_text(json.dumps(res))
    assert recheck.main(["--results", str(bad)]) == 1
    err = capsys.readouterr().err
    for what in ("arms[grpo][s0_r0][8]", "grpo-sft lower end", "failure_modes[sft][0] gave_up",
                 "grpo-rft runs x tasks lower end", "rft-sft instruction-cluster upper end",
                 "placebo-sft per_run[s1_r0]", "sft_pass_at_k_tasks[all][8]", "dev check of SFT seed 2: verdict",
                 "dev check of SFT seed 0: pass@1"):
        assert what in err, what
    assert "goal_met" not in err
    # a comparison claimed available although a run stopped early
    res = json.loads((results / "learning_v2.json").read_text())
    rows = [x for x in (results / "learning_v2" / "attempts.jsonl").read_text().splitlines()
            if not ('"arm":"grpo"' in x and '"sft_seed":0,"seed":1,"step":8' in x)]
    (bad / "learning_v2" / "attempts.jsonl").write_text("\n".join(rows) + "\n")
    res["attempts"] = len(rows)
    (bad / "learning_v2.json").write_text(json.dumps(res))
    assert recheck.main(["--results", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "run s0_r1 has no attempts at step 8" in err and "grpo-sft available" in err


@pytest.mark.parametrize("cmd,fmt", [
    ("awk -F';' '!/^#/ {print $2}' /app/x.csv > /app/y.txt", (";", True)),
    ("awk -F, '{print $1}' /app/x.csv > /app/y.txt", (",", False)),
    ("awk -F '|' 'NR>1{s+=$3} END{print s}' x.csv > y.txt", ("|", True)),
    ("awk -F'\\t' '{print $1}' x > y", ("\t", False)),
    ("awk 'BEGIN{FS=\":\"} /^#/ {next} {print $4}' x | sort -n | tail -n 1 > y", (":", True)),
    ("awk '{n++} END {print n}' x > y", (" ", False)),
    ("grep -v '^#' x | cut -d';' -f2 > y", (";", True)),
    ("echo 3 > y", None),
])
def test_assumed_format(cmd, fmt):
    assert analyze.assumed_format(cmd) == fmt


def test_writes_and_reads():
    assert analyze.is_write("awk '{print}' /app/a.csv > /app/b.txt", "/app/b.txt")
    assert analyze.is_write("awk '{print}' a.csv >b.txt", "/app/b.txt")
    assert analyze.is_write("cat a | tee ./b.txt", "/app/b.txt")
    assert not analyze.is_write("cat /app/b.txt", "/app/b.txt")
    assert not analyze.is_write("awk '{print}' a > /tmp/b.txt", "/app/b.txt")
    assert analyze.reads("head -n 3 /app/a.csv", "/app/a.csv", "/app/b.txt")
    assert not analyze.reads("ls /app", "/app/a.csv", "/app/b.txt")
    assert not analyze.reads("head -n 3 /app/aa.csv", "/app/a.csv", "/app/b.txt")
    # globs and the data file under a wrong extension show the file or an error about it: inspection too
    for cmd in ("head /app/data.*", "cat /app/data*", "cat data.csv", "head -n 3 ./data.dat", "head '/app/data.txt'",
                "cat /app/data", "head /app/*.txt | cat", "grep , *", "head -n2 /app/data.t?t 2>/dev/null"):
        assert analyze.reads(cmd, "/app/data.txt", "/app/answer.txt"), cmd
    for cmd in ("ls /app/data.*", "cat /tmp/data.txt", "cat /app/database.txt", "head /app/answer.txt",
                "cat /app/data.* > /app/answer.txt", "head /app/data.csv > /tmp/x"):
        assert not analyze.reads(cmd, "/app/data.txt", "/app/answer.txt"), cmd
    meta = {"src": "/app/a.csv", "dst": "/app/b.txt", "op": "count", "delim": ",", "header": False}

    def mode(*cmds, end="finished"):
        tr = {"pass": False, "end_reason": end, "turns": [{"actions": [{"tool": "bash", "args": {"cmd": c}}]}
                                                          for c in cmds]}
        return analyze.classify(tr, meta, None)

    assert mode("ls 2>/dev/null", "echo done") == ("gave_up", False)
    assert mode("awk '{n++} END {print n}' /app/a.csv > /app/c.txt", "echo done") == ("other", False)
    assert mode("cat /app/a.csv", "awk -F';' '{n++} END {print n}' a.csv > b.txt") == ("other", True)
    meta["header"] = True
    assert mode("awk -F';' '{n++} END {print n}' a.csv > b.txt", end="max_turns") == ("wrong_format", False)
    assert mode("awk 'NR>1 {n++} END {print n}' a.csv > b.txt", end="max_turns") == ("turn_limit", False)


def test_cli_matches_main(synthetic, tmp_path, monkeypatch):
    root, results = synthetic[0], synthetic[1]
    monkeypatch.setattr(sys, "argv", ["analyze.py", "--root", str(root), "--results", str(tmp_path)])
    analyze.cli()
    a, b = (json.loads((d / "learning_v2.json").read_text()) for d in (results, tmp_path))
    assert a.pop("command") == "pytest" and b.pop("command") == "cli"
    assert a == b
    assert recheck.main(["--results", str(tmp_path)]) == 0


def test_params_diagnostic_reads_field_file_and_op_from_the_command():
    params = _load("params")
    rng = random.Random(3)
    for _ in range(40):
        spec = family.draw(rng, "heldout")
        meta = {"op": spec.op, "k": spec.k, "src": spec.src, "dst": spec.dst}

        def tr(*cmds):
            return {"turns": [{"actions": [{"tool": "bash", "args": {"cmd": c}}]} for c in cmds]}

        right = family.command(spec, spec.delim, spec.header)
        want = {"file": True, "op": True, **({"field": True} if spec.op != "count" else {})}
        assert params.check(tr(f"head -n 3 {spec.src}", right), meta) == want, right
        other = "/app/data.md" if not spec.src.endswith(".md") else "/app/data.txt"
        wrong = right.replace(spec.src, other)
        if spec.op != "count":
            wrong = wrong.replace(f"${spec.k}", f"${spec.k % 6 + 1}")
        got = params.check(tr(wrong), meta)
        assert not got["file"] and got["op"] and not got.get("field", False), wrong
        assert params.check(tr(f"cat {spec.src}"), meta) is None  # no command that writes or runs awk
    assert params.op_of("awk -F';' 'NR>1 {print $3}' /app/data.txt > /app/answer.txt") == "values"


def test_run_reuses_a_root_only_with_the_same_settings_recipe_and_criteria(tmp_path):
    saved, now = tmp_path / "settings.json", {"command": "a", "scale": "full", "settings": run.SCALES["full"],
                                              "sft": run.SFT, "go": run.GO}
    run.keep_settings(saved, now)
    run.keep_settings(saved, dict(now, command="b"))  # resumed with another command line: the same run
    for change in ({"sft": run.SFT + ["sft.steps=1200"]}, {"go": dict(run.GO, pass1_min=0.1)},
                   {"settings": dict(run.SCALES["full"], sft_keep=3)}):
        with pytest.raises(SystemExit, match="holds a run with other settings"):
            run.keep_settings(saved, dict(now, **change))
