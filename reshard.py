"""Checkpoints that change topology: resume a checkpoint saved with one TP x PP x DP layout on any other.

DeepSpeed's universal checkpoint does this offline (merge every parameter into one file, then slice on load);
here it happens inside the load, so `load=DIR` simply works with another number of GPUs, and nothing is written
twice. Every rank of the new layout opens the old layout's files memory-mapped and copies out only the bytes of
its own slices:

- a parameter split over TP carries `tp_dim` (parallel.py): its old slices, side by side along that dimension,
  are the full tensor, of which the new rank takes its part. The word embedding's rows are the vocabulary padded
  to a multiple of make_vocab_size_divisible_by x TP: when the new TP size pads differently, the padding rows
  are dropped and new ones added as zeros, as the model initialises them (they are masked out of the softmax);
- a replicated parameter (LayerNorms, row-parallel biases) is taken from one TP rank after checking that every
  TP rank holds the same values (lesson 18: they can drift apart); the last stage's copy of the tied embedding
  must equal the first stage's (lesson 11) and is rebuilt from it;
- the optimizer state is found by parameter *name* (each rank file lists the names in the order of the
  optimizer's state_dict, see param_names), merged over the DP ranks' ZeRO-1 shards, and each per-parameter
  tensor shaped like the parameter (Adam's moments, fp32 master weights) is re-sliced exactly like the parameter;
  scalars (Adam's step) must agree across TP ranks. That rule, in optimizer_state(), is the one place to extend
  for a new optimizer state format;
- the run state (iteration, consumed samples and tokens, LR schedule, loss scaler) is global: rank 0's copy.

What cannot move: the RNG states (a dropout stream belongs to a rank of the old layout), so a resharded run
draws fresh streams seeded from seed + iteration, and says so; bitsandbytes' 8-bit optimizer states when TP
changes (their quantization blocks run along the flattened tensor, which a new TP cut would split) and
DeepSpeed's optimizer states (its own format): both are refused with the fix (the old layout, or no_load_optim).
"""

from dataclasses import fields

import torch

import checkpoint
import parallel
import safety
from model import GPT, GPTConfig

# rows are the padded vocabulary
VOCAB_PARAMS = ("embed.word.weight", "output_weight", "output_layer")
# the last stage's copy of the tied word embedding
TIED_COPY = {"output_weight": "embed.word.weight"}


def param_names(model, optimizer):
    """Names of the parameters in the order of optimizer.state_dict()'s integer keys (saved next to the optimizer
    state, so that another layout can find an entry by name). For ZeRO-1: this DP rank's shard only."""
    names = {id(p): n for n, p in parallel.unwrap(model).named_parameters()}
    # Under fp16/bf16 the optimizer steps fp32 masters (precision.MixedPrecisionOptimizer, possibly inside
    # parallel.ZeroShardedOptimizer): its model_params are the model's parameters in the same order.
    params = getattr(optimizer, "model_params", None)
    if params is None:
        inner = getattr(optimizer, "optimizer", optimizer)
        params = [p for group in inner.param_groups for p in group["params"]]
    return [names[id(p)] for p in params]


def describe(topology):
    return (
        f"TP={topology['tensor_model_parallel_size']} x PP={topology['pipeline_model_parallel_size']} x "
        f"DP={topology['data_parallel_size']}"
    )


class SavedLayout:
    """The files of a checkpoint written by another layout, each opened once, memory-mapped."""

    def __init__(self, tag_dir, topology):
        self.tag_dir = tag_dir
        self.tp, self.pp, self.dp = (
            topology[k]
            for k in (
                "tensor_model_parallel_size",
                "pipeline_model_parallel_size",
                "data_parallel_size",
            )
        )
        self.paper = {}  # (tp, dp, pp) -> a Grid on paper, to name the files of that rank
        self._models, self._ranks = {}, {}
        self.run = self.model(0, 0)["run"]
        self.config = self.run["config"]
        # which old stage holds each parameter name (TP rank 0's files have the same names as the others)
        self.stage_of = {}
        for pp in reversed(range(self.pp)):  # the first stage wins for the tied embedding
            for name in self.model(0, pp)["model"]:
                self.stage_of[TIED_COPY.get(name, name) if pp else name] = pp

    def grid(self, tp, dp, pp):
        return parallel.Grid(
            self.tp,
            self.pp,
            world_size=self.tp * self.pp * self.dp,
            rank=(pp * self.dp + dp) * self.tp + tp,
        )

    def model(self, tp, pp):
        if (tp, pp) not in self._models:
            path = checkpoint.model_file(self.tag_dir, self.grid(tp, 0, pp))
            self._models[tp, pp] = checkpoint.read(
                path, f"model shard of TP rank {tp}, stage {pp}", mmap=True
            )
        return self._models[tp, pp]

    def rank(self, tp, dp, pp):
        if (tp, dp, pp) not in self._ranks:
            path = checkpoint.rank_file(self.tag_dir, self.grid(tp, dp, pp))
            self._ranks[tp, dp, pp] = checkpoint.read(path, "optimizer and RNG state", mmap=True)
        return self._ranks[tp, dp, pp]


def reslice(pieces, dim, real, total, tp, rank):
    """This rank's part, along dim, of the tensor whose old TP slices are `pieces`: of their concatenation only
    the first `real` entries count (the rest is vocabulary padding); the new full tensor has `total` entries
    (zero padding after the real ones) cut into tp equal parts. Copies only the overlapping ranges."""
    size = total // tp
    start = rank * size
    shape = list(pieces[0].shape)
    shape[dim] = size
    out = torch.zeros(shape, dtype=pieces[0].dtype)
    offset = 0
    for piece in pieces:
        n = piece.shape[dim]
        lo, hi = max(offset, start), min(offset + n, start + size, real)
        if lo < hi:
            out.narrow(dim, lo - start, hi - lo).copy_(piece.narrow(dim, lo - offset, hi - lo))
        offset += n
    return out


class Resharder:
    """Builds this rank's model, optimizer and run state from a SavedLayout (see the module docstring)."""

    def __init__(self, layout, gpt):
        self.old, self.gpt, self.grid = layout, gpt, gpt.grid
        self.params = dict(gpt.named_parameters())
        saved_vocab = layout.config.get("vocab_size")
        if saved_vocab != gpt.config.vocab_size:
            raise ValueError(
                f"checkpoint {layout.tag_dir} has vocab_size {saved_vocab}, this model "
                f"{gpt.config.vocab_size}; resume with the checkpoint's vocab_size"
            )

    def _pieces(self, name, get):
        """[get(state dict of old TP rank t at the stage holding name) for each old TP rank t]."""
        src = TIED_COPY.get(name, name)
        if src not in self.old.stage_of:
            raise ValueError(
                f"checkpoint {self.old.tag_dir} has no parameter {src!r}; it was saved from another "
                "model (compare its config with this one's)"
            )
        return [get(t, self.old.stage_of[src], src) for t in range(self.old.tp)]

    def _merge(self, name, pieces, live_shape, what):
        """The new slice of `name` (or of an optimizer tensor shaped like it) from its old TP pieces."""
        tp_dim = getattr(self.params.get(name), "tp_dim", None)
        if tp_dim is None:
            for t, piece in enumerate(pieces[1:], 1):
                if not torch.equal(piece, pieces[0]):
                    raise ValueError(
                        f"{what} of {name!r} differs between TP rank 0 and TP rank {t} in checkpoint "
                        f"{self.old.tag_dir}: replicated copies must be identical (lesson 18); "
                        "resume with the saved layout, or repair the checkpoint"
                    )
            return pieces[0]
        old_total, total = (
            sum(p.shape[tp_dim] for p in pieces),
            live_shape[tp_dim] * self.grid.tp_size,
        )
        # the vocabulary's padding rows are dropped (and zeros padded) only when the padded size changes
        real = self.gpt.config.vocab_size if name in VOCAB_PARAMS and old_total != total else total
        other_dims = [n for d, n in enumerate(pieces[0].shape) if d != tp_dim]
        if other_dims != [n for d, n in enumerate(live_shape) if d != tp_dim] or (
            name not in VOCAB_PARAMS and old_total != total
        ):
            raise ValueError(
                f"checkpoint {self.old.tag_dir}: {name!r} has {self.old.tp} slices of shape "
                f"{tuple(pieces[0].shape)}, this model needs {tuple(live_shape)} x TP "
                f"{self.grid.tp_size}: the model config differs from the checkpoint's"
            )
        return reslice(pieces, tp_dim, real, total, self.grid.tp_size, self.grid.tp_rank)

    def model_state(self):
        old = self.old
        tied = not self.gpt.config.untie_embeddings_and_output_weights
        if tied and old.pp > 1 and (self.gpt.pre_process or self.gpt.post_process):
            for t in range(old.tp):  # the tied embedding's two copies must agree (lesson 11)
                first, last = (
                    old.model(t, 0)["model"]["embed.word.weight"],
                    old.model(t, old.pp - 1)["model"],
                )
                if not torch.equal(first, last["output_weight"]):
                    raise ValueError(
                        f"checkpoint {old.tag_dir}: the last stage's copy of the tied word embedding "
                        f"differs from the first stage's on TP rank {t} (lesson 11); resume with the "
                        "saved layout to investigate (dump_weights)"
                    )
        out = {}
        for name, live in self.gpt.state_dict().items():
            pieces = self._pieces(name, lambda t, pp, src: old.model(t, pp)["model"][src])
            out[name] = self._merge(name, pieces, live.shape, "the weight")
        return out

    def _old_optimizer(self, t, pp):
        """{name: per-parameter state} of the old (TP t, stage pp), merged over the DP ranks' ZeRO-1 shards."""
        states, dp = {}, 0
        while dp < self.old.dp:
            blob = self.old.rank(t, dp, pp)
            names, opt = blob.get("param_names"), blob["optimizer"]
            if names is None:
                raise ValueError(
                    f"checkpoint {self.old.tag_dir} does not name its optimizer's parameters (saved "
                    "under DeepSpeed, or by an older version): its optimizer state cannot be "
                    "resharded; resume with the saved layout, or set no_load_optim"
                )
            zero = opt.get("zero_stage") == 1
            inner = opt["optimizer"] if zero else opt
            # The fp32 masters (fp16/bf16, lesson 6) are listed in the same order as the names: every parameter
            # of a half-precision model has one. Kept as one more per-parameter state, re-sliced like the rest.
            masters = inner.get("fp32_master_weights")
            if masters is not None and len(masters) != len(names):
                raise ValueError(
                    f"checkpoint {self.old.tag_dir} holds {len(masters)} fp32 master weights for "
                    f"{len(names)} parameters: it cannot be resharded; resume with the saved layout, "
                    "or set no_load_optim (the masters then start from the weights)"
                )
            for index, name in enumerate(names):
                state = inner["state"].get(index)
                if masters is not None:
                    state = dict(state or {}, fp32_master=masters[index])
                if state is not None:
                    states[name] = state
            # without ZeRO every DP rank holds the same full state
            dp = dp + 1 if zero else self.old.dp
        return states

    def optimizer_state(self, optimizer, model, use_bnb_optimizer=False):
        """optimizer.state_dict() with every parameter's state filled in from the old layout."""
        old, cache = self.old, {}
        config = old.config
        self._check_optimizer_reshardable(use_bnb_optimizer)

        def old_state(t, pp, src):
            if (t, pp) not in cache:
                cache[t, pp] = self._old_optimizer(t, pp)
            return cache[t, pp].get(src)

        # The same TP cut (and vocabulary padding): each TP rank's state is what it was, whatever its format.
        same_cut = (
            old.tp == self.grid.tp_size
            and config.get("make_vocab_size_divisible_by")
            == self.gpt.config.make_vocab_size_divisible_by
        )
        template = optimizer.state_dict()
        inner = template["optimizer"] if "zero_stage" in template else template
        # this run's masters (fp16/bf16), to be replaced one by one
        masters = inner.get("fp32_master_weights")
        for index, name in enumerate(param_names(model, optimizer)):
            states = self._pieces(name, old_state)
            if any(s is None for s in states):
                if all(s is None for s in states) and masters is None:
                    continue  # never stepped
                raise ValueError(
                    f"checkpoint {old.tag_dir} has no optimizer state (or fp32 master weight) for "
                    f"{name!r} on some TP ranks: saved with another precision? Resume with the same "
                    "fp16/bf16 setting, or set no_load_optim"
                )
            if same_cut:
                merged = dict(states[self.grid.tp_rank])
            else:
                merged = self._merge_state(name, states)
            master = merged.pop("fp32_master", None)
            if masters is not None:
                if master is None:
                    raise ValueError(
                        f"checkpoint {old.tag_dir} has no fp32 master weight for {name!r} (saved "
                        "without fp16/bf16): resume with the same precision, or set no_load_optim"
                    )
                masters[index] = master.float()
            if merged:
                inner["state"][index] = merged
        return template

    def _check_optimizer_reshardable(self, use_bnb_optimizer):
        """Refuses an old optimizer state that cannot be resharded into this run's optimizer."""
        old = self.old
        config = old.config
        if config.get("deepspeed"):
            raise ValueError(
                f"checkpoint {old.tag_dir} holds DeepSpeed's optimizer state, which cannot be "
                "resharded here; resume with the saved layout, or set no_load_optim"
            )
        if bool(config.get("use_bnb_optimizer")) != use_bnb_optimizer:
            raise ValueError(
                f"checkpoint {old.tag_dir} was saved with use_bnb_optimizer="
                f"{bool(config.get('use_bnb_optimizer'))}: its optimizer state is not this optimizer's; "
                "resume with the same use_bnb_optimizer, or set no_load_optim"
            )
        if config.get("use_bnb_optimizer") and old.tp != self.grid.tp_size:
            raise ValueError(
                "bitsandbytes' 8-bit optimizer states are quantized in blocks along the flattened "
                f"tensor, which a new tensor_model_parallel_size cuts apart: resume with "
                f"tensor_model_parallel_size={old.tp} (PP and DP may change), or set no_load_optim"
            )

    def _merge_state(self, name, states):
        """One parameter's optimizer state for this rank, from the old TP ranks' states of it."""
        old = self.old
        live = self.params[name]
        tp_dim = getattr(live, "tp_dim", None)
        merged = {}
        for key, value in states[0].items():
            values = [s[key] for s in states]
            if torch.is_tensor(value) and value.ndim > 0:
                like_param = value.is_floating_point() and (
                    tp_dim is None
                    and value.shape == live.shape
                    or tp_dim is not None
                    and value.ndim == live.ndim
                )
                if not like_param:
                    raise ValueError(
                        f"optimizer state {key!r} of {name!r} (shape {tuple(value.shape)}, "
                        f"{value.dtype}) is not shaped like the parameter and cannot be re-sliced "
                        f"for TP={self.grid.tp_size}; resume with tensor_model_parallel_size="
                        f"{old.tp}, or set no_load_optim"
                    )
                merged[key] = self._merge(name, values, live.shape, f"optimizer state {key!r}")
            else:  # Adam's step, as an int or a 0-d tensor: the same on every TP rank
                if any(not torch.equal(torch.as_tensor(v), torch.as_tensor(value)) for v in values):
                    raise ValueError(
                        f"optimizer state {key!r} of {name!r} differs across TP ranks in "
                        f"checkpoint {old.tag_dir}: {values}"
                    )
                merged[key] = value
        return merged


def load(
    layout,
    model,
    optimizer,
    deepspeed=False,
    use_bnb_optimizer=False,
    need_optimizer=True,
):
    """(model_state, run_state, rank_state) for this rank from a checkpoint of another layout (a SavedLayout), in
    the format checkpoint.load returns; rank_state's "rng" is None (see the module docstring).
    need_optimizer=False (no_load_optim, an optimizer reset due now) skips the optimizer state, whatever its
    format. deepspeed (the layout's) and use_bnb_optimizer (the optimizer's): the run's keys of those names."""
    gpt = parallel.unwrap(model)
    resharder = Resharder(layout, gpt)
    model_state = resharder.model_state()
    optimizer_state = None
    if need_optimizer:
        if deepspeed:
            raise ValueError(
                "resharding into DeepSpeed's optimizer is not supported: resume with the saved layout, "
                "or set no_load_optim (the weights are resharded, the optimizer starts fresh)"
            )
        optimizer_state = resharder.optimizer_state(optimizer, model, use_bnb_optimizer)
    return model_state, layout.run, {"optimizer": optimizer_state, "rng": None}


def saved_model_config(load_dir):
    """(the GPTConfig of load_dir's latest checkpoint's model in one process, the checkpoint's training
    config as a dict, its tag directory), no tensor read: what load_full_model builds, for a tool to
    refuse a model before the gather."""
    if parallel.grid.world_size != 1:
        raise ValueError("a checkpoint is gathered into one process: run this as one process")
    checkpoint.check_directory(load_dir)
    tag_dir = checkpoint.latest_dir(load_dir)
    if tag_dir is None:
        raise ValueError(f"{load_dir} holds no checkpoint (no '{checkpoint.LATEST}' file)")
    saved = safety.checkpoint_run(tag_dir)["config"]
    cfg = GPTConfig(**{f.name: saved[f.name] for f in fields(GPTConfig) if f.name in saved})
    cfg.tensor_model_parallel_size = 1
    return cfg, saved, tag_dir


def load_full_model(load_dir):
    """The model of load_dir's latest checkpoint, whatever its layout, gathered into this one process (TP=1,
    PP=1, the vocabulary padded for one process), on the CPU in eval mode: (GPT, the checkpoint's training config
    as a dict, its tag directory). What tools/sample.py and tools/export_hf.py read."""
    cfg, saved, tag_dir = saved_model_config(load_dir)
    layout = SavedLayout(tag_dir, checkpoint.saved_topology(tag_dir))
    with torch.device("cpu"):
        gpt = GPT(cfg).eval()
    gpt.load_state_dict(Resharder(layout, gpt).model_state())
    return gpt, saved, tag_dir
