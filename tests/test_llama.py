"""The Llama / OLMo 2 block (normalization=rmsnorm, swiglu, num_query_groups, untie_embeddings_and_output_weights,
add_bias_linear=False, rotary_base), each against a reference: TP and PP layouts against one process (float64,
loss and every gradient), LlamaForCausalLM of `transformers` (a random model made here, at Llama 2's real
vocabulary of 32000) imported into TP x PP layouts and exported back by tools/export_hf.py, RMSNorm's and rotary's
numerics in bf16 against fp32 values rounded once, and the order of qk-layernorm and rotary against a
hand-written attention.
"""

import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F

import hf
import parallel
from helpers import (  # noqa: F401
    ROOT,
    assert_same_checkpoint,
    corpus,
    gather,
    losses,
    random_batches,
    run_main,
    spawn,  # corpus, synthetic_corpus: fixtures
    stage,
    synthetic_corpus,
)
from layers import RMSNorm, document_ids, packed_inputs
from model import GPT, GPTConfig, llama3_frequencies, rotary_cos_sin
from sections import section

sys.path.insert(0, os.path.join(ROOT, "tools"))

LLAMA_TINY = dict(
    num_layers=4,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=48,
    seq_length=16,
    vocab_size=50,
    make_vocab_size_divisible_by=32,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    position_embedding_type="rotary",
    normalization="rmsnorm",
    swiglu=True,
    untie_embeddings_and_output_weights=True,
    add_bias_linear=False,
    rotary_base=500000.0,
)


# -----------------------------------------------------------------------------
# Every layout computes the one-process model


def _one_process(cfg, batches, packed=None):
    real, parallel.grid = parallel.grid, parallel.Grid(1, 1, world_size=1, rank=0)
    try:
        model = GPT(cfg)
        model.init_weights(1234)
        loss = sum(model(x, y, **(packed or {})) for x, y in batches) / len(batches)
        loss.backward()
        return loss.item(), {n: p.grad for n, p in model.named_parameters()}
    finally:
        parallel.grid = real


def _llama_layout(tp, pp):
    parallel.grid = g = parallel.Grid(tp, pp)
    torch.set_default_dtype(torch.float64)
    cfg = GPTConfig(**LLAMA_TINY, tensor_model_parallel_size=tp)
    batches = random_batches(0, 3, 2, 16, cfg.vocab_size)
    ref_loss, ref_grads = _one_process(cfg, batches)
    model = stage(cfg)
    parallel.attach_grad_buffer(model, torch.float64)
    parallel.grad_buffer(model).start(len(batches))
    if pp > 1:
        loss = parallel.pipeline_forward_backward(model, batches)
    else:
        loss = 0.0
        for x, y in batches:
            micro = model(x, y)
            (micro / len(batches)).backward()
            loss = loss + micro.detach() / len(batches)
    loss = parallel.average_loss(loss)
    parallel.reduce_gradients(model)
    assert math.isclose(loss.item(), ref_loss, rel_tol=1e-12), (g, loss.item(), ref_loss)
    names = [n for n, _ in model.named_parameters()]
    assert any(n.endswith("mlp.gate.weight") for n in names) and not any(
        n.endswith("bias") for n in names
    )
    # untied: no copy
    assert ("output_layer" in names) == g.is_last_stage and "output_weight" not in names
    for name, p in model.named_parameters():
        expected = parallel.shard(ref_grads[name], getattr(p, "tp_dim", None))
        torch.testing.assert_close(
            p.main_grad, expected, rtol=1e-9, atol=1e-12, msg=lambda m: f"{g} {name}: {m}"
        )
    if tp > 1:  # replicated RMSNorm gains: the same gradient on every TP rank, bit for bit
        for name, p in model.named_parameters():
            if getattr(p, "tp_dim", None) is None:
                assert all(torch.equal(o, p.main_grad) for o in gather(p.main_grad, g.tp_group)), (
                    name
                )
        # packed documents under TP: each rank's heads masked alike
        x, y = batches[0]
        x = x.clone()
        x[:, [4, 9]] = 0
        packed = packed_inputs(x, 0, reset_position_ids=True, reset_attention_mask=True)
        expected, _ = _one_process(cfg, [(x, y)], packed)
        with torch.no_grad():
            assert math.isclose(model(x, y, **packed).item(), expected, rel_tol=1e-12)


def _llama_layouts():
    for tp, pp in ((2, 1), (1, 2)):
        _llama_layout(tp, pp)


def test_llama_block_tp2_and_pp2_match_one_process():
    """GQA with TP splitting the groups, SwiGLU's two column-parallel layers, the vocab-parallel untied output
    layer (no tied-embedding all-reduce on PP), RMSNorm: loss and every gradient as one process computes them."""
    spawn(_llama_layouts, 2, 1, 1)


def test_a_layout_that_cannot_split_the_groups_is_refused_by_name():
    with pytest.raises(
        ValueError, match=r"num_query_groups \(1\) must be divisible by tensor_model_parallel_size"
    ):
        GPTConfig(**{**LLAMA_TINY, "num_query_groups": 1}).check(tp_size=2)
    with pytest.raises(
        ValueError, match=r"num_query_groups \(3\) must divide num_attention_heads \(4\)"
    ):
        GPTConfig(**{**LLAMA_TINY, "num_query_groups": 3}).check()


def test_swiglu_width_and_parameter_count():
    """Megatron's default width with swiglu (2/3 of 4h, a multiple of 64), and the count as built: an untied
    output layer adds its real rows, not its padding."""
    assert GPTConfig(hidden_size=2048, swiglu=True).ffn_size == 5440
    tied = GPTConfig(**{**LLAMA_TINY, "untie_embeddings_and_output_weights": False})
    untied = GPTConfig(**LLAMA_TINY)
    assert untied.num_parameters() - tied.num_parameters() == 50 * 32
    h, f, kv = 32, 48, 2 * 8  # two key/value heads of 8
    block = 2 * h + h * (h + 2 * kv) + h * h + 3 * h * f
    assert untied.num_parameters() == 4 * block + h + 2 * 50 * 32


# -----------------------------------------------------------------------------
# Numerics: RMSNorm and rotary in bf16, the order of qk-layernorm and rotary


def test_rmsnorm_statistics_in_fp32_in_bf16():
    """bf16 inputs: the result is the fp64 normalisation rounded once to bf16, then the gain (transformers'
    order), element for element; statistics taken in bf16 miss a fifth of the elements by an ulp or more."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 256, generator=gen, dtype=torch.float64) * 300 + 1000).to(torch.bfloat16)
    norm = RMSNorm(256, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(256, generator=gen) + 0.5)
        got = norm(x)
    x64 = x.double()
    expected = norm.weight * (x64 / (x64.square().mean(-1, keepdim=True) + 1e-6).sqrt()).to(
        torch.bfloat16
    )
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, expected)


def test_rotary_angles_are_fp32_rounded_once_in_a_bf16_model():
    """The cos and sin a bf16 model uses at long positions are the fp32 values rounded once to bf16, never angles
    computed in bf16 (off by up to 1.7 at position 4000)."""
    cfg = GPTConfig(**{**LLAMA_TINY, "seq_length": 4096, "rotary_base": 10000.0})
    gpt = GPT(cfg).to(torch.bfloat16)
    _, (cos, sin) = gpt.positions(torch.zeros(1, 4096, 32, dtype=torch.bfloat16))
    ref_cos, ref_sin = rotary_cos_sin(4096, 8, torch.float32)
    assert torch.equal(cos, ref_cos.to(torch.bfloat16)) and torch.equal(
        sin, ref_sin.to(torch.bfloat16)
    )
    exact_cos, _ = rotary_cos_sin(4096, 8, torch.float64)
    # bf16's rounding, not bf16's angles
    assert (cos.double() - exact_cos).abs().max() < 2**-8 + 1e-3
    # rotary_base reaches the angles
    base = GPTConfig(**LLAMA_TINY)
    _, (cos5, _) = GPT(base).positions(torch.zeros(1, 16, 32))
    assert torch.equal(cos5, rotary_cos_sin(16, 8, torch.float32, base=500000.0)[0])


def test_qk_layernorm_comes_before_rotary_against_a_hand_written_attention():
    """Attention.heads against q and k written out here: the fused projection split by group, each head's q and k
    normalised, then turned by angles computed here in float64 (the order OLMo 2 uses)."""
    torch.manual_seed(0)
    cfg = GPTConfig(**{**LLAMA_TINY, "qk_layernorm": True, "num_query_groups": 4, "num_layers": 1})
    gpt = GPT(cfg).double()
    attn = gpt.blocks["0"].attn
    with torch.no_grad():
        for p in (attn.q_norm.weight, attn.k_norm.weight):
            p.copy_(torch.rand(8, dtype=torch.float64) + 0.5)
    x = torch.randn(2, 16, 32, dtype=torch.float64)
    _, rotary = gpt.positions(x)
    q, k, _ = attn.heads(x, rotary)
    qkv = F.linear(x, attn.qkv.weight).view(2, 16, 4, 3, 8)
    pos = torch.arange(16, dtype=torch.float64).view(-1, 1)
    theta = pos * 500000.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    cos, sin = theta.cos()[:, None], theta.sin()[:, None]  # (seq, 1 head, d/2)

    def turn(t):  # feature i and i + 4 turn together by the angle of their frequency
        a, b = t[..., :4], t[..., 4:]
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)

    def rms(t, w):
        return w * t / (t.square().mean(-1, keepdim=True) + cfg.layernorm_epsilon).sqrt()

    expected_q = turn(rms(qkv[:, :, :, 0], attn.q_norm.weight)).transpose(1, 2)
    expected_k = turn(rms(qkv[:, :, :, 1], attn.k_norm.weight)).transpose(1, 2)
    torch.testing.assert_close(q, expected_q, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(k, expected_k, rtol=1e-12, atol=1e-12)


# -----------------------------------------------------------------------------
# transformers' LlamaForCausalLM both ways


def _llama_dir(path, tie, vocab=32000, seed=0, rope=None):
    """A random LlamaForCausalLM (GQA 8 heads / 2 groups, rope_theta 500000) saved in path, its weights drawn
    wide enough that every part of the model moves the logits."""
    import transformers

    torch.manual_seed(seed)
    c = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_parameters=rope or {"rope_type": "default", "rope_theta": 500000.0},
        tie_word_embeddings=tie,
        rms_norm_eps=1e-6,
    )
    model = transformers.LlamaForCausalLM(c).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.rand_like(p) + 0.5 if p.ndim == 1 else torch.randn_like(p) * 0.15)
    model.save_pretrained(path)
    return model


def _batch(vocab, seed=1, seq=32):
    ids = torch.randint(0, vocab, (2, seq + 1), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1], ids[:, 1:]


def _hf_loss(model, x, y):
    with torch.no_grad():
        logits = model(x).logits
    return F.cross_entropy(logits.flatten(0, 1), y.flatten()).item(), logits


def _imported(directory, tp=1):
    cfg = GPTConfig(
        **hf.config_from_hf(directory),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
    )
    return cfg


# Llama 2's, Llama 3's
@pytest.mark.parametrize("tie, vocab", [(False, 32000), (True, 32000), (False, 128256)])
def test_llama_import_first_loss_equals_transformers(tie, vocab, tmp_path):
    theirs = _llama_dir(tmp_path, tie, vocab)
    x, y = _batch(vocab)
    expected, logits = _hf_loss(theirs, x, y)
    cfg = _imported(tmp_path)
    assert (cfg.untie_embeddings_and_output_weights, cfg.num_query_groups, cfg.rotary_base) == (
        not tie,
        2,
        5e5,
    )
    ours = GPT(cfg)
    hf.load_into(ours, str(tmp_path))
    ours.eval()
    with torch.no_grad():
        loss = ours(x, y).item()
        our_logits = ours(x)[..., :vocab]
    assert logits.std() > 1.0  # the weights are wide enough for the logits to tell models apart
    assert abs(loss - expected) <= 1e-5 * expected, (loss, expected)
    torch.testing.assert_close(our_logits, logits, rtol=1e-4, atol=1e-4)


def _import_layouts(directory, expected):
    x, y = _batch(32000)
    for tp, pp in ((2, 1), (1, 2)):
        parallel.grid = g = parallel.Grid(tp, pp)
        cfg = _imported(directory, tp)
        model = stage(cfg)
        hf.load_into(model, directory)
        with torch.no_grad():
            loss = (
                parallel.pipeline_forward_backward(model, [(x, y)], forward_only=True)
                if pp > 1
                else model(x, y)
            )
        loss = parallel.average_loss(loss).item()
        assert abs(loss - expected) <= 1e-5 * expected, (g, loss, expected)


def test_llama_import_into_tp2_and_pp2_layouts(tmp_path):
    """The untied lm_head vocab-parallel on TP, on the last stage of PP: the first loss is transformers'."""
    theirs = _llama_dir(tmp_path, tie=False)
    expected, _ = _hf_loss(theirs, *_batch(32000))
    spawn(_import_layouts, 2, 1, 1, str(tmp_path), expected)


@pytest.mark.parametrize("tie", [False, True])
def test_llama_export_generates_the_same_logits(tie, tmp_path):
    """tools/export_hf.py's model and state of our Llama-block model: LlamaForCausalLM computes our logits, and the
    import of the export is the model we started from, bit for bit."""
    import export_hf

    cfg = GPTConfig(
        **{
            **LLAMA_TINY,
            "vocab_size": 32000,
            "untie_embeddings_and_output_weights": not tie,
            "hidden_size": 64,
            "num_attention_heads": 8,
            "ffn_hidden_size": None,
        }
    )
    ours = GPT(cfg).eval()
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        ours.embed.word.weight[32000:] = 0.0
        if not tie:
            ours.output_layer[32000:] = 0.0
    model, state = export_hf.hf_model(ours, eod=0)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"} and (not missing) == (not tie)
    model.tie_weights()
    model.eval().save_pretrained(tmp_path)
    x, _ = _batch(32000, seed=2)
    with torch.no_grad():
        theirs, mine = model(x[:, :16]).logits, ours(x[:, :16])[..., :32000]
    assert theirs.std() > 0.5
    torch.testing.assert_close(theirs, mine, rtol=1e-5, atol=1e-5)
    back = GPT(_imported(str(tmp_path)))
    hf.load_into(back, str(tmp_path))
    for (name, a), b in zip(ours.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), name


LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}  # Llama-3.2-1B's


def test_llama3_rope_frequencies_are_transformers():
    """use_rope_scaling's frequencies are LlamaRotaryEmbedding's for rope_type llama3, bit for bit (head size 64,
    Llama 3.2's factor 32: high, medium and low frequencies all present)."""
    import transformers
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    c = transformers.LlamaConfig(
        hidden_size=512, num_attention_heads=8, rope_parameters=dict(LLAMA3)
    )
    theirs = LlamaRotaryEmbedding(c).inv_freq
    plain = 1.0 / 500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)
    ours = llama3_frequencies(plain, 32.0)
    assert torch.equal(ours, theirs)
    wavelen = 2 * math.pi / plain
    assert (
        (wavelen < 2048).any()
        and (wavelen > 8192).any()
        and ((wavelen > 2048) & (wavelen < 8192)).any()
    )
    cos, _ = rotary_cos_sin(9000, 64, base=500000.0, scaling_factor=32.0)
    assert torch.equal(cos[8999, :32], torch.cos(8999 * ours))


def test_llama3_rope_scaling_imports_and_exports(tmp_path):
    """A LlamaForCausalLM with rope_type llama3 imports as use_rope_scaling (first loss and logits transformers'
    at 64 positions) and its config exports back; other llama3 constants than Llama 3's are refused by name."""
    theirs = _llama_dir(tmp_path, tie=False, rope=dict(LLAMA3, factor=8.0))
    x, y = _batch(32000, seq=64)
    expected, logits = _hf_loss(theirs, x, y)
    cfg = _imported(tmp_path)
    assert (cfg.use_rope_scaling, cfg.rope_scaling_factor) == (True, 8.0)
    ours = GPT(cfg)
    hf.load_into(ours, str(tmp_path))
    ours.eval()
    with torch.no_grad():
        loss, our_logits = ours(x, y).item(), ours(x)[..., :32000]
        unscaled = GPT(GPTConfig(**{**cfg.__dict__, "use_rope_scaling": False}))
        unscaled.load_state_dict(ours.state_dict())
        unscaled_logits = unscaled.eval()(x)[..., :32000]
    assert abs(loss - expected) <= 1e-5 * expected, (loss, expected)
    torch.testing.assert_close(our_logits, logits, rtol=1e-4, atol=1e-4)
    assert (unscaled_logits - logits).abs().max() > 1e-2  # the scaling shows at these positions
    hf.hf_config(cfg).save_pretrained(tmp_path / "export")
    assert hf.config_from_hf(str(tmp_path / "export")) == hf.config_from_hf(str(tmp_path))
    # another original context is one parameter (tests/test_hf_fixes.py); other frequency factors are refused
    _llama_dir(tmp_path / "other", tie=False, vocab=64, rope=dict(LLAMA3, low_freq_factor=2.0))
    with pytest.raises(ValueError, match=r"rope_type 'llama3' with \{'low_freq_factor': 2.0\}"):
        hf.config_from_hf(str(tmp_path / "other"))


@pytest.mark.slow
def test_imported_llama_resumes_bit_exactly(corpus, tmp_path):
    """train.py --init_from_hf of a random LlamaForCausalLM (GQA, untied, llama3 rope scaling) at GPT-2's
    vocabulary on the bundled corpus: 4 iterations straight, or 2, a save, and 2 more resumed -- the same losses
    and the same checkpoint bit for bit (weights, Adam's moments, the RNG streams)."""
    _llama_dir(tmp_path / "llama", tie=False, vocab=50257, rope=dict(LLAMA3, factor=8.0))
    argv = [
        "config/finetune.py",
        f"--init_from_hf={tmp_path / 'llama'}",
        f"--data_path={corpus}",
        "--bf16=false",
        "--micro_batch_size=2",
        "--global_batch_size=4",
        "--log_interval=1",
        "--eval_iters=0",
        "--lr_warmup_samples=0",
        "--lr=1e-3",
        "--lr_decay_samples=40",
        "--save_interval=none",
    ]
    straight = run_main(*argv, "--train_iters=4", f"--save={tmp_path / 'a'}")
    run_main(*argv, "--train_iters=2", f"--save={tmp_path / 'b'}")
    resumed = run_main(*argv, "--train_iters=4", f"--save={tmp_path / 'b'}")
    assert "not loaded: resuming from the checkpoint" in resumed
    assert losses(resumed) == {i: losses(straight)[i] for i in (3, 4)}
    assert_same_checkpoint(tmp_path / "a", tmp_path / "b", 4)


# -----------------------------------------------------------------------------
# config/llama_1b.py


def test_llama_1b_config_counts_llama_3_2_1b_and_dry_runs():
    """1,235,814,400 parameters: Llama-3.2-1B's (its safetensors hold 1.236B with the tied lm_head once)."""
    import io

    import arguments
    import estimate

    cfg = arguments.load_config([os.path.join(ROOT, "config", "llama_1b.py")])
    model_cfg = section(GPTConfig, cfg)
    assert model_cfg.num_parameters() == 1_235_814_400 and model_cfg.ffn_size == 8192
    out = io.StringIO()
    report = estimate.dry_run(cfg, world_size=8, file=out)
    assert report["dp"] == 8 and "1.24B parameters" in out.getvalue()


@pytest.mark.slow
def test_llama_1b_config_trains_one_cpu_iteration_at_reduced_size():
    from helpers import losses, run_main

    out = run_main(
        "config/llama_1b.py",
        "--data_path=data/shakespeare-v2",
        "--num_layers=2",
        "--hidden_size=64",
        "--num_attention_heads=4",
        "--num_query_groups=2",
        "--ffn_hidden_size=128",
        "--seq_length=64",
        "--vocab_size=50257",
        "--micro_batch_size=2",
        "--global_batch_size=2",
        "--train_iters=1",
        "--lr_warmup_samples=0",
        "--log_interval=1",
        "--eval_interval=1000",
        "--eval_iters=1",
        "--sample_tokens=0",
        "--save=none",
        "--save_interval=none",
    )
    assert list(losses(out)) == [1] and math.isfinite(float(losses(out)[1]))


def test_init_from_hf_without_a_config_file_takes_the_model_s_keys(tmp_path):
    """`python train.py --init_from_hf=DIR`: the implicit default config's model keys (config/tiny.py's 4 x 128 and
    its embedding LayerNorm) yield to the model; a key given on the command line that contradicts it does not."""
    import arguments

    _llama_dir(tmp_path, tie=False, vocab=512)
    cfg = arguments.load_config([f"--init_from_hf={tmp_path}"])
    assert (
        cfg.num_layers,
        cfg.hidden_size,
        cfg.embed_layernorm,
        cfg.normalization,
        cfg.num_query_groups,
    ) == (2, 64, False, "rmsnorm", 2)
    hf.check_config(section(GPTConfig, cfg), str(tmp_path))
    with pytest.raises(ValueError, match=r"num_layers 3 \(config\) vs 2 \(model\)"):
        arguments.load_config([f"--init_from_hf={tmp_path}", "--num_layers=3"])


def test_init_from_hf_with_a_config_file_refuses_a_command_line_model_key(tmp_path):
    """config/finetune.py sets training keys only: a model key typed beside it (--num_layers=3 for a 2-layer model)
    is the user's and contradicts the model, not a value for the model's own to replace in silence."""
    import arguments

    _llama_dir(tmp_path, tie=False, vocab=512)
    cfg = arguments.load_config(["config/finetune.py", f"--init_from_hf={tmp_path}"])
    assert (cfg.num_layers, cfg.hidden_size) == (2, 64)
    with pytest.raises(ValueError, match=r"num_layers 3 \(config\) vs 2 \(model\)"):
        arguments.load_config(
            ["config/finetune.py", f"--init_from_hf={tmp_path}", "--num_layers=3"]
        )


# -----------------------------------------------------------------------------
# Packed documents that do not see each other


@pytest.mark.parametrize(
    "block",
    [
        dict(position_embedding_type="learned"),
        dict(position_embedding_type="alibi", embed_layernorm=True),
        LLAMA_TINY,
        {**LLAMA_TINY, "unfused_attention": True},
    ],
)
def test_packed_documents_compute_each_document_alone(block):
    """The logits of a packed sample (documents separated by the end-of-document token, layers.document_ids) equal
    those of each document run on its own, in float64: attention within the document, positions from 0."""
    eod = 0
    cfg = GPTConfig(
        **{
            **dict(
                num_layers=2,
                hidden_size=32,
                num_attention_heads=4,
                seq_length=24,
                vocab_size=50,
                make_vocab_size_divisible_by=32,
                hidden_dropout=0.0,
                attention_dropout=0.0,
            ),
            **block,
            "seq_length": 24,
        }
    )
    gpt = GPT(cfg).double().eval()
    tokens = torch.randint(1, 50, (2, 24), generator=torch.Generator().manual_seed(0))
    # the second sample starts with an empty document and has two eods in a row
    cuts = ([6, 15], [0, 11, 12])
    for row, ends in enumerate(cuts):
        tokens[row, ends] = eod
    documents = document_ids(tokens, eod)
    with torch.no_grad():
        packed = gpt(
            tokens, **packed_inputs(tokens, eod, reset_position_ids=True, reset_attention_mask=True)
        )
        unmasked = gpt(tokens)
        for row, ends in enumerate(cuts):
            bounds = [0] + [e + 1 for e in ends] + [24]
            for a, b in zip(bounds, bounds[1:]):
                alone = gpt(tokens[row : row + 1, a:b])[0]
                torch.testing.assert_close(packed[row, a:b], alone, rtol=1e-10, atol=1e-10)
    # the documents did see each other without it
    assert not torch.allclose(packed, unmasked, atol=1e-3)
    # an eod belongs to the document it ends
    assert documents[1].tolist()[:14] == [0] + [1] * 11 + [2, 3]


@pytest.mark.slow
def test_untied_gqa_checkpoint_of_tp2_exports_as_llama(synthetic_corpus, tmp_path):
    """train.py at TP=2 with the Llama block saves; tools/export_hf.py gathers it into one process (reshard.py:
    the untied output layer's vocab-parallel slices re-padded) and LlamaForCausalLM computes its logits."""
    import export_hf
    from helpers import launch

    llama = [
        "--position_embedding_type=rotary",
        "--normalization=rmsnorm",
        "--swiglu",
        "--num_query_groups=2",
        "--untie_embeddings_and_output_weights",
        "--add_bias_linear=False",
        "--rotary_base=500000",
        "--embed_layernorm=False",
    ]
    launch(
        tmp_path / "logs",
        2,
        "--tensor_model_parallel_size=2",
        *llama,
        "--train_iters=2",
        f"--data_path={synthetic_corpus}",
        f"--save={tmp_path / 'ckpt'}",
        "--save_interval=2",
    )
    diff, model, _ = export_hf.export(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    assert type(model).__name__ == "LlamaForCausalLM" and not model.config.tie_word_embeddings
    assert diff <= 1e-5
