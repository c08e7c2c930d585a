"""Local backend: the sandbox protocol with bubblewrap, for machines without Docker.

Isolation is clearly weaker than a container, and it is the host's own system:

- the host's ``/usr`` (and ``/etc``, ``/opt``) bound read-only; the task's Dockerfile is *not* applied,
  so tasks that need packages the host lacks will fail here;
- a private writable work dir (``limits.workdir``, default ``/app``), ``/tmp``, and ``/tests``, ``/logs``,
  ``/solution`` for the verifier and oracle: host directories removed on ``close``; the rest is read-only;
- new network (loopback only, ``--unshare-net``), pid, ipc and uts namespaces, ``--die-with-parent``;
- memory is capped per process by ``RLIMIT_AS`` (an allocation fails instead of an OOM kill); there is no
  CPU quota and no pid limit (``RLIMIT_NPROC`` counts the host user's processes, unusable as root).
"""

from __future__ import annotations

import asyncio
import os
import posixpath
import resource
import shutil
import signal
import tempfile
from pathlib import Path

from jaxrl_term.sandbox.base import CLEAN_PATH, CommandResult, SandboxError, SandboxLimits
from jaxrl_term.sandbox.shell import PersistentShell

RO_BINDS = ("/usr", "/etc", "/opt")


class ProcessTransport:
    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc

    async def write(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(data)
        await self.proc.stdin.drain()

    async def read(self) -> bytes:
        assert self.proc.stdout is not None
        return await self.proc.stdout.read(65536)

    async def close(self) -> None:
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


class LocalSandbox:
    def __init__(self, limits: SandboxLimits, root: Path):
        self.limits, self.root = limits, root
        self.work, self.tmp = root / "work", root / "tmp"
        self.shell: PersistentShell | None = None
        self._bwrap_pid: int | None = None
        self._closed = False

    @classmethod
    async def create(cls, limits: SandboxLimits, image: str | None = None) -> LocalSandbox:
        if shutil.which("bwrap") is None:
            raise SandboxError("the local sandbox needs bubblewrap: apt-get install bubblewrap")
        root = Path(tempfile.mkdtemp(prefix="jaxrl-local-"))
        sb = cls(limits, root)
        sb.work.mkdir()
        sb.tmp.mkdir()
        sb.tmp.chmod(0o1777)
        for _, host in sb._extra_binds():
            host.mkdir()
        sb.shell = PersistentShell(sb._spawn, sb._signal_command, workdir=limits.workdir,
                                   max_output_bytes=limits.max_output_bytes, env=dict(limits.env))
        try:
            await sb.shell.start()
        except BaseException:
            await sb.close()
            raise
        return sb

    def _argv(self, command: list[str] | None = None, workdir: str | None = None) -> list[str]:
        wd = self.limits.workdir
        argv = ["bwrap", "--die-with-parent", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
                "--hostname", "sandbox"]
        if not self.limits.network:
            argv.append("--unshare-net")
        for d in RO_BINDS:
            if os.path.isdir(d):
                argv += ["--ro-bind", d, d]
        for d in ("bin", "sbin", "lib", "lib64", "lib32"):
            host = Path("/") / d
            if host.is_symlink():
                argv += ["--symlink", os.readlink(host), f"/{d}"]
            elif host.is_dir():
                argv += ["--ro-bind", str(host), f"/{d}"]
        argv += ["--proc", "/proc", "--dev", "/dev", "--bind", str(self.tmp), "/tmp", "--bind", str(self.work), wd]
        for inside, host in self._extra_binds():
            argv += ["--bind", str(host), inside]
        argv += ["--chdir", workdir or wd, "--setenv", "HOME", wd, "--setenv", "PATH", CLEAN_PATH]
        return argv + (command or ["bash", "--noprofile", "--norc"])

    def _extra_binds(self) -> list[tuple[str, Path]]:
        """Private writable /tests, /logs and /solution (the verifier's and the oracle's places)."""
        return [(inside, self.root / inside.strip("/")) for inside in ("/tests", "/logs", "/solution")]

    async def exec(self, argv: list[str], timeout_s: float = 60.0, *, env: dict[str, str] | None = None,
                   workdir: str | None = None) -> CommandResult:
        """A second bwrap over the same private dirs, outside the agent's shell."""
        import time as _time

        from jaxrl_term.sandbox.shell import OutputCapture

        t0 = _time.monotonic()
        cmd = self._argv(argv, workdir)
        for k, v in (env or {}).items():
            cmd[-len(argv):-len(argv)] = ["--setenv", k, v]
        proc = await asyncio.create_subprocess_exec(*cmd, stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                                                    start_new_session=True)
        cap = OutputCapture(self.limits.max_output_bytes)
        timed_out = False

        async def pump():
            assert proc.stdout is not None
            while chunk := await proc.stdout.read(65536):
                cap.add(chunk)
            return await proc.wait()

        try:
            code = await asyncio.wait_for(pump(), timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            code = await proc.wait()
        return CommandResult(cap.text(), code, timed_out, cap.truncated, _time.monotonic() - t0)

    async def _spawn(self) -> ProcessTransport:
        mem = self.limits.memory_mb * 1024 * 1024

        def limit():
            resource.setrlimit(resource.RLIMIT_AS, (mem, mem))

        proc = await asyncio.create_subprocess_exec(
            *self._argv(), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, preexec_fn=limit, start_new_session=True,
        )
        self._bwrap_pid = proc.pid
        return ProcessTransport(proc)

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

    # -- paths ------------------------------------------------------------------------------------
    def _host_path(self, path: str, *, write: bool) -> Path:
        wd = self.limits.workdir
        p = posixpath.normpath(path if path.startswith("/") else posixpath.join(wd, path))
        for inside, host in ((wd, self.work), ("/tmp", self.tmp), *self._extra_binds()):
            if p == inside or p.startswith(inside.rstrip("/") + "/"):
                return host / posixpath.relpath(p, inside)
        if not write and any(p == d or p.startswith(d + "/") for d in RO_BINDS):
            return Path(p)
        raise SandboxError(
            f"{path}: the local sandbox can only {'write' if write else 'read'} under {wd}, /tmp, /tests, /logs"
            " and /solution"
            + ("" if write else f" (and read {', '.join(RO_BINDS)})")
        )

    # -- protocol ---------------------------------------------------------------------------------
    async def run(self, command: str, timeout_s: float = 30.0) -> CommandResult:
        assert self.shell is not None
        return await self.shell.run(command, timeout_s)

    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        host = self._host_path(path, write=True)
        host.parent.mkdir(parents=True, exist_ok=True)
        host.write_bytes(data)
        host.chmod(mode)

    async def read_file(self, path: str) -> bytes:
        host = self._host_path(path, write=False)
        if not host.is_file():
            raise SandboxError(f"read_file {path}: no such file")
        return host.read_bytes()

    async def upload_dir(self, local_dir: str | os.PathLike, remote_dir: str) -> None:
        local_dir = Path(local_dir)
        if not local_dir.is_dir():
            raise SandboxError(f"upload_dir: {local_dir} is not a directory")
        dest = self._host_path(remote_dir, write=True)
        shutil.copytree(local_dir, dest, dirs_exist_ok=True, symlinks=True)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.shell is not None:
            await self.shell.close()
        shutil.rmtree(self.root, ignore_errors=True)
