"""SGLang's rules, enforced by ``jaxrl_term.serve`` and honoured by the SGLang client and launcher: the context
limit, pause modes around weight updates, model-info fallbacks, memory release, health while paused, and
servers that die with the trainer. Each test fails on a client or server that breaks the rule."""

import asyncio
import ipaddress
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from flax import nnx

from helpers import free_port, hf_checkpoint
from jaxrl_term.model.hf import load_pretrained, save_pretrained
from jaxrl_term.rollout.engine import SamplingParams
from jaxrl_term.rollout.sglang import SGLangEngine, SGLangLauncher, ServerLimits, ServerSpec, default_advertise_host

REPO = Path(__file__).resolve().parents[1]
VOCAB = 1024
CONTEXT = 512
LONG = SamplingParams(temperature=0, max_new_tokens=480)  # ~1 s of decoding: long enough to pause mid-way


def run(coro):
    return asyncio.run(coro)


def prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.RandomState(seed).randint(0, VOCAB, n).tolist()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer_dir):
    d = tmp_path_factory.mktemp("fidelity_model")
    hf_checkpoint(d, rope_theta=10_000.0, vocab_size=VOCAB)
    for f in tiny_tokenizer_dir.iterdir():
        shutil.copy(f, d / f.name)
    return d


@pytest.fixture(scope="module")
def new_weights(model_dir, tmp_path_factory):
    """The same model with its lm_head negated: greedy outputs differ from the original's."""
    model = load_pretrained(model_dir)
    params = nnx.state(model)
    params["lm_head"].set_value(params["lm_head"][...] * -1.0)
    nnx.update(model, params)
    out = tmp_path_factory.mktemp("fidelity_v2")
    save_pretrained(model, out, dtype="float32")
    return out


@pytest.fixture(scope="module")
def orphan(model_dir, tmp_path_factory):
    """A parent process (with SGLANG_RETURN_ORIGINAL_LOGPROB set) that launched a server; ``servers`` starts it
    first so it boots alongside them (its test runs last). Yields (parent, server pid, url)."""
    port = free_port()
    script = textwrap.dedent(f"""
        import sys, time
        from jaxrl_term.rollout.sglang import SGLangLauncher, ServerSpec
        lau = SGLangLauncher({str(model_dir)!r}, [ServerSpec({port})], python=sys.executable,
                             module="jaxrl_term.serve", host="127.0.0.1", extra_args=["--context-length", "256"],
                             log_dir={str(tmp_path_factory.mktemp("orphan_logs"))!r})
        lau.start()
        print(lau.procs[0].pid, flush=True)
        time.sleep(600)
    """)
    env = dict(os.environ, SGLANG_RETURN_ORIGINAL_LOGPROB="1", RETURN_ORIGINAL_LOGPROB="1")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
    line = parent.stdout.readline().strip()
    assert line.isdigit(), f"the launching parent failed (exit code {parent.poll()})"
    server_pid = int(line)
    yield parent, server_pid, f"http://127.0.0.1:{port}"
    for pid, kill in ((parent.pid, os.kill), (server_pid, os.killpg)):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    parent.wait()


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory, orphan):
    """Two servers launched with the launcher's defaults (0.0.0.0, advertised URL): a current one and one that
    behaves as SGLang 0.5.5 (no /model_info)."""
    logs = str(tmp_path_factory.mktemp("fidelity_logs"))
    args = ["--max-running-requests", "8", "--context-length", str(CONTEXT)]
    now = SGLangLauncher(str(model_dir), [ServerSpec(free_port())], python=sys.executable,
                         module="jaxrl_term.serve", extra_args=args, log_dir=logs)
    old = SGLangLauncher(str(model_dir), [ServerSpec(free_port())], python=sys.executable, module="jaxrl_term.serve",
                         extra_args=args + ["--emulate-sglang-version", "0.5.5"], log_dir=logs)
    try:
        for lau in (now, old):
            lau.start()

        async def ready():
            await asyncio.gather(now.wait_ready(180), old.wait_ready(180))

        run(ready())
        for url, version in ((now.urls[0], "jaxrl_term"), (old.urls[0], "jaxrl_term (sglang 0.5.5)")):
            info = httpx.get(url + "/get_server_info", timeout=10).json()
            assert (info["version"], info["model_path"]) == (version, str(model_dir)), f"{url} is not our server"
        yield now.urls[0], old.urls[0]
    finally:
        now.stop(timeout_s=5)
        old.stop(timeout_s=5)


async def wait_running(c: SGLangEngine, url: str, n: int = 1) -> None:
    """Until ``n`` requests hold a slot on the server (so a pause catches them mid-generation)."""
    for _ in range(2000):
        info = (await c.client.get(url + "/get_server_info")).json()
        if info["internal_states"][0]["running"] >= n:
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the request never started running")


# ------------------------------------------------------------------------------------------------ launcher


def test_launcher_binds_all_interfaces_advertises_this_node_and_pins_log_prob_semantics(monkeypatch):
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    monkeypatch.setenv("RETURN_ORIGINAL_LOGPROB", "1")
    lau = SGLangLauncher("/m", [ServerSpec(30000, gpus="0")], weight_version=7)
    cmd = lau.command(lau.servers[0])
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0" and "--enable-fp32-lm-head" not in cmd
    assert cmd[cmd.index("--weight-version") + 1] == "7"
    assert lau.advertise_host == default_advertise_host() and lau.urls == [f"http://{lau.advertise_host}:30000"]
    try:
        assert not ipaddress.ip_address(lau.advertise_host).is_loopback
    except ValueError:  # a name, not an address
        assert lau.advertise_host not in ("localhost", "0.0.0.0")
    env = lau.env(lau.servers[0])
    assert "SGLANG_RETURN_ORIGINAL_LOGPROB" not in env and "RETURN_ORIGINAL_LOGPROB" not in env
    assert env["CUDA_VISIBLE_DEVICES"] == "0"
    asked = SGLangLauncher("/m", [ServerSpec(1)], host="127.0.0.1", fp32_lm_head=True, memory_saver=True)
    cmd = asked.command(asked.servers[0])
    assert {"--enable-fp32-lm-head", "--enable-memory-saver"} <= set(cmd) and asked.urls == ["http://127.0.0.1:1"]
    assert SGLangLauncher("/m", [ServerSpec(1)], advertise_host="node7").urls == ["http://node7:1"]


# ------------------------------------------------------------------------------------------ context limit


def test_max_new_tokens_near_the_context_limit_never_gets_a_400(servers):
    url, _ = servers

    async def go():
        async with httpx.AsyncClient(timeout=60) as h:
            async def raw(n, max_new=None):
                sp = {"temperature": 0} if max_new is None else {"temperature": 0, "max_new_tokens": max_new}
                r = await h.post(url + "/generate", json={"input_ids": prompt(n), "sampling_params": sp})
                return r.status_code, r.json()

            # the server enforces SGLang's three checks (tokenizer manager, then scheduler)
            code, body = await raw(CONTEXT)
            assert code == 400 and "is longer than the model's context length (512 tokens)" in body["error"]["message"]
            code, body = await raw(CONTEXT - 20, 20)
            assert code == 400 and "Requested token count exceeds" in body["error"]["message"]
            code, body = await raw(CONTEXT - 6)
            assert code == 400 and "exceeds the maximum allowed length (506 tokens)" in body["error"]["message"]
        learned, told = SGLangEngine([url]), SGLangEngine([url], context_length=CONTEXT)
        try:
            assert await learned.limits() == ServerLimits(CONTEXT, CONTEXT - 6) == await told.limits()
            sp = SamplingParams(temperature=0, max_new_tokens=64)
            near = await learned.generate(prompt(CONTEXT - 10, 1), sp)
            full = await told.generate(prompt(CONTEXT - 5, 2), sp)
            return near, full
        finally:
            await learned.aclose()
            await told.aclose()

    near, full = run(go())
    assert near.finish_reason == "length" and len(near.output_ids) == 8  # context - input - 2: all SGLang keeps
    assert full.finish_reason == "length" and full.output_ids == [] and full.prompt_tokens == CONTEXT - 5


# ------------------------------------------------------------------------------------- weight-sync modes


def test_flush_during_an_in_place_pause_is_rejected_and_the_in_place_client_does_not_flush(servers, model_dir,
                                                                                          new_weights):
    url, _ = servers
    p = prompt(10, 3)

    async def go():
        c = SGLangEngine([url], pause_mode="in_place")
        try:
            # SGLang 0.5.22+: 400, weights loaded, cache kept, version unchanged (<= 0.5.20: the server dies)
            gen = asyncio.create_task(c.generate(p, LONG))
            await wait_running(c, url)
            await c.client.post(url + "/pause_generation", json={"mode": "in_place"})
            r = await c.client.post(url + "/update_weights_from_disk", json={
                "model_path": str(new_weights), "weight_version": "10"})
            info = await c.model_info()
            await c.client.post(url + "/continue_generation", json={})
            first = await gen
            assert r.status_code == 400 and "cache was not flushed" in r.json()["message"]
            assert not r.json()["success"] and info["weight_version"] != "10"
            assert first.output_ids and c.aborts_retried == 0  # held, then finished (on mixed weights: any length)
            # the client's in_place sync sends flush_cache=false: it succeeds with a request held in place,
            # which then finishes on the new weights without being aborted
            await c.update_weights(model_dir, 11)
            gen = asyncio.create_task(c.generate(p, LONG))
            await wait_running(c, url)
            await c.update_weights(new_weights, 12)
            held = await gen
            await c.update_weights(model_dir, 13)
            return held, c.aborts_retried
        finally:
            await c.aclose()

    held, aborts = run(go())
    # finished after the update, never aborted; the server reports version 12 at output time, and the client tags
    # the turn with the older version it was submitted under (its tokens came from both): 11
    assert held.output_ids and held.weight_version == 11 and aborts == 0


def test_abort_sync_retries_the_inflight_turn_entirely_on_the_new_weights(servers, model_dir, new_weights):
    url, _ = servers
    p = prompt(12, 4)

    async def go():
        c = SGLangEngine([url])  # pause_mode="abort"
        try:
            gen = asyncio.create_task(c.generate(p, LONG, session="ep"))
            await wait_running(c, url)
            await c.update_weights(new_weights, 21)
            retried = await gen
            fresh = await c.generate(p, LONG)
            await c.update_weights(model_dir, 22)
            old = await c.generate(p, LONG)
            return retried, fresh, old, c.aborts_retried
        finally:
            await c.aclose()

    retried, fresh, old, aborts = run(go())
    assert aborts == 1 and retried.weight_version == 21 and retried.finish_reason == "length"
    assert retried.output_ids == fresh.output_ids != old.output_ids


def test_an_update_while_not_paused_waits_for_running_requests(servers, model_dir, new_weights):
    url, _ = servers

    async def go():
        c = SGLangEngine([url])
        try:
            gen = asyncio.create_task(c.generate(prompt(11, 7), LONG))
            await wait_running(c, url)
            r = await c.client.post(url + "/update_weights_from_disk", json={
                "model_path": str(new_weights), "weight_version": "51"})  # no pause: SGLang's writer lock
            running = (await c.client.get(url + "/get_server_info")).json()["internal_states"][0]["running"]
            info = await c.model_info()
            after = await c.generate(prompt(5, 8), SamplingParams(temperature=0, max_new_tokens=2))
            first = await gen
            await c.update_weights(model_dir, 52)
            return r.status_code, running, info, after, first
        finally:
            await c.aclose()

    code, running, info, after, first = run(go())
    assert code == 200 and running == 0 and info["weight_version"] == "51" and after.weight_version == 51
    assert first.weight_version != 51 and len(first.output_ids) == LONG.max_new_tokens  # finished on the old weights


def test_retract_pause_recomputes_held_requests_after_continue(servers):
    url, _ = servers
    p = prompt(9, 5)

    async def go():
        c = SGLangEngine([url])
        try:
            whole = await c.generate(p, LONG)
            gen = asyncio.create_task(c.generate(p, LONG))
            await wait_running(c, url)
            await c.client.post(url + "/pause_generation", json={"mode": "retract"})
            info = (await c.client.get(url + "/get_server_info")).json()["internal_states"][0]
            await asyncio.sleep(0.2)
            await c.client.post(url + "/continue_generation", json={})
            return whole, await gen, info
        finally:
            await c.aclose()

    whole, resumed, info = run(go())
    assert info == {"running": 0, "waiting": 1}  # retracted: no slot, back in the queue
    assert resumed.output_ids == whole.output_ids  # recomputed from prompt + output so far, same greedy tokens


def test_model_info_falls_back_to_get_model_info_on_servers_before_0_5_6(servers, model_dir):
    _, old_url = servers

    async def go():
        c = SGLangEngine([old_url])
        try:
            missing = (await c.client.get(old_url + "/model_info")).status_code
            await c.update_weights(model_dir, 41)  # verified through /get_model_info
            return missing, await c.model_info(), c._info_path[0]
        finally:
            await c.aclose()

    missing, info, path = run(go())
    assert missing == 404 and info["weight_version"] == "41" and path == "/get_model_info"


# --------------------------------------------------------------------------------- memory saver, health


def test_release_and_resume_memory_round_trip(servers):
    """Released tags show in the server's weight_version and only those are resumed (the state machine and the
    calls that kill a server: tests/test_memory_state.py)."""
    url, _ = servers
    p = prompt(8, 6)

    async def go():
        c = SGLangEngine([url])
        try:
            await c.release_memory(("weights", "kv_cache"))
            released = (await c.model_info())["weight_version"]
            await c.release_memory(("weights",))  # released already: not sent again
            await c.resume_memory()
            with pytest.raises(ValueError, match="tags"):
                await c.release_memory(("gpu",))
            after = await c.generate(p, SamplingParams(temperature=0, max_new_tokens=4))
            return released, (await c.model_info())["weight_version"], after
        finally:
            await c.aclose()

    released, resumed, after = run(go())
    assert released.endswith("|jaxrl-memory:released:weights,kv_cache") and resumed.endswith(":resumed:")
    assert len(after.output_ids) == 4


def test_health_is_503_while_paused(servers):
    url, _ = servers

    async def go():
        c = SGLangEngine([url])
        try:
            await c.client.post(url + "/pause_generation", json={"mode": "in_place"})
            t0 = time.monotonic()
            paused = [(await c.client.get(url + path)).status_code for path in ("/health", "/health_generate")]
            took = time.monotonic() - t0
            healthy_while_paused = await c.health()
            await c.client.post(url + "/continue_generation", json={})
            resumed = [(await c.client.get(url + path)).status_code for path in ("/health", "/health_generate")]
            return paused, took, healthy_while_paused, resumed, await c.health()
        finally:
            await c.aclose()

    paused, took, healthy_while_paused, resumed, healthy = run(go())
    assert paused == [503, 503] and took < 5
    # the client's health() is liveness without a generation (a released server dies on one): up while paused
    assert healthy_while_paused
    assert resumed == [200, 200] and healthy


# ------------------------------------------------------------------------------- servers die with us


def test_server_dies_when_the_process_that_launched_it_is_killed(orphan):
    parent, server_pid, url = orphan
    t_end = time.monotonic() + 120
    while True:
        try:
            if httpx.get(url + "/health_generate", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < t_end and parent.poll() is None, "the orphan server never came up"
        time.sleep(0.2)
    environ = Path(f"/proc/{server_pid}/environ").read_bytes().split(b"\0")
    assert not any(e.startswith((b"SGLANG_RETURN_ORIGINAL_LOGPROB=", b"RETURN_ORIGINAL_LOGPROB=")) for e in environ)
    os.kill(parent.pid, signal.SIGKILL)  # no cleanup code runs in the parent
    parent.wait()
    t_end = time.monotonic() + 10
    while time.monotonic() < t_end:
        try:
            httpx.get(url + "/health", timeout=1)
        except httpx.HTTPError:
            return
        time.sleep(0.1)
    raise AssertionError("the server still answers 10 s after its parent was SIGKILLed")
