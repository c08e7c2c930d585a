"""Run a task's own tests in the sandbox after the agent is done, so that an agent that did no work cannot score.

The agent is root in its sandbox and an optimiser: anything the verifier runs from the agent's filesystem, any file
it reads back, any process the agent left running is a way to forge a result. The order:

1. ``kill_all()``: every process the agent started dies (Docker: the container restarts, files kept; local: the
   sandbox's processes are killed); then the census (``_census``): the processes alive are listed (Docker: ``docker
   top``, by the engine's host) and must be exactly the sandbox's own keep-alive (``VerifierResult.census``).
2. Tamper check (``reward/tamper.py``): the engine's diff since the sandbox was created, resolved by the engine's
   stats of what each changed path is now and was in the image (``stat_paths`` / ``image_stat_paths``), against
   what the runner below will execute; any finding is the outcome ``tampered`` (score 0) and nothing runs.
3. ``/tests`` and ``/logs/verifier`` emptied and the task's tests written in, through the engine's archive API
   (``reset_dirs``, ``write_file``: nothing of the container runs; a link is replaced, never followed); the
   task's declared ``services`` started again from its definition.
4. The tests, in a fresh process as root (uid 0 by number) with our environment, wrapped by the toolkit's static
   ``timeout`` (``Sandbox.exec``):

   - ``pytest`` (built-in, TB-RL): on the verifier's own Python (``sandbox/toolchain.py``: a read-only copy of
     the image's interpreter, stdlib, libraries and pytest, its loader and libc blind to ``/etc/ld.so.preload``
     and ``/etc/nsswitch.conf``; or the host's read-only ``/usr`` python on the local backend) through
     ``sandbox/pristine/runner.py``: pytest rooted at ``/tests`` (its own ini, ``--rootdir``/``--confcutdir=/tests``,
     plugin autoload off, no work dir on ``sys.path`` unless the tests import a module only it provides, then
     appended last; standard-library and pytest module names only from the pristine paths); results come back on
     the exec's own stdout, tagged with a nonce sent on its stdin.
   - ``run-tests.sh`` (TB1) and ``harbor`` (``test.sh`` + ``/logs/verifier/reward.txt|json``): the format's own
     script, in the agent's environment (it may install things), so step 2 checks every interpreter, library,
     configuration and command that script runs; JUnit XML (TB1) via ``PYTEST_ADDOPTS`` in a random directory.

5. A verifier error (the tests could not run or report) is re-checked on a fresh sandbox of the same task: if the
   verifier works there, the agent broke it: ``verifier_sabotaged`` (score 0); only if it fails there too is it a
   ``verifier_error``. The fresh sandbox is on the same Docker engine (``sb.reopen``); a sandbox lost while its
   engine stopped answering is a ``verifier_error`` without the check (infrastructure: an engine that comes back
   would otherwise pass the check and read as sabotage).

Outcomes: ``scored`` (score in [0, 1]); ``test_timeout`` (0, reason kept); ``tampered`` (0, the findings kept);
``verifier_sabotaged`` (0); ``verifier_error`` (score None: the trajectory is retried or dropped, never scored).
What stays out of reach by construction (tests that import or run the agent's code) is listed in the README.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import functools
import json
import logging
import posixpath
import re
import secrets
import time
import xml.etree.ElementTree as ET
import zlib
from collections.abc import Callable, Mapping

from jaxrl_term.reward import tamper
from jaxrl_term.sandbox import toolchain
from jaxrl_term.sandbox.base import CLEAN_PATH, Sandbox, SandboxError
from jaxrl_term.tasks.task import Task, resolve_env

_log = logging.getLogger(__name__)
SCORING = ("weighted", "binary")
OUTCOMES = ("scored", "test_timeout", "tampered", "verifier_sabotaged", "verifier_error", "verifier_needs_network")
ZERO_OUTCOMES = ("tampered", "verifier_sabotaged")  # scored 0 whatever else would reward the trajectory


@dataclasses.dataclass(frozen=True)
class VerifierResult:
    score: float | None
    passed: dict[str, bool]  # test name -> passed (SKIPPED / XFAIL count as passed, as in Terminal-Bench)
    weights: dict[str, float]  # test name -> the weight it carried
    output: str
    duration_s: float
    error: str | None = None
    outcome: str = "scored"  # one of OUTCOMES
    rewards: dict[str, float] = dataclasses.field(default_factory=dict)  # Harbor reward.json / reward.txt
    tamper: tuple[str, ...] = ()  # the tamper check's findings (outcome tampered)
    toolchain: str = ""  # "pristine", or which python ran the tests and why
    engine_down: bool = False  # verifier_error because the sandbox's Docker engine died: never a sabotage check
    census: tuple[str, ...] = ()  # the processes alive when verification started (the sandbox's own only)

    @property
    def ok(self) -> bool:
        return self.outcome not in ("verifier_error", "verifier_needs_network")


# What a verifier prints when it reaches for the network and cannot (curl, wget, pip, uv, npm, git, Python, Go,
# apt): name resolution and route failures only; "connection refused" is what a test of a local server the agent
# did not start prints, and is not evidence. Confirmed on a fresh sandbox of the task before it counts.
NETWORK_FAILURE = re.compile(
    r"could not resolve host|couldn't resolve host|temporary failure in name resolution|name or service not known|"
    r"network is unreachable|nodename nor servname|unable to resolve host|\beai_again\b|\benotfound\b|\benetunreach\b|"
    r"failed to resolve|could not resolve|dns error|no such host|resolving timed out|"
    r"name resolution failed|failed to lookup address",
    re.I)
# (task id, verifier online, public network) -> evidence, once a fresh sandbox confirmed it; and those a fresh
# sandbox cleared (an agent's forged error text is not re-checked at the cost of a sandbox every time)
_NEEDS_NETWORK: dict[tuple, str] = {}
_NETWORK_OK: set[tuple] = set()


def reset_network_findings() -> None:
    _NEEDS_NETWORK.clear()
    _NETWORK_OK.clear()


def network_evidence(output: str) -> str | None:
    """The first line of ``output`` that reads as a network failure, or None."""
    for line in output.splitlines():
        if NETWORK_FAILURE.search(line):
            return line.strip()[:300]
    return None


def passed_from_cases(cases) -> dict[str, bool]:
    """Test name -> passed from (classname, name, passed) triples; a repeated name gets its class prefix."""
    out: dict[str, bool] = {}
    for cls, name, ok in cases:
        out[name if name not in out else f"{cls}::{name}"] = bool(ok)
    return out


def parse_junit(xml_text: str | bytes) -> dict[str, bool]:
    """Test name -> passed, from pytest's JUnit XML (a failure or error child = failed)."""
    root = ET.fromstring(xml_text)
    return passed_from_cases((c.get("classname", ""), c.get("name", ""),
                              c.find("failure") is None and c.find("error") is None) for c in root.iter("testcase"))


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


# Local backend: empty /tests and /logs/verifier (mount points there); a symlink or file the agent put in their place
# is removed first, so nothing is written through it; then the directories the tests need. Run by the host's
# read-only python. (Docker: ``reset_dirs``, through the engine's archive API.)
WIPE_PY = r"""
import json, os, shutil, sys
cfg = json.loads(sys.argv[1])
for d in ("/logs", "/tests", "/logs/verifier"):
    if os.path.islink(d) or (os.path.exists(d) and not os.path.isdir(d)):
        os.unlink(d)
    os.makedirs(d, exist_ok=True)
for d in ("/tests", "/logs/verifier"):
    for n in os.listdir(d):
        p = os.path.join(d, n)
        shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)
for d in cfg["dirs"]:
    os.makedirs(d, exist_ok=True)
"""


async def _write_tests(task: Task, sandbox: Sandbox) -> None:
    for rel, blob in task.tests.files.items():
        await sandbox.write_file(f"/tests/{rel}", blob.data, blob.mode)


def _tagged(output: str, nonce: str) -> tuple[str | None, str, str]:
    """(kind, payload, the output without the tagged line) of the runner's ``<nonce> KIND payload`` line."""
    kind, payload, rest = None, "", []
    for line in output.split("\n"):
        if kind is None and line.startswith(nonce + " "):
            kind, _, payload = line[len(nonce) + 1:].partition(" ")
            continue
        rest.append(line)
    return kind, payload, "\n".join(rest).strip("\n")


async def verify(task: Task, sandbox: Sandbox, *, scoring: str = "weighted", timeout_s: float | None = None,
                 workdir: str | None = None, fresh: Callable | None | bool = None) -> VerifierResult:
    """Kill the agent's processes, check for tampering, copy the task's tests in, run them, score.

    ``scoring``: ``weighted`` (TB-RL: Σ weights of passed ÷ Σ weights of tests that ran) or ``binary`` (Tmax: 1
    only if every test passed). ``fresh``: for the sabotage check, a zero-argument callable whose result gives a
    fresh sandbox of the task with ``async with``; None: ``open_task_sandbox(task)`` on the same backend; False:
    no check (a verifier error stays one)."""
    if scoring not in SCORING:
        raise ValueError(f"reward.scoring={scoring!r}; use one of {SCORING}")
    try:
        res = await _verify(task, sandbox, scoring, timeout_s, workdir)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # an engine API call failed outside the sandbox's own error handling
        answers = getattr(sandbox, "engine_answers", None)
        if answers is None or await asyncio.to_thread(answers):
            raise
        return VerifierResult(None, {}, {}, "", 0.0, f"the sandbox's Docker engine stopped answering during "
                                                     f"verification: {type(e).__name__}: {e}", "verifier_error",
                              engine_down=True)
    online = (getattr(sandbox, "phase_network", None) or {}).get("verifier", False)
    key = (task.id, online, getattr(getattr(sandbox, "limits", None), "public_network", None))
    if key in _NEEDS_NETWORK:  # the whole task is out (its successes too: no selection among its episodes)
        return _needs_network(res, _NEEDS_NETWORK[key], online)
    evidence = network_evidence(res.output) if res.score is None or res.score < 1 else None
    confirm = evidence is not None and key not in _NETWORK_OK and fresh is not False
    if (res.outcome != "verifier_error" and not confirm) or fresh is False or res.engine_down:
        return res
    if fresh is None or fresh is True:
        from jaxrl_term.tasks.env import open_task_sandbox

        backend = "docker" if getattr(sandbox, "container", None) is not None else "local"
        # the same settings as the sandbox had (tasks/env.py leaves them on it), else the defaults
        fresh = getattr(sandbox, "reopen", None) or functools.partial(open_task_sandbox, task, backend=backend)
    if confirm:
        # The verifier failed and printed a network failure. On a fresh sandbox of the task (no agent): if it
        # fails the same way, the verifier needs network it does not have, and the task is excluded from then on
        # (every episode dropped, never a 0 or a selected 1); if not, the agent made that output: its result
        # stands, and the task is not checked again.
        try:
            async with fresh() as sb:
                again = await _verify(task, sb, scoring, timeout_s, workdir)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - the check could not run: the result stands as a verifier error would
            again = None
        if again is not None and network_evidence(again.output) and (again.score is None or again.score < 1):
            _NEEDS_NETWORK[key] = evidence
            return _needs_network(res, evidence, online)
        if again is not None:
            _NETWORK_OK.add(key)
        if res.outcome != "verifier_error":
            return res
    try:
        async with fresh() as sb:
            again = await _verify(task, sb, scoring, timeout_s, workdir)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - the check itself could not run: the error stays an error
        return dataclasses.replace(res, error=f"{res.error} (a fresh sandbox of the task for the sabotage check "
                                              f"failed: {type(e).__name__}: {e})")
    if again.ok:
        return dataclasses.replace(res, score=0.0, outcome="verifier_sabotaged",
                                   duration_s=res.duration_s + again.duration_s,
                                   error=f"the verifier failed on the agent's sandbox ({res.error}) but works on a "
                                         f"fresh sandbox of the task ({again.outcome})")
    return dataclasses.replace(res, error=f"{res.error} (on a fresh sandbox of the task too: a task or "
                                          "infrastructure error)")


def _needs_network(res: VerifierResult, evidence: str, online: bool) -> VerifierResult:
    how = ("the network it had does not reach what it fetches from this machine (check sandbox.public_network "
           "and the machine's egress)") if online else (
        "it ran without network; grant it with [verifier] network_mode = \"public\" in task.toml or "
        "sandbox.verifier_network=public")
    return dataclasses.replace(res, score=None, outcome="verifier_needs_network", error=(
        f"verifier needs network: it failed with a network error ({evidence!r}), on a fresh sandbox of the task "
        f"too; {how}"))


async def _verify(task: Task, sandbox: Sandbox, scoring: str, timeout_s: float | None,
                  workdir: str | None) -> VerifierResult:
    t0 = time.monotonic()
    timeout_s = task.test_timeout_s if timeout_s is None else timeout_s
    workdir = workdir or task.environment.workdir
    nonce = secrets.token_hex(16)
    tc = await toolchain.for_sandbox(sandbox)
    runner = task.tests.runner
    level = "script" if runner != "pytest" else ("pristine" if tc.pristine else "image")

    def result(score, outcome="scored", error=None, output="", **kw) -> VerifierResult:
        return VerifierResult(score, kw.pop("passed", {}), kw.pop("weights", {}), output, time.monotonic() - t0,
                              error, outcome, toolchain=tc.label, **kw)

    # Set for every process verification starts, over the image's own ENV (no BASH_ENV, no SSH_CLIENT; stdin is
    # /dev/null or a pipe, never a socket: bash reads no start-up file), USER/LOGNAME: getpass needs no passwd lookup
    env = {"TEST_DIR": "/tests", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "HOME": "/root", "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1", "PATH": CLEAN_PATH, "USER": "root", "LOGNAME": "root",
           # git runs no fsmonitor command, whatever a repository's configuration says (git 2.31+)
           "GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "core.fsmonitor", "GIT_CONFIG_VALUE_0": "false"}
    if task.verifier_env:  # Harbor's [verifier] env (${VAR} from this process's environment)
        env = {**resolve_env(task.verifier_env, f"task {task.id}: [verifier]"), **env}
    phases = getattr(sandbox, "phase_network", None)
    if phases is not None:  # the verifier's own network (tasks/env.py decided it per phase); outside the try:
        await sandbox.set_network(phases["verifier"])  # an engine error here is infrastructure, never a 0
    try:
        await sandbox.kill_all()
        census = await _census(sandbox)
        scope = _scope(task, level, workdir, tc)
        found = await _tamper_findings(sandbox, tc, scope)
        if found:
            more = f" (+{len(found) - 8} more)" if len(found) > 8 else ""
            return result(0.0, "tampered", "the agent changed what the verifier runs: " + "; ".join(found[:8]) + more,
                          tamper=tuple(found), census=census)
        results = f"/logs/verifier/.{nonce}"
        dirs = sorted({results, *(f"/tests/{rel}".rsplit("/", 1)[0] for rel in task.tests.files)} - {"/tests"})
        apt = runner != "pytest" and re.search(r"(^|[^\w.-])apt(-get)?($|[^\w.-])", "\n".join(scope.scripts), re.M)
        if apt:  # apt's package lists and cache for the scripts: fresh, never the ones the agent left
            dirs += [f"{results}/apt/lists/partial", f"{results}/apt/archives/partial"]
        reset = getattr(sandbox, "reset_dirs", None)
        if reset is not None:  # Docker: through the engine's archive API, nothing of the container runs
            if not (await sandbox.stat_paths([workdir])).get(workdir):
                dirs.append(workdir)
            await reset(["/tests", "/logs/verifier"], dirs)
        else:  # local: /tests and /logs/verifier are mount points; the host's read-only python empties them
            prep = await sandbox.exec([*tc.python(nonce), "-c", WIPE_PY, json.dumps({"dirs": [*dirs, workdir]})],
                                      60, env={**env, **toolchain.START_ENV})
            if prep.exit_code != 0:
                return result(None, "verifier_error", f"could not prepare /tests and /logs/verifier: "
                                                      f"{prep.output.strip()}", prep.output)
        await _write_tests(task, sandbox)
        for i, cmd in enumerate(task.services):  # the task's own services, started as its definition says
            r = await sandbox.exec(["bash", "-c", f"( {cmd} ) </dev/null >/tmp/.jaxrl-service-{i}.log 2>&1"], 120,
                                   env=env, workdir=workdir)
            if r.exit_code != 0:
                return result(None, "verifier_error", f"service {i} ({cmd!r}) did not start: exit {r.exit_code}")
        if runner == "pytest":
            res = await _run_pytest(task, sandbox, tc, env, scoring, timeout_s, workdir, nonce, results, result,
                                    scope)
        else:
            if apt:
                await sandbox.write_file(f"{results}/apt.conf", (
                    f'Dir::State::Lists "{results}/apt/lists/";\nDir::Cache::Archives "{results}/apt/archives/";\n'
                ).encode())
                env = {**env, "APT_CONFIG": f"{results}/apt.conf"}
            res = await _run_script(task, sandbox, env, scoring, timeout_s, workdir, nonce, results, result)
        return dataclasses.replace(res, census=census)
    except CensusError as e:  # infrastructure: a fresh sandbox would pass and read as sabotage
        return result(None, "verifier_error", str(e), engine_down=True)
    except SandboxError as e:  # the sandbox broke under the verifier: checked on a fresh sandbox like any error
        if getattr(e, "engine_down", False):  # unless its engine died: infrastructure, no check (module doc)
            return result(None, "verifier_error", f"the sandbox's Docker engine stopped answering during "
                                                  f"verification: {e}", engine_down=True)
        return result(None, "verifier_error", f"the sandbox failed during verification: {e}")


async def _census(sandbox: Sandbox) -> tuple[str, ...]:
    """The processes alive once the agent's were killed, measured (Docker: ``docker top``, read by the engine's
    host; local: the sandbox's cgroup or uid). Exactly the sandbox's own keep-alive must be left
    (``own_processes``; a restarted container's init may take a moment to start it): anything else makes the
    sandbox be killed again, and a survivor after that is an infrastructure error (retried, never scored)."""
    processes = getattr(sandbox, "processes", None)
    if processes is None:
        return ()
    own = tuple(sorted(getattr(sandbox, "own_processes", ())))
    for attempt in range(2):
        for _ in range(30):
            try:
                procs = await processes()
            except Exception as e:  # noqa: BLE001 - an engine without `docker top` (no ps on its host)
                _log.warning("cannot list the sandbox's processes (%s: %s): the census is not measured; the "
                             "container's restart killed the agent's processes", type(e).__name__, e)
                return ("unmeasured",)
            names = tuple(sorted(p[2] for p in procs))
            if names == own:
                return names
            if any(n not in own and not n.startswith("runc") for n in names):  # runc's init: an exec starting
                break
            await asyncio.sleep(0.1)
        if attempt == 0:
            await sandbox.kill_all()
    raise CensusError(f"processes other than the sandbox's own {own} are alive after killing the agent's: {procs}")


class CensusError(SandboxError):
    """Processes survived killing the sandbox's: infrastructure (the attempt is retried), never a sabotage check."""


def _scope(task: Task, level: str, workdir: str, tc) -> tamper.Scope:
    """What the tests will execute and import, from the task's test files."""
    sources = [b.data.decode(errors="replace") for rel, b in task.tests.files.items() if rel.endswith(".py")]
    scripts = tuple(b.data.decode(errors="replace") for rel, b in task.tests.files.items() if rel.endswith(".sh"))
    import_dirs = []
    if "__init__.py" in task.tests.files:  # the tests are a package: pytest puts "/" on sys.path for them
        import_dirs.append("/")
    if any("sys.path" in src or "PYTHONPATH" in src for src in sources):  # the tests choose their own path
        import_dirs.append(workdir)
    modules = frozenset(tamper._module_name(posixpath.basename(rel)) for rel in task.tests.files
                        if rel.endswith(".py") and "/" not in rel)
    runs = any(re.search(r"\bsubprocess\b|\bos\.(system|popen|exec|spawn)|\bpexpect\b|\bpty\.spawn|\bsh\.",
                         src) for src in sources)
    return tamper.Scope(level, workdir, scripts=scripts, test_imports=tamper.python_imports(sources),
                        import_dirs=tuple(import_dirs), test_modules=modules, tests_run=runs,
                        test_words=tamper.command_words([*sources, *scripts]),
                        homes=tuple(tc.facts.get("homes") or ("/root",)))


async def _tamper_findings(sandbox: Sandbox, tc, scope: tamper.Scope) -> list[str]:
    changes = await sandbox.changes()
    want_now, want_image = tamper.stat_requests(changes, tc.facts, scope)
    stat = getattr(sandbox, "stat_paths", None)
    now = await stat(want_now) if want_now and stat is not None else {}
    image = await sandbox.image_stat_paths(want_image) if want_image and hasattr(sandbox, "image_stat_paths") else {}
    texts: dict[str, bytes] = {}
    for _ in range(6):  # follow links (chains, targets in the agent's areas) and .pth lines until nothing is new
        entries, found = await asyncio.to_thread(tamper.resolve, changes, now, image, scope)
        for p in tamper.read_requests(entries, tc.facts, scope):
            if p not in texts:
                try:
                    texts[p] = await sandbox.read_file(p)
                except SandboxError:
                    texts[p] = b"import pytest"  # unreadable (a directory, a dangling link): counted as code
        more = tamper.followups(changes, now, texts, scope) if stat is not None else []
        if not more:
            break
        now.update(await stat(more))
    found += await asyncio.to_thread(functools.partial(tamper.findings, entries, tc.facts, scope, now=now,
                                                       image=image, texts=texts))
    if any(e.path == "/etc/ld.so.cache" and e.kind != "D" for e in entries):
        found += tamper.ldcache_redirects(await sandbox.read_file("/etc/ld.so.cache"), tc.facts)
    return list(dict.fromkeys(found))


async def _agent_modules(task: Task, sandbox: Sandbox, tc, scope: tamper.Scope) -> bool:
    """Whether the tests import a module that only the agent's work dir provides (then the work dir is appended to
    their ``sys.path``, after everything else: it can add modules, never replace one)."""
    known = set(tc.facts.get("stdlib_names") or ()) | set(tc.facts.get("startup_modules") or ()) | {
        n for names in (tc.facts.get("site_names") or {}).values() for n in names} | {
        tamper._module_name(posixpath.basename(rel)) for rel in task.tests.files} | set(tamper.ALWAYS_SHADOWABLE)
    names = sorted(set(scope.test_imports) - known)
    if not names or not hasattr(sandbox, "stat_paths"):
        return bool(names)
    wd = scope.workdir.rstrip("/")
    st = await sandbox.stat_paths([p for n in names for p in (f"{wd}/{n}.py", f"{wd}/{n}")])
    return any(v is not None for v in st.values())


async def _run_pytest(task, sandbox, tc, env, scoring, timeout_s, workdir, nonce, results, result, scope):
    if "pytest.ini" in task.tests.files:
        ini = "/tests/pytest.ini"
    else:
        ini = f"{results}/pytest.ini"
        await sandbox.write_file(ini, b"[pytest]\n")
    args = [f"/tests/{task.tests.entry}", "-rA", "-p", "no:cacheprovider", "-c", ini, "--rootdir=/tests",
            "--confcutdir=/tests"]
    if tc.pristine:  # no locale file from the agent's filesystem at start-up; the tests get LANG back, not LC_ALL
        env = {**env, **toolchain.START_ENV}
    late = [workdir] if await _agent_modules(task, sandbox, tc, scope) else []
    runner = tc.runner(args, nonce, environ={k: None for k in toolchain.START_ENV} if tc.pristine else None,
                       late=late)
    res = await sandbox.exec(runner, timeout_s, env=env, workdir=workdir,
                             stdin=f"{nonce}\n".encode())
    kind, payload, output = _tagged(res.output, nonce)
    if res.timed_out:
        return result(0.0, "test_timeout", f"the tests exceeded their timeout of {timeout_s:.0f}s", output)
    if kind == "ERROR":
        return result(None, "verifier_error", f"the test runner failed: {json.loads(payload)}", output)
    if kind != "RESULT":
        return result(None, "verifier_error", f"no results from the test runner (exit {res.exit_code})", output)
    data = json.loads(zlib.decompress(base64.b64decode(payload)))
    passed = passed_from_cases(data["cases"])
    if not passed:
        return result(None, "verifier_error", f"the tests reported no test cases (exit {data['rc']})", output)
    weights = weights_for(list(passed), task.tests.weights)
    return result(score_of(passed, weights, scoring), output=output, passed=passed, weights=weights)


async def _run_script(task, sandbox, env, scoring, timeout_s, workdir, nonce, results, result):
    junit = f"{results}/junit.xml"
    env = {**env, "PYTHONPYCACHEPREFIX": f"/tmp/.jrt-pyc-{nonce[:16]}"}  # no bytecode from the agent's filesystem
    if task.tests.runner == "run-tests.sh":
        env["PYTEST_ADDOPTS"] = f"--junitxml={junit} -p no:cacheprovider"
    res = await sandbox.exec(["bash", f"/tests/{task.tests.entry}"], timeout_s, env=env, workdir=workdir)
    if res.timed_out:
        return result(0.0, "test_timeout", f"the tests exceeded their timeout of {timeout_s:.0f}s", res.output)
    await sandbox.kill_all()  # nothing left running (a service, what the script started) writes the results now
    if task.tests.runner == "harbor":
        return await _harbor_result(sandbox, res, scoring, result)
    try:
        passed = parse_junit(await sandbox.read_file(junit))
    except Exception as e:  # noqa: BLE001 - no report at all is a verifier error, whatever the cause
        return result(None, "verifier_error", f"no JUnit report from the tests (exit {res.exit_code}): {e}", res.output)
    if not passed:
        return result(None, "verifier_error", f"the tests reported no test cases (exit {res.exit_code})", res.output)
    weights = weights_for(list(passed), task.tests.weights)
    return result(score_of(passed, weights, scoring), output=res.output, passed=passed, weights=weights)


async def _harbor_result(sandbox: Sandbox, res, scoring: str, result) -> VerifierResult:
    rewards: dict[str, float] = {}
    try:
        txt = await sandbox.read_file("/logs/verifier/reward.txt")
        rewards = {"reward": float(txt.decode().strip())}
    except ValueError as e:
        return result(None, "verifier_error", f"/logs/verifier/reward.txt is not a number: {e}", res.output)
    except Exception:  # noqa: BLE001 - absent: try reward.json
        try:
            raw = json.loads(await sandbox.read_file("/logs/verifier/reward.json"))
            if not isinstance(raw, dict) or not raw:
                raise ValueError("expected a JSON object of name -> number")
            rewards = {str(k): float(v) for k, v in raw.items()}
        except Exception as e:  # noqa: BLE001
            return result(None, "verifier_error", f"test.sh wrote neither /logs/verifier/reward.txt nor a valid "
                                                  f"reward.json (exit {res.exit_code}): {e}", res.output)
    # The score: the "reward" entry; a single entry is that; otherwise the mean of all entries.
    if "reward" in rewards:
        value = rewards["reward"]
    elif len(rewards) == 1:
        value = next(iter(rewards.values()))
    else:
        value = sum(rewards.values()) / len(rewards)
    value = min(max(value, 0.0), 1.0)
    score = (1.0 if value >= 1.0 else 0.0) if scoring == "binary" else value
    return result(score, output=res.output, rewards=rewards)
