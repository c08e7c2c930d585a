"""The ``tbrl`` and ``tmax`` scaffolds speak their seeds' formats.

A scripted episode runs through ``run_episode`` on a real sandbox; next to it, the conversation the original
agent would hold for the same replies is rebuilt here from the originals' source, written down independently of
our implementation: Terminal-Bench-RL (Danau5tin/terminal-bench-rl: ``action_parser.py``,
``step_executor.py``, ``action_handler.py``, ``state_managers.py``, ``docker_env.py``, ``terminal_agent.py``)
and Tmax (hamishivi/tmax: ``Vanillux2Agent/agent.py``, ``rl_data/generator/vanillux_solver.py`` and
``sample_solutions.py``, with vLLM's Hermes tool parser). Only our own texts (prompts, the expected-format
examples, the truncation hint, the format-error wording) are taken from our modules; roles, order, joins,
wrappers, what runs and what ends the episode come from the reference. Any difference fails, and the
failure shows both transcripts side by side.
"""

import asyncio
import difflib
import json
import re
import shutil

import pytest
import yaml

from agent_helpers import ScriptedEngine
from conftest import need
from jaxrl_term.agent import tbrl as ours_tbrl
from jaxrl_term.agent import tmax as ours_tmax
from jaxrl_term.agent.actions import make_scaffold
from jaxrl_term.agent.loop import AgentLimits, run_episode
from jaxrl_term.agent.scaffold import load_prompt
from jaxrl_term.model.tokenizer import load_tokenizer
from jaxrl_term.sandbox.base import open_sandbox
from jaxrl_term.tasks.builtin import generate

TASK = generate("create_file", "easy", seed=3)


@pytest.fixture(scope="module")
def qwen3(qwen3_tokenizer_dir):
    return load_tokenizer(qwen3_tokenizer_dir)


@pytest.fixture(scope="module")
def sandbox_backend():
    if shutil.which("bwrap") is not None:
        return "local"
    from jaxrl_term.sandbox.images import DockerUnavailable, docker_client

    try:
        docker_client()
    except DockerUnavailable as e:
        need(False, f"no sandbox backend: bubblewrap is missing and Docker is unavailable ({e})")
    return "docker"


def run(tok, scaffold: str, replies: list[str], backend: str, **limits):
    async def go():
        image = None if backend == "local" else "jaxrl-term/base:trixie"
        async with open_sandbox(backend, image, workdir="/app") as sb:
            await sb.run("mkdir -p /app && cd /app", 10)
            engine = ScriptedEngine(tok, replies, repeat_last=False)
            return await run_episode(TASK, engine, sb, tok, make_scaffold(scaffold),
                                     limits=AgentLimits(**{"max_turns": 20, "command_timeout_s": 10, **limits}),
                                     workdir="/app")

    return asyncio.run(go())


def render(messages: list[dict]) -> list[str]:
    lines = []
    for m in messages:
        lines.append(f"===== {m['role']}" + (f" calls={json.dumps(m['calls'])}" if m.get("calls") is not None else ""))
        lines.extend(str(m.get("content")).split("\n"))
    return lines


def assert_same(ours: list[dict], reference: list[dict]):
    a, b = render(ours), render(reference)
    if a != b:
        width = 70
        side = [f"{x[:width]:<{width}} | {y[:width]}" for x, y in zip(a + [""] * (len(b) - len(a)),
                                                                      b + [""] * (len(a) - len(b)))]
        diff = "\n".join(difflib.unified_diff(b, a, "original", "ours", lineterm="", n=2))
        pytest.fail("transcripts differ (ours | original):\n" + "\n".join(side[:400]) + "\n\n" + diff)


# ------------------------------------------------------------------------------- Terminal-Bench-RL reference


class TbrlReference:
    """Terminal-Bench-RL's agent and environment, as its source defines them, for the actions used here."""

    def __init__(self, system_prompt: str, examples: dict[str, str]):
        self.system_prompt, self.examples = system_prompt, examples
        self.todos: dict[int, dict] = {}
        self.next_id = 1
        self.notes: list[str] = []
        self.files: dict[str, str] = {}
        self.parse_errors = 0

    # action_parser.py: ActionParserXMLYaml
    def parse(self, response: str):
        matches = re.findall(r"<(\w+)>([\s\S]*?)</\1>", response)
        actions, errors = [], []
        attempt = any(tag.lower() != "think" for tag, _ in matches)
        for tag, content in matches:
            if tag.lower() == "think":
                continue
            try:
                data = yaml.safe_load(content.strip())
            except yaml.YAMLError as e:
                mark = getattr(e, "problem_mark", None)
                desc = (f"YAML syntax error at line {mark.line + 1}, column {mark.column + 1}: "
                        f"{getattr(e, 'problem', None) or e}") if mark else f"YAML parsing error: {e}"
                errors.append(self.parse_error(tag, content, desc))
                continue
            if not isinstance(data, dict):
                desc = "Invalid action format. Expected YAML."
                if data is not None:
                    desc += f"\nReceived type: {type(data).__name__}"
                    if isinstance(data, (str, int, float, bool)):
                        desc += f" with value: {data!r}"
                errors.append(self.parse_error(tag, content, desc))
                continue
            if tag in ("bash", "file", "search", "todo", "scratchpad", "finish"):
                actions.append((tag, data))
        return actions, errors, attempt

    def parse_error(self, tag, content, desc):
        shown = content if len(content) <= 100 else content[:100] + "..."
        body = f'[ERROR] Failed to parse <{tag}> action: {desc}\nContent: "{shown}"\n'
        if tag in self.examples:  # _format_parsing_error: no example for other element names
            body += f"Expected format:\n{self.examples[tag]}"
        return f"<parse_error>\n{body}\n</parse_error>"

    # action_handler.py, state_managers.py (outputs of the actions used in the script)
    def todo_list(self):
        if not self.todos:
            return "Todo list is empty."
        return "\n".join(["Todo List:"] + [f"[{'✓' if t['done'] else ' '}] [{i}] {t['content']}"
                                           for i, t in sorted(self.todos.items())])

    def handle(self, tag, d, shell_output):
        if tag == "bash":
            return shell_output(d["cmd"]), False
        if tag == "todo":
            res = []
            for op in d["operations"]:
                if op["action"] == "add":
                    self.todos[self.next_id] = {"content": op["content"], "done": False}
                    res.append(f"Added todo [{self.next_id}]: {op['content']}")
                    self.next_id += 1
                elif op["action"] == "complete":
                    t = self.todos.get(op["task_id"])
                    if t is None:
                        res.append(f"[ERROR] Task {op['task_id']} not found")
                    else:
                        t["done"] = True
                        res.append(f"Completed task [{op['task_id']}]: {t['content']}")
            text = "\n".join(res)
            return (text + f"\n\n{self.todo_list()}" if d.get("view_all") else text), False
        if tag == "scratchpad":
            if d["action"] == "add_note":
                self.notes.append(d["content"])
                return f"Added note {len(self.notes)} to scratchpad", False
            return "\n".join(["Scratchpad Contents:"] + [f"\n--- Note {i + 1} ---\n{n}" for i, n in
                                                          enumerate(self.notes)]), False
        if tag == "file":
            path = d["file_path"]
            if d["action"] == "write":
                self.files[path] = d["content"]
                return f"Successfully wrote to {path}", False
            if d["action"] == "read":  # nl -ba
                return "".join(f"{i:6d}\t{line}\n" for i, line in enumerate(self.files[path].splitlines(), 1)), False
            if d["action"] == "edit":
                self.files[path] = self.files[path].replace(d["old_string"], d["new_string"], 1)
                return f"Successfully replaced first occurrence in {path}", False
        if tag == "search":  # grep -r -n -H on one file
            hits = [f"{d['path']}:{i}:{line}" for i, line in enumerate(self.files[d["path"]].splitlines(), 1)
                    if re.search(d["pattern"], line)]
            return "\n".join(hits) + "\n" if hits else "No matches found", False
        if tag == "finish":
            return f"Task marked as complete: {d.get('message', 'Task completed')}", False
        raise AssertionError(tag)

    # step_executor.py + docker_env.py + terminal_agent.py
    def conversation(self, instruction: str, replies: list[str], shell_output) -> tuple[list[dict], str]:
        convo = [{"role": "system", "content": self.system_prompt.strip()}, {"role": "user", "content": instruction}]
        for reply in replies:
            convo.append({"role": "assistant", "content": reply})
            actions, errors, attempt = self.parse(reply)
            if not attempt:
                return convo, "no_action"
            responses = list(errors)
            if actions:
                self.parse_errors = 0
            elif errors:
                self.parse_errors += 1
                if self.parse_errors >= 3:
                    return convo, "parse_errors"
            done = False
            for tag, d in actions:
                out, _ = self.handle(tag, d, shell_output)
                responses.append(f"<{tag}_output>\n{out}\n</{tag}_output>")
                if tag == "finish" or (tag == "bash" and d.get("end_after_cmd_success")):
                    done = True
                    break
            if done:
                return convo, "finished"
            convo.append({"role": "user", "content": "\n\n".join(responses) if responses else "No actions parsed"})
        raise AssertionError("the script ended before the episode")


TBRL_SCRIPT = [
    "<think>\nFirst a plan, then a look around. <bash>\ncmd: rm -rf /app\n</bash> is not for now.\n</think>\n"
    "<todo>\noperations:\n  - action: add\n    content: write the greeting\n  - action: add\n"
    "    content: check it\nview_all: true\n</todo>\n"
    "<bash>\ncmd: printf 'alpha\\nbeta\\n'\n</bash>\n"
    "<file>\naction: read\nfile_path: [unclosed\n</file>",
    "Writing the file now.\n<file>\naction: write\nfile_path: /app/greet.txt\ncontent: |\n  hello\n  world\n</file>\n"
    "<file>\naction: read\nfile_path: /app/greet.txt\n</file>\n"
    "<search>\naction: grep\npattern: wor\npath: /app/greet.txt\n</search>",
    "<file>\naction: edit\nfile_path: /app/greet.txt\nold_string: hello\nnew_string: goodbye\n</file>\n"
    "<scratchpad>\naction: add_note\ncontent: edited the greeting\n</scratchpad>\n"
    "<scratchpad>\naction: view_all_notes\n</scratchpad>\n"
    "<todo>\noperations:\n  - action: complete\n    task_id: 1\n  - action: complete\n    task_id: 9\n</todo>\n"
    "<note>an element of another name is an attempt that does nothing</note>",
    "<bash>\ncmd: cat /app/greet.txt\n</bash>\n<bash>\ncmd: 'echo \"done: yes\"'\n</bash>",
    "<b>no tool here</b>",
    "<finish>\nmessage: greeting written and checked\n</finish>",
]
# both parsers strip the element's body before YAML: the block scalar loses its final newline, and so does the file
SHELL = {"printf 'alpha\\nbeta\\n'": "alpha\nbeta\n", "cat /app/greet.txt": "goodbye\nworld",
         'echo "done: yes"': "done: yes\n"}


def tbrl_reference(replies):
    ref = TbrlReference(load_prompt("tbrl", timeout=30), ours_tbrl.EXAMPLES)
    return ref.conversation(TASK.instruction, replies, SHELL.__getitem__)


def test_tbrl_transcript_matches_terminal_bench_rl(qwen3, sandbox_backend):
    traj = run(qwen3, "tbrl", TBRL_SCRIPT, sandbox_backend)
    reference, end = tbrl_reference(TBRL_SCRIPT)
    assert_same(traj.messages, reference)
    assert traj.end_reason == end == "finished", traj.error
    # the layout: the long system prompt alone in the system turn, the task as given in the user turn
    assert traj.messages[0]["role"] == "system" and len(traj.messages[0]["content"]) > 8000
    assert traj.messages[1] == {"role": "user", "content": TASK.instruction}


@pytest.mark.parametrize("replies", [
    ["<todo>\noperations:\n  - action: add\n    content: look\n</todo>", "I believe the task is complete."],
    ["<bash>\ncmd: [\n</bash>", "<bash>\ncmd: 'a: b: c'\nx: [\n</bash>", "<finish>\n- not a mapping\n</finish>"],
    ["<bash>\ncmd: printf 'alpha\\nbeta\\n'\n</bash>", "<bash>\ncmd: [\n</bash>",
     "<bash>\ncmd: printf 'alpha\\nbeta\\n'\nend_after_cmd_success: true\n</bash>"],
], ids=["no_action_ends", "three_parse_errors_end", "end_after_cmd_success"])
def test_tbrl_episode_ends_as_terminal_bench_rl_ends_it(qwen3, sandbox_backend, replies):
    traj = run(qwen3, "tbrl", replies, sandbox_backend)
    reference, end = tbrl_reference(replies)
    assert_same(traj.messages, reference)
    assert traj.end_reason == end, (traj.end_reason, traj.error)


# ------------------------------------------------------------------------------------------ Tmax reference

MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


def hermes_tool_calls(text: str):
    """vLLM's Hermes2ProToolParser.extract_tool_calls: (tool calls, content)."""
    if "<tool_call>" not in text:
        return [], text
    try:
        raw = [json.loads(a if a else b) for a, b in
               re.findall(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", text, re.DOTALL)]
        calls = [{"id": f"call_{k}", "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                 for k, c in enumerate(raw)]
    except Exception:  # noqa: BLE001 - the parser reports no call on any failure
        return [], text
    return calls, text[: text.find("<tool_call>")]


def extract_tool_call(calls):
    """sample_solutions._extract_tool_call."""
    if not calls:
        return {"type": "no_tool_call", "tool_call_id": None}
    f = calls[0]["function"]
    if f["name"] != "bash":
        return {"type": "no_tool_call", "tool_call_id": calls[0]["id"]}
    command = json.loads(f["arguments"]).get("command", "").strip()
    return {"type": "done" if MARKER in command else "command", "command": command, "tool_call_id": calls[0]["id"]}


def vanillux_truncate(output: str) -> str:
    """vanillux_solver._truncate_observation with max_chars 10000, head 5000, tail 5000."""
    if len(output) <= 10000:
        return output
    return (f"{ours_tmax.TOO_LONG_HINT}\n\n---- HEAD (5000 chars) ----\n{output[:5000]}\n"
            f"---- {len(output) - 10000} chars elided ----\n---- TAIL (5000 chars) ----\n{output[-5000:]}")


def vanillux_conversation(instance: str, replies: list[str], execute, format_error):
    """Vanillux2Agent.run: the messages sent with each request, and how the run ended."""
    messages = [{"role": "system", "content": load_prompt("tmax_system").strip() + "\n"},
                {"role": "user", "content": instance}]
    for reply in replies:
        calls, _ = hermes_tool_calls(reply)
        action = extract_tool_call(calls)
        messages.append({"role": "assistant", "calls": [[c["function"]["name"], json.loads(c["function"]["arguments"])]
                                                         for c in calls]})
        if action["type"] == "no_tool_call":
            content = format_error(calls)
            messages.append({"role": "tool" if action["tool_call_id"] else "user", "content": content})
            continue
        output, code = execute(action["command"])
        output = output.rstrip()
        tool_content = f"{vanillux_truncate(output) if output else '(no output)'}\n\n(exit_code={code})"
        if action["type"] == "done" or MARKER in tool_content:
            return messages, "finished"  # the last tool message is logged, never sent
        messages.append({"role": "tool", "content": tool_content})
    raise AssertionError("the script ended before the episode")


def call(name, args, *, close=True):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n" + ("</tool_call>" if close else "")


TMAX_SCRIPT = [
    "THOUGHT: look at the directory first.\n\n" + call("bash", {"command": "printf 'one\\ntwo\\n'   "}),
    "THOUGHT: I will just think about it.",
    "THOUGHT: try python.\n\n" + call("python", {"code": "print(1)"}),
    "THOUGHT: a failing command.\n\n" + call("bash", {"command": "sh -c 'exit 3'"}),
    "THOUGHT: broken JSON.\n\n<tool_call>\n{\"name\": \"bash\", \"arguments\": {\"command\": \"ls\"\n</tool_call>",
    "THOUGHT: a big output.\n\n" + call("bash", {"command": "head -c 12000 /dev/zero | tr '\\0' x"}),
    "THOUGHT: two calls; only the first runs.\n\n" + call("bash", {"command": "printf A"}) + "\n" +
    call("bash", {"command": "printf B"}),
    "<think>\nThe reasoning may mention " + call("bash", {"command": "printf never"}) + " without running it.\n"
    "</think>\n\nTHOUGHT: an unclosed final call still counts.\n\n" + call("bash", {"command": "printf end"}, close=False),
    "THOUGHT: done.\n\n" + call("bash", {"command": f"echo {MARKER}"}),
]
TMAX_SHELL = {"printf 'one\\ntwo\\n'": ("one\ntwo\n", 0), "sh -c 'exit 3'": ("", 3),
              "head -c 12000 /dev/zero | tr '\\0' x": ("x" * 12000, 0), "printf A": ("A", 0),
              "printf end": ("end", 0), f"echo {MARKER}": (f"{MARKER}\n", 0)}


def tmax_format_error(calls):
    """Our wording in the original's format-error template (the original says the same for every case)."""
    if not calls:
        return ours_tmax.FORMAT_ERROR.format(error=ours_tmax.NO_CALL)
    return ours_tmax.FORMAT_ERROR.format(error=f"unknown tool '{calls[0]['function']['name']}'; the only tool is "
                                               "`bash`.")


def test_tmax_transcript_matches_the_tmax_agent(qwen3, sandbox_backend):
    traj = run(qwen3, "tmax", TMAX_SCRIPT, sandbox_backend, max_parse_error_turns=64)
    instance = load_prompt("tmax", task=TASK.instruction.strip(), marker=MARKER, timeout=120)
    # the reasoning's call is not a call (only text after </think> is read), as with a reasoning parser
    script = [r.split("</think>")[-1] for r in TMAX_SCRIPT]
    reference, end = vanillux_conversation(instance, script, TMAX_SHELL.__getitem__, tmax_format_error)
    ours = [{"role": m["role"], "calls": [[c["function"]["name"], c["function"]["arguments"]]
                                          for c in m.get("tool_calls", [])]}
            if m["role"] == "assistant" else m for m in traj.messages]
    assert_same(ours, reference)
    assert traj.end_reason == end == "finished", traj.error
    scaffold = make_scaffold("tmax")
    assert scaffold.tools == [ours_tmax.BASH_TOOL]
    params = scaffold.tools[0]["function"]["parameters"]
    assert scaffold.tools[0]["function"]["name"] == "bash" and params["required"] == ["command"]
    assert list(params["properties"]) == ["command"]
    assert f"echo {MARKER}" in traj.messages[1]["content"] and TASK.instruction.strip() in traj.messages[1]["content"]


def test_tmax_ends_when_the_marker_appears_in_an_output(qwen3, sandbox_backend):
    replies = ["THOUGHT: print the marker indirectly.\n\n" + call("bash", {"command": "echo COMPLETE_TASK_AND_SUBMIT_"
                                                                                     "$(echo FINAL_OUTPUT)"}),
               "THOUGHT: never reached.\n\n" + call("bash", {"command": "printf no"})]
    traj = run(qwen3, "tmax", replies, sandbox_backend)
    assert traj.end_reason == "finished" and len(traj.turns) == 1


def test_tmax_marker_in_the_elided_middle_of_an_output_does_not_end(qwen3, sandbox_backend):
    # the original looks for the marker in the tool message it sends, after its 5k + 5k head/tail cut
    middle = ("head -c 6000 /dev/zero | tr '\\0' a; echo; echo COMPLETE_TASK_AND_SUBMIT_$(echo FINAL_OUTPUT); "
              "head -c 6000 /dev/zero | tr '\\0' b")
    replies = ["THOUGHT: a long output.\n\n" + call("bash", {"command": middle}),
               "THOUGHT: still here.\n\n" + call("bash", {"command": "printf more"})]
    traj = run(qwen3, "tmax", replies, sandbox_backend, max_turns=2)
    assert traj.end_reason == "max_turns" and len(traj.turns) == 2, (traj.end_reason, traj.error)
    assert MARKER not in traj.messages[3]["content"] and "chars elided" in traj.messages[3]["content"]
