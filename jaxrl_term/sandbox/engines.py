"""Sandboxes over several Docker engines: placement, capacity, health, base images and metrics per engine.

Every node of a cluster runs a Docker daemon; the agent loop (light, async) stays where it is and places each
sandbox on one of ``sandbox.docker.hosts`` through Docker's remote API (``unix://``, ``tcp://`` with TLS,
``ssh://``). ``EnginePool.place()`` picks the least-loaded healthy engine (load = open sandboxes / capacity),
preferring one that already has the task's image, waits while every engine is full, and makes that engine the
current one for the sandbox's whole life (a context variable: ``docker.client()`` answers with its client, so
image builds, toolkit and toolchain volumes, containers, networks all land there). An engine that stops
answering is taken out of rotation for ``cooldown_s`` (its episodes fail and are retried elsewhere by the
rollout's retry loop: never scored) and tried again after.

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
import time
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


class Engine:
    def __init__(self, cfg: HostCfg):
        if cfg.capacity < 1:
            raise ValueError(f"sandbox.docker.hosts[{cfg.url}].capacity={cfg.capacity}: must be >= 1")
        if not cfg.url.startswith(("unix://", "tcp://", "ssh://", "http://", "https://")):
            raise ValueError(f"sandbox.docker.hosts url {cfg.url!r}: use unix://, tcp:// (with TLS) or ssh://")
        self.cfg, self.url, self.capacity = cfg, cfg.url, cfg.capacity
        self.name = cfg.name or cfg.url
        self._client = None
        self.open = 0
        self.images: set[str] = set()  # task recipes (tasks/env.recipe_key) whose image is here
        self.bases_ready = False
        self.pool: EnginePool | None = None
        self.down_until = 0.0
        self.created = self.failures = self.commands = 0
        self.create_s = self.command_s = 0.0

    def _tls(self):
        import docker

        if not (self.cfg.tls_verify or self.cfg.client_cert):
            return None
        return docker.tls.TLSConfig(
            client_cert=(self.cfg.client_cert, self.cfg.client_key) if self.cfg.client_cert else None,
            ca_cert=self.cfg.ca_cert, verify=self.cfg.ca_cert if self.cfg.tls_verify else False)

    def client(self):
        if self._client is None:
            import docker

            self._client = docker.DockerClient(base_url=self.url, tls=self._tls(), timeout=300, max_pool_size=128,
                                               use_ssh_client=self.url.startswith("ssh://"))
        return self._client

    @property
    def healthy(self) -> bool:
        return time.monotonic() >= self.down_until

    def ping(self, timeout_s: float = 5.0) -> bool:
        """Whether the engine answers within ``timeout_s`` (a fresh connection: the pooled ones may hang)."""
        try:
            import docker

            api = docker.APIClient(base_url=self.url, tls=self._tls(), timeout=timeout_s,
                                   use_ssh_client=self.url.startswith("ssh://"))
            try:
                return bool(api.ping())
            finally:
                api.close()
        except Exception:  # noqa: BLE001 - any failure to answer is "down"
            return False

    def mark_down(self, cooldown_s: float, why: str) -> None:
        self.down_until = time.monotonic() + cooldown_s
        log.warning("Docker engine %s out of rotation for %.0fs: %s", self.name, cooldown_s, why)

    def metrics(self) -> dict[str, float]:
        p = f"engine/{self.name}"
        return {f"{p}/open": self.open, f"{p}/created": self.created, f"{p}/failures": self.failures,
                f"{p}/create_ms": 1e3 * self.create_s / max(1, self.created),
                f"{p}/command_ms": 1e3 * self.command_s / max(1, self.commands), f"{p}/up": float(self.healthy)}


class EnginePool:
    def __init__(self, hosts: Sequence[HostCfg | dict], *, cooldown_s: float = 60.0):
        if not hosts:
            raise ValueError("sandbox.docker.hosts is empty")
        self.engines = [Engine(h if isinstance(h, HostCfg) else HostCfg(**h)) for h in hosts]
        for e in self.engines:
            e.pool = self
        names = [e.name for e in self.engines]
        if len(set(names)) != len(names):
            raise ValueError(f"sandbox.docker.hosts: names must be unique, got {names}")
        self.cooldown_s = cooldown_s

    def _pick(self, prefer: str | None) -> Engine | None:
        free = [e for e in self.engines if e.healthy and e.open < e.capacity]
        if not free:
            return None
        return min(free, key=lambda e: (prefer is not None and prefer not in e.images, e.open / e.capacity,
                                        self.engines.index(e)))

    @contextlib.asynccontextmanager
    async def place(self, prefer: str | None = None):
        """``async with pool.place(image) as engine``: the sandbox opened inside lives on ``engine``."""
        from jaxrl_term.sandbox.base import SandboxError

        while (engine := self._pick(prefer)) is None:
            if not any(e.healthy for e in self.engines):
                soonest = min(e.down_until for e in self.engines) - time.monotonic()
                if soonest > 0:
                    raise SandboxError(f"no Docker engine answers (all {len(self.engines)} out of rotation; the "
                                       f"first is retried in {soonest:.0f}s)")
            await asyncio.sleep(0.05)
        engine.open += 1
        token = CURRENT.set(engine)
        error: BaseException | None = None
        try:
            yield engine
        except BaseException as e:
            error = e
            raise
        finally:
            CURRENT.reset(token)
            engine.open -= 1
            # after every sandbox (the agent loop reports a lost sandbox as an invalid episode, not an exception):
            # an engine that does not answer leaves the rotation before the episode is retried
            if not isinstance(error, (asyncio.CancelledError, KeyboardInterrupt)):
                engine.failures += error is not None
                if not await asyncio.to_thread(engine.ping):
                    why = f"{type(error).__name__}: {error}" if error is not None else "it stopped answering"
                    engine.mark_down(self.cooldown_s, why)

    def copy_base_images(self, engine: Engine) -> None:
        """The base images (``images.BASE_IMAGES``) onto ``engine``: copied from a peer that has them (the other
        engines, then this machine's default one), else built there by the same set-up code as ``make sandbox``."""
        from jaxrl_term.sandbox.base import SandboxError
        from jaxrl_term.sandbox.docker import default_client
        from jaxrl_term.sandbox.images import BASE_IMAGES, build_base_image, resolve_ca_bundle

        peers = [e.client() for e in self.engines if e is not engine and e.healthy]
        try:
            peers.append(default_client())
        except Exception:  # noqa: BLE001 - no default engine on this machine
            pass
        for spec in BASE_IMAGES.values():
            if ensure_base_image(engine.client(), spec.name, peers):
                continue
            if engine.cfg.tls_verify or engine.cfg.client_cert or engine.url.startswith("ssh://"):
                raise SandboxError(f"Docker engine {engine.name} has no {spec.name} and no peer engine has it: "
                                   f"run `DOCKER_HOST={engine.url} python -m jaxrl_term.sandbox.images setup` "
                                   "(with DOCKER_TLS_VERIFY / DOCKER_CERT_PATH for TLS) once")
            log.info("building %s on engine %s (no peer has it)", spec.name, engine.name)
            build_base_image(engine.client(), spec, ca_bundle=resolve_ca_bundle("auto"), host=engine.url)
        engine.bases_ready = True

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for e in self.engines:
            out.update(e.metrics())
        return out


def current() -> Engine | None:
    return CURRENT.get()


def ensure_base_image(engine_client: Any, name: str, peers: Sequence[Any]) -> bool:
    """``name`` on the engine of ``engine_client``: copied from the first peer engine that has it (save/load
    through the API). False when no peer has it."""
    import docker

    try:
        engine_client.images.get(name)
        return True
    except docker.errors.ImageNotFound:
        pass
    for peer in peers:
        try:
            img = peer.images.get(name)
        except Exception:  # noqa: BLE001 - that peer lacks it or is down
            continue
        t0 = time.monotonic()
        engine_client.images.load(b"".join(img.save(named=True)))
        log.info("base image %s copied to engine %s in %.1fs", name, engine_client.api.base_url,
                 time.monotonic() - t0)
        return True
    return False


@contextlib.contextmanager
def local_daemon(root: str | None = None, wait_s: float = 90.0):
    """A second Docker daemon on this machine (root only) on its own socket, data root and exec root, in its own
    network namespace, without a default bridge or iptables rules: what tests and
    ``experiments/bench/sandbox_pool.py`` place sandboxes on.
    Yields ``{"url", "root", "proc"}``; ``restart(state)`` starts it again on the same data root."""
    import shutil
    import subprocess
    import tempfile

    root = root or tempfile.mkdtemp(prefix="jrt-d2-", dir="/tmp")  # short: a socket path has at most 107 bytes
    state = {"root": root, "url": f"unix://{root}/docker.sock"}
    state["proc"] = _start_daemon(root, wait_s)
    try:
        yield state
    finally:
        p = state["proc"]
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        subprocess.run(["bash", "-c", f"grep -o ' {root}[^ ]*' /proc/mounts | sort -r | xargs -r umount -l"],
                       capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


def restart(state: dict, wait_s: float = 90.0) -> None:
    state["proc"] = _start_daemon(state["root"], wait_s)


def _start_daemon(root: str, wait_s: float):
    import subprocess

    import docker

    sock = f"{root}/docker.sock"
    with open(f"{root}/dockerd.log", "ab") as log_file:
        # in its own network namespace: a second daemon in the host's would delete or reconfigure the first one's
        # docker0 (with --bridge none it removes it); the socket is a file, reachable from here all the same
        proc = subprocess.Popen(["unshare", "--net", "dockerd", "--host", f"unix://{sock}", "--data-root", f"{root}/data",
                                 "--exec-root", f"{root}/exec", "--pidfile", f"{root}/docker.pid", "--bridge", "none",
                                 "--iptables=false"], stdout=log_file, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            docker.DockerClient(base_url=f"unix://{sock}", timeout=5).ping()
            return proc
        except Exception as e:  # noqa: BLE001 - not up yet
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                with open(f"{root}/dockerd.log", errors="replace") as f:
                    raise RuntimeError(f"dockerd on {sock} did not start ({e}): {f.read()[-3000:]}") from e
            time.sleep(0.3)
