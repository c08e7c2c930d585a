"""Docker backend: one container per trajectory, a persistent shell over the exec socket.

Containers start with no network by default, CPU / memory (no swap) / pid limits, capabilities the agent does not
need dropped (``NET_RAW``, ``MKNOD``, ``AUDIT_WRITE``, ``SETFCAP``; ``SYS_PTRACE`` and ``SYS_ADMIN`` are never in
Docker's default set), ``no-new-privileges``, a disk quota where the storage driver allows one
(``sandbox.disk_gb``), a working dir and labels. The sandbox toolkit (``toolkit.py``) is mounted read-only at
``/opt/jaxrl``: the container's main process is its static ``pause`` under docker-init, and the persistent shell
starts non-dumpable through its ``nodump.so``.

Reaping: every container carries its owner's identity: machine id, boot id, pid and the pid's start time (a
reused pid is not the owner), and the run id. ``reap`` removes the containers of owners that are gone (a
crashed or SIGKILLed run: any container of this machine from an earlier boot, or whose owner pid is dead or now a
different process) and is called on start-up; SIGTERM in the entry points unwinds like an exception, so
``close`` still removes the container and its anonymous volumes.

CLI: ``python -m jaxrl_term.sandbox.docker reap [--all] [--run RUN_ID]``
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import concurrent.futures
import contextlib
import contextvars
import functools
import io
import json
import logging
import os
import posixpath
import socket
import struct
import sys
import tarfile
import uuid
from pathlib import Path

from jaxrl_term.sandbox.base import CommandResult, SandboxError, SandboxLimits, Stat, on_forced_exit, tar_directory
from jaxrl_term.sandbox.confine import PidPressure
from jaxrl_term.sandbox.shell import PersistentShell, kill_command, kill_tree_command

log = logging.getLogger(__name__)

LABEL_RUN = "jaxrl_term.run"
LABEL_TRAJ = "jaxrl_term.trajectory"
LABEL_HOST = "jaxrl_term.host"  # informational: hostnames change; identity is machine id + boot id + pid + start
LABEL_MACHINE = "jaxrl_term.machine"
LABEL_BOOT = "jaxrl_term.boot"
LABEL_PID = "jaxrl_term.pid"
LABEL_PID_START = "jaxrl_term.pid_start"
RUN_ID = os.environ.get("JAXRL_TERM_RUN_ID") or f"run-{uuid.uuid4().hex[:12]}"
DROPPED_CAPS = ["NET_RAW", "MKNOD", "AUDIT_WRITE", "SETFCAP"]
ROOT = "0:0"  # the exec's user by number: no lookup in the agent's /etc/passwd
# The default "public" network: a bridge made on first use with inter-container traffic off (one sandbox cannot
# reach another's services); egress as the engine's host allows. Name your own with sandbox.public_network.
PUBLIC_NETWORK = "jaxrl-public"

_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="jaxrl-docker")


def _executor() -> concurrent.futures.Executor:
    """The threads for the current engine's blocking Docker calls (each engine of a pool has its own: calls
    stuck on a hung engine until the client's read timeout cannot take the threads the other engines need), else
    the default engine's."""
    from jaxrl_term.sandbox.engines import CURRENT

    engine = CURRENT.get()
    return engine.executor() if engine is not None else _POOL


def client():
    """The current engine's client (``engines.EnginePool.place`` sets it for a sandbox's life), else the
    default engine's (``DOCKER_HOST`` / the local socket)."""
    from jaxrl_term.sandbox.engines import CURRENT

    engine = CURRENT.get()
    return engine.client() if engine is not None else default_client()


@functools.lru_cache(maxsize=1)
def default_client():
    import docker

    return docker.from_env(timeout=300, max_pool_size=128)


async def _call(fn, *args, **kwargs):
    # in the caller's context: what runs in the thread sees the same current engine
    ctx = contextvars.copy_context()
    return await asyncio.get_running_loop().run_in_executor(_executor(), functools.partial(ctx.run, fn, *args,
                                                                                          **kwargs))


def _remove_when_created(create: concurrent.futures.Future) -> None:
    """Done-callback of a container create whose caller was cancelled: remove the container it made, if any. On
    the thread's future, not an asyncio one: it runs even when the event loop ended first (a run stopping while
    an engine hangs under a create)."""
    if create.cancelled() or create.exception() is not None:
        return
    _POOL.submit(_quiet, create.result().remove, force=True, v=True)


def _removed(container, engine=None) -> bool:
    """Remove a container (and its anonymous volumes); whether it is gone (False: the engine did not answer).
    ``engine``: a pool's, where it stays recorded as an orphan until it is gone (removed when a probe finds the
    engine back: ``engines.EnginePool.probe``), also when the caller stops waiting for this."""
    import docker

    if engine is not None:
        engine.orphan("container", container.id)
    try:
        container.remove(force=True, v=True)
    except docker.errors.NotFound:
        pass
    except Exception as e:  # noqa: BLE001 - the engine is down, or refused
        log.debug("removing container %s: %s", container.short_id, e)
        return False
    if engine is not None:
        engine.unorphan("container", container.id)
    return True


def _quiet(fn, *args, **kwargs) -> None:
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - best effort: the reaper finds what is left by its labels
        log.debug("%s: %s", getattr(fn, "__name__", fn), e)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def machine_id() -> str:
    return _read("/etc/machine-id") or _read("/var/lib/dbus/machine-id") or socket.gethostname()


def boot_id() -> str:
    return _read("/proc/sys/kernel/random/boot_id")


def pid_start(pid: int) -> str:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat); "" if it is gone."""
    stat = _read(f"/proc/{pid}/stat")
    return stat.rsplit(")", 1)[1].split()[19] if stat else ""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def owner_labels() -> dict[str, str]:
    """Who owns the sandboxes this process creates: what ``reap`` checks."""
    return {LABEL_RUN: RUN_ID, LABEL_HOST: socket.gethostname(), LABEL_MACHINE: machine_id(), LABEL_BOOT: boot_id(),
            LABEL_PID: str(os.getpid()), LABEL_PID_START: pid_start(os.getpid())}


def owner_gone(labels: dict[str, str]) -> bool | None:
    """True if the owner recorded in ``labels`` is gone, False if alive, None if it is another machine's."""
    if labels.get(LABEL_MACHINE, machine_id()) != machine_id():
        return None
    if labels.get(LABEL_MACHINE) is None and labels.get(LABEL_HOST) != socket.gethostname():
        return None  # a container from before owner identities, made on another host
    if labels.get(LABEL_BOOT) and labels[LABEL_BOOT] != boot_id():
        return True  # made before this machine's last boot: every owner from then is gone
    try:
        pid = int(labels.get(LABEL_PID, "0"))
    except ValueError:
        return True
    if pid <= 0 or not _pid_alive(pid):
        return True
    start = labels.get(LABEL_PID_START)
    return bool(start) and pid_start(pid) != start  # the pid now belongs to another process


def reap(*, all_runs: bool = False, run_id: str | None = None, client_=None) -> int:
    """Remove labelled containers left behind. By default those whose owner (this machine) is gone; ``run_id``
    removes one run's; ``all_runs`` every jaxrl_term container. Returns how many were removed."""
    cl = client_ or client()
    filters = {"label": [LABEL_RUN if run_id is None else f"{LABEL_RUN}={run_id}"]}
    removed = 0
    # sparse: the list call alone (labels included); a full listing inspects each container and fails on one
    # that another process removes meanwhile
    for c in cl.containers.list(all=True, filters=filters, sparse=True):
        labels = c.attrs.get("Labels") or {}
        if not all_runs and run_id is None and owner_gone(labels) is not True:
            continue
        try:
            c.remove(force=True, v=True)
            removed += 1
        except Exception as e:  # noqa: BLE001 - already gone, or being removed by someone else
            log.debug("reap %s: %s", c.short_id, e)
    if removed:
        log.info("reaped %d leftover sandbox containers", removed)
    # compose environments' networks (labelled like their containers), once their containers are gone
    for net in cl.networks.list(filters=filters):
        labels = net.attrs.get("Labels") or {}
        if not all_runs and run_id is None and owner_gone(labels) is not True:
            continue
        try:
            net.remove()
        except Exception as e:  # noqa: BLE001 - still in use by a live container, or already gone
            log.debug("reap network %s: %s", net.name, e)
    return removed


_reaped_at_startup: set[str] = set()  # engines reaped by this process
_own_engines: dict[str, object] = {}  # engine URL -> client: where _reap_own_all looks at exit
_atexit_registered = False
_quota: dict[str, bool] = {}  # engine -> disk quota supported


def _reap_own(cl=None) -> None:
    """At interpreter exit: remove what this process still owns (a normal exit or an unwound SIGTERM closes its
    sandboxes already; this catches what an exception path skipped)."""
    try:
        cl = cl or default_client()
        mine = {LABEL_MACHINE: machine_id(), LABEL_PID: str(os.getpid())}
        for c in cl.containers.list(all=True, filters={"label": [f"{k}={v}" for k, v in mine.items()]},
                                    sparse=True):
            try:
                c.remove(force=True, v=True)
            except Exception:  # noqa: BLE001 - one that is already gone does not stop the rest
                pass
        for net in cl.networks.list(filters={"label": [f"{k}={v}" for k, v in mine.items()]}):
            try:
                net.remove()
            except Exception:  # noqa: BLE001
                pass
    except Exception:  # noqa: BLE001 - best effort at exit: the next start-up's reap catches the rest
        pass


def _reap_own_all() -> None:
    """At interpreter exit: ``_reap_own`` on every engine this process created sandboxes on. Each call waits at
    most ``EXIT_REAP_TIMEOUT_S``: an engine that stopped answering (a wedged daemon keeps pooled connections open
    and never replies) must not hold the exit for the client's 300 s per call; the next start-up's reap catches
    what is left there."""
    for cl in list(_own_engines.values()):
        try:
            cl.api.timeout = min(cl.api.timeout or EXIT_REAP_TIMEOUT_S, EXIT_REAP_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a client without an API object: reaped with its own timeout
            pass
        _reap_own(cl)


EXIT_REAP_TIMEOUT_S = 10.0


def _storage_quota_supported(cl, key: str = "") -> bool:
    """Whether ``--storage-opt size=`` works on the engine of ``cl`` (overlay2 on xfs with pquota, devicemapper,
    zfs, btrfs); decided once per engine (``key``) from ``docker info``."""
    if key not in _quota:
        driver = "unknown"
        try:
            info = cl.info()
            driver = info.get("Driver", "")
            status = dict(info.get("DriverStatus") or [])
            fs = status.get("Backing Filesystem", "")
            _quota[key] = driver in ("devicemapper", "zfs", "btrfs", "windowsfilter") or (driver == "overlay2" and
                                                                                          fs == "xfs")
        except Exception:  # noqa: BLE001
            _quota[key] = False
        if not _quota[key]:
            log.info("sandbox disk quota unavailable on Docker engine %s (storage driver %s): containers can fill "
                     "the engine's disk; use overlay2 on xfs (pquota) to enforce sandbox.disk_gb", key or "default",
                     driver)
    return _quota[key]


def ensure_public_network(name: str, cl=None) -> None:
    """``PUBLIC_NETWORK`` is created when missing (inter-container traffic off); any other name must exist."""
    import docker

    cl = cl or client()
    try:
        cl.networks.get(name)
    except docker.errors.NotFound:
        if name != PUBLIC_NETWORK:
            raise SandboxError(f"sandbox.public_network={name!r}: no such Docker network; create it or use "
                               f"{PUBLIC_NETWORK!r} (made for you)") from None
        try:
            cl.networks.create(name, driver="bridge", options={"com.docker.network.bridge.enable_icc": "false"})
        except docker.errors.APIError as e:  # made meanwhile by another process
            if "already exists" not in str(e):
                raise


def docker_errors():
    import docker

    return docker.errors


def _pids_current_file(container) -> Path | None:
    """The host's ``pids.current`` of a container's cgroup (v1 ``pids`` or v2), from its init's ``/proc/PID/cgroup``;
    None when the engine runs elsewhere (the pid is not ours to read) or the file is missing."""
    try:
        container.reload()
        pid = int(container.attrs["State"]["Pid"])
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except (OSError, KeyError, ValueError, TypeError):
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        for f in ([Path("/sys/fs/cgroup/pids") / path.lstrip("/") / "pids.current"] if "pids" in controllers.split(",")
                  else [Path("/sys/fs/cgroup") / path.lstrip("/") / "pids.current"] if controllers == "" else []):
            if f.is_file():
                return f
    return None


class DockerExecTransport:
    """The exec socket of ``bash`` in a container, demultiplexed (stdout and stderr frames, in order)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, sock, exec_id: str,
                 sealed: bool = False):
        self.reader, self.writer, self._sock, self.exec_id = reader, writer, sock, exec_id
        self.sealed = sealed  # the shell reads a socket (toolkit.SOCKIN), not the exec's pipe
        self._pending = b""

    @classmethod
    async def open(cls, container_id: str, workdir: str | None, env: dict[str, str], argv: list[str] | None = None,
                   sealed: bool = False, cl=None):
        api = (cl or client()).api
        exec_id = (await _call(
            api.exec_create, container_id, argv or ["bash", "--noprofile", "--norc"], stdin=True, stdout=True,
            stderr=True, tty=False, workdir=workdir, environment=env or None,
        ))["Id"]
        reader, writer, sock = await attach_exec(api, exec_id)
        return cls(reader, writer, sock, exec_id, sealed)

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
            aclose = getattr(self._sock, "aclose", None)
            await aclose() if aclose is not None else self._sock.close()
        except Exception:  # noqa: BLE001
            pass


def end_input(writer: asyncio.StreamWriter) -> None:
    """EOF on an exec's stdin while its output is still read. asyncio's TLS transport has no half-close: there the
    TCP socket's write side is shut after the data (what the Docker CLI's CloseWrite amounts to; dockerd ends the
    process's stdin when its read of the connection ends), never a helper from the container's image in front
    of the command (the verifier's runner takes its nonce on stdin: an image binary there would read it)."""
    import socket as _socket

    if writer.can_write_eof():
        writer.write_eof()
        return
    sock = writer.get_extra_info("socket")
    if sock is None:
        raise SandboxError("cannot end an exec's stdin on this transport")
    sock.shutdown(_socket.SHUT_WR)


async def attach_exec(api, exec_id: str):
    """Start exec ``exec_id`` attached: ``(reader, writer, closable)``, asyncio streams of its multiplexed output
    and its stdin. ``unix://`` and plain ``tcp://``: docker-py's upgraded socket, adopted by asyncio. TLS
    ``tcp://`` and ``ssh://``: their sockets (an ``SSLSocket``, an ssh client's pipes) cannot be adopted, so the
    exec is started here: HTTP/1.1 upgrade over asyncio's own TLS connection (the client's CA and certificate), or
    over ``ssh ... docker system dial-stdio`` (the command docker-py's ssh client runs)."""
    if not (api.base_url.startswith("https://") or api.base_url == "http+docker://ssh"):
        sock = await _call(api.exec_start, exec_id, socket=True)
        raw = getattr(sock, "_sock", sock)
        raw.setblocking(False)
        reader, writer = await asyncio.open_connection(sock=raw)
        return reader, writer, sock
    import ssl
    import urllib.parse

    path = api._url("/exec/{0}/start", exec_id)[len(api.base_url):]
    proc = None
    if api.base_url.startswith("https://"):
        u = urllib.parse.urlsplit(api.base_url)
        ctx = ssl.create_default_context(cafile=api.verify if isinstance(api.verify, str) else None)
        if api.verify is False:
            ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        if api.cert:
            ctx.load_cert_chain(*api.cert) if isinstance(api.cert, tuple) else ctx.load_cert_chain(api.cert)
        async with asyncio.timeout(60):  # not wait_for: on 3.11 it can swallow a cancellation
            reader, writer = await asyncio.open_connection(u.hostname, u.port, ssl=ctx)
        host = u.netloc
    else:
        target = api._custom_adapter.ssh_host  # user@host:port, as docker-py's ssh client splits it
        argv, user, port = ["ssh"], None, None
        if "@" in target:
            user, target = target.split("@", 1)
        if ":" in target:
            target, port = target.rsplit(":", 1)
        argv += (["-l", user] if user else []) + (["-p", port] if port else []) + ["--", target,
                                                                                    "docker system dial-stdio"]
        env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "SSL_CERT_FILE")}
        proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.PIPE,
                                                    stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.DEVNULL, env=env,
                                                    start_new_session=True)
        reader, writer = proc.stdout, proc.stdin
        host = "docker"
    closable = _Closer(writer, proc)
    try:
        body = json.dumps({"Detach": False, "Tty": False}).encode()
        writer.write((f"POST {path} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: jaxrl_term\r\n"
                      f"Content-Type: application/json\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n").encode() + body)
        await writer.drain()
        async with asyncio.timeout(60):
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        status = int(head.split(" ", 2)[1])
        if status not in (101, 200):
            import docker

            length = next((int(line.split(":", 1)[1]) for line in head.split("\r\n")
                           if line.lower().startswith("content-length:")), 0)
            async with asyncio.timeout(10):
                text = (await reader.read(length or 65536)).decode(errors="replace").strip()
            try:
                text = json.loads(text).get("message", text)
            except (ValueError, AttributeError):
                pass
            cls = docker.errors.NotFound if status == 404 else docker.errors.APIError
            raise cls(f"exec start {exec_id[:12]}: {status} {text}")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError, OSError, ValueError,
            IndexError) as e:  # the engine (or the ssh client) went away or answered nonsense: a sandbox error
        closable.close()
        raise SandboxError(f"exec start {exec_id[:12]} on {api.base_url}: {type(e).__name__}: {e}") from e
    except BaseException:
        closable.close()
        raise
    return reader, writer, closable


class _Closer:
    def __init__(self, writer, proc):
        self.writer, self.proc = writer, proc

    def close(self) -> None:
        try:
            self.writer.close()
        except Exception:  # noqa: BLE001 - closing a dead stream
            pass
        if self.proc is not None and self.proc.returncode is None:
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass

    async def aclose(self) -> None:
        self.close()
        if self.proc is not None:
            try:
                async with asyncio.timeout(5):
                    await self.proc.wait()  # reaped, its pipes' transports closed
            except (asyncio.TimeoutError, ProcessLookupError):
                pass


async def _stat_many(stat, paths: list[str], width: int = 16) -> dict:
    sem = asyncio.Semaphore(width)

    async def one(p):
        async with sem:
            return p, await _call(stat, p)

    return dict(await asyncio.gather(*(one(p) for p in paths)))


_IMAGE_STATS: dict[tuple[str, str], dict] = {}  # (engine URL, image id) -> path -> Stat | None (images never change)


@contextlib.contextmanager
def _reference_container(cl, image_id: str):
    """A created, never started container of ``image_id`` (the image's files as they are) for the engine's stats;
    removed on exit (labelled as this process's for the reaper meanwhile)."""
    c = cl.containers.create(image_id, ["/nonexistent"], network_mode="none",
                             labels={**owner_labels(), "jaxrl_term.reference": "1"})
    try:
        yield c.id
    finally:
        _quiet(c.remove, force=True, v=True)


def tar_entries(entries) -> bytes:
    """A tar of (relative name, data or None for a directory, mode), owner root."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data, mode in entries:
            info = tarfile.TarInfo(name)
            info.mode, info.uid, info.gid, info.uname, info.gname = mode, 0, 0, "root", "root"
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class DockerSandbox:
    own_processes = ("docker-init", "pause")  # what is left after kill_all: docker-init and the toolkit's pause

    def __init__(self, container, limits: SandboxLimits, shell: PersistentShell):
        self.container, self.limits, self.shell = container, limits, shell
        self._closed = False

    @property
    def id(self) -> str:
        return self.container.id

    @classmethod
    async def create(cls, image: str, limits: SandboxLimits, *, labels: dict[str, str] | None = None,
                     mounts: dict[str, str] | None = None) -> DockerSandbox:
        """``mounts``: extra named volumes mounted read-only, volume name -> path in the container."""
        from jaxrl_term.sandbox.engines import CURRENT

        engine = CURRENT.get()
        where = engine.url if engine is not None else ""  # by URL: two pools may both name an engine e0
        if where not in _reaped_at_startup:  # once per engine: what killed runs left there
            _reaped_at_startup.add(where)
            global _atexit_registered
            if not _atexit_registered:
                import atexit

                atexit.register(_reap_own_all)
                on_forced_exit(_reap_own_all)  # a second SIGTERM exits without atexit
                _atexit_registered = True
            _own_engines[where] = client()  # before the reap: a failed reap does not leave the engine out at exit
            await _call(reap, client_=client())
        all_labels = {LABEL_TRAJ: uuid.uuid4().hex[:16], **owner_labels(), **(labels or {})}
        engine_client = client()
        import docker

        from jaxrl_term.sandbox import toolkit

        try:
            await _call(client().images.get, image)  # never pull: no registry is assumed
        except docker.errors.ImageNotFound as e:
            raise SandboxError(f"image {image!r} not found locally; build it first (jaxrl_term.sandbox.images)") from e
        try:
            kit = await _call(toolkit.ensure_docker_volume, client(), image)
        except toolkit.ToolkitError as e:
            raise SandboxError(str(e)) from e
        volumes = {kit: {"bind": toolkit.MOUNT, "mode": "ro"},
                   **{v: {"bind": path, "mode": "ro"} for v, path in (mounts or {}).items()}}
        run_kwargs = dict(
            detach=True,
            init=True,  # docker-init (tini, bind-mounted from the host) reaps zombies and forwards signals
            nano_cpus=int(limits.cpus * 1e9),
            mem_limit=f"{limits.memory_mb}m",
            memswap_limit=f"{limits.memory_mb}m",
            pids_limit=limits.pids,
            working_dir=limits.workdir,
            labels=all_labels,
            environment=dict(limits.env) or None,
            volumes=volumes,
            cap_drop=list(DROPPED_CAPS),
            security_opt=["no-new-privileges"],
        )
        if limits.network:
            await _call(ensure_public_network, limits.public_network, client())
        if limits.task_network:  # a compose environment: the agent's container is its service "main"
            run_kwargs.update(network=limits.task_network, networking_config={
                limits.task_network: client().api.create_endpoint_config(aliases=["main"])})
        else:
            run_kwargs["network_mode"] = limits.public_network if limits.network else "none"
        if limits.disk_gb and await _call(_storage_quota_supported, engine_client, where):
            run_kwargs["storage_opt"] = {"size": f"{limits.disk_gb}G"}
        import time as _time

        t_create = _time.monotonic()
        ctx = contextvars.copy_context()
        create = _executor().submit(ctx.run, functools.partial(client().containers.run, image, [toolkit.PAUSE],
                                                               **run_kwargs))
        try:
            container = await asyncio.shield(asyncio.wrap_future(create))
        except asyncio.CancelledError:  # the create goes on in its thread: remove what it makes
            create.add_done_callback(_remove_when_created)
            raise
        except docker.errors.APIError as e:
            if engine is not None:  # refused creates in a row take an engine out of rotation (engines.py)
                engine.failing += 1
            raise SandboxError(f"cannot start a container from {image!r}: {e.explanation or e}") from e
        if engine is not None:  # per-engine metrics (engines.py)
            engine.failing = 0
            engine.created += 1
            engine.create_s += _time.monotonic() - t_create

        from jaxrl_term.sandbox import shell as shell_mod

        shell_argv = list(getattr(shell_mod, "SHELL_ARGV", ["bash", "--noprofile", "--norc"]))

        async def spawn():
            # the shell is non-dumpable (toolkit.NODUMP): the agent cannot read its memory; it reads a socket that
            # toolkit.SOCKIN fills from the exec's pipe: a process holding its stdin cannot write a command into it
            return await DockerExecTransport.open(container.id, limits.workdir,
                                                  {**dict(limits.env), "LD_PRELOAD": toolkit.NODUMP},
                                                  [toolkit.SOCKIN, toolkit.BASH_PATHS, *shell_argv], sealed=True,
                                                  cl=engine_client)

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

        async def kill_tree(shell_pid: int) -> None:
            # a replaced shell, its descendants and its session (as root, from a fresh exec: not the agent's shell)
            for attempt in range(3):
                try:
                    await _call(container.exec_run, kill_tree_command(shell_pid), user="root")
                    return
                except docker_errors().APIError:
                    await asyncio.sleep(0.1 * (attempt + 1))

        # this machine's /proc only knows the containers of an engine on this machine (a unix socket)
        local_engine = engine.url.startswith("unix://") if engine is not None else \
            engine_client.api.base_url == "http+docker://localhost"
        try:
            pids_file = await _call(_pids_current_file, container) if local_engine else None
        except BaseException:  # cancelled or failed before the sandbox exists to close it
            if engine is not None and not engine.healthy:  # it stopped answering: removed when it is back
                engine.orphan("container", container.id)
            else:
                await asyncio.shield(_call(_removed, container, engine))
            raise

        # read on the host (microseconds per command); None on a remote engine: the pid limit alone holds there
        pressure = PidPressure(limits.pids, lambda: int(pids_file.read_text()), [pids_file.with_name("pids.events")]) \
            if pids_file is not None else None

        def pid_pressure() -> bool:
            try:
                return pressure is not None and pressure()
            except (OSError, ValueError):
                return False

        shell = PersistentShell(spawn, signal_command, workdir=limits.workdir, max_output_bytes=limits.max_output_bytes,
                                recover=recover, kill_tree=kill_tree, pid_pressure=pid_pressure)
        sb = cls(container, limits, shell)
        sb.client = engine_client  # its engine's, for the sandbox's whole life (whatever the caller's context later)
        sb.engine = engine
        sb._online = limits.network and not limits.task_network
        try:
            if limits.task_network and limits.network:
                await sb.set_network(True)
            await shell.start()
        except BaseException:
            await sb.close()
            raise
        return sb

    # -- protocol ---------------------------------------------------------------------------------
    async def run(self, command: str, timeout_s: float = 30.0) -> CommandResult:
        res = await self.shell.run(command, timeout_s)
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.commands += 1
            engine.command_s += res.duration_s
        return res

    async def exec(self, argv: list[str], timeout_s: float = 60.0, *, env: dict[str, str] | None = None,
                   workdir: str | None = None, stdin: bytes | None = None) -> CommandResult:
        import time as _time

        from jaxrl_term.sandbox.base import CLEAN_PATH
        from jaxrl_term.sandbox.shell import OutputCapture

        from jaxrl_term.sandbox import toolkit

        t0 = _time.monotonic()
        # the toolkit's static `timeout` (read-only mount, absolute path): TERM at the deadline, KILL 2 s later, exit
        # status 124; uid 0 by number (no name lookup in the agent's /etc/passwd)
        wrapped = [toolkit.TIMEOUT, "-k", "2", f"{timeout_s:.3f}", *argv]
        environment = {"PATH": CLEAN_PATH, **(env or {})}
        cap = OutputCapture(self.limits.max_output_bytes)
        if stdin is None:
            res = await _call(self.container.exec_run, wrapped, environment=environment,
                              workdir=workdir or self.limits.workdir, user=ROOT, demux=False)
            cap.add(res.output or b"")
            code = res.exit_code
        else:
            code = await self._exec_stdin(wrapped, environment, workdir or self.limits.workdir, stdin, cap,
                                          timeout_s + 5)
        timed_out = code in (124, 137) and _time.monotonic() - t0 >= timeout_s * 0.99
        return CommandResult(cap.text(), code, timed_out, cap.truncated, _time.monotonic() - t0)

    async def _exec_stdin(self, argv, environment, workdir, data: bytes, cap, timeout_s: float) -> int | None:
        """exec with ``data`` on the process's stdin (then EOF), output demultiplexed into ``cap``."""
        api = self.client.api
        exec_id = (await _call(api.exec_create, self.container.id, argv, stdin=True, stdout=True, stderr=True,
                               tty=False, workdir=workdir, environment=environment, user=ROOT))["Id"]
        reader, writer, sock = await attach_exec(api, exec_id)
        t = DockerExecTransport(reader, writer, sock, exec_id)
        try:
            writer.write(data)
            await writer.drain()
            end_input(writer)

            async def pump():
                while chunk := await t.read():
                    cap.add(chunk)

            async with asyncio.timeout(timeout_s):  # not wait_for: on 3.11 it can swallow a cancellation
                await pump()
        finally:
            await t.close()
        for _ in range(50):  # the exit code appears once the process is reaped
            info = await _call(api.exec_inspect, exec_id)
            if not info.get("Running"):
                return info.get("ExitCode")
            await asyncio.sleep(0.05)
        return None

    async def kill_all(self) -> None:
        """Restart the container: every process dies (SIGKILL at once), files stay, the main process is the
        toolkit's ``pause`` again; the shell starts anew on the next ``run``."""
        await self.shell.close()
        try:
            await _call(self.container.restart, timeout=0)
        except Exception as e:  # noqa: BLE001 - a container that cannot restart is lost
            from jaxrl_term.sandbox.base import SandboxLost

            down = not await asyncio.to_thread(self.engine_answers, 3)
            lost = SandboxLost(f"could not restart container {self.container.short_id}"
                               f"{' (its Docker engine does not answer)' if down else ''}: {e}")
            lost.engine_down = down
            raise lost from e

    def engine_answers(self, tries: int = 3) -> bool:
        """Whether this sandbox's Docker engine answers a ping (a fresh connection, 5 s) once in ``tries``
        attempts a second apart: a "no" drops the episode as infrastructure, so one lost ping is not enough."""
        from jaxrl_term.sandbox.engines import MIN_API_VERSION, answers, ping_client

        engine = getattr(self, "engine", None)
        if engine is not None:
            return answers(engine.ping, tries)

        def default() -> bool:
            try:
                import docker

                cl = docker.from_env(timeout=5, version=MIN_API_VERSION)  # DOCKER_HOST / the local socket
                try:
                    return ping_client(cl)
                finally:
                    cl.close()
            except Exception:  # noqa: BLE001 - any failure to answer
                return False

        return answers(default, tries)

    async def changes(self) -> list[tuple[str, str]]:
        """``docker diff``, without the mount points Docker itself adds (read-only volumes, docker-init) and the
        directory entries that only changed because a mount point was created in them."""
        kinds = {0: "C", 1: "A", 2: "D"}
        diff = await _call(self.container.diff) or []
        ours = [m.get("Destination", "") for m in (self.container.attrs.get("Mounts") or [])]
        ours += ["/usr/sbin/docker-init", "/sbin/docker-init", "/dev/init"]
        out = []
        for d in diff:
            kind, path = kinds.get(d.get("Kind"), "C"), d.get("Path", "")
            if any(path == m or path.startswith(m.rstrip("/") + "/") for m in ours):
                continue
            if kind == "C" and any(m.startswith(path.rstrip("/") + "/") for m in ours):
                continue  # a parent directory that changed because Docker created a mount point in it
            out.append((kind, path))
        return out

    def _abs(self, path: str) -> str:
        return path if path.startswith("/") else posixpath.join(self.limits.workdir, path)

    # Files go in and out through the engine's archive API only: the engine resolves and writes paths itself,
    # nothing of the container's (no ``mkdir``, no shell) runs.

    def _stat_sync(self, path: str, container_id: str | None = None) -> Stat | None:
        api = self.client.api
        try:
            r = api.head(api._url("/containers/{0}/archive", container_id or self.container.id), params={"path": path},
                         timeout=60)
            if r.status_code == 404:
                return None
            if r.status_code != 200:
                raise SandboxError(f"stat {path}: the engine answered {r.status_code}")
            raw = json.loads(base64.b64decode(r.headers["X-Docker-Container-Path-Stat"]))
        except SandboxError:
            raise
        except Exception as e:  # noqa: BLE001 - the engine's answer could not be had or read: a sandbox error
            raise SandboxError(f"stat {path}: {type(e).__name__}: {e}") from e
        return Stat.from_engine(raw)

    async def stat_paths(self, paths) -> dict[str, Stat | None]:
        """What each path is now (the engine's stat: the last component not followed, earlier links resolved inside
        the container), None when it does not exist."""
        return await _stat_many(self._stat_sync, list(paths))

    async def image_stat_paths(self, paths) -> dict[str, Stat | None]:
        """What each path is in the sandbox's image (a created, never started container of it; cached per image)."""
        image = self.container.attrs["Image"]
        cache = _IMAGE_STATS.setdefault((self.client.api.base_url, image), {})
        todo = [p for p in dict.fromkeys(paths) if p not in cache]
        if todo:
            ref = contextlib.ExitStack()
            try:
                ref_id = await _call(lambda: ref.enter_context(_reference_container(self.client, image)))
            except docker_errors().APIError as e:
                raise SandboxError(f"a container of the sandbox's image for its stats: {e.explanation or e}") from e
            try:
                cache.update(await _stat_many(functools.partial(self._stat_sync, container_id=ref_id), todo))
            finally:
                await asyncio.shield(_call(ref.close))
        return {p: cache[p] for p in paths}

    async def processes(self) -> list[tuple[int, int, str]]:
        """(pid, ppid, command) of every process in the container, as the engine's host sees them (``docker top``:
        the engine runs ``ps``; nothing in the container runs)."""
        top = await _call(self.container.top, ps_args="-eo pid,ppid,comm")
        return [(int(p[0]), int(p[1]), p[2]) for p in top.get("Processes") or []]

    async def _missing_dirs(self, path: str) -> tuple[str, list[str]]:
        """(the deepest existing directory of ``path``, the components below it that do not exist)."""
        missing: list[str] = []
        while path != "/":
            st = await _call(self._stat_sync, path)
            if st is not None:
                if st.kind not in ("dir", "link"):  # a link: the engine follows it inside the container
                    raise SandboxError(f"{path} exists and is not a directory")
                break
            path, name = posixpath.split(path)
            missing.insert(0, name)
        return path, missing

    async def _put(self, at: str, entries: list[tuple[str, bytes | None, int]], what: str) -> None:
        """Unpack ``entries`` ((relative name, data or None for a directory, mode), in order) at ``at``."""
        try:
            ok = await _call(self.container.put_archive, at, tar_entries(entries))
        except docker_errors().APIError as e:
            raise SandboxError(f"{what}: the engine refused the archive: {e.explanation or e}") from e
        if not ok:
            raise SandboxError(f"{what}: the archive upload was refused")

    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        path = self._abs(path)
        parent, name = posixpath.split(path)
        base, missing = await self._missing_dirs(parent)
        dirs = [("/".join(missing[:i + 1]), None, 0o755) for i in range(len(missing))]
        await self._put(base, [*dirs, (posixpath.join(*missing, name), data, mode)], f"write_file {path}")

    async def reset_dirs(self, wipe: list[str], make: list[str]) -> None:
        """Empty the directories ``wipe`` and create the directories ``make`` (absolute, under ``/``) through the
        archive API alone: a regular file unpacked over a directory (or a link) removes it with everything below it,
        without following links; a directory unpacked over a link or file replaces it. Nothing runs in the
        container (the verifier's ``/tests`` and ``/logs/verifier``)."""
        def dirs(paths) -> list[tuple[str, None, int]]:  # every directory on the way, parents first, once
            out: dict[str, None] = {}
            for d in paths:
                parts = d.strip("/").split("/")
                out.update({"/".join(parts[:i + 1]): None for i in range(len(parts))})
            return [(d, None, 0o755) for d in out]

        parents = dirs(posixpath.dirname(d) for d in wipe if posixpath.dirname(d) != "/")
        await self._put("/", [*parents, *((d.strip("/"), b"", 0o644) for d in wipe)], "reset_dirs")
        await self._put("/", dirs([*wipe, *make]), "reset_dirs")

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
        base, missing = await self._missing_dirs(remote_dir)
        if missing:
            await self._put(base, [("/".join(missing[:i + 1]), None, 0o755) for i in range(len(missing))],
                            f"upload_dir {remote_dir}")
        data = tar_directory(Path(local_dir))
        if not await _call(self.container.put_archive, remote_dir, data):
            raise SandboxError(f"upload_dir {local_dir} -> {remote_dir}: the archive upload was refused")

    async def set_network(self, online: bool) -> None:
        """Connect or disconnect the public network (``docker network connect/disconnect``; the container keeps
        running). A container made with no network at all (``--network none``) cannot be connected later: open it
        with ``network=True`` when any phase needs the network, then detach it for the phases that do not."""
        if online == getattr(self, "_online", False):
            return
        if online and not self.limits.network and not self.limits.task_network:
            raise SandboxError("this sandbox was opened without network (network=False): it cannot be given one "
                               "later; open it with network=True and detach it for the offline phases")
        if online:
            await _call(ensure_public_network, self.limits.public_network, self.client)
        net = await _call(self.client.networks.get, self.limits.public_network)
        try:
            await _call(net.connect if online else net.disconnect, self.container)
        except docker_errors().APIError as e:
            raise SandboxError(f"cannot {'connect' if online else 'disconnect'} network "
                               f"{self.limits.public_network!r}: {e.explanation or e}") from e
        self._online = online

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self.shell.close()
        finally:
            engine = getattr(self, "engine", None)
            # out of rotation (it may never answer: hung), or a removal it did not answer (killed): the container
            # is removed when a probe finds it back (EnginePool.probe); else it goes now, even when this close is
            # cancelled (an attempt's deadline, a stopping run)
            if engine is not None and not engine.healthy:
                engine.orphan("container", self.container.id)
            else:
                await asyncio.shield(_call(_removed, self.container, engine))


def reap_targets(hosts: list[str], all_hosts: bool, overrides: list[str]) -> list:
    """The engines ``reap`` acts on: ``hosts`` (URLs or configured names) and, with ``all_hosts``, every engine of
    the composed config's ``sandbox.docker.hosts``; a configured engine keeps its name and TLS files."""
    from jaxrl_term.sandbox.engines import Engine, EnginePool, HostCfg

    configured = []
    if all_hosts or hosts:
        try:
            from omegaconf import OmegaConf

            from jaxrl_term.plan import compose

            listed = OmegaConf.to_container(compose(overrides).sandbox.docker.hosts, resolve=True)
        except Exception:  # noqa: BLE001 - no config to read (hosts given by URL need none)
            if all_hosts:
                raise
            listed = []
        configured = EnginePool(listed).engines if listed else []
        if all_hosts and not configured:
            raise ValueError("--all-hosts: the composed config has no sandbox.docker.hosts (pass the run's overrides "
                             "after --)")
    out = list(configured) if all_hosts else []
    for i, h in enumerate(dict.fromkeys(hosts)):
        known = next((e for e in configured if h in (e.url, e.name)), None)
        if known is None and "://" not in h:
            raise ValueError(f"--host {h!r}: not a URL (unix://, tcp://, ssh://) nor the name of an engine of "
                             f"sandbox.docker.hosts ({[e.name for e in configured]})")
        if known is None:
            known = Engine(HostCfg(url=h, name=f"host{i}", **_env_tls(h)), i)
        if known.url not in {e.url for e in out}:
            out.append(known)
    return out


def _env_tls(url: str) -> dict:
    """Docker's own TLS variables for a tcp:// engine not in the config: DOCKER_CERT_PATH holds ca.pem, cert.pem,
    key.pem; DOCKER_TLS_VERIFY=1 checks the engine's certificate."""
    path = os.environ.get("DOCKER_CERT_PATH")
    if not url.startswith("tcp://") or not path:
        return {}
    verify = os.environ.get("DOCKER_TLS_VERIFY", "") != ""  # as docker-py reads it: set and not empty
    return {"tls_verify": verify, "ca_cert": os.path.join(path, "ca.pem") if verify else None,
            "client_cert": os.path.join(path, "cert.pem"), "client_key": os.path.join(path, "key.pem")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxrl_term.sandbox.docker")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("reap", help="remove sandbox containers left behind by dead runs")
    r.add_argument("--all", action="store_true", help="remove every jaxrl_term container, live runs included")
    r.add_argument("--run", default=None, help="remove one run's containers")
    r.add_argument("--host", action="append", default=[],
                   help="reap this Docker engine only (repeatable): a URL (unix://, tcp://, ssh://) or the name of an "
                        "engine of sandbox.docker.hosts; an engine of the composed config (overrides after --) is "
                        "reached with its TLS files, another tcp:// one with DOCKER_CERT_PATH / DOCKER_TLS_VERIFY")
    r.add_argument("--all-hosts", action="store_true",
                   help="every engine of sandbox.docker.hosts in the composed config (with their TLS settings); "
                        "pass the same overrides as the run after --, e.g. -- +experiment=qwen32b_h100")
    r.add_argument("overrides", nargs="*", help="Hydra overrides (the run's), for --all-hosts and --host")
    args = ap.parse_args(argv)
    try:
        engines = reap_targets(args.host, args.all_hosts, args.overrides)
    except ValueError as e:
        print(f"reap: {e}", file=sys.stderr)
        return 2
    if not engines:  # neither --host nor --all-hosts: the default engine (DOCKER_HOST or the local socket)
        try:
            print(f"default engine: removed {reap(all_runs=args.all, run_id=args.run)} container(s)")
            return 0
        except Exception as e:  # noqa: BLE001
            print(f"default engine: not reaped ({type(e).__name__}: {e})")
            return 1
    failed = 0
    for engine in engines:  # the named engines only
        try:
            m = reap(all_runs=args.all, run_id=args.run, client_=engine.client())
            print(f"{engine.label}: removed {m} container(s)")
        except Exception as e:  # noqa: BLE001 - one engine down does not stop the others
            failed += 1
            print(f"{engine.label}: not reaped ({type(e).__name__}: {e})")
    return 1 if failed else 0


if __name__ == "__main__":
    from jaxrl_term.utils.cli import guard

    raise SystemExit(guard(main)())
