"""SGLang as the rollout engine: an exact token-in/token-out client, weight sync, and a launcher.

Every request sets ``input_ids``, ``return_logprob``, ``stop_token_ids`` and ``max_new_tokens``; token ids and
log-probs come from ``meta_info.output_token_logprobs`` (never from text). ``finish_reason`` is mapped;
``abort`` raises a retryable ``EngineError`` (the trajectory is retried or dropped, never scored). Several
servers: each episode (``session``) sticks to one server for prefix-cache reuse, new sessions go to the least
loaded; or one SGLang router URL with the routing key header. Connection errors and 5xx are retried with
backoff (a dead server is avoided for a while); 4xx are not.

Weight sync (``update_weights(dir, version)``): on every server, pause -> ``/update_weights_from_disk`` with
the version -> continue, then ``/model_info`` must report the new version.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from jaxrl_term.rollout.engine import EngineError, Generation, SamplingParams

log = logging.getLogger(__name__)
ROUTING_HEADER = "X-SMG-Routing-Key"
RETRYABLE = (httpx.ConnectError, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError, httpx.ReadTimeout,
             httpx.ConnectTimeout, httpx.PoolTimeout)


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


def parse_generation(obj: dict) -> Generation:
    """One SGLang ``/generate`` response -> ``Generation``. Abort raises a retryable ``EngineError``."""
    if not isinstance(obj, dict) or "meta_info" not in obj:
        raise EngineError(f"unexpected /generate response: {str(obj)[:300]}", retryable=False)
    meta = obj["meta_info"]
    fr = meta.get("finish_reason") or {}
    kind = fr.get("type") if isinstance(fr, dict) else str(fr)
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


class SGLangEngine:
    """``RolloutEngine`` over one or more SGLang (or ``jaxrl_term.serve``) servers."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        router: bool = False,
        request_timeout_s: float = 3600.0,
        connect_timeout_s: float = 10.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        down_cooldown_s: float = 30.0,
        pause_mode: str = "in_place",
        api_key: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        if not urls:
            raise ValueError("rollout.sglang.urls: give at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.router, self.max_retries, self.backoff_s = router, max_retries, backoff_s
        self.down_cooldown_s, self.pause_mode = down_cooldown_s, pause_mode
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(request_timeout_s, connect=connect_timeout_s), headers=headers,
            transport=transport, limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256),
        )
        self._sessions: dict[str, int] = {}
        self._inflight = [0] * len(self.urls)
        self._down_until = [0.0] * len(self.urls)

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
        last: Exception | None = None
        for attempt in range(self.max_retries + 1):
            i = server if server is not None else self._pick(session)
            headers = {ROUTING_HEADER: session} if (self.router and session) else None
            self._inflight[i] += 1
            try:
                r = await self.client.post(self.urls[i] + path, json=body, headers=headers)
            except RETRYABLE as e:
                last = e
                self._down_until[i] = time.monotonic() + self.down_cooldown_s
            else:
                if r.status_code < 500:
                    return r
                last = EngineError(f"{self.urls[i]}{path}: HTTP {r.status_code}: {r.text[:300]}")
            finally:
                self._inflight[i] -= 1
            if attempt < self.max_retries:
                await asyncio.sleep(self.backoff_s * 2**attempt)
        raise EngineError(f"{path} failed after {self.max_retries + 1} attempts: {type(last).__name__}: {last}",
                          retryable=True)

    # -- protocol ---------------------------------------------------------------------------------
    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, *, session: str | None = None
                       ) -> Generation:
        body = request_body([int(x) for x in input_ids], sampling, uuid.uuid4().hex)
        r = await self._post("/generate", body, session=session)
        if r.status_code >= 400:
            raise EngineError(f"/generate: HTTP {r.status_code}: {r.text[:500]}", retryable=False)
        return parse_generation(r.json())

    async def generate_batch(self, batch: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Generation]:
        """One batched request (a list of prompts); the response is a list in the same order."""
        body = request_body([[int(x) for x in ids] for ids in batch], sampling)
        r = await self._post("/generate", body)
        if r.status_code >= 400:
            raise EngineError(f"/generate: HTTP {r.status_code}: {r.text[:500]}", retryable=False)
        out = r.json()
        if not isinstance(out, list) or len(out) != len(batch):
            raise EngineError("a batched /generate must return one response per prompt", retryable=False)
        return [parse_generation(o) for o in out]

    async def model_info(self, server: int = 0) -> dict:
        r = await self.client.get(self.urls[server] + "/model_info")
        r.raise_for_status()
        return r.json()

    async def update_weights(self, source: Any, version: int) -> None:
        """``source``: an HF directory every server can read (e.g. written by ``save_pretrained``)."""
        path = str(source)
        errors = []
        for i, url in enumerate(self.urls):
            try:
                await self._post("/pause_generation", {"mode": self.pause_mode}, server=i)
                r = await self._post("/update_weights_from_disk", {
                    "model_path": path, "load_format": None, "flush_cache": True, "abort_all_requests": False,
                    "weight_version": str(version)}, server=i)
                res = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
                if r.status_code >= 400 or not res.get("success", False):
                    errors.append(f"{url}: {res.get('message') or r.text[:300]}")
            except EngineError as e:
                errors.append(f"{url}: {e}")
            finally:
                try:
                    await self._post("/continue_generation", {}, server=i)
                except EngineError as e:
                    errors.append(f"{url}: continue_generation failed: {e}")
        for i, url in enumerate(self.urls):
            if any(err.startswith(url) for err in errors):
                continue
            try:
                info = await self.model_info(i)
                if str(info.get("weight_version")) != str(version):
                    errors.append(f"{url}: /model_info reports weight_version {info.get('weight_version')!r}, "
                                  f"expected {version}")
            except httpx.HTTPError as e:
                errors.append(f"{url}: /model_info failed: {e}")
        if errors:
            raise EngineError("weight update to version %s failed on %d server(s): %s"
                              % (version, len(errors), "; ".join(errors)), retryable=False)

    async def health(self) -> bool:
        try:
            rs = await asyncio.gather(*(self.client.get(u + "/health", timeout=10) for u in self.urls))
        except httpx.HTTPError:
            return False
        return all(r.status_code == 200 for r in rs)

    async def wait_ready(self, deadline_s: float = 600.0, path: str = "/health_generate") -> None:
        """Wait until every server answers ``path`` with 200, or raise with the ones that did not."""
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

    async def aclose(self) -> None:
        await self.client.aclose()


# ---------------------------------------------------------------------------------------------- launcher


@dataclasses.dataclass
class ServerSpec:
    port: int
    gpus: str | None = None  # CUDA_VISIBLE_DEVICES, e.g. "0,1"
    tp_size: int = 1


class SGLangLauncher:
    """Start ``python -m sglang.launch_server`` processes (in SGLang's own environment: ``python``), wait until
    each answers ``/health_generate``, stop them cleanly (SIGTERM to the process group, then SIGKILL)."""

    def __init__(self, model_path: str, servers: Sequence[ServerSpec], *, python: str = "python",
                 module: str = "sglang.launch_server", host: str = "127.0.0.1", mem_fraction_static: float = 0.7,
                 context_length: int | None = None, extra_args: Sequence[str] = (), log_dir: str = "runs/sglang"):
        self.model_path, self.servers, self.python, self.module = model_path, list(servers), python, module
        self.host, self.mem, self.ctx, self.extra = host, mem_fraction_static, context_length, list(extra_args)
        self.log_dir = Path(log_dir)
        self.procs: list[subprocess.Popen] = []

    @property
    def urls(self) -> list[str]:
        return [f"http://{self.host}:{s.port}" for s in self.servers]

    def command(self, s: ServerSpec) -> list[str]:
        cmd = [self.python, "-m", self.module, "--model-path", self.model_path, "--host", self.host,
               "--port", str(s.port), "--tp-size", str(s.tp_size), "--mem-fraction-static", str(self.mem)]
        if self.ctx:
            cmd += ["--context-length", str(self.ctx)]
        return cmd + self.extra

    def start(self) -> list[str]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for s in self.servers:
            env = dict(os.environ)
            if s.gpus is not None:
                env["CUDA_VISIBLE_DEVICES"] = s.gpus
            logf = open(self.log_dir / f"server-{s.port}.log", "ab")
            self.procs.append(subprocess.Popen(self.command(s), stdout=logf, stderr=subprocess.STDOUT, env=env,
                                               start_new_session=True))
        return self.urls

    async def wait_ready(self, deadline_s: float = 900.0) -> None:
        t_end = time.monotonic() + deadline_s
        async with httpx.AsyncClient(timeout=30) as c:
            pending = dict(zip(self.urls, self.procs))
            while pending:
                for url, p in list(pending.items()):
                    if p.poll() is not None:
                        log_path = self.log_dir / f"server-{url.rsplit(':', 1)[1]}.log"
                        tail = log_path.read_text(errors="replace")[-3000:] if log_path.exists() else ""
                        raise EngineError(f"server {url} exited with code {p.returncode}:\n{tail}", retryable=False)
                    try:
                        if (await c.get(url + "/health_generate")).status_code == 200:
                            del pending[url]
                    except httpx.HTTPError:
                        pass
                if pending:
                    if time.monotonic() > t_end:
                        raise EngineError(f"servers not ready after {deadline_s:.0f}s: {sorted(pending)}")
                    await asyncio.sleep(1.0)

    def stop(self, timeout_s: float = 30.0) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        t_end = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(max(0.1, t_end - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.procs.clear()
