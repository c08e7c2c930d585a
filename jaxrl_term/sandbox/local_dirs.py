"""The local backend's sandbox directories on the host: claiming one (with its dedicated uid when root), the owner
record kept in it, and reaping the directories of owners that are gone.

A sandbox lives in ``$TMPDIR/jaxrl_term-local-<euid>/jaxrl-<id>`` (mode 0711 up to it: the sandbox's uid can reach
its own subdirectories, and list nothing). ``owner.json`` beside the bound subdirectories (the sandbox never sees it)
holds the owner's identity (machine id, boot id, pid and its start time, run id: ``docker.owner_labels``) and the
limits made for the sandbox (``confine.Confinement.record``), written before any of them exists.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import tempfile
import threading
import time
import uuid
from pathlib import Path

from jaxrl_term.sandbox import confine as cf
from jaxrl_term.sandbox.base import SandboxError

log = logging.getLogger(__name__)

LEGACY_MAX_AGE_S = 3600  # directories of the old backend (no owner record) older than this are reaped
NO_RECORD_GRACE_S = 60  # a directory is claimed, then its record written at once: older without one is broken



def base_dir() -> Path:
    """Where this user's sandbox directories live (mode 0711: the sandboxes' uids may pass, not list)."""
    d = Path(tempfile.gettempdir()) / f"jaxrl_term-local-{os.geteuid()}"
    try:
        d.mkdir(mode=0o711)
    except FileExistsError:
        pass
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise SandboxError(f"{d} is not a directory owned by uid {os.geteuid()}: remove it")
    os.chmod(d, 0o711)
    return d


def claim() -> tuple[str, Path, int | None]:
    """A new sandbox directory; running as root also a dedicated host uid, claimed by the directory's name."""
    base = base_dir()
    for _ in range(1000):
        uid = cf.UID_BASE + int.from_bytes(os.urandom(4), "little") % cf.UID_SPAN if os.geteuid() == 0 else None
        name = f"jaxrl-u{uid}" if uid is not None else f"jaxrl-{uuid.uuid4().hex[:12]}"
        try:
            (base / name).mkdir(mode=0o711)
        except FileExistsError:
            continue
        return name, base / name, uid
    raise SandboxError(f"could not claim a sandbox directory under {base}")


def owner() -> dict[str, str]:
    from jaxrl_term.sandbox.docker import owner_labels  # the same owner identity as the Docker backend's labels

    return owner_labels()


def _owner_gone(owner: dict[str, str]) -> bool:
    from jaxrl_term.sandbox.docker import owner_gone

    return owner_gone(owner) is True


def _rmtree(path: Path) -> None:
    def fix(fn, p, exc):  # a directory the sandbox made unreadable (only matters when not root)
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else os.unlink(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=fix)


def destroy(root: Path) -> None:
    """Kill a sandbox's processes, remove its cgroups and its directory (from its owner record)."""
    try:
        rec = json.loads((root / "owner.json").read_text())
        cf.Confinement.from_record(rec["confine"]).release()
    except (OSError, ValueError, KeyError) as e:
        log.debug("no usable owner record in %s: %s", root, e)
        if root.name.startswith("jaxrl-u") and root.name[7:].isdigit():
            cf.Confinement("uid", 0, 0, int(root.name[7:])).kill_all()
    _rmtree(root)


def reap(*, all_runs: bool = False, run_id: str | None = None) -> int:
    """Remove local sandboxes left behind: by default those whose owner process is gone (SIGKILLed, crashed, or an
    earlier boot); ``run_id`` one run's; ``all_runs`` every one of this user. Returns how many were removed."""
    removed = 0
    for d in sorted(base_dir().iterdir()):
        if not d.name.startswith("jaxrl-"):
            continue
        try:
            owner = json.loads((d / "owner.json").read_text())["owner"]
        except (OSError, ValueError, KeyError):
            owner = None  # being created (the record follows within microseconds), or broken
        if all_runs:
            hit = True
        elif owner is None:
            hit = time.time() - d.stat().st_mtime > NO_RECORD_GRACE_S and run_id is None
        elif run_id is not None:
            hit = owner.get("jaxrl_term.run") == run_id
        else:
            hit = _owner_gone(owner)
        if hit:
            destroy(d)
            removed += 1
    # the backend before owner records: bare directories in the temp dir, no limits, processes died with bwrap
    for d in Path(tempfile.gettempdir()).glob("jaxrl-local-*"):
        if d.is_dir() and not d.is_symlink() and time.time() - d.stat().st_mtime > LEGACY_MAX_AGE_S:
            _rmtree(d)
            removed += 1
    if removed:
        log.info("reaped %d leftover local sandboxes", removed)
    return removed


OWN: set[Path] = set()  # this process's open sandbox directories, removed at exit if a close was skipped
_started = False
_start_lock = threading.Lock()


def _reap_own() -> None:
    for root in list(OWN):
        try:
            destroy(root)
        except Exception as e:  # noqa: BLE001 - best effort at exit: the next start-up's reap catches the rest
            log.debug("removing %s at exit: %s", root, e)


def first_start() -> None:
    """Once per process: reap what dead owners left, and remove this process's own sandboxes at exit."""
    global _started
    with _start_lock:
        if _started:
            return
        _started = True
    import atexit

    from jaxrl_term.sandbox.base import on_forced_exit

    atexit.register(_reap_own)
    on_forced_exit(_reap_own)  # a second SIGTERM exits without atexit
    try:
        reap()
    except Exception as e:  # noqa: BLE001 - leftovers must not stop a new run; they are retried next start
        log.warning("reaping local sandboxes failed: %s", e)


def write_record(root: Path, confinement: cf.Confinement) -> None:
    (root / "owner.json").write_text(json.dumps({"owner": owner(), "confine": confinement.record()}))
    os.chmod(root / "owner.json", 0o600)
