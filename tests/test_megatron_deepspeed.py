"""Megatron-DeepSpeed checkpoints in (megatron_ds.py, tools/import_megatron_deepspeed.py).

The reference is a run of ours: 3 iterations straight at TP1 (bf16, dropout off, the GPT-2 vocabulary), saving at
iteration 2. Its iteration-2 state is written out as Megatron-DeepSpeed would have saved it at TP2 x PP2 x DP2
(write_megatron_checkpoint: GPTModelPipe's layer files, the vocabulary padded for TP2, the fused QKV rebuilt head by
head from q, k and v, the engine's mp_rank states with param_shapes and Megatron's args, iteration, tokens,
checkpoint_info and lr_scheduler, BF16-optimizer ZeRO partitions with the flat fp32 groups, Adam's moments and
FusedAdam's step in the param group, the tied embedding's copy on the last stage), imported, and resumed:
- at TP1 the resumed iteration 3 equals the straight run's bit for bit (its loss, and the weights, fp32 masters,
  moments and step of its checkpoint);
- at TP2 x PP2 (the written layout, loaded as each of its four ranks) every weight, master and moment is the
  reference's slice, and the counters and LR schedule are carried over.
"""

import argparse
import contextlib
import enum
import math
import os
import re
import runpy
import subprocess
import sys
import types
from collections import OrderedDict

import pytest
import torch

import arguments
import checkpoint
import megatron_ds
import optim
import parallel
import run_state
import safety
import schedule
import training
from builders import build_model, build_optimizer
from helpers import ROOT, assert_same, final_state, losses, plan_of, run_main

TP, PP, DP = 2, 2, 2
ARGS = [
    "--num_layers=2",
    "--hidden_size=64",
    "--num_attention_heads=4",
    "--seq_length=32",
    "--micro_batch_size=2",
    "--global_batch_size=4",
    "--bf16",
    "--activation=gelu_tanh",
    "--lr_warmup_samples=4",
    "--lr_decay_samples=40",
    "--train_iters=3",
    "--log_interval=1",
    "--eval_interval=1000",
    "--eval_iters=1",
    "--sample_tokens=0",
    "--device=cpu",
]
BLOCK = {
    "ln_1": "input_layernorm",
    "attn.qkv": "self_attention.query_key_value",
    "attn.proj": "self_attention.dense",
    "ln_2": "post_attention_layernorm",
    "mlp.fc1": "mlp.dense_h_to_4h",
    "mlp.fc2": "mlp.dense_4h_to_h",
}
# row-parallel: split along the inputs
COLUMNS = ("self_attention.dense.weight", "mlp.dense_4h_to_h.weight")
# split along the outputs
ROWS = ("word_embeddings.weight", "self_attention.query_key_value", "mlp.dense_h_to_4h")


class PositionEmbeddingType(enum.Enum):  # megatron.enums's, pickled into args as Megatron does
    rotary = 1
    absolute = 2
    alibi = 3


PositionEmbeddingType.__module__ = "megatron.enums"


@contextlib.contextmanager
def _megatron_importable():
    """While the args are pickled: `megatron.enums` importable, as in a Megatron-DeepSpeed run. Not afterwards:
    the import reads them without Megatron installed."""
    enums = types.ModuleType("megatron.enums")
    enums.PositionEmbeddingType = PositionEmbeddingType
    sys.modules.update({"megatron": types.ModuleType("megatron"), "megatron.enums": enums})
    try:
        yield
    finally:
        del sys.modules["megatron"], sys.modules["megatron.enums"]


# -----------------------------------------------------------------------------
# Megatron-DeepSpeed's side, written from a state of ours


def _megatron_qkv(t, heads):
    """Our fused qkv (rows) -> Megatron's, rebuilt from q, k and v: each TP partition's output is [np, 3, hn]
    (ParallelAttention's view of mixed_x_layer), i.e. head by head, q then k then v."""
    q, k, v = t.view(heads, 3, -1, *t.shape[1:]).unbind(1)
    per_head = [torch.cat([q[h], k[h], v[h]]) for h in range(heads)]
    return torch.cat(per_head)


def _full_tensors(cfg, model, rank):
    """{Megatron name in GPTModelPipe (layer index, key): {"weight" (bf16), "fp32", "exp_avg", "exp_avg_sq"}} of
    the whole model, the vocabulary padded for TP2, from our one-process checkpoint."""
    opt = rank["optimizer"]
    names = rank["param_names"]
    padded = (
        math.ceil(cfg.vocab_size / (cfg.make_vocab_size_divisible_by * TP))
        * cfg.make_vocab_size_divisible_by
        * TP
    )
    out = {}
    for index, name in enumerate(names):
        state = opt["state"][index]
        tensors = {
            "weight": model[name],
            "fp32": opt["fp32_master_weights"][index],
            "exp_avg": state["exp_avg"],
            "exp_avg_sq": state["exp_avg_sq"],
        }
        if name == "embed.word.weight":
            tensors = {
                k: torch.cat([t, t.new_zeros(padded - t.shape[0], t.shape[1])])
                for k, t in tensors.items()
            }
        if name.endswith("attn.qkv.weight") or name.endswith("attn.qkv.bias"):
            tensors = {k: _megatron_qkv(t, cfg.num_attention_heads) for k, t in tensors.items()}
        out[_megatron_name(cfg, name)] = tensors
    return out, opt["state"][0]["step"]


def _megatron_name(cfg, name):
    embedding = {
        "embed.word.weight": "word_embeddings.weight",
        "embed.position.weight": "position_embeddings.weight",
        "embed.norm.weight": "word_embeddings.norm.weight",
        "embed.norm.bias": "word_embeddings.norm.bias",
    }
    if name in embedding:
        return 1, embedding[name]
    if name.startswith("ln_f."):
        return cfg.num_layers + 4, name[len("ln_f.") :]
    _, layer, rest = name.split(".", 2)
    module, what = rest.rsplit(".", 1)
    return 3 + int(layer), f"{BLOCK[module]}.{what}"


def _tp_slice(key, t, tp):
    if key in COLUMNS:
        return t.chunk(TP, dim=1)[tp].clone()
    if key.startswith(ROWS):
        return t.chunk(TP, dim=0)[tp].clone()
    return t.clone()


def _stage_layers(cfg, pp):
    """GPTModelPipe's layers with parameters on stage pp (partition 'type:transformer': the blocks split evenly)."""
    per = cfg.num_layers // PP
    blocks = list(range(3 + pp * per, 3 + (pp + 1) * per))
    return ([1] if pp == 0 else []) + blocks + ([cfg.num_layers + 4] if pp == PP - 1 else [])


def _param_groups(cfg, full, pp, tp):
    """The stage's ZeRO groups as Megatron builds them (its modules in order; LayerNorms and biases without weight
    decay): [[(optimizer name, {tensors})]] x 2. On the last stage the tied embedding module comes first, as
    `tied_modules` is registered before the layers, with its word embedding (a copy of the first stage's) and its
    unused position embedding."""
    decay, no_decay = [], []
    entries = [(layer, key) for (layer, key) in full if layer in _stage_layers(cfg, pp)]
    if pp == PP - 1:
        unused = {
            k: torch.full_like(t, 0.5) for k, t in full[1, "position_embeddings.weight"].items()
        }
        entries = [(1, "word_embeddings.weight"), (1, "position_embeddings.weight")] + entries
    for layer, key in entries:
        tensors = (
            unused
            if pp > 0 and (layer, key) == (1, "position_embeddings.weight")
            else full[layer, key]
        )
        name = f"tied_modules.embed.{key}" if layer == 1 else f"{layer}.{key}"
        norm = "layernorm" in key or ".norm." in key or layer == cfg.num_layers + 4
        group = no_decay if norm or key.endswith("bias") else decay
        group.append((name, {k: _tp_slice(key, t, tp) for k, t in tensors.items()}))
    return [decay, no_decay]


def _zero_partitions(groups, step, cfg, style):
    """Each DP rank's optimizer_state_dict of one (stage, TP rank). Each group is flattened, padded at its end to
    a multiple of nccl_start_alignment_factor (2) x DP and cut into DP parts. style "bf16": DeepSpeed's
    BF16_Optimizer with FusedAdam (tr11-176B): the partitions as they are, the step in the param group; "zero":
    DeepSpeedZeroOptimizer (fp16 ZeRO-1, tr8b-104B): torch Adam's state_dict with the padding and the step in the
    state, the fp32 groups without the padding; "elastic": its elastic_checkpoint, per-group states without the
    padding, the step beside them."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.utils.tensor_fragment import fragment_address

    flats, paddings = [], []
    for group in groups:
        flat = {
            k: torch.cat([t[k].float().flatten() for _, t in group])
            for k in ("fp32", "exp_avg", "exp_avg_sq")
        }
        padding = -flat["fp32"].numel() % (2 * DP)
        flats.append({k: torch.cat([t, t.new_zeros(padding)]) for k, t in flat.items()})
        paddings.append(padding)
    out = []
    for dp in range(DP):
        parts = [{k: t.chunk(DP)[dp].clone() for k, t in flat.items()} for flat in flats]
        pads = [pad if dp == DP - 1 else 0 for pad in paddings]
        lean = [{k: t[: t.numel() - pad] for k, t in p.items()} for p, pad in zip(parts, pads)]
        param_groups = [
            {
                "lr": 1e-3,
                "betas": (cfg.adam_beta1, cfg.adam_beta2),
                "eps": cfg.adam_eps,
                "weight_decay": wd,
                "bias_correction": True,
                "params": [g],
            }
            for g, wd in enumerate((cfg.weight_decay, 0.0))
        ]
        moments = [{"exp_avg": p["exp_avg"], "exp_avg_sq": p["exp_avg_sq"]} for p in parts]
        fp32 = [p["fp32"] for p in (parts if style == "bf16" else lean)]
        if style == "bf16":
            base = {
                "state": dict(enumerate(moments)),
                "param_groups": [dict(g, step=step) for g in param_groups],
            }
        elif style == "zero":
            base = {
                "state": {
                    g: dict(m, step=torch.tensor(float(step))) for g, m in enumerate(moments)
                },
                "param_groups": param_groups,
            }
        else:
            base = [{"exp_avg": p["exp_avg"], "exp_avg_sq": p["exp_avg_sq"]} for p in lean]
        shard = {
            "clip_grad": cfg.clip_grad,
            "base_optimizer_state": base,
            "single_partition_of_fp32_groups": fp32,
            "group_paddings": pads,
            "partition_count": [DP, DP],
            "ds_version": "0.6.0",
            "param_slice_mappings": _slice_mappings(groups, parts, dp, fragment_address),
        }
        if style != "bf16":
            shard.update(
                loss_scaler=DynamicLossScaler(2.0**16, 1000, 1.0, 2, False),
                dynamic_loss_scale=True,
                overflow=False,
                zero_stage=1,
            )
        if style == "elastic":
            shard["base_optimizer_state_step"] = step
        out.append(shard)
    return out


def _slice_mappings(groups, parts, dp, fragment_address):
    """DeepSpeed's param_slice_mappings of DP rank dp: each parameter's (numel, start) in its partition."""
    mappings = []
    for group, flat in zip(groups, parts):
        size, offset, mapping = flat["fp32"].numel(), 0, OrderedDict()
        for name, t in group:
            lo, hi = max(offset, dp * size), min(offset + t["fp32"].numel(), (dp + 1) * size)
            if lo < hi:
                mapping[name] = fragment_address(numel=hi - lo, start=lo - dp * size)
            offset += t["fp32"].numel()
        mappings.append(mapping)
    return mappings


def _megatron_args(cfg, run):
    state = run["state"]
    return argparse.Namespace(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        ffn_hidden_size=4 * cfg.hidden_size,
        seq_length=cfg.seq_length,
        max_position_embeddings=cfg.seq_length,
        padded_vocab_size=50432,
        make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by,
        tokenizer_type="GPT2BPETokenizer",
        layernorm_epsilon=cfg.layernorm_epsilon,
        init_method_std=cfg.init_method_std,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        apply_query_key_layer_scaling=False,
        embed_layernorm=True,
        position_embedding_type=PositionEmbeddingType.absolute,
        bias_gelu_fusion=True,
        openai_gelu=False,
        glu_activation=None,
        apply_residual_connection_post_layernorm=False,
        micro_batch_size=cfg.micro_batch_size,
        global_batch_size=cfg.global_batch_size,
        rampup_batch_size=None,
        train_iters=cfg.train_iters,
        train_samples=None,
        seed=cfg.seed,
        weight_decay=cfg.weight_decay,
        clip_grad=cfg.clip_grad,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_eps=cfg.adam_eps,
        fp16=False,
        bf16=True,
        loss_scale=None,
        initial_loss_scale=2**32,
        min_loss_scale=1.0,
        loss_scale_window=1000,
        hysteresis=2,
        tensor_model_parallel_size=TP,
        pipeline_model_parallel_size=PP,
        pp_partition_method=None,
        lr_decay_tokens=None,
        consumed_train_samples=state["consumed_samples"],
        consumed_train_tokens=state["consumed_tokens"],
        deepspeed=True,
    )


# What later Megatron-DeepSpeed (microsoft's) stores for DeepSpeed's ds_to_universal: how each parameter is cut
UNIVERSAL_INFO = {
    "universal_checkpoint_version": 0.2,
    "original_vocab_size": 50257,
    "padded_vocab_size": 50432,
    "vocabulary_parameter_patterns": [r"tied_modules.embed.word_embeddings.weight"],
    "pipeline_replicated_parameter_patterns": [
        r"tied_modules.embed.word_embeddings.weight",
        r"tied_modules.embed.position_embeddings.weight",
    ],
    "tp_replicated_parameter_patterns": [
        r"tied_modules.embed.word_embeddings.norm.weight",
        r"tied_modules.embed.word_embeddings.norm.bias",
        r"tied_modules.embed.position_embeddings.weight",
        r"\d+.input_layernorm.weight",
        r"\d+.input_layernorm.bias",
        r"\d+.post_attention_layernorm.weight",
        r"\d+.post_attention_layernorm.bias",
        r"\d+.self_attention.dense.bias",
        r"\d+.mlp.dense_4h_to_h.bias",
        r"\d+.weight",
        r"\d+.bias",
    ],
    "parameter_with_row_parallelism_patterns": [
        r"\d+.mlp.dense_4h_to_h.weight",
        r"\d+.self_attention.dense.weight",
    ],
}


def write_megatron_checkpoint(directory, cfg, model, rank, run, style="bf16"):
    """global_stepN of a Megatron-DeepSpeed run at TP2 x PP2 x DP2 holding our one-process state; style: the
    ZeRO optimizer's format (_zero_partitions)."""
    full, step = _full_tensors(cfg, model, rank)
    iteration = run["state"]["iteration"]
    tag_dir = os.path.join(directory, f"global_step{iteration}")
    os.makedirs(tag_dir)
    for (
        layer,
        key,
    ), tensors in full.items():  # DeepSpeed's save_state_dict: one file per layer and TP rank
        for tp in range(TP):
            path = os.path.join(tag_dir, f"layer_{layer:02d}-model_{tp:02d}-model_states.pt")
            sd = torch.load(path, weights_only=False) if os.path.exists(path) else OrderedDict()
            sd[key] = _tp_slice(key, tensors["weight"], tp)
            torch.save(sd, path)
    lr = run["scheduler"]
    megatron_lr = {
        "max_lr": lr["max_lr"],
        "warmup_steps": lr["warmup_samples"],
        "num_steps": run["state"]["scheduler_samples"],
        "warmup_tokens": 0,
        "num_tokens": run["state"]["scheduler_tokens"],
        "decay_style": lr["decay_style"],
        "decay_steps": lr["decay_samples"],
        "min_lr": lr["min_lr"],
    }
    for pp in range(PP):
        for tp in range(TP):
            groups = _param_groups(cfg, full, pp, tp)
            mp = pp * TP + tp
            prefix = "bf16_zero_pp_rank_" if style == "bf16" else "zero_pp_rank_"
            for dp, shard in enumerate(_zero_partitions(groups, step, cfg, style)):
                torch.save(
                    {"optimizer_state_dict": shard, "ds_config": {}, "ds_version": "0.6.0"},
                    os.path.join(tag_dir, f"{prefix}{dp}_mp_rank_{mp:02d}_optim_states.pt"),
                )
            shapes = [OrderedDict((name, t["fp32"].shape) for name, t in group) for group in groups]
            engine = {
                "module": None,
                "buffer_names": [],
                "optimizer": None,
                "param_shapes": shapes,
                "lr_scheduler": megatron_lr,
                "sparse_tensor_module_names": set(),
                "skipped_steps": 0,
                "global_steps": iteration,
                "global_samples": run["state"]["consumed_samples"],
                "dp_world_size": DP,
                "mp_world_size": TP * PP,
                "ds_config": {},
                "ds_version": "0.6.0",
                "args": _megatron_args(cfg, run),
                "checkpoint_version": 3.0,
                "iteration": iteration,
                "tokens": run["state"]["consumed_tokens"],
                "checkpoint_info": {
                    "padded_vocab_size": 50432,
                    "original_vocab_size": cfg.vocab_size,
                },
                "universal_checkpoint_info": UNIVERSAL_INFO,
            }
            with _megatron_importable():
                torch.save(engine, os.path.join(tag_dir, f"mp_rank_{mp:02d}_model_states.pt"))
    with open(os.path.join(directory, "latest"), "w") as f:
        f.write(f"global_step{iteration}")
    return tag_dir


# -----------------------------------------------------------------------------
# The reference run, its state as Megatron-DeepSpeed's checkpoint, imported


def _import(mds, ours, *extra):
    main = runpy.run_path(os.path.join(ROOT, "tools", "import_megatron_deepspeed.py"))["main"]
    return main(["--load", str(mds), "--save", str(ours), *extra])


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(reference dir, its stdout, the Megatron-DeepSpeed dir, our imported dir, config, iteration-2 files)."""
    root = tmp_path_factory.mktemp("megatron_ds")
    ref, mds, ours = root / "ref", root / "mds", root / "ours"
    out = run_main(*ARGS, f"--save={ref}", "--save_interval=2")
    cfg = arguments.prepare(arguments.load_config(ARGS))
    step2 = ref / "global_step2"
    blob = torch.load(step2 / "mp_rank_00_000_model_states.pt", weights_only=False)
    rank = torch.load(step2 / "rank_00000_optim_states.pt", weights_only=False)
    write_megatron_checkpoint(mds, cfg, blob["model"], rank, blob["run"])
    # the reference leaves the vocabulary's padding out of the softmax (our default), so that its TP1 run and the
    # TP2 checkpoint are one model; Megatron's softmax over the padding is the import's default
    _import(mds, ours, "--padded_vocab_in_softmax=false")
    return ref, out, mds, ours, cfg, (blob, rank)


@pytest.mark.slow
def test_resumed_at_tp1_equals_the_straight_run_bit_for_bit(imported, tmp_path):
    ref, ref_out, _, ours, _, _ = imported
    out = run_main(*ARGS, f"--load={ours}", f"--save={tmp_path}")
    assert "saved with TP=2 x PP=2 x DP=1, now TP=1 x PP=1 x DP=1" in out
    assert "loaded checkpoint" in out and "at iteration 2" in out
    # the loss of the imported weights
    assert sorted(losses(out)) == [3] and losses(out)[3] == losses(ref_out)[3]
    (_, model, rank), (_, want_model, want_rank) = final_state(tmp_path), final_state(ref)
    # one step from the imported state: bit-exact
    assert_same(model["model"], want_model["model"], "weights")
    # fp32 masters, moments, step
    assert_same(rank["optimizer"], want_rank["optimizer"], "optimizer")
    for key in (
        "iteration",
        "consumed_samples",
        "consumed_tokens",
        "scheduler_samples",
        "scheduler_tokens",
    ):
        assert model["run"]["state"][key] == want_model["run"]["state"][key], key


def _load_rank(directory, rank):
    """Rank `rank` of TP2 x PP2 (on paper: loading needs no collectives): its model, optimizer and run state."""
    cfg = arguments.load_config(
        [
            *ARGS,
            f"--load={directory}",
            f"--tensor_model_parallel_size={TP}",
            f"--pipeline_model_parallel_size={PP}",
        ]
    )
    arguments.prepare(cfg, TP * PP)
    saved = parallel.grid
    parallel.grid = parallel.Grid(TP, PP, world_size=TP * PP, rank=rank)
    try:
        model = build_model(cfg, "cpu")
        optimizer = build_optimizer(cfg, model)
        parts = run_state.Parts(
            cfg, model, optimizer, plan_of(cfg), optim.scaler_for(cfg), training.NO_CALLBACKS
        )
        run_state.load(parts)
        return model, optimizer, parts, parallel.grid
    finally:
        parallel.grid = saved


def test_the_written_tp2_pp2_layout_holds_the_reference_state(imported, capsys):
    """Loaded as each rank of TP2 x PP2 (the checkpoint's own layout: no resharding), every weight, fp32 master,
    moment and step is the reference's (its TP slice; the vocabulary's padding rows zero), and the iteration,
    consumed samples and tokens and the LR schedule are the reference's at iteration 2."""
    _, _, _, ours, cfg, (blob, ref_rank) = imported
    _assert_holds_reference(ours, cfg, blob, ref_rank, capsys)


@pytest.mark.parametrize("style", ["zero", "elastic"])
def test_deepspeeds_other_zero_formats_give_the_same_state(imported, tmp_path, capsys, style):
    """DeepSpeed's fp16 ZeRO-1 optimizer (tr8b-104B's: the step in torch Adam's state, the fp32 groups without
    their padding) and its elastic_checkpoint format (per-group states, the step beside them): the same state
    comes out as from the BF16 optimizer's."""
    _, _, _, _, cfg, (blob, ref_rank) = imported
    write_megatron_checkpoint(tmp_path / "mds", cfg, blob["model"], ref_rank, blob["run"], style)
    _import(tmp_path / "mds", tmp_path / "ours", "--padded_vocab_in_softmax=false")
    _assert_holds_reference(tmp_path / "ours", cfg, blob, ref_rank, capsys)


def test_deepspeeds_universal_checkpoint_gives_the_same_state(imported, tmp_path, capsys):
    """The checkpoint turned into DeepSpeed's universal checkpoint by DeepSpeed's own ds_to_universal (whole
    tensors in zero/<parameter>/, the vocabulary's padding dropped, no layer files): the same state comes out."""
    from deepspeed.checkpoint import ds_to_universal

    universal = tmp_path / "universal" / "global_step2_universal"
    with _megatron_importable():  # DeepSpeed's reader unpickles Megatron's args
        ds_to_universal.main(
            argparse.Namespace(
                input_folder=str(imported[2] / "global_step2"),
                output_folder=str(universal),
                num_extract_workers=1,
                num_merge_workers=1,
                keep_temp_folder=False,
                strict=True,
                inject_missing_state=False,
            )
        )
    assert not any(n.startswith("layer_") for n in os.listdir(universal))
    # by latest_universal
    _import(tmp_path / "universal", tmp_path / "ours", "--padded_vocab_in_softmax=false")
    _, _, _, _, cfg, (blob, ref_rank) = imported
    _assert_holds_reference(tmp_path / "ours", cfg, blob, ref_rank, capsys)


def _assert_holds_reference(ours, cfg, blob, ref_rank, capsys):
    names = ref_rank["param_names"]
    ref_state = {n: ref_rank["optimizer"]["state"][i] for i, n in enumerate(names)}
    masters = dict(zip(names, ref_rank["optimizer"]["fp32_master_weights"]))
    for rank in range(TP * PP):
        model, optimizer, parts, g = _load_rank(ours, rank)
        assert "resharding" not in capsys.readouterr().out
        assert parts.state.iteration == 2 and parts.state.consumed_samples == 8
        assert (
            parts.state.consumed_tokens == 8 * cfg.seq_length and parts.state.scheduler_samples == 8
        )
        # Megatron records no token count at the end of a sample warm-up (0) unless it decays by tokens; the LR
        # does not read it then: the schedule's keys and its next LR are the reference's
        lr, want = (
            parts.schedule.lr_schedule,
            schedule.AnnealingLR(cfg.lr, cfg.min_lr, cfg.lr_decay_style, 4, 40),
        )
        want.load_state_dict(blob["run"]["scheduler"], override=False)
        assert {k: v for k, v in lr.state_dict().items() if k != "warmup_end_tokens"} == {
            k: v for k, v in blob["run"]["scheduler"].items() if k != "warmup_end_tokens"
        }
        assert lr.get_lr(12, 12 * cfg.seq_length) == want.get_lr(12, 12 * cfg.seq_length)
        for name, p in model.named_parameters():
            source = "embed.word.weight" if name == "output_weight" else name
            tensors = {
                "weight": blob["model"][source],
                "fp32": masters[source],
                "exp_avg": ref_state[source]["exp_avg"],
                "exp_avg_sq": ref_state[source]["exp_avg_sq"],
            }
            main = optimizer.main_param(p)
            live = {
                "weight": p,
                "fp32": main,
                "exp_avg": optimizer.state[main]["exp_avg"],
                "exp_avg_sq": optimizer.state[main]["exp_avg_sq"],
            }
            for key, t in tensors.items():
                tp_dim = getattr(p, "tp_dim", None)
                if source == "embed.word.weight":  # 50304 rows at TP1, 50432 at TP2: zero padding
                    t = torch.cat(
                        [t[: cfg.vocab_size], t.new_zeros(50432 - cfg.vocab_size, t.shape[1])]
                    )
                want = parallel.shard(t, tp_dim, g) if tp_dim is not None else t
                assert torch.equal(live[key], want), (rank, name, key)
            assert optimizer.state[main]["step"] == ref_state[source]["step"] == 2


# -----------------------------------------------------------------------------
# Memory at scale: one output (stage, TP rank) at a time


def test_each_output_stage_reads_only_the_source_files_it_needs(imported, tmp_path, monkeypatch):
    """Held whole, one of tr11-176B's TP ranks is ~620 GB of state. Spied on the loader: each output (stage, TP
    rank) of a PP2 import opens the layer files of its own layers (the last stage also the embedding's, whose word
    embedding its tied output layer copies) and the ZeRO partitions of the source stages holding its parameters,
    and is handed the state of its own parameters alone. Before that, the lesson-11 check reads the tied word
    embedding's two copies. The mp_rank files (names and shapes) are left out of the count."""
    opened, seen = [], []
    load, write, check = (
        megatron_ds.read_file,
        megatron_ds.stage_files,
        megatron_ds.check_tied_copies,
    )

    def spy_load(path, what):
        if "mp_rank_" not in os.path.basename(path) or "zero_pp" in os.path.basename(path):
            opened.append(os.path.basename(path))
        return load(path, what)

    def spy_write(tag_dir, cfg, g, tensors, adam, run):
        seen.append(((g.pp_rank, g.tp_rank), sorted(opened), len(tensors), len(adam)))
        opened.clear()
        return write(tag_dir, cfg, g, tensors, adam, run)

    def spy_check(ckpt, tp):
        check(ckpt, tp)
        assert sorted(opened) == sorted(
            f"bf16_zero_pp_rank_{dp}_mp_rank_{pp * TP + tp:02d}_optim_states.pt"
            for pp in range(PP)
            for dp in range(DP)
        )
        opened.clear()

    monkeypatch.setattr(megatron_ds, "read_file", spy_load)
    monkeypatch.setattr(megatron_ds, "stage_files", spy_write)
    monkeypatch.setattr(megatron_ds, "check_tied_copies", spy_check)
    _import(imported[2], tmp_path / "ours", "--padded_vocab_in_softmax=false")

    def zero(pp, tp):
        return [
            f"bf16_zero_pp_rank_{dp}_mp_rank_{pp * TP + tp:02d}_optim_states.pt" for dp in range(DP)
        ]

    def layers(tp, *indices):
        return [f"layer_{i:02d}-model_{tp:02d}-model_states.pt" for i in indices]

    # stage 0: word, position, embedding norm (2), block 0 (12); stage 1: block 1 (12), ln_f (2), output layer
    want = [((0, tp), sorted(layers(tp, 1, 3) + zero(0, tp)), 16, 16) for tp in range(TP)] + [
        ((1, tp), sorted(layers(tp, 1, 4, 6) + zero(0, tp) + zero(1, tp)), 15, 15)
        for tp in range(TP)
    ]
    assert sorted(seen) == sorted(want)


def _rank_files(tag_dir, pp_size, rank):
    """(weights, {name: (fp32 master, Adam state)}) of one rank of our TP2 x pp_size checkpoint."""
    g = parallel.Grid(TP, pp_size, world_size=TP * pp_size, rank=rank)
    model = torch.load(checkpoint.model_file(str(tag_dir), g), weights_only=False)["model"]
    opt = torch.load(checkpoint.rank_file(str(tag_dir), g), weights_only=False)
    state = {
        name: (opt["optimizer"]["fp32_master_weights"][i], opt["optimizer"]["state"][i])
        for i, name in enumerate(opt["param_names"])
    }
    return model, state


def test_written_as_one_stage_it_holds_what_the_two_stage_import_holds(imported, tmp_path):
    """The PP2 source written as PP1, its one output stage reading both source stages: every weight, fp32 master,
    moment and step equals those of the PP2 import (which the tests above hold to the reference), the last
    stage's tied output layer aside."""
    _import(
        imported[2],
        tmp_path / "ours",
        "--padded_vocab_in_softmax=false",
        "--pipeline_model_parallel_size=1",
    )
    for tp in range(TP):
        model, state = _rank_files(tmp_path / "ours" / "global_step2", 1, tp)
        want_model, want_state = {}, {}
        for pp in range(PP):
            m, st = _rank_files(imported[3] / "global_step2", PP, pp * TP + tp)
            want_model.update((k, v) for k, v in m.items() if k != "output_weight")
            want_state.update((k, v) for k, v in st.items() if k != "output_weight")
        assert_same(model, want_model, "weights")
        assert_same(state, want_state, "optimizer")


def test_flags_the_megatron_run_did_not_read_are_not_carried(imported):
    """Megatron's args hold every flag: a bf16 run's still has the fp16 loss scaler's, which our run would refuse
    beside bf16 (sections.SWITCHED). They are left at our defaults, as Megatron ignored them."""
    ckpt = megatron_ds.Checkpoint(str(imported[2]))
    ckpt.args.loss_scale, ckpt.args.loss_scale_window = 12.0, 500
    cfg = megatron_ds.config_from_args(ckpt)
    assert (cfg.bf16, cfg.loss_scale, cfg.loss_scale_window, cfg.hysteresis) == (
        True,
        None,
        1000,
        2,
    )


def test_files_are_found_by_their_rank_numbers_not_as_text(tmp_path):
    """DeepSpeedCheckpoint sorts the mp_rank files as text; DP ranks are not zero-padded in the ZeRO files' names,
    so that with 12 of them zero_pp_rank_10 sorts before zero_pp_rank_2 as text. Every file of a TP4 x PP3 x DP12
    name list (12 mp_rank files, 144 ZeRO files, each holding its own ranks) is found as the rank it names."""
    import megatron_ds

    tp, pp, dp = 4, 3, 12
    tag = tmp_path / "global_step5"
    tag.mkdir()
    args = argparse.Namespace(
        num_layers=3, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
    )
    for t in range(tp):
        for layer in (1, 3, 4, 5, 7):  # not read here: TP is their number, the layers their indices
            (tag / f"layer_{layer:02d}-model_{t:02d}-model_states.pt").touch()
    for mp in range(tp * pp):
        torch.save({"args": args, "mp": mp}, tag / f"mp_rank_{mp:02d}_model_states.pt")
        for d in range(dp):
            torch.save(
                {"optimizer_state_dict": {"dp": d, "mp": mp}},
                tag / f"bf16_zero_pp_rank_{d}_mp_rank_{mp:02d}_optim_states.pt",
            )
    ckpt = megatron_ds.Checkpoint(tag)
    assert (ckpt.tp, ckpt.pp, ckpt.dp) == (tp, pp, dp)
    for s in range(pp):
        for t in range(tp):
            assert ckpt.model_state(s, t)["mp"] == s * tp + t
            assert ckpt.zero_shards(s, t) == [{"dp": d, "mp": s * tp + t} for d in range(dp)]


# -----------------------------------------------------------------------------
# Bad input: one message naming the problem and the fix, nothing half-written


def _copy(mds, tmp_path):
    import shutil

    copy = tmp_path / "mds"
    shutil.copytree(mds, copy)
    return copy, copy / "global_step2"


def test_a_directory_that_is_not_such_a_checkpoint_is_refused(imported, tmp_path):
    ref = imported[0]
    (tmp_path / "source").mkdir()
    with pytest.raises(
        ValueError, match="is not a Megatron-DeepSpeed checkpoint: no layer_XX-model_YY"
    ):
        _import(tmp_path / "source", tmp_path / "out")
    with pytest.raises(
        ValueError, match="is not a Megatron-DeepSpeed pipeline checkpoint: it needs layer_XX"
    ):
        _import(ref, tmp_path / "out")  # one of ours
    assert not (tmp_path / "out").exists()


def test_a_shape_mismatch_is_refused(imported, tmp_path):
    mds, tag = _copy(imported[2], tmp_path)
    path = tag / "layer_03-model_01-model_states.pt"
    sd = torch.load(path, weights_only=False)
    sd["self_attention.query_key_value.weight"] = sd["self_attention.query_key_value.weight"][
        :-16
    ].clone()
    torch.save(sd, path)
    with pytest.raises(
        ValueError,
        match=r"blocks.0.attn.qkv.weight of TP rank 1 needs shape \(96, 64\), the "
        r"Megatron-DeepSpeed checkpoint has shape \(80, 64\)",
    ):
        _import(mds, tmp_path / "out")


def test_a_full_save_directory_and_an_older_zero_format_are_refused(imported, tmp_path):
    mds, tag = _copy(imported[2], tmp_path)
    with pytest.raises(
        ValueError, match="is not empty: the import writes a new checkpoint directory"
    ):
        _import(mds, imported[0])
    path = tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"  # DeepSpeed < 0.4's ZeRO stage 1
    torch.save(
        {
            "optimizer_state_dict": {
                "local_sub_partitions_of_fp32_groups": [],
                "base_optimizer_state": [],
            }
        },
        path,
    )
    with pytest.raises(
        ValueError,
        match="hold base_optimizer_state, local_sub_partitions_of_fp32_groups: not the "
        "ZeRO-1/2 or BF16 optimizer format",
    ):
        _import(mds, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_zero_partitions_padded_per_parameter_are_refused(imported, tmp_path):
    mds, tag = _copy(imported[2], tmp_path)
    # DeepSpeed's newer parameter_alignment
    path = tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shard = torch.load(path, weights_only=False)
    shard["optimizer_state_dict"]["param_alignment_paddings"] = [[0, 3, 0], [0]]
    torch.save(shard, path)
    with pytest.raises(ValueError, match="pad each parameter .*parameter_alignment"):
        _import(mds, tmp_path / "out")


def test_a_tied_embedding_copy_that_differs_is_refused(imported, tmp_path):
    """Lesson 11: the last stage's copy of the tied embedding (the first entry of its ZeRO group 0 here) must be the
    first stage's."""
    mds, tag = _copy(imported[2], tmp_path)
    path = tag / f"bf16_zero_pp_rank_0_mp_rank_{(PP - 1) * TP:02d}_optim_states.pt"
    shard = torch.load(path, weights_only=False)
    shard["optimizer_state_dict"]["single_partition_of_fp32_groups"][0][0] += 1e-3
    torch.save(shard, path)
    with pytest.raises(
        ValueError,
        match=r"the last stage's fp32 copy of the tied word embedding differs from the "
        r"first stage's on TP rank 0 \(lesson 11\)",
    ):
        _import(mds, tmp_path / "out")


def _drop_param_shapes(tag):
    """The mp_rank files as DeepSpeed 0.19 writes them for bf16 without ZeRO: param_shapes None."""
    for mp in range(TP * PP):
        path = tag / f"mp_rank_{mp:02d}_model_states.pt"
        with _megatron_importable():
            engine = torch.load(path, weights_only=False)
            engine["param_shapes"] = None
            torch.save(engine, path)


def test_without_param_shapes_the_slice_mappings_give_the_same_state(imported, tmp_path, capsys):
    """The engine's param_shapes name what the flat ZeRO groups hold; where they are None (DeepSpeed
    0.19's BF16_Optimizer), the partitions' param_slice_mappings and the layer files' shapes do: at
    TP2 x PP2 x DP2 with the groups' alignment padding, the same state comes out (DeepSpeed's own
    writer: tests/test_deepspeed_writer.py)."""
    mds, tag = _copy(imported[2], tmp_path)
    _drop_param_shapes(tag)
    _import(mds, tmp_path / "ours", "--padded_vocab_in_softmax=false")
    _, _, _, _, cfg, (blob, ref_rank) = imported
    _assert_holds_reference(tmp_path / "ours", cfg, blob, ref_rank, capsys)


@pytest.mark.parametrize(
    "group, entry, message",
    [
        (
            0,
            0,
            r"tied_modules.embed.word_embeddings.weight's fragments in the ZeRO partitions of "
            r"stage 0, TP rank 0 are not contiguous",
        ),
        (
            1,
            1,
            r"tied_modules.embed.word_embeddings.norm.bias takes elements \[65, 129\) of ZeRO "
            r"group 1 of stage 0, TP rank 0, where the previous parameter ends at 64; layer 1's "
            r"file has shape \(64,\) for it",
        ),
    ],
)
def test_slice_mappings_that_do_not_tile_their_group_are_refused(
    imported, tmp_path, group, entry, message
):
    """Cut by mappings with a gap, the parameters after it would be read shifted: refused, naming
    the parameter (one split across DP ranks, one within a rank)."""
    mds, tag = _copy(imported[2], tmp_path)
    _drop_param_shapes(tag)
    path = tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    shard = torch.load(path, weights_only=False)
    mapping = shard["optimizer_state_dict"]["param_slice_mappings"][group]
    name = list(mapping)[entry]
    mapping[name] = type(mapping[name])(numel=mapping[name].numel, start=mapping[name].start + 1)
    torch.save(shard, path)
    with pytest.raises(ValueError, match=message):
        _import(mds, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_zero_files_without_param_shapes_or_slice_mappings_are_refused(imported, tmp_path):
    """With neither, nothing names the parameters in the flat groups: refused, saying so, before
    anything is written."""
    mds, tag = _copy(imported[2], tmp_path)
    _drop_param_shapes(tag)
    for name in os.listdir(tag):
        if "zero_pp_rank" in name:
            shard = torch.load(tag / name, weights_only=False)
            del shard["optimizer_state_dict"]["param_slice_mappings"]
            torch.save(shard, tag / name)
    message = (
        r"mp_rank_02_model_states.pt holds no param_shapes and the ZeRO partitions of "
        r"stage 1, TP rank 0 no param_slice_mappings: nothing names the parameters .*import "
        r"the weights alone"
    )
    with pytest.raises(ValueError, match=message):
        _import(mds, tmp_path / "out")
    assert not (tmp_path / "out").exists()


TP_RANK_FILES = ", ".join(f"layer_{i:02d}-model_01-model_states.pt" for i in (1, 3, 4, 6))
LAYER_MISSING = (
    r"global_step2 is incomplete: its args say num_layers=2 \(the embedding, 2 transformer layers and "
    r"the final norm\), and the files of {} are missing; copy the whole checkpoint directory"
)


@pytest.mark.parametrize(
    "gone, message",
    [
        (
            "-model_01-",
            rf"its args say TP=2 x PP=2, and 4 of its files are missing: {TP_RANK_FILES};",
        ),
        ("layer_04-", LAYER_MISSING.format("layer_04")),
        ("layer_06-", LAYER_MISSING.format("layer_06")),
    ],
)
def test_missing_layer_files_are_named(imported, tmp_path, gone, message):
    """TP rank 1's layer files gone: the file names alone look like TP1 (then refused for its vocabulary, or
    its layer count); the args' TP x PP names the missing files. A transformer layer's files (every TP
    rank's) gone: the layers after it were counted one place down (a message about shapes); the final
    norm's: the last layer was read as it (a message about a feature)."""
    mds, tag = _copy(imported[2], tmp_path)
    for name in os.listdir(tag):
        if name.startswith("layer_") and gone in name:
            os.remove(tag / name)
    with pytest.raises(ValueError, match=message):
        _import(mds, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_mp_rank_file_whose_args_disagree_is_named(imported, tmp_path):
    """One mp_rank file of another run (its args say TP=4 among TP=2 files): refused, naming the
    file and the args that differ."""
    mds, tag = _copy(imported[2], tmp_path)
    path = tag / "mp_rank_03_model_states.pt"
    with _megatron_importable():
        engine = torch.load(path, weights_only=False)
        engine["args"].tensor_model_parallel_size = 4
        torch.save(engine, path)
    message = (
        r"mp_rank_03_model_states.pt's args disagree with mp_rank_00_model_states.pt's: "
        r"tensor_model_parallel_size 4 \(there\) vs 2: the directory holds files of two "
        r"runs"
    )
    with pytest.raises(ValueError, match=message):
        _import(mds, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_killed_imports_partial_directory_is_named_and_kept(imported, tmp_path):
    """kill -9 runs no clean-up: a killed import leaves its global_stepN.partial. Re-running names
    it as a half-finished import to delete (before the source is read), and deletes nothing."""
    leftover = tmp_path / "out" / "global_step2.partial"
    leftover.mkdir(parents=True)
    (leftover / "mp_rank_00_000_model_states.pt").write_bytes(b"half")
    message = (
        r"holds global_step2.partial: a half-finished import, killed before it completed; "
        r"delete it \(rm -r .*global_step2.partial\) and run the import again"
    )
    with pytest.raises(ValueError, match=message):
        _import(imported[2], tmp_path / "out")
    assert sorted(os.listdir(tmp_path / "out")) == ["global_step2.partial"]
    assert (leftover / "mp_rank_00_000_model_states.pt").read_bytes() == b"half"
    (tmp_path / "file").write_text("mine")
    with pytest.raises(ValueError, match="--save .*file is a file: give a new or empty directory"):
        _import(imported[2], tmp_path / "file")
    assert (tmp_path / "file").read_text() == "mine"


def test_a_save_under_a_file_is_refused_before_the_source_is_read(tmp_path):
    """It was a NotADirectoryError traceback, after the source was read."""
    (tmp_path / "file").write_text("mine")
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"--save={tmp_path / 'file' / 'out'} cannot be created: {tmp_path / 'file'} is a file"
        ),
    ):
        _import(tmp_path / "no_source", tmp_path / "file" / "out")  # read, it would be named
    assert sorted(os.listdir(tmp_path)) == ["file"]


def test_a_bad_stage_count_or_partition_method_is_refused(imported, tmp_path):
    """--pipeline_model_parallel_size 0 was taken as the source's, -1 gave a message about layers;
    an unknown --pp_partition_method was dropped in silence (the source's own value, when ours does
    not read it, still is: test_flags_the_megatron_run_did_not_read_are_not_carried)."""
    for stages in ("0", "-1"):
        with pytest.raises(
            ValueError,
            match=f"^--pipeline_model_parallel_size {stages} must be at least 1: the stages of the "
            "written checkpoint; leave it out for the source's",
        ):
            _import(
                tmp_path / "no_source", tmp_path / "out", f"--pipeline_model_parallel_size={stages}"
            )
    with pytest.raises(
        ValueError,
        match=re.escape(
            "--pp_partition_method 'bogus' is not one of type:transformer|embedding, type:transformer"
        ),
    ):
        _import(imported[2], tmp_path / "out", "--pp_partition_method=bogus")
    ckpt = megatron_ds.Checkpoint(str(imported[2]))
    ckpt.args.pp_partition_method = "parameters"  # Megatron's, which ours does not read
    assert megatron_ds.config_from_args(ckpt).pp_partition_method == "type:transformer|embedding"
    assert not (tmp_path / "out").exists()


def test_a_kill_while_latest_is_written_leaves_no_empty_latest(imported, tmp_path, monkeypatch):
    """The import wrote `latest` in place: killed after the open, it left an empty one, which named the
    directory itself ("model shard is missing ... another topology"). Here the kill comes as `latest`'s bytes
    go to disk: there is no `latest` yet, and the finished directory is whole."""
    import builtins

    class Killed(BaseException):
        pass

    real_open = builtins.open

    def killed_after_opening_latest(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        if "w" in mode and os.path.basename(str(path)).startswith(checkpoint.LATEST):
            raise Killed
        return f

    monkeypatch.setattr(builtins, "open", killed_after_opening_latest)
    with pytest.raises(Killed):
        _import(imported[2], tmp_path / "out")
    monkeypatch.setattr(builtins, "open", real_open)
    assert sorted(os.listdir(tmp_path / "out")) == ["global_step2", "latest.tmp"]
    with pytest.raises(ValueError, match="has global_step\\* directories but no 'latest' file"):
        checkpoint.latest_dir(str(tmp_path / "out"))


def test_a_sigterm_during_the_import_leaves_nothing_and_says_so(imported, tmp_path):
    """SIGTERM half-way (here: the process signals itself as the second output rank is written, in
    a process of its own): exit 143, a message, and no save directory; kill -9 is the case above."""
    script = (
        f"import os, runpy, signal, sys; sys.path.insert(0, {ROOT!r}); import megatron_ds\n"
        "write, calls = megatron_ds.stage_files, []\n"
        "def stage_files(*args):\n"
        "    calls.append(1)\n"
        "    if len(calls) == 2:\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return write(*args)\n"
        "megatron_ds.stage_files = stage_files\n"
        f"sys.argv = ['import', '--load', {str(imported[2])!r}, '--save', "
        f"{str(tmp_path / 'out')!r}]\n"
        f"runpy.run_path({os.path.join(ROOT, 'tools', 'import_megatron_deepspeed.py')!r}, "
        "run_name='__main__')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False, timeout=600
    )
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert "error: the import was stopped by SIGTERM; what it had written is removed" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_missing_zero_partition_is_refused(imported, tmp_path):
    mds, tag = _copy(imported[2], tmp_path)
    os.remove(tag / "bf16_zero_pp_rank_1_mp_rank_03_optim_states.pt")
    with pytest.raises(ValueError, match="partitions are missing or of another checkpoint"):
        _import(mds, tmp_path / "out")


def test_without_optimizer_files_the_weights_alone_are_imported(imported, tmp_path, capsys):
    mds, tag = _copy(imported[2], tmp_path)
    for name in os.listdir(tag):
        if "zero_pp_rank" in name:
            os.remove(tag / name)
    _import(mds, tmp_path / "out")
    assert (
        "importing the weights alone; the run continues with a fresh Adam"
        in capsys.readouterr().out
    )
    config = final_state(tmp_path / "out")[1]["run"]["config"]
    # Megatron's model, by default
    assert config["padded_vocab_in_softmax"] and config["vocab_size"] == 50257
    tag_dir = str(tmp_path / "out" / "global_step2")
    for r in range(TP * PP):
        g = parallel.Grid(TP, PP, world_size=TP * PP, rank=r)
        weights = torch.load(checkpoint.model_file(tag_dir, g), weights_only=False)["model"]
        rank = torch.load(checkpoint.rank_file(tag_dir, g), weights_only=False)
        assert rank["optimizer"]["state"] == {}  # Adam from step 0
        for name, master in zip(rank["param_names"], rank["optimizer"]["fp32_master_weights"]):
            assert torch.equal(master, weights[name].float()), name  # the masters are the weights


# -----------------------------------------------------------------------------
# fp16: DeepSpeed's dynamic loss scaler -> ours


@pytest.mark.parametrize("since_overflow", [1, 2, 3, 4, 5, 9])
def test_the_loss_scale_doubles_at_the_update_deepspeed_would(since_overflow):
    """DeepSpeed's DynamicLossScaler, some clean updates after an overflow, converted; then both take clean
    updates: our scale doubles at the same updates as DeepSpeed's."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    import megatron_ds

    theirs = DynamicLossScaler(
        init_scale=2.0**16,
        scale_window=4,
        min_scale=1.0,
        delayed_shift=2,
        consecutive_hysteresis=False,
    )
    theirs.cur_iter, theirs.last_overflow_iter, theirs.cur_hysteresis = 10, 10 - since_overflow, 1
    ours = optim.LossScaler(initial_scale=1.0, window=4, hysteresis=2)
    ours.load_state_dict(megatron_ds.loss_scale_state(theirs, ours.state_dict()))
    assert ours.scale == 2.0**16 and ours.hysteresis_left == 1
    for _ in range(12):
        theirs.update_scale(False)
        ours.update(False)
        assert ours.scale == theirs.cur_scale and ours.hysteresis_left == theirs.cur_hysteresis


def test_a_checkpoint_without_a_token_count_resumes_with_full_length_samples():
    """Without `tokens` or consumed_train_tokens the import counted 0 tokens for its samples, a run state
    the resume refuses as damaged (its tokens are fewer than its samples)."""
    cfg = arguments.prepare(
        arguments.load_config(
            ["--num_layers=2", "--hidden_size=64", "--num_attention_heads=4", "--seq_length=32"]
        )
    )
    args = types.SimpleNamespace(consumed_train_samples=96)
    ckpt = types.SimpleNamespace(args=args, state={"iteration": 6, "lr_scheduler": {}}, zero=None)
    run = megatron_ds.run_dict(ckpt, cfg)
    assert run["state"]["consumed_tokens"] == 96 * 32
    checked, _ = checkpoint.checked_run_state(run["state"], run["config"])
    assert checked["consumed_tokens"] == 96 * 32


def test_an_imported_lr_schedule_is_the_one_its_resume_checks_against():
    """A run whose decay follows its length (lr_decay_samples unset), imported at iteration 2 after batches of 16
    where this config has 8: the resume builds its schedule from the checkpoint's counters (the run's length from
    where it is), and so must the importer, or the resume refuses the import's own schedule as changed."""
    cfg = arguments.prepare(
        arguments.load_config(
            [
                "--global_batch_size=8",
                "--micro_batch_size=8",
                "--train_iters=10",
                "--lr_warmup_samples=0",
                "--lr_decay_samples=none",
            ]
        )
    )
    assert cfg.lr_decay_samples is None and cfg.lr_decay_tokens is None
    samples = 32  # 2 x 16
    ckpt = types.SimpleNamespace(
        args=types.SimpleNamespace(consumed_train_samples=samples),
        state={
            "iteration": 2,
            "tokens": samples * cfg.seq_length,
            "lr_scheduler": {"num_steps": samples},
        },
        zero=None,
    )
    run = megatron_ds.run_dict(ckpt, cfg)
    safety.check_lr_schedule(run["scheduler"], arguments.to_dict(cfg), run["state"])


def test_an_empty_latest_is_named(imported, tmp_path):
    """It named the directory itself, then 'mp_rank_00_model_states.pt is missing'."""
    mds, _ = _copy(imported[2], tmp_path)
    (mds / "latest").write_text("\n")
    message = r"latest is empty .*: pass the global_stepN directory to import as --load \(it holds global_step2\)"
    with pytest.raises(ValueError, match=message):
        _import(mds, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_save_inside_the_source_is_refused(imported, tmp_path):
    """It was written there, and DeepSpeed's readers, which walk the tree, then read it as the source's own files:
    the source no longer imported ("args disagree")."""
    mds, tag = _copy(imported[2], tmp_path)
    before = sorted(os.listdir(tag))
    for inside in (tag / "ours", mds / "ours"):
        with pytest.raises(ValueError, match=r"is inside the Megatron-DeepSpeed checkpoint --load"):
            _import(mds, inside)
    assert sorted(os.listdir(tag)) == before and not (mds / "ours").exists()
