"""The teacher: a spec of the taxonomy in, a terminal task out, through any OpenAI-compatible chat endpoint.

The client is the judge's (``reward/judge.py``): the same endpoint list with fallback in order, retries with
``Retry-After``, circuit breakers, API keys from the environment, token usage and cost; only the answer's
parsing differs (the judge parses a score, the teacher a task). Answers are cached by (endpoint, model, prompt):
a resumed run asks nothing twice within a process.

The answer format is strict: one ``<task>`` element holding exactly one ``<instruction>``, ``<truth>``,
``<dockerfile>``, ``<tests>`` and ``<solution>`` element and any number of ``<file path="...">`` elements (build
context), nothing else. ``parse_task`` raises ``TeacherFormatError`` naming what is wrong; the pipeline sends that
message back to the teacher (a repair), as it does for build errors and test failures.
"""

from __future__ import annotations

import contextvars
import dataclasses
import hashlib
import re
from collections.abc import Mapping, Sequence
from pathlib import PurePosixPath

from jaxrl_term.datagen.taxonomy import TaskSpec
from jaxrl_term.reward.judge import JudgeClient, JudgeEndpoint, JudgeFailure, _left
from jaxrl_term.tasks.task import Environment, FileBlob, Solution, Task, Tests

SYSTEM = """\
You write tasks for training terminal agents. A task is a Linux container in a given starting state, an
instruction for an agent working in a shell inside it, hidden pytest tests that decide whether the agent
succeeded, and a reference solution. Your task will be checked mechanically before anyone uses it:

1. The image is built from your Dockerfile, which must start with `FROM {base_image}` and may COPY the files you
   give. Build steps have no network unless a package is already in the image; prefer what is there
   (bash, coreutils, python3, pytest, git, curl, procps, tmux).
2. The tests run in the initial state (nothing done): every test must FAIL. A test that passes before any work
   rewards doing nothing.
3. Your solution runs as `bash /solution/solve.sh` in the work dir /app; afterwards every test must PASS.
4. The tests are copied to /tests after the agent has finished and run with pytest as root. They must check the
   outcome the instruction asks for (files, their content, a running service, a program's output), not how it was
   reached, and must not be satisfiable by an empty or trivial answer.
The instruction must say everything a competent engineer needs (paths, formats, names) and nothing about the
tests. The truth section is for graders only: the facts a correct solution establishes.

Answer with exactly this structure and nothing else inside <task>:
<task>
<instruction>the text the agent sees</instruction>
<truth>what a correct solution achieves, for graders</truth>
<dockerfile>
FROM {base_image}
WORKDIR /app
...
</dockerfile>
<file path="relative/path/in/build/context">content (zero or more of these)</file>
<tests>
a pytest file: import what it needs from the standard library, one or more test_ functions
</tests>
<solution>
a bash script
</solution>
</task>"""

USER = """\
Write one task for this point of the taxonomy.

- Domain: {domain}
- Category (skill type): {skill_type}
- Primitive skills to exercise (use at least two): {primitive_skills}
- Persona of the person asking: {persona}
- Command complexity: {command_complexity}
- Task complexity: {task_complexity}
- Verifier kind: {verifier_kind} ({verifier_summary})
- Fixture kind: {fixture_kind} ({fixture_summary})
- Language: {language}
{anchor}
Base image: {base_image}. Work dir: /app."""

REPAIR_FORMAT = ("Your answer could not be used: {error}\nAnswer again with the complete task in the required "
                 "structure (one <task> with instruction, truth, dockerfile, optional file elements, tests, "
                 "solution).")
REPAIR_BUILD = ("The image did not build: {error}\nFix the Dockerfile (and files) and answer again with the "
                "complete task.")
REPAIR_INITIAL = ("In the initial state, before any work, these tests already pass: {tests}. Every test must "
                  "fail until the task is done. Answer again with the complete task.")
REPAIR_ORACLE = ("After your solution ran, the task was not solved: {error}\nFix the solution or the tests "
                 "(whichever is wrong) and answer again with the complete task.")

VERIFIER_SUMMARIES = {
    "exact_text": "exact text or state equality checks",
    "metric_threshold": "a numeric metric against a reference must meet a declared threshold",
    "adversarial_corpus": "must reject an evil corpus and preserve a clean one",
    "fuzz_equivalence": "fuzzed inputs must give outputs equal to a reference oracle's",
    "multi_protocol": "the tests send real protocol requests to a service the agent runs",
}
FIXTURE_SUMMARIES = {
    "text_only": "no artefact beyond text files",
    "image": "an image file with information to recover",
    "audio": "a short audio clip with information to recover",
    "video": "a short video with an event to locate",
    "stripped_binary": "a stripped binary to analyse",
    "vendored_package": "bundled package source with a deliberate breakage",
    "multi_service_compose": "cooperating services with one misconfiguration",
}

_SECTIONS = ("instruction", "truth", "dockerfile", "tests", "solution")
_REQUESTS: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("teacher_requests", default=None)
_TAG = re.compile(r"<(/?)(task|instruction|truth|dockerfile|tests|solution|file)(\s+path=\"([^\"]*)\")?\s*>")


class TeacherFormatError(ValueError):
    """The teacher's answer is not a usable task; the message says what to fix (it is sent back as a repair)."""


def render_messages(spec: TaskSpec, base_image: str) -> list[dict[str, str]]:
    anchor = (f"- Build it around this real-software situation: {spec.real_software_anchor}\n"
              if spec.real_software_anchor else "")
    user = USER.format(domain=spec.domain, skill_type=spec.skill_type,
                       primitive_skills="; ".join(spec.primitive_skills), persona=spec.persona,
                       command_complexity=spec.command_complexity, task_complexity=spec.task_complexity,
                       verifier_kind=spec.verifier_kind,
                       verifier_summary=VERIFIER_SUMMARIES.get(spec.verifier_kind, "as its name says"),
                       fixture_kind=spec.fixture_kind,
                       fixture_summary=FIXTURE_SUMMARIES.get(spec.fixture_kind, "as its name says"),
                       language=spec.language, anchor=anchor, base_image=base_image)
    return [{"role": "system", "content": SYSTEM.format(base_image=base_image)}, {"role": "user", "content": user}]


@dataclasses.dataclass(frozen=True)
class ParsedTask:
    instruction: str
    truth: str
    dockerfile: str
    files: Mapping[str, str]
    tests: str
    solution: str

    def to_task(self, task_id: str, spec: TaskSpec, *, agent_timeout_s: float = 600.0,
                test_timeout_s: float = 120.0) -> Task:
        env = Environment(dockerfile=self.dockerfile, files={p: FileBlob.text(c) for p, c in self.files.items()},
                          workdir="/app")
        tests = Tests("pytest", {"test_outputs.py": FileBlob.text(self.tests)}, "test_outputs.py")
        solution = Solution({"solve.sh": FileBlob.text(self.solution, 0o755)}, "solve.sh")
        # flat values only: they survive the Harbor export (task.toml [metadata]) and our Parquet
        meta = {"difficulty": spec.task_complexity, "category": spec.domain,
                "tags": [spec.skill_type, spec.verifier_kind, spec.fixture_kind, spec.language],
                "source": "datagen", "truth": self.truth}
        meta.update({f"spec_{k}": v for k, v in spec.to_json().items() if v is not None})
        return Task(task_id, self.instruction, env, tests, solution, agent_timeout_s=agent_timeout_s,
                    test_timeout_s=test_timeout_s, metadata=meta)


def parse_task(text: str, base_image: str) -> ParsedTask:
    """The strict parse of a teacher's answer (see the module docstring)."""
    starts = [m for m in _TAG.finditer(text) if m.group(2) == "task" and not m.group(1)]
    if len(starts) != 1:
        raise TeacherFormatError(f"expected exactly one <task> element, found {len(starts)}")
    end = text.find("</task>", starts[0].end())
    if end < 0:
        raise TeacherFormatError("<task> is not closed (no </task>)")
    body = text[starts[0].end():end]
    sections: dict[str, str] = {}
    files: dict[str, str] = {}
    pos = 0
    for m in _TAG.finditer(body):
        if m.start() < pos:
            continue
        closing, name, path = m.group(1), m.group(2), m.group(4)
        _no_stray(body[pos:m.start()])
        if closing or name == "task":
            raise TeacherFormatError(f"unexpected <{closing}{name}> inside <task>")
        close = body.find(f"</{name}>", m.end())
        if close < 0:
            raise TeacherFormatError(f"<{name}> is not closed")
        content = _strip_fence(body[m.end():close])
        pos = close + len(f"</{name}>")
        if name == "file":
            if path is None:
                raise TeacherFormatError("<file> needs a path attribute: <file path=\"data/input.txt\">")
            files[_safe_path(path)] = content if content.endswith("\n") else content + "\n"
            continue
        if path is not None:
            raise TeacherFormatError(f"<{name}> takes no path attribute")
        if name in sections:
            raise TeacherFormatError(f"<{name}> appears more than once")
        sections[name] = content
    _no_stray(body[pos:])
    missing = [s for s in _SECTIONS if not sections.get(s, "").strip()]
    if missing:
        raise TeacherFormatError(f"missing or empty: {', '.join('<' + s + '>' for s in missing)}")
    dockerfile = sections["dockerfile"].strip() + "\n"
    first = next((ln.split() for ln in dockerfile.splitlines()
                  if ln.strip() and not ln.lstrip().startswith(("#", "ARG"))), [])
    if len(first) < 2 or first[0].upper() != "FROM" or first[1] != base_image:
        raise TeacherFormatError(f"the Dockerfile must start with `FROM {base_image}` (found "
                                 f"{' '.join(first[:2]) or 'nothing'!r})")
    tests = sections["tests"].strip() + "\n"
    if not re.search(r"^\s*def test_\w*\s*\(", tests, re.M):
        raise TeacherFormatError("<tests> has no pytest test function (def test_...)")
    try:
        compile(tests, "test_outputs.py", "exec")
    except SyntaxError as e:
        raise TeacherFormatError(f"<tests> is not valid Python: line {e.lineno}: {e.msg}") from e
    solution = sections["solution"].strip() + "\n"
    if not solution.startswith("#!"):
        solution = "#!/bin/bash\nset -e\n" + solution
    return ParsedTask(sections["instruction"].strip(), sections["truth"].strip(), dockerfile, files, tests, solution)


def _no_stray(text: str) -> None:
    stray = text.strip()
    if not stray:
        return
    m = re.match(r"<(/?)([\w-]+)", stray)
    if m:
        raise TeacherFormatError(f"unknown element <{m.group(1)}{m.group(2)}> inside <task>; use only <instruction>, "
                                 "<truth>, <dockerfile>, <file path=\"...\">, <tests> and <solution>")
    raise TeacherFormatError(f"text outside the elements inside <task>: {stray[:80]!r}")


def _strip_fence(s: str) -> str:
    """Content of an element, without one surrounding Markdown code fence if the teacher added one."""
    t = s.strip("\n")
    m = re.fullmatch(r"\s*```[\w+-]*\n(.*?)\n?```\s*", t, re.S)
    return m.group(1) if m else t


def _safe_path(path: str) -> str:
    p = PurePosixPath(path)
    if p.is_absolute() or ".." in p.parts or not p.parts or path.strip() != path or p.name == "Dockerfile":
        raise TeacherFormatError(f"<file path={path!r}>: give a relative path inside the build context, without "
                                 "'..' (and not the Dockerfile itself)")
    return str(p)


class TeacherClient(JudgeClient):
    """The judge's client with answers returned as text: fallback over ``endpoints`` in order (each retried on
    infrastructure failures, breakers per endpoint), for ``rounds`` rounds; ``JudgeFailure`` when all fail."""

    def __init__(self, endpoints: Sequence[JudgeEndpoint], **kw):
        import collections

        super().__init__(endpoints, **kw)
        self.calls = 0  # chat completions requested (repairs included, cache hits not)
        self.answers: collections.OrderedDict[str, str] = collections.OrderedDict()  # (endpoint, prompt) -> text

    async def _answer(self, ep, messages, headers, seed, temperature) -> tuple[str, str]:
        self.calls += 1
        counter = _REQUESTS.get()
        if counter is not None:
            counter[0] += 1
        text, finish = await self._complete(ep, messages, headers, seed, temperature)
        if finish == "length":
            raise JudgeFailure("truncated", f"the answer stopped at max_tokens={ep.max_tokens}")
        return text, finish

    async def chat(self, messages: list[dict[str, str]], *, deadline: float | None = None,
                   use_cache: bool = True, requests: list[int] | None = None) -> tuple[str, str]:
        """(answer text, endpoint name). ``requests``: a one-element counter this call adds its HTTP requests to
        (retries included; a cache hit adds none), exact under concurrency (``calls`` is the client's total)."""
        import asyncio

        if requests is not None:
            _REQUESTS.set(requests)
        key = hashlib.sha256(repr(messages).encode()).hexdigest()
        last: JudgeFailure | None = None
        for rnd in range(self.rounds):
            for ep in self.endpoints:
                ck = f"{ep.name}\x1f{ep.model}\x1f{key}"
                if use_cache and ck in self.answers:
                    self.answers.move_to_end(ck)
                    self.stats["cache_hits"] += 1
                    return self.answers[ck], ep.name
                if not self.breakers[ep.name].available():
                    continue
                try:
                    text, _ = await self._ask(ep, messages, deadline, None, None)
                except JudgeFailure as f:
                    last = f
                    continue
                if use_cache and self.cache_size > 0:
                    self.answers[ck] = text
                    if len(self.answers) > self.cache_size:
                        self.answers.popitem(last=False)
                return text, ep.name
            left = _left(deadline)
            if rnd + 1 < self.rounds and (left is None or left > 0):
                await asyncio.sleep(self.backoff_s * 2**rnd if left is None else min(self.backoff_s * 2**rnd, left))
        raise last or JudgeFailure("unavailable", "every teacher endpoint is unavailable (circuit breakers open)")
