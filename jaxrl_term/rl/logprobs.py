"""Per-token log-probs and entropies in fp32 through the model's chunked fp32 LM head.

Arrays are aligned with the token they score: ``logp[b, t] = log p(tokens[b, t] | tokens[b, :t])``, and
position 0 (no context) is 0. Only [B, chunk, V] logits exist at a time (``model.lm_head_map``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def logprob_and_entropy(logits: jax.Array, targets: jax.Array, temperature: float = 1.0):
    """logits [B, C, V] -> (log p(targets) [B, C] fp32, entropy [B, C] fp32) of softmax(logits / temperature)."""
    z = logits.astype(jnp.float32) / temperature
    logz = jax.nn.logsumexp(z, axis=-1)
    tgt = jnp.take_along_axis(z, targets[..., None], axis=-1)[..., 0]
    p = jnp.exp(z - logz[..., None])
    entropy = logz - jnp.sum(p * z, axis=-1)
    return tgt - logz, entropy


def token_logprobs(model, hidden: jax.Array, tokens: jax.Array, *, temperature: float = 1.0, chunk: int | None = None):
    """hidden [B, T, H] (from ``model.hidden_states(tokens, ...)``), tokens [B, T] -> (logp, entropy) [B, T] fp32.

    The hidden state at t-1 scores token t; column 0 is 0 for both outputs.
    """
    targets = tokens[:, 1:]

    def fn(logits, tgt):
        return logprob_and_entropy(logits, tgt, temperature)

    lp, ent = model.lm_head_map(hidden[:, :-1], fn, targets, chunk=chunk)
    pad = ((0, 0), (1, 0))
    return jnp.pad(lp, pad), jnp.pad(ent, pad)


def sequence_logprobs(
    model,
    tokens: jax.Array,
    attention_mask: jax.Array,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    *,
    temperature: float = 1.0,
    chunk: int | None = None,
):
    """Forward + log-probs in one call: tokens [B, T] -> (logp, entropy) [B, T] fp32.

    With packing (``segment_ids``), the first token of every segment has no context in its own segment;
    its log-prob is meaningless and must be masked by the caller (the batcher's loss mask never covers it).
    """
    hidden = model.hidden_states(tokens, attention_mask, positions, segment_ids)
    return token_logprobs(model, hidden, tokens, temperature=temperature, chunk=chunk)
