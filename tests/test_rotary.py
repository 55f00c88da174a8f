"""Rotary position embeddings (position_embedding_type="rotary", GPT-NeoX's, as Megatron-DeepSpeed has
them): the rotation against a naive float64 one and its relative-position property; the whole model
against transformers' GPTNeoXForCausalLM (sequential residual, random weights, nothing downloaded);
the fused (SDPA) and unfused attention paths; activation checkpointing; TP=2 against one process; a
bit-exact resume; tools/export_hf.py refusing it by name."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

import model
import parallel
from helpers import (  # noqa: F401
    ROOT,
    SMALL,
    TINY,
    assert_same_checkpoint,
    corpus,
    gather,
    log_fields,
    losses,
    random_batches,  # (corpus is a fixture)
    run_main,
    spawn,
    stage,
)
from model import GPT, GPTConfig, apply_rotary, core_attention, rotary_cos_sin, unfused_attention


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
        position_embedding_type="rotary",
    )
    return GPTConfig(**{**base, **kw})


def _naive_rotation(x, base=10000.0):
    """Each feature pair (i, i + d/2) of position t turned by t * base^(-2i/d), one at a time."""
    *_, T, d = x.shape
    out = x.clone()
    for t in range(T):
        for i in range(d // 2):
            angle = t * base ** (-2 * i / d)
            a, b = x[..., t, i], x[..., t, i + d // 2]
            out[..., t, i] = a * math.cos(angle) - b * math.sin(angle)
            out[..., t, i + d // 2] = b * math.cos(angle) + a * math.sin(angle)
    return out


def test_rotation_equals_the_naive_one_and_scores_depend_on_the_distance_only():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 10, 8, dtype=torch.float64, generator=gen)
    cos, sin = rotary_cos_sin(10, 8, torch.float64)
    torch.testing.assert_close(apply_rotary(x, cos, sin), _naive_rotation(x), atol=1e-12, rtol=0)
    # the same q and k at every position: q_m . k_n depends on m - n only
    q, k = (
        torch.randn(1, 1, 1, 8, dtype=torch.float64, generator=gen).expand(1, 1, 10, 8)
        for _ in range(2)
    )
    scores = (apply_rotary(q, cos, sin) @ apply_rotary(k, cos, sin).transpose(-1, -2))[0, 0]
    for shift in range(1, 4):
        torch.testing.assert_close(
            scores.diagonal(-shift)[:-1], scores.diagonal(-shift)[1:], atol=1e-12, rtol=0
        )
    assert not torch.allclose(scores.diagonal(0)[0], scores.diagonal(-1)[0])


def test_model_equals_transformers_gpt_neox():
    transformers = pytest.importorskip("transformers")
    h, heads, layers, vocab, T = 48, 6, 2, 100, 24
    hf_cfg = transformers.GPTNeoXConfig(
        vocab_size=vocab,
        hidden_size=h,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * h,
        hidden_act="gelu",
        use_parallel_residual=False,
        max_position_embeddings=T,
        layer_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 1.0,
        },
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    hf_cfg._attn_implementation = "eager"  # an implementation independent of ours (we use SDPA)
    torch.manual_seed(0)
    hf = transformers.GPTNeoXForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # randomise everything, so that a wrong mapping shows
        for name, p in hf.named_parameters():
            p.normal_(
                1.0 if "norm" in name and name.endswith("weight") else 0.0,
                0.1 if p.ndim == 1 else 0.3,
            )
        hf.lm_head.weight.copy_(hf.gpt_neox.embed_in.weight)  # ours is tied
    sd = hf.state_dict()
    ours_sd = {
        "embed.word.weight": sd["gpt_neox.embed_in.weight"],
        "ln_f.weight": sd["gpt_neox.final_layer_norm.weight"],
        "ln_f.bias": sd["gpt_neox.final_layer_norm.bias"],
    }
    names = {
        "ln_1": "input_layernorm",
        "ln_2": "post_attention_layernorm",
        "attn.qkv": "attention.query_key_value",
        "attn.proj": "attention.dense",
        "mlp.fc1": "mlp.dense_h_to_4h",
        "mlp.fc2": "mlp.dense_4h_to_h",
    }
    for i in range(layers):
        for ours, theirs in names.items():  # NeoX's fused QKV is laid out head by head, as ours
            for kind in ("weight", "bias"):
                ours_sd[f"blocks.{i}.{ours}.{kind}"] = sd[f"gpt_neox.layers.{i}.{theirs}.{kind}"]
    ours = GPT(_cfg())
    ours.load_state_dict(ours_sd, strict=True)
    ids = torch.randint(0, vocab, (2, T), generator=torch.Generator().manual_seed(1))
    # float64: NeoX computes its angles in float32 (1e-7 relative), ~1e-6 in the logits
    for dtype, atol in ((torch.float64, 1e-5), (torch.float32, 2e-5)):
        with torch.no_grad():
            expected, logits = hf.to(dtype)(ids).logits, ours.to(dtype).eval()(ids)
        assert expected.std() > 1.0
        torch.testing.assert_close(logits, expected, atol=atol, rtol=0)

    # the rotation matters: without it the logits are different
    def no_turn(T, d, dtype, device, base):
        return torch.ones(T, d, dtype=dtype), torch.zeros(T, d, dtype=dtype)

    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(model, "rotary_cos_sin", no_turn)
        ours.positions_cache = (None, None)  # GPT.positions keeps what it built for this length
        assert not torch.allclose(ours(ids), expected, atol=1e-2)


@pytest.mark.parametrize(
    "switch",
    [
        dict(apply_query_key_layer_scaling=True),
        dict(stable_attention=True),
        dict(qk_layernorm=True),
    ],
)
def test_fused_and_unfused_attention_compute_the_same_rotary_model(switch, monkeypatch):
    """SDPA (the default, layer scaling included) against Megatron's explicit path (unfused_attention), in float64;
    SDPA is the one that runs by default, and with qk_layernorm the rotation comes after the norm."""
    ids = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(3))
    fused = GPT(_cfg(**switch)).double()
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        torch.nn.functional,
        "scaled_dot_product_attention",
        lambda *a, **k: calls.append(1) or sdpa(*a, **k),
    )
    with torch.no_grad():
        out = fused(ids)
        reference = GPT(
            _cfg(**{**switch, "apply_query_key_layer_scaling": True, "unfused_attention": True})
        ).double()
        reference.load_state_dict(fused.state_dict())
        calls_fused = len(calls)
        torch.testing.assert_close(out, reference(ids), atol=1e-12, rtol=0)
    assert calls_fused == 2  # one per layer: every variant is fused
    q, k, v = (
        torch.randn(2, 6, 64, 32, generator=torch.Generator().manual_seed(i)).bfloat16()
        for i in range(3)
    )
    cos, sin = rotary_cos_sin(64, 32)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    assert q.dtype == torch.bfloat16  # turned in the compute dtype, as Megatron-DeepSpeed does
    diff = (core_attention(q, k, v).double() - unfused_attention(q, k, v).double()).abs().max()
    assert diff < 0.05


def test_gradients_with_activation_checkpointing_and_no_position_parameters():
    ids = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(2))
    plain, ckpt = GPT(_cfg()).double(), GPT(_cfg(checkpoint_activations=True)).double()
    ckpt.load_state_dict(plain.state_dict())
    for m in (plain, ckpt):
        m.train()
        m(ids[:, :-1], targets=ids[:, 1:]).backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-12, rtol=0, msg=name)
    assert not any("position" in n for n, _ in plain.named_parameters())
    cfg = _cfg()
    assert cfg.num_parameters() == sum(p.numel() for p in plain.parameters())
    learned = _cfg(position_embedding_type="learned")
    assert learned.num_parameters() - cfg.num_parameters() == 24 * 48  # the position table
    with pytest.raises(ValueError, match=r"head size \(7\) must be even"):
        GPT(_cfg(hidden_size=42))


def _tp2_matches_one_process():
    """TP=2: each rank turns its own heads' q and k; loss, logits and grad norm are one process's."""
    g = parallel.grid
    torch.set_default_dtype(torch.float64)
    cfg = GPTConfig(
        **{**TINY, "position_embedding_type": "rotary"}, tensor_model_parallel_size=g.tp_size
    )
    real, parallel.grid = parallel.grid, parallel.Grid(1, 1, world_size=1, rank=0)
    try:  # the reference: the whole model in this process
        whole = GPT(cfg)
        whole.init_weights(1234)
        x, y = random_batches(0, 1, 2, 16, cfg.vocab_size)[0]
        ref_loss = whole(x, y)
        ref_loss.backward()
        ref_logits = whole(x)
        ref_norm = torch.stack([p.grad.norm() for p in whole.parameters()]).square().sum().sqrt()
    finally:
        parallel.grid = real
    split = stage(cfg)
    loss = split(x, y)
    loss.backward()
    parallel.reduce_gradients(split)
    assert math.isclose(loss.item(), ref_loss.item(), rel_tol=1e-12)
    torch.testing.assert_close(parallel.gather_from_tp(split(x)), ref_logits, atol=1e-12, rtol=0)
    assert math.isclose(parallel.grad_norm(split).item(), ref_norm.item(), rel_tol=1e-12)
    for (
        name,
        p,
    ) in split.named_parameters():  # replicated parameters: the same gradient on both ranks
        if getattr(p, "tp_dim", None) is None:
            assert all(torch.equal(other, p.grad) for other in gather(p.grad, g.tp_group)), name


def test_tp2_equals_one_process():
    spawn(_tp2_matches_one_process, 2, 2, 1)


def test_resume_is_bit_exact_and_exports_to_our_own_class(corpus, tmp_path):
    args = [*SMALL, "--position_embedding_type=rotary"]
    straight = run_main(*args, "--train_iters=6", f"--save={tmp_path / 'a'}")
    run_main(*args, "--train_iters=3", f"--save={tmp_path / 'b'}")
    resumed = run_main(
        *args, "--train_iters=6", f"--save={tmp_path / 'b'}", f"--load={tmp_path / 'b'}"
    )

    def numbers(out, after=0):
        return {i: (f["lm loss"], f["grad norm"]) for i, f in log_fields(out).items() if i > after}

    assert sorted(losses(resumed)) == [4, 5, 6] and numbers(resumed) == numbers(straight, after=3)
    assert_same_checkpoint(tmp_path / "a", tmp_path / "b", 6)  # weights, moments, RNG: bit for bit
    out = tmp_path / "hf"
    proc = subprocess.run(
        [sys.executable, "tools/export_hf.py", "--load", str(tmp_path / "a"), "--output", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    # no transformers class computes rotary in a GPT-2 block: the export carries our own (hf_remote/), and
    # export_hf.py checks its logits against ours before it says so
    assert proc.returncode == 0, proc.stderr
    assert "largest logit difference" in proc.stdout + proc.stderr
    config = json.loads((out / "config.json").read_text())
    assert "auto_map" in config and (out / "modeling_stablegpt.py").exists()
