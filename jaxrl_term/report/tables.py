"""The report's numbers as tables of strings (shared by the HTML page and ``report.md``), and ``report.md``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxrl_term.report.load import Run, as_dict, as_float

Rows = list[list[str]]
GROUP_HEAD = ["", "tasks", "attempts", "pass@1", "pass@k"]
STEP_HEAD = ["step", "reward", "pass rate", "loss", "grad norm", "turns", "tokens", "step s"]
EVAL_HEAD = ["step", "pass@1", "± std", "pass@k", "k", "tasks", "attempts"]
ENGINE_HEAD = ["engine", "sandboxes", "failed", "left rotation", "of which hung", "out of rotation s", "in rotation"]
# an evaluation summary's key -> the config key it repeats
SUMMARY_KEYS: dict[str, str | None] = {"policy": "policy.kind", "source": "data.source", "split": "data.split",
                                       "scaffold": "agent.scaffold", "path": "policy.path", "step": None}
DIFFICULTIES = ("easy", "medium", "hard")
CONFIG_KEYS = ("policy.kind", "policy.path", "policy.model", "model.name", "model.path", "algo.name",
               "algo.loss", "algo.group_size", "data.source", "data.split", "eval.data.source", "eval.attempts",
               "agent.scaffold", "sandbox.backend", "rollout.engine", "rollout.temperature", "trainer.steps",
               "seed")


def pct(x: Any) -> str:
    f = as_float(x)
    return "-" if f is None else f"{f:.1%}"


def num(x: Any, fmt: str = ".4g") -> str:
    f = as_float(x)
    if f is None:
        return "-" if x is None else str(x)
    return format(f, fmt)


def count(x: Any) -> str:
    f = as_float(x)
    return "-" if f is None else str(round(f))


def seconds(x: Any) -> str:
    f = as_float(x)
    if f is None:
        return "-"
    return f"{f:.1f} s" if f < 120 else f"{f / 60:.1f} min" if f < 7200 else f"{f / 3600:.2f} h"


def _get(tree: Any, path: str) -> Any:
    for part in path.split("."):
        tree = as_dict(tree).get(part)
    return tree


def header_rows(run: Run) -> Rows:
    """Run dir, kind, the policy and config basics, wall time."""
    s = run.summary
    rows = [["run dir", str(run.dir)], ["kind", "evaluation" if run.kind == "eval" else "training"]]
    shown = set()
    if run.kind == "eval":  # the summary's record of what was evaluated, then the config for the rest
        for key, config_key in SUMMARY_KEYS.items():
            if s.get(key) is not None:
                rows.append([key, str(s[key])])
                if config_key:
                    shown.add(config_key)
    for key in CONFIG_KEYS:
        v = _get(run.config, key)
        if v is not None and not isinstance(v, dict | list) and key not in shown:
            rows.append([key, str(v)])
    if run.kind == "eval":
        rows.append(["wall time", seconds(s.get("wall_s"))])
    elif as_float(s.get("seconds")) is not None:
        rows.append(["wall time", seconds(s["seconds"])])
    else:
        steps = [as_float(m.get("time/step_s")) for m in run.steps]
        rows.append(["time in steps", seconds(sum(t for t in steps if t is not None)) if any(steps) else "-"])
        if as_float(run.warm_start.get("seconds")) is not None:
            rows.append(["warm start time", seconds(run.warm_start["seconds"])])
    return rows


def score_rows(s: dict) -> Rows:
    """pass@1 ± std, pass@k for each k, tasks, attempts, invalid attempts, means."""
    rows = [["pass@1", f"{pct(s.get('pass@1'))} ± {pct(s.get('pass@1_std'))}"]]
    pass_at = as_dict(s.get("pass_at"))
    rows += [[f"pass@{k}", pct(v)] for k, v in pass_at.items() if k != "1"]
    if not pass_at and s.get("k") not in (None, 1):
        rows.append([f"pass@{s.get('k')}", pct(s.get("pass@k"))])
    rows += [["tasks", count(s.get("tasks"))], ["attempts", count(s.get("attempts"))],
             ["invalid attempts (re-run, then dropped; never scored)", count(s.get("attempts_invalid", 0))],
             ["reward (mean)", num(s.get("reward_mean"), ".3f")], ["turns (mean)", num(s.get("turns_mean"), ".2f")],
             ["tokens (mean)", num(s.get("tokens_mean"), ".0f")]]
    if s.get("tasks_incomplete"):
        rows.append(["tasks with fewer attempts than k", str(len(s["tasks_incomplete"]))])
    return rows


def group_rows(s: dict, axis: str) -> Rows:
    """``by_difficulty`` / ``by_category`` rows (the "None" group: tasks without one)."""
    groups = sorted(((n, g) for n, g in as_dict(s.get(axis)).items() if isinstance(g, dict)), key=group_order)
    return [[name if name != "None" else "(none)", count(g.get("tasks")), count(g.get("attempts")),
             pct(g.get("pass@1")), pct(g.get("pass@k"))] for name, g in groups]


def group_order(item: tuple[str, Any]) -> tuple:
    """Difficulties easy, medium, hard first, other names alphabetically, tasks without a group last."""
    name = item[0]
    return name == "None", DIFFICULTIES.index(name) if name in DIFFICULTIES else len(DIFFICULTIES), name


def failure_rows(s: dict) -> Rows:
    modes = as_dict(s.get("failure_modes"))
    return [[str(k), str(v)] for k, v in sorted(modes.items(), key=lambda kv: -(as_float(kv[1]) or 0))]


def reward_cell(m: dict) -> str:
    return f"{num(m.get('reward/mean'), '.3f')} ({pct(m.get('reward/pass_rate'))} passed)"


def train_score_rows(run: Run) -> Rows:
    """First and last step's reward and pass rate, and the held-out pass@1 before and after."""
    steps, evals = run.steps, run.eval_points
    rows = []
    if steps:
        rows += [["steps", str(len(steps))], ["reward, first step", reward_cell(steps[0])],
                 ["reward, last step", reward_cell(steps[-1])]]
    if evals:
        rows += [[f"held-out pass@1, step {evals[0]['step']}", pct(evals[0].get("eval/pass@1"))]]
        if len(evals) > 1:
            rows += [[f"held-out pass@1, step {evals[-1]['step']}", pct(evals[-1].get("eval/pass@1"))]]
    return rows


def step_rows(run: Run) -> Rows:
    return [[str(m["step"]), num(m.get("reward/mean"), ".3f"), pct(m.get("reward/pass_rate")),
             num(m.get("train/loss")), num(m.get("train/grad_norm"), ".3g"), num(m.get("episode/turns_mean"), ".2f"),
             num(m.get("episode/tokens_mean"), ".0f"), num(m.get("time/step_s"), ".1f")] for m in run.steps]


def eval_rows(run: Run) -> Rows:
    return [[str(m["step"]), pct(m.get("eval/pass@1")), pct(m.get("eval/pass@1_std")), pct(m.get("eval/pass@k")),
             count(m.get("eval/k")), count(m.get("eval/tasks")), count(m.get("eval/attempts"))]
            for m in run.eval_points]


def engine_rows(run: Run) -> Rows:
    """Per Docker engine of ``sandbox.docker.hosts`` (``engine/NAME/*`` step metrics): sandboxes opened, failed,
    times out of rotation (and how many for missed liveness probes), seconds out, and whether it is in rotation at
    the last step that reports it."""
    names = sorted({k.split("/")[1] for m in run.steps for k in m if k.startswith("engine/") and k.count("/") == 2})
    rows = []
    for n in names:
        seen = [m for m in run.steps if f"engine/{n}/up" in m]

        def total(key: str) -> str:
            return count(sum(as_float(m.get(f"engine/{n}/{key}")) or 0 for m in seen))

        last = seen[-1] if seen else {}
        up = as_float(last.get(f"engine/{n}/up"))
        rows.append([n, total("created"), total("failures"), total("left"), total("hung"),
                     seconds(last.get(f"engine/{n}/out_s", 0.0)), "-" if up is None else ("yes" if up else "no")])
    return rows


def warm_start_rows(run: Run) -> Rows:
    return [[k, num(v) if as_float(v) is not None else str(v)] for k, v in run.warm_start.items()
            if not isinstance(v, list | dict)]


def md_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    def cell(c: str) -> str:
        return str(c).replace("|", "\\|").replace("\n", " ")

    return "\n".join(["| " + " | ".join(cell(h) for h in head) + " |", "|" + "---|" * len(head)]
                     + ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows])


def score_markdown(s: dict, title: str) -> list[str]:
    lines = [f"## {title}", "", md_table(["", "value"], score_rows(s)), ""]
    for axis, name in (("by_difficulty", "by difficulty"), ("by_category", "by category")):
        if group_rows(s, axis):
            lines += [f"### {title}, {name}", "", md_table(GROUP_HEAD, group_rows(s, axis)), ""]
    if failure_rows(s):
        lines += [f"### {title}, failure modes", "", md_table(["mode", "attempts"], failure_rows(s)), ""]
    return lines


def render_markdown(run: Run) -> str:
    """``report.md``: the header, the scores, and for training the warm start, held-out evaluations and steps."""
    lines = [f"# jaxrl_term {'evaluation' if run.kind == 'eval' else 'training'} report", "",
             md_table(["", ""], header_rows(run)), ""]
    if run.notes:
        lines += ["**Missing from this run dir, or skipped**:", ""] + [f"- {n}" for n in run.notes] + [""]
    if run.kind == "eval":
        lines += score_markdown(run.summary, "Score") if "pass@1" in run.summary else ["No scores.", ""]
    else:
        if train_score_rows(run):
            lines += ["## Score", "", md_table(["", "value"], train_score_rows(run)), ""]
        if run.warm_start:
            lines += ["## Warm start", "", md_table(["", "value"], warm_start_rows(run)), ""]
        if run.eval_points:
            lines += ["## Held-out evaluations", "", md_table(EVAL_HEAD, eval_rows(run)), ""]
        if run.evals:
            lines += score_markdown(run.headline, f"Latest held-out evaluation (step {max(run.evals)})")
        lines += ["## Steps", "", md_table(STEP_HEAD, step_rows(run)) if run.steps else "No training step yet.", ""]
        if engine_rows(run):
            lines += ["## Docker engines", "", md_table(ENGINE_HEAD, engine_rows(run)), ""]
    lines.append(f"{len(run.transcripts)} transcript(s): see report.html.")
    return "\n".join(lines) + "\n"
