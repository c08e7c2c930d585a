"""SGLang's memory-saver state machine: ``jaxrl_term.serve`` dies where SGLang's scheduler dies (a resume of a tag
not released, a second release, a release while busy, a forward pass on released memory), and the trainer's
release / resume / update cycle (``rollout/memory.py``) leaves every server serving at the right weight version
after a fresh start, a resume from a checkpoint, a restart of one server and a SIGKILLed trainer, in every
colocation mode. The state machine runs in-process on a stub engine (``on_death`` records what would have killed
the server), one real process shows the death itself, and the cycle runs against real server processes. SGLang's
rules, with the source they come from: ``jaxrl_term/serve.py`` and ``jaxrl_term/rollout/memory.py``."""

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from helpers import free_port, hf_checkpoint
from jaxrl_term.rollout.engine import EngineError, Generation
from jaxrl_term.rollout.memory import MARK, MemoryState, WeightCycle
from jaxrl_term.rollout.sglang import SGLangEngine
from jaxrl_term.serve import Rules, create_app, parse_version

REPO = Path(__file__).resolve().parents[1]
VOCAB = 1024
ARGS = ["--context-length", "256", "--max-running-requests", "4"]


class Server:
    """One ``jaxrl_term.serve`` process that can be killed and started again on the same port."""

    def __init__(self, model_dir: Path, logs: Path, env: dict, name: str, *extra: str):
        self.cmd = [sys.executable, "-m", "jaxrl_term.serve", "--model-dir", str(model_dir), *ARGS, *extra]
        self.port, self.env, self.log = free_port(), env, logs / f"{name}.log"
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Server":
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([*self.cmd, "--port", str(self.port)], cwd=REPO, env=self.env, stdout=out,
                                         stderr=subprocess.STDOUT)
        return self

    def wait_up(self, timeout_s: float = 180) -> None:
        """Until ``/model_info`` answers (never ``/health_generate``: it generates)."""
        t_end = time.monotonic() + timeout_s
        while time.monotonic() < t_end:
            assert self.proc.poll() is None, f"{self.url} exited: {self.log.read_text()[-2000:]}"
            try:
                if httpx.get(self.url + "/model_info", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"{self.url} did not come up: {self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def post(self, path: str, body: dict | None = None, timeout: float = 30) -> httpx.Response:
        return httpx.post(self.url + path, json=body if body is not None else {}, timeout=timeout)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("memstate_model")
    hf_checkpoint(d, vocab_size=VOCAB)
    return d


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    """Started together (they boot in parallel): a pair for the trainer's cycle and one to die, with
    ``--enable-memory-saver`` as the launcher starts them for ``time_share``."""
    logs = tmp_path_factory.mktemp("memstate_logs")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(logs / "xla"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    env.pop("XLA_FLAGS", None)  # one CPU device per server
    saver = "--enable-memory-saver"
    named = {name: Server(model_dir, logs, env, name, saver, "--weight-version", "0") for name in ("a", "b", "victim")}
    try:
        for s in named.values():
            s.start()
        for s in named.values():
            s.wait_up()
        yield named
    finally:
        for s in named.values():
            s.kill()


def run(coro):
    return asyncio.run(coro)


# ------------------------------------------------------------------------------ serve: SGLang's state machine


class StubEngine:
    """What serve's handlers ask of an engine, for the state machine alone; ``busy`` requests hold slots."""

    cfg = SimpleNamespace(max_seq_len=256, max_batch=4)

    def __init__(self):
        self.weight_version, self.busy, self.pending_update, self.stats = 0, 0, False, {}
        self.slot_cache: list[list] = [[] for _ in range(4)]

    def request_counts(self):
        return self.busy, 0

    async def generate(self, ids, sampling):
        return Generation([7] * sampling.max_new_tokens, [-1.0] * sampling.max_new_tokens, "length",
                          self.weight_version)

    async def update_weights(self, path, version):
        self.weight_version = version

    async def health(self):
        return True

    def abort_all(self):
        pass

    def resume(self):
        pass


def serve_app(version: str | None = None, memory_saver: bool = True):
    """An in-process ``jaxrl_term.serve`` app; ``died`` collects what would have killed it."""
    died: list[str] = []
    engine = StubEngine()
    app = create_app(engine, rules=Rules(parse_version(version)), flags={"enable_memory_saver": memory_saver},
                     on_death=died.append)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://serve"), engine, died


GEN = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}


def test_a_resume_of_tags_never_released_kills_the_server_and_harmless_calls_do_not():
    async def go():
        c, _, died = serve_app()
        async with c:
            harmless = [await c.post("/release_memory_occupation", json={"tags": ["gpu"]}),  # any string: tracked
                        await c.post("/resume_memory_occupation", json={"tags": ["gpu"]}),
                        await c.post("/continue_generation", json={}),  # not paused: a no-op
                        await c.post("/release_memory_occupation", json={"tags": ["kv_cache"]}),
                        await c.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}),
                        await c.post("/generate", json=GEN)]
            assert [r.status_code for r in harmless] == [200] * 6 and harmless[0].json() is None and not died
            # issue 43: a freshly launched server, resumed as the old client did on every restart
            r = await c.post("/resume_memory_occupation", json={"tags": ["weights", "kv_cache", "cuda_graph"]})
            return r.status_code, died

    code, died = run(go())
    assert code == 500 and len(died) == 1 and died[0].startswith("KeyError: 'weights'")


@pytest.mark.parametrize("memory_saver", [True, False])
def test_a_second_release_of_a_tag_kills_a_server_with_the_memory_saver(memory_saver):
    async def go():
        c, _, died = serve_app(memory_saver=memory_saver)
        async with c:
            codes = [(await c.post("/release_memory_occupation", json={"tags": tags})).status_code
                     for tags in (["kv_cache"], ["weights"], [])]  # [] = every tag: kv_cache again
            return codes, died

    codes, died = run(go())
    if memory_saver:  # torch_memory_saver exits on a region that is paused already
        assert codes == [200, 200, 500] and "Cannot pause allocation that is not active. tag=kv_cache" in died[0]
    else:  # nothing is unmapped: SGLang's no-op adapter
        assert codes == [200, 200, 200] and not died


@pytest.mark.parametrize("version,memory_saver,dies", [
    (None, False, "AssertionError: release_memory_occupation should be called only when server is idle."),
    ("0.5.6", False, "AssertionError: release_memory_occupation should be called only when no ongoing request."),
    ("0.5.4", True, "illegal memory access"),  # no assertion yet: the running requests hit freed memory
    ("0.5.4", False, None)])
def test_a_release_while_a_request_runs_kills_the_server(version, memory_saver, dies):
    async def go():
        c, engine, died = serve_app(version, memory_saver)
        engine.busy = 1
        async with c:
            return (await c.post("/release_memory_occupation", json={"tags": None})).status_code, died

    code, died = run(go())
    if dies is None:
        assert (code, died) == (200, [])
    else:
        assert code == 500 and len(died) == 1 and dies in died[0]


@pytest.mark.parametrize("version,memory_saver,health,dies", [
    (None, True, None, True), ("0.5.9", True, 503, True), (None, False, 200, False), ("0.5.9", False, 503, False)])
def test_a_forward_pass_on_released_memory_kills_the_server(version, memory_saver, health, dies):
    """/generate and (from 0.5.10, a real generation) /health_generate while released; up to 0.5.9 the scheduler
    skips the health probe while anything is released and it times out (503)."""
    async def go():
        c, _, died = serve_app(version, memory_saver)
        async with c:
            await c.post("/release_memory_occupation", json={})
            probe = (await c.get("/health_generate")).status_code
            n = len(died)
            gen = (await c.post("/generate", json=GEN)).status_code
            update = (await c.post("/update_weights_from_disk", json={"model_path": "/"})).status_code
            return probe, n, gen, update, died

    probe, died_by_probe, gen, update, died = run(go())
    assert probe == (500 if health is None else health) and died_by_probe == (1 if health is None else 0)
    assert (gen, update) == ((500, 500) if dies else (200, 200))
    assert all("illegal memory access" in d for d in died) and len(died) == (2 + (health is None) if dies else 0)


def test_update_weight_version_sets_what_model_info_reports_from_0_5_2():
    async def go():
        out = []
        for version in (None, "0.5.1"):
            c, _, _ = serve_app(version)
            async with c:
                r = await c.post("/update_weight_version", json={"new_version": "7|x", "abort_all_requests": False})
                out.append((r.status_code, (await c.get("/get_model_info")).json().get("weight_version")))
        return out

    assert run(go()) == [(200, "7|x"), (404, "0")]


def test_a_real_server_dies_as_sglang_does(servers):
    """The process exits by SIGKILL (SGLang's parent kills its process tree), the call's connection drops, and
    nothing answers afterwards."""
    s = servers["victim"]
    with pytest.raises(httpx.TransportError):
        s.post("/resume_memory_occupation", {"tags": None})
    assert s.proc.wait(timeout=20) == -signal.SIGKILL
    log = s.log.read_text()
    assert "Scheduler hit an exception: KeyError: 'kv_cache'" in log, log[-2000:]
    with pytest.raises(httpx.ConnectError):
        httpx.get(s.url + "/model_info", timeout=2)


# ------------------------------------------------------------------------------ the client's memory state


def test_memory_state_round_trips_through_the_weight_version_string():
    for st in (MemoryState("7"), MemoryState("default", "released", ("weights", "kv_cache")),
               MemoryState("3|x", "resuming", ("cuda_graph",)), MemoryState("3", "resumed")):
        assert MemoryState.parse(st.marker()) == st
    assert MemoryState.parse(None) == MemoryState(None) and MemoryState.parse(12).version == "12"
    assert MemoryState("1", "released", ("weights",)).released == ("weights",)
    assert MemoryState("1", "resumed").released == ()


def check_serving(servers_, version: int) -> None:
    """Every server alive, at ``version``, and generating (tokens stamped with that version)."""
    for s in servers_:
        assert s.proc.poll() is None, f"{s.url} died: {s.log.read_text()[-2000:]}"
        assert httpx.get(s.url + "/model_info", timeout=10).json()["weight_version"] == str(version)
        r = s.post("/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 3, r.text
        assert r.json()["meta_info"]["weight_version"] == str(version)


KILLED_TRAINER = textwrap.dedent("""
    import asyncio, sys
    from jaxrl_term.rollout.memory import WeightCycle
    from jaxrl_term.rollout.sglang import SGLangEngine

    async def main(urls, mode, model):
        engine = SGLangEngine(urls.split(","), weight_version=0)
        cycle = WeightCycle(engine, time_share=mode == "time_share")
        await cycle.attach(60)
        await cycle.release()
        if mode == "time_share":
            print("released", flush=True)
            await asyncio.sleep(3600)
        post = engine.client.post

        async def stall(url, *a, **k):  # killed inside the update: the servers are paused
            if url.endswith("/update_weights_from_disk"):
                print("paused", flush=True)
                await asyncio.sleep(3600)
            return await post(url, *a, **k)

        engine.client.post = stall
        await cycle.load(model, 99)

    asyncio.run(main(*sys.argv[1:]))
""")


@pytest.mark.parametrize("mode", ["time_share", "static", "none"])
def test_every_server_serves_the_right_version_after_resume_restart_and_a_killed_trainer(servers, model_dir, mode):
    pair = [servers["a"], servers["b"]]
    urls = [s.url for s in pair]
    time_share = mode == "time_share"
    v = {"time_share": 100, "static": 200, "none": 300}[mode]

    async def trainer(first_load: int | None, steps: list[int], between=None):
        """A trainer's life: attach; on a resume, load the checkpoint's weights first; then per step release,
        (the update; ``between`` runs here), load."""
        engine = SGLangEngine(urls, weight_version=0)
        cycle = WeightCycle(engine, time_share=time_share)
        try:
            await cycle.attach(60)
            if first_load is not None:
                await cycle.load(model_dir, first_load)
            for step in steps:
                await cycle.release()
                if time_share:
                    assert MARK + "released" in (await engine.model_info(0))["weight_version"]
                if between is not None:
                    await asyncio.to_thread(between)
                await cycle.load(model_dir, step)
        finally:
            await engine.aclose()

    run(trainer(None, [v + 1]))  # a fresh start
    check_serving(pair, v + 1)
    run(trainer(v + 2, [v + 3]))  # a resume from a checkpoint: nothing released, load first
    check_serving(pair, v + 3)

    def restart_b():  # one server restarts mid-cycle: it comes back fresh at its launch version
        pair[1].kill()
        pair[1].start().wait_up()
        assert httpx.get(pair[1].url + "/model_info").json()["weight_version"] == "0"

    run(trainer(None, [v + 4], between=restart_b))
    check_serving(pair, v + 4)

    # a trainer SIGKILLed after its release (time_share) or inside an update (paused); a new one attaches
    proc = subprocess.Popen([sys.executable, "-c", KILLED_TRAINER, ",".join(urls), mode, str(model_dir)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == ("released" if time_share else "paused")
        if not time_share:
            assert proc.stdout.readline().strip() == "paused"  # both servers
    finally:
        proc.kill()
        proc.wait()
    left = httpx.get(urls[0] + "/model_info").json()["weight_version"]
    assert (MARK + "released:weights,kv_cache,cuda_graph" in left) if time_share else left == str(v + 4)
    run(trainer(v + 5, [v + 6]))
    check_serving(pair, v + 6)


def test_a_client_killed_inside_a_release_leaves_a_state_no_client_guesses_at(servers, model_dir):
    a = servers["a"]
    in_doubt = MemoryState("5", "releasing", ("weights",)).marker()
    assert a.post("/update_weight_version", {"new_version": in_doubt, "abort_all_requests": False}).status_code == 200

    async def go():
        engine = SGLangEngine([a.url])
        try:
            for call in (engine.release_memory(), engine.resume_memory(), WeightCycle(engine, time_share=True)
                         .attach(10)):
                with pytest.raises(EngineError, match=f"{a.url}.*restart this server"):
                    await call
            await engine.update_weights(model_dir, 7)  # it was never released in fact: an update clears it
        finally:
            await engine.aclose()

    run(go())
    check_serving([a], 7)
