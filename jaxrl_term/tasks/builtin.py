"""Built-in parametric task families for the embedded default and CPU experiments.

Each family draws its parameters from a seeded RNG at one of three difficulties and returns an instruction,
build-context files, pytest tests (every test fails in the initial state) and an oracle ``solve.sh``, on
``jaxrl-term/base:trixie``. An instance belongs to the train or the held-out split by a hash of the family and
its *instruction text* (what the model sees before acting; not the file contents it has yet to read), so the
splits never share an instance nor an instruction: prompt-identical instances always fall in the same split. A
(family, difficulty) cell whose instruction is constant (``sort_uniq`` easy / medium, ``csv_stats``, ...) or
comes from a short list falls wholly, or mostly, in one split: ``generate`` refuses a cell with no instance of
the asked split (``NoInstanceError``, found by a cached scan of the cell) and ``builtin_tasks`` skips such cells
with one warning. Task ids stay a hash of family and parameters (``param_key``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import random
import shlex
from collections import Counter
from collections.abc import Callable

from jaxrl_term.tasks.task import Environment, FileBlob, Solution, Task, Tests

BASE_IMAGE = "jaxrl-term/base:trixie"
DIFFICULTIES = ("easy", "medium", "hard")
SPLITS = ("train", "heldout")
log = logging.getLogger(__name__)
WORDS = ("alpha", "bravo", "cedar", "delta", "ember", "fjord", "gamma", "harbor", "indigo", "juniper", "kernel",
         "lumen", "maple", "nectar", "onyx", "pixel", "quartz", "raven", "sierra", "tundra", "umber", "vector",
         "willow", "xenon", "yonder", "zephyr")


@dataclasses.dataclass
class Spec:
    params: dict
    instruction: str
    tests: str  # a pytest file
    solution: str  # bash
    files: dict[str, bytes | tuple[bytes, int]] = dataclasses.field(default_factory=dict)
    setup: list[str] = dataclasses.field(default_factory=list)  # extra RUN lines (offline)


def _py(s: object) -> str:
    return repr(s)


def _heredoc(path: str, content: str) -> str:
    tag = "JRT_EOF"
    assert tag not in content
    return f"mkdir -p {shlex.quote(path.rsplit('/', 1)[0] or '/')}\ncat > {shlex.quote(path)} <<'{tag}'\n{content}{tag}\n"


def _words(rng: random.Random, n: int) -> list[str]:
    return [rng.choice(WORDS) for _ in range(n)]


# ---------------------------------------------------------------------------------------------- families


def create_file(rng: random.Random, d: str) -> Spec:
    n_files = {"easy": 1, "medium": 2, "hard": 3}[d]
    n_lines = {"easy": 1, "medium": 3, "hard": 4}[d]
    files = {}
    for i in range(n_files):
        parts = _words(rng, {"easy": 0, "medium": 1, "hard": 2}[d])
        path = "/app/" + "/".join(parts + [f"{rng.choice(WORDS)}_{i}.txt"])
        files[path] = "".join(" ".join(_words(rng, 3)) + f" {rng.randint(0, 999)}\n" for _ in range(n_lines))
    listing = "\n".join(f"- `{p}` containing exactly:\n```\n{c}```" for p, c in files.items())
    tests = "from pathlib import Path\n\n" + "".join(
        f"def test_file_{i}():\n    assert Path({_py(p)}).read_text() == {_py(c)}\n\n" for i, (p, c) in enumerate(files.items()))
    return Spec({"files": files}, f"Create the following file(s), creating directories as needed:\n{listing}",
                tests, "".join(_heredoc(p, c) for p, c in files.items()))


def count_matches(rng: random.Random, d: str) -> Spec:
    levels = ["INFO", "DEBUG", "WARN", "ERROR"]
    n_files = 3 if d == "hard" else 1
    logs = {}
    for i in range(n_files):
        lines = []
        for _ in range(rng.randint(30, 60)):
            lvl = rng.choice(levels)
            word = rng.choice(WORDS)
            lvl_txt = lvl.lower() if (d != "easy" and rng.random() < 0.3) else lvl
            lines.append(f"2024-0{rng.randint(1, 9)}-1{rng.randint(0, 9)} {lvl_txt} {word} code={rng.randint(1, 500)}")
        logs[f"logs/{rng.choice(WORDS)}_{i}.log"] = "\n".join(lines) + "\n"
    target = rng.choice(["ERROR", "WARN"])
    if d == "easy":
        def count(text):
            return sum(target in line.split() for line in text.splitlines())
        instr = f"Count the lines of /app/{next(iter(logs))} whose level field is exactly `{target}` (case-sensitive). Write only the number to /app/answer.txt."
        expected = f"{count(next(iter(logs.values())))}\n"
        sol = f"grep -cw {target} /app/{next(iter(logs))} > /app/answer.txt || true\n"
    elif d == "medium":
        def count(text):
            return sum(line.split()[1].upper() == target for line in text.splitlines())
        instr = f"Count the lines of /app/{next(iter(logs))} whose level (second field) is `{target}`, ignoring case. Write only the number to /app/answer.txt."
        expected = f"{count(next(iter(logs.values())))}\n"
        sol = f"awk 'toupper($2)==\"{target}\"' /app/{next(iter(logs))} | wc -l > /app/answer.txt\n"
    else:
        def count(text):
            return sum(line.split()[1].upper() == target for line in text.splitlines())
        rows = sorted((p.rsplit("/", 1)[-1], count(t)) for p, t in logs.items())
        expected = "".join(f"{name}: {c}\n" for name, c in rows)
        instr = (f"For every .log file in /app/logs, count the lines whose level (second field) is `{target}`, ignoring case. "
                 "Write one line per file to /app/answer.txt as `<file name>: <count>`, sorted by file name.")
        sol = ("cd /app/logs && for f in $(ls *.log | sort); do "
               f"echo \"$f: $(awk 'toupper($2)==\"{target}\"' $f | wc -l)\"; done > /app/answer.txt\n")
    tests = f"from pathlib import Path\n\ndef test_answer():\n    assert Path('/app/answer.txt').read_text().strip() == {_py(expected.strip())}\n"
    return Spec({"logs": logs, "target": target}, instr, tests, sol, {k: v.encode() for k, v in logs.items()})


def sort_uniq(rng: random.Random, d: str) -> Spec:
    words = _words(rng, rng.randint(20, 40))
    data = "\n".join(words) + "\n"
    if d == "easy":
        expected = "\n".join(sorted(words)) + "\n"
        instr = "Sort the lines of /app/words.txt alphabetically (keeping duplicates) and write them to /app/sorted.txt."
        sol = "LC_ALL=C sort /app/words.txt > /app/sorted.txt\n"
    elif d == "medium":
        expected = "".join(f"{w}\n" for w in sorted(set(words)))
        instr = "Write the distinct words of /app/words.txt to /app/sorted.txt, one per line, sorted alphabetically."
        sol = "LC_ALL=C sort -u /app/words.txt > /app/sorted.txt\n"
    else:
        k = rng.randint(3, 5)
        counts = Counter(words)
        top = sorted(counts.items(), key=lambda x: (-x[1], x[0]))[:k]
        expected = "".join(f"{c} {w}\n" for w, c in top)
        instr = (f"Write the {k} most frequent words of /app/words.txt to /app/sorted.txt as `<count> <word>` lines, "
                 "most frequent first; break ties alphabetically.")
        sol = f"LC_ALL=C sort /app/words.txt | uniq -c | awk '{{print $1, $2}}' | LC_ALL=C sort -k1,1nr -k2,2 | head -n {k} > /app/sorted.txt\n"
    tests = f"from pathlib import Path\n\ndef test_sorted():\n    assert Path('/app/sorted.txt').read_text() == {_py(expected)}\n"
    return Spec({"words": words}, instr, tests, sol, {"words.txt": data.encode()})


def permissions(rng: random.Random, d: str) -> Spec:
    modes = ["600", "640", "644", "700", "750", "755", "400", "444"]
    n = {"easy": 1, "medium": 3, "hard": 4}[d]
    names = [f"{rng.choice(WORDS)}_{i}.{rng.choice(['txt', 'sh', 'conf'])}" for i in range(n)]
    want = {f"/app/files/{name}": rng.choice([m for m in modes if m != "664"]) for name in names}
    files = {f"files/{name}": (b"content\n", 0o664) for name in names}
    instr = "Set these exact permission modes:\n" + "\n".join(f"- `{p}`: {m}" for p, m in want.items())
    sol = "".join(f"chmod {m} {p}\n" for p, m in want.items())
    tests = "import os, stat\n\n" + "".join(
        f"def test_mode_{i}():\n    assert oct(stat.S_IMODE(os.stat({_py(p)}).st_mode)) == {_py(oct(int(m, 8)))}\n\n"
        for i, (p, m) in enumerate(want.items()))
    if d == "hard":
        dirmode = rng.choice(["750", "700", "711"])  # never COPY's 755: the initial state must fail
        want_dir = "/app/files"
        instr += f"\n- the directory `{want_dir}` itself: {dirmode}"
        sol += f"chmod {dirmode} {want_dir}\n"
        tests += f"def test_dir_mode():\n    assert oct(stat.S_IMODE(os.stat({_py(want_dir)}).st_mode)) == {_py(oct(int(dirmode, 8)))}\n"
        want["dir"] = dirmode
    return Spec({"want": want}, instr, tests, sol, files)


def python_function(rng: random.Random, d: str) -> Spec:
    if d == "easy":
        k = rng.randint(2, 9)
        instr = (f"Create /app/solution.py defining `solve(numbers)` that returns the sum of the integers in the "
                 f"list `numbers` that are divisible by {k}.")
        impl = f"def solve(numbers):\n    return sum(n for n in numbers if n % {k} == 0)\n"
        cases = [[rng.randint(-50, 50) for _ in range(rng.randint(0, 8))] for _ in range(4)]
        ref = {tuple(c): sum(n for n in c if n % k == 0) for c in cases}
        checks = [f"    assert mod.solve({list(c)}) == {v}" for c, v in ref.items()]
        params = {"k": k}
    elif d == "medium":
        m = rng.randint(7, 1000)
        instr = (f"Create /app/solution.py defining `solve(n)` that returns the n-th Fibonacci number modulo {m} "
                 "(F(0) = 0, F(1) = 1).")
        impl = f"def solve(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, (a + b) % {m}\n    return a % {m}\n"

        def fib(n):
            a, b = 0, 1
            for _ in range(n):
                a, b = b, a + b
            return a % m
        ns = [0, 1] + [rng.randint(2, 90) for _ in range(3)]
        checks = [f"    assert mod.solve({n}) == {fib(n)}" for n in ns]
        params = {"m": m}
    else:
        sep = rng.choice([":", "-", "*"])
        instr = (f"Create /app/solution.py defining `encode(s)` (run-length encoding: each run of a character c "
                 f"repeated n times becomes `n{sep}c`, runs joined with commas, e.g. 'aab' -> '2{sep}a,1{sep}b'; "
                 f"'' -> '') and `decode(t)` that inverts it.")
        impl = (f"def encode(s):\n    out, i = [], 0\n    while i < len(s):\n        j = i\n        while j < len(s) and s[j] == s[i]:\n"
                f"            j += 1\n        out.append(f'{{j - i}}{sep}{{s[i]}}')\n        i = j\n    return ','.join(out)\n\n"
                f"def decode(t):\n    if not t:\n        return ''\n    out = []\n    for part in t.split(','):\n"
                f"        n, c = part.split({_py(sep)}, 1)\n        out.append(c * int(n))\n    return ''.join(out)\n")
        strs = ["", "a"] + ["".join(rng.choice("abc") * rng.randint(1, 3) for _ in range(rng.randint(1, 5))) for _ in range(3)]

        def enc(s):
            out, i = [], 0
            while i < len(s):
                j = i
                while j < len(s) and s[j] == s[i]:
                    j += 1
                out.append(f"{j - i}{sep}{s[i]}")
                i = j
            return ",".join(out)
        checks = [f"    assert mod.encode({_py(s)}) == {_py(enc(s))}\n    assert mod.decode({_py(enc(s))}) == {_py(s)}"
                  for s in strs]
        params = {"sep": sep, "strs": strs}
    tests = ("import importlib.util\n\ndef load():\n    spec = importlib.util.spec_from_file_location('solution', '/app/solution.py')\n"
             "    mod = importlib.util.module_from_spec(spec)\n    spec.loader.exec_module(mod)\n    return mod\n\n"
             "def test_solution():\n    mod = load()\n" + "\n".join(checks) + "\n")
    return Spec({"d": d, **params}, instr, tests, _heredoc("/app/solution.py", impl))


def json_to_csv(rng: random.Random, d: str) -> Spec:
    fields = ["name", "team", "score", "age"]
    recs = [{"name": f"{rng.choice(WORDS)}{i}", "team": rng.choice(["red", "blue", "green"]),
             "score": rng.randint(0, 100), "age": rng.randint(18, 70)} for i in range(rng.randint(6, 12))]
    if d == "easy":
        cols = rng.sample(fields, 2)
        rows = [[str(r[c]) for c in cols] for r in recs]
        instr = (f"/app/records.json holds a list of objects. Write /app/out.csv with a header line `{','.join(cols)}` "
                 "and one line per record, in the input order, with those two fields.")
        sol_py = f"rows = [[str(r[c]) for c in {cols!r}] for r in data]"
    elif d == "medium":
        cols, thr = ["name", "score"], rng.randint(30, 70)
        rows = [[r["name"], str(r["score"])] for r in recs if r["score"] > thr]
        instr = (f"/app/records.json holds a list of objects. Write /app/out.csv with header `name,score` and one "
                 f"line per record whose score is greater than {thr}, in the input order.")
        sol_py = f"rows = [[r['name'], str(r['score'])] for r in data if r['score'] > {thr}]"
    else:
        cols = ["team", "total", "count"]
        agg: dict[str, list[int]] = {}
        for r in recs:
            agg.setdefault(r["team"], []).append(r["score"])
        rows = [[t, str(sum(v)), str(len(v))] for t, v in sorted(agg.items())]
        instr = ("/app/records.json holds a list of objects. Write /app/out.csv with header `team,total,count`: one "
                 "line per team (sorted by team name) with the sum of its scores and its number of records.")
        sol_py = ("agg = {}\nfor r in data:\n    agg.setdefault(r['team'], []).append(r['score'])\n"
                  "rows = [[t, str(sum(v)), str(len(v))] for t, v in sorted(agg.items())]")
    expected = ",".join(cols) + "\n" + "".join(",".join(r) + "\n" for r in rows)
    sol = ("python3 - <<'JRT_PY'\nimport json\ndata = json.load(open('/app/records.json'))\n" + sol_py +
           f"\nopen('/app/out.csv', 'w').write({_py(','.join(cols) + chr(10))} + ''.join(','.join(r) + '\\n' for r in rows))\nJRT_PY\n")
    tests = f"from pathlib import Path\n\ndef test_csv():\n    assert Path('/app/out.csv').read_text() == {_py(expected)}\n"
    return Spec({"recs": recs, "cols": cols, "d": d}, instr, tests, sol, {"records.json": json.dumps(recs, indent=1).encode()})


def csv_stats(rng: random.Random, d: str) -> Spec:
    cats = rng.sample(["north", "south", "east", "west", "central"], 3)
    rows = [(rng.choice(cats), rng.randint(1, 200)) for _ in range(rng.randint(8, 16))]
    data = "region,value\n" + "".join(f"{c},{v}\n" for c, v in rows)
    by: dict[str, list[int]] = {}
    for c, v in rows:
        by.setdefault(c, []).append(v)
    if d == "easy":
        expected = {"total": sum(v for _, v in rows)}
        instr = "Write the sum of the `value` column of /app/data.csv to /app/stats.json as `{\"total\": <int>}`."
        sol_py = "out = {'total': sum(int(r['value']) for r in rows)}"
    elif d == "medium":
        expected = {c: round(sum(v) / len(v), 2) for c, v in sorted(by.items())}
        instr = ("Write a JSON object to /app/stats.json mapping each region of /app/data.csv to the mean of its "
                 "`value`s rounded to 2 decimals.")
        sol_py = ("by = {}\nfor r in rows:\n    by.setdefault(r['region'], []).append(int(r['value']))\n"
                  "out = {c: round(sum(v) / len(v), 2) for c, v in by.items()}")
    else:
        import statistics

        expected = {c: {"max": max(v), "median": statistics.median(v)} for c, v in sorted(by.items())}
        instr = ("Write a JSON object to /app/stats.json mapping each region of /app/data.csv to "
                 "`{\"max\": <int>, \"median\": <number>}` of its `value`s.")
        sol_py = ("import statistics\nby = {}\nfor r in rows:\n    by.setdefault(r['region'], []).append(int(r['value']))\n"
                  "out = {c: {'max': max(v), 'median': statistics.median(v)} for c, v in by.items()}")
    sol = ("python3 - <<'JRT_PY'\nimport csv, json\nrows = list(csv.DictReader(open('/app/data.csv')))\n" + sol_py +
           "\njson.dump(out, open('/app/stats.json', 'w'))\nJRT_PY\n")
    tests = f"import json\n\ndef test_stats():\n    assert json.load(open('/app/stats.json')) == {_py(expected)}\n"
    return Spec({"rows": rows, "d": d}, instr, tests, sol, {"data.csv": data.encode()})


def git_basics(rng: random.Random, d: str) -> Spec:
    repo = f"/app/{rng.choice(WORDS)}"
    fname, content = f"{rng.choice(WORDS)}.md", f"# {rng.choice(WORDS)} {rng.randint(1, 99)}\n"
    msg = f"Add {fname} ({rng.choice(WORDS)})"
    git = "git -c user.name=Agent -c user.email=agent@example.com"
    instr = f"Create a git repository at {repo} with a file {fname} containing `{content.strip()}` committed with the message `{msg}`"
    sol = f"mkdir -p {repo} && cd {repo} && git init -q && printf %s {shlex.quote(content)} > {fname} && git add {fname} && {git} commit -qm {shlex.quote(msg)}\n"
    tests = ("import subprocess\n\ndef git(*a):\n    return subprocess.run(['git', '-C', " + _py(repo) +
             ", *a], capture_output=True, text=True, check=True).stdout\n\n"
             f"def test_first_commit():\n    assert {_py(msg)} in git('log', '--format=%s', '--all').splitlines()\n\n")
    params = {"repo": repo, "fname": fname, "msg": msg, "d": d}
    if d == "easy":
        instr += "."
        tests += (f"def test_content_and_clean_tree():\n    assert git('show', 'HEAD:{fname}') == {_py(content)}\n"
                  "    assert git('status', '--porcelain') == ''\n")
    elif d == "medium":
        branch = f"feature-{rng.choice(WORDS)}"
        f2 = f"{rng.choice(WORDS)}.txt"
        instr += f"; then create a branch `{branch}` with a second commit adding an empty file {f2}, and leave `{branch}` checked out."
        sol += f"cd {repo} && git checkout -qb {branch} && touch {f2} && git add {f2} && {git} commit -qm 'Add {f2}'\n"
        tests += (f"def test_branch():\n    assert git('rev-parse', '--abbrev-ref', 'HEAD').strip() == {_py(branch)}\n"
                  f"    assert {_py(f2)} in git('ls-tree', '--name-only', 'HEAD').split()\n"
                  f"    assert int(git('rev-list', '--count', 'HEAD')) == 2\n")
        params.update(branch=branch)
    else:
        tag = f"v{rng.randint(1, 9)}.{rng.randint(0, 9)}.{rng.randint(0, 9)}"
        msg2 = f"Update {fname}"
        instr += (f"; tag that commit `{tag}` (a lightweight tag); then append the line `done` to {fname} and "
                  f"commit it with the message `{msg2}`.")
        sol += (f"cd {repo} && git tag {tag} && echo done >> {fname} && git add {fname} && {git} commit -qm {shlex.quote(msg2)}\n")
        tests += (f"def test_tag_and_history():\n    assert git('log', '--format=%s').splitlines() == [{_py(msg2)}, {_py(msg)}]\n"
                  f"    assert git('rev-parse', {_py(tag)}) == git('rev-parse', 'HEAD~1')\n"
                  f"    assert git('show', 'HEAD:{fname}') == {_py(content + 'done' + chr(10))}\n")
        params.update(tag=tag)
    return Spec(params, instr, tests, sol)


def sed_config(rng: random.Random, d: str) -> Spec:
    keys = rng.sample(["port", "host", "workers", "timeout", "log_level", "cache_size", "retries"], 5)
    vals = {k: str(rng.randint(1, 9000)) for k in keys}
    if d != "hard":
        cfg = "".join(f"{k}={v}\n" for k, v in vals.items())
        n_change = 1 if d == "easy" else 2
        change = {k: str(int(vals[k]) + rng.randint(1, 999)) for k in rng.sample(keys, n_change)}
        new = dict(vals, **change)
        add = {}
        if d == "medium":
            add = {"mode": rng.choice(["fast", "safe"])}
            new.update(add)
        expected = "".join(f"{k}={v}\n" for k, v in new.items())
        instr = ("Edit /app/app.conf (key=value lines): " + "; ".join(f"set `{k}` to `{v}`" for k, v in change.items())
                 + ("; and append the line " + ", ".join(f"`{k}={v}`" for k, v in add.items()) if add else "")
                 + ". Keep every other line and the order unchanged.")
        sol = "".join(f"sed -i 's/^{k}=.*/{k}={v}/' /app/app.conf\n" for k, v in change.items())
        sol += "".join(f"echo {k}={v} >> /app/app.conf\n" for k, v in add.items())
        params = {"cfg": cfg, "change": change, "add": add}
    else:
        sections = {"dev": dict(vals), "prod": dict(vals)}
        k = rng.choice(keys)
        v = str(int(vals[k]) + rng.randint(1, 999))
        cfg = "".join(f"[{s}]\n" + "".join(f"{a}={b}\n" for a, b in kv.items()) for s, kv in sections.items())
        sections["prod"][k] = v
        expected = "".join(f"[{s}]\n" + "".join(f"{a}={b}\n" for a, b in kv.items()) for s, kv in sections.items())
        instr = f"In /app/app.conf, set `{k}` to `{v}` in the [prod] section only; change nothing else."
        sol = f"sed -i '/^\\[prod\\]/,/^\\[/ s/^{k}=.*/{k}={v}/' /app/app.conf\n"
        params = {"cfg": cfg, "k": k, "v": v}
    tests = f"from pathlib import Path\n\ndef test_config():\n    assert Path('/app/app.conf').read_text() == {_py(expected)}\n"
    return Spec(params, instr, tests, sol, {"app.conf": cfg.encode()})


def find_files(rng: random.Random, d: str) -> Spec:
    exts = ["log", "txt", "csv", "tmp"]
    tree = {}
    for i in range(rng.randint(8, 14)):
        path = "/".join(_words(rng, rng.randint(0, 2)) + [f"f{i}.{rng.choice(exts)}"])
        tree[f"tree/{path}"] = ("x" * rng.choice([10, 200, 5000]) + "\n").encode()
    ext = rng.choice(exts[:3])
    if d == "easy":
        sel = sorted(p[len("tree/"):] for p in tree if p.endswith("." + ext))
        instr = f"List every `.{ext}` file under /app/tree (paths relative to /app/tree, sorted) into /app/found.txt."
        sol = f"cd /app/tree && find . -type f -name '*.{ext}' | sed 's|^./||' | LC_ALL=C sort > /app/found.txt\n"
    elif d == "medium":
        size = 1000
        sel = sorted(p[len("tree/"):] for p, b in tree.items() if len(b) > size)
        instr = f"List every file under /app/tree larger than {size} bytes (paths relative to /app/tree, sorted) into /app/found.txt."
        sol = f"cd /app/tree && find . -type f -size +{size}c | sed 's|^./||' | LC_ALL=C sort > /app/found.txt\n"
    else:
        size = 100
        sel = sorted(p[len("tree/"):] for p, b in tree.items() if len(b) > size and p.endswith("." + ext))
        instr = (f"List every `.{ext}` file under /app/tree larger than {size} bytes into /app/found.txt as "
                 "`<size in bytes> <path relative to /app/tree>` lines sorted by path.")
        sel = [f"{len(tree['tree/' + p])} {p}" for p in sel]
        sol = (f"cd /app/tree && find . -type f -name '*.{ext}' -size +{size}c -printf '%P\\n' | LC_ALL=C sort | "
               "while read -r p; do echo \"$(stat -c %s \"$p\") $p\"; done > /app/found.txt\n")
    expected = "".join(s + "\n" for s in sel)
    tests = (f"from pathlib import Path\n\ndef test_found():\n    assert Path('/app/found.txt').exists()\n"
             f"    assert Path('/app/found.txt').read_text() == {_py(expected)}\n")
    return Spec({"tree": sorted(tree), "ext": ext, "d": d}, instr, tests, sol, tree)


def archive(rng: random.Random, d: str) -> Spec:
    names = [f"{rng.choice(WORDS)}_{i}.txt" for i in range(rng.randint(2, 4))]
    files = {f"src/{n}": f"{rng.choice(WORDS)} {rng.randint(0, 99)}\n".encode() for n in names}
    out = f"/app/{rng.choice(WORDS)}.tar.gz"
    if d == "easy":
        instr = f"Create a gzip-compressed tar archive {out} containing the directory /app/src (entries `src/...`)."
        sol = f"cd /app && tar -czf {out} src\n"
        check = "    assert sorted(n for n in names if not n.endswith('/') and n != 'src') == sorted(%r)\n" % sorted(files)
    elif d == "medium":
        only = rng.choice(names)
        instr = f"Create a gzip-compressed tar archive {out} that contains only `src/{only}` from /app."
        sol = f"cd /app && tar -czf {out} src/{only}\n"
        check = f"    assert [n for n in names if n != 'src'] == ['src/{only}']\n"
    else:
        instr = (f"Create a gzip-compressed tar archive {out} of /app/src whose entries are the files themselves "
                 "(no directory prefix), and then delete /app/src.")
        sol = f"cd /app/src && tar -czf {out} * && cd /app && rm -rf /app/src\n"
        check = ("    assert sorted(n.lstrip('./') for n in names if n not in ('.', './')) == sorted(%r)\n"
                 "    assert not Path('/app/src').exists()\n") % sorted(names)
    tests = ("import tarfile\nfrom pathlib import Path\n\ndef test_archive():\n"
             f"    with tarfile.open({_py(out)}, 'r:gz') as t:\n        names = t.getnames()\n" + check)
    return Spec({"names": names, "out": out, "d": d}, instr, tests, sol, files)


FAMILIES: dict[str, Callable[[random.Random, str], Spec]] = {
    "create_file": create_file,
    "count_matches": count_matches,
    "sort_uniq": sort_uniq,
    "permissions": permissions,
    "python_function": python_function,
    "json_to_csv": json_to_csv,
    "csv_stats": csv_stats,
    "git_basics": git_basics,
    "sed_config": sed_config,
    "find_files": find_files,
    "archive": archive,
}
CATEGORIES = {
    "create_file": "file-operations", "count_matches": "text-processing", "sort_uniq": "text-processing",
    "permissions": "system-administration", "python_function": "software-engineering",
    "json_to_csv": "data-processing", "csv_stats": "data-processing", "git_basics": "version-control",
    "sed_config": "system-administration", "find_files": "file-operations", "archive": "file-operations",
}


# ---------------------------------------------------------------------------------------------- assembly


class NoInstanceError(ValueError):
    """A (family, difficulty) cell has no instance in the asked split: all its instructions hash to the other."""


def split_of(family: str, instruction: str) -> str:
    """The split of an instance, decided by what the model sees: its family and instruction text (about 1 in 5
    instructions is held out). Instances with byte-identical instructions always share a split."""
    h = int(hashlib.sha256(f"{family}\0{instruction}".encode()).hexdigest(), 16)
    return "heldout" if h % 5 == 0 else "train"


_SCAN_DRAWS = 400


@functools.cache
def cell_splits(family: str, difficulty: str) -> frozenset[str] | None:
    """The splits that a cell's instructions fall in, from a fixed scan of ``_SCAN_DRAWS`` draws, when the scan
    saw every instruction at least twice (a small instruction space, seen whole: Good-Turing's estimate of the
    unseen share is then 0); None for a large space (its instructions fall in both splits)."""
    rng = random.Random(f"scan/{family}/{difficulty}")
    seen = Counter(FAMILIES[family](rng, difficulty).instruction for _ in range(_SCAN_DRAWS))
    if 1 in seen.values():
        return None
    return frozenset(split_of(family, i) for i in seen)


def param_key(family: str, params: dict) -> str:
    return hashlib.sha256(f"{family}\0{json.dumps(params, sort_keys=True, default=str)}".encode()).hexdigest()[:12]


def generate(family: str, difficulty: str, *, split: str = "train", seed: int = 0) -> Task:
    """One instance of ``family`` at ``difficulty`` from the ``split`` instruction space, seeded; a cell with no
    instance of ``split`` raises ``NoInstanceError`` within 16 draws."""
    if family not in FAMILIES:
        raise ValueError(f"unknown built-in family {family!r}; known: {sorted(FAMILIES)}")
    if difficulty not in DIFFICULTIES or split not in SPLITS:
        raise ValueError(f"difficulty must be one of {DIFFICULTIES} and split one of {SPLITS}")
    rng = random.Random(f"{family}/{difficulty}/{split}/{seed}")
    for i in range(1000):
        spec = FAMILIES[family](rng, difficulty)
        if split_of(family, spec.instruction) == split:
            break
        if i == 15 and split not in (cell_splits(family, difficulty) or SPLITS):
            raise NoInstanceError(
                f"{family}/{difficulty} has no {split} instance: the split is a hash of the instruction, and every "
                f"instruction of this cell is in the {'train' if split == 'heldout' else 'heldout'} split; "
                f"use another difficulty or family")
    else:
        raise NoInstanceError(f"{family}/{difficulty}: could not draw a {split} instance in 1000 tries")
    files = {k: FileBlob(*v) if isinstance(v, tuple) else FileBlob(v) for k, v in spec.files.items()}
    lines = [f"FROM {BASE_IMAGE}", "WORKDIR /app"]
    lines += [f"COPY {shlex.quote(k)} /app/{shlex.quote(k)}" for k in sorted(files)]
    lines += [f"RUN {cmd}" for cmd in spec.setup]
    env = Environment(dockerfile="\n".join(lines) + "\n", files=files, workdir="/app")
    tests = Tests("pytest", {"test_outputs.py": FileBlob.text(spec.tests)}, "test_outputs.py")
    solution = Solution({"solve.sh": FileBlob.text("#!/bin/bash\nset -e\n" + spec.solution, 0o755)}, "solve.sh")
    key = param_key(family, spec.params)
    metadata = {"difficulty": difficulty, "category": CATEGORIES[family], "tags": [family, "builtin"],
                "source": "builtin", "family": family, "split": split, "seed": seed, "param_key": key}
    timeouts = {"easy": 300.0, "medium": 600.0, "hard": 900.0}[difficulty]
    return Task(f"builtin-{family}-{difficulty}-{key}", spec.instruction, env, tests, solution, timeouts, 60.0,
                metadata)


def builtin_tasks(
    n_per_cell: int = 1,
    *,
    families: list[str] | None = None,
    difficulties: tuple[str, ...] | list[str] = DIFFICULTIES,
    split: str = "train",
    seed: int = 0,
) -> list[Task]:
    """``n_per_cell`` instances for every (family, difficulty) that has any in ``split``, ids unique; the cells
    with none (all their instructions in the other split) are skipped with one warning naming them."""
    out, seen, empty = [], set(), []
    for fam in families or list(FAMILIES):
        for diff in difficulties:
            k = 0
            while sum(1 for t in out if t.metadata["family"] == fam and t.difficulty == diff) < n_per_cell:
                try:
                    t = generate(fam, diff, split=split, seed=seed * 100_003 + k)
                except NoInstanceError:
                    empty.append(f"{fam}/{diff}")
                    break
                k += 1
                if t.id not in seen:
                    seen.add(t.id)
                    out.append(t)
                if k > 50 * n_per_cell:
                    break
    if empty:
        log.warning("built-in %s split: skipped %d cell(s) with no %s instance (their instructions are all in the "
                    "other split): %s", split, len(empty), split, ", ".join(empty))
    return out
