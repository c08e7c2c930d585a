"""File operations beneath a host directory the sandbox can write, that never follow a symbolic link.

The host process (root, often) reads and writes files in directories the agent controls, so every path is walked
component by component from the directory's own descriptor with ``O_NOFOLLOW`` (``openat2(RESOLVE_BENEATH |
RESOLVE_NO_SYMLINKS)`` semantics): a link anywhere in the path, swapped in at any moment, makes the call fail
instead of reaching the host. The final file must be a regular file (a FIFO would block the host), opened
non-blocking. ``owner`` = (uid, gid) given to what is created, so the agent can change it afterwards.

``parts``: the path's components below the directory, already free of ``.`` and ``..``.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from jaxrl_term.sandbox.base import SandboxError

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
Owner = tuple[int, int] | None


def _no_links(what: str, name: str) -> SandboxError:
    return SandboxError(f"{what}: {name!r} is a symbolic link or not a directory; the local sandbox's file API "
                        "follows no links (use the shell)")


def _sub_dir(fd: int, name: str, what: str, *, create: bool, owner: Owner) -> int:
    try:
        return os.open(name, DIR_FLAGS, dir_fd=fd)
    except FileNotFoundError:
        if not create:
            raise SandboxError(f"{what}: no such file or directory") from None
    except OSError as e:
        raise _no_links(what, name) from e
    try:
        os.mkdir(name, 0o755, dir_fd=fd)
    except FileExistsError:
        pass
    try:
        sub = os.open(name, DIR_FLAGS, dir_fd=fd)
    except OSError as e:
        raise _no_links(what, name) from e
    if owner:
        os.fchown(sub, *owner)
    return sub


def open_dir(root: Path, parts: list[str], what: str, *, create: bool = False, owner: Owner = None) -> int:
    """A descriptor of root/parts (directories made when ``create``)."""
    fd = os.open(root, DIR_FLAGS)
    try:
        for part in parts:
            sub = _sub_dir(fd, part, what, create=create, owner=owner)
            os.close(fd)
            fd = sub
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_file(dir_fd: int, name: str, what: str, flags: int, mode: int = 0o600) -> int:
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except FileNotFoundError:
        raise SandboxError(f"read_file {what}: no such file") from None
    except OSError as e:
        raise SandboxError(f"{what}: {os.strerror(e.errno)} (the local sandbox's file API follows no links)") from e
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise SandboxError(f"{what}: not a regular file")
    return fd


def _write_at(dir_fd: int, name: str, what: str, src, mode: int, owner: Owner) -> int:
    fd = _open_file(dir_fd, name, what, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        with open(fd, "wb", closefd=False) as f:
            if isinstance(src, bytes):
                f.write(src)
            else:
                shutil.copyfileobj(src, f, 1 << 20)
        os.fchmod(fd, mode)
        if owner:
            os.fchown(fd, *owner)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write(root: Path, parts: list[str], data: bytes, mode: int, what: str, owner: Owner = None) -> None:
    if not parts:
        raise SandboxError(f"{what}: a directory")
    dfd = open_dir(root, parts[:-1], what, create=True, owner=owner)
    try:
        os.close(_write_at(dfd, parts[-1], what, data, mode, owner))
    finally:
        os.close(dfd)


def read(root: Path, parts: list[str], what: str) -> bytes:
    if not parts:
        raise SandboxError(f"read_file {what}: a directory")
    dfd = open_dir(root, parts[:-1], what)
    try:
        fd = _open_file(dfd, parts[-1], what, os.O_RDONLY)
    finally:
        os.close(dfd)
    with open(fd, "rb") as f:
        return f.read()


def upload(src: Path, root: Path, parts: list[str], what: str, owner: Owner = None) -> None:
    """Copy the host tree ``src`` into root/parts: modes and mtimes kept, links copied as links."""
    dfd = open_dir(root, parts, what, create=True, owner=owner)
    try:
        _upload(src, dfd, what, owner)
        os.fchmod(dfd, stat.S_IMODE(src.stat().st_mode))
    finally:
        os.close(dfd)


def _upload(src: Path, dfd: int, what: str, owner: Owner) -> None:
    for e in os.scandir(src):
        st = e.stat(follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            try:
                os.unlink(e.name, dir_fd=dfd)
            except (FileNotFoundError, IsADirectoryError, PermissionError):
                pass
            os.symlink(os.readlink(e.path), e.name, dir_fd=dfd)
            if owner:
                os.chown(e.name, *owner, dir_fd=dfd, follow_symlinks=False)
        elif stat.S_ISDIR(st.st_mode):
            sub = _sub_dir(dfd, e.name, what, create=True, owner=owner)
            try:
                _upload(Path(e.path), sub, what, owner)
                os.fchmod(sub, stat.S_IMODE(st.st_mode))
            finally:
                os.close(sub)
        elif stat.S_ISREG(st.st_mode):
            with open(e.path, "rb") as f:
                fd = _write_at(dfd, e.name, what, f, stat.S_IMODE(st.st_mode), owner)
            try:
                os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))
            finally:
                os.close(fd)


def listing(root: Path) -> list[str]:
    """Every entry below ``root`` as a relative path (links listed, never followed)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        out += [os.path.normpath(os.path.join(rel, n)) for n in dirnames + filenames]
    return sorted(out)
