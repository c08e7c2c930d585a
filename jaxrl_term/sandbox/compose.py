"""Compose environments: the services of a task's ``environment/docker-compose.yaml`` beside the agent's sandbox.

Harbor's Docker environment runs ``docker compose`` with its own base file: a service ``main`` (built from
``environment/Dockerfile`` or ``docker_image``, kept alive) that the agent works in, plus whatever services the
task's compose file adds. Docker Compose v2 is not installable on every machine this runs on (it is a Go binary
from GitHub; Debian 12 packages only the end-of-life v1), and the agent's container needs our own confinement
(read-only toolkit, persistent shell, labels the reaper knows), so this module runs the compose subset tasks use
on the Docker SDK directly: one bridge network per sandbox (``internal`` when the task has no network, so the
services reach each other but nothing else), each service a container on it under its service name, started in
``depends_on`` order and waited for (``healthcheck`` -> healthy, else running), every one carrying the sandbox's
owner labels so ``reap`` removes them with the agent's container. The agent's container joins the network as
``main``. The network is always internal: services never reach outside (in Harbor they may); the agent's
container reaches the outside only through the public network its phase is given (tasks/env.py).

Supported per service: ``build`` (a context inside ``environment/``, optional ``dockerfile``), ``image`` (present
on the engine: nothing is pulled), ``environment``, ``command``, ``entrypoint``, ``depends_on``, ``healthcheck``,
``working_dir``, ``user``, ``hostname``, ``expose``, ``labels``, ``restart`` (ignored: a sandbox lives minutes),
``deploy.resources.limits`` (cpus, memory). ``main`` takes ``build`` (context ``environment/`` itself),
``image``, ``environment``,
``depends_on``, ``working_dir``, ``expose``, ``labels``, ``deploy``. Anything else (``ports``, ``volumes``,
``networks``, ``privileged``, ...) is refused with the file and key named. Values are interpolated as Compose
does (``${VAR}``, ``${VAR:-default}``, ``$$``) from the task's ``[environment] env`` (never from the whole host
environment) and Harbor's ``CPUS`` / ``MEMORY``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import uuid
from collections.abc import Mapping
from typing import Any

import yaml

from jaxrl_term.tasks.task import TaskFormatError

MAIN = "main"
SERVICE_KEYS = {"build", "image", "environment", "command", "entrypoint", "depends_on", "healthcheck", "working_dir",
                "user", "hostname", "expose", "labels", "restart", "deploy"}
MAIN_KEYS = {"build", "image", "environment", "depends_on", "working_dir", "expose", "labels", "deploy"}
TOP_KEYS = {"services", "version", "name"}
HEALTH_WAIT_S = 180.0  # after a healthcheck's start_period
PROJECT_LABEL = "jaxrl_term.compose"


@dataclasses.dataclass(frozen=True)
class Service:
    name: str
    spec: Mapping[str, Any]

    @property
    def depends_on(self) -> list[str]:
        d = self.spec.get("depends_on") or []
        return list(d) if isinstance(d, (list, dict)) else []


@dataclasses.dataclass(frozen=True)
class ComposeSpec:
    services: Mapping[str, Service]  # without main
    main: Mapping[str, Any]  # main's overrides ({} when the file does not name it)

    def order(self) -> list[Service]:
        """Services in ``depends_on`` order (a dependency before what needs it)."""
        out: list[Service] = []
        seen: set[str] = set()

        def visit(name: str, path: tuple[str, ...]):
            if name in seen or name == MAIN:
                return
            for dep in self.services[name].depends_on:
                visit(dep, path + (name,))
            seen.add(name)
            out.append(self.services[name])

        for name in self.services:
            visit(name, ())
        return out


def parse_compose(text: str, where: str) -> ComposeSpec:
    """Validate a compose file against the subset above; every error names ``where`` and the key."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise TaskFormatError(f"{where}: invalid YAML ({str(e).splitlines()[0]})") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("services"), dict) or not doc["services"]:
        raise TaskFormatError(f"{where}: expected a mapping with a non-empty 'services' mapping")
    for key, value in doc.items():
        if key not in TOP_KEYS and value:
            raise TaskFormatError(f"{where}: top-level {key!r} is not supported by jaxrl_term's compose sandboxes "
                                  f"(supported: {sorted(TOP_KEYS)}); one network per sandbox is made for you")
    services: dict[str, Service] = {}
    main: dict[str, Any] = {}
    for name, spec in doc["services"].items():
        spec = spec or {}
        if not isinstance(spec, dict):
            raise TaskFormatError(f"{where}: services.{name} must be a mapping")
        if not re.fullmatch(r"[a-zA-Z0-9][a-zA-Z0-9_.-]*", str(name)):
            raise TaskFormatError(f"{where}: services.{name}: not a valid service name")
        allowed = MAIN_KEYS if name == MAIN else SERVICE_KEYS
        for key in spec:
            if key not in allowed:
                why = ("the agent's service runs jaxrl_term's own keep-alive and shell" if name == MAIN else
                       "it would reach outside the sandbox or is not implemented")
                raise TaskFormatError(f"{where}: services.{name}.{key} is not supported ({why}); supported keys: "
                                      f"{sorted(allowed)}")
        if name != MAIN and not spec.get("build") and not spec.get("image"):
            raise TaskFormatError(f"{where}: services.{name} needs 'build' or 'image'")
        deploy = spec.get("deploy") or {}
        extra = set(deploy) - {"resources"} or set((deploy.get("resources") or {})) - {"limits"} or \
            set(((deploy.get("resources") or {}).get("limits") or {})) - {"cpus", "memory"}
        if extra:
            raise TaskFormatError(f"{where}: services.{name}.deploy: only resources.limits.cpus/memory are "
                                  f"supported, not {sorted(extra)}")
        b = spec.get("build")
        if isinstance(b, dict) and set(b) - {"context", "dockerfile"}:
            raise TaskFormatError(f"{where}: services.{name}.build: only context and dockerfile are supported, not "
                                  f"{sorted(set(b) - {'context', 'dockerfile'})}")
        if name == MAIN and b:
            ctx = b if isinstance(b, str) else b.get("context", ".")
            if str(ctx).strip().removeprefix("./").rstrip("/") not in ("", "."):
                raise TaskFormatError(f"{where}: services.main.build.context {ctx!r}: the agent's image is built "
                                      "from environment/ itself; move its Dockerfile there")
        if name == MAIN:
            main = dict(spec)
        else:
            services[str(name)] = Service(str(name), spec)
    for svc in [*services.values(), Service(MAIN, main)]:
        for dep in svc.depends_on:
            if dep not in services and dep != MAIN:
                raise TaskFormatError(f"{where}: services.{svc.name}.depends_on names {dep!r}, which is not a service")
            if dep == MAIN and svc.name != MAIN:
                raise TaskFormatError(f"{where}: services.{svc.name} depends on main: main starts last (the agent's "
                                      "sandbox); make the dependency the other way round")
    spec = ComposeSpec(services, main)
    _check_cycles(spec, where)
    return spec


def _check_cycles(spec: ComposeSpec, where: str) -> None:
    state: dict[str, int] = {}

    def visit(name: str, path: list[str]):
        if state.get(name) == 1:
            raise TaskFormatError(f"{where}: depends_on cycle: {' -> '.join(path + [name])}")
        if state.get(name) == 2:
            return
        state[name] = 1
        for dep in spec.services[name].depends_on:
            visit(dep, path + [name])
        state[name] = 2

    for n in spec.services:
        visit(n, [])


_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-(.*?))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Compose's variable substitution on every string of ``value`` (unset without default: empty, as Compose)."""
    if isinstance(value, str):
        def sub(m: re.Match) -> str:
            if m.group(0) == "$$":
                return "$"
            name = m.group(1) or m.group(3)
            if name in env and (env[name] != "" or ":-" not in m.group(0)):
                return env[name]
            return m.group(2) or ""
        return _VAR.sub(sub, value)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


def environment_of(spec: Mapping[str, Any]) -> dict[str, str]:
    e = spec.get("environment") or {}
    if isinstance(e, list):
        return dict((s.split("=", 1) + [""])[:2] for s in map(str, e))
    return {str(k): "" if v is None else str(v) for k, v in e.items()}


def _seconds(v: Any, default: float) -> float:
    """Compose durations: ``30s``, ``1m30s``, ``500ms``, or a number of seconds."""
    if v is None:
        return default
    if isinstance(v, (int, float)):
        return float(v)
    total, units = 0.0, {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    for num, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", str(v)):
        total += float(num) * units[unit]
    return total or default


def _memory_bytes(v: Any) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)b?\s*", str(v), re.I)
    if not m:
        raise TaskFormatError(f"deploy.resources.limits.memory {v!r}: use a size like 512M or 1G")
    return int(float(m.group(1)) * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}[m.group(2).lower()])


def context_files(files: Mapping[str, Any], dockerfile: str | None, build: Any, where: str):
    """(Dockerfile text, {relative path: (bytes, mode)}) of a service's ``build`` inside ``environment/``."""
    ctx, name = (build, "Dockerfile") if isinstance(build, str) else (build.get("context", "."),
                                                                      build.get("dockerfile", "Dockerfile"))
    ctx = str(ctx).strip().removeprefix("./").rstrip("/")
    ctx = "" if ctx in (".", "") else ctx
    if ctx.startswith("/") or ".." in ctx.split("/"):
        raise TaskFormatError(f"{where}: build context {ctx!r} must stay inside environment/")
    prefix = f"{ctx}/" if ctx else ""
    sub = {k[len(prefix):]: (v.data, v.mode) for k, v in files.items() if k.startswith(prefix)}
    path = f"{prefix}{name}"
    if path == "Dockerfile" and dockerfile is not None:
        text = dockerfile
    elif path in files:
        text = files[path].data.decode()
    else:
        raise TaskFormatError(f"{where}: build needs {path!r} in environment/, which is not there")
    sub.pop(name, None)
    return text, sub


@dataclasses.dataclass
class Project:
    """A running compose environment: its network and service containers (the agent's container apart)."""

    network: str
    containers: list
    client: Any

    async def close(self) -> None:
        """Every container labelled with this project (also one whose creation was cancelled half-way), then
        the network. On an engine of a pool that is out of rotation (it stopped answering) nothing is asked of
        it: what is known is removed when a probe finds it back (``engines.EnginePool.probe``), the rest by the
        reaper."""
        from jaxrl_term.sandbox.docker import _call
        from jaxrl_term.sandbox.engines import CURRENT

        engine = CURRENT.get()
        if engine is not None and not engine.healthy:
            for c in self.containers:
                engine.orphan("container", c.id)
            engine.orphan("network", self.network)
            return
        try:
            listed = await _call(self.client.containers.list, all=True, sparse=True,
                                 filters={"label": f"{PROJECT_LABEL}={self.network}"})
        except Exception:  # noqa: BLE001 - the engine is gone: the reaper catches the rest
            listed = []
        for c in {c.id: c for c in [*self.containers, *listed]}.values():
            try:
                await _call(c.remove, force=True, v=True)
            except Exception:  # noqa: BLE001 - already gone (the reaper); nothing else to free
                pass
        try:
            net = await _call(self.client.networks.get, self.network)
            await _call(net.remove)
        except Exception:  # noqa: BLE001
            pass


async def start(spec: ComposeSpec, *, files: Mapping[str, Any], dockerfile: str | None, builder, labels: dict,
                internal: bool, env: Mapping[str, str], limits, where: str, build_timeout_s: float) -> Project:
    """Make the sandbox's network and start every service but ``main`` on it; the caller starts ``main``."""
    from jaxrl_term.sandbox import docker as dk
    from jaxrl_term.sandbox.base import SandboxError

    cl = dk.client()
    import docker

    name = f"jaxrl-{uuid.uuid4().hex[:12]}"
    await dk._call(cl.networks.create, name, driver="bridge", internal=internal, labels=dict(labels))
    net = name
    project = Project(net, [], cl)
    try:
        for svc in spec.order():
            s = interpolate(dict(svc.spec), env)
            if s.get("build"):
                text, ctx = context_files(files, dockerfile, s["build"], f"{where}: services.{svc.name}")
                image = await builder.ensure(text, ctx, timeout_s=build_timeout_s)
            else:
                image = str(s["image"])
                from jaxrl_term.tasks.env import ensure_on_engine

                try:
                    await ensure_on_engine(image)  # several engines: copied from a peer that has it
                    await dk._call(cl.images.get, image)
                except docker.errors.ImageNotFound as e:
                    raise SandboxError(f"{where}: services.{svc.name}.image {image!r} is not on this Docker engine "
                                       "and jaxrl_term never pulls; load or build it first, or give a 'build'") from e
            lim = ((s.get("deploy") or {}).get("resources") or {}).get("limits") or {}
            kwargs = dict(
                detach=True, network=net, labels={**labels, "jaxrl_term.service": svc.name, PROJECT_LABEL: net},
                networking_config={net: cl.api.create_endpoint_config(aliases=[svc.name])},
                environment=environment_of(s) or None, hostname=s.get("hostname") or svc.name,
                nano_cpus=int(float(lim.get("cpus", limits.cpus)) * 1e9),
                mem_limit=_memory_bytes(lim["memory"]) if "memory" in lim else f"{limits.memory_mb}m",
                pids_limit=limits.pids, cap_drop=list(dk.DROPPED_CAPS), security_opt=["no-new-privileges"],
                init=True,
            )
            for key, arg in (("command", "command"), ("entrypoint", "entrypoint"), ("working_dir", "working_dir"),
                             ("user", "user")):
                if s.get(key) is not None:
                    kwargs[arg] = s[key]
            hc = s.get("healthcheck")
            if hc and not hc.get("disable"):
                test = hc.get("test")
                test = ["CMD-SHELL", test] if isinstance(test, str) else test
                kwargs["healthcheck"] = {"test": test,
                                         "interval": int(_seconds(hc.get("interval"), 5) * 1e9),
                                         "timeout": int(_seconds(hc.get("timeout"), 30) * 1e9),
                                         "retries": int(hc.get("retries", 3)),
                                         "start_period": int(_seconds(hc.get("start_period"), 0) * 1e9)}
            try:
                c = await dk._call(cl.containers.create, image, kwargs.pop("command", None), **kwargs)
            except docker.errors.APIError as e:
                raise SandboxError(f"{where}: services.{svc.name}: cannot create its container: "
                                   f"{e.explanation or e}") from e
            project.containers.append(c)
            await dk._call(c.start)
            await _wait_ready(c, svc.name, where, "healthcheck" in kwargs,
                              HEALTH_WAIT_S + kwargs.get("healthcheck", {}).get("start_period", 0) / 1e9)
        return project
    except BaseException:
        await project.close()
        raise


async def _wait_ready(c, name: str, where: str, healthcheck: bool, wait_s: float) -> None:
    from jaxrl_term.sandbox.base import SandboxError
    from jaxrl_term.sandbox.docker import _call

    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        await _call(c.reload)
        st = c.attrs.get("State") or {}
        health = (st.get("Health") or {}).get("Status")
        if st.get("Status") in ("exited", "dead"):
            logs = (await _call(c.logs, tail=20)).decode(errors="replace")
            raise SandboxError(f"{where}: services.{name} exited (code {st.get('ExitCode')}) before the agent "
                               f"started: {logs.strip()[-1500:]}")
        if st.get("Running") and (not healthcheck or health == "healthy"):
            return
        if health == "unhealthy":
            raise SandboxError(f"{where}: services.{name} is unhealthy (its healthcheck failed)")
        if loop.time() > deadline:
            raise SandboxError(f"{where}: services.{name} not ready after {wait_s:.0f}s (health {health})")
        await asyncio.sleep(0.2)
