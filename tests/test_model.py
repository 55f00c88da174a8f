"""Tests for model.py: the parameter count against lesson 16's formula and the real configs'
sizes, equivalence with Hugging Face's GPT-2 (random weights, nothing downloaded), the initialisation rules of
lesson 3, the attention variants against a float64 reference, what each switch changes (lessons 1, 2, 15),
vocabulary padding and generation, and a short overfit run that catches a broken backward pass."""

import math
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import arguments
import model as model_module
import parallel
from model import GPT, GPTConfig, core_attention, sinusoidal_positions, unfused_attention
from sections import section

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(**kw):
    """A small config with dropout off (tests that need dropout turn it on explicitly)."""
    base = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=16,
        vocab_size=100,
        make_vocab_size_divisible_by=1,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    base.update(kw)
    return GPTConfig(**base)


def _numel(model):
    return sum(p.numel() for p in model.parameters())


def _formula(n, h, v, s):
    """Lesson 16, written out: n*(12h^2 + 13h) + v*h + s*h + 2h."""
    return n * (12 * h * h + 13 * h) + v * h + s * h + 2 * h


def _ids(cfg, batch=2, length=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, length or cfg.seq_length), generator=g)


def _layer_norm(x, weight, bias, eps=1e-5):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


def _reference_attention(q, k, v):
    """softmax(q k^T / sqrt(d) + causal mask) v, computed naively."""
    T, d = q.shape[-2], q.shape[-1]
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    future = torch.ones(T, T, dtype=torch.bool).triu(diagonal=1)
    return scores.masked_fill(future, float("-inf")).softmax(dim=-1) @ v


# -----------------------------------------------------------------------------
# 1. Parameter count


@pytest.mark.parametrize(
    "n,h,heads,v,s", [(1, 8, 2, 11, 4), (2, 64, 4, 100, 32), (3, 48, 6, 1000, 17)]
)
def test_num_parameters_matches_model_and_seed_formula(n, h, heads, v, s):
    cfg = _cfg(num_layers=n, hidden_size=h, num_attention_heads=heads, vocab_size=v, seq_length=s)
    assert cfg.num_parameters() == _numel(GPT(cfg)) == _formula(n, h, v, s)


@pytest.mark.parametrize(
    "switches",
    [
        dict(embed_layernorm=True),
        dict(normformer=True),
        dict(embed_layernorm=True, normformer=True),
    ],
)
def test_num_parameters_with_switches(switches):
    n, h, heads, v, s = 3, 48, 6, 101, 20
    cfg = _cfg(
        num_layers=n,
        hidden_size=h,
        num_attention_heads=heads,
        vocab_size=v,
        seq_length=s,
        **switches,
    )
    expected = _formula(n, h, v, s)
    if switches.get("embed_layernorm"):
        expected += 2 * h  # LayerNorm gain and bias on the word embeddings
    if switches.get("normformer"):
        # post-attention LN, FFN LN (4h wide), one scale per head
        expected += n * (2 * h + 2 * 4 * h + heads)
    assert _numel(GPT(cfg)) == cfg.num_parameters() == expected


def test_num_parameters_counts_padding_only_when_asked():
    cfg = _cfg(vocab_size=100, make_vocab_size_divisible_by=64)  # padded to 128
    model = GPT(cfg)
    assert model.embed.word.weight.shape[0] == 128
    assert (
        _numel(model)
        == cfg.num_parameters(padded=True)
        == cfg.num_parameters() + 28 * cfg.hidden_size
    )


def test_pipeline_stages_hold_the_model_with_the_tied_head_twice():
    cfg = _cfg(num_layers=4)
    first = GPT(cfg, layers=range(0, 2), post_process=False)
    last = GPT(cfg, layers=range(2, 4), pre_process=False)
    duplicate = last.output_weight.numel()
    assert _numel(first) + _numel(last) - duplicate == cfg.num_parameters() == _numel(GPT(cfg))


def test_word_embedding_weight_is_this_stages_copy():
    cfg = _cfg(num_layers=3)
    whole, first = GPT(cfg), GPT(cfg, layers=range(0, 1), post_process=False)
    middle = GPT(cfg, layers=range(1, 2), pre_process=False, post_process=False)
    last = GPT(cfg, layers=range(2, 3), pre_process=False)
    assert whole.word_embedding_weight() is whole.embed.word.weight
    assert first.word_embedding_weight() is first.embed.word.weight
    assert middle.word_embedding_weight() is None
    assert last.word_embedding_weight() is last.output_weight
    # the same initial values
    assert torch.equal(last.word_embedding_weight(), first.word_embedding_weight())


def test_a_model_built_for_another_grid_is_that_ranks_slice():
    """GPT(grid=...) builds TP rank 1 of 2 in this single process: its shapes and initial values are that rank's
    slices of the one-process model, and this process's grid is left alone (what estimate.py relies on)."""
    # padded to 112
    cfg = _cfg(vocab_size=100, make_vocab_size_divisible_by=8, tensor_model_parallel_size=2)
    full = GPT(cfg, grid=parallel.Grid(world_size=1))
    rank1 = GPT(cfg, grid=parallel.Grid(2, 1, world_size=2, rank=1))
    assert parallel.grid.tp_size == 1 and parallel.grid.world_size == 1
    assert (
        rank1.embed.word.weight.shape == (56, cfg.hidden_size)
        and rank1.embed.word.vocab_start == 56
    )
    assert rank1.blocks["0"].attn.local_heads == cfg.num_attention_heads // 2
    named = dict(full.named_parameters())
    for name, p in rank1.named_parameters():
        dim = getattr(p, "tp_dim", None)
        expected = named[name] if dim is None else named[name].chunk(2, dim=dim)[1]
        assert torch.equal(p, expected), name


# (name, n, h, heads, s, check of the formula's value in the chronicles' rounding)
REAL_SIZES = [
    ("tr8b-104B", 64, 11600, 80, 2048, lambda p: round(p / 1e9, 2) == 103.96),
    ("tr8-104B", 32, 16384, 32, 2048, lambda p: round(p / 1e9) == 104),
    ("tr1-13B", 40, 5120, 32, 2048, lambda p: round(p / 1e9) == 13),
    ("tr3-1B3", 24, 2048, 16, 2048, lambda p: round(p / 1e9, 1) == 1.3),
    ("gpt2-125M", 12, 768, 12, 1024, lambda p: 124e6 <= p < 125e6),
]


@pytest.mark.parametrize("name,n,h,heads,s,size_ok", REAL_SIZES, ids=[r[0] for r in REAL_SIZES])
def test_real_model_sizes_on_meta_device(name, n, h, heads, s, size_ok):
    v = 50257
    cfg = GPTConfig(
        num_layers=n, hidden_size=h, num_attention_heads=heads, seq_length=s, vocab_size=v
    )
    assert cfg.num_parameters() == _formula(n, h, v, s)
    assert size_ok(cfg.num_parameters())
    # Padding to a multiple of 128 (x TP): 50304 on one rank, 50688 with TP=4 (as the 104B runs).
    assert cfg.padded_vocab_size == 50304
    assert cfg.num_parameters(padded=True) == _formula(n, h, 50304, s)
    with torch.device("meta"):
        model = GPT(cfg)
        unpadded = GPT(
            GPTConfig(
                num_layers=n,
                hidden_size=h,
                num_attention_heads=heads,
                seq_length=s,
                vocab_size=v,
                make_vocab_size_divisible_by=1,
            )
        )
    assert all(p.is_meta for p in model.parameters())
    assert _numel(model) == cfg.num_parameters(padded=True)
    assert _numel(unpadded) == cfg.num_parameters()


def test_padded_count_with_tensor_parallel():
    cfg = GPTConfig(
        num_layers=64,
        hidden_size=11600,
        num_attention_heads=80,
        seq_length=2048,
        tensor_model_parallel_size=4,
    )
    assert cfg.padded_vocab_size == 50688
    assert cfg.num_parameters(padded=True) == _formula(64, 11600, 50688, 2048)
    assert cfg.num_parameters() == _formula(64, 11600, 50257, 2048)


@pytest.mark.parametrize("recompute, f", [(False, 3), (True, 4)])
def test_flops_are_megatrons_formula(recompute, f):
    """The log line's TFLOPs (lesson 23): 24 f B s n h^2 (1 + s/6h + V/16nh), f = 4 with recomputation."""
    n, h, s, B = 64, 11600, 2048, 2048
    cfg = GPTConfig(
        num_layers=n,
        hidden_size=h,
        num_attention_heads=80,
        seq_length=s,
        checkpoint_activations=recompute,
        tensor_model_parallel_size=4,
    )
    V = cfg.padded_vocab_size
    assert cfg.flops_per_iteration(B, s) == 24 * f * B * s * n * h * h * (
        1 + s / (6 * h) + V / (16 * n * h)
    )


def test_a_forked_mlp_is_counted_as_built(monkeypatch):
    """Parameter count and FLOPs come from the model as built: a fork's feed-forward (here 8h wide, the dense
    weights of a block 4h^2 + 16h^2) changes both without a formula to edit. (A config no other test uses: the
    count is cached per config.)"""
    h, n = 40, 3
    monkeypatch.setattr(
        model_module,
        "mlp",
        lambda cfg, grid: nn.Sequential(nn.Linear(h, 8 * h), nn.Linear(8 * h, h)),
    )
    cfg = GPTConfig(
        num_layers=n,
        hidden_size=h,
        num_attention_heads=5,
        seq_length=8,
        vocab_size=99,
        make_vocab_size_divisible_by=1,
    )
    assert (
        cfg.num_parameters()
        == _numel(GPT(cfg))
        == n * (4 * h * h + 4 * h + 16 * h * h + 9 * h + 4 * h) + 99 * h + 8 * h + 2 * h
    )
    assert cfg.flops_per_iteration(2, 8) == 3 * 2 * 8 * (2 * 20 * n * h * h) * (
        1 + 8 / (6 * h) + 99 / (16 * n * h)
    )


# (file, n, h, s, size check): the shipped configs must be the models the seeds describe.
CONFIG_SIZES = [
    ("tr8b_104b.py", 64, 11600, 2048, lambda p: round(p / 1e9, 2) == 103.96),
    ("tr8_104b.py", 32, 16384, 2048, lambda p: round(p / 1e9) == 104),
    ("tr1_13b.py", 40, 5120, 2048, lambda p: round(p / 1e9) == 13),
    ("tr3_1b3.py", 24, 2048, 2048, lambda p: round(p / 1e9, 1) == 1.3),
    ("gpt2_125m.py", 12, 768, 1024, lambda p: 124e6 <= p < 125e6),
]


@pytest.mark.parametrize("name,n,h,s,size_ok", CONFIG_SIZES, ids=[c[0] for c in CONFIG_SIZES])
def test_config_files_have_the_seeds_sizes(name, n, h, s, size_ok):
    cfg = section(GPTConfig, arguments.load_config([os.path.join(ROOT, "config", name)]))
    assert (cfg.num_layers, cfg.hidden_size, cfg.seq_length, cfg.vocab_size) == (n, h, s, 50257)
    extra = 2 * h if cfg.embed_layernorm else 0
    assert not cfg.normformer
    assert cfg.num_parameters() == _formula(n, h, 50257, s) + extra
    assert size_ok(cfg.num_parameters())
    with torch.device("meta"):
        model = GPT(cfg)
    assert _numel(model) == cfg.num_parameters(padded=True)


# -----------------------------------------------------------------------------
# 2. Equivalence with Hugging Face's GPT-2 (random weights; nothing downloaded)


def _hf_and_ours(dtype):
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        n_positions=32,
        vocab_size=50257,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,
    )
    hf_cfg._attn_implementation = "eager"  # an implementation independent of ours (we use SDPA)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    # HF starts with zero biases and unit LayerNorm gains: randomise everything so that a wrong mapping shows.
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif "ln_" in name:
                p.normal_(1.0, 0.1)
            elif "c_attn" in name:
                # peaked attention, so that a head permutation would change the output
                p.normal_(0.0, 0.2)
            else:
                p.normal_(0.0, 0.05)
    h, heads, hd = 64, 4, 16
    sd = hf.state_dict()

    def qkv(t):  # HF [q | k | v] on the output dim -> ours head by head, [heads, 3, head_dim]
        return t.reshape(3, heads, hd, *t.shape[1:]).transpose(0, 1).reshape(3 * h, *t.shape[1:])

    ours_sd = {
        "embed.word.weight": sd["transformer.wte.weight"],
        "embed.position.weight": sd["transformer.wpe.weight"],
        "ln_f.weight": sd["transformer.ln_f.weight"],
        "ln_f.bias": sd["transformer.ln_f.bias"],
    }
    for i in range(2):
        src, dst = f"transformer.h.{i}.", f"blocks.{i}."
        for ln in ("ln_1", "ln_2"):
            for kind in ("weight", "bias"):
                ours_sd[dst + f"{ln}.{kind}"] = sd[src + f"{ln}.{kind}"]
        # Conv1D stores (in, out): transpose to nn.Linear's (out, in).
        ours_sd[dst + "attn.qkv.weight"] = qkv(sd[src + "attn.c_attn.weight"].t())
        ours_sd[dst + "attn.qkv.bias"] = qkv(sd[src + "attn.c_attn.bias"])
        for ours_name, hf_name in (
            ("attn.proj", "attn.c_proj"),
            ("mlp.fc1", "mlp.c_fc"),
            ("mlp.fc2", "mlp.c_proj"),
        ):
            ours_sd[dst + ours_name + ".weight"] = sd[src + hf_name + ".weight"].t()
            ours_sd[dst + ours_name + ".bias"] = sd[src + hf_name + ".bias"]
    ours = GPT(
        GPTConfig(
            num_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            seq_length=32,
            vocab_size=50257,
            make_vocab_size_divisible_by=1,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            activation="gelu_tanh",
        )
    ).eval()
    ours.load_state_dict(ours_sd, strict=True)
    return hf.to(dtype), ours.to(dtype)


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
def test_logits_equal_huggingface_gpt2(dtype, atol):
    hf, ours = _hf_and_ours(dtype)
    ids = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
        logits = ours(ids)
    assert logits.dtype == dtype
    assert expected.std() > 0.1  # not a degenerate comparison
    torch.testing.assert_close(logits, expected, atol=atol, rtol=0)


# the logits' standard
@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_loss_equals_huggingface_gpt2(dtype, atol):
    hf, ours = _hf_and_ours(dtype)
    ids = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        # HF shifts the labels itself, and takes its loss in fp32 whatever the dtype
        out = hf(ids, labels=ids)
        loss = ours(ids[:, :-1], targets=ids[:, 1:])  # ours takes them already shifted
        # in dtype
        expected = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert loss.ndim == 0 and loss.dtype == dtype
    torch.testing.assert_close(loss, expected, atol=atol, rtol=0)
    torch.testing.assert_close(loss.double(), out.loss.double(), atol=1e-5, rtol=0)


# -----------------------------------------------------------------------------
# 3. Initialisation (lesson 3)


def test_small_init_formula():
    assert GPTConfig(hidden_size=11600, init_method_std="small_init").std == pytest.approx(
        0.00587220219514703, rel=1e-12
    )
    assert GPTConfig(hidden_size=768, init_method_std="small_init").std == pytest.approx(
        math.sqrt(2 / 3840)
    )
    assert GPTConfig(init_method_std=0.006).std == 0.006


def _assert_std(t, expected, rel=0.03):
    t = t.detach().double()
    assert abs(t.mean().item()) < 0.05 * expected
    assert t.std().item() == pytest.approx(expected, rel=rel)


def test_init_std_of_every_weight():
    n, h = 4, 256
    cfg = _cfg(
        num_layers=n,
        hidden_size=h,
        num_attention_heads=4,
        vocab_size=1000,
        seq_length=64,
        init_method_std="small_init",
    )
    std = math.sqrt(2 / (5 * h))
    model = GPT(cfg)
    _assert_std(model.embed.word.weight[:1000], std)  # the real rows (the padded ones are zeros)
    _assert_std(model.embed.position.weight, std)
    for block in model.blocks.values():
        _assert_std(block.attn.qkv.weight, std)
        _assert_std(block.mlp.fc1.weight, std)
        # The output layers of each block: std / sqrt(2 * num_layers) (Megatron's scaled_init_method).
        _assert_std(block.attn.proj.weight, std / math.sqrt(2 * n))
        _assert_std(block.mlp.fc2.weight, std / math.sqrt(2 * n))
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert torch.all(p == 0), name
        elif p.ndim == 1:
            assert torch.all(p == 1), name  # LayerNorm gains


def test_xavier_uniform_embedding():
    V, h = 1000, 256
    cfg = _cfg(hidden_size=h, vocab_size=V, embed_init="xavier_uniform", init_method_std=0.02)
    # the real rows (the padded ones are zeros)
    w = GPT(cfg).embed.word.weight.detach().double()[:V]
    bound = math.sqrt(6 / (V + h))
    assert w.abs().max() <= bound
    assert w.abs().max() > 0.99 * bound  # uniform over the whole interval, not a narrower one
    assert w.var().item() == pytest.approx(bound**2 / 3, rel=0.03)  # variance of U(-b, b)
    assert abs(w.mean().item()) < 0.01 * bound
    # a uniform, not a normal: the fraction inside half the bound is 1/2 (a normal of that variance gives 0.66)
    assert (w.abs() < bound / 2).double().mean().item() == pytest.approx(0.5, abs=0.01)


def test_embed_init_std_is_separate_from_init_method_std():
    cfg = _cfg(hidden_size=256, vocab_size=1000, embed_init_std=0.1, init_method_std=0.02)
    model = GPT(cfg)
    _assert_std(model.embed.word.weight[:1000], 0.1)
    _assert_std(model.embed.position.weight, 0.02)
    _assert_std(model.blocks["0"].attn.qkv.weight, 0.02)
    _assert_std(model.blocks["0"].mlp.fc1.weight, 0.02)


def test_sinusoidal_position_init():
    T, h = 16, 32
    model = GPT(_cfg(seq_length=T, hidden_size=h, position_embedding_init="sinusoidal"))
    expected = torch.zeros(T, h, dtype=torch.float64)
    for pos in range(T):  # "Attention is all you need", section 3.5
        for i in range(h // 2):
            angle = pos / 10000 ** (2 * i / h)
            expected[pos, 2 * i] = math.sin(angle)
            expected[pos, 2 * i + 1] = math.cos(angle)
    torch.testing.assert_close(
        model.embed.position.weight.detach().double(), expected, atol=1e-6, rtol=0
    )
    torch.testing.assert_close(sinusoidal_positions(T, h).double(), expected, atol=1e-6, rtol=0)


def test_init_is_a_function_of_seed_and_name():
    cfg = _cfg()
    torch.manual_seed(1)
    a = GPT(cfg)
    torch.manual_seed(2)  # the global RNG must not matter
    b = GPT(cfg)
    c = GPT(cfg)
    c.init_weights(seed=4321)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
    random_names = [k for k in sa if not (k.endswith("bias") or sa[k].ndim == 1)]
    assert random_names
    for name in random_names:
        assert not torch.equal(sa[name], sc[name]), name
    # Different names, different draws (two same-shaped weights are not copies of each other).
    assert not torch.equal(sa["blocks.0.attn.qkv.weight"], sa["blocks.1.attn.qkv.weight"])


def test_pipeline_stages_start_from_the_single_model_weights():
    cfg = _cfg(num_layers=2, embed_layernorm=True)
    whole = GPT(cfg)
    first = GPT(cfg, layers=range(0, 1), post_process=False)
    last = GPT(cfg, layers=range(1, 2), pre_process=False)
    ref = dict(whole.named_parameters())
    names = set()
    for stage in (first, last):
        for name, p in stage.named_parameters():
            if name == "output_weight":
                continue
            assert torch.equal(p, ref[name]), name
            names.add(name)
    assert names == set(ref)
    assert torch.equal(last.output_weight, first.embed.word.weight)
    # ... and the two stages compute what the whole model computes.
    ids = _ids(cfg)
    with torch.no_grad():
        torch.testing.assert_close(
            last(first(ids), targets=ids), whole(ids, targets=ids), atol=1e-6, rtol=0
        )


# -----------------------------------------------------------------------------
# 4. Attention numerics


def _qkv(dtype=torch.float64, B=2, H=3, T=24, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (2.0 * torch.randn(B, H, T, D, dtype=torch.float64, generator=g) for _ in range(2))
    v = torch.randn(B, H, T, D, dtype=torch.float64, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


ATTENTION_VARIANTS = {
    "fused": lambda q, k, v: core_attention(q, k, v),
    "fused_stable": lambda q, k, v: core_attention(q, k, v, stable=True),
    "core_unfused_layer_scaling": lambda q, k, v: core_attention(
        q, k, v, stable=True, layer_scaling=5.0, unfused=True
    ),
    "unfused": lambda q, k, v: unfused_attention(q, k, v),
    "unfused_stable": lambda q, k, v: unfused_attention(q, k, v, stable=True),
    "unfused_layer_scaling": lambda q, k, v: unfused_attention(q, k, v, layer_scaling=3.0),
    "unfused_stable_layer_scaling": lambda q, k, v: unfused_attention(
        q, k, v, stable=True, layer_scaling=7.0
    ),
}


@pytest.mark.parametrize("variant", ATTENTION_VARIANTS)
def test_attention_variants_equal_reference_in_float64(variant):
    q, k, v = _qkv()
    out = ATTENTION_VARIANTS[variant](q, k, v)
    assert out.dtype == torch.float64 and out.shape == v.shape
    torch.testing.assert_close(out, _reference_attention(q, k, v), atol=1e-12, rtol=0)


def test_reference_attention_is_causal():
    # The reference itself: position t must not see later positions.
    q, k, v = _qkv()
    out = _reference_attention(q, k, v)
    v2 = v.clone()
    v2[:, :, 10:] += 1.0
    torch.testing.assert_close(_reference_attention(q, k, v2)[:, :, :10], out[:, :, :10])
    assert not torch.allclose(_reference_attention(q, k, v2)[:, :, 10:], out[:, :, 10:])


def _half_dtype():
    try:
        q, k, v = _qkv(torch.float16, T=4, D=4)
        core_attention(q, k, v)
        unfused_attention(q, k, v)
        return torch.float16
    except RuntimeError:
        return torch.bfloat16


def test_attention_variants_in_half_precision_round_differently_but_stay_close():
    dtype = _half_dtype()
    q, k, v = _qkv(dtype, T=64, D=64)
    ref = _reference_attention(*(t.double() for t in (q, k, v)))
    outs = {}
    for name, fn in ATTENTION_VARIANTS.items():
        out = fn(q, k, v)
        assert out.dtype == dtype, name
        err = (out.double() - ref).abs().max().item()
        assert err < (0.03 if dtype == torch.float16 else 0.15), (name, err)
        outs[name] = out
    # The scalings are the same function in exact arithmetic, so in half precision they must round differently:
    # bitwise-equal outputs would mean a switch is ignored.
    names = list(outs)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert not torch.equal(outs[a], outs[b]), (a, b)


@pytest.mark.parametrize(
    "switch",
    [
        dict(stable_attention=True),
        dict(apply_query_key_layer_scaling=True),
        dict(stable_attention=True, apply_query_key_layer_scaling=True),
    ],
)
def test_model_with_attention_switches_computes_the_same_function_in_float64(switch):
    cfg = _cfg(num_layers=3)
    ids = _ids(cfg)
    base = GPT(cfg).double()
    other = GPT(_cfg(num_layers=3, **switch)).double()
    with torch.no_grad():
        torch.testing.assert_close(other(ids), base(ids), atol=1e-12, rtol=0)
        torch.testing.assert_close(
            other(ids, targets=ids), base(ids, targets=ids), atol=1e-6, rtol=1e-6
        )


def test_layer_scaling_is_fused_unless_unfused_is_asked():
    # Fused kernels accumulate q k^T in fp32: layer scaling changes nothing there. unfused=True is Megatron's path.
    q, k, v = _qkv(_half_dtype(), T=64, D=64)
    for stable in (False, True):
        fused = core_attention(q, k, v, stable=stable)
        assert torch.equal(core_attention(q, k, v, stable=stable, layer_scaling=3.0), fused)
        assert torch.equal(
            core_attention(q, k, v, stable=stable, layer_scaling=3.0, unfused=True),
            unfused_attention(q, k, v, stable=stable, layer_scaling=3.0),
        )


def test_layer_scaling_uses_the_layer_number():
    model = GPT(_cfg(num_layers=3, apply_query_key_layer_scaling=True))
    assert [b.attn.layer_scaling for b in model.blocks.values()] == [1.0, 2.0, 3.0]
    assert all(b.attn.layer_scaling is None for b in GPT(_cfg(num_layers=3)).blocks.values())


# -----------------------------------------------------------------------------
# 5. Switches change what they claim (lessons 1, 2, 15)


def test_embed_layernorm_normalises_word_embeddings_only():
    cfg = _cfg(embed_layernorm=True)
    model = GPT(cfg).double()
    assert GPT(_cfg()).embed.norm is None
    norm = model.embed.norm
    with torch.no_grad():  # a non-trivial gain and bias, so that an unapplied LayerNorm cannot pass
        norm.weight.normal_(1.0, 0.3)
        norm.bias.normal_(0.0, 0.3)
    seen = []
    handle = norm.register_forward_hook(lambda mod, inp, out: seen.append(inp[0]))
    ids = _ids(cfg, length=10)
    with torch.no_grad():
        out = model.embed(ids)
        model(ids)
    handle.remove()
    word, pos = model.embed.word.weight, model.embed.position.weight
    assert len(seen) == 2
    # the input is the word embedding alone
    torch.testing.assert_close(seen[0], word[ids], atol=0, rtol=0)
    expected = _layer_norm(word[ids], norm.weight, norm.bias) + pos[:10]
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)


def test_scale_embeddings_multiplies_word_embeddings_by_sqrt_h():
    cfg = _cfg(scale_embeddings=True, hidden_size=48, num_attention_heads=4)
    model = GPT(cfg).double()
    ids = _ids(cfg, length=10)
    word, pos = model.embed.word.weight, model.embed.position.weight
    with torch.no_grad():
        torch.testing.assert_close(
            model.embed(ids), word[ids] * math.sqrt(48) + pos[:10], atol=1e-12, rtol=0
        )
        plain = GPT(_cfg(hidden_size=48, num_attention_heads=4)).double()
        torch.testing.assert_close(plain.embed(ids), word[ids] + pos[:10], atol=1e-12, rtol=0)


def test_embed_dropout_is_separate_from_hidden_dropout():
    ids = _ids(_cfg(), length=12)

    def varies(**kw):
        model = GPT(_cfg(**kw)).train()
        with torch.no_grad():
            return not torch.equal(model(ids), model(ids))

    assert varies(embed_dropout=0.5)  # hidden_dropout = attention_dropout = 0
    assert not varies(embed_dropout=0.0)
    assert varies(hidden_dropout=0.5, embed_dropout=0.0)  # the blocks still drop
    # OPT's "no dropout on embeddings": the embedding output is deterministic while the blocks drop.
    model = GPT(_cfg(hidden_dropout=0.5, embed_dropout=0.0)).train()
    with torch.no_grad():
        assert torch.equal(model.embed(ids), model.embed(ids))
    # None means "as hidden_dropout" (Megatron has a single dropout).
    model = GPT(_cfg(hidden_dropout=0.5)).train()
    with torch.no_grad():
        assert not torch.equal(model.embed(ids), model.embed(ids))


ACTIVATION_FORMULAS = {
    "relu": lambda x: x.clamp(min=0),
    "gelu": lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2))),
    "gelu_tanh": lambda x: (
        0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    ),
}


@pytest.mark.parametrize("activation", ACTIVATION_FORMULAS)
def test_activation_is_the_one_configured(activation):
    model = GPT(_cfg(activation=activation)).double()
    mlp = model.blocks["0"].mlp
    x = torch.randn(2, 5, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 3
    with torch.no_grad():
        out = mlp(x)
        for name, act in ACTIVATION_FORMULAS.items():
            expected = mlp.fc2(act(mlp.fc1(x)))
            if name == activation:
                torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
            else:
                assert not torch.allclose(out, expected, atol=1e-6), name


def test_unknown_activation_is_refused():
    with pytest.raises(ValueError, match="activation"):
        GPT(_cfg(activation="swish"))


def test_normformer_block_matches_manual_computation():
    h, heads = 32, 4
    cfg = _cfg(normformer=True, hidden_size=h, num_attention_heads=heads)
    model = GPT(cfg).double()
    block = model.blocks["1"]
    assert (
        block.ln_attn is not None
        and block.mlp.ln is not None
        and block.attn.head_scale.shape == (heads,)
    )
    plain = GPT(_cfg(hidden_size=h, num_attention_heads=heads)).blocks["1"]
    assert plain.ln_attn is None and plain.mlp.ln is None and plain.attn.head_scale is None
    with torch.no_grad():  # non-trivial values for the three NormFormer additions
        g = torch.Generator().manual_seed(3)
        for p in (block.attn.head_scale, block.ln_attn.weight, block.mlp.ln.weight):
            p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=g, dtype=torch.float64))
        for p in (block.ln_attn.bias, block.mlp.ln.bias):
            p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64))
    B, T, D = 2, 10, h // heads
    x = torch.randn(B, T, h, dtype=torch.float64, generator=g)
    with torch.no_grad():
        y = _layer_norm(x, block.ln_1.weight, block.ln_1.bias)
        qkv = F.linear(y, block.attn.qkv.weight, block.attn.qkv.bias).view(B, T, heads, 3, D)
        q, k, v = (qkv[:, :, :, j].transpose(1, 2) for j in range(3))
        att = _reference_attention(q, k, v) * block.attn.head_scale.view(1, heads, 1, 1)
        a = block.attn.proj(att.transpose(1, 2).reshape(B, T, h))
        x1 = x + _layer_norm(a, block.ln_attn.weight, block.ln_attn.bias)
        m = F.gelu(block.mlp.fc1(_layer_norm(x1, block.ln_2.weight, block.ln_2.bias)))
        expected = x1 + block.mlp.fc2(_layer_norm(m, block.mlp.ln.weight, block.mlp.ln.bias))
        torch.testing.assert_close(block(x), expected, atol=1e-12, rtol=0)


def test_normformer_refuses_tensor_parallel():
    with pytest.raises(ValueError, match="normformer"):
        GPT(
            _cfg(normformer=True, tensor_model_parallel_size=2),
            grid=parallel.Grid(2, 1, world_size=2),
        )


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--make_vocab_size_divisible_by=0"],
            r"^make_vocab_size_divisible_by=0 must be at least 1 \(1: no padding",
        ),
        (["--attention_dropout=-0.1"], r"^attention_dropout=-0.1 must be in \[0, 1\)"),
        (["--hidden_dropout=1.5"], r"^hidden_dropout=1.5 must be in \[0, 1\)"),
        (["--embed_dropout=1"], r"^embed_dropout=1.0 must be in \[0, 1\)"),
        (
            ["--init_method_std=-0.02"],
            r"^init_method_std=-0.02 must be a positive number .* or 'small_init'",
        ),
        (
            ["--init_method_std=smallinit"],
            r"^init_method_std='smallinit' must be a positive number .* or 'small_init'",
        ),
        (
            ["--use_rope_scaling"],
            r"^use_rope_scaling=True does nothing without position_embedding_type='rotary' \(here "
            r"position_embedding_type='learned'\): set position_embedding_type='rotary', or drop use_rope_scaling$",
        ),
        (
            ["--original_max_position_embeddings=2048"],
            r"^original_max_position_embeddings=2048 does nothing without use_rope_scaling",
        ),
        (
            ["--position_embedding_type=alibi", "--rotary_base=500000"],
            r"^rotary_base=500000.0 does nothing without position_embedding_type='rotary' \(here "
            r"position_embedding_type='alibi'\)",
        ),
        (
            ["--position_embedding_type=rotary", "--rope_scaling_factor=32"],
            r"^rope_scaling_factor=32.0 does nothing without use_rope_scaling \(here use_rope_scaling=False\): "
            r"set use_rope_scaling, or drop rope_scaling_factor$",
        ),
        (["--embed_init_std=-0.01"], r"^embed_init_std=-0.01 must be positive, or None"),
        # a run of NaN losses, every step dropped, that exited 0
        (["--layernorm_epsilon=-1"], r"^layernorm_epsilon=-1.0 must be positive"),
        (["--layernorm_epsilon=0"], r"^layernorm_epsilon=0.0 must be positive"),
    ],
)
def test_model_keys_that_cannot_work_are_refused_by_name_before_anything_is_built(flags, message):
    """Each was a traceback at the model's build or first forward (ZeroDivisionError, torch's dropout or init
    message naming no key, float('smallinit')), or, for rotary's keys with other positions, a run that ignored
    them: refused by GPTConfig.check in arguments.validate, naming the key and its value."""
    cfg = arguments.load_config(["--train_iters=1", *flags])
    with pytest.raises(ValueError, match=message):
        arguments.validate(cfg, reads_data=False)


def test_rotarys_keys_are_taken_with_rotary_positions_and_small_init_by_its_name():
    for flags in (
        [
            "--position_embedding_type=rotary",
            "--rotary_base=500000",
            "--use_rope_scaling",
            "--rope_scaling_factor=32",
            "--original_max_position_embeddings=2048",
        ],
        ["--init_method_std=small_init", "--embed_dropout=0", "--hidden_dropout=0.5"],
    ):
        arguments.validate(arguments.load_config(["--train_iters=1", *flags]), reads_data=False)


@pytest.mark.parametrize("streams", ["default only", "with the model-parallel stream"])
def test_checkpoint_activations_gives_identical_loss_and_grads(streams):
    import rng

    # unseeded: attention dropout draws from the default stream too (conftest resets it)
    rng.set_states(None)
    ids = _ids(_cfg(), length=12)
    results = []
    for checkpointing in (False, True):
        # dropout on: recomputation must replay the same masks
        model = GPT(
            _cfg(
                num_layers=3,
                hidden_dropout=0.2,
                attention_dropout=0.2,
                checkpoint_activations=checkpointing,
            )
        ).train()
        calls = []
        for block in model.blocks.values():
            # (a hook on the block itself would miss the recomputation, which stops early once its last needed
            # activation is rebuilt; the block's first LayerNorm runs in both passes)
            block.ln_1.register_forward_hook(lambda *args: calls.append(1))
        torch.manual_seed(7)
        # attention dropout from its own stream, replayed in the recomputation
        if streams != "default only":
            rng.seed(7)
        loss = model(ids, targets=ids)
        loss.backward()
        # with checkpointing every block runs twice: forward, then recomputed in backward
        assert len(calls) == (6 if checkpointing else 3)
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss0, grads0), (loss1, grads1) = results
    torch.testing.assert_close(loss1, loss0, atol=0, rtol=0)
    assert grads0.keys() == grads1.keys()
    for name in grads0:
        assert grads0[name] is not None, name
        torch.testing.assert_close(grads1[name], grads0[name], atol=1e-7, rtol=1e-6, msg=name)


# -----------------------------------------------------------------------------
# 6. Vocabulary padding


@pytest.mark.parametrize(
    "vocab,multiple,tp,expected",
    [
        (50257, 128, 1, 50304),
        (50257, 128, 4, 50688),
        (50257, 1, 1, 50257),
        (50257, 1, 2, 50258),
        (100, 8, 2, 112),
        (128, 128, 1, 128),
        (129, 128, 1, 256),
    ],
)
def test_padded_vocab_size(vocab, multiple, tp, expected):
    cfg = GPTConfig(
        vocab_size=vocab, make_vocab_size_divisible_by=multiple, tensor_model_parallel_size=tp
    )
    assert cfg.padded_vocab_size == expected
    assert expected % (multiple * tp) == 0 and vocab <= expected < vocab + multiple * tp


def test_generate_never_samples_padding_ids():
    cfg = _cfg(vocab_size=100, make_vocab_size_divisible_by=64, seq_length=8)  # padded to 128
    model = GPT(cfg).eval()
    with torch.no_grad():
        # final hidden state = all ones, so a token's logit is the sum of its embedding row: the 28 padding
        # rows get 1e3 * h and would take all the probability if they were sampled from.
        model.ln_f.weight.zero_()
        model.ln_f.bias.fill_(1.0)
        model.embed.word.weight[100:] = 1e3
    prompt = _ids(cfg, batch=3, length=4)
    with torch.no_grad():
        assert model(prompt)[:, -1].argmax(-1).min() >= 100  # the bias works
    g = torch.Generator().manual_seed(0)
    for top_k in (None, 5):
        out = model.generate(prompt, max_new_tokens=12, temperature=1.0, top_k=top_k, generator=g)
        assert out.shape == (3, 16)  # longer than seq_length: the context window slides
        assert torch.equal(out[:, :4], prompt)
        assert out.max() < 100 and out.min() >= 0


@pytest.mark.parametrize("embed_init", ["normal", "xavier_uniform"])
def test_padding_does_not_change_the_model(embed_init):
    """GPT-2's 50257 tokens padded to 50304 (TP=1) and to 50432 (TP=2's multiple): the real rows start the same,
    the padded rows are zeros, and loss and gradients are the same (the padding is masked out of the softmax)."""
    models = [
        GPT(
            _cfg(
                num_layers=1,
                vocab_size=50257,
                make_vocab_size_divisible_by=m,
                embed_init=embed_init,
            )
        )
        for m in (128, 256)
    ]
    assert [m.embed.word.weight.shape[0] for m in models] == [50304, 50432]
    a, b = (m.embed.word.weight for m in models)
    assert torch.equal(a[:50257], b[:50257])
    assert not a[50257:].any() and not b[50257:].any()
    x, y = _ids(models[0].config, length=9)[:, :-1], _ids(models[0].config, length=9, seed=1)[:, 1:]
    losses = [m(x, y) for m in models]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=0)
    torch.testing.assert_close(a.grad[:50257], b.grad[:50257], rtol=1e-5, atol=1e-7)
    assert not a.grad[50257:].any() and not b.grad[50257:].any()  # the padded rows never learn


# -----------------------------------------------------------------------------
# 7. A tiny model memorises a fixed batch (catches a broken backward)


def test_tiny_model_overfits_a_batch():
    cfg = _cfg(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=100)
    model = GPT(cfg).train()
    data = _ids(cfg, batch=4, length=17, seed=5)
    x, y = data[:, :-1], data[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for _ in range(50):
        opt.zero_grad(set_to_none=True)
        loss = model(x, targets=y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(100), rel=0.1)  # starts near uniform
    assert losses[-1] < 0.2 * losses[0], losses[::10]


def test_census_builds_the_model_without_importing_dynamo():
    """model.census builds the whole model on the meta device wherever parameters are counted (estimate.py's dry
    run builds nothing else). nn.Embedding's default normal_ on meta runs through torch._refs, which imports
    torch._dynamo: about 2 s of CPU per process, for a table init_weights draws again anyway. A fresh interpreter,
    so that no earlier test's imports count."""
    import subprocess
    import sys

    code = (
        "import sys, model; c = model.census(model.GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4,"
        " vocab_size=512)); print(c['parameters'], 'torch._dynamo' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    expected = sum(
        p.numel()
        for p in GPT(
            GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=512)
        ).parameters()
    )
    assert out == [str(expected), "False"]
