"""Task sources -> ``Task``: Terminal-Bench 1 dirs, Harbor / TB2 dirs, the TB-RL CSV, our Parquet.

``load_tasks(source)`` picks the reader from what ``source`` is; ``save_parquet`` / ``export_harbor`` write.
Every error names the file (or CSV row) and the field; ``skip_bad=True`` logs bad tasks and loads the rest.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import os
import re
import sys
import tomllib
from collections.abc import Iterable, Sequence
from pathlib import Path

import yaml

from jaxrl_term.tasks.task import (Environment, FileBlob, Healthcheck, NetworkPolicy, Solution, Task,
                                   TaskFormatError, Tests)

log = logging.getLogger(__name__)

TB1_DEFAULT_AGENT_TIMEOUT, TB1_DEFAULT_TEST_TIMEOUT = 360.0, 60.0
HARBOR_DEFAULT_AGENT_TIMEOUT, HARBOR_DEFAULT_TEST_TIMEOUT = 600.0, 600.0
TBRL_AGENT_TIMEOUT, TBRL_TEST_TIMEOUT = 1800.0, 180.0


# -------------------------------------------------------------------------------------------- helpers


def _read_tree(root: Path, exclude: Iterable[str] = ()) -> dict[str, FileBlob]:
    """Every regular file under ``root`` (relative posix path -> bytes + mode), minus excluded top names."""
    out: dict[str, FileBlob] = {}
    excluded = set(exclude)
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if rel.parts[0] in excluded or not p.is_file() or "__pycache__" in rel.parts:
            continue
        out[rel.as_posix()] = FileBlob(p.read_bytes(), p.stat().st_mode & 0o7777)
    return out


def dockerfile_workdir(dockerfile: str | None, default: str = "/app") -> str:
    """The last absolute WORKDIR of a Dockerfile (what ``docker exec`` starts in), else ``default``."""
    wd = default
    for line in (dockerfile or "").splitlines():
        parts = line.strip().split(None, 1)
        if len(parts) == 2 and parts[0].upper() == "WORKDIR" and parts[1].strip().startswith("/"):
            wd = parts[1].strip().strip("\"'")
    return wd


def _number(value, where: str, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TaskFormatError(f"{where}: {field} must be a number, got {value!r}")
    return float(value)


def count_tests(task: Task) -> int:
    if task.tests.weights:
        return len(task.tests.weights)
    n = 0
    for name, blob in task.tests.files.items():
        if name.endswith(".py"):
            n += len(re.findall(rb"^\s*(?:async\s+)?def\s+test_", blob.data, re.M))
    return n


# ------------------------------------------------------------------------------------------ TB1 dirs


def load_tb1_task(d: Path) -> Task:
    """A Terminal-Bench 1.x task directory (task.yaml, Dockerfile, run-tests.sh, tests/, solution.sh|yaml)."""
    ty = d / "task.yaml"
    try:
        meta = yaml.safe_load(ty.read_text())
    except yaml.YAMLError as e:
        raise TaskFormatError(f"{ty}: invalid YAML ({str(e).splitlines()[0]})") from e
    if not isinstance(meta, dict):
        raise TaskFormatError(f"{ty}: expected a mapping at the top level")
    instruction = meta.get("instruction")
    if instruction is None and isinstance(meta.get("descriptions"), list):
        base = [x for x in meta["descriptions"] if isinstance(x, dict) and x.get("key") == "base"]
        instruction = (base or meta["descriptions"])[0].get("description")
    if not isinstance(instruction, str) or not instruction.strip():
        raise TaskFormatError(f"{ty}: instruction must be a non-empty string")
    dockerfile_path = d / "Dockerfile"
    if not dockerfile_path.is_file():
        raise TaskFormatError(f"{d}: Dockerfile is missing")
    tests_dir = d / "tests"
    if not tests_dir.is_dir() or not any(tests_dir.iterdir()):
        raise TaskFormatError(f"{d}: tests/ is missing or empty; a task needs its tests")
    test_files = _read_tree(tests_dir)
    if (d / "run-tests.sh").is_file():
        test_files["run-tests.sh"] = FileBlob((d / "run-tests.sh").read_bytes(), 0o755)
        tests = Tests("run-tests.sh", test_files, "run-tests.sh")
    else:
        entry = "test_outputs.py" if "test_outputs.py" in test_files else next(
            (n for n in test_files if n.endswith(".py") and Path(n).name.startswith("test")), None)
        if entry is None:
            raise TaskFormatError(f"{tests_dir}: no run-tests.sh and no test_*.py file")
        tests = Tests("pytest", test_files, entry)
    solution = None
    if (d / "solution.sh").is_file():
        solution = Solution({"solution.sh": FileBlob((d / "solution.sh").read_bytes(), 0o755)}, "solution.sh")
    elif (d / "solution.yaml").is_file():
        sy = d / "solution.yaml"
        try:
            steps = yaml.safe_load(sy.read_text())
        except yaml.YAMLError as e:
            raise TaskFormatError(f"{sy}: invalid YAML ({str(e).splitlines()[0]})") from e
        if not isinstance(steps, list) or not all(isinstance(s, dict) and "command" in s for s in steps):
            raise TaskFormatError(f"{sy}: expected a list of {{command: ...}} steps")
        script = "#!/bin/bash\n" + "\n".join(str(s["command"]).rstrip("\n") for s in steps) + "\n"
        solution = Solution({"solution.sh": FileBlob(script.encode(), 0o755)}, "solution.sh")
    dockerfile = dockerfile_path.read_text()
    where = str(ty)
    agent_t = _number(meta.get("max_agent_timeout_sec", TB1_DEFAULT_AGENT_TIMEOUT), where, "max_agent_timeout_sec")
    test_t = _number(meta.get("max_test_timeout_sec", TB1_DEFAULT_TEST_TIMEOUT), where, "max_test_timeout_sec")
    tags = meta.get("tags") or []
    if not isinstance(tags, list):
        raise TaskFormatError(f"{ty}: tags must be a list")
    metadata = {k: v for k, v in meta.items() if k not in ("instruction", "descriptions", "tags")}
    metadata.update(tags=[str(t) for t in tags], source="tb1", source_path=str(d))
    env = Environment(
        dockerfile=dockerfile,
        files=_read_tree(d, exclude=("task.yaml", "Dockerfile", "run-tests.sh", "tests", "solution.sh",
                                     "solution.yaml", "docker-compose.yaml", "docker-compose.yml")),
        workdir=dockerfile_workdir(dockerfile),
    )
    return Task(d.name, instruction, env, tests, solution, agent_t, test_t, metadata)


# --------------------------------------------------------------------------------------- Harbor dirs


def _memory_mb(value, where: str) -> int:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", str(value), re.I)
    if not m:
        raise TaskFormatError(f"{where}: [environment] memory must look like '2G' or '512M', got {value!r}")
    scale = {"": 1 / 2**20, "K": 1 / 1024, "M": 1, "G": 1024, "T": 1024**2}[m.group(2).upper()]
    return int(float(m.group(1)) * scale)


# Harbor's task model (``TaskConfig`` in harbor/models/task/config.py): every field, its default, and what we
# do with it. A field we cannot honour is refused by name when it asks for something; unknown keys are refused
# (a misspelt key would otherwise be silently dropped).
HARBOR_TOP = {"schema_version", "version", "task", "metadata", "verifier", "agent", "environment", "solution",
              "source"}
HARBOR_ENVIRONMENT = {"build_timeout_sec", "docker_image", "cpus", "memory_mb", "storage_mb", "gpus", "gpu_types",
                      "allow_internet", "network_mode", "allowed_hosts", "mcp_servers", "env", "skills_dir",
                      "healthcheck", "memory", "storage"}
HARBOR_VERIFIER = {"timeout_sec", "env", "user", "network_mode", "allowed_hosts"}
HARBOR_AGENT = {"timeout_sec", "user", "network_mode", "allowed_hosts"}
HARBOR_SOLUTION = {"env"}
HARBOR_HEALTHCHECK = {"command", "interval_sec", "timeout_sec", "start_period_sec", "start_interval_sec", "retries"}
HARBOR_DEFAULTS = {"build_timeout_sec": 600.0, "cpus": 1, "memory_mb": 2048, "storage_mb": 10240, "gpus": 0,
                   "allow_internet": True}


def _table(cfg: dict, name: str, where: str, keys: set[str]) -> dict:
    t = cfg.get(name, {})
    if not isinstance(t, dict):
        raise TaskFormatError(f"{where}: [{name}] must be a table")
    unknown = sorted(set(t) - keys)
    if unknown:
        raise TaskFormatError(f"{where}: [{name}] {unknown[0]} is not a field of Harbor's task model (known: "
                              f"{sorted(keys)}); fix the spelling or remove it")
    return t


def _str_map(value, where: str, field: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(v, (str, int, float, bool)) for v in value.values()):
        raise TaskFormatError(f"{where}: {field} must be a table of NAME = \"value\"")
    return {str(k): str(v).lower() if isinstance(v, bool) else str(v) for k, v in value.items()}


def _network(section: dict, where: str, name: str) -> NetworkPolicy | None:
    """A section's network_mode / allowed_hosts (Harbor: allowed_hosts alone means allowlist)."""
    mode, hosts = section.get("network_mode"), section.get("allowed_hosts") or []
    if mode is None and not hosts:
        return None
    if not isinstance(hosts, list):
        raise TaskFormatError(f"{where}: [{name}] allowed_hosts must be a list of host names")
    try:
        policy = NetworkPolicy(mode or "allowlist", tuple(str(h).strip().lower().rstrip(".") for h in hosts))
    except TaskFormatError as e:
        raise TaskFormatError(f"{where}: [{name}] {e}") from e
    if policy.mode == "allowlist":
        raise TaskFormatError(f"{where}: [{name}] network_mode = 'allowlist' (allowed_hosts {list(policy.allowed_hosts)})"
                              " is not supported: jaxrl_term's sandboxes enforce no per-host egress rules; use "
                              "'public' or 'no-network'")
    return policy


def load_harbor_task(d: Path) -> Task:
    """A Harbor / Terminal-Bench 2 task directory (instruction.md, task.toml, environment/, tests/, solution/),
    with Harbor's defaults: 1 CPU, 2048 MB, 10240 MB of storage, internet allowed, 600 s build / verifier."""
    tt = d / "task.toml"
    try:
        cfg = tomllib.loads(tt.read_text())
    except tomllib.TOMLDecodeError as e:
        raise TaskFormatError(f"{tt}: invalid TOML ({e})") from e
    inst = d / "instruction.md"
    if not inst.is_file():
        raise TaskFormatError(f"{d}: instruction.md is missing")
    tests_dir = d / "tests"
    if not (tests_dir / "test.sh").is_file():
        raise TaskFormatError(f"{d}: tests/test.sh is missing; a Harbor task needs its verifier script")
    where = str(tt)
    unknown = sorted(set(cfg) - HARBOR_TOP)
    if unknown:
        raise TaskFormatError(f"{where}: {unknown[0]!r} is not a field of Harbor's task model (known: "
                              f"{sorted(HARBOR_TOP)})")
    if not isinstance(cfg.get("metadata", {}), dict):
        raise TaskFormatError(f"{where}: [metadata] must be a table")
    meta = dict(_table(cfg, "metadata", where, set(cfg.get("metadata") or {})))
    ver = _table(cfg, "verifier", where, HARBOR_VERIFIER)
    agent = _table(cfg, "agent", where, HARBOR_AGENT)
    envc = {**HARBOR_DEFAULTS, **_table(cfg, "environment", where, HARBOR_ENVIRONMENT)}
    sol = _table(cfg, "solution", where, HARBOR_SOLUTION)
    for section, t in (("agent", agent), ("verifier", ver)):
        if t.get("user") is not None:
            raise TaskFormatError(f"{where}: [{section}] user = {t['user']!r} is not supported: the {section} runs as "
                                  "root in jaxrl_term's sandboxes; remove it")
    if _number(envc["gpus"], where, "[environment] gpus") > 0 or envc.get("gpu_types"):
        raise TaskFormatError(f"{where}: [environment] gpus = {envc['gpus']} (gpu_types {envc.get('gpu_types')}) "
                              "cannot be honoured: jaxrl_term's sandboxes pass no GPUs through; drop the task or "
                              "set gpus = 0")
    for field in ("mcp_servers", "skills_dir"):
        if envc.get(field):
            raise TaskFormatError(f"{where}: [environment] {field} = {envc[field]!r} is not supported (jaxrl_term's "
                                  "agent has no MCP client or skills directory); remove it")
    test_t = _number(ver.get("timeout_sec", HARBOR_DEFAULT_TEST_TIMEOUT), where, "[verifier] timeout_sec")
    agent_t = agent.get("timeout_sec")
    agent_t = HARBOR_DEFAULT_AGENT_TIMEOUT if agent_t is None else _number(agent_t, where, "[agent] timeout_sec")
    env_dir = d / "environment"
    dockerfile = (env_dir / "Dockerfile").read_text() if (env_dir / "Dockerfile").is_file() else None
    compose_text = None
    for name in ("docker-compose.yaml", "docker-compose.yml"):
        if (env_dir / name).is_file():
            from jaxrl_term.sandbox.compose import parse_compose

            compose_text = (env_dir / name).read_text()
            main = parse_compose(compose_text, str(env_dir / name)).main
            if dockerfile is None and main.get("build"):
                from jaxrl_term.sandbox.compose import context_files

                files = _read_tree(env_dir)
                dockerfile, _ = context_files(files, None, main["build"], str(env_dir / name))
            elif dockerfile is None and main.get("image") and not envc.get("docker_image"):
                envc["docker_image"] = main["image"]
            break
    image = envc.get("docker_image")
    if dockerfile is None and not image:
        raise TaskFormatError(f"{d}: needs environment/Dockerfile, [environment] docker_image in task.toml, or a "
                              "'main' service with build or image in environment/docker-compose.yaml")
    memory = _memory_mb(envc["memory"], where) if envc.get("memory") is not None else \
        int(_number(envc["memory_mb"], where, "[environment] memory_mb"))
    storage = _memory_mb(envc["storage"], where) if envc.get("storage") is not None else \
        int(_number(envc["storage_mb"], where, "[environment] storage_mb"))
    hc = envc.get("healthcheck")
    healthcheck = None
    if hc is not None:
        if not isinstance(hc, dict) or not isinstance(hc.get("command"), str):
            raise TaskFormatError(f"{where}: [environment.healthcheck] needs command = \"...\"")
        bad = sorted(set(hc) - HARBOR_HEALTHCHECK)
        if bad:
            raise TaskFormatError(f"{where}: [environment.healthcheck] {bad[0]} is not a field (known: "
                                  f"{sorted(HARBOR_HEALTHCHECK)})")
        healthcheck = Healthcheck(hc["command"], *(
            _number(hc.get(k, dflt), where, f"[environment.healthcheck] {k}") for k, dflt in (
                ("interval_sec", 5.0), ("timeout_sec", 30.0), ("start_period_sec", 0.0),
                ("start_interval_sec", 5.0))), int(_number(hc.get("retries", 3), where, "retries")))
    if not isinstance(envc["allow_internet"], bool):
        raise TaskFormatError(f"{where}: [environment] allow_internet must be true or false")
    env = Environment(
        dockerfile=dockerfile,
        files=_read_tree(env_dir, exclude=("Dockerfile", "docker-compose.yaml", "docker-compose.yml"))
        if env_dir.is_dir() else {},
        image=None if dockerfile else image,
        workdir=dockerfile_workdir(dockerfile),
        cpus=_number(envc["cpus"], where, "[environment] cpus"),
        memory_mb=memory,
        allow_internet=envc["allow_internet"],
        build_timeout_s=_number(envc["build_timeout_sec"], where, "[environment] build_timeout_sec"),
        network=_network(envc, where, "environment"),
        env=_str_map(envc.get("env", {}), where, "[environment] env"),
        storage_mb=storage,
        compose=compose_text,
        healthcheck=healthcheck,
    )
    tests = Tests("harbor", _read_tree(tests_dir), "test.sh")
    solution = None
    if (d / "solution" / "solve.sh").is_file():
        solution = Solution(_read_tree(d / "solution"), "solve.sh")
    tags = meta.pop("tags", []) or []
    if not isinstance(tags, list):
        raise TaskFormatError(f"{tt}: [metadata] tags must be a list")
    meta.update(tags=[str(t) for t in tags], source="harbor", source_path=str(d))
    for key in ("schema_version", "version", "source"):
        if key in cfg:
            meta.setdefault(f"harbor_{key}", cfg[key])
    if "task" in cfg:
        meta.setdefault("package", cfg["task"])
    return Task(d.name, inst.read_text(), env, tests, solution, agent_t, test_t, meta,
                agent_network=_network(agent, where, "agent"), verifier_network=_network(ver, where, "verifier"),
                verifier_env=_str_map(ver.get("env", {}), where, "[verifier] env"),
                solution_env=_str_map(sol.get("env", {}), where, "[solution] env"))


# ------------------------------------------------------------------------------------------ TB-RL CSV

TBRL_COLUMNS = ("task_id", "difficulty", "title", "use_case_category", "prompt", "category", "tags", "dockerfile",
                "test_functions", "test_weights", "additional_files", "created_at", "updated_at")


def _tbrl_row(row: dict, where: str) -> Task:
    tid = (row.get("task_id") or "").strip()
    if not tid:
        raise TaskFormatError(f"{where}: task_id is empty")
    where = f"{where} ({tid})"
    try:
        weights = json.loads(row["test_weights"])
    except json.JSONDecodeError as e:
        raise TaskFormatError(f"{where}: test_weights is not valid JSON ({e})") from e
    if not isinstance(weights, dict) or not weights:
        raise TaskFormatError(f"{where}: test_weights must be a non-empty JSON object of test name -> weight")
    weights = {str(k): _number(v, where, f"test_weights[{k!r}]") for k, v in weights.items()}
    total = sum(weights.values())
    if abs(total - 1.0) > 1e-6:
        raise TaskFormatError(f"{where}: test_weights sum to {total:.6g}, not 1")
    tests_src = row.get("test_functions") or ""
    missing = [k for k in weights if not re.search(rf"^\s*(?:async\s+)?def\s+{re.escape(k)}\s*\(", tests_src, re.M)]
    if missing:
        raise TaskFormatError(f"{where}: test_weights name tests that test_functions does not define: {missing}")
    try:
        extra = json.loads(row.get("additional_files") or "{}")
    except json.JSONDecodeError as e:
        raise TaskFormatError(f"{where}: additional_files is not valid JSON ({e})") from e
    if not isinstance(extra, dict) or not all(isinstance(v, str) for v in extra.values()):
        raise TaskFormatError(f"{where}: additional_files must be a JSON object of path -> text")
    dockerfile = row.get("dockerfile") or ""
    if not dockerfile.strip():
        raise TaskFormatError(f"{where}: dockerfile is empty")
    prompt = row.get("prompt") or ""
    if not prompt.strip():
        raise TaskFormatError(f"{where}: prompt is empty")
    metadata = {
        "difficulty": row.get("difficulty"),
        "title": row.get("title"),
        "use_case_category": row.get("use_case_category"),
        "category": row.get("category"),
        "tags": [t for t in (row.get("tags") or "").split("|") if t],
        "created_at": row.get("created_at"),
        "updated_at": row.get("updated_at"),
        "source": "tbrl_csv",
    }
    env = Environment(dockerfile=dockerfile, files={k: FileBlob.text(v) for k, v in extra.items()},
                      workdir=dockerfile_workdir(dockerfile))
    tests = Tests("pytest", {"test_outputs.py": FileBlob.text(tests_src)}, "test_outputs.py", weights)
    return Task(tid, prompt, env, tests, None, TBRL_AGENT_TIMEOUT, TBRL_TEST_TIMEOUT, metadata)


def load_tbrl_csv(path: Path, *, skip_bad: bool = False, errors: list | None = None) -> list[Task]:
    csv.field_size_limit(sys.maxsize)
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = [c for c in ("task_id", "prompt", "dockerfile", "test_functions", "test_weights")
                   if c not in (reader.fieldnames or [])]
        if missing:
            raise TaskFormatError(f"{path}: missing columns {missing}; expected the Terminal-Bench-RL CSV columns")
        tasks = []
        for i, row in enumerate(reader, start=2):  # line 1 is the header
            try:
                tasks.append(_tbrl_row(row, f"{path}: row {i}"))
            except TaskFormatError as e:
                if not skip_bad:
                    raise
                _record(errors, e)
    return tasks


# ----------------------------------------------------------------------------------------- Parquet


def _files_to_list(files) -> list[dict]:
    return [{"path": k, "data": v.data, "mode": v.mode} for k, v in sorted(files.items())]


def _files_from_list(items) -> dict[str, FileBlob]:
    return {x["path"]: FileBlob(x["data"], x["mode"]) for x in items or []}


def _schema():
    import pyarrow as pa

    files = pa.list_(pa.struct([("path", pa.string()), ("data", pa.binary()), ("mode", pa.int32())]))
    return pa.schema([
        ("id", pa.string()), ("instruction", pa.string()),
        ("dockerfile", pa.string()), ("env_files", files), ("image", pa.string()), ("workdir", pa.string()),
        ("cpus", pa.float64()), ("memory_mb", pa.int64()), ("allow_internet", pa.bool_()),
        ("build_timeout_s", pa.float64()),
        ("tests_runner", pa.string()), ("tests_entry", pa.string()), ("tests_files", files),
        ("tests_weights", pa.string()),
        ("solution_entry", pa.string()), ("solution_files", files),
        ("agent_timeout_s", pa.float64()), ("test_timeout_s", pa.float64()), ("metadata", pa.string()),
        ("semantics", pa.string()),  # JSON: the fields below (optional: files written before it load unchanged)
    ])


def _policy_json(p: NetworkPolicy | None):
    return None if p is None else {"mode": p.mode, "allowed_hosts": list(p.allowed_hosts)}


def _policy_from(d) -> NetworkPolicy | None:
    return None if d is None else NetworkPolicy(d["mode"], tuple(d.get("allowed_hosts") or ()))


def _semantics(t: Task) -> str:
    e = t.environment
    return json.dumps({
        "network": _policy_json(e.network), "env": dict(e.env), "storage_mb": e.storage_mb, "compose": e.compose,
        "healthcheck": dataclasses.asdict(e.healthcheck) if e.healthcheck else None,
        "agent_network": _policy_json(t.agent_network), "verifier_network": _policy_json(t.verifier_network),
        "verifier_env": dict(t.verifier_env), "solution_env": dict(t.solution_env), "services": list(t.services),
    }, ensure_ascii=False)


def _with_semantics(env: Environment, raw: str | None) -> tuple[Environment, dict]:
    """The environment with its semantics column applied, and the task-level fields of that column."""
    sem = json.loads(raw) if raw else {}
    env = dataclasses.replace(env, network=_policy_from(sem.get("network")), env=sem.get("env") or {},
                              storage_mb=sem.get("storage_mb"), compose=sem.get("compose"),
                              healthcheck=Healthcheck(**sem["healthcheck"]) if sem.get("healthcheck") else None)
    task_kw = dict(agent_network=_policy_from(sem.get("agent_network")),
                   verifier_network=_policy_from(sem.get("verifier_network")),
                   verifier_env=sem.get("verifier_env") or {}, solution_env=sem.get("solution_env") or {},
                   services=tuple(sem.get("services") or ()))
    return env, task_kw


def save_parquet(tasks: Sequence[Task], path: str | os.PathLike) -> Path:
    """All tasks in one Parquet file; binary files and modes kept (``load_tasks`` reads it back equal)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for t in tasks:
        e = t.environment
        rows.append({
            "id": t.id, "instruction": t.instruction,
            "dockerfile": e.dockerfile, "env_files": _files_to_list(e.files), "image": e.image,
            "workdir": e.workdir, "cpus": e.cpus, "memory_mb": e.memory_mb, "allow_internet": e.allow_internet,
            "build_timeout_s": e.build_timeout_s,
            "tests_runner": t.tests.runner, "tests_entry": t.tests.entry, "tests_files": _files_to_list(t.tests.files),
            "tests_weights": json.dumps(dict(t.tests.weights)),
            "solution_entry": t.solution.entry if t.solution else None,
            "solution_files": _files_to_list(t.solution.files) if t.solution else None,
            "agent_timeout_s": t.agent_timeout_s, "test_timeout_s": t.test_timeout_s,
            "metadata": json.dumps(dict(t.metadata), ensure_ascii=False),
            "semantics": _semantics(t),
        })
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=_schema()), path)
    return path


def load_parquet(path: Path, *, skip_bad: bool = False, errors: list | None = None) -> list[Task]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    missing = set(_schema().names) - set(table.column_names) - {"semantics"}
    if missing:
        raise TaskFormatError(f"{path}: not a jaxrl_term task Parquet file (missing columns {sorted(missing)})")
    tasks = []
    for i, r in enumerate(table.to_pylist()):
        try:
            env = Environment(r["dockerfile"], _files_from_list(r["env_files"]), r["image"], r["workdir"], r["cpus"],
                              r["memory_mb"], r["allow_internet"], r["build_timeout_s"])
            env, task_kw = _with_semantics(env, r.get("semantics"))
            tests = Tests(r["tests_runner"], _files_from_list(r["tests_files"]), r["tests_entry"],
                          json.loads(r["tests_weights"] or "{}"))
            sol = Solution(_files_from_list(r["solution_files"]), r["solution_entry"]) if r["solution_entry"] else None
            tasks.append(Task(r["id"], r["instruction"], env, tests, sol, r["agent_timeout_s"], r["test_timeout_s"],
                              json.loads(r["metadata"] or "{}"), **task_kw))
        except (TaskFormatError, json.JSONDecodeError, TypeError, KeyError) as e:
            err = TaskFormatError(f"{path}: row {i} ({r.get('id')}): {type(e).__name__ + ': ' if isinstance(e, KeyError) else ''}{e}")
            if not skip_bad:
                raise err from e
            _record(errors, err)
    return tasks


# ---------------------------------------------------------------------------------------- dispatch


def _record(errors: list | None, e: Exception) -> None:
    log.warning("skipping bad task: %s", e)
    if errors is not None:
        errors.append(str(e))


def _load_dir_task(d: Path) -> Task:
    if (d / "task.toml").is_file():
        return load_harbor_task(d)
    if (d / "task.yaml").is_file():
        return load_tb1_task(d)
    raise TaskFormatError(f"{d}: neither task.toml (Harbor) nor task.yaml (Terminal-Bench 1)")


def load_tasks(source: str | os.PathLike, *, skip_bad: bool = False, errors: list | None = None) -> list[Task]:
    """Tasks from a TB1 or Harbor task dir, a folder of them, a TB-RL CSV, our Parquet file, or
    ``builtin[:train|heldout]`` (one instance of every built-in family and difficulty that has one in the split).

    With ``skip_bad`` a task that fails to load is logged (and appended to ``errors``) and the rest load.
    """
    if str(source).startswith("builtin"):
        from jaxrl_term.tasks.builtin import SPLITS, builtin_tasks

        name, _, split = str(source).partition(":")
        if name != "builtin" or (split or "train") not in SPLITS:
            raise TaskFormatError(f"{source}: the built-in tasks are builtin, builtin:train or builtin:heldout")
        return builtin_tasks(1, split=split or "train")
    src = Path(source)
    if not src.exists():
        raise TaskFormatError(f"{src}: no such file or directory")
    if src.is_file():
        if src.suffix == ".csv":
            return load_tbrl_csv(src, skip_bad=skip_bad, errors=errors)
        if src.suffix == ".parquet":
            return load_parquet(src, skip_bad=skip_bad, errors=errors)
        raise TaskFormatError(f"{src}: unknown task file type; use a .csv (TB-RL) or .parquet file, or a task dir")
    if (src / "task.toml").is_file() or (src / "task.yaml").is_file():
        return [_load_dir_task(src)]
    tasks = []
    subdirs = sorted(p for p in src.iterdir() if p.is_dir() and not p.name.startswith("."))
    for d in subdirs:
        try:
            tasks.append(_load_dir_task(d))
        except (TaskFormatError, OSError) as e:
            err = e if isinstance(e, TaskFormatError) else TaskFormatError(f"{d}: {e}")
            if not skip_bad:
                raise err
            _record(errors, err)
    if not tasks and not errors:
        raise TaskFormatError(f"{src}: no task directories (task.toml or task.yaml) found")
    return tasks


# ------------------------------------------------------------------------------------ Harbor export

# tests/test.sh for exported pytest tasks: run pytest with JUnit XML and write the weighted pass fraction
# (TB-RL: sum of weights of passed tests / sum of weights of tests that ran) to /logs/verifier/reward.txt.
_EXPORT_TEST_SH = """#!/bin/bash
# Written by jaxrl_term export_harbor: {entry} with per-test weights (weights.json), weighted pass fraction.
mkdir -p /logs/verifier
cd {workdir}
PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python3 -m pytest /tests/{entry} -rA -p no:cacheprovider \\
  --junitxml=/logs/verifier/junit.xml
python3 - <<'EOF'
import json, xml.etree.ElementTree as ET
weights = json.load(open("/tests/weights.json"))
ran = passed = 0.0
for case in ET.parse("/logs/verifier/junit.xml").iter("testcase"):
    name = case.get("name", "")
    w = weights.get(name, weights.get(name.split("[")[0], 0.0 if weights else 1.0))
    ran += w
    if case.find("failure") is None and case.find("error") is None:
        passed += w
open("/logs/verifier/reward.txt", "w").write(str(passed / ran if ran else 0.0))
EOF
"""


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{json.dumps(str(k))} = {_toml_value(x)}" for k, x in v.items()) + " }"
    return json.dumps(str(v), ensure_ascii=False)


def _network_lines(p: NetworkPolicy | None) -> list[str]:
    if p is None:
        return []
    return [f"network_mode = {_toml_value(p.mode)}"] + (
        [f"allowed_hosts = {_toml_value(list(p.allowed_hosts))}"] if p.allowed_hosts else [])


def export_harbor(tasks: Sequence[Task], out_dir: str | os.PathLike) -> Path:
    """Write each task as a Harbor task directory under ``out_dir`` (loadable by ``load_tasks``)."""
    out = Path(out_dir)
    for t in tasks:
        d = out / t.id
        if d.exists():
            import shutil

            shutil.rmtree(d)
        (d / "environment").mkdir(parents=True)
        (d / "tests").mkdir()
        (d / "instruction.md").write_text(t.instruction)
        meta = {k: v for k, v in t.metadata.items() if v is not None and isinstance(v, (str, int, float, bool, list))}
        lines = ["version = \"1.0\"", "", "[metadata]"]
        lines += [f"{k} = {_toml_value(v)}" for k, v in sorted(meta.items()) if k not in ("source_path",)]
        e = t.environment
        lines += ["", "[verifier]", f"timeout_sec = {t.test_timeout_s!r}", *_network_lines(t.verifier_network)]
        if t.verifier_env:
            lines.append(f"env = {_toml_value(dict(t.verifier_env))}")
        lines += ["", "[agent]", f"timeout_sec = {t.agent_timeout_s!r}", *_network_lines(t.agent_network)]
        if t.solution_env:
            lines += ["", "[solution]", f"env = {_toml_value(dict(t.solution_env))}"]
        lines += ["", "[environment]", f"build_timeout_sec = {e.build_timeout_s!r}",
                  f"allow_internet = {_toml_value(e.allow_internet)}", *_network_lines(e.network)]
        # Harbor's defaults (1 CPU, 2048 MB, 10240 MB) would apply to an unset field: write what the task had
        lines.append(f"cpus = {e.cpus if e.cpus is not None else HARBOR_DEFAULTS['cpus']!r}")
        lines.append(f"memory_mb = {e.memory_mb if e.memory_mb is not None else HARBOR_DEFAULTS['memory_mb']}")
        if e.storage_mb is not None:
            lines.append(f"storage_mb = {e.storage_mb}")
        if e.env:
            lines.append(f"env = {_toml_value(dict(e.env))}")
        if e.image and not e.dockerfile:
            lines.append(f"docker_image = {_toml_value(e.image)}")
        if e.healthcheck:
            h = e.healthcheck
            lines += ["", "[environment.healthcheck]", f"command = {_toml_value(h.command)}",
                      f"interval_sec = {h.interval_s!r}", f"timeout_sec = {h.timeout_s!r}",
                      f"start_period_sec = {h.start_period_s!r}", f"start_interval_sec = {h.start_interval_s!r}",
                      f"retries = {h.retries}"]
        if e.compose:
            (d / "environment" / "docker-compose.yaml").write_text(e.compose)
        (d / "task.toml").write_text("\n".join(lines) + "\n")
        if t.environment.dockerfile:
            (d / "environment" / "Dockerfile").write_text(t.environment.dockerfile)
        _write_files(d / "environment", t.environment.files)
        if t.tests.runner == "harbor":
            _write_files(d / "tests", t.tests.files)
        else:
            _write_files(d / "tests", t.tests.files)
            entry = "run-tests.sh" if t.tests.runner == "run-tests.sh" else t.tests.entry
            if t.tests.runner == "run-tests.sh":
                entry = next((n for n in t.tests.files if n.endswith(".py") and Path(n).name.startswith("test")),
                             entry)
            (d / "tests" / "weights.json").write_text(json.dumps(dict(t.tests.weights)))
            sh = d / "tests" / "test.sh"
            sh.write_text(_EXPORT_TEST_SH.format(entry=entry, workdir=t.environment.workdir))
            sh.chmod(0o755)
        if t.solution:
            (d / "solution").mkdir()
            files = dict(t.solution.files)
            if t.solution.entry != "solve.sh":
                files["solve.sh"] = FileBlob(f"#!/bin/bash\nbash /solution/{t.solution.entry}\n".encode(), 0o755)
            _write_files(d / "solution", files)
    return out


def _write_files(root: Path, files) -> None:
    for rel, blob in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(blob.data)
        p.chmod(blob.mode)
