"""Console scripts (``pip install`` puts them on PATH) and ``python -m jaxrl_term``: the entry points in one list.

Each script runs exactly what ``python -m <module>`` runs (the same early config checks and error handling)."""

from __future__ import annotations

import sys

# (console script, python -m module, what it does)
ENTRY_POINTS = (
    ("jaxrl-term-train", "jaxrl_term.train", "RL training (Hydra): +experiment=NAME, key=value overrides, -m sweeps"),
    ("jaxrl-term-sft", "jaxrl_term.sft", "supervised fine-tuning on demonstrations; writes run_dir/hf_final"),
    ("jaxrl-term-eval", "jaxrl_term.eval", "pass@k of a policy (checkpoint, SGLang, OpenAI, oracle, nop) on tasks"),
    ("jaxrl-term-report", "jaxrl_term.report", "HTML / markdown report of a run; compare and summary tables"),
    ("jaxrl-term-tasks", "jaxrl_term.tasks", "ls / convert / check task sets (TB1, Harbor, TB-RL CSV, Parquet)"),
    ("jaxrl-term-datagen", "jaxrl_term.datagen", "taxonomy-driven task generation: sample / run / report"),
    ("jaxrl-term-plan", "jaxrl_term.plan", "memory and throughput plan of a preset on its hardware (no GPU needed)"),
    ("jaxrl-term-serve", "jaxrl_term.serve", "an SGLang-compatible HTTP server on the embedded JAX engine"),
    ("jaxrl-term-images", "jaxrl_term.sandbox.images", "Docker engine and base images: setup"),
    ("jaxrl-term-sandbox", "jaxrl_term.sandbox.docker", "reap containers left by killed runs"),
    ("jaxrl-term-judge-eval", "jaxrl_term.reward.judge_eval", "rank LLM judges on labelled trajectories"),
)


def _guarded(module: str):
    """The entry point ``module.main`` with ``utils.cli.guard`` (bad input: one line, exit code 2)."""

    def run() -> int:
        from importlib import import_module

        from jaxrl_term.utils.cli import guard

        return guard(import_module(module).main)()

    run.__name__ = module.rsplit(".", 1)[-1]
    return run


def train() -> None:
    from jaxrl_term import train as t

    sys.argv[1:] = t.route_run_dir(t.early_preflight(sys.argv[1:]))
    t.main()


def eval() -> None:  # noqa: A001 - the command's name
    from jaxrl_term.eval import __main__ as e

    e.early_check(sys.argv[1:])
    e.main()


sft = _guarded("jaxrl_term.sft")
report = _guarded("jaxrl_term.report.__main__")
tasks = _guarded("jaxrl_term.tasks.__main__")
datagen = _guarded("jaxrl_term.datagen.__main__")
plan = _guarded("jaxrl_term.plan")
serve = _guarded("jaxrl_term.serve")
images = _guarded("jaxrl_term.sandbox.images")
sandbox = _guarded("jaxrl_term.sandbox.docker")
judge_eval = _guarded("jaxrl_term.reward.judge_eval")


def listing() -> str:
    width = max(len(m) for _, m, _ in ENTRY_POINTS)
    lines = ["jaxrl_term entry points (python -m MODULE, or the console script):", ""]
    lines += [f"  python -m {m:<{width}}  {s:<22}  {what}" for s, m, what in ENTRY_POINTS]
    lines += ["", "Each takes --help (Hydra entry points: --help shows the config groups)."]
    return "\n".join(lines)
