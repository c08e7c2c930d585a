"""The episode: token in, token out.

The prompt is rendered once by the chat template. Each turn sends the exact ids so far to the engine and
appends its output ids verbatim (loss mask 1, their log-probs kept); the observation is appended as the chat
template's delta for the new turn(s) plus the generation prompt (loss mask 0), its contents as plain text (a
``<|im_end|>`` printed by a command is text, not the end of a turn). The policy's own tokens are never decoded
and re-encoded into the stream. A reply stopped by another stop token than ``<|im_end|>`` (``<|endoftext|>``)
or cut at the length limit is closed with ``<|im_end|>`` as the template closes every assistant turn (by the
next observation's delta, or alone when the episode ends on it).

Every reply becomes actions or scored parse errors; only the infrastructure (engine, sandbox) can make an
episode invalid. The turn is recorded before its tools run. Each observation gets a token budget: at most
``max_observation_tokens``, and no more than leaves room for the next reply; longer contents keep their
beginning and end with a note (each result on its own: a scaffold marks which parts of a message are
results, so wrappers and exit codes survive the cut). No JAX here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid

from jaxrl_term.agent.chat import EOS_TEXT, ChatDelta
from jaxrl_term.agent.scaffold import PARTS, Parsed, Scaffold
from jaxrl_term.agent.text import clean, clean_value
from jaxrl_term.agent.tools import ToolBox
from jaxrl_term.agent.trajectory import Trajectory, TurnRecord
from jaxrl_term.rollout.engine import EngineError, RolloutEngine, SamplingParams
from jaxrl_term.sandbox.base import Sandbox

__all__ = ["EOS_TEXT", "AgentLimits", "ChatDelta", "fit_observation", "run_episode"]
log = logging.getLogger(__name__)
TRUNCATION_NOTE = "\n[... {n} tokens of this output were cut to fit the context ...]\n"


@dataclasses.dataclass(frozen=True)
class AgentLimits:
    max_turns: int = 30
    max_tokens_per_turn: int = 2048
    max_context_tokens: int = 32768
    command_timeout_s: float = 30.0
    trajectory_timeout_s: float = 1800.0  # wall clock for the whole episode (also capped by the task's own)
    max_parse_error_turns: int = 3
    min_new_tokens: int = 16  # less room than this in the context ends the episode (context_full)
    max_observation_tokens: int | None = None  # per turn; None: a quarter of max_context_tokens

    def observation_budget(self, room: int) -> int:
        """Tokens an observation may take when ``room`` tokens of context are left: the cap, and no more than
        leaves the next reply ``max_tokens_per_turn`` (or half the room, if less; ``min_new_tokens`` at least)."""
        cap = self.max_observation_tokens or self.max_context_tokens // 4
        reserve = max(self.min_new_tokens, min(self.max_tokens_per_turn, room // 2))
        return max(0, min(cap, room - reserve))


def fit_observation(delta: ChatDelta, messages: list[dict], closed: bool, budget: int
                    ) -> tuple[list[dict], list[int]] | None:
    """``messages`` (contents made encodable) whose delta fits in ``budget`` tokens, and the delta.

    A message may give its content as ``parts`` ((text, cuttable) pairs, see :data:`PARTS`); otherwise the whole
    content is one cuttable part. When the delta is too long, the longest cuttable parts are cut to their first
    and last tokens with a note between them, the shorter ones kept whole, and the fixed parts (a result's
    wrapper, its exit code) kept as they are. None if even that does not fit."""
    parts = [[(clean(t), cut) for t, cut in (m.get(PARTS) or [(m["content"], True)])] for m in messages]

    def build(ps: list[list[tuple[str, bool]]]) -> list[dict]:
        return [{**{k: v for k, v in m.items() if k != PARTS}, "content": "".join(t for t, _ in p)}
                for m, p in zip(messages, ps)]

    whole = build(parts)
    ids = delta.observation_ids(whole, closed)
    if len(ids) <= budget:
        return whole, ids
    where = [(i, j) for i, p in enumerate(parts) for j, (t, cut) in enumerate(p) if cut and t]
    toks = [delta.encode_plain(parts[i][j][0]) for i, j in where]
    note = len(delta.encode_plain(TRUNCATION_NOTE.format(n=10**6)))
    available = budget - (len(ids) - sum(map(len, toks))) - note * len(where)
    for _ in range(4):
        if available < 0:
            break
        cut = [list(p) for p in parts]
        for (i, j), t, share in zip(where, toks, _water_fill([len(t) for t in toks], available)):
            if len(t) > share:
                head, tail = share // 2, share - share // 2
                text = delta.decode(t[:head]) + TRUNCATION_NOTE.format(n=len(t) - share) + \
                    (delta.decode(t[len(t) - tail:]) if tail else "")
                cut[i][j] = (clean(text), True)
        ids = delta.observation_ids(fitted := build(cut), closed)
        if len(ids) <= budget:
            return fitted, ids
        available -= len(ids) - budget + 8  # decoding and re-encoding at the cuts shifted a few tokens
    omitted = "[output omitted: no room left in the context]"
    for fallback in (build([[(omitted if cut else t, cut) for t, cut in p] for p in parts]),
                     [{**m, "content": omitted} for m in whole]):
        ids = delta.observation_ids(fallback, closed)
        if len(ids) <= budget:
            return fallback, ids
    return None


def _water_fill(lengths: list[int], total: int) -> list[int]:
    """Shares of ``total`` for items of ``lengths``: short items whole, the rest split evenly."""
    shares = [0] * len(lengths)
    left, order = total, sorted(range(len(lengths)), key=lambda i: lengths[i])
    for k, i in enumerate(order):
        shares[i] = min(lengths[i], left // (len(order) - k))
        left -= shares[i]
    return shares


async def run_episode(
    task,
    engine: RolloutEngine,
    sandbox: Sandbox,
    tokenizer,
    scaffold: Scaffold,
    *,
    sampling: SamplingParams | None = None,
    limits: AgentLimits | None = None,
    enable_thinking: bool | None = None,
    workdir: str | None = None,
) -> Trajectory:
    """Run one episode of ``task`` in ``sandbox``. Never raises for model, tool or engine failures: the
    trajectory records how it ended (``end_reason``); engine and sandbox failures make it invalid."""
    limits = limits or AgentLimits()
    sampling = sampling or SamplingParams()
    t_start = time.monotonic()
    deadline = t_start + min(limits.trajectory_timeout_s, getattr(task, "agent_timeout_s", None) or float("inf"))
    delta = ChatDelta(tokenizer, scaffold.tools, enable_thinking)
    stop_ids = tuple(dict.fromkeys((*sampling.stop_token_ids, *delta.eos_ids)))
    tools = ToolBox(sandbox, workdir=workdir or task.environment.workdir, command_timeout_s=limits.command_timeout_s)
    messages = clean_value(scaffold.initial_messages(task.instruction))
    ids = delta.prompt_ids(messages)
    mask, logprobs = [0] * len(ids), [0.0] * len(ids)
    traj = Trajectory(task.id, scaffold.name, ids, mask, logprobs, len(ids), messages, [], "max_turns")

    def end(reason: str, error: str | None = None) -> Trajectory:
        last = traj.turns[-1] if traj.turns else None
        if last is not None and last.n_observation == 0 and last.start + last.n_output == len(ids) and \
                ids[-1] != delta.eos_id:
            # the episode ends on a reply stopped by <|endoftext|> or cut: close it as the template does (not
            # the policy's token), so the stream is a whole conversation
            ids.append(delta.eos_id)
            mask.append(0)
            logprobs.append(0.0)
        traj.end_reason, traj.error, traj.duration_s = reason, error, time.monotonic() - t_start
        return traj

    session = f"{task.id}/{uuid.uuid4().hex[:12]}"
    chat = getattr(engine, "chat", None)  # chat-level engines get messages (OpenAIChatEngine)
    if chat is not None and scaffold.tools:
        raise ValueError(f"scaffold {scaffold.name!r} calls tools through the chat template; a chat endpoint "
                         "needs a text scaffold (agent=bash or tbrl)")
    if len(ids) + limits.min_new_tokens > limits.max_context_tokens:
        return end("context_full", f"the prompt alone has {len(ids)} tokens")
    parse_streak = 0
    for turn in range(limits.max_turns):
        room = limits.max_context_tokens - len(ids)
        if room < limits.min_new_tokens:
            return end("context_full")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return end("timeout")
        # a seeded episode gives every turn its own seed (the same seed each turn would repeat its randomness)
        seed = None if sampling.seed is None else (sampling.seed + 1_000_003 * turn) % 2**31
        # room - 1: SGLang rejects input + max_new >= context (<= 0.5.10) with HTTP 400
        params = sampling.replace(max_new_tokens=min(limits.max_tokens_per_turn, room - 1), stop_token_ids=stop_ids,
                                  seed=seed)
        t0 = time.monotonic()
        try:
            if chat is not None:  # a chat endpoint (evaluation): the conversation as messages
                request = chat([{"role": m["role"], "content": m["content"]} for m in messages], params,
                               session=session)
            else:
                request = engine.generate(list(ids), params, session=session)
            async with asyncio.timeout(remaining):  # not wait_for: on 3.11 it can swallow a cancellation that
                gen = await request                  # lands as the generation completes (the episode would go on)
        except asyncio.TimeoutError:
            trouble = engine.trouble(session) if hasattr(engine, "trouble") else None
            if trouble:  # the engine was retrying when time ran out: the infrastructure's fault, not the policy's
                return end("engine_error", f"the episode's wall-clock limit ran out while the engine was retrying "
                                           f"({trouble})")
            return end("timeout", "the episode's wall-clock limit ran out while the engine was generating")
        except Exception as e:  # noqa: BLE001 - any engine failure invalidates the trajectory, never scores 0
            if hasattr(engine, "trouble"):
                engine.trouble(session)  # forget the session's retries
            return end("engine_error", str(e) if isinstance(e, EngineError) else f"{type(e).__name__}: {e}")
        gen_s = time.monotonic() - t0
        if gen.finish_reason == "length" and not gen.output_ids:  # the server's context has no room left
            return end("context_full", "no room left in the server's context")
        if gen.finish_reason == "abort" or not gen.output_ids:
            return end("engine_error", f"the engine aborted the request ({gen.finish_reason})")
        start = len(ids)
        out = list(gen.output_ids)
        ids.extend(out)
        mask.extend([1] * len(out))
        logprobs.extend(float(x) for x in gen.output_logprobs)
        closed = out[-1] == delta.eos_id  # any other stop (or none) is closed by the observation's delta
        text = gen.text if gen.text is not None else \
            tokenizer.decode(out[:-1] if out[-1] in stop_ids else out, skip_special_tokens=False)
        parsed: Parsed = scaffold.parse(text)
        messages.append(clean_value(scaffold.assistant_message(text, parsed)))
        record = TurnRecord(turn, start, len(out), 0, text,
                            clean_value([{"tool": a.tool, "args": a.args} for a in parsed.actions]),
                            clean_value(list(parsed.errors)), [], gen.finish_reason, gen_s, 0.0, gen.weight_version)
        traj.turns.append(record)  # before the tools run: an episode that ends in them still accounts its tokens
        if parsed.no_action:
            return end("no_action")
        t1 = time.monotonic()
        results = []
        try:
            for action in parsed.actions:
                res = await tools.call(action.tool, action.args, time_left_s=deadline - time.monotonic())
                results.append(res)
                record.results.append(clean_value({"tool": res.tool, "ok": res.ok, "text": res.text,
                                                   "exit_code": res.exit_code, "timed_out": res.timed_out,
                                                   "duration_s": res.duration_s}))
                if res.finished:
                    break
        except Exception as e:  # noqa: BLE001 - the sandbox itself broke (not the model's doing): invalid
            record.tool_s = time.monotonic() - t1
            return end("sandbox_error", f"{type(e).__name__}: {e}")
        record.tool_s = time.monotonic() - t1
        if scaffold.finished(parsed, results):
            return end("finished")
        # consecutive replies with parse errors and nothing run (a reply that ran something resets the count)
        parse_streak = 0 if parsed.actions else parse_streak + parsed.is_error_turn
        if parse_streak >= limits.max_parse_error_turns:
            return end("parse_errors", f"{parse_streak} replies in a row without a valid action")
        if turn + 1 >= limits.max_turns:
            return end("max_turns")  # nothing would read an observation
        if time.monotonic() >= deadline:
            return end("timeout")
        fitted = fit_observation(delta, scaffold.observation_messages(parsed, results), closed,
                                 limits.observation_budget(limits.max_context_tokens - len(ids)))
        if fitted is None:
            return end("context_full", "no room left for the observation")
        obs, obs_ids = fitted
        ids.extend(obs_ids)
        mask.extend([0] * len(obs_ids))
        logprobs.extend([0.0] * len(obs_ids))
        messages.extend(obs)
        record.n_observation = len(obs_ids)
    return end("max_turns")
