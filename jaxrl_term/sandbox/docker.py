"""Docker backend: one container per trajectory, a persistent shell over the exec socket.

Containers start with no network by default, CPU / memory (no swap) / pid limits, a working dir and labels
(``jaxrl_term.run``, ``jaxrl_term.trajectory``, plus the owning host and pid). ``reap`` removes containers
whose owning process is gone (a crashed or SIGKILLed run) and is called on start-up; ``close`` removes the
container and its anonymous volumes. Blocking SDK calls run in a thread pool sized for hundreds of sandboxes.

CLI: ``python -m jaxrl_term.sandbox.docker reap [--all]``
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import functools
import io
import logging
import os
import posixpath
import socket
import struct
import tarfile
import uuid
from pathlib import Path

from jaxrl_term.sandbox.base import CommandResult, SandboxError, SandboxLimits, tar_directory
from jaxrl_term.sandbox.shell import PersistentShell, kill_command

log = logging.getLogger(__name__)

LABEL_RUN = "jaxrl_term.run"
LABEL_TRAJ = "jaxrl_term.trajectory"
LABEL_HOST = "jaxrl_term.host"
LABEL_PID = "jaxrl_term.pid"
RUN_ID = os.environ.get("JAXRL_TERM_RUN_ID") or f"run-{uuid.uuid4().hex[:12]}"

_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="jaxrl-docker")


@functools.lru_cache(maxsize=1)
def client():
    import docker

    return docker.from_env(timeout=300, max_pool_size=128)


async def _call(fn, *args, **kwargs):
    return await asyncio.get_running_loop().run_in_executor(_POOL, functools.partial(fn, *args, **kwargs))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap(*, all_runs: bool = False, run_id: str | None = None) -> int:
    """Remove labelled containers left behind. By default those whose owning process on this host is dead;
    ``run_id`` removes one run's; ``all_runs`` every jaxrl_term container. Returns how many were removed."""
    filters = {"label": [LABEL_RUN if run_id is None else f"{LABEL_RUN}={run_id}"]}
    removed = 0
    host = socket.gethostname()
    for c in client().containers.list(all=True, filters=filters):
        labels = c.labels or {}
        if not all_runs and run_id is None:
            if labels.get(LABEL_HOST) != host:
                continue
            try:
                if _pid_alive(int(labels.get(LABEL_PID, "0"))):
                    continue
            except ValueError:
                pass
        try:
            c.remove(force=True, v=True)
            removed += 1
        except Exception as e:  # noqa: BLE001 - already gone, or being removed by someone else
            log.debug("reap %s: %s", c.short_id, e)
    if removed:
        log.info("reaped %d leftover sandbox containers", removed)
    return removed


_reaped_at_startup = False


def docker_errors():
    import docker

    return docker.errors


class DockerExecTransport:
    """The exec socket of ``bash`` in a container, demultiplexed (stdout and stderr frames, in order)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, sock, exec_id: str):
        self.reader, self.writer, self._sock, self.exec_id = reader, writer, sock, exec_id
        self._pending = b""

    @classmethod
    async def open(cls, container_id: str, workdir: str | None, env: dict[str, str]):
        api = client().api
        exec_id = (await _call(
            api.exec_create, container_id, ["bash", "--noprofile", "--norc"], stdin=True, stdout=True,
            stderr=True, tty=False, workdir=workdir, environment=env or None,
        ))["Id"]
        sock = await _call(api.exec_start, exec_id, socket=True)
        raw = getattr(sock, "_sock", sock)
        raw.setblocking(False)
        reader, writer = await asyncio.open_connection(sock=raw)
        return cls(reader, writer, sock, exec_id)

    async def write(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def read(self) -> bytes:
        # Frame: 1 byte stream type, 3 zero bytes, 4 bytes big-endian length, then the payload.
        try:
            header = await self.reader.readexactly(8)
        except asyncio.IncompleteReadError:
            return b""
        _, size = struct.unpack(">BxxxL", header)
        try:
            return await self.reader.readexactly(size)
        except asyncio.IncompleteReadError as e:
            return e.partial

    async def close(self) -> None:
        try:
            self.writer.close()
        except Exception:  # noqa: BLE001 - closing a dead socket
            pass
        try:
            self._sock.close()
        except Exception:  # noqa: BLE001
            pass


class DockerSandbox:
    def __init__(self, container, limits: SandboxLimits, shell: PersistentShell):
        self.container, self.limits, self.shell = container, limits, shell
        self._closed = False

    @property
    def id(self) -> str:
        return self.container.id

    @classmethod
    async def create(cls, image: str, limits: SandboxLimits, *, labels: dict[str, str] | None = None) -> DockerSandbox:
        global _reaped_at_startup
        if not _reaped_at_startup:
            _reaped_at_startup = True
            await _call(reap)
        all_labels = {
            LABEL_RUN: RUN_ID,
            LABEL_TRAJ: uuid.uuid4().hex[:16],
            LABEL_HOST: socket.gethostname(),
            LABEL_PID: str(os.getpid()),
            **(labels or {}),
        }
        import docker

        try:
            await _call(client().images.get, image)  # never pull: no registry is assumed
        except docker.errors.ImageNotFound as e:
            raise SandboxError(f"image {image!r} not found locally; build it first (jaxrl_term.sandbox.images)") from e
        try:
            container = await _call(
                client().containers.run,
                image,
                ["tail", "-f", "/dev/null"],
                detach=True,
                init=True,
                network_mode="bridge" if limits.network else "none",
                nano_cpus=int(limits.cpus * 1e9),
                mem_limit=f"{limits.memory_mb}m",
                memswap_limit=f"{limits.memory_mb}m",
                pids_limit=limits.pids,
                working_dir=limits.workdir,
                labels=all_labels,
                environment=dict(limits.env) or None,
            )
        except docker.errors.APIError as e:
            raise SandboxError(f"cannot start a container from {image!r}: {e.explanation or e}") from e

        async def spawn():
            return await DockerExecTransport.open(container.id, limits.workdir, dict(limits.env))

        async def signal_command(shell_pid: int, start: tuple[int, int], sig: str) -> None:
            # Retried: with every pid taken (a fork bomb) the exec itself may fail to start at first.
            for attempt in range(5):
                try:
                    res = await _call(container.exec_run, kill_command(shell_pid, start, sig), user="root")
                    if res.exit_code == 0:
                        return
                except docker_errors().APIError:
                    pass
                await asyncio.sleep(0.1 * (attempt + 1))

        async def recover() -> None:
            log.warning("sandbox %s: restarting the container (its processes are killed, files kept)",
                        container.short_id)
            await _call(container.restart, timeout=0)

        shell = PersistentShell(spawn, signal_command, workdir=limits.workdir, max_output_bytes=limits.max_output_bytes,
                                recover=recover)
        sb = cls(container, limits, shell)
        try:
            await shell.start()
        except BaseException:
            await sb.close()
            raise
        return sb

    # -- protocol ---------------------------------------------------------------------------------
    async def run(self, command: str, timeout_s: float = 30.0) -> CommandResult:
        return await self.shell.run(command, timeout_s)

    async def exec(self, argv: list[str], timeout_s: float = 60.0, *, env: dict[str, str] | None = None,
                   workdir: str | None = None) -> CommandResult:
        import time as _time

        from jaxrl_term.sandbox.base import CLEAN_PATH
        from jaxrl_term.sandbox.shell import OutputCapture

        t0 = _time.monotonic()
        # coreutils `timeout` inside the container: TERM at the deadline, KILL 2 s later, exit status 124.
        wrapped = ["timeout", "-k", "2", f"{timeout_s:.3f}", *argv]
        environment = {"PATH": CLEAN_PATH, **(env or {})}
        res = await _call(self.container.exec_run, wrapped, environment=environment,
                          workdir=workdir or self.limits.workdir, user="root", demux=False)
        cap = OutputCapture(self.limits.max_output_bytes)
        cap.add(res.output or b"")
        code = res.exit_code
        timed_out = code in (124, 137) and _time.monotonic() - t0 >= timeout_s * 0.99
        return CommandResult(cap.text(), code, timed_out, cap.truncated, _time.monotonic() - t0)

    def _abs(self, path: str) -> str:
        return path if path.startswith("/") else posixpath.join(self.limits.workdir, path)

    async def _mkdir(self, path: str) -> None:
        res = await _call(self.container.exec_run, ["mkdir", "-p", path], user="root")
        if res.exit_code != 0:
            raise SandboxError(f"mkdir -p {path}: {res.output.decode(errors='replace').strip()}")

    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        path = self._abs(path)
        parent, name = posixpath.split(path)
        await self._mkdir(parent)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), mode
            tar.addfile(info, io.BytesIO(data))
        if not await _call(self.container.put_archive, parent, buf.getvalue()):
            raise SandboxError(f"write_file {path}: the archive upload was refused")

    async def read_file(self, path: str) -> bytes:
        import docker

        path = self._abs(path)
        try:
            stream, stat = await _call(self.container.get_archive, path)
            data = await _call(lambda: b"".join(stream))
        except docker.errors.NotFound as e:
            raise SandboxError(f"read_file {path}: no such file") from e
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            member = tar.next()
            if member is None or not member.isfile():
                raise SandboxError(f"read_file {path}: not a regular file")
            f = tar.extractfile(member)
            assert f is not None
            return f.read()

    async def upload_dir(self, local_dir: str | os.PathLike, remote_dir: str) -> None:
        remote_dir = self._abs(remote_dir)
        await self._mkdir(remote_dir)
        data = tar_directory(Path(local_dir))
        if not await _call(self.container.put_archive, remote_dir, data):
            raise SandboxError(f"upload_dir {local_dir} -> {remote_dir}: the archive upload was refused")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self.shell.close()
        try:
            await _call(self.container.remove, force=True, v=True)
        except Exception as e:  # noqa: BLE001 - already removed (e.g. by the reaper); nothing else to free
            log.debug("remove %s: %s", self.container.short_id, e)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxrl_term.sandbox.docker")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("reap", help="remove sandbox containers left behind by dead runs")
    r.add_argument("--all", action="store_true", help="remove every jaxrl_term container, live runs included")
    r.add_argument("--run", default=None, help="remove one run's containers")
    args = ap.parse_args(argv)
    n = reap(all_runs=args.all, run_id=args.run)
    print(f"removed {n} container(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
