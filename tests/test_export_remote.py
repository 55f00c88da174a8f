"""Every model exports: what no transformers class computes goes out as StableGPTForCausalLM (hf_remote/), loaded by
AutoModelForCausalLM with trust_remote_code. Each architecture's export, a random model made here, computes our
model's logits (fp32) and greedy continuation; the flagship configs' architecture goes through tools/export_hf.py
from a TP=2 x PP=2 checkpoint and loads in a Python that cannot see this repository; the three classes of
transformers stay theirs. Nothing is downloaded (local_files_only)."""

import ast
import json
import os
import subprocess
import sys

import pytest
import torch

import arguments
import hf
from helpers import ROOT, write_checkpoint
from model import GPT, GPTConfig
from sections import section

sys.path.insert(0, os.path.join(ROOT, "tools"))
import export_hf  # noqa: E402

transformers = pytest.importorskip("transformers")

TINY = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    seq_length=32,
    vocab_size=512,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
# Each architecture that no transformers class computes (hf.family refuses it), by the switch that makes it so
REMOTE = {
    "gpt2 + embedding LayerNorm (gpt2_125m)": dict(embed_layernorm=True, activation="gelu_tanh"),
    "normformer": dict(normformer=True),
    "qk_layernorm": dict(qk_layernorm=True),
    "scale_embeddings": dict(scale_embeddings=True, embed_layernorm=True),
    "alibi without the embedding LayerNorm": dict(position_embedding_type="alibi"),
    "alibi, relu": dict(position_embedding_type="alibi", embed_layernorm=True, activation="relu"),
    "alibi, erf gelu, normformer": dict(
        position_embedding_type="alibi", embed_layernorm=True, normformer=True
    ),
    "rotary with the GPT-2 block": dict(position_embedding_type="rotary"),
    "rotary, rmsnorm, plain MLP, GQA": dict(
        position_embedding_type="rotary", normalization="rmsnorm", num_query_groups=2
    ),
    "llama block + qk_layernorm, llama3 rope (factor 4, context 16)": dict(
        position_embedding_type="rotary",
        normalization="rmsnorm",
        swiglu=True,
        add_bias_linear=False,
        num_query_groups=2,
        untie_embeddings_and_output_weights=True,
        qk_layernorm=True,
        rotary_base=100.0,
        use_rope_scaling=True,
        rope_scaling_factor=4.0,
        original_max_position_embeddings=16,
    ),
    "llama block with learned positions, untied": dict(
        normalization="rmsnorm",
        swiglu=True,
        add_bias_linear=False,
        num_query_groups=1,
        untie_embeddings_and_output_weights=True,
    ),
    "llama block with alibi, ffn_hidden_size": dict(
        position_embedding_type="alibi",
        embed_layernorm=True,
        normalization="rmsnorm",
        swiglu=True,
        ffn_hidden_size=96,
    ),
}
STANDARD = {
    "gpt2": (dict(activation="gelu_tanh"), "GPT2LMHeadModel"),
    "bloom": (
        dict(position_embedding_type="alibi", embed_layernorm=True, activation="gelu_tanh"),
        "BloomForCausalLM",
    ),
    "llama": (
        dict(
            position_embedding_type="rotary",
            normalization="rmsnorm",
            swiglu=True,
            add_bias_linear=False,
            num_query_groups=2,
        ),
        "LlamaForCausalLM",
    ),
}


def _random(cfg, seed=0):
    """Our model with every parameter random and wide (norm gains around 1, biases and head scales nonzero), so
    that a parameter mapped to the wrong place, or a switch ignored, moves the logits well past fp32 rounding."""
    gpt = GPT(cfg)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in gpt.parameters():
            p.copy_(torch.rand_like(p) + 0.5 if p.ndim == 1 else torch.randn_like(p) * 0.15)
    return gpt.eval()


def _load(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(directory), trust_remote_code=True, local_files_only=True
    ).eval()


def _greedy(gpt, theirs, prompt, new=6):
    ours = gpt.generate(prompt, new, top_k=1)  # top-1 sampling is greedy
    out = theirs.generate(
        prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
    )
    assert out.tolist() == ours.tolist()


@pytest.mark.parametrize("name", REMOTE)
def test_what_no_class_computes_exports_with_our_modeling_file_at_equal_logits(name, tmp_path):
    cfg = GPTConfig(**TINY, **REMOTE[name])
    with pytest.raises(ValueError):
        hf.family(cfg)  # no transformers class: otherwise this case belongs to test_export_hf.py
    gpt = _random(cfg)
    assert export_hf.save(gpt, str(tmp_path / "hf")) == "StableGPTForCausalLM"
    config = json.load(open(tmp_path / "hf" / "config.json"))
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_stablegpt.StableGPTForCausalLM"
    assert {"configuration_stablegpt.py", "modeling_stablegpt.py"} <= set(
        os.listdir(tmp_path / "hf")
    )
    theirs = _load(tmp_path / "hf")
    assert type(theirs).__name__ == "StableGPTForCausalLM"
    # and so in any transformers version, whichever way it ties
    tied = not cfg.untie_embeddings_and_output_weights
    assert theirs.config.tie_word_embeddings == tied
    assert (theirs.lm_head.weight.data_ptr() == theirs.model.embed.word.weight.data_ptr()) == tied
    x = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = gpt(x)[..., :512]
        torch.testing.assert_close(theirs(x).logits, expected, rtol=1e-5, atol=1e-5)
        # an all-ones attention_mask (what tokenizers hand over) is the plain causal model
        torch.testing.assert_close(
            theirs(x, attention_mask=torch.ones_like(x)).logits, expected, rtol=1e-5, atol=1e-5
        )
    _greedy(gpt, theirs, x[:1, :5])


@pytest.mark.parametrize("position_embedding_type", ["learned", "alibi", "rotary"])
def test_left_padding_leaves_each_sequences_logits_as_alone(position_embedding_type, tmp_path):
    """Batched generation (lm-eval's generate_until) pads on the left: the padding keys are masked and positions
    count from the first real token, so each real token's logits are those of its sequence run alone (ours)."""
    cfg = GPTConfig(**TINY, position_embedding_type=position_embedding_type, embed_layernorm=True)
    gpt = _random(cfg)
    export_hf.save(gpt, str(tmp_path / "hf"))
    theirs = _load(tmp_path / "hf")
    x = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(2))
    short = x[1, 7:]  # 13 real tokens after 7 padding ones
    mask = torch.ones_like(x)
    mask[1, :7] = 0
    with torch.no_grad():
        batch = theirs(x, attention_mask=mask).logits
        torch.testing.assert_close(batch[0], gpt(x[:1])[0, :, :512], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(batch[1, 7:], gpt(short[None])[0, :, :512], rtol=1e-5, atol=1e-5)
        out = theirs.generate(
            x,
            attention_mask=mask,
            max_new_tokens=4,
            min_new_tokens=4,
            do_sample=False,
            pad_token_id=0,
        )
    assert out[1, 20:].tolist() == gpt.generate(short[None], 4, top_k=1)[0, 13:].tolist()


@pytest.mark.parametrize("kind", STANDARD)
def test_what_a_class_computes_still_exports_to_that_class(kind, tmp_path):
    switches, name = STANDARD[kind]
    gpt = _random(GPTConfig(**TINY, **switches))
    assert export_hf.save(gpt, str(tmp_path / "hf")) == name
    config = json.load(open(tmp_path / "hf" / "config.json"))
    assert "auto_map" not in config and config["architectures"] == [name]
    assert not any(n.endswith(".py") for n in os.listdir(tmp_path / "hf"))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "hf"), local_files_only=True
    ).eval()
    assert type(theirs).__name__ == name
    x = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(theirs(x).logits, gpt(x)[..., :512], rtol=1e-5, atol=1e-5)


def test_the_modeling_files_import_torch_and_transformers_only():
    """The export must load where this repository is not: its files import nothing of ours (each other, relatively,
    as transformers' dynamic modules require)."""
    allowed = {"math", "torch", "transformers", "."}
    for name in hf.REMOTE_FILES:
        with open(os.path.join(ROOT, "hf_remote", name)) as f:
            tree = ast.parse(f.read())
        found = {
            a.name.split(".")[0]
            for n in ast.walk(tree)
            if isinstance(n, ast.Import)
            for a in n.names
        }
        found |= {
            "." if n.level else n.module.split(".")[0]
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom)
        }
        assert found <= allowed, (name, found - allowed)


@pytest.mark.parametrize(
    "switches, message",
    [
        (dict(padded_vocab_in_softmax=True), "padded_vocab_in_softmax=True"),
        # a fork's own value of a key the modeling file has (GPTConfig takes it; the model's check would refuse it)
        (
            dict(position_embedding_type="xpos", embed_layernorm=True, activation="gelu_tanh"),
            "='xpos'",
        ),
        (dict(activation="swish"), "activation='swish'"),
        (
            dict(position_embedding_type="rotary", normalization="scalenorm"),
            "normalization='scalenorm'",
        ),
    ],
)
def test_what_our_modeling_file_does_not_compute_is_refused_by_name(switches, message):
    """Megatron's softmax over the padding columns (its count depends on the TP size) and a fork's new function:
    no export computes them, and none is written ("xpos" with BLOOM's other keys is not a BloomForCausalLM)."""
    with pytest.raises(ValueError, match=message):
        export_hf.target_class(GPTConfig(**TINY, **switches))


FLAGSHIPS = ["config/gpt2_125m.py", "config/tr3_1b3.py", "config/tr8b_104b.py"]
SHRUNK = [
    "--num_layers=2",
    "--hidden_size=64",
    "--num_attention_heads=4",
    "--seq_length=32",
    "--micro_batch_size=1",
    "--global_batch_size=1",
    "--bf16=false",
    "--fp16=false",
]


@pytest.mark.parametrize("config_file", FLAGSHIPS)
def test_flagship_configs_architecture_exports_at_equal_logits(config_file, tmp_path):
    """The flagship configs' model keys (the embedding LayerNorm, their activation and init) at tiny sizes."""
    cfg = section(GPTConfig, arguments.load_config([config_file, *SHRUNK, "--vocab_size=512"]))
    assert cfg.embed_layernorm and cfg.position_embedding_type == "learned"
    gpt = _random(cfg)
    assert export_hf.save(gpt, str(tmp_path / "hf")) == "StableGPTForCausalLM"
    x = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(
            _load(tmp_path / "hf")(x).logits, gpt(x)[..., :512], rtol=1e-5, atol=1e-5
        )


@pytest.mark.slow
def test_gpt2_125m_exports_from_tp2_pp2_and_loads_without_this_repository(tmp_path):
    """gpt2_125m's architecture at tiny sizes and GPT-2's vocabulary, from a TP=2 x PP=2 checkpoint through
    tools/export_hf.py (whose own check compares the logits with the checkpoint's model), then loaded and run
    greedily by a Python that cannot import this repository (-I, another working directory)."""
    argv = [
        FLAGSHIPS[0],
        *SHRUNK,
        "--vocab_size=50257",
        "--tensor_model_parallel_size=2",
        "--pipeline_model_parallel_size=2",
    ]
    write_checkpoint(str(tmp_path / "ckpt"), argv, lambda stage: None)
    diff, theirs, tok = export_hf.export(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    assert diff <= 1e-5 and type(theirs).__name__ == "StableGPTForCausalLM" and tok is not None
    # TP=2's padding dropped
    assert json.load(open(tmp_path / "hf" / "config.json"))["vocab_size"] == 50257
    prompt = tok("ROMEO:\nBut soft", return_tensors="pt")["input_ids"]
    code = (
        "import sys, json, torch, transformers\n"
        f"m = transformers.AutoModelForCausalLM.from_pretrained({str(tmp_path / 'hf')!r}, "
        "trust_remote_code=True, local_files_only=True)\n"
        f"out = m.generate(torch.tensor({prompt.tolist()}), max_new_tokens=5, min_new_tokens=5, do_sample=False)\n"
        "print(json.dumps(out.tolist()))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run(
        [sys.executable, "-I", "-c", code],
        cwd=str(tmp_path),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    # the checkpoint's initial weights
    gpt = GPT(section(GPTConfig, arguments.load_config(argv[:-2]))).eval()
    assert (
        json.loads(run.stdout.strip().splitlines()[-1]) == gpt.generate(prompt, 5, top_k=1).tolist()
    )
