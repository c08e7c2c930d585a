"""The framing of the persistent shell: what bash runs around each command, and the tag that proves a status.

The agent's code runs *inside* the shell (it must: ``cd``, variables and functions persist), so it holds every
file descriptor the shell holds: it can read the shell's input (bash's saved copy of fd 0 while the command's
stdin is /dev/null), read and write the shell's output pipe (``/proc/self/fd/1`` reopens a pipe in any mode), and
through history, ``BASH_COMMAND`` in a DEBUG trap, ``PS4`` under ``set -x`` or a loadable builtin see whatever
text the shell parses. A marker built from a nonce that travels through those pipes can be read and forged, and
a marker printed by ``printf`` after ``eval`` can be replaced by a function. So the secret lives where only bash's
parser has it, and every marker carries a MAC:

* At start the shell reads one ``while`` loop with a fresh 128-bit key K inside it as arithmetic literals. It is
  parsed once, kept only in the parse tree and never printed: the loop, not the parser, reads each command (with
  ``read -N``), so no later text passes through history, ``BASH_COMMAND`` or ``set -v``. The shell is
  non-dumpable (``toolkit.NODUMP``): no other process can read its memory. Before the loop, ``enable`` (loadable
  builtins; re-enabling) and ``trap`` (DEBUG/ERR/signal handlers: the only way to run the agent's code between
  the loop's own commands) are disabled and ``PS4`` is read-only (no code in xtrace prompts).
* Per command the loop reads a header (a fresh 63-bit nonce n, the byte length) and the bytes, ``eval``s them
  with stdin from /dev/null after restoring the user's posix mode, the options posix mode resets and
  ``set -e/-u/-x``, then captures ``$?`` by arithmetic (a read-only target fails there instead of making bash
  abandon the loop), turns posix mode on by arithmetic (``(( POSIXLY_CORRECT = 1 ))``: special builtins ``set``,
  ``unset``, ``eval``, ``exit`` are then found before the agent's functions), removes the agent's ``read`` and
  ``printf`` functions, checks that none of its variables was made read-only or a nameref, and prints
  ``\n__JRT_<n>_END_<rc>_<len>_<uptime cs>_<last pid>_<pid>_<tag>_<cwd>\0\n`` with
  ``tag = SipHash-2-4_K(n, rc | len << 8, uptime cs, last pid | pid << 32)`` computed in bash arithmetic. The
  agent sees tags but never K: it cannot make a tag for a status the command did not return. Only the cwd is not
  covered (it only decides where a restarted shell starts).
* A ``BEGIN`` line before ``eval`` separates what background jobs printed between commands; ``BROKEN`` lines come
  from the loop's own checks. Neither carries a status, so forging them only costs the agent a restart.

What the tag cannot cover: the command's bytes. A process the agent left holding the shell's stdin can stop the
idle shell, take the next command and write a same-length one under the same header (a pipe reopens for writing
through ``/proc/self/fd``); hashing the bytes in bash costs microseconds a byte. Backends close this by giving the
shell a socket for stdin (``Transport.sealed``): a stolen command then never runs, which is a timeout.
"""

from __future__ import annotations

import re
import secrets

# -- the tag -----------------------------------------------------------------------------------
_M64 = (1 << 64) - 1
_SIP_INIT = (0x736F6D6570736575, 0x646F72616E646F6D, 0x6C7967656E657261, 0x7465646279746573)


def _rotl(x: int, b: int) -> int:
    return ((x << b) | (x >> (64 - b))) & _M64


def _sipround(v0: int, v1: int, v2: int, v3: int) -> tuple[int, int, int, int]:
    v0 = (v0 + v1) & _M64; v1 = _rotl(v1, 13) ^ v0; v0 = _rotl(v0, 32)
    v2 = (v2 + v3) & _M64; v3 = _rotl(v3, 16) ^ v2
    v0 = (v0 + v3) & _M64; v3 = _rotl(v3, 21) ^ v0
    v2 = (v2 + v1) & _M64; v1 = _rotl(v1, 17) ^ v2; v2 = _rotl(v2, 32)
    return v0, v1, v2, v3


def siphash24(k0: int, k1: int, data: bytes) -> int:
    """SipHash-2-4 of ``data`` under the key (k0, k1) (each the little-endian half of the 16-byte key)."""
    v = [k0 ^ _SIP_INIT[0], k1 ^ _SIP_INIT[1], k0 ^ _SIP_INIT[2], k1 ^ _SIP_INIT[3]]
    tail = len(data) % 8
    blocks = [int.from_bytes(data[i:i + 8], "little") for i in range(0, len(data) - tail, 8)]
    blocks.append(int.from_bytes(data[len(data) - tail:], "little") | ((len(data) & 0xFF) << 56))
    for m in blocks:
        v[3] ^= m
        v = list(_sipround(*_sipround(*v)))
        v[0] ^= m
    v[2] ^= 0xFF
    for _ in range(4):
        v = list(_sipround(*v))
    return v[0] ^ v[1] ^ v[2] ^ v[3]


def tag_words(words: list[int], k0: int, k1: int) -> int:
    """The marker's tag: SipHash-2-4 of the 64-bit ``words`` (little-endian, 8 bytes each)."""
    return siphash24(k0, k1, b"".join((w & _M64).to_bytes(8, "little") for w in words))


def as_signed(x: int) -> str:
    x &= _M64
    return str(x - (1 << 64) if x >> 63 else x)


def bash_tag_expr(k0: int, k1: int, words: list[str], out: str = "_Jm") -> str:
    """A bash arithmetic expression that sets ``out`` to ``tag_words`` of the (already validated integer)
    variables named in ``words``, the key as literals. Temporaries ``_J0``.. ``_J3``; bash arithmetic is signed
    64-bit, so a logical right shift is an arithmetic one masked."""
    a, b, c, d = "_J0", "_J1", "_J2", "_J3"

    def rot(x: str, n: int) -> str:
        return f"{x}=({x}<<{n})|(({x}>>{64 - n})&{(1 << n) - 1})"

    rnd = ",".join([f"{a}+={b}", rot(b, 13), f"{b}^={a}", rot(a, 32), f"{c}+={d}", rot(d, 16), f"{d}^={c}",
                    f"{a}+={d}", rot(d, 21), f"{d}^={a}", f"{c}+={b}", rot(b, 17), f"{b}^={c}", rot(c, 32)])
    parts = [f"{a}={as_signed(k0 ^ _SIP_INIT[0])}", f"{b}={as_signed(k1 ^ _SIP_INIT[1])}",
             f"{c}={as_signed(k0 ^ _SIP_INIT[2])}", f"{d}={as_signed(k1 ^ _SIP_INIT[3])}"]
    for m in [*words, as_signed((8 * len(words) & 0xFF) << 56)]:
        parts += [f"{d}^={m}", rnd, rnd, f"{a}^={m}"]
    parts += [f"{c}^=255", rnd, rnd, rnd, rnd, f"{out}={a}^{b}^{c}^{d}"]
    return ",".join(parts)


# -- the loop ---------------------------------------------------------------------------------------
# Names the loop assigns with plain (string) assignments; the agent may make any of them read-only or a nameref
# while its command runs. ``unset -n`` drops a nameref, ``unset -v`` the variable and its attributes; a read-only
# one survives both and is caught by the ``@a`` check before any assignment (an assignment to a read-only variable
# would make bash abandon the loop). The header and the command are only read after the command ran.
_VARS = ("__jrt_h __jrt_c __jrt_pre __jrt_f __jrt_on __jrt_off __jrt_up __jrt_la __jrt_lp __jrt_cs _J0 _J1 _J2 _J3 "
         "_Jm _Jw0 _Jw1 _Jw2 _Jw3 TMOUT")
HEADER = 37  # 16 hex digits of nonce, 20 decimal digits of length, newline
# options that posix mode turns on and turning it off resets to defaults: restored to the user's values
_POSIX_SHOPTS = ("expand_aliases", "inherit_errexit", "shift_verbose", "sourcepath")


def _attrs(names: str) -> str:
    return "".join("${" + n + "@a}" for n in names.split())


def loop_script(k0: int, k1: int, state: str) -> str:
    """The framing loop (see the module docstring); ``state`` names the variable (unguessable, assigned after the
    command and unset before the next) that carries the user's ``$-``, ``$SHELLOPTS`` and ``$BASHOPTS`` over."""
    tag = bash_tag_expr(k0, k1, ["_Jw0", "_Jw1", "_Jw2", "_Jw3"])
    post_vars = _VARS.replace("__jrt_h ", "").replace("__jrt_c ", "")

    def broken(why: str) -> str:
        return ("{ (( POSIXLY_CORRECT = 1 )); \\unset -f printf; "
                f"\\printf '\\n__JRT_%s_BROKEN_{why}\\n' \"${{__jrt_h:0:16}}\" >&253; \\exit 97; }}")

    keep = "".join(f"  [[ :${state}: == *:{o}:* ]] && __jrt_on+=' {o}' || __jrt_off+=' {o}'\n"
                   for o in _POSIX_SHOPTS)
    return (
        # before the loop: the user's state as it starts, then posix mode for our own command lookups (special
        # builtins such as set, unset, eval and exit are found before functions of the same names)
        f"{state}=$-:$SHELLOPTS:$BASHOPTS\n"
        "(( POSIXLY_CORRECT = 1 ))\n"
        "while :; do\n"
        # (nothing here can be read-only: the check after the previous command made sure)
        f"  \\unset -n __jrt_r {_VARS}; \\unset -v __jrt_r {_VARS}\n"
        f"  LC_ALL=C \\read -r -N {HEADER} __jrt_h || \\exit 0\n"
        f"  if [[ ${{#__jrt_h}} != {HEADER} || ${{__jrt_h:0:36}} == *[!0-9a-f]* ]]; then {broken('header')}; fi\n"
        "  LC_ALL=C \\read -r -N \"$((10#${__jrt_h:16:20}))\" __jrt_c || \\exit 0\n"
        # the user's posix mode, the options it resets, and -e/-u/-x: restored by the first line eval runs
        f"  __jrt_pre= __jrt_on= __jrt_off= __jrt_f=${{{state}%%:*}}\n"
        f"  if [[ :${state}: != *:posix:* ]]; then\n"
        "  __jrt_pre='\\unset POSIXLY_CORRECT;'\n"
        f"{keep}"
        "  [[ -n $__jrt_on ]] && __jrt_pre+=\" \\\\shopt -s$__jrt_on;\"\n"
        "  [[ -n $__jrt_off ]] && __jrt_pre+=\" \\\\shopt -u$__jrt_off;\"\n"
        "  fi\n"
        "  __jrt_f=${__jrt_f//[!eux]/}\n"
        "  [[ -n $__jrt_f ]] && __jrt_pre+=\" \\\\set -$__jrt_f\"\n"
        f"  \\unset -v {state}\n"
        # what background jobs printed before this point belongs to no command
        "  \\printf '\\n__JRT_%s_BEGIN\\n' \"${__jrt_h:0:16}\" >&253 2>/dev/null\n"
        "  \\eval \"$__jrt_pre\"$'\\n'\"$__jrt_c\" < /dev/null\n"
        # the status first, by arithmetic (a read-only target fails there instead of abandoning the loop); then
        # the user's state; then posix mode, also by arithmetic. No function or trap can run in between.
        f"  if ! (( __jrt_r = $?, 1 )); then {broken('status')}; fi\n"
        f"  {state}=$-:$SHELLOPTS:$BASHOPTS\n"
        f"  if ! (( POSIXLY_CORRECT = 1 )) || [[ :$SHELLOPTS: != *:posix:* ]]; then {broken('posix')}; fi\n"
        "  \\set +eux\n"
        f"  \\unset -f read printf; \\unset -n {post_vars}; \\unset -v {post_vars}\n"
        # the header was the agent's to change while its command ran: a changed one fails the check in Python.
        # LC_ALL and IFS stay the user's: each is only set for one read, which a read-only one would defeat.
        f"  if [[ -n {_attrs(post_vars + ' __jrt_h __jrt_c')} || ${{__jrt_r@a}}${{LC_ALL@a}}${{IFS@a}} == *[rn]* ||"
        f" ${{#__jrt_h}} != {HEADER} || ${{__jrt_h:0:36}} == *[!0-9a-f]* ]]; then {broken('vars')}; fi\n"
        # the kill rule's reference for the next command: uptime (centiseconds) and the namespace's last pid
        "  IFS= \\read -r -d ' ' __jrt_up < /proc/uptime; IFS= \\read -r __jrt_la < /proc/loadavg\n"
        "  __jrt_cs=${__jrt_up/./} __jrt_lp=${__jrt_la##* }\n"
        "  [[ -n $__jrt_cs && $__jrt_cs != *[!0-9]* && ${#__jrt_cs} -le 15 ]] || __jrt_cs=0\n"
        "  [[ -n $__jrt_lp && $__jrt_lp != *[!0-9]* && ${#__jrt_lp} -le 9 ]] || __jrt_lp=0\n"
        "  (( _Jw0 = 16#${__jrt_h:0:16}, _Jw1 = __jrt_r | (10#${__jrt_h:16:20} << 8), _Jw2 = 10#$__jrt_cs, "
        "_Jw3 = 10#$__jrt_lp | ($$ << 32), 1 ))\n"
        f"  (( {tag}, 1 ))\n"
        "  \\printf '\\n__JRT_%s_END_%s_%s_%s_%s_%s_%s_%s\\0\\n' \"${__jrt_h:0:16}\" \"$__jrt_r\" "
        "\"$((10#${__jrt_h:16:20}))\" \"$__jrt_cs\" \"$__jrt_lp\" \"$$\" \"$_Jm\" \"$PWD\" >&253 2>/dev/null || "
        "\\printf '\\n__JRT_%s_END_%s_%s_%s_%s_%s_%s_%s\\0\\n' \"${__jrt_h:0:16}\" \"$__jrt_r\" "
        "\"$((10#${__jrt_h:16:20}))\" \"$__jrt_cs\" \"$__jrt_lp\" \"$$\" \"$_Jm\" \"$PWD\"\n"
        "done\n"
    )


# What ``set -x`` prints of the loop's own lines after the command (PS4 is read-only: always "+ "); removed.
XTRACE_TAIL = re.compile(rb"\+ \(\(\s+__jrt_r = \d+, 1\s+\)\)\n(?:\+ [^\n]*\n){0,6}?\+ set \+eux\n\Z")

# A command whose status says whether another process may read the shell's memory (the toolkit's nodump
# preload in effect): a forked subshell is another process, and a non-dumpable target refuses it.
PROBE = "( : < /proc/$$/mem ) 2>/dev/null"


def setup_script(env: dict[str, str], cwd: str | None) -> str:
    """What the shell runs once before the loop: one output stream (and a copy at fd 253 for the markers, so a
    user's ``exec >file`` does not break the framing), no history, SIGINT survived (``kill -INT $$``), the
    environment and the last directory, then the defences above. bash >= 4.4 (``${x@a}``) is required."""
    exports = "".join(f"export {k}={sh_quote(v)}\n" for k, v in env.items())
    cd = f"cd {sh_quote(cwd)} 2>/dev/null || true\n" if cwd else ""
    return (
        "exec 2>&1 253>&1\nset +o history\ntrap '((1))' INT\n"
        "export PAGER=cat GIT_PAGER=cat TERM=dumb\n"
        f"{exports}{cd}"
        "if ((BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] < 404)); then echo \"__JRT_OLD_BASH $BASH_VERSION\"; "
        "exit 1; fi\n"
        "readonly PS4='+ '\nenable -n trap enable\n"
    )


def frame(command: str) -> tuple[str, bytes]:
    """(nonce, bytes to send) for one command; NUL bytes are dropped (bash variables cannot hold them)."""
    body = command.encode("utf-8", "surrogateescape").replace(b"\x00", b"")
    n = f"{secrets.randbits(63):016x}"
    return n, f"{n}{len(body):020d}\n".encode() + body


class Forged(Exception):
    """A marker for this command whose tag does not verify."""


def end_marker(buf: bytearray, n: str, key: tuple[int, int]) -> tuple[dict, int, int] | None:
    """The verified end marker for nonce ``n`` in ``buf``: (fields, start, end); None if absent yet. Fields:
    code, length, cs (uptime in centiseconds), last_pid, pid, cwd. Raises ``Forged`` on a bad tag."""
    m = re.search(rb"\n__JRT_" + n.encode() + rb"_END_(\d+)_(\d+)_(\d+)_(\d+)_(\d+)_(-?\d+)_([^\x00]*)\x00\n", buf)
    if m is None:
        return None
    code, length, cs, last_pid, pid, tag = (int(g) for g in m.groups()[:6])
    fields = {"code": code, "length": length, "cs": cs, "last_pid": last_pid, "pid": pid,
              "cwd": m.group(7).decode(errors="replace")}
    words = [int(n, 16), code | (length << 8), cs, last_pid | (pid << 32)]
    if tag & _M64 != tag_words(words, *key) or code > 255:
        raise Forged(f"a marker for this command carried a wrong tag (status {code})")
    return fields, m.start(), m.end()


def sh_quote(s: str) -> str:
    return "'" + s.replace("'", "'\"'\"'") + "'"
