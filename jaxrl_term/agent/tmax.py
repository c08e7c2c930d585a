"""``tmax``: Tmax's agent (hamishivi/tmax, ``Vanillux2Agent`` with the vanillux prompts, mini-SWE-agent v2).

Facts kept from the original:

- one tool, ``bash``, called natively (``<tool_call>{"name": "bash", "arguments": {"command": ...}}``), its
  schema passed to the chat template; the system turn holds the reply rules (a THOUGHT, then exactly one
  call) and the first user turn the task inside the instance template (workflow, rules, submit command);
- calls are read as vLLM's Hermes parser reads them (``<tool_call>`` blocks, the last one may be unclosed;
  one invalid block and the reply has no call at all), and only the first call runs;
- each result is a ``tool`` message: the command's output (trailing whitespace stripped, ``(no output)`` when
  empty), cut to its first and last 5,000 characters behind a hint when longer than 10,000, then a blank line
  and ``(exit_code=N)``;
- a reply without a (valid) call gets a format-error message as a user turn; a call to another tool, or one
  whose arguments are unusable, gets it as a tool turn; the episode goes on;
- the episode ends after a command containing ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` runs, or when that
  marker appears in the tool message (the output after the cut: a marker in the elided middle does not count).

Ours on top: only the text after the reasoning (up to the first ``</think>``) is searched for calls; an empty or
non-string ``command`` is a format error (the original would run an empty command or fail).
"""

from __future__ import annotations

import json
import re

from jaxrl_term.agent.scaffold import Action, Parsed, Scaffold, from_parts, load_prompt
from jaxrl_term.agent.text import clean_value, split_thinking
from jaxrl_term.agent.tools import ToolError, ToolResult, validate

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.S)
BASH_TOOL = {"type": "function", "function": {
    "name": "bash",
    "description": "Run a bash command in a persistent shell: the working directory and exported variables carry "
                   "over to the next call.",
    "parameters": {"type": "object", "properties": {
        "command": {"type": "string", "description": "The command to run."}}, "required": ["command"]}}}
TOO_LONG_HINT = ("This command printed too much, so only the beginning and the end of its output are shown.\n"
                 "Run commands that print less: view parts of files with head, tail or sed -n 'A,Bp', make searches "
                 "more specific, or send the output to a file and search that file.\n")
FORMAT_ERROR = ("Format error: {error}\n\nEvery reply must contain EXACTLY ONE call to the `bash` tool. To finish the "
                "task, call the `bash` tool with the command `echo " + SUBMIT_MARKER + "` and nothing else in it.\n")
NO_CALL = "your reply has no valid `bash` tool call."


def truncate_output(output: str, max_chars: int = 10_000) -> str:
    """The original's cut: longer than ``max_chars``, the output becomes the hint and its first and last
    ``max_chars // 2`` characters, with the number of characters left out."""
    if len(output) <= max_chars:
        return output
    head = tail = max_chars // 2
    return (f"{TOO_LONG_HINT}\n\n---- HEAD ({head} chars) ----\n{output[:head]}\n"
            f"---- {len(output) - head - tail} chars elided ----\n---- TAIL ({tail} chars) ----\n{output[-tail:]}")


def tool_message(output: str, exit_code: int | None, max_chars: int = 10_000) -> str:
    return "".join(t for t, _ in tool_message_parts(output, exit_code, max_chars))


def tool_message_parts(output: str, exit_code: int | None, max_chars: int = 10_000) -> list[tuple[str, bool]]:
    """The tool message as (text, cuttable) parts: the shown output, then the exit code (never cut)."""
    output = output.rstrip()
    shown = truncate_output(output, max_chars) if output else "(no output)"
    return [(shown, True), (f"\n\n(exit_code={-1 if exit_code is None else exit_code})", False)]


def read_calls(body: str) -> list[dict] | None:
    """The tool calls in ``body`` as vLLM's Hermes parser returns them ({"name", "arguments"}), or None when a
    block is not a valid call (the parser then reports no call at all)."""
    try:
        calls = [json.loads(closed or open_) for closed, open_ in _CALL.findall(body)]
    except (ValueError, RecursionError):
        return None
    if not all(isinstance(c, dict) and isinstance(c.get("name"), str) and "arguments" in c for c in calls):
        return None
    return calls


class TmaxScaffold(Scaffold):
    name = "tmax"
    tools = [BASH_TOOL]

    def __init__(self, *, max_actions_per_turn: int = 1, max_observation_chars: int = 10_000,
                 command_timeout_s: float = 120.0, prompt: str | None = None):
        super().__init__(max_actions_per_turn=1, max_observation_chars=max_observation_chars,
                         command_timeout_s=command_timeout_s, prompt=prompt)

    def initial_messages(self, instruction: str) -> list[dict]:
        system = self.system_prompt("tmax_system", marker=SUBMIT_MARKER, timeout=int(self.command_timeout_s))
        return [{"role": "system", "content": system.strip() + "\n"},
                {"role": "user", "content": load_prompt("tmax", task=instruction.strip(), marker=SUBMIT_MARKER,
                                                        timeout=int(self.command_timeout_s))}]

    def parse(self, text: str) -> Parsed:
        body = split_thinking(text)[1]
        calls = read_calls(body) if "<tool_call>" in body else []
        if not calls:
            return Parsed([], [NO_CALL], meta={"role": "user", "calls": []})
        meta = {"role": "tool", "calls": calls}
        first = calls[0]
        if first["name"] != "bash":
            return Parsed([], [f"unknown tool '{first['name']:.100}'; the only tool is `bash`."], meta=meta)
        args = first["arguments"]
        command = args.get("command") if isinstance(args, dict) else None
        if not isinstance(command, str) or not command.strip():
            return Parsed([], ["the `bash` call needs a `command` argument: a non-empty string."], meta=meta)
        try:
            checked = validate("bash", {"cmd": command.strip()})
        except ToolError as e:
            return Parsed([], [f"{e}."], meta=meta)
        return Parsed([Action("bash", checked, json.dumps(first, ensure_ascii=False, default=str))], [], meta=meta)

    def finished(self, parsed: Parsed, results: list[ToolResult]) -> bool:
        # the original looks for the marker in the tool message it built (after its head/tail cut)
        return any(SUBMIT_MARKER in a.args["cmd"] for a in parsed.actions) or \
            any(SUBMIT_MARKER in tool_message(r.text, r.exit_code, self.max_observation_chars) for r in results)

    def observation_messages(self, parsed: Parsed, results: list[ToolResult]) -> list[dict]:
        if parsed.errors or not results:
            error = parsed.errors[0] if parsed.errors else NO_CALL
            return [{"role": parsed.meta.get("role", "user"), "content": FORMAT_ERROR.format(error=error)}]
        r = results[0]
        return [from_parts("tool", tool_message_parts(r.text, r.exit_code, self.max_observation_chars))]

    def assistant_message(self, text: str, parsed: Parsed) -> dict:
        return native_assistant_message(text, parsed.meta.get("calls") or [])


def native_assistant_message(text: str, calls: list[dict]) -> dict:
    """The reply as a chat message with ``tool_calls`` (what an OpenAI-style server returns): the text outside
    the call blocks as content, the reasoning kept in it for the template to split off."""
    body = split_thinking(text)[1]
    if not calls:
        return {"role": "assistant", "content": text}
    head = text[: len(text) - len(body)]
    content = (head + _CALL.sub("", body)).rstrip("\n")
    return {"role": "assistant", "content": content,
            "tool_calls": [{"type": "function", "function": clean_value({"name": c["name"],
                                                                          "arguments": c["arguments"]})}
                           for c in calls]}
