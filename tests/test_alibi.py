"""ALiBi (lesson 19): the slopes as BLOOM defines them, every attention path with the bias against a naive
float64 reference, each TP rank's share of the heads, the parameter count without position embeddings, and the
whole model against transformers' BloomForCausalLM (random weights, nothing downloaded)."""

import math

import pytest
import torch

import model
import parallel
from model import GPT, GPTConfig, alibi_bias, alibi_slopes, core_attention, unfused_attention
from sections import section


def _cfg(**kw):
    base = dict(
        num_layers=2,
        hidden_size=48,
        num_attention_heads=6,
        seq_length=24,
        vocab_size=100,
        make_vocab_size_divisible_by=1,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        position_embedding_type="alibi",
    )
    base.update(kw)
    return GPTConfig(**base)


def _close(slopes, expected):
    torch.testing.assert_close(
        slopes, torch.tensor(expected, dtype=torch.float64), rtol=1e-15, atol=0
    )


def test_slopes_power_of_two_and_bloom_112_heads():
    assert alibi_slopes(8).tolist() == [2.0**-i for i in range(1, 9)]  # exact powers of two
    _close(alibi_slopes(16), [2.0 ** (-i / 2) for i in range(1, 17)])
    # BLOOM: 2^(-i/8), i = 1..64, then 2^(-j/16), j = 1, 3, ..., 95
    _close(
        alibi_slopes(112),
        [2.0 ** (-i / 8) for i in range(1, 65)] + [2.0 ** (-j / 16) for j in range(1, 96, 2)],
    )
    # 6 heads: 4 of the 4-head sequence, then the 1st and 3rd of the 8-head sequence
    assert alibi_slopes(6).tolist() == [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]
    # a TP rank's heads
    assert torch.equal(alibi_slopes(112, range(56, 84)), alibi_slopes(112)[56:84])


def test_slopes_equal_transformers_bloom():
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    for heads in (6, 12, 16, 112):
        # HF's alibi is slope * key position; at query 0 with a full mask it is 0, at key 1 it is the slope
        hf = bloom.build_alibi_tensor(torch.ones(1, 2), heads, torch.float32)[:, 0, 1]
        torch.testing.assert_close(hf, alibi_slopes(heads).float(), rtol=1e-6, atol=0)


def _reference(q, k, v, slopes):
    """softmax(q k^T / sqrt(d) - slope * (i - j), causal) v, naively in float64."""
    T, d = q.shape[-2], q.shape[-1]
    i, j = torch.arange(T).view(-1, 1), torch.arange(T).view(1, -1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d) - slopes.view(-1, 1, 1) * (i - j)
    return scores.masked_fill(j > i, float("-inf")).softmax(dim=-1) @ v


def _qkv(dtype=torch.float64, B=2, H=6, T=20, D=8):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, dtype=torch.float64, generator=g) for _ in range(3))
    return q.to(dtype), k.to(dtype), v.to(dtype)


PATHS = {
    "fused": lambda q, k, v, b: core_attention(q, k, v, bias=b),
    "fused_stable": lambda q, k, v, b: core_attention(q, k, v, stable=True, bias=b),
    "layer_scaling": lambda q, k, v, b: core_attention(q, k, v, layer_scaling=3.0, bias=b),
    "stable_layer_scaling": lambda q, k, v, b: core_attention(
        q, k, v, stable=True, layer_scaling=5.0, bias=b
    ),
    "unfused": lambda q, k, v, b: unfused_attention(q, k, v, bias=b),
}


@pytest.mark.parametrize("path", PATHS)
def test_attention_with_alibi_equals_reference_in_float64(path):
    q, k, v = _qkv()
    slopes = alibi_slopes(6)
    out = PATHS[path](q, k, v, alibi_bias(slopes, 20, torch.float64))
    torch.testing.assert_close(out, _reference(q, k, v, slopes), atol=1e-12, rtol=0)
    # the bias matters: without it the result is different
    assert not torch.allclose(out, core_attention(q, k, v), atol=1e-3)


@pytest.mark.parametrize(
    "switch", [dict(stable_attention=True), dict(apply_query_key_layer_scaling=True)]
)
def test_model_with_alibi_and_attention_switches_is_the_same_function(switch):
    ids = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(
            GPT(_cfg(num_layers=3, **switch)).double()(ids),
            GPT(_cfg(num_layers=3)).double()(ids),
            atol=1e-12,
            rtol=0,
        )


def test_fused_and_unfused_agree_in_half_precision():
    dtype = torch.bfloat16
    q, k, v = _qkv(dtype, T=64, D=32)
    slopes = alibi_slopes(6)
    ref = _reference(q.double(), k.double(), v.double(), slopes)
    bias = alibi_bias(slopes, 64)
    for name, fn in PATHS.items():
        out = fn(q, k, v, bias)
        assert out.dtype == dtype
        assert (out.double() - ref).abs().max() < 0.05, name


def test_model_has_no_position_embedding_and_counts_parameters():
    cfg = _cfg(embed_layernorm=True)
    model = GPT(cfg)
    names = {n for n, _ in model.named_parameters()}
    assert not any("position" in n for n in names)
    h, n, v = 48, 2, 100
    assert cfg.num_parameters() == n * (12 * h * h + 13 * h) + v * h + 2 * h + 2 * h  # no s*h
    assert cfg.num_parameters() == sum(p.numel() for p in model.parameters())
    learned = GPTConfig(**{**cfg.__dict__, "position_embedding_type": "learned"})
    assert learned.num_parameters() - cfg.num_parameters() == 24 * 48
    with pytest.raises(ValueError, match="position_embedding_type='rope'"):
        GPT(_cfg(position_embedding_type="rope"))


def test_each_tp_rank_takes_its_heads_slopes():
    for rank in range(2):
        model = GPT(
            _cfg(tensor_model_parallel_size=2), grid=parallel.Grid(2, 1, world_size=2, rank=rank)
        )
        assert model.alibi_heads == range(3 * rank, 3 * rank + 3)


def _hf_bloom_and_ours(dtype, checkpoint_activations=False):
    transformers = pytest.importorskip("transformers")
    h, heads, layers, vocab = 48, 6, 2, 100
    hf_cfg = transformers.BloomConfig(
        vocab_size=vocab,
        hidden_size=h,
        n_layer=layers,
        n_head=heads,
        layer_norm_epsilon=1e-5,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    hf = transformers.BloomForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # randomise everything, so that a wrong mapping shows
        for name, p in hf.named_parameters():
            p.normal_(
                1.0 if "layernorm" in name or "ln_f" in name else 0.0, 0.1 if p.ndim == 1 else 0.3
            )
    sd = hf.state_dict()
    ours_sd = {
        "embed.word.weight": sd["transformer.word_embeddings.weight"],
        "embed.norm.weight": sd["transformer.word_embeddings_layernorm.weight"],
        "embed.norm.bias": sd["transformer.word_embeddings_layernorm.bias"],
        "ln_f.weight": sd["transformer.ln_f.weight"],
        "ln_f.bias": sd["transformer.ln_f.bias"],
    }
    names = {
        "ln_1": "input_layernorm",
        "ln_2": "post_attention_layernorm",
        "attn.qkv": "self_attention.query_key_value",
        "attn.proj": "self_attention.dense",
        "mlp.fc1": "mlp.dense_h_to_4h",
        "mlp.fc2": "mlp.dense_4h_to_h",
    }
    for i in range(layers):
        for ours, theirs in names.items():  # BLOOM's fused QKV is laid out head by head, as ours
            for kind in ("weight", "bias"):
                ours_sd[f"blocks.{i}.{ours}.{kind}"] = sd[f"transformer.h.{i}.{theirs}.{kind}"]
    ours = GPT(
        _cfg(
            embed_layernorm=True,
            activation="gelu_tanh",
            checkpoint_activations=checkpoint_activations,
        )
    )
    ours.load_state_dict(ours_sd, strict=True)
    return hf.to(dtype), ours.to(dtype).eval()


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-6), (torch.float32, 1e-5)])
def test_logits_equal_transformers_bloom(dtype, atol, monkeypatch):
    # float64: HF computes its slopes in float32 (a 1e-8 relative difference, times the distance)
    hf, ours = _hf_bloom_and_ours(dtype)
    ids = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
        logits = ours(ids)
    assert expected.std() > 0.1
    torch.testing.assert_close(logits, expected, atol=atol, rtol=0)
    # the biases matter: with zero slopes (no position information) the logits are different
    monkeypatch.setattr(
        model, "alibi_slopes", lambda n, heads, device: torch.zeros(6, dtype=torch.float64)
    )
    ours.positions_cache = (None, None)  # GPT.positions keeps what it built for this length
    with torch.no_grad():
        assert not torch.allclose(ours(ids), expected, atol=1e-2)


def test_alibi_gradients_with_activation_checkpointing():
    _, plain = _hf_bloom_and_ours(torch.float64)
    _, ckpt = _hf_bloom_and_ours(torch.float64, checkpoint_activations=True)
    ids = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(2))
    for m in (plain, ckpt):
        m.train()
        m(ids[:, :-1], targets=ids[:, 1:]).backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-12, rtol=0, msg=name)


# -----------------------------------------------------------------------------
# BLOOM-176B (config/tr11_176b.py)


def test_tr11_176b_config_is_bloom():
    import arguments

    cfg = arguments.load_config(["config/tr11_176b.py"])
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.seq_length) == (
        70,
        14336,
        112,
        2048,
    )
    assert (cfg.position_embedding_type, cfg.embed_layernorm, cfg.activation, cfg.bf16) == (
        "alibi",
        True,
        "gelu_tanh",
        True,
    )
    assert (
        cfg.adam_beta1,
        cfg.adam_beta2,
        cfg.adam_eps,
        cfg.lr,
        cfg.min_lr,
        cfg.lr_warmup_samples,
    ) == (0.9, 0.95, 1e-8, 6e-5, 6e-6, 183_105)
    assert (cfg.init_method_std, cfg.weight_decay, cfg.clip_grad, cfg.global_batch_size) == (
        0.0048,
        0.1,
        1.0,
        2048,
    )
    assert cfg.rampup_batch_size == [192, 16, 9_765_625]
    assert (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size) == (4, 12)
    model_cfg = section(GPTConfig, cfg)
    assert model_cfg.padded_vocab_size == 250_880  # 490 x 128 x TP 4
    # n(12h^2 + 13h) + vh + 2h + the embedding LayerNorm's 2h: no s*h with ALiBi. Padded, it is BLOOM's published
    # 176,247,271,424 parameters (its vocabulary of 250,880 rows).
    assert model_cfg.num_parameters() == 176_244_404_224
    assert model_cfg.num_parameters(padded=True) == 176_247_271_424


@pytest.mark.slow
def test_tr11_176b_validates_and_dry_run_prints_176b(monkeypatch):
    import arguments
    from helpers import run_cli

    arguments.validate(arguments.load_config(["config/tr11_176b.py"]), 384)  # 384 A100s: DP = 8
    monkeypatch.setenv("WORLD_SIZE", "384")
    proc = run_cli("config/tr11_176b.py", "--dry_run")
    assert "176.24B parameters" in proc.stdout and "TP=4 x PP=12 x DP=8 = 384 GPUs" in proc.stdout
    assert "estimated total per GPU" in proc.stdout
