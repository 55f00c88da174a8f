"""Hugging Face `transformers` models (GPT2LMHeadModel, BloomForCausalLM) <-> stablegpt, with one mapping used
both ways: importing a model directory here, exporting a checkpoint in tools/export_hf.py.

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
  sequences it sees).
The output layer is the word embedding in both (tied); on a last pipeline stage without the embedding its copy
(reshard.TIED_COPY) gets the same rows.
"""
import json
import os
from dataclasses import fields

import torch

import parallel
import reshard
from model import GPTConfig

KINDS = {"gpt2": "GPT2LMHeadModel", "bloom": "BloomForCausalLM"}

# our config key -> the transformers config attribute
CONFIG = {
    "gpt2": {"num_layers": "n_layer", "hidden_size": "n_embd", "num_attention_heads": "n_head",
             "seq_length": "n_positions", "vocab_size": "vocab_size", "layernorm_epsilon": "layer_norm_epsilon"},
    "bloom": {"num_layers": "n_layer", "hidden_size": "hidden_size", "num_attention_heads": "n_head",
              "vocab_size": "vocab_size", "layernorm_epsilon": "layer_norm_epsilon"},
}
# ... and the keys each class fixes (BLOOM: ALiBi and the embedding LayerNorm, lesson 19; its GeLU is tanh's)
FIXED = {"gpt2": {"position_embedding_type": "learned", "embed_layernorm": False},
         "bloom": {"position_embedding_type": "alibi", "embed_layernorm": True, "activation": "gelu_tanh"}}
GPT2_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}  # ours -> transformers' ACT2FN
GPT2_ACTIVATIONS_IN = {**{v: k for k, v in GPT2_ACTIVATIONS.items()}, "gelu_pytorch_tanh": "gelu_tanh"}

# GPTConfig fields neither class needs to express: training only, or the same function in exact arithmetic
NOT_MAPPED = {"hidden_dropout", "attention_dropout", "embed_dropout", "init_method_std", "embed_init",
              "embed_init_std", "position_embedding_init", "checkpoint_activations", "make_vocab_size_divisible_by",
              "apply_query_key_layer_scaling", "stable_attention", "tensor_model_parallel_size",
              "z_loss"}  # a term of the training loss only
MAPPED = {"activation", *FIXED["gpt2"], *CONFIG["gpt2"], *CONFIG["bloom"]}

# Parameter names: ours -> (theirs, layout steps theirs -> ours), their names without transformers' "transformer."
# (checkpoints on the Hub come with it, from the *LMHeadModel classes, and without it, from the bare models).
WEIGHTS = {
    "gpt2": {"embed.word.weight": ("wte.weight", ("vocab",)), "embed.position.weight": ("wpe.weight", ("positions",)),
             "ln_f.weight": ("ln_f.weight", ()), "ln_f.bias": ("ln_f.bias", ())},
    "bloom": {"embed.word.weight": ("word_embeddings.weight", ("vocab",)),
              "embed.norm.weight": ("word_embeddings_layernorm.weight", ()),
              "embed.norm.bias": ("word_embeddings_layernorm.bias", ()),
              "ln_f.weight": ("ln_f.weight", ()), "ln_f.bias": ("ln_f.bias", ())},
}
# ... per block i (blocks.{i}.X <-> h.{i}.Y): our module -> (theirs, steps of the weight, steps of the bias)
BLOCK = {
    "gpt2": {"ln_1": ("ln_1", (), ()), "ln_2": ("ln_2", (), ()),
             "attn.qkv": ("attn.c_attn", ("conv1d", "qkv"), ("qkv",)),
             "attn.proj": ("attn.c_proj", ("conv1d",), ()),
             "mlp.fc1": ("mlp.c_fc", ("conv1d",), ()), "mlp.fc2": ("mlp.c_proj", ("conv1d",), ())},
    "bloom": {"ln_1": ("input_layernorm", (), ()), "ln_2": ("post_attention_layernorm", (), ()),
              "attn.qkv": ("self_attention.query_key_value", (), ()),  # head by head, as ours
              "attn.proj": ("self_attention.dense", (), ()),
              "mlp.fc1": ("mlp.dense_h_to_4h", (), ()), "mlp.fc2": ("mlp.dense_4h_to_h", (), ())},
}
# Their tensors with no counterpart, and why: the causal-mask buffers older GPT-2 files carry, the tied output layer
IGNORED = (".attn.bias", ".attn.masked_bias", "lm_head.weight")


def _regroup(t, a, b):
    """Along dim 0, [a, b, head_dim] -> [b, a, head_dim]: GPT-2's [3, heads] <-> our [heads, 3]."""
    return t.reshape(a, b, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def _pad_rows(t, rows):
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t


# step: (theirs -> ours, ours -> theirs), each f(tensor, GPTConfig)
STEPS = {
    "conv1d": (lambda t, c: t.t(), lambda t, c: t.t()),
    "qkv": (lambda t, c: _regroup(t, 3, c.num_attention_heads), lambda t, c: _regroup(t, c.num_attention_heads, 3)),
    "vocab": (lambda t, c: _pad_rows(t, c.padded_vocab_size), lambda t, c: t[:c.vocab_size]),
    "positions": (lambda t, c: t[:c.seq_length], lambda t, c: t),
}


def weight_map(kind, num_layers):
    """{our parameter name: (their name without "transformer.", steps theirs -> ours)} of a whole model."""
    table = dict(WEIGHTS[kind])
    for i in range(num_layers):
        for ours, (theirs, weight_steps, bias_steps) in BLOCK[kind].items():
            table[f"blocks.{i}.{ours}.weight"] = (f"h.{i}.{theirs}.weight", weight_steps)
            table[f"blocks.{i}.{ours}.bias"] = (f"h.{i}.{theirs}.bias", bias_steps)
    return table


def to_ours(t, steps, cfg):
    for step in steps:
        t = STEPS[step][0](t, cfg)
    return t


def to_theirs(t, steps, cfg):
    for step in reversed(steps):
        t = STEPS[step][1](t, cfg)
    return t


# -----------------------------------------------------------------------------
# Which class a model is (both ways)


def family(cfg):
    """'gpt2' or 'bloom' for a GPTConfig (or anything with its fields), or a ValueError naming what neither class
    can compute."""
    defaults = GPTConfig()
    unknown = [f"{f.name}={getattr(cfg, f.name)!r}" for f in fields(GPTConfig)
               if f.name not in NOT_MAPPED | MAPPED and getattr(cfg, f.name) != getattr(defaults, f.name)]
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: neither GPT2LMHeadModel nor BloomForCausalLM has it")
    if cfg.position_embedding_type not in ("learned", "alibi"):
        raise ValueError(f"position_embedding_type={cfg.position_embedding_type!r}: GPT2LMHeadModel has learned "
                         "positions and BloomForCausalLM ALiBi; neither has rotary embeddings (transformers' "
                         "GPTNeoXForCausalLM would be the class to map them to)")
    if cfg.position_embedding_type == "learned":
        if cfg.embed_layernorm:
            raise ValueError("learned position embeddings with embed_layernorm: GPT2LMHeadModel has no embedding "
                             "LayerNorm and BloomForCausalLM no position embeddings")
        if cfg.activation not in GPT2_ACTIVATIONS:
            raise ValueError(f"activation={cfg.activation!r} is not one of GPT2LMHeadModel's")
        return "gpt2"
    if not cfg.embed_layernorm:
        raise ValueError("ALiBi without embed_layernorm: BloomForCausalLM always normalises the word embeddings")
    if cfg.activation != "gelu_tanh":
        raise ValueError(f"activation={cfg.activation!r} to BloomForCausalLM: its GeLU is the tanh approximation "
                         "(activation='gelu_tanh')")
    return "bloom"


def hf_config(cfg, **extra):
    """The transformers config of a GPTConfig (GPT2Config or BloomConfig); extra: their other keys (token ids,
    dropout)."""
    import transformers
    kind = family(cfg)
    keys = {theirs: getattr(cfg, ours) for ours, theirs in CONFIG[kind].items()}
    if kind == "gpt2":
        return transformers.GPT2Config(**keys, activation_function=GPT2_ACTIVATIONS[cfg.activation],
                                       tie_word_embeddings=True, **extra)
    return transformers.BloomConfig(**keys, tie_word_embeddings=True, **extra)


def export_state(state, cfg):
    """The state dict of the transformers model (GPT2LMHeadModel's or BloomForCausalLM's names) of our whole-model
    (TP=1, PP=1) state dict; the output layer is left to transformers' tying."""
    return {f"transformer.{theirs}": to_theirs(state[ours], steps, cfg)
            for ours, (theirs, steps) in weight_map(family(cfg), cfg.num_layers).items()}


# -----------------------------------------------------------------------------
# Import


def _hf_config(directory):
    """(kind, the transformers config) of the model in directory, or one error naming the fix."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"Hugging Face model directory {directory} does not exist; nothing is downloaded: "
                                f"fetch the model first (e.g. huggingface-cli download gpt2 --local-dir {directory}) "
                                "or fix the path")
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{directory} has no config.json: it is not a transformers model directory (as "
                                "save_pretrained or huggingface-cli download write one)")
    try:
        with open(path) as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} cannot be read ({type(e).__name__}: {e}); download the model again") from None
    if model_type not in KINDS:
        raise ValueError(f"{directory} holds a model of type {model_type!r}; stablegpt imports "
                         f"{' and '.join(KINDS.values())} (model_type 'gpt2' or 'bloom')")
    import transformers
    theirs = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    refusals = [(not theirs.tie_word_embeddings, "tie_word_embeddings=false: an output layer of its own (stablegpt "
                                             "ties it to the word embedding)")]
    if model_type == "gpt2":
        refusals += [
            (theirs.activation_function not in GPT2_ACTIVATIONS_IN,
             f"activation_function={theirs.activation_function!r}: not one of {sorted(GPT2_ACTIVATIONS_IN)}"),
            (theirs.n_inner not in (None, 4 * theirs.n_embd),
             f"n_inner={theirs.n_inner}: stablegpt's MLP is 4 x n_embd wide"),
            (not theirs.scale_attn_weights, "scale_attn_weights=false: attention scores without 1/sqrt(head_dim)"),
            (theirs.scale_attn_by_inverse_layer_idx, "scale_attn_by_inverse_layer_idx=true: scores divided by the "
                                                 "layer number"),
            (theirs.add_cross_attention, "add_cross_attention=true: an encoder-decoder model")]
    else:
        refusals += [(theirs.apply_residual_connection_post_layernorm,
                      "apply_residual_connection_post_layernorm=true: the residual taken after the LayerNorm")]
    for refused, why in refusals:
        if refused:
            raise ValueError(f"the {KINDS[model_type]} in {directory} has {why}; stablegpt cannot compute it")
    return model_type, theirs


def config_from_hf(directory):
    """Our config keys of the transformers model in directory (the model's shapes and function; training keys
    such as dropout are the run's own)."""
    kind, theirs = _hf_config(directory)
    keys = {ours: getattr(theirs, name) for ours, name in CONFIG[kind].items()}
    keys.update(FIXED[kind])
    if kind == "gpt2":
        keys["activation"] = GPT2_ACTIVATIONS_IN[theirs.activation_function]
    return keys


def check_config(cfg, directory):
    """Refuse a config (a training config or a GPTConfig) that contradicts the model in directory: one ValueError
    naming each key that differs, with both values. A shorter seq_length than GPT-2's n_positions is allowed (the
    first positions are kept)."""
    keys = config_from_hf(directory)
    differ = []
    for key, value in keys.items():
        ours = getattr(cfg, key)
        if ours != value and not (key == "seq_length" and ours <= value):
            differ.append(f"{key} {ours!r} (config) vs {value!r} (model)")
    if differ:
        raise ValueError(f"the config contradicts the Hugging Face model in {directory}: {', '.join(differ)}; "
                         "leave these keys out of the config (they come from the model) or set them as the model has "
                         "them")
    try:
        family(cfg)
    except ValueError as e:
        raise ValueError(f"the config contradicts the Hugging Face model in {directory}: {e}; leave it out of "
                         "the config") from None


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
                    raise ValueError(f"{index} cannot be read ({type(e).__name__}: {e}); download the model "
                                     "again") from None
            else:
                continue
            for file in files:
                for key in self._keys(file):
                    self.file_of[key.removeprefix("transformer.")] = (file, key)
            return
        raise FileNotFoundError(f"{directory} holds no weights: none of {', '.join(self.FILES)} (or their "
                                "*.index.json for sharded ones); download the model's weight files too")

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
                        self._open[file] = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
                    except RuntimeError as e:
                        if "zipfile" not in str(e):
                            raise
                        self._open[file] = torch.load(path, map_location="cpu", weights_only=True)
            return what(self._open[file])
        except Exception as e:  # missing, truncated or not the format its name says
            raise ValueError(f"weight file {path} cannot be read ({type(e).__name__}: {e}); it is missing or "
                             "corrupt: download it again") from None

    def _keys(self, file):
        return self._read(file, lambda f: list(f.keys()))

    def get(self, name):
        file, key = self.file_of[name]
        return self._read(file, lambda f: f.get_tensor(key) if hasattr(f, "get_tensor") else f[key])


@torch.no_grad()
def load_into(model, directory):
    """Copy the weights of the transformers model in directory into `model`: a GPT (model.py), whole or this
    rank's TP x PP stage of it, before an optimizer takes its parameters (DeepSpeed's included). Refuses a model
    config that contradicts the directory's (check_config), and a directory whose weights do not all have a place
    here, or lack one."""
    cfg = model.cfg
    kind, _ = _hf_config(directory)
    check_config(cfg, directory)
    weights = Weights(directory)
    table = weight_map(kind, cfg.num_layers)
    theirs = {name for name, _ in table.values()}
    extra = sorted(n for n in weights.file_of if n not in theirs and not n.endswith(IGNORED))
    missing = sorted(theirs - set(weights.file_of))
    if extra or missing:
        raise ValueError(f"the weights in {directory} are not a {KINDS[kind]}'s: "
                         + (f"missing {', '.join(missing[:5])}" if missing else "")
                         + ("; " if extra and missing else "")
                         + (f"unexpected {', '.join(extra[:5])}" if extra else "") + "; download the model again")
    for name, p in model.named_parameters():
        source, steps = table[reshard.TIED_COPY.get(name, name)]
        full = to_ours(weights.get(source), steps, cfg)
        expected = list(p.shape)
        tp_dim = getattr(p, "tp_dim", None)
        if tp_dim is not None:
            expected[tp_dim] *= model.grid.tp_size
        if list(full.shape) != expected:
            raise ValueError(f"{source} in {directory} has shape {tuple(full.shape)} where {name} needs "
                             f"{tuple(expected)}: its config.json does not describe its weights; download it again")
        p.copy_(parallel.shard(full, tp_dim, model.grid))
