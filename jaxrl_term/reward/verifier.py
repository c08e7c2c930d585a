"""Run a task's own tests in the sandbox after the agent is done, honestly.

Tamper-proofing: ``/tests`` and ``/logs/verifier`` are wiped and the tests are copied in from the ``Task``
(never from anything the agent could have changed); every verifier command is a fresh process as root with
a clean environment (``Sandbox.exec``), not the agent's shell; pytest runs with the working dir removed
from ``sys.path`` (a planted ``pytest.py`` is not imported), plugin autoload off, its own ini file,
``--rootdir``/``--confcutdir`` at ``/tests`` (a ``conftest.py`` or ``pytest.ini`` the agent planted in the
work dir or above is not read), and reports through JUnit XML in a directory with a random name. Harbor
tasks read ``/logs/verifier/reward.txt|json`` written by their ``test.sh`` after the wipe. Processes the
agent left running are not killed (tests may check services it started).

Outcomes: ``scored`` (score in [0, 1]), ``test_timeout`` (the tests exceeded their timeout: score 0, the
reason kept), ``verifier_error`` (the tests could not run or report at all: score None, the trajectory must
be retried or dropped, never scored 0).
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import time
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Mapping

from jaxrl_term.sandbox.base import Sandbox
from jaxrl_term.tasks.task import Task

SCORING = ("weighted", "binary")

# pytest through the image's python3, with '' / the work dir dropped from sys.path first.
PYTEST = ("python3", "-c",
          "import os, sys; sys.path[:] = [p for p in sys.path if p not in ('', '.', os.getcwd())]; "
          "import pytest; sys.exit(pytest.main(sys.argv[1:]))")


@dataclasses.dataclass(frozen=True)
class VerifierResult:
    score: float | None
    passed: dict[str, bool]  # test name -> passed (SKIPPED / XFAIL count as passed, as in Terminal-Bench)
    weights: dict[str, float]  # test name -> the weight it carried
    output: str
    duration_s: float
    error: str | None = None
    outcome: str = "scored"  # scored | test_timeout | verifier_error
    rewards: dict[str, float] = dataclasses.field(default_factory=dict)  # Harbor reward.json / reward.txt

    @property
    def ok(self) -> bool:
        return self.outcome != "verifier_error"


def parse_junit(xml_text: str | bytes) -> dict[str, bool]:
    """Test name -> passed, from pytest's JUnit XML (a failure or error child = failed)."""
    root = ET.fromstring(xml_text)
    out: dict[str, bool] = {}
    for case in root.iter("testcase"):
        name = case.get("name", "")
        cls = case.get("classname", "")
        key = name if name not in out else f"{cls}::{name}"
        out[key] = case.find("failure") is None and case.find("error") is None
    return out


def weights_for(names, weights: Mapping[str, float]) -> dict[str, float]:
    """Weight per test that ran: exact name, else its function (parametrized cases share it equally);
    tests absent from a non-empty weight table weigh 0; an empty table weighs every test 1."""
    if not weights:
        return {n: 1.0 for n in names}
    base = {n: n.split("::")[-1].split("[")[0] for n in names}
    counts: dict[str, int] = {}
    for n in names:
        if n not in weights:
            counts[base[n]] = counts.get(base[n], 0) + 1
    return {n: float(weights[n]) if n in weights else float(weights.get(base[n], 0.0)) / counts[base[n]]
            for n in names}


def score_of(passed: Mapping[str, bool], weights: Mapping[str, float], scoring: str) -> float:
    if scoring == "binary":
        return 1.0 if passed and all(passed.values()) else 0.0
    ran = sum(weights[n] for n in passed)
    return sum(weights[n] for n, ok in passed.items() if ok) / ran if ran > 0 else 0.0


async def _write_tests(task: Task, sandbox: Sandbox) -> None:
    for rel, blob in task.tests.files.items():
        await sandbox.write_file(f"/tests/{rel}", blob.data, blob.mode)


async def verify(task: Task, sandbox: Sandbox, *, scoring: str = "weighted", timeout_s: float | None = None,
                 workdir: str | None = None) -> VerifierResult:
    """Copy the task's tests in, run them, score. ``scoring``: ``weighted`` (TB-RL: Σ weights of passed ÷
    Σ weights of tests that ran) or ``binary`` (Tmax: 1 only if every test passed)."""
    if scoring not in SCORING:
        raise ValueError(f"reward.scoring={scoring!r}; use one of {SCORING}")
    t0 = time.monotonic()
    timeout_s = task.test_timeout_s if timeout_s is None else timeout_s
    workdir = workdir or task.environment.workdir
    nonce = uuid.uuid4().hex
    results = f"/logs/verifier/.{nonce}"

    def fail(msg: str, output: str = "") -> VerifierResult:
        return VerifierResult(None, {}, {}, output, time.monotonic() - t0, msg, "verifier_error")

    # Empty /tests and /logs/verifier (mount points on the local backend); a symlink or file the agent put
    # in their place is removed first, so nothing is written through it.
    wipe = ("set -e; for d in /logs /tests /logs/verifier; do "
            'if [ -L "$d" ] || { [ -e "$d" ] && [ ! -d "$d" ]; }; then rm -rf "$d"; fi; mkdir -p "$d"; done; '
            f"find /tests /logs/verifier -mindepth 1 -delete; mkdir -p {results} {shlex.quote(workdir)}")
    prep = await sandbox.exec(["bash", "-c", wipe], 60)
    if prep.exit_code != 0:
        return fail(f"could not prepare /tests and /logs/verifier: {prep.output.strip()}", prep.output)
    await _write_tests(task, sandbox)
    env = {"TEST_DIR": "/tests", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "HOME": "/root", "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1"}
    junit = f"{results}/junit.xml"
    runner = task.tests.runner
    if runner == "pytest":
        ini = "/tests/pytest.ini" if "pytest.ini" in task.tests.files else f"{results}/pytest.ini"
        if ini != "/tests/pytest.ini":
            await sandbox.write_file(ini, b"[pytest]\n")
        argv = [*PYTEST, f"/tests/{task.tests.entry}", "-rA", "-p", "no:cacheprovider", "-c", ini,
                "--rootdir=/tests", "--confcutdir=/tests", f"--junitxml={junit}"]
    elif runner == "run-tests.sh":
        env["PYTEST_ADDOPTS"] = f"--junitxml={junit} -p no:cacheprovider"
        argv = ["bash", f"/tests/{task.tests.entry}"]
    else:
        argv = ["bash", f"/tests/{task.tests.entry}"]
    res = await sandbox.exec(argv, timeout_s, env=env, workdir=workdir)
    if res.timed_out:
        return VerifierResult(0.0, {}, {}, res.output, time.monotonic() - t0,
                              f"the tests exceeded their timeout of {timeout_s:.0f}s", "test_timeout")
    if runner == "harbor":
        return await _harbor_result(task, sandbox, res, scoring, t0)
    try:
        xml = await sandbox.read_file(junit)
        passed = parse_junit(xml)
    except Exception as e:  # noqa: BLE001 - no report at all is a verifier error, whatever the cause
        return fail(f"no JUnit report from the tests (exit {res.exit_code}): {e}", res.output)
    if not passed:
        return fail(f"the tests reported no test cases (exit {res.exit_code})", res.output)
    weights = weights_for(list(passed), task.tests.weights)
    return VerifierResult(score_of(passed, weights, scoring), passed, weights, res.output, time.monotonic() - t0)


async def _harbor_result(task: Task, sandbox: Sandbox, res, scoring: str, t0: float) -> VerifierResult:
    rewards: dict[str, float] = {}
    try:
        txt = await sandbox.read_file("/logs/verifier/reward.txt")
        rewards = {"reward": float(txt.decode().strip())}
    except ValueError as e:
        return VerifierResult(None, {}, {}, res.output, time.monotonic() - t0,
                              f"/logs/verifier/reward.txt is not a number: {e}", "verifier_error")
    except Exception:  # noqa: BLE001 - absent: try reward.json
        try:
            raw = json.loads(await sandbox.read_file("/logs/verifier/reward.json"))
            if not isinstance(raw, dict) or not raw:
                raise ValueError("expected a JSON object of name -> number")
            rewards = {str(k): float(v) for k, v in raw.items()}
        except Exception as e:  # noqa: BLE001
            return VerifierResult(None, {}, {}, res.output, time.monotonic() - t0,
                                  f"test.sh wrote neither /logs/verifier/reward.txt nor a valid reward.json "
                                  f"(exit {res.exit_code}): {e}", "verifier_error")
    # The score: the "reward" entry; a single entry is that; otherwise the mean of all entries.
    if "reward" in rewards:
        value = rewards["reward"]
    elif len(rewards) == 1:
        value = next(iter(rewards.values()))
    else:
        value = sum(rewards.values()) / len(rewards)
    value = min(max(value, 0.0), 1.0)
    score = (1.0 if value >= 1.0 else 0.0) if scoring == "binary" else value
    return VerifierResult(score, {}, {}, res.output, time.monotonic() - t0, rewards=rewards)
