"""A sandbox set up for one task: its image built (Docker) or its Dockerfile replayed (local backend)."""

from __future__ import annotations

import contextlib
import logging
import shlex
from collections.abc import AsyncIterator

from jaxrl_term.sandbox import toolchain
from jaxrl_term.sandbox.base import Sandbox, SandboxError, SandboxPool, open_sandbox
from jaxrl_term.tasks.task import Task, TaskFormatError

log = logging.getLogger(__name__)


async def image_for(task: Task, builder) -> str:
    """The task's image: prebuilt, or built from its Dockerfile (cached by content)."""
    env = task.environment
    if env.dockerfile:
        files = {k: (v.data, v.mode) for k, v in env.files.items()}
        return await builder.ensure(env.dockerfile, files, timeout_s=env.build_timeout_s)
    assert env.image
    return env.image


def _limits(task: Task, limits: dict) -> dict:
    out = dict(limits)
    env = task.environment
    out["workdir"] = env.workdir
    if env.cpus is not None:
        out["cpus"] = env.cpus
    if env.memory_mb is not None:
        out["memory_mb"] = env.memory_mb
    if env.allow_internet and limits.get("network") is not False:
        out["network"] = True
    return out


@contextlib.asynccontextmanager
async def open_task_sandbox(
    task: Task,
    *,
    backend: str = "docker",
    builder=None,
    pool: SandboxPool | None = None,
    labels: dict[str, str] | None = None,
    **limits,
) -> AsyncIterator[Sandbox]:
    """``async with open_task_sandbox(task, builder=ImageBuilder()) as sb`` -> a sandbox in the task's initial
    state. Docker: the task image (built on first use), with the verifier's toolchain volume mounted read-only
    (``sandbox/toolchain.py``). Local: the host system with the Dockerfile's WORKDIR / COPY / ENV / RUN steps
    replayed inside the sandbox (no package installs)."""
    lim = _limits(task, limits)
    labels = {"jaxrl_term.task": task.id[:63], **(labels or {})}
    mounts = None
    if backend == "docker":
        if builder is None:
            from jaxrl_term.sandbox.images import ImageBuilder

            builder = ImageBuilder()
        image = await image_for(task, builder)
        # the verifier's own python, copied from the pristine image (made once per image, before any agent runs)
        tc = await toolchain.for_image(image)
        mounts = {tc.volume: toolchain.MOUNT} if tc.volume else None
    else:
        image = None
    cm = (pool.sandbox(image, labels=labels, mounts=mounts, **lim) if pool
          else open_sandbox(backend, image, labels=labels, mounts=mounts, **lim))
    async with cm as sb:
        if backend == "local":
            await replay_dockerfile(task, sb)
        yield sb


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
