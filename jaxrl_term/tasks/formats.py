"""Task sources -> ``Task``: Terminal-Bench 1 dirs, Harbor / TB2 dirs, the TB-RL CSV, our Parquet.

``load_tasks(source)`` picks the reader from what ``source`` is; ``save_parquet`` / ``export_harbor`` write.
Every error names the file (or CSV row) and the field; ``skip_bad=True`` logs bad tasks and loads the rest.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import re
import sys
import tomllib
from collections.abc import Iterable, Sequence
from pathlib import Path

import yaml

from jaxrl_term.tasks.task import Environment, FileBlob, Solution, Task, TaskFormatError, Tests

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


def load_harbor_task(d: Path) -> Task:
    """A Harbor / Terminal-Bench 2 task directory (instruction.md, task.toml, environment/, tests/, solution/)."""
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
    for section in ("metadata", "verifier", "agent", "environment"):
        if section in cfg and not isinstance(cfg[section], dict):
            raise TaskFormatError(f"{tt}: [{section}] must be a table")
    meta = dict(cfg.get("metadata", {}))
    ver, agent, envc = cfg.get("verifier", {}), cfg.get("agent", {}), cfg.get("environment", {})
    test_t = _number(ver.get("timeout_sec", HARBOR_DEFAULT_TEST_TIMEOUT), where, "[verifier] timeout_sec")
    agent_t = _number(agent.get("timeout_sec", HARBOR_DEFAULT_AGENT_TIMEOUT), where, "[agent] timeout_sec")
    env_dir = d / "environment"
    dockerfile = (env_dir / "Dockerfile").read_text() if (env_dir / "Dockerfile").is_file() else None
    image = envc.get("docker_image")
    if dockerfile is None and not image:
        raise TaskFormatError(f"{d}: needs environment/Dockerfile or [environment] docker_image in task.toml")
    memory = envc.get("memory_mb", envc.get("memory"))
    env = Environment(
        dockerfile=dockerfile,
        files=_read_tree(env_dir, exclude=("Dockerfile",)) if env_dir.is_dir() else {},
        image=None if dockerfile else image,
        workdir=dockerfile_workdir(dockerfile),
        cpus=_number(envc["cpus"], where, "[environment] cpus") if "cpus" in envc else None,
        memory_mb=_memory_mb(memory, where) if memory is not None else None,
        allow_internet=bool(envc.get("allow_internet", False)),
        build_timeout_s=_number(envc.get("build_timeout_sec", 1800.0), where, "[environment] build_timeout_sec"),
    )
    tests = Tests("harbor", _read_tree(tests_dir), "test.sh")
    solution = None
    if (d / "solution" / "solve.sh").is_file():
        solution = Solution(_read_tree(d / "solution"), "solve.sh")
    tags = meta.pop("tags", []) or []
    if not isinstance(tags, list):
        raise TaskFormatError(f"{tt}: [metadata] tags must be a list")
    meta.update(tags=[str(t) for t in tags], source="harbor", source_path=str(d))
    return Task(d.name, inst.read_text(), env, tests, solution, agent_t, test_t, meta)


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
    ])


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
        })
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=_schema()), path)
    return path


def load_parquet(path: Path, *, skip_bad: bool = False, errors: list | None = None) -> list[Task]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    missing = set(_schema().names) - set(table.column_names)
    if missing:
        raise TaskFormatError(f"{path}: not a jaxrl_term task Parquet file (missing columns {sorted(missing)})")
    tasks = []
    for i, r in enumerate(table.to_pylist()):
        try:
            env = Environment(r["dockerfile"], _files_from_list(r["env_files"]), r["image"], r["workdir"], r["cpus"],
                              r["memory_mb"], r["allow_internet"], r["build_timeout_s"])
            tests = Tests(r["tests_runner"], _files_from_list(r["tests_files"]), r["tests_entry"],
                          json.loads(r["tests_weights"] or "{}"))
            sol = Solution(_files_from_list(r["solution_files"]), r["solution_entry"]) if r["solution_entry"] else None
            tasks.append(Task(r["id"], r["instruction"], env, tests, sol, r["agent_timeout_s"], r["test_timeout_s"],
                              json.loads(r["metadata"] or "{}")))
        except (TaskFormatError, json.JSONDecodeError, TypeError) as e:
            err = TaskFormatError(f"{path}: row {i} ({r.get('id')}): {e}")
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
    ``builtin[:train|heldout]`` (one instance of every built-in family and difficulty).

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
    return json.dumps(str(v), ensure_ascii=False)


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
        lines += ["", "[verifier]", f"timeout_sec = {t.test_timeout_s!r}", "", "[agent]",
                  f"timeout_sec = {t.agent_timeout_s!r}", "", "[environment]",
                  f"build_timeout_sec = {t.environment.build_timeout_s!r}",
                  f"allow_internet = {_toml_value(t.environment.allow_internet)}"]
        if t.environment.cpus is not None:
            lines.append(f"cpus = {t.environment.cpus!r}")
        if t.environment.memory_mb is not None:
            lines.append(f"memory_mb = {t.environment.memory_mb}")
        if t.environment.image and not t.environment.dockerfile:
            lines.append(f"docker_image = {_toml_value(t.environment.image)}")
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
