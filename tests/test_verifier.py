"""The verifier against real containers: oracle/nop checks, TB-RL samples vs plain pytest, tamper-proofing,
timeouts and verifier errors as outcomes of their own."""

import asyncio
import re
from pathlib import Path

import pytest

from conftest import SHARED, need
from jaxrl_term.reward.verifier import parse_junit, score_of, verify, weights_for
from jaxrl_term.tasks.builtin import builtin_tasks, generate
from jaxrl_term.tasks.check import check_tasks
from jaxrl_term.tasks.env import open_task_sandbox
from jaxrl_term.tasks.formats import export_harbor, load_tasks

FIXTURES = Path(__file__).parent / "fixtures" / "tasks"
CSV_PATH = SHARED / "datasets" / "terminal-bench-rl" / "latest_verified.csv"
# Twelve TB-RL tasks on both Terminal-Bench base images (python-3-13 and ubuntu-24-04), cheap to build
# offline; two of them (a dataset flaw we found with `check --agent nop`) pass some tests before any work.
TBRL_SAMPLE = [
    "redis-protocol-client-implementation", "symbolic-polynomial-operations", "draft_dp_bcd2c3da",
    "draft_dp_01591001", "draft_dp_052e598b", "draft_dp_e13928db", "run-length-encoding-compression",
    "security-remove-hardcoded-password", "base64-decode-secret-message", "parse-raw-http-request",
    "system-fix-script-permissions", "log-rotation-file-size-management",
]


def run(coro):
    return asyncio.run(coro)


# ------------------------------------------------------------------------------------------- scoring units


def test_junit_parsing_and_weighted_and_binary_scores():
    xml = """<testsuites><testsuite name="pytest">
      <testcase classname="test_outputs" name="test_a"/>
      <testcase classname="test_outputs" name="test_b"><failure message="x"/></testcase>
      <testcase classname="test_outputs" name="test_c"><skipped message="skip"/></testcase>
      <testcase classname="test_outputs" name="test_p[1]"/>
      <testcase classname="test_outputs" name="test_p[2]"><error message="e"/></testcase>
    </testsuite></testsuites>"""
    passed = parse_junit(xml)
    assert passed == {"test_a": True, "test_b": False, "test_c": True, "test_p[1]": True, "test_p[2]": False}
    w = weights_for(list(passed), {"test_a": 0.2, "test_b": 0.3, "test_c": 0.1, "test_p": 0.4})
    assert w["test_p[1]"] == pytest.approx(0.2) and w["test_p[2]"] == pytest.approx(0.2)
    assert score_of(passed, w, "weighted") == pytest.approx((0.2 + 0.1 + 0.2) / 1.0)
    assert score_of(passed, w, "binary") == 0.0
    # only tests that ran count in the denominator
    part = {"test_a": True, "test_b": False}
    assert score_of(part, weights_for(list(part), {"test_a": 0.2, "test_b": 0.3, "test_x": 0.5}),
                    "weighted") == pytest.approx(0.4)
    assert score_of({"t": True}, {"t": 1.0}, "binary") == 1.0


# -------------------------------------------------------------------------------------- oracle / nop checks


def test_every_builtin_family_oracle_scores_1_and_nop_0_on_every_difficulty(backend):
    tasks = builtin_tasks(1)
    for agent, want in (("oracle", 1.0), ("nop", 0.0)):
        results = run(check_tasks(tasks, agent, jobs=3, backend=backend))
        bad = [(r.task_id, r.reason) for r in results if r.broken or r.score != want]
        assert not bad, bad


def test_tb1_and_harbor_fixtures_oracle_1_nop_0(docker_client):
    tasks = load_tasks(FIXTURES)
    for agent, want in (("oracle", 1.0), ("nop", 0.0)):
        results = run(check_tasks(tasks, agent, jobs=2))
        assert [(r.task_id, r.score, r.outcome) for r in results] == [(t.id, want, "scored") for t in tasks]


def test_harbor_reward_json_with_several_keys_is_read(docker_client):
    task = load_tasks(FIXTURES / "harbor-json-keys")[0]

    async def go():
        async with open_task_sandbox(task) as sb:
            await sb.run("printf 'alpha\\nbeta\\n' > /app/keys.txt")  # exists, but wrong
            return await verify(task, sb)

    res = run(go())
    assert res.outcome == "scored" and res.score == 0.0
    assert res.rewards == {"reward": 0.0, "file_exists": 1.0, "n_lines": 2.0}


def test_exported_harbor_tasks_keep_their_verdicts(docker_client, tmp_path):
    tasks = builtin_tasks(1, families=["json_to_csv"], difficulties=["medium"]) + load_tasks(FIXTURES / "tb1-word-count")
    exported = load_tasks(export_harbor(tasks, tmp_path / "h"))
    assert all(t.tests.runner == "harbor" for t in exported)
    for agent, want in (("oracle", 1.0), ("nop", 0.0)):
        assert [r.score for r in run(check_tasks(exported, agent, jobs=2))] == [want] * len(exported)


def test_tbrl_sample_builds_and_nop_outcomes_agree_with_plain_pytest(docker_client):
    need(CSV_PATH.is_file(), "TB-RL CSV missing")
    by_id = {t.id: t for t in load_tasks(CSV_PATH)}
    sample = [by_id[i] for i in TBRL_SAMPLE]
    assert {t.environment.dockerfile.split()[1].split(":")[0] for t in sample} == {
        "ghcr.io/laude-institute/t-bench/python-3-13", "ghcr.io/laude-institute/t-bench/ubuntu-24-04"}

    async def one(task, builder):
        async with open_task_sandbox(task, builder=builder) as sb:
            res = await verify(task, sb)
            plain = await sb.exec(["bash", "-c", f"cd {task.environment.workdir} && "
                                   "python3 -m pytest /tests/test_outputs.py -rA -p no:cacheprovider"], 300)
            return res, plain.output

    async def main():
        from jaxrl_term.sandbox.images import ImageBuilder

        builder, sem = ImageBuilder(), asyncio.Semaphore(3)

        async def guarded(t):
            async with sem:
                return await one(t, builder)

        return await asyncio.gather(*(guarded(t) for t in sample))

    mixed = 0
    for task, (res, plain) in zip(sample, run(main())):
        assert res.outcome == "scored", (task.id, res.error)
        mixed += 0 < sum(res.passed.values()) < len(res.passed)
        summary = {m.group(2): m.group(1) == "PASSED"
                   for m in re.finditer(r"^(PASSED|FAILED|ERROR) \S+?::(\S+)", plain, re.M)}
        assert res.passed == summary, task.id
        assert set(res.passed) == set(task.tests.weights), task.id
    assert mixed >= 2  # the comparison covers passing and failing tests


# ------------------------------------------------------------------------------------------ tamper-proofing

TAMPER = r"""
mkdir -p /tests && cat > /tests/test_outputs.py <<'EOF'
def test_fake():
    assert True
EOF
mkdir -p /usr/local/bin && printf '#!/bin/sh\necho "1 passed"; exit 0\n' > /usr/local/bin/pytest
chmod +x /usr/local/bin/pytest
cat > /app/pytest.py <<'EOF'
import sys
def main(*a, **k):
    return 0
EOF
cat > /app/conftest.py <<'EOF'
import pytest
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    rep.outcome = "passed"
EOF
cp /app/conftest.py /conftest.py
printf '[pytest]\naddopts = -p no:terminal\n' > /app/pytest.ini
cp /app/pytest.ini /pytest.ini
mkdir -p /logs/verifier && echo 1.0 > /logs/verifier/reward.txt && echo '{"reward": 1}' > /logs/verifier/reward.json
echo tampered
"""


def test_tampering_does_not_change_the_verdict(backend):
    task = generate("csv_stats", "medium", seed=11)

    async def go():
        async with open_task_sandbox(task, backend=backend) as sb:
            honest = await verify(task, sb)
            assert "tampered" in (await sb.run(TAMPER, 30)).output
            # Positive control: the planted /conftest.py and /pytest.ini do fool a run rooted at / ...
            await sb.exec(["bash", "-c", "cd /tmp && python3 -m pytest /tests/test_outputs.py --rootdir=/ "
                           "-p no:cacheprovider --junitxml=/tmp/naive.xml"], 60)
            naive = parse_junit(await sb.read_file("/tmp/naive.xml"))
            # ... but not the verifier (which also wiped the rewritten /tests and the planted reward files)
            after = await verify(task, sb)
            return honest, naive, after

    honest, naive, after = run(go())
    assert naive and all(naive.values())
    assert honest.outcome == "scored" and honest.score == after.score == 0.0
    if backend == "docker":  # the pytest on PATH hides the image's: a command the tests' subprocesses could run
        assert after.outcome == "tampered" and any("/usr/local/bin/pytest" in f for f in after.tamper), after.tamper
    else:  # the local system is read-only: the rest changes nothing the pristine runner reads
        assert after.outcome == "scored" and after.passed == honest.passed and not any(after.passed.values())


def test_harbor_reward_file_planted_by_the_agent_is_ignored(docker_client):
    task = load_tasks(FIXTURES / "harbor-json-keys")[0]

    async def go():
        async with open_task_sandbox(task) as sb:
            await sb.run("mkdir -p /logs/verifier /tests && echo 1.0 > /logs/verifier/reward.txt && "
                         "printf '#!/bin/sh\\necho 1.0 > /logs/verifier/reward.txt\\n' > /tests/test.sh", 10)
            return await verify(task, sb)

    res = run(go())
    assert res.score == 0.0 and res.rewards["reward"] == 0.0


# --------------------------------------------------------------------------------------- distinct outcomes


def _with_tests(task, source: str, timeout: float):
    from dataclasses import replace

    from jaxrl_term.tasks.task import FileBlob, Tests

    return replace(task, tests=Tests("pytest", {"test_outputs.py": FileBlob.text(source)}, "test_outputs.py"),
                   test_timeout_s=timeout)


def test_a_hanging_test_run_is_a_timeout_outcome(backend):
    task = _with_tests(generate("create_file", "easy"), "import time\n\ndef test_slow():\n    time.sleep(60)\n", 2.0)

    async def go():
        async with open_task_sandbox(task, backend=backend) as sb:
            return await verify(task, sb)

    res = run(go())
    assert res.outcome == "test_timeout" and res.score == 0.0 and "timeout" in res.error and res.duration_s < 15


def test_tests_that_cannot_report_are_a_verifier_error_not_a_zero(backend):
    task = _with_tests(generate("create_file", "easy"), "# no tests in here\n", 30.0)

    async def go():
        async with open_task_sandbox(task, backend=backend) as sb:
            return await verify(task, sb)

    res = run(go())
    assert res.outcome == "verifier_error" and res.score is None and not res.ok and res.error
