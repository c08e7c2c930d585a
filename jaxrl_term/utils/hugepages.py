"""Transparent huge pages for malloc, set before the process starts (the CPU update step's page faults).

XLA:CPU allocates every large temporary of a step afresh (activations, the logits and their gradient, the
stacked scan residuals), and glibc's malloc serves each one with a fresh ``mmap``: every 4 KiB page faults on
first touch, every step. Measured on the 100M bench config: 525,000 minor faults per update step (2 GB), and
1,200 with glibc's tunable ``glibc.malloc.hugetlb=1`` (glibc >= 2.35: malloc asks for transparent huge pages
with ``madvise``, which the kernel's default ``madvise`` THP mode grants): the step 10-12% faster
(experiments/results/train_step.md has the row without it). glibc reads its tunables once, when the process
starts, so the entry points (``train``, ``sft``, ``eval``, ``serve``, as ``python -m jaxrl_term.X`` or the
``jaxrl-term-X`` scripts) re-execute themselves once with it set, when the package is first imported (``at_entry``,
before JAX is loaded).

Nothing changes when: the variable ``JAXRL_TERM_MALLOC_HUGEPAGES=0`` is set (opt out), the tunable is already
in ``GLIBC_TUNABLES``, the C library is not glibc >= 2.35, or the kernel's THP mode is ``never``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb"
OPT_OUT = "JAXRL_TERM_MALLOC_HUGEPAGES"
_WAS = "_JAXRL_TERM_GLIBC_TUNABLES_WAS"  # set across the re-exec: the user's own GLIBC_TUNABLES ("-" if unset)
_seen = False  # once per process: a second call (an entry point importing the package, then calling) is a no-op
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def glibc_version() -> tuple[int, int] | None:
    """(major, minor) of the running glibc, or None (another C library, or not Linux)."""
    try:
        name, _, version = os.confstr("CS_GNU_LIBC_VERSION").partition(" ")
        major, minor = version.split(".")[:2]
        return (int(major), int(minor)) if name == "glibc" else None
    except (AttributeError, ValueError, OSError):
        return None


def thp_mode() -> str | None:
    """The kernel's transparent-huge-page mode (``always``, ``madvise``, ``never``), or None if unknown."""
    try:
        text = _THP_MODE.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def wanted(env: dict[str, str] | None = None) -> bool:
    """Whether this process should run with ``glibc.malloc.hugetlb=1`` and does not yet."""
    env = os.environ if env is None else env
    if env.get(OPT_OUT, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if TUNABLE in env.get("GLIBC_TUNABLES", ""):  # already set (to whatever the user chose)
        return False
    version = glibc_version()
    return version is not None and version >= (2, 35) and thp_mode() in ("always", "madvise")


def tuned_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with the tunable added to ``GLIBC_TUNABLES`` (other tunables kept)."""
    env = dict(os.environ if env is None else env)
    have = env.get("GLIBC_TUNABLES", "")
    env["GLIBC_TUNABLES"] = f"{have}:{TUNABLE}=1" if have else f"{TUNABLE}=1"
    return env


def reexec_with_hugepage_malloc() -> None:
    """Re-execute this process's own command line with the tunable set, if ``wanted()``; ``at_entry`` calls it
    when the package is first imported (before threads, open sockets or anything worth keeping: ``execv`` keeps
    the pid, the open descriptors and the environment, and replaces everything else). In the re-executed
    process glibc has read the tunable already: ``GLIBC_TUNABLES`` goes back to what the user had, so the
    programs this one starts (sandboxes, servers) see the environment they were given. Returns when nothing is
    to be done; a failing exec is not fatal (the process goes on as it is)."""
    global _seen
    if _seen:
        return
    _seen = True
    if _WAS in os.environ:  # the re-executed process (or one started by it): restore, never loop
        was = os.environ.pop(_WAS)
        if was == "-":
            os.environ.pop("GLIBC_TUNABLES", None)
        else:
            os.environ["GLIBC_TUNABLES"] = was
        return
    if not wanted() or not getattr(sys, "orig_argv", None) or not sys.executable:
        return
    env = tuned_env()
    env[_WAS] = os.environ.get("GLIBC_TUNABLES", "-")
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, list(sys.orig_argv), env)
    except OSError as e:
        print(f"[jaxrl_term] could not re-execute with GLIBC_TUNABLES={env['GLIBC_TUNABLES']} ({e}); "
              "going on without huge pages for malloc", file=sys.stderr)


ENTRY_POINTS = ("train", "sft", "eval", "serve")


def is_entry_command(argv: list[str]) -> bool:
    """Whether ``argv`` (``sys.orig_argv``) runs one of the entry points that do heavy CPU work: ``-m`` after
    any interpreter options (``python -u -X dev -m jaxrl_term.train``, ``-mjaxrl_term.train``), or a script."""
    modules = {f"jaxrl_term.{e}" for e in ENTRY_POINTS}
    i = 1
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "-":
        a = argv[i]
        if a == "-m":
            return i + 1 < len(argv) and argv[i + 1] in modules
        if a.startswith("-m"):
            return a[2:] in modules
        if a in ("-c",):
            return False
        i += 2 if a in ("-X", "-W", "--check-hash-based-pycs") else 1
    return i < len(argv) and Path(argv[i]).name in {f"jaxrl-term-{e}" for e in ENTRY_POINTS}


def at_entry() -> None:
    """Called when the package is imported: restores the environment in a re-executed process; re-executes an
    entry-point command (never a library user's process, a test runner or another script)."""
    if _WAS in os.environ or is_entry_command(list(getattr(sys, "orig_argv", []))):
        reexec_with_hugepage_malloc()
