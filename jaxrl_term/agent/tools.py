"""The agent's tools over the ``Sandbox`` protocol (Claude-Code-like, as in Terminal-Bench-RL).

``bash`` runs in the persistent shell; the file tools move bytes through the sandbox's file API (never
``sed``), so quotes, newlines, unicode and binary content are safe; ``search`` runs grep / glob / ls in a
fresh process, capped; ``todo`` and ``scratchpad`` are the agent's own notes; ``finish`` ends the episode.
Every failure comes back as an error result (``ok=False``) for the model to read, never as an exception.
"""

from __future__ import annotations

import dataclasses
import posixpath
import shlex
from collections.abc import Mapping
from typing import Any

from jaxrl_term.sandbox.base import Sandbox, SandboxError, SandboxLost

SEARCH_CAP = 100  # lines
READ_LIMIT = 2000  # lines per read by default
TOOL_NAMES = ("bash", "file", "search", "todo", "scratchpad", "finish")


@dataclasses.dataclass
class ToolResult:
    tool: str
    ok: bool
    text: str
    finished: bool = False
    exit_code: int | None = None
    timed_out: bool = False
    duration_s: float = 0.0


class ToolError(Exception):
    """A bad call (wrong or missing arguments, no match...): shown to the model as an error result."""


def _str(args: Mapping, key: str, required: bool = True, default: Any = None) -> Any:
    v = args.get(key, default)
    if v is None:
        if required:
            raise ToolError(f"missing required argument `{key}`")
        return default
    if not isinstance(v, str):
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return str(v)
        raise ToolError(f"`{key}` must be a string, got {type(v).__name__}")
    return v


def _int(args: Mapping, key: str, default: int | None) -> int | None:
    v = args.get(key, default)
    if v is None:
        return None
    try:
        return int(v)
    except (TypeError, ValueError) as e:
        raise ToolError(f"`{key}` must be an integer, got {v!r}") from e


class ToolBox:
    """One per episode: holds the sandbox, the work dir for relative paths, and the todo / notes state."""

    def __init__(self, sandbox: Sandbox, *, workdir: str = "/app", command_timeout_s: float = 30.0,
                 max_command_timeout_s: float = 600.0):
        self.sb, self.workdir = sandbox, workdir
        self.command_timeout_s, self.max_command_timeout_s = command_timeout_s, max_command_timeout_s
        self.todos: list[dict] = []
        self.notes: list[str] = []
        self._next_todo = 1
        self._bg = 0

    async def call(self, tool: str, args: Mapping[str, Any], *, time_left_s: float | None = None) -> ToolResult:
        if not isinstance(args, Mapping):
            return ToolResult(tool, False, f"arguments must be a mapping of name -> value, got {type(args).__name__}")
        handler = getattr(self, f"_{tool}", None) if tool in TOOL_NAMES else None
        if handler is None:
            return ToolResult(tool, False, f"unknown tool `{tool}`; available tools: {', '.join(TOOL_NAMES)}")
        try:
            return await handler(args, time_left_s)
        except ToolError as e:
            return ToolResult(tool, False, f"error: {e}")
        except SandboxLost:
            raise  # the sandbox is gone: the episode ends as a sandbox error, not the model's fault
        except SandboxError as e:
            return ToolResult(tool, False, f"sandbox error: {e}")

    def _path(self, p: str) -> str:
        return posixpath.normpath(p if p.startswith("/") else posixpath.join(self.workdir, p))

    # -- bash ---------------------------------------------------------------------------------------
    async def _bash(self, args, time_left_s):
        cmd = _str(args, "cmd", default=args.get("command"))
        block = args.get("block", True)
        timeout = float(args.get("timeout_secs", args.get("timeout", self.command_timeout_s)) or self.command_timeout_s)
        timeout = max(1.0, min(timeout, self.max_command_timeout_s))
        if time_left_s is not None:
            timeout = max(1.0, min(timeout, time_left_s))
        if block is False or str(block).lower() == "false":
            self._bg += 1
            log = f"/tmp/bg_{self._bg}.log"
            r = await self.sb.run(f"nohup bash -c {shlex.quote(cmd)} > {log} 2>&1 &\necho started, output in {log}",
                                  timeout)
            return ToolResult("bash", r.exit_code == 0, r.output, exit_code=r.exit_code, duration_s=r.duration_s)
        r = await self.sb.run(cmd, timeout)
        text = r.output
        if r.timed_out:
            text += f"\n[command timed out after {timeout:.0f}s and was interrupted]"
        if r.shell_restarted:
            text += "\n[the shell was restarted: variables and functions are gone]"
        ok = r.exit_code == 0 and not r.timed_out
        finished = bool(args.get("end_after_cmd_success")) and ok
        return ToolResult("bash", ok, text, finished, r.exit_code, r.timed_out, r.duration_s)

    # -- file ---------------------------------------------------------------------------------------
    async def _read_text(self, path: str) -> str:
        data = await self.sb.read_file(path)
        if b"\x00" in data[:8192]:
            raise ToolError(f"{path} is a binary file ({len(data)} bytes); inspect it with bash (xxd, file)")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ToolError(f"{path} is not valid UTF-8 text ({e}); inspect it with bash") from e

    async def _mode(self, path: str) -> int:
        r = await self.sb.exec(["stat", "-c", "%a", path], 30)
        return int(r.output.strip(), 8) if r.exit_code == 0 and r.output.strip().isdigit() else 0o644

    async def _file(self, args, time_left_s):
        action = _str(args, "action")
        if action == "metadata":
            paths = args.get("file_paths") or ([args["file_path"]] if args.get("file_path") else None)
            if not isinstance(paths, list) or not paths or len(paths) > 10:
                raise ToolError("metadata needs `file_paths`: a list of 1 to 10 paths")
            out = []
            for p in paths:
                p = self._path(str(p))
                r = await self.sb.exec(["stat", "-c", "%n: %F, %s bytes, mode %a, modified %y", p], 30)
                out.append(r.output.strip() if r.exit_code == 0 else f"{p}: no such file or directory")
            return ToolResult("file", True, "\n".join(out))
        path = self._path(_str(args, "file_path", default=args.get("path")))
        if action == "read":
            text = await self._read_text(path)
            lines = text.splitlines()
            offset = max(1, _int(args, "offset", 1) or 1)
            limit = _int(args, "limit", READ_LIMIT) or READ_LIMIT
            chunk = lines[offset - 1: offset - 1 + limit]
            body = "\n".join(f"{i:6d}\t{line}" for i, line in enumerate(chunk, start=offset))
            more = len(lines) - (offset - 1 + len(chunk))
            return ToolResult("file", True, body + (f"\n[... {more} more lines; use offset/limit]" if more > 0 else ""))
        if action == "write":
            content = args.get("content")
            if not isinstance(content, str):
                raise ToolError("write needs `content` (a string)")
            await self.sb.write_file(path, content.encode(), 0o644)
            return ToolResult("file", True, f"wrote {len(content.encode())} bytes to {path}")
        if action in ("edit", "multi_edit"):
            edits = [args] if action == "edit" else args.get("edits")
            if not isinstance(edits, list) or not edits:
                raise ToolError("multi_edit needs `edits`: a list of {old_string, new_string}")
            text = await self._read_text(path)
            for k, e in enumerate(edits, start=1):
                if not isinstance(e, Mapping):
                    raise ToolError(f"edit {k}: must be a mapping with old_string and new_string")
                old, new = e.get("old_string"), e.get("new_string")
                if not isinstance(old, str) or not isinstance(new, str) or old == "":
                    raise ToolError(f"edit {k}: needs a non-empty `old_string` and a `new_string` (strings)")
                n = text.count(old)
                where = f"edit {k}: " if action == "multi_edit" else ""
                if n == 0:
                    raise ToolError(f"{where}old_string not found in {path}; nothing was changed")
                if n > 1 and not e.get("replace_all"):
                    raise ToolError(f"{where}old_string occurs {n} times in {path}; add surrounding context to make "
                                    "it unique (or set replace_all: true); nothing was changed")
                text = text.replace(old, new) if e.get("replace_all") else text.replace(old, new, 1)
            await self.sb.write_file(path, text.encode(), await self._mode(path))
            return ToolResult("file", True, f"applied {len(edits)} edit(s) to {path}")
        raise ToolError(f"unknown file action `{action}`; use read, write, edit, multi_edit or metadata")

    # -- search -------------------------------------------------------------------------------------
    async def _search(self, args, time_left_s):
        action = _str(args, "action")
        path = self._path(_str(args, "path", required=False, default=".") or ".")
        if action == "grep":
            pattern = _str(args, "pattern")
            argv = ["grep", "-rnI", "-E", "--", pattern, path]
            if args.get("include"):
                argv[1:1] = [f"--include={args['include']}"]
        elif action == "glob":
            pattern = _str(args, "pattern")
            argv = ["bash", "-c", 'shopt -s globstar nullglob dotglob; cd "$1" && printf "%s\\n" $2', "bash", path,
                    pattern]
        elif action == "ls":
            argv = ["ls", "-la", path]
        else:
            raise ToolError(f"unknown search action `{action}`; use grep, glob or ls")
        r = await self.sb.exec(argv, 60)
        lines = r.output.splitlines()
        text = "\n".join(lines[:SEARCH_CAP])
        if len(lines) > SEARCH_CAP:
            text += f"\n[... {len(lines) - SEARCH_CAP} more lines not shown; narrow the search]"
        if action == "grep" and r.exit_code == 1:
            text = "no matches"
        return ToolResult("search", r.exit_code in (0, 1), text or "(nothing)")

    # -- todo / scratchpad / finish -----------------------------------------------------------------
    async def _todo(self, args, time_left_s):
        ops = args.get("operations")
        if not isinstance(ops, list) or not ops:
            raise ToolError("todo needs `operations`: a list of {action: add|complete|delete|view_all, ...}")
        msgs = []
        for op in ops:
            if not isinstance(op, Mapping):
                raise ToolError("each todo operation must be a mapping")
            act = op.get("action")
            if act == "add":
                self.todos.append({"id": self._next_todo, "content": _str(op, "content"), "done": False})
                msgs.append(f"added task {self._next_todo}")
                self._next_todo += 1
            elif act in ("complete", "delete"):
                tid = _int(op, "task_id", None)
                item = next((t for t in self.todos if t["id"] == tid), None)
                if item is None:
                    raise ToolError(f"no todo with task_id {tid}")
                if act == "complete":
                    item["done"] = True
                else:
                    self.todos.remove(item)
                msgs.append(f"{act}d task {tid}")
            elif act != "view_all":
                raise ToolError(f"unknown todo action `{act}`")
        listing = "\n".join(f"[{'x' if t['done'] else ' '}] {t['id']}. {t['content']}" for t in self.todos) or "(empty)"
        return ToolResult("todo", True, "\n".join(msgs + ["todo list:", listing]))

    async def _scratchpad(self, args, time_left_s):
        action = _str(args, "action")
        if action == "add_note":
            self.notes.append(_str(args, "content"))
            return ToolResult("scratchpad", True, f"note {len(self.notes)} saved")
        if action == "view_all_notes":
            return ToolResult("scratchpad", True, "\n".join(f"{i}. {n}" for i, n in enumerate(self.notes, 1)) or "(no notes)")
        raise ToolError(f"unknown scratchpad action `{action}`; use add_note or view_all_notes")

    async def _finish(self, args, time_left_s):
        return ToolResult("finish", True, _str(args, "message", required=False, default="") or "", finished=True)


# JSON schemas for Qwen3's native tool calling (the qwen_tools scaffold)
TOOL_SCHEMAS = [
    {"type": "function", "function": {"name": "bash", "description": "Run a command in the persistent bash shell.",
     "parameters": {"type": "object", "properties": {
         "cmd": {"type": "string", "description": "the command"},
         "timeout_secs": {"type": "integer", "description": "seconds before it is interrupted (default 30)"},
         "block": {"type": "boolean", "description": "false runs it in the background"}}, "required": ["cmd"]}}},
    {"type": "function", "function": {"name": "file", "description": "Read, write or edit files (exact string edits).",
     "parameters": {"type": "object", "properties": {
         "action": {"type": "string", "enum": ["read", "write", "edit", "multi_edit", "metadata"]},
         "file_path": {"type": "string"}, "content": {"type": "string"},
         "offset": {"type": "integer"}, "limit": {"type": "integer"},
         "old_string": {"type": "string"}, "new_string": {"type": "string"},
         "replace_all": {"type": "boolean"},
         "edits": {"type": "array", "items": {"type": "object"}},
         "file_paths": {"type": "array", "items": {"type": "string"}}}, "required": ["action"]}}},
    {"type": "function", "function": {"name": "search", "description": "grep file contents, glob file names, or ls.",
     "parameters": {"type": "object", "properties": {
         "action": {"type": "string", "enum": ["grep", "glob", "ls"]}, "pattern": {"type": "string"},
         "path": {"type": "string"}, "include": {"type": "string"}}, "required": ["action"]}}},
    {"type": "function", "function": {"name": "todo", "description": "Manage your task list.",
     "parameters": {"type": "object", "properties": {"operations": {"type": "array", "items": {"type": "object"}}},
                    "required": ["operations"]}}},
    {"type": "function", "function": {"name": "scratchpad", "description": "Keep notes.",
     "parameters": {"type": "object", "properties": {
         "action": {"type": "string", "enum": ["add_note", "view_all_notes"]}, "content": {"type": "string"}},
         "required": ["action"]}}},
    {"type": "function", "function": {"name": "finish", "description": "End the task once it is verified done.",
     "parameters": {"type": "object", "properties": {"message": {"type": "string"}}, "required": ["message"]}}},
]
