"""Sandboxes over several Docker engines: placement, capacity, health, base images and metrics per engine.

Every node of a cluster runs a Docker daemon; the agent loop (light, async) stays where it is and places each
sandbox on one of ``sandbox.docker.hosts`` through Docker's remote API (``unix://``, ``tcp://`` with TLS,
``ssh://``). ``EnginePool.place()`` picks the least-loaded healthy engine (load = open sandboxes / capacity),
preferring one that already has the task's image, waits while every engine is full, and makes that engine the
current one for the sandbox's whole life (a context variable: ``docker.client()`` answers with its client, so
image builds, toolkit and toolchain volumes, containers, networks all land there).

Health. An engine leaves the rotation when it does not answer after a sandbox failed there, refuses container
creates in a row, or misses ``probe_misses`` liveness probes in a row (a watcher thread per engine pings it every
``probe_interval_s`` with a ``probe_timeout_s`` bound, on a fresh connection): a hung engine (a stopped or wedged
daemon, which accepts connections and never answers) is out of rotation within ``hang_bound_s`` =
``probe_misses x (probe_interval_s + probe_timeout_s)``, 20 s by default, not the client's 300 s read timeout.
The sandboxes it holds then fail at once with a ``SandboxError`` (their tasks are cancelled; ``place`` turns that
into the error), so their attempts are retried on another engine (never scored). An engine out of rotation gets
no sandbox until it answers a probe: after its cool-down (``cooldown_s``, doubled after each failed probe, up to
8x) the watcher pings it; an answer puts it back, silence extends the cool-down. Attempts are not handed to an
engine that has not answered: while another engine is in rotation they wait for room there; only when no engine
answers does an attempt fail (after the first cool-down's probe), so a run whose every engine is gone stops
(``RolloutStalled``) instead of waiting forever. Containers whose removal a silent engine did not answer are
removed when it is back.

Task images are built on the engine that needs them (same recipe hash, same cache key); the base images they
start ``FROM`` are copied from an engine that has them (``docker save | docker load`` through the API) when a new
engine lacks them.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import logging
import os
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)

CURRENT: contextvars.ContextVar = contextvars.ContextVar("jaxrl_term_engine", default=None)


@dataclasses.dataclass
class HostCfg:
    """One Docker engine: ``url`` (``unix:///var/run/docker.sock``, ``tcp://node7:2376``, ``ssh://user@node7``),
    ``capacity`` (sandboxes at once), TLS files for ``tcp://`` (``tls_verify`` checks the engine's certificate
    against ``ca_cert``)."""

    url: str = "unix:///var/run/docker.sock"
    capacity: int = 16
    tls_verify: bool = False
    ca_cert: str | None = None
    client_cert: str | None = None
    client_key: str | None = None
    name: str | None = None


MIN_API_VERSION = "1.24"  # docker-py's minimum: the engine's own version is asked once per client


class Engine:
    def __init__(self, cfg: HostCfg, index: int = 0):
        if isinstance(cfg.capacity, bool) or not isinstance(cfg.capacity, int) or cfg.capacity < 1:
            raise ValueError(f"sandbox.docker.hosts[{index}].capacity={cfg.capacity!r}: must be an integer >= 1")
        if not isinstance(cfg.url, str) or not cfg.url.startswith(("unix://", "tcp://", "ssh://", "http://",
                                                                    "https://")):
            raise ValueError(f"sandbox.docker.hosts[{index}].url={cfg.url!r}: use unix://, tcp:// (with TLS) or "
                             "ssh://")
        for f in ("ca_cert", "client_cert", "client_key"):
            path = getattr(cfg, f)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"sandbox.docker.hosts[{index}].{f}={path!r}: no such file")
        if cfg.tls_verify and not cfg.ca_cert:
            raise ValueError(f"sandbox.docker.hosts[{index}] ({cfg.url}): tls_verify needs ca_cert (the CA that "
                             "signed the engine's certificate)")
        if bool(cfg.client_cert) != bool(cfg.client_key):
            raise ValueError(f"sandbox.docker.hosts[{index}] ({cfg.url}): client_cert and client_key go together")
        self.cfg, self.url, self.capacity = cfg, cfg.url, cfg.capacity
        self.name = cfg.name or f"e{index}"  # metric names: engine/e0/open, ...
        self._client = None
        self._executor = None
        self._executor_lock = threading.Lock()
        self._client_lock = threading.Lock()
        self.base_lock = threading.Lock()  # one copy / build of the base images at a time
        self.image_locks: dict[str, threading.Lock] = {}  # one copy of a prebuilt image at a time
        self.prebuilt: set[str] = set()  # prebuilt images known to be here
        self.open = 0
        self.images: set[str] = set()  # task recipes (tasks/env.recipe_key) whose image is here
        self.bases_ready = False
        self.pool: EnginePool | None = None
        # in rotation once it answered a probe (the first at once: an engine dead from the start costs no attempt);
        # out from mark_down until it answers a probe after its cool-down
        self.in_rotation, self.fresh = False, True
        self.down_until = 0.0  # the cool-down's end: no probe before
        self.backoff = 0  # failed probes since it left the rotation (each doubles the next cool-down, up to 8x)
        self.left_at = time.monotonic()
        self._state_lock = threading.Lock()
        self._probe_lock = threading.Lock()
        self.holders: dict[object, tuple] = {}  # a place() here (its token) -> (its asyncio task, the task's loop)
        # tickets of places failed because this engine stopped answering (EnginePool._cut) -> whether the cancel
        # was delivered for that place (one per task: its innermost place, the first to see the CancelledError)
        self.cut: dict[object, bool] = {}
        # ("container" | "network", id) it was left holding (a removal it did not answer, or skipped because it
        # was out of rotation): removed when a probe finds it back
        self.orphans: set[tuple[str, str]] = set()
        self.created = self.failures = self.commands = 0
        self.create_s = self.command_s = 0.0
        self.left = self.rejoined = self.hung = self.probes_failed = 0  # times out of / back into rotation
        self.out_s = 0.0  # seconds out of rotation (closed spells; metrics() adds the current one)
        self.failing = 0  # consecutive container creates the engine refused (DockerSandbox.create counts them)
        self._reported: dict[str, float] = {}

    def executor(self):
        """This engine's threads for blocking Docker calls (``docker._call``): 64, made on first use."""
        with self._executor_lock:
            if self._executor is None:
                import concurrent.futures

                self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=64,
                                                                       thread_name_prefix=f"jaxrl-docker-{self.name}")
            return self._executor

    @property
    def label(self) -> str:
        """How logs and errors name it: its configured name and URL."""
        return f"{self.name} ({self.url})"

    @property
    def tls(self) -> bool:
        return bool(self.cfg.tls_verify or self.cfg.client_cert)

    def _tls(self):
        import docker

        if not self.tls:
            return None
        return docker.tls.TLSConfig(
            client_cert=(self.cfg.client_cert, self.cfg.client_key) if self.cfg.client_cert else None,
            ca_cert=self.cfg.ca_cert, verify=self.cfg.ca_cert if self.cfg.tls_verify else False)

    def client(self):
        """The engine's client (made once; its API version is asked of the engine: call it off the event loop
        the first time, as ``EnginePool.place`` does)."""
        with self._client_lock:
            if self._client is None:
                cl = self._connect(timeout_s=10, version=MIN_API_VERSION, max_pool_size=128)
                try:  # the engine's API version (what docker-py's "auto" does), asked with a short timeout
                    cl.api._version = cl.api.version(api_version=False)["ApiVersion"]
                except BaseException:
                    cl.close()
                    raise
                cl.api.timeout = 300  # builds, image copies and big transfers take long
                self._client = cl
            return self._client

    def _connect(self, timeout_s: float, version: str, **kw):
        import docker

        if self.url.startswith("ssh://"):
            _mend_ssh_close()

        cl = docker.DockerClient(base_url=self.url, tls=self._tls(), timeout=timeout_s, version=version,
                                 use_ssh_client=self.url.startswith("ssh://"), **kw)
        # requests lets REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE (set on many clusters) replace the engine's CA per
        # request, which fails TLS verification; HTTP(S)_PROXY must not route the engine's API either
        cl.api.trust_env = False
        return cl

    @property
    def healthy(self) -> bool:
        """In rotation: it answered since it last failed (a cool-down's end alone does not put it back)."""
        return self.in_rotation

    @property
    def probe_due(self) -> bool:
        return not self.in_rotation and time.monotonic() >= self.down_until

    def ping(self, timeout_s: float = 5.0) -> bool:
        """Whether the engine answers within ``timeout_s`` (a fresh connection: the pooled ones may hang; over ssh,
        an ``ssh`` process killed at the deadline: docker-py's ssh socket has no read timeout)."""
        if self.url.startswith("ssh://"):
            return _ssh_ping(self.url, timeout_s)
        try:
            cl = self._connect(timeout_s=timeout_s, version=MIN_API_VERSION)
            try:
                return ping_client(cl)
            finally:
                cl.close()
        except Exception:  # noqa: BLE001 - any failure to answer is "down"
            return False

    def mark_down(self, cooldown_s: float, why: str) -> bool:
        """Out of rotation until a probe after ``cooldown_s`` answers (doubled per failed probe since it left).
        Whether this call took it out (False: it was out already, or two threads raced and the other did)."""
        now = time.monotonic()
        with self._state_lock:
            left = self.in_rotation
            if self.in_rotation:
                self.in_rotation, self.left_at, self.backoff = False, now, 0
                self.left += 1
            elif self.fresh:  # its first probe: out since the start
                self.fresh, self.backoff = False, 0
                self.left += 1
            else:
                self.backoff += 1
            wait = cooldown_s * 2 ** min(self.backoff, 3)
            self.down_until = now + wait
        log.warning("Docker engine %s out of rotation, probed again in %.0fs: %s", self.label, wait, why)
        return left

    def orphan(self, kind: str, ident: str) -> None:
        with self._state_lock:
            self.orphans.add((kind, ident))

    def unorphan(self, kind: str, ident: str) -> None:
        with self._state_lock:
            self.orphans.discard((kind, ident))

    def mark_up(self) -> None:
        with self._state_lock:
            if self.in_rotation:
                return
            self.in_rotation, self.backoff = True, 0
            if self.fresh:  # its first probe answered
                self.fresh = False
                return
            self.rejoined += 1
            self.out_s += time.monotonic() - self.left_at
        log.warning("Docker engine %s answers again: back in rotation after %.0fs", self.label,
                    time.monotonic() - self.left_at)

    def metrics(self) -> dict[str, float]:
        """``open`` and ``up`` now; ``out_s`` (seconds out of rotation, the current spell included) in total;
        ``created``, ``failures``, ``left`` (times it left the rotation), ``hung`` (of those, missed liveness probes)
        since the last call; latencies averaged over them."""
        p = f"engine/{self.name}"
        now = {"created": self.created, "failures": self.failures, "commands": self.commands,
               "create_s": self.create_s, "command_s": self.command_s, "left": self.left, "hung": self.hung}
        d = {k: v - self._reported.get(k, 0) for k, v in now.items()}
        self._reported = now
        return {f"{p}/open": self.open, f"{p}/created": d["created"], f"{p}/failures": d["failures"],
                f"{p}/create_ms": 1e3 * d["create_s"] / max(1, d["created"]),
                f"{p}/command_ms": 1e3 * d["command_s"] / max(1, d["commands"]), f"{p}/up": float(self.healthy),
                f"{p}/left": d["left"], f"{p}/hung": d["hung"], f"{p}/out_s": self.out_total_s()}

    def out_total_s(self) -> float:
        with self._state_lock:
            return self.out_s + (0.0 if self.in_rotation or self.fresh else time.monotonic() - self.left_at)


def _ssh_ping(url: str, timeout_s: float) -> bool:
    """``GET /_ping`` through ``ssh HOST docker system dial-stdio`` (what docker-py's ssh client runs, with the
    same ``-l`` / ``-p``), bounded by ``timeout_s`` in wall time: the ssh process is killed at the deadline."""
    import subprocess
    import urllib.parse

    u = urllib.parse.urlsplit(url)
    argv = ["ssh", "-o", f"ConnectTimeout={max(1, int(timeout_s))}"]
    if u.username:
        argv += ["-l", u.username]
    if u.port:
        argv += ["-p", str(u.port)]
    argv += ["--", u.hostname or "", "docker", "system", "dial-stdio"]
    try:
        r = subprocess.run(argv, input=b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n", capture_output=True,
                           timeout=timeout_s)
    except (subprocess.TimeoutExpired, OSError):
        return False
    head, _, body = r.stdout.partition(b"\r\n\r\n")
    return head.startswith(b"HTTP/1.") and b" 200 " in head.split(b"\r\n")[0] and body.strip() == b"OK"


def ping_client(cl) -> bool:
    """``GET /_ping`` without an API version in the path: engines refuse versioned calls below their minimum
    (Docker 25+ raised it), and a ping must not fail for that."""
    api = cl.api
    return api._result(api._get(f"{api.base_url}/_ping")) == "OK"


def answers(probe, tries: int = 3, gap_s: float = 1.0) -> bool:
    """Whether ``probe()`` succeeds once in ``tries`` attempts ``gap_s`` apart (one lost ping is not a dead
    engine; this decides whether an episode is dropped as infrastructure instead of scored)."""
    for i in range(tries):
        if probe():
            return True
        if i + 1 < tries:
            time.sleep(gap_s)
    return False


def _mend_ssh_close() -> None:
    """docker-py's ssh client socket (``use_ssh_client=True``: the ``ssh`` program, so ``~/.ssh/config``, agents
    and jump hosts work as in a shell) writes to ssh's stdin on close; when ssh already exited (its remote ``docker
    system dial-stdio`` ended with the response, e.g. after every ``exec_run``) that raises BrokenPipeError
    (docker/docker-py#3218, open). Closing a finished connection is not an error: tolerated here."""
    from docker.transport import sshconn

    if getattr(sshconn.SSHSocket.close, "_jaxrl_mended", False):
        return
    original = sshconn.SSHSocket.close

    def close(self):
        try:
            original(self)
        except (BrokenPipeError, ValueError, OSError):  # ssh is gone: nothing left to close but the process
            if self.proc is not None and self.proc.poll() is None:
                self.proc.terminate()

    close._jaxrl_mended = True
    sshconn.SSHSocket.close = close


# after this many container creates in a row refused by an engine that still answers pings (a full disk, a broken
# storage driver), it leaves the rotation like one that does not answer; an episode's own errors (a task image
# that does not build, the policy server, the verifier) never count
MAX_CONSECUTIVE_FAILURES = 3


class EnginePool:
    def __init__(self, hosts: Sequence[HostCfg | dict], *, cooldown_s: float = 60.0, probe_interval_s: float = 5.0,
                 probe_timeout_s: float = 5.0, probe_misses: int = 2):
        if not hosts:
            raise ValueError("sandbox.docker.hosts is empty")
        fields = {f.name for f in dataclasses.fields(HostCfg)}
        cfgs = []
        for i, h in enumerate(hosts):
            if isinstance(h, str):
                h = {"url": h}
            if not isinstance(h, (HostCfg, dict)):
                raise ValueError(f"sandbox.docker.hosts[{i}]: a mapping {{url, capacity, ...}}, got {h!r}")
            if isinstance(h, dict):
                unknown = sorted(set(h) - fields)
                if unknown:
                    raise ValueError(f"sandbox.docker.hosts[{i}]: unknown key(s) {unknown}; use {sorted(fields)}")
                h = HostCfg(**h)
            cfgs.append(h)
        self.engines = [Engine(h, i) for i, h in enumerate(cfgs)]
        for e in self.engines:
            e.pool = self
        names = [e.name for e in self.engines]
        if len(set(names)) != len(names):
            raise ValueError(f"sandbox.docker.hosts: names must be unique, got {names}")
        urls = [e.url for e in self.engines]
        if len(set(urls)) != len(urls):
            raise ValueError(f"sandbox.docker.hosts: an engine is listed twice ({urls}); raise its capacity instead")
        for key, v in (("cooldown_s", cooldown_s), ("probe_interval_s", probe_interval_s),
                       ("probe_timeout_s", probe_timeout_s)):
            if not v > 0:
                raise ValueError(f"sandbox.docker.{key}={v}: must be > 0")
        if isinstance(probe_misses, bool) or not isinstance(probe_misses, int) or probe_misses < 1:
            raise ValueError(f"sandbox.docker.probe_misses={probe_misses!r}: must be an integer >= 1")
        self.cooldown_s = cooldown_s
        self.probe_interval_s, self.probe_timeout_s, self.probe_misses = probe_interval_s, probe_timeout_s, probe_misses
        self._lock = threading.Lock()  # open counts: event loops of several threads may share this pool
        self._watching = False
        self._stop = threading.Event()

    @property
    def hang_bound_s(self) -> float:
        """The longest an engine that stopped answering stays in rotation (``probe_misses`` probes in a row)."""
        return self.probe_misses * (self.probe_interval_s + self.probe_timeout_s)

    def watch(self) -> None:
        """Start the watchers (one daemon thread per engine; ``place`` does on first use). They hold the pool
        weakly: a pool that is closed or no longer used stops them."""
        with self._lock:
            if self._watching:
                return
            self._watching = True
        for i, e in enumerate(self.engines):
            threading.Thread(target=_watch, args=(weakref.ref(self), i, self._stop), name=f"jaxrl-engine-{e.name}",
                             daemon=True).start()

    def close(self) -> None:
        """Stop the watchers."""
        self._stop.set()

    def _check(self, e: Engine, misses: int) -> int:
        """One watcher round for ``e``: a probe when it is out and due, else a liveness ping; the misses in a
        row after it."""
        try:
            return self._round(e, misses)
        except Exception:  # noqa: BLE001 - a watcher must not die: the next round tries again
            log.exception("engine %s: watcher round failed", e.label)
            return misses

    def _round(self, e: Engine, misses: int) -> int:
        if not e.healthy:
            if e.probe_due:
                self.probe(e)
            return 0
        if e.ping(self.probe_timeout_s):
            return 0
        if misses + 1 < self.probe_misses or not e.healthy:
            return misses + 1
        e.hung += 1
        self.take_out(e, f"no answer to {self.probe_misses} liveness probes in a row ({self.probe_timeout_s:g}s "
                         "each): hung or gone")
        return 0

    def take_out(self, e: Engine, why: str) -> None:
        """``e`` did not answer: out of rotation, and the sandboxes it holds fail now (``_cut``; once: a thread
        that finds it already out leaves it)."""
        if e.mark_down(self.cooldown_s, why):
            self._cut(e)

    def probe(self, e: Engine) -> bool:
        """An engine out of rotation whose cool-down ended: a bounded ping puts it back (and removes what it was
        left holding), silence extends its cool-down. Nothing is charged to an attempt. Whether it is in
        rotation after."""
        with e._probe_lock:
            if not e.probe_due:  # another thread probed it meanwhile
                return e.healthy
            if not e.ping(self.probe_timeout_s):
                e.probes_failed += 1
                e.mark_down(self.cooldown_s, "it still does not answer after its cool-down")
                if e.holders:  # places made on it while out (refused creates, a verifier's pinned check)
                    self._cut(e)
                return False
            e.mark_up()
        # off this thread (a watcher's, or an attempt's): the engine may go silent again under these removals
        threading.Thread(target=self._remove_orphans, args=(e,), name=f"jaxrl-orphans-{e.name}", daemon=True).start()
        return True

    def _remove_orphans(self, e: Engine) -> None:
        import docker

        with e._state_lock:
            orphans, e.orphans = e.orphans, set()
        if not orphans:
            return
        try:
            cl = e._connect(timeout_s=30, version=e.client().api._version)
        except Exception:  # noqa: BLE001 - it went again: kept for its next return
            with e._state_lock:
                e.orphans |= orphans
            return
        try:
            for kind, ident in sorted(orphans):  # containers before the networks they are on
                try:
                    if kind == "container":
                        cl.api.remove_container(ident, force=True, v=True)
                    else:
                        cl.api.remove_network(ident)
                except docker.errors.NotFound:
                    pass
                except Exception as err:  # noqa: BLE001 - kept for its next return (the reaper covers the rest)
                    e.orphan(kind, ident)
                    log.warning("engine %s: could not remove %s %s left by a silent spell: %s", e.label, kind,
                                ident[:12], err)
        finally:
            cl.close()

    def _cut(self, e: Engine) -> None:
        """Fail the sandboxes placed on ``e`` (it stopped answering) now: each holder's task is cancelled on its
        own loop, if its place is still there when the loop runs the call (one that left meanwhile is spared), and
        ``place`` turns that into a ``SandboxError`` (the attempt is retried on another engine) instead of waiting
        on the engine."""
        tasks: dict = {}
        with self._lock:
            for ticket, (task, loop) in e.holders.items():
                if ticket not in e.cut:  # a place cut already is not cancelled twice
                    e.cut[ticket] = False
                    tasks.setdefault(task, (loop, []))[1].append(ticket)
        for task, (loop, tickets) in tasks.items():  # one cancel per task (nested places of one task share it)
            with contextlib.suppress(RuntimeError):  # its loop has closed: nothing to cancel
                loop.call_soon_threadsafe(self._cancel_if_cut, e, task, tickets)

    def _cancel_if_cut(self, e: Engine, task, tickets: list) -> None:
        """On the task's loop thread, where ``place``'s exit runs too: cancel only a place still held, and mark
        the innermost such place as the one the cancel is for (``place`` turns exactly that CancelledError
        into a SandboxError)."""
        with self._lock:
            held = [t for t in tickets if t in e.cut]
            if not held or task.done():
                return
            e.cut[held[-1]] = True
        task.cancel(f"Docker engine {e.name} stopped answering")

    def _pick(self, prefer: str | None) -> Engine | None:
        free = [e for e in self.engines if e.healthy and e.open < e.capacity]
        if not free:
            return None
        return min(free, key=lambda e: (prefer is not None and prefer not in e.images, e.open / e.capacity,
                                        self.engines.index(e)))

    async def _wait_for_engine(self, prefer: str | None, timeout_s: float | None) -> Engine:
        from jaxrl_term.sandbox.base import SandboxError

        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            with self._lock:
                engine = self._pick(prefer)
                if engine is not None:
                    engine.open += 1
                    return engine
            if deadline is not None and time.monotonic() > deadline:
                raise SandboxError(f"no Docker engine had room for a sandbox within {timeout_s:.0f}s "
                                   f"({self.describe()})")
            if not any(e.healthy for e in self.engines):
                # no engine in rotation (at start-up: none probed yet): probe every one whose cool-down has ended,
                # at once; when none answers this sandbox fails (the episode is retried, then dropped: a run whose
                # every engine is gone stops instead of waiting forever); when none is due, wait for the first
                due = [e for e in self.engines if e.probe_due]
                if not due:
                    until = min(e.down_until for e in self.engines)
                    until = until if deadline is None else min(until, deadline)
                    await asyncio.sleep(max(0.0, until - time.monotonic()))
                    continue
                answered = await asyncio.gather(*(asyncio.to_thread(self.probe, e) for e in due))
                if not any(answered) and not any(e.healthy for e in self.engines):
                    raise SandboxError(f"no Docker engine answers ({self.describe()})")
                continue
            # room is taken, or the engines that answer are full: wait (never handed to one that has not answered)
            await asyncio.sleep(0.05)

    def describe(self) -> str:
        now = time.monotonic()
        return ", ".join(f"{e.name}: {e.open}/{e.capacity} open" + ("" if e.healthy else
                                                                    f", out of rotation, probed in "
                                                                    f"{max(0.0, e.down_until - now):.0f}s")
                         for e in self.engines)

    @contextlib.asynccontextmanager
    async def place(self, prefer: str | None = None, *, on: Engine | None = None, timeout_s: float | None = None):
        """``async with pool.place(image) as engine``: the sandbox opened inside lives on ``engine``.

        ``on``: that engine, over its capacity if need be (a verifier's check on a fresh sandbox of an episode
        that holds a place there must not wait for its own place); it fails at once if the engine does not
        answer. ``timeout_s``: how long to wait for room (None: as long as it takes; the run's own cap bounds
        the waiters)."""
        from jaxrl_term.sandbox.base import SandboxError

        self.watch()
        if on is not None:
            if on not in self.engines:
                raise ValueError(f"engine {on.name} is not in this pool")
            # out of rotation for another episode's reason is no reason here: only an engine that does not answer
            if not on.healthy and not await asyncio.to_thread(on.ping, self.probe_timeout_s):
                raise SandboxError(f"Docker engine {on.name} ({on.url}) does not answer")
            engine = on
            with self._lock:
                engine.open += 1
        else:
            engine = await self._wait_for_engine(prefer, timeout_s)
        task, ticket = asyncio.current_task(), object()
        with self._lock:
            engine.holders[ticket] = (task, asyncio.get_running_loop())
        token = CURRENT.set(engine)
        error: BaseException | None = None
        try:
            try:
                await asyncio.to_thread(engine.client)  # its API version asked off the event loop
            except Exception as e:  # noqa: BLE001 - it does not answer: infrastructure, never the episode's fault
                raise SandboxError(f"Docker engine {engine.name} ({engine.url}): {type(e).__name__}: {e}") from e
            yield engine
        except BaseException as e:
            with self._lock:
                ours = engine.cut.pop(ticket, False)  # True: _cancel_if_cut cancelled the task for this place
            # the engine stopped answering (_cut) and nothing else cancelled this task (an attempt's deadline, a
            # stopping run: those stay cancellations)
            if isinstance(e, asyncio.CancelledError) and ours and task.uncancel() == 0:
                error = SandboxError(f"Docker engine {engine.label} stopped answering: this sandbox's attempt is "
                                     "retried on another engine")
                raise error from e
            error = e
            raise
        finally:
            CURRENT.reset(token)
            # after every sandbox (the agent loop reports a lost sandbox as an invalid episode, not an exception):
            # an engine that does not answer leaves the rotation before the episode is retried
            with self._lock:
                engine.open -= 1
                engine.holders.pop(ticket, None)
                engine.cut.pop(ticket, None)
            if not engine.healthy:
                engine.failures += error is not None  # already out of rotation (the watcher, another sandbox)
            elif isinstance(error, asyncio.CancelledError):
                # an attempt cut off (its deadline, or the run stopping): the engine may be what hung it (a wedged
                # daemon accepts and never answers); the next attempt must not wait a whole deadline on it again
                if not await asyncio.to_thread(engine.ping, self.probe_timeout_s) and engine.healthy:
                    self.take_out(engine, "it did not answer after a sandbox's work was cut off")
            elif not isinstance(error, (asyncio.CancelledError, KeyboardInterrupt, GeneratorExit)):
                engine.failures += error is not None
                if not await asyncio.to_thread(engine.ping, self.probe_timeout_s):
                    if engine.healthy:
                        self.take_out(engine, f"{type(error).__name__}: {error}" if error is not None
                                      else "it stopped answering")
                elif engine.failing >= MAX_CONSECUTIVE_FAILURES:
                    engine.failing = 0
                    engine.mark_down(self.cooldown_s, f"{MAX_CONSECUTIVE_FAILURES} container creates in a row were "
                                                      f"refused there (last: {type(error).__name__}: {error})")

    def copy_base_images(self, engine: Engine) -> None:
        """The base images (``images.BASE_IMAGES``) onto ``engine``: copied from a peer that has them (the other
        engines, then this machine's default one), else built there by the same set-up code as ``make sandbox``.
        Once per engine at a time (threads of several event loops may ask together)."""
        from jaxrl_term.sandbox.base import SandboxError
        from jaxrl_term.sandbox.docker import default_client
        from jaxrl_term.sandbox.images import BASE_IMAGES, build_base_image, resolve_ca_bundle

        with engine.base_lock:
            if engine.bases_ready:
                return
            peers = [e.client for e in self.engines if e is not engine and e.healthy]
            peers.append(default_client)
            for spec in BASE_IMAGES.values():
                if ensure_image(engine.client(), spec.name, peers, where=engine.label):
                    continue
                if engine.tls or engine.url.startswith("ssh://"):
                    raise SandboxError(f"Docker engine {engine.name} ({engine.url}) has no {spec.name} and no peer "
                                       f"engine has it: run `DOCKER_HOST={engine.url} python -m "
                                       "jaxrl_term.sandbox.images setup` (with DOCKER_TLS_VERIFY / DOCKER_CERT_PATH "
                                       "for TLS) once")
                log.info("building %s on engine %s (no peer has it)", spec.name, engine.label)
                build_base_image(engine.client(), spec, ca_bundle=resolve_ca_bundle("auto"), host=engine.url)
            engine.bases_ready = True

    def copy_image(self, engine: Engine, name: str) -> None:
        """A prebuilt image (a task's ``docker_image``, a compose ``image:``; never pulled) onto ``engine`` from a
        peer engine that has it; SandboxError naming the image when none has."""
        from jaxrl_term.sandbox.base import SandboxError
        from jaxrl_term.sandbox.docker import default_client

        if name in engine.prebuilt:
            return
        with self._lock:
            lock = engine.image_locks.setdefault(name, threading.Lock())
        with lock:
            if name in engine.prebuilt:
                return
            peers = [e.client for e in self.engines if e is not engine and e.healthy] + [default_client]
            if not ensure_image(engine.client(), name, peers, where=engine.label):
                raise SandboxError(f"image {name!r} is on no Docker engine of sandbox.docker.hosts (nothing is "
                                   f"pulled): load or build it on one of them, e.g. `docker -H {engine.url} load`")
            engine.prebuilt.add(name)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for e in self.engines:
            out.update(e.metrics())
        return out


def _watch(ref: weakref.ref, index: int, stop: threading.Event) -> None:
    """A watcher thread: ``EnginePool._check`` of engine ``index`` every ``probe_interval_s`` until ``stop`` or the
    pool is gone."""
    misses = 0
    while True:
        pool = ref()
        if pool is None:
            return
        misses, interval = pool._check(pool.engines[index], misses), pool.probe_interval_s
        del pool
        if stop.wait(interval):
            return


_SHARED: dict[str, EnginePool] = {}
_SHARED_LOCK = threading.Lock()


def shared_pool(hosts: Sequence[HostCfg | dict | str], **settings) -> EnginePool:
    """One ``EnginePool`` per process for the same hosts and settings (``cooldown_s``, ``probe_*``;
    config.SandboxCfg.engines)."""
    import json

    key = json.dumps([[dataclasses.asdict(h) if isinstance(h, HostCfg) else h for h in hosts], settings],
                     sort_keys=True, default=str)
    with _SHARED_LOCK:
        if key not in _SHARED:
            _SHARED[key] = EnginePool(hosts, **settings)
        return _SHARED[key]


def current() -> Engine | None:
    return CURRENT.get()


def ensure_image(engine_client: Any, name: str, peers: Sequence[Any], *, where: str | None = None) -> bool:
    """``name`` (a base image, or any image that is never pulled) on the engine of ``engine_client``: copied from
    the first peer engine that has it, streamed ``save -> load`` through the API. A copy already there is kept
    unless the peer's carries another recipe (the ``jaxrl_term.recipe`` label ``images.py`` sets: a stale base
    image under the same tag is replaced). A peer that is down or fails mid-copy is skipped. ``peers``: clients,
    or callables that make one; ``where``: the engine's name in logs (``Engine.label``; default its API URL).
    False when the image is not there and no peer could give it."""
    import docker

    from jaxrl_term.sandbox.images import RECIPE_LABEL

    try:
        have = (engine_client.images.get(name).labels or {}).get(RECIPE_LABEL)
        present = True
    except docker.errors.ImageNotFound:
        have, present = None, False
    for peer in peers:
        try:
            peer = peer() if callable(peer) else peer
            img = peer.images.get(name)
        except Exception:  # noqa: BLE001 - that peer lacks it or is down
            continue
        want = (img.labels or {}).get(RECIPE_LABEL)
        if present and (want is None or want == have):
            return True  # the same recipe (or an image without one: nothing to compare)
        t0 = time.monotonic()
        try:
            tag = next((t for t in img.tags if t in (name, f"{name}:latest")), True)  # this name, not the first tag
            engine_client.images.load(img.save(named=tag))  # a generator of chunks: streamed, never all in memory
            engine_client.images.get(name)
        except Exception as e:  # noqa: BLE001 - that peer went away mid-copy, or the load failed: try the next
            log.warning("copying %s to engine %s failed: %s", name, where or engine_client.api.base_url, e)
            continue
        log.info("image %s copied to engine %s in %.1fs%s", name, where or engine_client.api.base_url,
                 time.monotonic() - t0, f" (replacing recipe {have})" if present else "")
        return True
    return present


@contextlib.contextmanager
def local_daemon(root: str | None = None, wait_s: float = 90.0, *, tls: bool = False):
    """A second Docker daemon on this machine (root only) on its own socket, data root and exec root, in its own
    network namespace, without a default bridge or iptables rules: what tests and
    ``experiments/bench/sandbox_pool.py`` place sandboxes on.
    Yields ``{"url", "root", "proc"}``; ``restart(state)`` starts it again on the same data root.

    ``tls``: the daemon also listens on TCP with ``--tlsverify`` (a CA, server and client certificates made here
    with ``openssl``), reached from this namespace through a relay on 127.0.0.1; the state then has
    ``tcp_url``, ``ca_cert``, ``client_cert``, ``client_key`` (a ``HostCfg`` for a TLS engine)."""
    import shutil
    import subprocess
    import tempfile

    root = root or tempfile.mkdtemp(prefix="jrt-d2-", dir="/tmp")  # short: a socket path has at most 107 bytes
    state = {"root": root, "url": f"unix://{root}/docker.sock", "tls": tls}
    if tls:
        state.update(_make_certs(root))
    state["proc"] = _start_daemon(state, wait_s)
    try:
        yield state
    finally:
        for k in ("relay", "proc"):
            p = state.get(k)
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
        _kill_leftovers(root)
        subprocess.run(["bash", "-c", f"grep -o ' {root}[^ ]*' /proc/mounts | sort -r | xargs -r umount -l"],
                       capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


def _kill_leftovers(root: str) -> int:
    """SIGKILL what a daemon on ``root`` leaves running when it was SIGKILLed itself (a stopped daemon takes its
    containers down; a killed one cannot): processes with an argument that is ``root`` or a path under it (or
    ``--flag=`` one: containerd, its ``containerd-shim``s) and every descendant of theirs (the containers'
    processes); never this process or its ancestors. Returns how many."""
    import signal

    under = root.rstrip("/") + "/"

    def names_root(arg: bytes) -> bool:
        a = arg.decode(errors="replace").rpartition("=")[2]
        return a == root.rstrip("/") or a.startswith(under)

    parent: dict[int, int] = {}
    named: set[int] = set()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if any(names_root(a) for a in f.read().split(b"\0") if a):
                    named.add(int(d))
        except (OSError, ValueError, IndexError):
            continue
    doomed = set(named)
    grew = True
    while grew:  # descendants, to any depth
        more = {pid for pid, pp in parent.items() if pp in doomed and pid not in doomed}
        grew = bool(more)
        doomed |= more
    me = os.getpid()
    while me > 1:  # this process and its ancestors stay, whatever their command lines say
        doomed.discard(me)
        me = parent.get(me, 0)
    for pid in doomed:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return len(doomed)


def restart(state: dict, wait_s: float = 90.0) -> None:
    relay = state.pop("relay", None)
    if relay is not None and relay.poll() is None:
        relay.kill()
    _clear_stale_containerd(state["root"])
    state["proc"] = _start_daemon(state, wait_s)


def _clear_stale_containerd(root: str) -> None:
    """After a SIGKILLed dockerd its containerd's pid file stays; while that pid exists (an unreaped zombie, or
    a reused pid) the next dockerd waits for that "running" containerd and times out. Kill it if it is still ours,
    then drop the pid file."""
    import signal

    pidfile = f"{root}/exec/containerd/containerd.pid"
    try:
        with open(pidfile) as f:
            pid = int(f.read().strip())
    except (OSError, ValueError):
        return
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            ours = root.encode() in f.read()
    except OSError:
        ours = False
    if ours:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        for _ in range(100):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] in "ZX":
                        break
            except OSError:
                break
            time.sleep(0.05)
    with contextlib.suppress(FileNotFoundError):
        os.remove(pidfile)


def _make_certs(root: str) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 / localhost and a client certificate (clientAuth), by openssl."""
    import subprocess

    d = f"{root}/tls"
    os.makedirs(d, exist_ok=True)

    def run(*argv: str) -> None:
        subprocess.run(argv, check=True, capture_output=True, cwd=d)

    run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=jaxrl-test-ca",
        "-keyout", "ca-key.pem", "-out", "ca.pem")
    for who, ext in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth"),
                     ("client", "extendedKeyUsage=clientAuth")):
        run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={who}", "-keyout", f"{who}-key.pem",
            "-out", f"{who}.csr")
        with open(f"{d}/{who}.ext", "w") as f:
            f.write(ext + "\n")
        run("openssl", "x509", "-req", "-in", f"{who}.csr", "-CA", "ca.pem", "-CAkey", "ca-key.pem",
            "-CAcreateserial", "-days", "2", "-extfile", f"{who}.ext", "-out", f"{who}.pem")
    return {"ca_cert": f"{d}/ca.pem", "client_cert": f"{d}/client.pem", "client_key": f"{d}/client-key.pem",
            "server_cert": f"{d}/server.pem", "server_key": f"{d}/server-key.pem"}


# Accepts on 127.0.0.1 in this network namespace, connects to 127.0.0.1:2376 in the daemon's (bytes both ways,
# half-closes passed on): TLS stays end to end between the client and dockerd.
_RELAY = r"""
import asyncio, ctypes, os, socket, sys
ns, port_file = sys.argv[1], sys.argv[2]
lsock = socket.socket()
lsock.bind(("127.0.0.1", 0))
lsock.listen(128)
fd = os.open(ns, os.O_RDONLY)
if ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) != 0:
    raise SystemExit(f"setns: errno {ctypes.get_errno()}")
async def pipe(r, w):
    try:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
        if w.can_write_eof():
            w.write_eof()
    except OSError:
        w.close()
async def handle(r, w):
    try:
        r2, w2 = await asyncio.open_connection("127.0.0.1", 2376)
    except OSError:
        w.close()
        return
    await asyncio.gather(pipe(r, w2), pipe(r2, w))
    w.close(); w2.close()
async def main():
    server = await asyncio.start_server(handle, sock=lsock)
    with open(port_file + ".tmp", "w") as f:
        f.write(str(lsock.getsockname()[1]))
    os.replace(port_file + ".tmp", port_file)
    await server.serve_forever()
asyncio.run(main())
"""


def _start_daemon(state: dict, wait_s: float):
    import subprocess
    import sys

    import docker

    root = state["root"]
    sock = f"{root}/docker.sock"
    argv = ["dockerd", "--host", f"unix://{sock}", "--data-root", f"{root}/data",
            "--exec-root", f"{root}/exec", "--pidfile", f"{root}/docker.pid", "--bridge", "none", "--iptables=false"]
    if state.get("tls"):
        argv += ["--host", "tcp://127.0.0.1:2376", "--tlsverify", "--tlscacert", state["ca_cert"], "--tlscert",
                 state["server_cert"], "--tlskey", state["server_key"]]
    with open(f"{root}/dockerd.log", "ab") as log_file:
        # in its own network namespace: a second daemon in the host's would delete or reconfigure the first one's
        # docker0 (with --bridge none it removes it); the socket is a file, reachable from here all the same
        # (its loopback up: the TLS listener is on 127.0.0.1 there)
        proc = subprocess.Popen(["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *argv],
                                stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            docker.DockerClient(base_url=f"unix://{sock}", timeout=5).ping()
            break
        except Exception as e:  # noqa: BLE001 - not up yet
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                with open(f"{root}/dockerd.log", errors="replace") as f:
                    raise RuntimeError(f"dockerd on {sock} did not start ({e}): {f.read()[-3000:]}") from e
            time.sleep(0.3)
    if state.get("tls"):
        port_file = f"{root}/relay.port"
        with contextlib.suppress(FileNotFoundError):
            os.remove(port_file)
        with open(f"{root}/relay.log", "ab") as relay_log:
            state["relay"] = subprocess.Popen([sys.executable, "-c", _RELAY, f"/proc/{proc.pid}/ns/net", port_file],
                                              stdout=relay_log, stderr=subprocess.STDOUT, start_new_session=True)
        while not os.path.exists(port_file):
            if state["relay"].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the TLS relay to the second dockerd did not start")
            time.sleep(0.05)
        with open(port_file) as f:
            state["tcp_url"] = f"tcp://127.0.0.1:{f.read().strip()}"
    return proc
