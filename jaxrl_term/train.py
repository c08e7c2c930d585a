"""Hydra entry point: ``python -m jaxrl_term.train [+experiment=NAME] [key=value ...]``.

Composes the config tree (``conf/``), initialises multi-host JAX when asked, builds the mesh, the
tokenizer and the policy model (from an HF directory or random init), and checks one sharded forward pass.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import hydra
from omegaconf import OmegaConf

from jaxrl_term.config import Config, model_from_cfg, register

log = logging.getLogger("jaxrl_term.train")
CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")
register()


def build_tokenizer(model_cfg, cache_dir: Path):
    from jaxrl_term.model.tokenizer import ensure_tokenizer, load_tokenizer

    spec = model_cfg.tokenizer
    if spec in ("tiny", "qwen3"):
        path = ensure_tokenizer(spec, cache_dir / f"tokenizer-{spec}")
    else:
        path = Path(spec).expanduser()
    return load_tokenizer(path), path


def build_model(cfg: Config, mesh):
    from jaxrl_term.model.hf import load_pretrained
    from jaxrl_term.model.qwen3 import create_model
    from jaxrl_term.parallel.mesh import LogicalRules, ShardingCtx

    rules = LogicalRules.from_mapping(OmegaConf.to_container(cfg.mesh.rules) if cfg.mesh.rules else None)
    arch, opts = model_from_cfg(cfg.model)
    if cfg.model.path:
        return load_pretrained(
            cfg.model.path, param_dtype=opts.param_dtype, compute_dtype=opts.compute_dtype, mesh=mesh,
            rules=rules, options=opts,
        )
    return create_model(arch, opts, seed=cfg.seed, shard=ShardingCtx(mesh, rules))


def run(cfg: Config) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxrl_term.parallel.mesh import initialize_distributed, make_mesh

    d = cfg.mesh.distributed
    initialize_distributed(
        enabled=d.enabled, coordinator_address=d.coordinator_address, num_processes=d.num_processes,
        process_id=d.process_id, local_device_ids=d.local_device_ids,
        initialization_timeout_s=d.initialization_timeout_s,
    )
    mesh = make_mesh(OmegaConf.to_container(cfg.mesh.shape))
    cache_dir = Path(os.path.expanduser(cfg.cache_dir))
    tokenizer, tok_path = build_tokenizer(cfg.model, cache_dir)
    model = build_model(cfg, mesh)
    if len(tokenizer) > model.config.vocab_size:
        raise ValueError(
            f"model.vocab_size={model.config.vocab_size} is smaller than the tokenizer ({len(tokenizer)} tokens "
            f"in {tok_path}); pick a matching model/tokenizer pair"
        )
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "List the files in /app."}], tokenize=False, add_generation_prompt=True
    )
    ids = np.asarray([tokenizer(prompt, add_special_tokens=False)["input_ids"]], np.int32)
    batch = max(mesh.shape["data"] * mesh.shape["fsdp"], 1)
    ids = np.repeat(ids, batch, axis=0)
    logits = jax.jit(lambda m, x: m(x))(model, jnp.asarray(ids))
    summary = {
        "model": cfg.model.name,
        "params": int(n_params),
        "mesh": dict(mesh.shape),
        "devices": jax.device_count(),
        "tokenizer": str(tok_path),
        "prompt_tokens": int(ids.shape[1]),
        "logits_finite": bool(jnp.isfinite(logits).all()),
    }
    log.info("%s", summary)
    return summary


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def main(cfg: Config) -> None:
    logging.basicConfig(level=logging.INFO)
    run(cfg)


if __name__ == "__main__":
    main()
