"""Sandboxes over several Docker engines: a second Docker daemon started by this test on its own socket and data
root; episodes of a rollout land on both, the task image is built on the second engine on demand (its base image
copied there first); an engine that never answers costs no attempt; stopping (SIGSTOP) or killing the second
daemon mid-episode sends the episodes to the first, the batch completes with the verifier's own rewards, a
resumed engine rejoins after a probe, and the reaper leaves nothing on either engine (or only on the one named)."""

import asyncio
import os
import shutil
import time

import pytest

from conftest import need
from helpers import SessionEngine

DEFAULT = "unix:///var/run/docker.sock"


@pytest.fixture
def second_engine(docker_client):
    need(shutil.which("dockerd") is not None and os.geteuid() == 0, "a second Docker daemon needs dockerd and root")
    import subprocess

    from jaxrl_term.sandbox.engines import local_daemon

    def bridge():  # the first engine's default bridge: a second daemon must leave it alone
        return subprocess.run(["ip", "-4", "addr", "show", "docker0"], capture_output=True, text=True).stdout

    before = bridge()
    with local_daemon() as state:
        yield state
    assert bridge() == before, "the second Docker daemon changed the first one's docker0"


def test_placement_least_loaded_image_preferred_capacity_and_cool_down(monkeypatch):
    """EnginePool's choices (no Docker needed): least loaded, an engine with the image preferred, a full pool
    waits, an engine that does not answer leaves the rotation and comes back only when a probe after its
    cool-down answers (a failed probe doubles the next cool-down)."""
    from jaxrl_term.sandbox.base import SandboxError
    from jaxrl_term.sandbox.engines import CURRENT, EnginePool

    monkeypatch.setattr(EnginePool, "watch", lambda self: None)  # the watcher threads: the real-engine tests below
    pool = EnginePool([{"url": "unix:///nonexistent/a.sock", "capacity": 2, "name": "a"},
                       {"url": "unix:///nonexistent/b.sock", "capacity": 1, "name": "b"}], cooldown_s=0.3,
                      probe_timeout_s=1)
    a, b = pool.engines
    assert pool._pick(None) is None  # none has answered a probe yet
    a.mark_up(), b.mark_up()  # (their first probes answered)
    assert pool._pick(None) is a  # both empty: the first
    a.open = 1
    assert pool._pick(None) is b  # 1/2 loaded vs 0/1
    b.images.add("recipe")
    a.open = 0
    assert pool._pick("recipe") is b  # the image is there
    b.open = 1
    assert pool._pick("recipe") is a  # b is full
    a.open = 2
    assert pool._pick(None) is None  # all full: place() waits
    a.open = b.open = 0

    async def use(**kw):
        async with pool.place(**kw) as e:
            assert CURRENT.get() is e
            raise OSError("engine gone")

    with pytest.raises(SandboxError, match="Docker engine a"):  # its client cannot even ask the API version
        asyncio.run(use())
    assert CURRENT.get() is None and not a.healthy and a.failures == 1  # it does not answer: out of rotation
    assert pool._pick(None) is b
    time.sleep(0.35)
    assert a.probe_due and not a.healthy and pool._pick(None) is b  # its cool-down's end alone is not enough
    assert not pool.probe(a) and not a.probe_due and a.down_until - time.monotonic() > 0.45  # silent: 0.6 s more
    b.mark_down(0.01, "test")
    time.sleep(0.02)
    t0 = time.monotonic()
    with pytest.raises(SandboxError, match="no Docker engine answers"):
        asyncio.run(use())  # all out: probes the first whose cool-down ends, still silent
    assert time.monotonic() - t0 < 0.3 and not b.healthy and b.backoff == 1
    b.down_until = time.monotonic() + 60
    with pytest.raises(SandboxError, match="does not answer"):  # a pinned place fails at once on a dead engine
        asyncio.run(use(on=b))
    monkeypatch.setattr(type(a), "ping", lambda self, timeout_s=5.0: True)  # the engines answer again
    a.down_until = b.down_until = 0.0
    assert pool.probe(a) and pool.probe(b) and a.healthy and b.healthy  # back after a probe answers
    assert a.left == b.left == a.rejoined == b.rejoined == 1 and a.backoff == b.backoff == 0
    assert pool.metrics()["engine/a/out_s"] > 0.3 and pool.metrics()["engine/a/left"] == 0  # (counted once)
    a._client = b._client = object()  # (no client calls below)
    a.open, b.open = 2, 1

    async def pinned():  # over capacity on its own engine: a verifier's check never waits for its episode's place
        async with pool.place(on=a) as e:
            return e, e.open

    assert asyncio.run(pinned()) == (a, 3) and a.open == 2
    with pytest.raises(SandboxError, match="within 0s"):
        asyncio.run(use(timeout_s=0.1))  # all full: a bounded wait ends with an error naming the engines
    a.open = b.open = 0

    async def refused():  # what DockerSandbox.create counts when the engine refuses a container
        async with pool.place(on=a) as e:
            e.failing += 1
            raise SandboxError("cannot start a container: no space left on device")

    for _ in range(5):  # an episode's own errors never take an engine out
        with pytest.raises(OSError):
            asyncio.run(use(on=a))
    assert a.healthy
    for _ in range(3):  # 3 refused creates in a row do
        assert a.healthy
        with pytest.raises(SandboxError):
            asyncio.run(refused())
    assert not a.healthy and b.healthy and a.failures == 9
    assert pool._pick(None) is b
    # at start-up no engine has answered yet: all are probed at once, so a dead first one costs no attempt
    fresh = EnginePool([{"url": "unix:///nonexistent/c.sock", "name": "c"}, {"url": "unix:///nonexistent/d.sock",
                                                                           "name": "d"}])
    monkeypatch.setattr(type(a), "ping", lambda self, timeout_s=5.0: self.name == "d")
    fresh.engines[1]._client = object()

    async def first():
        async with fresh.place() as e:
            return e.name

    assert asyncio.run(first()) == "d" and not fresh.engines[0].healthy and fresh.engines[1].healthy
    with pytest.raises(ValueError, match="capacity"):
        EnginePool([{"url": "unix:///x", "capacity": 0}])
    with pytest.raises(ValueError, match=r"hosts\[0\].url='node1:2376': use unix://, tcp://"):
        EnginePool([{"url": "node1:2376"}])
    with pytest.raises(ValueError, match=r"hosts\[1\]: unknown key\(s\) \['capacty'\]"):
        EnginePool([{"url": "unix:///x"}, {"url": "unix:///y", "capacty": 3}])
    with pytest.raises(ValueError, match="tls_verify needs ca_cert"):
        EnginePool([{"url": "tcp://node1:2376", "tls_verify": True}])
    with pytest.raises(ValueError, match="listed twice"):
        EnginePool([{"url": "unix:///x"}, {"url": "unix:///x"}])
    with pytest.raises(ValueError, match="probe_misses=0"):
        EnginePool([{"url": "unix:///x"}], probe_misses=0)
    assert [e.name for e in EnginePool(["unix:///x", "unix:///y"]).engines] == ["e0", "e1"]


def test_a_cut_fails_the_places_still_held_once_and_leaves_real_cancellations_alone(monkeypatch):
    """``EnginePool._cut`` (an engine that stopped answering) from another thread: a place still held fails with a
    SandboxError (once, also for a nested place of the same task: a verifier's fresh sandbox); a place left
    before the cancel reaches its loop is spared; a real cancellation arriving with the cut stays one."""
    from jaxrl_term.sandbox.base import SandboxError
    from jaxrl_term.sandbox.engines import EnginePool

    monkeypatch.setattr(EnginePool, "watch", lambda self: None)
    pool = EnginePool([{"url": "unix:///nonexistent/a.sock", "capacity": 4, "name": "a"}], probe_timeout_s=0.1)
    (a,) = pool.engines
    a.mark_up()
    a._client = object()
    monkeypatch.setattr(type(a), "ping", lambda self, timeout_s=5.0: True)

    async def held(nested: bool):
        async with pool.place():
            if nested:
                async with pool.place(on=a):
                    await asyncio.sleep(30)
            await asyncio.sleep(30)

    async def cut_while(coro, *, also_cancel: bool = False):
        task = asyncio.create_task(coro)
        await asyncio.sleep(0.05)
        await asyncio.to_thread(pool._cut, a)  # the watcher's thread
        if also_cancel:
            task.cancel()
        try:
            return await asyncio.wait_for(task, 5)
        except BaseException as e:  # noqa: BLE001
            return e

    for nested in (False, True):
        a.in_rotation = True
        err = asyncio.run(cut_while(held(nested)))
        assert isinstance(err, SandboxError) and "stopped answering" in str(err), err
        assert a.open == 0 and not a.holders and not a.cut
    assert isinstance(asyncio.run(cut_while(held(False), also_cancel=True)), asyncio.CancelledError)

    async def in_one_turn(*calls):  # calls made together on the loop while a place is held
        task = asyncio.create_task(held(False))
        await asyncio.sleep(0.05)
        asyncio.get_running_loop().call_soon(lambda: [c(task) for c in calls])
        try:
            return await asyncio.wait_for(task, 5)
        except BaseException as e:  # noqa: BLE001
            return e

    def cut(task):
        pool._cut(a)

    # a real cancel queued before the cut stays a cancellation; two cuts (the watcher and a sandbox's exit) one
    # SandboxError
    assert isinstance(asyncio.run(in_one_turn(lambda t: t.cancel(), cut)), asyncio.CancelledError)
    assert isinstance(asyncio.run(in_one_turn(cut, cut)), SandboxError)

    async def spared():  # the cut's cancel reaches the loop after the place was left: nothing is cancelled
        place = pool.place()
        await place.__aenter__()
        pool._cut(a)  # on the loop's own thread: its cancel runs after this coroutine next yields ...
        await place.__aexit__(None, None, None)  # ... which is after the place let go (its exit pings a)
        await asyncio.sleep(0.05)
        return "not cancelled"

    assert asyncio.run(spared()) == "not cancelled"


def _engines(url2, capacity=2, **settings):
    from jaxrl_term.sandbox.engines import EnginePool

    return EnginePool([{"url": DEFAULT, "capacity": capacity, "name": "one"},
                       {"url": url2, "capacity": capacity, "name": "two"}], **{"cooldown_s": 600, **settings})


def _pipeline(tasks, tok, engine, pool, **kw):
    from jaxrl_term.agent.actions import BashScaffold
    from jaxrl_term.agent.loop import AgentLimits
    from jaxrl_term.rollout.engine import SamplingParams
    from jaxrl_term.rollout.pipeline import RolloutPipeline

    return RolloutPipeline(tasks, engine=engine, tokenizer=tok, scaffold_factory=BashScaffold, group_size=2,
                           groups_per_step=2, sampling=SamplingParams(max_new_tokens=64),
                           limits=AgentLimits(max_turns=3, max_context_tokens=4096), backend="docker", pool=pool,
                           drop_zero_variance=False, max_concurrent_episodes=4, **kw)


def test_killed_engine_episodes_are_retried_on_the_other_and_nothing_is_left(second_engine, tiny_tokenizer_dir):
    """The second daemon SIGKILLed under an episode: the batch completes on the first with the verifier's rewards;
    restarted, it rejoins after a probe and what the kill left there is removed; ``reap --all-hosts``."""
    import docker

    from jaxrl_term.agent.actions import SENTINEL
    from jaxrl_term.model.tokenizer import load_tokenizer
    from jaxrl_term.sandbox.base import SandboxPool
    from jaxrl_term.sandbox.docker import LABEL_RUN, RUN_ID
    from jaxrl_term.sandbox.docker import main as reap_cli
    from jaxrl_term.tasks.builtin import generate

    tok = load_tokenizer(tiny_tokenizer_dir)
    tasks = [generate("create_file", "easy", seed=21)]
    engines = _engines(second_engine["url"], cooldown_s=1, probe_interval_s=0.5, probe_timeout_s=1)
    engine = SessionEngine(tok, ["```bash\nsleep 4; echo working\n```", f"```bash\necho {SENTINEL}\n```"])
    two = docker.DockerClient(base_url=second_engine["url"])

    async def main():
        pool = SandboxPool("docker", max_concurrent=4, engines=engines)
        pipe = _pipeline(tasks, tok, engine, pool, max_episode_retries=3)
        pipe.start()

        async def kill_two():  # the second daemon dies while an episode runs on it
            for _ in range(1200):
                try:
                    running = await asyncio.to_thread(two.containers.list, filters={"label": "jaxrl_term.group"})
                except Exception:  # noqa: BLE001
                    running = []
                if running:
                    await asyncio.sleep(1.0)
                    second_engine["proc"].kill()
                    await asyncio.to_thread(second_engine["proc"].wait)
                    return True
                await asyncio.sleep(0.1)
            return False

        killer = asyncio.create_task(kill_two())
        try:
            batch = await asyncio.wait_for(pipe.get_batch(0), 900)
        finally:
            await pipe.stop()
        return batch, pipe.take_counters(), await killer

    batch, counters, killed = asyncio.run(main())
    assert killed
    assert len(batch) == 2 and all(len(g.trajectories) == 2 and g.rewards == [0.0, 0.0] for g in batch)
    assert counters["engine/two/up"] == 0.0  # out of rotation
    assert not any(counters.get(f"pipeline/{o}", 0) for o in ("verifier_sabotaged", "tampered")), counters
    retried = sum(v for k, v in counters.items() if k.startswith("pipeline/retry_"))
    assert retried >= 1, counters
    assert engines.engines[1].orphans  # the containers whose removal the killed engine did not answer
    # the second daemon is restarted: a probe puts it back and removes what the kill left there
    from jaxrl_term.sandbox.engines import restart

    restart(second_engine)
    two = docker.DockerClient(base_url=second_engine["url"])
    t0 = time.monotonic()
    while not engines.engines[1].healthy or two.containers.list(all=True, filters={"label": f"{LABEL_RUN}={RUN_ID}"}):
        assert time.monotonic() - t0 < 60, engines.describe()
        time.sleep(0.2)
    assert engines.engines[1].rejoined == 1
    engines.close()
    # a dead run's containers on both engines: reap --all-hosts (the preset's engines) leaves nothing of it
    dead = f"jrt-test-dead-{os.getpid()}"
    for cl in (docker.from_env(), two):
        cl.containers.create("jaxrl-term/base:trixie", "true", labels={LABEL_RUN: dead})
    hosts = (f"sandbox.docker.hosts=[{{url:'{DEFAULT}',capacity:2,name:one}},"
             f"{{url:'{second_engine['url']}',capacity:2,name:two}}]")
    assert reap_cli(["reap", "--run", dead, "--all-hosts", "--", hosts]) == 0  # the preset's engines
    for cl in (docker.from_env(), two):
        assert cl.containers.list(all=True, filters={"label": f"{LABEL_RUN}={dead}"}) == []


def test_a_dead_or_hung_engine_costs_no_attempt_and_a_resumed_one_rejoins(second_engine, tiny_tokenizer_dir):
    """(a) an engine that never answers, through many cool-downs, while another is healthy: no attempt is charged
    and every episode passes; (b) episodes land on a new second engine (its base images copied there, the task
    image built there), which is stopped (SIGSTOP) while it holds them: out of rotation within ``hang_bound_s``,
    its episodes retried on the first, none dropped; (c) resumed (SIGCONT): a probe puts it back, the containers
    it was left holding are removed and the next batch uses both engines; (d) ``reap --host`` of one engine
    leaves the other's containers alone."""
    import signal

    import docker

    from jaxrl_term.agent.actions import SENTINEL
    from jaxrl_term.model.tokenizer import load_tokenizer
    from jaxrl_term.sandbox.base import SandboxPool
    from jaxrl_term.sandbox.docker import LABEL_RUN
    from jaxrl_term.sandbox.docker import main as reap_cli
    from jaxrl_term.sandbox.engines import EnginePool
    from jaxrl_term.tasks.builtin import generate

    tok = load_tokenizer(tiny_tokenizer_dir)
    task = generate("create_file", "easy", seed=21)
    solve = task.solution.files["solve.sh"].data.decode().split("\n", 2)[2]  # the oracle's commands
    two = docker.DockerClient(base_url=second_engine["url"])
    assert two.images.list() == []  # a new engine: nothing on it
    pid = second_engine["proc"].pid  # dockerd itself (unshare execs it)

    def running_on_two():
        try:
            return two.containers.list(all=True, filters={"label": "jaxrl_term.group"}, sparse=True)
        except Exception:  # noqa: BLE001 - stopped: it does not answer
            return []

    async def batch(engines, first_reply, side=None):
        pool = SandboxPool("docker", max_concurrent=4, engines=engines)
        llm = SessionEngine(tok, [f"```bash\n{first_reply}{solve}```", f"```bash\necho {SENTINEL}\n```"])
        pipe = _pipeline([task] * 2, tok, llm, pool, max_episode_retries=2)
        pipe.start()
        watcher = asyncio.create_task(side()) if side else None
        try:
            out = await asyncio.wait_for(pipe.get_batch(0), 600)
        finally:
            await pipe.stop()
        return out, pipe.take_counters(), (await watcher if watcher else None)

    def retried(counters):
        return sum(v for k, v in counters.items() if k.startswith("pipeline/retry_"))

    # (a) an engine on a socket that does not exist, cool-down 0.2 s: the 1-2 of 12 dropped
    dead = EnginePool([{"url": DEFAULT, "capacity": 2, "name": "one"},
                       {"url": "unix:///nonexistent/gone.sock", "capacity": 2, "name": "gone"}],
                      cooldown_s=0.2, probe_interval_s=0.2, probe_timeout_s=1)
    groups, counters, _ = asyncio.run(batch(dead, ""))
    dead.close()
    assert [g.rewards for g in groups] == [[1.0, 1.0]] * 2 and retried(counters) == 0, counters
    assert counters["engine/gone/created"] == 0 and counters["engine/gone/left"] == 1
    assert dead.engines[1].probes_failed >= 2  # probed after each cool-down, never given an attempt

    # (b) the second engine hangs with episodes on it
    pool = EnginePool([{"url": DEFAULT, "capacity": 2, "name": "one"},
                       {"url": second_engine["url"], "capacity": 2, "name": "two"}],
                      cooldown_s=1, probe_interval_s=0.5, probe_timeout_s=1, probe_misses=2)
    assert pool.hang_bound_s == 3.0

    async def stop_two():
        while not await asyncio.to_thread(running_on_two):
            await asyncio.sleep(0.1)
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        while pool.engines[1].healthy:
            await asyncio.sleep(0.02)
        return time.monotonic() - t0

    try:
        groups, counters, out_after = asyncio.run(batch(pool, "sleep 3\n", stop_two))
    finally:
        os.kill(pid, signal.SIGCONT)
    assert out_after <= pool.hang_bound_s + 1.0, out_after  # (+1 s: a loaded 2-core machine's scheduling)
    assert [g.rewards for g in groups] == [[1.0, 1.0]] * 2, counters  # none dropped, none scored 0
    assert counters["engine/two/hung"] == 1 and 1 <= retried(counters) <= 2, counters
    assert not counters.get("pipeline/episodes_failed"), counters
    tags = [t for img in two.images.list() for t in img.tags]
    assert any(t.startswith("jaxrl-term/base:") for t in tags)  # copied there for the build ...
    assert any(not t.startswith("jaxrl-term/base:") for t in tags), tags  # ... and the task image built there

    # (c) resumed: back after a probe; what it held is removed; it takes sandboxes again
    t0 = time.monotonic()
    while not (pool.engines[1].healthy and not running_on_two()):
        assert time.monotonic() - t0 < 30, (pool.describe(), [c.attrs for c in running_on_two()])
        time.sleep(0.1)
    groups, counters, _ = asyncio.run(batch(pool, ""))
    pool.close()
    assert [g.rewards for g in groups] == [[1.0, 1.0]] * 2, counters
    assert counters["engine/one/created"] >= 1 and counters["engine/two/created"] >= 1, counters
    assert retried(counters) == 0 and counters["engine/two/up"] == 1.0
    assert pool.engines[1].rejoined == 1 and counters["engine/two/out_s"] > 1.0

    # (d) a dead run's containers on both engines; reaping one host leaves the other's
    one = docker.from_env()
    dead_run = f"jrt-test-dead-{os.getpid()}"
    made = [cl.containers.create("jaxrl-term/base:trixie", "true", labels={LABEL_RUN: dead_run}) for cl in (one, two)]
    try:
        assert reap_cli(["reap", "--run", dead_run, "--host", second_engine["url"]]) == 0
        assert two.containers.list(all=True, filters={"label": f"{LABEL_RUN}={dead_run}"}) == []
        assert [c.id for c in one.containers.list(all=True, filters={"label": f"{LABEL_RUN}={dead_run}"})] == \
            [made[0].id]
    finally:
        made[0].remove(force=True)


def test_a_tiny_training_step_places_episodes_on_both_engines(second_engine, tmp_path):
    """The preset route: ``sandbox.docker.hosts`` from the command line, a real training step (tiny model)."""
    import json

    from test_train import QUICK, _train

    hosts = (f"sandbox.docker.hosts=[{{url:'{DEFAULT}',capacity:2,name:one}},"
             f"{{url:'{second_engine['url']}',capacity:2,name:two}}]")
    run_dir = tmp_path / "run"
    proc = _train([*QUICK, "sandbox.backend=docker", "trainer.steps=1", hosts, f"run_dir={run_dir}"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if m["step"] >= 0]
    created = {n: sum(m.get(f"engine/{n}/created", 0) for m in steps) for n in ("one", "two")}
    assert created["one"] >= 1 and created["two"] >= 1, created  # 4 episodes over both engines
    assert all(m["engine/two/up"] == 1.0 for m in steps if "engine/two/up" in m)
    from jaxrl_term.report.load import load_run
    from jaxrl_term.report.tables import engine_rows

    rows = {r[0]: r for r in engine_rows(load_run(run_dir))}  # the report's engine table
    assert rows["two"][1] == str(created["two"]) and rows["two"][3:5] == ["0", "0"] and rows["two"][-1] == "yes"


@pytest.fixture
def tls_engine(docker_client):
    need(shutil.which("dockerd") is not None and os.geteuid() == 0, "a second Docker daemon needs dockerd and root")
    need(shutil.which("openssl") is not None, "the test's certificates are made with openssl")
    from jaxrl_term.sandbox.engines import local_daemon

    with local_daemon(tls=True) as state:
        yield state


FAKE_SSH = """#!/bin/sh
# The ssh client, at the edge this test does not cover: it logs its options and runs the remote command here,
# against the Docker engine FAKE_SSH_DOCKER_HOST names (the remote's own engine, as `ssh node docker ...` would).
while [ $# -gt 0 ]; do
  case "$1" in --) shift; break;; -l|-p) echo "$1 $2" >> "$FAKE_SSH_LOG"; shift 2;; *) shift;; esac
done
host=$1; shift
echo "host $host: $*" >> "$FAKE_SSH_LOG"
DOCKER_HOST=$FAKE_SSH_DOCKER_HOST exec sh -c "$*"
"""


def test_tls_and_ssh_engines_run_the_shell_files_stdin_and_the_verifier(tls_engine, tmp_path, monkeypatch):
    """A TLS engine (``--tlsverify``, certificates made here) and an ssh:// engine (``docker system dial-stdio``
    through the ssh client): the persistent shell, exec with stdin (EOF included), files and the verifier (oracle
    1, nothing done 0) work on both, over asyncio's own TLS / the ssh client's pipes; without a client
    certificate the TLS engine refuses."""
    from jaxrl_term.sandbox.engines import EnginePool
    from jaxrl_term.tasks.builtin import generate
    from jaxrl_term.tasks.check import check_task
    from jaxrl_term.tasks.env import open_task_sandbox

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(FAKE_SSH)
    (bin_dir / "ssh").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SSH_LOG", str(tmp_path / "ssh.log"))
    monkeypatch.setenv("FAKE_SSH_DOCKER_HOST", tls_engine["url"])
    # the engines met here are gone after the test (the stand-in ssh with its PATH): not reaped at this process's exit
    monkeypatch.setattr("jaxrl_term.sandbox.docker._own_engines", {})
    tls = {"url": tls_engine["tcp_url"], "tls_verify": True, "ca_cert": tls_engine["ca_cert"],
           "client_cert": tls_engine["client_cert"], "client_key": tls_engine["client_key"], "name": "tls"}
    assert EnginePool([tls]).engines[0].ping()
    no_cert = EnginePool([{"url": tls_engine["tcp_url"], "tls_verify": True, "ca_cert": tls_engine["ca_cert"]}])
    assert not no_cert.engines[0].ping()  # --tlsverify: a client without a certificate is refused
    task = generate("create_file", "easy", seed=31)

    async def on(host: dict):
        pool = EnginePool([host])
        async with open_task_sandbox(task, engines=pool) as sb:
            assert sb.engine.name == host["name"]
            shell = await sb.run("cd /tmp && echo $((6 * 7)) && pwd")
            cat = await sb.exec(["cat"], stdin=b"line\n" * 3)  # ends: stdin reaches EOF
            big = await sb.exec(["wc", "-c"], stdin=b"x" * 200_000)
            await sb.write_file("/tmp/f.bin", bytes(range(256)) * 64)
            back = await sb.read_file("/tmp/f.bin")
        oracle = await check_task(task, "oracle", limits={"engines": EnginePool([host])})
        nop = await check_task(task, "nop", limits={"engines": EnginePool([host])})
        return shell, cat, big, back, oracle, nop

    for host in (tls, {"url": "ssh://tester@node7:2222", "name": "ssh"}):
        shell, cat, big, back, oracle, nop = asyncio.run(on(host))
        assert shell.output == "42\n/tmp\n" and shell.exit_code == 0, (host, shell)
        assert cat.output == "line\n" * 3 and cat.exit_code == 0 and not cat.timed_out, (host, cat)
        assert big.output.strip() == "200000", (host, big)
        assert back == bytes(range(256)) * 64
        assert oracle.score == 1.0 and not oracle.broken, (host, oracle)
        assert nop.score == 0.0 and not nop.broken, (host, nop)
    log = (tmp_path / "ssh.log").read_text()
    assert "-l tester" in log and "-p 2222" in log and "host node7: docker system dial-stdio" in log

    # a task's prebuilt image (never pulled) that only the default engine has: copied onto the TLS engine
    import dataclasses

    import docker

    default = docker.from_env()
    default.images.get("jaxrl-term/base:bookworm").tag("jaxrl-test/prebuilt", "engines")
    try:
        prebuilt = dataclasses.replace(task, environment=dataclasses.replace(
            task.environment, dockerfile=None, files={}, image="jaxrl-test/prebuilt:engines"))

        async def run_prebuilt():
            async with open_task_sandbox(prebuilt, engines=EnginePool([tls])) as sb:
                return await sb.run("echo prebuilt ok")

        assert asyncio.run(run_prebuilt()).output == "prebuilt ok\n"
        there = docker.DockerClient(base_url=tls_engine["url"])
        assert there.images.get("jaxrl-test/prebuilt:engines").id == default.images.get("jaxrl-test/prebuilt:engines").id
    finally:
        default.images.remove("jaxrl-test/prebuilt:engines")

    # reap --host NAME: the TLS engine of the composed config, reached with its certificates (and only it)
    from jaxrl_term.sandbox.docker import LABEL_RUN
    from jaxrl_term.sandbox.docker import main as reap_cli

    dead = f"jrt-test-dead-{os.getpid()}"
    there.containers.create("jaxrl-term/base:trixie", "true", labels={LABEL_RUN: dead})
    hosts = "sandbox.docker.hosts=[{" + ",".join(f"{k}:'{v}'" if isinstance(v, str) else f"{k}:{str(v).lower()}"
                                                 for k, v in tls.items()) + "}]"
    assert reap_cli(["reap", "--run", dead, "--host", "tls", "--", hosts]) == 0
    assert there.containers.list(all=True, filters={"label": f"{LABEL_RUN}={dead}"}) == []
    assert reap_cli(["reap", "--run", dead, "--host", "nosuch", "--", hosts]) == 2  # neither a URL nor a name


def test_engine_dying_under_the_verifier_is_an_error_not_sabotage(second_engine):
    """The engine dies after the agent's last turn: the verifier cannot restart the container; that is
    infrastructure (``verifier_error``, engine_down, no score), never ``verifier_sabotaged`` from a check on a
    healthy engine, and the check on a fresh sandbox is not even tried elsewhere."""
    import docker

    from jaxrl_term.reward.verifier import verify
    from jaxrl_term.sandbox.docker import LABEL_RUN, RUN_ID, reap
    from jaxrl_term.sandbox.engines import restart
    from jaxrl_term.tasks.builtin import generate
    from jaxrl_term.tasks.env import open_task_sandbox

    task = generate("create_file", "easy", seed=41)
    engines = _engines(second_engine["url"])
    two = engines.engines[1]
    engines.engines[0].open = engines.engines[0].capacity  # the first engine is full: the sandbox goes to the second

    async def main():
        async with open_task_sandbox(task, engines=engines) as sb:
            assert sb.engine is two
            await sb.run("echo done > /app/out.txt")
            second_engine["proc"].kill()
            await asyncio.to_thread(second_engine["proc"].wait)
            engines.engines[0].open = 0  # room on the healthy engine now: a check must not go there
            return await verify(task, sb)

    res = asyncio.run(main())
    assert res.outcome == "verifier_error" and res.score is None and res.engine_down, res
    assert "stopped answering" in res.error
    assert not two.healthy  # out of rotation after the sandbox
    restart(second_engine)
    cl = docker.DockerClient(base_url=second_engine["url"])
    reap(run_id=RUN_ID, client_=cl)
    assert cl.containers.list(all=True, filters={"label": f"{LABEL_RUN}={RUN_ID}"}) == []


def test_preflight_names_a_bad_engine_entry_before_anything_connects(tmp_path):
    from jaxrl_term.config import preflight
    from jaxrl_term.plan import compose

    def problems(hosts: str):
        return [p for p in preflight(compose([f"sandbox.docker.hosts={hosts}"]), need_paths=False)
                if p[0] == "sandbox.docker.hosts"]

    assert problems("[{url:'unix:///var/run/docker.sock',capacity:4},{url:'ssh://rl@node2',capacity:8}]") == []
    (key, what, fix), = problems("[{url:'unix:///a'},{url:'tcp://node1:2376',capacty:8}]")
    assert "hosts[1]: unknown key(s) ['capacty']" in what and "capacity" in fix
    (_, what, _), = problems("[{url:'tcp://node1:2376',tls_verify:true,ca_cert:'/nonexistent/ca.pem'}]")
    assert "hosts[0].ca_cert='/nonexistent/ca.pem': no such file" in what
    (_, what, _), = problems("[{url:'node1:2376'}]")
    assert "use unix://, tcp://" in what
    bad = [p for p in preflight(compose(["sandbox.docker.hosts=[{url:'unix:///a'}]", "sandbox.docker.probe_misses=0"]),
                                need_paths=False) if p[0].startswith("sandbox.docker")]
    assert [p[0] for p in bad] == ["sandbox.docker.probe_misses"] and "must be an integer >= 1" in bad[0][1]
