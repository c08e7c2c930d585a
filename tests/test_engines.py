"""Sandboxes over several Docker engines: a second Docker daemon started by this test on its own socket and data
root; episodes of a rollout land on both (seen by their labels), the task image is built on the second engine
on demand (its base image copied there first); killing the second daemon mid-episode sends the episodes to the
first, the batch completes with the verifier's own rewards, and the reaper leaves nothing on either engine."""

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
    waits, an engine that does not answer leaves the rotation and comes back after its cool-down."""
    from jaxrl_term.sandbox.base import SandboxError
    from jaxrl_term.sandbox.engines import CURRENT, EnginePool

    pool = EnginePool([{"url": "unix:///nonexistent/a.sock", "capacity": 2, "name": "a"},
                       {"url": "unix:///nonexistent/b.sock", "capacity": 1, "name": "b"}], cooldown_s=0.3)
    a, b = pool.engines
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
    b.down_until = a.down_until
    t0 = time.monotonic()
    with pytest.raises(SandboxError, match="no Docker engine answers"):
        asyncio.run(use())  # all out: waits for the first cool-down, asks again, still silent
    assert time.monotonic() - t0 >= 0.2 and not a.healthy
    b.down_until = time.monotonic() + 60
    with pytest.raises(SandboxError, match="does not answer"):  # a pinned place fails at once on a dead engine
        asyncio.run(use(on=b))
    a.down_until = b.down_until = 0.0
    assert a.healthy and b.healthy  # back after the cool-down
    a._client = b._client = object()  # (no client calls below)
    a.open, b.open = 2, 1

    async def pinned():  # over capacity on its own engine: a verifier's check never waits for its episode's place
        async with pool.place(on=a) as e:
            return e, e.open

    assert asyncio.run(pinned()) == (a, 3) and a.open == 2
    with pytest.raises(SandboxError, match="within 0s"):
        asyncio.run(use(timeout_s=0.1))  # all full: a bounded wait ends with an error naming the engines
    a.open = b.open = 0
    a.down_until = b.down_until = 0.0
    monkeypatch.setattr(type(a), "ping", lambda self, timeout_s=5.0: True)  # it answers, but refuses creates

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
    assert [e.name for e in EnginePool(["unix:///x", "unix:///y"]).engines] == ["e0", "e1"]


def _engines(url2, capacity=2):
    from jaxrl_term.sandbox.engines import EnginePool

    return EnginePool([{"url": DEFAULT, "capacity": capacity, "name": "one"},
                       {"url": url2, "capacity": capacity, "name": "two"}], cooldown_s=600)


def _pipeline(tasks, tok, engine, pool, **kw):
    from jaxrl_term.agent.actions import BashScaffold
    from jaxrl_term.agent.loop import AgentLimits
    from jaxrl_term.rollout.engine import SamplingParams
    from jaxrl_term.rollout.pipeline import RolloutPipeline

    return RolloutPipeline(tasks, engine=engine, tokenizer=tok, scaffold_factory=BashScaffold, group_size=2,
                           groups_per_step=2, sampling=SamplingParams(max_new_tokens=64),
                           limits=AgentLimits(max_turns=3, max_context_tokens=4096), backend="docker", pool=pool,
                           drop_zero_variance=False, max_concurrent_episodes=4, **kw)


async def _watch(clients: dict, seen: dict, stop: asyncio.Event):
    """Which sandbox containers (by label) each engine ran."""
    while not stop.is_set():
        for name, cl in clients.items():
            try:
                for c in await asyncio.to_thread(cl.containers.list, all=True,
                                                 filters={"label": "jaxrl_term.group"}, sparse=True):
                    seen[name].add(c.id)
            except Exception:  # noqa: BLE001 - the engine was killed
                pass
        await asyncio.sleep(0.1)


def test_episodes_land_on_both_engines_and_images_are_built_where_needed(second_engine, tiny_tokenizer_dir):
    import docker

    from jaxrl_term.agent.actions import SENTINEL
    from jaxrl_term.model.tokenizer import load_tokenizer
    from jaxrl_term.sandbox.base import SandboxPool
    from jaxrl_term.tasks.builtin import generate

    tok = load_tokenizer(tiny_tokenizer_dir)
    two = docker.DockerClient(base_url=second_engine["url"])
    assert two.images.list() == []  # a new engine: nothing on it
    tasks = [generate("create_file", "easy", seed=11), generate("count_matches", "easy", seed=12)]
    engines = _engines(second_engine["url"])
    engine = SessionEngine(tok, [f"```bash\nsleep 2; echo {SENTINEL}\n```"])

    async def main():
        pool = SandboxPool("docker", max_concurrent=4, engines=engines)
        pipe = _pipeline(tasks, tok, engine, pool)
        seen = {"one": set(), "two": set()}
        stop = asyncio.Event()
        watcher = asyncio.create_task(_watch({"one": docker.from_env(), "two": two}, seen, stop))
        pipe.start()
        try:
            batch = await asyncio.wait_for(pipe.get_batch(0), 600)
        finally:
            await pipe.stop()
            stop.set()
            await watcher
        return batch, pipe.take_counters(), seen

    batch, counters, seen = asyncio.run(main())
    assert len(batch) == 2 and all(g.rewards == [0.0, 0.0] for g in batch)  # the verifier's: no work, 0
    assert seen["one"] and seen["two"], seen  # the episodes landed on both engines
    assert counters["engine/one/created"] + counters["engine/two/created"] >= 4
    assert counters["engine/two/created"] >= 1 and counters["engine/two/up"] == 1.0
    tags = [t for img in two.images.list() for t in img.tags]
    assert any(t.startswith("jaxrl-term/base:") for t in tags)  # copied there for the build ...
    assert any(not t.startswith("jaxrl-term/base:") for t in tags), tags  # ... and a task image built there
    assert two.containers.list(all=True, filters={"label": "jaxrl_term.group"}) == []


def test_killed_engine_episodes_are_retried_on_the_other_and_nothing_is_left(second_engine, tiny_tokenizer_dir):
    import docker

    from jaxrl_term.agent.actions import SENTINEL
    from jaxrl_term.model.tokenizer import load_tokenizer
    from jaxrl_term.sandbox.base import SandboxPool
    from jaxrl_term.sandbox.docker import LABEL_RUN, RUN_ID
    from jaxrl_term.sandbox.docker import main as reap_cli
    from jaxrl_term.tasks.builtin import generate

    tok = load_tokenizer(tiny_tokenizer_dir)
    tasks = [generate("create_file", "easy", seed=21)]
    engines = _engines(second_engine["url"])
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
    # the second daemon comes back: the reaper leaves nothing of this run on either engine
    from jaxrl_term.sandbox.engines import restart

    restart(second_engine)
    two = docker.DockerClient(base_url=second_engine["url"])
    assert two.containers.list(all=True, filters={"label": f"{LABEL_RUN}={RUN_ID}"})  # left there by the kill
    hosts = (f"sandbox.docker.hosts=[{{url:'{DEFAULT}',capacity:2,name:one}},"
             f"{{url:'{second_engine['url']}',capacity:2,name:two}}]")
    assert reap_cli(["reap", "--run", RUN_ID, "--all-hosts", "--", hosts]) == 0  # the preset's engines
    for cl in (docker.from_env(), two):
        assert cl.containers.list(all=True, filters={"label": f"{LABEL_RUN}={RUN_ID}"}) == []


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
