"""estimate.py (the dry run) sizes the GPU that needs the most: native ZeRO-1 deals out whole parameters."""

import io
import os

import torch

import arguments
import estimate
import parallel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_deal_out_gives_each_parameter_to_the_least_loaded_rank():
    assert parallel.deal_out([10, 3, 3, 3, 3, 1], 2) == [0, 1, 1, 1, 1, 0]
    assert parallel.deal_out([], 4) == []


def test_tr11_dry_run_reports_the_rank_with_the_embedding_shard():
    # stage 0 of TP 4 x PP 12 x DP 8: the 899M-element embedding shard's optimizer state (12 B each) on one rank
    cfg = arguments.load_config([os.path.join(ROOT, "config", "tr11_176b.py")])
    out = io.StringIO()
    result = estimate.dry_run(cfg, world_size=384, file=out)
    assert round(result["model_states"] / 2**30, 1) == 32.3
    assert "32.30 GiB on the largest rank (an even share would be 27.82 GiB)" in out.getvalue()


def test_deepspeed_bf16_zero_stage_0_is_sized_as_the_zero_1_it_runs():
    """DeepSpeed with bf16 runs zero_stage=0 as ZeRO-1 (BF16_Optimizer, deepspeed_engine.ds_config): its optimizer
    state is sharded over DP, and the dry run sizes that, not an unsharded ZeRO-0."""
    results, lines = [], []
    for zero in (0, 1):
        cfg = arguments.load_config(
            ["--deepspeed", "--bf16", f"--zero_stage={zero}", "--global_batch_size=64"]
        )
        out = io.StringIO()
        results.append(estimate.dry_run(cfg, world_size=4, file=out)["model_states"])
        lines.append(next(line for line in out.getvalue().splitlines() if "<- configured" in line))
    assert results[0] == results[1]
    assert lines[0].startswith("  ZeRO-1 over DP=4:")
    assert lines[0].endswith("<- configured (zero_stage=0 runs as 1 under DeepSpeed with bf16)")
    assert lines[1].startswith("  ZeRO-1 over DP=4:") and lines[1].endswith("<- configured")


def test_the_dry_run_in_docs_parallelism_is_what_it_prints():
    """The page showed 2 B of gradients and 16 B of optimizer state per parameter (14.93 GiB) after the code had
    come to allocate 4 and 12 (14.43 GiB): the block is compared with the dry run itself."""
    command = "    $ WORLD_SIZE=256 python train.py config/tr8b_104b.py --dry_run\n"
    with open(os.path.join(ROOT, "docs", "parallelism.md")) as f:
        page = f.read()
    shown = page.split(command, 1)[1].split("\n\n", 1)[0]
    out = io.StringIO()
    cfg = arguments.load_config([os.path.join(ROOT, "config", "tr8b_104b.py")])
    estimate.dry_run(cfg, world_size=256, file=out)
    assert shown.splitlines() == [
        "    " + line for line in out.getvalue().rstrip("\n").splitlines()
    ]


# -----------------------------------------------------------------------------
# Activations per layer: the GPT-2 block, GQA's keys and values, SwiGLU's gate


def test_layer_activations_of_the_gpt2_block_are_korthikantis():
    """With Megatron's unfused attention, which keeps the B*H*T^2 scores; the fused kernels keep a log-sum-exp of
    each query's softmax instead (4asb in fp32)."""
    from model import GPTConfig

    s, b, h, a = 2048, 4, 1024, 16
    cfg = GPTConfig(hidden_size=h, num_attention_heads=a, unfused_attention=True)
    fused = GPTConfig(hidden_size=h, num_attention_heads=a)
    for t in (1, 2, 4):
        assert estimate.layer_activations(cfg, s, b, t) == s * b * h * (
            10 + 24 / t + 5 * a * s / (h * t)
        )
        assert (
            estimate.layer_activations(fused, s, b, t)
            == s * b * h * (10 + 24 / t) + 4 * a * s * b / t
        )


def test_fused_attention_keeps_its_output_and_a_log_sum_exp_per_query():
    """Measured: what autograd keeps of scaled_dot_product_attention (the CPU's flash kernel) besides q, k and v
    is its output (the output projection's input, 2sbh in bf16) and the softmax's log-sum-exp in fp32 (4asb),
    not the scores that layer_activations counts only for unfused_attention."""
    from model import core_attention

    b, a, s, d = 2, 4, 64, 16
    q, k, v = (torch.randn(b, a, s, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    skip = {t.untyped_storage().data_ptr() for t in (q, k, v)}
    kept = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        core_attention(q, k, v)
    assert sum(kept.values()) == 2 * s * b * a * d + 4 * a * s * b


def test_layer_activations_of_the_llama_block_by_hand():
    """Llama-3.2-1B's layer (h 2048, 32 query heads, 8 key/value heads of 64, SwiGLU of 8192) at s 2048, b 1,
    counted tensor by tensor in bytes: GQA keeps a quarter of MHA's keys and values, SwiGLU four tensors of f."""
    from model import GPTConfig

    cfg = GPTConfig(
        hidden_size=2048,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=8192,
        swiglu=True,
        normalization="rmsnorm",
        position_embedding_type="rotary",
    )
    s, h, f = 2048, 2048, 8192
    # norm, QKV and MLP inputs (bf16), two dropout masks (a byte each)
    replicated = 2 * s * h * 4 + s * h * 2
    q, k, v, proj_in = 2 * s * h, 2 * s * 8 * 64, 2 * s * 8 * 64, 2 * s * h
    scores = 4 * 32 * s  # the fused kernel's fp32 log-sum-exp of each query's softmax
    swiglu = 4 * (2 * s * f)  # gate out, up out, SiLU out, product
    for t in (1, 2, 4):
        expected = replicated + (q + k + v + proj_in + scores + swiglu) / t
        assert estimate.layer_activations(cfg, s, 1, t) == expected
    mha = GPTConfig(hidden_size=2048, num_attention_heads=32, ffn_hidden_size=8192, swiglu=True)
    assert (
        estimate.layer_activations(mha, s, 1) - estimate.layer_activations(cfg, s, 1)
        == 2 * 2 * s * h * 3 / 4
    )


def _saved_bytes(module, x):
    """Bytes of the tensors autograd keeps for backward in module(x), each storage once, leaving out the
    parameters and x itself: what the module adds to a layer's activations."""
    skip = {p.untyped_storage().data_ptr() for p in module.parameters()} | {
        x.untyped_storage().data_ptr()
    }
    kept = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(kept.values())


def test_mlp_activations_are_what_torch_keeps():
    """Measured: the bytes autograd keeps in bf16 for the GeLU MLP (4sbf) and SwiGLU (8sbf), tiny CPU modules."""
    from layers import SwiGLU
    from model import MLP, GPTConfig

    s, b, h, f = 16, 2, 32, 48
    x = torch.randn(s, b, h, dtype=torch.bfloat16, requires_grad=True)
    for swiglu, per_f in ((False, 4), (True, 8)):
        cfg = GPTConfig(hidden_size=h, num_attention_heads=4, ffn_hidden_size=f, swiglu=swiglu)
        module = (SwiGLU if swiglu else MLP)(cfg, parallel.Grid()).to(torch.bfloat16)
        assert _saved_bytes(module, x) == per_f * s * b * f
        attention_and_rest = estimate.layer_activations(
            GPTConfig(hidden_size=h, num_attention_heads=4, ffn_hidden_size=1, swiglu=swiglu), s, b
        )
        assert estimate.layer_activations(cfg, s, b) - attention_and_rest == per_f * s * b * (f - 1)
