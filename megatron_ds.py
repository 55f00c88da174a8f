"""Megatron-DeepSpeed checkpoints (the format of tr8b-104B and tr11-176B) read into this project's checkpoints, so
that `train.py --load` continues a BigScience-style run where Megatron-DeepSpeed stopped.

    ckpt = megatron_ds.Checkpoint(MDS_DIR)           # its `latest` tag: files, layout, args, iteration
    megatron_ds.convert(ckpt, OUR_DIR)               # our global_stepN/ with weights, Adam state, counters

What Megatron-DeepSpeed's pipeline engine (GPTModelPipe under DeepSpeed) writes into global_stepN/:
- layer_XX-model_TT-model_states.pt: one pipeline layer's weights on TP rank TT, XX its index in GPTModelPipe's
  list of layers (1: the embedding, then the transformer layers, then the final LayerNorm). The tied output
  layer on the last stage is a function of the embedding module, not a layer of its own: no file holds it;
- mp_rank_MM_model_states.pt (MM = stage x TP + TP rank): DeepSpeed's engine state (`param_shapes`: the names and
  shapes of the parameters its ZeRO optimizer flattened, group by group; `lr_scheduler`) and Megatron's (`args`,
  `iteration`, `tokens`, `checkpoint_info`);
- [bf16_]zero_pp_rank_D_mp_rank_MM_optim_states.pt: data-parallel rank D's ZeRO-1 partition of that stage's
  optimizer: each parameter group is one flat fp32 tensor (the masters) cut into DP equal parts, Adam's moments
  flattened the same way, the step in the state or, for FusedAdam, in the param group. The last stage's
  partitions hold the tied embedding's copy too (and its unused position embedding).

The result is our checkpoint of the same TP size (its padded vocabulary rows are kept as they are: with
padded_vocab_in_softmax, the default here, the run continues Megatron's softmax exactly), any number of stages
(default: the source's), DP=1; reshard.py re-cuts it for any other TP x PP x DP layout when it is loaded. Our
model on each stage is built on the meta device to name and shape every tensor, so a converted checkpoint holds
exactly what a run of ours would save.

DeepSpeed's own readers (deepspeed.checkpoint) find the files: the layout from the file names
(get_model_3d_descriptor_from_metadata), each rank's ZeRO files (ZeROCheckpoint, which orders them by their rank
numbers: the DP rank in their names is not zero-padded). The mp_rank and layer files are opened by the names their
ranks give. DeepSpeedCheckpoint itself is not used: it sorts the mp_rank files as text (mp_rank_100 before
mp_rank_11), refuses a directory without ZeRO files (a weights-only import), and its layer-to-stage map assumes
equal stages, which BLOOM's partition (5 layers on its first and last stage, 6 between) is not; no reader there
turns a flat ZeRO partition back into parameters (ds_to_universal does it through files on disk, and needs the
universal_checkpoint_info that 2021-22 checkpoints lack), so that is done here from
`param_shapes`, or where the engine saved none (DeepSpeed 0.19 under bf16 without ZeRO) from the
partitions' `param_slice_mappings`.

DeepSpeed's universal checkpoint (ds_to_universal's output: zero/<name>/fp32.pt, exp_avg.pt, ... whole tensors
with the dimension they were cut along, the vocabulary's padding dropped, and the mp_rank files, no layer files) is
read too: its masters are the weights, each tensor is cut for the TP size its args name. Its fp16 loss scale is not.
One made from a checkpoint without universal_checkpoint_info (the bigscience fork's) holds the last
stage's untrained copies of the tied embedding module's position embedding and LayerNorm: refused
(check_replicated_copies); the checkpoint it was made from imports.

Not read: the pre-0.4 ZeRO stage-1 format
(sub-partitions), Megatron checkpoints without the pipeline engine (--no-pipeline-parallel) and the RNG states
(a converted run draws fresh streams from seed + iteration and says so).

Memory: one output (stage, TP rank) at a time. Its parameters' layer files and the ZeRO partitions of the source
stages holding them are opened memory-mapped (torch.load(mmap=True): torch.save's zip files, torch >= 1.6; older
legacy-format files are read whole; a universal checkpoint's files hold one parameter each and are read one at a
time), and only its parameters' elements are read and copied: 14 bytes a parameter of the stage under bf16
(weights, fp32 masters, both moments). Computed for tr11-176B (TP4 x PP12, written as PP12): ~56 GB for its first
or last stage (5 layers and the word embedding) instead of ~617 GB for a whole TP rank; more output stages cut it
further. The lesson-11 check reads the tied word embedding's two fp32 copies (~7 GB there).
"""

import math
import os
import pickle
import shutil
import types
import zipfile
from collections import OrderedDict
from dataclasses import asdict, dataclass

import torch

import arguments
import checkpoint
import files
import optim
import parallel
import precision
import reshard
import run_state
import schedule
import sections
from model import GPT, GPTConfig
from optim import OptimizerConfig
from sections import section

# Their names -> ours: the embedding layer's, a transformer layer's (weight and bias each), the final LayerNorm's
EMBEDDING = {
    "word_embeddings.weight": "embed.word.weight",
    "position_embeddings.weight": "embed.position.weight",
    "word_embeddings.norm.weight": "embed.norm.weight",
    "word_embeddings.norm.bias": "embed.norm.bias",
}
BLOCK = {
    "input_layernorm": "ln_1",
    "self_attention.query_key_value": "attn.qkv",
    "self_attention.dense": "attn.proj",
    "post_attention_layernorm": "ln_2",
    "mlp.dense_h_to_4h": "mlp.fc1",
    "mlp.dense_4h_to_h": "mlp.fc2",
}
FINAL_NORM = {"weight": "ln_f.weight", "bias": "ln_f.bias"}
# the prefix of the embedding module's parameters in the optimizer's names
TIED = "tied_modules.embed."
LAYER_FILE = checkpoint.MEGATRON_DS_LAYER_FILE
# an optimizer state's tensors: the fp32 master and Adam's moments
STATE_KEYS = ("fp32", "exp_avg", "exp_avg_sq")

# Megatron's args -> our keys of the same meaning and name; the others are translated in config_from_args
SAME_ARGS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "seq_length",
    "layernorm_epsilon",
    "init_method_std",
    "hidden_dropout",
    "attention_dropout",
    "make_vocab_size_divisible_by",
    "apply_query_key_layer_scaling",
    "embed_layernorm",
    "micro_batch_size",
    "global_batch_size",
    "seed",
    "weight_decay",
    "clip_grad",
    "adam_beta1",
    "adam_beta2",
    "adam_eps",
    "fp16",
    "bf16",
    "loss_scale",
    "initial_loss_scale",
    "min_loss_scale",
    "loss_scale_window",
    "hysteresis",
    "tensor_model_parallel_size",
)
POSITIONS = {"absolute": "learned", "alibi": "alibi"}  # PositionEmbeddingType's names -> ours


# Megatron's enums in its pickled args, by value: read without Megatron installed (_StandIn)
MEGATRON_ENUMS = {
    ("megatron.enums", "PositionEmbeddingType"): {1: "rotary", 2: "absolute", 3: "alibi"}
}


class _StandIn:
    """An object of a class whose module is not installed here (Megatron's, in the pickled args): the
    arguments and state it was pickled with, and the member name of a known Megatron enum."""

    names = {}

    def __init__(self, *args):
        self.args = args
        self.name = self.names.get(args[0]) if args else None

    def __setstate__(self, state):
        self.__dict__.update(state if isinstance(state, dict) else {"state": state})


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            return type(
                name,
                (_StandIn,),
                {"names": MEGATRON_ENUMS.get((module, name), {}), "__module__": module},
            )


# torch.load's pickle_module: the standard pickle with the Unpickler above
PICKLE = types.ModuleType("megatron_ds_pickle")
PICKLE.Unpickler, PICKLE.load, PICKLE.__name__ = _Unpickler, pickle.load, "pickle"


def read_file(path, what):
    """A source file, memory-mapped: a tensor's bytes are read from disk when it is used, so that a stage reads of
    a layer file or a ZeRO partition only the parameters it needs. torch.save's files since torch 1.6 (zip
    archives) allow it; older ones (torch.save's legacy format) are read whole."""
    try:
        return torch.load(
            path,
            map_location="cpu",
            weights_only=False,
            mmap=zipfile.is_zipfile(path),
            pickle_module=PICKLE,
        )
    except Exception as e:  # truncated or not a torch file: say which
        raise ValueError(
            f"{path} ({what}) cannot be read ({type(e).__name__}: {e}); the Megatron-DeepSpeed "
            "checkpoint is incomplete or corrupt: copy the file again"
        ) from None


def tag_dir_of(load_dir):
    """The global_stepN directory that load_dir's `latest` names (or load_dir itself when it is one)."""
    if not os.path.isdir(load_dir):
        raise ValueError(f"Megatron-DeepSpeed checkpoint directory {load_dir} does not exist")
    if any(LAYER_FILE.fullmatch(n) for n in os.listdir(load_dir)) or os.path.isdir(
        os.path.join(load_dir, "zero")
    ):
        return load_dir
    latest, tracker = (
        os.path.join(load_dir, "latest"),
        os.path.join(load_dir, "latest_checkpointed_iteration.txt"),
    )
    if not os.path.isfile(latest):  # ds_to_universal's tag file, beside its output
        latest = (
            os.path.join(load_dir, "latest_universal")
            if os.path.isfile(os.path.join(load_dir, "latest_universal"))
            else latest
        )
    if os.path.isfile(latest):  # DeepSpeed's tag file
        with open(latest) as f:
            tag = f.read().strip()
        if not tag:  # it would name load_dir itself
            steps = sorted(n for n in os.listdir(load_dir) if n.startswith("global_step"))
            raise ValueError(
                f"{latest} is empty (a save killed while it wrote it?): pass the global_stepN directory "
                f"to import as --load (it holds {', '.join(steps) or 'no global_stepN'})"
            )
    elif os.path.isfile(tracker):  # Megatron's, an iteration number
        latest = tracker
        with open(tracker) as f:
            tag = f"global_step{f.read().strip()}"
    else:
        raise ValueError(
            f"{load_dir} is not a Megatron-DeepSpeed checkpoint: no layer_XX-model_YY-model_states.pt "
            "files and no 'latest' file; pass the directory given to --save (or one of its "
            "global_stepN)"
        )
    if not os.path.isdir(os.path.join(load_dir, tag)):
        raise ValueError(
            f"{latest} names {tag!r}, which is not a directory of {load_dir}; write an existing "
            "global_stepN into it"
        )
    return os.path.join(load_dir, tag)


class Checkpoint:
    """The files of one Megatron-DeepSpeed checkpoint (a global_stepN directory), found by DeepSpeed's readers."""

    def __init__(self, load_dir):
        from deepspeed.checkpoint import constants as ds
        from deepspeed.checkpoint.reshape_utils import (
            get_files,
            get_files_with_prefix,
            get_zero_files,
        )

        self.dir = tag_dir_of(load_dir)
        files = get_files(self.dir)
        self.layer_files = sorted(f for f in files if LAYER_FILE.fullmatch(os.path.basename(f)))
        model_files = get_files_with_prefix(files, ds.MODEL_FILE_PREFIX)
        # DeepSpeed's universal checkpoint (ds_to_universal): zero/<parameter>/fp32.pt, ... and the mp_rank files
        self.universal = os.path.isdir(os.path.join(self.dir, "zero"))
        if not (self.layer_files or self.universal) or not model_files:
            raise ValueError(
                f"{self.dir} is not a Megatron-DeepSpeed pipeline checkpoint: it needs "
                "layer_XX-model_YY-model_states.pt (or a universal checkpoint's zero/) and "
                "mp_rank_XX_model_states.pt files (a checkpoint saved with --no-pipeline-parallel, or "
                "of another program, cannot be imported)"
            )
        self._read_args()
        # before the layout is read from the file names (a missing TP rank reads as a smaller TP)
        check_files(self, model_files)
        check_args_agree(self, model_files)
        zero_files = [] if self.universal else get_zero_files(self.dir)
        layout = self._read_layout(files, zero_files, model_files)
        self._open_zero(zero_files, layout)
        self.layers = self._layer_indices()
        check_layers(self)

    def _read_args(self):
        """Megatron's own state (args, iteration, tokens, lr_scheduler), from mp_rank_00."""
        self.tp = self.pp = 1
        self._shapes = {}
        self.state = self.model_state(0, 0)
        self.args = self.state.get("args")
        if getattr(self.args, "num_layers", None) is None:
            raise ValueError(
                f"{self.dir}'s mp_rank_00_model_states.pt holds no Megatron 'args': not a "
                "Megatron-DeepSpeed checkpoint"
            )

    def _read_layout(self, files, zero_files, model_files):
        """DeepSpeed's 3D layout (kept as tp, pp, dp), refused if mp_rank files are missing."""
        from deepspeed.checkpoint.reshape_3d_utils import (
            get_model_3d_descriptor_from_metadata,
            model_3d_desc,
        )

        # the layout from the file names alone (TP = the embedding layer's files, PP = model files / TP); a
        # universal checkpoint has no layer files: its args say
        layout = (
            model_3d_desc(
                self.args.pipeline_model_parallel_size, self.args.tensor_model_parallel_size
            )
            if self.universal
            else get_model_3d_descriptor_from_metadata(
                files, zero_files, [(f, {}) for f in model_files]
            )
        )
        self.tp, self.pp, self.dp = layout.tp_degree, layout.pp_degree, layout.dp_degree
        if len(model_files) != self.tp * self.pp:
            raise ValueError(
                f"{self.dir} has {len(model_files)} mp_rank_*_model_states.pt files for TP={self.tp}: "
                "some are missing; copy the whole checkpoint directory"
            )
        return layout

    def _open_zero(self, zero_files, layout):
        """DeepSpeed's reader of the ZeRO partitions, if any; whether optimizer state was saved."""
        self.zero = None
        if zero_files:
            from deepspeed.checkpoint.zero_checkpoint import ZeROCheckpoint

            self.zero = ZeROCheckpoint(self.dir, source_3d=layout)
        self.has_optimizer = self.universal or self.zero is not None

    def _layer_indices(self):
        """The pipeline layer indices held: from the layer files, or a universal one's zero/."""
        if not self.universal:
            return sorted(
                {int(LAYER_FILE.fullmatch(os.path.basename(f)).group(1)) for f in self.layer_files}
            )
        # the embedding (1), then the layers its parameters name: the blocks, the final norm
        return [1] + sorted(
            {
                int(n.split(".")[0])
                for n in os.listdir(os.path.join(self.dir, "zero"))
                if n.split(".")[0].isdigit()
            }
        )

    def model_state(self, pp, tp):
        # by name, not by place in the sorted list: mp_rank_100 sorts before mp_rank_11 (tr8b-104B had 128)
        path = os.path.join(self.dir, f"mp_rank_{pp * self.tp + tp:02d}_model_states.pt")
        if not os.path.isfile(path):
            raise ValueError(
                f"{path} is missing: the checkpoint is incomplete; copy the whole directory"
            )
        return read_file(path, f"engine state of stage {pp}, TP rank {tp}")

    def layer(self, index, tp):
        path = os.path.join(self.dir, f"layer_{index:02d}-model_{tp:02d}-model_states.pt")
        if not os.path.isfile(path):
            raise ValueError(
                f"{path} is missing: the checkpoint is incomplete; copy the whole directory"
            )
        return read_file(path, f"layer {index} of TP rank {tp}")

    def param_shapes(self, pp, tp):
        """The engine's param_shapes of (stage pp, TP rank tp): names and shapes only, kept (the mp_rank files
        are read once). DeepSpeed 0.19 saves none for bf16 without ZeRO (BF16_Optimizer, BLOOM's
        setup): then the ZeRO partitions' param_slice_mappings give them
        (shapes_from_slice_mappings)."""
        if (pp, tp) not in self._shapes:
            shapes = self.model_state(pp, tp).get("param_shapes")
            if not shapes and self.zero is not None:
                shapes = shapes_from_slice_mappings(self, pp, tp)
            self._shapes[pp, tp] = shapes
        return self._shapes[pp, tp]

    def zero_file(self, pp, tp, dp):
        """The ZeRO partition file of DP rank dp of (stage pp, TP rank tp). DeepSpeed's ZeROCheckpoint orders them
        by their numbers (sort_zero_files), not as text, where zero_pp_rank_10 would come before zero_pp_rank_2."""
        (path,) = self.zero.get_files_for_rank(pp_index=pp, tp_index=tp, dp_index=dp)
        return path

    def zero_shards(self, pp, tp, ranks=None):
        """The optimizer_state_dict of DP ranks `ranks` (default all) of (stage pp, TP rank tp), in DP order,
        memory-mapped."""
        return [
            read_file(
                self.zero_file(pp, tp, dp),
                f"ZeRO partition of DP rank {dp}, stage {pp}, TP rank {tp}",
            )["optimizer_state_dict"]
            for dp in (range(self.dp) if ranks is None else ranks)
        ]


# Megatron's args that every mp_rank file of one save holds alike (rank, local_rank and such differ)
AGREED_ARGS = SAME_ARGS + (
    "pipeline_model_parallel_size",
    "padded_vocab_size",
    "ffn_hidden_size",
    "max_position_embeddings",
    "position_embedding_type",
    "glu_activation",
    "tokenizer_type",
    "train_iters",
    "train_samples",
    "consumed_train_samples",
    "consumed_train_tokens",
)


def check_files(ckpt, model_files):
    """Every mp_rank and layer file of the TP x PP layout the args name is there, or one ValueError
    naming the missing ones. From the file names alone, a missing TP rank looks like a smaller TP
    size (then refused for a vocabulary or a layer count it does not have)."""
    tp = getattr(ckpt.args, "tensor_model_parallel_size", None)
    pp = getattr(ckpt.args, "pipeline_model_parallel_size", None)
    if not tp or not pp:
        return
    names = {os.path.basename(f) for f in model_files}
    missing = [f"mp_rank_{m:02d}_model_states.pt" for m in range(tp * pp)]
    missing = [name for name in missing if name not in names]
    ranks = {}  # layer index -> the TP ranks with its file
    for f in ckpt.layer_files:
        index, rank = LAYER_FILE.fullmatch(os.path.basename(f)).groups()
        ranks.setdefault(int(index), set()).add(int(rank))
    missing += [
        f"layer_{i:02d}-model_{t:02d}-model_states.pt"
        for i in sorted(ranks)
        for t in range(tp)
        if t not in ranks[i]
    ]
    if missing:
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise ValueError(
            f"{ckpt.dir} is incomplete: its args say TP={tp} x PP={pp}, and "
            f"{len(missing)} of its files are missing: "
            f"{', '.join(missing[:8])}{more}; copy the whole checkpoint directory"
        )


def check_layers(ckpt):
    """The layer files are the embedding, args.num_layers consecutive transformer layers and the final norm, or
    one ValueError naming the missing ones: our_name counts the blocks from the first one's index, and a
    missing one would shift the others (GPTModelPipe's layout: the embedding at E, the layers from E + 2, the
    final norm after one more function)."""
    n = ckpt.args.num_layers
    held, first = ckpt.layers, ckpt.layers[0] + 2
    blocks = held[1:-1]
    if len(held) == n + 2 and blocks == list(range(held[1], held[1] + n)):
        return
    expected = [held[0], *range(first, first + n), first + n + 1]
    missing = [i for i in expected if i not in held]
    names = ", ".join(f"layer_{i:02d}" for i in missing)
    named = (
        f"the files of {names} are missing"
        if missing and set(held) <= set(expected)
        else f"it holds layers {', '.join(map(str, held))}"
    )
    raise ValueError(
        f"{ckpt.dir} is incomplete: its args say num_layers={n} (the embedding, {n} transformer layers and "
        f"the final norm), and {named}; copy the whole checkpoint directory"
    )


def _comparable(value):
    """An arg's value comparable across files: a Megatron enum read without Megatron (a _StandIn) is
    equal to nothing but itself."""
    if isinstance(value, _StandIn):
        return type(value).__module__, type(value).__name__, value.args
    return value


def check_args_agree(ckpt, model_files):
    """Every mp_rank file's args (AGREED_ARGS) and iteration are mp_rank_00's, or one ValueError
    naming the file and the args that differ: files of two runs, or two saves, in one directory."""
    first = {k: _comparable(getattr(ckpt.args, k, None)) for k in AGREED_ARGS}
    first["iteration"] = ckpt.state.get("iteration")
    for path in sorted(model_files):
        if os.path.basename(path) == "mp_rank_00_model_states.pt":
            continue
        state = read_file(path, "engine state")
        theirs = {k: _comparable(getattr(state.get("args"), k, None)) for k in AGREED_ARGS}
        theirs["iteration"] = state.get("iteration")
        differ = [
            f"{k} {theirs[k]!r} (there) vs {first[k]!r}" for k in first if theirs[k] != first[k]
        ]
        if differ:
            raise ValueError(
                f"{path}'s args disagree with mp_rank_00_model_states.pt's: "
                f"{'; '.join(differ)}: the directory holds files of two runs or two "
                "saves; copy the whole checkpoint directory of one save"
            )


def shapes_from_slice_mappings(ckpt, pp, tp):
    """param_shapes of (stage pp, TP rank tp) from its ZeRO partitions' param_slice_mappings (each
    DP rank's {name: (numel, start)} in its part of each flat group) and the layer files' shapes,
    for a checkpoint whose engine saved none. The places must tile each group from 0 in DP order."""
    shards = ckpt.zero_shards(pp, tp)
    where = f"stage {pp}, TP rank {tp}"
    if any(not s.get("param_slice_mappings") for s in shards):
        raise ValueError(
            f"{ckpt.dir}: mp_rank_{pp * ckpt.tp + tp:02d}_model_states.pt holds no "
            f"param_shapes and the ZeRO partitions of {where} no "
            "param_slice_mappings: nothing names the parameters in the optimizer's "
            "flat groups; import the weights alone (Adam then restarts from step 0) "
            "by moving the *zero_pp_rank_* files away"
        )
    shapes, files = [], {}  # files: layer index -> {key: shape} of its file on TP rank tp
    for group in range(len(shards[0]["param_slice_mappings"])):
        places, base = {}, 0  # name -> [start, stop) in the group's flat tensor
        for shard in shards:
            for name, address in shard["param_slice_mappings"][group].items():
                start = base + address.start
                lo, hi = places.get(name, (start, start))
                if hi != start:
                    raise ValueError(
                        f"{ckpt.dir}: {name}'s fragments in the ZeRO partitions "
                        f"of {where} are not contiguous: the partitions are damaged "
                        "or of two runs"
                    )
                places[name] = (lo, start + address.numel)
            base += shard["single_partition_of_fp32_groups"][group].numel()
        names, end = OrderedDict(), 0
        for name, (lo, hi) in sorted(places.items(), key=lambda item: item[1]):
            layer, key = optimizer_name(ckpt, name)
            if layer not in files:
                files[layer] = {k: t.shape for k, t in ckpt.layer(layer, tp).items()}
            shape = files[layer].get(key)
            if shape is None or lo != end or hi - lo != math.prod(shape):
                found = "nothing" if shape is None else f"shape {tuple(shape)}"
                raise ValueError(
                    f"{ckpt.dir}: {name} takes elements [{lo}, {hi}) of ZeRO group "
                    f"{group} of {where}, where the previous parameter ends at {end}; "
                    f"layer {layer}'s file has {found} for it: the partitions and the "
                    "layer files are of two runs"
                )
            names[name], end = shape, hi
        shapes.append(names)
    return shapes


# -----------------------------------------------------------------------------
# Their names and ours


def our_name(ckpt, layer, key):
    """Our parameter name of `key` in layer file `layer` (the embedding, a transformer layer, the final norm)."""
    embedding, final = ckpt.layers[0], ckpt.layers[-1]
    table = EMBEDDING if layer == embedding else FINAL_NORM if layer == final else None
    if table is None:
        module, _, what = key.rpartition(".")
        ours = BLOCK.get(module)
        name = None if ours is None else f"blocks.{layer - ckpt.layers[1]}.{ours}.{what}"
    else:
        name = table.get(key)
    if name is None:
        raise ValueError(
            f"{ckpt.dir}: layer {layer} holds {key!r}, which this model has no place for (a "
            "Megatron-DeepSpeed feature stablegpt does not compute); it cannot be imported"
        )
    return name


def optimizer_name(ckpt, name):
    """(layer index, key in its layer file) of a name in the engine's param_shapes ('3.mlp.dense_4h_to_h.weight',
    'tied_modules.embed.word_embeddings.weight')."""
    if name.startswith(TIED):
        return ckpt.layers[0], name[len(TIED) :]
    index, _, key = name.partition(".")
    if not index.isdigit():
        raise ValueError(
            f"{ckpt.dir}: the optimizer holds {name!r}, not a parameter of GPTModelPipe's layers"
        )
    return int(index), key


def source_index(ckpt, tp):
    """{our name: (source stage, their optimizer name)} of TP rank tp, from every stage's param_shapes: where each
    parameter's optimizer state is. The tied embedding's at the first stage; the last stage's copies are not in it
    (check_tied_copies reads them), nor its unused position embedding."""
    out = {}
    for pp in range(ckpt.pp):
        shapes = ckpt.param_shapes(pp, tp)
        if not shapes:  # a universal checkpoint's: its ZeRO partitions are gone
            raise ValueError(
                f"{ckpt.dir}: mp_rank_{pp * ckpt.tp + tp:02d}_model_states.pt "
                "holds no param_shapes (the names and shapes of the optimizer's "
                "parameters), which a universal checkpoint needs; import the one it "
                "was made from"
            )
        for names in shapes:
            for name in names:
                if pp == 0 or not name.startswith(TIED):
                    out[our_name(ckpt, *optimizer_name(ckpt, name))] = pp, name
    return out


def _layer_of(ckpt, ours):
    """The index of the layer file holding our parameter `ours` (our_name's inverse, as far as the file)."""
    if ours.startswith("embed."):
        return ckpt.layers[0]
    if ours.startswith("ln_f."):
        return ckpt.layers[-1]
    return ckpt.layers[1] + int(ours.split(".")[1])  # blocks.<i>.


def stage_weights(ckpt, tp, names):
    """{our name: tensor} of `names` on TP rank tp, from the layer files of their layers alone, memory-mapped (a
    universal checkpoint's: its fp32 masters, one parameter's file at a time)."""
    if ckpt.universal:
        index = source_index(ckpt, tp)
        return {
            ours: universal_slice(ckpt, index[ours][1], "fp32", tp)
            for ours in sorted(names)
            if ours in index
        }
    out = {}
    for layer in sorted({_layer_of(ckpt, ours) for ours in names} & set(ckpt.layers)):
        for key, tensor in ckpt.layer(layer, tp).items():
            # every key of an opened file is checked: unknown ones are refused
            ours = our_name(ckpt, layer, key)
            if ours in names:
                out[ours] = tensor
    return out


def universal_slice(ckpt, name, key, tp):
    """TP rank tp's slice of a universal checkpoint's zero/<name>/<key>.pt (a whole tensor, cut along its cat_dim;
    replicated without one), the vocabulary's padding rows, which it drops, back as zeros."""
    blob = read_file(
        os.path.join(ckpt.dir, "zero", name, f"{key}.pt"), f"universal {key} of {name}"
    )
    if "sub_param_shape" in blob or "param_n_sub_params" in blob:
        raise ValueError(
            f"{ckpt.dir}: {name} is stored as sub-parameters (a GLU's fused weights), which this import "
            "does not read"
        )
    t = blob["param"]
    if blob.get("vocab_tensor"):
        t = torch.cat([t, t.new_zeros(ckpt.args.padded_vocab_size - t.shape[0], *t.shape[1:])])
    dim = blob.get("cat_dim")
    return t if dim is None else t.chunk(ckpt.tp, dim)[tp].clone()


def universal_states(ckpt, shapes, tp, wanted=None, keys=STATE_KEYS):
    """adam_states of a universal checkpoint: each parameter's fp32 master and moments (keys:
    which), the step in its own step.pt or (FusedAdam's) in the param group of
    zero/optimizer_state.pt."""
    common = None
    out = {}
    for group, names in enumerate(shapes):
        for name, shape in names.items():
            if wanted is not None and name not in wanted:
                continue
            state = {key: universal_slice(ckpt, name, key, tp) for key in keys}
            if any(tuple(t.shape) != tuple(shape) for t in state.values()):
                raise ValueError(
                    f"{ckpt.dir}: zero/{name} cut for TP rank {tp} of {ckpt.tp} is not of shape "
                    f"{tuple(shape)} (param_shapes): the universal checkpoint is of another layout"
                )
            step = os.path.join(ckpt.dir, "zero", name, "step.pt")
            if os.path.isfile(step):
                state["step"] = int(read_file(step, f"universal step of {name}"))
            else:
                common = common or read_file(
                    os.path.join(ckpt.dir, "zero", "optimizer_state.pt"), "optimizer state"
                )
                state["step"] = int(common["param_groups"][group]["step"])
            out[name] = state
    return out


def _group_states(shard, group):
    """(exp_avg and exp_avg_sq of one param group, flat; its step) in one DP rank's ZeRO partition. The base
    optimizer's state is torch's state_dict (one flat parameter per group) or, with DeepSpeed's elastic_checkpoint,
    a list of per-group states; FusedAdam (apex's, DeepSpeed's) counts the step in the param group."""
    base = shard["base_optimizer_state"]
    state = base[group] if isinstance(base, list) else base["state"].get(group, {})
    step = state.get("step")
    if step is None and isinstance(base, dict):
        step = base["param_groups"][group].get("step")
    if step is None:
        step = shard.get("base_optimizer_state_step")
    return state, step


def _flat_slice(parts, start, stop):
    """Elements [start, stop) of the DP partitions `parts` of one flat group, as if concatenated: a copy of those
    elements alone (the partitions are memory-mapped: only their pages are read)."""
    pieces, base = [], 0
    for part in parts:
        lo, hi = max(start - base, 0), min(stop - base, part.numel())
        if lo < hi:
            pieces.append(part[lo:hi])
        base += part.numel()
    return torch.cat(pieces)


def _checked_zero_shards(ckpt, pp, tp):
    """Every DP rank's ZeRO partition of (stage pp, TP rank tp) and the engine's param_shapes, or one ValueError
    naming a format this import does not read."""
    shapes = ckpt.param_shapes(pp, tp)
    shards = ckpt.zero_shards(pp, tp)
    if "single_partition_of_fp32_groups" not in shards[0] or not shapes:
        found = ", ".join(sorted(shards[0])[:6])
        raise ValueError(
            f"{ckpt.dir}: the ZeRO partitions hold {found}: not the ZeRO-1/2 or BF16 optimizer format "
            "of DeepSpeed >= 0.4 (flat fp32 groups and param_shapes); convert it with a DeepSpeed of "
            "its time, or import the weights alone by moving the *zero_pp_rank_* files away"
        )
    if any(any(p) for s in shards for p in s.get("param_alignment_paddings") or []):
        raise ValueError(
            f"{ckpt.dir}: the ZeRO partitions pad each parameter (DeepSpeed's parameter_alignment, "
            "newer than Megatron-DeepSpeed), which this import does not read; import the weights alone "
            "by moving the *zero_pp_rank_* files away"
        )
    return shards, shapes


def adam_states(ckpt, pp, tp, wanted=None, keys=STATE_KEYS):
    """{their optimizer name: {"fp32", "exp_avg", "exp_avg_sq", "step"}} of the parameters `wanted` (default all)
    of (stage pp, TP rank tp): each param group's DP partitions read as one flat tensor (the padding DeepSpeed
    adds for alignment is at its end) and cut into parameters in the order of the engine's param_shapes; only
    the wanted parameters' elements are read and copied. keys: which of the three tensors."""
    if ckpt.universal:
        return universal_states(ckpt, ckpt.param_shapes(pp, tp), tp, wanted, keys)
    shards, shapes = _checked_zero_shards(ckpt, pp, tp)
    out = {}
    for group, names in enumerate(shapes):
        states = [_group_states(s, group) for s in shards]
        parts = {"fp32": [s["single_partition_of_fp32_groups"][group] for s in shards]}
        parts.update(
            {key: [state[key] for state, _ in states] for key in ("exp_avg", "exp_avg_sq")}
        )
        steps = {None if step is None else int(step) for _, step in states}
        total, held = (
            sum(math.prod(shape) for shape in names.values()),
            sum(t.numel() for t in parts["fp32"]),
        )
        if (
            len(steps) != 1
            or None in steps
            or any(sum(t.numel() for t in p) < total for p in parts.values())
        ):
            raise ValueError(
                f"{ckpt.dir}: the ZeRO partitions of stage {pp}, TP rank {tp}, group {group} hold "
                f"{held} values and Adam steps {sorted(steps, key=str)} for {total} "
                "parameters: partitions are missing or of another checkpoint; copy the whole directory"
            )
        (step,) = steps
        offset = 0
        for name, shape in names.items():
            n = math.prod(shape)
            if wanted is None or name in wanted:  # copies: torch.save writes a view's whole storage
                out[name] = {
                    k: _flat_slice(parts[k], offset, offset + n).view(tuple(shape)) for k in keys
                }
                out[name]["step"] = step
            offset += n
    return out


def stage_adam(ckpt, tp, names):
    """{our name: {"fp32", "exp_avg", "exp_avg_sq", "step"}} of `names` on TP rank tp: only the ZeRO partitions
    of the source stages holding them are opened. The tied output layer's state is the first stage's word
    embedding's, as before this import worked stage by stage (check_tied_copies holds the last stage's copy to it)."""
    index, wanted = source_index(ckpt, tp), {}
    for ours in names:
        if ours in index:
            pp, theirs = index[ours]
            wanted.setdefault(pp, {})[theirs] = ours
    out = {}
    for pp, theirs in sorted(wanted.items()):
        for name, state in adam_states(ckpt, pp, tp, theirs).items():
            out[theirs[name]] = state
    return out


def check_tied_copies(ckpt, tp):
    """The last stage's copy of the tied word embedding was stepped with the same all-reduced gradient as the first
    stage's: its fp32 masters must be the same (lesson 11). Read from the two stages' partitions alone, before
    anything is written."""
    name = TIED + "word_embeddings.weight"
    if (
        ckpt.pp == 1
        or ckpt.universal
        or not any(name in g for g in ckpt.param_shapes(ckpt.pp - 1, tp) or [])
    ):
        return  # one copy; a universal checkpoint keeps one file per parameter
    first, last = (
        adam_states(ckpt, pp, tp, {name}, keys=("fp32",))[name]["fp32"] for pp in (0, ckpt.pp - 1)
    )
    if not torch.equal(first, last):
        raise ValueError(
            f"{ckpt.dir}: the last stage's fp32 copy of the tied word embedding differs from "
            f"the first stage's on TP rank {tp} (lesson 11); the checkpoint cannot be "
            "continued as it is: compare the two in Megatron-DeepSpeed, or repair one copy"
        )


def untrained(name, exp_avg_sq):
    """Where Adam's second moment says a parameter never had a gradient ('' if nowhere it should
    have): the whole tensor, or a row of the learned position table, which every step uses whole
    (its rows are seq_length: config_from_args holds that)."""
    if not exp_avg_sq.any():
        return "everywhere"
    if name.endswith("position_embeddings.weight"):
        rows = (exp_avg_sq.reshape(exp_avg_sq.shape[0], -1) == 0).all(dim=1).nonzero().flatten()
        if len(rows):
            more = f" and {len(rows) - 8} more" if len(rows) > 8 else ""
            return f"in rows {rows[:8].tolist()}{more}"
    return ""


def check_replicated_copies(ckpt, tp):
    """A universal checkpoint keeps one copy of a parameter that several pipeline stages hold (the
    tied embedding module: on the first stage, which trains all of it, and on the last, which uses
    its word embedding alone). ds_to_universal keeps the first stage's only when the checkpoint's
    universal_checkpoint_info names it (pipeline_replicated_parameter_patterns); the bigscience
    fork stores no such info and --inject_missing_state adds an empty one, so the last stage's copy
    is kept: its position embedding and embedding LayerNorm untrained, Adam's moments zero. Such
    copies are refused, named, before anything is written. (The import of a checkpoint that is not
    universal takes them from the first stage's own partitions: source_index.)"""
    if not ckpt.universal or ckpt.pp == 1:
        return
    stages = {}
    for pp in range(ckpt.pp):
        for names in ckpt.param_shapes(pp, tp):
            for name in names:
                stages.setdefault(name, set()).add(pp)
    found = []
    for name in sorted(n for n, held in stages.items() if len(held) > 1 and 0 in held):
        state = adam_states(ckpt, 0, tp, {name}, keys=("exp_avg_sq",))[name]
        where = untrained(name, state["exp_avg_sq"]) if state["step"] > 0 else ""
        if where:
            steps = state["step"]
            found.append(f"zero/{name} (Adam's exp_avg_sq zero {where} after {steps} steps)")
    if found:
        raise ValueError(
            f"{ckpt.dir} holds untrained copies of parameters that the first pipeline stage "
            f"trains: {', '.join(found)}. DeepSpeed's ds_to_universal kept the last stage's "
            "copies, as the checkpoint it converted names no "
            "pipeline_replicated_parameter_patterns (a bigscience-fork checkpoint has no "
            "universal_checkpoint_info; --inject_missing_state adds an empty one); import the "
            "original global_stepN directory instead, from which each parameter is taken from the "
            "stage that trains it"
        )


# -----------------------------------------------------------------------------
# Megatron's args and counters -> our config and run state


def _vocab_size(args, vocab_size):
    """The tokenizer's vocabulary (Megatron keeps only the padded size): given, or GPT-2's for its tokenizer."""
    if vocab_size is not None:
        return vocab_size
    if getattr(args, "tokenizer_type", None) == "GPT2BPETokenizer":
        return 50257
    raise ValueError(
        f"the checkpoint's tokenizer is {getattr(args, 'tokenizer_type', None)!r}, whose vocabulary "
        f"size Megatron does not store (only the padded {args.padded_vocab_size}): give it with "
        "--vocab_size (tokenizer.json's size, e.g. 250680 for BLOOM's)"
    )


def _model_keys(args):
    """Our keys of the model Megatron's args describe, or one ValueError naming what stablegpt does not compute."""
    keys = {}
    position = getattr(args, "position_embedding_type", "absolute")
    # the enum, or its name
    position = (getattr(position, "name", None) or str(position)).split(".")[-1]
    refusals = [
        (
            position not in POSITIONS,
            f"position_embedding_type {position} (stablegpt imports absolute and alibi positions)",
        ),
        (
            bool(getattr(args, "glu_activation", None)),
            f"glu_activation {getattr(args, 'glu_activation', 0)}",
        ),
        (
            getattr(args, "apply_residual_connection_post_layernorm", False),
            "apply_residual_connection_post_layernorm (the residual taken after the LayerNorm)",
        ),
        (
            position == "absolute"
            and getattr(args, "max_position_embeddings", args.seq_length) != args.seq_length,
            f"max_position_embeddings {getattr(args, 'max_position_embeddings', None)} "
            f"other than seq_length {args.seq_length} (stablegpt's table has seq_length rows)",
        ),
    ]
    for refused, what in refusals:
        if refused:
            raise ValueError(
                f"the Megatron-DeepSpeed checkpoint has {what}: stablegpt cannot continue it"
            )
    keys["position_embedding_type"] = POSITIONS[position]
    # Megatron's fused bias-GeLU (bias_gelu_fusion, its default) and openai_gelu are the tanh approximation
    tanh = getattr(args, "bias_gelu_fusion", False) or getattr(args, "openai_gelu", False)
    keys["activation"] = "gelu_tanh" if tanh else "gelu"
    ffn = getattr(args, "ffn_hidden_size", None)
    keys["ffn_hidden_size"] = None if ffn in (None, 4 * args.hidden_size) else ffn
    return keys


def config_from_args(
    ckpt,
    vocab_size=None,
    pipeline_model_parallel_size=None,
    pp_partition_method=None,
    padded_vocab_in_softmax=True,
):
    """Our training config of the checkpoint's run (arguments.Config), laid out as TP=its TP, PP=the given
    number of stages (default its own), DP=1. The LR schedule comes from the scheduler's own state (samples
    throughout, whichever unit its args used). padded_vocab_in_softmax: Megatron's softmax runs over the padded
    vocabulary too (lesson 16), so the run it continues is that model; False leaves the padding out from now on
    (a model of any TP size, no longer exactly Megatron's)."""
    args, lr = ckpt.args, ckpt.state.get("lr_scheduler") or {}
    keys = {k: getattr(args, k) for k in SAME_ARGS if getattr(args, k, None) is not None}
    keys.update(
        _model_keys(args),
        vocab_size=_vocab_size(args, vocab_size),
        tensor_model_parallel_size=ckpt.tp,
        pipeline_model_parallel_size=(
            ckpt.pp if pipeline_model_parallel_size is None else pipeline_model_parallel_size
        ),
        padded_vocab_in_softmax=padded_vocab_in_softmax,
    )
    if getattr(args, "rampup_batch_size", None):  # Megatron keeps the three numbers as strings
        keys["rampup_batch_size"] = [int(x) for x in args.rampup_batch_size]
    if pp_partition_method is not None and pp_partition_method not in parallel.PARTITION_METHODS:
        raise ValueError(
            f"--pp_partition_method {pp_partition_method!r} is not one of "
            f"{', '.join(parallel.PARTITION_METHODS)}"
        )
    # the source run's own value, where ours reads it: one we do not read is left at our default
    method = pp_partition_method or getattr(args, "pp_partition_method", None) or "type:transformer"
    if method in parallel.PARTITION_METHODS:
        keys["pp_partition_method"] = method
    if lr:
        keys.update(
            lr=lr["max_lr"],
            min_lr=lr["min_lr"],
            lr_decay_style=lr["decay_style"],
            lr_warmup_samples=lr["warmup_steps"],
            lr_decay_samples=lr["decay_steps"],
            lr_decay_tokens=getattr(args, "lr_decay_tokens", None),
        )
    length = (
        {"train_samples": args.train_samples}
        if getattr(args, "train_samples", None)
        else {"train_iters": getattr(args, "train_iters", None)}
    )
    cfg = arguments.Config(**keys, **length)
    # Megatron's args hold every flag, read or not (its loss scaler's beside bf16): ours, those its run read
    for key in (k for unread in sections.unread(cfg).values() for k in unread):
        setattr(cfg, key, arguments.FIELDS[key].default)
    padded = section(GPTConfig, cfg).padded_vocab_size
    if padded != args.padded_vocab_size:
        raise ValueError(
            f"vocab_size {cfg.vocab_size} pads to {padded} rows at TP={ckpt.tp} with "
            f"make_vocab_size_divisible_by={cfg.make_vocab_size_divisible_by}, the checkpoint has "
            f"{args.padded_vocab_size}: give the tokenizer's vocabulary size with --vocab_size"
        )
    return arguments.prepare(cfg, ckpt.tp * cfg.pipeline_model_parallel_size, reads_data=False)


def loss_scale_state(scaler, ours):
    """Our LossScaler's state_dict (ours: a fresh one's) from DeepSpeed's fp16 DynamicLossScaler. DeepSpeed
    doubles at an update whose stable interval (cur_iter - last_overflow_iter - 1) is a positive multiple of
    scale_window; ours after scale_window clean updates in a row: clean_steps is set so that the next doubling
    comes at the same update. Right after an overflow DeepSpeed waits scale_window + 1 updates: clean_steps -1."""
    if scaler is None or not getattr(scaler, "dynamic", False):
        return ours
    stable = scaler.cur_iter - scaler.last_overflow_iter - 1
    clean = (stable - 1) % scaler.scale_window if stable > 0 else -1
    return {
        "scale": float(scaler.cur_scale),
        "clean_steps": clean,
        "hysteresis_left": int(scaler.cur_hysteresis),
    }


def run_dict(ckpt, cfg):
    """The run dict of our checkpoint files ({"state", "scheduler", "scaler", "config"}) from Megatron's counters:
    iteration, consumed samples (args.consumed_train_samples) and tokens (`tokens`), the LR scheduler's samples
    (num_steps: applied iterations only) and tokens (num_tokens: Megatron counts every iteration's)."""
    args, sd = ckpt.args, ckpt.state
    lr = sd.get("lr_scheduler") or {}
    samples = int(getattr(args, "consumed_train_samples", 0) or 0)
    # A checkpoint that saved no token count ran every sample at full length (the curriculum that shortens
    # them is the bigscience fork's, which saves `tokens`); zero would be refused on resume as damaged.
    tokens = int(
        sd.get("tokens") or getattr(args, "consumed_train_tokens", 0) or samples * cfg.seq_length
    )
    state = run_state.RunState(
        iteration=int(sd["iteration"]),
        consumed_samples=samples,
        consumed_tokens=tokens,
        scheduler_samples=int(lr.get("num_steps", samples)),
        scheduler_tokens=int(lr.get("num_tokens", tokens)),
    )
    schedule_cfg = section(schedule.ScheduleConfig, cfg)
    # from the checkpoint's counters, as the resume of what this writes builds it (a decay over the run's length)
    annealing = schedule.Schedule(schedule_cfg, 1, cfg.seq_length, asdict(state)).lr_schedule
    scheduler = annealing.state_dict()
    # Megatron records the token count at the end of its sample warm-up in `warmup_tokens` (0 unless it decays
    # by tokens); ours in warmup_end_tokens, None while the warm-up lasts
    if annealing.warmup_samples and state.scheduler_samples >= annealing.warmup_samples:
        scheduler["warmup_end_tokens"] = int(lr.get("warmup_tokens", 0))
    scaler = None
    if ckpt.zero is not None and cfg.fp16:
        scaler = ckpt.zero_shards(0, 0, ranks=[0])[0].get("loss_scaler")
    fresh = optim.scaler_for(section(OptimizerConfig, cfg)).state_dict()
    return {
        "state": asdict(state),
        "scheduler": scheduler,
        "scaler": loss_scale_state(scaler, fresh),
        "config": asdict(cfg),
    }


# -----------------------------------------------------------------------------
# Our checkpoint


@dataclass(frozen=True)
class Target:
    """What our checkpoint's files follow from, of the run's config (convert makes it): the model's
    and the optimizer's sections, the layout's values that split the model and lay out the optimizer
    state, and the schedule's peak lr (the optimizer's param groups hold it)."""

    model_cfg: GPTConfig
    optim_cfg: OptimizerConfig
    pipeline_model_parallel_size: int
    pp_partition_method: str
    deepspeed: bool
    zero_stage: int
    lr: float


def _meta_stage(target, g):
    """Our model's stage of rank g on the meta device: its tensors' names, shapes and dtypes, no memory."""
    num_layers = target.model_cfg.num_layers
    layers = parallel.partition_layers(num_layers, g.pp_size, target.pp_partition_method)[g.pp_rank]
    with torch.device("meta"):
        gpt = GPT(target.model_cfg, layers, g.is_first_stage, g.is_last_stage, grid=g)
    return gpt.to(precision.compute_dtype(target.optim_cfg))


def stage_files(tag_dir, target, g, tensors, adam, run):
    """Write the files of rank g (TP rank, stage; DP=1): its stage built on the meta device names and shapes every
    tensor, and its optimizer (optim.optimizer_for) gives the state_dict layout our load reads. adam None: the
    weights alone, Adam fresh (no steps), the fp32 masters the weights. Returns the manifest entries."""
    gpt = _meta_stage(target, g)
    model_state = {}
    for name, live in gpt.state_dict().items():
        source = tensors.get(reshard.TIED_COPY.get(name, name))
        if source is None or source.shape != live.shape:
            found = "nothing" if source is None else f"shape {tuple(source.shape)}"
            raise ValueError(
                f"{name} of TP rank {g.tp_rank} needs shape {tuple(live.shape)}, the Megatron-DeepSpeed "
                f"checkpoint has {found}: its args do not describe its weights (or --vocab_size is "
                "wrong); check the checkpoint's files"
            )
        model_state[name] = source.to(live.dtype).clone()
    optimizer = optim.optimizer_for(
        target.optim_cfg, gpt, target.lr, target.deepspeed, target.zero_stage
    )
    template = optimizer.state_dict()
    masters = template.get("fp32_master_weights")
    names = reshard.param_names(gpt, optimizer)
    for index, name in enumerate(names):
        state = None if adam is None else adam.get(reshard.TIED_COPY.get(name, name))
        if adam is not None and (state is None or state["fp32"].shape != model_state[name].shape):
            raise ValueError(
                f"the ZeRO partitions of TP rank {g.tp_rank} hold no state of shape "
                f"{tuple(model_state[name].shape)} for {name}: the optimizer's param_shapes do not match "
                "the layer files; the checkpoint is of two runs, or damaged"
            )
        if masters is not None:  # the run's truth under fp16/bf16 (lesson 6)
            masters[index] = model_state[name].float() if state is None else state["fp32"]
        if state is not None:
            template["state"][index] = {
                "step": state["step"],
                "exp_avg": state["exp_avg"],
                "exp_avg_sq": state["exp_avg_sq"],
            }
    rank_state = {"optimizer": template, "rng": None, "param_names": names}
    return checkpoint.write_files(
        tag_dir, model_state, run, rank_state, write_model_state=True, g=g
    )


def _write_stage(ckpt, target, g, run, tag_dir):
    """Rank g's files: the state of its parameters alone is read (their layer files and the ZeRO partitions of
    the source stages holding them) and is freed on return, before the next rank's is read."""
    names = {reshard.TIED_COPY.get(name, name) for name in _meta_stage(target, g).state_dict()}
    tensors = stage_weights(ckpt, g.tp_rank, names)
    adam = stage_adam(ckpt, g.tp_rank, names) if ckpt.has_optimizer else None
    return stage_files(tag_dir, target, g, tensors, adam, run)


def _write(ckpt, target, run, tag_dir):
    """Every rank's files and the manifest into tag_dir, one (stage, TP rank) at a time; returns the last rank's
    grid."""
    tp, pp = target.model_cfg.tensor_model_parallel_size, target.pipeline_model_parallel_size
    if ckpt.has_optimizer:
        for t in range(tp):
            check_tied_copies(ckpt, t)
            check_replicated_copies(ckpt, t)
    entries, g = [], None
    for t in range(tp):
        for stage in range(pp):
            g = parallel.Grid(tp, pp, world_size=tp * pp, rank=stage * tp + t)
            entries.append(_write_stage(ckpt, target, g, run, tag_dir))
    checkpoint.write_manifest(tag_dir, entries, g)
    return g


def check_save_dir(save_dir, load_dir=None):
    """save_dir is new or empty, and outside the source checkpoint load_dir, or one ValueError; one that names
    a half-finished import left in it (a killed import's global_stepN.partial: kill -9 runs no clean-up),
    never deleted here."""
    if os.path.exists(save_dir) and not os.path.isdir(save_dir):
        raise ValueError(f"--save {save_dir} is a file: give a new or empty directory")
    source = load_dir and os.path.realpath(load_dir)
    if source and (os.path.realpath(save_dir) + os.sep).startswith(source + os.sep):
        # DeepSpeed's readers walk the source's tree: our files inside it would be read as its own
        raise ValueError(
            f"--save {save_dir} is inside the Megatron-DeepSpeed checkpoint --load {load_dir}, which "
            "the import only reads; give a directory outside it"
        )
    files.check_output_dir(save_dir, "--save", "a new or empty directory")
    held = sorted(os.listdir(save_dir)) if os.path.isdir(save_dir) else []
    leftovers = [n for n in held if n.endswith(".partial")]
    if leftovers:
        raise ValueError(
            f"{save_dir} holds {', '.join(leftovers)}: a half-finished import, killed "
            f"before it completed; delete it (rm -r "
            f"{os.path.join(save_dir, leftovers[0])}) and run the import again"
        )
    if held:
        raise ValueError(
            f"{save_dir} is not empty: the import writes a new checkpoint directory; "
            "give an empty or new --save"
        )


def convert(ckpt, save_dir, cfg, log=print):
    """Write our checkpoint of ckpt (a Checkpoint) into save_dir/global_stepN with cfg's layout (TP the
    checkpoint's, DP=1), its manifest, then `latest`. Returns the tag directory. A tool of the
    upper floor, as tools/import_megatron_deepspeed.py's own: it (and run_dict) read the whole
    config, which the checkpoint records whole; the files' writers get the Target."""
    check_save_dir(save_dir)
    if not ckpt.has_optimizer:
        log(
            f"no ZeRO optimizer files in {ckpt.dir}: importing the weights alone; the run continues with a fresh "
            "Adam (step 0, zero moments) and fp32 masters from the weights"
        )
    run = run_dict(ckpt, cfg)
    tag_dir = os.path.join(save_dir, f"global_step{run['state']['iteration']}")
    # written into .partial, renamed when complete: a refusal half-way (a damaged partition) leaves nothing
    partial, created = tag_dir + ".partial", not os.path.exists(save_dir)
    os.makedirs(partial)
    try:
        target = Target(
            section(GPTConfig, cfg),
            section(OptimizerConfig, cfg),
            cfg.pipeline_model_parallel_size,
            cfg.pp_partition_method,
            cfg.deepspeed,
            cfg.zero_stage,
            cfg.lr,
        )
        g = _write(ckpt, target, run, partial)
    except BaseException:
        shutil.rmtree(save_dir if created else partial)
        raise
    os.replace(partial, tag_dir)
    checkpoint.point_latest(save_dir, os.path.basename(tag_dir))
    state = run["state"]
    log(
        f"imported {ckpt.dir} (TP={ckpt.tp} x PP={ckpt.pp} x DP={ckpt.dp}) into {tag_dir} as "
        f"{reshard.describe(checkpoint.topology(g))}: iteration {state['iteration']}, consumed samples "
        f"{state['consumed_samples']:,}, tokens {state['consumed_tokens']:,}; load it with any layout"
    )
    return tag_dir
