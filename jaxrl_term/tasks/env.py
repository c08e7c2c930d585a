"""A sandbox set up for one task: its image built (Docker) or its Dockerfile replayed (local backend)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import shlex
from collections.abc import AsyncIterator

from jaxrl_term.sandbox import toolchain
from jaxrl_term.sandbox.base import Sandbox, SandboxError, SandboxPool, open_sandbox
from jaxrl_term.tasks.task import NO_NETWORK, PUBLIC, NetworkPolicy, Task, TaskFormatError, resolve_env

log = logging.getLogger(__name__)


async def image_for(task: Task, builder) -> str:
    """The task's image: prebuilt, or built from its Dockerfile (cached by content)."""
    env = task.environment
    if env.dockerfile:
        files = {k: (v.data, v.mode) for k, v in env.files.items()}
        return await builder.ensure(env.dockerfile, files, timeout_s=env.build_timeout_s)
    assert env.image
    await ensure_on_engine(env.image)
    return env.image


async def ensure_on_engine(image: str) -> None:
    """Several engines (sandbox.docker.hosts): a prebuilt image copied onto the sandbox's engine from a peer that
    has it (never pulled)."""
    import asyncio

    from jaxrl_term.sandbox.engines import CURRENT

    engine = CURRENT.get()
    if engine is not None and engine.pool is not None:
        await asyncio.to_thread(engine.pool.copy_image, engine, image)


def recipe_key(task: Task) -> str:
    """What makes a task's image (its Dockerfile and context, or its image name): placement prefers an engine
    that has it."""
    import hashlib

    env = task.environment
    h = hashlib.sha256((env.dockerfile or env.image or "").encode())
    for k, v in sorted(env.files.items()):
        h.update(k.encode() + v.data)
    return h.hexdigest()[:16]


NETWORK_OVERRIDES = ("task", "none", "public")  # sandbox.agent_network / sandbox.verifier_network
PHASE_KEYS = ("agent_network", "verifier_network")


def phase_policies(task: Task, agent: str = "task", verifier: str = "task") -> dict[str, NetworkPolicy]:
    """The network each phase gets: the task's own policy (Harbor's ``[agent]`` / ``[verifier]`` over
    ``[environment]``), or the run's override (``none``: never; ``public``: always). ``allowlist`` is refused:
    our sandboxes enforce no per-host egress rules."""
    out = {}
    for phase, override in (("agent", agent), ("verifier", verifier)):
        if override not in NETWORK_OVERRIDES:
            raise ValueError(f"sandbox.{phase}_network={override!r}; use one of {NETWORK_OVERRIDES}")
        policy = task.phase_network(phase) if override == "task" else PUBLIC if override == "public" else NO_NETWORK
        if policy.mode == "allowlist":
            raise TaskFormatError(f"task {task.id}: the {phase} phase's network_mode = 'allowlist' (allowed_hosts "
                                  f"{list(policy.allowed_hosts)}) is not supported by jaxrl_term's sandboxes; set "
                                  f"sandbox.{phase}_network=public or none to decide for it")
        out[phase] = policy
    return out


def task_problems(tasks, limits: dict, backend: str) -> list[str]:
    """What would stop a task's sandbox from opening as the task asks, found before any model or sandbox starts:
    a network policy we cannot enforce, an ``${VAR}`` that is not set, a compose environment or a change of
    network between phases on the local backend."""
    out = []
    for t in tasks:
        try:
            phases = phase_policies(t, limits.get("agent_network", "task"), limits.get("verifier_network", "task"))
            resolve_env(t.environment.env, f"task {t.id}: [environment]")
            resolve_env(t.verifier_env, f"task {t.id}: [verifier]")
        except (TaskFormatError, ValueError) as e:
            out.append(str(e))
            continue
        online = [ph for ph, p in phases.items() if p.online]
        if backend == "local" and t.environment.compose:
            out.append(f"task {t.id}: a compose environment needs sandbox=docker")
        elif backend == "local" and online and limits.get(f"{online[0]}_network") != "public":
            out.append(f"task {t.id}: its {online[0]} phase asks for network, and on the local backend that is the "
                       "host's own network (its services on localhost included); set "
                       f"sandbox.{online[0]}_network=none, or =public to accept that")
        elif backend == "local" and phases["agent"].online != phases["verifier"].online:
            out.append(f"task {t.id}: its agent phase has {'' if phases['agent'].online else 'no '}network and its "
                       f"verifier phase {'has' if phases['verifier'].online else 'has none'}: the local backend "
                       "cannot switch network between phases; use sandbox=docker or set sandbox.agent_network / "
                       "sandbox.verifier_network to the same value")
    return out


def check_tasks_open(tasks, limits: dict, backend: str) -> None:
    """``task_problems`` as an exception (train and eval call it when the tasks are loaded)."""
    problems = task_problems(tasks, limits, backend)
    if problems:
        more = f"\n... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise TaskFormatError(f"{len(problems)} task(s) cannot run as they ask:\n" + "\n".join(problems[:20]) + more)


def _limits(task: Task, limits: dict, phases: dict[str, NetworkPolicy]) -> dict:
    out = {k: v for k, v in limits.items() if k not in PHASE_KEYS}
    env = task.environment
    out["workdir"] = env.workdir
    if env.cpus is not None:
        out["cpus"] = env.cpus
    if env.memory_mb is not None:
        out["memory_mb"] = env.memory_mb
    if env.storage_mb is not None:  # Harbor's storage_mb, as cpus and memory: the task's own value
        out["disk_gb"] = env.storage_mb / 1024
    # attached at creation when any phase needs the network (a container made without one cannot get one later)
    out["network"] = any(p.online for p in phases.values())
    task_env = resolve_env(env.env, f"task {task.id}: [environment]") if env.env else {}
    if task_env:
        out["env"] = tuple(sorted({**dict(out.get("env") or ()), **task_env}.items()))
    return out


@contextlib.asynccontextmanager
async def open_task_sandbox(
    task: Task,
    *,
    backend: str = "docker",
    builder=None,
    pool: SandboxPool | None = None,
    labels: dict[str, str] | None = None,
    engines=None,
    on_engine=None,
    **limits,
) -> AsyncIterator[Sandbox]:
    """``async with open_task_sandbox(task, builder=ImageBuilder()) as sb`` -> a sandbox in the task's initial
    state, in its agent phase. Docker: the task image (built on first use), with the verifier's toolchain volume
    mounted read-only (``sandbox/toolchain.py``); a compose environment's other services started on the sandbox's
    own network (``sandbox/compose.py``). Local: the host system with the Dockerfile's WORKDIR / COPY / ENV / RUN
    steps replayed inside the sandbox (no package installs).

    Network per phase: ``agent_network`` / ``verifier_network`` (``task`` | ``none`` | ``public``) decide it;
    ``sb.phase_network`` holds each phase's answer and the verifier switches to its own (``Sandbox.set_network``).
    The task's ``[environment] env`` is resolved from this process's environment (``${VAR}``) and set in the
    sandbox; ``[environment] healthcheck`` must pass before this returns."""
    if "network" in limits:
        raise TypeError("open_task_sandbox(network=...) was replaced by agent_network= / verifier_network= "
                        "(task | none | public): the network is decided per phase")
    if pool is not None:  # the pool's settings, then the caller's: the same for this sandbox and sb.reopen
        limits = {**pool.default_limits, **pool.phase_overrides, **limits}
    overrides = {k: limits.get(k, "task") for k in PHASE_KEYS}
    phases = phase_policies(task, overrides["agent_network"], overrides["verifier_network"])
    if backend == "local":
        problems = task_problems([task], limits, backend)
        if problems:
            raise SandboxError(problems[0])
    lim = _limits(task, limits, phases)
    labels = {"jaxrl_term.task": task.id[:63], **(labels or {})}
    env = task.environment
    engines = engines if engines is not None else getattr(pool, "engines", None)
    async with contextlib.AsyncExitStack() as stack:
        mounts = None
        if backend == "docker" and engines is not None:  # several engines: this sandbox's, for its whole life
            if pool is not None:  # the run's cap first, then a place on an engine
                await stack.enter_async_context(pool.slot())
            engine = await stack.enter_async_context(engines.place(prefer=recipe_key(task), on=on_engine))
            labels = {**labels, "jaxrl_term.engine": engine.name[:63]}
        if backend == "docker":
            if builder is None:
                from jaxrl_term.sandbox.images import ImageBuilder

                builder = ImageBuilder()
            image = await image_for(task, builder)
            if engines is not None:
                engine.images.add(recipe_key(task))
            # the verifier's own python, copied from the pristine image (made once per image, before any agent runs)
            tc = await toolchain.for_image(image)
            mounts = {tc.volume: toolchain.MOUNT} if tc.volume else None
            if env.compose:
                if pool is not None and engines is None:  # the services count against the cap with their sandbox
                    await stack.enter_async_context(pool.slot())
                lim = await _start_compose(task, builder, lim, labels, stack)
        else:
            image = None
        held = backend == "docker" and (bool(env.compose) or engines is not None)
        cm = (pool.sandbox(image, labels=labels, mounts=mounts, slot_held=held, **lim) if pool
              else open_sandbox(backend, image, labels=labels, mounts=mounts, **lim))
        sb = await stack.enter_async_context(cm)
        sb.phase_network = {phase: p.online for phase, p in phases.items()}
        # a fresh sandbox of the same task with the same settings (the verifier's sabotage / network checks)
        # on the same engine, over its capacity (this episode holds a place there): a check never waits for its
        # own episode's place, and an engine that died under the verifier fails the check instead of passing it
        # on a healthy one (which would read as sabotage)
        sb.reopen = functools.partial(open_task_sandbox, task, backend=backend, builder=builder, labels=labels,
                                      engines=engines, on_engine=engine if engines is not None else None, **limits)
        if lim["network"] and not phases["agent"].online:
            await sb.set_network(False)  # the verifier phase gets it back; the agent never sees it
        if backend == "local":
            await replay_dockerfile(task, sb)
        if env.healthcheck is not None:
            await run_healthcheck(task, sb)
        yield sb


async def _start_compose(task: Task, builder, lim: dict, labels: dict, stack) -> dict:
    """Start a compose environment's services; the agent's sandbox joins their network as ``main``."""
    from jaxrl_term.sandbox import compose
    from jaxrl_term.sandbox.base import SandboxLimits
    from jaxrl_term.sandbox.docker import owner_labels

    env = task.environment
    where = f"task {task.id}: environment/docker-compose.yaml"
    spec = compose.parse_compose(env.compose, where)

    # interpolation from the task's own [environment] env (itself resolved from named host variables) and
    # Harbor's compose variables: never the whole host environment (a task file must not read the trainer's keys)
    variables = {**dict(lim.get("env") or ()), "CPUS": str(lim.get("cpus", 1)),
                 "MEMORY": f"{lim.get('memory_mb', 2048)}M"}
    base = SandboxLimits(**{k: v for k, v in lim.items() if k in SandboxLimits.__dataclass_fields__})
    project = await compose.start(spec, files=env.files, dockerfile=env.dockerfile, builder=builder,
                                  labels={**owner_labels(), **labels}, internal=True, env=variables, limits=base,
                                  where=where, build_timeout_s=env.build_timeout_s)
    stack.push_async_callback(project.close)
    main = compose.interpolate(dict(spec.main), variables)
    out = dict(lim, task_network=project.network)
    main_env = compose.environment_of(main)
    if main_env:
        out["env"] = tuple(sorted({**dict(out.get("env") or ()), **main_env}.items()))
    if main.get("working_dir"):
        out["workdir"] = str(main["working_dir"])
    limits_ = ((main.get("deploy") or {}).get("resources") or {}).get("limits") or {}
    if "cpus" in limits_:
        out["cpus"] = float(limits_["cpus"])
    if "memory" in limits_:
        out["memory_mb"] = compose._memory_bytes(limits_["memory"]) // 2**20
    return out


async def run_healthcheck(task: Task, sb: Sandbox) -> None:
    """Harbor's environment healthcheck (Docker HEALTHCHECK semantics): failures during ``start_period_s`` do not
    count; ``retries`` consecutive failures after it fail the sandbox."""
    hc = task.environment.healthcheck
    assert hc is not None
    loop = asyncio.get_running_loop()
    start, failures, last = loop.time(), 0, ""
    while True:
        r = await sb.exec(["bash", "-c", hc.command], hc.timeout_s)
        if r.exit_code == 0:
            return
        last = r.output.strip()[-500:] or f"exit {r.exit_code}"
        in_start = loop.time() - start < hc.start_period_s
        if not in_start:
            failures += 1
            if failures >= hc.retries:
                raise SandboxError(f"task {task.id}: [environment.healthcheck] {hc.command!r} failed {failures} "
                                   f"times after the start period: {last}")
        await asyncio.sleep(hc.start_interval_s if in_start else hc.interval_s)


async def replay_dockerfile(task: Task, sb: Sandbox) -> None:
    """Apply a simple Dockerfile inside a local sandbox: WORKDIR, COPY/ADD from the context, ENV, RUN.
    Anything else (multi-stage COPY --from, USER, remote ADD) is refused with the line named."""
    env = task.environment
    if not env.dockerfile:
        raise TaskFormatError(f"task {task.id}: the local backend needs a Dockerfile (image {env.image!r} given)")
    workdir = "/"
    exports: list[str] = []
    lines = _logical_lines(env.dockerfile)
    for n, line in lines:
        word, _, rest = line.partition(" ")
        word, rest = word.upper(), rest.strip()
        where = f"task {task.id}: Dockerfile line {n} ({line[:60]!r})"
        if word in ("FROM", "CMD", "ENTRYPOINT", "EXPOSE", "LABEL", "ARG", "SHELL", "VOLUME", "HEALTHCHECK", "#"):
            continue
        if word == "WORKDIR":
            workdir = rest if rest.startswith("/") else f"{workdir.rstrip('/')}/{rest}"
            await _run(sb, f"mkdir -p {shlex.quote(workdir)}", where)
        elif word == "ENV":
            exports.append(_env_to_export(rest))
        elif word in ("COPY", "ADD"):
            args = shlex.split(rest)
            if any(a.startswith("--from") or a.startswith("http") for a in args):
                raise SandboxError(f"{where}: not supported by the local backend")
            args = [a for a in args if not a.startswith("--")]
            *srcs, dest = args
            if not dest.startswith("/"):
                dest = f"{workdir.rstrip('/')}/{dest}"
            for src in srcs:
                await _copy(task, sb, src, dest, dest.endswith("/") or len(srcs) > 1, where)
        elif word == "RUN":
            cmd = "; ".join(exports + [f"cd {shlex.quote(workdir)}", rest])
            await _run(sb, cmd, where)
        else:
            raise SandboxError(f"{where}: instruction {word} is not supported by the local backend")
    if exports:
        await sb.run("; ".join(exports), 30)
    await sb.run(f"cd {shlex.quote(workdir)}", 30)


def _logical_lines(dockerfile: str) -> list[tuple[int, str]]:
    out, buf, start = [], "", 0
    for i, raw in enumerate(dockerfile.splitlines(), start=1):
        s = raw.strip()
        if not buf and (not s or s.startswith("#")):
            continue
        if not buf:
            start = i
        if s.endswith("\\"):
            buf += s[:-1] + " "
            continue
        out.append((start, (buf + s).strip()))
        buf = ""
    if buf:
        out.append((start, buf.strip()))
    return out


def _env_to_export(rest: str) -> str:
    parts = shlex.split(rest)
    if len(parts) >= 2 and "=" not in parts[0]:
        return f"export {parts[0]}={shlex.quote(' '.join(parts[1:]))}"
    return "export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in (p.split("=", 1) for p in parts))


async def _run(sb: Sandbox, cmd: str, where: str) -> None:
    r = await sb.exec(["bash", "-c", cmd], 600)
    if r.exit_code != 0:
        raise SandboxError(f"{where}: failed (exit {r.exit_code}): {r.output[-2000:]}")


async def _copy(task: Task, sb: Sandbox, src: str, dest: str, dest_is_dir: bool, where: str) -> None:
    """Docker's COPY: a file to ``dest`` (or into it when it is a directory), a directory's contents into
    ``dest``, ``.`` the whole context."""
    src = src[2:] if src.startswith("./") else src
    src = "" if src in (".", "") else src.rstrip("/")
    files = task.environment.files
    matched = {k: v for k, v in files.items() if not src or k == src or k.startswith(src + "/")}
    if not matched:
        raise SandboxError(f"{where}: {src!r} is not in the build context")
    for rel, blob in matched.items():
        if not src:
            target = f"{dest.rstrip('/')}/{rel}"
        elif rel == src:
            target = f"{dest.rstrip('/')}/{rel.rsplit('/', 1)[-1]}" if dest_is_dir else dest
        else:
            target = f"{dest.rstrip('/')}/{rel[len(src) + 1:]}"
        await sb.write_file(target, blob.data, blob.mode)
