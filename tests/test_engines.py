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


def test_placement_least_loaded_image_preferred_capacity_and_cool_down():
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

    async def use():
        async with pool.place() as e:
            assert CURRENT.get() is e
            raise OSError("engine gone")

    with pytest.raises(OSError):
        asyncio.run(use())
    assert CURRENT.get() is None and not a.healthy and a.failures == 1  # it does not answer: out of rotation
    assert pool._pick(None) is b
    b.down_until = a.down_until
    with pytest.raises(SandboxError, match="no Docker engine answers"):
        asyncio.run(use())
    time.sleep(0.35)
    assert a.healthy and b.healthy  # back after the cool-down
    with pytest.raises(ValueError, match="capacity"):
        EnginePool([{"url": "unix:///x", "capacity": 0}])
    with pytest.raises(ValueError, match="unix://, tcp://"):
        EnginePool([{"url": "node1:2376"}])


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
    from jaxrl_term.sandbox.docker import LABEL_RUN, RUN_ID, reap
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
    retried = sum(v for k, v in counters.items() if k.startswith("pipeline/retry_"))
    assert retried >= 1, counters
    # the second daemon comes back: the reaper leaves nothing of this run on either engine
    from jaxrl_term.sandbox.engines import restart

    restart(second_engine)
    two = docker.DockerClient(base_url=second_engine["url"])
    for cl in (docker.from_env(), two):
        reap(run_id=RUN_ID, client_=cl)
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
