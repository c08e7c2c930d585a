"""Local backend: the sandbox protocol with bubblewrap, for machines without Docker.

Isolation is weaker than a container's, and it is the host's own system: the host's ``/usr`` and ``/etc`` (and
``/opt``) are bound read-only and the task's Dockerfile is *not* applied, so tasks that need packages the host
lacks fail here. What the agent gets:

- a user namespace: a non-root uid inside (``SANDBOX_UID``), no capabilities, ``no_new_privs``, no further user
  namespaces. ``mount``, ``mknod`` and writes to the read-only system fail; tasks that need root fail here (Docker is
  the real backend). Running as root, the sandbox's processes run as a host uid of their own (``confine.py``);
- a pid limit and a memory limit (cgroups, or ``RLIMIT_NPROC`` on that uid; see ``confine.py``), and ``RLIMIT_AS``
  per process; the sandbox refuses to start where no pid limit can be applied;
- private writable ``limits.workdir`` (default ``/app``), ``/tmp``, ``/tests``, ``/logs``, ``/solution``: host
  directories removed on ``close``; the root and everything else is read-only; the toolkit at ``/opt/jaxrl``;
- new network (loopback only), pid, ipc, uts and cgroup namespaces; a clean environment; ``--die-with-parent``.

The persistent shell starts non-dumpable (``toolkit.NODUMP``): the agent cannot read its stdin pipe or memory.
``exec`` (the verifier, set-up steps) runs in a second bubblewrap over the same directories, as uid 0 of its own
user namespace mapped to the same host uid, with no capabilities: "root" for scripts that check, no more power
than the agent's (the system is read-only anyway).

The file API runs on the host and never follows a symbolic link: paths under the writable directories are walked
component by component with ``O_NOFOLLOW`` from the directory's own descriptor (a link anywhere in the path is
refused); other paths are read by ``cat`` inside the sandbox, as the agent's uid, so they show the agent's view.

Reaping: each sandbox directory holds ``owner.json`` (owner machine, boot, pid and its start time, run id, and
the limits made for it) outside what the sandbox can see. ``reap`` (called when the first sandbox of a process
starts; CLI ``python -m jaxrl_term.sandbox.local reap``) kills and removes the sandboxes of owners that are gone.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import logging
import os
import posixpath
import shutil
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path

from jaxrl_term.sandbox import beneath
from jaxrl_term.sandbox import confine as cf
from jaxrl_term.sandbox import local_dirs as dirs
from jaxrl_term.sandbox.base import CLEAN_PATH, CommandResult, SandboxError, SandboxLimits, SandboxLost, Stat
from jaxrl_term.sandbox.local_dirs import reap  # noqa: F401 - the backend's reaper, for callers and the CLI
from jaxrl_term.sandbox.shell import OutputCapture, PersistentShell

log = logging.getLogger(__name__)

RO_BINDS = ("/usr", "/etc")
SANDBOX_UID = 1000  # the agent's uid (and gid) inside; exec runs as 0 inside, mapped to the same host uid
EXTRA_DIRS = ("/tests", "/logs", "/solution")


class ProcessTransport:
    """The shell's stdout pipe, and its stdin: one end of a socketpair (``sealed``: a process the agent leaves
    holding the shell's stdin cannot reopen it for writing through ``/proc/self/fd``, as it could a pipe)."""

    sealed = True

    def __init__(self, proc: asyncio.subprocess.Process, writer: asyncio.StreamWriter):
        self.proc, self._w = proc, writer

    async def write(self, data: bytes) -> None:
        self._w.write(data)
        await self._w.drain()

    async def read(self) -> bytes:
        assert self.proc.stdout is not None
        return await self.proc.stdout.read(65536)

    async def close(self) -> None:
        # bwrap --die-with-parent: killing it kills its pid namespace's init, and with it every process of the shell
        try:
            self._w.close()
        except Exception:  # noqa: BLE001 - closing a dead socket
            pass
        if self.proc.returncode is None:
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass
            await self.proc.wait()


def _descendants(root_pid: int) -> dict[int, tuple[int, int, int]]:
    """host pid -> (pgrp, start tick, innermost-namespace pid) for every descendant of ``root_pid``."""
    info: dict[int, tuple[int, int, int, int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            status = (d / "status").read_text()
        except OSError:
            continue
        nspid = next((line.split()[-1] for line in status.splitlines() if line.startswith("NSpid:")), d.name)
        info[int(d.name)] = (int(fields[1]), int(fields[2]), int(fields[19]), int(nspid))
    out: dict[int, tuple[int, int, int]] = {}
    frontier = {root_pid}
    while frontier:
        nxt = {pid for pid, v in info.items() if v[0] in frontier and pid not in out}
        for pid in nxt:
            out[pid] = info[pid][1:]
        frontier = nxt
    return out


# ------------------------------------------------------------------------------------------- bubblewrap


_BWRAP: dict[str, object] = {}


def _bwrap() -> tuple[str, bool]:
    """bwrap's path, and whether it has ``--disable-userns`` (0.8+)."""
    if "path" not in _BWRAP:
        path = shutil.which("bwrap")
        if path is None:
            raise SandboxError("the local sandbox needs bubblewrap: apt-get install bubblewrap")
        help_text = subprocess.run([path, "--help"], capture_output=True, text=True, check=False).stdout
        _BWRAP.update(path=path, disable_userns="--disable-userns" in help_text)
        if not _BWRAP["disable_userns"]:
            log.warning("bubblewrap %s lacks --disable-userns (0.8+): the agent can create nested user namespaces",
                        path)
    return str(_BWRAP["path"]), bool(_BWRAP["disable_userns"])


USERNS_HINT = (
    "the local backend needs unprivileged user namespaces (Debian: sysctl kernel.unprivileged_userns_clone=1; "
    "Ubuntu 24.04+: sysctl kernel.apparmor_restrict_unprivileged_userns=0 or an AppArmor profile for bwrap); "
    "or use the docker backend"
)


# --------------------------------------------------------------------------------------------- sandbox


class LocalSandbox:
    own_processes = ()  # nothing of the sandbox's own is left after kill_all

    def __init__(self, limits: SandboxLimits, root: Path, confinement: cf.Confinement):
        self.limits, self.root, self.confine = limits, root, confinement
        self.work, self.tmp = root / "work", root / "tmp"
        self.shell: PersistentShell | None = None
        self._bwrap_pid: int | None = None
        self._closed = False
        self._owner_ids = (confinement.host_uid, confinement.host_uid) if confinement.host_uid is not None else None
        self._opt: list[tuple[str, str | None]] = []  # host /opt entries (name, link target or None)
        self._passwd = False  # an /etc/passwd naming SANDBOX_UID is bound over the host's

    @classmethod
    async def create(cls, limits: SandboxLimits, image: str | None = None) -> LocalSandbox:
        _bwrap()
        await asyncio.to_thread(dirs.first_start)
        kind = cf.pick_kind()
        from jaxrl_term.sandbox import toolkit

        try:
            kit = toolkit.ensure_host_dir()
        except toolkit.ToolkitError as e:
            raise SandboxError(str(e)) from e
        name, root, uid = dirs.claim()
        dirs.OWN.add(root)
        try:
            conf = cf.Confinement.plan(kind, name, limits.pids, limits.memory_mb, uid)
            dirs.write_record(root, conf)
            sb = cls(limits, root, conf)
            await asyncio.to_thread(sb._prepare, kit)
        except BaseException:
            dirs.OWN.discard(root)
            dirs.destroy(root)
            raise
        try:
            if not _BWRAP.get("probed"):
                await sb._probe()
                _BWRAP["probed"] = True
            sb.shell = sb._make_shell()
            await sb.shell.start()
        except BaseException:
            await sb.close()
            raise
        return sb

    def _prepare(self, kit: Path) -> None:
        self.confine.apply()
        for d in (self.work, self.tmp, *(h for _, h in self._extra_binds())):
            d.mkdir()
            if self._owner_ids:
                os.chown(d, *self._owner_ids)
        self.tmp.chmod(0o1777)
        (self.root / "kit").mkdir()
        for f in kit.iterdir():
            shutil.copy2(f, self.root / "kit" / f.name)  # a copy: /root (the toolkit's cache) is closed to the uid
        self._opt = [(e.name, os.readlink(e.path) if e.is_symlink() else None) for e in os.scandir("/opt")
                     if e.name != "jaxrl"] if os.path.isdir("/opt") else []
        try:
            import pwd

            pwd.getpwuid(SANDBOX_UID)
        except KeyError:  # give the agent's uid a name and a home (some tools ask)
            entry = f"sandbox:x:{SANDBOX_UID}:{SANDBOX_UID}:sandbox:{self.limits.workdir}:/bin/bash\n"
            for f, line in (("passwd", entry), ("group", f"sandbox:x:{SANDBOX_UID}:\n")):
                host = Path("/etc") / f
                (self.root / f).write_text((host.read_text() if host.exists() else "") + line)
            self._passwd = True

    def _make_shell(self) -> PersistentShell:
        hooks = {"recover": self._recover, "pid_pressure": self.confine.pressure(), "kill_tree": self._kill_tree}
        accepted = inspect.signature(PersistentShell.__init__).parameters  # hooks of the shell's own version
        return PersistentShell(self._spawn, self._signal_command, workdir=self.limits.workdir,
                               max_output_bytes=self.limits.max_output_bytes, env=dict(self.limits.env),
                               **{k: v for k, v in hooks.items() if k in accepted})

    async def _probe(self) -> None:
        """Start one sandbox process to turn bwrap's failures (user namespaces refused) into a clear error."""
        proc = await asyncio.create_subprocess_exec(
            *self.confine.exec_prefix(), *self._argv(["true"], uid=SANDBOX_UID),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
            start_new_session=True, env=self._host_env())
        _, err = await proc.communicate()
        if proc.returncode != 0:
            msg = err.decode(errors="replace").strip()
            userns = ("namespace", "uid map", "setting up uid", "Operation not permitted")
            hint = USERNS_HINT if any(w in msg for w in userns) and "jaxrl_term confine:" not in msg else ""
            raise SandboxError(f"bubblewrap could not start the local sandbox: {msg}" + (f" ({hint})" if hint else ""))

    def _host_env(self) -> dict[str, str]:
        """The spawn hop's environment. It passes PATH alone on to bwrap (which passes its environment on: none
        of the host's variables reach the agent); the hop's own interpreter may need the loader's path."""
        env = {"PATH": CLEAN_PATH}
        if os.environ.get("LD_LIBRARY_PATH"):
            env["LD_LIBRARY_PATH"] = os.environ["LD_LIBRARY_PATH"]
        return env

    def _argv(self, command: list[str], *, uid: int, workdir: str | None = None,
              env: dict[str, str] | None = None, as_pid_1: bool = False) -> list[str]:
        wd = self.limits.workdir
        path, disable_userns = _bwrap()
        # as_pid_1 (the shell): no bwrap reaper as pid 1, which would hold the shell's pipes open where the agent
        # could read them (/proc/1/fd/0); the non-dumpable shell is pid 1 and reaps orphans itself
        argv = [path, *(["--as-pid-1"] if as_pid_1 else []), "--unshare-user", "--uid", str(uid), "--gid", str(uid), "--cap-drop", "ALL",
                "--die-with-parent", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
                "--hostname", "sandbox"]
        if disable_userns:
            argv.append("--disable-userns")
        if not self.limits.network:
            argv.append("--unshare-net")
        for d in RO_BINDS:
            if os.path.isdir(d):
                argv += ["--ro-bind", d, d]
        if self._passwd:
            argv += ["--ro-bind", str(self.root / "passwd"), "/etc/passwd",
                     "--ro-bind", str(self.root / "group"), "/etc/group"]
        for d in ("bin", "sbin", "lib", "lib64", "lib32"):
            host = Path("/") / d
            if host.is_symlink():
                argv += ["--symlink", os.readlink(host), f"/{d}"]
            elif host.is_dir():
                argv += ["--ro-bind", str(host), f"/{d}"]
        # /opt: the host's entries read-only (links stay links) and the toolkit; a tmpfs under them, then read-only
        argv += ["--tmpfs", "/opt"]
        for entry, link in self._opt:
            argv += ["--symlink", link, f"/opt/{entry}"] if link is not None else \
                ["--ro-bind", f"/opt/{entry}", f"/opt/{entry}"]
        argv += ["--ro-bind", str(self.root / "kit"), "/opt/jaxrl", "--remount-ro", "/opt"]
        argv += ["--proc", "/proc", "--dev", "/dev", "--bind", str(self.tmp), "/tmp", "--bind", str(self.work), wd]
        for inside, host in self._extra_binds():
            argv += ["--bind", str(host), inside]
        argv += ["--remount-ro", "/", "--chdir", workdir or wd, "--setenv", "HOME", wd, "--setenv", "PATH", CLEAN_PATH]
        for k, v in (env or {}).items():
            argv += ["--setenv", k, v]
        return argv + ["--", *command]

    def _extra_binds(self) -> list[tuple[str, Path]]:
        """Private writable /tests, /logs and /solution (the verifier's and the oracle's places)."""
        return [(inside, self.root / inside.strip("/")) for inside in EXTRA_DIRS]

    def _writable(self) -> list[tuple[str, Path]]:
        return [(self.limits.workdir, self.work), ("/tmp", self.tmp), *self._extra_binds()]

    # -- processes --------------------------------------------------------------------------------
    async def _spawn(self) -> ProcessTransport:
        from jaxrl_term.sandbox import shell as shell_mod
        from jaxrl_term.sandbox import toolkit

        argv = list(getattr(shell_mod, "SHELL_ARGV", ["bash", "--noprofile", "--norc"]))
        ours, theirs = socket.socketpair()
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.confine.exec_prefix(), *self._argv(argv, uid=SANDBOX_UID, env={"LD_PRELOAD": toolkit.NODUMP},
                                                         as_pid_1=True), stdin=theirs,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                start_new_session=True, env=self._host_env())
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.shutdown(socket.SHUT_RD)  # the shell's stdin only: nothing comes back this way
        _, writer = await asyncio.open_connection(sock=ours)
        self._bwrap_pid = proc.pid
        return ProcessTransport(proc, writer)

    async def exec(self, argv: list[str], timeout_s: float = 60.0, *, env: dict[str, str] | None = None,
                   workdir: str | None = None, stdin: bytes | None = None) -> CommandResult:
        """A second bubblewrap over the same directories, outside the agent's shell: uid 0 of its own user namespace
        (the same host uid as the agent's, no capabilities), in the sandbox's limits."""
        t0 = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *self.confine.exec_prefix(), *self._argv(argv, uid=0, workdir=workdir, env=env),
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            start_new_session=True, env=self._host_env())
        cap = OutputCapture(self.limits.max_output_bytes)
        timed_out = False

        async def feed():
            assert proc.stdin is not None
            try:
                proc.stdin.write(stdin)
                await proc.stdin.drain()
                proc.stdin.close()
            except (BrokenPipeError, ConnectionResetError):
                pass

        async def pump():
            assert proc.stdout is not None
            while chunk := await proc.stdout.read(65536):
                cap.add(chunk)
            return await proc.wait()

        feeder = asyncio.create_task(feed()) if stdin is not None else None
        try:
            async with asyncio.timeout(timeout_s):  # not wait_for: on 3.11 it can swallow a cancellation
                code = await pump()
        except TimeoutError:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # bwrap; --die-with-parent takes its pid namespace along
            except ProcessLookupError:
                pass
            code = await proc.wait()
        finally:
            if feeder is not None:
                feeder.cancel()
        return CommandResult(cap.text(), code, timed_out, cap.truncated, time.monotonic() - t0)

    async def _signal_command(self, shell_pid: int, start: tuple[int, int], sig: str) -> None:
        """The rule of ``shell.KILL_SCRIPT``, applied from the host to the bwrap process's descendants
        (the shell's ``$$`` is a pid-namespace pid; /proc's NSpid maps it)."""
        if self._bwrap_pid is None:
            return
        tree = _descendants(self._bwrap_pid)
        shell = next((pid for pid, (_, _, ns) in tree.items() if ns == shell_pid), None)
        if shell is None:
            return
        t0, last = start
        shell_pgrp = tree[shell][0]

        def is_new(tick: int, ns: int) -> bool:
            return ns > last or tick > t0

        old = {pgrp for pgrp, tick, ns in tree.values() if not is_new(tick, ns)}
        passes = [signal.SIGINT] if sig == "INT" else [signal.SIGSTOP, signal.SIGKILL, signal.SIGKILL]
        for signum in passes:
            for pid, (pgrp, tick, ns) in _descendants(self._bwrap_pid).items():
                if pid == shell or not is_new(tick, ns) or (pgrp != shell_pgrp and pgrp in old):
                    continue
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass

    async def _kill_tree(self, shell_pid: int | None = None) -> None:
        """Kill the shell's whole pid namespace (its bwrap; the namespace dies with its init)."""
        if self._bwrap_pid is not None:
            for pid in [self._bwrap_pid, *_descendants(self._bwrap_pid)]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    async def _recover(self) -> None:
        """Before a shell restart that failed (e.g. every pid taken): kill every process of the sandbox."""
        if not await asyncio.to_thread(self.confine.kill_all):
            raise SandboxLost("the sandbox's processes could not be killed")

    async def kill_all(self) -> None:
        """Kill every process of the sandbox (the shell's, and any exec's); the shell restarts on the next run."""
        if self.shell is not None:
            await self.shell.close()
        await self._recover()

    async def changes(self) -> list[tuple[str, str]]:
        """Everything in the writable directories (they start empty; the rest of the filesystem is read-only):
        ("C", mount point) when it has content, ("A", path) for each entry."""
        out: list[tuple[str, str]] = []
        for inside, host in self._writable():
            found = await asyncio.to_thread(beneath.listing, host)
            if found:
                out += [("C", inside), *(("A", posixpath.join(inside, rel)) for rel in found)]
        return out

    async def processes(self) -> list[tuple[int, int, str]]:
        """(pid, ppid, command) of every process of the sandbox's confinement (its cgroup or its uid)."""
        def read() -> list[tuple[int, int, str]]:
            out = []
            for pid in self.confine.members():
                try:
                    line = Path(f"/proc/{pid}/stat").read_text()
                except OSError:
                    continue
                out.append((pid, int(line.rsplit(")", 1)[1].split()[1]), line[line.index("(") + 1:line.rindex(")")]))
            return out

        return await asyncio.to_thread(read)

    async def stat_paths(self, paths) -> dict[str, Stat | None]:
        """What each path under the writable directories is (no link followed), None when absent or elsewhere."""
        def one(path: str):
            where = self._locate(path)
            if where is None:
                return None
            host, parts = where
            try:
                st = os.lstat(host.joinpath(*parts))
            except OSError:
                return None
            kind = "dir" if stat.S_ISDIR(st.st_mode) else "link" if stat.S_ISLNK(st.st_mode) else \
                "file" if stat.S_ISREG(st.st_mode) else "other"
            target = os.readlink(host.joinpath(*parts)) if kind == "link" else ""
            return Stat(kind, st.st_mode & 0o777, target, st.st_size)

        return await asyncio.to_thread(lambda: {p: one(p) for p in paths})

    async def image_stat_paths(self, paths) -> dict[str, Stat | None]:
        """The writable directories start empty and the rest cannot change: nothing was there in the "image"."""
        return {p: None for p in paths}

    # -- files ------------------------------------------------------------------------------------
    def _locate(self, path: str) -> tuple[Path, list[str]] | None:
        """(host dir, components) for a path under a writable directory, else None (``..`` resolved lexically:
        it cannot climb out of the sandbox's own root)."""
        p = "/" + posixpath.normpath(posixpath.join(self.limits.workdir, path)).lstrip("/")
        for inside, host in sorted(self._writable(), key=lambda x: -len(x[0])):
            if p == inside or p.startswith(inside.rstrip("/") + "/"):
                rel = posixpath.relpath(p, inside)
                return host, ([] if rel == "." else rel.split("/"))
        return None

    def _writable_target(self, path: str) -> tuple[Path, list[str]]:
        where = self._locate(path)
        if where is None:
            raise SandboxError(f"{path}: the local sandbox can only write under "
                               f"{', '.join(i for i, _ in self._writable())}")
        return where

    async def _read_inside(self, path: str) -> bytes:
        """A file outside the writable directories, read by ``cat`` in the sandbox as the agent."""
        proc = await asyncio.create_subprocess_exec(
            *self.confine.exec_prefix(), *self._argv(["cat", "--", path], uid=SANDBOX_UID),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True, env=self._host_env())
        out, err = await proc.communicate()
        if proc.returncode != 0:
            msg = err.decode(errors="replace").strip()
            raise SandboxError(f"read_file {path}: " + ("no such file" if "No such file" in msg else msg))
        return out

    # -- protocol ---------------------------------------------------------------------------------
    async def run(self, command: str, timeout_s: float = 30.0) -> CommandResult:
        assert self.shell is not None
        return await self.shell.run(command, timeout_s)

    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        host, parts = self._writable_target(path)
        await asyncio.to_thread(beneath.write, host, parts, data, mode, path, self._owner_ids)

    async def read_file(self, path: str) -> bytes:
        where = self._locate(path)
        if where is None:
            return await self._read_inside(path)
        return await asyncio.to_thread(beneath.read, *where, path)

    async def upload_dir(self, local_dir: str | os.PathLike, remote_dir: str) -> None:
        local_dir = Path(local_dir)
        if not local_dir.is_dir():
            raise SandboxError(f"upload_dir: {local_dir} is not a directory")
        host, parts = self._writable_target(remote_dir)
        await asyncio.to_thread(beneath.upload, local_dir, host, parts, remote_dir, self._owner_ids)

    async def set_network(self, online: bool) -> None:
        """The local sandbox's network namespace is fixed at start: host network or loopback only."""
        if online != self.limits.network:
            raise SandboxError(f"the local backend cannot {'give' if online else 'take away'} network between "
                               "phases (its network namespace is fixed at start); use sandbox=docker for a task "
                               "whose agent and verifier phases differ in network")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.shell is not None:
            await self.shell.close()
        await asyncio.to_thread(dirs.destroy, self.root)
        dirs.OWN.discard(self.root)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m jaxrl_term.sandbox.local")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("reap", help="remove local sandboxes left behind by dead runs")
    r.add_argument("--all", action="store_true", help="every local sandbox of this user, live owners' too")
    r.add_argument("--run", help="one run's sandboxes (its run id)")
    args = ap.parse_args(argv)
    print(f"removed {dirs.reap(all_runs=args.all, run_id=args.run)} local sandboxes")


if __name__ == "__main__":
    main()
