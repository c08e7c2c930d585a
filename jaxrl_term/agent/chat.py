"""Chat-template rendering as token ids, with message contents kept as plain text.

The chat template's own markers (``<|im_start|>``, ``<|im_end|>``) are control tokens; the same strings inside
a message (a command that echoes ``<|im_end|>``, a task that quotes it) are text, and are encoded as the plain
tokens of that text. Otherwise a tool's output could end the user turn and open one of its own. Everything else
is the template's rendering tokenised as usual: when no content holds special-token text, the ids equal
``tokenizer(apply_chat_template(...))`` exactly.

How: the messages are rendered once with a placeholder in place of each content; the placeholders locate the
contents in the real rendering. Special tokens are recognised only in the template's parts; the text between
two of them (template text and contents together, so that tokenisation across the joins is unchanged) is
encoded with special tokens split.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

EOS_TEXT = "<|im_end|>"
EOT_TEXT = "<|endoftext|>"
# placeholder delimiters: private-use code points no template touches (one pair no content uses is picked)
_DELIMS = [(chr(0xF0000 + 2 * k), chr(0xF0001 + 2 * k)) for k in range(8)]


class ChatDelta:
    """Token ids of chat renderings: the prompt, and the turns appended after an assistant turn."""

    def __init__(self, tokenizer, tools=None, enable_thinking: bool | None = None):
        self.tok, self.tools = tokenizer, tools
        self.kw = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        probe = self._render([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], False)
        self.after_eos = probe[probe.rindex(EOS_TEXT) + len(EOS_TEXT):]  # "\n" for Qwen3
        self._base = [{"role": "user", "content": "x"}]
        self._base_text = self._render(self._base, False)
        self.eos_id = tokenizer.convert_tokens_to_ids(EOS_TEXT)
        self.eos_ids = [self.eos_id]
        eot = tokenizer.convert_tokens_to_ids(EOT_TEXT)
        self.eot_id = eot if isinstance(eot, int) and eot != tokenizer.unk_token_id else None
        if self.eot_id is not None:
            self.eos_ids.append(self.eot_id)
        specials = sorted({t.content for t in tokenizer.added_tokens_decoder.values() if t.special}, key=len,
                          reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, specials))) if specials else None

    def _render(self, messages, gen: bool) -> str:
        return self.tok.apply_chat_template(messages, tools=self.tools, tokenize=False, add_generation_prompt=gen,
                                            **self.kw)

    # -- encoding -----------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """``text`` as the template's text: special-token strings in it become control tokens."""
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def encode_plain(self, text: str) -> list[int]:
        """``text`` as content: special-token strings in it stay plain text."""
        return self.tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def _encode_pieces(self, skeleton: str, contents: Sequence[str], mark: re.Pattern) -> list[int]:
        """``skeleton`` (a rendering with placeholders) with ``contents`` put back, as ids: special tokens only
        where the skeleton has them, the text between them encoded with special tokens split."""
        ids: list[int] = []
        text: list[str] = []

        def flush():
            if text:
                ids.extend(self.encode_plain("".join(text)))
                text.clear()

        pos = 0
        for m in mark.finditer(skeleton):
            self._template_part(skeleton[pos: m.start()], text, ids, flush)
            text.append(contents[int(m.group(1))])
            pos = m.end()
        self._template_part(skeleton[pos:], text, ids, flush)
        flush()
        return ids

    def _template_part(self, part: str, text: list[str], ids: list[int], flush) -> None:
        if self._special_re is None:
            text.append(part)
            return
        pos = 0
        for m in self._special_re.finditer(part):
            text.append(part[pos: m.start()])
            flush()
            ids.append(self.tok.convert_tokens_to_ids(m.group(0)))
            pos = m.end()
        text.append(part[pos:])

    def render_ids(self, messages: list[dict], gen: bool, *, content_roles=("system", "user", "tool")) -> list[int]:
        """``messages`` rendered by the template and encoded, the contents of ``content_roles`` messages as
        plain text (assistant turns are the template's to transform: it splits their reasoning off)."""
        skeleton, contents, mark = self._skeleton(messages, gen, content_roles)
        if self._fill(skeleton, contents, mark) != self._render(messages, gen):
            raise ValueError("the chat template does not insert message contents verbatim; cannot keep "
                             "special-token text in contents plain")
        return self._encode_pieces(skeleton, contents, mark)

    @staticmethod
    def _fill(skeleton: str, contents: Sequence[str], mark: re.Pattern) -> str:
        return mark.sub(lambda m: contents[int(m.group(1))], skeleton)

    def _skeleton(self, messages, gen, content_roles, skip: int = 0) -> tuple[str, list[str], re.Pattern]:
        """The rendering with a placeholder for each content of ``content_roles`` (from message ``skip`` on),
        the contents, and the placeholders' pattern."""
        used = json.dumps(messages, ensure_ascii=False, default=str)
        opener, closer = next(((a, b) for a, b in _DELIMS if a not in used and b not in used), (None, None))
        if opener is None:
            raise ValueError("every placeholder delimiter occurs in the messages")
        contents: list[str] = []
        marked = []
        for i, m in enumerate(messages):
            c = m.get("content")
            if i >= skip and m.get("role") in content_roles and isinstance(c, str) and c:
                marked.append({**m, "content": f"{opener}{len(contents)}{closer}"})
                contents.append(c)
            else:
                marked.append(m)
        return self._render(marked, gen), contents, re.compile(f"{opener}(\\d+){closer}")

    # -- the episode's two renderings ---------------------------------------------------------------
    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The first request: ``messages`` + the generation prompt."""
        return self.render_ids(messages, True)

    def observation_ids(self, messages: list[dict], closed: bool) -> list[int]:
        """``messages`` (user or tool turns) + the generation prompt, appended after an assistant turn.
        ``closed``: the assistant's output already ends with <|im_end|>; otherwise the turn is closed here
        (those tokens are not the policy's)."""
        skeleton, contents, mark = self._skeleton([*self._base, *messages], True, ("system", "user", "tool"),
                                                  skip=len(self._base))
        if not skeleton.startswith(self._base_text) or \
                self._fill(skeleton, contents, mark) != self._render([*self._base, *messages], True):
            raise ValueError("chat template renders history differently when turns are added; cannot append deltas")
        delta = ("" if closed else EOS_TEXT) + self.after_eos + skeleton[len(self._base_text):]
        return self._encode_pieces(delta, contents, mark)
