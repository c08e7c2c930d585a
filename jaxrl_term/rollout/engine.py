"""The rollout engine protocol: token ids in, token ids and fp32 log-probs out.

``SGLangEngine`` (servers on GPU clusters) and ``JaxEngine`` (embedded) implement it; the agent loop and the
trainer never know which. No JAX here: the agent loop imports this module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

FINISH_REASONS = ("stop", "length", "abort")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = no top-k
    max_new_tokens: int = 512
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings (matched on decoded text by the engine)
    seed: int | None = None

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"sampling.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")

    def replace(self, **kw: Any) -> SamplingParams:
        return dataclasses.replace(self, **kw)


@dataclasses.dataclass(frozen=True)
class Generation:
    output_ids: list[int]  # includes the matched stop token / EOS, exactly as sampled
    output_logprobs: list[float]  # fp32 log-prob of each output id under the sampling distribution
    finish_reason: str  # stop | length | abort
    weight_version: int | None = None
    matched_stop: int | str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    text: str | None = None  # a chat engine's reply as text (the ids then only count tokens)

    def __post_init__(self):
        if len(self.output_ids) != len(self.output_logprobs):
            raise ValueError(
                f"engine returned {len(self.output_ids)} ids but {len(self.output_logprobs)} log-probs"
            )
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason {self.finish_reason!r}; expected one of {FINISH_REASONS}")


class EngineError(RuntimeError):
    """The engine could not produce a generation. ``retryable``: an abort, a 5xx or a lost connection."""

    def __init__(self, message: str, retryable: bool = True):
        super().__init__(message)
        self.retryable = retryable


class TroubleLog:
    """What went wrong in a session's request in flight, for an engine that retries inside one request.

    When the agent's deadline cancels a request that was retrying (server errors, 429, lost connections), the
    episode ran out of time because of the infrastructure, not the policy: the loop asks ``trouble(session)`` and
    ends the episode as an engine error (retried or dropped) rather than an agent timeout (scored)."""

    def __init__(self) -> None:
        self._trouble: dict[str, str] = {}

    def note_trouble(self, session: str | None, message: str) -> None:
        if session is not None:
            self._trouble[session] = message

    def clear_trouble(self, session: str | None) -> None:
        if session is not None:
            self._trouble.pop(session, None)

    def trouble(self, session: str | None) -> str | None:
        """The last retryable failure of the session's current (or just-cancelled) request; None if none."""
        return self._trouble.pop(session, None) if session is not None else None


@runtime_checkable
class RolloutEngine(Protocol):
    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, *,
                       session: str | None = None) -> Generation:
        """``session`` (one per episode) lets multi-server engines keep an episode's turns on one server."""
        ...

    async def update_weights(self, source: Any, version: int) -> None:
        """``source``: a directory of HF safetensors (servers) or live params (embedded engine)."""
        ...

    async def health(self) -> bool: ...
