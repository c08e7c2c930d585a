"""The agent's tools over the ``Sandbox`` protocol (Claude-Code-like, as in Terminal-Bench-RL).

``bash`` runs in the persistent shell; the file tools move bytes through the sandbox's file API (never
``sed``), so quotes, newlines, unicode and binary content are safe; ``search`` runs grep / glob / ls in a
fresh process, capped; ``todo`` and ``scratchpad`` are the agent's own notes; ``finish`` ends the episode.

Arguments come from model text (YAML or JSON), so any value can arrive: ``validate`` turns them into checked,
normalised arguments or a ``ToolError`` (what the model reads). A failed call is an error result
(``ok=False``, text ``[ERROR] ...``), never an exception; only a lost sandbox (``SandboxLost``) propagates.
"""

from __future__ import annotations

import dataclasses
import datetime
import fnmatch
import math
import posixpath
import shlex
from collections.abc import Mapping
from typing import Any

from jaxrl_term.agent.text import clean_value
from jaxrl_term.sandbox.base import Sandbox, SandboxError, SandboxLost

SEARCH_CAP = 100  # lines
READ_LIMIT = 2000  # lines per read by default
MAX_READ_BYTES = 8 << 20  # larger files are for bash (head, grep)
MAX_PATH_CHARS = 4096
MAX_PATTERN_CHARS = 8192
MAX_COMMAND_TIMEOUT_S = 600.0
TOOL_NAMES = ("bash", "file", "search", "todo", "scratchpad", "finish")
FILE_ACTIONS = ("read", "write", "edit", "multi_edit", "metadata")
SEARCH_ACTIONS = ("grep", "glob", "ls")
TODO_ACTIONS = ("add", "complete", "delete", "view_all")
NOTE_ACTIONS = ("add_note", "view_all_notes")
_TRUE, _FALSE = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}


@dataclasses.dataclass
class ToolResult:
    tool: str
    ok: bool
    text: str
    finished: bool = False
    exit_code: int | None = None
    timed_out: bool = False
    duration_s: float = 0.0
    output: str | None = None  # bash: the command's own output, without the notes added to ``text``


class ToolError(Exception):
    """A bad call (wrong or missing arguments, no match...): shown to the model as an error result."""


# -------------------------------------------------------------------------------------------- arguments


def _type(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def _depth(v: Any, limit: int) -> bool:
    """Whether ``v`` nests no deeper than ``limit`` lists / mappings (iteratively: no recursion)."""
    stack = [(v, 0)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, (dict, list)):
            if d >= limit:
                return False
            stack.extend((y, d + 1) for y in (x.values() if isinstance(x, dict) else x))
    return True


def _str(args: Mapping, key: str, *, required: bool = True, default: str | None = None, nonempty: bool = False,
         max_chars: int | None = None, alias: str | None = None) -> str | None:
    v = args.get(key, args.get(alias) if alias else None)
    if v is None:
        if required:
            raise ToolError(f"missing required argument `{key}`")
        return default
    if isinstance(v, bool) or not isinstance(v, (str, int, float, datetime.date)):
        raise ToolError(f"`{key}` must be a string, got {_type(v)}")
    if isinstance(v, datetime.date):
        v = v.isoformat()  # YAML reads `2024-01-02` as a date
    elif not isinstance(v, str):
        v = str(v)
    if nonempty and not v.strip():
        raise ToolError(f"`{key}` must not be empty")
    if max_chars is not None and len(v) > max_chars:
        raise ToolError(f"`{key}` is {len(v)} characters long; at most {max_chars}")
    return v


def _path(args: Mapping, key: str, *, required: bool = True, default: str | None = None,
          alias: str | None = None) -> str | None:
    p = _str(args, key, required=required, default=default, nonempty=required, max_chars=MAX_PATH_CHARS, alias=alias)
    if p is not None and "\x00" in p:
        raise ToolError(f"`{key}` contains a NUL character")
    return p


def _int(args: Mapping, key: str, default: int | None, *, minimum: int | None = None) -> int | None:
    v = args.get(key)
    if v is None:
        return default
    n: int | None = None
    if isinstance(v, int) and not isinstance(v, bool):
        n = v
    elif isinstance(v, float) and math.isfinite(v) and v == int(v):
        n = int(v)
    elif isinstance(v, str) and len(v) < 24:
        try:
            n = int(v.strip())
        except ValueError:
            n = None
    if n is None or abs(n) > 10**12:
        raise ToolError(f"`{key}` must be an integer, got {v!r:.80}")
    if minimum is not None and n < minimum:
        raise ToolError(f"`{key}` must be at least {minimum}, got {n}")
    return n


def _seconds(args: Mapping, key: str) -> float | None:
    v = args.get(key)
    if v is None:
        return None
    x: float | None = None
    if isinstance(v, (int, float, str)) and not isinstance(v, bool):
        try:
            x = float(v.strip() if isinstance(v, str) else v)
        except (ValueError, OverflowError):
            x = None
    if x is None or not math.isfinite(x) or x <= 0:
        raise ToolError(f"`{key}` must be a positive number of seconds, got {v!r:.80}")
    return x


def _bool(args: Mapping, key: str, default: bool) -> bool:
    v = args.get(key)
    if v is None:
        return default
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in _TRUE | _FALSE:
        return v.strip().lower() in _TRUE
    raise ToolError(f"`{key}` must be true or false, got {v!r:.80}")


def _str_list(args: Mapping, key: str, *, required: bool, max_items: int | None = None) -> list[str]:
    v = args.get(key)
    if v is None or v == []:
        if required:
            raise ToolError(f"missing required argument `{key}` (a list)")
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list):
        raise ToolError(f"`{key}` must be a list, got {_type(v)}")
    if max_items is not None and len(v) > max_items:
        raise ToolError(f"`{key}` has {len(v)} items; at most {max_items}")
    return [_path({key: x}, key) for x in v]


def _choice(args: Mapping, key: str, choices: tuple[str, ...], what: str) -> str:
    v = args.get(key)
    if v is None:
        raise ToolError(f"{what} requires `{key}`: one of {', '.join(choices)}")
    if not isinstance(v, str) or v not in choices:
        raise ToolError(f"unknown {what} {key} {v!r:.60}; use one of {', '.join(choices)}")
    return v


def validate(tool: str, args: Any) -> dict[str, Any]:
    """Checked, normalised arguments for ``tool``, or ``ToolError`` saying what is wrong."""
    if tool not in TOOL_NAMES:
        raise ToolError(f"unknown tool `{tool:.60}`; available tools: {', '.join(TOOL_NAMES)}")
    if not isinstance(args, Mapping):
        raise ToolError(f"arguments must be a mapping of name: value, got {_type(args)}")
    if not _depth(dict(args), 16):
        raise ToolError("the arguments are nested too deeply")
    args = clean_value(dict(args))
    if not all(isinstance(k, str) for k in args):
        raise ToolError("argument names must be strings")
    return _VALIDATORS[tool](args)


def _v_bash(a):
    return {"cmd": _str(a, "cmd", alias="command", nonempty=True), "block": _bool(a, "block", True),
            "timeout_secs": _seconds(a, "timeout_secs") or _seconds(a, "timeout"),
            "end_after_cmd_success": _bool(a, "end_after_cmd_success", False)}


def _v_file(a):
    action = _choice(a, "action", FILE_ACTIONS, "file action")
    if action == "metadata":
        paths = _str_list(a, "file_paths", required=False, max_items=10) or _str_list(a, "file_path", required=False)
        if not paths:
            raise ToolError("metadata requires `file_paths`: a list of 1 to 10 paths")
        return {"action": action, "file_paths": paths}
    out = {"action": action, "file_path": _path(a, "file_path", alias="path")}
    if action == "read":
        out.update(offset=_int(a, "offset", None, minimum=1), limit=_int(a, "limit", None, minimum=1))
    elif action == "write":
        out["content"] = _str(a, "content", required=False, default="")
    elif action == "edit":
        pre = a.get("edits")  # already validated (validate is idempotent: the loop validates, then the tool runs)
        out["edits"] = ([_edit(pre[0], "")] if "old_string" not in a and isinstance(pre, list) and len(pre) == 1
                        else [_edit(a, "")])
    else:
        edits = a.get("edits")
        if not isinstance(edits, list) or not edits:
            raise ToolError("multi_edit requires `edits`: a list of {old_string, new_string, replace_all}")
        out["edits"] = [_edit(e, f"edit {k}: ") for k, e in enumerate(edits, 1)]
    return out


def _edit(e, where: str) -> dict:
    if not isinstance(e, Mapping):
        raise ToolError(f"{where}must be a mapping with old_string and new_string, got {_type(e)}")
    try:
        old = _str(e, "old_string", nonempty=True)
        new = _str(e, "new_string")
        return {"old_string": old, "new_string": new, "replace_all": _bool(e, "replace_all", False)}
    except ToolError as err:
        raise ToolError(f"{where}{err}") from None


def _v_search(a):
    action = _choice(a, "action", SEARCH_ACTIONS, "search action")
    out = {"action": action, "path": _path(a, "path", required=False, default=".") or "."}
    if action in ("grep", "glob"):
        out["pattern"] = _str(a, "pattern", nonempty=True, max_chars=MAX_PATTERN_CHARS)
        if "\x00" in out["pattern"]:
            raise ToolError("`pattern` contains a NUL character")
    if action == "grep":
        out["include"] = _path(a, "include", required=False)
    if action == "ls":
        out["ignore"] = _str_list(a, "ignore", required=False)
    return out


def _v_todo(a):
    ops = a.get("operations")
    if ops is None and "action" in a:
        raise ToolError("todo takes an `operations` list: operations: [{action: add, content: ...}]")
    if not isinstance(ops, list) or not ops:
        raise ToolError(f"`operations` must be a non-empty list, got {_type(ops)}")
    out, seen = [], set()
    for i, op in enumerate(ops, 1):
        if not isinstance(op, Mapping):
            raise ToolError(f"operation {i} must be a mapping, got {_type(op)}")
        try:
            act = _choice(op, "action", TODO_ACTIONS, "todo action")
            item = {"action": act}
            if act == "add":
                item["content"] = _str(op, "content", nonempty=True)
            elif act in ("complete", "delete"):
                item["task_id"] = _int(op, "task_id", None, minimum=1)
                if item["task_id"] is None:
                    raise ToolError(f"`{act}` requires `task_id`")
                if (act, item["task_id"]) in seen:
                    raise ToolError(f"duplicate {act} of task {item['task_id']}")
                seen.add((act, item["task_id"]))
        except ToolError as e:
            raise ToolError(f"operation {i}: {e}") from None
        out.append(item)
    return {"operations": out, "view_all": _bool(a, "view_all", False)}


def _v_scratchpad(a):
    action = _choice(a, "action", NOTE_ACTIONS, "scratchpad action")
    return {"action": action, "content": _str(a, "content", required=False, default="")}


def _v_finish(a):
    return {"message": _str(a, "message", required=False, default="Task completed")}


_VALIDATORS = {"bash": _v_bash, "file": _v_file, "search": _v_search, "todo": _v_todo,
               "scratchpad": _v_scratchpad, "finish": _v_finish}


# -------------------------------------------------------------------------------------------- the tools


class ToolBox:
    """One per episode: holds the sandbox, the work dir for relative paths, and the todo / notes state."""

    def __init__(self, sandbox: Sandbox, *, workdir: str = "/app", command_timeout_s: float = 30.0,
                 max_command_timeout_s: float = MAX_COMMAND_TIMEOUT_S):
        self.sb, self.workdir = sandbox, workdir
        self.command_timeout_s, self.max_command_timeout_s = command_timeout_s, max_command_timeout_s
        self.todos: dict[int, dict] = {}
        self.notes: list[str] = []
        self._next_todo = 1
        self._bg = 0
        self._aux_s = 30.0  # limit of the helper processes (stat, the write check) of the current call

    async def call(self, tool: str, args: Any, *, time_left_s: float | None = None) -> ToolResult:
        """Run one call. Bad arguments and failed operations are error results; a lost sandbox raises."""
        try:
            checked = validate(tool, args)
            left = None if time_left_s is None else max(1.0, time_left_s)
            self._aux_s = 30.0 if left is None else min(30.0, left)  # helpers, too, end with the episode
            return await getattr(self, f"_{tool}")(checked, left)
        except ToolError as e:
            return ToolResult(tool if tool in TOOL_NAMES else "unknown", False, f"[ERROR] {e}")
        except SandboxLost:
            raise  # the sandbox is gone: the episode ends as a sandbox error, not the model's fault
        except SandboxError as e:
            return ToolResult(tool, False, f"[ERROR] sandbox: {e}")

    def _abs(self, p: str) -> str:
        return posixpath.normpath(p if p.startswith("/") else posixpath.join(self.workdir, p))

    def _timeout(self, asked: float | None, time_left_s: float | None, default: float) -> float:
        t = max(1.0, min(asked or default, self.max_command_timeout_s))
        return max(1.0, min(t, time_left_s)) if time_left_s is not None else t

    # -- bash ---------------------------------------------------------------------------------------
    async def _bash(self, a, time_left_s):
        timeout = self._timeout(a["timeout_secs"], time_left_s, self.command_timeout_s)
        if not a["block"]:
            self._bg += 1
            log = f"/tmp/bg_{self._bg}.log"
            r = await self.sb.run(f"nohup bash -c {shlex.quote(a['cmd'])} > {log} 2>&1 &", timeout)
            text = f"Command started in background (output in {log})"
            return ToolResult("bash", r.exit_code == 0, text, exit_code=r.exit_code, duration_s=r.duration_s,
                              output=r.output)
        r = await self.sb.run(a["cmd"], timeout)
        text = r.output
        if r.timed_out:
            text += f"\n[Command timed out after {timeout:.0f} seconds and was interrupted]"
        if r.shell_restarted:
            text += "\n[the shell was restarted: variables and functions are gone]"
        ok = r.exit_code == 0 and not r.timed_out
        return ToolResult("bash", ok, text, a["end_after_cmd_success"] and ok, r.exit_code, r.timed_out,
                          r.duration_s, output=r.output)

    # -- file ---------------------------------------------------------------------------------------
    async def _stat(self, path: str) -> tuple[str, int, int] | None:
        """(kind, size, mode) of ``path`` following links, or None when it does not exist."""
        r = await self.sb.exec(["stat", "-L", "-c", "%F|%s|%a", "--", path], self._aux_s)
        parts = r.output.strip().split("|")
        if r.exit_code != 0 or len(parts) != 3 or not parts[1].isdigit():
            return None
        return parts[0], int(parts[1]), int(parts[2], 8) if parts[2].isdigit() else 0o644

    async def _read_text(self, path: str) -> tuple[str, int]:
        st = await self._stat(path)
        if st is None:
            raise ToolError(f"File not found: {path}")
        kind, size, mode = st
        if "regular" not in kind:
            raise ToolError(f"{path} is not a regular file ({kind})")
        if size > MAX_READ_BYTES:
            raise ToolError(f"{path} has {size} bytes; read large files with bash (head, tail, grep)")
        data = await self.sb.read_file(path)
        if b"\x00" in data[:8192]:
            raise ToolError(f"{path} is a binary file ({len(data)} bytes); inspect it with bash (xxd, file)")
        try:
            return data.decode("utf-8"), mode
        except UnicodeDecodeError as e:
            raise ToolError(f"{path} is not valid UTF-8 text ({e}); inspect it with bash") from e

    async def _writable(self, path: str) -> str:
        """The resolved path a write of ``path`` goes to, its parent created; ToolError when it cannot be written
        (kernel file systems, read-only mounts, a directory in the way)."""
        script = ('p=$(realpath -m -- "$1") || exit 2\n'
                  'case "$p" in /proc|/proc/*|/sys|/sys/*|/dev|/dev/*) echo "cannot write under /proc, /sys or /dev";'
                  ' exit 3;; esac\n'
                  'd=$(dirname -- "$p"); mkdir -p -- "$d" 2>&1 || exit 4\n'
                  '[ -w "$d" ] || { echo "$d is not writable"; exit 5; }\n'
                  'if [ -e "$p" ] && [ ! -f "$p" ]; then echo "$p exists and is not a regular file"; exit 6; fi\n'
                  'printf "%s" "$p"\n')
        r = await self.sb.exec(["sh", "-c", script, "sh", path], self._aux_s)
        if r.exit_code != 0 or not r.output.startswith("/"):
            raise ToolError(f"cannot write {path}: {r.output.strip() or 'exit status %s' % r.exit_code}")
        return r.output

    async def _file(self, a, time_left_s):
        action = a["action"]
        if action == "metadata":
            return await self._metadata(a["file_paths"])
        path = self._abs(a["file_path"])
        if action == "read":
            text, _ = await self._read_text(path)
            lines = text.splitlines()
            offset = a["offset"] or 1
            limit = a["limit"] or READ_LIMIT
            chunk = lines[offset - 1: offset - 1 + limit]
            body = "".join(f"{i:6d}\t{line}\n" for i, line in enumerate(chunk, start=offset))
            more = len(lines) - (offset - 1 + len(chunk))
            return ToolResult("file", True, body + (f"[... {more} more lines; use offset/limit]" if more > 0 else ""))
        if action == "write":
            target = await self._writable(path)
            await self.sb.write_file(target, a["content"].encode(), 0o644)
            return ToolResult("file", True, f"Successfully wrote to {path}")
        text, mode = await self._read_text(path)
        notes = []
        for k, e in enumerate(a["edits"], start=1):
            where = f"edit {k}: " if action == "multi_edit" else ""
            n = text.count(e["old_string"])
            if n == 0:
                raise ToolError(f"{where}old_string not found in {path}; nothing was changed")
            if n > 1 and not e["replace_all"]:
                raise ToolError(f"{where}old_string occurs {n} times in {path}; add surrounding context to make it "
                                "unique (or set replace_all: true); nothing was changed")
            text = text.replace(e["old_string"], e["new_string"], -1 if e["replace_all"] else 1)
            what = "all occurrences" if e["replace_all"] else "first occurrence"
            notes.append(f"{'Edit %d: ' % k if action == 'multi_edit' else ''}Successfully replaced {what} in {path}")
        target = await self._writable(path)
        await self.sb.write_file(target, text.encode(), mode)
        return ToolResult("file", True, "\n".join(notes))

    async def _metadata(self, paths: list[str]) -> ToolResult:
        out = []
        for p in paths:
            p = self._abs(p)
            r = await self.sb.exec(["stat", "-L", "-c", "%s|%U:%G|%a|%F", "--", p], self._aux_s)
            parts = r.output.strip().split("|")
            if r.exit_code != 0 or len(parts) != 4:
                out.append(f"{p}: Not found")
            else:
                out.append(f"{p}:\n  Size: {parts[0]} bytes\n  Type: {parts[3]}\n  Owner: {parts[1]}\n"
                           f"  Permissions: {parts[2]}")
        return ToolResult("file", True, "\n\n".join(out))

    # -- search -------------------------------------------------------------------------------------
    async def _search(self, a, time_left_s):
        action, path = a["action"], self._abs(a["path"])
        timeout = self._timeout(60.0, time_left_s, 60.0)
        if action == "ls":
            return await self._ls(path, a["ignore"], timeout)
        if action == "grep":
            argv = ["grep", "-rnHI", "--color=never", "-E", "--", a["pattern"], path]
            if a["include"]:
                argv[1:1] = [f"--include={a['include']}"]
        else:
            argv = ["bash", "-c", 'shopt -s globstar nullglob dotglob; cd -- "$1" && printf "%s\\n" $2', "bash", path,
                    a["pattern"]]
        r = await self.sb.exec(argv, timeout)
        if r.timed_out:
            raise ToolError(f"the search timed out after {timeout:.0f}s; narrow it")
        if action == "grep" and r.exit_code not in (0, 1):
            raise ToolError(f"grep failed: {r.output.strip()[:500]}")
        if action == "glob" and r.exit_code != 0:
            raise ToolError(f"glob failed: {r.output.strip()[:500] or 'no such directory: ' + path}")
        lines = [ln for ln in r.output.splitlines() if ln]
        if not lines:
            return ToolResult("search", True, "No matches found" if action == "grep" else
                              "No files found matching pattern")
        unit = "matches" if action == "grep" else "files"
        if len(lines) > SEARCH_CAP:
            text = "\n".join(lines[:SEARCH_CAP]) + \
                f"\n\n[Output truncated to {SEARCH_CAP} {unit}; {len(lines) - SEARCH_CAP} more not shown]"
        else:  # grep's own output (as Terminal-Bench-RL shows it); file names one per line
            text = r.output if action == "grep" else "\n".join(lines)
        return ToolResult("search", True, text)

    async def _ls(self, path: str, ignore: list[str], timeout: float) -> ToolResult:
        st = await self._stat(path)
        if st is None:
            raise ToolError(f"Path not found: {path}")
        if st[0] != "directory":
            raise ToolError(f"Path is not a directory: {path}")
        r = await self.sb.exec(["ls", "-la", "--", path], timeout)
        if r.exit_code != 0:
            raise ToolError(f"ls failed: {r.output.strip()[:500]}")
        if not ignore:
            return ToolResult("search", True, r.output)
        lines = r.output.rstrip("\n").split("\n")

        def name(line: str) -> str | None:
            parts = line.split(None, 8)
            return parts[8].split(" -> ")[0] if len(parts) == 9 else None

        def ignored(n: str, pattern: str) -> bool:
            # a glob matches the name; a bare word anywhere in it (Terminal-Bench-RL's rule: `node` hides node_modules)
            return fnmatch.fnmatchcase(n, pattern) or (not any(c in pattern for c in "*?[") and pattern in n)

        lines = [ln for ln in lines if (n := name(ln)) is None or not any(ignored(n, g) for g in ignore)]
        return ToolResult("search", True, "\n".join(lines))

    # -- todo / scratchpad / finish -----------------------------------------------------------------
    def _todo_list(self) -> str:
        if not self.todos:
            return "Todo list is empty."
        return "\n".join(["Todo List:"] + [f"[{'✓' if t['done'] else ' '}] [{i}] {t['content']}"
                                           for i, t in sorted(self.todos.items())])

    async def _todo(self, a, time_left_s):
        msgs, ok, show = [], True, a["view_all"]
        for op in a["operations"]:
            act = op["action"]
            if act == "add":
                self.todos[self._next_todo] = {"content": op["content"], "done": False}
                msgs.append(f"Added todo [{self._next_todo}]: {op['content']}")
                self._next_todo += 1
            elif act == "view_all":
                show = True
            else:
                tid = op["task_id"]
                item = self.todos.get(tid)
                if item is None:
                    msgs.append(f"[ERROR] Task {tid} not found")
                    ok = False
                elif act == "delete":
                    del self.todos[tid]
                    msgs.append(f"Deleted task [{tid}]: {item['content']}")
                elif item["done"]:
                    msgs.append(f"Task {tid} is already completed")
                else:
                    item["done"] = True
                    msgs.append(f"Completed task [{tid}]: {item['content']}")
        text = "\n".join(msgs)
        if show:
            text = f"{text}\n\n{self._todo_list()}" if text else self._todo_list()
        return ToolResult("todo", ok, text)

    async def _scratchpad(self, a, time_left_s):
        if a["action"] == "add_note":
            if not a["content"].strip():
                raise ToolError("Cannot add empty note")
            self.notes.append(a["content"])
            return ToolResult("scratchpad", True, f"Added note {len(self.notes)} to scratchpad")
        if not self.notes:
            return ToolResult("scratchpad", True, "Scratchpad is empty.")
        return ToolResult("scratchpad", True, "\n".join(["Scratchpad Contents:"] + [
            f"\n--- Note {i} ---\n{n}" for i, n in enumerate(self.notes, 1)]))

    async def _finish(self, a, time_left_s):
        return ToolResult("finish", True, f"Task marked as complete: {a['message']}", finished=True)


# JSON schemas for Qwen3's native tool calling (the qwen_tools scaffold)
_S, _I, _B = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}
TOOL_SCHEMAS = [
    {"type": "function", "function": {"name": "bash", "description": "Run a command in the persistent bash shell.",
     "parameters": {"type": "object", "properties": {
         "cmd": {"type": "string", "description": "the command"},
         "timeout_secs": {"type": "integer", "description": "seconds before it is interrupted (default 30, at most 600)"},
         "block": {"type": "boolean", "description": "false runs it in the background"},
         "end_after_cmd_success": {"type": "boolean", "description": "end the task if the command succeeds"}},
         "required": ["cmd"]}}},
    {"type": "function", "function": {"name": "file", "description": "Read, write or edit files (exact string edits).",
     "parameters": {"type": "object", "properties": {
         "action": {"type": "string", "enum": list(FILE_ACTIONS)},
         "file_path": _S, "content": _S, "offset": _I, "limit": _I, "old_string": _S, "new_string": _S,
         "replace_all": _B, "edits": {"type": "array", "items": {"type": "object"}},
         "file_paths": {"type": "array", "items": _S}}, "required": ["action"]}}},
    {"type": "function", "function": {"name": "search", "description": "grep file contents, glob file names, or ls.",
     "parameters": {"type": "object", "properties": {
         "action": {"type": "string", "enum": list(SEARCH_ACTIONS)}, "pattern": _S, "path": _S, "include": _S,
         "ignore": {"type": "array", "items": _S}}, "required": ["action"]}}},
    {"type": "function", "function": {"name": "todo", "description": "Manage your task list.",
     "parameters": {"type": "object", "properties": {"operations": {"type": "array", "items": {"type": "object"}},
                                                     "view_all": _B}, "required": ["operations"]}}},
    {"type": "function", "function": {"name": "scratchpad", "description": "Keep notes.",
     "parameters": {"type": "object", "properties": {
         "action": {"type": "string", "enum": list(NOTE_ACTIONS)}, "content": _S}, "required": ["action"]}}},
    {"type": "function", "function": {"name": "finish", "description": "End the task once it is verified done.",
     "parameters": {"type": "object", "properties": {"message": _S}, "required": ["message"]}}},
]
