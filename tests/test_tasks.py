"""Task formats: the real TB-RL CSV, TB1 and Harbor dirs, Parquet round trips, built-in families, bad input."""

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SHARED, need
from jaxrl_term.tasks.builtin import (DIFFICULTIES, FAMILIES, SPLITS, NoInstanceError, builtin_tasks, generate,
                                      param_key)
from jaxrl_term.tasks.formats import count_tests, export_harbor, load_tasks, save_parquet
from jaxrl_term.tasks.task import FileBlob, TaskFormatError

CSV_PATH = SHARED / "datasets" / "terminal-bench-rl" / "latest_verified.csv"
FIXTURES = Path(__file__).parent / "fixtures" / "tasks"


@pytest.fixture(scope="module")
def tbrl():
    need(CSV_PATH.is_file(), f"{CSV_PATH} (the shared TB-RL dataset) is missing")
    return load_tasks(CSV_PATH)


def test_all_331_tbrl_rows_load_with_every_column(tbrl):
    assert len(tbrl) == 331 and len({t.id for t in tbrl}) == 331
    with open(CSV_PATH, newline="") as f:
        csv.field_size_limit(sys.maxsize)
        rows = {r["task_id"]: r for r in csv.DictReader(f)}
    for t in tbrl:
        r = rows[t.id]
        assert t.instruction == r["prompt"] and t.environment.dockerfile == r["dockerfile"]
        assert t.tests.files["test_outputs.py"].data.decode() == r["test_functions"]
        assert dict(t.tests.weights) == json.loads(r["test_weights"])
        assert abs(sum(t.tests.weights.values()) - 1.0) < 1e-6
        extra = json.loads(r["additional_files"] or "{}")
        assert {k: v.data.decode() for k, v in t.environment.files.items()} == extra
        assert t.metadata["tags"] == [x for x in r["tags"].split("|") if x]
        for col in ("difficulty", "title", "use_case_category", "category", "created_at", "updated_at"):
            assert t.metadata[col] == r[col]
    assert sum(bool(t.environment.files) for t in tbrl) == 203


def test_csv_to_parquet_to_task_is_lossless(tbrl, tmp_path):
    path = save_parquet(tbrl, tmp_path / "tbrl.parquet")
    again = load_tasks(path)
    assert again == tbrl  # every field of every task


def test_parquet_keeps_binary_context_files_and_modes(tmp_path):
    tasks = builtin_tasks(1, families=["permissions", "archive"])
    blob = bytes(range(256)) * 3
    t0 = tasks[0]
    env = type(t0.environment)(**{**t0.environment.__dict__, "files": {**t0.environment.files,
                                                                         "bin/data.bin": FileBlob(blob, 0o751)}})
    tasks[0] = type(t0)(**{**t0.__dict__, "environment": env})
    again = load_tasks(save_parquet(tasks, tmp_path / "t.parquet"))
    assert again == tasks
    assert again[0].environment.files["bin/data.bin"] == FileBlob(blob, 0o751)


def test_weights_that_do_not_sum_to_one_or_bad_json_name_the_row(tmp_path):
    need(CSV_PATH.is_file(), "TB-RL CSV missing")
    with open(CSV_PATH, newline="") as f:
        csv.field_size_limit(sys.maxsize)
        reader = csv.DictReader(f)
        rows = [next(reader) for _ in range(3)]
        fields = reader.fieldnames
    rows[1] = dict(rows[1], test_weights='{"test_a": 0.5,')  # invalid JSON
    bad = tmp_path / "bad.csv"
    with open(bad, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    with pytest.raises(TaskFormatError, match=rf"bad\.csv: row 3 \({rows[1]['task_id']}\): test_weights is not valid JSON"):
        load_tasks(bad)
    errors = []
    ok = load_tasks(bad, skip_bad=True, errors=errors)
    assert [t.id for t in ok] == [rows[0]["task_id"], rows[2]["task_id"]] and len(errors) == 1
    weights = json.loads(rows[0]["test_weights"])
    rows[1] = dict(rows[0], test_weights=json.dumps({k: v * 2 for k, v in weights.items()}))
    with open(bad, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    with pytest.raises(TaskFormatError, match=r"row 3 .*test_weights sum to 2, not 1"):
        load_tasks(bad)


def test_tb1_and_harbor_fixture_dirs_load():
    tb1, harbor = load_tasks(FIXTURES / "tb1-word-count")[0], load_tasks(FIXTURES / "harbor-json-keys")[0]
    assert tb1.tests.runner == "run-tests.sh" and set(tb1.tests.files) == {"run-tests.sh", "test_outputs.py"}
    assert tb1.solution.entry == "solution.sh" and tb1.agent_timeout_s == 120 and tb1.test_timeout_s == 30
    assert tb1.metadata["tags"] == ["wc", "files"] and tb1.difficulty == "easy" and tb1.environment.workdir == "/app"
    assert set(tb1.environment.files) == {"input.txt"}  # no tests, solution or compose file in the build context
    assert harbor.tests.runner == "harbor" and harbor.solution.entry == "solve.sh"
    assert harbor.environment.memory_mb == 1024 and harbor.environment.cpus == 1.0
    assert harbor.test_timeout_s == 60 and harbor.agent_timeout_s == 300 and harbor.category == "data-processing"
    assert set(harbor.environment.files) == {"data.json"}
    both = load_tasks(FIXTURES)
    assert [t.id for t in both] == ["harbor-json-keys", "tb1-word-count"]


def test_tb1_solution_yaml_becomes_a_script(tmp_path):
    d = tmp_path / "t"
    shutil.copytree(FIXTURES / "tb1-word-count", d)
    (d / "solution.sh").unlink()
    (d / "solution.yaml").write_text("- command: cd /app\n- command: wc -w < input.txt > count.txt\n  min_timeout_sec: 5\n")
    t = load_tasks(d)[0]
    assert t.solution.files["solution.sh"].data.decode().endswith("cd /app\nwc -w < input.txt > count.txt\n")


def test_bad_task_dirs_name_the_file_and_field(tmp_path):
    h = tmp_path / "harbor"
    shutil.copytree(FIXTURES / "harbor-json-keys", h)
    toml = (h / "task.toml").read_text().replace("timeout_sec = 60.0", 'timeout_sec = "ten"')
    (h / "task.toml").write_text(toml)
    with pytest.raises(TaskFormatError, match=r"task\.toml: \[verifier\] timeout_sec must be a number, got 'ten'"):
        load_tasks(h)
    (h / "task.toml").write_text("[verifier\ntimeout_sec = 1")
    with pytest.raises(TaskFormatError, match=r"task\.toml: invalid TOML"):
        load_tasks(h)
    t = tmp_path / "tb1"
    shutil.copytree(FIXTURES / "tb1-word-count", t)
    shutil.rmtree(t / "tests")
    with pytest.raises(TaskFormatError, match=r"tb1: tests/ is missing"):
        load_tasks(t)
    shutil.copytree(FIXTURES / "tb1-word-count" / "tests", t / "tests")
    (t / "task.yaml").write_text("instruction: [unclosed\n")
    with pytest.raises(TaskFormatError, match=r"task\.yaml: invalid YAML"):
        load_tasks(t)
    # a folder with one bad task: strict fails, skip_bad loads the others and reports the bad one
    folder = tmp_path / "folder"
    folder.mkdir()
    shutil.copytree(FIXTURES / "tb1-word-count", folder / "good")
    shutil.copytree(t, folder / "bad")
    with pytest.raises(TaskFormatError, match="bad"):
        load_tasks(folder)
    errors = []
    assert [x.id for x in load_tasks(folder, skip_bad=True, errors=errors)] == ["good"] and len(errors) == 1


def test_export_harbor_round_trips_the_task(tmp_path, tbrl):
    tasks = [*builtin_tasks(1, families=["sed_config"]), tbrl[0], *load_tasks(FIXTURES)]
    export_harbor(tasks, tmp_path / "h")
    back = {t.id: t for t in load_tasks(tmp_path / "h")}
    for t in tasks:
        b = back[t.id]
        assert b.instruction == t.instruction and b.environment.dockerfile == t.environment.dockerfile
        assert b.environment.files == t.environment.files
        assert b.difficulty == t.difficulty and b.tags == t.tags
        assert b.test_timeout_s == t.test_timeout_s and b.agent_timeout_s == t.agent_timeout_s
        assert b.tests.runner == "harbor" and (b.solution is None) == (t.solution is None)
        if t.tests.runner != "harbor":
            assert json.loads(b.tests.files["weights.json"].data) == dict(t.tests.weights)


def test_cli_ls_and_convert(tmp_path):
    out = subprocess.run([sys.executable, "-m", "jaxrl_term.tasks", "ls", str(FIXTURES)], capture_output=True,
                         text=True, check=True).stdout
    assert "tb1-word-count" in out and "harbor-json-keys" in out and "2 tasks" in out
    assert "│ test.sh" in out  # a Harbor verifier script, not "0 tests"
    subprocess.run([sys.executable, "-m", "jaxrl_term.tasks", "convert", str(FIXTURES), str(tmp_path / "x.parquet")],
                   check=True, capture_output=True)
    assert load_tasks(tmp_path / "x.parquet") == load_tasks(FIXTURES)
    bad = subprocess.run([sys.executable, "-m", "jaxrl_term.tasks", "ls", str(tmp_path / "nope")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "no such file" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "jaxrl_term.tasks", "convert", str(FIXTURES), str(tmp_path / "o.json")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "give DST.parquet" in bad.stderr and not (tmp_path / "o.json").exists()
    subprocess.run([sys.executable, "-m", "jaxrl_term.tasks", "convert", str(FIXTURES), str(tmp_path / "hb")],
                   check=True, capture_output=True)
    assert {t.id for t in load_tasks(tmp_path / "hb")} == {t.id for t in load_tasks(FIXTURES)}


# ------------------------------------------------------------------------------------- built-in families


def test_builtin_families_cover_three_difficulties_and_at_least_eight_families():
    tasks = builtin_tasks(1) + builtin_tasks(1, split="heldout")  # a cell may be wholly in one split
    assert len(FAMILIES) >= 8
    assert {(t.metadata["family"], t.difficulty) for t in tasks} == {(f, d) for f in FAMILIES for d in DIFFICULTIES}
    for t in tasks:
        assert t.solution and t.tests.runner == "pytest" and "FROM jaxrl-term/base:trixie" in t.environment.dockerfile
        assert count_tests(t) >= 1 and t.difficulty in DIFFICULTIES


def test_builtin_generation_is_seeded():
    a, b = generate("csv_stats", "hard", seed=3), generate("csv_stats", "hard", seed=3)
    assert a == b and generate("csv_stats", "hard", seed=4) != a


# the cells whose instruction never changes (only the files the agent has yet to read do)
CONSTANT_INSTRUCTION = [("sort_uniq", "easy"), ("sort_uniq", "medium"), ("csv_stats", "easy"), ("csv_stats", "medium"),
                        ("csv_stats", "hard"), ("json_to_csv", "hard"), ("find_files", "medium")]


def test_train_and_heldout_splits_never_share_an_instance(caplog):
    """The split is a hash of family and instruction (what the model sees), so no instance and no instruction is
    in both splits, over every family, difficulty and seed; a constant-instruction cell falls wholly in one split:
    ``generate`` refuses it for the other at once and ``builtin_tasks`` skips it there, naming it in one warning."""
    import time

    tasks, warnings = {}, {}
    for split in SPLITS:
        with caplog.at_level("WARNING", logger="jaxrl_term.tasks.builtin"):
            caplog.clear()
            tasks[split] = [t for seed in (0, 1, 2) for t in builtin_tasks(4, split=split, seed=seed)]
            warnings[split] = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
        assert all(t.metadata["split"] == split for t in tasks[split])
    texts = {s: {t.instruction for t in tasks[s]} for s in SPLITS}
    keys = {s: {t.metadata["param_key"] for t in tasks[s]} for s in SPLITS}
    assert not texts["train"] & texts["heldout"] and not keys["train"] & keys["heldout"]
    assert len([f for f in FAMILIES if any(t.metadata["family"] == f for t in tasks["heldout"])]) >= 8
    for fam, d in CONSTANT_INSTRUCTION:
        cells = {s: [t for t in tasks[s] if (t.metadata["family"], t.difficulty) == (fam, d)] for s in SPLITS}
        (home,) = [s for s in SPLITS if cells[s]]  # exactly one split holds the cell
        other = "heldout" if home == "train" else "train"
        assert len({t.instruction for t in cells[home]}) == 1 and len(cells[home]) == 12
        assert len(warnings[other]) == 3 and all(f"{fam}/{d}" in w for w in warnings[other])  # one a call
        t0 = time.monotonic()
        with pytest.raises(NoInstanceError, match=f"{fam}/{d} has no {other} instance"):
            generate(fam, d, split=other, seed=7)
        assert time.monotonic() - t0 < 1.0
    assert not any(w for w in warnings["train"] if "sort_uniq/easy" in w)  # a constant cell in train is kept there


def test_training_refuses_heldout_tasks_whose_instruction_is_a_training_tasks(monkeypatch):
    """A held-out task with a training task's exact prompt is not held out: the trainer refuses it, naming both."""
    from types import SimpleNamespace

    from jaxrl_term.tasks import dataset
    from jaxrl_term.train import Trainer

    train = [generate("csv_stats", "easy", seed=1), generate("sed_config", "easy", seed=1)]
    same_prompt = generate("csv_stats", "easy", seed=2)  # other data file, same instruction
    assert same_prompt.id != train[0].id and same_prompt.instruction == train[0].instruction
    fake = SimpleNamespace(cfg=SimpleNamespace(trainer=SimpleNamespace(eval_every=1, eval_before_train=True),
                                               eval=SimpleNamespace(data=None)))
    heldout = builtin_tasks(1, families=["sed_config", "find_files"], split="heldout")
    monkeypatch.setattr(dataset, "load_from_config", lambda data: [*heldout, same_prompt])
    with pytest.raises(ValueError, match="1 held-out task.s. have an instruction byte-identical") as e:
        Trainer.load_heldout(fake, train)
    assert same_prompt.id in str(e.value) and train[0].id in str(e.value) and "eval.data.split=heldout" in str(e.value)
    monkeypatch.setattr(dataset, "load_from_config", lambda data: heldout)
    assert Trainer.load_heldout(fake, train) == heldout


def test_param_key_depends_on_family_and_params():
    assert param_key("a", {"x": 1}) != param_key("b", {"x": 1}) != param_key("a", {"x": 2})


def test_entry_points_are_listed_and_installed_as_console_scripts():
    """``python -m jaxrl_term`` lists every entry point; pyproject declares a console script for each, pointing
    at a callable of jaxrl_term.cli; the installed script runs the module's CLI (bad input: exit 2)."""
    import shutil
    import tomllib

    import jaxrl_term.cli as cli

    out = subprocess.run([sys.executable, "-m", "jaxrl_term"], capture_output=True, text=True, check=True).stdout
    scripts = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]["scripts"]
    for script, module, _ in cli.ENTRY_POINTS:
        assert f"python -m {module}" in out and script in out
        target = scripts[script]
        assert target.startswith("jaxrl_term.cli:") and callable(getattr(cli, target.split(":")[1]))
    exe = shutil.which("jaxrl-term-tasks", path=str(Path(sys.executable).parent))
    assert exe, "the console scripts are not installed (pip install -e .)"
    bad = subprocess.run([exe, "convert", str(FIXTURES), "/nonexistent/o.json"], capture_output=True, text=True)
    assert bad.returncode == 2 and "give DST.parquet" in bad.stderr
