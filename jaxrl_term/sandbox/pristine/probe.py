"""Snapshot the image's Python into the toolchain volume; report what the tamper checks need to know.

Runs as ``python3 -c <this> <config json>`` in a one-shot container of the pristine task image (no agent has run
in it), as root, without network, the volume mounted read-write at ``config["vol"]``. Its last output line is
``JRT_PROBE <json>``. Layout written (the volume is mounted at ``config["mount"]`` in sandboxes)::

    bin/python3                          the interpreter (its real file)
    <platlibdir>/python3.X/              stdlib and lib-dynload, without tests, tkinter, idlelib, site dirs
    so/                                  the dynamic loader (ld.so) and every library the above load
    pytest/                              pytest and the packages a pytest session imports from the image
    pycache/<mount>/...                  the image's own bytecode for those sources (``-X pycache_prefix``)
    pycache/<site dir>/...               and for the image's site-packages, so that no bytecode is read from
                                         the agent's filesystem
"""

import sys

INITIAL = sorted({n.split(".")[0] for n in sys.modules})  # imported before ``-c``/``-m`` code: not shadowable by cwd

import json
import os

EXCLUDE = {"test", "tests", "idle_test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3",
           "site-packages", "dist-packages", "__pycache__", "sitecustomize.py", "usercustomize.py"}
# commands the format scripts and the sandbox machinery run: their libraries are toolchain files
COMMANDS = ("bash", "sh", "dash", "env", "timeout", "mkdir", "python3", "python", "pytest")


def elf_interp(path):
    """The ELF64 program interpreter (PT_INTERP) of ``path``, None if static or not ELF64."""
    import struct

    with open(path, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF" or head[4] != 2:
            return None
        e = "<" if head[5] == 1 else ">"
        phoff, = struct.unpack_from(e + "Q", head, 0x20)
        phentsize, phnum = struct.unpack_from(e + "HH", head, 0x36)
        for i in range(phnum):
            f.seek(phoff + i * phentsize)
            p_type, _, p_offset, _, _, p_filesz = struct.unpack(e + "IIQQQQ", f.read(40))
            if p_type == 3:
                f.seek(p_offset)
                return f.read(p_filesz).rstrip(b"\0").decode()
    return None


def needed(loader, path):
    """soname -> resolved path of every library ``path`` loads (the loader's --list, as ldd does)."""
    import subprocess

    r = subprocess.run([loader, "--list", path], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                       text=True, timeout=60, check=False)
    libs = {}
    for line in r.stdout.splitlines():
        name, arrow, rest = line.strip().partition("=>")
        target = rest.strip().split(" (")[0].strip()
        if arrow and target.startswith("/"):
            libs[name.strip()] = target
    return libs


def top_names(d):
    out = set()
    try:
        entries = os.listdir(d)
    except OSError:
        return []
    for n in entries:
        if n.endswith((".dist-info", ".egg-info", ".pth")) or n == "__pycache__":
            continue
        out.add(n.split(".")[0])
    return sorted(out)


def pytest_session():
    """Run a one-test pytest session here (plugin autoload off, as the verifier does): its version, whether it
    passed, and the top-level modules Python and pytest import to do it."""
    import tempfile

    d = tempfile.mkdtemp(prefix="jrt-probe-")
    with open(os.path.join(d, "test_probe.py"), "w") as f:
        f.write("def test_ok():\n    assert True\n")
    with open(os.path.join(d, "pytest.ini"), "w") as f:
        f.write("[pytest]\n")
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    saved = os.dup(1), os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    try:
        import pytest

        rc = pytest.main([os.path.join(d, "test_probe.py"), "-q", "-p", "no:cacheprovider", "-c",
                          os.path.join(d, "pytest.ini"), "--rootdir", d, "--junitxml", os.path.join(d, "j.xml")])
        version = pytest.__version__
    except BaseException as e:  # noqa: BLE001 - reported, not raised
        rc, version = f"{type(e).__name__}: {e}", None
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
    return version, rc


def builtin_nsswitch(vol, mount):
    """The image's ``/etc/nsswitch.conf`` with only the services glibc has built in (``files``, ``dns``), written in
    the volume under a name as long as ``/etc/nsswitch.conf``: lookups keep the image's order, no module is loaded.
    Returns the path as the sandboxes see it."""
    seen = (mount.rstrip("/") + "/nsswitch.conf")[:len("/etc/nsswitch.conf")]
    lines = []
    try:
        with open("/etc/nsswitch.conf") as f:
            for line in f.read().splitlines():
                db, sep, rest = line.split("#", 1)[0].partition(":")
                kept = [w for w in rest.split() if w in ("files", "dns")]
                if sep and db.strip() and kept:
                    lines.append(f"{db.strip()}: {' '.join(kept)}")
    except OSError:
        lines = ["hosts: files dns"]
    with open(os.path.join(vol, seen[len(mount.rstrip("/")) + 1:]), "w") as f:
        f.write("\n".join(lines) + "\n")
    return seen


def patch(path, name, mount, repl=None):
    """Point the C string ``name`` in the copy at ``path`` to ``repl``, a path of the same length inside the
    read-only ``mount`` (by default one that does not exist): the loader then preloads nothing
    (``/etc/ld.so.preload``) and libc reads the volume's name-service configuration (``/etc/nsswitch.conf``),
    whatever the agent writes there. Returns the names patched."""
    repl = (repl or (mount.rstrip("/") + "/" + "-" * len(name))).encode()[:len(name)]
    if len(repl) != len(name) or not repl.startswith(mount.encode() + b"/"):
        raise ValueError(f"the toolchain mount {mount!r} is too long to patch {name!r}")
    with open(path, "rb") as f:
        data = f.read()
    if name + b"\0" not in data:
        return []
    with open(path, "wb") as f:
        f.write(data.replace(name + b"\0", repl + b"\0"))
    return [name.decode()]


def under(path, dirs):
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)


def mirror_pycs(src, seen_as, vol, tag):
    """Copy ``src``'s ``__pycache__/*.<tag>.pyc`` to where ``-X pycache_prefix=<mount>/pycache`` looks for the
    bytecode of sources that sandboxes see at ``seen_as``."""
    import shutil

    for root, dirs, files in os.walk(src):
        dirs[:] = [x for x in dirs if x not in EXCLUDE or x == "__pycache__"]
        if os.path.basename(root) != "__pycache__":
            continue
        rel = os.path.relpath(os.path.dirname(root), src)
        dest = os.path.normpath(os.path.join(vol, "pycache", seen_as.lstrip("/"), rel))
        for name in files:
            if name.endswith(f".{tag}.pyc"):
                os.makedirs(dest, exist_ok=True)
                shutil.copy2(os.path.join(root, name), os.path.join(dest, name))


def main(cfg):
    import base64
    import shutil
    import site
    import sysconfig

    vol, mount = cfg["vol"], cfg["mount"]
    out = {"version": "{}.{}".format(*sys.version_info[:2])}
    exe = os.path.realpath(sys.executable)
    out["executable"] = exe
    platlib = getattr(sys, "platlibdir", "lib")
    paths = sysconfig.get_paths()
    stdlib, platstdlib = paths["stdlib"], paths["platstdlib"]
    dynload = next((p for p in sys.path if p.rstrip("/").endswith("lib-dynload")),
                   os.path.join(platstdlib, "lib-dynload"))
    out["stdlib"] = sorted({stdlib, platstdlib, dynload})
    # what the image's python3 puts on sys.path after its stdlib (site dirs, .pth entries, PYTHONPATH): the runner
    # appends these after the pristine paths
    std = {stdlib, platstdlib, dynload}
    out["append"] = [p for p in sys.path if p and p not in std and not p.endswith(".zip")]
    user_site = site.getusersitepackages() if hasattr(site, "getusersitepackages") else None
    site_dirs = list(out["append"])
    for d in list(getattr(site, "getsitepackages", list)()) + [user_site]:
        if d and d not in site_dirs:
            site_dirs.append(d)
    out["site_dirs"] = site_dirs
    out["user_site"] = user_site
    out["site_names"] = {d: top_names(d) for d in site_dirs}
    out["path_dirs"] = [d for d in os.environ.get("PATH", "").split(":") if d.startswith("/")]
    try:
        import pwd

        homes = {p.pw_dir for p in pwd.getpwall() if p.pw_dir.startswith(("/root", "/home/"))}
    except (ImportError, KeyError, OSError):
        homes = set()
    out["homes"] = sorted(homes | {"/root"})
    try:
        with open("/etc/ld.so.cache", "rb") as f:
            out["ldcache"] = base64.b64encode(f.read()).decode()
    except OSError:
        out["ldcache"] = None

    version, rc = pytest_session()
    out["startup_modules"] = sorted({n.split(".")[0] for n in sys.modules})
    out["initial_modules"] = INITIAL
    out["stdlib_names"] = sorted(getattr(sys, "stdlib_module_names", ()))  # 3.10+
    deps = {}
    for name in out["startup_modules"]:
        f = getattr(sys.modules.get(name), "__file__", None)
        if f and under(os.path.realpath(f), [os.path.realpath(d) for d in site_dirs]):
            deps[name] = os.path.dirname(f) if os.path.basename(f).startswith("__init__.") else f
    vt = tuple(int(x) for x in (version or "0").split(".")[:2] if x.isdigit())
    usable = rc == 0 and vt >= (7, 0)
    out["pytest"] = {"version": version, "usable": usable,
                     "why": "" if usable else f"pytest {version} in the image (session result {rc!r})",
                     "deps": sorted(deps) if usable else []}

    out["ok"] = True
    if vol is None:  # facts only (the local backend's host python)
        return out

    # -- the interpreter, its stdlib and lib-dynload ---------------------------------------------------
    ver = out["version"]
    lib = os.path.join(vol, platlib, "python" + ver)
    os.makedirs(os.path.join(vol, "bin"), exist_ok=True)
    os.makedirs(os.path.join(vol, "so"), exist_ok=True)
    shutil.copy2(exe, os.path.join(vol, "bin", "python3"))

    def ignore(d, names):
        return [n for n in names if n in EXCLUDE or n.startswith("config-")]

    for src in (stdlib, platstdlib):
        shutil.copytree(src, lib, ignore=ignore, symlinks=False, ignore_dangling_symlinks=True, dirs_exist_ok=True)
    if not under(dynload, [stdlib, platstdlib]) and os.path.isdir(dynload):
        shutil.copytree(dynload, os.path.join(lib, "lib-dynload"), ignore=ignore, dirs_exist_ok=True)
    tag = sys.implementation.cache_tag
    for src in (stdlib, platstdlib):
        mirror_pycs(src, os.path.join(mount, platlib, "python" + ver), vol, tag)
    for d in site_dirs:
        if os.path.isdir(d):
            mirror_pycs(d, d, vol, tag)

    # -- the loader and the shared libraries -----------------------------------------------------------
    loader = elf_interp(exe)
    out["loader"] = loader
    files = set()
    if loader:
        shutil.copy2(os.path.realpath(loader), os.path.join(vol, "so", "ld.so"))
        out["patched"] = patch(os.path.join(vol, "so", "ld.so"), b"/etc/ld.so.preload", mount)
        sos = [exe] + [os.path.join(r, n) for r, _, ns in os.walk(os.path.join(lib, "lib-dynload")) for n in ns
                       if ".so" in n]
        libs = {}
        for f in sos:
            libs.update(needed(loader, f))
        for d in {os.path.dirname(p) for p in libs.values()}:
            if os.path.exists(os.path.join(d, "libgcc_s.so.1")):  # glibc dlopens it for thread cancellation
                libs.setdefault("libgcc_s.so.1", os.path.join(d, "libgcc_s.so.1"))
        for name, target in libs.items():
            shutil.copy2(os.path.realpath(target), os.path.join(vol, "so", name))
            if name.startswith("libc.so"):
                out["patched"] += patch(os.path.join(vol, "so", name), b"/etc/nsswitch.conf", mount,
                                        builtin_nsswitch(vol, mount))
        out["libs"] = libs
        files |= {loader, os.path.realpath(loader)}
        files |= set(libs.values()) | {os.path.realpath(p) for p in libs.values()}
        for cmd in COMMANDS:
            p = shutil.which(cmd)
            if p:
                files |= {p, os.path.realpath(p)}
                interp = elf_interp(os.path.realpath(p))
                if interp:
                    for target in needed(interp, os.path.realpath(p)).values():
                        files |= {target, os.path.realpath(target)}
    out["toolchain_files"] = sorted(files)

    # -- pytest and what its session imported from the image's site dirs ------------------------------
    if usable:
        dest = os.path.join(vol, "pytest")
        os.makedirs(dest, exist_ok=True)
        for name, src in deps.items():
            target = os.path.join(dest, os.path.basename(src))
            if os.path.isdir(src):
                shutil.copytree(src, target, ignore=ignore, dirs_exist_ok=True)
                mirror_pycs(src, os.path.join(mount, "pytest", os.path.basename(src)), vol, tag)
            else:
                shutil.copy2(src, target)
                base = os.path.basename(src).rsplit(".", 1)[0]
                pyc = os.path.join(os.path.dirname(src), "__pycache__", f"{base}.{tag}.pyc")
                if os.path.exists(pyc):
                    os.makedirs(os.path.join(vol, "pycache", mount.lstrip("/"), "pytest"), exist_ok=True)
                    shutil.copy2(pyc, os.path.join(vol, "pycache", mount.lstrip("/"), "pytest",
                                                   os.path.basename(pyc)))
    return out


if __name__ == "__main__":
    config = json.loads(sys.argv[1])
    sys.path[:] = [p for p in sys.path if p not in ("", ".", os.getcwd())]
    try:
        if sys.version_info < (3, 8):  # noqa: UP036 - this runs on the task image's python, of any age
            v = "{}.{}".format(*sys.version_info[:2])
            result = {"ok": False, "version": v, "reason": f"the image's python3 is {v}; the verifier's copy needs 3.8+"}
        else:
            result = main(config)
    except Exception as e:  # noqa: BLE001 - the host gets the reason and falls back
        result = {"ok": False, "reason": f"snapshotting the image's python3 failed: {type(e).__name__}: {e}"}
    sys.stdout.write("\nJRT_PROBE " + json.dumps(result) + "\n")
