"""``tbrl``: Terminal-Bench-RL's action format and conversation, on our tools.

Facts kept from the original agent (Danau5tin/terminal-bench-rl, ``src/agent_core``):

- the long system prompt is the system turn and the task, as given, the first user turn;
- an action is an XML element named after its tool whose body is a YAML mapping; the elements are found as
  ``<name>...</name>`` pairs anywhere in the reply (``<think>`` elements are skipped) and run in order;
- an element of any other name counts as an attempt but does nothing; a reply with no element at all ends the
  episode (the task is then scored as it stands);
- the observation is one user message: the parse errors first, then each result as
  ``<{tool}_output>\\n...\\n</{tool}_output>``, joined by blank lines; a parse error is
  ``<parse_error>`` with the tag, what is wrong, an excerpt of the body (100 characters) and the tag's
  expected format;
- three replies in a row with parse errors and no valid action end the episode.

Ours on top: only the text after the reasoning (up to the first ``</think>``) is parsed; a reply that ends
inside an action (cut off) is a parse error rather than "no action"; arguments are checked before anything
runs (wrong values are parse errors, as the original's action factory made them); YAML aliases and flow
collections nested more than 64 deep are refused; each result's body (not its wrapper) is what the loop's
token budget may cut.
"""

from __future__ import annotations

import bisect
import re
from collections import defaultdict

import yaml

from jaxrl_term.agent.scaffold import Action, Parsed, Scaffold, from_parts
from jaxrl_term.agent.text import head_tail, split_thinking
from jaxrl_term.agent.tools import TOOL_NAMES, ToolError, ToolResult, validate

MAX_BODY_CHARS = 200_000
_OPEN = re.compile(r"<(\w+)>")
_CLOSE = re.compile(r"</(\w+)>")
IGNORED_TAGS = ("think",)
NO_OUTPUT = "No actions parsed"

# The expected format shown with a parse error, per tag.
EXAMPLES = {
    "bash": "<bash>\ncmd: 'ls -la /app'\nblock: true               # optional; false runs it in the background\n"
            "timeout_secs: 30          # optional; default 30, at most 600\n"
            "end_after_cmd_success: false  # optional; true ends the task if the command succeeds\n</bash>",
    "file": "<file>\naction: read              # read | write | edit | multi_edit | metadata\n"
            "file_path: '/app/main.py'\n"
            "offset: 1                 # read: optional first line\nlimit: 100                # read: optional\n"
            "content: |                # write: the whole file\n  text\n"
            "old_string: 'exact text'  # edit: must occur once (or set replace_all: true)\n"
            "new_string: 'replacement' # edit\n"
            "edits:                    # multi_edit: applied in order, all or nothing\n"
            "  - old_string: 'a'\n    new_string: 'b'\n"
            "file_paths: ['/app/a.py'] # metadata: up to 10 paths\n</file>",
    "search": "<search>\naction: grep              # grep | glob | ls\npattern: 'def main'       # grep: an extended "
              "regex; glob: a name pattern such as '**/*.py'\npath: '/app'              # optional; default the work "
              "directory\ninclude: '*.py'           # grep: optional file filter\n"
              "ignore: ['*.pyc']         # ls: optional patterns to leave out\n</search>",
    "todo": "<todo>\noperations:\n  - action: add           # add | complete | delete | view_all\n"
            "    content: 'Inspect the config'\n  - action: complete\n    task_id: 1\n"
            "view_all: true            # optional; show the list afterwards\n</todo>",
    "scratchpad": "<scratchpad>\naction: add_note          # add_note | view_all_notes\n"
                  "content: 'What I learned'\n</scratchpad>",
    "finish": "<finish>\nmessage: 'What was done and how it was verified'\n</finish>",
}


MAX_FLOW_DEPTH = 64


class _NoAliasLoader(yaml.SafeLoader):
    """YAML without anchors/aliases (a model's output cannot expand into a 'billion laughs') and with flow
    collections (``[``, ``{``) nested at most ``MAX_FLOW_DEPTH`` deep: PyYAML's scanner takes time quadratic in
    that depth (2,000 brackets: half a second per element, while every other episode in the process waits)."""

    def fetch_flow_collection_start(self, token_class):
        if self.flow_level >= MAX_FLOW_DEPTH:
            raise yaml.scanner.ScannerError(None, None, f"[ and {{ are nested more than {MAX_FLOW_DEPTH} deep",
                                            self.get_mark())
        super().fetch_flow_collection_start(token_class)

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, "aliases (*name) are not allowed", event.start_mark)
        return super().compose_node(parent, index)


def xml_elements(text: str) -> tuple[list[tuple[str, str, int, int]], int]:
    """``<name>body</name>`` elements as the original's ``re.findall(r'<(\\w+)>([\\s\\S]*?)</\\1>')`` finds
    them, as (name, body, start, end); and where the last element ended. Linear in the text: each opening tag
    looks its closing tag up among the closing tags' positions."""
    closers: dict[str, list[int]] = defaultdict(list)
    for m in _CLOSE.finditer(text):
        closers[m.group(1)].append(m.start())
    found, pos = [], 0
    while (m := _OPEN.search(text, pos)) is not None:
        name, at = m.group(1), closers.get(m.group(1), [])
        k = bisect.bisect_left(at, m.end())
        if k == len(at):
            pos = m.start() + 1
            continue
        end = at[k] + len(name) + 3
        found.append((name, text[m.end(): at[k]], m.start(), end))
        pos = end
    return found, (found[-1][3] if found else 0)


def _yaml_error(e: Exception) -> str:
    mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
    if mark is not None:
        return f"YAML syntax error at line {mark.line + 1}, column {mark.column + 1}: {problem or e}"
    return f"YAML parsing error: {e}"


def parse_error(tag: str, body: str, desc: str) -> str:
    shown = body if len(body) <= 100 else body[:100] + "..."
    example = f"Expected format:\n{EXAMPLES[tag]}" if tag in EXAMPLES else ""  # none for other names, as the original
    return f"<parse_error>\n[ERROR] Failed to parse <{tag}> action: {desc}\nContent: \"{shown}\"\n{example}\n</parse_error>"


class TbrlScaffold(Scaffold):
    name = "tbrl"

    def initial_messages(self, instruction: str) -> list[dict]:
        system = self.system_prompt("tbrl", timeout=int(self.command_timeout_s))
        return [{"role": "system", "content": system.strip()},
                {"role": "user", "content": instruction}]

    def parse(self, text: str) -> Parsed:
        body_text = split_thinking(text)[1]
        elements, last_end = xml_elements(body_text)
        actions: list[Action] = []
        errors: list[str] = []
        attempted = False
        for tag, body, start, end in elements:
            if tag.lower() in IGNORED_TAGS:
                continue
            attempted = True
            raw = body_text[start:end]
            if len(body) > MAX_BODY_CHARS:
                errors.append(parse_error(tag, body, f"the body is longer than {MAX_BODY_CHARS} characters"))
                continue
            try:
                data = yaml.load(body.strip(), Loader=_NoAliasLoader)
            except yaml.YAMLError as e:
                errors.append(parse_error(tag, body, _yaml_error(e)))
                continue
            except (ValueError, RecursionError) as e:  # an impossible date, brackets nested hundreds deep
                errors.append(parse_error(tag, body, f"YAML parsing error: {type(e).__name__}: {str(e)[:200]}"))
                continue
            if not isinstance(data, dict):  # the original's message, for every element name
                desc = "Invalid action format. Expected YAML."
                if data is not None:
                    desc += f"\nReceived type: {type(data).__name__}"
                    if isinstance(data, (str, int, float, bool)):
                        desc += f" with value: {data!r:.200}"
                errors.append(parse_error(tag, body, desc))
                continue
            if tag not in TOOL_NAMES:
                continue  # a mapping under another name: the original skips it without a message
            try:
                actions.append(Action(tag, validate(tag, data), raw))
            except ToolError as e:
                errors.append(parse_error(tag, body, str(e)))
        cut = next((m for m in _OPEN.finditer(body_text, last_end) if m.group(1) in TOOL_NAMES), None)
        if cut is not None:
            attempted = True
            errors.append(parse_error(cut.group(1), body_text[cut.end():],
                                      f"<{cut.group(1)}> is never closed with </{cut.group(1)}> (was the reply cut off?)"))
        if len(actions) > self.max_actions_per_turn:
            errors.append(f"<parse_error>\n[ERROR] {len(actions)} actions in one reply; only the first "
                          f"{self.max_actions_per_turn} were run.\n</parse_error>")
            actions = actions[: self.max_actions_per_turn]
        return Parsed(actions, errors, no_action=not attempted)

    def observation_messages(self, parsed: Parsed, results: list[ToolResult]) -> list[dict]:
        blocks = [[(e, False)] for e in parsed.errors]
        blocks += [[(f"<{r.tool}_output>\n", False), (head_tail(r.text, self.max_observation_chars), True),
                    (f"\n</{r.tool}_output>", False)] for r in results]  # the body is what the budget may cut
        if not blocks:
            return [{"role": "user", "content": NO_OUTPUT}]
        parts = blocks[0]
        for b in blocks[1:]:
            parts = parts + [("\n\n", False)] + b
        return [from_parts("user", parts)]
