"""The stall guard: a Docker daemon that wedges mid-run (it accepts connections and never answers) must stop the
run with the reasons, not leave the trainer waiting while every episode fails and new groups are started.

The daemon is the machine's real one, reached through a byte-forwarding proxy on its own unix socket that this
test starts; ``wedge()`` makes the proxy swallow every request from then on, as a hung dockerd does. The first
step runs real episodes and the real verifier through it; the second step must raise ``RolloutStalled`` within a
bounded time, naming the setting and why the episodes failed."""

import asyncio
import socket
import threading
import time

import pytest

DOCKER_SOCK = "/var/run/docker.sock"


class WedgingProxy:
    """unix socket -> the Docker daemon's socket, one thread pair per connection; after ``wedge()`` new
    connections are accepted and read from but never forwarded, and open ones stop forwarding."""

    def __init__(self, path: str):
        self.path, self.wedged, self.closed = path, threading.Event(), threading.Event()
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(path)
        self.server.listen(64)
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            self.conns.append(client)
            if self.closed.is_set():  # accepted while close() ran: end it too
                self._end(client)
                return
            if self.wedged.is_set():
                threading.Thread(target=self._swallow, args=(client,), daemon=True).start()
                continue
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            upstream.connect(DOCKER_SOCK)
            self.conns.append(upstream)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _swallow(self, s):
        try:
            while s.recv(65536):
                pass
        except OSError:
            pass

    def _pump(self, src, dst):
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if self.wedged.is_set():  # hung: what comes now goes nowhere
                    self._swallow(src)
                    return
                dst.sendall(data)
        except OSError:
            pass
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def wedge(self):
        self.wedged.set()

    @staticmethod
    def _end(c):
        for end in (lambda: c.shutdown(socket.SHUT_RDWR), c.close):
            try:
                end()
            except OSError:
                pass

    def close(self):
        self.closed.set()
        try:
            self.server.shutdown(socket.SHUT_RDWR)  # wakes the accept thread
        except OSError:
            pass
        self.server.close()
        for c in list(self.conns):  # threads blocked on the hung daemon see the connection end and return
            self._end(c)


@pytest.fixture
def proxy(docker_client, tmp_path):
    p = WedgingProxy(str(tmp_path / "docker.sock"))
    yield p
    p.close()


def test_a_wedged_docker_daemon_stops_the_run_with_the_reasons(proxy, tiny_tokenizer_dir):
    from jaxrl_term.agent.actions import SENTINEL, BashScaffold
    from jaxrl_term.agent.loop import AgentLimits
    from jaxrl_term.model.tokenizer import load_tokenizer
    from jaxrl_term.rollout.engine import SamplingParams
    from jaxrl_term.rollout.pipeline import RolloutPipeline, RolloutStalled
    from jaxrl_term.sandbox.base import SandboxPool
    from jaxrl_term.sandbox.engines import EnginePool
    from jaxrl_term.tasks.builtin import generate

    from helpers import SessionEngine

    tok = load_tokenizer(tiny_tokenizer_dir)
    tasks = [generate("create_file", "easy", seed=s) for s in (31, 32, 33)]
    # both episodes declare done without doing the task: the verifier's own rewards, 0 and 0
    llm = SessionEngine(tok, [f"```bash\necho {SENTINEL}\n```"])
    engines = EnginePool([{"url": f"unix://{proxy.path}", "capacity": 4, "name": "proxied"}], cooldown_s=1.0)

    async def main():
        pool = SandboxPool("docker", max_concurrent=4, engines=engines)
        pipe = RolloutPipeline(tasks, engine=llm, tokenizer=tok, scaffold_factory=BashScaffold, group_size=2,
                               groups_per_step=1, sampling=SamplingParams(max_new_tokens=64),
                               limits=AgentLimits(max_turns=2, max_context_tokens=4096), backend="docker", pool=pool,
                               drop_zero_variance=False, max_concurrent_episodes=4, max_episode_retries=1,
                               attempt_deadline_s=45, max_consecutive_failed_groups=2)
        with pytest.raises(ValueError, match="max_consecutive_failed_groups"):
            RolloutPipeline(tasks, engine=llm, tokenizer=tok, scaffold_factory=BashScaffold, group_size=2,
                            groups_per_step=1, sampling=SamplingParams(), limits=AgentLimits(),
                            max_consecutive_failed_groups=0)
        pipe.start()
        try:
            first = await asyncio.wait_for(pipe.get_batch(0), 600)  # through the proxy, to the real daemon
            counters0 = pipe.take_counters()
            proxy.wedge()
            await pipe.set_policy_version(1)
            t0 = time.monotonic()
            with pytest.raises(RolloutStalled) as stalled:
                await asyncio.wait_for(pipe.get_batch(1), 300)  # a hang here is the bug this test is about
            waited = time.monotonic() - t0
            counters1 = pipe.take_counters()
        finally:
            await pipe.stop()
            proxy.close()  # Docker calls still blocked on the hung daemon (in threads) get a reset and return
        return first, counters0, str(stalled.value), waited, counters1

    first, counters0, message, waited, counters1 = asyncio.run(main())
    assert len(first) == 1 and first[0].error is None and len(first[0].rewards) == 2
    assert counters0.get("pipeline/groups_dropped_errors", 0) == 0 and counters0["pipeline/episodes"] == 2
    # two groups in a row, each with its reason: the engine that stopped answering
    assert "2 groups in a row" in message and "trainer.max_consecutive_failed_groups=2" in message, message
    assert message.count("episodes failed after their retries") == 2, message
    assert "Docker engine" in message or "does not answer" in message, message
    assert "docker info" in message and "resumes from the last checkpoint" in message
    assert counters1["pipeline/groups_dropped_errors"] == 2
    assert counters1.get("pipeline/episodes", 0) == 0
    # the first attempt hangs until its deadline (45 s); the engine then leaves the rotation and the next attempts
    # fail at once instead of waiting out a deadline each
    assert waited < 150, waited


def test_failures_that_are_not_in_a_row_do_not_stop_the_run():
    """The guard counts groups dropped in a row, in the order the trainer takes them: a group that ran between
    two failures (taken, stale or filtered alike) resets it, so a flaky task or a brief outage is survived."""
    from jaxrl_term.agent.loop import AgentLimits
    from jaxrl_term.rollout.engine import SamplingParams
    from jaxrl_term.rollout.pipeline import Group, RolloutPipeline, RolloutStalled
    from jaxrl_term.tasks.builtin import generate

    task = generate("create_file", "easy", seed=1)
    pipe = RolloutPipeline([task], engine=None, tokenizer=None, scaffold_factory=None, group_size=2,
                           groups_per_step=2, sampling=SamplingParams(), limits=AgentLimits(),
                           drop_zero_variance=True, max_consecutive_failed_groups=2)

    def ok(seq, rewards=(0.0, 1.0)):
        return Group(seq, task, [None, None], list(rewards), 0, 0.0, 0.0, None)

    def bad(seq):
        return Group(seq, task, [], [], -1, 0.0, 0.0, f"1/2 episodes failed after their retries (failure {seq})")

    async def steps():
        # step 0: fail, ok, fail, zero-variance (filtered: it ran), fail, ok: never 2 failures in a row
        pipe._results.update({g.seq: g for g in (bad(0), ok(1), bad(2), ok(3, (1.0, 1.0)), bad(4), ok(5))})
        out = await pipe.get_batch(0)
        counters = pipe.take_counters()
        # step 1: fail, ok, then two failures in a row: the run stops, naming both
        pipe._results.update({g.seq: g for g in (bad(6), ok(7), bad(8), bad(9))})
        with pytest.raises(RolloutStalled, match=r"(?s)2 groups in a row.*failure 8.*failure 9") as e:
            await pipe.get_batch(1)
        return out, counters, str(e.value)

    out, counters, message = asyncio.run(steps())
    assert [g.seq for g in out] == [1, 5]
    assert counters["pipeline/groups_dropped_errors"] == 3
    assert counters["pipeline/groups_filtered_zero_variance"] == 1
    assert "failure 6" not in message  # the group that ran between reset the count


def test_the_exit_reap_does_not_hang_on_a_wedged_engine(proxy, monkeypatch):
    """At interpreter exit every engine this process used is reaped; one that stopped answering must not hold
    the exit for the client's 300 s per call (it did: the suite's process lingered 5 minutes after its last
    test). The next start-up's reap catches what is left there."""
    import docker

    from jaxrl_term.sandbox import docker as sd

    proxy.wedge()
    wedged = docker.DockerClient(base_url=f"unix://{proxy.path}", timeout=300, version="1.24")
    monkeypatch.setattr(sd, "_own_engines", {f"unix://{proxy.path}": wedged})
    t0 = time.monotonic()
    sd._reap_own_all()  # never raises: best effort
    assert time.monotonic() - t0 < sd.EXIT_REAP_TIMEOUT_S + 10
    assert wedged.api.timeout == sd.EXIT_REAP_TIMEOUT_S
