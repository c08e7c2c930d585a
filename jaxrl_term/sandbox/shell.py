"""A persistent bash per sandbox with exact, framed command completion.

The shell reads its script from a pipe. Every command is sent as a quoted here-document (so quotes,
heredocs and syntax errors inside it cannot desynchronise the shell), then ``eval``-ed in the shell itself
with stdin from /dev/null, between two markers carrying a fresh nonce::

    \\n__JRT_<nonce>_BEGIN_<uptime>_<last pid>_\\n   <command output>   \\n__JRT_<nonce>_END_<exit status>_<cwd>\\n

``cd``, variables and functions persist; stdout and stderr are one pipe (``exec 2>&1``), so they stay in
order. Job control (``set -m``) puts every job of a command in its own process group. On timeout the
command's processes (see ``KILL_SCRIPT``) get SIGINT, then whatever is left is stopped and killed, from
outside the shell, and the shell goes on.
A shell stuck in a builtin loop, or one the command exited, is restarted (state is lost; the result says so).
Output is capped head + tail with a marker; invalid UTF-8 is replaced.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Protocol

from jaxrl_term.sandbox.base import CommandResult, SandboxError, SandboxLost

# Run out of band (not in the shell), with bash builtins only (no fork per process, so it works even when a
# fork bomb holds every pid). A process is *new* if its pid is above the namespace's last pid when the
# command began, or it started after the command's start tick (pids wrap). The command's processes are the
# new ones in the shell's own process group (command substitutions) or in a process group with no old
# member (the jobs it started, their orphans, setsid'ed daemons). Jobs of earlier commands keep their old
# process groups, so a server started before is left alone. KILL first stops them all (no more forking),
# then kills, twice, to catch children born mid-pass.
KILL_SCRIPT = r"""
shell=$1; t0=$2; last=$3; sig=$4
read -r s < "/proc/$shell/stat" || exit 0
r=${s##*) }; set -- $r; shell_pgrp=$3
scan() {
  pids=(); pgrps=(); starts=()
  for d in /proc/[0-9]*; do
    read -r s < "$d/stat" 2>/dev/null || continue
    r=${s##*) }; set -- $r
    pids+=("${d#/proc/}"); pgrps+=("$3"); starts+=("${20}")
  done
}
declare -A old
scan
is_new() { [ "${pids[$1]}" -gt "$last" ] || [ "${starts[$1]}" -gt "$t0" ]; }
for i in "${!pids[@]}"; do is_new "$i" || old[${pgrps[i]}]=1; done
signal_all() {
  scan
  for i in "${!pids[@]}"; do
    p=${pids[i]}
    { [ "$p" = "$$" ] || [ "$p" = "$shell" ] || ! is_new "$i"; } && continue
    g=${pgrps[i]}
    if [ "$g" = "$shell_pgrp" ] || [ -z "${old[$g]}" ]; then kill -s "$1" "$p" 2>/dev/null; fi
  done
}
if [ "$sig" = KILL ]; then signal_all STOP; signal_all KILL; signal_all KILL; else signal_all "$sig"; fi
exit 0
"""
CLK_TCK = os.sysconf("SC_CLK_TCK")


def kill_command(shell_pid: int, start: tuple[int, int], sig: str) -> list[str]:
    """argv that signals one command's processes (``start`` = (tick, last pid) when it began), for backends
    that run it next to the shell."""
    return ["bash", "-c", KILL_SCRIPT, "bash", str(shell_pid), str(start[0]), str(start[1]), sig]


class Transport(Protocol):
    """A byte pipe to the shell: its stdin, and its stdout (stderr merged in by the shell itself)."""

    async def write(self, data: bytes) -> None: ...
    async def read(self) -> bytes: ...  # b"" at EOF
    async def close(self) -> None: ...


class OutputCapture:
    """Keep the first ``head`` and the last ``tail`` bytes of a stream; count what was dropped."""

    def __init__(self, limit: int):
        self.head_limit = limit // 2
        self.tail_limit = limit - self.head_limit
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head_limit - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > self.tail_limit:
                del self.tail[: len(self.tail) - self.tail_limit]

    @property
    def truncated(self) -> bool:
        return self.total > len(self.head) + len(self.tail)

    def text(self) -> str:
        if not self.truncated:
            raw = bytes(self.head + self.tail)
            return decode(raw)
        dropped = self.total - len(self.head) - len(self.tail)
        return decode(bytes(self.head)) + f"\n[... {dropped} bytes of output truncated ...]\n" + decode(bytes(self.tail))


def decode(raw: bytes) -> str:
    """Lossy text for the model: invalid UTF-8 becomes U+FFFD, NUL bytes become ``\\0``."""
    return raw.decode("utf-8", errors="replace").replace("\x00", "\\0")


class PersistentShell:
    """One long-lived bash over a ``Transport``; ``run`` is serialised (one command at a time).

    ``spawn`` opens a new transport to a fresh ``bash``; ``signal_command(shell_pid, start, sig)`` sends
    ``sig`` (INT, or KILL) to the processes of the command that began at ``start`` = (boot tick, last pid
    of the pid namespace), by the rule of ``KILL_SCRIPT``.
    """

    def __init__(
        self,
        spawn: Callable[[], Awaitable[Transport]],
        signal_command: Callable[[int, tuple[int, int], str], Awaitable[None]],
        *,
        workdir: str | None = None,
        max_output_bytes: int = 32768,
        kill_grace_s: float = 1.0,
        env: dict[str, str] | None = None,
        recover: Callable[[], Awaitable[None]] | None = None,
    ):
        self._spawn, self._signal_command, self._recover = spawn, signal_command, recover
        self.workdir, self.max_output_bytes, self.kill_grace_s = workdir, max_output_bytes, kill_grace_s
        self.env = env or {}
        self._t: Transport | None = None
        self._buf = bytearray()
        self._lock = asyncio.Lock()
        self.pid: int | None = None
        self.restarts = 0
        self.last_cwd: str | None = workdir

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self, timeout_s: float = 30.0) -> None:
        self._t = await self._spawn()
        self._buf.clear()
        nonce = uuid.uuid4().hex
        exports = "".join(f"export {k}={_sh_quote(v)}\n" for k, v in self.env.items())
        cd = f"cd {_sh_quote(self.last_cwd)} 2>/dev/null || true\n" if self.last_cwd else ""
        await self._t.write(
            (
                "exec 2>&1\nset -m\ntrap : INT\nset +o history\nunset PROMPT_COMMAND\nexport PAGER=cat GIT_PAGER=cat TERM=dumb\n"
                f"{exports}{cd}printf '\\n__JRT_{nonce}_READY_%s_\\n' \"$$\"\n"
            ).encode()
        )
        pat = re.compile(rb"\n__JRT_" + nonce.encode() + rb"_READY_(\d+)_\n")
        try:
            m = await asyncio.wait_for(self._read_until(pat), timeout_s)
        except (asyncio.TimeoutError, EOFError) as e:
            raise SandboxError(f"the shell did not start within {timeout_s:.0f}s (is bash in the image?): {e}") from e
        self.pid, end = int(m.group(1)), m.end()
        del self._buf[:end]

    async def close(self) -> None:
        if self._t is not None:
            await self._t.close()
            self._t = None

    async def _restart(self) -> None:
        await self.close()
        self.restarts += 1
        try:
            await self.start()
        except Exception as first:
            # A sandbox that cannot even start a new shell (e.g. every pid taken by a fork bomb): let the
            # backend reset it (the Docker backend restarts the container; files are kept), then retry once.
            if self._recover is None:
                raise SandboxLost(f"the shell could not be restarted: {first}") from first
            try:
                await self.close()
                await self._recover()
                await self.start()
            except Exception as e:
                raise SandboxLost(f"the sandbox could not be recovered: {e}") from e

    # -- reading ----------------------------------------------------------------------------------
    async def _fill(self) -> None:
        assert self._t is not None
        data = await self._t.read()
        if not data:
            raise EOFError("the shell exited")
        self._buf += data

    async def _read_until(self, pat: re.Pattern) -> re.Match:
        while True:
            m = pat.search(self._buf)
            if m:
                return m
            await self._fill()

    # -- commands ---------------------------------------------------------------------------------
    async def run(self, command: str, timeout_s: float) -> CommandResult:
        async with self._lock:
            if self._t is None:
                await self.start()
            return await self._run(command, timeout_s)

    async def _run(self, command: str, timeout_s: float) -> CommandResult:
        nonce = uuid.uuid4().hex
        tag = f"__JRT_{nonce}"
        if tag in command:
            raise SandboxError("command contains the shell's framing nonce")
        # The framing lines run with errexit off (a user's `set -e` must not kill the shell on our own
        # `read`, which returns 1 at the end of the here-document); the user's setting is restored around
        # their command, so `set -e` keeps its meaning for what they run.
        script = (
            "__jrt_e=${-//[^e]/}; set +e\n"
            f"IFS= read -r -d '' __jrt_c <<'{tag}_CMD'\n{command}\n{tag}_CMD\n"
            "read -r __jrt_up _ < /proc/uptime; read -r _ _ _ _ __jrt_lp < /proc/loadavg\n"
            f"printf '\\n{tag}_BEGIN_%s_%s_\\n' \"$__jrt_up\" \"$__jrt_lp\"\n"
            '[ -n "$__jrt_e" ] && set -e\n'
            'eval "$__jrt_c" < /dev/null\n'
            "__jrt_rc=$?; __jrt_e=${-//[^e]/}; set +e\n"
            f"printf '\\n{tag}_END_%s_%s\\n' \"$__jrt_rc\" \"$PWD\"\n"
            '[ -n "$__jrt_e" ] && set -e\n'
        )
        t0 = time.monotonic()
        cap = OutputCapture(self.max_output_bytes)
        try:
            await self._t.write(script.encode())
            begin = await asyncio.wait_for(
                self._read_until(re.compile(rb"\n" + tag.encode() + rb"_BEGIN_([\d.]*)_(\d*)_\n")), max(timeout_s, 5.0)
            )
        except (EOFError, asyncio.TimeoutError, OSError) as e:
            await self._restart()
            return CommandResult(f"[sandbox: the shell stopped responding ({e}); it was restarted]", None,
                                 False, False, time.monotonic() - t0, shell_restarted=True)
        up, last_pid = begin.group(1).decode(), begin.group(2).decode()
        start = (int(float(up) * CLK_TCK) if up else 0, int(last_pid) if last_pid else 0)
        del self._buf[: begin.end()]
        end_pat = re.compile(rb"\n" + tag.encode() + rb"_END_(\d+)_(.*)\n")
        deadline = t0 + timeout_s
        timed_out = False
        stage = 0  # 0 running, 1 SIGINT sent, 2 SIGKILL sent
        while True:
            m = end_pat.search(self._buf)
            if m:
                # (groups first: a match on a bytearray reads the buffer lazily)
                code, cwd = int(m.group(1)), m.group(2).decode(errors="replace")
                cap.add(bytes(self._buf[: m.start()]))
                del self._buf[: m.end()]
                self.last_cwd = cwd or self.last_cwd
                if timed_out and stage < 2:
                    # The foreground part stopped on SIGINT; what it left running (background children
                    # ignore SIGINT) is killed too, so a timed-out command leaves nothing behind.
                    await self._signal(start, "KILL")
                return CommandResult(cap.text(), code, timed_out, cap.truncated, time.monotonic() - t0)
            # Everything before a (possibly partial) end marker can go to the capture already.
            at = self._buf.find(b"\n" + tag.encode())
            safe = at if at >= 0 else max(0, len(self._buf) - len(tag) - 1)
            if safe:
                cap.add(bytes(self._buf[:safe]))
                del self._buf[:safe]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if stage == 2:  # the shell itself is stuck (e.g. a builtin loop): replace it
                    cap.add(bytes(self._buf))
                    self._buf.clear()
                    await self._restart()
                    note = "\n[sandbox: command timed out; the shell was restarted, variables and functions are lost]"
                    return CommandResult(cap.text() + note, None, True, cap.truncated, time.monotonic() - t0,
                                         shell_restarted=True)
                timed_out = True
                stage += 1
                await self._signal(start, "INT" if stage == 1 else "KILL")
                deadline = time.monotonic() + self.kill_grace_s
                continue
            try:
                await asyncio.wait_for(self._fill(), remaining)
            except asyncio.TimeoutError:
                continue
            except (EOFError, OSError):
                cap.add(bytes(self._buf))
                self._buf.clear()
                await self._restart()
                note = "\n[sandbox: the shell exited; a new one was started in the last directory]"
                return CommandResult(cap.text() + note, None, timed_out, cap.truncated, time.monotonic() - t0,
                                     shell_restarted=True)

    async def _signal(self, start: tuple[int, int], sig: str) -> None:
        try:
            await self._signal_command(self.pid, start, sig)
        except Exception:  # noqa: BLE001 - the restart path still recovers the sandbox if this fails
            pass


def _sh_quote(s: str) -> str:
    return "'" + s.replace("'", "'\"'\"'") + "'"
