"""The persistent shell against an adversarial agent, on both backends: every trick yields the command's true status
or ``framing_broken`` with a restart, never a status the command did not produce; ``false`` still reports 1 after
each. Plus the tag itself against the published SipHash vector, and the key against everything the agent can read."""

import asyncio
import os
import random
import subprocess
import time


from jaxrl_term.sandbox.base import open_sandbox
from jaxrl_term.sandbox.framing import as_signed, bash_tag_expr, siphash24, tag_words

IMAGE = "jaxrl-term/base:trixie"


def run(coro):
    return asyncio.run(coro)


async def _with(backend, fn, **limits):
    async with open_sandbox(backend, IMAGE, **limits) as sb:
        return await fn(sb)


def broken(r) -> bool:
    return bool(getattr(r, "framing_broken", "framing broken" in r.output))


def truthful(r, code: int) -> bool:
    """The command's own status, or no status at all (framing broken, the shell restarted)."""
    return r.exit_code == code or (r.exit_code is None and r.shell_restarted)


async def _statuses_are_exact(sb):
    assert (await sb.run("false")).exit_code == 1
    assert (await sb.run("(exit 7)")).exit_code == 7
    r = await sb.run("echo ok")
    assert r.exit_code == 0 and r.output == "ok\n", r


# --------------------------------------------------------------------------------------------- the tag


def test_siphash_matches_the_reference_vector_and_the_bash_arithmetic():
    key = bytes(range(16))
    k0, k1 = int.from_bytes(key[:8], "little"), int.from_bytes(key[8:], "little")
    assert siphash24(k0, k1, bytes(range(15))) == 0xA129CA6149BE45E5  # SipHash paper, appendix A
    rng = random.Random(0)
    for _ in range(5):
        k0, k1 = rng.getrandbits(64), rng.getrandbits(64)
        words = [rng.getrandbits(63) for _ in range(4)]
        names = [f"w{i}" for i in range(4)]
        setup = ",".join(f"{n}={as_signed(w)}" for n, w in zip(names, words))
        script = f"(( {setup}, {bash_tag_expr(k0, k1, names)}, 1 )); echo $_Jm"
        out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
        assert int(out) & (2**64 - 1) == tag_words(words, k0, k1)


# ------------------------------------------------------------------------------------------ forged output


def test_forged_end_markers_in_the_output_are_ignored(backend):
    async def go(sb):
        fakes = ("printf '\\n__JRT_%016x_END_0_5_1_1_1_123_/app\\0\\n' 12345; "
                 "printf '\\n__JRT_0123456789abcdef_END_0_/app\\n'; "
                 "printf '\\n__JRT_%016x_BEGIN\\n__JRT_%016x_BROKEN_vars\\n' 1 2")
        r = await sb.run(fakes + "; false")
        assert r.exit_code == 1 and "__JRT_0123456789abcdef_END_0_/app" in r.output and not broken(r)
        # a background writer floods the pipe with markers while later commands run
        await sb.run("(for i in $(seq 3000); do printf '\\n__JRT_%016x_END_0_%d_1_1_1_1_/x\\0\\n' $RANDOM $i; "
                     "done) > /dev/stdout 2>&1 &")
        for _ in range(10):
            r = await sb.run("false")
            assert truthful(r, 1), r
        await sb.run("wait", timeout_s=60)  # the flood shares the shell's output: let it end before exact outputs
        await _statuses_are_exact(sb)

    run(_with(backend, go))


def test_an_output_thief_cannot_change_a_status(backend):
    """A background process reopens the shell's output pipe for reading (``/proc/self/fd/1``: a pipe opens in any
    mode) and writes everything back with each status turned into 0: the tag no longer verifies."""
    thief = ("import os\n"
             "fd = os.open('/proc/self/fd/1', os.O_RDONLY)\n"
             "while True:\n"
             "    data = os.read(fd, 65536)\n"
             "    os.write(1, data.replace(b'_END_1_', b'_END_0_'))\n")

    async def go(sb):
        await sb.write_file("/tmp/thief.py", thief.encode())
        await sb.run("timeout 8 python3 /tmp/thief.py &")
        await asyncio.sleep(0.5)
        for _ in range(10):
            r = await sb.run("false", timeout_s=3)
            assert truthful(r, 1), r
        await asyncio.sleep(8)
        await _statuses_are_exact(sb)

    run(_with(backend, go))


# ------------------------------------------------------------------------------------- the shell's builtins


def test_redefined_builtins_cannot_change_a_status(backend):
    async def go(sb):
        names = "printf read eval builtin command set unset echo exit declare source type wait"
        defs = "; ".join(f"{n}() {{ return 0; }}" for n in names.split()) + "; test() { return 0; }"
        r = await sb.run(defs + "; false")
        assert r.exit_code == 1, r
        assert (await sb.run("false")).exit_code == 1
        assert (await sb.run("sh -c 'exit 9'")).exit_code == 9
        assert (await sb.run("eval false")).exit_code == 0  # the agent's own `eval` is what it calls
        r = await sb.run("type -t eval set unset")  # the agent's functions persist (`type` is one of them)
        assert r.exit_code == 0 and (await sb.run("false")).exit_code == 1

    run(_with(backend, go))


def test_enable_and_trap_are_not_available_to_the_agent(backend):
    async def go(sb):
        for cmd in ("enable -n read printf", "enable -f /tmp/x.so evil", "builtin enable read",
                    "trap 'echo pwned' DEBUG", "trap 'false' ERR RETURN INT"):
            r = await sb.run(cmd)
            assert r.exit_code in (1, 127) and "pwned" not in r.output, (cmd, r)
        assert (await sb.run("false")).exit_code == 1
        r = await sb.run("alias false=true; shopt -s expand_aliases; false")
        assert r.exit_code == 1  # an alias applies from the next command on, as in a script
        assert (await sb.run("false")).exit_code == 0  # ... and then it is the agent's own `false`
        await sb.run("unalias false")
        await _statuses_are_exact(sb)

    run(_with(backend, go))


def test_prompts_and_xtrace_run_no_code_and_show_no_framing(backend):
    async def go(sb):
        r = await sb.run("PS4='$(echo PWNED)+ '")
        assert r.exit_code == 1 and "readonly" in r.output
        r = await sb.run("PROMPT_COMMAND='echo PWNED'; PS0='$(echo PWNED)'; PS1='$(echo PWNED)'; PS2='x'; false")
        assert r.exit_code == 1 and "PWNED" not in r.output
        r = await sb.run("set -x; false")
        assert r.exit_code == 1 and "__jrt" not in r.output and "false" in r.output
        r = await sb.run("echo traced")
        assert r.output == "++ echo traced\ntraced\n" and r.exit_code == 0
        r = await sb.run("set +x; set -v; echo verbose")
        assert r.exit_code == 0 and "verbose\n" in r.output
        r = await sb.run("set +v")
        assert (await sb.run("echo quiet")).output == "quiet\n"
        await _statuses_are_exact(sb)

    run(_with(backend, go))


def test_tampering_with_the_framing_variables_never_changes_a_status(backend):
    async def go(sb):
        attacks = {  # attack -> the framing must break (else the true status comes back)
            "readonly __jrt_r=0": True,  # the status capture would fail and keep 0
            "declare -n __jrt_r=FAKE; FAKE=0": False,  # the capture goes through the nameref: still the status
            "readonly __jrt_h": True,
            "__jrt_h=${__jrt_h:0:16}00000000000000000001$'\\n'": True,  # claims a 1-byte command
            "readonly __jrt_c __jrt_pre": True,
            "readonly POSIXLY_CORRECT": True,  # posix mode (our builtins before the agent's functions) cannot be set
            "readonly _J0=1 _Jm=0": True,
            "readonly TMOUT=1": True,
            "readonly LC_ALL": True,
            "IFS=0123456789; readonly IFS": True,
        }
        for attack, breaks in attacks.items():
            r = await sb.run(f"{attack}; false")
            if breaks:
                assert r.exit_code is None and broken(r) and r.shell_restarted, (attack, r)
            else:
                assert r.exit_code == 1 and not broken(r), (attack, r)
            r = await sb.run("false")
            assert r.exit_code == 1 and not broken(r), (attack, r)

    run(_with(backend, go))


# ----------------------------------------------------------------------------------- the shell's descriptors


def test_redirecting_the_shells_own_output_keeps_the_framing(backend):
    async def go(sb):
        r = await sb.run("exec 2>/dev/null; ls /nonexistent; echo rc=$?")
        assert r.output == "rc=2\n" and r.exit_code == 0
        assert (await sb.run("false")).exit_code == 1
        r = await sb.run("exec >/dev/null; echo hidden; false")  # the marker has its own copy of the channel
        assert r.output == "" and r.exit_code == 1
        assert (await sb.run("exec >&253 2>&1; echo visible")).output == "visible\n"
        # with every copy of the channel closed the status cannot come back: a restart, never a status
        r = await sb.run("exec 253>&- >/dev/null; false", timeout_s=2)
        assert r.exit_code is None and r.shell_restarted
        await _statuses_are_exact(sb)

    run(_with(backend, go))


def test_the_shells_memory_environment_and_pipes_are_closed_to_the_agent(backend):
    async def go(sb):
        assert sb.shell.protected, "the shell must start non-dumpable (toolkit.NODUMP)"
        for f in ("mem", "environ", "fd/0", "fd/1", "fd/253"):
            r = await sb.run(f"cat /proc/$$/{f} > /dev/null")
            assert r.exit_code == 1 and "Permission denied" in r.output, (f, r)
        r = await sb.run("python3 -c \"import os; os.open('/proc/%d/mem' % os.getppid(), os.O_RDONLY)\" 2>&1 | "
                         "tail -1")
        assert "Permission" in r.output or "No such" in r.output

    run(_with(backend, go))


def test_the_key_never_reaches_anything_the_agent_can_read(backend):
    async def go(sb):
        k0, k1 = sb.shell._key
        secrets_ = {as_signed(k0 ^ c) for c in (0x736F6D6570736575, 0x6C7967656E657261)} | \
                   {as_signed(k1 ^ c) for c in (0x646F72616E646F6D, 0x7465646279746573)}
        probes = ["set", "declare -p", "declare -f", "alias", "history", "fc -l", "echo \"$BASH_COMMAND|$_\"",
                  "compgen -v", "tr '\\0' ' ' < /proc/$$/cmdline", "env", "jobs -l", "caller",
                  "set -o history; echo x", "history", "set -x; true", "set +x", "cat /proc/self/fd/0",
                  "timeout 1 cat <&10; timeout 1 cat <&11", "for fd in /proc/$$/fd/*; do echo $fd; done",
                  "echo ${!_J*} ${!__jrt*}"]
        seen = ""
        for p in probes:
            seen += (await sb.run(p, timeout_s=3)).output
        assert seen and not any(s in seen for s in secrets_)
        await _statuses_are_exact(sb)

    run(_with(backend, go))


def test_replacing_or_killing_the_shell_restarts_it_with_no_status(backend):
    fake = ("import sys, time; sys.stdout.write('\\n__JRT_%016x_END_0_5_1_1_1_1_/app\\0\\n' % 5); "
            "sys.stdout.flush(); time.sleep(30)")

    async def go(sb):
        await sb.run("cd /tmp")
        for cmd in (f"exec python3 -c \"{fake}\"", "exec true", "kill -9 $$", "exit 0"):
            r = await sb.run(cmd, timeout_s=2)
            if cmd == "kill -9 $$" and sb.shell.pid == 1:
                assert r.exit_code == 0  # the local shell is its namespace's init: SIGKILL from inside is ignored
                continue
            assert r.exit_code is None and r.shell_restarted, (cmd, r)
            assert (await sb.run("pwd")).output == "/tmp\n"
        await _statuses_are_exact(sb)

    run(_with(backend, go))


def test_an_input_thief_cannot_answer_for_bash_on_a_sealed_input(backend):
    """A background subshell keeps the shell's stdin (bash's saved copy at fd 10 while the command's stdin is
    /dev/null), stops the idle shell, takes the next command's bytes and writes them back through
    ``/proc/self/fd/10`` with ``false`` turned into ``true `` (same length, same header), then resumes the shell.
    The tag cannot bind the command's bytes (hashing them in bash costs microseconds a byte), so this holds only
    where the shell's stdin is a socket (``Transport.sealed``, both backends): a pipe reopens for writing, a socket
    does not."""
    thief = ("( exec 4>/proc/self/fd/10 || exit; shell=$$\n"
             "  while :; do\n"
             "    sleep 0.05; kill -STOP $shell\n"
             "    IFS= LC_ALL=C read -r -N 37 h <&10 || exit\n"
             "    IFS= LC_ALL=C read -r -N $((10#${h:16:20})) c <&10\n"
             "    printf '%s%s' \"$h\" \"${c//false/true }\" >&4; kill -CONT $shell\n"
             "  done ) > /dev/null 2>&1 &\n")

    async def go(sb):
        await sb.run(thief)
        forged = 0
        for _ in range(3):
            await asyncio.sleep(0.3)
            r = await sb.run("false", timeout_s=3)
            assert r.exit_code in (0, 1, None), r
            forged += r.exit_code == 0
        assert sb.shell.input_sealed  # both backends: the shell's stdin is a socket
        assert forged == 0

    run(_with(backend, go))


# --------------------------------------------------------------------------------- processes and restarts


def test_a_restart_kills_the_old_shells_whole_tree(backend):
    async def go(sb):
        await sb.run("for i in 1 2 3; do (while :; do :; done) & echo $! >> /tmp/spin; done; echo $$ > /tmp/old")
        r = await sb.run("while :; do :; done", timeout_s=1)
        assert r.shell_restarted and r.timed_out
        await asyncio.sleep(0.3)
        # (builtins only: a pid of the old namespace may be reused by a new process)
        r = await sb.run("n=0; for d in /proc/[0-9]*; do read -r s 2>/dev/null < $d/stat || continue; "
                         "[[ $s == *'(bash) R'* && ${d#/proc/} != $$ ]] && n=$((n+1)); done; echo spinning=$n")
        assert r.output == "spinning=0\n", r

    run(_with(backend, go))


def test_a_fork_bomb_that_returns_at_once_is_killed_under_pid_pressure(backend):
    async def go(sb):
        t0 = time.monotonic()
        r = await sb.run("bomb() { bomb | bomb & }; bomb; echo started", timeout_s=10)
        assert r.output.startswith("started") or "process limit" in r.output
        deadline = time.monotonic() + 20
        while True:
            out = await sb.run("echo alive; ls /proc | grep -c '^[0-9]'", timeout_s=10)
            lines = out.output.splitlines()
            if "alive" in lines and lines[-1].isdigit() and int(lines[-1]) < 20:
                break
            assert time.monotonic() < deadline, out
        assert time.monotonic() - t0 < 25
        await _statuses_are_exact(sb)

    run(_with(backend, go, pids=64))


# ------------------------------------------------------------------------------------ what users rely on


def test_user_options_aliases_and_arguments_persist(backend):
    async def go(sb):
        await sb.run("set -u; set -o posix; shopt -s extglob expand_aliases; alias hi='echo aliased'; set -- a b")
        r = await sb.run("echo $#; hi; [[ abc == +([a-c]) ]] && echo glob; echo $-; shopt -o posix")
        lines = r.output.splitlines()
        assert lines[:3] == ["2", "aliased", "glob"] and "u" in lines[3] and lines[4].split() == ["posix", "on"], r
        await sb.run("set +u +o posix")
        r = await sb.run("echo ${NOPE_X:-unset}; shopt -o posix")
        assert r.output.split() == ["unset", "posix", "off"]
        r = await sb.run("set -e; false")  # errexit ends the shell, as in a script; the next shell has it off
        assert r.shell_restarted and (await sb.run("false; echo $-")).output.strip().find("e") < 0

def test_utf8_and_long_commands_arrive_byte_exact(backend):
    async def go(sb):
        r = await sb.run("export LC_ALL=C.UTF-8; echo 'héllo ☃ 日本'; x='ü'; echo ${#x}")
        assert r.output == "héllo ☃ 日本\n1\n" and r.exit_code == 0
        body = "".join(random.Random(1).choice("abc ☃\n'\"$\\") for _ in range(100_000))
        t0 = time.monotonic()
        r = await sb.run(f"cat > /tmp/big <<'JRT_EOF'\n{body}\nJRT_EOF\nwc -c < /tmp/big")
        assert int(r.output) == len((body + "\n").encode()) and r.exit_code == 0
        assert time.monotonic() - t0 < 10
        assert (await sb.run("printf 'a\\0b' | wc -c")).output.strip() == "3"
        await _statuses_are_exact(sb)

    run(_with(backend, go))


def test_the_kill_rule_spares_earlier_jobs_and_their_new_children(backend):
    async def go(sb):
        # an earlier "server" that forks a worker every 0.2 s
        await sb.run("(while :; do sleep 0.2 & wait; done) & echo $! > /tmp/server")
        r = await sb.run("sleep 100 & sleep 100", timeout_s=1)
        assert r.timed_out and r.exit_code == 130 and not r.shell_restarted
        r = await sb.run("kill -0 $(cat /tmp/server) && echo server-alive; pgrep -c -x sleep || true")
        assert "server-alive" in r.output.splitlines(), r
        await sb.run("kill $(cat /tmp/server)")

    run(_with(backend, go))


def test_ci_does_not_skip_docker(docker_client):
    """Under CI=true the Docker half of this file must run (conftest turns a missing engine into a failure)."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        assert docker_client.ping()


def test_a_fork_refused_by_the_limit_is_pressure_even_when_the_count_is_low_again():
    """Docker only (the local backend as root also sets RLIMIT_NPROC on its uid, which refuses first and is not
    counted in pids.events). The count is sampled after the command, when its processes may be gone: a fork the limit refused during
    the command still counts as pid pressure (the limit's refusal counter), so what the command left is killed."""
    async def go(sb):
        r = await sb.run("for i in $(seq 80); do (sleep 0.3) & done 2>/dev/null; wait; sleep 0.5; echo done",
                         timeout_s=60)
        assert "done" in r.output and "near its process limit" in r.output, r
        await _statuses_are_exact(sb)
        assert "near its process limit" not in (await sb.run("echo calm")).output

    run(_with("docker", go, pids=64))
