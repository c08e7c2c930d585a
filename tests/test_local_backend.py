"""The local (bubblewrap) backend as a boundary: no capabilities, a non-root uid, pid and memory limits, a file API
that follows no links out of the sandbox, kill_all / changes / exec(stdin), and reaping. Checked against the host
itself (its files, its process table, its cgroups), on every limit mechanism this machine has."""

import asyncio
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import need

from jaxrl_term.sandbox import confine as cf
from jaxrl_term.sandbox.base import SandboxError, open_sandbox

@pytest.fixture(autouse=True)
def _bwrap():
    from conftest import need

    need(shutil.which("bwrap") is not None, "bubblewrap (bwrap) is not installed")  # under CI=true: a failure


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(params=["auto", "uid"])
def kind(request, monkeypatch):
    """The machine's first limit mechanism (cgroups here), and the dedicated-uid RLIMIT_NPROC fallback."""
    if request.param == "uid":
        need(os.geteuid() == 0, "the dedicated-uid mechanism needs root")
    monkeypatch.setenv("JAXRL_TERM_LOCAL_CONFINE", request.param)
    return cf.pick_kind()


async def _with(fn, **limits):
    async with open_sandbox("local", **limits) as sb:
        return await fn(sb)


def _host_pids_of(sb) -> list[int]:
    return sb.confine.members()


# ----------------------------------------------------------------------------------------- identity


def test_agent_is_not_root_and_has_no_capabilities(kind):
    async def go(sb):
        r = await sb.run("id -u; id -g; grep -E '^(CapInh|CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs)' /proc/self/status")
        lines = r.output.split("\n")
        assert lines[0] != "0" and lines[1] != "0", r.output
        caps = dict(line.split(":\t") for line in lines[2:] if line)
        assert all(int(caps[c], 16) == 0 for c in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")), caps
        assert caps["NoNewPrivs"] == "1"
        # exec (the verifier): uid 0 of its own namespace, still no capabilities
        r = await sb.exec(["sh", "-c", "id -u; grep CapEff /proc/self/status"])
        assert r.output.split("\n")[0] == "0" and r.output.split()[-1] == "0000000000000000", r.output
        # on the host, neither runs as root
        r = await sb.run("sleep 30 & echo started")
        assert r.output == "started\n"
        uids = {int(Path(f"/proc/{p}/status").read_text().split("Uid:")[1].split()[0]) for p in _host_pids_of(sb)}
        assert uids and 0 not in uids or os.geteuid() != 0, uids

    run(_with(go))


def test_remount_mknod_nested_userns_and_system_writes_fail():
    marker = f"jaxrl-escape-{uuid.uuid4().hex[:8]}"

    async def go(sb):
        r = await sb.run(f"mount -o remount,rw /usr && touch /usr/{marker}; echo rc=$?")
        assert "rc=0" not in r.output
        for cmd in (f"touch /usr/{marker}", f"touch /etc/{marker}", f"touch /{marker}", f"touch /opt/jaxrl/{marker}",
                    "mknod /app/null c 1 3", "mknod /tmp/disk b 8 0", "unshare -Ur true", "unshare -m true",
                    "mount -t tmpfs none /app", "chroot / true"):
            r = await sb.run(f"{cmd}; echo rc=$?")
            assert "rc=0" not in r.output, (cmd, r.output)

    run(_with(go))
    assert not any(Path(d, marker).exists() for d in ("/usr", "/etc", "/"))


# ------------------------------------------------------------------------------------------- files


def test_file_api_never_follows_a_symlink_out_of_the_sandbox(tmp_path):
    host_target = Path("/tmp") / f"jaxrl-host-{uuid.uuid4().hex[:8]}"
    passwd_hash = hashlib.sha256(Path("/etc/passwd").read_bytes()).hexdigest()
    (tmp_path / "up").mkdir()
    (tmp_path / "up" / "f.txt").write_text("x")

    async def go(sb):
        await sb.run("ln -s / /app/h; ln -s /etc /app/e; mkdir -p /app/d; ln -s /app/h /app/d/l; "
                     "ln -s /etc/passwd /app/pw; ln -s ../../ /app/d/up; mkfifo /app/fifo")
        writes = [f"/app/h{host_target}", f"h{host_target}", "/app/e/jaxrl-x", f"/app/d/l{host_target}",
                  f"/app/d/../h{host_target}", f"/app/d/up{host_target}", "/app/pw", "/app/fifo", "/usr/bin/jaxrl-x"]
        for p in writes:
            with pytest.raises(SandboxError):
                await sb.write_file(p, b"owned\n")
        for p in ("/app/h/etc/shadow", "/app/e/shadow", "/app/pw", "/app/d/l/etc/shadow", "/etc/shadow"):
            with pytest.raises(SandboxError):
                await sb.read_file(p)
        with pytest.raises(SandboxError):
            await sb.upload_dir(tmp_path / "up", f"/app/h{host_target}")
        # links planted where an upload will write: a directory, then a file of the uploaded tree
        (tmp_path / "up" / "sub").mkdir()
        await sb.run("mkdir -p /app/p1 /app/p2; ln -s /etc /app/p1/sub; ln -s /etc/passwd /app/p2/f.txt")
        for dest in ("/app/p1", "/app/p2"):
            with pytest.raises(SandboxError):
                await sb.upload_dir(tmp_path / "up", dest)
        # `..` stays in the sandbox: this is the sandbox's own /tmp, not the host's
        await sb.write_file(f"/app/../..{host_target}", b"inside")
        assert (await sb.run(f"cat {host_target}")).output == "inside"
        # inside the sandbox's own files everything still works, and reads of the system show the agent's view
        await sb.write_file("/app/d/ok.txt", b"fine")
        assert (await sb.run("cat /app/d/ok.txt")).output == "fine"
        assert await sb.read_file("/etc/hostname") == Path("/etc/hostname").read_bytes()

    t0 = time.monotonic()
    run(_with(go))
    assert time.monotonic() - t0 < 20  # the FIFO did not block a write
    assert not host_target.exists()
    assert hashlib.sha256(Path("/etc/passwd").read_bytes()).hexdigest() == passwd_hash


def test_files_written_by_the_host_belong_to_the_agent(tmp_path):
    (tmp_path / "proj" / "sub").mkdir(parents=True)
    (tmp_path / "proj" / "sub" / "a.py").write_text("print('a')\n")
    os.symlink("sub/a.py", tmp_path / "proj" / "link.py")

    async def go(sb):
        await sb.write_file("/app/new/dir/f.txt", b"data", mode=0o600)
        await sb.upload_dir(tmp_path / "proj", "/app/proj")
        r = await sb.run("echo more >> /app/new/dir/f.txt && rm -r /app/proj/sub && readlink /app/proj/link.py && "
                         "stat -c %U /app/new/dir")
        assert r.exit_code == 0, r.output
        assert r.output.split("\n")[0] == "sub/a.py"

    run(_with(go))


# ------------------------------------------------------------------------------------------- limits


def test_fork_bomb_is_contained_and_the_next_command_works(kind):
    before = len(os.listdir("/proc"))

    async def go(sb):
        counts = []

        async def sample():
            while True:
                # pids.current where the sandbox has a cgroup: one atomic count (the union of a /proc scan and
                # cgroup.procs read moments apart counts a churning bomb twice)
                counts.append(sb.confine.count())
                await asyncio.sleep(0.05)

        sampler = asyncio.create_task(sample())
        r = await sb.run("bomb() { bomb | bomb & }; bomb; sleep 5", timeout_s=4)
        sampler.cancel()
        assert r.timed_out and "Resource temporarily unavailable" in r.output  # the limit refused forks
        assert 0.8 * 64 <= max(counts) <= 64 + 1, max(counts)  # + the shell's bwrap (outside the namespace)
        out = await sb.run("echo alive; ls /proc | grep -c '^[0-9]'", timeout_s=30)
        assert out.output.startswith("alive\n"), out
        assert int(out.output.split()[1]) < 20  # the bomb is gone
        assert (await sb.run("python3 -c 'print(6*7)'")).output == "42\n"

    run(_with(go, pids=64))
    assert len(os.listdir("/proc")) < before + 50  # nothing leaked onto the host


def test_a_single_memory_hog_fails_and_the_next_command_works(kind):
    async def go(sb):
        r = await sb.run("python3 -c 'a = bytearray(2 * 1024**3); print(len(a))'", timeout_s=60)
        assert r.exit_code != 0 and "2147483648" not in r.output
        assert (await sb.run("echo ok")).output == "ok\n"

    run(_with(go, memory_mb=256))


def test_memory_of_all_processes_together_is_capped():
    """cgroup mechanisms only: four processes of 120 MiB each do not all fit in 256 MiB."""
    kind = cf.pick_kind()
    need(kind.startswith("cgroup"), f"no cgroup here ({kind}): memory is capped per process only")

    async def go(sb):
        cmd = ("for i in 1 2 3 4; do python3 -c 'import time; a = b\"x\" * (120 << 20); time.sleep(3)' & done; "
               "ok=0; for j in 1 2 3 4; do wait -n && ok=$((ok+1)); done; echo ok=$ok")
        r = await sb.run(cmd, timeout_s=60)
        assert "ok=" in r.output and int(r.output.split("ok=")[1]) < 4, r.output
        assert (await sb.run("echo next")).output == "next\n"

    run(_with(go, memory_mb=256))


def test_refuses_to_start_without_a_pid_limit(monkeypatch):
    monkeypatch.setenv("JAXRL_TERM_LOCAL_CONFINE", "auto")
    monkeypatch.setattr(cf, "cgroup2_parent", lambda: None)
    monkeypatch.setattr(cf, "cgroup1_parents", dict)
    monkeypatch.setattr(cf.os, "geteuid", lambda: 1000)
    with pytest.raises(SandboxError, match="cannot apply a pid limit.*JAXRL_TERM_CGROUP"):
        run(_with(lambda sb: None))


def test_a_cgroup_that_cannot_limit_pids_is_refused(tmp_path, monkeypatch):
    """A delegated "cgroup" whose children get no pids.max (here a plain directory) must not run unconfined."""
    (tmp_path / "cgroup.controllers").write_text("pids memory\n")
    (tmp_path / "cgroup.subtree_control").write_text("pids memory\n")
    monkeypatch.setenv("JAXRL_TERM_CGROUP", str(tmp_path))
    monkeypatch.setenv("JAXRL_TERM_LOCAL_CONFINE", "cgroup2")
    cf.cgroup2_parent.cache_clear()
    try:
        with pytest.raises(SandboxError, match="no pids.max"):
            run(_with(lambda sb: None))
    finally:
        cf.cgroup2_parent.cache_clear()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cgroup.controllers", "cgroup.subtree_control"]


# ----------------------------------------------------------------------------- kill_all, changes, exec


def test_kill_all_kills_every_process_and_keeps_the_files():
    async def go(sb):
        await sb.run("cd /tmp; echo kept > /app/f; sleep 1000 & setsid sleep 1001 & (sleep 1002 &); disown -a")
        assert len(_host_pids_of(sb)) >= 4
        await sb.kill_all()
        assert _host_pids_of(sb) == []
        r = await sb.run("pwd; cat /app/f; ps -e -o comm= | grep -c sleep")
        assert r.output == "/tmp\nkept\n0\n", r.output

    run(_with(go))


def test_changes_list_what_the_sandbox_wrote():
    async def go(sb):
        assert await sb.changes() == []
        await sb.write_file("/app/a.txt", b"a")
        await sb.run("mkdir -p /tmp/d && touch /tmp/d/b; mkdir -p ~/.local/lib/python3/site-packages; "
                     "touch ~/.local/lib/python3/site-packages/evil.pth")
        ch = await sb.changes()
        for item in [("A", "/app/a.txt"), ("A", "/tmp/d"), ("A", "/tmp/d/b"), ("C", "/app"),
                     ("A", "/app/.local/lib/python3/site-packages/evil.pth")]:
            assert item in ch, (item, ch)

    run(_with(go))


def test_exec_feeds_stdin_and_runs_the_host_python_and_pytest(tmp_path):
    need(subprocess.run(["/usr/bin/python3", "-c", "import pytest"], capture_output=True, check=False).returncode == 0,
         "the host's /usr/bin/python3 has no pytest")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("def test_ok():\n    assert open('/app/out').read() == 'hi'\n")

    async def go(sb):
        r = await sb.exec(["python3", "-c", "import sys; print(sys.stdin.read()[::-1])"], stdin=b"abc123")
        assert r.exit_code == 0 and r.output == "321cba\n", r
        await sb.run("printf hi > /app/out; chmod 600 /app/out")
        await sb.upload_dir(tmp_path / "tests", "/tests")
        r = await sb.exec(["python3", "-m", "pytest", "-q", "-p", "no:cacheprovider", "/tests"], workdir="/tests",
                          timeout_s=120)
        assert r.exit_code == 0 and "1 passed" in r.output, r.output
        r = await sb.exec(["sleep", "30"], timeout_s=1)
        assert r.timed_out

    run(_with(go))


SPAWN_PROBE = r"""
import asyncio, os, signal, sys, threading
forks = []
os.register_at_fork(before=lambda: forks.append(1))  # runs on any fork() that runs Python (os.fork, preexec_fn)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # the spawning thread's mask must not reach the sandbox
signal.signal(signal.SIGQUIT, signal.SIG_IGN)  # nor an ignored disposition
signal.signal(signal.SIGUSR1, signal.SIG_IGN)
from jaxrl_term.sandbox.base import open_sandbox

async def go():
    async with open_sandbox("local") as sb:
        shell = await sb.run("grep -E '^Sig(Blk|Ign)' /proc/self/status")
        ex = await sb.exec(["grep", "-E", "^Sig(Blk|Ign)", "/proc/self/status"])
        env = await sb.exec(["env"])
        assert "LC_CTYPE" not in env.output and "LD_LIBRARY_PATH" not in env.output, env.output  # PATH only
        await sb.write_file("/app/x", b"data")
        back = await sb.read_file("/app/x")
        return shell.output, ex.output, back

print(repr(asyncio.run(go())), len(forks))
"""


def test_sandbox_processes_are_spawned_without_python_in_a_fork_of_the_trainer():
    """Spawning runs no Python between fork and exec in the (multithreaded) trainer: a ``preexec_fn`` forks with
    every library's atfork handlers and the GIL held, a rare deadlock that froze the event loop. The sandbox's
    processes still start with no blocked or ignored signals (SIGPIPE and SIGXFSZ included), whatever the
    spawning thread had."""
    out = subprocess.run([sys.executable, "-c", SPAWN_PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    shell, ex, back = eval(out.stdout.rsplit(" ", 1)[0])  # noqa: S307 - our own probe's repr
    forks = int(out.stdout.rsplit(" ", 1)[1])
    assert forks == 0, out.stdout
    # a command started directly (exec): exactly what the spawn gave it. The standard signals (1-31) only: 32 and
    # 33 are glibc's own (cancellation, set*id broadcast; sigaction refuses them), and a CI harness had them ignored
    fields = dict(line.split(":\t") for line in ex.splitlines() if line)
    assert int(fields["SigBlk"], 16) == 0 and int(fields["SigIgn"], 16) & 0x7FFFFFFF == 0, ex
    assert "SigBlk:\t0000000000000000" in shell, shell  # the agent's shell: nothing blocked
    assert back == b"data"


def test_a_confinement_that_cannot_be_applied_fails_loudly_before_the_command(tmp_path):
    """The spawn hop (``Confinement.exec_prefix``) never runs the command unconfined: a cgroup it cannot join is
    exit 125 with the reason, and the command never ran."""
    marker = tmp_path / "ran"
    bad = cf.Confinement("cgroup2", 64, 256 << 20, None, (str(tmp_path / "no-such-cgroup"),))
    out = subprocess.run([*bad.exec_prefix(), "/bin/sh", "-c", f"touch {marker}"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 125 and "jaxrl_term confine: FileNotFoundError" in out.stderr, out
    assert not marker.exists()
    ok = cf.Confinement("uid", 64, 256 << 20, None, ())
    out = subprocess.run([*ok.exec_prefix(), "/bin/sh", "-c", "ulimit -v; echo $$"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.split()[0] == str(256 << 10), out  # RLIMIT_AS in KiB


def test_sixteen_concurrent_sandboxes_twenty_commands_each():
    from jaxrl_term.sandbox.base import SandboxPool

    async def main():
        pool = SandboxPool("local", max_concurrent=16, memory_mb=256)
        failures = []

        async def worker(i):
            async with pool.sandbox() as sb:
                for j in range(20):
                    r = await sb.run(f"echo {i}-{j} $((i={i}*{j}))")
                    if r.exit_code != 0 or r.output != f"{i}-{j} {i * j}\n":
                        failures.append((i, j, r))

        await asyncio.gather(*(worker(i) for i in range(16)))
        return failures, pool

    failures, pool = run(main())
    assert failures == [] and pool.created == 16 and pool.failed == 0 and pool.open == 0


# ------------------------------------------------------------------------------------------- reaping

OWNER = """
import asyncio, json, os, signal, sys, threading, time
from jaxrl_term.sandbox.base import open_sandbox, unwind_on_sigterm
async def main():
    async with open_sandbox('local') as a, open_sandbox('local') as b:
        for sb in (a, b):
            await sb.run('sleep 1000 &')
        try:  # the test signals as soon as it reads this line: print() may not have returned yet
            print(json.dumps([[str(a.root), str(b.root)], list(a.confine.cgroups) + list(b.confine.cgroups),
                              [a.confine.host_uid, b.confine.host_uid]]), flush=True)
            if sys.argv[1] == 'KILL':
                os.kill(os.getpid(), signal.SIGKILL)
            await asyncio.sleep(1000)
        except BaseException:
            if sys.argv[1] == 'STUCK':  # the unwinding waits on what no signal ends (a step on a worker thread)
                print('unwinding', flush=True)
                worker = threading.Thread(target=time.sleep, args=(1000,))
                worker.start()
                worker.join()
            raise
if sys.argv[1] in ('TERM', 'STUCK'):
    unwind_on_sigterm()
asyncio.run(main())
"""


def _start_owner(tmp_path, how):
    script = tmp_path / "owner.py"
    script.write_text(OWNER)
    proc = subprocess.Popen([sys.executable, str(script), how], stdout=subprocess.PIPE, text=True)
    roots, cgroups, uids = json.loads(proc.stdout.readline())
    return proc, [Path(r) for r in roots], cgroups, uids


def _uid_alive(uids) -> bool:
    return any(cf.uid_pids(u) for u in uids if u is not None)


def test_a_sigkilled_owners_sandboxes_are_reaped(tmp_path, kind):
    from jaxrl_term.sandbox.local import reap

    proc, roots, cgroups, uids = _start_owner(tmp_path, "KILL")
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert all(r.is_dir() for r in roots)  # the killed owner could not clean up
    deadline = time.monotonic() + 5
    while _uid_alive(uids) and time.monotonic() < deadline:  # its processes died with it (--die-with-parent)
        time.sleep(0.05)
    assert not _uid_alive(uids)
    assert reap() >= 2
    assert not any(r.exists() for r in roots) and not any(os.path.exists(c) for c in cgroups)


def test_sigterm_cleans_up_like_a_normal_exit(tmp_path):
    proc, roots, cgroups, uids = _start_owner(tmp_path, "TERM")
    assert all(r.is_dir() for r in roots)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    assert not any(r.exists() for r in roots) and not any(os.path.exists(c) for c in cgroups)
    assert not _uid_alive(uids)


def test_a_second_sigterm_removes_the_sandboxes_and_exits_when_the_unwinding_is_stuck(tmp_path):
    proc, roots, cgroups, uids = _start_owner(tmp_path, "STUCK")
    proc.send_signal(signal.SIGTERM)
    assert proc.stdout.readline() == "unwinding\n"
    time.sleep(0.5)
    assert proc.poll() is None and all(r.is_dir() for r in roots)  # stuck with its sandboxes open
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert not any(r.exists() for r in roots) and not any(os.path.exists(c) for c in cgroups)
    deadline = time.monotonic() + 5
    while _uid_alive(uids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _uid_alive(uids)


def test_reap_leaves_live_owners_alone():
    from jaxrl_term.sandbox.local import reap

    async def go(sb):
        reap()
        assert sb.root.is_dir() and (await sb.run("echo up")).output == "up\n"

    run(_with(go))
