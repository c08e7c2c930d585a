"""Sandbox prerequisites: a Docker engine and locally built base images (no registry is needed).

``python -m jaxrl_term.sandbox.images setup`` (called by ``make train`` and ``make test``):

1. If the Docker engine does not answer and we are root on Debian, install ``docker.io`` and
   ``debootstrap`` and start ``dockerd``. Elsewhere, say so and go on (the local backend can serve).
2. Build the base images with ``debootstrap`` + ``docker import``, then a one-step ``docker build`` that
   installs an optional extra CA bundle (for TLS-intercepting proxies) and sets the environment. Each
   image carries a label with the hash of its recipe; a second run finds it and takes seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import weakref
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

RECIPE_LABEL = "jaxrl_term.recipe"
HOST_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
DOCKERD_LOG = "/var/log/jaxrl-term-dockerd.log"
RECIPE_VERSION = 1  # bump to rebuild every base image


@dataclasses.dataclass(frozen=True)
class BaseImage:
    name: str  # e.g. jaxrl-term/base:trixie
    suite: str  # Debian suite for debootstrap
    packages: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = (
        ("PIP_BREAK_SYSTEM_PACKAGES", "1"),
        ("LANG", "C.UTF-8"),
        ("DEBIAN_FRONTEND", "noninteractive"),
    )


COMMON_PACKAGES = (
    "python3",
    "python-is-python3",  # `python`, as in the python:3.x images Terminal-Bench tasks are written for
    "python3-pip",
    "python3-venv",
    "python3-pytest",
    "tmux",
    "git",
    "curl",
    "ca-certificates",
    "procps",
)

BASE_IMAGES: dict[str, BaseImage] = {
    "trixie": BaseImage("jaxrl-term/base:trixie", "trixie", COMMON_PACKAGES),
    "bookworm": BaseImage("jaxrl-term/base:bookworm", "bookworm", COMMON_PACKAGES),
}


class DockerUnavailable(RuntimeError):
    """No Docker engine can be reached or started here (the message says why)."""


# ------------------------------------------------------------------------------------------------ engine


def docker_client(timeout: int = 120):
    """A docker SDK client that answers ``ping``, or ``DockerUnavailable``."""
    import docker

    try:
        client = docker.from_env(timeout=timeout)
        client.ping()
        return client
    except Exception as e:  # noqa: BLE001 - the SDK raises several unrelated types for "no engine"
        raise DockerUnavailable(f"Docker engine not answering ({type(e).__name__}: {e})") from e


def _is_debian() -> bool:
    return Path("/etc/debian_version").is_file()


def _apt_install(packages: Sequence[str]) -> None:
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    log.info("apt-get install %s", " ".join(packages))
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages],
        check=True,
        env=env,
        stdout=subprocess.DEVNULL,
    )


def ensure_engine(install: bool = True, wait_s: float = 90.0):
    """Return a client for a running engine, installing and starting one where we may."""
    try:
        return docker_client()
    except DockerUnavailable as first:
        if not install:
            raise
        if os.geteuid() != 0 or not _is_debian():
            raise DockerUnavailable(
                f"{first}; cannot install or start one here (needs root on Debian). "
                "Start Docker yourself, or use the local (bubblewrap) sandbox backend: sandbox=local"
            ) from first
    if shutil.which("dockerd") is None:
        _apt_install(["docker.io", "debootstrap", "bubblewrap"])
    log.info("starting dockerd (log: %s)", DOCKERD_LOG)
    with open(DOCKERD_LOG, "ab") as out:
        subprocess.Popen(
            ["dockerd", "--host", "unix:///var/run/docker.sock"],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return docker_client()
        except DockerUnavailable:
            if time.monotonic() > deadline:
                tail = Path(DOCKERD_LOG).read_text(errors="replace")[-2000:]
                raise DockerUnavailable(f"dockerd did not answer within {wait_s:.0f}s; its log ends:\n{tail}")
            time.sleep(0.5)


def _host_has_pytest() -> bool:
    return subprocess.run(["/usr/bin/python3", "-c", "import pytest"], capture_output=True).returncode == 0 \
        if Path("/usr/bin/python3").exists() else False


def ensure_toolkit(install: bool = True) -> bool:
    """The sandbox toolkit (``toolkit.py``: non-dumpable shell, stdin relay, keep-alive, static exec ``timeout``) is
    compiled by the host's C compiler: install gcc and a static libc where missing (root on Debian), then build it
    once now, not at the first sandbox."""
    from jaxrl_term.sandbox import toolkit

    cc = shutil.which("gcc") or shutil.which("cc")
    static_libc = cc is not None and os.path.isabs(subprocess.run(
        [cc, "-print-file-name=libc.a"], capture_output=True, text=True, check=False).stdout.strip())
    if not static_libc and install and os.geteuid() == 0 and shutil.which("apt-get"):
        _apt_install(["gcc", "libc6-dev"])  # the toolkit's static `timeout` links glibc's libc.a
    try:
        toolkit.ensure_host_dir()
        return True
    except toolkit.ToolkitError as e:
        print(f"[jaxrl_term] {e}", file=sys.stderr)
        return False


def ensure_bubblewrap(install: bool = True) -> bool:
    """The local sandbox backend's needs on the host: bwrap, and python3 with pytest, git, tmux for tasks and
    their verifier (installed as root on Debian when missing)."""
    if shutil.which("bwrap") and _host_has_pytest() and shutil.which("git"):
        return True
    if install and os.geteuid() == 0 and _is_debian():
        try:
            _apt_install(["bubblewrap", "python3", "python3-pytest", "git", "tmux", "procps"])
        except subprocess.CalledProcessError as e:
            print(f"[jaxrl_term] could not install the local backend's packages: {e}", file=sys.stderr)
    ok = shutil.which("bwrap") is not None
    if not ok:
        print("[jaxrl_term] bubblewrap (bwrap) missing: the local sandbox backend is unavailable", file=sys.stderr)
    return ok


# ------------------------------------------------------------------------------------------------ images


def apt_mirror() -> str:
    """The Debian mirror from this machine's apt sources (deb822 or one-line format)."""
    candidates: list[str] = []
    d = Path("/etc/apt/sources.list.d")
    for f in sorted(d.glob("*.sources")) if d.is_dir() else []:
        for block in f.read_text().split("\n\n"):
            fields = dict(
                line.split(":", 1) for line in block.splitlines() if ":" in line and not line.startswith("#")
            )
            uris, suites = fields.get("URIs", "").split(), fields.get("Suites", "")
            if uris and "security" not in suites and "/debian" in uris[0] and "security" not in uris[0]:
                candidates.append(uris[0])
    sl = Path("/etc/apt/sources.list")
    if sl.is_file():
        for line in sl.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[0] == "deb" and "security" not in line:
                url = next(p for p in parts[1:] if p.startswith(("http", "file")))
                if "/debian" in url:
                    candidates.append(url)
    return candidates[0].rstrip("/") if candidates else DEFAULT_MIRROR


def resolve_ca_bundle(ca_bundle: str | None) -> Path | None:
    """``auto`` = the host's bundle when present; ``none``/None = no extra bundle; else a path."""
    if ca_bundle in (None, "", "none"):
        return None
    if ca_bundle == "auto":
        p = Path(HOST_CA_BUNDLE)
        return p if p.is_file() else None
    p = Path(ca_bundle)
    if not p.is_file():
        raise FileNotFoundError(f"extra CA bundle {p}: not found; pass an existing PEM file, 'auto' or 'none'")
    return p


def recipe_hash(spec: BaseImage, mirror: str, ca: Path | None) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([RECIPE_VERSION, dataclasses.asdict(spec), mirror]).encode())
    if ca is not None:
        h.update(ca.read_bytes())
    return h.hexdigest()[:16]


def _image_recipe(client, name: str) -> str | None:
    import docker

    try:
        img = client.images.get(name)
    except docker.errors.ImageNotFound:
        return None
    return (img.labels or {}).get(RECIPE_LABEL)


def _build_context(dockerfile: str, files: dict[str, bytes]) -> io.BytesIO:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in {"Dockerfile": dockerfile.encode(), **files}.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    buf.seek(0)
    return buf


def build_base_image(client, spec: BaseImage, *, mirror: str | None = None, ca_bundle: Path | None = None,
                     force: bool = False, host: str | None = None) -> tuple[str, bool]:
    """Build ``spec`` unless an image with the same recipe exists. Returns (name, built). ``host``: the engine's
    URL when ``client`` is not the default engine's (the rootfs import goes through the CLI)."""
    mirror = mirror or apt_mirror()
    digest = recipe_hash(spec, mirror, ca_bundle)
    if not force and _image_recipe(client, spec.name) == digest:
        return spec.name, False
    if shutil.which("debootstrap") is None:
        if os.geteuid() == 0 and _is_debian():
            _apt_install(["debootstrap"])
        else:
            raise DockerUnavailable("debootstrap is not installed and cannot be installed here (needs root on Debian)")
    t0 = time.monotonic()
    rootfs_tag = f"jaxrl-term/rootfs:{spec.suite}-{digest}"
    with tempfile.TemporaryDirectory(prefix=f"jaxrl-debootstrap-{spec.suite}-") as tmp:
        root = Path(tmp) / "rootfs"
        cmd = [
            "debootstrap",
            "--variant=minbase",
            f"--include={','.join(spec.packages)}",
            spec.suite,
            str(root),
            mirror,
        ]
        log.info("%s", " ".join(cmd))
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"debootstrap {spec.suite} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        shutil.rmtree(root / "var/cache/apt/archives", ignore_errors=True)
        (root / "var/cache/apt/archives/partial").mkdir(parents=True, exist_ok=True)
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        assert tar.stdout is not None
        _docker_import(tar.stdout, rootfs_tag, host)
        tar.wait()
    lines = [f"FROM {rootfs_tag}"]
    files: dict[str, bytes] = {}
    env = list(spec.env)
    if ca_bundle is not None:
        files["extra-ca.crt"] = ca_bundle.read_bytes()
        lines += [
            "COPY extra-ca.crt /usr/local/share/ca-certificates/jaxrl-term-extra-ca.crt",
            "RUN update-ca-certificates >/dev/null 2>&1 || true",
        ]
        bundle = "/etc/ssl/certs/ca-certificates.crt"
        env += [("PIP_CERT", bundle), ("REQUESTS_CA_BUNDLE", bundle), ("SSL_CERT_FILE", bundle)]
    lines += [f"ENV {k}={json.dumps(v)}" for k, v in env]
    lines += [f'LABEL {RECIPE_LABEL}="{digest}"', 'CMD ["bash"]']
    _build(client, "\n".join(lines) + "\n", files, spec.name)
    try:
        client.images.remove(rootfs_tag, noprune=False)
    except Exception:  # noqa: BLE001 - the final image still references its layers; untagging is cosmetic
        pass
    log.info("built %s in %.0fs", spec.name, time.monotonic() - t0)
    return spec.name, True


def _docker_import(stream, tag: str, host: str | None = None) -> None:
    """``docker import`` from a tar stream (the CLI streams; the SDK would buffer the whole rootfs)."""
    docker_cli = shutil.which("docker")
    if docker_cli is None:
        raise DockerUnavailable("the docker CLI is not on PATH (apt-get install docker.io)")
    proc = subprocess.run([docker_cli, *(["-H", host] if host else []), "import", "-", tag], stdin=stream,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"docker import {tag} failed: {proc.stderr.strip()}")


def _build(client, dockerfile: str, files: dict[str, bytes], tag: str) -> None:
    ctx = _build_context(dockerfile, files)
    log_lines: list[str] = []
    for chunk in client.api.build(fileobj=ctx, custom_context=True, tag=tag, rm=True, forcerm=True, decode=True):
        if "stream" in chunk:
            log_lines.append(chunk["stream"])
        if "error" in chunk:
            raise RuntimeError(f"docker build {tag} failed: {chunk['error']}\n{''.join(log_lines)[-3000:]}")


# ------------------------------------------------------------------------------------------ task images

# Registry base images named by tasks -> local images, used only when the named image is not present locally.
# First matching glob wins; configurable (sandbox.image_map).
DEFAULT_IMAGE_MAP: tuple[tuple[str, str], ...] = (
    ("ghcr.io/laude-institute/t-bench/python-3-13*", "jaxrl-term/base:trixie"),
    ("ghcr.io/laude-institute/t-bench/ubuntu-24-04*", "jaxrl-term/base:trixie"),
    ("ghcr.io/laude-institute/t-bench/*", "jaxrl-term/base:trixie"),
    ("python:3.13*", "jaxrl-term/base:trixie"),
    ("python:3*", "jaxrl-term/base:bookworm"),  # older pins have wheels for 3.11, often not for 3.13
    ("ubuntu:*", "jaxrl-term/base:trixie"),
    ("debian:bookworm*", "jaxrl-term/base:bookworm"),
    ("debian:*", "jaxrl-term/base:trixie"),
)
TASK_IMAGE_REPO = "jaxrl-term/task"
CA_PATH_IN_IMAGE = "/usr/local/share/ca-certificates/jaxrl-term-extra-ca.crt"


class ImageBuildError(RuntimeError):
    """A task image that could not be built; ``step`` and ``log`` hold the failing step and its output."""

    def __init__(self, message: str, step: str = "", log: str = ""):
        super().__init__(message + (f"\nfailing step: {step}" if step else "") + (f"\n{log}" if log else ""))
        self.step, self.log = step, log


def _from_lines(dockerfile: str):
    """Yield (line index, image, stage alias) for every FROM instruction."""
    for i, line in enumerate(dockerfile.splitlines()):
        parts = line.strip().split()
        if not parts or parts[0].upper() != "FROM":
            continue
        args = [p for p in parts[1:] if not p.startswith("--")]
        if not args:
            continue
        alias = args[2] if len(args) >= 3 and args[1].upper() == "AS" else None
        yield i, args[0], alias


def resolve_base(client, image: str, image_map: Sequence[tuple[str, str]]) -> str:
    """The image itself when present locally, else its mapping, else an error naming the config."""
    import fnmatch

    import docker

    try:
        client.images.get(image)
        return image
    except docker.errors.ImageNotFound:
        pass
    for pattern, local in image_map:
        if fnmatch.fnmatchcase(image, pattern):
            return local
    raise ImageBuildError(
        f"FROM {image}: not available locally and no registry can be reached; map it to a local image in "
        "sandbox.image_map (glob -> image), e.g. ['" + image.split(":")[0] + "*', 'jaxrl-term/base:trixie']"
    )


def prepare_dockerfile(client, dockerfile: str, image_map, ca_bundle: Path | None) -> tuple[str, list[str]]:
    """Rewrite FROM lines to local images; add the extra CA bundle after FROMs that are not our bases.
    Returns the new Dockerfile and the resolved base images (for the cache key)."""
    lines = dockerfile.splitlines()
    stages: set[str] = set()
    bases: list[str] = []
    inserts: dict[int, list[str]] = {}
    for i, image, alias in _from_lines(dockerfile):
        if image in stages:  # FROM an earlier build stage
            resolved = image
        else:
            resolved = resolve_base(client, image, image_map)
            bases.append(resolved)
            if resolved != image:
                lines[i] = lines[i].replace(image, resolved, 1)
            if ca_bundle is not None and not resolved.startswith("jaxrl-term/base:"):
                inserts[i] = [
                    f"COPY jaxrl-term-extra-ca.crt {CA_PATH_IN_IMAGE}",
                    f"ENV PIP_CERT={CA_PATH_IN_IMAGE} REQUESTS_CA_BUNDLE={CA_PATH_IN_IMAGE} "
                    f"SSL_CERT_FILE={CA_PATH_IN_IMAGE}",
                ]
        if alias:
            stages.add(alias)
    if not bases and not stages:
        raise ImageBuildError("Dockerfile has no FROM instruction")
    out: list[str] = []
    for i, line in enumerate(lines):
        out.append(line)
        out.extend(inserts.get(i, []))
    return "\n".join(out) + "\n", bases


ContextFiles = dict[str, "bytes | tuple[bytes, int]"]


def _context_tar(dockerfile: str, files: ContextFiles, ca_bundle: Path | None) -> io.BytesIO:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        entries = {"Dockerfile": (dockerfile.encode(), 0o644)}
        for name, val in files.items():
            data, mode = val if isinstance(val, tuple) else (val, 0o644)
            entries[name.lstrip("/")] = (data, mode)
        if ca_bundle is not None:
            entries["jaxrl-term-extra-ca.crt"] = (ca_bundle.read_bytes(), 0o644)
        for name, (data, mode) in sorted(entries.items()):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), mode, 0
            tar.addfile(info, io.BytesIO(data))
    buf.seek(0)
    return buf


def task_image_tag(dockerfile: str, files: ContextFiles, base_ids: Sequence[str], ca: Path | None) -> str:
    h = hashlib.sha256()
    h.update(dockerfile.encode())
    for name in sorted(files):
        val = files[name]
        data, mode = val if isinstance(val, tuple) else (val, 0o644)
        h.update(f"\0{name}\0{mode}\0".encode())
        h.update(data)
    h.update(json.dumps(list(base_ids)).encode())
    if ca is not None:
        h.update(ca.read_bytes())
    return f"{TASK_IMAGE_REPO}:{h.hexdigest()[:20]}"


def build_task_image(
    client,
    dockerfile: str,
    files: ContextFiles | None = None,
    *,
    image_map: Sequence[tuple[str, str]] = DEFAULT_IMAGE_MAP,
    ca_bundle: Path | None = None,
    timeout_s: float = 1800,
) -> tuple[str, bool]:
    """Build a task's image from its Dockerfile and build-context files; cached by content hash.
    Returns (tag, built). Errors come back as ``ImageBuildError`` with the failing step's log."""
    import docker

    files = files or {}
    prepared, bases = prepare_dockerfile(client, dockerfile, image_map, ca_bundle)
    base_ids = [client.images.get(b).id for b in bases]
    tag = task_image_tag(prepared, files, base_ids, ca_bundle)
    try:
        client.images.get(tag)
        return tag, False
    except docker.errors.ImageNotFound:
        pass
    ctx = _context_tar(prepared, files, ca_bundle)
    step, step_log, all_log = "", [], []
    t0 = time.monotonic()
    try:
        for chunk in client.api.build(fileobj=ctx, custom_context=True, tag=tag, rm=True, forcerm=True,
                                      decode=True, labels={"jaxrl_term.task_image": "1"}):
            text = chunk.get("stream", "")
            if text.startswith("Step "):
                step, step_log = text.strip(), []
            elif text:
                step_log.append(text)
            all_log.append(text)
            if "error" in chunk:
                raise ImageBuildError(f"docker build failed: {chunk['error'].strip()}", step,
                                      "".join(step_log)[-4000:])
            if time.monotonic() - t0 > timeout_s:
                raise ImageBuildError(f"docker build exceeded {timeout_s:.0f}s", step, "".join(step_log)[-4000:])
    except docker.errors.APIError as e:
        raise ImageBuildError(f"docker build failed: {e.explanation or e}", step, "".join(step_log)[-4000:]) from e
    return tag, True


class ImageBuilder:
    """Async, de-duplicated task image builds: concurrent requests for one image build it once."""

    def __init__(self, image_map: Sequence[tuple[str, str]] = DEFAULT_IMAGE_MAP, ca_bundle: str | None = "auto",
                 max_parallel_builds: int = 2):

        self.image_map = tuple(tuple(x) for x in image_map)
        self.ca_bundle = resolve_ca_bundle(ca_bundle)
        # per event loop: an asyncio lock binds to the loop that first waits on it, and a builder outlives
        # ``asyncio.run`` calls (a lock left held by a cancelled run of a closed loop must not block the next)
        self._per_loop: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._max_parallel_builds = max_parallel_builds
        self.built = 0  # images actually built (not found in the cache)

    async def ensure(self, dockerfile: str, files: ContextFiles | None = None, timeout_s: float = 1800) -> str:
        import asyncio

        from jaxrl_term.sandbox.engines import CURRENT

        engine = CURRENT.get()  # several engines: built on the one the sandbox is placed on (engines.py)
        key = hashlib.sha256(dockerfile.encode() + repr(sorted((files or {}).items())).encode()).hexdigest()
        locks, sem = self._per_loop.setdefault(asyncio.get_running_loop(),
                                               ({}, asyncio.Semaphore(self._max_parallel_builds)))
        lock = locks.setdefault((engine.name if engine else "", key), asyncio.Lock())
        async with lock, sem:
            if engine is not None:
                client = engine.client()
                if not engine.bases_ready:  # a new engine: the base images its task images start FROM
                    await asyncio.to_thread(engine.pool.copy_base_images, engine)
            else:
                client = docker_client()
            tag, built = await asyncio.to_thread(build_task_image, client, dockerfile, files,
                                                 image_map=self.image_map, ca_bundle=self.ca_bundle,
                                                 timeout_s=timeout_s)
            self.built += int(built)
            return tag


def setup(
    images: Sequence[str] = ("trixie", "bookworm"),
    *,
    ca_bundle: str | None = "auto",
    mirror: str | None = None,
    install: bool = True,
    force: bool = False,
    require: bool = False,
) -> bool:
    """Engine + base images. Returns True when Docker is ready; False (with a message) when it cannot be."""
    ensure_bubblewrap(install)
    ensure_toolkit(install)
    try:
        client = ensure_engine(install=install)
    except DockerUnavailable as e:
        if require:
            raise
        print(f"[jaxrl_term] Docker unavailable: {e}", file=sys.stderr)
        print("[jaxrl_term] Going on without Docker: the local sandbox backend will serve.", file=sys.stderr)
        return False
    ca = resolve_ca_bundle(ca_bundle)
    for key in images:
        if key not in BASE_IMAGES:
            raise ValueError(f"unknown base image {key!r}; known: {sorted(BASE_IMAGES)}")
        t0 = time.monotonic()
        name, built = build_base_image(client, BASE_IMAGES[key], mirror=mirror, ca_bundle=ca, force=force)
        print(f"[jaxrl_term] {name}: {'built' if built else 'cached'} ({time.monotonic() - t0:.1f}s)")
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxrl_term.sandbox.images")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("setup", help="start Docker (installing it as root on Debian) and build base images")
    s.add_argument("--images", default="trixie,bookworm", help="comma-separated: " + ",".join(BASE_IMAGES))
    s.add_argument("--ca-bundle", default="auto", help="extra CA bundle for images: auto (host's), none, or a path")
    s.add_argument("--mirror", default=None, help="Debian mirror (default: from the host's apt sources)")
    s.add_argument("--no-install", action="store_true", help="never install or start Docker")
    s.add_argument("--force", action="store_true", help="rebuild even when cached")
    s.add_argument("--require", action="store_true", help="fail (exit 1) when Docker cannot be had")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[jaxrl_term] %(message)s")
    try:
        ok = setup(
            [i for i in args.images.split(",") if i],
            ca_bundle=args.ca_bundle,
            mirror=args.mirror,
            install=not args.no_install,
            force=args.force,
            require=args.require,
        )
    except DockerUnavailable as e:
        print(f"[jaxrl_term] Docker required but unavailable: {e}", file=sys.stderr)
        return 1
    return 0 if ok or not args.require else 1


if __name__ == "__main__":
    from jaxrl_term.utils.cli import guard

    sys.exit(guard(main)())
