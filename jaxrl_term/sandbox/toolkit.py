"""A read-only toolkit mounted in every sandbox at ``/opt/jaxrl``: what the sandbox's own machinery runs, so that
none of it comes from the agent's writable filesystem.

* ``nodump.so``: an ``LD_PRELOAD`` library with no libc dependency (raw system calls) whose constructor makes the
  process non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``) and drops ``LD_PRELOAD`` from its environment. The
  persistent shell starts with it: a process without ``CAP_SYS_PTRACE`` (Docker's default set has none; the local
  backend drops every capability) can then neither open ``/proc/<shell>/fd/*`` nor read the shell's memory or
  ptrace it, so the framing script waiting in the shell's stdin pipe stays secret. Children of the shell exec
  normally and are dumpable again.
* ``sockin``: a static relay that starts the persistent shell with a *socket* for its stdin (a ``socketpair``) and
  copies its own stdin (the exec's pipe) into it, non-dumpable itself. A process the agent leaves holding the shell's
  stdin (bash keeps a saved copy while a command runs) can then read a command before bash does, which only costs a
  timeout, but cannot write one in its place: ``/proc/self/fd/N`` reopens a pipe for writing, never a socket, and
  the relay's pipe is behind its non-dumpable ``/proc/<pid>/fd``. ``sockin PATHS ARGV0 ARGS...`` executes the first
  of the colon-separated absolute ``PATHS`` that exists; it exits with the shell's status.
* ``pause``: a static keep-alive (the container's main process under docker-init) that cannot be swapped for a
  script: ``tail -f /dev/null`` from the image could be replaced by the agent with something that runs again
  when the container restarts for verification.
* ``timeout``: the wrapper of every ``Sandbox.exec`` (the verifier's included), started by absolute path, linked
  statically against the host's glibc: a deadline that no ``timeout``, loader or libc of the agent's filesystem
  can replace.

They are compiled from the C sources below by the host's ``gcc`` (``-nostdlib``: no libc, any Linux image; ``timeout``
static against glibc's ``libc.a``), into
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
SOCKIN = f"{MOUNT}/sockin"
TIMEOUT = f"{MOUNT}/timeout"
BASH_PATHS = "/bin/bash:/usr/bin/bash:/usr/local/bin/bash"
VERSION = 3
NAMES = ("nodump.so", "pause", "sockin", "timeout")

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


SOCKIN_C = r"""
static long sys6(long n, long a, long b, long c, long d, long e, long f) {
    long ret;
#if defined(__x86_64__)
    register long r10 __asm__("r10") = d;
    register long r8 __asm__("r8") = e;
    register long r9 __asm__("r9") = f;
    __asm__ volatile ("syscall" : "=a"(ret) : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10), "r"(r8), "r"(r9)
                      : "rcx", "r11", "memory");
#elif defined(__aarch64__)
    register long x8 __asm__("x8") = n;
    register long x0 __asm__("x0") = a;
    register long x1 __asm__("x1") = b;
    register long x2 __asm__("x2") = c;
    register long x3 __asm__("x3") = d;
    register long x4 __asm__("x4") = e;
    register long x5 __asm__("x5") = f;
    __asm__ volatile ("svc 0" : "+r"(x0) : "r"(x8), "r"(x1), "r"(x2), "r"(x3), "r"(x4), "r"(x5) : "memory");
    ret = x0;
#else
#error "toolkit: unsupported architecture"
#endif
    return ret;
}
#if defined(__x86_64__)
enum { NR_READ = 0, NR_WRITE = 1, NR_CLOSE = 3, NR_SHUTDOWN = 48, NR_SOCKETPAIR = 53, NR_CLONE = 56, NR_EXECVE = 59,
       NR_WAIT4 = 61, NR_KILL = 62, NR_PRCTL = 157, NR_EXIT_GROUP = 231, NR_DUP3 = 292 };
__asm__(".globl _start\n_start:\n xor %rbp, %rbp\n mov %rsp, %rdi\n and $-16, %rsp\n call start_c\n hlt\n");
#else
enum { NR_READ = 63, NR_WRITE = 64, NR_CLOSE = 57, NR_SHUTDOWN = 210, NR_SOCKETPAIR = 199, NR_CLONE = 220,
       NR_EXECVE = 221, NR_WAIT4 = 260, NR_KILL = 129, NR_PRCTL = 167, NR_EXIT_GROUP = 94, NR_DUP3 = 24 };
__asm__(".globl _start\n_start:\n mov x0, sp\n bl start_c\n");
#endif
#define S(n, a, b, c) sys6(n, (long)(a), (long)(b), (long)(c), 0, 0, 0)
#define EINTR 4

static char buf[65536];
static char path[4096];

__attribute__((noreturn)) static void die(int code) { for (;;) S(NR_EXIT_GROUP, code, 0, 0); }

__attribute__((used, noreturn)) void start_c(long *sp) {
    long argc = sp[0];
    char **argv = (char **)(sp + 1), **envp = argv + argc + 1;
    int sv[2];
    S(NR_PRCTL, 4, 0, 0);  /* PR_SET_DUMPABLE 0: its stdin pipe is not reachable through /proc/<pid>/fd */
    if (argc < 3 || sys6(NR_SOCKETPAIR, 1 /* AF_UNIX */, 1 /* SOCK_STREAM */, 0, (long)sv, 0, 0) < 0) die(126);
    long pid = sys6(NR_CLONE, 17 /* SIGCHLD: a plain fork */, 0, 0, 0, 0, 0);
    if (pid < 0) die(126);
    if (pid == 0) {
        S(NR_DUP3, sv[1], 0, 0);
        S(NR_CLOSE, sv[0], 0, 0);
        S(NR_CLOSE, sv[1], 0, 0);
        for (const char *p = argv[1]; *p;) {  /* the first of the colon-separated paths that executes */
            long k = 0;
            while (*p && *p != ':' && k < (long)sizeof(path) - 1) path[k++] = *p++;
            path[k] = 0;
            if (*p == ':') p++;
            S(NR_EXECVE, path, argv + 2, envp);
        }
        die(127);
    }
    S(NR_CLOSE, sv[1], 0, 0);
    S(NR_CLOSE, 1, 0, 0);  /* the shell's output is its own */
    S(NR_CLOSE, 2, 0, 0);
    long pump = sys6(NR_CLONE, 17, 0, 0, 0, 0, 0);
    if (pump == 0) {  /* copies the exec's stdin into the socket (non-dumpable, as its parent) */
        for (;;) {
            long n = S(NR_READ, 0, buf, sizeof(buf));
            if (n == -EINTR) continue;
            if (n <= 0) break;
            for (long off = 0; off < n;) {
                long w = S(NR_WRITE, sv[0], buf + off, n - off);
                if (w == -EINTR) continue;
                if (w <= 0) die(0);
                off += w;
            }
        }
        S(NR_SHUTDOWN, sv[0], 1 /* SHUT_WR */, 0);
        die(0);
    }
    S(NR_CLOSE, 0, 0, 0);
    S(NR_CLOSE, sv[0], 0, 0);
    int status = 0;  /* the exec ends when the shell does (its stream's EOF is how an exit is seen) */
    while (sys6(NR_WAIT4, pid, (long)&status, 0, 0, 0, 0) == -EINTR) {}
    if (pump > 0) S(NR_KILL, pump, 9, 0);
    die((status >> 8) & 0xff);
}
"""


TIMEOUT_C = r"""
/* timeout -k KILL_AFTER DURATION COMMAND [ARG]...: the verifier's exec wrapper, coreutils' exit statuses (124 timed
   out, 125 own failure, 126 cannot execute, 127 not found, 128+N killed by signal N). The command runs in timeout's
   own process group: at DURATION the group gets SIGTERM, KILL_AFTER later SIGKILL. Started by absolute path
   (toolkit.TIMEOUT). Static: no loader or libc from the agent's filesystem. */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

static volatile sig_atomic_t phase;
static pid_t child;
static double kill_after;

static void arm(double s) {
    struct itimerval t;
    memset(&t, 0, sizeof t);
    t.it_value.tv_sec = (time_t)s;
    t.it_value.tv_usec = (suseconds_t)((s - (double)(time_t)s) * 1e6);
    if (t.it_value.tv_sec == 0 && t.it_value.tv_usec == 0) t.it_value.tv_usec = 1;
    setitimer(ITIMER_REAL, &t, 0);
}

static void on_alarm(int sig) {
    (void)sig;
    if (phase == 0) {
        phase = 1;
        kill(child, SIGTERM);
        kill(0, SIGTERM);
        if (kill_after > 0) arm(kill_after);
    } else {
        kill(child, SIGKILL);
        kill(0, SIGKILL);
    }
}

int main(int argc, char **argv) {
    int i = 1;
    if (i + 1 < argc && strcmp(argv[i], "-k") == 0) { kill_after = strtod(argv[i + 1], 0); i += 2; }
    if (i + 1 >= argc) return 125;
    double duration = strtod(argv[i++], 0);
    setpgid(0, 0);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_alarm;
    sigaction(SIGALRM, &sa, 0);
    child = fork();
    if (child < 0) return 125;
    if (child == 0) {
        signal(SIGALRM, SIG_DFL);
        execvp(argv[i], argv + i);
        _exit(errno == ENOENT ? 127 : 126);
    }
    signal(SIGTERM, SIG_IGN);  /* the group's SIGTERM is for the command */
    if (duration > 0) arm(duration);
    int status;
    while (waitpid(child, &status, 0) < 0)
        if (errno != EINTR) return 125;
    if (phase) return 124;
    if (WIFEXITED(status)) return WEXITSTATUS(status);
    if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
    return 125;
}
"""


class ToolkitError(RuntimeError):
    """The toolkit cannot be built here (the message names what is missing)."""


def _hash() -> str:
    parts = f"{VERSION}/{platform.machine()}/{NODUMP_C}/{PAUSE_C}/{SOCKIN_C}/{TIMEOUT_C}"
    return hashlib.sha256(parts.encode()).hexdigest()[:12]


def cache_root() -> Path:
    return Path(os.environ.get("JAXRL_TERM_CACHE", "~/.cache/jaxrl_term")).expanduser() / "toolkit"


@functools.lru_cache(maxsize=1)
def ensure_host_dir() -> Path:
    """Build (once) and return the host directory holding ``nodump.so``, ``pause``, ``sockin`` and ``timeout``."""
    out = cache_root() / _hash()
    if all((out / n).is_file() for n in NAMES):
        return out
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise ToolkitError("the sandbox toolkit needs a C compiler to build /opt/jaxrl (apt-get install gcc)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        (tmp / "nodump.c").write_text(NODUMP_C)
        (tmp / "pause.c").write_text(PAUSE_C)
        (tmp / "sockin.c").write_text(SOCKIN_C)
        (tmp / "timeout.c").write_text(TIMEOUT_C)
        common = ["-O2", "-nostdlib", "-fno-stack-protector", "-fno-builtin"]
        for argv in ([gcc, *common, "-fPIC", "-shared", "-o", "nodump.so", "nodump.c"],
                     [gcc, *common, "-static", "-fno-pie", "-no-pie", "-o", "pause", "pause.c"],
                     [gcc, *common, "-static", "-fno-pie", "-no-pie", "-o", "sockin", "sockin.c"],
                     [gcc, "-O2", "-static", "-o", "timeout", "timeout.c"]):  # glibc's libc.a (libc6-dev)
            proc = subprocess.run(argv, cwd=tmp, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise ToolkitError(f"building the sandbox toolkit failed: {' '.join(argv)}\n{proc.stderr[-2000:]}"
                                   + ("\n(a static libc is needed: apt-get install libc6-dev)" if "timeout" in argv
                                      else ""))
        for name in ("nodump.c", "pause.c", "sockin.c", "timeout.c"):
            (tmp / name).unlink()
        for name in NAMES:
            (tmp / name).chmod(0o755)
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
