"""Entry points re-execute once with glibc's huge-page malloc (jaxrl_term/utils/hugepages.py): it takes effect
(page faults of fresh 64 MiB mallocs drop), the user's environment comes back, an opt-out and a library import
change nothing, and nothing loops."""

import os
import subprocess
import sys

from conftest import REPO, need
from jaxrl_term.utils import hugepages

# malloc and touch 4 x 64 MiB (fresh mmaps: glibc's threshold tops out at 32 MiB), count the page faults
PROBE = r"""
import ctypes, os, resource, sys
print("start", os.getpid(), flush=True)
from jaxrl_term.utils import hugepages
hugepages.reexec_with_hugepage_malloc()
hugepages.reexec_with_hugepage_malloc()  # a second call in the same process is a no-op
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    p = libc.malloc(64 << 20)
    ctypes.memset(p, 1, 64 << 20)
    libc.free(p)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
print("end", os.getpid(), faults, repr(os.environ.get("GLIBC_TUNABLES")),
      sorted(k for k in os.environ if "JAXRL_TERM_GLIBC" in k), flush=True)
"""


def _probe(env_extra: dict[str, str], argv: list[str] | None = None):
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", hugepages.OPT_OUT)}
    env.update(env_extra)
    out = subprocess.run(argv or [sys.executable, "-c", PROBE], capture_output=True, text=True, env=env,
                         timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    starts = [x for x in lines if x.startswith("start")]
    end = next(x for x in lines if x.startswith("end")).split(" ", 3)
    return len(starts), {int(x.split()[1]) for x in starts} | {int(end[1])}, int(end[2]), end[3]


def test_reexec_takes_effect_restores_the_environment_and_can_be_turned_off():
    need(hugepages.wanted({}),
         f"glibc >= 2.35 and THP madvise/always (here glibc {hugepages.glibc_version()}, THP {hugepages.thp_mode()})")
    n, pids, faults_on, rest = _probe({})
    assert n == 2 and len(pids) == 1  # re-executed once, same process
    assert rest == "None []"  # GLIBC_TUNABLES as the user had it (unset), the marker gone
    n, _, faults_off, rest = _probe({hugepages.OPT_OUT: "0"})
    assert n == 1 and rest == "None []"
    assert faults_on * 4 < faults_off, (faults_on, faults_off)  # 2 MiB pages: far fewer first-touch faults
    n, _, faults_mix, rest = _probe({"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"})
    assert n == 2 and rest == "'glibc.malloc.arena_max=4' []" and faults_mix * 4 < faults_off  # the user's kept
    n, _, _, _ = _probe({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})
    assert n == 1  # the user's own choice of the tunable is left alone


def test_only_entry_points_reexecute():
    assert hugepages.is_entry_command(["python", "-m", "jaxrl_term.train", "+experiment=tiny_cpu"])
    assert hugepages.is_entry_command(["/v/bin/python", "/v/bin/jaxrl-term-eval", "x=1"])
    assert hugepages.is_entry_command(["python", "-u", "-X", "dev", "-m", "jaxrl_term.sft"])
    assert hugepages.is_entry_command(["python", "-mjaxrl_term.serve"])
    assert not hugepages.is_entry_command(["python", "script.py", "-m", "jaxrl_term.train"])
    assert not hugepages.is_entry_command(["python", "-c", "pass", "-m", "jaxrl_term.train"])
    assert not hugepages.is_entry_command(["python", "-m", "jaxrl_term.report"])
    assert not hugepages.is_entry_command(["python", "-m", "pytest", "tests"])
    assert not hugepages.is_entry_command(["python", "-c", "import jaxrl_term"])
    # importing the package in another program (a script, a test runner) never re-executes it
    out = subprocess.run([sys.executable, "-c", "import os; print(os.getpid()); import jaxrl_term; print(os.getpid())"],
                         capture_output=True, text=True, timeout=60, cwd=REPO,
                         env={k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"})
    assert out.returncode == 0 and len(out.stdout.split()) == 2, out.stdout + out.stderr
