"""A replay engine: answers each turn of an episode with the next of a fixed list of replies.

It drives the real agent loop with known-good actions (the oracle solutions of tasks) to produce expert
trajectories for warm-start fine-tuning (``jaxrl_term.sft``), with the exact token stream and loss mask the
RL trainer uses. Log-probs are 0 (these tokens were not sampled by any policy).
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Sequence

from jaxrl_term.agent.actions import SENTINEL, SUBMIT_MARKER
from jaxrl_term.rollout.engine import EngineError, Generation, SamplingParams


class ReplayEngine:
    """``RolloutEngine`` that replays ``replies`` (one per turn); an exhausted script is an engine error."""

    def __init__(self, tokenizer, replies: Sequence[str]):
        self.tok, self.replies = tokenizer, list(replies)
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.turn = 0

    async def generate(self, input_ids, sampling: SamplingParams, *, session: str | None = None) -> Generation:
        if self.turn >= len(self.replies):
            raise EngineError("the replay script is exhausted", retryable=False)
        text = self.replies[self.turn]
        self.turn += 1
        ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.eos]
        finish = "stop"
        if len(ids) > sampling.max_new_tokens:
            ids, finish = ids[: sampling.max_new_tokens], "length"
        return Generation(ids, [0.0] * len(ids), finish, weight_version=None, matched_stop=self.eos)

    async def update_weights(self, source, version: int) -> None:
        raise EngineError("a replay engine has no weights", retryable=False)

    async def health(self) -> bool:
        return True


def oracle_replies(task, scaffold: str) -> list[str]:
    """The task's oracle solution as the replies of a competent agent in ``scaffold``'s action format."""
    if task.solution is None:
        raise ValueError(f"task {task.id} has no oracle solution")
    script = task.solution.files[task.solution.entry].data.decode()
    lines = [ln for ln in script.splitlines() if not ln.startswith("#!")]
    body = "\n".join(lines).strip() + "\n"
    if scaffold == "bash":
        return [f"I will carry out the steps the task asks for, then check the result.\n```bash\n{body}```",
                f"The commands succeeded, so the task is done.\n```bash\necho {SENTINEL}\n```"]
    if scaffold == "tbrl":
        return [f"<bash>\ncmd: |\n{textwrap.indent(body, '  ')}</bash>",
                "<finish>\nmessage: The task is done.\n</finish>"]
    if scaffold == "tmax":
        run = json.dumps({"name": "bash", "arguments": {"command": body}})
        submit = json.dumps({"name": "bash", "arguments": {"command": f"echo {SUBMIT_MARKER}"}})
        return [f"THOUGHT: I will carry out the steps the task asks for, then check the result.\n\n"
                f"<tool_call>\n{run}\n</tool_call>",
                f"THOUGHT: The commands succeeded, so the task is done and I submit.\n\n<tool_call>\n{submit}\n</tool_call>"]
    if scaffold == "qwen_tools":
        call = json.dumps({"name": "bash", "arguments": {"cmd": body}})
        done = json.dumps({"name": "finish", "arguments": {"message": "The task is done."}})
        return [f"<tool_call>\n{call}\n</tool_call>", f"<tool_call>\n{done}\n</tool_call>"]
    raise ValueError(f"no oracle replies for scaffold {scaffold!r}")
