"""Tamper detection: which filesystem changes since the sandbox was created touch what the verifier will run.

``findings(changes, facts, level=..., workdir=..., commands=...)`` reads ``Sandbox.changes()`` (Docker: ``docker
diff`` against the pristine image; local: the writable directories) with the image's facts from the toolchain probe
(``sandbox/pristine/probe.py``) and returns one line per finding; any finding marks the attempt ``tampered``
(score 0). Rules, by what the runner executes from the agent's filesystem:

every runner
  ``/etc/ld.so.preload`` (the loader reads it even when started by absolute path); ``/etc/nsswitch.conf`` (NSS
  modules are loaded by any ``getpwuid``); ``mkdir``/``timeout``/shells/interpreters in a ``PATH`` dir (the
  sandbox's own file API runs ``mkdir``); in the image's site dirs (appended to the tests' ``sys.path``): a file
  of the image changed or deleted, or a new top-level module shadowing one the image has in a later site dir;
  ``/etc/ld.so.cache`` mapping a library name of the image to another file (``ldcache_redirects``).
``level="image"`` (pytest on the image's own python, when it could not be copied), and ``"script"``
  additionally: anything added, changed or deleted in the stdlib dirs (outside site/dist-packages), the
  interpreter, the dynamic loader, and the libraries of the interpreters and shells (``toolchain_files``).
``level="script"`` (TB1 ``run-tests.sh``, Harbor ``test.sh``: the format's own script in the agent's environment)
  additionally: ``/etc/ld.so.conf*`` (the script may run ``ldconfig`` through ``apt-get``); any command the test
  scripts invoke, in a ``PATH`` dir (and ``$HOME/.local/bin``); ``.pth`` files with ``import`` lines and
  ``sitecustomize``/``usercustomize`` in a site dir (system and user site); ``/etc/python3*``; pytest configuration
  at ``/`` (``conftest.py``, ``pytest.ini``, ``pyproject.toml``, ``tox.ini``, ``setup.cfg``: read when pytest
  looks above ``/tests``); in the work dir (the scripts' cwd, first on ``sys.path`` for ``python3 -m pytest``) a
  module named like one Python or pytest imports after start-up (``pytest.py``, ``argparse.py``, ...).

Bytecode is never read from the agent's filesystem (``-X pycache_prefix``/``PYTHONPYCACHEPREFIX``), so
``__pycache__`` entries are not findings.
"""

from __future__ import annotations

import posixpath
import re
import struct
from collections.abc import Iterable, Mapping, Sequence

from jaxrl_term.sandbox.base import CLEAN_PATH

LEVELS = ("pristine", "image", "script")
INTERPRETERS = re.compile(r"^(python[0-9.]*|pip[0-9.]*|pytest|py\.test|bash|sh|dash|zsh|ksh|env|timeout|mkdir|uv|uvx"
                          r"|ldconfig)$")
PYTEST_CONFIG = ("conftest.py", "pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg")
ALWAYS_SHADOWABLE = ("runpy", "pytest", "_pytest", "pluggy", "iniconfig", "packaging", "py", "sitecustomize",
                     "usercustomize")
PREFIX_WORDS = {"if", "then", "else", "elif", "do", "while", "until", "!", "{", "exec", "command", "sudo", "nohup",
                "time", "env", "xargs", "builtin"}  # a command follows
BUILTINS = {"fi", "done", "for", "in", "case", "esac", "function", "}", "set", "export", "local", "return", "exit",
            "source", ".", "cd", "echo", "printf", "test", "[", "[[", "true", "false", "read", "shift", "trap",
            "wait", "unset", "declare", "eval", "let", "pushd", "popd", "umask", "ulimit"}  # no command follows


def _under(path: str, d: str) -> bool:
    d = d.rstrip("/") or "/"
    return path == d or path.startswith(d + "/") or d == "/"


def _in_pycache(path: str) -> bool:
    return "/__pycache__/" in path or path.endswith("/__pycache__")


def script_commands(scripts: Iterable[str]) -> set[str]:
    """The command names a shell script runs (first word of each pipeline stage; paths reduced to their name)."""
    out: set[str] = set()
    for text in scripts:
        heredoc = None
        for line in text.splitlines():
            if heredoc is not None:  # a here-document's body is data, not commands
                heredoc = None if line.strip() == heredoc else heredoc
                continue
            m = re.search(r"<<-?\s*['\"]?([A-Za-z_][A-Za-z0-9_]*)", line)
            heredoc = m.group(1) if m else None
            line = line.split("#", 1)[0] if not line.lstrip().startswith("#!") else ""
            for segment in re.split(r"\|\||&&|[|;&()`]|\$\(", line):
                words = segment.split()
                while words and (re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]) or words[0] in PREFIX_WORDS):
                    words = words[1:]
                if not words or words[0] in BUILTINS:
                    continue
                name = posixpath.basename(words[0].strip("\"'"))
                if re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*", name):
                    out.add(name)
    return out


STDLIB = re.compile(r"^/usr(/local)?/lib(64)?/python3\.\d+(/|$)")
SITE = re.compile(r"/(site|dist)-packages(/|$)")


def findings(changes: Sequence[tuple[str, str]], facts: Mapping, *, level: str, workdir: str, home: str = "/root",
             commands: Iterable[str] = (), tbin: bool = True) -> list[str]:
    """One line per change that touches what the verifier runs at this ``level`` (see the module docstring)."""
    if level not in LEVELS:
        raise ValueError(f"tamper level {level!r}; use one of {LEVELS}")
    script, image = level == "script", level in ("image", "script")
    path_dirs = {*CLEAN_PATH.split(":"), *facts.get("path_dirs", ())}
    if script:
        path_dirs.add(f"{home}/.local/bin")
    commands = set(commands)
    site_dirs = [d.rstrip("/") for d in facts.get("site_dirs") or ()]
    site_names = {d.rstrip("/"): set(v) for d, v in (facts.get("site_names") or {}).items()}
    stdlib = [d.rstrip("/") for d in facts.get("stdlib") or ()]
    toolchain_files = set(facts.get("toolchain_files") or ())
    if facts.get("executable"):
        toolchain_files.add(facts["executable"])
    shadowable = (set(facts.get("startup_modules") or ()) | set(ALWAYS_SHADOWABLE)) - set(
        facts.get("initial_modules") or ()) - {"test_probe", "__main__"}
    wd = workdir.rstrip("/") or "/"
    parents = {posixpath.dirname(p) for _, p in changes}  # a changed directory is listed with what changed in it
    out: list[str] = []
    for kind, path in changes:
        name, parent = posixpath.basename(path), posixpath.dirname(path)
        why = None
        if kind == "C" and path in parents:
            continue
        if path == "/etc/ld.so.preload":
            why = "LD_PRELOAD for every process, the verifier's included"
        elif path == "/etc/nsswitch.conf":
            why = "name-service modules are loaded into the test process"
        elif parent in path_dirs and INTERPRETERS.match(name) and (
                image or name == "mkdir" or (name == "timeout" and not tbin)):
            why = "a command the verifier runs"
        elif script and parent in path_dirs and name in commands:
            why = "a command the test scripts run"
        elif _in_pycache(path):
            continue
        elif site := next((d for d in site_dirs if _under(path, d)), None):
            rel = path[len(site) + 1:]
            top = rel.split("/")[0].split(".")[0]
            if kind in ("C", "D") and top in site_names.get(site, ()):
                why = "a file of the image's site-packages (on the tests' sys.path) changed"
            elif kind == "A" and "/" not in rel and any(top in names for d, names in site_names.items() if d != site):
                why = f"shadows the image's module {top!r}"
            elif script and name in ("sitecustomize.py", "usercustomize.py"):
                why = "code every python runs at start-up"
        elif image and (any(_under(path, d) for d in stdlib) or STDLIB.match(path)) and not SITE.search(path) \
                and path not in stdlib:
            why = "the stdlib of the python the tests run on"
        elif image and path in toolchain_files:
            why = "the interpreter, the loader or a library of the interpreters and shells"
        elif script and path.startswith("/etc/ld.so.conf"):
            why = "library search path (ldconfig runs when the script installs packages)"
        elif script and path.startswith("/etc/python3"):
            why = "the system python's configuration"
        elif script and parent == "/" and name in (*PYTEST_CONFIG, "setup.py"):
            why = "pytest configuration above /tests"
        elif script and parent == wd and kind in ("A", "C") and _module_name(name) in shadowable:
            why = "shadows a module Python or pytest imports (the work dir is first on sys.path for python3 -m pytest)"
        if why:
            out.append(f"{kind} {path}: {why}")
    return out


def pth_paths(changes: Sequence[tuple[str, str]], facts: Mapping) -> list[str]:
    """Added or changed ``.pth`` files at the top of a site dir (system or user site): the verifier reads them and
    passes their text to ``pth_findings``."""
    site_dirs = [d.rstrip("/") for d in (facts.get("site_dirs") or ())]
    return [p for k, p in changes if k in ("A", "C") and p.endswith(".pth") and posixpath.dirname(p) in site_dirs]


def pth_findings(texts: Mapping[str, bytes]) -> list[str]:
    """``.pth`` files with ``import`` lines: code every python (the script runner's included) runs at start-up."""
    out = []
    for path, data in texts.items():
        lines = data.decode(errors="replace").splitlines()
        if any(line.startswith(("import ", "import\t")) for line in lines):
            out.append(f"A {path}: a .pth file that runs code at every python start-up")
    return out


def _module_name(name: str) -> str:
    for suffix in (".py", ".pyc"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    if ".so" in name:
        return name.split(".")[0]
    return name  # a package directory


def parse_ldcache(data: bytes) -> dict[str, set[str]]:
    """soname -> paths, from glibc's ``/etc/ld.so.cache`` (the ``glibc-ld.so.cache1.1`` format, possibly after an
    old-format section). Raises ``ValueError`` on anything else."""
    magic = b"glibc-ld.so.cache1.1"
    base = data.find(magic)
    if base < 0:
        raise ValueError("not a glibc ld.so.cache (1.1)")
    nlibs, _ = struct.unpack_from("<II", data, base + 20)

    def cstr(off: int) -> str:
        end = data.index(b"\0", base + off)
        return data[base + off:end].decode(errors="replace")

    out: dict[str, set[str]] = {}
    for i in range(nlibs):
        _flags, key, value, _os, _hwcap = struct.unpack_from("<iIIIQ", data, base + 48 + 24 * i)
        out.setdefault(cstr(key), set()).add(cstr(value))
    return out


def ldcache_redirects(data: bytes, facts: Mapping) -> list[str]:
    """Library names the image resolved (its ld.so.cache, and what the probe's loader found) that the agent's
    ``/etc/ld.so.cache`` now maps to another file."""
    import base64

    baseline: dict[str, set[str]] = {}
    if facts.get("ldcache"):
        try:
            baseline = parse_ldcache(base64.b64decode(facts["ldcache"]))
        except ValueError:
            baseline = {}
    for name, path in (facts.get("libs") or {}).items():
        baseline.setdefault(name, set()).add(path)
    try:
        now = parse_ldcache(data)
    except ValueError as e:
        return [f"C /etc/ld.so.cache: unreadable ({e})"]
    out = []
    for name, paths in now.items():
        if name in baseline and not paths <= baseline[name]:
            out.append(f"C /etc/ld.so.cache: {name} now resolves to {sorted(paths - baseline[name])}")
    return out
