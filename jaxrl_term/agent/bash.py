"""``bash``: one fenced bash block per reply (mini-SWE-agent v1 style); the episode ends when a command prints
the completion sentinel; format errors get a corrective message and the episode goes on.

A block opens with a fence tagged bash/sh/shell and closes at a line holding only a fence, so
``echo '```'`` stays in the command; a fence line inside a heredoc (``cat > README.md <<'EOF'``) is the
heredoc's text, not the end of the block.
"""

from __future__ import annotations

import re

from jaxrl_term.agent.scaffold import Action, Parsed, Scaffold, from_parts
from jaxrl_term.agent.text import head_tail, split_thinking
from jaxrl_term.agent.tools import ToolResult

SENTINEL = "JAXRL_TERM_TASK_COMPLETE"
_OPEN = re.compile(r"```(?:bash|sh|shell)[ \t]*\n")
_CLOSE = re.compile(r"[ \t]*```[ \t]*")
_HEREDOC = re.compile(r"(?<!<)<<(?!<)(-?)[ \t]*(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\2")


def _block_end(text: str, start: int, heredocs: bool) -> tuple[str, int] | None:
    """(body, end) of the block whose body starts at ``start``: up to the first line that is only a fence
    (outside heredocs when ``heredocs``); None when no line closes it."""
    pending: list[tuple[str, bool]] = []  # heredoc delimiters still open, in order: (word, tabs stripped)
    pos = start
    while pos <= len(text):
        nl = text.find("\n", pos)
        end = len(text) if nl < 0 else nl
        line = text[pos:end]
        if pending:
            word, dash = pending[0]
            if (line.lstrip("\t") if dash else line) == word:
                pending.pop(0)
        elif _CLOSE.fullmatch(line):
            return text[start: max(start, pos - 1)], end
        elif heredocs:
            pending.extend((m.group(3), m.group(1) == "-") for m in _HEREDOC.finditer(line))
        if nl < 0:
            return None
        pos = nl + 1
    return None


def bash_blocks(text: str) -> tuple[list[str], bool]:
    """The bodies of the bash blocks in ``text``, and whether the last one is never closed."""
    blocks: list[str] = []
    pos = 0
    while (m := _OPEN.search(text, pos)) is not None:
        found = _block_end(text, m.end(), True) or _block_end(text, m.end(), False)
        if found is None:
            return blocks, True  # no closing line after this one: none after later openers either
        blocks.append(found[0])
        pos = found[1]
    return blocks, False


class BashScaffold(Scaffold):
    name = "bash"

    def initial_messages(self, instruction: str) -> list[dict]:
        prompt = self.system_prompt("bash", instruction=instruction, sentinel=SENTINEL,
                                    timeout=int(self.command_timeout_s))
        return [{"role": "system", "content": prompt}, {"role": "user", "content": "Begin working on the task."}]

    def parse(self, text: str) -> Parsed:
        blocks, unclosed = bash_blocks(split_thinking(text)[1])
        if len(blocks) != 1 or unclosed:
            found = "an unclosed" if unclosed and not blocks else ("no" if not blocks else f"{len(blocks)}")
            return Parsed([], [f"Your reply had {found} bash code blocks; it must have EXACTLY ONE, closed by a "
                               "line with only ```:\nyour reasoning, then\n```bash\n<one command>\n```"])
        cmd = blocks[0].strip()
        if not cmd:
            return Parsed([], ["The bash code block is empty."])
        return Parsed([Action("bash", {"cmd": cmd}, blocks[0])], [])

    def finished(self, parsed: Parsed, results: list[ToolResult]) -> bool:
        return any(r.tool == "bash" and (r.output or "").lstrip().startswith(SENTINEL) for r in results)

    def observation_messages(self, parsed: Parsed, results: list[ToolResult]) -> list[dict]:
        if parsed.errors or not results:
            return [{"role": "user", "content": "Format error: " + ("\n".join(parsed.errors) or "no command ran")}]
        r = results[0]
        if r.exit_code is None and not r.ok and r.output is None:  # the call itself was refused
            return [{"role": "user", "content": f"Format error: {r.text}"}]
        note = "\n<note>the command timed out and was interrupted</note>" if r.timed_out else ""
        return [from_parts("user", [(f"<returncode>{r.exit_code}</returncode>{note}\n<output>\n", False),
                                    (head_tail(r.text, self.max_observation_chars), True), ("</output>", False)])]
