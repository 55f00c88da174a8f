"""tools/export_hf.py: GPT2LMHeadModel and BloomForCausalLM exports from TP=2 checkpoints (the vocabulary padding
of TP=2 dropped), logits checked by the tool itself and against a merge of the TP shards written here (so a wrong
merge in reshard.py, which the tool uses, is not exported and "verified"), greedy generation in transformers
against GPT.generate; a tiny ALiBi + embedding-LayerNorm model resumes bit-exactly; configurations neither class can
express are refused by name by hf.family, and exported with our own modeling file (tests/test_export_remote.py)."""

import dataclasses
import json
import os
import sys

import pytest
import torch

import data
import hf
import reshard
from helpers import (  # noqa: F401
    ROOT,
    assert_same_checkpoint,
    build_tokenizer_file,
    corpus,
    launch,
    losses,
    play_corpus,
    run_main,
)
from model import GPT, GPTConfig

sys.path.insert(0, os.path.join(ROOT, "tools"))
import export_hf  # noqa: E402

pytest.importorskip("transformers")

TINY = [
    "--num_layers=2",
    "--hidden_size=32",
    "--num_attention_heads=4",
    "--seq_length=32",
    "--micro_batch_size=2",
    "--global_batch_size=4",
    "--log_interval=1",
    "--eval_iters=0",
    "--device=cpu",
    "--split=1,0,0",
    "--hidden_dropout=0.1",
    "--attention_dropout=0.1",
    "--lr=1e-2",
    "--sample_tokens=0",
]


@pytest.mark.parametrize(
    "switches, message",
    [
        (dict(embed_layernorm=True), "learned position embeddings with embed_layernorm"),
        (dict(position_embedding_type="alibi"), "ALiBi without embed_layernorm"),
        (
            dict(position_embedding_type="alibi", embed_layernorm=True, activation="relu"),
            "activation='relu' to Bloom",
        ),
        (
            dict(position_embedding_type="alibi", embed_layernorm=True, activation="gelu"),
            "activation='gelu' to Bloom",
        ),
        (dict(normformer=True), "normformer=True"),
        (dict(scale_embeddings=True), "scale_embeddings=True"),
        (dict(qk_layernorm=True), "qk_layernorm=True"),
        (dict(position_embedding_type="rotary"), "position_embedding_type='rotary'"),
        (
            dict(position_embedding_type="rotary", embed_layernorm=True, activation="gelu_tanh"),
            "neither has rotary embeddings",
        ),
    ],
)
def test_what_no_class_expresses_is_refused_by_the_classes_and_exports_as_our_own(
    switches, message
):
    with pytest.raises(ValueError, match=message):
        hf.family(GPTConfig(**switches))
    # tests/test_export_remote.py
    assert export_hf.target_class(GPTConfig(**switches)) == "stablegpt"
    assert (
        export_hf.target_class(
            GPTConfig(stable_attention=True, apply_query_key_layer_scaling=True, z_loss=1e-4)
        )
        == "gpt2"
    )
    assert (
        export_hf.target_class(
            GPTConfig(position_embedding_type="alibi", embed_layernorm=True, activation="gelu_tanh")
        )
        == "bloom"
    )


@pytest.mark.slow
def test_gpt2_export_from_tp2(corpus, tmp_path):  # noqa: F811
    # GPT-2's real vocabulary: 50257 is padded to 50432 for TP=2, and the export must drop those rows
    launch(
        tmp_path,
        2,
        *TINY,
        f"--data_path={corpus}",
        "--vocab_size=50257",
        "--train_iters=2",
        "--tensor_model_parallel_size=2",
        f"--save={tmp_path / 'ckpt'}",
        "--activation=gelu_tanh",
        "--embed_layernorm=false",
    )
    diff, hf, tok = export_hf.export(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    assert diff <= 1e-5 and type(hf).__name__ == "GPT2LMHeadModel"
    assert hf.config.vocab_size == 50257 and hf.config.activation_function == "gelu_new"
    names = set(os.listdir(tmp_path / "hf"))
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    import transformers

    loaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    text = "ROMEO:\nBut soft, what light through yonder window breaks?"
    assert loaded(text)["input_ids"] == data.get_tokenizer().encode_ordinary(text)
    # against a merge that shares no code with the export's (reshard.py): the two shards concatenated here
    gpt = merged_by_hand(tmp_path / "ckpt" / "global_step2", tp=2)
    ids = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (gpt(ids)[..., :50257] - hf(ids).logits).abs().max().item() <= 1e-5
    # greedy generation in transformers is GPT.generate's
    _greedy_matches(hf, loaded, str(tmp_path / "ckpt"))


def merged_by_hand(tag_dir, tp):
    """The one-process model of a TP checkpoint (PP=1): each parameter's TP shards concatenated along the
    dimension where their shape differs from the one-process shape, the vocabulary padding cut and redone;
    replicated parameters must be equal on every rank. Independent of reshard.py, which the export uses."""
    files = [
        torch.load(tag_dir / f"mp_rank_{t:02d}_000_model_states.pt", weights_only=False)
        for t in range(tp)
    ]
    saved = files[0]["run"]["config"]
    cfg = GPTConfig(
        **{f.name: saved[f.name] for f in dataclasses.fields(GPTConfig) if f.name in saved}
    )
    cfg.tensor_model_parallel_size = 1
    gpt = GPT(cfg).eval()
    state = {}
    for name, full in gpt.state_dict().items():
        pieces = [f["model"][name] for f in files]
        if pieces[0].shape == full.shape:
            assert all(torch.equal(p, pieces[0]) for p in pieces), name
            state[name] = pieces[0]
            continue
        dim = next(d for d in range(full.dim()) if pieces[0].shape[d] != full.shape[d])
        real = cfg.vocab_size if pieces[0].shape[dim] * tp != full.shape[dim] else full.shape[dim]
        state[name] = torch.zeros_like(full)
        state[name].narrow(dim, 0, real).copy_(torch.cat(pieces, dim).narrow(dim, 0, real))
    gpt.load_state_dict(state)
    return gpt


@pytest.fixture(scope="module")
def play(tmp_path_factory):
    """A tokenizer.json of 400 tokens (</s> ends documents) and a play tokenized with it."""
    tmp = tmp_path_factory.mktemp("play")
    tokenizer_file = build_tokenizer_file(tmp / "tokenizer.json")
    return tokenizer_file, play_corpus(tokenizer_file, tmp)


def _greedy_matches(hf, tok, gpt_dir, prompt="ROMEO:\n", new=16):
    ids = torch.tensor([tok(prompt)["input_ids"]])
    gpt, _, _ = reshard.load_full_model(gpt_dir)
    ours = gpt.generate(ids, new, top_k=1)  # top-1 sampling is greedy
    theirs = hf.generate(ids, max_new_tokens=new, do_sample=False, min_new_tokens=new)
    assert ours.tolist() == theirs.tolist(), (tok.decode(ours[0]), tok.decode(theirs[0]))


@pytest.mark.slow
def test_bloom_export_from_tp2_generates_the_same_tokens(play, tmp_path):
    tokenizer_file, prefix = play
    launch(
        tmp_path,
        2,
        *TINY,
        f"--data_path={prefix}",
        f"--tokenizer_file={tokenizer_file}",
        "--vocab_size=400",
        "--position_embedding_type=alibi",
        "--embed_layernorm",
        "--activation=gelu_tanh",
        "--train_iters=4",
        "--tensor_model_parallel_size=2",
        f"--save={tmp_path / 'ckpt'}",
    )
    diff, hf, tok = export_hf.export(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    # not 512
    assert diff <= 1e-5 and type(hf).__name__ == "BloomForCausalLM" and hf.config.vocab_size == 400
    config = json.load(open(tmp_path / "hf" / "config.json"))
    assert config["eos_token_id"] == 2 and config["n_head"] == 4
    assert tok.eos_token == "</s>" and os.path.exists(tmp_path / "hf" / "tokenizer.json")
    _greedy_matches(hf, tok, str(tmp_path / "ckpt"))


def test_tiny_alibi_model_resumes_bit_exactly_and_exports(play, tmp_path):
    tokenizer_file, prefix = play
    args = [
        *TINY,
        f"--data_path={prefix}",
        f"--tokenizer_file={tokenizer_file}",
        "--vocab_size=400",
        "--position_embedding_type=alibi",
        "--embed_layernorm",
        "--activation=gelu_tanh",
        "--train_iters=6",
    ]
    straight = losses(run_main(*args, f"--save={tmp_path / 'straight'}"))
    run_main(*args, f"--save={tmp_path}", "--exit_interval=3")
    resumed = losses(run_main(*args, f"--load={tmp_path}", f"--save={tmp_path}"))
    assert sorted(resumed) == [4, 5, 6] and all(resumed[i] == straight[i] for i in resumed)
    assert_same_checkpoint(tmp_path, tmp_path / "straight", 6)  # bit-exact: weights, moments, RNG
    diff, hf, tok = export_hf.export(str(tmp_path), str(tmp_path / "hf"))
    assert diff <= 1e-5
    _greedy_matches(hf, tok, str(tmp_path))
