"""Sandboxes against real Docker containers and real bubblewrap: the same behaviour tests on both backends,
plus the limits only Docker can enforce (stated per test)."""

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import need
from jaxrl_term.sandbox.base import Sandbox, SandboxPool, open_sandbox

IMAGE = "jaxrl-term/base:trixie"


def run(coro):
    return asyncio.run(coro)


async def _with(backend, fn, **limits):
    async with open_sandbox(backend, IMAGE, **limits) as sb:
        assert isinstance(sb, Sandbox)
        return await fn(sb)


# --------------------------------------------------------------------------------------------- the shell


def test_state_persists_and_exit_codes_are_exact(backend):
    async def go(sb):
        assert (await sb.run("cd /tmp; export X=1; f() { echo fn-$1; }")).exit_code == 0
        r = await sb.run("pwd; echo $X; f ok")
        assert r.output == "/tmp\n1\nfn-ok\n" and r.exit_code == 0
        assert (await sb.run("false")).exit_code == 1
        r = await sb.run("no_such_command_xyz")
        assert r.exit_code == 127 and "not found" in r.output
        assert (await sb.run("sh -c 'kill -INT $$'")).exit_code == 130
        assert (await sb.run("exit_code() { return 42; }; exit_code")).exit_code == 42
        # stderr and stdout interleave in order; quotes, heredocs and syntax errors do not break framing
        r = await sb.run("echo a; echo b >&2; echo c")
        assert r.output == "a\nb\nc\n"
        r = await sb.run("cat <<'EOF'\nline \"1\" $HOME\nEOF")
        assert r.output == 'line "1" $HOME\n'
        r = await sb.run('echo "unclosed')
        assert r.exit_code == 2 and "unexpected EOF" in r.output
        assert (await sb.run("echo still fine")).output == "still fine\n"

    run(_with(backend, go))


def test_timeout_interrupts_the_command_and_the_shell_goes_on(backend):
    async def go(sb):
        await sb.run("export KEEP=yes; sleep 300 & echo $! > /tmp/bg.pid")
        t0 = time.monotonic()
        r = await sb.run("echo started; sleep 100", timeout_s=1)
        elapsed = time.monotonic() - t0
        assert r.timed_out and elapsed < 2.0, (r, elapsed)
        assert r.exit_code == 130 and "started" in r.output and not r.shell_restarted
        r = await sb.run("echo $KEEP; kill -0 $(cat /tmp/bg.pid) && echo bg-alive")
        assert r.output == "yes\nbg-alive\n"  # state and the earlier background job survive

    run(_with(backend, go))


def test_a_stuck_shell_is_restarted_and_says_so(backend):
    async def go(sb):
        await sb.run("cd /tmp; export GONE=1")
        r = await sb.run("while true; do :; done", timeout_s=1)
        assert r.timed_out and r.shell_restarted and "restarted" in r.output
        r = await sb.run("pwd; echo ${GONE:-unset}")
        assert r.output == "/tmp\nunset\n"  # the directory is restored, variables are not
        r = await sb.run("exit 3")
        assert r.shell_restarted and "exited" in r.output
        assert (await sb.run("echo back")).output == "back\n"

    run(_with(backend, go))


def test_commands_reading_stdin_get_eof(backend):
    async def go(sb):
        r = await sb.run("cat; read x; echo rc=$?; python3 -c 'import sys; print(len(sys.stdin.read()))'",
                         timeout_s=5)
        assert not r.timed_out and r.output == "rc=1\n0\n"

    run(_with(backend, go))


def test_huge_output_is_capped_head_and_tail(backend):
    async def go(sb):
        t0 = time.monotonic()
        r = await sb.run("echo FIRST; head -c 100000000 /dev/zero | tr '\\0' x; echo; echo LAST", timeout_s=60)
        assert r.truncated and r.exit_code == 0 and not r.timed_out
        assert r.output.startswith("FIRST\n") and r.output.endswith("LAST\n")
        assert "bytes of output truncated" in r.output and len(r.output) < 40_000
        assert time.monotonic() - t0 < 30
        assert (await sb.run("echo next")).output == "next\n"

    run(_with(backend, go, max_output_bytes=32768))


def test_binary_and_invalid_utf8_output(backend):
    async def go(sb):
        r = await sb.run("printf 'ok \\377\\376 \\000 end'")
        assert r.exit_code == 0 and r.output.startswith("ok ") and r.output.endswith(" end")
        assert "\ufffd" in r.output and "\\0" in r.output

    run(_with(backend, go))


def test_no_network_inside(backend):
    from conftest import host_tcp_server

    async def go(sb, addrs, port):
        for a in addrs:  # a server this test started on the host, reachable from the host itself
            r = await sb.run(f"python3 -c \"import socket; socket.create_connection(('{a}', {port}), timeout=3)\" "
                             "&& echo CONNECTED", timeout_s=15)
            assert r.exit_code != 0 and "CONNECTED" not in r.output, (a, r)
            r = await sb.run(f"curl -sS -m 3 http://{a}:{port}/ >/dev/null && echo CONNECTED", timeout_s=15)
            assert "CONNECTED" not in r.output, (a, r)

    with host_tcp_server() as (addrs, port):
        run(_with(backend, lambda sb: go(sb, addrs, port)))


# ----------------------------------------------------------------------------------------------- files


def test_files_text_binary_and_upload_dir_with_modes(backend, tmp_path):
    tree = tmp_path / "tree"
    (tree / "sub" / "deep").mkdir(parents=True)
    (tree / "run.sh").write_text("#!/bin/sh\necho from-script\n")
    (tree / "run.sh").chmod(0o755)
    (tree / "sub" / "data.bin").write_bytes(bytes(range(256)))
    (tree / "sub" / "deep" / "note.txt").write_text("naïve ☃\n")
    (tree / "sub" / "deep" / "note.txt").chmod(0o600)

    async def go(sb):
        await sb.write_file("hello.txt", b"hello 'quoted' \"text\"\n")
        assert (await sb.run("cat /app/hello.txt")).output == "hello 'quoted' \"text\"\n"
        blob = bytes(range(256)) * 100
        await sb.write_file("/tmp/new/dir/blob.bin", blob, mode=0o640)
        assert await sb.read_file("/tmp/new/dir/blob.bin") == blob
        assert (await sb.run("stat -c %a /tmp/new/dir/blob.bin")).output.strip() == "640"
        await sb.upload_dir(tree, "/app/proj")
        r = await sb.run("cd /app/proj && ./run.sh && stat -c '%a %n' run.sh sub/deep/note.txt && cat sub/deep/note.txt")
        assert r.output == "from-script\n755 run.sh\n600 sub/deep/note.txt\nnaïve ☃\n"
        assert await sb.read_file("/app/proj/sub/data.bin") == bytes(range(256))
        await sb.run("printf 'made inside' > /app/inside.txt")
        assert await sb.read_file("inside.txt") == b"made inside"
        from jaxrl_term.sandbox.base import SandboxError

        with pytest.raises(SandboxError, match="no such file"):
            await sb.read_file("/app/missing.txt")

    run(_with(backend, go))


# ------------------------------------------------------------------------------------ limits (Docker only)


def test_fork_bomb_hits_the_pid_limit_and_the_sandbox_recovers(backend):
    """Both backends: Docker's pids cgroup, the local backend's pids cgroup or per-sandbox uid RLIMIT_NPROC."""
    before = len(os.listdir("/proc"))

    async def go(sb):
        r = await sb.run("bomb() { bomb | bomb & }; bomb; sleep 5", timeout_s=4)
        assert r.timed_out
        out = await sb.run("echo alive; ls /proc | grep -c '^[0-9]'", timeout_s=30)
        assert out.output.startswith("alive\n")
        assert int(out.output.split()[1]) < 20  # the bomb is gone
        assert (await sb.run("cat /proc/self/status | grep -c Pid")).exit_code == 0

    run(_with(backend, go, pids=64))
    assert len(os.listdir("/proc")) < before + 200  # nothing leaked onto the host


@pytest.mark.docker
def test_memory_hog_is_oom_killed_and_the_next_command_works(docker_client):
    """Docker only (cgroup memory limit); the local backend caps address space instead (next test)."""

    async def go(sb):
        r = await sb.run("python3 -c 'a = bytearray(2 * 1024**3); print(len(a))'", timeout_s=60)
        assert r.exit_code == 137 and "2147483648" not in r.output
        assert (await sb.run("echo ok")).output == "ok\n"

    run(_with("docker", go, memory_mb=256))


def test_local_backend_caps_process_memory():
    import shutil

    need(shutil.which("bwrap") is not None, "bubblewrap (bwrap) is not installed")

    async def go(sb):
        r = await sb.run("python3 -c 'a = bytearray(2 * 1024**3); print(len(a))'", timeout_s=60)
        assert r.exit_code != 0 and "MemoryError" in r.output
        assert (await sb.run("echo ok")).output == "ok\n"
        r = await sb.run("touch /usr/should-fail 2>&1; echo rc=$?")
        assert "rc=1" in r.output  # the system is read-only

    run(_with("local", go, memory_mb=512))


# ------------------------------------------------------------------------------------- cleanup and scale


@pytest.mark.docker
def test_reaper_removes_containers_of_a_killed_run(docker_client, tmp_path):
    script = tmp_path / "owner.py"
    script.write_text(
        "import asyncio, os, signal, sys\n"
        "from jaxrl_term.sandbox.base import open_sandbox\n"
        "async def main():\n"
        "    async with open_sandbox('docker', sys.argv[1], labels={'jaxrl_term.test': 'reaper'}) as a, \\\n"
        "               open_sandbox('docker', sys.argv[1], labels={'jaxrl_term.test': 'reaper'}) as b:\n"
        "        print('ready', flush=True)\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "asyncio.run(main())\n"
    )
    proc = subprocess.run([sys.executable, str(script), IMAGE], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9 and "ready" in proc.stdout, proc.stderr
    left = docker_client.containers.list(all=True, filters={"label": "jaxrl_term.test=reaper"})
    assert len(left) == 2  # the killed process could not clean up
    from jaxrl_term.sandbox.docker import reap

    assert reap() >= 2
    assert docker_client.containers.list(all=True, filters={"label": "jaxrl_term.test=reaper"}) == []


STUCK_OWNER = """
import asyncio, sys, threading, time
from jaxrl_term.sandbox.base import open_sandbox, unwind_on_sigterm
async def main():
    async with open_sandbox('docker', sys.argv[1], labels={'jaxrl_term.test': 'forced'}) as a, \\
               open_sandbox('docker', sys.argv[1], labels={'jaxrl_term.test': 'forced'}) as b:
        try:  # the test signals as soon as it reads this line: print() may not have returned yet
            print('ready', flush=True)
            await asyncio.sleep(1000)
        except BaseException:
            print('unwinding', flush=True)  # and waits on what no signal ends (a train step on a worker thread)
            worker = threading.Thread(target=time.sleep, args=(1000,))
            worker.start()
            worker.join()
            raise
unwind_on_sigterm()
asyncio.run(main())
"""


@pytest.mark.docker
def test_a_second_sigterm_removes_the_containers_when_the_unwinding_is_stuck(docker_client, tmp_path):
    """A run whose unwinding hangs (SIGTERM, then a worker thread that never returns) is ended by a second
    SIGTERM; before it exits, the Docker backend removes the containers it owns, without waiting for the reaper of
    the next start-up."""
    script = tmp_path / "owner.py"
    script.write_text(STUCK_OWNER)
    proc = subprocess.Popen([sys.executable, str(script), IMAGE], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        mine = {"label": "jaxrl_term.test=forced"}
        assert len(docker_client.containers.list(all=True, filters=mine)) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.stdout.readline() == "unwinding\n"
        time.sleep(0.5)
        assert proc.poll() is None  # stuck, with its containers still there
        assert len(docker_client.containers.list(all=True, filters=mine)) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        assert docker_client.containers.list(all=True, filters=mine) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        for c in docker_client.containers.list(all=True, filters={"label": "jaxrl_term.test=forced"}):
            c.remove(force=True)


@pytest.mark.docker
def test_cancelled_sandboxes_leave_no_container(docker_client):
    """An episode attempt cut off at its deadline cancels whatever its sandbox is doing: a container create in
    flight (its thread finishes the create; the container is then removed), the shell's start, a command, or the
    close itself. Whenever the cancel lands, no container is left behind for the reaper."""

    async def use():
        async with open_sandbox("docker", IMAGE, labels={"jaxrl_term.test": "cancelled"}) as sb:
            await sb.run("sleep 30", timeout_s=60)

    async def main():
        for delay in (0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.6, 1.0, 2.0):
            task = asyncio.ensure_future(use())
            await asyncio.sleep(delay)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    run(main())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # removals that a done-callback started may still be running
        left = docker_client.containers.list(all=True, filters={"label": "jaxrl_term.test=cancelled"})
        if not left:
            break
        time.sleep(0.5)
    assert left == []


@pytest.mark.docker
def test_sixteen_concurrent_sandboxes_twenty_commands_each(docker_client):
    async def main():
        pool = SandboxPool("docker", max_concurrent=16, memory_mb=256)
        failures = []

        async def worker(i):
            async with pool.sandbox(IMAGE) as sb:
                for j in range(20):
                    r = await sb.run(f"echo {i}-{j} $((i={i}*{j}))")
                    if r.exit_code != 0 or not r.output.startswith(f"{i}-{j} "):
                        failures.append((i, j, r))

        t0 = time.monotonic()
        await asyncio.gather(*(worker(i) for i in range(16)))
        return failures, pool, time.monotonic() - t0

    failures, pool, elapsed = run(main())
    assert failures == [] and pool.created == 16 and pool.failed == 0 and pool.open == 0


def test_pool_caps_how_many_are_open_at_once(backend):
    async def main():
        pool = SandboxPool(backend, max_concurrent=2)
        peak = 0

        async def worker():
            nonlocal peak
            async with pool.sandbox(IMAGE) as sb:
                peak = max(peak, pool.open)
                await sb.run("sleep 0.2")

        await asyncio.gather(*(worker() for _ in range(5)))
        return peak, pool

    peak, pool = run(main())
    assert peak == 2 and pool.created == 5 and pool.waiting == 0


def test_unknown_backend_and_missing_image_fail_clearly(backend):
    from jaxrl_term.sandbox.base import SandboxError

    with pytest.raises(SandboxError, match="backend 'vm'"):
        run(_with("vm", lambda sb: None))
    if backend == "docker":
        with pytest.raises(SandboxError, match="not found locally"):
            asyncio.run(_open_missing())


async def _open_missing():
    async with open_sandbox("docker", "jaxrl-term/does-not-exist:1"):
        pass


def test_user_shell_options_do_not_break_the_framing(backend):
    async def go(sb):
        assert (await sb.run("set -e; set -u; set -o pipefail; echo on")).output == "on\n"
        r = await sb.run("echo still here; echo $-")
        assert r.output.startswith("still here\n") and "e" in r.output.split("\n")[1]
        r = await sb.run("false")  # with errexit, a failing command ends the shell, as in a terminal
        assert r.shell_restarted
        assert (await sb.run("echo fresh")).output == "fresh\n"

    run(_with(backend, go))


def test_signals_blocked_in_the_trainer_do_not_leak_into_the_sandbox(backend):
    """A SIGINT mask of the spawning thread (a native library's, a background launch) is inherited through fork
    and exec: the shell must still see SIGINT (status 130, timeouts by SIGINT first)."""
    import signal

    async def go(sb):
        assert (await sb.run("sh -c 'kill -INT $$'")).exit_code == 130
        r = await sb.run("echo started; sleep 30", timeout_s=1)
        assert r.timed_out and r.exit_code == 130, r

    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGQUIT})
    try:
        run(_with(backend, go))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
