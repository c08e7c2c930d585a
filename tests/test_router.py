"""The real ``sglang-router`` (PyPI ``sglang-router``, the Rust binary) in front of two ``jaxrl_term.serve``
processes on loopback, driven by the SGLang client: an episode's turns stay on one server (the server's own
``cached_tokens`` shows its prefix was reused), episodes spread over both, a weight sync reaches both servers
directly, and a killed server is routed around without losing an episode. One router and two servers serve
every test in this module; the last test kills one of them."""

import asyncio
import importlib.util
import json
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import need

from jaxrl_term.rollout.engine import SamplingParams
from jaxrl_term.rollout.launcher import ServerSpec, SGLangLauncher
from jaxrl_term.rollout.router import SGLangRouter, free_port
from jaxrl_term.rollout.sglang import SGLangEngine

VOCAB = 1024
SP = SamplingParams(temperature=1.0, max_new_tokens=6)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer_dir):
    from jaxrl_term.model.hf import save_pretrained
    from jaxrl_term.model.qwen3 import Qwen3Config, create_model

    arch = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    out = tmp_path_factory.mktemp("router_model") / "tiny"
    return save_pretrained(create_model(arch, seed=5), out, "float32", tokenizer_dir=tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    """(launcher of two servers, the router in front of them)."""
    need(importlib.util.find_spec("sglang_router") is not None,
         "sglang-router is not installed (pip install 'sglang-router>=0.3.2,<0.4', in the test extra)")
    logs = tmp_path_factory.mktemp("router_logs")
    lau = SGLangLauncher(str(model_dir), [ServerSpec(free_port()), ServerSpec(free_port())], python=sys.executable,
                         module="jaxrl_term.serve", host="127.0.0.1",
                         extra_args=["--context-length", "512", "--max-running-requests", "8"], log_dir=str(logs))
    router = SGLangRouter(lau.urls, python=sys.executable, health_check_interval_s=1, health_failure_threshold=2,
                          log_level="info", log_dir=str(logs))
    with pytest.MonkeyPatch.context() as mp:  # one compilation cache: a program one server compiled, the other loads
        mp.setenv("JAX_COMPILATION_CACHE_DIR", str(logs / "xla"))
        mp.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        mp.setenv("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
        lau.start()
    try:
        asyncio.run(lau.wait_ready(180))
        router.start()
        asyncio.run(router.wait_ready(60))
        yield lau, router
    finally:
        router.stop()
        lau.stop()


def engine(lau, router, **kw) -> SGLangEngine:
    # the router's URL, not the object: an engine given the object owns the router and stops it on close
    return SGLangEngine(lau.urls, router=router.url, max_retries=4, backoff_s=0.5, **kw)


async def generated(url: str) -> int:
    """Tokens the server has generated so far (its engine's own counter)."""
    async with httpx.AsyncClient(timeout=10) as c:
        return (await c.get(url + "/get_server_info")).json()["stats"]["generated"]


async def counters(urls) -> list[int]:
    return list(await asyncio.gather(*(generated(u) for u in urls)))


def first_prompt(e: int) -> list[int]:
    # episodes differ from their first token; as long as a later turn's new tokens (6 + 3): the same programs
    return [100 + e] + [(7 * e + 3 * k) % VOCAB for k in range(9)]


async def turn(c: SGLangEngine, ids: list[int], session: str):
    """One turn; the next turn's input (this one's, the output, an 'observation'), and the generation."""
    g = await c.generate(ids, SP, session=session)
    return ids + g.output_ids + [5, 6, 7], g


def test_an_episodes_turns_stay_on_one_server_and_episodes_spread_over_both(cluster):
    lau, router = cluster

    async def go():
        c = engine(lau, router)
        try:
            ids: dict[int, list[int]] = {}
            prompts, cached, served = ({e: [] for e in range(6)} for _ in range(3))
            # first turns two at a time (the router puts a new episode where fewer requests run, so each pair
            # splits); episode 0 alone first, so that one server compiles the programs the other then loads
            for group in ([0], [1, 2], [3, 4], [5]):
                firsts = await asyncio.gather(*(turn(c, first_prompt(k), f"spread-{k}") for k in group))
                for k, (nxt, _) in zip(group, firsts):
                    ids[k] = nxt
                    prompts[k].append(len(first_prompt(k)))
            after = await counters(lau.urls)
            for _ in range(2):  # then one request at a time, episodes interleaved: the counters say who served it
                for e in range(6):
                    before = after
                    prompts[e].append(len(ids[e]))
                    ids[e], g = await turn(c, ids[e], f"spread-{e}")
                    after = await counters(lau.urls)
                    served[e].append([k for k in range(2) if after[k] > before[k]])
                    cached[e].append(g.cached_tokens)
            return prompts, cached, served
        finally:
            await c.aclose()

    prompts, cached, served = asyncio.run(go())
    for e in range(6):
        assert served[e] in ([[0]] * 2, [[1]] * 2), f"episode {e}'s turns 2-3 were served by {served[e]}"
        # the server also held the episode's whole previous input in its prefix cache, the first turn's included
        assert all(c >= p for c, p in zip(cached[e], prompts[e])), (e, cached[e], prompts[e])
    assert {served[e][0][0] for e in range(6)} == {0, 1}, f"every episode went to one server: {served}"


def test_a_weight_sync_through_the_engine_reaches_both_servers(cluster, model_dir):
    lau, router = cluster

    async def go():
        c = engine(lau, router)
        try:
            await c.update_weights(model_dir, 5)  # pause -> update -> continue on each worker, not the router
            infos = [await c.model_info(i) for i in range(len(lau.urls))]
            g = await c.generate(first_prompt(50), SP, session="after-sync")
            # a long pause (a big model loading its weights) must not take the servers out of the router's pool:
            # its probe is /v1/models, which answers while paused (SGLang's /health does not)
            for u in lau.urls:
                await c.client.post(u + "/pause_generation", json={"mode": "abort"})
            await asyncio.sleep(2.5)  # more than health_failure_threshold (2) probes, 1 s apart
            workers = (await c.client.get(router.url + "/workers")).json()["workers"]
            for u in lau.urls:
                await c.client.post(u + "/continue_generation", json={})
            return infos, g, [w["is_healthy"] for w in workers]
        finally:
            await c.aclose()

    infos, g, healthy = asyncio.run(go())
    assert [i["weight_version"] for i in infos] == ["5", "5"]
    assert g.weight_version == 5 and len(g.output_ids) > 0
    assert healthy == [True, True]


def test_a_killed_server_is_routed_around_and_no_episode_is_lost(cluster):
    lau, router = cluster

    async def go():
        c = engine(lau, router)
        try:
            state, home = {}, {}
            for e in range(4):  # one turn each, one at a time: the servers' counters say where each episode is
                before = await counters(lau.urls)
                state[e], _ = await turn(c, first_prompt(20 + e), f"kill-{e}")
                after = await counters(lau.urls)
                home[e] = [k for k in range(2) if after[k] > before[k]]
            victim = home[0][0]
            survivor = 1 - victim
            os.killpg(lau.procs[victim].pid, signal.SIGKILL)
            lau.procs[victim].wait()
            t0 = time.monotonic()
            before = await generated(lau.urls[survivor])
            out, took = {e: ([], []) for e in range(4)}, []
            for _ in range(2):  # every episode goes on, one turn at a time
                for e in range(4):
                    t = time.monotonic()
                    out[e][0].append(len(state[e]))
                    state[e], g = await turn(c, state[e], f"kill-{e}")
                    out[e][1].append(g)
                    took.append(time.monotonic() - t)
            elapsed = time.monotonic() - t0
            made = await generated(lau.urls[survivor]) - before
            async with httpx.AsyncClient(timeout=10) as h:
                for _ in range(40):  # the router's probe: 2 failures 1 s apart
                    workers = {w["url"]: w["is_healthy"] for w in (await h.get(router.url + "/workers")).json()
                               ["workers"]}
                    if not workers[lau.urls[victim]]:
                        break
                    await asyncio.sleep(0.25)
            return home, victim, out, took, elapsed, made, workers
        finally:
            await c.aclose()

    home, victim, out, took, elapsed, made, workers = asyncio.run(go())
    assert all(len(h) == 1 for h in home.values()), home
    assert max(took) < 15 and elapsed < 30, f"turns after the kill took {[round(t, 1) for t in took]} s"
    assert made == sum(len(g.output_ids) for _, gens in out.values() for g in gens)  # all of it on the survivor
    for prompts, gens in out.values():
        assert gens[1].cached_tokens >= prompts[0]  # a moved episode stays on its new server
    assert workers[lau.urls[victim]] is False and workers[lau.urls[1 - victim]] is True


def test_only_single_generates_go_through_the_router_and_the_rest_to_every_server():
    """The client's side, without processes: what goes to the router, and what to each worker."""
    one = json.loads((Path(__file__).parent / "fixtures" / "sglang" / "length.json").read_text())
    seen: list[tuple[str, str, str | None]] = []
    asked: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.host, request.url.path, request.headers.get("x-smg-routing-key")))
        if request.url.path == "/get_server_info":
            ctx = {"a": 4096, "b": 2048}[request.url.host]
            return httpx.Response(200, json={"context_length": ctx, "max_req_input_len": ctx - 6})
        if request.url.path == "/generate":
            body = json.loads(request.content)
            if isinstance(body["input_ids"][0], list):
                return httpx.Response(200, json=[one] * len(body["input_ids"]))
            asked.append(body["sampling_params"]["max_new_tokens"])
            return httpx.Response(200, json=one)
        if request.url.path == "/update_weights_from_disk":
            return httpx.Response(200, json={"success": True})
        if request.url.path == "/model_info":
            return httpx.Response(200, json={"weight_version": "2"})
        return httpx.Response(200, json={})

    async def go():
        c = SGLangEngine(["http://a:1", "http://b:1"], router="http://r:9", transport=httpx.MockTransport(handler))
        try:
            g = await c.generate([1, 2, 3], SamplingParams(max_new_tokens=4000), session="ep-7")
            n_single = len(seen)
            await c.generate_batch([[1], [2]], SamplingParams(max_new_tokens=4))
            n_batch = len(seen)
            await c.update_weights("/w", 2)
            return g, n_single, n_batch
        finally:
            await c.aclose()

    g, n_single, n_batch = asyncio.run(go())
    assert g.finish_reason == "length"
    # limits from every worker (the tightest wins), the turn through the router with the episode as its key
    assert sorted(seen[:2]) == [("a", "/get_server_info", None), ("b", "/get_server_info", None)]
    assert seen[2:n_single] == [("r", "/generate", "ep-7")] and asked == [2048 - 3 - 2]
    assert [(h, p) for h, p, _ in seen[n_single:n_batch]] in ([("a", "/generate")], [("b", "/generate")])
    sync = {(h, p) for h, p, _ in seen[n_batch:]}
    for path in ("/pause_generation", "/update_weights_from_disk", "/continue_generation", "/model_info"):
        assert {("a", path), ("b", path)} <= sync
    assert not any(h == "r" for h, _, _ in seen[n_batch:])


def test_auto_routes_through_a_router_only_with_several_servers(monkeypatch, tmp_path):
    from omegaconf import OmegaConf

    from jaxrl_term.config import SGLangCfg
    from jaxrl_term.rollout import setup

    started = []
    monkeypatch.setattr(SGLangRouter, "start", lambda self: started.append(self.command()) or self.url)

    def router(urls, **sglang):
        cfg = OmegaConf.create({"run_dir": str(tmp_path), "rollout": {"sglang": OmegaConf.structured(SGLangCfg)}})
        cfg.rollout.sglang.merge_with(sglang)
        return setup.make_router(cfg, urls)

    one, two = ["http://a:1"], ["http://a:1", "http://b:1"]
    assert router(one) is None and router(two, router="false") is None and not started
    r = router(two)  # auto, two servers: a router is started in front of both
    assert isinstance(r, SGLangRouter) and r.worker_urls == two and len(started) == 1
    cmd = started[0]
    assert cmd[cmd.index("--policy") + 1] == "manual" and cmd[cmd.index("--health-check-endpoint") + 1] == "/v1/models"
    assert isinstance(router(one, router="true"), SGLangRouter)
    assert router(two, router_url="http://r:9") == "http://r:9" and len(started) == 2
