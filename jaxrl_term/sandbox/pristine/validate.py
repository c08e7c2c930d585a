"""Check a freshly filled toolchain volume through the verifier's own invocation, and warm its bytecode.

``<mount>/so/ld.so --library-path <mount>/so <mount>/bin/python3 -I -S -X pycache_prefix=<mount>/pycache -c <this>
<config json>`` in a one-shot container of the pristine image with the volume mounted read-write at ``<mount>``.
Every module the runner needs must come from the volume: the stdlib, pytest and its dependencies, ctypes (for
``prctl``), xml, zlib. A one-test pytest session and the common stdlib modules are imported with bytecode
writing on, so that their ``.pyc`` land in ``<mount>/pycache`` (read-only later). Last line:
``JRT_VALIDATE <json>``.
"""

import json
import os
import sys

COMMON = ("json", "subprocess", "re", "pathlib", "shutil", "tempfile", "csv", "hashlib", "socket", "datetime",
          "collections", "itertools", "functools", "typing", "dataclasses", "unittest", "threading", "asyncio",
          "random", "math", "statistics", "decimal", "struct", "base64", "zlib", "gzip", "tarfile", "zipfile", "io",
          "textwrap", "string", "glob", "fnmatch", "stat", "signal", "time", "logging", "argparse", "inspect",
          "ast", "difflib", "pprint", "copy", "enum", "contextlib", "operator", "uuid", "shlex", "configparser",
          "sqlite3", "http.client", "urllib.request", "xml.etree.ElementTree", "email", "html", "ctypes",
          "multiprocessing", "platform", "getpass", "pwd", "grp", "locale", "importlib.util", "traceback")


def main(cfg):
    mount = cfg["mount"].rstrip("/")

    def inside(p):
        p = os.path.realpath(p)
        return p == mount or p.startswith(mount + "/")

    out = {"problems": []}
    foreign = [p for p in sys.path if p and not inside(p)]
    if foreign:
        out["problems"].append(f"sys.path outside the volume: {foreign}")
    sys.path[:] = [p for p in sys.path if p] + [mount + "/pytest"]
    sys.dont_write_bytecode = False
    import importlib

    for name in ("encodings", "os", "zlib", "base64", "json", "xml.etree.ElementTree", "ctypes", "pytest",
                 "_pytest", "pluggy") + tuple(cfg["deps"]):
        try:
            m = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001
            out["problems"].append(f"import {name}: {type(e).__name__}: {e}")
            continue
        f = getattr(m, "__file__", None)
        if f and not inside(f):
            out["problems"].append(f"{name} comes from {f}, outside the volume")
    for name in COMMON:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001, S110 - not every image has every module; only bytecode warming
            pass
    foreign = sorted({getattr(m, "__file__", "") for m in list(sys.modules.values())
                      if getattr(m, "__file__", None) and not inside(m.__file__)})
    if foreign:
        out["problems"].append(f"modules loaded from outside the volume: {foreign[:10]}")
    try:
        import ctypes

        if ctypes.CDLL(None).prctl(4, 0, 0, 0, 0) != 0:
            out["problems"].append("prctl(PR_SET_DUMPABLE) failed")
    except Exception as e:  # noqa: BLE001
        out["problems"].append(f"ctypes: {type(e).__name__}: {e}")
    import tempfile

    import pytest

    d = tempfile.mkdtemp(prefix="jrt-validate-")
    with open(os.path.join(d, "test_ok.py"), "w") as f:
        f.write("def test_ok():\n    assert 1 + 1 == 2\n")
    with open(os.path.join(d, "pytest.ini"), "w") as f:
        f.write("[pytest]\n")
    saved = os.dup(1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    try:
        rc = pytest.main([os.path.join(d, "test_ok.py"), "-rA", "-p", "no:cacheprovider", "-c",
                          os.path.join(d, "pytest.ini"), "--rootdir=" + d, "--confcutdir=" + d,
                          "--junitxml=" + os.path.join(d, "j.xml")])
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
    if rc != 0:
        out["problems"].append(f"a one-test pytest session through the copy exited {rc}")
    out["pytest"] = pytest.__version__
    return out


if __name__ == "__main__":
    try:
        result = main(json.loads(sys.argv[1]))
    except Exception as e:  # noqa: BLE001 - the host gets the reason and falls back
        result = {"problems": [f"{type(e).__name__}: {e}"]}
    sys.stdout.write("\nJRT_VALIDATE " + json.dumps(result) + "\n")
