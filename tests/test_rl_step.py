"""The jitted update: exact gradient accumulation, sharding, a real learning signal, bad input."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_term.model.qwen3 import ModelOptions, Qwen3Config, create_model
from jaxrl_term.parallel.mesh import make_mesh
from jaxrl_term.rl.batch import BatchError, Sample, make_batch, to_microbatches
from jaxrl_term.rl.losses import ppo_clip_loss
from jaxrl_term.rl.step import AlgoConfig, OptimConfig, make_train_step

CFG = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)
OPTIM = OptimConfig(lr=1e-3, weight_decay=0.0, grad_clip=1e9)
# Adam with eps >> |g| makes the first update -lr * g / (|g| + eps) ~ -lr * g: linear in the gradient, so
# comparing updates compares gradients (plain Adam's first step is ~ sign(g), which amplifies fp32 noise).
LINEAR = OptimConfig(lr=1.0, eps=1.0, weight_decay=0.0, grad_clip=1e9)


def params0(seed=0):
    return nnx.to_pure_dict(nnx.state(create_model(CFG, seed=seed), nnx.Param))


def samples(n=8, seed=0):
    """Uneven prompt and response lengths, so microbatches hold different token counts."""
    rng = np.random.RandomState(seed)
    out = []
    for i in range(n):
        p, r = rng.randint(2, 6), rng.randint(1, 20)
        toks = rng.randint(0, CFG.vocab_size, p + r)
        mask = [0] * p + [1] * r
        lp = np.where(np.array(mask) > 0, np.log(rng.uniform(0.05, 0.9, p + r)), 0.0)
        out.append(Sample(toks.tolist(), mask, lp.tolist(), float(rng.randn())))
    return out


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def run_step(algo, batch, mesh=None, params=None, optim=OPTIM):
    ts = make_train_step(CFG, algo, optim, mesh)
    state = ts.init_state(params if params is not None else params0())
    return ts, *ts(state, batch)


@pytest.mark.parametrize("loss", ["ppo_clip", "dppo"])
def test_one_two_four_microbatches_give_the_same_update(loss):
    batch = make_batch(samples(), buckets=(32,), row_multiple=4)
    results = []
    p0 = leaves(params0())
    for m in (1, 2, 4):
        algo = AlgoConfig(loss=loss, microbatches=m)
        _, state, metrics = run_step(algo, batch, optim=LINEAR)
        results.append(([b - a for a, b in zip(p0, leaves(state.params))], metrics))
    counts = to_microbatches(batch, 4).loss_mask.sum(axis=(1, 2))
    assert len(set(counts.tolist())) > 1  # uneven token counts per microbatch
    for params, metrics in results[1:]:
        assert metrics["loss"] == pytest.approx(results[0][1]["loss"], rel=1e-5, abs=1e-7)
        assert metrics["grad_norm"] == pytest.approx(results[0][1]["grad_norm"], rel=1e-5)
        for a, b in zip(results[0][0], params, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-8)  # atol: a few fp32 ulps of the params


def test_mean_of_microbatch_means_is_a_different_objective():
    batch = make_batch(samples(), buckets=(32,), row_multiple=4)
    algo = AlgoConfig(microbatches=4)
    ts = make_train_step(CFG, algo, OPTIM)
    params = jax.device_put(params0(), ts.param_shardings)
    mb = to_microbatches(batch, 4)

    def per_token(p, x):
        logp, _ = ts._logprobs(p, jax.device_put(jax.tree.map(lambda a: a[None], x), ts.batch_sharding))
        return ppo_clip_loss(logp[0], x.old_logp, x.advantages, x.loss_mask, algo.eps_low, algo.eps_high)

    xs = [jax.tree.map(lambda a, i=i: a[i], mb) for i in range(4)]
    global_mean = sum(float(per_token(params, x).sum()) for x in xs) / float(mb.loss_mask.sum())
    mean_of_means = np.mean([float(per_token(params, x).sum()) / float(x.loss_mask.sum()) for x in xs])
    _, metrics = ts(ts.init_state(params0()), batch)
    assert metrics["loss"] == pytest.approx(global_mean, rel=1e-5)
    assert abs(mean_of_means - global_mean) > 1e-3 * abs(global_mean) + 1e-4


@pytest.mark.parametrize("shape", [(8, 1, 1), (2, 2, 2)])
def test_sharded_step_equals_single_device_step(shape):
    batch = make_batch(samples(16, seed=1), buckets=(32,), row_multiple=16)
    algo = AlgoConfig(microbatches=2)
    p0 = leaves(params0())
    _, ref_state, ref_metrics = run_step(algo, batch, optim=LINEAR)
    mesh = make_mesh(dict(zip(("data", "fsdp", "tensor"), shape)))
    ts, state, metrics = run_step(algo, batch, mesh, optim=LINEAR)
    assert metrics["loss"] == pytest.approx(ref_metrics["loss"], rel=1e-5)
    for p, a, b in zip(p0, leaves(ref_state.params), leaves(state.params), strict=True):
        np.testing.assert_allclose(b - p, a - p, rtol=1e-4, atol=1e-8)  # atol: a few fp32 ulps of the params
    # shardings: parameters follow the rules table (fully sharded over data x fsdp), Adam moments follow them
    q = state.params["layers"]["q_proj"]
    assert q.sharding.is_equivalent_to(NamedSharding(mesh, P(None, ("data", "fsdp"), "tensor", None)), 4)
    mu = state.opt_state[1][0].mu["layers"]["q_proj"]
    assert mu.sharding.is_equivalent_to(q.sharding, 4)
    emb = state.params["embed_tokens"]
    assert emb.sharding.is_equivalent_to(NamedSharding(mesh, P("tensor", ("data", "fsdp"))), 2)
    assert state.step.sharding.is_fully_replicated


@pytest.mark.parametrize("loss", ["ppo_clip", "dppo"])
def test_positive_advantage_raises_the_chosen_tokens_log_prob(loss):
    rng = np.random.RandomState(7)
    prompt = rng.randint(0, CFG.vocab_size, 4).tolist()
    chosen = rng.randint(0, CFG.vocab_size, 6).tolist()
    tokens, mask = prompt + chosen, [0] * 4 + [1] * 6
    algo = AlgoConfig(loss=loss, eps_high=10.0, delta=1.0)  # trust region wide open: pure signal
    ts = make_train_step(CFG, algo, OptimConfig(lr=3e-3, weight_decay=0.0))
    state = ts.init_state(params0())
    probe = make_batch([Sample(tokens, mask, [0.0] * 10, 1.0)], buckets=(16,))
    lp0 = ts.logprobs(state.params, probe)[0][0, 4:10]
    batch = make_batch([Sample(tokens, mask, [0.0] * 4 + lp0.tolist(), 1.0)] * 2, buckets=(16,))
    losses, chosen_lp = [], [lp0.sum()]
    for _ in range(6):
        state, metrics = ts(state, batch)
        losses.append(metrics["loss"])
        chosen_lp.append(ts.logprobs(state.params, probe)[0][0, 4:10].sum())
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert all(b > a for a, b in zip(chosen_lp, chosen_lp[1:])), chosen_lp
    assert chosen_lp[-1] - chosen_lp[0] > 1.0


def test_all_masked_batch_skips_the_update_and_keeps_params_finite():
    s = [Sample([1, 2, 3], [0, 0, 0], [0.0] * 3, 1.0)] * 2
    batch = make_batch(s, buckets=(8,))
    _, state, metrics = run_step(AlgoConfig(), batch)
    assert metrics["skipped"] == 1.0 and metrics["tokens"] == 0 and np.isfinite(metrics["loss"])
    for a, b in zip(leaves(params0()), leaves(state.params)):
        np.testing.assert_array_equal(a, b)


def test_non_finite_gradient_skips_the_update():
    s = [Sample([1, 2, 3, 4], [0, 1, 1, 1], [0.0, -1.0, -1.0, -1.0], 3e38)] * 2
    batch = make_batch(s, buckets=(8,))
    _, state, metrics = run_step(AlgoConfig(loss="dppo"), batch)
    assert metrics["skipped"] == 1.0
    assert all(np.isfinite(x).all() for x in leaves(state.params))


def test_bad_samples_are_refused_with_their_index():
    good = Sample([1, 2, 3], [0, 1, 1], [0.0, -0.5, -0.2], 0.5)
    with pytest.raises(BatchError, match=r"sample 1: tokens \(3\), loss_mask \(2\)"):
        make_batch([good, Sample([1, 2, 3], [0, 1], [0.0, -1.0, -1.0], 1.0)])
    with pytest.raises(BatchError, match="sample 0: advantage is nan"):
        make_batch([dataclasses.replace(good, advantage=float("nan"))])
    with pytest.raises(BatchError, match="rollout_logprobs"):
        make_batch([dataclasses.replace(good, rollout_logprobs=[0.0, float("nan"), -1.0])])
    with pytest.raises(BatchError, match="longer than the largest length bucket"):
        make_batch([good], buckets=(2,))
    with pytest.raises(BatchError, match="loss_mask\\[0\\] is 1"):
        make_batch([dataclasses.replace(good, loss_mask=[1, 1, 1])])
    with pytest.raises(BatchError, match="vocab_size"):
        make_batch([dataclasses.replace(good, tokens=[1, 2, 999])], vocab_size=128)
    with pytest.raises(ValueError, match="not a registered loss"):
        AlgoConfig(loss="reinforce++")


def test_packing_gives_the_same_update_as_padding():
    s = samples(6, seed=3)
    padded = make_batch(s, buckets=(32,), row_multiple=1)
    packed = make_batch(s, buckets=(32, 64), pack=True, pack_len=64)
    assert packed.tokens.shape[0] < padded.tokens.shape[0]
    assert packed.segment_ids.max() > 1
    p0 = leaves(params0())
    _, a, ma = run_step(AlgoConfig(), padded, optim=LINEAR)
    _, b, mb = run_step(AlgoConfig(), packed, optim=LINEAR)
    assert ma["loss"] == pytest.approx(mb["loss"], rel=1e-5)
    for p, x, y in zip(p0, leaves(a.params), leaves(b.params)):
        np.testing.assert_allclose(y - p, x - p, rtol=1e-4, atol=1e-8)  # atol: a few fp32 ulps of the params


def test_buckets_bound_the_number_of_shapes():
    shapes = {make_batch(samples(8, seed=k), buckets=(16, 32, 64), row_multiple=8).tokens.shape for k in range(20)}
    assert shapes <= {(8, 16), (8, 32), (8, 64)}


def test_bf16_params_and_compute_update_stays_finite():
    opts = ModelOptions(param_dtype="bfloat16", compute_dtype="bfloat16")
    ts = make_train_step(CFG, AlgoConfig(), OPTIM, options=opts)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params0())
    state = ts.init_state(params)
    state, metrics = ts(state, make_batch(samples(), buckets=(32,)))
    assert state.params["layers"]["q_proj"].dtype == jnp.bfloat16
    assert np.isfinite(metrics["loss"]) and metrics["skipped"] == 0.0


def test_old_policy_pass_and_epochs_start_on_policy():
    algo = AlgoConfig(use_old_logp=True, recompute_old_logp=True, epochs=3, eps_high=0.28)
    ts = make_train_step(CFG, algo, OptimConfig(lr=1e-2, weight_decay=0.0))
    state = ts.init_state(params0())
    state, history = ts.update(state, make_batch(samples(), buckets=(32,)))
    assert len(history) == 3 and int(state.step) == 3
    assert history[0]["ratio"] == pytest.approx(1.0, abs=1e-5) and history[0]["clip_frac"] == 0.0
    assert abs(history[-1]["ratio"] - 1.0) > 1e-3  # later epochs are off-policy against the same old_logp


def test_reference_pass_feeds_the_kl_term():
    algo = AlgoConfig(kl_coef=0.1, kl_estimator="k3")
    ts = make_train_step(CFG, algo, OptimConfig(lr=1e-2, weight_decay=0.0))
    ref = params0()
    state = ts.init_state(params0())
    batch = make_batch(samples(), buckets=(32,))
    state, h1 = ts.update(state, batch, ref_params=ref)
    state, h2 = ts.update(state, batch, ref_params=ref)
    assert h1[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference at the first step
    assert h2[0]["kl"] > 1e-6
    with pytest.raises(ValueError, match="ref_params"):
        ts.update(state, batch)


def test_speed_options_give_the_same_loss_and_gradients():
    """The CPU speed options of experiments/results/train_step.md change no number: the layers' matmuls on merged
    [B*T] tokens (model.options.flat_matmuls) and the layer loop unrolled (model.options.scan_layers=false), alone
    and together, and with our blockwise attention as the CPU presets run it, equal the plain step ([B, T]
    einsums, lax.scan over layers, dense attention): loss and every gradient to fp32 tolerance, on a tiny config
    with GQA, padding and two microbatches."""
    import jax
    import numpy as np
    from flax import nnx

    from jaxrl_term.model.qwen3 import ModelOptions, Qwen3, Qwen3Config
    from jaxrl_term.rl.batch import Batch
    from jaxrl_term.rl.step import AlgoConfig, OptimConfig, make_train_step

    cfg = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
    rng = np.random.RandomState(3)
    b, t = 4, 24
    seg = np.ones((b, t), np.int32)
    seg[1, 17:] = 0  # a padded row
    mask = (rng.rand(b, t) > 0.3).astype(np.float32) * (seg > 0)
    batch = Batch(tokens=rng.randint(0, 96, (b, t)).astype(np.int32),
                  positions=np.tile(np.arange(t, dtype=np.int32), (b, 1)), segment_ids=seg, loss_mask=mask,
                  advantages=np.repeat(rng.randn(b, 1), t, 1).astype(np.float32),
                  rollout_logp=(np.log(rng.uniform(0.05, 0.5, (b, t))) * mask).astype(np.float32),
                  old_logp=np.zeros((b, t), np.float32), ref_logp=np.zeros((b, t), np.float32),
                  fresh=np.ones((b, t), np.float32))
    out, loops = {}, {}
    for flat, scan, attention in ((False, True, "dot_product_attention"), (True, True, "dot_product_attention"),
                                  (False, False, "dot_product_attention"), (True, False, "dot_product_attention"),
                                  (True, False, "blockwise")):
        opts = ModelOptions(flat_matmuls=flat, scan_layers=scan, attention=attention, attention_block=8)
        ts = make_train_step(cfg, AlgoConfig(microbatches=2), OptimConfig(lr=1e-3), options=opts)
        params = nnx.to_pure_dict(nnx.state(Qwen3(cfg, opts, rngs=nnx.Rngs(0)), nnx.Param))
        grads, ok, metrics = ts._grad_step(params, ts.place_batch(batch))
        out[flat, scan, attention] = (jax.device_get(grads), float(metrics["loss"]), bool(ok))
        hlo = ts._grad_step.lower(params, ts.place_batch(batch)).as_text()
        loops[flat, scan, attention] = hlo.count("stablehlo.while")
    # the layer loop really is unrolled: only the microbatch loop is left (forward and backward)
    d = "dot_product_attention"
    assert loops[False, False, d] == loops[True, False, d] < loops[False, True, d] == loops[True, True, d]
    ref = out[False, True, d]
    for key, (grads, loss, ok) in out.items():
        assert ok and ref[2], key
        np.testing.assert_allclose(loss, ref[1], rtol=1e-6, atol=1e-7, err_msg=str(key))
        got, want = jax.tree.leaves(grads), jax.tree.leaves(ref[0])
        assert len(got) == len(want) > 5
        for g1, g0 in zip(got, want):
            np.testing.assert_allclose(g1, g0, rtol=1e-5, atol=1e-7, err_msg=str(key))
