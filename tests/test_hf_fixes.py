"""Issue 40's smaller Hugging Face items, and the bugs a mutation audit found no test catching: each test's docstring
names the bug it catches. Every model is a random one made here (nothing is downloaded)."""

import json
import math
import os
import sys

import pytest
import torch

import arguments
import hf
import loader
import run_state
import usage
from helpers import ROOT, build_tokenizer_file, corpus, play_corpus, run_main, write_checkpoint  # noqa: F401
from model import GPT, GPTConfig

sys.path.insert(0, os.path.join(ROOT, "tools"))
import export_hf  # noqa: E402

LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _llama(path, vocab=512, rope=None, seed=0, **config):
    """A random LlamaForCausalLM (GQA: 8 heads, 2 groups; untied) saved in path, its weights wide enough that
    every part of the model moves the logits."""
    import transformers

    torch.manual_seed(seed)
    c = transformers.LlamaConfig(
        **{
            "vocab_size": vocab,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "max_position_embeddings": 64,
            "rms_norm_eps": 1e-6,
            "rope_parameters": rope or {"rope_type": "default", "rope_theta": 500000.0},
            "tie_word_embeddings": False,
            **config,
        }
    )
    model = transformers.LlamaForCausalLM(c).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.rand_like(p) + 0.5 if p.ndim == 1 else torch.randn_like(p) * 0.15)
    model.save_pretrained(path)
    return model


def _imported(directory):
    cfg = GPTConfig(**hf.config_from_hf(str(directory)), hidden_dropout=0.0, attention_dropout=0.0)
    gpt = GPT(cfg)
    hf.load_into(gpt, str(directory))
    return gpt.eval()


# -----------------------------------------------------------------------------
# The exporter: the imported model's token ids and context


@pytest.fixture(scope="module")
def play(tmp_path_factory):
    """A 400-token tokenizer.json and the play tokenized with it."""
    tmp = tmp_path_factory.mktemp("play")
    tokenizer_file = build_tokenizer_file(tmp / "tokenizer.json")
    return tokenizer_file, play_corpus(tokenizer_file, tmp)


@pytest.mark.slow
def test_export_keeps_the_imported_llamas_token_ids_and_context(play, tmp_path):
    """Catches: the exporter writing the training tokenizer's end of document (GPT-2's 50256 when no tokenizer_file
    is set, out of a 512-token vocabulary) as bos/eos instead of the imported model's ids, and seq_length (32) as
    max_position_embeddings instead of the imported Llama's context (4096); and the record of the import lost on
    resume. train.py --init_from_hf runs 1 iteration, saves, resumes for one more; each export keeps 7, 9, 4096."""
    _, prefix = play
    _llama(tmp_path / "llama", bos_token_id=7, eos_token_id=9, max_position_embeddings=4096)
    argv = [
        "config/finetune.py",
        f"--init_from_hf={tmp_path / 'llama'}",
        f"--data_path={prefix}",
        "--bf16=false",
        "--seq_length=32",
        "--micro_batch_size=1",
        "--global_batch_size=1",
        "--eval_iters=0",
        "--lr_warmup_samples=0",
        "--lr_decay_samples=40",
        "--log_interval=1",
        "--save_interval=none",
        f"--save={tmp_path / 'ckpt'}",
    ]
    run_main(*argv, "--train_iters=1")
    for iteration in (1, 2):
        if iteration == 2:
            run_main(*argv, "--train_iters=2")
        # the second replaces the first: an earlier export of ours (tools/export_hf.py's --overwrite)
        export_hf.export(str(tmp_path / "ckpt"), str(tmp_path / "hf"), overwrite=iteration == 2)
        config = json.load(open(tmp_path / "hf" / "config.json"))
        assert (config["bos_token_id"], config["eos_token_id"]) == (7, 9), (iteration, config)
        assert config["max_position_embeddings"] == 4096, (iteration, config)


def test_export_token_ids_of_a_run_not_imported_are_its_tokenizers_only_where_they_are_the_models(
    tmp_path,
):
    """Catches: a rotary model of 512 tokens trained without tokenizer_file (no import) exported with GPT-2's 50256
    as bos/eos, an id it does not have. Its token ids are left unset; at GPT-2's vocabulary they are 50256."""
    argv = [
        "--num_layers=1",
        "--hidden_size=32",
        "--num_attention_heads=4",
        "--seq_length=16",
        "--position_embedding_type=rotary",
        "--normalization=rmsnorm",
        "--swiglu",
        "--add_bias_linear=false",
        "--untie_embeddings_and_output_weights",
        "--embed_layernorm=false",
        "--micro_batch_size=1",
        "--global_batch_size=1",
    ]
    write_checkpoint(str(tmp_path / "ckpt"), [*argv, "--vocab_size=512"], lambda stage: None)
    export_hf.export(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    config = json.load(open(tmp_path / "hf" / "config.json"))
    assert (config["bos_token_id"], config["eos_token_id"]) == (None, None)
    assert config["max_position_embeddings"] == 16
    gpt2_vocab = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=50257)
    assert export_hf.export_keys(gpt2_vocab, None, None) == {
        "bos_token_id": 50256,
        "eos_token_id": 50256,
    }


def test_run_state_records_the_import_and_old_checkpoints_load():
    """Catches: the import's record (hf_origin) not carried by the run state, or a checkpoint written before it
    existed no longer loading into a RunState."""
    state = run_state.RunState()
    older = {
        "iteration": 3,
        "consumed_samples": 24,
        "consumed_tokens": 768,
        "scheduler_samples": 24,
        "scheduler_tokens": 768,
        "optimizer_reset": None,
        "callbacks": {},
        "history": {"loss": [], "grad norm": []},
    }
    state.load(older)  # as written before hf_origin was kept (its migration: checkpoint.MIGRATIONS)
    assert state.hf_origin is None and state.iteration == 3
    state.load({**older, "iteration": 4, "consumed_samples": 32, "hf_origin": {"eos_token_id": 2}})
    assert state.hf_origin == {"eos_token_id": 2}


# -----------------------------------------------------------------------------
# Messages and --help


def test_llama_data_of_another_tokenizer_names_the_models_tokenizer(corpus, tmp_path):  # noqa: F811
    """Catches: a Llama of 32000 tokens on the GPT-2-tokenized bundled corpus told to 'set vocab_size to at least
    50257' (which init_from_hf refuses) instead of tokenizing the data with the model's tokenizer.json."""
    _llama(tmp_path / "llama", vocab=32000)
    cfg = arguments.load_config(
        ["config/finetune.py", f"--init_from_hf={tmp_path / 'llama'}", f"--data_path={corpus}"]
    )
    context = loader.DataContext(cfg.seq_length, cfg.vocab_size, cfg.init_from_hf, False, 0, 1)
    with pytest.raises(ValueError) as e:
        loader.check_data(cfg.split, context, [corpus], train_samples=10)
    tokenizer = os.path.join(str(tmp_path / "llama"), "tokenizer.json")
    assert f"--tokenizer-file {tokenizer}" in str(e.value) and f"tokenizer_file={tokenizer}" in str(
        e.value
    )
    assert "at least" not in str(e.value)
    plain = loader.DataContext(64, 32000, None, False, 0, 1)  # no import: the old advice
    with pytest.raises(ValueError, match="set vocab_size to at least 50257"):
        loader.check_data("969,30,1", plain, [corpus], train_samples=10)


def test_help_names_llama_for_init_from_hf():
    """Catches: --help describing init_from_hf as a GPT-2 or BLOOM directory only."""
    (meaning,) = [f[5] for f in usage.config_fields() if f[2] == "init_from_hf"]
    assert all(name in meaning for name in ("GPT-2", "BLOOM", "Llama")), meaning


# -----------------------------------------------------------------------------
# llama3 rope scaling: its factor and its original context


@pytest.mark.parametrize("factor, original", [(4.0, 8192), (16.0, 1024)])
def test_llama3_rope_scaling_factor_and_original_context_import_and_export(
    factor, original, tmp_path
):
    """Catches: the llama3 factor read from another key than `factor` on import (every other test uses Llama 3's 8,
    the fallback), and an original_max_position_embeddings other than Llama 3's 8192 refused or ignored. Both
    are imported (logits transformers' at 64 positions, where another factor or context moves them) and exported
    (the config's rope parameters; the exported model's logits)."""
    rope = dict(LLAMA3, factor=factor, original_max_position_embeddings=original)
    theirs = _llama(tmp_path / "llama", rope=rope)
    ours = _imported(tmp_path / "llama")
    assert (ours.config.rope_scaling_factor, ours.config.original_max_position_embeddings) == (
        factor,
        original,
    )
    x = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(x).logits
        logits = ours(x)[..., :512]
        llama3 = GPT(
            GPTConfig(
                **{
                    **ours.config.__dict__,
                    "rope_scaling_factor": 8.0,
                    "original_max_position_embeddings": 8192,
                }
            )
        )
        llama3.load_state_dict(ours.state_dict())
        # Llama 3's constants are not these
        assert (llama3.eval()(x)[..., :512] - expected).abs().max() > 1e-3
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    exported, state = export_hf.hf_model(ours, keys={})
    missing, unexpected = exported.load_state_dict(state, strict=False)
    assert not missing and not unexpected
    parameters = exported.config.rope_parameters
    assert (parameters["factor"], parameters["original_max_position_embeddings"]) == (
        factor,
        original,
    )
    with torch.no_grad():
        torch.testing.assert_close(exported.eval()(x).logits, expected, rtol=1e-5, atol=1e-5)


# -----------------------------------------------------------------------------
# Grouped-query attention on every attention path, and in the telemetry probe

GQA = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=8,
    num_query_groups=2,
    seq_length=16,
    vocab_size=64,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
PATHS = {
    "unfused": dict(unfused_attention=True),
    "unfused, layer scaling": dict(unfused_attention=True, apply_query_key_layer_scaling=True),
    "unfused, stable": dict(unfused_attention=True, stable_attention=True),
    "unfused, attention dropout (eval)": dict(unfused_attention=True, attention_dropout=0.1),
    "layer scaling": dict(apply_query_key_layer_scaling=True),
    "stable": dict(stable_attention=True),
    "attention dropout (eval)": dict(attention_dropout=0.1),
}


def _wide(gpt):
    """Weights wide enough that attention is far from uniform: a head paired with another group's key moves the
    output well beyond fp32 rounding."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in gpt.parameters():
            p.copy_(torch.rand_like(p) + 0.5 if p.ndim == 1 else torch.randn_like(p) * 0.3)
    return gpt.eval()


@pytest.mark.parametrize("positions", ["rotary", "alibi"])
def test_gqa_every_attention_path_equals_the_fused_one(positions):
    """Catches: the key/value heads of grouped-query attention (8 heads, 2 groups) repeated in the wrong order on
    the unfused path (repeat instead of repeat_interleave: head h must use group h // 4, not h % 2), which
    unfused_attention (with layer scaling, stable attention or dropout) selects. Every path's output equals the
    fused one's (SDPA's enable_gqa) on the same weights within fp32 rounding, with and without packed documents."""
    base = {
        **GQA,
        "position_embedding_type": positions,
        "embed_layernorm": positions == "alibi",
        "activation": "gelu_tanh",
    }
    ref = _wide(GPT(GPTConfig(**base)))
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    documents = torch.tensor([[0] * 5 + [1] * 11, [0] * 9 + [1] * 7])
    with torch.no_grad():
        expected, expected_docs = ref(x), ref(x, documents=documents)
        for name, switches in PATHS.items():
            other = GPT(GPTConfig(**{**base, **switches})).eval()
            other.load_state_dict(ref.state_dict())
            torch.testing.assert_close(other(x), expected, rtol=1e-5, atol=1e-5, msg=name)
            torch.testing.assert_close(
                other(x, documents=documents),
                expected_docs,
                rtol=1e-5,
                atol=1e-5,
                msg=f"{name}, packed documents",
            )


def test_telemetry_attention_logits_of_gqa_pair_each_head_with_its_groups_key():
    """Catches: the telemetry probe of attention logits given the key heads in the wrong order under grouped-query
    attention (repeat instead of repeat_interleave). Its largest logit and lowest head entropy per layer equal a
    direct computation in which query head h meets key head h // (heads / groups)."""
    from stability import telemetry

    gpt = _wide(GPT(GPTConfig(**GQA, position_embedding_type="rotary")))
    heads, per_group = 8, 8 // 2
    seen = {}
    for layer, block in gpt.blocks.items():

        def heads_of(x, rotary=None, heads_fn=block.attn.heads, layer=int(layer)):
            seen[layer] = heads_fn(x, rotary)
            return seen[layer]

        block.attn.heads = heads_of
    recorder = telemetry.Telemetry(gpt, gpt.config)
    recorder.begin()
    with torch.no_grad():
        gpt(torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1)))
    stats = recorder.finish()
    for layer, (q, k, _) in sorted(seen.items()):
        T, D = q.shape[-2], q.shape[-1]
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        largest, entropies = -math.inf, []
        for h in range(heads):
            scores = (q[:, h] @ k[:, h // per_group].transpose(-1, -2) / math.sqrt(D)).masked_fill(
                ~causal, -math.inf
            )
            largest = max(largest, scores.max().item())
            probs = scores.softmax(-1)
            entropies.append(-torch.special.xlogy(probs, probs).sum(-1).mean().item())
        assert math.isclose(stats["attention logit max"][layer], largest, rel_tol=1e-5), layer
        assert math.isclose(stats["attention entropy min"][layer], min(entropies), rel_tol=1e-5), (
            layer
        )


# -----------------------------------------------------------------------------
# An untied output layer's initialisation


def test_untied_output_layer_is_drawn_independently_of_the_embedding():
    """Catches: an untied output layer initialised from the word embedding's stream (a copy, a permutation or a
    scaled copy of it) instead of a stream of its own. The two are uncorrelated and hold different values; each is
    the same from the same seed and another from another seed."""
    cfg = GPTConfig(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=500,
        untie_embeddings_and_output_weights=True,
    )

    def weights(seed):
        gpt = GPT(cfg, seed=seed)
        return gpt.embed.word.weight[:500].detach().clone(), gpt.output_layer[:500].detach().clone()

    embed, output = weights(1234)
    assert not torch.equal(embed, output)
    # not a permutation
    assert not torch.equal(embed.flatten().sort().values, output.flatten().sort().values)
    correlation = torch.corrcoef(torch.stack([embed.flatten(), output.flatten()]))[0, 1].item()
    # 32000 pairs: ~0.0056 for independent draws; 1 for a copy
    assert abs(correlation) < 0.03, correlation
    # each output row's best match among the embedding's rows: ~0.4 by chance over 500 rows of 64 features, 1 for
    # rows copied, scaled or moved
    best = torch.corrcoef(torch.cat([embed, output]))[500:, :500].abs().max(dim=1).values
    assert best.mean() < 0.6, best.mean()
    again = weights(1234)
    assert torch.equal(again[0], embed) and torch.equal(again[1], output)
    other = weights(99)
    assert not torch.equal(other[0], embed) and not torch.equal(other[1], output)
