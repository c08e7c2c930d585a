"""The verifier's own Python: for each task image, a copy taken from the pristine image before any agent runs,
mounted read-only in the task's sandboxes, so that the tests never run on an interpreter, library or pytest the
agent could have written.

Docker: a named volume per image id (``jaxrl-pytool-<hash>-<image id>``), filled once by a one-shot container of
the image (``pristine/probe.py``): the interpreter, its stdlib and lib-dynload, every shared library they load and
the dynamic loader, pytest with what a pytest session imports (the image's own pytest 7+, else the host venv's
pure-Python pytest / pluggy / iniconfig / packaging) and the image's bytecode for all of it. The copied loader and
libc never read the agent's ``/etc/ld.so.preload`` or ``/etc/nsswitch.conf``: the probe points those two file names
at paths inside the read-only volume that do not exist (same length, patched in the copies), so no library the
agent names is preloaded and no NSS module is loaded by name lookups in the tests' process. A second
one-shot container (``pristine/validate.py``) checks through the copy that nothing is loaded from outside the
volume. Sandboxes mount it at ``MOUNT``; the verifier starts Python as::

    MOUNT/so/ld.so --library-path MOUNT/so MOUNT/bin/python3 -I -S -B -X pycache_prefix=MOUNT/pycache

(the loader invoked directly: a replaced ``/lib64/ld-linux*``, libc or ``python3`` in the agent's filesystem is
never used; it starts with ``LC_ALL=C`` (``START_ENV``): glibc's built-in locale reads no locale data or
``gconv-modules.cache`` (which names modules to ``dlopen``) from the agent's filesystem, and Python skips its C-locale
coercion; ``-I -S``: no environment variables, no ``site``, so no ``.pth``, ``sitecustomize`` or user site;
bytecode only from the volume). The image's own ``sys.path`` entries (site-packages) are appended after the
pristine paths by the runner, behind its import guard: the standard library's module names and those of the pytest
session's own packages (copied into the volume) resolve on the pristine paths only.

When an image's Python cannot be copied (no ``python3``, older than 3.8, a copy that loads files from outside the
volume, no usable pytest anywhere) the toolchain says why (``reason``) and the runner uses the image's own
python by absolute path with ``-I -S``; the verifier then relies on tamper detection of the stdlib, site dirs and
interpreter (``reward/tamper.py``).

Local backend: the host's ``/usr`` is bound read-only into the sandbox: the host's python under ``/usr`` with
``-I`` is the pristine interpreter (no copy needed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import io
import json
import logging
import os
import shutil
import subprocess
import tarfile
import weakref
from collections.abc import Mapping
from pathlib import Path

from jaxrl_term.sandbox.base import CLEAN_PATH
from jaxrl_term.sandbox.pristine import source

log = logging.getLogger(__name__)

MOUNT = "/opt/jaxrl-py"
VERSION = 2
LABEL = "jaxrl_term.toolchain"


# The host venv's pytest, copied into the volume when the image has no pytest 7+ (pure Python).
HOST_PYTEST = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "py", "pygments")


@dataclasses.dataclass(frozen=True)
class Toolchain:
    """How the verifier starts Python in a sandbox, and what the image looked like before any agent ran.

    ``argv``: the interpreter invocation (``-c <runner>`` follows); ``pristine``: True when nothing it loads at
    start-up is writable by the agent; ``reason``: why not; ``roots``: the runner refuses to run when a start-up
    ``sys.path`` entry lies outside these; ``pre`` / ``append``: added after the start-up path (the pristine pytest)
    / after everything (the image's own site dirs); ``executable``: ``sys.executable`` for the tests (the image's
    python); ``facts``: the probe's report (``reward/tamper.py``)."""

    argv: tuple[str, ...]
    pristine: bool
    reason: str = ""
    roots: tuple[str, ...] = ()
    pre: tuple[str, ...] = ()
    append: tuple[str, ...] = ()
    executable: str | None = None
    facts: Mapping = dataclasses.field(default_factory=dict)
    volume: str | None = None

    @property
    def label(self) -> str:
        return "pristine" if self.pristine else f"image python ({self.reason})"

    def python(self, nonce: str) -> list[str]:
        """The interpreter argv; a fallback to the image's python reads bytecode only from a fresh directory."""
        if self.pristine:
            return list(self.argv)
        return [*self.argv, "-X", f"pycache_prefix=/tmp/.jrt-pyc-{nonce[:16]}"]

    def runner(self, pytest_args: list[str], nonce: str, environ: Mapping[str, str | None] | None = None,
               late: list[str] | tuple[str, ...] = ()) -> list[str]:
        """``late``: directories appended after everything else (the agent's work dir, for tests that import it)."""
        cfg = {"roots": list(self.roots), "pre": list(self.pre), "append": list(self.append), "late": list(late),
               "guard": sorted((self.facts.get("pytest") or {}).get("deps", ())) if self.pristine else [],
               "executable": self.executable, "path": CLEAN_PATH, "args": pytest_args, "environ": dict(environ or {})}
        return [*self.python(nonce), "-c", source("runner.py"), json.dumps(cfg)]

    def unmounted(self, why: str) -> Toolchain:
        return image_fallback(self.facts, why, None)


def image_fallback(facts: Mapping, reason: str, volume: str | None) -> Toolchain:
    """The image's own python by absolute path with ``-I -S`` (the tamper check covers its files)."""
    if facts.get("append") is None:  # not even probed: the image's python with its site, by PATH
        return Toolchain(("python3", "-I", "-B"), False, reason, facts=facts, volume=volume)
    return Toolchain((facts.get("executable") or "python3", "-I", "-S", "-B"), False, reason,
                     append=tuple(facts["append"]), facts=facts, volume=volume)


def _cache_dir() -> Path:
    return Path(os.environ.get("JAXRL_TERM_CACHE", "~/.cache/jaxrl_term")).expanduser() / "toolchain"


def _host_pytest_dirs() -> dict[str, Path]:
    import importlib.util

    out = {}
    for name in HOST_PYTEST:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin:
            continue
        origin = Path(spec.origin)
        out[name] = origin.parent if origin.name == "__init__.py" else origin
    return out


def _host_pytest_requires() -> tuple[int, int]:
    """The lowest Python the host's pytest and its dependencies support."""
    import importlib.metadata
    import re

    low = (3, 8)
    for dist in ("pytest", "pluggy", "iniconfig", "packaging"):
        try:
            spec = importlib.metadata.metadata(dist).get("Requires-Python") or ""
        except importlib.metadata.PackageNotFoundError:
            continue
        m = re.search(r">=\s*(\d+)\.(\d+)", spec)
        if m:
            low = max(low, (int(m.group(1)), int(m.group(2))))
    return low


@functools.lru_cache(maxsize=1)
def _hash() -> str:
    import pytest

    parts = [str(VERSION), source("probe.py"), source("validate.py"), pytest.__version__]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:10]


# --------------------------------------------------------------------------------------------- Docker


def _tar(files: dict[str, tuple[bytes, int]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, (data, mode) in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), mode
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _helper(cl, image: str, volume: str, bind: str, mode: str, **kwargs):
    """A container of ``image`` with ``volume`` at ``bind`` (never the agent's), labelled for the reaper."""
    from jaxrl_term.sandbox.docker import owner_labels

    return cl.containers.create(image, kwargs.pop("command", ["/nonexistent"]), network_mode="none", user="root",
                                volumes={volume: {"bind": bind, "mode": mode}},
                                labels={**owner_labels(), LABEL: "helper"}, **kwargs)


def _run_once(cl, image: str, volume: str, bind: str, mode: str, entrypoint: list[str], command: list[str],
              timeout_s: float = 900) -> tuple[int, str]:
    c = _helper(cl, image, volume, bind, mode, entrypoint=entrypoint, command=command, working_dir="/")
    try:
        c.start()
        code = c.wait(timeout=timeout_s).get("StatusCode", -1)
        return code, c.logs(stdout=True, stderr=True).decode(errors="replace")
    finally:
        c.remove(force=True)


def _put(cl, image: str, volume: str, files: dict[str, tuple[bytes, int]]) -> None:
    c = _helper(cl, image, volume, "/vol", "rw")
    try:
        if not c.put_archive("/vol", _tar(files)):
            raise RuntimeError(f"could not write into the toolchain volume {volume}")
    finally:
        c.remove(force=True)


def _tagged(logs: str, tag: str) -> dict | None:
    for line in reversed(logs.splitlines()):
        if line.startswith(tag + " "):
            return json.loads(line[len(tag) + 1:])
    return None


def _read_manifest(cl, image: str, volume: str) -> dict | None:
    import docker

    try:
        cl.volumes.get(volume)
    except docker.errors.NotFound:
        return None
    c = _helper(cl, image, volume, "/vol", "ro")
    try:
        stream, _ = c.get_archive("/vol/manifest.json")
        with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
            member = tar.next()
            f = tar.extractfile(member) if member is not None else None
            return json.loads(f.read()) if f is not None else None
    except docker.errors.NotFound:
        return None
    finally:
        c.remove(force=True)


def _fill(cl, image_id: str, volume: str) -> dict:
    """Fill ``volume`` from the pristine image; the manifest (written last) says whether the copy is usable."""
    import docker

    cl.volumes.create(volume, labels={LABEL: image_id})
    manifest = {"version": VERSION, "image": image_id, "pristine": False}
    try:
        code, logs = _run_once(cl, image_id, volume, "/vol", "rw", ["python3"],
                               ["-c", source("probe.py"), json.dumps({"vol": "/vol", "mount": MOUNT})])
    except docker.errors.APIError as e:
        why = str(getattr(e, "explanation", "") or e)
        reason = "no python3 in the image" if "executable file not found" in why or "no such file" in why.lower() \
            else f"the image's python3 could not run: {why[:300]}"
        return {**manifest, "reason": reason, "facts": {}}
    facts = _tagged(logs, "JRT_PROBE") or {"ok": False, "reason": f"the probe exited {code}: {logs[-500:]}"}
    manifest["facts"] = facts
    if not facts.get("ok"):
        return {**manifest, "reason": facts.get("reason", "the probe failed")}
    deps = facts["pytest"]["deps"]
    if not facts["pytest"]["usable"]:
        need = _host_pytest_requires()
        have = tuple(int(x) for x in facts["version"].split("."))
        if have < need:
            return {**manifest, "reason": f"{facts['pytest']['why']}, and the host's pytest needs Python "
                                          f"{need[0]}.{need[1]}+ (the image has {facts['version']})"}
        files = {}
        for path in _host_pytest_dirs().values():
            paths = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()
                                                    and "__pycache__" not in p.parts]
            for p in paths:
                rel = p.name if path.is_file() else f"{path.name}/{p.relative_to(path).as_posix()}"
                files[f"pytest/{rel}"] = (p.read_bytes(), 0o644)
        _put(cl, image_id, volume, files)
        deps = [n for n in HOST_PYTEST if n in _host_pytest_dirs()]
        manifest["pytest_source"] = "host"
    else:
        manifest["pytest_source"] = "image"
    so = f"{MOUNT}/so"
    entry = [f"{so}/ld.so", "--library-path", so, f"{MOUNT}/bin/python3"] if facts.get("loader") \
        else [f"{MOUNT}/bin/python3"]
    code, logs = _run_once(cl, image_id, volume, MOUNT, "rw", entry[:1],
                           [*entry[1:], "-I", "-S", "-X", f"pycache_prefix={MOUNT}/pycache", "-c",
                            source("validate.py"), json.dumps({"mount": MOUNT, "deps": deps})])
    check = _tagged(logs, "JRT_VALIDATE") or {"problems": [f"the check exited {code}: {logs[-500:]}"]}
    if check["problems"]:
        return {**manifest, "reason": "the copy of the image's python is not self-contained: "
                                      + "; ".join(check["problems"])[:600]}
    return {**manifest, "pristine": True, "reason": "", "pytest": check.get("pytest")}


def volume_name(image_id: str) -> str:
    return f"jaxrl-pytool-{_hash()}-{image_id.split(':')[-1][:16]}"


def _ensure(image_id: str) -> Toolchain:
    from jaxrl_term.sandbox.docker import client

    cl = client()
    volume = volume_name(image_id)
    manifest = _read_manifest(cl, image_id, volume)
    if manifest is None:
        manifest = _fill(cl, image_id, volume)
        _put(cl, image_id, volume, {"manifest.json": (json.dumps(manifest).encode(), 0o644)})
        if not manifest["pristine"]:
            log.warning("verifier toolchain for image %s: %s; its tests run on the image's own python, guarded by "
                        "the tamper check only", image_id[:19], manifest["reason"])
    facts = manifest.get("facts") or {}
    if not manifest["pristine"]:
        return image_fallback(facts, manifest["reason"], volume)
    so = f"{MOUNT}/so"
    loader = [f"{so}/ld.so", "--library-path", so] if facts.get("loader") else []
    argv = (*loader, f"{MOUNT}/bin/python3", "-I", "-S", "-B", "-X", f"pycache_prefix={MOUNT}/pycache")
    return Toolchain(argv, True, "", (MOUNT,), (f"{MOUNT}/pytest",), tuple(facts["append"]), facts["executable"],
                     facts, volume)


def prune(*, all_images: bool = False, min_age_s: float = 3600.0) -> int:
    """Remove toolchain volumes no container uses that belong to an older version of the toolchain or to an image
    that is gone (``all_images``: every unused one), made more than ``min_age_s`` ago. Returns how many."""
    import datetime

    import docker

    from jaxrl_term.sandbox.docker import client

    cl = client()
    prefix = f"jaxrl-pytool-{_hash()}-"
    now = datetime.datetime.now(datetime.timezone.utc)
    removed = 0
    for vol in cl.volumes.list(filters={"label": LABEL}):
        created = (vol.attrs.get("CreatedAt") or "")[:19]
        try:
            age = (now - datetime.datetime.fromisoformat(created).replace(tzinfo=datetime.timezone.utc)).total_seconds()
        except ValueError:
            age = min_age_s
        if age < min_age_s:
            continue
        if vol.name.startswith(prefix) and not all_images:
            try:
                cl.images.get(vol.attrs.get("Labels", {}).get(LABEL, ""))
                continue  # current version, image still here
            except docker.errors.ImageNotFound:
                pass
        try:
            vol.remove()
            removed += 1
        except docker.errors.APIError:  # in use by a container, or removed meanwhile
            pass
    return removed


START_ENV = {"LC_ALL": "C"}  # the pristine interpreter's start-up: no locale files (see the module's docstring)

_ready: dict[tuple[str, str], Toolchain] = {}  # (engine, image id) -> toolchain, per process
_locks: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # event loop -> image id -> lock
_pruned: set[str] = set()  # engines pruned by this process


async def for_image(image: str) -> Toolchain:
    """The toolchain of a Docker image (tag or id): its volume made on first use, cached by image id."""
    from jaxrl_term.sandbox.docker import _call, client

    from jaxrl_term.sandbox.engines import CURRENT

    engine = CURRENT.get()
    where = engine.name if engine is not None else ""  # a volume per engine (the same image id on each)
    image_id = (await _call(client().images.get, image)).id
    key = (where, image_id)
    if key in _ready:
        return _ready[key]
    if where not in _pruned:  # once per process and engine: volumes of older toolchains and of deleted images
        _pruned.add(where)
        await _call(prune)
    lock = _locks.setdefault(asyncio.get_running_loop(), {}).setdefault(key, asyncio.Lock())
    async with lock:
        if key not in _ready:
            _ready[key] = await _call(_ensure, image_id)
    return _ready[key]


# --------------------------------------------------------------------------------------------- local


@functools.lru_cache(maxsize=1)
def local_toolchain() -> Toolchain:
    """The host's python under ``/usr`` (bound read-only into local sandboxes) with ``-I``."""
    for cand in (shutil.which("python3", path=CLEAN_PATH), "/usr/bin/python3"):
        if not cand:
            continue
        real = os.path.realpath(cand)
        if not real.startswith("/usr/"):
            continue
        proc = subprocess.run([real, "-I", "-c", source("probe.py"), json.dumps({"vol": None, "mount": None})],
                              capture_output=True, text=True, check=False, cwd="/",
                              env={"PATH": CLEAN_PATH, "HOME": "/root", "LANG": "C.UTF-8"})
        facts = _tagged(proc.stdout, "JRT_PROBE") or {}
        if facts.get("ok") and facts["pytest"]["usable"]:
            return Toolchain((real, "-I", "-B"), True, "", ("/usr",), facts=facts)
    return Toolchain(("python3", "-I", "-B"), False, "no python3 with pytest 7+ under the host's /usr")


async def for_sandbox(sb) -> Toolchain:
    """The toolchain for an open sandbox: Docker, from its image (the volume must be mounted, which
    ``open_task_sandbox`` does); local, the host's python."""
    container = getattr(sb, "container", None)
    if container is None:
        return await asyncio.to_thread(local_toolchain)
    tc = await for_image(container.attrs["Image"])
    mounts = container.attrs.get("Mounts") or []
    if tc.volume and not any(m.get("Name") == tc.volume and m.get("Destination") == MOUNT for m in mounts):
        return tc.unmounted("the sandbox was opened without the verifier's toolchain volume (use "
                            "tasks.env.open_task_sandbox)")
    return tc


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m jaxrl_term.sandbox.toolchain")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prune", help="remove unused verifier toolchain volumes (old versions, deleted images)")
    p.add_argument("--all", action="store_true", help="every unused toolchain volume")
    p.add_argument("--min-age", type=float, default=0.0, help="only volumes older than this many seconds")
    args = ap.parse_args(argv)
    print(f"removed {prune(all_images=args.all, min_age_s=args.min_age)} toolchain volume(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
