"""Every config's attention goes through the fused kernel (scaled_dot_product_attention), layer scaling and ALiBi
included; Megatron's explicit path runs only with unfused_attention, and computes the same function."""

import glob
import os

import pytest
import torch

import arguments
import model
from helpers import SMALL, corpus, run_main  # noqa: F401 (corpus: a fixture)
from model import GPT, GPTConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "config", "*.py")))
ATTENTION_KEYS = (
    "position_embedding_type",
    "apply_query_key_layer_scaling",
    "stable_attention",
    "qk_layernorm",
    "attention_dropout",
    "unfused_attention",
    "fp16",
    "bf16",
)


def attention_settings(name):
    """The config's attention keys after derive() (which fills apply_query_key_layer_scaling)."""
    cfg = arguments.derive(
        arguments.load_config([os.path.join(ROOT, "config", f"{name}.py")]), world_size=1
    )
    return {key: getattr(cfg, key) for key in ATTENTION_KEYS}


def tiny(settings, **kw):
    model_keys = {k: v for k, v in settings.items() if k not in ("fp16", "bf16")}
    base = dict(
        num_layers=3,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=16,
        vocab_size=300,
        make_vocab_size_divisible_by=128,
        hidden_dropout=0.0,
    )
    return GPTConfig(**{**base, **model_keys, **kw})


def forward_backward(gpt, ids):
    gpt.zero_grad()
    loss = gpt(ids, targets=ids.roll(-1, dims=1))
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in gpt.parameters()]


@pytest.mark.parametrize("name", CONFIGS)
def test_every_config_attention_is_fused_and_equals_the_explicit_path(name):
    settings = attention_settings(name)
    assert not settings["unfused_attention"], (
        f"config/{name}.py runs Megatron's explicit attention by default"
    )
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    explicit = GPT(tiny(settings, attention_dropout=0.0, unfused_attention=True)).double()
    fused = GPT(tiny(settings, attention_dropout=0.0)).double()
    fused.load_state_dict(explicit.state_dict())
    expected = forward_backward(explicit, ids)
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            model,
            "unfused_attention",
            lambda *a, **k: pytest.fail("the explicit attention path ran"),
        )
        mp.setattr(
            torch.nn.functional,
            "scaled_dot_product_attention",
            lambda *a, **k: calls.append(1) or sdpa(*a, **k),
        )
        loss, grads = forward_backward(fused, ids)
        assert len(calls) == 3  # one fused call per layer
        # float64: the same function, to rounding
        torch.testing.assert_close(loss, expected[0], atol=1e-12, rtol=0)
        for g, e in zip(grads, expected[1]):
            torch.testing.assert_close(g, e, atol=1e-10, rtol=1e-9)
        # the config's own dropout and half precision (bf16 where CPU fp16 is slow), still fused
        half = torch.bfloat16 if settings["fp16"] or settings["bf16"] else torch.float32
        with_dropout = GPT(tiny(settings)).to(half).train()
        loss, grads = forward_backward(with_dropout, ids)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads)
    # dropout and rounding move it a little, not a lot
    assert abs(loss.double() - expected[0]) < 0.1


def test_layer_scaling_is_only_a_rounding_difference_in_half_precision():
    # Megatron's explicit path with layer scaling against the fused kernel, bf16: close, not equal (they round
    # differently), so that bit-level reproduction of a 2021 run is a switch worth having.
    settings = attention_settings("tr8b_104b")
    assert settings["apply_query_key_layer_scaling"]
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    explicit = GPT(tiny(settings, attention_dropout=0.0, unfused_attention=True)).bfloat16().eval()
    fused = GPT(tiny(settings, attention_dropout=0.0)).bfloat16().eval()
    fused.load_state_dict(explicit.state_dict())
    with torch.no_grad():
        a, b = explicit(ids).double(), fused(ids).double()
    assert not torch.equal(a, b)
    assert (a - b).abs().max() < 0.05 * a.abs().max()


@pytest.mark.parametrize("kind", ["alibi", "rotary"])
def test_positions_are_built_once_per_length_in_the_compute_dtype(kind, monkeypatch):
    built = []
    make = {"alibi": "alibi_bias", "rotary": "rotary_cos_sin"}[kind]
    original = getattr(model, make)
    monkeypatch.setattr(model, make, lambda *a, **k: built.append(1) or original(*a, **k))
    gpt = GPT(tiny({"position_embedding_type": kind})).bfloat16()
    for T in (16, 16, 8, 8):
        ids = torch.randint(0, 300, (2, T), generator=torch.Generator().manual_seed(T))
        gpt(ids, targets=ids).backward()
        bias, rotary = gpt.positions_cache[1]
        tensor = bias if kind == "alibi" else rotary[0]
        assert tensor.dtype == torch.bfloat16 and tensor.shape[-2] == T
    assert len(built) == 2  # once per length, for every layer and micro-batch at that length


def test_unfused_attention_takes_alibi_bias_in_fp32():
    # Megatron's path adds the bias to the fp32 scores: it gets it in fp32, not rounded to the compute dtype first
    gpt = GPT(tiny({"position_embedding_type": "alibi", "unfused_attention": True})).bfloat16()
    gpt(torch.zeros(1, 8, dtype=torch.long))
    assert gpt.positions_cache[1][0].dtype == torch.float32


def test_alibi_bias_cache_matches_a_fresh_build():
    gpt = GPT(tiny({"position_embedding_type": "alibi"})).eval()
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        first = gpt(ids)
        gpt.positions_cache = (None, None)
        torch.testing.assert_close(gpt(ids), first, atol=0, rtol=0)


# -----------------------------------------------------------------------------
# On a GPU: the kernel actually chosen


@pytest.mark.cuda
@pytest.mark.parametrize("name", CONFIGS)
def test_fused_kernel_is_chosen_on_cuda(name):
    """Only flash and memory-efficient attention allowed: SDPA raises if neither takes the config's settings."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    settings = attention_settings(name)
    dtype = torch.float16 if settings["fp16"] else torch.bfloat16
    cfg = tiny(settings, hidden_size=256, num_attention_heads=4, seq_length=256)
    gpt = GPT(cfg).to("cuda", dtype).train()
    ids = torch.randint(0, 300, (2, 256), device="cuda")
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        gpt(ids, targets=ids).backward()
    if settings["position_embedding_type"] != "alibi":  # no bias: the flash kernel itself
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            gpt(ids, targets=ids).backward()


# -- attention_backend: SDPA's kernel chosen where attention is computed ---------------------------


def test_a_chosen_backend_computes_the_same_attention_and_one_that_cannot_says_so():
    """attention_backend=math on the CPU gives the unfused reference's output and gradients (the
    kernel is really switched: torch's own choice there is its flash kernel); a backend without a
    kernel for the call fails with one message naming the key and the fix, not a silent fall-back;
    an unknown name is refused by the config's check, before anything is built."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=g, requires_grad=True) for _ in range(3))
    grad = torch.randn(2, 4, 16, 8, generator=g)
    ref = model.unfused_attention(q, k, v)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spied(*args, **kwargs):  # which backends were enabled when SDPA ran
        calls.append(
            (torch.backends.cuda.math_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled())
        )
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.nn.functional, "scaled_dot_product_attention", spied)
        out = model.core_attention(q, k, v, backend="math")
    assert calls == [(True, False)]  # math alone
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.backends.cuda.flash_sdp_enabled()  # put back after the call
    with pytest.raises(
        ValueError,
        match=r"attention_backend=efficient: torch's efficient kernel does "
        r"not take this attention \(cpu.*--attention_backend=auto",
    ):
        model.core_attention(q, k, v, backend="efficient")
    gpt = GPT(tiny(attention_settings("tiny"), attention_backend="efficient"))  # the key reaches it
    with pytest.raises(ValueError, match="attention_backend=efficient: "):
        gpt(torch.zeros(1, 16, dtype=torch.long))
    with pytest.raises(
        ValueError, match="attention_backend='fa3' is not one of auto, flash, cudnn"
    ):
        GPTConfig(
            num_layers=1, hidden_size=32, num_attention_heads=4, attention_backend="fa3"
        ).check()


@pytest.mark.parametrize(
    "flags, message",
    [
        # refused at the first step, after the build
        (
            ["--attention_backend=flash", "--position_embedding_type=alibi"],
            "attention_backend=flash takes no bias, and ALiBi's is one",
        ),
        # never called: the explicit path takes no SDPA kernel
        (
            ["--attention_backend=math", "--unfused_attention"],
            "attention_backend=math does nothing with unfused_attention",
        ),
    ],
)
def test_a_backend_the_model_cannot_run_with_on_any_device_is_refused_before_the_build(
    flags, message
):
    with pytest.raises(ValueError, match=message):
        arguments.validate(arguments.load_config(["--train_iters=1", *flags]), reads_data=False)
    arguments.validate(arguments.load_config(["--train_iters=1", flags[1]]), reads_data=False)


@pytest.mark.parametrize(
    "flags, what",
    [
        (
            ["--attention_backend=efficient", "--attention_dropout=0"],
            "dropout 0.0, causal",
        ),  # no CPU kernel
        (["--attention_backend=flash", "--attention_dropout=0.1"], "dropout 0.1, causal"),
        # the documents' dense mask
        (
            ["--attention_backend=flash", "--attention_dropout=0", "--reset_attention_mask"],
            "dropout 0.0, a bias",
        ),
        # refused for any device: validate's
        (["--attention_backend=flash", "--position_embedding_type=alibi"], None),
    ],
)
def test_a_backend_this_device_cannot_run_is_refused_before_the_build(
    corpus, monkeypatch, flags, what
):
    """A kernel that does not take the model's attention on this device refused it at the first step, after the
    build and the checkpoint's load (minutes at scale). A refusal for every device is arguments.validate's."""
    import builders

    def build(*args, **kwargs):
        raise AssertionError("built")

    monkeypatch.setattr(builders, "build", build)
    with pytest.raises(ValueError, match=f"^{flags[0][2:]}") as refused:
        run_main(*SMALL, "--train_iters=1", *flags)
    if what:
        assert f"(cpu, torch.float32, head_dim 16, {what}" in str(refused.value)


def test_the_backend_probe_leaves_the_runs_random_streams_as_they_were():
    """The probe's dropout drew from the run's stream: a run with a named backend then drew other dropout masks
    (and other data orders where the CPU stream draws them) than the same run with auto."""
    cfg = GPTConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=2,
        seq_length=16,
        attention_backend="math",
        attention_dropout=0.5,
    )
    before = torch.get_rng_state()
    model.check_attention_backend(cfg, torch.device("cpu"), torch.float32)
    assert torch.equal(torch.get_rng_state(), before)
