"""The ``fields`` task family of the learning_v2 experiment: a file whose format the instruction does not state.

Each task asks for one result computed from one field of the records in a data file (the values of field k,
its distinct values, its sum or largest value, or the number of records). Two attributes of the file are
hidden, i.e. never named by the instruction:

- the delimiter: ``,`` (the default a hurried agent assumes) or ``;``, ``|``, ``:``;
- a header line: absent (the default) or a first line ``# name<d>colour<d>small<d>large``.

An agent that assumes the default writes ``awk -F',' '{...}'``; that passes only when the file happens to be in
the default format (or the op does not depend on what differs). An agent that looks first (``head -n 3 FILE``)
can pick the delimiter and skip the header. The SFT teacher mostly assumes the default and looks first in a
minority of its demonstrations (``demo``); RL can discover that looking pays. ``grade`` = the number of hidden
attributes that differ from the default; ``default_ok`` = whether the default command passes this task.

Splits are disjoint by construction (``disjointness`` checks it on the generated text):
- instruction parameters: every (op, field, extension) cell belongs to one split (``cell_split``), so a
  held-out instruction asks for a combination no SFT or RL instruction asks for; every pair of its parts occurs
  in training, in other combinations, and no part is predictable from the other two as seen in training
  (``shortcuts``: 0);
- sentence frames: the intro and ask slots have phrasings reserved for the held-out split, so no held-out
  instruction's template (frame + key phrase) occurs in SFT or RL data;
- held-out instructions that would share a word 8-gram with any SFT/RL instruction are redrawn.
Shared by both splits, as a vocabulary: the op's key phrase (``WHAT``) and the paths (fixed but for the input's
extension). The split holds out instructions, not the words and phrases they are made of.

Everything here is pure Python (no sandbox): tasks are ``jaxrl_term`` Tasks on the base image with a Harbor
``test.sh`` (the output file byte for byte) and an oracle; demonstrations are the scripted replies and the
outputs the sandbox gives for them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import re
import shlex

from jaxrl_term.agent.actions import SENTINEL
from jaxrl_term.tasks.task import Environment, FileBlob, Solution, Task, Tests

BASE_IMAGE = "jaxrl-term/base:trixie"
DELIMS = (",", ";", "|", ":")
DEFAULT_DELIM = ","
# Extensions: one token each in the tiny tokenizer. With 8 of them the SFT policy writes the right one on new
# (op, field, extension) combinations 510 of 512 times; with 4, 70% (dev check, PREREGISTRATION.md change 8).
EXTS = ("txt", "csv", "log", "json", "md", "py", "sh", "c")
# Paths are fixed but for the input's extension: the 0.92M policy copies a one-digit field number (90%) or an
# extension (94%) from the instruction into its command, and file names not at all (3% of 395 commands, chance:
# measured on training tasks with names from a 28-word vocabulary), so names would only add noise to the test of
# what this experiment is about: looking at a file before assuming its format.
INPUT, OUTPUT = "/app/data", "/app/answer.txt"
WORDS = ("alpha", "bravo", "cedar", "delta", "ember", "fjord", "gamma", "harbor", "indigo", "juniper", "kernel",
         "lumen", "maple", "nectar", "onyx", "pixel")
COLOURS = ("red", "blue", "green", "amber", "teal", "violet")
# A record: a name, a colour and four numbers of different ranges (fields 3-6).
HEADER = ("name", "colour", "qty", "price", "rank", "score")
NUMBERS = ((1, 99), (100, 999), (1, 9), (10, 99))
OPS = ("values", "distinct", "sum", "max", "count")
FIELDS = {"values": (1, 2, 3, 4, 5, 6), "distinct": (1, 2, 3, 4, 5, 6), "sum": (3, 4, 5, 6), "max": (3, 4, 5, 6),
          "count": (None,)}

# Template slots: the sentence frame (intro, ask) has phrasings for training (SFT and RL data), some of them
# "dev" (training phrasings that the dev check of ``run.py --dev`` holds out, as it holds out the dev cells), and
# phrasings reserved for the held-out split; {src} / {dst} are the input / output paths, {what} the op's key
# phrase. Training phrasings put the key phrase before and after the output path, as held-out ones do: with four
# intros and three asks, all key phrase first, the SFT policy chose the right op for 20% of held-out commands
# (pilot 4), against 94% in training frames.
INTRO = {
    "train": ("The file {src} holds one record per line.", "Each line of {src} is a record.",
              "{src} contains records, one per line.", "There are records in {src}, one on each line.",
              "In {src} every line is one record.", "The records are in {src}, a line each.",
              "{src} lists records, each on its own line.", "One record per line is what {src} has."),
    "dev": ("You will find records in {src}, one line apiece.", "The data file {src} keeps a record on every line."),
    "heldout": ("Records are stored line by line in {src}.", "You are given {src}, a file with a record per line.",
                "Look up the records of {src}; a line holds one of them."),
}
ASK = {
    "train": ("Write {what} to {dst}.", "Save {what} in {dst}.", "Put {what} into {dst}.",
              "Compute {what} and write it to {dst}.", "Into {dst}, write {what}.", "Fill {dst} with {what}.",
              "Make {dst} contain {what}.", "{dst} should hold {what}."),
    # dev: words of their own on both sides of {what} (change 12): "Output {what} to {dst}" shared "{what} to" with
    # "Write {what} to {dst}", so the 8-gram filter rejected every dev task but sums and maxima
    "dev": ("Record {what} inside {dst}.", "Deliver {dst} listing {what}."),
    "heldout": ("Store {what} as {dst}.", "Create {dst} holding {what}.", "Report {what} by writing it to {dst}."),
}
# The op's key phrase is shared by both splits: a 0.92M model trained from scratch on these templates cannot
# learn what a paraphrase of it means (measured in the first pilot: 0% and 10% right ops on two held-out
# paraphrases of "distinct values"), and that is not what this experiment asks. Held-out instructions are new
# sentences (reserved frames, reserved (op, field, extension) cells), whose key phrases the policy knows.
# The field is written as awk writes it ("field $3"): the command's `` $3`` then repeats tokens of the
# instruction, which a small transformer copies (an induction head); after "field 3" it has to map `` 3`` to
# ``$3``, and on new combinations the policy recalled a field seen with the rest of the instruction instead (43%
# right; dev check, change 8).
WHAT = {
    "values": ("the values of field ${k}, in file order", "field ${k} of every record, in order"),
    "distinct": ("the sorted distinct values of field ${k}", "the distinct values of field ${k}, sorted"),
    "sum": ("the sum of field ${k}", "the total of field ${k}"),
    "max": ("the largest value of field ${k}", "the maximum of field ${k}"),
    "count": ("the number of records", "how many records there are"),
}
REASON = {
    "assume": "The file is comma separated, so I will compute the answer with awk.",
    "look": "I do not know the file's format yet, so I will look at its first lines.",
    "act": "Now I know the delimiter{hdr}, so I will compute the answer with awk.",
    "done": "The result is written, so the task is done.",
}
# The teacher restating the instruction's parameters next to each command (``demo(restate=True)``, change 14): the
# key phrase with its field and the input path are copied verbatim from the instruction into the reasoning, and the
# command written right after repeats them at a short distance. Each demonstration then copies the parameters twice
# per command, and in two contexts (prose and awk), where the plain teacher copies them once. Short enough that
# every reply fits agent.max_tokens_per_turn (96; data.episodes checks).
REASON_RESTATED = {
    "assume": "It is comma separated, so from {src} I write {what}.",
    "look": "I do not know the format of {src} yet, so I will look at its first lines.",
    "act": "I know the delimiter{hdr}: from {src} I write {what}.",
    "done": REASON["done"],
}
NGRAM = 8  # word n-grams a held-out instruction may not share with any SFT/RL instruction
# (the first "values" key phrase is 8 words, "the values of field $3 in file order": every held-out or dev
# instruction with it is rejected, so those use the second one; found in change 12, kept: it only filters more)


def _h(*parts) -> int:
    return int(hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest(), 16)


@dataclasses.dataclass(frozen=True)
class Spec:
    split: str
    op: str
    k: int | None
    src: str  # /app/data.<ext>
    dst: str  # /app/answer.txt
    delim: str
    header: bool
    records: tuple[tuple, ...]  # (name, colour, 4 numbers)
    template: tuple[str, str, str]  # the (intro, ask, what) phrasings it was written from
    instruction: str

    @property
    def grade(self) -> int:
        return int(self.delim != DEFAULT_DELIM) + int(self.header)

    @property
    def lines(self) -> list[str]:
        head = [f"# {self.delim.join(HEADER)}"] if self.header else []
        return head + [self.delim.join(map(str, r)) for r in self.records]

    @property
    def data(self) -> str:
        return "".join(line + "\n" for line in self.lines)

    @property
    def expected(self) -> list[str]:
        return run_awk(self, self.delim, self.header)

    @property
    def default_ok(self) -> bool:
        return run_awk(self, DEFAULT_DELIM, False) == self.expected


def cell_split(op: str, k: int | None, ext: str) -> str:
    """An instruction's parameters (op, field, extension) belong to one split: ``heldout``, or ``train`` (which
    includes the ``dev`` cells: a held-out-style part of the training split, for choosing the SFT mix and model
    without ever evaluating on held-out tasks; ``--dev`` in run.py leaves them out of SFT/RL data).

    Held-out: (op, field, extension) with field k >= 3 and (k + op) = extension mod 4 (ops and extensions by
    index); dev: (k + op + 1) = extension mod 4. So in training (even without the dev cells) every parameter of a
    held-out cell takes >= 2 values given the other two (``shortcuts`` checks it): no part of a held-out
    instruction is predictable from the rest of it as seen in training. (Pilot 3's rotation left e.g. every
    training sum over a .dat file on field 4, and the policy then wrote $4 for held-out sums of field 3 on .dat
    files: 100 of 293 commands on such cells took that shortcut.)"""
    if op == "count" or k is None or k < 3:
        return "train"
    r = (k + OPS.index(op) - EXTS.index(ext)) % len(EXTS)
    return "heldout" if r == 0 else "dev" if r == len(EXTS) - 1 else "train"


CELLS = {sp: [(op, k, ext) for op in OPS for k in FIELDS[op] for ext in EXTS if cell_split(op, k, ext) == sp]
         for sp in ("train", "dev", "heldout")}  # "train": without the dev cells


def shortcuts(train: list[tuple], target: list[tuple]) -> int:
    """How many ``target`` cells have a parameter that the ``train`` cells determine from the other two (the
    train cells sharing the other two parameters show < 2 values of it): 0 = none can be guessed that way."""
    bad = 0
    for cell in target:
        for i in range(3):
            rest = [j for j in range(3) if j != i]
            seen = {c[i] for c in train if all(c[j] == cell[j] for j in rest)}
            bad += len(seen) < 2 and cell[0] != "count"
    return bad


def draw(rng: random.Random, split: str) -> Spec:
    """A task of ``split``: ``train`` (training cells and phrasings, dev ones included), ``train_only`` (without
    the dev cells and phrasings: the dev check's training data), ``dev`` or ``heldout``."""
    if split == "train_only":
        pool, frames = CELLS["train"], "train"
    elif split == "train":
        pool, frames = CELLS["train"] + CELLS["dev"], "train"
    else:
        pool, frames = CELLS[split], split
    intros, asks = INTRO[frames], ASK[frames]
    if split == "train":
        intros, asks = intros + INTRO["dev"], asks + ASK["dev"]
    op, k, ext = rng.choice(pool)
    src, dst = f"{INPUT}.{ext}", OUTPUT
    delim = DEFAULT_DELIM if rng.random() < 0.4 else rng.choice(DELIMS[1:])
    header = rng.random() < 0.5
    n = rng.randint(4, 8)
    records = tuple((f"{rng.choice(WORDS)}{i}", rng.choice(COLOURS), *(rng.randint(a, b) for a, b in NUMBERS))
                    for i in range(n))
    template = (rng.choice(intros), rng.choice(asks), rng.choice(WHAT[op]))
    text = template[0].format(src=src) + " " + template[1].format(what=template[2].format(k=k), dst=dst)
    return Spec(split, op, k, src, dst, delim, header, records, template, text[0].upper() + text[1:])


def parse_record(fields: list[str]) -> tuple:
    """A data-file line's fields back to a record (ValueError when it is not one)."""
    if len(fields) != len(HEADER):
        raise ValueError(f"a record has {len(HEADER)} fields, not {len(fields)}")
    return (fields[0], fields[1], *map(int, fields[2:]))


# ----------------------------------------------------------------------------------------- commands


def command(spec: Spec, delim: str, header: bool) -> str:
    """The awk command for ``spec`` under an assumed format (the oracle's when it is the file's)."""
    skip = "!/^#/ " if header else ""
    d = shlex.quote(delim)
    src, dst = spec.src, spec.dst
    if spec.op == "values":
        return f"awk -F{d} '{skip}{{print ${spec.k}}}' {src} > {dst}"
    if spec.op == "distinct":
        return f"awk -F{d} '{skip}{{print ${spec.k}}}' {src} | sort -u > {dst}"
    if spec.op == "sum":
        return f"awk -F{d} '{skip}{{s += ${spec.k}}} END {{print s}}' {src} > {dst}"
    if spec.op == "max":
        return f"awk -F{d} '{skip}{{print ${spec.k}}}' {src} | sort -n | tail -n 1 > {dst}"
    return f"awk '{skip}{{n++}} END {{print n}}' {src} > {dst}"


def _num(s: str) -> float:
    """awk's string -> number: the longest leading numeric prefix, else 0."""
    m = re.match(r"\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", s)
    return float(m.group(0)) if m else 0.0


def _fmt(x: float) -> str:
    return str(int(x)) if x == int(x) else repr(x)


def run_awk(spec: Spec, delim: str, header: bool) -> list[str]:
    """The output lines ``command(spec, delim, header)`` gives on ``spec``'s file (awk, sort -u / -n semantics
    for these inputs; checked against the real tools by tests/test_learning_v2.py)."""
    lines = [ln for ln in spec.lines if not (header and ln.startswith("#"))]
    if spec.op == "count":
        return [str(len(lines))]
    cols = [ln.split(delim) for ln in lines]
    vals = [c[spec.k - 1] if spec.k - 1 < len(c) else "" for c in cols]
    if spec.op == "values":
        return vals
    if spec.op == "distinct":
        return sorted(set(vals), key=lambda v: v.encode())
    if spec.op == "sum":
        return [_fmt(sum(_num(v) for v in vals))]
    # sort -n: by numeric prefix (non-numbers as 0), ties by the whole line (bytes); tail -n 1 = the last
    return [sorted(vals, key=lambda v: (_num(v), v.encode()))[-1]]


# ------------------------------------------------------------------------------------------- tasks


def task_id(spec: Spec) -> str:
    return "fields-" + hashlib.sha256(f"{spec.instruction}\0{spec.data}".encode()).hexdigest()[:16]


def to_task(spec: Spec) -> Task:
    name = spec.src.rsplit("/", 1)[1]
    env = Environment(dockerfile=f"FROM {BASE_IMAGE}\nWORKDIR /app\nCOPY {name} {spec.src}\n",
                      files={name: FileBlob(spec.data.encode())}, workdir="/app")
    # a Harbor test.sh: the output file, byte for byte (no interpreter to start: cheap enough for 100k attempts)
    test_sh = (f"#!/bin/bash\nif cmp -s /tests/expected.txt {spec.dst}; then echo 1 > /logs/verifier/reward.txt\n"
               "else echo 0 > /logs/verifier/reward.txt; fi\n")
    expected = "".join(x + "\n" for x in spec.expected)
    sol = "#!/bin/bash\nset -e\n" + command(spec, spec.delim, spec.header) + "\n"
    meta = {"difficulty": "easy", "category": "data-processing", "tags": ["fields", "learning_v2"],
            "source": "learning_v2", "family": "fields", "split": spec.split, "op": spec.op, "k": spec.k,
            "delim": spec.delim, "header": spec.header, "grade": spec.grade, "default_ok": spec.default_ok,
            "src": spec.src, "dst": spec.dst, "template": list(spec.template)}
    tests = Tests("harbor", {"test.sh": FileBlob.text(test_sh, 0o755), "expected.txt": FileBlob.text(expected)},
                  "test.sh")
    return Task(task_id(spec), spec.instruction, env, tests,
                Solution({"solve.sh": FileBlob.text(sol, 0o755)}, "solve.sh"), 120.0, 60.0, meta)


def _reply(reason: str, cmd: str) -> str:
    return f"{reason}\n```bash\n{cmd}\n```"


def demo(spec: Spec, look: bool, restate: bool = False) -> tuple[list[str], dict[str, str]]:
    """A teacher's demonstration: (replies, {command: the output the sandbox prints for it}). ``look``: read
    the file's head first, then act on its format; else assume the default (comma, no header). ``restate``: the
    reasoning repeats the instruction's key phrase and input path (``REASON_RESTATED``)."""
    reason = REASON_RESTATED if restate else REASON
    what, src = spec.template[2].format(k=spec.k), spec.src
    done = _reply(reason["done"], f"echo {SENTINEL}")
    outputs = {f"echo {SENTINEL}": SENTINEL + "\n"}
    if not look:
        cmd = command(spec, DEFAULT_DELIM, False)
        return [_reply(reason["assume"].format(what=what, src=src), cmd), done], {cmd: "", **outputs}
    peek = f"head -n 3 {spec.src}"
    act = command(spec, spec.delim, spec.header)
    hdr = " and skip the header line" if spec.header else ""
    return ([_reply(reason["look"].format(src=src), peek),
             _reply(reason["act"].format(hdr=hdr, what=what, src=src), act), done],
            {peek: "".join(ln + "\n" for ln in spec.lines[:3]), act: "", **outputs})


# ------------------------------------------------------------------------------------------- splits


def words(text: str) -> list[str]:
    """Whitespace words, lower-cased, without the punctuation around them (a path is one word)."""
    return [w for w in (t.strip(".,;:()'\"") for t in text.lower().split()) if w]


def ngrams(text: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    w = words(text)
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


def make_train(n: int, seed: int, dev: bool = False) -> list[Spec]:
    """``n`` training specs; ``dev``: without the dev cells and phrasings (the dev check's training data)."""
    rng = random.Random(f"fields/train/{seed}")
    return [draw(rng, "train_only" if dev else "train") for _ in range(n)]


def make_heldout(n: int, seed: int, seen: set[tuple[str, ...]], dev: bool = False) -> list[Spec]:
    """``n`` held-out specs, none sharing a word ``NGRAM``-gram with ``seen`` (the SFT/RL instructions'). ``dev``:
    tasks on the dev cells and phrasings instead, for the dev check of ``run.py --dev``."""
    rng = random.Random(f"fields/{'dev' if dev else 'heldout'}/{seed}")
    out, ids = [], set()
    for _ in range(200 * n):
        s = draw(rng, "dev" if dev else "heldout")
        if not ngrams(s.instruction) & seen and task_id(s) not in ids:
            out.append(s)
            ids.add(task_id(s))
            if len(out) == n:
                return out
    raise RuntimeError(f"only {len(out)} of {n} held-out instructions avoid every SFT/RL {NGRAM}-gram")


def disjointness(heldout: list[Spec], training: dict[str, list[Spec]]) -> dict:
    """Overlap counts of the held-out instructions against each training source (all must be 0)."""
    out: dict = {"ngram_n": NGRAM, "heldout_tasks": len(heldout),
                 "heldout_instructions": len({s.instruction for s in heldout})}
    for src, specs in training.items():
        texts = {s.instruction for s in specs}
        grams = set().union(*(ngrams(t) for t in texts)) if texts else set()
        combos = {(s.template, s.op, s.k, s.src, s.dst) for s in specs}
        params = {(s.op, s.k, s.src) for s in specs}
        templates = {s.template for s in specs}
        slots = [{s.template[i] for s in specs} for i in range(2)]  # the frame; key phrases are shared
        out[src] = {"instructions": len(texts),
                    "exact": sum(s.instruction in texts for s in heldout),
                    "ngram": sum(bool(ngrams(s.instruction) & grams) for s in heldout),
                    "parameters": sum((s.op, s.k, s.src) in params for s in heldout),
                    "combination": sum((s.template, s.op, s.k, s.src, s.dst) in combos for s in heldout),
                    "template": sum(s.template in templates for s in heldout),
                    "template_slot": sum(any(s.template[i] in slots[i] for i in range(2)) for s in heldout)}
    cells = {(s.op, s.k, s.src.rsplit(".", 1)[1]) for specs in training.values() for s in specs}
    out["shortcuts"] = shortcuts(list(cells), sorted({(s.op, s.k, s.src.rsplit(".", 1)[1]) for s in heldout},
                                                     key=str))
    out["all_zero"] = out["shortcuts"] == 0 and all(v[key] == 0 for v in out.values() if isinstance(v, dict)
                          for key in ("exact", "ngram", "parameters", "combination", "template", "template_slot"))
    return out
