"""The datagen pipeline end to end against the scripted teacher of the tests (a real OpenAI-compatible HTTP
server on localhost), in real Docker sandboxes, into experiments/results/datagen_scripted/ (report.md + .png,
records.jsonl): what a run costs in teacher calls per kept task when answers need repairs or get rejected.

    .venv/bin/python experiments/datagen/scripted_run.py

Scenarios (one spec each): a good task; a Dockerfile that fails to build, fixed on repair; an answer without
its tests, fixed on repair; tests that pass before any work; an oracle that fails; a near-duplicate of the good
task; a copy of an evaluation task; a teacher answering HTTP 500 (an error, retried by the next run).
"""

import asyncio
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from teacher_server import TeacherServer, file_task  # noqa: E402
from test_datagen import LONG, _spec  # noqa: E402

from jaxrl_term.datagen.__main__ import compose  # noqa: E402
from jaxrl_term.datagen.run import run_datagen  # noqa: E402
from jaxrl_term.tasks.dataset import load_dataset  # noqa: E402


def main() -> None:
    eval_task = load_dataset("builtin", split="heldout", n_per_cell=8)[0]
    scenarios = {
        "good": [file_task("alpha.txt", "hello alpha", instruction=LONG.format(line="hello alpha", who="on-call"))],
        "build": [file_task("beta.txt", "beta line", dockerfile_extra="RUN exit 3\n"), file_task("beta.txt", "beta line")],
        "format": [file_task("gamma.txt", "gamma line").replace("<tests>", "<test>").replace("</tests>", "</test>"),
                   file_task("gamma.txt", "gamma line")],
        "initial": [file_task("delta.txt", "delta line", dockerfile_extra="RUN printf 'delta line\\n' > /app/delta.txt\n")],
        "oracle": [file_task("eps.txt", "eps line", solution="printf 'wrong\\n' > /app/eps.txt")],
        "dup": [file_task("alpha.txt", "hello alpha", instruction=LONG.format(line="hello alpha", who="night-shift"))],
        "contaminated": [file_task("zeta.txt", "zeta line", instruction=eval_task.instruction + " Then stop.")],
        "down": [500],
    }
    out_final = ROOT / "experiments" / "results" / "datagen_scripted"
    with tempfile.TemporaryDirectory() as tmp:
        specs = Path(tmp) / "specs.jsonl"
        specs.write_text("".join(json.dumps(_spec(n, i).to_json()) + "\n" for i, n in enumerate(scenarios)))
        server = TeacherServer(scenarios).start()
        out = Path(tmp) / "gen"
        try:
            cfg = compose([f"datagen.out_dir={out}", f"datagen.specs={specs}", "datagen.max_repairs=1",
                           "datagen.teacher.rounds=1", "datagen.teacher.retries=0", "datagen.teacher.backoff_s=0.01",
                           "datagen.teacher.failure_threshold=100",
                           f"datagen.teacher.endpoints=[{{name:scripted,base_url:'{server.url}',model:teacher}}]"])
            summary = asyncio.run(run_datagen(cfg))
        finally:
            server.stop()
        if out_final.exists():
            shutil.rmtree(out_final)
        out_final.mkdir(parents=True)
        for name in ("report.md", "report.png", "records.jsonl"):
            shutil.copy(out / name, out_final / name)
        text = (out_final / "report.md").read_text().replace(str(out), "scripted run (experiments/datagen/scripted_run.py)")
        (out_final / "report.md").write_text(text)
    print(json.dumps({k: v for k, v in summary.items() if k != "per_axis"}, indent=2))


if __name__ == "__main__":
    main()
