"""An OpenAI-compatible teacher written for the datagen tests: a real HTTP server on localhost that answers
scripted task-writing replies.

The scenario is the spec's persona (``Persona of the person asking: <scenario>`` in the prompt); the round is the
number of assistant turns already in the conversation (0 = first answer, 1 = after one repair request). Each
scenario is a list of answers by round (the last repeats); an answer is a task text, or an int (an HTTP error
status, returned instead of an answer). ``calls`` counts requests per scenario; ``repair_prompts`` keeps the
repair messages the pipeline sent.
"""

import re
from collections import Counter, defaultdict

from judge_server import JudgeServer, LocalServer
from starlette.requests import Request
from starlette.routing import Route

BASE = "jaxrl-term/base:trixie"


def task_text(instruction: str, *, dockerfile_extra: str = "", tests: str | None = None, solution: str,
              files: dict[str, str] | None = None, base: str = BASE) -> str:
    files_xml = "".join(f'<file path="{p}">{c}</file>\n' for p, c in (files or {}).items())
    return (f"Here is the task.\n<task>\n<instruction>{instruction}</instruction>\n"
            f"<truth>the file holds the requested line</truth>\n"
            f"<dockerfile>\nFROM {base}\nWORKDIR /app\n{dockerfile_extra}</dockerfile>\n{files_xml}"
            f"<tests>\n{tests}\n</tests>\n<solution>\n{solution}\n</solution>\n</task>\n")


def file_task(name: str, line: str, *, instruction: str | None = None, **kw) -> str:
    """A task: write ``line`` into /app/<name>; the tests read it back."""
    tests = (f"from pathlib import Path\n\n\ndef test_{name.replace('.', '_')}_has_the_line():\n"
             f"    assert Path('/app/{name}').read_text().strip() == {line!r}\n")
    kw.setdefault("solution", f"printf '%s\\n' {line!r} > /app/{name}")
    return task_text(instruction or f"Create /app/{name} holding exactly one line: {line}", tests=tests, **kw)


class TeacherServer(LocalServer):
    def __init__(self, scenarios: dict[str, list]):
        self.scenarios = scenarios
        self.calls: Counter = Counter()
        self.repair_prompts: defaultdict = defaultdict(list)
        super().__init__([Route("/v1/chat/completions", self.chat, methods=["POST"])])

    async def chat(self, request: Request):
        body = await request.json()
        msgs = body["messages"]
        m = re.search(r"Persona of the person asking: scenario-(\S+)", msgs[1]["content"])
        scenario = m.group(1) if m else "?"
        self.calls[scenario] += 1
        rnd = sum(x["role"] == "assistant" for x in msgs)
        if rnd:
            self.repair_prompts[scenario].append(msgs[-1]["content"])
        answers = self.scenarios.get(scenario)
        if answers is None:
            return JudgeServer.error(404, f"no scenario {scenario}")
        ans = answers[min(rnd, len(answers) - 1)]
        if isinstance(ans, int):
            return JudgeServer.error(ans, "scripted failure")
        return JudgeServer.answer(body.get("model"), ans, "".join(x["content"] for x in msgs))
