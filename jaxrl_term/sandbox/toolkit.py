"""A read-only toolkit mounted in every sandbox at ``/opt/jaxrl``: what the sandbox's own machinery runs, so that
none of it comes from the agent's writable filesystem.

* ``nodump.so``: an ``LD_PRELOAD`` library with no libc dependency (raw system calls) whose constructor makes the
  process non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``) and drops ``LD_PRELOAD`` from its environment. The
  persistent shell starts with it: a process without ``CAP_SYS_PTRACE`` (Docker's default set has none; the local
  backend drops every capability) can then neither open ``/proc/<shell>/fd/*`` nor read the shell's memory or
  ptrace it, so the framing script waiting in the shell's stdin pipe stays secret. Children of the shell exec
  normally and are dumpable again.
* ``pause``: a static keep-alive (the container's main process under docker-init) that cannot be swapped for a
  script: ``tail -f /dev/null`` from the image could be replaced by the agent with something that runs again
  when the container restarts for verification.

Both are compiled from the C sources below by the host's ``gcc`` (``-nostdlib``: no libc, any Linux image), into
``cache_dir/toolkit/<hash>``; Docker sandboxes mount a named volume holding the same files read-only.
"""

from __future__ import annotations

import functools
import hashlib
import io
import logging
import os
import platform
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

MOUNT = "/opt/jaxrl"
NODUMP = f"{MOUNT}/nodump.so"
PAUSE = f"{MOUNT}/pause"
VERSION = 1

_SYSCALL = r"""
static long sys2(long n, long a, long b) {
    long ret;
#if defined(__x86_64__)
    __asm__ volatile ("syscall" : "=a"(ret) : "a"(n), "D"(a), "S"(b) : "rcx", "r11", "memory");
#elif defined(__aarch64__)
    register long x8 __asm__("x8") = n;
    register long x0 __asm__("x0") = a;
    register long x1 __asm__("x1") = b;
    __asm__ volatile ("svc 0" : "+r"(x0) : "r"(x8), "r"(x1) : "memory");
    ret = x0;
#else
#error "toolkit: unsupported architecture"
#endif
    return ret;
}
#if defined(__x86_64__)
#define NR_PRCTL 157
#define NR_PAUSE 34
#elif defined(__aarch64__)
#define NR_PRCTL 167
#define NR_PPOLL 73
#endif
"""

NODUMP_C = _SYSCALL + r"""
/* LD_PRELOAD constructor: PR_SET_DUMPABLE = 4, value 0; then remove LD_PRELOAD from the environment in place
   (glibc passes argc, argv, envp to constructors; the shell copies its environment after they ran). */
__attribute__((constructor)) static void jaxrl_nodump(int argc, char **argv, char **envp) {
    (void)argc; (void)argv;
    sys2(NR_PRCTL, 4, 0);
    if (!envp) return;
    char **out = envp;
    for (char **e = envp; *e; e++) {
        const char *p = *e, *k = "LD_PRELOAD=";
        while (*k && *p == *k) { p++; k++; }
        if (*k) *out++ = *e;
    }
    *out = 0;
}
"""

PAUSE_C = _SYSCALL + r"""
void _start(void) {
    for (;;) {
#if defined(__x86_64__)
        sys2(NR_PAUSE, 0, 0);
#else
        sys2(NR_PPOLL, 0, 0);
#endif
    }
}
"""


class ToolkitError(RuntimeError):
    """The toolkit cannot be built here (the message names what is missing)."""


def _hash() -> str:
    return hashlib.sha256(f"{VERSION}/{platform.machine()}/{NODUMP_C}/{PAUSE_C}".encode()).hexdigest()[:12]


def cache_root() -> Path:
    return Path(os.environ.get("JAXRL_TERM_CACHE", "~/.cache/jaxrl_term")).expanduser() / "toolkit"


@functools.lru_cache(maxsize=1)
def ensure_host_dir() -> Path:
    """Build (once) and return the host directory holding ``nodump.so`` and ``pause``."""
    out = cache_root() / _hash()
    if (out / "nodump.so").is_file() and (out / "pause").is_file():
        return out
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise ToolkitError("the sandbox toolkit needs a C compiler to build /opt/jaxrl (apt-get install gcc)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        (tmp / "nodump.c").write_text(NODUMP_C)
        (tmp / "pause.c").write_text(PAUSE_C)
        common = ["-O2", "-nostdlib", "-fno-stack-protector", "-fno-builtin"]
        for argv in ([gcc, *common, "-fPIC", "-shared", "-o", "nodump.so", "nodump.c"],
                     [gcc, *common, "-static", "-fno-pie", "-no-pie", "-o", "pause", "pause.c"]):
            proc = subprocess.run(argv, cwd=tmp, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise ToolkitError(f"building the sandbox toolkit failed: {' '.join(argv)}\n{proc.stderr[-2000:]}")
        for name in ("nodump.c", "pause.c"):
            (tmp / name).unlink()
        (tmp / "nodump.so").chmod(0o755)
        (tmp / "pause").chmod(0o755)
        try:
            tmp.rename(out)
        except OSError:  # another process built it first
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def volume_name() -> str:
    return f"jaxrl-toolkit-{_hash()}"


_volumes_ready: set[tuple[int, str]] = set()


def ensure_docker_volume(client, image: str) -> str:
    """The toolkit as a named Docker volume (created and filled once per engine), for a ``:ro`` mount.

    Filled through a created-but-never-started container of ``image`` (any local image works; no registry, no
    bind mount of a host path, so it also works on a remote engine). The name carries the content hash; a fill
    that fails removes the volume."""
    import docker

    name = volume_name()
    key = (id(client), name)
    if key in _volumes_ready:
        return name
    try:
        vol = client.volumes.get(name)
        if (vol.attrs.get("Labels") or {}).get("jaxrl_term.toolkit") == "complete":
            _volumes_ready.add(key)
            return name
        vol.remove(force=True)
    except docker.errors.NotFound:
        pass
    src = ensure_host_dir()
    client.volumes.create(name, labels={"jaxrl_term.toolkit": "complete"})
    filler = client.containers.create(image, ["/nonexistent"], network_mode="none",
                                      volumes={name: {"bind": "/vol", "mode": "rw"}},
                                      labels={"jaxrl_term.toolkit_filler": "1"})
    try:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for f in sorted(src.iterdir()):
                info = tar.gettarinfo(str(f), arcname=f.name)
                info.uid = info.gid = 0
                info.uname = info.gname = "root"
                with open(f, "rb") as fh:
                    tar.addfile(info, fh)
        if not filler.put_archive("/vol", buf.getvalue()):
            raise ToolkitError(f"could not fill the toolkit volume {name}")
    except BaseException:
        filler.remove(force=True)
        client.volumes.get(name).remove(force=True)
        raise
    filler.remove(force=True)
    _volumes_ready.add(key)
    log.info("sandbox toolkit volume %s ready", name)
    return name
