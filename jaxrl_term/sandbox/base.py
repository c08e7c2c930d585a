"""The sandbox protocol every backend implements, and ``open_sandbox`` to get one.

Async throughout: hundreds of sandboxes run concurrently from one event loop. A sandbox is cattle: one per
trajectory, created from an image, removed (with its volumes) on ``close``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Protocol, runtime_checkable


class SandboxError(RuntimeError):
    """The sandbox itself failed (could not start, lost its shell, file transfer failed)."""


class SandboxLost(SandboxError):
    """The sandbox cannot be used any more (its shell cannot be restarted, its container is gone).
    ``engine_down``: its Docker engine stopped answering too (infrastructure: nothing the agent did)."""

    engine_down: bool = False


@dataclasses.dataclass(frozen=True)
class CommandResult:
    output: str  # stdout and stderr merged in order; head + tail when truncated
    exit_code: int | None  # None when the shell was lost before reporting a status
    timed_out: bool
    truncated: bool
    duration_s: float
    shell_restarted: bool = False  # the shell had to be replaced: variables and functions are gone


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    cpus: float = 1.0
    memory_mb: int = 2048
    pids: int = 512
    network: bool = False  # attached to ``public_network`` (``Sandbox.set_network`` changes it per phase)
    public_network: str = "jaxrl-public"  # the Docker network "public" means (one with the egress the run allows)
    task_network: str | None = None  # a compose environment's network, joined as service "main"
    workdir: str = "/app"
    max_output_bytes: int = 32768  # per command, head + tail
    env: tuple[tuple[str, str], ...] = ()
    disk_gb: float | None = None  # writable layer quota (Docker storage drivers that support it)


@dataclasses.dataclass(frozen=True)
class Stat:
    """What a path is: ``kind`` dir / file / link / other, permission bits, a link's target (as the engine resolves
    it), size."""

    kind: str
    mode: int
    target: str = ""
    size: int = 0

    @classmethod
    def from_engine(cls, raw: dict) -> Stat:
        m = int(raw.get("mode", 0))  # Go's os.FileMode: type bits high, permission bits low
        special = (1 << 26) | (1 << 25) | (1 << 24) | (1 << 21) | (1 << 19)  # device, pipe, socket, char, irregular
        kind = "dir" if m & (1 << 31) else "link" if m & (1 << 27) else "other" if m & special else "file"
        return cls(kind, m & 0o777, raw.get("linkTarget") or "", int(raw.get("size", 0)))

    @property
    def executable(self) -> bool:
        return self.kind == "file" and bool(self.mode & 0o111)


CLEAN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@runtime_checkable
class Sandbox(Protocol):
    async def run(self, command: str, timeout_s: float = 30.0) -> CommandResult: ...
    async def exec(self, argv: list[str], timeout_s: float = 60.0, *, env: dict[str, str] | None = None,
                   workdir: str | None = None, stdin: bytes | None = None) -> CommandResult:
        """A fresh process as root, outside the agent's shell (none of its functions, aliases or variables):
        what the verifier and set-up steps use. ``stdin``: bytes fed to the process (then EOF)."""
        ...
    async def kill_all(self) -> None:
        """Kill every process the agent could have started (everything but the sandbox's own keep-alive); the
        persistent shell starts again on the next ``run``. Files are kept."""
        ...
    async def changes(self) -> list[tuple[str, str]]:
        """Filesystem changes since the sandbox was created: (kind, path), kind in A (added), C (changed),
        D (deleted). Paths the backend mounts read-only cannot change and are not listed."""
        ...
    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None: ...
    async def read_file(self, path: str) -> bytes: ...
    async def upload_dir(self, local_dir: str | os.PathLike, remote_dir: str) -> None: ...
    async def close(self) -> None: ...
    async def set_network(self, online: bool) -> None:
        """Attach (``True``) or detach the public network for the next phase; a compose environment's own network
        stays. Backends that cannot change it raise ``SandboxError`` when asked for a change."""
        ...


BACKENDS = ("docker", "local")


_FORCED_EXIT: list = []  # what a forced exit still runs: the backends' removal of this process's sandboxes


def on_forced_exit(fn) -> None:
    """Run ``fn`` (no arguments, best effort) when a second SIGTERM ends the process without unwinding."""
    if fn not in _FORCED_EXIT:
        _FORCED_EXIT.append(fn)


def unwind_on_sigterm() -> None:
    """Make SIGTERM unwind like Ctrl-C (KeyboardInterrupt in the main thread), so ``finally`` blocks and context
    managers run and sandboxes are removed; the default action would kill the process on the spot. Call it from
    entry points (train, eval, tasks check).

    A second SIGTERM ends the process at once (exit status 143): the unwinding can wait on what a signal cannot
    interrupt, e.g. a train step or an XLA compile on a worker thread (``asyncio.run`` joins its executor's
    threads, and so does the interpreter's exit). Before it exits, the backends remove this process's sandboxes
    (``on_forced_exit``); a training run resumes from its last checkpoint."""
    import signal
    import sys
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    received = []

    def handler(signum, frame):
        received.append(signum)
        if len(received) == 1:
            raise KeyboardInterrupt(f"signal {signum}")
        try:
            sys.stderr.write(f"[jaxrl_term] signal {signum} again: removing this process's sandboxes and exiting "
                             f"now, without waiting for running threads\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - a closed stderr must not stop the exit
            pass
        for fn in reversed(_FORCED_EXIT):
            try:
                fn()
            except BaseException:  # noqa: BLE001 - best effort: the next start-up's reap catches the rest
                pass
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


@contextlib.asynccontextmanager
async def open_sandbox(
    backend: str = "docker",
    image: str | None = None,
    *,
    labels: dict[str, str] | None = None,
    mounts: dict[str, str] | None = None,
    **limits,
) -> AsyncIterator[Sandbox]:
    """``async with open_sandbox("docker", "jaxrl-term/base:trixie", memory_mb=1024) as sb: ...``

    ``limits`` are ``SandboxLimits`` fields. ``mounts`` (Docker): named volumes mounted read-only, name -> path.
    The sandbox is closed (container removed) on exit, also on error or cancellation.
    """
    lim = SandboxLimits(**limits)
    if backend == "docker":
        from jaxrl_term.sandbox.docker import DockerSandbox

        if not image:
            raise SandboxError("the docker backend needs an image")
        sb: Sandbox = await DockerSandbox.create(image, lim, labels=labels, mounts=mounts)
    elif backend == "local":
        from jaxrl_term.sandbox.local import LocalSandbox

        sb = await LocalSandbox.create(lim, image=image)
    else:
        raise SandboxError(f"sandbox backend {backend!r}; use one of {BACKENDS}")
    try:
        yield sb
    finally:
        await sb.close()


def tar_directory(local_dir: str | os.PathLike, arcname: str = ".") -> bytes:
    """A tar archive of ``local_dir`` (modes kept, owner reset to root) for the archive APIs."""
    import io
    import tarfile

    local_dir = Path(local_dir)
    if not local_dir.is_dir():
        raise SandboxError(f"upload_dir: {local_dir} is not a directory")

    def reset(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        return info

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(str(local_dir), arcname=arcname, filter=reset)
    return buf.getvalue()


class SandboxPool:
    """Caps how many sandboxes exist at once; the rest wait in FIFO order.

    ``async with pool.sandbox(image) as sb`` blocks while ``max_concurrent`` are open. Counters tell how
    many are open, waiting, created and failed to start.
    """

    def __init__(self, backend: str = "docker", max_concurrent: int = 16, *, engines=None, **default_limits):
        import asyncio

        if max_concurrent < 1:
            raise ValueError("sandbox.max_concurrent must be >= 1")
        # the run's per-phase network overrides (tasks/env.py reads them); not sandbox limits themselves
        self.phase_overrides = {k: default_limits.pop(k) for k in ("agent_network", "verifier_network")
                                if k in default_limits}
        self.backend, self.max_concurrent, self.default_limits = backend, max_concurrent, default_limits
        self.engines = engines  # engines.EnginePool: sandboxes over several Docker engines (tasks/env.py places)
        self._sem = asyncio.Semaphore(max_concurrent)
        self.open = self.waiting = self.created = self.failed = 0

    @contextlib.asynccontextmanager
    async def slot(self):
        """Hold one of the ``max_concurrent`` places (``sandbox(..., slot_held=True)`` then opens in it): what a
        sandbox needs before it exists (a compose environment's services) is started inside the cap too."""
        self.waiting += 1
        try:
            await self._sem.acquire()
        finally:
            self.waiting -= 1
        try:
            yield
        finally:
            self._sem.release()

    @contextlib.asynccontextmanager
    async def sandbox(self, image: str | None = None, *, labels: dict[str, str] | None = None,
                      mounts: dict[str, str] | None = None, slot_held: bool = False, **limits):
        if not slot_held:
            self.waiting += 1
            try:
                await self._sem.acquire()
            finally:
                self.waiting -= 1
        try:
            try:
                cm = open_sandbox(self.backend, image, labels=labels, mounts=mounts,
                                  **{**self.default_limits, **limits})
                sb = await cm.__aenter__()
            except BaseException:
                self.failed += 1
                raise
            self.created += 1
            self.open += 1
            try:
                yield sb
            finally:
                self.open -= 1
                await cm.__aexit__(None, None, None)
        finally:
            if not slot_held:
                self._sem.release()
