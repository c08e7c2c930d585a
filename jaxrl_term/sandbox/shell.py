"""A persistent bash per sandbox with exact command completion that the agent cannot forge.

Each command goes to one long-lived ``bash`` (``cd``, variables and functions persist) and comes back with its
output and a status proven by a MAC the agent cannot make (``framing.py`` explains the protocol). Anything that
does not verify (a wrong tag, the loop's own checks failing, a command that claims another length) restarts the
shell and the result says ``framing_broken``; the status of such a command is unknown, never guessed.

stdout and stderr are one pipe (``exec 2>&1``), so they stay in order. There is no job control (``set -m``): a
foreground job killed by SIGINT would make a non-interactive bash with job control abandon the loop. On timeout
the command's processes (``KILL_SCRIPT``) get SIGINT, then whatever is left is stopped and killed, from outside
the shell, and the shell goes on. A shell stuck in a builtin loop, or one the command exited or replaced, is
restarted (state is lost; the result says so), and the old shell's whole tree is killed (``kill_tree``). When the
sandbox nears its pid limit after a command (``pid_pressure``), what the last few commands started is killed: a
fork bomb returns at once and keeps every pid. Output is capped head + tail; invalid UTF-8 is replaced.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import inspect
import logging
import os
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from jaxrl_term.sandbox import framing
from jaxrl_term.sandbox.base import CommandResult, SandboxError, SandboxLost

log = logging.getLogger(__name__)

SHELL_ARGV = ["bash", "--noprofile", "--norc"]  # non-interactive: no prompts, job notices or history to handle
RECENT_COMMANDS = 4  # under pid pressure, the processes these last commands started are killed

# Run out of band (not in the shell), with bash builtins only (no fork per process, so it works even when a
# fork bomb holds every pid). A process is *new* if its pid is above the namespace's last pid when the
# command began, or it started after the command's start tick (pids wrap). The command's processes are the new
# ones whose line of parents reaches the shell (its children, their children ...) or the namespace's init
# (orphans: a daemon the command double-forked) without passing an old process: the children an earlier
# command's background job forks later are spared with it, and so is anything started from outside the shell
# (a ``docker exec``, whose parent is outside the namespace). KILL first stops them all (no more forking), then
# kills, twice, to catch children born mid-pass.
KILL_SCRIPT = r"""
shell=$1; t0=$2; last=$3; sig=$4
scan() {
  pids=(); declare -gA parent=() start=() verdict=()
  for d in /proc/[0-9]*; do
    read -r s 2>/dev/null < "$d/stat" || continue
    r=${s##*) }; set -- $r
    p=${d#/proc/}; pids+=("$p"); parent[$p]=$2; start[$p]=${20}
  done
}
is_new() { (( $1 > last || ${start[$1]:-0} > t0 )); }
ours() {  # new, and its parents reach the shell or init through new processes only (memoised per scan)
  local p=$1 chain=() v=0
  while :; do
    if [[ -n ${verdict[$p]} ]]; then v=${verdict[$p]}; break; fi
    if (( p == shell || p == 1 )); then v=1; break; fi
    if (( p == 0 )) || ! is_new "$p"; then v=0; break; fi
    chain+=("$p"); p=${parent[$p]:-0}
  done
  for p in "${chain[@]}"; do verdict[$p]=$v; done
  (( v ))
}
signal_all() {
  scan
  for p in "${pids[@]}"; do
    (( p == $$ || p == shell || p == 1 )) && continue
    ours "$p" && kill -s "$1" "$p" 2>/dev/null
  done
}
if [ "$sig" = KILL ]; then signal_all STOP; signal_all KILL; signal_all KILL; else signal_all "$sig"; fi
exit 0
"""

# The old shell's whole tree, out of band: the shell, its descendants, and (when it or its parent, the stdin relay,
# leads its session, as an exec'd process does) every process of its session: background jobs in their own process groups and their
# orphans. Daemons that left the session with setsid are spared, as when a terminal closes.
KILL_TREE_SCRIPT = r"""
shell=$1
read -r s < "/proc/$shell/stat" || exit 0
r=${s##*) }; set -- $r; sid=$4; lead=0
# its session counts when the shell leads it, or when its parent (the toolkit's stdin relay) does
[[ $sid = "$shell" || $sid = "$2" ]] && lead=1
pass() {
  local sig=$1
  declare -A kids=()
  local -a all=() parents=() sessions=()
  for d in /proc/[0-9]*; do
    read -r s 2>/dev/null < "$d/stat" || continue
    r=${s##*) }; set -- $r
    all+=("${d#/proc/}"); parents+=("$2"); sessions+=("$4")
  done
  kids[$shell]=1
  local grew=1
  while ((grew)); do
    grew=0
    for i in "${!all[@]}"; do
      p=${all[i]}
      [[ -n ${kids[$p]} ]] && continue
      if [[ -n ${kids[${parents[i]}]} ]] || { (( lead )) && [[ ${sessions[i]} = "$sid" ]]; }; then kids[$p]=1; grew=1; fi
    done
  done
  for p in "${!kids[@]}"; do [[ $p = $$ || $p = 1 ]] || kill -s "$sig" "$p" 2>/dev/null; done
}
pass STOP; pass KILL; pass KILL
exit 0
"""
CLK_TCK = os.sysconf("SC_CLK_TCK")


def kill_command(shell_pid: int, start: tuple[int, int], sig: str) -> list[str]:
    """argv that signals one command's processes (``start`` = (tick, last pid) when it began), for backends
    that run it next to the shell."""
    return ["bash", "-c", KILL_SCRIPT, "bash", str(shell_pid), str(start[0]), str(start[1]), sig]


def kill_tree_command(shell_pid: int) -> list[str]:
    """argv that kills a shell and its whole tree (see ``KILL_TREE_SCRIPT``), for backends that run it next to
    the shell as root."""
    return ["bash", "-c", KILL_TREE_SCRIPT, "bash", str(shell_pid)]


class Transport(Protocol):
    """A byte pipe to the shell: its stdin, and its stdout (stderr merged in by the shell itself).

    A transport whose shell reads a *socket* (not a pipe) sets ``sealed = True``: a process the agent leaves
    holding the shell's stdin can then read a command before bash does (the command then never runs: a timeout)
    but cannot write one in its place (``/proc/self/fd/N`` reopens a pipe for writing, never a socket).
    """

    sealed: bool

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

    def drop_suffix(self, pattern: re.Pattern) -> None:
        """Remove a match of ``pattern`` (anchored at the end) from the end of what was kept."""
        buf = self.tail if self.tail else self.head
        m = pattern.search(bytes(buf[-4096:]))
        if m is not None:
            cut = len(m.group(0))
            del buf[len(buf) - cut:]
            self.total -= cut

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


async def _call_hook(fn: Callable[..., Any], *args) -> Any:
    """Hooks may be plain or async callables."""
    out = fn(*args)
    return await out if inspect.isawaitable(out) else out


_FIELDS = {f.name for f in dataclasses.fields(CommandResult)}


def _result(output: str, code: int | None, timed_out: bool, truncated: bool, duration: float, *,
            restarted: bool = False, broken: bool = False) -> CommandResult:
    extra = {"framing_broken": broken} if "framing_broken" in _FIELDS else {}
    return CommandResult(output, code, timed_out, truncated, duration, shell_restarted=restarted, **extra)


@dataclasses.dataclass
class _Marker:
    code: int
    length: int
    start: tuple[int, int]  # (boot tick, last pid) when the marker was made: the next command's kill reference
    pid: int
    cwd: str


class PersistentShell:
    """One long-lived bash over a ``Transport``; ``run`` is serialised (one command at a time).

    Hooks from the backend (``shell_pid`` is the shell's pid in the sandbox's pid namespace):

    * ``spawn()``: a new transport to a fresh ``SHELL_ARGV`` bash, started non-dumpable (``toolkit.NODUMP``);
    * ``signal_command(shell_pid, start, sig)``: send ``sig`` (INT, or KILL) to the processes of the command
      that began at ``start`` = (boot tick, last pid of the pid namespace), by the rule of ``KILL_SCRIPT``;
    * ``kill_tree(shell_pid)``: SIGKILL a shell being replaced and its whole tree (``KILL_TREE_SCRIPT``);
    * ``pid_pressure()``: True when the sandbox's process count is near its limit;
    * ``recover()``: reset a sandbox in which not even a new shell can start (every pid taken).

    Only ``spawn`` and ``signal_command`` are required; the others may be plain or async callables.
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
        kill_tree: Callable[[int], Any] | None = None,
        pid_pressure: Callable[[], Any] | None = None,
    ):
        self._spawn, self._signal_command, self._recover = spawn, signal_command, recover
        self._kill_tree, self._pid_pressure = kill_tree, pid_pressure
        self.workdir, self.max_output_bytes, self.kill_grace_s = workdir, max_output_bytes, kill_grace_s
        self.env = env or {}
        self._t: Transport | None = None
        self._buf = bytearray()
        self._lock = asyncio.Lock()
        self._key = (0, 0)
        self.pid: int | None = None
        self.protected: bool | None = None  # whether the shell is non-dumpable (its key unreadable)
        self.input_sealed = False  # whether the shell's stdin is a socket (see ``Transport``)
        self.restarts = 0
        self.last_cwd: str | None = workdir
        self._start = (0, 0)  # kill reference: (tick, last pid) at the end of the previous command
        self._recent: collections.deque[tuple[int, int]] = collections.deque(maxlen=RECENT_COMMANDS)
        self._shell_start = (0, 0)  # kill reference of everything this shell started
        self._pressed = False  # the previous check found pressure too

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self, timeout_s: float = 30.0) -> None:
        self._t = await self._spawn()
        self._buf.clear()
        self.pid = None
        self._key = (secrets.randbits(64), secrets.randbits(64))
        try:
            state = f"__jrt_s{secrets.token_hex(8)}"
            script = framing.setup_script(self.env, self.last_cwd) + framing.loop_script(*self._key, state)
            await self._t.write(script.encode())
            async with asyncio.timeout(timeout_s):  # not wait_for: on 3.11 it can swallow a cancellation
                m = await self._exchange(framing.PROBE, timeout_s)
        except (TimeoutError, EOFError, OSError) as e:
            old = re.search(rb"__JRT_OLD_BASH (\S+)", self._buf)
            if old:
                raise SandboxError(f"the sandbox's bash is {old.group(1).decode()}; the persistent shell needs "
                                   "bash >= 4.4 (use a newer base image)") from e
            raise SandboxError(f"the shell did not start within {timeout_s:.0f}s (is bash in the image?): {e}") from e
        if m is None:
            raise SandboxError(f"the shell's framing failed at start: {decode(bytes(self._buf[-500:]))}")
        self.pid, self._start = m.pid, m.start
        self._shell_start = m.start
        self._pressed = False
        self._recent.clear()
        self.input_sealed = bool(getattr(self._t, "sealed", False))
        self.protected = m.code != 0
        if not self.protected:
            log.warning("sandbox shell %s is dumpable: its framing key can be read by the agent's processes "
                        "(start it with LD_PRELOAD=%s)", self.pid, "/opt/jaxrl/nodump.so")
        self._buf.clear()

    async def _exchange(self, command: str, timeout_s: float) -> _Marker | None:
        """Send one command at start-up and wait for its marker (no timeout handling: used for the probe)."""
        n, payload = framing.frame(command)
        await self._t.write(payload)
        while True:
            got = self._match(n)
            if got is not None:
                marker, _, end = got
                del self._buf[:end]
                return marker
            if re.search(rb"\n__JRT_" + n.encode() + rb"_BROKEN_", self._buf):
                return None
            await self._fill()

    async def close(self) -> None:
        if self._t is not None:
            await self._t.close()
            self._t = None

    async def _restart(self) -> None:
        old = self.pid
        await self.close()
        if old is not None and self._kill_tree is not None:
            try:
                await _call_hook(self._kill_tree, old)
            except Exception as e:  # noqa: BLE001 - the new shell still starts; the old tree is logged
                log.warning("could not kill the old shell's process tree (pid %s): %s", old, e)
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

    # -- framing ----------------------------------------------------------------------------------
    def _match(self, n: str) -> tuple[_Marker, int, int] | None:
        """The verified end marker for nonce ``n`` in the buffer (``framing.Forged`` on a bad tag)."""
        got = framing.end_marker(self._buf, n, self._key)
        if got is None:
            return None
        f, start, end = got
        tick = f["cs"] * CLK_TCK // 100
        ref = (tick, f["last_pid"]) if tick and f["last_pid"] else self._start  # 0: /proc was unreadable
        return _Marker(f["code"], f["length"], ref, f["pid"], f["cwd"]), start, end

    # -- reading ----------------------------------------------------------------------------------
    async def _fill(self) -> None:
        assert self._t is not None
        data = await self._t.read()
        if not data:
            raise EOFError("the shell exited")
        self._buf += data

    # -- commands ---------------------------------------------------------------------------------
    async def run(self, command: str, timeout_s: float) -> CommandResult:
        async with self._lock:
            if self._t is None:
                await self.start()
            start = self._start
            res = await self._run(command, timeout_s)
            return await self._after(res, start)

    async def _after(self, res: CommandResult, start: tuple[int, int]) -> CommandResult:
        """Pid pressure: kill what the last few commands started (a fork bomb that returned at once keeps
        growing after its command ended, so the check after a later command must still reach it)."""
        self._recent.append(start)
        if self._pid_pressure is None or self.pid is None:
            return res
        try:
            pressed = await _call_hook(self._pid_pressure)
        except Exception as e:  # noqa: BLE001 - the check is advisory; the pid limit still holds
            log.debug("pid_pressure: %s", e)
            return res
        if not pressed:
            self._pressed = False
            return res
        if self._pressed:  # killing what the last commands started did not help: everything this shell started
            await self._signal(self._shell_start, "KILL")
            what = "every process the shell's commands started was killed"
        else:
            await self._signal(self._recent[0], "KILL")
            what = f"what the last {RECENT_COMMANDS} commands started was killed"
        self._pressed = True
        self._recent.clear()
        return dataclasses.replace(res, output=res.output + f"\n[sandbox: the sandbox was near its process limit; {what}]")

    async def _run(self, command: str, timeout_s: float) -> CommandResult:
        n, payload = framing.frame(command)
        t0 = time.monotonic()
        start = self._start
        cap = OutputCapture(self.max_output_bytes)
        try:
            await self._t.write(payload)
        except (OSError, RuntimeError) as e:
            await self._restart()
            return _result(f"[sandbox: the shell stopped responding ({e}); it was restarted]", None, False, False,
                           time.monotonic() - t0, restarted=True)
        tag = b"\n__JRT_" + n.encode()
        broken_pat = re.compile(re.escape(tag) + rb"_BROKEN_(\w+)\n")
        begun = False
        deadline = t0 + timeout_s
        timed_out = False
        stage = 0  # 0 running, 1 SIGINT sent, 2 SIGKILL sent
        while True:
            if not begun:
                b = self._buf.find(tag + b"_BEGIN\n")
                if b >= 0:
                    del self._buf[: b + len(tag) + 7]
                    begun = True
            try:
                got = self._match(n)
            except framing.Forged as e:
                return await self._broken(cap, str(e), timed_out, t0)
            if got is not None:
                marker, at, end = got
                cap.add(bytes(self._buf[:at]))
                del self._buf[:end]
                if marker.pid != self.pid or marker.length != len(payload) - framing.HEADER:
                    return await self._broken(cap, "the shell evaluated something else than the command",
                                              timed_out, t0)
                cap.drop_suffix(framing.XTRACE_TAIL)
                self.last_cwd = marker.cwd or self.last_cwd
                self._start = marker.start
                if timed_out and stage < 2:
                    # The foreground part stopped on SIGINT; what it left running (background children
                    # ignore SIGINT) is killed too, so a timed-out command leaves nothing behind.
                    await self._signal(start, "KILL")
                return _result(cap.text(), marker.code, timed_out, cap.truncated, time.monotonic() - t0)
            b = broken_pat.search(self._buf)
            if b is not None:
                why = b.group(1).decode()  # (before the buffer changes: a match on a bytearray reads it lazily)
                cap.add(bytes(self._buf[: b.start()]))
                self._buf.clear()
                return await self._broken(cap, f"the shell's own checks failed ({why})", timed_out, t0)
            # Everything before a (possibly partial) marker can go to the capture already (before the command
            # began: what background jobs printed between commands, dropped).
            at = self._buf.find(tag)
            safe = at if at >= 0 else max(0, len(self._buf) - len(tag) - 8)
            if safe:
                if begun:
                    cap.add(bytes(self._buf[:safe]))
                del self._buf[:safe]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if stage == 2:  # the shell itself is stuck (e.g. a builtin loop): replace it
                    cap.add(bytes(self._buf))
                    self._buf.clear()
                    await self._restart()
                    note = "\n[sandbox: command timed out; the shell was restarted, variables and functions are lost]"
                    return _result(cap.text() + note, None, True, cap.truncated, time.monotonic() - t0,
                                   restarted=True)
                timed_out = True
                stage += 1
                await self._signal(start, "INT" if stage == 1 else "KILL")
                deadline = time.monotonic() + self.kill_grace_s
                continue
            try:
                async with asyncio.timeout(remaining):  # wait_for (3.11) loses a cancel that lands as _fill ends
                    await self._fill()
            except TimeoutError:
                continue
            except (EOFError, OSError):
                cap.add(bytes(self._buf))
                self._buf.clear()
                await self._restart()
                note = "\n[sandbox: the shell exited; a new one was started in the last directory]"
                return _result(cap.text() + note, None, timed_out, cap.truncated, time.monotonic() - t0,
                               restarted=True)

    async def _broken(self, cap: OutputCapture, why: str, timed_out: bool, t0: float) -> CommandResult:
        """The framing was tampered with: no status can be trusted; the shell (and its tree) is replaced."""
        self._buf.clear()
        await self._signal(self._start, "KILL")
        await self._restart()
        note = (f"\n[sandbox: framing broken: {why}; the command's status is unknown and the shell was restarted, "
                "variables and functions are lost]")
        return _result(cap.text() + note, None, timed_out, cap.truncated, time.monotonic() - t0, restarted=True,
                       broken=True)

    async def _signal(self, start: tuple[int, int], sig: str) -> None:
        try:
            await self._signal_command(self.pid, start, sig)
        except Exception as e:  # noqa: BLE001 - the restart path still recovers the sandbox if this fails
            log.debug("signal %s to the command's processes: %s", sig, e)
