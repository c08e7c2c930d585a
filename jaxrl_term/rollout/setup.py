"""Rollout engines from config: the embedded JAX engine, or SGLang servers (launched here or given by URL).

Multi-host runs launch each node's servers from that node's trainer process, *before* the trainer touches a
GPU (SGLang sizes its KV cache from the memory free when it starts: ``rollout.colocation``); every process
publishes its servers' advertised URLs and process 0, the only one that sends requests, gets them all. With more
than one server in all (``rollout.sglang.router=auto``), process 0 then starts ``sglang-router`` in front of
them (``rollout.router``); the engine owns it and stops it when closed.
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
    from jaxrl_term.config import model_overrides
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
        weight_version=str(weight_version), rope_scaling=model_overrides(cfg.model).get("rope_scaling"))
    launcher.start()
    log.info("launched %d SGLang server(s): %s", len(la.servers), ", ".join(launcher.urls))
    return launcher


def make_router(cfg, urls: list[str]):
    """``rollout.sglang.router``: the router URL to send ``/generate`` to, a started ``SGLangRouter`` in front of
    ``urls``, or None (the client's own per-episode affinity)."""
    s = cfg.rollout.sglang
    mode = str(s.router).lower()
    if mode == "false" or (mode == "auto" and not s.router_url and len(urls) < 2):
        return None
    if s.router_url:
        return s.router_url
    import importlib.util

    from jaxrl_term.rollout.router import SGLangRouter

    r = s.router_launch
    if r.python is None and importlib.util.find_spec("sglang_router") is None:
        raise ValueError(f"rollout.sglang.router={s.router} routes the {len(urls)} servers through sglang-router, "
                         "which is not installed here: pip install 'sglang-router>=0.3.2,<0.4' (or set "
                         "rollout.sglang.router_launch.python to an interpreter that has it), or set "
                         "rollout.sglang.router=false (the client keeps each episode on one server itself)")
    router = SGLangRouter(urls, python=r.python, module=r.module, host=r.host, port=r.port, policy=r.policy,
                          assignment_mode=r.assignment_mode, health_check_endpoint=r.health_check_endpoint,
                          health_check_interval_s=r.health_check_interval_s,
                          health_failure_threshold=r.health_failure_threshold, request_timeout_s=s.request_timeout_s,
                          startup_timeout_s=r.ready_timeout_s, log_level=r.log_level, extra_args=list(r.extra_args),
                          log_dir=str(Path(cfg.run_dir) / "sglang"))
    router.start()
    return router


def make_sglang_engine(cfg, urls: list[str], weight_version: int | None = None):
    """The SGLang client over ``urls`` (every server), through sglang-router when ``make_router`` says so."""
    from jaxrl_term.rollout.sglang import SGLangEngine

    s = cfg.rollout.sglang
    if not urls:
        raise ValueError("rollout.sglang.urls is empty and the launcher is off: nothing to send requests to")
    router = make_router(cfg, urls)
    try:
        return SGLangEngine(urls, router=router, request_timeout_s=s.request_timeout_s, max_retries=s.max_retries,
                            backoff_s=s.backoff_s, pause_mode=s.pause_mode,
                            context_length=s.context_length or (s.launch.context_length if s.launch.enabled else None),
                            abort_retries=s.abort_retries, idle_timeout_s=s.idle_timeout_s,
                            weight_version=weight_version)
    except BaseException:
        if router is not None and not isinstance(router, str):
            router.stop()
        raise


def make_jax_engine(cfg, model, tokenizer, weight_version: int):
    from jaxrl_term.rollout.jax_engine import JaxEngine, JaxEngineConfig

    j = cfg.rollout.jax
    return JaxEngine(model, tokenizer,
                     JaxEngineConfig(max_batch=j.max_batch, max_seq_len=j.max_seq_len, prefill_chunk=j.prefill_chunk,
                                     param_dtype=j.param_dtype, prefix_reuse=j.prefix_reuse,
                                     decode_steps=j.decode_steps, matmul_dtype=j.matmul_dtype,
                                     deterministic=cfg.trainer.deterministic_engine),
                     weight_version=weight_version)
