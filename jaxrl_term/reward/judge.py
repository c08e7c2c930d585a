"""An LLM judge of *how* the agent worked, over OpenAI-compatible chat completions, one judge per group.

**Missing means the infrastructure failed, never the trajectory.** Failures are of two kinds:
- infrastructure (``INFRA``): 429, 5xx, timeouts, connection errors, a missing or rejected API key, a wrong
  URL or model (404, a 400 that names the model or key), malformed responses. The endpoint is retried
  (``retries``, honouring ``Retry-After``), then the next endpoint is asked; when every endpoint fails for
  ``rounds`` rounds the judgement is *missing*.
- caused by the prompt (``PROMPT``): a context-length error, a content filter, any other 400/422 rejection
  of the request (``bad_request``: only the prompt varies between requests), a refusal or an answer that
  stays unparsable after one repair, a truncated answer. The trajectory is rendered again smaller
  (``shrink`` x the budget) and asked again on the same endpoint; if that fails too the judge part is **0**
  (``JudgeResult.zeroed`` names why). Making the judge fail is never a way out of a bad judgement.

**One judge per group.** Judges score at different levels (Terminal-Bench-RL measured mean scores of 0.26 and
0.76 on the same cases), and group-relative advantages compare trajectories of one group, so
``judge_group`` scores every trajectory of a group on one endpoint. If that endpoint fails part-way (an
infrastructure failure after its retries), the whole group is judged again on the next endpoint; the
residual skew within a group is zero by construction.

**Breakers** (``judge_breaker.py``) count consecutive infrastructure failures per endpoint (prompt-caused
failures prove the endpoint is up and count as successes): after ``failure_threshold`` the endpoint is
skipped for ``cooldown_s`` (or the server's ``Retry-After``), then one trial request decides; a trial that is
cancelled releases the half-open state, and a cached answer is no trial. A ``Retry-After`` below the
threshold still holds the endpoint until then.

Each endpoint renders the transcript for its own ``context_tokens - max_tokens`` (``judge_render.py``). The
cache is keyed by (endpoint, model, hash of the prompt without its boundary), so it hits. Token usage,
``finish_reason`` and a cost estimate (``usd_per_mtok_in`` / ``usd_per_mtok_out``) go to the metrics.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import time
from collections.abc import Sequence

import httpx

from jaxrl_term.reward.judge_breaker import CircuitBreaker, retry_after_s
from jaxrl_term.reward.judge_parse import parse_score
from jaxrl_term.reward.judge_render import REPAIR, estimate_tokens, render_prompt

log = logging.getLogger(__name__)

__all__ = [
    "INFRA",
    "PROMPT",
    "CircuitBreaker",
    "GroupJudgement",
    "JudgeClient",
    "JudgeEndpoint",
    "JudgeFailure",
    "JudgeResult",
    "endpoints_from_config",
    "parse_score",
    "render_prompt",
]

INFRA = ("rate_limited", "server_error", "timeout", "connection", "no_api_key", "auth", "client_error",
         "bad_response", "unavailable")
PROMPT = ("context_length", "content_filter", "bad_request", "unparsable", "truncated")
_CONTEXT = ("context length", "context_length", "maximum context", "context window", "too many tokens",
            "prompt is too long", "input is too long", "maximum input length", "reduce the length", "too long for")
_FILTER = ("content_filter", "content filter", "content management policy", "responsibleaipolicyviolation",
           "safety system", "flagged", "moderation", "policy violation")
# a 400 that is about the endpoint's configuration, not the prompt: infrastructure (missing, never 0)
_CONFIG = ("not a valid model", "invalid model", "unknown model", "model not found", "no such model",
           "does not exist", "api key", "api_key", "unauthorized", "no endpoints found", "max_tokens",
           "temperature", "unsupported parameter", "unrecognized request argument")  # after _CONTEXT's check


@dataclasses.dataclass(frozen=True)
class JudgeEndpoint:
    name: str
    base_url: str  # e.g. https://openrouter.ai/api/v1 (…/chat/completions is appended)
    model: str
    api_key_env: str | None = None
    timeout_s: float = 60.0
    max_concurrency: int = 4
    max_tokens: int = 4096  # room for judges that reason before the JSON
    temperature: float = 0.0
    context_tokens: int = 32768  # the model's context window: the prompt is rendered for what is left
    bytes_per_token: float = 3.0  # the prompt's size estimate (UTF-8 bytes per token)
    usd_per_mtok_in: float = 0.0  # prices for the cost estimate
    usd_per_mtok_out: float = 0.0

    def __post_init__(self):
        if self.prompt_budget < 2000:
            raise ValueError(f"judge endpoint {self.name}: context_tokens={self.context_tokens} - max_tokens="
                             f"{self.max_tokens} leaves {self.prompt_budget} tokens for the prompt; the rubric and a "
                             "transcript need at least 2000 (raise context_tokens or lower max_tokens)")

    @property
    def prompt_budget(self) -> int:
        return self.context_tokens - self.max_tokens - 256


class JudgeFailure(Exception):
    def __init__(self, kind: str, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.kind, self.retry_after = kind, retry_after

    @property
    def prompt_caused(self) -> bool:
        return self.kind in PROMPT


@dataclasses.dataclass
class JudgeResult:
    score: float | None
    endpoint: str | None
    reasoning: str = ""
    cached: bool = False
    attempts: list[dict] = dataclasses.field(default_factory=list)  # endpoint, outcome, latency_s, error
    zeroed: str | None = None  # the prompt-caused failure that scored this trajectory 0
    shrunk: bool = False  # scored on the smaller rendering

    @property
    def missing(self) -> bool:
        return self.score is None


@dataclasses.dataclass
class GroupJudgement:
    endpoint: str | None  # the one endpoint that scored every trajectory; None when the group is missing
    results: list[JudgeResult]
    attempts: list[dict]

    @property
    def missing(self) -> bool:
        return self.endpoint is None


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()


class JudgeClient:
    def __init__(self, endpoints: Sequence[JudgeEndpoint], *, failure_threshold: int = 2, cooldown_s: float = 60.0,
                 rounds: int = 2, backoff_s: float = 2.0, cache_size: int = 10000,
                 max_transcript_chars: int | None = None, retries: int = 1, max_retry_after_s: float = 30.0,
                 shrink: float = 0.4, transport: httpx.AsyncBaseTransport | None = None):
        if not endpoints:
            raise ValueError("reward.judge.endpoints: give at least one judge endpoint")
        if len({e.name for e in endpoints}) != len(endpoints):
            raise ValueError("reward.judge.endpoints: endpoint names must be unique (breakers and metrics use them)")
        self.endpoints = list(endpoints)
        self.breakers = {e.name: CircuitBreaker(failure_threshold, cooldown_s) for e in self.endpoints}
        self.sems = {e.name: asyncio.Semaphore(e.max_concurrency) for e in self.endpoints}
        self.rounds, self.backoff_s, self.retries = rounds, backoff_s, retries
        self.max_retry_after_s, self.shrink = max_retry_after_s, shrink
        self.max_transcript_chars = max_transcript_chars
        self.cache: collections.OrderedDict[str, JudgeResult] = collections.OrderedDict()
        self.cache_size = cache_size
        self.http = httpx.AsyncClient(transport=transport, limits=httpx.Limits(max_connections=256))
        self.stats: collections.Counter = collections.Counter()
        self.cost_usd_total = 0.0

    async def aclose(self) -> None:
        await self.http.aclose()

    def take_stats(self) -> dict[str, float]:
        out = {f"judge/{k}": v for k, v in self.stats.items()}
        out["judge/cost_usd_total"] = round(self.cost_usd_total, 6)
        self.stats.clear()
        return out

    # -- groups -------------------------------------------------------------------------------------
    async def score(self, task, trajectory, deadline: float | None = None) -> JudgeResult:
        """One trajectory (a group of one)."""
        g = await self.judge_group(task, [trajectory], deadline)
        r = g.results[0]
        r.attempts = g.attempts
        return r

    async def judge_group(self, task, trajectories: Sequence, deadline: float | None = None) -> GroupJudgement:
        """Every trajectory scored by one endpoint, or the whole group missing. ``deadline``: time.monotonic()."""
        attempts: list[dict] = []
        if not trajectories:
            return GroupJudgement("", [], attempts)
        for rnd in range(self.rounds):
            for ep in self.endpoints:
                left = _left(deadline)
                if left is not None and left <= 0:
                    break
                if not self.breakers[ep.name].available():
                    attempts.append({"endpoint": ep.name, "outcome": "skipped_unavailable", "latency_s": 0.0})
                    self.stats[f"{ep.name}/skipped"] += 1
                    continue
                t0 = time.monotonic()
                try:
                    results = await self._group_on(ep, task, trajectories, deadline)
                except JudgeFailure as f:
                    attempts.append({"endpoint": ep.name, "outcome": f.kind, "latency_s": time.monotonic() - t0,
                                     "error": str(f)[:300]})
                    self.stats["group_endpoint_failed"] += 1
                    log.info("judge %s failed a group of %d (%s): %s", ep.name, len(trajectories), f.kind, str(f)[:200])
                    continue
                if attempts:
                    self.stats["group_failovers"] += 1  # the whole group was judged again here
                attempts.append({"endpoint": ep.name, "outcome": "ok", "latency_s": time.monotonic() - t0})
                self.stats[f"{ep.name}/groups"] += 1
                return GroupJudgement(ep.name, results, attempts)
            left = _left(deadline)
            if rnd + 1 < self.rounds and (left is None or left > 0):
                pause = self.backoff_s * 2**rnd
                await asyncio.sleep(pause if left is None else min(pause, left))
        self.stats["groups_missing"] += 1
        return GroupJudgement(None, [JudgeResult(None, None) for _ in trajectories], attempts)

    async def _group_on(self, ep: JudgeEndpoint, task, trajectories: Sequence, deadline: float | None) -> list:
        """Score every trajectory on ``ep`` concurrently; the first infrastructure failure cancels the rest."""
        first: list[JudgeResult] = []
        rest = list(trajectories)
        while rest and self.breakers[ep.name].half_open():  # one at a time until a trial request closes it
            try:  # (a cached answer makes no request, so the next trajectory is the trial)
                async with asyncio.timeout(_left(deadline)):  # not wait_for: on 3.11 it can swallow a cancellation
                    first.append(await self.judge_one(ep, task, rest.pop(0), deadline=deadline))
            except TimeoutError as e:
                raise JudgeFailure("timeout", "the group's deadline passed") from e
        tasks = [asyncio.ensure_future(self.judge_one(ep, task, t, deadline=deadline)) for t in rest]
        try:
            pending = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending, timeout=_left(deadline),
                                                   return_when=asyncio.FIRST_EXCEPTION)
                if not done:
                    raise JudgeFailure("timeout", "the group's deadline passed")
                for t in done:
                    if t.exception() is not None:
                        raise t.exception()
            return first + [t.result() for t in tasks]
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- one trajectory on one endpoint ------------------------------------------------------------------
    def _budget(self, ep: JudgeEndpoint) -> tuple[int, float | None]:
        cap = None if not self.max_transcript_chars else self.max_transcript_chars / ep.bytes_per_token
        return ep.prompt_budget, cap

    async def judge_one(self, ep: JudgeEndpoint, task, trajectory, *, deadline: float | None = None,
                        seed: int | None = None, temperature: float | None = None,
                        use_cache: bool = True) -> JudgeResult:
        """A score from ``ep`` (0 with ``zeroed`` set when the trajectory breaks the judge at both sizes), or
        ``JudgeFailure`` for an infrastructure failure."""
        budget, cap = self._budget(ep)
        attempts: list[dict] = []
        key, res, last = None, None, None
        for level, frac in enumerate((1.0, self.shrink)):
            prompt = render_prompt(task, trajectory, int(budget * frac), ep.bytes_per_token,
                                   transcript_cap_tokens=None if cap is None else cap * frac)
            if level == 0:
                key = f"{ep.name}\x1f{ep.model}\x1f{prompt.key}"
                if use_cache and key in self.cache:
                    self.cache.move_to_end(key)
                    self.stats["cache_hits"] += 1
                    return dataclasses.replace(self.cache[key], cached=True, attempts=[])
            t0 = time.monotonic()
            try:
                s, why = await self._ask(ep, prompt.messages, deadline, seed, temperature)
            except JudgeFailure as f:
                attempts.append({"endpoint": ep.name, "outcome": f.kind, "latency_s": time.monotonic() - t0,
                                 "error": str(f)[:300], "est_tokens": prompt.est_tokens})
                if not f.prompt_caused:
                    raise
                last = f
                continue
            attempts.append({"endpoint": ep.name, "outcome": "ok", "latency_s": time.monotonic() - t0})
            res = JudgeResult(s, ep.name, why, attempts=attempts, shrunk=level > 0)
            if level > 0:
                self.stats[f"{ep.name}/shrunk"] += 1
            break
        if res is None:  # the trajectory broke the judge at both sizes: the judge part is 0, not missing
            self.stats["zeroed"] += 1
            self.stats[f"{ep.name}/zeroed_{last.kind}"] += 1
            why = f"scored 0: the judge failed on this trajectory ({last.kind}: {last})"[:500]
            log.warning("judge %s %s", ep.name, why)  # loud: a misconfigured endpoint would zero every group
            res = JudgeResult(0.0, ep.name, why, attempts=attempts, zeroed=last.kind)
        if use_cache and self.cache_size > 0:
            self.cache[key] = dataclasses.replace(res, attempts=[])
            if len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        return res

    async def _ask(self, ep: JudgeEndpoint, messages: list[dict], deadline, seed, temperature) -> tuple[float, str]:
        """One prompt on one endpoint, retried on infrastructure failures (``Retry-After`` honoured)."""
        br = self.breakers[ep.name]
        for attempt in range(self.retries + 1):
            wait, left = br.wait_s(), _left(deadline)
            if wait > 0:
                if wait > self.max_retry_after_s or (left is not None and left < wait):
                    raise JudgeFailure("unavailable", f"{ep.name} asked to wait {wait:.1f}s (Retry-After)")
                await asyncio.sleep(wait)
            try:
                return await self._ask_once(ep, messages, seed, temperature)
            except JudgeFailure as f:
                if f.prompt_caused or f.kind in ("no_api_key", "auth", "unavailable") or attempt == self.retries:
                    raise
                pause = 0.0 if f.retry_after is not None else self.backoff_s * 2**attempt  # Retry-After: wait_s()
                left = _left(deadline)
                if left is not None and left <= pause:
                    raise
                await asyncio.sleep(pause)
        raise AssertionError("unreachable")

    async def _ask_once(self, ep: JudgeEndpoint, messages: list[dict], seed, temperature) -> tuple[float, str]:
        headers = {}
        if ep.api_key_env:
            key = os.environ.get(ep.api_key_env)
            if not key:
                self.stats[f"{ep.name}/no_api_key"] += 1
                raise JudgeFailure("no_api_key", f"environment variable {ep.api_key_env} is not set")
            headers["Authorization"] = f"Bearer {key}"
        br = self.breakers[ep.name]
        trial = br.enter()
        if trial is None:
            raise JudgeFailure("unavailable", f"{ep.name}: circuit breaker open or Retry-After pending")
        settled = False
        try:
            async with self.sems[ep.name]:
                try:
                    out = await self._answer(ep, messages, headers, seed, temperature)
                except JudgeFailure as f:
                    br.settle(trial, ok=f.prompt_caused, retry_after=f.retry_after)  # prompt-caused: the endpoint is up
                    settled = True
                    self.stats[f"{ep.name}/{f.kind}"] += 1
                    log.info("judge %s: %s: %s", ep.name, f.kind, str(f)[:200])
                    raise
                br.settle(trial, ok=True)
                settled = True
                self.stats[f"{ep.name}/ok"] += 1
                return out
        finally:
            if not settled:
                br.abandon(trial)

    async def _answer(self, ep, messages, headers, seed, temperature) -> tuple[float, str]:
        text, finish = await self._complete(ep, messages, headers, seed, temperature)
        try:
            return parse_score(text)
        except ValueError:
            self.stats[f"{ep.name}/repairs"] += 1
            repair = [*messages, {"role": "assistant", "content": text}, {"role": "user", "content": REPAIR}]
            text2, finish2 = await self._complete(ep, repair, headers, seed, temperature)
            try:
                return parse_score(text2)
            except ValueError as e:
                kind = "truncated" if "length" in (finish, finish2) else "unparsable"
                raise JudgeFailure(kind, f"after one repair: {e}: {text2[:200]!r}") from e

    async def _complete(self, ep: JudgeEndpoint, messages, headers, seed, temperature) -> tuple[str, str]:
        body = {"model": ep.model, "messages": messages, "max_tokens": ep.max_tokens,
                "temperature": ep.temperature if temperature is None else temperature}
        if seed is not None:
            body["seed"] = seed
        try:
            r = await self.http.post(ep.base_url.rstrip("/") + "/chat/completions", json=body, headers=headers,
                                     timeout=ep.timeout_s)
        except httpx.TimeoutException as e:
            raise JudgeFailure("timeout", f"no answer within {ep.timeout_s:.0f}s") from e
        except httpx.HTTPError as e:
            raise JudgeFailure("connection", f"{type(e).__name__}: {e}") from e
        code, low = r.status_code, r.text[:4000].lower()
        if code == 429:
            raise JudgeFailure("rate_limited", "HTTP 429", retry_after_s(r.headers.get("retry-after")))
        if code >= 500:
            raise JudgeFailure("server_error", f"HTTP {code}: {r.text[:200]}",
                               retry_after_s(r.headers.get("retry-after")))
        if code >= 400:
            if code == 413 or any(k in low for k in _CONTEXT):
                kind = "context_length"
            elif any(k in low for k in _FILTER):
                kind = "content_filter"
            elif code in (400, 422) and not any(k in low for k in _CONFIG):
                kind = "bad_request"  # the request differs from a good one only in its prompt
            else:
                kind = {401: "auth", 403: "auth", 408: "timeout"}.get(code, "client_error")
            raise JudgeFailure(kind, f"HTTP {code}: {r.text[:200]}")
        try:
            data = r.json()
            choice = data["choices"][0]
            text, finish = choice["message"].get("content") or "", str(choice.get("finish_reason") or "none")
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
            raise JudgeFailure("bad_response", f"not a chat completion response: {r.text[:200]}") from e
        self._count_usage(ep, data.get("usage") or {}, finish, messages)
        if finish == "content_filter":
            raise JudgeFailure("content_filter", "the answer was withheld by a content filter (finish_reason)")
        return text, finish

    def _count_usage(self, ep: JudgeEndpoint, usage: dict, finish: str, messages) -> None:
        pt = usage.get("prompt_tokens")
        if not isinstance(pt, int):  # no usage reported: estimate, and say so
            pt = sum(estimate_tokens(m["content"], ep.bytes_per_token) for m in messages)
            self.stats[f"{ep.name}/usage_estimated"] += 1
        ct = usage.get("completion_tokens") if isinstance(usage.get("completion_tokens"), int) else 0
        rt = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
        self.stats[f"{ep.name}/prompt_tokens"] += pt
        self.stats[f"{ep.name}/completion_tokens"] += ct
        if rt:
            self.stats[f"{ep.name}/reasoning_tokens"] += rt
        self.stats[f"{ep.name}/finish_{finish}"] += 1
        cost = (pt * ep.usd_per_mtok_in + ct * ep.usd_per_mtok_out) / 1e6
        if cost:
            self.stats["cost_usd"] += cost
            self.cost_usd_total += cost
        if finish == "length":
            log.warning("judge %s stopped at max_tokens=%d (finish_reason=length); judges that reason first need "
                        "more", ep.name, ep.max_tokens)


def endpoints_from_config(items) -> list[JudgeEndpoint]:
    fields = {f.name for f in dataclasses.fields(JudgeEndpoint)}
    out = []
    for i, it in enumerate(items):
        it = dict(it)
        unknown = set(it) - fields
        if unknown:
            raise ValueError(f"reward.judge.endpoints[{i}]: unknown keys {sorted(unknown)}; known: {sorted(fields)}")
        out.append(JudgeEndpoint(**it))
    return out
