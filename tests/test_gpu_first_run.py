"""experiments/bench/gpu_first_run.py, the prepared first run on a GPU, run at its tiny shape on the CPU so that it
cannot rot before a GPU is lent: every check runs and passes (GPU-only readings say n/a) and the report is written."""

import os
import sys

from conftest import REPO, run_stacked

SCRIPT = REPO / "experiments" / "bench" / "gpu_first_run.py"


def table(text: str) -> dict[str, tuple[str, str]]:
    """check -> (result, verdict) from the report's markdown table."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) >= 4 and cells[-1] in ("pass", "FAIL", "n/a"):
            rows["|".join(cells[:-3])] = ("|".join(cells[-3:-2]), cells[-1])
    return rows


def test_first_gpu_run_script_runs_every_check_on_the_cpu_at_a_tiny_shape(tmp_path):
    out = tmp_path / "gpu_first_run.md"
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_")}  # one CPU device, no allocator vars
    r = run_stacked([sys.executable, str(SCRIPT), "--shape", "tiny", "--allow-cpu", "--out", str(out)], cwd=REPO,
                    timeout=600, env={**env, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stderr[-5000:] + r.stdout[-3000:]
    text = out.read_text()
    assert text.startswith("# First GPU run") and "jax " in text and "on cpu (cpu)" in text
    rows = table(text)
    assert table(r.stdout) == rows  # the printed table is the written one
    verdicts = {k: v for k, (_, v) in rows.items()}
    assert "FAIL" not in verdicts.values(), rows
    # n/a only where a reading needs a GPU (device memory, the CUDA context) or a GPU's time budget
    assert all(res.startswith("n/a on cpu") or k == "total wall time" for k, (res, v) in rows.items() if v == "n/a")
    for prefix, n in (("allocator settings before JAX's backend", 1), ("attention bfloat16: blockwise vs", 4),
                      ("attention float32: blockwise vs xla", 4), ("bf16 compute / fp32 master vs fp32: loss", 1),
                      ("bf16 vs fp32:", 2), ("release/resume: train state bit-identical", 1),
                      ("engine (bf16 products) vs trainer log-prob gap", 2), ("update step MFU", 1)):
        assert sum(k.startswith(prefix) and v == "pass" for k, v in verdicts.items()) == n, (prefix, rows)
    assert "XLA_PYTHON_CLIENT_ALLOCATOR=platform" in rows["allocator settings before JAX's backend"][0]
    assert "## gpu_step_mfu.py" in text  # its own table, reused rather than rewritten
