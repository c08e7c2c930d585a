"""Rollout engines from config: the embedded JAX engine, or SGLang servers (launched here or given by URL).

Multi-host runs launch each node's servers from that node's trainer process, *before* the trainer touches a
GPU (SGLang sizes its KV cache from the memory free when it starts: ``rollout.colocation``); every process
publishes its servers' advertised URLs and process 0, the only one that sends requests, gets them all.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)


def launch_local_servers(cfg, run_dir: Path, *, weight_version: int = 0):
    """Start this node's SGLang servers (``rollout.sglang.launch``); None when nothing is launched here."""
    r = cfg.rollout
    if r.engine != "sglang" or not r.sglang.launch.enabled:
        return None
    from jaxrl_term.rollout.sglang import ServerSpec, SGLangLauncher

    la, co = r.sglang.launch, r.sglang.colocation
    if not la.model_path:
        raise ValueError("rollout.sglang.launch.model_path (or model.path) must name the HF model dir the servers "
                         "start from")
    launcher = SGLangLauncher(
        la.model_path, [ServerSpec(x.port, x.gpus, x.tp_size) for x in la.servers], python=la.python,
        module=la.module, host=la.host, advertise_host=la.advertise_host,
        mem_fraction_static=la.mem_fraction_static, context_length=la.context_length, extra_args=list(la.extra_args),
        log_dir=str(run_dir / "sglang"), fp32_lm_head=bool(cfg.model.options.lm_head_fp32 and la.fp32_lm_head),
        memory_saver=co.mode == "time_share", deterministic=bool(cfg.trainer.deterministic_engine),
        weight_version=str(weight_version))
    launcher.start()
    log.info("launched %d SGLang server(s): %s", len(la.servers), ", ".join(launcher.urls))
    return launcher


def make_sglang_engine(cfg, urls: list[str], weight_version: int | None = None):
    from jaxrl_term.rollout.sglang import SGLangEngine

    s = cfg.rollout.sglang
    if not urls:
        raise ValueError("rollout.sglang.urls is empty and the launcher is off: nothing to send requests to")
    return SGLangEngine(urls, router=s.router, request_timeout_s=s.request_timeout_s, max_retries=s.max_retries,
                        backoff_s=s.backoff_s, pause_mode=s.pause_mode,
                        context_length=s.context_length or (s.launch.context_length if s.launch.enabled else None),
                        abort_retries=s.abort_retries, idle_timeout_s=s.idle_timeout_s, weight_version=weight_version)


def make_jax_engine(cfg, model, tokenizer, weight_version: int):
    from jaxrl_term.rollout.jax_engine import JaxEngine, JaxEngineConfig

    j = cfg.rollout.jax
    return JaxEngine(model, tokenizer,
                     JaxEngineConfig(max_batch=j.max_batch, max_seq_len=j.max_seq_len, prefill_chunk=j.prefill_chunk,
                                     param_dtype=j.param_dtype, prefix_reuse=j.prefix_reuse,
                                     decode_steps=j.decode_steps, matmul_dtype=j.matmul_dtype,
                                     deterministic=cfg.trainer.deterministic_engine),
                     weight_version=weight_version)
