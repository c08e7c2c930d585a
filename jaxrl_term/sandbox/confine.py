"""Limits and identity for the local (bubblewrap) backend: a pid limit, a memory limit and the host uid a sandbox's
processes run as.

The first mechanism that works on this machine is used (``JAXRL_TERM_LOCAL_CONFINE=auto|cgroup2|cgroup1|uid``
forces one):

- ``cgroup2``: one cgroup per sandbox with ``pids.max``, ``memory.max`` and ``memory.swap.max = 0``, under a
  delegated parent: ``$JAXRL_TERM_CGROUP`` (e.g. a systemd unit or scope with ``Delegate=yes``, for non-root
  users), else ``jaxrl_term`` under this process's own cgroup, else ``jaxrl_term`` at the top of the hierarchy.
- ``cgroup1``: the same with the v1 ``pids`` and ``memory`` controllers (root on a v1 or hybrid hierarchy),
  nested under this process's own cgroups so the sandboxes stay inside whatever limits the owner lives in.
- ``uid``: no writable cgroup, running as root: ``RLIMIT_NPROC`` on the sandbox's dedicated host uid (the kernel
  counts that uid's processes, and only the sandbox has it); memory is then capped per process only
  (``RLIMIT_AS``, which every mechanism also sets, so one huge allocation fails with ``MemoryError``).

None of them works: ``SandboxError`` naming the fix. A sandbox never runs without a pid limit.

Identity: running as root, every sandbox gets its own unprivileged host uid and gid (``UID_BASE`` + n, claimed by
creating the sandbox's directory), so its processes can signal, trace or read nothing of the host's or another
sandbox's; as another user, the sandbox runs as that user. Either way a user namespace maps it to a non-root uid
with no capabilities inside (``local.py``).
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import logging
import os
import signal
import time
from pathlib import Path

from jaxrl_term.sandbox.base import SandboxError

log = logging.getLogger(__name__)

UID_BASE = 2_000_000_000  # far above login users, subuid ranges (100000+) and Docker's userns remapping
UID_SPAN = 1_000_000
KINDS = ("cgroup2", "cgroup1", "uid")
_warned_memory = False
NO_PID_LIMIT = (
    "the local sandbox cannot apply a pid limit on this machine and will not run unconfined: it needs a writable "
    "cgroup (cgroup v2: export JAXRL_TERM_CGROUP=<a delegated cgroup dir>, e.g. from `systemd-run --user --scope "
    "-p Delegate=yes ...`; cgroup v1/v2 hierarchies as root), or to run as root (a dedicated uid with "
    "RLIMIT_NPROC). Or use the docker backend."
)


def _write(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


# Runs as its own process (``Confinement.exec_prefix``), as root when the sandbox has a dedicated uid: the signal
# state a fresh terminal would give (a blocked mask and ignored dispositions pass through exec: a SIGINT blocked in
# the trainer's thread, or ignored by a ``nohup``/background launch, would make every ``kill -INT`` a no-op and
# every timeout a SIGKILL; Python itself ignores SIGPIPE and SIGXFSZ), then join the cgroups, set the rlimits and
# drop to the dedicated uid, in that order; then, if the trainer that started it still lives (bwrap's
# ``--die-with-parent`` watches the parent it finds), exec the command with PATH as its only variable (the
# interpreter adds LC_CTYPE to its own environment in the C locale; the hop's loader variables stop here too).
# A failure exits 125 with the reason on stderr, before the command runs.
_HOP = r"""
import posix, resource, sys, _signal as sg
try:
    sep = sys.argv.index("--")
    parent, memory, pids, uid = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    cgroups, argv = sys.argv[5:sep], sys.argv[sep + 1:]
    sg.pthread_sigmask(sg.SIG_SETMASK, [])
    for sig in range(1, sg.NSIG):
        if sig not in (sg.SIGKILL, sg.SIGSTOP):
            try:
                if sg.getsignal(sig) in (sg.SIG_IGN, sg.default_int_handler):
                    sg.signal(sig, sg.SIG_DFL)
            except (OSError, ValueError):
                pass
    for d in cgroups:
        fd = posix.open(d + "/cgroup.procs", posix.O_WRONLY)
        try:
            posix.write(fd, b"0")
        finally:
            posix.close(fd)
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    if uid:
        resource.setrlimit(resource.RLIMIT_NPROC, (pids, pids))
        posix.setgroups([])
        posix.setresgid(int(uid), int(uid), int(uid))
        posix.setresuid(int(uid), int(uid), int(uid))
    if posix.getppid() != parent:
        raise RuntimeError("the trainer that started this sandbox process is gone")
    posix.execve(argv[0], argv, {b"PATH": posix.environ[b"PATH"]})
except BaseException as e:
    sys.stderr.write("jaxrl_term confine: %s: %s\n" % (type(e).__name__, e))
    sys.stderr.flush()
    posix._exit(125)
"""


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(mount root, mount point, fs type, super options) of every cgroup mount, from /proc/self/mountinfo."""
    out = []
    for line in _read(Path("/proc/self/mountinfo")).splitlines():
        pre, _, post = line.partition(" - ")
        f, g = pre.split(), post.split()
        if len(f) >= 5 and len(g) >= 3 and g[0] in ("cgroup", "cgroup2"):
            out.append((f[3], f[4].replace("\\040", " "), g[0], set(g[2].split(","))))
    return out


def _own_dir(mount_root: str, mount_point: str, own: str) -> Path:
    rel = os.path.relpath(own, mount_root) if own.startswith(mount_root) else own.lstrip("/")
    return Path(mount_point) / ("" if rel == "." else rel)


# ---------------------------------------------------------------------------------------------- parents


def _v2_ready(base: Path, parent_may_enable: bool) -> bool:
    """``base`` exists (created if needed) and hands pids (and memory when present) to its children."""
    try:
        base.mkdir(exist_ok=True)
        want = {"pids", "memory"}
        have = set(_read(base / "cgroup.controllers").split())
        if "pids" not in have and parent_may_enable:
            _write(base.parent / "cgroup.subtree_control", " ".join(f"+{c}" for c in want))
            have = set(_read(base / "cgroup.controllers").split())
        if "pids" not in have:
            return False
        missing = (want & have) - set(_read(base / "cgroup.subtree_control").split())
        if missing:
            _write(base / "cgroup.subtree_control", " ".join(f"+{c}" for c in sorted(missing)))
        return True
    except OSError as e:
        log.debug("cgroup v2 parent %s unusable: %s", base, e)
        return False


@functools.lru_cache(maxsize=1)
def cgroup2_parent() -> Path | None:
    """The delegated cgroup v2 directory per-sandbox cgroups are made in, or None."""
    env = os.environ.get("JAXRL_TERM_CGROUP")
    if env:
        return Path(env) if _v2_ready(Path(env), parent_may_enable=False) else None
    v2 = [(root, mp) for root, mp, kind, _ in _mounts() if kind == "cgroup2"]
    own = next((line[3:] for line in _read(Path("/proc/self/cgroup")).splitlines() if line.startswith("0::")), None)
    if not v2 or own is None:
        return None
    root, mp = v2[0]
    for base in (_own_dir(root, mp, own) / "jaxrl_term", Path(mp) / "jaxrl_term"):
        if _v2_ready(base, parent_may_enable=True):
            return base
    return None


@functools.lru_cache(maxsize=1)
def cgroup1_parents() -> dict[str, Path]:
    """controller -> the v1 directory per-sandbox cgroups are made in ({} without a writable ``pids``)."""
    own = {}
    for line in _read(Path("/proc/self/cgroup")).splitlines():
        _, ctrls, path = line.split(":", 2)
        for c in ctrls.split(","):
            own[c] = path
    out = {}
    for root, mp, kind, opts in _mounts():
        for c in ("pids", "memory"):
            if kind == "cgroup" and c in opts and c in own and c not in out:
                base = _own_dir(root, mp, own[c]) / "jaxrl_term"
                try:
                    base.mkdir(exist_ok=True)
                    if os.access(base, os.W_OK):
                        out[c] = base
                except OSError as e:
                    log.debug("cgroup v1 %s parent %s unusable: %s", c, base, e)
    return out if "pids" in out else {}


def pick_kind() -> str:
    forced = os.environ.get("JAXRL_TERM_LOCAL_CONFINE", "auto")
    if forced not in ("auto", *KINDS):
        raise SandboxError(f"JAXRL_TERM_LOCAL_CONFINE={forced!r}: use auto, {', '.join(KINDS)}")
    usable = {"cgroup2": lambda: cgroup2_parent() is not None, "cgroup1": lambda: bool(cgroup1_parents()),
              "uid": lambda: os.geteuid() == 0}
    for kind in KINDS if forced == "auto" else (forced,):
        if usable[kind]():
            return kind
    raise SandboxError(NO_PID_LIMIT if forced == "auto" else f"JAXRL_TERM_LOCAL_CONFINE={forced}: not usable here. "
                       + NO_PID_LIMIT)


# -------------------------------------------------------------------------------------------- processes


def uid_pids(uid: int) -> list[int]:
    """Live host pids whose real uid is ``uid`` (read from status: a non-dumpable process's /proc dir is root's)."""
    out = []
    for d in os.scandir("/proc"):
        if not d.name.isdigit():
            continue
        try:
            st = d.stat(follow_symlinks=False)
            if st.st_uid not in (uid, 0):
                continue
            with open(f"/proc/{d.name}/status") as f:
                for line in f:
                    if line.startswith("State:") and line.split()[1] in ("Z", "X"):
                        break  # exited, waiting to be reaped: nothing left to kill
                    if line.startswith("Uid:"):
                        if int(line.split()[1]) == uid:
                            out.append(int(d.name))
                        break
        except (OSError, ValueError):
            continue
    return out


def limit_hits(events: Path) -> int:
    """How many forks the pid limit refused so far: the ``max`` counter of ``pids.events`` (cgroup v1 and v2);
    0 when absent."""
    for line in _read(events).splitlines():
        key, _, value = line.partition(" ")
        if key == "max" and value.strip().isdigit():
            return int(value)
    return 0


class PidPressure:
    """``()`` -> True when a sandbox is under pid pressure: the limit refused a fork since the last look, or
    the count is at 80% of the limit or more. The first catches what a sampled count misses: a fork bomb whose
    processes sleep in bash's fork-retry loop and die holds the count at a fluctuating level below the limit."""

    def __init__(self, limit: int, count, events: list[Path]):
        self.limit, self._count, self._events = limit, count, events
        self._seen = self._hits()

    def _hits(self) -> int:
        return sum(limit_hits(e) for e in self._events)

    def __call__(self) -> bool:
        hits = self._hits()
        refused, self._seen = hits > self._seen, hits
        return refused or self._count() >= 0.8 * self.limit


def _kill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@dataclasses.dataclass
class Confinement:
    """One sandbox's limits. ``exec_prefix`` applies them to a process on its way to exec bubblewrap."""

    kind: str
    pids: int
    memory_bytes: int
    host_uid: int | None = None  # a dedicated host uid (running as root), else None: this process's own user
    cgroups: tuple[str, ...] = ()  # the sandbox's cgroup dirs (one per v1 controller; one for v2)

    @classmethod
    def plan(cls, kind: str, name: str, pids: int, memory_mb: int, host_uid: int | None) -> Confinement:
        """What ``apply`` will make (recorded with the sandbox before anything exists, for the reaper)."""
        if kind == "uid" and host_uid is None:
            raise SandboxError(NO_PID_LIMIT)
        if kind == "cgroup2":
            dirs = [cgroup2_parent() / name]
        elif kind == "cgroup1":
            dirs = [parent / name for parent in cgroup1_parents().values()]
        else:
            dirs = []
        return cls(kind, pids, memory_mb * 1024 * 1024, host_uid, tuple(map(str, dirs)))

    def apply(self) -> None:
        try:
            for d in map(Path, self.cgroups):
                d.mkdir()
                if (d / "pids.max").exists():
                    _write(d / "pids.max", str(self.pids))
                if (d / "memory.max").exists():  # v2
                    _write(d / "memory.max", str(self.memory_bytes))
                    if (d / "memory.swap.max").exists():
                        _write(d / "memory.swap.max", "0")
                elif (d / "memory.limit_in_bytes").exists():  # v1
                    _write(d / "memory.limit_in_bytes", str(self.memory_bytes))
                    if (d / "memory.memsw.limit_in_bytes").exists():
                        _write(d / "memory.memsw.limit_in_bytes", str(self.memory_bytes))
        except OSError as e:
            self.release()
            raise SandboxError(f"could not set up the sandbox's {self.kind} limits: {e}") from e
        if self.cgroups and not any((Path(d) / "pids.max").exists() for d in self.cgroups):
            self.release()
            raise SandboxError(f"the sandbox's cgroups {self.cgroups} have no pids.max: " + NO_PID_LIMIT)
        global _warned_memory
        if not _warned_memory and not any((Path(d) / f).exists() for d in self.cgroups
                                          for f in ("memory.max", "memory.limit_in_bytes")):
            _warned_memory = True
            log.warning("no writable cgroup memory controller (limits: %s): sandbox memory is capped per process "
                        "only (RLIMIT_AS)", self.kind)

    def record(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_record(cls, rec: dict) -> Confinement:
        return cls(rec["kind"], rec["pids"], rec["memory_bytes"], rec.get("host_uid"), tuple(rec.get("cgroups", ())))

    # -- in the child -----------------------------------------------------------------------------
    def exec_prefix(self) -> list[str]:
        """The argv to put in front of bubblewrap's: a fresh, single-threaded interpreter (``python -I -S``) that
        sets the sandbox's signal state, cgroups, rlimits and uid (``_HOP``), then execs the rest of the argv in
        the same process (same pid: bwrap's ``--die-with-parent`` still watches the trainer).

        Never a ``preexec_fn``: that runs Python in a fork of the trainer, a process with dozens of native
        threads (XLA, orbax/tensorstore, tokenizers, OpenBLAS), after ``fork()`` has run every library's
        ``pthread_atfork`` handlers while holding the GIL; a handler waiting for a lock that a thread waiting
        for the GIL holds deadlocks the fork, and with it the event loop that called it (asyncio spawns
        synchronously): the whole run stops with no log line. Without ``preexec_fn`` the spawn is a
        ``vfork``/exec with no Python and no handlers in between. Costs one interpreter start (~10 ms) per
        sandbox process (the shell, ``exec`` calls; no module beyond ``posix``, ``_signal`` and ``resource``)."""
        import sys

        uid = "" if self.host_uid is None else str(self.host_uid)
        return [sys.executable, "-I", "-S", "-c", _HOP, str(os.getpid()), str(self.memory_bytes), str(self.pids), uid,
                *self.cgroups, "--"]

    # -- from the host ----------------------------------------------------------------------------
    def members(self) -> list[int]:
        """Host pids of every process in the sandbox: cgroup members and the dedicated uid's processes."""
        pids: set[int] = set(uid_pids(self.host_uid)) if self.host_uid is not None else set()
        for d in self.cgroups:
            pids.update(int(p) for p in _read(Path(d) / "cgroup.procs").split())
        return sorted(pids)

    def count(self) -> int:
        """Tasks charged against the pid limit right now."""
        for d in self.cgroups:
            if (Path(d) / "pids.current").exists():
                return int(_read(Path(d) / "pids.current") or 0)
        return len(self.members())

    def pressure(self) -> PidPressure:
        """The pid-pressure check of this sandbox (made once its cgroups exist)."""
        return PidPressure(self.pids, self.count, [Path(d) / "pids.events" for d in self.cgroups])

    def kill_all(self, timeout_s: float = 10.0) -> bool:
        """SIGKILL every process of the sandbox until none is left; True if none is."""
        deadline = time.monotonic() + timeout_s
        for d in self.cgroups:
            if (Path(d) / "cgroup.kill").exists():
                try:
                    _write(Path(d) / "cgroup.kill", "1")
                except OSError:
                    pass
        while True:
            left = self.members()
            if not left:
                return True
            if time.monotonic() > deadline:
                log.warning("sandbox processes still alive after kill: %s", left[:10])
                return False
            _kill(left)
            time.sleep(0.01)

    def release(self) -> None:
        """Kill what is left and remove the cgroups (retried: dying processes leave them late)."""
        self.kill_all()
        for d in self.cgroups:
            for _ in range(100):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY:
                        log.debug("rmdir %s: %s", d, e)
                        break
                    _kill(int(p) for p in _read(Path(d) / "cgroup.procs").split())
                    time.sleep(0.02)

