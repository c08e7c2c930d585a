"""``python -m jaxrl_term.eval policy=oracle|nop|checkpoint|sglang|openai data.source=SRC eval.attempts=K
run_dir=DIR [+experiment=NAME] [key=value ...]``: writes DIR/summary.json (``pass@1``, ``pass@k``, per task),
DIR/attempts.jsonl, transcripts and the report. Restarting on the same DIR re-runs no finished attempt."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

import hydra

from jaxrl_term.config import format_problems, register
from jaxrl_term.train import CONF_DIR, HYDRA_FLAGS

register()


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra_compose("eval_config", overrides=list(overrides))


def check(cfg) -> None:
    from jaxrl_term.eval.run import apply_hf_path, policy_problems

    apply_hf_path(cfg)
    problems = policy_problems(cfg)
    if problems:
        print(format_problems(problems), file=sys.stderr)
        sys.exit(2)


def early_check(argv: list[str]) -> None:
    """The config checked before Hydra makes a run dir: ``config error: KEY: what; fix`` and exit 2."""
    if any(a.split("=")[0] in HYDRA_FLAGS for a in argv):
        return
    try:
        cfg = compose([a for a in argv if not a.startswith("-")])
    except Exception as e:  # noqa: BLE001 - Hydra's composition errors: unknown keys, groups, types
        msg = str(e).strip() or type(e).__name__
        if e.__cause__ is not None and str(e.__cause__).strip() not in msg:
            msg += "\n" + str(e.__cause__).strip()
        print(f"config error: {msg}", file=sys.stderr)
        sys.exit(2)
    check(cfg)


def print_summary(summary: dict, run_dir: str) -> None:
    from rich.console import Console
    from rich.table import Table

    def pct(x):
        return "-" if x is None else f"{x:.1%}"

    t = Table(title=f"eval {summary.get('policy')} on {summary.get('source')}: {summary['tasks']} tasks, "
                    f"k={summary['k']}")
    for col in ("", "tasks", "pass@1", "pass@k"):
        t.add_column(col)
    t.add_row("all", str(summary["tasks"]), f"{pct(summary['pass@1'])} ± {summary['pass@1_std']:.1%}",
              pct(summary["pass@k"]))
    for axis in ("by_difficulty", "by_category"):
        for name, g in summary[axis].items():
            if name != "None":
                t.add_row(f"{axis[3:]} {name}", str(g["tasks"]), pct(g["pass@1"]), pct(g["pass@k"]))
    c = Console()
    c.print(t)
    if summary["failure_modes"]:
        c.print("failure modes: " + ", ".join(f"{k} {v}" for k, v in summary["failure_modes"].items()))
    c.print(f"summary: {Path(run_dir) / 'summary.json'}")


@hydra.main(config_path=CONF_DIR, config_name="eval_config", version_base="1.3")
def main(cfg) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "absl", "jax._src.xla_bridge", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from jaxrl_term.eval.run import run_eval
    from jaxrl_term.sandbox.base import unwind_on_sigterm

    from jaxrl_term.rollout.colocation import config_env
    from jaxrl_term.runtime_env import apply_env

    unwind_on_sigterm()
    check(cfg)
    apply_env(config_env(cfg), who="eval")  # before anything touches a backend (runtime_env.py)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    summary = asyncio.run(run_eval(cfg))
    print_summary(summary, str(run_dir))
    if cfg.eval.report:
        from jaxrl_term.report import write_report

        print(f"report: {write_report(run_dir)}")


if __name__ == "__main__":
    early_check(sys.argv[1:])
    main()
