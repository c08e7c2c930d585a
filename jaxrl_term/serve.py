"""The embedded JAX engine behind SGLang's HTTP contract, rules included.

``python -m jaxrl_term.serve --model-dir DIR [--port P]`` (SGLang's flag names are accepted too:
``--model-path``, ``--context-length``, ``--max-running-requests``, ``--weight-version``,
``--enable-deterministic-inference``; GPU-only ones are accepted and ignored), so the SGLang client, the
launcher and SGLang tooling work against it. Responses have SGLang 0.5's shapes. ``/v1/chat/completions``
(OpenAI style, through the chat template) lets it serve as a local LLM judge.

The point of this server is that our tests catch client bugs that only a real SGLang would show, so it enforces
SGLang's rules (as read in the released SGLang source, 0.4.6 to 0.5.23):

* ``/generate`` (``TokenizerManager._validate_one_request`` and the scheduler's ``validate_input_length``):
  400 if the input has ``>= context`` tokens, if ``input + max_new_tokens >= context`` (SGLang <= 0.5.10; ``>``
  from 0.5.12), or if the input has ``>= max_req_input_len = min(context - 1, pool - 1) - 5`` tokens; otherwise
  ``max_new_tokens`` is clamped to ``max_req_len - input - 1`` (at most ``context - input - 2`` new tokens).
* Pause (``/pause_generation {"mode"}``, modes from 0.5.6): ``abort`` ends every request with finish ``abort``
  before the pause returns; ``in_place`` keeps running requests and their K/V; ``retract`` requeues them and
  recomputes them after ``/continue_generation``. New ``/generate`` calls wait while paused.
* ``/update_weights_from_disk``: while not paused it waits for in-flight requests (SGLang's writer lock). With
  ``flush_cache`` (default true) and requests still running it answers 400 "Weights were updated, but the cache
  was not flushed ..." as SGLang 0.5.22+ does; SGLang <= 0.5.20 asserts and the whole server dies there.
  Requests waiting in the queue count as running except while paused (0.5.22+; 0.5.6-0.5.8 ignore them too).
* ``/health`` and ``/health_generate``: 503 while paused. SGLang's probe is a 1-token generation that blocks on
  a paused server and gives 503 after ``SGLANG_HEALTH_CHECK_TIMEOUT`` (20 s); we answer at once.
* Memory saver (``/release_memory_occupation`` / ``/resume_memory_occupation`` ``{"tags"}``, 200 with a ``null``
  body; the scheduler's ``release_memory_occupation`` / ``resume_memory_occupation`` in
  ``managers/scheduler_update_weights_mixin.py``, from 0.5.20 ``managers/scheduler_components/weight_updater.py``;
  ``torch_memory_saver`` ``csrc/core.cpp`` ``pause`` / ``resume``). Per tag, as the scheduler's ``offload_tags``:
  tags ``None`` or ``[]`` mean all (``kv_cache``, ``weights``, ``cuda_graph``; ``cuda_graph`` from 0.5.5); any
  string is accepted and tracked. Release adds its tags; with ``--enable-memory-saver`` it unmaps them, and a tag
  unmapped already exits the scheduler ("Cannot pause allocation that is not active"). Release while requests run:
  ``AssertionError`` from 0.5.5 (before: the running requests touch freed memory). Resume removes each tag from
  ``offload_tags`` first: one that is not there raises ``KeyError``. ``/generate`` (and chat) on unmapped memory,
  and ``/update_weights_from_disk`` on unmapped weights, hit an illegal memory access. ``/health_generate`` while
  anything is released: 503 up to 0.5.9 (the scheduler skips the probe and nothing answers it), from 0.5.10 a real
  generation (dies when unmapped). ``/update_weight_version {"new_version", "abort_all_requests"}`` (0.5.2+) sets
  the version ``/model_info`` reports, nothing else. Nothing exposes ``offload_tags``. Where SGLang's scheduler
  dies, this server dies as SGLang's does: ``run_scheduler_process`` logs "Scheduler hit an exception" and sends
  SIGQUIT to its parent, whose handler kills the process tree, itself with SIGKILL (``utils.kill_process_tree``);
  a client sees the connection drop and nothing answers afterwards. Not emulated: SGLang's resumed memory is
  uninitialised (the weights are garbage until the next update); here they are kept.

By default the strictest rule of 0.5.x applies where versions differ (a client that passes works with all of
them); ``--emulate-sglang-version X`` switches to one version's behaviour: no ``/model_info`` before 0.5.6,
no pause modes before 0.5.6 (every pause aborts), ``>`` in the token-count check from 0.5.12.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import time
import uuid
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from jaxrl_term.rollout.engine import EngineError, SamplingParams

log = logging.getLogger("jaxrl_term.serve")
FLUSH_TEXT = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
              "requests, the operation will not be performed.)\n")  # SGLang's text for 200 and 400 alike
NOT_FLUSHED = ("Weights were updated, but the cache was not flushed because requests are still running or "
               "queued. Retract or finish them, then call /flush_cache.")


@dataclasses.dataclass(frozen=True)
class Rules:
    """Where SGLang versions differ: ``version`` None = the strictest behaviour of 0.5.x."""

    version: tuple[int, ...] | None = None

    def _at_least(self, *v: int) -> bool:
        return self.version is None or self.version >= v

    @property
    def model_info_route(self) -> bool:  # /model_info from 0.5.6; /get_model_info in all versions
        return self._at_least(0, 5, 6)

    @property
    def weight_version(self) -> bool:  # weight_version in model info and meta_info from 0.5.1
        return self._at_least(0, 5, 1)

    @property
    def pause_modes(self) -> bool:
        return self._at_least(0, 5, 6)

    @property
    def total_inclusive(self) -> bool:  # input + max_new >= context rejects up to 0.5.10, > from 0.5.12
        return self.version is None or self.version < (0, 5, 12)

    @property
    def memory_tags(self) -> tuple[str, ...]:  # what tags None or [] mean; cuda_graph from 0.5.5
        return ("kv_cache", "weights", "cuda_graph") if self._at_least(0, 5, 5) else ("weights", "kv_cache")

    @property
    def release_idle_assert(self) -> str | None:  # the text of the idleness assertion in release (0.5.5+)
        if self._at_least(0, 5, 10):
            return "release_memory_occupation should be called only when server is idle."
        return "release_memory_occupation should be called only when no ongoing request." if self._at_least(0, 5, 5) \
            else None

    @property
    def health_probe_skipped_while_released(self) -> bool:  # <= 0.5.9; from 0.5.10 the probe generates
        return not self._at_least(0, 5, 10)

    @property
    def update_weight_version_route(self) -> bool:
        return self._at_least(0, 5, 2)

    @property
    def paused_ignores_waiting(self) -> bool:  # flush idleness ignores the waiting queue while paused
        v = self.version
        return v is None or (0, 5, 6) <= v < (0, 5, 10) or v >= (0, 5, 22)


def parse_version(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    return tuple(int(x) for x in text.split(".")[:3] if x.isdigit())


def check_request(n_input: int, max_new: int | None, context: int, max_req_input_len: int,
                  inclusive: bool = True) -> int:
    """SGLang's checks on one ``/generate`` request. Returns the clamped ``max_new_tokens``; raises
    ``ValueError`` with SGLang's message (HTTP 400) when the request is rejected."""
    if n_input >= context:
        raise ValueError(f"The input ({n_input} tokens) is longer than the model's context length "
                         f"({context} tokens).")
    if max_new is not None:
        total = n_input + max_new
        if total >= context if inclusive else total > context:
            raise ValueError(
                f"Requested token count exceeds the model's maximum context length of {context} tokens. You "
                f"requested a total of {total} tokens: {n_input} tokens from the input messages and {max_new} "
                "tokens for the completion. Please reduce the number of tokens in the input messages or the "
                "completion to fit within the limit.")
    if n_input >= max_req_input_len:  # the scheduler's check
        raise ValueError(f"Input length ({n_input} tokens) exceeds the maximum allowed length "
                         f"({max_req_input_len} tokens). Use a shorter input or enable --allow-auto-truncate.")
    max_req_len = max_req_input_len + 5
    return min(128 if max_new is None else max_new, max_req_len - n_input - 1)  # 128: SGLang's default


def sampling_from_request(sp: dict, default_stop_ids: tuple[int, ...]) -> SamplingParams:
    stop = sp.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    stop_ids = tuple(int(x) for x in (sp.get("stop_token_ids") or ()))
    if not sp.get("ignore_eos", False):
        stop_ids = tuple(dict.fromkeys(stop_ids + default_stop_ids))
    seed = sp.get("sampling_seed", sp.get("seed"))
    return SamplingParams(
        temperature=float(sp.get("temperature", 1.0)),
        top_p=float(sp.get("top_p", 1.0)),
        top_k=int(sp.get("top_k", -1)),
        max_new_tokens=int(sp.get("max_new_tokens", 128)),  # SGLang's default
        stop_token_ids=stop_ids,
        stop=stop,
        seed=None if seed is None else int(seed),
    )


def finish_reason_json(gen) -> dict:
    if gen.finish_reason == "stop":
        return {"type": "stop", "matched": gen.matched_stop}
    if gen.finish_reason == "length":
        return {"type": "length", "length": len(gen.output_ids)}
    return {"type": "abort", "message": "aborted by pause_generation or abort_all_requests"}


ILLEGAL_ACCESS = "torch.AcceleratorError: CUDA error: an illegal memory access was encountered"


class SchedulerDeath(Exception):
    """What kills SGLang's scheduler, and with it the whole server."""


@dataclasses.dataclass
class MemorySaver:
    """The scheduler's ``offload_tags`` (any strings) and, with ``--enable-memory-saver``, the torch_memory_saver
    regions that are unmapped (see the module docstring)."""

    rules: Rules
    enabled: bool
    offload_tags: set[str] = dataclasses.field(default_factory=set)
    unmapped: set[str] = dataclasses.field(default_factory=set)

    def release(self, tags: list[str] | None, idle: bool) -> list[str]:
        text = self.rules.release_idle_assert
        if not idle and (text or self.enabled):
            raise SchedulerDeath(f"AssertionError: {text}" if text else f"{ILLEGAL_ACCESS} (requests running on "
                                 "memory release_memory_occupation freed)")
        tags = list(tags or self.rules.memory_tags)
        self.offload_tags.update(tags)
        for tag in ("kv_cache", "weights", "cuda_graph"):  # the scheduler's order
            if self.enabled and tag in tags and tag in self.rules.memory_tags:
                if tag in self.unmapped:
                    raise SchedulerDeath(f"[torch_memory_saver.cpp] Cannot pause allocation that is not active. "
                                         f"tag={tag} (release_memory_occupation of a tag released already)")
                self.unmapped.add(tag)
        return tags

    def resume(self, tags: list[str] | None) -> None:
        tags = list(tags or self.rules.memory_tags)
        for tag in tags:
            if tag not in self.offload_tags:
                raise SchedulerDeath(f"KeyError: {tag!r} (resume_memory_occupation: self.offload_tags.remove(tag) "
                                     f"of a tag that is not released; released: {sorted(self.offload_tags)})")
            self.offload_tags.remove(tag)
        self.unmapped.difference_update(tags)

    def check_forward(self, what: str) -> None:
        if self.unmapped:
            raise SchedulerDeath(f"{ILLEGAL_ACCESS} ({what} on released memory: {sorted(self.unmapped)})")


def die_like_sglang(message: str) -> None:
    """SGLang's end when its scheduler raises: the log line, then the parent kills the process tree, itself by
    SIGKILL; every connection drops and nothing answers afterwards."""
    log.error("Scheduler hit an exception: %s", message)
    log.error("SIGQUIT received. It usually means one child failed.")
    os.kill(os.getpid(), signal.SIGKILL)


class Admission:
    """The tokenizer manager's side of SGLang: the pause gate and the weight-update lock (each request is a
    reader; an update while not paused is the writer, which waits for in-flight requests and holds new ones)."""

    def __init__(self):
        self.cond = asyncio.Condition()
        self.paused = False
        self.updating = False
        self.inflight = 0

    @contextlib.asynccontextmanager
    async def request(self):
        async with self.cond:
            await self.cond.wait_for(lambda: not self.paused and not self.updating)
            self.inflight += 1
        try:
            yield
        finally:
            async with self.cond:
                self.inflight -= 1
                self.cond.notify_all()

    @contextlib.asynccontextmanager
    async def writer(self):
        async with self.cond:
            await self.cond.wait_for(lambda: not self.updating)
            self.updating = True
            await self.cond.wait_for(lambda: self.inflight == 0)
        try:
            yield
        finally:
            async with self.cond:
                self.updating = False
                self.cond.notify_all()

    async def set_paused(self, paused: bool) -> None:
        async with self.cond:
            self.paused = paused
            self.cond.notify_all()

    async def drained(self, timeout_s: float) -> None:
        async with self.cond:
            async with asyncio.timeout(timeout_s):  # not wait_for: on 3.11 it can swallow a cancellation
                await self.cond.wait_for(lambda: self.inflight == 0)


def create_app(engine, tokenizer=None, model_path: str = "", tokenizer_path: str = "", *,
               rules: Rules | None = None, weight_version: str | None = None, flags: dict | None = None,
               on_death=die_like_sglang) -> Starlette:
    """``on_death(message)``: what a scheduler death does (default: exit as SGLang's server does)."""
    rules = rules or Rules()
    default_stop: tuple[int, ...] = ()
    if tokenizer is not None:
        ids = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")]
        default_stop = tuple(i for i in ids if isinstance(i, int) and i != tokenizer.unk_token_id)
    # SGLang's weight_version is any string; the engine orders its versions as integers (a generation reports the
    # older of its submission and output versions): each load gets the next integer, mapped back to its string
    names = {engine.weight_version: str(engine.weight_version if weight_version is None else weight_version)}
    context = engine.cfg.max_seq_len
    pool = engine.cfg.max_batch * engine.cfg.max_seq_len  # SGLang's max_total_num_tokens
    max_req_input_len = min(context - 1, pool - 1) - 5
    # model_path and weight_version as the tokenizer manager knows them (updated only by a successful update)
    state = {"model_path": model_path, "weight_version": names[engine.weight_version]}
    adm = Admission()
    mem = MemorySaver(rules, bool((flags or {}).get("enable_memory_saver")))

    def err(msg: str, code: int = 400) -> JSONResponse:
        return JSONResponse({"error": {"message": msg}, "object": "error", "message": msg}, status_code=code)

    def idle() -> bool:
        running, waiting = engine.request_counts()
        return running == 0 and (waiting == 0 or (adm.paused and rules.paused_ignores_waiting))

    async def body_of(request: Request) -> dict:
        raw = await request.body()
        return (await request.json()) if raw else {}

    async def run_one(ids: list[int], sampling: SamplingParams):
        async with adm.request():
            # at forward time, past the pause gate: a request held by a pause during which memory was released
            # runs on unmapped memory when generation continues, as in SGLang
            mem.check_forward("a forward pass")
            return await engine.generate(ids, sampling)

    async def one(ids, text, sp: dict, rid: str, return_logprob: bool, skip_special: bool) -> dict:
        if ids is None:
            if tokenizer is None or text is None:
                raise ValueError("give input_ids (no tokenizer loaded for text)")
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        max_new = sp.get("max_new_tokens")
        max_new = check_request(len(ids), None if max_new is None else int(max_new), context, max_req_input_len,
                                rules.total_inclusive)
        t0 = time.monotonic()
        gen = await run_one(ids, sampling_from_request(sp, default_stop).replace(max_new_tokens=max_new))
        out_text = tokenizer.decode(gen.output_ids, skip_special_tokens=skip_special) if tokenizer else None
        meta = {
            "id": rid,
            "finish_reason": finish_reason_json(gen),
            "prompt_tokens": len(ids),
            "completion_tokens": len(gen.output_ids),
            "cached_tokens": gen.cached_tokens or 0,
            "e2e_latency": time.monotonic() - t0,
        }
        if rules.weight_version:
            # the version when the output was produced
            meta["weight_version"] = names.get(gen.weight_version, str(gen.weight_version))
        if return_logprob:
            meta["output_token_logprobs"] = [[lp, tid, None] for lp, tid in zip(gen.output_logprobs, gen.output_ids)]
            meta["input_token_logprobs"] = []
        return {"text": out_text, "output_ids": gen.output_ids, "meta_info": meta}

    async def generate(request: Request):
        try:
            body = await request.json()
        except ValueError:
            return err("request body is not JSON")
        if body.get("stream"):
            return err("streaming is not supported by jaxrl_term.serve")
        sp = body.get("sampling_params") or {}
        ids, text = body.get("input_ids"), body.get("text")
        rl = bool(body.get("return_logprob", False))
        batched = (isinstance(ids, list) and ids and isinstance(ids[0], list)) or isinstance(text, list)
        try:
            if batched:
                items = ids if ids is not None else [None] * len(text)
                texts = text if isinstance(text, list) else [None] * len(items)
                rids = body.get("rid") or [uuid.uuid4().hex for _ in items]
                sps = sp if isinstance(sp, list) else [sp] * len(items)
                out = await asyncio.gather(*(one(i, t, s, r, rl, bool(s.get("skip_special_tokens", True)))
                                             for i, t, s, r in zip(items, texts, sps, rids)))
                return JSONResponse(list(out))
            return JSONResponse(await one(ids, text, sp, body.get("rid") or uuid.uuid4().hex, rl,
                                          bool(sp.get("skip_special_tokens", True))))
        except (EngineError, ValueError, TypeError) as e:
            return err(str(e))

    async def chat_completions(request: Request):
        """OpenAI-style chat completions through the chat template (e.g. to serve a local LLM judge)."""
        if tokenizer is None:
            return err("chat completions need a tokenizer in the model dir (or --tokenizer-path)")
        body = await request.json()
        try:
            text = tokenizer.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            sp = {"temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
                  "max_new_tokens": body.get("max_tokens") or body.get("max_completion_tokens") or 512,
                  "stop": body.get("stop"), "seed": body.get("seed")}
            max_new = check_request(len(ids), None, context, max_req_input_len)
            sampling = sampling_from_request(sp, default_stop)
            gen = await run_one(ids, sampling.replace(max_new_tokens=min(max_new, sampling.max_new_tokens)))
        except (KeyError, EngineError, ValueError, TypeError) as e:
            return err(str(e))
        out = gen.output_ids[:-1] if gen.finish_reason == "stop" and isinstance(gen.matched_stop, int) else gen.output_ids
        return JSONResponse({
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model", "jaxrl_term"),
            "choices": [{"index": 0, "finish_reason": "length" if gen.finish_reason == "length" else "stop",
                         "message": {"role": "assistant", "content": tokenizer.decode(out, skip_special_tokens=True)}}],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": len(gen.output_ids),
                      "total_tokens": len(ids) + len(gen.output_ids)}})

    async def update_weights_from_disk(request: Request):
        """SGLang's ``UpdateWeightFromDiskReqInput``: model_path, load_format, abort_all_requests, weight_version,
        flush_cache (default true), is_async, torch_empty_cache, keep_pause, recapture_cuda_graph, token_step,
        manifest (the GPU-only ones are accepted and ignored)."""
        body = await body_of(request)
        path, version = body.get("model_path"), body.get("weight_version")

        def fail(msg: str) -> JSONResponse:
            return JSONResponse({"success": False, "message": msg, "num_paused_requests": 0}, status_code=400)

        if not isinstance(path, str) or not path:
            return fail("model_path is required")
        if body.get("abort_all_requests"):
            await asyncio.to_thread(engine.abort_all)
        # not paused: the writer lock waits for in-flight requests; paused: the update goes straight in
        async with (contextlib.nullcontext() if adm.paused else adm.writer()):
            if "weights" in mem.unmapped:
                mem.check_forward("update_weights_from_disk: loading weights")
            try:
                if not Path(path).is_dir():
                    raise EngineError(f"model_path {path!r} is not a directory", retryable=False)
                n = max(names) + 1
                names[n] = str(version) if version is not None else state["weight_version"]
                await engine.update_weights(path, n)
                while engine.pending_update and await engine.health():
                    await asyncio.sleep(0.005)
            except EngineError as e:
                return fail(str(e))
        state["model_path"] = path
        if body.get("flush_cache", True) and not idle():
            # SGLang 0.5.22+ answers this; 0.5.6-0.5.20 assert ("Cache flush failed after updating weights") and
            # the server dies. The weights are new either way; the tokenizer keeps the old weight_version.
            log.warning("update_weights_from_disk: cache not flushed, requests running %s", engine.request_counts())
            return fail(NOT_FLUSHED)
        if version is not None:
            state["weight_version"] = str(version)
        return JSONResponse({"success": True, "message": "Succeeded to update model weights.",
                             "num_paused_requests": 0})

    async def model_info(request: Request):
        info = {"model_path": state["model_path"], "tokenizer_path": tokenizer_path, "is_generation": True,
                "preferred_sampling_params": None}
        if rules.weight_version:
            info["weight_version"] = state["weight_version"]
        return JSONResponse(info)

    async def health(request: Request):
        # SGLang serves /health and /health_generate from one handler (http_server.py): a one-token generation
        # unless SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION is off (default on, 0.5.6 to 0.5.23)
        if os.environ.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "true").lower() not in ("0", "false", "no"):
            return await health_generate(request)
        if adm.paused:
            return err("generation is paused", 503)
        return JSONResponse({}) if await engine.health() else err("engine is not running", 503)

    async def health_generate(request: Request):
        if adm.paused:
            return err("generation is paused", 503)
        if mem.offload_tags and rules.health_probe_skipped_while_released:
            return err("memory is released: the scheduler skips the probe", 503)
        try:
            probe = SamplingParams(max_new_tokens=1, temperature=0)
            async with asyncio.timeout(20):
                await run_one([default_stop[0] if default_stop else 0], probe)
            return JSONResponse({})
        except SchedulerDeath:
            raise
        except Exception as e:  # noqa: BLE001 - any failure means "not ready"
            return err(f"generation failed: {e}", 503)

    async def pause(request: Request):
        mode = (await body_of(request)).get("mode", "abort")
        if not rules.pause_modes:
            mode = "abort"  # before 0.5.6 the body is ignored and every pause aborts
        if mode not in ("abort", "in_place", "retract"):
            return err(f"unknown pause mode {mode!r}")
        await adm.set_paused(True)
        await asyncio.to_thread(engine.pause, mode)
        if mode == "abort":
            await adm.drained(60)  # SGLang returns once every aborted request has left
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(request: Request):
        engine.resume()
        await adm.set_paused(False)
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(request: Request):
        if not idle():
            return PlainTextResponse(FLUSH_TEXT, status_code=400)
        engine.slot_cache = [[] for _ in engine.slot_cache]
        return PlainTextResponse(FLUSH_TEXT)

    async def memory_tags(request: Request) -> list[str] | None:
        tags = (await body_of(request)).get("tags")  # Optional[List[str]]: any strings, None or [] = all
        if tags is not None and not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
            raise ValueError(f"tags must be a list of strings or null, got {tags!r}")
        return tags

    async def release_memory(request: Request):
        try:
            tags = await memory_tags(request)
        except ValueError as e:
            return err(str(e), 422)
        if "kv_cache" in mem.release(tags, idle()):
            engine.slot_cache = [[] for _ in engine.slot_cache]  # SGLang flushes the prefix cache with the KV
        return JSONResponse(None)

    async def resume_memory(request: Request):
        try:
            tags = await memory_tags(request)
        except ValueError as e:
            return err(str(e), 422)
        mem.resume(tags)
        return JSONResponse(None)

    async def update_weight_version(request: Request):
        body = await body_of(request)
        version = body.get("new_version")
        if not isinstance(version, str):
            return err("new_version (a string) is required", 422)
        if body.get("abort_all_requests", True):
            await asyncio.to_thread(engine.abort_all)
        state["weight_version"] = names[engine.weight_version] = version
        return JSONResponse({"success": True, "message": f"Weight version updated to {version}",
                             "new_version": version})

    async def scheduler_died(request: Request, exc: SchedulerDeath):
        on_death(str(exc))  # SGLang's server is gone here; an in-process app answers 500
        return err(f"scheduler died: {exc}", 500)

    async def server_info(request: Request):
        running, waiting = engine.request_counts()
        return JSONResponse({
            "model_path": state["model_path"], "context_length": context, "max_total_num_tokens": pool,
            "max_req_input_len": max_req_input_len, "max_running_requests": engine.cfg.max_batch,
            "weight_version": state["weight_version"], **(flags or {}), "status": "ready",
            "internal_states": [{"running": running, "waiting": waiting}],
            "version": "jaxrl_term" + (f" (sglang {'.'.join(map(str, rules.version))})" if rules.version else ""),
            "engine": "jax", "max_batch": engine.cfg.max_batch, "stats": engine.stats})

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [{"id": state["model_path"], "object": "model",
                                                         "root": state["model_path"], "max_model_len": context}]})

    routes = [
        Route("/generate", generate, methods=["POST", "PUT"]),
        Route("/update_weights_from_disk", update_weights_from_disk, methods=["POST"]),
        Route("/get_model_info", model_info, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/health_generate", health_generate, methods=["GET"]),
        Route("/pause_generation", pause, methods=["POST"]),
        Route("/continue_generation", resume, methods=["POST"]),
        Route("/flush_cache", flush_cache, methods=["POST", "GET"]),
        Route("/release_memory_occupation", release_memory, methods=["POST", "GET"]),
        Route("/resume_memory_occupation", resume_memory, methods=["POST", "GET"]),
        Route("/get_server_info", server_info, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]
    if rules.model_info_route:
        routes += [Route("/model_info", model_info, methods=["GET"]),
                   Route("/server_info", server_info, methods=["GET"])]
    if rules.update_weight_version_route:
        routes.append(Route("/update_weight_version", update_weight_version, methods=["POST"]))
    return Starlette(routes=routes, exception_handlers={SchedulerDeath: scheduler_died})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m jaxrl_term.serve")
    ap.add_argument("--model-dir", "--model-path", dest="model_dir", required=True)
    ap.add_argument("--tokenizer-path", default=None, help="default: the model dir")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--max-batch", "--max-running-requests", dest="max_batch", type=int, default=16)
    ap.add_argument("--max-seq-len", "--context-length", dest="max_seq_len", type=int, default=None,
                    help="default 4096; above the config's derived length only with SGLang's environment variable")
    ap.add_argument("--json-model-override-args", default="{}",
                    help="config.json keys replaced before loading, as SGLang does (e.g. rope_scaling: YaRN)")
    ap.add_argument("--param-dtype", default="float32")
    ap.add_argument("--compute-dtype", default="float32")
    ap.add_argument("--weight-version", default=None, help="initial weight version (SGLang's default: 'default'; "
                                                            "here: 0)")
    ap.add_argument("--enable-deterministic-inference", action="store_true",
                    help="batch-invariant sampling: JaxEngineConfig(deterministic=True)")
    ap.add_argument("--emulate-sglang-version", default=None,
                    help="behave as this SGLang version where versions differ (e.g. 0.5.5: no /model_info)")
    # accepted for command-line compatibility with sglang.launch_server; meaningless here
    for flag in ("--tp-size", "--dp-size", "--mem-fraction-static", "--admin-api-key"):
        ap.add_argument(flag, default=None)
    # --enable-fp32-lm-head: our sampler always takes log-softmax in fp32 (and weights here are fp32);
    # --enable-memory-saver: nothing is freed on CPU, but released memory counts as unmapped: what SGLang's
    # scheduler dies of (a second release, a forward pass on it) kills this server too
    for flag in ("--skip-server-warmup", "--enable-memory-saver", "--enable-fp32-lm-head"):
        ap.add_argument(flag, action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from jaxrl_term.runtime_env import apply_env

    # before the backend exists (runtime_env.py): SGLang's static share of the GPU is XLA's preallocation here
    apply_env({"XLA_PYTHON_CLIENT_MEM_FRACTION": str(float(args.mem_fraction_static))}
              if args.mem_fraction_static is not None else {}, who="serve")
    import uvicorn

    from jaxrl_term.model.hf import load_pretrained
    from jaxrl_term.rollout.jax_engine import JaxEngine, JaxEngineConfig

    import json

    from jaxrl_term.rollout.launcher import ALLOW_LONGER_CONTEXT_ENV, sglang_context_length

    overrides = json.loads(args.json_model_override_args)
    if args.max_seq_len is not None:  # SGLang's rule (ModelConfig._derive_context_length), its own words
        derived = sglang_context_length({**json.loads((Path(args.model_dir) / "config.json").read_text()), **overrides})
        if args.max_seq_len > derived and os.environ.get(ALLOW_LONGER_CONTEXT_ENV, "").lower() not in ("1", "true"):
            raise ValueError(f"User-specified context_length ({args.max_seq_len}) is greater than the derived "
                             f"context_length ({derived}). ... To allow overriding this maximum, set the env var "
                             f"{ALLOW_LONGER_CONTEXT_ENV}=1")
    args.max_seq_len = args.max_seq_len or 4096
    model = load_pretrained(args.model_dir, param_dtype=args.param_dtype, compute_dtype=args.compute_dtype,
                            overrides=overrides)
    tok_dir = args.tokenizer_path or args.model_dir
    tokenizer = None
    if (Path(tok_dir) / "tokenizer.json").is_file():
        from jaxrl_term.model.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(tok_dir)
    engine = JaxEngine(model, tokenizer, JaxEngineConfig(max_batch=args.max_batch, max_seq_len=args.max_seq_len,
                                                         deterministic=args.enable_deterministic_inference))
    flags = {"enable_memory_saver": args.enable_memory_saver, "enable_fp32_lm_head": args.enable_fp32_lm_head,
             "enable_deterministic_inference": args.enable_deterministic_inference}
    app = create_app(engine, tokenizer, os.path.abspath(args.model_dir), os.path.abspath(tok_dir),
                     rules=Rules(parse_version(args.emulate_sglang_version)), weight_version=args.weight_version,
                     flags=flags)
    log.info("serving %s on http://%s:%d", args.model_dir, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    import sys

    from jaxrl_term.utils.cli import guard

    sys.exit(guard(main)())
