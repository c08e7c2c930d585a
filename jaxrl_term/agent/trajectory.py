"""A trajectory: the exact token stream the policy saw and produced, with everything needed to train on it
and to audit it. No JAX here."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# no_action: the reply attempted no action and the scaffold ends the episode on it (Terminal-Bench-RL's rule)
END_REASONS = ("finished", "no_action", "max_turns", "context_full", "timeout", "parse_errors", "engine_error",
               "sandbox_error")
INVALID_ENDS = ("engine_error", "sandbox_error")  # retry or drop; never a 0 reward
MASK_TURNS = ("none", "malformed")  # algo.mask_turns: which turns' tokens leave the loss


@dataclasses.dataclass
class TurnRecord:
    index: int
    start: int  # position in token_ids of the turn's first engine token
    n_output: int  # engine tokens (loss mask 1)
    n_observation: int  # observation delta tokens appended after them (loss mask 0)
    text: str  # the engine output, decoded
    actions: list[dict]  # {"tool", "args"}
    errors: list[str]  # parse errors
    results: list[dict]  # {"tool", "ok", "text", "exit_code", "timed_out", "duration_s"}
    finish_reason: str
    gen_s: float
    tool_s: float
    weight_version: int | None = None


@dataclasses.dataclass
class Trajectory:
    task_id: str
    scaffold: str
    token_ids: list[int]
    loss_mask: list[int]  # 1 exactly on engine-produced tokens
    logprobs: list[float]  # the engine's fp32 log-prob on masked tokens, 0 elsewhere
    prompt_len: int
    messages: list[dict]  # the conversation as chat messages (for the drift check and the judge)
    turns: list[TurnRecord]
    end_reason: str
    error: str | None = None
    duration_s: float = 0.0
    reward: float | None = None
    reward_parts: dict[str, Any] = dataclasses.field(default_factory=dict)
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def valid(self) -> bool:
        return self.end_reason not in INVALID_ENDS

    @property
    def num_policy_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def weight_versions(self) -> list[int]:
        return sorted({t.weight_version for t in self.turns if t.weight_version is not None})

    def malformed_turns(self) -> list[int]:
        """Indices of the turns whose reply had a parse error or was cut at the token limit."""
        return [t.index for t in self.turns if t.errors or t.finish_reason == "length"]

    def train_mask(self, mask_turns: str = "none") -> list[int]:
        """The loss mask the trainer uses: ``loss_mask``, less the tokens of the turns ``mask_turns`` names
        (``malformed``: those of ``malformed_turns``)."""
        if mask_turns not in MASK_TURNS:
            raise ValueError(f"algo.mask_turns={mask_turns!r}; use one of {MASK_TURNS}")
        mask = list(self.loss_mask)
        if mask_turns == "malformed":
            drop = set(self.malformed_turns())
            for t in self.turns:
                if t.index in drop:
                    mask[t.start:t.start + t.n_output] = [0] * t.n_output
        return mask

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Trajectory:
        d = dict(d)
        d["turns"] = [TurnRecord(**t) for t in d.get("turns", [])]
        return cls(**d)

    def check(self) -> None:
        """Internal consistency: equal lengths, mask and log-probs where the turns say."""
        n = len(self.token_ids)
        if not (len(self.loss_mask) == len(self.logprobs) == n):
            raise ValueError(f"trajectory {self.task_id}: ids {n}, mask {len(self.loss_mask)}, "
                             f"logprobs {len(self.logprobs)}")
        expect = [0] * n
        for t in self.turns:
            for i in range(t.start, t.start + t.n_output):
                expect[i] = 1
        if expect != list(self.loss_mask):
            raise ValueError(f"trajectory {self.task_id}: loss mask does not match the engine's turns")


def write_jsonl(path: str | os.PathLike, trajectories: Iterable[Trajectory], append: bool = True) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a" if append else "w") as f:
        for t in trajectories:
            f.write(json.dumps(t.to_dict(), ensure_ascii=False) + "\n")


def read_jsonl(path: str | os.PathLike) -> list[Trajectory]:
    with open(path) as f:
        return [Trajectory.from_dict(json.loads(line)) for line in f if line.strip()]


@dataclasses.dataclass(frozen=True)
class DriftReport:
    equal: bool  # no difference left once the explained ones (``notes``) are accounted for
    first_diff: int | None  # first token index where the stream and a fresh rendering differ (unexplained)
    stream_len: int
    render_len: int
    stream_context: str = ""
    render_context: str = ""
    notes: tuple[str, ...] = ()  # differences that are expected, and why


EOT_NOTE = ("turn {k} was stopped by <|endoftext|>: the stream keeps that sampled token before the <|im_end|> "
            "the loop added; a rendering has only the <|im_end|>")
FINAL_THINK_NOTE = ("the final assistant turn has no reasoning: the template renders an empty think block there "
                    "(Qwen3 does for the turn after the last user query), the model wrote none")


def check_drift(traj: Trajectory, tokenizer, *, tools=None, enable_thinking: bool | None = None) -> DriftReport:
    """Re-render ``traj.messages`` with the chat template and compare with the token stream.

    The rendering is encoded as the loop encodes observations (special-token text in contents stays plain).
    Two differences are expected and explained in ``notes`` rather than reported: a turn stopped by
    ``<|endoftext|>`` (the stream keeps the sampled token), and the empty think block the template adds to a
    final assistant turn without reasoning. Others are reported: Qwen3 drops the reasoning of assistant turns
    before the last user query, and re-tokenising text can differ from what was sampled; the report says where
    the first one is.
    """
    from jaxrl_term.agent.chat import ChatDelta

    delta = ChatDelta(tokenizer, tools, enable_thinking)
    gen_prompt = traj.messages[-1]["role"] != "assistant"
    rendered = delta.render_ids(traj.messages, gen_prompt)
    closed_eot = _eot_positions(traj, delta)
    notes = [EOT_NOTE.format(k=k) for k, t in enumerate(traj.turns) if t.start + t.n_output - 1 in closed_eot]
    stream = [x for i, x in enumerate(traj.token_ids) if i not in closed_eot]

    def trim(r: list[int]) -> list[int]:  # the template's newline after the final <|im_end|>
        extra = r[len(stream):]
        return r[: len(stream)] if not gen_prompt and extra and delta.decode(extra).strip() == "" else r

    rendered = trim(rendered)
    first = _first_diff(stream, rendered)
    if first is not None and not gen_prompt and traj.turns:
        last_start = traj.turns[-1].start - sum(1 for i in closed_eot if i < traj.turns[-1].start)
        empty = delta.encode("<think>\n\n</think>\n\n")
        if first == last_start and rendered[first: first + len(empty)] == empty:
            rendered = trim(rendered[:first] + rendered[first + len(empty):])
            notes.append(FINAL_THINK_NOTE)
            first = _first_diff(stream, rendered)
    if first is None:
        return DriftReport(True, None, len(stream), len(rendered), notes=tuple(notes))
    lo = max(0, first - 8)
    return DriftReport(False, first, len(stream), len(rendered), delta.decode(stream[lo: first + 24]),
                       delta.decode(rendered[lo: first + 24]), tuple(notes))


def _eot_positions(traj: Trajectory, delta) -> set[int]:
    """Positions of the <|endoftext|> tokens that ended turns the loop then closed with <|im_end|>."""
    s = traj.token_ids
    if delta.eot_id is None:
        return set()
    return {t.start + t.n_output - 1 for t in traj.turns
            if t.n_output and t.start + t.n_output < len(s) and s[t.start + t.n_output - 1] == delta.eot_id
            and s[t.start + t.n_output] == delta.eos_id}


def _first_diff(a: list[int], b: list[int]) -> int | None:
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if first is None and len(a) != len(b):
        first = min(len(a), len(b))
    return first
