"""Tiny random Qwen3 checkpoints written by transformers itself (the independent reference)."""

import socket
from pathlib import Path

import numpy as np

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


def hf_checkpoint(path: Path, *, tied: bool = False, rope_theta: float = 1e6, seed: int = 0, **overrides):
    """Save a random transformers Qwen3ForCausalLM (fp32) to ``path``; returns the torch model."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(**{**TINY, **overrides}, tie_word_embeddings=tied, rope_theta=rope_theta)
    model = Qwen3ForCausalLM(cfg).eval()
    # Random norm weights, so a transposed or swapped norm cannot hide behind all-ones.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(str(path))
    return model


def padded_batch(vocab: int, seed: int = 0):
    """ids [3, 12]: one full row, one right-padded, one left-padded; mask and positions to match."""
    rng = np.random.RandomState(seed)
    ids = rng.randint(0, vocab, (3, 12)).astype(np.int32)
    mask = np.ones((3, 12), np.int32)
    mask[1, 8:] = 0
    mask[2, :5] = 0
    pos = np.maximum(mask.cumsum(-1) - 1, 0).astype(np.int32)
    return ids, mask, pos


def hf_logits(model, ids, mask, pos):
    import torch

    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(ids, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            position_ids=torch.tensor(pos, dtype=torch.long),
        )
    return out.logits.float().numpy()


class SessionEngine:
    """Scripted LLM (the only fake): per episode, turn k gets replies[k]; some calls fail."""

    def __init__(self, tokenizer, replies, fail_calls=()):
        self.tok, self.replies, self.fail = tokenizer, replies, set(fail_calls)
        self.turns: dict[str, int] = {}
        self.calls = 0
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

    async def generate(self, ids, sampling, *, session=None):
        from jaxrl_term.rollout.engine import EngineError, Generation

        self.calls += 1
        if self.calls in self.fail:
            raise EngineError("injected: connection reset")
        k = self.turns.get(session, 0)
        self.turns[session] = k + 1
        out = self.tok(self.replies[min(k, len(self.replies) - 1)], add_special_tokens=False)["input_ids"] + [self.eos]
        return Generation(out, [-0.5] * len(out), "stop", weight_version=0)


_PORTS = iter(np.random.default_rng().permutation(np.arange(20000, 30000)).tolist())


def free_port() -> int:
    """A free port below the kernel's ephemeral range (32768+), where bind(0) and outgoing connections take
    theirs: another test process launching servers cannot be handed the same one in the meantime."""
    for port in _PORTS:
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-29999")
