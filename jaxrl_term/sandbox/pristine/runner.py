"""Run the task's pytest file and report the results on the exec's own stdout, tagged with a nonce.

``python -c <this> <config json>``, the nonce on stdin. The nonce is read before anything imports a test module;
then the process makes itself non-dumpable (a process the tests start cannot read its memory or open its file
descriptors), moves the exec's stdout to a descriptor that children do not inherit, and points fds 1 and 2 at a
pipe it drains itself: output of the tests and of anything they leave running never reaches the exec's stdout.
pytest writes its JUnit XML to an anonymous memory file (``/proc/self/fd/N``), never to a path. The first line
written is ``<nonce> RESULT <base64 zlib json>`` (pytest's exit code and, per test case, class name, name, passed);
the captured output follows.

config: ``roots`` (every sys.path entry at start must lie under one of them; empty: not checked), ``pre`` (added
after the start-up path: the pristine pytest), ``append`` (the image's own sys.path entries, after everything
else; their ``.pth`` files contribute directory lines, never ``import`` lines), ``late`` (after those: the agent's
work dir when the tests import a module only it provides: it can add a module, never hide one), ``guard`` (module
names, besides the standard library's, found only on the pristine paths: the pytest session's packages), ``executable`` (``sys.executable``
for the tests: the image's python), ``path`` (``PATH`` for the tests), ``environ`` (variables set, or unset when null, for the tests after start-up:
the interpreter starts with ``LC_ALL=C`` so that glibc loads no locale or gconv file from the agent's filesystem, and
the tests get the task's locale back), ``args`` (pytest's arguments).
"""

import os
import sys


def with_pth(dirs):
    """``dirs`` (the image's own path entries, its ``.pth`` directories among them, in the image's order), then the
    directories that ``.pth`` files name now and the image did not have: after all of them, so that a ``.pth`` file
    the agent wrote can add modules and never hide one of a later site dir (no ``import`` lines executed)."""
    out = list(dict.fromkeys(dirs))
    for d in list(out):
        try:
            names = sorted(os.listdir(d))
        except OSError:
            continue
        for n in names:
            if not n.endswith(".pth"):
                continue
            try:
                with open(os.path.join(d, n), encoding="utf-8", errors="replace") as f:
                    lines = f.read().splitlines()
            except OSError:
                continue
            for line in lines:
                line = line.strip()
                if not line or line.startswith(("#", "import ", "import\t")):
                    continue
                p = os.path.abspath(os.path.join(d, line))
                if os.path.isdir(p) and p not in out:
                    out.append(p)
    return out


class Guard:
    """A meta-path finder, first in line: a module named like one of the standard library's (any platform's: Python
    and pytest probe for ``_wmi``, ``msvcrt``, ... and carry on without them) or like pytest's own is imported from
    the pristine paths or not at all, never from the directories appended after them (the image's site dirs, the
    agent's work dir), where the agent could have put one the stdlib lacks."""

    def __init__(self, paths, extra):
        import importlib.machinery

        names = getattr(sys, "stdlib_module_names", None) or set(sys.builtin_module_names) | {
            "msvcrt", "winreg", "_winapi", "nt", "_wmi", "_overlapped", "winsound", "_msi", "_winreg"}
        self.names, self.paths = set(names) | set(extra), list(paths)
        self.finder = importlib.machinery.PathFinder

    def find_spec(self, name, path=None, target=None):
        if path is not None or name not in self.names or name in sys.builtin_module_names:
            return None  # a submodule follows its package; builtins and other top-level names: the normal path
        import importlib.machinery

        if importlib.machinery.FrozenImporter.find_spec(name) is not None:
            return None
        spec = self.finder.find_spec(name, self.paths, target)
        if spec is None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return spec

    def invalidate_caches(self):
        pass


class Drain:
    """Fds 1 and 2 point at a pipe; a thread keeps its first and last bytes."""

    def __init__(self, limit=24000):
        import threading

        self.head, self.tail, self.total, self.limit = bytearray(), bytearray(), 0, limit
        r, w = os.pipe()
        os.dup2(w, 1)
        os.dup2(w, 2)
        os.close(w)
        self.r = r
        self.thread = threading.Thread(target=self._pump, daemon=True)
        self.thread.start()

    def _pump(self):
        while True:
            data = os.read(self.r, 65536)
            if not data:
                return
            self.total += len(data)
            room = self.limit // 3 - len(self.head)
            if room > 0:
                self.head += data[:room]
                data = data[room:]
            self.tail += data
            del self.tail[:max(0, len(self.tail) - (self.limit - self.limit // 3))]

    def close(self):
        sys.stdout.flush()
        sys.stderr.flush()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        self.thread.join(0.5)  # a process the tests left running may hold the pipe: take what is there
        dropped = self.total - len(self.head) - len(self.tail)
        mid = b"\n[... %d bytes of test output truncated ...]\n" % dropped if dropped > 0 else b""
        return bytes(self.head) + mid + bytes(self.tail)


def write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def main():
    nonce = sys.stdin.readline().strip()  # first: before anything imports a test module
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    import base64
    import json
    import zlib

    cfg = json.loads(sys.argv[1])
    out = os.dup(1)  # not inheritable (PEP 446): tests and their children never get the exec's stdout

    def emit(kind, payload):
        write_all(out, (f"\n{nonce} {kind} {payload}\n").encode())

    roots = [r.rstrip("/") for r in cfg["roots"]]
    foreign = [p for p in sys.path if p and roots and not any(p == r or p.startswith(r + "/") for r in roots)]
    if foreign:
        emit("ERROR", json.dumps(f"sys.path outside the verifier's toolchain {roots}: {foreign}"))
        return 3
    pristine = [p for p in sys.path if p] + cfg["pre"]
    sys.path[:] = pristine + with_pth(cfg["append"])
    sys.path += [p for p in cfg.get("late") or () if p not in sys.path]
    sys.meta_path.insert(0, Guard(pristine, cfg.get("guard") or ()))
    if cfg.get("executable"):
        sys.executable = cfg["executable"]
    os.environ["PATH"] = cfg["path"]
    for k, v in (cfg.get("environ") or {}).items():  # what the tests' processes get back (e.g. their locale)
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        import ctypes

        dumpable = ctypes.CDLL(None).prctl(4, 0, 0, 0, 0) != 0  # PR_SET_DUMPABLE, 0
    except Exception:  # noqa: BLE001 - reported in the result
        dumpable = True
    try:
        junit = os.memfd_create("junit")
    except (AttributeError, OSError):
        import tempfile

        keep = tempfile.TemporaryFile()  # noqa: SIM115 - unlinked, no path to it; open until the end
        junit = keep.fileno()
    drain = Drain()
    try:
        import pytest

        rc = pytest.main([*cfg["args"], f"--junitxml=/proc/self/fd/{junit}"])
        version = pytest.__version__
    except BaseException as e:  # noqa: BLE001 - the runner reports any failure to run pytest
        log = drain.close()
        emit("ERROR", json.dumps(f"pytest could not run: {type(e).__name__}: {e}"))
        write_all(out, log)
        return 3
    log = drain.close()
    os.lseek(junit, 0, 0)
    chunks = []
    while True:
        b = os.read(junit, 1 << 20)
        if not b:
            break
        chunks.append(b)
    cases = []
    if chunks:
        import xml.etree.ElementTree as ET

        root = ET.fromstring(b"".join(chunks))
        cases = [[c.get("classname", ""), c.get("name", ""), c.find("failure") is None and c.find("error") is None]
                 for c in root.iter("testcase")]
    payload = {"rc": int(rc), "cases": cases, "pytest": version, "dumpable": dumpable}
    emit("RESULT", base64.b64encode(zlib.compress(json.dumps(payload).encode(), 9)).decode())
    write_all(out, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
