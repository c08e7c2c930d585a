"""The fit planner (``python -m jaxrl_term.plan``): it compiles the real train step on fake devices, its numbers
agree with an independent compile, and its verdict follows the budget."""

import json
import re
import subprocess
import sys

import jax
import pytest

from conftest import REPO

# A cluster-shaped preset shrunk to test size: 2 nodes x 4 "GPUs" of 1 GB, a tiny Qwen3, a 2 x 4 mesh,
# 2 launched TP-2 servers per node sharing the GPUs statically.
SMALL = ["+experiment=qwen32b_h100", "model=tiny", "model.random_init=true", "model.tokenizer=tiny",
         "model.options.scan_layers=true", "model.options.attention_block=512",  # the GPU presets' layer path
         "model.options.attention=cudnn", "model.options.remat=full", "model.options.remat_groups=2",
         "model.options.mlp_chunk=128", "agent.max_context_tokens=512", "trainer.buckets=[256,512]",
         "trainer.cluster.nodes=2", "trainer.cluster.gpus_per_node=4", "trainer.cluster.gpu_memory_gb=1",
         "mesh.shape={data: 2, fsdp: 4, tensor: 1}", "algo.group_size=4", "trainer.groups_per_step=3",
         "rollout.sglang.colocation.mode=static", "rollout.sglang.colocation.sglang_reserve_gb=0.1",
         "rollout.sglang.colocation.cuda_context_gb=0.05", "rollout.sglang.colocation.nccl_gb=0.02",
         "rollout.sglang.colocation.xla_runtime_gb=0.01", "rollout.sglang.launch.mem_fraction_static=0.3",
         "rollout.sglang.launch.context_length=512",
         "rollout.sglang.launch.servers=[{port: 30000, gpus: '0,1', tp_size: 2}, {port: 30001, gpus: '2,3', tp_size: 2}]"]


def _plan(args, tmp_path, name="plan.json"):
    out = tmp_path / name
    proc = subprocess.run([sys.executable, "-m", "jaxrl_term.plan", *args, "--json", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    return proc, (json.loads(out.read_text()) if out.exists() else None)


def _independent_peak(overrides, devices: int) -> tuple[float, tuple[int, int, int]]:
    """Compile the same step here, by hand, on the first ``devices`` of this process's 8 fake devices."""
    import dataclasses

    from omegaconf import OmegaConf

    from jaxrl_term.config import model_from_cfg
    from jaxrl_term.parallel.mesh import LogicalRules, make_mesh
    from jaxrl_term.plan import abstract_batch, compose
    from jaxrl_term.rl.batch import microbatch_layout, pick_bucket
    from jaxrl_term.rl.step import make_train_step

    cfg = compose(overrides)
    arch, opts = model_from_cfg(cfg.model)
    if opts.attention == "cudnn":  # CPU: the flash kernel of the same memory order
        opts = dataclasses.replace(opts, attention="blockwise")
    mesh = make_mesh(OmegaConf.to_container(cfg.mesh.shape), devices=jax.devices()[:devices])
    rules = LogicalRules.from_mapping(OmegaConf.to_container(cfg.mesh.rules))
    algo = OmegaConf.to_object(cfg.algo)
    ts = make_train_step(arch, algo, OmegaConf.to_object(cfg.optim), mesh, options=opts, rules=rules)
    rows = cfg.trainer.groups_per_step * cfg.algo.group_size
    m, b = microbatch_layout(rows, ts.shards, algo.microbatches)
    t = pick_bucket(cfg.agent.max_context_tokens, list(cfg.trainer.buckets))
    ma = ts._step.lower(ts.abstract_state(), abstract_batch(ts, m, b, t)).compile().memory_analysis()
    peak = (ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes + ma.temp_size_in_bytes)
    return peak / 1e9, (m, b, t)


def test_planner_on_a_cluster_shaped_preset_agrees_with_an_independent_compile(tmp_path):
    proc, plan = _plan(SMALL, tmp_path)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    text = proc.stdout
    m = re.search(r"batch \[(\d+), (\d+), (\d+)\]", text)
    assert m, text
    # 12 trajectories on 8 data-parallel shards: padded to 16 rows (the shard count), not 8 x microbatches
    assert tuple(int(x) for x in m.groups()) == (2, 8, 512) == tuple(plan["train"]["batch"])
    assert plan["train"]["devices"] == 8 and plan["train"]["attention"] == "blockwise"
    peak, shape = _independent_peak(SMALL, 8)
    assert shape == tuple(plan["train"]["batch"])
    assert plan["train"]["peak_gb"] == pytest.approx(peak, rel=0.10)
    # every term is printed; parameters and optimizer state are fully sharded over the 8 devices
    for term in ("parameters", "optimizer state", "gradient buffers", "temporaries", "peak", "headroom"):
        assert term in text
    from jaxrl_term.model.qwen3 import Qwen3Config

    tiny = Qwen3Config(vocab_size=1024, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    assert plan["train"]["params_gb"] == pytest.approx(tiny.num_params() * 4 / 8 / 1e9, rel=0.05)
    assert plan["train"]["flops"] > plan["train"]["model_flops"] > 0
    # two servers per node, each sized from mem_fraction_static of a 1 GB GPU, each serving 32 / (2 x 2)
    # concurrent episodes; KV per token per GPU = 2 (K, V) x 2 layers x 1 KV head (2 over TP 2) x 16 x 2 bytes
    servers = plan["servers"]
    assert len(servers) == 2 and all(s["concurrency"] == 8 for s in servers)
    # SGLang's KV pool: mem_fraction_static of what was free before its weights (after its CUDA context and, TP 2,
    # its NCCL buffers), less the weights
    kv = 0.3 * (1 - 0.05 - 0.02) - tiny.num_params() * 2 / 2 / 1e9
    assert all(s["kv_tokens"] == int(kv * 1e9 // 128) for s in servers)
    assert all(s["full_contexts"] == s["kv_tokens"] // 512 for s in servers)
    assert "SGLang servers" in text and ("FITS" in text or "DOES NOT FIT" in text)
    # every phase of a step, each term printed and summed
    assert [p["name"] for p in plan["phases"]] == ["update", "rollout", "weight sync"]
    for p in plan["phases"]:
        assert p["total_gb"] == pytest.approx(sum(p["terms"].values()))
        assert p["name"] in text
    assert "full contexts in KV" in text and "concurrent episodes" in text and "runtime overheads" in text


def test_planner_names_the_largest_term_when_the_step_does_not_fit(tmp_path):
    proc, plan = _plan([*SMALL, "trainer.cluster.gpu_memory_gb=0.02", "rollout.sglang.colocation.sglang_reserve_gb=0",
                        "rollout.sglang.colocation.cuda_context_gb=0", "rollout.sglang.colocation.nccl_gb=0",
                        "rollout.sglang.colocation.xla_runtime_gb=0", "--no-flops"], tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "DOES NOT FIT" in proc.stdout and "largest term" in proc.stdout
    assert not plan["fits"] and plan["reasons"]


def test_planner_refuses_a_bad_config_before_compiling(tmp_path):
    proc, _ = _plan(["+experiment=qwen3_8b_a100x2", "model.options.param_dtype=bfloat16", "--no-flops"], tmp_path)
    assert proc.returncode != 0
    assert "model.options.param_dtype" in proc.stdout + proc.stderr and "fp32 master" in proc.stdout + proc.stderr


def _colocation(overrides):
    from jaxrl_term.plan import compose
    from jaxrl_term.rollout.colocation import colocation_plan

    return colocation_plan(compose(overrides))


def test_every_phase_counts_the_runtime_overheads_no_compile_shows():
    # qwen32b_h100: time_share, TP-4 servers at mem_fraction_static 0.5 of 80 GB, 32 trainer devices
    colo = _colocation(["+experiment=qwen32b_h100"])
    update, rollout, sync = colo.phases(peak_gb=40.0, resident_gb=12.0)
    trainer = 1.0 + 1.0 + 1.0  # CUDA context, NCCL (32 devices), XLA runtime
    assert update.total_gb == pytest.approx(3.0 + 40.0 + trainer)  # a released server keeps 3 GB
    serving = 40.0 + 6.0 + 1.0 + 1.0  # static + reserve + CUDA context + NCCL (TP 4)
    assert rollout.total_gb == pytest.approx(serving + 12.0 + trainer)  # platform allocator: temporaries returned
    assert sync.total_gb == pytest.approx(serving + 12.0 + 2 * 512 * 1024**2 / 1e9 + trainer)
    assert colo.trainer_budget_gb == pytest.approx(80 - 3.0 - 2.0)


def test_static_colocation_caps_xla_at_what_the_servers_leave_without_preallocating_it():
    colo = _colocation(["+experiment=tmax_qwen3_8b"])
    serving = 0.3 * 80 + 6.0 + 1.0 + 1.0
    assert colo.xla_mem_fraction == pytest.approx((80 - serving - 2.0) / 80)
    env = colo.trainer_env()
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"  # else the device holds the whole cap, not the peak
    update, rollout, _ = colo.phases(peak_gb=30.0, resident_gb=6.0)
    assert rollout.total_gb == update.total_gb  # the BFC allocator keeps its peak between updates


def test_planner_refuses_a_phase_with_less_than_ten_percent_free_even_when_the_step_fits():
    from jaxrl_term.plan import TrainPlan, verdict

    colo = _colocation(["+experiment=qwen32b_h100", "rollout.sglang.launch.mem_fraction_static=0.7"])
    train = TrainPlan(devices=32, mesh={}, batch=(1, 32, 32768), rows=32, attention="blockwise", params_gb=4.1,
                      optimizer_gb=8.2, grad_accumulator_gb=0.0, microbatch_grads_gb=4.1, temporaries_gb=20.0,
                      peak_gb=30.0, flops=None, model_flops=1.0, compile_s=0.0)
    fits, reasons = verdict(train, colo, [])
    assert not fits  # rollout: 56 + 6 + 1 + 1 serving + 12.3 state + 3 = 79.3 of 80 GB
    assert any(r.startswith("rollout:") and "needs >= 10%" in r for r in reasons), reasons
    assert not any(r.startswith("update:") for r in reasons)

