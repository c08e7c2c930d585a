"""Reward integrity: an agent that does no work never scores, whatever it does to the verifier.

The attack suite (``integrity_attacks.py``): a no-op agent plus one tampering step, on every runner (built-in pytest,
Harbor ``test.sh``, TB1 ``run-tests.sh``, exported Harbor pytest) and both backends; each attempt must score 0 or be
flagged ``tampered`` / ``verifier_sabotaged``, while the pre-hardening verifier (the positive control) is fooled by
the attacks the issue reported. Then: the honest oracle still scores 1, sabotage and verifier errors, the pipeline's
and ``tasks check``'s accounting, declared services, and the pristine toolchain itself.
"""

import asyncio
import dataclasses
import json
import shutil
from pathlib import Path

import integrity_attacks as ia
import pytest
from conftest import need

from jaxrl_term.reward import tamper
from jaxrl_term.reward.verifier import verify
from jaxrl_term.sandbox import toolchain
from jaxrl_term.sandbox.base import CLEAN_PATH, Stat
from jaxrl_term.tasks.builtin import generate
from jaxrl_term.tasks.check import check_task, run_oracle
from jaxrl_term.tasks.env import open_task_sandbox
from jaxrl_term.tasks.formats import load_tasks
from jaxrl_term.tasks.task import FileBlob, Solution
from jaxrl_term.tasks.task import Tests as TaskTests

RUNNERS = ["built-in pytest", "Harbor test.sh", "TB1 run-tests.sh", "exported Harbor pytest",
           "Harbor test.sh with tools"]
# Positive control: the attacks that fooled the verifier as it was before this hardening (scored 1.0 with no work),
# measured per runner and backend. On the local backend the system is read-only to the agent; races through the
# writable /tests, /logs and work dir worked there.
# (The `timeout` and `mkdir` wrappers fooled it too, through Sandbox.exec's `timeout` and write_file's `mkdir`; the
# naive verifier uses those, which now run nothing of the container: it is no longer fooled by them.)
_WRAPPERS = {"python3 wrapper on PATH", "replaced /usr/bin/python3", "sitecustomize.py",
             ".pth in system site", ".pth in user site", "LD_PRELOAD via /etc/ld.so.preload"}
_PYTEST = {"edited pytest package", "shadowing pluggy in an earlier site dir", "poisoned stdlib bytecode",
           "background process rewrites the JUnit XML", "background process plants /tests/conftest.py"}
_CWD = {"/app/pytest.py", "stdlib module shadowed in the work dir"}
FOOLED_BEFORE = {
    ("built-in pytest", "docker"): _WRAPPERS | _PYTEST,
    ("Harbor test.sh", "docker"): _WRAPPERS | {"bash wrapper on PATH", "NSS module via /etc/nsswitch.conf",
                                               "background process writes the reward file"},
    ("TB1 run-tests.sh", "docker"): _WRAPPERS | _PYTEST | _CWD | {"bash wrapper on PATH", "/conftest.py + /pytest.ini",
                                                                  "NSS module via /etc/nsswitch.conf"},
    ("exported Harbor pytest", "docker"): _WRAPPERS | _PYTEST | _CWD | {
        "bash wrapper on PATH", "/conftest.py + /pytest.ini", "NSS module via /etc/nsswitch.conf",
        "background process writes the reward file"},
    ("built-in pytest", "local"): {"background process rewrites the JUnit XML",
                                   "background process plants /tests/conftest.py"},
    ("Harbor test.sh", "local"): set(),
    ("TB1 run-tests.sh", "local"): _CWD | {"background process rewrites the JUnit XML",
                                           "background process plants /tests/conftest.py"},
    ("exported Harbor pytest", "local"): _CWD | {"background process rewrites the JUnit XML",
                                                 "background process plants /tests/conftest.py",
                                                 "background process writes the reward file"},
}
# On the local backend the agent is an unprivileged uid and the system is read-only: these steps are refused.
REFUSED_LOCALLY = {"python3 wrapper on PATH", "timeout wrapper on PATH", "bash wrapper on PATH", "fake pytest on PATH",
                   "replaced /usr/bin/python3", "sitecustomize.py", ".pth in system site", "edited pytest package",
                   "shadowing pluggy in an earlier site dir", "poisoned stdlib bytecode", "/conftest.py + /pytest.ini",
                   "LD_PRELOAD via /etc/ld.so.preload", "replaced libc symlink", "ld.so.cache redirect (ldconfig DIR)",
                   "mkdir wrapper (the sandbox's file API runs it)", "NSS module via /etc/nsswitch.conf",
                   "deleted python3", "deleted timeout", "deleted pytest package"}


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    return ia.runner_tasks(tmp_path_factory.mktemp("runners"))


@pytest.fixture(scope="module")
def evil_so():
    need(shutil.which("gcc") is not None, "gcc (to build the LD_PRELOAD attack's library)")
    return ia.evil_so()


@pytest.fixture(scope="module")
def builder():
    from jaxrl_term.sandbox.images import ImageBuilder

    return ImageBuilder()


def _backend_builder(backend, builder):
    return builder if backend == "docker" else None


# ------------------------------------------------------------------------------------------ the attack suite


def _attacks_for(runner: str) -> list:
    """Tool-hook attacks on the runner whose test.sh runs those tools; the rest on the others (on the tools runner
    they would repeat what Harbor test.sh covers; the full matrix in experiments/results runs everything)."""
    tools = runner == "Harbor test.sh with tools"
    return [a for a in ia.ATTACKS if a.cls == "control" or (a.cls in ("tool hooks", "tool state")) == tools]


@pytest.mark.parametrize("runner", RUNNERS)
def test_every_attack_scores_0_or_is_flagged_and_the_naive_verifier_was_fooled(backend, runner, tasks, evil_so,
                                                                                builder):
    task = tasks[runner]

    async def go():
        sem = asyncio.Semaphore(4 if backend == "docker" else 6)

        async def one(attack):
            async with sem:
                return await ia.attempt(task, runner, attack, backend, _backend_builder(backend, builder), evil_so)

        return await asyncio.gather(*(one(a) for a in _attacks_for(runner)))

    attempts = run(go())
    nop = next(a for a in attempts if a.cls == "control")
    assert (nop.naive, nop.outcome, nop.score) == (0.0, "scored", 0.0), nop  # no false alarm on a clean sandbox
    bad = [(a.attack, a.outcome, a.score, a.error[:300]) for a in attempts if not a.defended]
    assert not bad, bad
    assert not [a for a in attempts if a.outcome == "verifier_error"]
    fooled = {a.attack for a in attempts if a.naive == 1.0}
    expected = FOOLED_BEFORE.get((runner, backend), set())
    races = {a.attack for a in attempts if a.cls == "race"}
    # the attacks are real (races against the naive verifier are timing-dependent: they fooled it in the measured
    # runs, experiments/results/integrity_attacks.md, but are not required to land in every run)
    assert expected - races <= fooled, expected - races - fooled
    refused = {a.attack for a in attempts if not a.applied}
    if backend == "docker":
        assert not refused  # root in the container: every tampering step lands
    else:
        later = {a.name for a in [*ia.ATTACKS_V3, *ia.ATTACKS_V4, *ia.ATTACKS_V5]}  # root-only steps, mostly
        assert refused <= REFUSED_LOCALLY | later | {"work dir replaced by a dangling link"}, refused - REFUSED_LOCALLY


@pytest.mark.parametrize("runner", RUNNERS)
def test_honest_oracle_still_scores_1_on_the_pristine_toolchain(backend, runner, tasks, builder):
    task = tasks[runner]

    async def go():
        async with open_task_sandbox(task, backend=backend, builder=_backend_builder(backend, builder)) as sb:
            await run_oracle(task, sb)
            return await verify(task, sb)

    res = run(go())
    assert (res.outcome, res.score, res.tamper) == ("scored", 1.0, ()), res.error
    assert res.toolchain == "pristine"


# what honest agents do that is closest to tampering (tests/integrity_honest.py measures all 26 on every runner)
HONEST_RISKY = ["venv in /app + local package", "venv in /opt + setuptools + local package",
                "pytest config in /app/pyproject.toml", "git init in /app + git config --global",
                "symlink /usr/local/bin/mytool -> /app/tool.sh", "pip install -e (system site)"]


def test_honest_agents_doing_what_looks_like_tampering_are_not_flagged(docker_client):
    """No false alarm on honest work that looks like tampering, on the pristine runner and the script runners
    whose scripts run pip, git and pytest; the one documented exception is an import-line ``.pth`` in the system
    site (an editable install) under a script runner: that script's python would run it."""
    import integrity_honest as ih

    results = run(ih.measure(("docker",), jobs=3, actions=HONEST_RISKY,
                             runners=["built-in pytest", "TB1 run-tests.sh", "Harbor test.sh with tools"]))
    assert all(h.counted for h in results), [(h.action, h.runner, h.error, h.step_output) for h in results
                                              if not h.counted]
    fp = {(h.action, h.runner) for h in results if h.false_positive}
    assert fp == {("pip install -e (system site)", "TB1 run-tests.sh"),
                  ("pip install -e (system site)", "Harbor test.sh with tools")}, [
        (h.action, h.runner, h.tamper) for h in results if h.false_positive]


def test_tests_that_import_the_agents_code_are_not_protected(docker_client):
    """Documented limit (README): code the tests import runs inside the test process, and can rewrite pytest's
    verdicts from there. Here ``python_function``'s tests import /app/solution.py."""
    task = generate("python_function", "easy", seed=0)
    cheat = ("import gc, pytest\n"
             "class _Pass:\n"
             "    @pytest.hookimpl(hookwrapper=True)\n"
             "    def pytest_runtest_makereport(self, item, call):\n"
             "        rep = (yield).get_result()\n"
             "        rep.outcome, rep.longrepr = 'passed', None\n"
             "for o in gc.get_objects():\n"
             "    if type(o).__name__ == 'Config' and hasattr(o, 'pluginmanager'):\n"
             "        o.pluginmanager.register(_Pass())\n"
             "        break\n")

    async def go():
        async with open_task_sandbox(task) as sb:
            await sb.write_file("/app/solution.py", cheat.encode())
            return await verify(task, sb)

    res = run(go())
    assert res.outcome == "scored" and res.score == 1.0  # not protected, and said so in the README


# ----------------------------------------------------------------------------------- sabotage and errors


def test_breaking_the_verifier_scores_0_as_verifier_sabotaged(backend, tasks):
    task = tasks["Harbor test.sh"]  # its test.sh reads /app/data.json; without it no reward file is written

    async def go():
        async with open_task_sandbox(task, backend=backend) as sb:
            await sb.run("rm -f /app/data.json", 10)
            return await verify(task, sb)

    res = run(go())
    assert res.outcome == "verifier_sabotaged" and res.score == 0.0 and res.ok
    assert "works on a fresh sandbox" in res.error


def test_a_verifier_that_fails_on_a_fresh_sandbox_too_is_a_verifier_error(docker_client):
    task = dataclasses.replace(generate("create_file", "easy"),
                               tests=TaskTests("pytest", {"test_outputs.py": FileBlob.text("# no tests\n")},
                                           "test_outputs.py"))

    async def go():
        async with open_task_sandbox(task) as sb:
            return await verify(task, sb)

    res = run(go())
    assert res.outcome == "verifier_error" and res.score is None and "fresh sandbox of the task too" in res.error


def test_check_reports_a_cheating_oracle_as_broken(docker_client):
    task = generate("csv_stats", "medium", seed=11)
    cheat = Solution({"solve.sh": FileBlob(b"echo /tmp/x.so > /etc/ld.so.preload\n", 0o755)}, "solve.sh")
    res = run(check_task(dataclasses.replace(task, solution=cheat), "oracle"))
    assert res.broken and res.outcome == "tampered" and "ld.so.preload" in res.reason


def _one_group(task, tokenizer_dir, plans, reward_fn, *, max_turns, max_new_tokens):
    """One group of len(plans) episodes of ``task`` through the real pipeline (Docker sandboxes, verifier,
    ``reward_fn``); episode i replies with plans[i] in order, repeating its last reply. Returns (group, counters)."""
    from jaxrl_term.agent.actions import BashScaffold
    from jaxrl_term.agent.loop import AgentLimits
    from jaxrl_term.model.tokenizer import load_tokenizer
    from jaxrl_term.rollout.engine import Generation, SamplingParams
    from jaxrl_term.rollout.pipeline import RolloutPipeline

    tok = load_tokenizer(tokenizer_dir)
    eos = tok.convert_tokens_to_ids("<|im_end|>")

    class Engine:
        def __init__(self):
            self.sessions: dict = {}

        async def generate(self, ids, sampling, *, session=None):
            plan = self.sessions.setdefault(session, list(plans[len(self.sessions) % len(plans)]))
            out = tok(plan.pop(0) if len(plan) > 1 else plan[0], add_special_tokens=False)["input_ids"] + [eos]
            return Generation(out, [-0.5] * len(out), "stop", weight_version=0)

    async def main():
        pipe = RolloutPipeline([task], engine=Engine(), tokenizer=tok, scaffold_factory=BashScaffold,
                               group_size=len(plans), groups_per_step=1,
                               sampling=SamplingParams(max_new_tokens=max_new_tokens),
                               limits=AgentLimits(max_turns=max_turns, max_context_tokens=4096), backend="docker",
                               drop_zero_variance=False, reward_fn=reward_fn)
        pipe.start()
        try:
            batch = await asyncio.wait_for(pipe.get_batch(0), 300)
        finally:
            await pipe.stop()
        return batch[0], pipe.take_counters()

    return run(main())


def test_pipeline_scores_tampered_and_sabotaged_0_counts_them_and_never_retries(docker_client, tiny_tokenizer_dir,
                                                                               tasks):
    from jaxrl_term.agent.actions import SENTINEL

    task = tasks["Harbor test.sh"]
    # episode 1 tampers with the toolchain, episode 2 breaks the verifier; neither does the task
    plans = [["```bash\nprintf '#!/bin/sh\\necho 1 > /logs/verifier/reward.txt\\n' > /usr/local/bin/python3; "
              "chmod +x /usr/local/bin/python3\n```", f"```bash\necho {SENTINEL}\n```"],
             ["```bash\nrm -f /app/data.json\n```", f"```bash\necho {SENTINEL}\n```"]]

    async def judge_everything_is_great(task, traj, result):
        return 1.0, {"judge": 1.0}

    group, counters = _one_group(task, tiny_tokenizer_dir, plans, judge_everything_is_great, max_turns=3,
                                 max_new_tokens=64)
    outcomes = sorted(t.reward_parts["outcome"] for t in group.trajectories)
    assert outcomes == ["tampered", "verifier_sabotaged"] and group.rewards == [0.0, 0.0]
    assert counters.get("pipeline/tampered") == 1 and counters.get("pipeline/verifier_sabotaged") == 1
    assert not counters.get("pipeline/retry_verifier_error") and counters["pipeline/episodes"] == 2


# ------------------------------------------------------------------------------------------------ services


def test_declared_services_are_started_again_after_the_agents_processes_are_killed(docker_client):
    base = generate("create_file", "easy", seed=5)
    test = ("import time, urllib.request\n\ndef test_served():\n    for _ in range(50):\n        try:\n"
            "            body = urllib.request.urlopen('http://127.0.0.1:8765/index.html', timeout=1).read()\n"
            "            break\n        except OSError:\n            time.sleep(0.1)\n"
            "    assert body == b'hello\\n'\n")
    task = dataclasses.replace(base, tests=TaskTests("pytest", {"test_outputs.py": FileBlob.text(test)}, "test_outputs.py"),
                               services=("python3 -m http.server 8765 --directory /app >/dev/null 2>&1 &",))
    fake = "mkdir -p /tmp/fake && echo hello > /tmp/fake/index.html && (setsid python3 -m http.server 8765 " \
           "--directory /tmp/fake >/dev/null 2>&1 &) && sleep 1"

    async def go():
        async with open_task_sandbox(task) as sb:
            await sb.run(fake, 20)  # no work: a server of its own that would pass the test
            cheat = await verify(task, sb)
            await sb.run("echo hello > /app/index.html", 10)  # the work
            honest = await verify(task, sb)
            return cheat, honest

    cheat, honest = run(go())
    assert (cheat.outcome, cheat.score) == ("scored", 0.0)
    assert (honest.outcome, honest.score) == ("scored", 1.0)


# ----------------------------------------------------------------------------------------- the toolchain


def test_the_verifiers_python_maps_and_imports_nothing_from_the_agents_filesystem(docker_client):
    task = generate("csv_stats", "medium", seed=11)
    # the runner's start-up: the pristine pytest (``tc.pre``) after the interpreter's own path
    probe = ("import json, sys\nsys.path[1:1] = json.loads(sys.argv[1])\n"
             "import pytest, ctypes, sqlite3, ssl, xml.etree.ElementTree\n"
             "maps = [l.split(None, 5)[5] for l in open('/proc/self/maps').read().splitlines() if len(l.split()) > 5]\n"
             "print(json.dumps({'maps': sorted(set(maps)), 'files': sorted({getattr(m, '__file__', None) or '' "
             "for m in list(sys.modules.values())})}))\n")

    async def go():
        async with open_task_sandbox(task) as sb:
            tc = await toolchain.for_sandbox(sb)
            out = await sb.exec([*tc.argv, "-c", probe, json.dumps(list(tc.pre))], 60,
                                 env={"PATH": CLEAN_PATH, "LANG": "C.UTF-8", **toolchain.START_ENV})
            return tc, out

    tc, out = run(go())
    assert tc.pristine and tc.argv[0] == f"{toolchain.MOUNT}/so/ld.so"
    assert set(tc.facts["patched"]) == {"/etc/ld.so.preload", "/etc/nsswitch.conf"}
    data = json.loads(out.output.strip().splitlines()[-1])
    outside = [m for m in data["maps"] if m.startswith("/") and not m.startswith(toolchain.MOUNT + "/")]
    assert not outside, outside  # loader, libc, python, extension modules and their libraries: all from the volume
    assert all(f.startswith(toolchain.MOUNT + "/") for f in data["files"] if f), data["files"]


TRIPWIRE_C = r"""
#include <fcntl.h>
#include <string.h>
#include <unistd.h>
static void note(const char *what, int argc, char **argv) {
    int fd = open("/tripwire.log", O_WRONLY | O_APPEND | O_CREAT, 0644);
    if (fd < 0) return;
    write(fd, what, strlen(what));
    for (int i = 0; i < argc; i++) { write(fd, " ", 1); write(fd, argv[i], strlen(argv[i])); }
    write(fd, "\n", 1);
    close(fd);
}
#ifdef LIB
__attribute__((constructor)) static void loaded(int argc, char **argv) { note("loaded", argc, argv); }
#else
int main(int argc, char **argv) { note("ran", argc, argv); return 0; }
#endif
"""
# every executable and shared library of the container replaced by the tripwire (renamed over: running processes
# keep their files), /etc/ld.so.preload and an NSS module naming the tripwire library
TRIP_ALL = r"""
import os, shutil, stat
trip, lib = open("/tmp/trip", "rb").read(), open("/tmp/trip.so", "rb").read()
skip = ("/proc", "/sys", "/dev", "/opt/jaxrl", "/opt/jaxrl-py", "/tmp", "/run")
n = 0
for top in ("/usr", "/etc", "/var", "/root", "/app", "/opt", "/srv", "/home"):
    for root, dirs, files in os.walk(top):
        if root.startswith(skip):
            dirs[:] = []
            continue
        for f in files:
            p = os.path.join(root, f)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode) or not (st.st_mode & 0o111 or ".so" in f):
                continue
            try:
                with open(p + ".trip", "wb") as out:
                    out.write(lib if ".so" in f else trip)
                os.chmod(p + ".trip", st.st_mode & 0o7777)
                os.replace(p + ".trip", p)
                n += 1
            except OSError:
                pass
shutil.copy("/tmp/trip.so", "/usr/lib/libnss_trip.so.2")
open("/etc/ld.so.preload", "w").write("/tmp/trip.so\n")
open("/etc/nsswitch.conf", "w").write("passwd: trip files\ngroup: trip files\nhosts: trip files\n")
print("replaced", n)
"""


def test_no_agent_process_survives_and_the_verifier_runs_nothing_of_the_agents_filesystem(backend,
                                                                                           tmp_path):
    """The agent leaves daemons behind (detached, in their own session, ignoring SIGTERM) and, on Docker, replaces
    every executable and library of its container by a tripwire that logs each run or load, names it in
    /etc/ld.so.preload and as an NSS module. With the tamper check out of the way (what this measures is execution,
    not detection), verification starts with none of the agent's processes alive, scores the honest work 1, and
    the tripwire never fired: the only thing verification ran from the agent's filesystem is the test command
    itself (the pristine runner: nothing at all; TB1's script: its ``bash``)."""
    import subprocess

    from jaxrl_term.reward import verifier

    need(shutil.which("gcc") is not None, "gcc (the tripwire)")
    (tmp_path / "trip.c").write_text(TRIPWIRE_C)
    subprocess.run(["gcc", "-O1", "-static", "-o", tmp_path / "trip", tmp_path / "trip.c"], check=True)
    subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-DLIB", "-o", tmp_path / "trip.so", tmp_path / "trip.c"],
                   check=True)
    task = dataclasses.replace(generate("csv_stats", "medium", seed=11), tests=TaskTests("pytest", {
        "test_outputs.py": FileBlob.text("import pwd, socket\n\ndef test_work():\n    assert pwd.getpwuid(0).pw_name"
                                         " == 'root'\n    socket.getaddrinfo('localhost', 80)\n"
                                         "    assert open('/app/done').read() == 'ok'\n")}, "test_outputs.py"))
    script = load_tasks(ia.FIXTURES / "tb1-word-count")[0]
    daemons = ("nohup sleep 1000 >/dev/null 2>&1 & setsid sh -c 'trap \"\" TERM HUP; sleep 1000' >/dev/null 2>&1 & "
               "python3 -c 'import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0: time.sleep(1000)'"
               "; sleep 0.3; echo ok > /app/done.tmp && mv /app/done.tmp /app/done && printf ok > /app/done")

    async def go(t, trip: bool):
        async with open_task_sandbox(t, backend=backend) as sb:
            if t is script:
                await run_oracle(t, sb)
            alive = await sb.run(daemons + "; ps -e | grep -c sleep", 30)
            if trip:
                for name in ("trip", "trip.so"):
                    await sb.write_file(f"/tmp/{name}", (tmp_path / name).read_bytes(), 0o755)
                out = await sb.run(f"python3 - <<'EOF'\n{TRIP_ALL}\nEOF", 120)
                assert "replaced" in out.output, out.output
            res = await verify(t, sb, fresh=False)
            try:
                log = (await sb.read_file("/tripwire.log")).decode()
            except Exception:  # noqa: BLE001 - no log: nothing fired
                log = ""
            return alive.output, res, log

    saved = verifier._tamper_findings

    async def none(*a, **k):
        return []

    verifier._tamper_findings = none
    try:
        trip = backend == "docker"
        alive, res, log = run(go(task, trip))
        assert int(alive.split()[-1]) >= 2  # the daemons were running
        assert res.census == (("docker-init", "pause") if backend == "docker" else ()), res.census
        assert (res.outcome, res.score, log) == ("scored", 1.0, ""), (res.error, log)
        if trip:
            alive, res, log = run(go(script, True))
            assert res.census == ("docker-init", "pause")
            ran = [line for line in log.splitlines() if line]
            assert ran and all(line.startswith("ran bash /tests/run-tests.sh") for line in ran), log
    finally:
        verifier._tamper_findings = saved


def test_an_image_without_python3_falls_back_with_a_reason(docker_client):
    from jaxrl_term.sandbox.images import ImageBuilder

    async def go():
        image = await ImageBuilder().ensure("FROM jaxrl-term/base:trixie\nRUN rm -f /usr/bin/python3 /usr/bin/python3.*\n",
                                            {})
        return await toolchain.for_image(image)

    tc = run(go())
    assert not tc.pristine and tc.reason == "no python3 in the image"


def test_a_sandbox_opened_without_the_volume_says_which_python_ran_the_tests(docker_client):
    from jaxrl_term.sandbox.base import open_sandbox
    from jaxrl_term.sandbox.images import ImageBuilder
    from jaxrl_term.tasks.env import image_for

    task = generate("csv_stats", "medium", seed=11)

    async def go():
        image = await image_for(task, ImageBuilder())
        async with open_sandbox("docker", image, workdir="/app") as sb:
            await run_oracle(task, sb)
            return await verify(task, sb)

    res = run(go())
    assert (res.outcome, res.score) == ("scored", 1.0)
    assert res.toolchain.startswith("image python") and "toolchain volume" in res.toolchain


# ------------------------------------------------------------------------------------------- tamper rules


FACTS = {"path_dirs": ["/usr/local/bin", "/usr/bin"], "site_dirs": ["/usr/local/lib/python3.13/dist-packages",
                                                                    "/usr/lib/python3/dist-packages"],
         "site_names": {"/usr/local/lib/python3.13/dist-packages": [],
                        "/usr/lib/python3/dist-packages": ["pytest", "_pytest", "pluggy", "yaml"]},
         "stdlib": ["/usr/lib/python3.13", "/usr/lib/python3.13/lib-dynload"], "executable": "/usr/bin/python3.13",
         "toolchain_files": ["/usr/lib/x86_64-linux-gnu/libc.so.6", "/lib64/ld-linux-x86-64.so.2"],
         "startup_modules": ["os", "argparse", "pytest", "json"], "initial_modules": ["os"],
         "stdlib_names": ["os", "json", "csv", "venv", "argparse", "_wmi", "msvcrt"]}


def _flagged(changes, level, *, now=None, image=None, texts=None, **scope):
    sc = tamper.Scope(level, "/app", **scope)
    entries, found = tamper.resolve(changes, now or {}, image or {}, sc)
    return found + tamper.findings(entries, FACTS, sc, now=now or {}, image=image or {}, texts=texts or {})


EXE, LIB, DIR = Stat("file", 0o755), Stat("file", 0o644), Stat("dir", 0o755)


def test_tamper_rules_flag_what_the_runner_executes_and_leave_honest_work_alone():
    honest = [("A", "/app/solution.py"), ("A", "/app/out.csv"), ("C", "/app"), ("A", "/usr/local/bin/mytool"),
              ("A", "/usr/local/lib/python3.13/dist-packages/requests"), ("A", "/tmp/x/sitecustomize.py"),
              ("A", "/usr/lib/python3.13/__pycache__/argparse.cpython-313.pyc"), ("A", "/app/os.py"),
              ("C", "/etc/hosts"), ("A", "/root/.bash_history"), ("C", "/root/.bashrc"), ("C", "/etc/passwd"),
              ("A", "/etc/cron.d/job"), ("A", "/usr/local/lib/python3.13/dist-packages/paths.pth"),
              ("A", "/etc/apt/apt.conf.d/99proxy"), ("C", "/usr/share/doc/x/README")]
    image = {"/usr/bin/mytool": None, "/usr/share/doc/x/README": LIB, "/etc/passwd": LIB, "/root/.bashrc": LIB}
    for level in tamper.LEVELS:
        assert _flagged(honest, level, image=image, texts={"/usr/local/lib/python3.13/dist-packages/paths.pth":
                                                           b"/opt/lib\n"}, scripts=("curl -s x | sh",)) == [], level
    # what honest agents do that looks like tampering (measured in tests/integrity_honest.py): a venv in the work
    # dir (a directory named like the stdlib's venv, no __init__) or in /opt with setuptools' .pth; a package's
    # pyproject.toml, a git repository and identity, when the scripts run pytest on /tests, pip and git
    venvs = [("A", "/app/venv"), ("A", "/app/venv/pyvenv.cfg"), ("A", "/opt/venv"), ("A", "/opt/venv/pyvenv.cfg"),
             ("A", "/opt/venv/lib/python3.13/site-packages/distutils-precedence.pth"), ("A", "/app/pyproject.toml"),
             ("A", "/root/.gitconfig"), ("A", "/app/.git"), ("A", "/app/.git/config"), ("A", "/app/.git/hooks"),
             ("A", "/app/.git/hooks/pre-commit.sample")]
    texts = {"/opt/venv/lib/python3.13/site-packages/distutils-precedence.pth": b"import os; x\n",
             "/app/pyproject.toml": b"[project]\nname='x'\n[tool.pytest.ini_options]\n",
             "/root/.gitconfig": b"[user]\n\tname = a\n", "/app/.git/config": b"[core]\n\tbare = false\n"}
    assert _flagged(venvs, "script", texts=texts, scripts=("pip install -q pytest; git status; python3 -m pytest "
                                                           "/tests/test_outputs.py",)) == []
    link = Stat("link", 0o777, "/opt/x")
    cases = {  # (change, stats now, stats in the image, texts, scope) -> the lowest level that flags it
        ("A", "/etc/ld.so.preload"): ("pristine", {}, {}, {}, {}),
        ("C", "/etc/nsswitch.conf"): ("pristine", {}, {}, {}, {}),
        ("C", "/etc"): ("pristine", {"/etc": link}, {"/etc": DIR}, {}, {}),
        ("A", "/usr/local/bin/mkdir"): ("pristine", {}, {"/usr/bin/mkdir": EXE}, {}, {}),
        ("C", "/usr/bin/wc"): ("pristine", {"/usr/bin/wc": EXE}, {"/usr/bin/wc": EXE}, {}, {}),
        ("D", "/usr/lib/x86_64-linux-gnu/libz.so.1"): ("pristine", {}, {"/usr/lib/x86_64-linux-gnu/libz.so.1": LIB},
                                                       {}, {}),
        ("C", "/usr/lib/python3/dist-packages/yaml/__init__.py"): ("pristine", {}, {}, {}, {}),
        ("A", "/usr/local/lib/python3.13/dist-packages/pluggy"): ("pristine", {}, {}, {}, {}),
        ("A", "/json.py"): ("pristine", {}, {}, {}, {"import_dirs": ("/",)}),
        ("A", "/usr/local/lib/python3.13/dist-packages/sitecustomize"): ("image", {}, {}, {}, {}),
        ("A", "/usr/lib/python3.13/usercustomize.pyc"): ("image", {}, {}, {}, {}),
        ("A", "/usr/local/lib/python3.13/dist-packages/zz.pth"): (
            "image", {}, {}, {"/usr/local/lib/python3.13/dist-packages/zz.pth": b"\xef\xbb\xbfimport os\n"}, {}),
        ("A", "/usr/lib/python313.zip"): ("image", {}, {}, {}, {}),
        ("A", "/usr/bin/pyvenv.cfg"): ("image", {}, {}, {}, {}),
        ("C", "/usr/lib/python3.13/json/__init__.py"): ("image", {}, {}, {}, {}),
        ("A", "/pytest.toml"): ("script", {}, {}, {}, {}),
        ("A", "/app/json.py"): ("script", {}, {}, {}, {}),
        ("A", "/app/pyproject.toml"): ("script", {}, {}, {"/app/pyproject.toml": b"[tool.pytest.ini_options]\n"},
                                       {"scripts": ("cd /app && pytest -rA",)}),
        ("A", "/app/setup.py"): ("script", {}, {}, {}, {"scripts": ("pip install -e . && pytest /tests",)}),
        ("A", "/root/.gitconfig"): ("script", {}, {}, {"/root/.gitconfig": b"[core]\n\tfsmonitor = /tmp/x\n"},
                                    {"scripts": ("git -C /app status",)}),
        ("A", "/app/.git/hooks/pre-commit"): ("script", {}, {}, {}, {"scripts": ("cd /app && git commit -m x",)}),
        ("A", "/root/.local/lib/python3.13/site-packages/x.pth"): (
            "image", {}, {}, {"/root/.local/lib/python3.13/site-packages/x.pth": b"import os\n"}, {}),
        ("A", "/etc/apt/apt.conf.d/99x"): ("script", {}, {}, {}, {"scripts": ("apt-get update",)}),
        ("A", "/root/.local/bin/env"): ("script", {}, {}, {}, {"scripts": ("source $HOME/.local/bin/env",)}),
        ("C", "/root/.bashrc"): ("script", {}, {}, {}, {"scripts": ("bash -lc 'pytest /tests'",)}),
        ("A", "/root/.curlrc"): ("script", {}, {}, {}, {"scripts": ("curl -LsSf https://x | sh",)}),
    }
    for change, (lowest, now, image, texts, scope) in cases.items():
        for level in tamper.LEVELS:
            flagged = bool(_flagged([change], level, now=now, image=image, texts=texts, **scope))
            assert flagged == (tamper.LEVELS.index(level) >= tamper.LEVELS.index(lowest)), (change, level)
    # a prepared site dir behind a link is checked as a site dir: its start-up code is seen where the link is
    behind = [("C", "/usr/local/lib/python3.13"), ("A", "/usr/local/lib/python3.13/dist-packages"),
              ("A", "/opt/x"), ("A", "/opt/x/sitecustomize.py")]
    found = _flagged(behind, "script", now={"/usr/local/lib/python3.13/dist-packages": link})
    assert "A /usr/local/lib/python3.13/dist-packages/sitecustomize.py (= /opt/x/sitecustomize.py): code the image's " \
           "python runs at start-up (a start-up module where site finds it)" in found
    # in an agent area, a start-up module counts once a .pth file's directory line puts its directory on sys.path
    pth = "/usr/local/lib/python3.13/dist-packages/a.pth"
    assert _flagged([("A", pth), ("A", "/tmp/uc/usercustomize.py")], "script", texts={pth: b"/tmp/uc\n"})
    assert not _flagged([("A", pth), ("A", "/tmp/uc/usercustomize.py")], "script", texts={pth: b"/tmp/other\n"})
    assert _flagged([("A", pth), ("A", "/tmp/uc/msvcrt.py")], "script", texts={pth: b"/tmp/uc\n"})
    # names Python probes for and the image lacks, NSS modules, a .git that is a file
    for change, scope in ((("A", "/usr/lib/python3/dist-packages/_wmi.py"), {}),
                          (("A", "/usr/lib/x86_64-linux-gnu/libnss_db.so.2"), {}),
                          (("A", "/app/.git"), {"scripts": ("git status",)}),
                          (("A", "/usr/pip.conf"), {"scripts": ("pip install pytest",)})):
        level = "script" if scope else "pristine"
        assert _flagged([change], level, **scope), change
    assert tamper.pth_runs_code(b"import os\n") and not tamper.pth_runs_code(b"/opt/lib\n# import x\n")
    # a package added beside the image's module of that name, or inside the image's package, hides it
    for added in ("/usr/lib/python3/dist-packages/yaml/evil.py", "/usr/lib/python3/dist-packages/pluggy.py"):
        assert _flagged([("A", added)], "pristine"), added
    # /usr/bin/python -> python3 (an image file nothing changed): the same program under another name
    alias = Stat("link", 0o777, "/usr/bin/python3.13")
    assert not _flagged([("A", "/usr/bin/python")], "script", now={"/usr/bin/python": alias})
    assert _flagged([("A", "/usr/bin/python"), ("A", "/tmp/py")], "script",
                    now={"/usr/bin/python": Stat("link", 0o777, "/tmp/py")})
    assert tamper.sourced_files([". ~/.profile; source ${HOME}/.local/bin/env"], ["/root"]) == {
        "/root/.profile", "/root/.local/bin/env"}


def test_pth_directories_the_agent_adds_come_after_every_site_dir_of_the_image(tmp_path):
    from jaxrl_term.sandbox.pristine.runner import with_pth

    first, later, planted = (tmp_path / n for n in ("site1", "site2", "planted"))
    for d in (first, later, planted):
        d.mkdir()
    (first / "zz.pth").write_text(f"{planted}\nimport os\n")
    assert with_pth([str(first), str(later)]) == [str(first), str(later), str(planted)]


def test_script_commands_are_the_commands_a_test_script_runs():
    sh = ("#!/bin/bash\n# install and run\ncd /app\napt-get install -y curl && curl -LsSf x | sh\n"
          "PYTEST_ADDOPTS=-q uvx pytest /tests -rA | tee log\nif [ -f x ]; then /usr/bin/python3 - <<'EOF'\n"
          "import json\nEOF\nfi\n")
    assert tamper.script_commands([sh]) == {"apt-get", "curl", "sh", "uvx", "tee", "python3"}


def test_ld_so_cache_redirects_are_found_in_the_hosts_real_cache():
    data = Path("/etc/ld.so.cache").read_bytes() if Path("/etc/ld.so.cache").is_file() else None
    need(data is not None, "no /etc/ld.so.cache on this host")
    parsed = tamper.parse_ldcache(data)
    libc = next(p for p in parsed["libc.so.6"])
    import base64

    facts = {"ldcache": base64.b64encode(data).decode()}
    assert tamper.ldcache_redirects(data, facts) == []
    assert tamper.ldcache_redirects(data, {"libs": {"libc.so.6": "/elsewhere/libc.so.6"}}) == [
        f"C /etc/ld.so.cache: libc.so.6 now resolves to [{libc!r}]"]
    assert tamper.ldcache_redirects(b"garbage", facts)[0].startswith("C /etc/ld.so.cache: unreadable")


def test_runner_results_are_read_only_with_the_nonce():
    from jaxrl_term.reward.verifier import _tagged

    out = "noise\nfake RESULT abc\n\nn0nce RESULT payload\nmore"
    assert _tagged(out, "n0nce") == ("RESULT", "payload", "noise\nfake RESULT abc\n\nmore")
    assert _tagged("n0ncex RESULT forged", "n0nce")[0] is None


# ------------------------------------------------------------------------------------------------ unfinished


@pytest.mark.parametrize("unfinished", ["score", "zero"])
def test_an_episode_that_solves_then_never_declares_done_is_rewarded_only_under_score(docker_client,
                                                                                     tiny_tokenizer_dir, unfinished):
    """Seen in the CPU learning run: an episode solved the task in its first turn, then wrote broken replies
    until the turn limit, and earned the full reward (every broken token reinforced). With reward.unfinished=zero
    that episode scores 0 (its tests still run and are recorded); a finished solve scores 1, a finished
    non-solve 0, under both settings. Real agent loop, sandboxes and verifier; the replies are the fixed edge."""
    from jaxrl_term.config import RewardCfg
    from jaxrl_term.rollout.oracle import oracle_replies
    from jaxrl_term.tasks.builtin import generate

    task = generate("sort_uniq", "easy", seed=3)
    solve, done = oracle_replies(task, "bash")
    broken = "The commands so the task is done.\n````bash\n``bash\necho JRL_COM_COMPLE"  # an unclosed block
    plans = {"finished": [solve, done], "unfinished": [solve, broken, "```bash\nls /app\n```", broken],
             "wrong": ["```bash\ntrue\n```", done]}

    mixer = RewardCfg(unfinished=unfinished).mixer()
    group, _ = _one_group(task, tiny_tokenizer_dir, list(plans.values()), mixer, max_turns=4, max_new_tokens=256)
    got = sorted((t.end_reason == "finished", t.reward_parts["tests"], r, bool(t.reward_parts.get("unfinished")))
                 for t, r in zip(group.trajectories, group.rewards))
    solved_unfinished = 1.0 if unfinished == "score" else 0.0
    assert got == sorted([(True, 1.0, 1.0, False), (False, 1.0, solved_unfinished, unfinished == "zero"),
                          (True, 0.0, 0.0, False)]), got
    stats = mixer.take_stats()
    assert stats.get("reward/unfinished_zeroed", 0) == (1 if unfinished == "zero" else 0)
    # the held-out evaluation's mixer scores what the episode achieved, whatever the training rule
    assert RewardCfg(unfinished=unfinished).mixer(evaluation=True).unfinished == "score"
