"""Hugging Face `transformers` models (GPT2LMHeadModel, BloomForCausalLM, LlamaForCausalLM) <-> stablegpt, with one
mapping used both ways: importing a model directory here, exporting a checkpoint in tools/export_hf.py.

    keys = hf.config_from_hf(DIR)    # our config keys of the model in DIR: num_layers=12, ..., activation=gelu_tanh
    hf.check_config(cfg, DIR)        # a config key that contradicts the model: one ValueError naming both values
    hf.load_into(model, DIR)         # this rank's slices of every weight, on any TP x PP layout

DIR is a local directory as `save_pretrained` writes it (or as downloaded beforehand: `huggingface-cli download
gpt2 --local-dir gpt2`): config.json and model.safetensors or pytorch_model.bin, possibly sharded with an
*.index.json. Nothing is downloaded. Each rank reads the tensors of its own pipeline stage one at a time
(memory-mapped: the largest, the word embedding, is the peak) and keeps its TP slice.

The mapping (CONFIG, WEIGHTS, BLOCK): our config key or parameter name <-> theirs, and the layout steps between
the two tensors (STEPS), each with its inverse:
- "conv1d": GPT-2's Conv1D stores a linear layer as (in, out), nn.Linear as (out, in): transposed;
- "qkv": GPT-2's fused c_attn is [q | k | v] along its outputs (each heads x head_dim), ours is head by head,
  [heads, 3, head_dim] (Megatron's, so that a TP slice is a set of whole heads); BLOOM's query_key_value is
  already head by head;
- "vocab": their vocab_size rows, ours padded with zero rows to a multiple of make_vocab_size_divisible_by x TP
  (lesson 16), as the model initialises them (padded rows are never looked up and are masked out of the softmax);
- "positions": GPT-2's n_positions rows; a shorter seq_length keeps the first ones (the same function on the
  sequences it sees);
- "gqa": Llama's q_proj, k_proj and v_proj (three tensors: ours is a tuple of their names) are one fused qkv here,
  group by group, [groups, q heads of the group + k + v, head_dim] (Megatron's GQA layout, so that a TP slice is a
  set of whole groups). Llama's rotate_half turns features (i, i + d/2), as our rotary does: no permutation.
The output layer is the word embedding in GPT-2 and BLOOM (tied); on a last pipeline stage without the embedding
its copy (reshard.TIED_COPY) gets the same rows. Llama's lm_head is its own (untie_embeddings_and_output_weights)
or tied, as its tie_word_embeddings says.

A model no transformers class computes (GPT-2 with the embedding LayerNorm, NormFormer, qk-layernorm, ...) exports
to stablegpt's own modeling file, hf_remote/ (REMOTE): config.json's auto_map points transformers at it, loaded with
trust_remote_code=True; its parameters are ours under "model." (the output layer is lm_head), its config keys ours.
"""

import json
import os
from dataclasses import fields

import torch

import parallel
import reshard
from model import LLAMA3_ROPE, GPTConfig

KINDS = {"gpt2": "GPT2LMHeadModel", "bloom": "BloomForCausalLM", "llama": "LlamaForCausalLM"}

# our config key -> the transformers config attribute
CONFIG = {
    "gpt2": {
        "num_layers": "n_layer",
        "hidden_size": "n_embd",
        "num_attention_heads": "n_head",
        "seq_length": "n_positions",
        "vocab_size": "vocab_size",
        "layernorm_epsilon": "layer_norm_epsilon",
    },
    "bloom": {
        "num_layers": "n_layer",
        "hidden_size": "hidden_size",
        "num_attention_heads": "n_head",
        "vocab_size": "vocab_size",
        "layernorm_epsilon": "layer_norm_epsilon",
    },
    "llama": {
        "num_layers": "num_hidden_layers",
        "hidden_size": "hidden_size",
        "num_attention_heads": "num_attention_heads",
        "num_query_groups": "num_key_value_heads",
        "ffn_hidden_size": "intermediate_size",
        "seq_length": "max_position_embeddings",
        "vocab_size": "vocab_size",
        "layernorm_epsilon": "rms_norm_eps",
        "add_bias_linear": "attention_bias",
    },
}
# ... and the keys each class fixes (BLOOM: ALiBi and the embedding LayerNorm, lesson 19; its GeLU is tanh's)
FIXED = {
    "gpt2": {"position_embedding_type": "learned", "embed_layernorm": False},
    "bloom": {
        "position_embedding_type": "alibi",
        "embed_layernorm": True,
        "activation": "gelu_tanh",
    },
    "llama": {
        "position_embedding_type": "rotary",
        "embed_layernorm": False,
        "normalization": "rmsnorm",
        "swiglu": True,
    },
}
# ours -> transformers' ACT2FN
GPT2_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}
GPT2_ACTIVATIONS_IN = {
    **{v: k for k, v in GPT2_ACTIVATIONS.items()},
    "gelu_pytorch_tanh": "gelu_tanh",
}

# GPTConfig fields neither class needs to express: training only, or the same function in exact arithmetic
NOT_MAPPED = {
    "hidden_dropout",
    "attention_dropout",
    "embed_dropout",
    "init_method_std",
    "embed_init",
    "embed_init_std",
    "position_embedding_init",
    "checkpoint_activations",
    "make_vocab_size_divisible_by",
    "apply_query_key_layer_scaling",
    "stable_attention",
    "unfused_attention",
    "tensor_model_parallel_size",
    "attention_backend",  # which of torch's kernels computes attention, not what it computes
    "z_loss",
}  # a term of the training loss only
# ... and the GPT-2 block, which both have: the Llama block's keys at their defaults (family() checks them)
GPT2_BLOCK = {
    "normalization": "layernorm",
    "swiglu": False,
    "ffn_hidden_size": None,
    "num_query_groups": None,
    "untie_embeddings_and_output_weights": False,
    "add_bias_linear": True,
    "rotary_base": 10000.0,
    "use_rope_scaling": False,
    "rope_scaling_factor": 8.0,
    "original_max_position_embeddings": LLAMA3_ROPE["original_max_position_embeddings"],
}
MAPPED = {
    "activation",
    *GPT2_BLOCK,
    *FIXED["gpt2"],
    *CONFIG["gpt2"],
    *CONFIG["bloom"],
    *CONFIG["llama"],
}

# Parameter names: ours -> (theirs, layout steps theirs -> ours), their names without transformers' "transformer."
# (checkpoints on the Hub come with it, from the *LMHeadModel classes, and without it, from the bare models).
WEIGHTS = {
    "gpt2": {
        "embed.word.weight": ("wte.weight", ("vocab",)),
        "embed.position.weight": ("wpe.weight", ("positions",)),
        "ln_f.weight": ("ln_f.weight", ()),
        "ln_f.bias": ("ln_f.bias", ()),
    },
    "bloom": {
        "embed.word.weight": ("word_embeddings.weight", ("vocab",)),
        "embed.norm.weight": ("word_embeddings_layernorm.weight", ()),
        "embed.norm.bias": ("word_embeddings_layernorm.bias", ()),
        "ln_f.weight": ("ln_f.weight", ()),
        "ln_f.bias": ("ln_f.bias", ()),
    },
}
# ... per block i (blocks.{i}.X <-> h.{i}.Y): our module -> (theirs, steps of the weight, steps of the bias)
BLOCK = {
    "gpt2": {
        "ln_1": ("ln_1", (), ()),
        "ln_2": ("ln_2", (), ()),
        "attn.qkv": ("attn.c_attn", ("conv1d", "qkv"), ("qkv",)),
        "attn.proj": ("attn.c_proj", ("conv1d",), ()),
        "mlp.fc1": ("mlp.c_fc", ("conv1d",), ()),
        "mlp.fc2": ("mlp.c_proj", ("conv1d",), ()),
    },
    "bloom": {
        "ln_1": ("input_layernorm", (), ()),
        "ln_2": ("post_attention_layernorm", (), ()),
        "attn.qkv": ("self_attention.query_key_value", (), ()),  # head by head, as ours
        "attn.proj": ("self_attention.dense", (), ()),
        "mlp.fc1": ("mlp.dense_h_to_4h", (), ()),
        "mlp.fc2": ("mlp.dense_4h_to_h", (), ()),
    },
    "llama": {
        "ln_1": ("input_layernorm", (), ()),
        "ln_2": ("post_attention_layernorm", (), ()),
        "attn.qkv": (
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            ("gqa",),
            ("gqa",),
        ),
        "attn.proj": ("self_attn.o_proj", (), ()),
        "mlp.gate": ("mlp.gate_proj", (), ()),
        "mlp.fc1": ("mlp.up_proj", (), ()),
        "mlp.fc2": ("mlp.down_proj", (), ()),
    },
}
WEIGHTS["llama"] = {
    "embed.word.weight": ("model.embed_tokens.weight", ("vocab",)),
    "ln_f.weight": ("model.norm.weight", ()),
    "output_layer": ("lm_head.weight", ("vocab",)),
}
BLOCKS = {"gpt2": "h", "bloom": "h", "llama": "model.layers"}  # their prefix of block i's names
# Their tensors with no counterpart, and why: the causal-mask buffers older GPT-2 files carry, the tied output layer
IGNORED = (".attn.bias", ".attn.masked_bias", "lm_head.weight", "rotary_emb.inv_freq")


def _regroup(t, a, b):
    """Along dim 0, [a, b, head_dim] -> [b, a, head_dim]: GPT-2's [3, heads] <-> our [heads, 3]."""
    return t.reshape(a, b, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def _gqa_in(ts, c):
    """Llama's [q_proj, k_proj, v_proj] (weights or biases) -> our fused qkv, [groups, q per group + 2, head_dim]."""
    g, rest = c.query_groups, ts[0].shape[1:]
    return torch.cat([t.reshape(g, -1, *rest) for t in ts], dim=1).reshape(-1, *rest)


def _gqa_out(t, c):
    """Our fused qkv -> Llama's [q_proj, k_proj, v_proj]."""
    g, d, rest = c.query_groups, c.hidden_size // c.num_attention_heads, t.shape[1:]
    q, k, v = t.reshape(g, -1, *rest).split((c.num_attention_heads // g * d, d, d), dim=1)
    return [x.reshape(-1, *rest) for x in (q, k, v)]


def _pad_rows(t, rows):
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t


# step: (theirs -> ours, ours -> theirs), each f(tensor, GPTConfig)
STEPS = {
    "conv1d": (lambda t, c: t.t(), lambda t, c: t.t()),
    "qkv": (
        lambda t, c: _regroup(t, 3, c.num_attention_heads),
        lambda t, c: _regroup(t, c.num_attention_heads, 3),
    ),
    "vocab": (lambda t, c: _pad_rows(t, c.padded_vocab_size), lambda t, c: t[: c.vocab_size]),
    "positions": (lambda t, c: t[: c.seq_length], lambda t, c: t),
    "gqa": (_gqa_in, _gqa_out),
}


def weight_map(kind, num_layers, model_cfg=None):
    """{our parameter name: (their name without "transformer.", or a tuple of names, steps theirs -> ours)} of a
    whole model. model_cfg (a Llama's GPTConfig): which biases and which output layer the model
    has."""
    table = dict(WEIGHTS[kind])
    norm_bias = linear_bias = True
    if kind == "llama":
        norm_bias, linear_bias = model_cfg.normalization == "layernorm", model_cfg.add_bias_linear
        if not model_cfg.untie_embeddings_and_output_weights:
            del table["output_layer"]
    for i in range(num_layers):
        for ours, (theirs, weight_steps, bias_steps) in BLOCK[kind].items():
            name = lambda n, what: f"{BLOCKS[kind]}.{i}.{n}.{what}"
            names = lambda what: (
                tuple(name(n, what) for n in theirs)
                if isinstance(theirs, tuple)
                else name(theirs, what)
            )
            table[f"blocks.{i}.{ours}.weight"] = (names("weight"), weight_steps)
            if norm_bias if ours.startswith("ln_") else linear_bias:
                table[f"blocks.{i}.{ours}.bias"] = (names("bias"), bias_steps)
    return table


def their_names(theirs):
    """The tuple of their names of one of ours (Llama's q, k and v are three)."""
    return theirs if isinstance(theirs, tuple) else (theirs,)


def to_ours(t, steps, model_cfg):
    for step in steps:
        t = STEPS[step][0](t, model_cfg)
    return t


def to_theirs(t, steps, model_cfg):
    for step in reversed(steps):
        t = STEPS[step][1](t, model_cfg)
    return t


# -----------------------------------------------------------------------------
# Which class a model is (both ways)


def family(model_cfg):
    """'gpt2', 'bloom' or 'llama' for a GPTConfig (or anything with its fields), or a ValueError naming what no
    class can compute."""
    _refuse_unmapped(model_cfg)
    if model_cfg.position_embedding_type == "rotary":
        _refuse_unlike_llama(model_cfg)
        return "llama"
    _refuse_unlike_gpt2_block(model_cfg)
    return _gpt2_or_bloom(model_cfg)


def _refuse_unmapped(model_cfg):
    """Refuses a field off its default that is in neither MAPPED nor NOT_MAPPED."""
    defaults = GPTConfig()
    unknown = [
        f"{f.name}={getattr(model_cfg, f.name)!r}"
        for f in fields(GPTConfig)
        if f.name not in NOT_MAPPED | MAPPED
        and getattr(model_cfg, f.name) != getattr(defaults, f.name)
    ]
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: neither {' nor '.join(KINDS.values())} has it")


def _refuse_unlike_llama(model_cfg):
    """Refuses rotary embeddings with any of LlamaForCausalLM's fixed switches set otherwise."""
    differ = [
        f"{key}={getattr(model_cfg, key)!r}"
        for key, value in FIXED["llama"].items()
        if getattr(model_cfg, key) != value
    ]
    if differ:
        raise ValueError(
            f"position_embedding_type='rotary' with {', '.join(differ)}: GPT2LMHeadModel and "
            "BloomForCausalLM: neither has rotary embeddings; LlamaForCausalLM has them with "
            + ", ".join(
                f"{k}={v!r}" for k, v in FIXED["llama"].items() if k != "position_embedding_type"
            )
        )


def _refuse_unlike_gpt2_block(model_cfg):
    """Refuses learned or ALiBi positions with a block other than GPT-2's (Llama's switches)."""
    differ = [
        f"{key}={getattr(model_cfg, key)!r}"
        for key, value in GPT2_BLOCK.items()
        if getattr(model_cfg, key) != value
    ]
    if differ:
        raise ValueError(
            f"{', '.join(differ)} with {model_cfg.position_embedding_type} positions: "
            "GPT2LMHeadModel and "
            "BloomForCausalLM have the GPT-2 block (LlamaForCausalLM, with rotary embeddings, has these)"
        )


def _gpt2_or_bloom(model_cfg):
    """'gpt2' (learned positions) or 'bloom' (ALiBi) for a GPT-2 block, or what neither has."""
    # a fork's own: no class has it
    if model_cfg.position_embedding_type not in ("learned", "alibi"):
        raise ValueError(
            f"position_embedding_type={model_cfg.position_embedding_type!r}: none of "
            f"{', '.join(KINDS.values())} has it"
        )
    if model_cfg.position_embedding_type == "learned":
        if model_cfg.embed_layernorm:
            raise ValueError(
                "learned position embeddings with embed_layernorm: GPT2LMHeadModel has no embedding "
                "LayerNorm and BloomForCausalLM no position embeddings"
            )
        if model_cfg.activation not in GPT2_ACTIVATIONS:
            raise ValueError(f"activation={model_cfg.activation!r} is not one of GPT2LMHeadModel's")
        return "gpt2"
    if not model_cfg.embed_layernorm:
        raise ValueError(
            "ALiBi without embed_layernorm: BloomForCausalLM always normalises the word embeddings"
        )
    if model_cfg.activation != "gelu_tanh":
        raise ValueError(
            f"activation={model_cfg.activation!r} to BloomForCausalLM: its GeLU is "
            "the tanh approximation "
            "(activation='gelu_tanh')"
        )
    return "bloom"


def hf_config(model_cfg, **extra):
    """The transformers config of a GPTConfig (GPT2Config, BloomConfig or LlamaConfig); extra: their other keys
    (token ids, dropout; a Llama's max_position_embeddings, which is seq_length otherwise: rotary has no table)."""
    import transformers

    kind = family(model_cfg)
    keys = {theirs: getattr(model_cfg, ours) for ours, theirs in CONFIG[kind].items()}
    if kind == "llama":
        keys.update(
            num_key_value_heads=model_cfg.query_groups,
            intermediate_size=model_cfg.ffn_size,
            mlp_bias=model_cfg.add_bias_linear,
            hidden_act="silu",
            head_dim=model_cfg.hidden_size // model_cfg.num_attention_heads,
            rope_parameters=rope_parameters(model_cfg),
            tie_word_embeddings=not model_cfg.untie_embeddings_and_output_weights,
        )
        return transformers.LlamaConfig(**{**keys, **extra})
    if kind == "gpt2":
        activation = GPT2_ACTIVATIONS[model_cfg.activation]
        return transformers.GPT2Config(
            **keys, activation_function=activation, tie_word_embeddings=True, **extra
        )
    return transformers.BloomConfig(**keys, tie_word_embeddings=True, **extra)


def export_state(state, model_cfg):
    """The state dict of the transformers model (GPT2LMHeadModel's, BloomForCausalLM's or LlamaForCausalLM's
    names) of our whole-model (TP=1, PP=1) state dict; a tied output layer is left to transformers' tying."""
    kind = family(model_cfg)
    out = {}
    for ours, (theirs, steps) in weight_map(kind, model_cfg.num_layers, model_cfg).items():
        tensors = to_theirs(state[ours], steps, model_cfg)
        for name, t in zip(
            their_names(theirs), tensors if isinstance(theirs, tuple) else [tensors]
        ):
            out[name if kind == "llama" else f"transformer.{name}"] = t
    return out


# -----------------------------------------------------------------------------
# Every other model: stablegpt's own modeling file, loaded with trust_remote_code

REMOTE = "StableGPTForCausalLM"
# in hf_remote/, copied next to the weights
REMOTE_FILES = ("configuration_stablegpt.py", "modeling_stablegpt.py")
# GPTConfig fields that hf_remote's config has under the same name (the others: NOT_MAPPED, or refused), and the
# values it knows of those that name a function (a fork's new activation or positions are refused by name)
REMOTE_VALUES = {
    "position_embedding_type": ("learned", "alibi", "rotary"),
    "normalization": ("layernorm", "rmsnorm"),
    "activation": ("gelu", "gelu_tanh", "relu"),
}
REMOTE_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_attention_heads",
    "seq_length",
    "layernorm_epsilon",
    "normalization",
    "swiglu",
    "activation",
    "add_bias_linear",
    "position_embedding_type",
    "rotary_base",
    "use_rope_scaling",
    "rope_scaling_factor",
    "original_max_position_embeddings",
    "embed_layernorm",
    "scale_embeddings",
    "qk_layernorm",
    "normformer",
    "untie_embeddings_and_output_weights",
    "num_query_groups",
    "ffn_hidden_size",
)


def export_class(model_cfg):
    """'gpt2', 'bloom' or 'llama' where that transformers class computes the model (family), else 'stablegpt'
    (hf_remote/), or a ValueError naming what neither computes."""
    try:
        return family(model_cfg)
    except ValueError as e:
        standard = str(e)
    defaults = GPTConfig()
    unknown = [
        f"{f.name}={getattr(model_cfg, f.name)!r}"
        for f in fields(GPTConfig)
        if f.name not in NOT_MAPPED | set(REMOTE_KEYS)
        and getattr(model_cfg, f.name) != getattr(defaults, f.name)
    ]
    unknown += [
        f"{key}={getattr(model_cfg, key)!r}"
        for key, known in REMOTE_VALUES.items()
        if getattr(model_cfg, key) not in known
    ]
    # padded_vocab_in_softmax: the padding columns' share of the softmax, by TP size (lesson 16)
    if unknown:
        raise ValueError(
            f"{', '.join(unknown)}: no transformers class has it ({standard}), nor stablegpt's own "
            f"{REMOTE} (hf_remote/modeling_stablegpt.py: add it there)"
        )
    return "stablegpt"


def remote_config(model_cfg, **extra):
    """config.json of the REMOTE model of a GPTConfig; extra: other keys (token ids, dropout, dtype, a
    max_position_embeddings other than seq_length)."""
    keys = {key: getattr(model_cfg, key) for key in REMOTE_KEYS}
    untie = keys.pop("untie_embeddings_and_output_weights")
    keys.update(
        num_query_groups=model_cfg.query_groups,
        ffn_hidden_size=model_cfg.ffn_size,
        max_position_embeddings=model_cfg.seq_length,
        low_freq_factor=LLAMA3_ROPE["low_freq_factor"],
        high_freq_factor=LLAMA3_ROPE["high_freq_factor"],
    )
    modules = {
        "AutoConfig": "configuration_stablegpt.StableGPTConfig",
        "AutoModelForCausalLM": f"modeling_stablegpt.{REMOTE}",
    }
    return {
        "model_type": "stablegpt",
        "architectures": [REMOTE],
        "auto_map": modules,
        "tie_word_embeddings": not untie,
        **keys,
        **extra,
    }


def remote_state(state, model_cfg):
    """The REMOTE model's state dict of our whole-model (TP=1, PP=1) state dict: ours under "model.", an untied
    output layer as lm_head (a tied one is left to transformers' tying), the vocabulary's padding rows dropped."""
    vocab = ("embed.word.weight", "output_layer")
    return {
        "lm_head.weight" if name == "output_layer" else f"model.{name}": t[: model_cfg.vocab_size]
        if name in vocab
        else t
        for name, t in state.items()
    }


# -----------------------------------------------------------------------------
# Import


def _hf_config(directory):
    """(kind, the transformers config) of the model in directory, or one error naming the fix."""
    model_type = _model_type_in(directory)
    import transformers

    theirs = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    refusals = [
        (
            model_type != "llama" and not theirs.tie_word_embeddings,
            "tie_word_embeddings=false: an output "
            "layer of its own (stablegpt ties it to the word embedding in this class)",
        )
    ]
    if model_type == "llama":
        refusals += _llama_refusals(theirs)
    elif model_type == "gpt2":
        refusals += _gpt2_refusals(theirs)
    else:
        refusals += _bloom_refusals(theirs)
    for refused, why in refusals:
        if refused:
            raise ValueError(
                f"the {KINDS[model_type]} in {directory} has {why}; stablegpt cannot compute it"
            )
    return model_type, theirs


def _model_type_in(directory):
    """The model_type of directory's config.json, one of KINDS, or the error naming the fix."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            f"Hugging Face model directory {directory} does not exist; nothing is downloaded: "
            f"fetch the model first (e.g. huggingface-cli download gpt2 --local-dir {directory}) "
            "or fix the path"
        )
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{directory} has no config.json: it is not a transformers model directory (as "
            "save_pretrained or huggingface-cli download write one)"
        )
    try:
        with open(path) as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError) as e:
        raise ValueError(
            f"{path} cannot be read ({type(e).__name__}: {e}); download the model again"
        ) from None
    if model_type not in KINDS:
        raise ValueError(
            f"{directory} holds a model of type {model_type!r}; stablegpt imports "
            f"{', '.join(KINDS.values())} (model_type {', '.join(map(repr, KINDS))})"
        )
    return model_type


def _llama_refusals(theirs):
    """[(refused, why)] of a LlamaConfig: its rope scaling, activation, head size and biases."""
    rope_type, found = rope_type_of(theirs), rope(theirs)
    head_dim = getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads
    other = {
        k: found.get(k)
        for k, v in LLAMA3_ROPE.items()
        # that one is a key of ours
        if found.get(k) != v and k != "original_max_position_embeddings"
    }
    return [
        (
            rope_type not in ("default", "llama3"),
            f"rope scaling of type {rope_type!r}: stablegpt's rotary "
            "embeddings are unscaled (rope_type 'default') or Llama 3.1's (rope_type 'llama3')",
        ),
        (
            rope_type == "llama3" and bool(other),
            f"rope_type 'llama3' with {other}: stablegpt's (Megatron's) "
            f"llama3 scaling has Llama 3's low_freq_factor {LLAMA3_ROPE['low_freq_factor']} and "
            f"high_freq_factor {LLAMA3_ROPE['high_freq_factor']}",
        ),
        (
            theirs.hidden_act != "silu",
            f"hidden_act={theirs.hidden_act!r}: stablegpt's swiglu gates with SiLU",
        ),
        (
            head_dim * theirs.num_attention_heads != theirs.hidden_size,
            f"head_dim={head_dim}: stablegpt's head size is hidden_size / num_attention_heads",
        ),
        (
            theirs.attention_bias != theirs.mlp_bias,
            f"attention_bias={theirs.attention_bias} with mlp_bias="
            f"{theirs.mlp_bias}: stablegpt's add_bias_linear is one switch for both",
        ),
    ]


def _gpt2_refusals(theirs):
    """[(refused, why)] of a GPT2Config: activation, MLP width, score scaling, cross-attention."""
    return [
        (
            theirs.activation_function not in GPT2_ACTIVATIONS_IN,
            f"activation_function={theirs.activation_function!r}: not one of "
            f"{sorted(GPT2_ACTIVATIONS_IN)}",
        ),
        (
            theirs.n_inner not in (None, 4 * theirs.n_embd),
            f"n_inner={theirs.n_inner}: stablegpt's MLP is 4 x n_embd wide",
        ),
        (
            not theirs.scale_attn_weights,
            "scale_attn_weights=false: attention scores without 1/sqrt(head_dim)",
        ),
        (
            theirs.scale_attn_by_inverse_layer_idx,
            "scale_attn_by_inverse_layer_idx=true: scores divided by the layer number",
        ),
        (theirs.add_cross_attention, "add_cross_attention=true: an encoder-decoder model"),
    ]


def _bloom_refusals(theirs):
    """[(refused, why)] of a BloomConfig: a residual taken after the LayerNorm."""
    return [
        (
            theirs.apply_residual_connection_post_layernorm,
            "apply_residual_connection_post_layernorm=true: the residual taken after the LayerNorm",
        )
    ]


def rope(theirs):
    """A Llama config's rotary parameters, {"rope_theta", "rope_type"}, from transformers 5's rope_parameters or
    the older rope_theta and rope_scaling."""
    found = dict(
        getattr(theirs, "rope_parameters", None) or getattr(theirs, "rope_scaling", None) or {}
    )
    found.setdefault("rope_theta", getattr(theirs, "rope_theta", 10000.0))
    return found


def rope_type_of(theirs):
    return rope(theirs).get("rope_type", rope(theirs).get("type", "default"))


def rope_parameters(model_cfg):
    """LlamaConfig's rope_parameters of our rotary keys."""
    if not model_cfg.use_rope_scaling:
        return {"rope_theta": model_cfg.rotary_base, "rope_type": "default"}
    return {
        "rope_theta": model_cfg.rotary_base,
        "rope_type": "llama3",
        "factor": model_cfg.rope_scaling_factor,
        **LLAMA3_ROPE,
        "original_max_position_embeddings": model_cfg.original_max_position_embeddings,
    }


def config_from_hf(directory):
    """Our config keys of the transformers model in directory (the model's shapes and function; training keys
    such as dropout are the run's own)."""
    kind, theirs = _hf_config(directory)
    keys = {ours: getattr(theirs, name) for ours, name in CONFIG[kind].items()}
    keys.update(FIXED[kind])
    if kind == "gpt2":
        keys["activation"] = GPT2_ACTIVATIONS_IN[theirs.activation_function]
    if kind == "llama":
        keys["untie_embeddings_and_output_weights"] = not theirs.tie_word_embeddings
        keys["rotary_base"] = float(rope(theirs)["rope_theta"])
        keys["use_rope_scaling"] = rope_type_of(theirs) == "llama3"
        if keys[
            "use_rope_scaling"
        ]:  # unscaled: the keys' defaults (GPT2_BLOCK), which nothing reads
            keys["rope_scaling_factor"] = float(rope(theirs)["factor"])
            keys["original_max_position_embeddings"] = int(
                rope(theirs).get(
                    "original_max_position_embeddings",
                    LLAMA3_ROPE["original_max_position_embeddings"],
                )
            )
        else:
            keys.update(
                {
                    k: GPT2_BLOCK[k]
                    for k in ("rope_scaling_factor", "original_max_position_embeddings")
                }
            )
    return keys


def origin(directory):
    """What an export of a run started from the model in directory keeps of it besides the model's function: its
    special token ids and the context it is made for (a rotary model's max_position_embeddings; learned positions
    keep the table they have). The run state records it (builders.build), so that resumed runs keep it too."""
    kind, theirs = _hf_config(directory)
    found = {
        key: getattr(theirs, key, None) for key in ("bos_token_id", "eos_token_id", "pad_token_id")
    }
    if kind == "llama":
        found["max_position_embeddings"] = theirs.max_position_embeddings
    return {"model_type": kind, **found}


def check_config(model_cfg, directory):
    """Refuse a config (a training config or a GPTConfig) that contradicts the model in directory: one ValueError
    naming each key that differs, with both values. A shorter seq_length than GPT-2's n_positions is allowed (the
    first positions are kept)."""
    keys = config_from_hf(directory)
    differ = []
    for key, value in keys.items():
        ours = getattr(model_cfg, key)
        if ours != value and not (key == "seq_length" and ours <= value):
            differ.append(f"{key} {ours!r} (config) vs {value!r} (model)")
    if differ:
        raise ValueError(
            f"the config contradicts the Hugging Face model in {directory}: {', '.join(differ)}; "
            "leave these keys out of the config (they come from the model) or set them as the model has "
            "them"
        )
    try:
        family(model_cfg)
    except ValueError as e:
        raise ValueError(
            f"the config contradicts the Hugging Face model in {directory}: {e}; leave it out of "
            "the config"
        ) from None


class Weights:
    """The tensors of a transformers model directory by name (without "transformer."), read one at a time:
    safetensors or PyTorch's .bin, one file or sharded (an *.index.json)."""

    FILES = ("model.safetensors", "pytorch_model.bin")

    def __init__(self, directory):
        self.directory, self.file_of, self._open = directory, {}, {}
        for name in self.FILES:
            index = os.path.join(directory, name + ".index.json")
            if os.path.isfile(os.path.join(directory, name)):
                files = [name]
            elif os.path.isfile(index):
                try:
                    with open(index) as f:
                        files = sorted(set(json.load(f)["weight_map"].values()))
                except (OSError, ValueError, KeyError) as e:
                    raise ValueError(
                        f"{index} cannot be read ({type(e).__name__}: {e}); download the model "
                        "again"
                    ) from None
            else:
                continue
            for file in files:
                for key in self._keys(file):
                    self.file_of[key.removeprefix("transformer.")] = (file, key)
            return
        raise FileNotFoundError(
            f"{directory} holds no weights: none of {', '.join(self.FILES)} (or their "
            "*.index.json for sharded ones); download the model's weight files too"
        )

    def _read(self, file, what):
        """what(the opened file): safetensors' lazy reader, or the .bin's state dict (memory-mapped unless it is
        in PyTorch's legacy format); one ValueError naming a missing or corrupt file."""
        path = os.path.join(self.directory, file)
        try:
            if file not in self._open:
                if file.endswith(".safetensors"):
                    from safetensors import safe_open

                    self._open[file] = safe_open(path, framework="pt")
                else:
                    try:
                        self._open[file] = torch.load(
                            path, map_location="cpu", mmap=True, weights_only=True
                        )
                    except RuntimeError as e:
                        if "zipfile" not in str(e):
                            raise
                        self._open[file] = torch.load(path, map_location="cpu", weights_only=True)
            return what(self._open[file])
        except Exception as e:  # missing, truncated or not the format its name says
            raise ValueError(
                f"weight file {path} cannot be read ({type(e).__name__}: {e}); it is missing or "
                "corrupt: download it again"
            ) from None

    def _keys(self, file):
        return self._read(file, lambda f: list(f.keys()))

    def get(self, name):
        file, key = self.file_of[name]
        return self._read(file, lambda f: f.get_tensor(key) if hasattr(f, "get_tensor") else f[key])

    def rows(self, name):
        """The first dimension of tensor `name`, from safetensors' header (nothing else read) or the .bin's
        memory-mapped state dict."""
        file, key = self.file_of[name]
        return self._read(
            file,
            lambda f: f.get_slice(key).get_shape()[0] if hasattr(f, "get_slice") else len(f[key]),
        )


def check_weights(model_cfg, directory):
    """Refuse a directory whose weight files do not hold exactly the tensors of its model (names, and the
    vocabulary's rows: their vocab_size, which the "vocab" step would otherwise pad up to with zero rows in
    silence), from the files' headers: one ValueError, before anything is built. Returns (the Weights, the
    weight_map they were checked against)."""
    kind, _ = _hf_config(directory)
    weights = Weights(directory)
    table = weight_map(kind, model_cfg.num_layers, model_cfg)
    theirs = {name for names, _ in table.values() for name in their_names(names)}
    extra = sorted(n for n in weights.file_of if n not in theirs and not n.endswith(IGNORED))
    missing = sorted(theirs - set(weights.file_of))
    if extra or missing:
        raise ValueError(
            f"the weights in {directory} are not a {KINDS[kind]}'s: "
            + (f"missing {', '.join(missing[:5])}" if missing else "")
            + ("; " if extra and missing else "")
            + (f"unexpected {', '.join(extra[:5])}" if extra else "")
            + "; download the model again"
        )
    for source, steps in table.values():
        if "vocab" in steps:
            name = their_names(source)[0]
            rows = weights.rows(name)
            if rows != model_cfg.vocab_size:
                raise ValueError(
                    f"{name} in {directory} has {rows} rows where its config.json says vocab_size "
                    f"{model_cfg.vocab_size}: the config does not describe the weights; download the "
                    "model again"
                )
    return weights, table


@torch.no_grad()
def load_into(model, directory):
    """Copy the weights of the transformers model in directory into `model`: a GPT (model.py), whole or this
    rank's TP x PP stage of it, before an optimizer takes its parameters (DeepSpeed's included). Refuses a model
    config that contradicts the directory's (check_config), and a directory whose weights do not all have a place
    here, or lack one."""
    model_cfg = model.config
    check_config(model_cfg, directory)
    weights, table = check_weights(model_cfg, directory)
    for name, p in model.named_parameters():
        source, steps = table[reshard.TIED_COPY.get(name, name)]
        tensors = [weights.get(n) for n in their_names(source)]
        full = to_ours(tensors if isinstance(source, tuple) else tensors[0], steps, model_cfg)
        expected = list(p.shape)
        tp_dim = getattr(p, "tp_dim", None)
        if tp_dim is not None:
            expected[tp_dim] *= model.grid.tp_size
        if list(full.shape) != expected:
            raise ValueError(
                f"{'/'.join(their_names(source))} in {directory} has shape {tuple(full.shape)} where "
                f"{name} needs {tuple(expected)}: its config.json does not describe its weights; "
                "download it again"
            )
        p.copy_(parallel.shard(full, tp_dim, model.grid))
