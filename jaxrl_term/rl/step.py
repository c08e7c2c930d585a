"""The RL update: one ``jax.jit`` with explicit in/out shardings and donated state.

A batch arrives as [M, b, T] microbatches. ``lax.scan`` runs them with fp32 gradient accumulators; each
microbatch contributes the *numerator* of the aggregated loss, and the sum is divided once by the global
denominator (token count, or sequence count for sequence-level modes), computed from the masks up front.
A mean of microbatch means would weight tokens differently; this is the exact batch objective.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_term.agent.trajectory import MASK_TURNS
from jaxrl_term.model.qwen3 import ModelOptions, Qwen3, Qwen3Config
from jaxrl_term.parallel.mesh import LogicalRules, ShardingCtx, make_mesh, state_shardings
from jaxrl_term.rl.batch import Batch, from_microbatches, microbatch_layout, to_microbatches
from jaxrl_term.rl.logprobs import sequence_logprobs
from jaxrl_term.rl.losses import POLICY_LOSSES, aggregate, kl_penalty


@dataclasses.dataclass
class AlgoConfig:
    """What the update optimises (conf/algo/*.yaml)."""

    name: str = "grpo"
    loss: str = "ppo_clip"  # ppo_clip | dppo
    advantage: str = "grpo"  # grpo | drgrpo | rloo | loop
    std_ddof: int = 0
    group_size: int = 8
    # PPO / GRPO / DAPO
    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip: Optional[float] = None
    use_old_logp: bool = False  # ratio against a trainer recomputation (old_logp) instead of rollout log-probs
    recompute_old_logp: bool = False  # run a no-grad pass before the update to fill old_logp
    tis_cap: Optional[float] = None  # truncated importance sampling vs. the rollout policy (needs old_logp)
    epochs: int = 1  # optimizer passes over each batch (PPO-style; >1 needs use_old_logp)
    # DPPO
    delta: float = 0.1
    divergence: str = "binary_tv"  # binary_tv | binary_kl
    ratio_cap: Optional[float] = 10.0
    # KL to a reference policy (both seeds ran without it)
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    # aggregation and numerics
    aggregation: str = "token-mean"
    norm_len: Optional[int] = None
    temperature: float = 1.0  # the sampling temperature (the trainer sets it from rollout.temperature)
    microbatches: int = 1  # at least this many microbatches (memory); rows are padded only to the shard count
    # turns whose tokens leave the loss (the episode still counts in its group's advantages): none | malformed
    # (the reply had a parse error or was cut at the token limit: DAPO's overlong filtering, widened to broken
    # replies; their sampled tokens are mostly noise, pushing them up or down teaches the format nothing)
    mask_turns: str = "none"
    negative_weight: float = 1.0  # scale of negative advantages (0: positive only; 0.1: W-REINFORCE)
    shuffle_rewards: bool = False  # placebo control: permute each batch's rewards before the advantages

    def __post_init__(self):
        errors = self.problems()
        if errors:
            raise ValueError("; ".join(f"algo.{k}: {msg}" for k, msg in errors))

    def problems(self) -> list[tuple[str, str]]:
        """(key, what is wrong and how to fix it) for every setting that cannot run or silently does nothing."""
        from jaxrl_term.rl.advantages import ESTIMATORS
        from jaxrl_term.rl.losses import AGG_MODES

        out: list[tuple[str, str]] = []
        if self.loss not in POLICY_LOSSES:
            out.append(("loss", f"{self.loss!r} is not a registered loss; use one of {sorted(POLICY_LOSSES)}"))
        if self.advantage not in ESTIMATORS:
            out.append(("advantage", f"{self.advantage!r} is not a registered estimator; use one of "
                                     f"{sorted(ESTIMATORS)}"))
        if self.aggregation not in AGG_MODES:
            out.append(("aggregation", f"{self.aggregation!r}; use one of {AGG_MODES}"))
        if self.aggregation == "seq-mean-token-sum-norm" and not self.norm_len:
            out.append(("norm_len", "aggregation seq-mean-token-sum-norm needs a constant length; set algo.norm_len"))
        if not 0.0 <= self.negative_weight <= 1.0:
            out.append(("negative_weight", f"{self.negative_weight} must be in [0, 1] (1: advantages as estimated)"))
        if self.mask_turns not in MASK_TURNS:
            out.append(("mask_turns", f"{self.mask_turns!r}; use one of {MASK_TURNS}"))
        if self.divergence not in ("binary_tv", "binary_kl"):
            out.append(("divergence", f"{self.divergence!r}; use binary_tv or binary_kl"))
        if self.kl_estimator not in ("k1", "k2", "k3"):
            out.append(("kl_estimator", f"{self.kl_estimator!r}; use k1, k2 or k3"))
        if self.tis_cap and not self.recompute_old_logp:
            out.append(("tis_cap", "truncated importance sampling reweights by exp(old_logp - rollout_logp), and "
                                   "without algo.recompute_old_logp=true old_logp is a copy of the rollout log-probs: "
                                   "every weight is 1 (a silent no-op); set algo.recompute_old_logp=true and "
                                   "algo.use_old_logp=true, or algo.tis_cap=null"))
        if self.tis_cap and not self.use_old_logp:
            out.append(("tis_cap", "TIS needs the recomputed old policy as the ratio's base; set algo.use_old_logp=true"))
        if self.tis_cap is not None and self.tis_cap <= 0:
            out.append(("tis_cap", f"{self.tis_cap} must be > 0 (or null)"))
        if self.use_old_logp and not self.recompute_old_logp:
            out.append(("use_old_logp", "without algo.recompute_old_logp=true old_logp is a copy of the rollout "
                                        "log-probs, so this changes nothing; set recompute_old_logp=true too"))
        if self.epochs > 1 and self.loss == "ppo_clip" and not (self.use_old_logp and self.recompute_old_logp):
            out.append(("epochs", "several passes over a batch with ppo_clip need the ratio against the policy "
                                  "before the update: set algo.use_old_logp=true and algo.recompute_old_logp=true"))
        if self.epochs < 1:
            out.append(("epochs", f"{self.epochs} must be >= 1"))
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            out.append(("dual_clip", f"{self.dual_clip} must be > 1 (the lower bound -c A on the loss of A < 0 "
                                     "tokens; <= 1 would clip every negative-advantage token), or null"))
        if not self.temperature > 0:
            out.append(("temperature", f"{self.temperature}: log-probs of softmax(logits / T) are undefined at T <= 0 "
                                       "(greedy decoding has no sampling distribution to learn from); use "
                                       "rollout.temperature > 0 for training"))
        if self.group_size < 2:
            out.append(("group_size", "must be >= 2 (advantages are relative to the group)"))
        if self.microbatches < 1:
            out.append(("microbatches", f"{self.microbatches} must be >= 1"))
        return out


@dataclasses.dataclass
class OptimConfig:
    """optax.chain(clip_by_global_norm, adamw(schedule)) (conf/optim/*.yaml)."""

    lr: float = 1e-6
    schedule: str = "constant"  # constant | warmup_constant | warmup_cosine
    warmup_steps: int = 0
    total_steps: int = 1000
    end_lr_ratio: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    # fp32 master weights and AdamW moments in host memory, a compute-dtype copy on the devices (ZeRO-Offload;
    # one process): for models whose fp32 state does not fit the GPUs (rl/offload.py)
    offload: bool = False


def make_schedule(o: OptimConfig):
    if o.schedule == "constant":
        return optax.constant_schedule(o.lr)
    if o.schedule == "warmup_constant":
        return optax.join_schedules(
            [optax.linear_schedule(0.0, o.lr, max(o.warmup_steps, 1)), optax.constant_schedule(o.lr)],
            [max(o.warmup_steps, 1)],
        )
    if o.schedule == "warmup_cosine":
        return optax.warmup_cosine_decay_schedule(
            0.0, o.lr, max(o.warmup_steps, 1), max(o.total_steps, o.warmup_steps + 1), o.lr * o.end_lr_ratio
        )
    raise ValueError(f"optim.schedule={o.schedule!r}; use constant, warmup_constant or warmup_cosine")


def _decay_mask(params):
    """Weight decay on matrices only: norms (1-D per layer) are left alone."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: not str(getattr(path[-1], "key", "")).endswith("norm"), params
    )


def make_optimizer(o: OptimConfig) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(o.grad_clip),
        optax.adamw(make_schedule(o), b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=_decay_mask),
    )


@struct.dataclass
class TrainState:
    params: Any  # pure dict of arrays, master dtype (fp32 or bf16 by model.options.param_dtype)
    opt_state: Any
    step: jax.Array  # int32 scalar
    rng: jax.Array  # uint32[2] (raw key: checkpoints stay plain arrays)


# metrics averaged over fresh tokens (rows sampled by the weights being trained), not over all loss tokens
FRESH_METRICS = ("logp_gap_mean", "mismatch_kl")
COUNT_METRICS = ("fresh_tokens", "signal_tokens")


def finalize_metrics(sums: dict, tokens) -> dict:
    """Summed per-token metrics -> reported values: means over loss tokens, gap metrics over fresh tokens,
    ``logp_gap_max`` as is, counts as counts."""
    ntok = jnp.maximum(tokens, 1.0)
    fresh = jnp.maximum(sums.get("fresh_tokens", tokens), 1.0)
    out = {}
    for k, v in sums.items():
        if k == "logp_gap_max" or k in COUNT_METRICS:
            out[k] = v
        elif k in FRESH_METRICS:
            out[k] = v / fresh
        else:
            out[k] = v / ntok
    return out


def optimizer_count(opt_state) -> jax.Array:
    """The schedule's step: optax's own count (it does not advance on skipped updates), not ``TrainState.step``."""
    for path, value in optax.tree_utils.tree_get_all_with_path(opt_state, "count"):
        if any(getattr(k, "tuple_name", "") == "ScaleByScheduleState" for k in path):
            return value
    return optax.tree_utils.tree_get(opt_state, "count")


METRIC_SUMS = ("logp_gap_mean", "entropy", "clip_frac", "masked_frac", "ratio", "tis_weight", "kl")


@dataclasses.dataclass
class TrainStep:
    """The compiled update and its helpers for one (model, algo, optim, mesh) combination."""

    model_cfg: Qwen3Config
    options: ModelOptions
    algo: AlgoConfig
    optim: OptimConfig
    mesh: jax.sharding.Mesh
    rules: LogicalRules
    graphdef: Any
    optimizer: optax.GradientTransformation
    param_shardings: Any
    state_shardings: TrainState
    batch_sharding: NamedSharding
    _step: Any = None
    _logprobs: Any = None
    _grad_step: Any = None

    # -- state ------------------------------------------------------------------------------------
    def init_state(self, params, seed: int = 0) -> TrainState:
        """TrainState from a pure dict of params (any placement), placed with the state shardings."""
        params = jax.device_put(params, self.param_shardings)

        def init(p):
            return TrainState(p, self.optimizer.init(p), jnp.zeros((), jnp.int32), jax.random.PRNGKey(seed))

        return jax.jit(init, out_shardings=self.state_shardings)(params)

    def abstract_state(self) -> TrainState:
        """ShapeDtypeStructs with shardings: the restore target for checkpoints (any mesh)."""
        shapes = jax.eval_shape(lambda: self._abstract_init())
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes,
                            self.state_shardings)

    def _abstract_init(self):
        params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), _abstract_params(self)[1])
        return TrainState(params, self.optimizer.init(params), jnp.zeros((), jnp.int32), jax.random.PRNGKey(0))

    def grad_bytes_per_device(self) -> float:
        """Bytes of one microbatch's gradients on one device (sharded like the parameters, param dtype)."""
        total = 0
        for s, sh in zip(jax.tree.leaves(_abstract_params(self)[1]), jax.tree.leaves(self.param_shardings)):
            total += int(np.prod(sh.shard_shape(s.shape))) * np.dtype(s.dtype).itemsize
        return float(total)

    def model(self, params) -> Qwen3:
        return nnx.merge(self.graphdef, params)

    # -- batches ----------------------------------------------------------------------------------
    @property
    def shards(self) -> int:
        """Data-parallel shards: the batch's rows are split over data x fsdp."""
        return self.mesh.shape["data"] * self.mesh.shape["fsdp"]

    def layout(self, rows: int) -> tuple[int, int]:
        """(M, b) for a batch of ``rows`` rows (a multiple of ``shards``): see ``rl.batch.microbatch_layout``."""
        return microbatch_layout(rows, self.shards, self.algo.microbatches)

    def place_batch(self, batch: Batch) -> Batch:
        rows = batch.tokens.shape[0]
        if rows % self.shards:
            raise ValueError(
                f"{rows} rows do not divide over {self.shards} data-parallel shards; "
                f"build the batch with row_multiple={self.shards}"
            )
        mb = to_microbatches(batch, self.layout(rows)[0])
        # every process holds the whole batch: each device takes its slice (multi-host safe)
        return jax.tree.map(lambda x: jax.make_array_from_callback(x.shape, self.batch_sharding,
                                                                   lambda idx, x=x: x[idx]), mb)

    # -- calls ------------------------------------------------------------------------------------
    def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, float]]:
        """One optimizer update on ``batch`` ([B, T], host). Donates ``state``."""
        new_state, metrics = self._step(state, self.place_batch(batch))
        return new_state, {k: float(v) for k, v in jax.device_get(metrics).items()}

    def update(self, state: TrainState, batch: Batch, ref_params=None) -> tuple[TrainState, list[dict[str, float]]]:
        """The whole update for one batch: the optional old-policy pass (``algo.recompute_old_logp``), the
        optional reference pass (``algo.kl_coef > 0``, ``ref_params``), then ``algo.epochs`` steps.
        Returns the new state and one metrics dict per step."""
        if self.algo.recompute_old_logp:
            batch = batch.replace(old_logp=self.logprobs(state.params, batch)[0])
        if self.algo.kl_coef:
            if ref_params is None:
                raise ValueError("algo.kl_coef > 0 needs the reference policy's params (ref_params)")
            batch = batch.replace(ref_logp=self.logprobs(ref_params, batch)[0])
        history = []
        for _ in range(self.algo.epochs):
            state, metrics = self(state, batch)
            history.append(metrics)
        return state, history

    def logprobs(self, params, batch: Batch) -> tuple[np.ndarray, np.ndarray]:
        """No-grad (logp, entropy) [B, T] under ``params`` (old-policy or reference pass)."""
        lp, ent = self._logprobs(params, self.place_batch(batch))
        return from_microbatches(jax.device_get(lp)), from_microbatches(jax.device_get(ent))


def _abstract_params(ts_or_cfg):
    cfg, opts, shard = ts_or_cfg.model_cfg, ts_or_cfg.options, ShardingCtx(ts_or_cfg.mesh, ts_or_cfg.rules)
    abstract = nnx.eval_shape(lambda: Qwen3(cfg, opts, rngs=nnx.Rngs(0), shard=shard))
    graphdef, state = nnx.split(abstract)
    return graphdef, nnx.to_pure_dict(state), state


def make_train_step(
    model_cfg: Qwen3Config,
    algo_cfg: AlgoConfig,
    optim_cfg: OptimConfig,
    mesh: jax.sharding.Mesh | None = None,
    *,
    options: ModelOptions | None = None,
    rules: LogicalRules | None = None,
) -> TrainStep:
    """Build the jitted update for a model architecture on a mesh (a one-device mesh when None)."""
    options = options or ModelOptions()
    rules = rules or LogicalRules.from_mapping()
    if mesh is None:
        mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
    shard = ShardingCtx(mesh, rules)
    ts = TrainStep(model_cfg, options, algo_cfg, optim_cfg, mesh, rules, None, make_optimizer(optim_cfg),
                   None, None, shard.named((None, "batch", None)))
    graphdef, abstract_params, abstract_state = _abstract_params(ts)
    ts.graphdef = graphdef
    ts.param_shardings = nnx.to_pure_dict(state_shardings(abstract_state, shard))
    replicated = NamedSharding(mesh, P())
    abstract_opt = jax.eval_shape(ts.optimizer.init, abstract_params)
    opt_shardings = optax.tree_map_params(
        ts.optimizer, lambda _, s: s, abstract_opt, ts.param_shardings, transform_non_params=lambda _: replicated
    )
    ts.state_shardings = TrainState(ts.param_shardings, opt_shardings, replicated, replicated)
    batch_sh = jax.tree.map(lambda _: ts.batch_sharding, Batch(*([0] * len(dataclasses.fields(Batch)))))
    loss_fn = POLICY_LOSSES[algo_cfg.loss]
    algo = algo_cfg
    schedule = make_schedule(optim_cfg)
    needs_signal = algo.loss != "nll" and not algo.kl_coef

    def forward(params, x: Batch):
        model = nnx.merge(graphdef, params)
        attn = (x.segment_ids > 0).astype(jnp.int32)
        return sequence_logprobs(model, x.tokens, attn, x.positions, x.segment_ids,
                                 temperature=algo.temperature, chunk=options.logits_chunk or None)

    def numerator(params, x: Batch):
        logp, ent = forward(params, x)
        inputs = dict(logp=logp, entropy=ent, rollout_logp=x.rollout_logp, old_logp=x.old_logp,
                      advantages=x.advantages, loss_mask=x.loss_mask, fresh=x.fresh)
        per_tok, metrics = loss_fn(inputs, algo)
        # tokens that carry a learning signal: a non-zero advantage (the nll warm-start loss and a KL term
        # have a gradient without one)
        metrics["signal_tokens"] = (x.advantages != 0) * x.loss_mask
        if algo.kl_coef:
            kl = kl_penalty(logp, x.ref_logp, algo.kl_estimator) * x.loss_mask
            per_tok = per_tok + algo.kl_coef * kl
            metrics["kl"] = kl
        num, _ = aggregate(per_tok, x.loss_mask, algo.aggregation, segment_ids=x.segment_ids, norm_len=algo.norm_len)
        sums = {k: (v.max() if k == "logp_gap_max" else v.sum()) for k, v in metrics.items()}
        return num, sums

    def denominator(x: Batch):
        mask = x.loss_mask
        return aggregate(jnp.zeros_like(mask), mask, algo.aggregation, segment_ids=x.segment_ids,
                         norm_len=algo.norm_len)[1]

    def gradients(params, mb: Batch):
        """The batch gradient (fp32) of numerator / global denominator, whether it can be applied (``ok``: some
        loss tokens and a finite norm), and the step's metrics except the learning rate.

        The denominator is known before any backward pass (it only reads the masks), so each microbatch's
        numerator is divided by it up front: the accumulated gradient is already the batch gradient, with no
        separate model-sized division pass.
        """
        denom = jax.vmap(denominator)(mb).sum()
        tokens = mb.loss_mask.sum()
        safe_denom = jnp.maximum(denom, 1e-8)

        def scaled(p, x):
            num, sums = numerator(p, x)
            return num / safe_denom, (num, sums)

        grad_fn = jax.value_and_grad(scaled, has_aux=True)

        def micro(carry, x):
            grads, num_acc, m_acc = carry
            (_, (num, sums)), g = grad_fn(params, x)
            grads = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g)
            m_acc = {k: (jnp.maximum(m_acc[k], v) if k == "logp_gap_max" else m_acc[k] + v) for k, v in sums.items()}
            return (grads, num_acc + num, m_acc), None

        if mb.tokens.shape[0] == 1:  # one microbatch: its gradient is the batch's (no zeroed fp32 accumulator to
            # write and add into: a model-sized pass less, ~3% of the 100M CPU step)
            (_, (num, msum)), g = grad_fn(params, jax.tree.map(lambda a: a[0], mb))
            grads = jax.tree.map(lambda b: b.astype(jnp.float32), g)
        else:
            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
            _, metric_shape = jax.eval_shape(numerator, params, jax.tree.map(lambda a: a[0], mb))
            metric0 = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), metric_shape)
            (grads, num, msum), _ = jax.lax.scan(micro, (zeros, jnp.zeros((), jnp.float32), metric0), mb,
                                                 unroll=options.unroll or 1)
        grad_norm = optax.global_norm(grads)
        # Skip the update (params and optimizer state untouched: AdamW's momentum and decay would still move the
        # weights) when there is nothing to learn from: no loss token, no token with a non-zero advantage, or a
        # non-finite gradient.
        signal = msum["signal_tokens"] > 0 if needs_signal else jnp.bool_(True)
        ok = (denom > 0) & jnp.isfinite(grad_norm) & signal
        metrics = finalize_metrics(msum, tokens)
        metrics.update(loss=num / safe_denom, grad_norm=grad_norm, tokens=tokens,
                       skipped=1.0 - ok.astype(jnp.float32), no_signal=1.0 - signal.astype(jnp.float32),
                       denominator=denom)
        return grads, ok, metrics

    def apply(params, opt_state, grads):
        updates, new_opt = ts.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_opt

    def train_step(state: TrainState, mb: Batch):
        grads, ok, metrics = gradients(state.params, mb)
        # A skipped update leaves params and optimizer state bit-identical. lax.cond rather than
        # where(ok, new, old): with `where` the old buffers must outlive the new ones, so XLA copies every
        # donated parameter and moment (three model-sized copies per device); the cond updates them in place.
        out = jax.eval_shape(apply, state.params, state.opt_state, grads)  # optax may promote moment dtypes

        def keep(p, o, g):
            return jax.tree.map(lambda x, s: x.astype(s.dtype), (p, o), out)

        params, opt_state = jax.lax.cond(ok, apply, keep, state.params, state.opt_state, grads)
        key, _ = jax.random.split(state.rng)
        metrics["lr"] = schedule(optimizer_count(state.opt_state))  # optax's count: it skips skipped steps
        return TrainState(params, opt_state, state.step + 1, key), metrics

    # The gradient alone (for an optimizer that lives elsewhere, e.g. on the host): grads sharded like the
    # parameters, in fp32; apply them only when ``ok``.
    grad_shardings = ts.param_shardings
    ts._grad_step = jax.jit(gradients, in_shardings=(ts.param_shardings, batch_sh),
                            out_shardings=(grad_shardings, replicated, replicated))

    ts._step = jax.jit(
        train_step,
        in_shardings=(ts.state_shardings, batch_sh),
        out_shardings=(ts.state_shardings, replicated),
        donate_argnums=(0,),
    )

    def logprob_pass(params, mb: Batch):
        return jax.lax.map(lambda x: forward(params, x), mb)

    ts._logprobs = jax.jit(logprob_pass, in_shardings=(ts.param_shardings, batch_sh),
                           out_shardings=(ts.batch_sharding, ts.batch_sharding))
    return ts
