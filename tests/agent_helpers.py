"""A scripted engine: the only fake in the agent tests (it stands in for the LLM, the edge not under test)."""

import asyncio

from jaxrl_term.rollout.engine import EngineError, Generation


class ScriptedEngine:
    """Replays fixed replies as token ids (the tokenizer's own encoding, then <|im_end|>, or <|endoftext|> for
    the replies whose index is in ``eot_at``), with distinct log-probs per token so alignment can be checked.
    Records every request."""

    def __init__(self, tokenizer, replies, *, repeat_last=True, delay_s=0.0, fail_at=None, abort_at=None,
                 eot_at=()):
        self.tok, self.replies, self.eot_at = tokenizer, list(replies), set(eot_at)
        self.repeat_last, self.delay_s, self.fail_at, self.abort_at = repeat_last, delay_s, fail_at, abort_at
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
        self.requests: list[list[int]] = []
        self.outputs: list[list[int]] = []
        self.logprobs: list[list[float]] = []

    async def generate(self, input_ids, sampling, *, session=None):
        n = len(self.requests)
        self.requests.append(list(input_ids))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.fail_at == n:
            raise EngineError("connection reset by peer")
        if self.abort_at == n:
            return Generation([self.eos], [-0.1], "abort")
        if n >= len(self.replies) and not self.repeat_last:
            raise EngineError("script exhausted", retryable=False)
        text = self.replies[min(n, len(self.replies) - 1)]
        ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.eot if n in self.eot_at else self.eos]
        finish = "stop"
        if len(ids) > sampling.max_new_tokens:
            ids, finish = ids[: sampling.max_new_tokens], "length"
        lps = [-0.001 * (n + 1) - 0.0001 * i for i in range(len(ids))]
        self.outputs.append(ids)
        self.logprobs.append(lps)
        return Generation(ids, lps, finish, weight_version=7)

    async def update_weights(self, source, version):
        pass

    async def health(self):
        return True
