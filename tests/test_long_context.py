"""Context past the trained range only on purpose: preflight, the SGLang launcher's argv and env, serve's rule.

SGLang's behaviour reproduced here (sgl-project/sglang, python/sglang/srt): ``get_context_length`` multiplies
max_position_embeddings by rope_scaling.factor only without original_max_position_embeddings;
``ModelConfig._derive_context_length`` refuses a longer --context-length unless
SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN is set; ``get_config`` applies --json-model-override-args with
``config.update``.
"""

import json

import pytest

from jaxrl_term.model.qwen3 import Qwen3Config
from jaxrl_term.rollout.launcher import ALLOW_LONGER_CONTEXT_ENV, ServerSpec, SGLangLauncher, sglang_context_length

QWEN_64K = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32768}
# Qwen/Qwen3-8B's config.json as released: 40960 positions, no scaling
QWEN3_8B = {**Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=128).to_hf(),
            "rope_parameters": None, "rope_scaling": None}


def _model_dir(path, **changes):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**QWEN3_8B, **changes}))
    (path / "model.safetensors").write_bytes(b"")  # preflight looks for weights, never reads them
    (path / "tokenizer.json").write_text("{}")
    return path


def _preflight(capsys, *args):
    """``python -m jaxrl_term.train +experiment=tmax_qwen3_8b ARGS --preflight``, in this process: (exit code,
    stdout, stderr)."""
    from jaxrl_term.train import early_preflight

    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        early_preflight(["+experiment=tmax_qwen3_8b", "data.source=builtin", *args, "--preflight"])
    out, err = capsys.readouterr()
    return e.value.code, out, err


def test_tmax_preset_passes_preflight_with_yarn_and_plain_rope_at_64k_is_refused_in_one_line(tmp_path, capsys):
    model = _model_dir(tmp_path / "Qwen3-8B")
    code, out, err = _preflight(capsys, f"model.path={model}")
    assert code == 0 and "preflight: ok" in out, err
    code, _, err = _preflight(capsys, f"model.path={model}", "model.rope_scaling=null")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("config error: agent.max_context_tokens: ")
    assert "65536" in lines[0] and "40960" in lines[0] and f"{model}/config.json" in lines[0]
    assert "model.rope_scaling={rope_type:yarn,factor:2.0,original_max_position_embeddings:32768}" in lines[0]


def test_launcher_passes_the_scaling_and_allows_the_longer_context_exactly_when_sglang_would_refuse(tmp_path,
                                                                                                  monkeypatch):
    def launcher(model, ctx, scaling=QWEN_64K):
        lau = SGLangLauncher(str(model), [ServerSpec(30000)], context_length=ctx, rope_scaling=scaling)
        cmd, env = lau.command(lau.servers[0]), lau.env(lau.servers[0])
        over = json.loads(cmd[cmd.index("--json-model-override-args") + 1]) if "--json-model-override-args" in cmd \
            else None
        return cmd, over, env.get(ALLOW_LONGER_CONTEXT_ENV)

    monkeypatch.delenv(ALLOW_LONGER_CONTEXT_ENV, raising=False)
    # Qwen3-8B as released: the override goes in; SGLang derives 40960 (the scaling has an original length, so no
    # factor), so 65536 needs the variable
    released = _model_dir(tmp_path / "released")
    cmd, over, allow = launcher(released, 65536)
    assert over == {"rope_scaling": {**QWEN_64K, "rope_theta": 1e6}, "rope_parameters": {**QWEN_64K, "rope_theta": 1e6}}
    assert allow == "1"
    assert cmd[cmd.index("--context-length") + 1] == "65536"
    assert launcher(released, 40960)[2] is None and launcher(released, None)[2] is None
    # config.json edited as the model card says (scaling added, max_position_embeddings left at 40960): no override
    carded = _model_dir(tmp_path / "carded", rope_scaling=QWEN_64K)
    assert launcher(carded, 65536)[1:] == (None, "1")
    # our own export (max_position_embeddings = original x factor): SGLang derives 65536 by itself
    exported = _model_dir(tmp_path / "exported", **Qwen3Config(**{**_arch(), "rope_scaling": QWEN_64K}).to_hf())
    assert launcher(exported, 65536)[1:] == (None, None)
    # an export without scaling carries rope_parameters (default, with rope_theta), which SGLang's Qwen3 layer reads
    # before rope_scaling: the override must replace both
    plain_export = _model_dir(tmp_path / "plain_export", **Qwen3Config(**_arch()).to_hf())
    assert set(launcher(plain_export, 65536)[1]) == {"rope_scaling", "rope_parameters"}
    # no scaling asked: nothing added; past the model's positions is refused rather than allowed
    assert launcher(released, 32768, None)[1:] == (None, None)
    with pytest.raises(ValueError, match=r"--context-length 65536 is past the model's 40960 positions"):
        launcher(released, 65536, None)
    with pytest.raises(ValueError, match=r"--context-length 70000 is past the model's 65536 positions"):
        launcher(released, 70000)


def _arch():
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim")
    return {k: QWEN3_8B[k] for k in keys}


def test_sglang_context_length_follows_get_context_length():
    assert sglang_context_length({"max_position_embeddings": 40960}) == 40960
    assert sglang_context_length({"max_position_embeddings": 40960, "rope_scaling": QWEN_64K}) == 40960
    # v4 without original_max_position_embeddings: factor x max_position_embeddings; v5 standardises the original
    # length in (factor 1): the smaller is what every SGLang accepts
    assert sglang_context_length({"max_position_embeddings": 32768, "rope_scaling": {"type": "linear", "factor": 2}}) \
        == 65536
    yarn_no_original = {"rope_type": "yarn", "factor": 2}
    assert sglang_context_length({"max_position_embeddings": 32768, "rope_scaling": yarn_no_original}) == 32768
    assert sglang_context_length({"seq_length": 8192, "max_position_embeddings": 32768}) == 8192
    assert sglang_context_length({}) == 2048


def test_serve_enforces_sglang_context_rule_and_applies_the_override(tmp_path, monkeypatch):
    from jaxrl_term.model.hf import CheckpointError
    from jaxrl_term.serve import main

    model = _model_dir(tmp_path / "m", **Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32,
                                                     num_hidden_layers=1, num_attention_heads=2,
                                                     num_key_value_heads=1, head_dim=8,
                                                     max_position_embeddings=128).to_hf())
    (model / "model.safetensors").unlink()  # main() stops at the weights: the config is what is checked here
    monkeypatch.delenv(ALLOW_LONGER_CONTEXT_ENV, raising=False)
    yarn = json.dumps({"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128}})
    args = ["--model-dir", str(model), "--context-length", "256", "--json-model-override-args", yarn]
    with pytest.raises(ValueError, match=r"context_length \(256\) is greater than the derived context_length \(128\)"
                                         rf".*{ALLOW_LONGER_CONTEXT_ENV}=1"):
        main(args)
    monkeypatch.setenv(ALLOW_LONGER_CONTEXT_ENV, "1")
    with pytest.raises(CheckpointError, match="safetensors"):  # past the rule, the override parsed
        main(args)
    with pytest.raises(CheckpointError, match="rope_type 'longrope' is not supported"):
        main(["--model-dir", str(model), "--json-model-override-args",
              json.dumps({"rope_scaling": {"rope_type": "longrope"}})])
