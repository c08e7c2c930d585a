"""Evaluation from config: the policy (``policy.*``), its engine, the tasks (``data.*``), the evaluator.

Also the held-out evaluation the trainer runs every ``trainer.eval_every`` steps (``held_out``): the same
evaluator with the trainer's live engine on ``eval.data``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from omegaconf import OmegaConf

from jaxrl_term.eval.core import HARNESS, POLICIES, EvalSettings, Evaluator
from jaxrl_term.rollout.engine import EngineError

log = logging.getLogger("jaxrl_term.eval")


# ------------------------------------------------------------------------------------------- checkpoints


def is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and (any(path.glob("*.safetensors"))
                                                  or (path / "model.safetensors.index.json").is_file())


def orbax_location(path: Path, step: int | None) -> tuple[Path, int | None]:
    """(checkpoints dir, step) for a training run dir, its ``checkpoints/`` dir, or one step's dir."""
    if (path / "checkpoints").is_dir():
        return path / "checkpoints", step
    if path.name.isdigit() and (path / "state").exists():
        return path.parent, int(path.name) if step is None else step
    if any(p.name.isdigit() for p in path.iterdir()):
        return path, step
    raise FileNotFoundError(f"policy.path={path}: neither an HF model dir (config.json + safetensors) nor an orbax "
                            "checkpoint (a run dir with checkpoints/, a checkpoints/ dir, or one step's dir)")


def policy_problems(cfg) -> list[tuple[str, str, str]]:
    """Config problems of an evaluation, before anything is built."""
    from jaxrl_term.config import preflight

    p = cfg.policy
    out = []
    if p.kind not in POLICIES:
        return [("policy", f"{p.kind!r}", f"use one of {POLICIES} (policy=NAME)")]
    model_keys = p.kind in HARNESS or p.kind == "openai" or p.kind == "sglang"
    for key, what, fix in preflight(cfg, training=False):
        if model_keys and key == "model.path":
            continue  # no weights are loaded here
        if p.kind in HARNESS and key.startswith(("model.", "rollout.")):
            continue
        out.append((key, what, fix))
    if p.kind == "checkpoint" and p.path:
        path = Path(os.path.expanduser(p.path))
        if not path.exists():
            out.append(("policy.path", f"{path} does not exist", "a training run dir, its checkpoints/ dir, one "
                        "step's dir, or an HF model dir"))
        elif not is_hf_dir(path):
            try:
                ckpt_dir, _ = orbax_location(path, p.step)
            except FileNotFoundError as e:
                out.append(("policy.path", str(e).removeprefix(f"policy.path={path}: "), ""))
            else:
                out += arch_problems(cfg, ckpt_dir.parent / "config.yaml")
    if p.kind == "openai":
        if not p.base_url:
            out.append(("policy.base_url", "missing", "e.g. policy.base_url=https://api.openai.com/v1"))
        if not p.model:
            out.append(("policy.model", "missing", "the model name the endpoint serves, e.g. policy.model=gpt-4.1"))
        if p.api_key_env and not os.environ.get(p.api_key_env):
            out.append(("policy.api_key_env", f"{p.api_key_env} is not set",
                        f"export {p.api_key_env}=..., or policy.api_key_env=null for a keyless server"))
        if cfg.agent.scaffold in ("qwen_tools", "tmax"):
            out.append(("agent.scaffold", f"{cfg.agent.scaffold} declares its tools through the chat template; a "
                        "chat endpoint gets the conversation as text messages", "use agent=bash or tbrl with "
                        "policy=openai"))
    if p.kind == "sglang" and not list(cfg.rollout.sglang.urls):
        out.append(("rollout.sglang.urls", "empty", "give the servers: rollout.sglang.urls=[http://host:30000]"))
    return out


ARCH_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "tie_word_embeddings")


def arch_problems(cfg, run_config: Path) -> list[tuple[str, str, str]]:
    """The checkpoint's run was trained with another architecture than ``model.*`` says (its config.yaml)."""
    import yaml

    try:
        model = (yaml.safe_load(run_config.read_text()) or {}).get("model") or {}
    except (OSError, yaml.YAMLError):
        return []
    diff = [f"model.{k}={model[k]} there, {cfg.model[k]} here" for k in ARCH_KEYS
            if k in model and model[k] != cfg.model[k]]
    if not diff:
        return []
    return [("model", f"policy.path was trained with another model ({'; '.join(diff)})",
             f"evaluate with the run's own settings: +experiment=... or model={model.get('name', '...')}")]


def apply_hf_path(cfg) -> None:
    """``policy=checkpoint policy.path=HF_DIR``: the model (and its tokenizer, when it has one) come from there."""
    p = cfg.policy
    if p.kind == "checkpoint" and p.path and is_hf_dir(Path(os.path.expanduser(p.path))):
        path = str(Path(os.path.expanduser(p.path)).resolve())
        OmegaConf.update(cfg, "model.path", path)
        if (Path(path) / "tokenizer.json").is_file():
            OmegaConf.update(cfg, "model.tokenizer", path)


def load_checkpoint(cfg):
    """(model, tokenizer, tokenizer dir, weight version) for ``policy=checkpoint``."""
    import jax
    from flax import nnx

    from jaxrl_term.parallel.mesh import LogicalRules, make_mesh
    from jaxrl_term.train import build_model, build_tokenizer
    from jaxrl_term.utils.checkpoint import Checkpointer

    mesh = make_mesh(OmegaConf.to_container(cfg.mesh.shape))
    rules = LogicalRules.from_mapping(OmegaConf.to_container(cfg.mesh.rules) if cfg.mesh.rules else None)
    tok, tok_path = build_tokenizer(cfg.model, Path(os.path.expanduser(cfg.cache_dir)))
    model = build_model(cfg, mesh, rules)
    version = 0
    p = cfg.policy
    if p.path and not is_hf_dir(Path(os.path.expanduser(p.path))):
        ckpt_dir, step = orbax_location(Path(os.path.expanduser(p.path)), p.step)
        state = nnx.state(model, nnx.Param)
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                              nnx.to_pure_dict(state))
        with Checkpointer(ckpt_dir, max_to_keep=None) as ck:
            try:
                params, version = ck.restore_params(target, step)
            except (ValueError, KeyError) as e:
                raise ValueError(f"policy.path={p.path}: the checkpoint does not fit this model config "
                                 f"({type(e).__name__}: {str(e)[:300]}); evaluate with the run's own model "
                                 "settings (its +experiment=..., or model=...)") from e
        nnx.replace_by_pure_dict(state, params)
        nnx.update(model, state)
        log.info("policy: %s step %d", ckpt_dir, version)
    if len(tok) > model.config.vocab_size:
        raise ValueError(f"model.vocab_size={model.config.vocab_size} is smaller than the tokenizer ({len(tok)})")
    return model, tok, tok_path, version


# ------------------------------------------------------------------------------------------------ run


def settings(cfg) -> EvalSettings:
    e = cfg.eval
    return EvalSettings(attempts=e.attempts, concurrency=e.concurrency, max_retries=e.max_retries, seed=e.seed,
                        progress=e.progress, attempt_deadline_s=e.attempt_deadline_s)


def sampling(cfg):
    from jaxrl_term.rollout.engine import SamplingParams

    e, r = cfg.eval, cfg.rollout
    return SamplingParams(temperature=r.temperature if e.temperature is None else e.temperature,
                          top_p=r.top_p if e.top_p is None else e.top_p, top_k=r.top_k,
                          max_new_tokens=cfg.agent.max_tokens_per_turn)


def make_evaluator(cfg, tasks, run_dir, *, policy: str, engine=None, tokenizer=None, backend: str, builder=None,
                   reward_fn=None, fingerprint: dict | None = None, extra: dict | None = None) -> Evaluator:
    agent = OmegaConf.to_object(cfg.agent)
    sb = OmegaConf.to_object(cfg.sandbox)
    return Evaluator(tasks, run_dir, policy=policy, settings=settings(cfg), engine=engine, tokenizer=tokenizer,
                     scaffold_factory=agent.scaffold_obj, sampling=sampling(cfg), limits=agent.limits(),
                     enable_thinking=agent.enable_thinking, backend=backend, builder=builder,
                     sandbox_limits=sb.limits(), scoring=cfg.reward.scoring, reward_fn=reward_fn,
                     fingerprint=fingerprint, extra=extra)


async def run_eval(cfg) -> dict:
    """``python -m jaxrl_term.eval``: evaluate ``policy`` on ``data`` into ``run_dir``; the summary."""
    from jaxrl_term.rollout.colocation import config_env
    from jaxrl_term.runtime_env import apply_env
    from jaxrl_term.tasks.dataset import load_from_config
    from jaxrl_term.train import build_tokenizer, resolve_backend, sandbox_backend

    # before a checkpoint policy touches a device (callers other than the eval entry point: datagen's pass rates)
    apply_env(config_env(cfg), who="eval")

    p = cfg.policy
    source = cfg.data.source
    tasks = load_from_config(cfg.data)
    from jaxrl_term.tasks.env import check_tasks_open

    check_tasks_open(tasks, OmegaConf.to_object(cfg.sandbox).limits(), resolve_backend(cfg.sandbox.backend))
    engine = tok = None
    fingerprint = {"source": str(source), "split": cfg.data.split if str(source).startswith("builtin") else None,
                   "scaffold": None if p.kind in HARNESS else cfg.agent.scaffold}
    version = None
    if p.kind == "checkpoint":
        from jaxrl_term.rollout.setup import make_jax_engine

        model, tok, _, version = load_checkpoint(cfg)
        engine = make_jax_engine(cfg, model, tok, version)
        fingerprint.update(path=str(p.path or cfg.model.path or f"random init (seed {cfg.seed})"), step=version)
    elif p.kind == "sglang":
        from jaxrl_term.rollout.setup import make_sglang_engine

        tok, _ = build_tokenizer(cfg.model, Path(os.path.expanduser(cfg.cache_dir)))
        engine = make_sglang_engine(cfg, list(cfg.rollout.sglang.urls))
        # before any /health_generate: a server a killed trainer left released dies on a generation, and one it
        # left resumed holds undefined weights (rollout/memory.py)
        for i, url in enumerate(engine.urls):
            st = await engine.memory.state(i)
            if st.state:
                raise EngineError(f"{url}: its weight_version says a trainer left its memory {st.state} "
                                  f"({st.version!r}); its weights are not a policy. Resume that training run, or "
                                  "restart the server from the weights to evaluate", retryable=False)
        await engine.wait_ready(cfg.rollout.sglang.launch.ready_timeout_s)
        fingerprint.update(urls=list(cfg.rollout.sglang.urls))
    elif p.kind == "openai":
        from jaxrl_term.rollout.openai_chat import OpenAIChatEngine

        tok, _ = build_tokenizer(cfg.model, Path(os.path.expanduser(cfg.cache_dir)))
        engine = OpenAIChatEngine.from_config(p, tok)
        fingerprint.update(base_url=p.base_url, model=p.model)
    backend, builder = sandbox_backend(cfg.sandbox)
    reward = OmegaConf.to_object(cfg.reward).mixer(evaluation=True) if p.kind not in HARNESS else None
    log.info("evaluating %s on %d task(s) from %s, %d attempt(s) each, %s sandboxes -> %s", p.kind, len(tasks),
             source, cfg.eval.attempts, backend, cfg.run_dir)
    ev = make_evaluator(cfg, tasks, cfg.run_dir, policy=p.kind, engine=engine, tokenizer=tok, backend=backend,
                        builder=builder, reward_fn=reward, fingerprint=fingerprint)
    try:
        ev.check()  # before the config is written over the earlier evaluation's
        Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.run_dir) / "eval_config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        summary = await ev.run()
    finally:
        if reward is not None and reward.judge is not None:
            await reward.judge.aclose()
        if engine is not None:
            if hasattr(engine, "aclose"):
                await engine.aclose()
            elif hasattr(engine, "close"):
                engine.close()
    return summary


async def held_out(cfg, tasks, run_dir: Path, *, engine, tokenizer, backend: str, builder, reward_fn, step: int,
                   policy: str = "checkpoint") -> dict:
    """The trainer's held-out evaluation of the current weights (``step`` updates applied) into ``run_dir``."""
    fingerprint = {"source": str(cfg.eval.data.source), "scaffold": cfg.agent.scaffold, "step": step}
    ev = make_evaluator(cfg, tasks, run_dir, policy=policy, engine=engine, tokenizer=tokenizer, backend=backend,
                        builder=builder, reward_fn=reward_fn, fingerprint=fingerprint, extra={"step": step})
    return await ev.run()
