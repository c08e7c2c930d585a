"""A chat-level engine for evaluation: any OpenAI-compatible ``/chat/completions`` endpoint (closed models,
vLLM, SGLang's ``/v1``, ``jaxrl_term.serve``) through the same text scaffolds.

The agent loop is token-level; a chat engine gets the conversation as messages instead (``chat``) and returns
the reply's text with its ids under *our* tokenizer (special-token strings kept as text), which only serve to
count tokens for the context and observation budgets. Log-probs are 0 and no weight version is known: such
episodes are for evaluation, never for training. Retries 429 / 5xx / connection errors with exponential
backoff (``Retry-After`` honoured); a 4xx other than 408/409/429 is the request's fault and is not retried, except
a 400 saying the conversation exceeds the model's context: that ends the episode as ``context_full`` (scored),
as a full context does with a token-level engine.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import re
from collections.abc import Sequence

import httpx

from jaxrl_term.rollout.engine import EngineError, Generation, SamplingParams, TroubleLog

log = logging.getLogger(__name__)
RETRY_STATUS = {408, 409, 429, 500, 502, 503, 504}
# a 400 that says the conversation is longer than the model's context (OpenAI's code, vLLM's / SGLang's messages)
CONTEXT_FULL = re.compile(r"context_length_exceeded|maximum context length|longer than the model's context|"
                          r"context window|prompt is too long", re.IGNORECASE)


class OpenAIChatEngine(TroubleLog):
    """``chat(messages, sampling)`` -> ``Generation`` (with ``text``) from ``{base_url}/chat/completions``."""

    def __init__(self, base_url: str, model: str, tokenizer, *, api_key: str | None = None,
                 request_timeout_s: float = 300.0, max_retries: int = 4, backoff_s: float = 1.0,
                 max_backoff_s: float = 60.0):
        super().__init__()
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.tok = model, tokenizer
        self.max_retries, self.backoff_s, self.max_backoff_s = max_retries, backoff_s, max_backoff_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(timeout=request_timeout_s, headers=headers)
        self.eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")

    @classmethod
    def from_config(cls, policy, tokenizer) -> OpenAIChatEngine:
        key = os.environ.get(policy.api_key_env) if policy.api_key_env else None
        return cls(policy.base_url, policy.model, tokenizer, api_key=key, request_timeout_s=policy.request_timeout_s,
                   max_retries=policy.max_retries)

    async def chat(self, messages: Sequence[dict], sampling: SamplingParams, *, session: str | None = None
                   ) -> Generation:
        body = {"model": self.model, "messages": [{"role": m["role"], "content": m["content"]} for m in messages],
                "temperature": sampling.temperature, "top_p": sampling.top_p, "max_tokens": sampling.max_new_tokens}
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        self.clear_trouble(session)
        data = await self._post(body, session)
        self.clear_trouble(session)
        if isinstance(data, dict) and data.get("context_full") is True:  # the conversation no longer fits: the episode's context is full
            return Generation([], [], "length", text="")
        try:
            choice = data["choices"][0]
            text = choice["message"].get("content") or ""
            finish = choice.get("finish_reason") or "stop"
        except (KeyError, IndexError, TypeError, AttributeError) as e:
            raise EngineError(f"{self.url}: unexpected response ({type(e).__name__}: {str(data)[:200]})") from e
        ids = self.tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        if finish == "length":
            ids = ids[: sampling.max_new_tokens] or ids
            return Generation(ids, [0.0] * len(ids), "length", text=text)
        ids = ids + [self.eos_id]
        return Generation(ids, [0.0] * len(ids), "stop", matched_stop=self.eos_id, text=text)

    async def _post(self, body: dict, session: str | None = None) -> dict:
        last = ""
        for attempt in range(self.max_retries + 1):
            wait = min(self.max_backoff_s, self.backoff_s * 2**attempt) * (0.5 + random.random() / 2)
            try:
                r = await self._client.post(self.url, json=body)
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}: {e}"
            else:
                if r.status_code == 200:
                    try:
                        return r.json()
                    except ValueError:
                        last = f"HTTP 200 with a body that is not JSON: {r.text[:200]!r}"
                elif r.status_code in RETRY_STATUS:
                    last = f"HTTP {r.status_code}: {r.text[:200]}"
                    after = r.headers.get("retry-after")
                    if after and after.replace(".", "", 1).isdigit():
                        wait = min(self.max_backoff_s, float(after))
                elif r.status_code in (400, 413) and CONTEXT_FULL.search(r.text):
                    return {"context_full": True}
                else:
                    raise EngineError(f"{self.url}: HTTP {r.status_code}: {r.text[:300]}", retryable=False)
            self.note_trouble(session, last)
            if attempt < self.max_retries:
                log.warning("%s: %s; retrying in %.1fs", self.url, last, wait)
                await asyncio.sleep(wait)
        raise EngineError(f"{self.url}: {last} (after {self.max_retries} retries)")

    async def generate(self, input_ids, sampling: SamplingParams, *, session: str | None = None) -> Generation:
        raise EngineError("an OpenAI chat endpoint takes messages, not token ids (the agent loop calls chat())",
                          retryable=False)

    async def update_weights(self, source, version: int) -> None:
        raise EngineError("a remote chat endpoint's weights cannot be updated", retryable=False)

    async def health(self) -> bool:
        return True

    async def aclose(self) -> None:
        await self._client.aclose()
