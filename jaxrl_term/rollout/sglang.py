"""SGLang as the rollout engine: an exact token-in/token-out client and weight sync.

Every request sets ``input_ids``, ``return_logprob``, ``stop_token_ids`` and ``max_new_tokens``; token ids and
log-probs come from ``meta_info.output_token_logprobs`` (never from text). ``finish_reason`` is mapped.

Routing. With ``router`` (an ``sglang-router`` URL, or a launched ``rollout.router.SGLangRouter`` that the
engine then owns and stops), every single ``/generate`` goes to the router with the episode id (``session``) in
``X-SMG-Routing-Key``: its ``manual`` policy keeps an episode's turns on one server (its prefix cache) and routes
around dead ones; everything the router does not forward to every worker (weight sync, pause/continue, flush,
memory release/resume, ``/get_server_info`` limits, batched ``/generate``) goes to the worker ``urls`` directly.
Without a router the client does the same itself: each session sticks to one server, new sessions go to the
least loaded. Connection errors and 5xx are retried with backoff (a dead server is avoided for a while); 4xx
are not.

Context length. SGLang rejects (HTTP 400) an input of ``>= context`` tokens, ``input + max_new_tokens >=
context`` (<= 0.5.10; ``>`` from 0.5.12) and, in the scheduler, an input of ``>= max_req_input_len`` tokens
(``min(context - 1, KV pool - 1) - 5``), then clamps ``max_new_tokens`` to ``context - input - 2``. The client
learns each server's limits once (``/get_server_info``: ``max_req_input_len`` and ``context_length``, else
``/v1/models`` ``max_model_len``), or takes ``context_length``, and sends ``max_new_tokens <= context - input -
2``. With no room left at all it does not call the server and returns a ``Generation`` with no tokens and finish
``length``.

Aborts. A request that ends with finish ``abort`` (a pause in ``abort`` mode, ``abort_all_requests``) is sent
again, up to ``abort_retries`` times; SGLang holds new requests while paused, so the retry waits for
``/continue_generation`` and the whole turn comes from the new weights. Aborts that persist raise a retryable
``EngineError``.

Weight sync (``update_weights(dir, version)``), on every server at once: ``/pause_generation {"mode"}`` ->
``/update_weights_from_disk {"weight_version", "flush_cache"}`` -> ``/continue_generation``, then ``/model_info``
(``/get_model_info`` before 0.5.6) must report the new version. ``pause_mode``:

* ``abort`` (default): every request in flight ends and is retried (above); before updating, the client polls
  ``/flush_cache`` until it answers 200, which is an idle check valid in every version (0.5.6+ only returns from
  the pause once requests have left; before that the abort is fire and forget). The update then flushes the
  prefix cache (``flush_cache: true``): no K/V from old weights survives. Fully on-policy turns.
* ``in_place``: running requests stay in the batch with their K/V and continue on the new weights after the
  update (their prefix was computed by the old ones: slightly off-policy). ``flush_cache: false``, because
  SGLang's flush fails while requests are running: the scheduler asserts and the server dies (<= 0.5.20) or the
  update answers 400 (0.5.22+).
* ``retract``: running requests are requeued and recomputed after the update (their K/V is freed).
  ``flush_cache: false`` too: retracted requests sit in the waiting queue, which 0.5.10-0.5.20 count as busy, so
  the assert kills the server there.
In the last two modes the client then asks ``/flush_cache`` once while still paused (a plain endpoint: it answers
400 instead of crashing when busy): that empties the prefix cache whenever the server allows it (retract:
0.5.6-0.5.8 and 0.5.22+; in_place: only when nothing was running), otherwise old-weight prefixes stay cached.
Before 0.5.6 there are no modes (every pause aborts) and every update flushes: use ``abort`` with those servers.

Memory saver (``release_memory`` / ``resume_memory``, servers started with ``--enable-memory-saver``): SGLang
frees the tagged GPU memory (``weights``, ``kv_cache``, ``cuda_graph`` from 0.5.5) and asserts it is idle
(>= 0.5.5: the server dies if requests are running), so call them between rollouts only. Its scheduler also dies
on a resume of a tag it does not hold and on a second release; what each server has released is kept in its own
``weight_version`` so that restarts of either side cannot get this wrong (``rollout/memory.py``).

The launcher (``rollout/launcher.py``) starts servers with the flags and environment these rules need.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

import httpx

from jaxrl_term.rollout.engine import EngineError, Generation, SamplingParams, TroubleLog
from jaxrl_term.rollout.memory import ServerMemory, each_server
from jaxrl_term.rollout.router import SGLangRouter, wait_router_ready

log = logging.getLogger(__name__)
ROUTING_HEADER = "X-SMG-Routing-Key"
RETRYABLE = (httpx.ConnectError, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError, httpx.ReadTimeout,
             httpx.ConnectTimeout, httpx.PoolTimeout)
PAUSE_MODES = ("abort", "in_place", "retract")
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
# set, they make SGLang return raw (pre-temperature) log-probs: SGLANG_RETURN_ORIGINAL_LOGPROB (0.5.5+),
# RETURN_ORIGINAL_LOGPROB (0.5.2-0.5.3)
LOGPROB_ENV = ("SGLANG_RETURN_ORIGINAL_LOGPROB", "RETURN_ORIGINAL_LOGPROB")


def request_body(input_ids, sampling: SamplingParams, rid: str | list[str] | None = None) -> dict:
    sp: dict[str, Any] = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "max_new_tokens": sampling.max_new_tokens,  # SGLang's default is 128: always set
        "stop_token_ids": list(sampling.stop_token_ids),
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    if sampling.stop:
        sp["stop"] = list(sampling.stop)
    if sampling.seed is not None:
        sp["sampling_seed"] = sampling.seed
    body = {"input_ids": input_ids, "sampling_params": sp, "return_logprob": True, "logprob_start_len": -1,
            "top_logprobs_num": 0}
    if rid is not None:
        body["rid"] = rid
    return body


def _version(v) -> int | None:
    if v is None:
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def _finish(obj: Any) -> dict:
    fr = obj.get("meta_info", {}).get("finish_reason") if isinstance(obj, dict) else None
    return fr if isinstance(fr, dict) else {"type": fr}


def parse_generation(obj: dict) -> Generation:
    """One SGLang ``/generate`` response -> ``Generation``. Abort raises a retryable ``EngineError``."""
    if not isinstance(obj, dict) or "meta_info" not in obj:
        raise EngineError(f"unexpected /generate response: {str(obj)[:300]}", retryable=False)
    meta = obj["meta_info"]
    fr = _finish(obj)
    kind = fr.get("type")
    if kind == "abort":
        raise EngineError(f"request aborted by the server: {fr.get('message', '')}", retryable=True)
    if kind not in ("stop", "length"):
        raise EngineError(f"unknown finish_reason {fr!r}", retryable=False)
    pairs = meta.get("output_token_logprobs")
    if pairs is None:
        raise EngineError("response has no output_token_logprobs (was return_logprob set?)", retryable=False)
    ids = [int(p[1]) for p in pairs]
    lps = [float(p[0]) for p in pairs]
    out_ids = obj.get("output_ids")
    if out_ids is not None and list(out_ids) != ids:
        raise EngineError("output_ids and output_token_logprobs disagree", retryable=False)
    return Generation(ids, lps, kind, _version(meta.get("weight_version")), fr.get("matched") if kind == "stop" else None,
                      meta.get("prompt_tokens"), meta.get("cached_tokens"))


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """A server's token limits: ``context_length`` and ``max_req_input_len`` (inputs must be shorter)."""

    context_length: int
    max_req_input_len: int

    @classmethod
    def from_context(cls, context_length: int) -> ServerLimits:
        return cls(context_length, context_length - 1 - 5)  # a KV pool at least one context long

    def max_new_tokens(self, n_input: int, requested: int) -> int:
        """What to ask for: at most ``context - input - 2`` (what the scheduler keeps), 0 when there is no room."""
        if n_input >= self.max_req_input_len:
            return 0
        return max(0, min(requested, self.context_length - n_input - 2))


class SGLangEngine(TroubleLog):
    """``RolloutEngine`` over one or more SGLang (or ``jaxrl_term.serve``) servers."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        router: str | SGLangRouter | None = None,
        request_timeout_s: float = 3600.0,
        connect_timeout_s: float = 10.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        down_cooldown_s: float = 30.0,
        pause_mode: str = "abort",
        context_length: int | None = None,
        abort_retries: int = 3,
        idle_timeout_s: float = 60.0,
        weight_version: int | None = None,
        api_key: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        if not urls:
            raise ValueError("rollout.sglang.urls: give at least one server URL")
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"rollout.sglang.pause_mode={pause_mode!r}; use one of {PAUSE_MODES}")
        self.urls = [u.rstrip("/") for u in urls]  # the workers: sync, pause, memory and limits reach each one
        self._router_proc = router if isinstance(router, SGLangRouter) else None  # launched for us: we stop it
        self.router = (router.url if isinstance(router, SGLangRouter) else router.rstrip("/")) if router else None
        self.max_retries, self.backoff_s = max_retries, backoff_s
        self.down_cooldown_s, self.pause_mode = down_cooldown_s, pause_mode
        self.abort_retries, self.idle_timeout_s = abort_retries, idle_timeout_s
        self.weight_version = weight_version  # the version every server had when this engine last updated them
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(request_timeout_s, connect=connect_timeout_s), headers=headers,
            transport=transport, limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256),
        )
        super().__init__()
        self._sessions: dict[str, int] = {}
        self._inflight = [0] * len(self.urls)
        self._down_until = [0.0] * len(self.urls)
        given = ServerLimits.from_context(context_length) if context_length else None
        self._limits: list[ServerLimits | None] = [given] * len(self.urls)
        self._limit_locks = [asyncio.Lock() for _ in self.urls]
        self._info_path: list[str | None] = [None] * len(self.urls)  # /model_info, or /get_model_info (< 0.5.6)
        self._common_limits: ServerLimits | None = None  # through the router: the tightest of every worker's
        self.aborts_retried = 0

    # -- routing ----------------------------------------------------------------------------------
    def _pick(self, session: str | None) -> int:
        now = time.monotonic()
        up = [i for i in range(len(self.urls)) if self._down_until[i] <= now] or list(range(len(self.urls)))
        if session is not None and session in self._sessions and self._sessions[session] in up:
            return self._sessions[session]
        i = min(up, key=lambda k: self._inflight[k])
        if session is not None:
            self._sessions[session] = i
        return i

    async def _post(self, path: str, body: dict, *, session: str | None = None, server: int | None = None):
        """POST to worker ``server``; else to the router (with the session's routing key) when there is one,
        else to the session's server."""
        last: Exception | None = None
        for attempt in range(self.max_retries + 1):
            routed = server is None and self.router is not None
            i = None if routed else server if server is not None else self._pick(session)
            url = self.router if routed else self.urls[i]
            headers = {ROUTING_HEADER: session} if (routed and session) else None
            if i is not None:
                self._inflight[i] += 1
            try:
                r = await self.client.post(url + path, json=body, headers=headers)
            except RETRYABLE as e:
                last = e
                if i is not None:
                    self._down_until[i] = time.monotonic() + self.down_cooldown_s
            else:
                if r.status_code < 500:
                    return r
                last = EngineError(f"{url}{path}: HTTP {r.status_code}: {r.text[:300]}")
            finally:
                if i is not None:
                    self._inflight[i] -= 1
            self.note_trouble(session, f"{url}{path}: {type(last).__name__}: {last}")
            if attempt < self.max_retries:
                await asyncio.sleep(self.backoff_s * 2**attempt)
        raise EngineError(f"{path} failed after {self.max_retries + 1} attempts: {type(last).__name__}: {last}",
                          retryable=True)

    async def _call(self, server: int, path: str, body: dict) -> httpx.Response:
        """POST to one server; any HTTP error status raises (non-retryable) ``EngineError``."""
        r = await self._post(path, body, server=server)
        if r.status_code >= 400:
            raise EngineError(f"{path}: HTTP {r.status_code}: {r.text[:300]}", retryable=False)
        return r

    async def _get_json(self, server: int, *paths: str) -> dict:
        """GET the first of ``paths`` the server has (404 -> the next one)."""
        url = self.urls[server]
        for k, path in enumerate(paths):
            try:
                r = await self.client.get(url + path, timeout=30)
            except httpx.HTTPError as e:
                if isinstance(e, RETRYABLE):
                    self._down_until[server] = time.monotonic() + self.down_cooldown_s
                raise EngineError(f"{url}{path}: {type(e).__name__}: {e}") from e
            if r.status_code == 404 and k < len(paths) - 1:
                continue
            if r.status_code >= 400:
                raise EngineError(f"{url}{path}: HTTP {r.status_code}: {r.text[:300]}", retryable=r.status_code >= 500)
            return r.json()
        raise AssertionError("unreachable")

    # -- limits -----------------------------------------------------------------------------------
    async def limits(self, server: int = 0) -> ServerLimits:
        """The server's token limits, learned once (see the module docstring)."""
        if self._limits[server] is None:
            async with self._limit_locks[server]:
                if self._limits[server] is None:
                    self._limits[server] = await self._learn_limits(server)
        return self._limits[server]

    async def _route_limits(self, session: str | None) -> ServerLimits:
        """The limits a request must fit: its server's, or through the router (which picks the server) the
        tightest of every worker's (of those that answer: the router routes around the others)."""
        if self.router is None:
            return await self.limits(self._pick(session))
        if self._common_limits is not None:
            return self._common_limits
        every = await asyncio.gather(*(self.limits(i) for i in range(len(self.urls))), return_exceptions=True)
        known = [x for x in every if isinstance(x, ServerLimits)]
        if not known:
            raise next(x for x in every if isinstance(x, BaseException))
        lim = ServerLimits(min(x.context_length for x in known), min(x.max_req_input_len for x in known))
        if len(known) == len(every):
            self._common_limits = lim
        return lim

    async def _learn_limits(self, server: int) -> ServerLimits:
        info = await self._get_json(server, "/get_server_info", "/server_info")
        ctx, max_input = info.get("context_length"), info.get("max_req_input_len")
        if not ctx:  # server_args.context_length is None unless given on the command line
            models = await self._get_json(server, "/v1/models")
            ctx = next((m.get("max_model_len") for m in models.get("data", []) if m.get("max_model_len")), None)
        if not ctx:
            raise EngineError(f"{self.urls[server]}: cannot learn the context length (no context_length in "
                              "/get_server_info, no max_model_len in /v1/models); set rollout.sglang.context_length",
                              retryable=False)
        lim = ServerLimits.from_context(int(ctx))
        if max_input:
            lim = ServerLimits(int(ctx), min(int(max_input), lim.max_req_input_len))
        log.info("%s: context %d tokens, inputs < %d tokens", self.urls[server], lim.context_length,
                 lim.max_req_input_len)
        return lim

    # -- protocol ---------------------------------------------------------------------------------
    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, *, session: str | None = None
                       ) -> Generation:
        ids = [int(x) for x in input_ids]
        last = ""
        self.clear_trouble(session)
        for _ in range(self.abort_retries + 1):
            max_new = (await self._route_limits(session)).max_new_tokens(len(ids), sampling.max_new_tokens)
            if max_new < 1:  # no room: finish "length" with nothing generated, as if the context had filled up
                return Generation([], [], "length", None, None, len(ids), None)
            body = request_body(ids, sampling.replace(max_new_tokens=max_new), uuid.uuid4().hex)
            submitted = self.weight_version  # SGLang reports the version at *output* time: keep the older one
            r = await self._post("/generate", body, session=session)
            if r.status_code >= 400:
                raise EngineError(f"/generate: HTTP {r.status_code}: {r.text[:500]}", retryable=False)
            obj = r.json()
            fr = _finish(obj)
            if fr.get("type") != "abort":
                gen = parse_generation(obj)
                if submitted is not None:
                    reported = gen.weight_version
                    gen = dataclasses.replace(gen, weight_version=submitted if reported is None else
                                              min(submitted, reported))
                self.clear_trouble(session)
                return gen
            last = str(fr.get("message", ""))
            self.aborts_retried += 1
            self.note_trouble(session, f"request aborted by the server ({last})")
            log.info("%s: request aborted (%s); sending it again", self.router or self.urls[self._pick(session)], last)
        raise EngineError(f"request aborted by the server {self.abort_retries + 1} times (last: {last})",
                          retryable=True)

    async def generate_batch(self, batch: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Generation]:
        """One batched request (a list of prompts); the response is a list in the same order. Prompts with no
        room left get an empty ``length`` generation; an abort raises (no per-prompt retry). Sent to one worker,
        never through the router (it refuses a list of sampling params)."""
        server = self._pick(None)
        lim = await self.limits(server)
        ids = [[int(x) for x in p] for p in batch]
        room = [lim.max_new_tokens(len(p), sampling.max_new_tokens) for p in ids]
        send = [k for k, n in enumerate(room) if n >= 1]
        out: list[Generation | None] = [None if room[k] >= 1 else Generation([], [], "length", None, None, len(p))
                                        for k, p in enumerate(ids)]
        if send:
            body = request_body([ids[k] for k in send], sampling)
            body["sampling_params"] = [dict(body["sampling_params"], max_new_tokens=room[k]) for k in send]
            r = await self._post("/generate", body, server=server)
            if r.status_code >= 400:
                raise EngineError(f"/generate: HTTP {r.status_code}: {r.text[:500]}", retryable=False)
            res = r.json()
            if not isinstance(res, list) or len(res) != len(send):
                raise EngineError("a batched /generate must return one response per prompt", retryable=False)
            for k, o in zip(send, res):
                out[k] = parse_generation(o)
        return out  # type: ignore[return-value]

    async def model_info(self, server: int = 0) -> dict:
        """``/model_info``; servers older than 0.5.6 only have ``/get_model_info`` (remembered per server)."""
        paths = [self._info_path[server]] if self._info_path[server] else ["/model_info", "/get_model_info"]
        for k, path in enumerate(paths):
            try:
                r = await self.client.get(self.urls[server] + path, timeout=30)
            except httpx.HTTPError as e:
                raise EngineError(f"{self.urls[server]}{path}: {type(e).__name__}: {e}") from e
            if r.status_code == 404 and k < len(paths) - 1:
                continue
            if r.status_code >= 400:
                raise EngineError(f"{self.urls[server]}{path}: HTTP {r.status_code}: {r.text[:300]}", retryable=False)
            self._info_path[server] = path
            return r.json()
        raise AssertionError("unreachable")

    async def update_weights(self, source: Any, version: int) -> None:
        """``source``: an HF directory every server can read (e.g. written by ``save_pretrained``)."""
        path = str(source)
        results = await asyncio.gather(*(self._update_one(i, path, version) for i in range(len(self.urls))))
        errors = [f"{self.urls[i]}: {e}" for i, e in enumerate(results) if e]
        for i, url in enumerate(self.urls):
            if results[i]:
                continue
            try:
                info = await self.model_info(i)
            except EngineError as e:
                errors.append(f"{url}: {e}")
                continue
            if str(info.get("weight_version")) != str(version):
                errors.append(f"{url}: model info reports weight_version {info.get('weight_version')!r}, "
                              f"expected {version}")
        if errors:
            raise EngineError("weight update to version %s failed on %d server(s): %s"
                              % (version, len(errors), "; ".join(errors)), retryable=False)
        self.weight_version = version

    async def _update_one(self, i: int, path: str, version: int) -> str | None:
        """Pause, update, continue one server; returns what went wrong, or None."""
        error = None
        try:
            await self._call(i, "/pause_generation", {"mode": self.pause_mode})
            if self.pause_mode == "abort":
                await self._wait_idle(i)
            r = await self._post("/update_weights_from_disk", {
                "model_path": path, "load_format": None, "abort_all_requests": False,
                "weight_version": str(version), "flush_cache": self.pause_mode == "abort"}, server=i)
            res = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
            if r.status_code >= 400 or not res.get("success", False):
                error = f"update_weights_from_disk: HTTP {r.status_code}: {res.get('message') or r.text[:300]}"
            elif self.pause_mode != "abort":
                r = await self._post("/flush_cache", {}, server=i)
                if r.status_code != 200:
                    log.info("%s: prefix cache kept after the update (requests held by the %s pause)",
                             self.urls[i], self.pause_mode)
        except EngineError as e:
            error = str(e)
        finally:
            try:
                await self._call(i, "/continue_generation", {})
            except EngineError as e:
                error = f"{error}; " if error else ""
                error += f"continue_generation failed: {e}"
        return error

    async def _wait_idle(self, i: int) -> None:
        """Poll ``/flush_cache`` until 200: no request is running or queued (valid in every version)."""
        t_end = time.monotonic() + self.idle_timeout_s
        while True:
            r = await self._post("/flush_cache", {}, server=i)
            if r.status_code == 200:
                return
            if time.monotonic() > t_end:
                raise EngineError(f"still busy {self.idle_timeout_s:.0f}s after pause(abort): /flush_cache answered "
                                  f"HTTP {r.status_code}", retryable=False)
            await asyncio.sleep(0.1)

    @functools.cached_property
    def memory(self) -> ServerMemory:
        """What each server has released, kept in the server itself (``rollout/memory.py``)."""
        return ServerMemory(self)

    async def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Free the servers' GPU memory (``--enable-memory-saver``); only while no request is in flight. A tag
        a server has released already is not released again (SGLang's scheduler would die)."""
        self._check_tags(tags)
        await each_server(self, "/release_memory_occupation",
                          (self.memory.release(i, list(tags)) for i in range(len(self.urls))))

    async def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Take back what each server has released (of ``tags``, default all), and nothing else: a restarted
        server has nothing released (SGLang's scheduler dies on resuming a tag it does not hold). The weights
        are undefined afterwards: load new ones (``update_weights``)."""
        if tags is not None:
            self._check_tags(tags)
        await each_server(self, "/resume_memory_occupation",
                          (self.memory.resume(i, None if tags is None else list(tags)) for i in range(len(self.urls))))

    @staticmethod
    def _check_tags(tags: Sequence[str]) -> None:
        bad = [t for t in tags if t not in MEMORY_TAGS]
        if bad:
            raise ValueError(f"memory tags {bad}; SGLang knows {list(MEMORY_TAGS)}")

    async def health(self) -> bool:
        """Every server answers ``/v1/models`` (and the router reports them healthy). Not ``/health``: SGLang
        answers it with a one-token generation, which kills a server whose memory is released (>= 0.5.10)."""
        try:
            probes = [u + "/v1/models" for u in self.urls] + ([self.router + "/readiness"] if self.router else [])
            rs = await asyncio.gather(*(self.client.get(u, timeout=10) for u in probes))
        except httpx.HTTPError:
            return False
        return all(r.status_code == 200 for r in rs)

    async def wait_ready(self, deadline_s: float = 600.0, path: str = "/health_generate") -> None:
        """Wait until every server answers ``path`` with 200 and the router (if any) reports them all healthy,
        or raise with the ones that did not."""
        t_end = time.monotonic() + deadline_s
        pending = set(self.urls)
        while pending:
            for u in list(pending):
                try:
                    if (await self.client.get(u + path, timeout=30)).status_code == 200:
                        pending.discard(u)
                except httpx.HTTPError:
                    pass
            if pending:
                if time.monotonic() > t_end:
                    raise EngineError(f"servers not ready after {deadline_s:.0f}s: {sorted(pending)}")
                await asyncio.sleep(0.5)
        if self.router is not None:
            await wait_router_ready(self.router, len(self.urls), max(1.0, t_end - time.monotonic()),
                                    proc=self._router_proc)

    async def aclose(self) -> None:
        await self.client.aclose()
        if self._router_proc is not None:
            await asyncio.to_thread(self._router_proc.stop)


# the launcher moved to rollout/launcher.py; kept importable from here
from jaxrl_term.rollout.launcher import ServerSpec, SGLangLauncher, default_advertise_host  # noqa: E402,F401
