"""Task generation (jaxrl_term.datagen): the taxonomy sampler against the taxonomy's shares, the teacher's strict
parser against hostile answers, and the whole pipeline end to end against a scripted OpenAI-compatible teacher
with validation in real Docker sandboxes."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from scipy.stats import chisquare

from jaxrl_term.datagen.taxonomy import DEFAULT_TAXONOMY, TaskSpec, TaxonomyError, load_taxonomy, spec_axis_value
from jaxrl_term.datagen.teacher import TeacherFormatError, parse_task
from teacher_server import BASE, TeacherServer, file_task, task_text

ROOT = Path(__file__).resolve().parents[1]
AXES = ("corpus_kind", "domain", "skill_type", "command_complexity", "task_complexity", "verifier_kind",
        "fixture_kind", "language")


@pytest.fixture(scope="module")
def tax():
    return load_taxonomy()


def _chi2(specs, expected):
    for axis in AXES:
        values = sorted(expected[axis])
        obs = np.array([sum(spec_axis_value(s, axis) == v for s in specs) for v in values], float)
        exp = np.array([expected[axis][v] for v in values]) * len(specs)
        keep = exp > 0
        assert obs[~keep].sum() == 0, f"{axis}: drew values of probability 0"
        if keep.sum() == 1:
            assert obs[keep][0] == len(specs)
            continue
        stat, p = chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum())
        assert p > 1e-3, f"{axis}: chi-square p = {p:.2g} (stat {stat:.1f}); observed {obs}, expected {exp}"


def test_ten_thousand_specs_match_the_taxonomy_shares(tax):
    """10,000 draws of the tmax_15k mix at a fixed seed: every axis passes a chi-square test against the target
    shares, and those shares are the ones the taxonomy file itself records for the published mix."""
    specs = tax.sample(10_000, seed=123)
    expected = tax.expected_shares("tmax_15k")
    _chi2(specs, expected)
    recorded = yaml.safe_load(DEFAULT_TAXONOMY.read_text())["tmax_15k"]["sampler_expected_shares_at_actual_counts"]
    for axis, shares in recorded.items():
        for v, p in shares.items():
            assert expected[axis][v] == pytest.approx(p, abs=1e-3), (axis, v)
    # the other rules: 3-5 primitive skills of the spec's own domain, no repeats; anchors about 35% of the time
    for s in specs[:2000]:
        pool = set(tax.domains[s.domain].primitives)
        assert 3 <= len(s.primitive_skills) <= 5 and len(set(s.primitive_skills)) == len(s.primitive_skills)
        assert set(s.primitive_skills) <= pool and s.persona in tax.domains[s.domain].personas
        assert s.skill_type in tax.domains[s.domain].skill_types
        novel = (s.task_complexity == "intricate" or s.verifier_kind != "exact_text" or s.fixture_kind != "text_only")
        assert s.base_image == ("base_intricate.sif" if novel else tax.domains[s.domain].base_image)
    anchored = np.mean([s.real_software_anchor is not None for s in specs])
    assert abs(anchored - 0.35) < 0.02


@pytest.mark.parametrize("corpus", ["legacy", "sft_v2", "rl_v2"])
def test_each_corpus_kind_follows_its_bucket_rule(tax, corpus):
    """Per corpus kind, the derived probabilities of the file (M / (M + 1) for the new bucket), and draws that
    match them; legacy never draws a new-bucket value, rl_v2 never an exact-text verifier."""
    specs = tax.sample(4000, seed=5, corpus=corpus)
    expected = tax.expected_shares(corpus=corpus)
    derived = yaml.safe_load(DEFAULT_TAXONOMY.read_text())["legacy_v2_mixing"]["derived_sampling_probabilities"]
    for axis, shares in derived[corpus].items():
        for v, p in shares.items():
            assert expected[axis].get(v, 0.0) == pytest.approx(p, abs=1e-3)
    _chi2(specs, expected)
    if corpus == "legacy":
        assert {s.verifier_kind for s in specs} == {"exact_text"} and {s.fixture_kind for s in specs} == {"text_only"}
    if corpus == "rl_v2":
        assert "exact_text" not in {s.verifier_kind for s in specs}


def test_draws_are_reproducible_and_prefix_stable(tax):
    a, b = tax.sample(50, seed=9), tax.sample(200, seed=9)
    assert a == b[:50] and tax.sample(50, seed=9, start=150) == b[150:]
    assert a != tax.sample(50, seed=10)
    assert len({s.spec_id for s in b}) == 200


def test_a_broken_taxonomy_names_its_field(tmp_path):
    raw = yaml.safe_load(DEFAULT_TAXONOMY.read_text())
    bad = dict(raw)
    del bad["domains"]
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(bad))
    with pytest.raises(TaxonomyError, match=r"a.yaml: missing field domains"):
        load_taxonomy(tmp_path / "a.yaml")
    bad = json.loads(json.dumps(raw))
    bad["legacy_v2_mixing"]["multipliers"]["rl_v2"]["task_complexity"] = 1.0  # contradicts derived 0.75
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(bad))
    with pytest.raises(TaxonomyError, match=r"derived_sampling_probabilities\.rl_v2\.task_complexity\.\w+ = .* gives"):
        load_taxonomy(tmp_path / "b.yaml")
    bad = json.loads(json.dumps(raw))
    bad["legacy_v2_mixing"]["new_buckets"]["verifier_kind"].append("vibes")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(bad))
    with pytest.raises(TaxonomyError, match=r"verifier_kind 'vibes'"):
        load_taxonomy(tmp_path / "c.yaml")
    with pytest.raises(TaxonomyError, match="does not exist"):
        load_taxonomy(tmp_path / "missing.yaml")
    with pytest.raises(TaxonomyError, match="no mix 'nope'"):
        load_taxonomy().sample(3, mix="nope")


def test_sample_cli_writes_the_spec_keys(tmp_path):
    out = tmp_path / "specs.jsonl"
    r = subprocess.run([sys.executable, "-m", "jaxrl_term.datagen", "sample", "--n", "300", "--seed", "4",
                        "--corpus", "rl_v2", "--out", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "verifier_kind" in r.stdout and "target" in r.stdout
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 300
    for k in ("corpus_kind", "domain", "skill_type", "task_complexity", "verifier_kind", "fixture_kind", "language"):
        assert all(k in row for row in rows)
    assert {row["corpus_kind"] for row in rows} == {"rl_v2"}
    assert rows[:10] == [s.to_json() for s in load_taxonomy().sample(10, 4, corpus="rl_v2")]
    r = subprocess.run([sys.executable, "-m", "jaxrl_term.datagen", "sample", "--n", "5", "--mix", "tmax_15k",
                        "--corpus", "legacy"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode != 0 and "not allowed with" in r.stderr


# --------------------------------------------------------------------------------------------- the parser
GOOD = file_task("out.txt", "abc")


def test_parse_accepts_a_well_formed_answer_and_strips_fences():
    fenced = GOOD.replace("<tests>\n", "<tests>\n```python\n").replace("\n</tests>", "\n```\n</tests>")
    for text in (GOOD, fenced):
        p = parse_task(text, BASE)
        assert p.instruction.startswith("Create /app/out.txt") and p.dockerfile.startswith(f"FROM {BASE}")
        assert "def test_" in p.tests and p.solution.startswith("#!/bin/bash")
    p = parse_task(task_text("do it", tests="def test_x():\n    assert 0", solution="true",
                             files={"data/in.csv": "a,b\n"}), BASE)
    assert dict(p.files) == {"data/in.csv": "a,b\n"}


@pytest.mark.parametrize("mutate,msg", [
    (lambda t: t.replace("<truth>the file holds the requested line</truth>\n", ""), "missing or empty: <truth>"),
    (lambda t: t.replace("</task>", "<tests>def test_y(): pass</tests></task>"), "appears more than once"),
    (lambda t: t.replace("<task>", "<task><task>"), "exactly one <task>"),
    (lambda t: t.replace("</task>", ""), "not closed"),
    (lambda t: t.replace(f"FROM {BASE}", "FROM ubuntu:24.04"), "must start with `FROM jaxrl-term/base:trixie`"),
    (lambda t: t.replace("def test_out_txt_has_the_line", "def check_it"), "no pytest test function"),
    (lambda t: t.replace("def test_out_txt_has_the_line():", "def test_x(:"), "not valid Python"),
    (lambda t: t.replace("<instruction>", "stray words <instruction>"), "text outside the elements"),
    (lambda t: t.replace("</task>", '<file path="../../etc/passwd">x</file></task>'), "relative path"),
    (lambda t: t.replace("</task>", '<file path="/etc/passwd">x</file></task>'), "relative path"),
    (lambda t: t.replace("</task>", '<file path="Dockerfile">FROM evil</file></task>'), "Dockerfile itself"),
    (lambda t: t.replace("</task>", "<file>x</file></task>"), "needs a path"),
    (lambda t: t.replace("<solution>", "<solution path=\"x\">"), "takes no path"),
    (lambda t: t.replace("</task>", "<notes>hi</notes></task>"), "unknown element <notes>"),
])
def test_parse_rejects_hostile_or_broken_answers(mutate, msg):
    with pytest.raises(TeacherFormatError, match=msg.replace("(", r"\(").replace(")", r"\)")
                       .replace("`", "`").replace("*", r"\*").replace("+", r"\+")):
        parse_task(mutate(GOOD), BASE)


# ------------------------------------------------------------------------------------------ end to end
LONG = ("The operations team keeps a small status board under /app that other scripts read every few minutes, "
        "and the board is missing its greeting entry after last week's migration. Create the file /app/alpha.txt "
        "so that it holds exactly one line, the greeting {line}, with a trailing newline and nothing else: no "
        "leading spaces, no extra blank lines, no comments. Do not touch any other file under /app, and do not "
        "leave helper scripts behind; the readers of the board are strict about its contents and will treat any "
        "additional line as a corrupted entry that pages the {who} engineer.")


def _spec(name: str, i: int) -> TaskSpec:
    return TaskSpec(f"test-{i:02d}-{name}", "legacy", "file_operations", "File and directory manipulation",
                    ("Bulk file renaming", "Directory tree traversal", "Symbolic link management"), f"scenario-{name}",
                    "bash-only", "short", "exact_text", "text_only", "Bash", None, "base_file_operations.sif")


@pytest.mark.docker
@pytest.mark.slow
def test_pipeline_keeps_exactly_the_valid_tasks_and_resumes(tmp_path, docker_client):
    """Against a scripted teacher: a good task and two repaired ones (a Dockerfile that fails to build, an answer
    missing its tests) are kept; a task whose tests pass before any work, one whose oracle fails, a near-duplicate
    of a kept task and a copy of an evaluation task are rejected with those reasons; a teacher that answers 500 is
    an error, not a rejection, and is done on the next run, which asks nothing about the finished specs. The kept
    tasks load with load_tasks and pass `tasks check --agent oracle`."""
    from jaxrl_term.datagen.__main__ import compose
    from jaxrl_term.datagen.run import run_datagen
    from jaxrl_term.tasks.check import check_tasks
    from jaxrl_term.tasks.dataset import load_dataset
    from jaxrl_term.tasks.formats import load_parquet, load_tasks

    eval_task = load_dataset("builtin", split="heldout", n_per_cell=8)[0]
    good = file_task("alpha.txt", "hello from datagen alpha", instruction=LONG.format(line="hello from datagen alpha",
                                                                                     who="on-call"))
    dup = file_task("alpha.txt", "hello from datagen alpha", instruction=LONG.format(line="hello from datagen alpha",
                                                                                    who="night-shift"))
    no_tests = file_task("gamma.txt", "gamma line").replace("<tests>", "<test>").replace("</tests>", "</test>")
    scenarios = {
        "good": [good],
        "build": [file_task("beta.txt", "beta line", dockerfile_extra="RUN exit 3\n"), file_task("beta.txt", "beta line")],
        "format": [no_tests, file_task("gamma.txt", "gamma line")],
        "initial": [file_task("delta.txt", "delta line", dockerfile_extra="RUN printf 'delta line\\n' > /app/delta.txt\n")],
        "oracle": [file_task("eps.txt", "eps line", solution="printf 'wrong\\n' > /app/eps.txt")],
        "dup": [dup],
        "contaminated": [file_task("zeta.txt", "zeta line", instruction=eval_task.instruction + " Then stop.")],
        "down": [500],
    }
    names = list(scenarios)
    specs_file = tmp_path / "specs.jsonl"
    specs_file.write_text("".join(json.dumps(_spec(n, i).to_json()) + "\n" for i, n in enumerate(names)))
    server = TeacherServer(scenarios).start()
    out = tmp_path / "gen"

    def cfg():
        c = compose([f"datagen.out_dir={out}", f"datagen.specs={specs_file}", "datagen.max_repairs=1",
                     "datagen.jobs=2", "datagen.teacher.rounds=1", "datagen.teacher.retries=0",
                     "datagen.teacher.backoff_s=0.01", "datagen.teacher.failure_threshold=100",
                     f"datagen.teacher.endpoints=[{{name:scripted,base_url:'{server.url}',model:teacher}}]"])
        return c

    try:
        import asyncio

        summary = asyncio.run(run_datagen(cfg()))
        recs = {r["spec_id"].split("-", 2)[2]: r for r in map(json.loads, (out / "records.jsonl").read_text().splitlines())}
        got = {n: (r["status"], r["reason"]) for n, r in recs.items()}
        assert got == {"good": ("kept", ""), "build": ("kept", ""), "format": ("kept", ""),
                       "initial": ("rejected", "passes_initially"), "oracle": ("rejected", "oracle_fails"),
                       "dup": ("rejected", "near_duplicate"), "contaminated": ("rejected", "contaminated"),
                       "down": ("error", "teacher_server_error")}, got
        assert recs["build"]["repairs"] == 1 and recs["format"]["repairs"] == 1 and recs["good"]["repairs"] == 0
        assert "did not build" in server.repair_prompts["build"][0]
        assert "could not be used" in server.repair_prompts["format"][0] and "<tests>" in server.repair_prompts["format"][0]
        assert "test_delta_txt_has_the_line" in server.repair_prompts["initial"][0]
        assert "not solved" in server.repair_prompts["oracle"][0]
        assert "test-00-good" in recs["dup"]["detail"] and eval_task.id in recs["contaminated"]["detail"]
        assert server.calls["dup"] == 1 and server.calls["contaminated"] == 1  # rejected before any build
        assert summary["kept"] == 3 and summary["reasons"]["near_duplicate"] == 1
        assert summary["calls_per_kept"] == pytest.approx(summary["calls"] / 3)

        kept = load_tasks(out / "harbor")
        assert sorted(t.id for t in kept) == ["test-00-good", "test-01-build", "test-02-format"]
        assert kept[0].metadata["spec_domain"] == "file_operations" and kept[0].metadata["truth"]
        assert sorted(t.id for t in load_parquet(out / "tasks.parquet")) == sorted(t.id for t in kept)
        checked = asyncio.run(check_tasks(kept, "oracle"))
        assert all(not r.broken and r.score == 1.0 for r in checked), [(r.task_id, r.reason) for r in checked]
        report = (out / "report.md").read_text()
        assert "| passes_initially | 1 |" in report and (out / "report.png").stat().st_size > 1000

        # resume: the teacher is back; only the unfinished spec is asked again
        before = dict(server.calls)
        server.scenarios["down"] = [file_task("eta.txt", "eta line")]
        summary = asyncio.run(run_datagen(cfg()))
        asked = {k: v - before.get(k, 0) for k, v in server.calls.items() if v != before.get(k, 0)}
        assert asked == {"down": 1}
        assert summary["kept"] == 4 and summary["errors"] == 0
        assert len(load_tasks(out / "harbor")) == 4
    finally:
        server.stop()


def test_run_cli_refuses_a_config_without_a_teacher(tmp_path):
    r = subprocess.run([sys.executable, "-m", "jaxrl_term.datagen", "run", f"datagen.out_dir={tmp_path}/x"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "datagen.teacher.endpoints: empty" in r.stderr
    r = subprocess.run([sys.executable, "-m", "jaxrl_term.datagen", "run", "+datagen=example",
                        f"datagen.out_dir={tmp_path}/x"], capture_output=True, text=True, cwd=ROOT,
                       env={k: v for k, v in __import__("os").environ.items() if k != "OPENROUTER_API_KEY"})
    assert r.returncode == 2 and "OPENROUTER_API_KEY is not set" in r.stderr
    r = subprocess.run([sys.executable, "-m", "jaxrl_term.datagen", "run", "datagen.nope=1"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "nope" in r.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.docker
@pytest.mark.slow
def test_pass_rate_band_rejects_tasks_the_policy_never_solves(tmp_path, docker_client):
    """datagen.pass_rate: validated tasks are evaluated with jaxrl_term.eval (here the nop policy: pass@1 = 0)
    and rejected as out_of_band when their pass rate is outside the band; nothing is exported for them."""
    from jaxrl_term.datagen.__main__ import compose
    from jaxrl_term.datagen.run import run_datagen

    import asyncio

    server = TeacherServer({"one": [file_task("one.txt", "line one")], "two": [file_task("two.txt", "line two")]}).start()
    specs = tmp_path / "specs.jsonl"
    specs.write_text("".join(json.dumps(_spec(n, i).to_json()) + "\n" for i, n in enumerate(["one", "two"])))
    out = tmp_path / "gen"
    try:
        cfg = compose([f"datagen.out_dir={out}", f"datagen.specs={specs}", "datagen.pass_rate.enabled=true",
                       "datagen.pass_rate.attempts=1", "datagen.pass_rate.band=[0.5,1.0]",
                       "datagen.pass_rate.eval_overrides=['policy=nop']", "datagen.decontaminate=[]",
                       f"datagen.teacher.endpoints=[{{name:scripted,base_url:'{server.url}',model:teacher}}]"])
        summary = asyncio.run(run_datagen(cfg))
    finally:
        server.stop()
    recs = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()]
    assert [(r["status"], r["reason"], r["pass_rate"]) for r in recs] == [("rejected", "out_of_band", 0.0)] * 2
    assert summary["kept"] == 0 and not (out / "harbor").exists()
    assert "| 0.0–0.1 | 2 |" in (out / "report.md").read_text()


def test_teacher_answers_are_cached_per_endpoint_and_prompt():
    """The same prompt is asked once (a second chat makes no HTTP request and counts no request); another prompt
    is asked; the per-call request counter sees only its own requests."""
    import asyncio

    from jaxrl_term.datagen.teacher import TeacherClient, render_messages
    from jaxrl_term.reward.judge import JudgeEndpoint

    server = TeacherServer({"a": [file_task("a.txt", "a")], "b": [file_task("b.txt", "b")]}).start()
    try:
        async def main():
            t = TeacherClient([JudgeEndpoint("s", server.url, "teacher")])
            try:
                ma, mb = (render_messages(_spec(n, 0), BASE) for n in ("a", "b"))
                counts = [[0], [0], [0]]
                first = await t.chat(ma, requests=counts[0])
                again = await t.chat(ma, requests=counts[1])
                other = await t.chat(mb, requests=counts[2])
                return first, again, other, counts, t.calls
            finally:
                await t.aclose()

        first, again, other, counts, calls = asyncio.run(main())
    finally:
        server.stop()
    assert first == again and first[0].count("a.txt") and "b.txt" in other[0]
    assert counts == [[1], [0], [1]] and calls == 2 and dict(server.calls) == {"a": 1, "b": 1}
