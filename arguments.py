"""Configuration: every knob is a field of Config, named after Megatron's flag with underscores. Each key is
declared and checked by the module that uses it (schedule.ScheduleConfig and schedule.check, ...); Config is
their composition and validate() the list of their checks.

A run is configured by a Python file whose module globals set fields (config/*.py), then by command-line
overrides in any of the forms BigScience's SLURM scripts use:

    python train.py config/tr8b_104b.py --lr 6e-5 --lr-warmup-samples 216_320 --embed-layernorm \
        --skip-train-iteration-range 13251-14000 16652-18500 --rampup_batch_size="16 16 9_765_625"

Unknown keys and impossible values stop the run with one message naming the problem and the fix.
"""

import difflib
import math
import os
import runpy
import sys
import types
import typing
from dataclasses import asdict, dataclass, fields

import torch

import checkpoint
import deepspeed_engine
import eval_harness
import hf
import loader
import optim
import parallel
import report
import schedule
import sections
import usage
from checkpoint import CheckpointConfig
from eval_harness import EvalHarnessConfig
from loader import DataConfig
from model import GPTConfig, attention_backend_problem
from optim import OptimizerConfig
from parallel import LayoutConfig
from report import LoggingConfig
from schedule import ScheduleConfig
from sections import section
from stability import config as stability_config
from stability.config import StabilityConfig

DEFAULT_CONFIG = "config/tiny.py"


@dataclass
class Config(
    StabilityConfig,
    EvalHarnessConfig,
    LoggingConfig,
    CheckpointConfig,
    LayoutConfig,
    ScheduleConfig,
    OptimizerConfig,
    DataConfig,
    GPTConfig,
):
    """Every key of a run, flat (cfg.lr), each declared and checked by its owner: a dataclass's fields come base
    class last first, so the keys read model, data, optimizer, schedule, parallel, checkpoint, logging, stability.
    usage.py reads this list of bases from the source for `--help`: an owner is one more base here."""

    config_file = "this config"  # not a key: the file's name in messages (load_config sets it)


FIELDS = {f.name: f for f in fields(Config)}

# The pairs of keys a config gives one of, each declared by its owner beside the check that reads it
EXCLUSIVE = schedule.EXCLUSIVE + schedule.EXCLUSIVE_LENGTHS + optim.EXCLUSIVE + parallel.EXCLUSIVE


# -----------------------------------------------------------------------------
# Parsing


def _convert(key, value, annotation):
    """Convert a config-file value or a command-line string to the field's type, or explain why not."""
    args = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    if value is None and type(None) in args:
        return None
    if isinstance(value, str) and value.lower() == "none" and type(None) in args:
        return None
    errors = []
    for kind in (a for a in args if a is not type(None)):
        try:
            return _convert_one(value, kind)
        except (TypeError, ValueError) as e:
            errors.append(str(e))
    names = " or ".join(getattr(a, "__name__", str(a)) for a in args)
    raise ValueError(f"config key {key!r}: cannot use {value!r} as {names}")


def _convert_one(value, kind):
    origin = typing.get_origin(kind)
    if origin is list:
        (item,) = typing.get_args(kind)
        if isinstance(value, str):
            value = value.replace(",", " ").split() if item is int else value.split()
        if not isinstance(value, (list, tuple)):
            value = [value]
        return [_convert_one(v, item) for v in value]
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise ValueError(f"{value!r} is not a boolean")
    if kind is int:
        if isinstance(value, bool):
            raise ValueError("bool is not int")
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            number = float(value.replace("_", ""))  # "216_320", "1e6"
            if not number.is_integer():
                raise ValueError(f"{value!r} is not an integer")
            return int(number)
        if isinstance(value, int):
            return value
        raise ValueError(f"{value!r} is not an integer")
    if kind is float:
        if isinstance(value, bool):
            raise ValueError("bool is not float")
        return float(value.replace("_", "") if isinstance(value, str) else value)
    if kind is str:
        if not isinstance(value, str):
            raise ValueError(f"{value!r} is not a string")
        return value
    raise TypeError(f"unsupported config type {kind}")


_NO_VIRTUAL_STAGES = (
    "no interleaved (virtual) pipeline stages: each of the pipeline_model_parallel_size stages holds one run of "
    "consecutive layers under 1F1B; drop the flag, and keep pipeline_model_parallel_size the number of stages"
)
_RECOMPUTE_ONE_LAYER = (
    "checkpoint_activations recomputes every layer, one at a time (Megatron's uniform method, 1 layer a chunk): "
    "drop the flag (num_layers is the model's depth)"
)
_WHOLE_ACTIVATIONS = (
    "the layer inputs that checkpoint_activations keeps are not split over the tensor-parallel ranks: each "
    "keeps them whole; drop the flag"
)

# Megatron-LM flags with no key of that name here, and what sets the same thing: a spelling suggestion would be
# wrong for each (lr_decay_iters is one letter-change from lr_decay_tokens, another unit).
MEGATRON_NAMES = {
    "lr_decay_iters": "the decay counts samples here: lr_decay_samples = lr_decay_iters x global_batch_size",
    "lr_warmup_iters": "the warm-up counts samples here: lr_warmup_samples = lr_warmup_iters x global_batch_size",
    "lr_warmup_fraction": "the warm-up counts samples here: lr_warmup_samples = the fraction x train_samples",
    "use_checkpoint_lr_scheduler": "a resume follows the checkpoint's LR schedule already: drop the flag "
    "(override_lr_scheduler follows the config's instead)",
    "override_opt_param_scheduler": "override_lr_scheduler",
    "use_distributed_optimizer": "zero_stage=1 (the optimizer state sharded over the data-parallel ranks)",
    "num_key_value_heads": "num_query_groups (the key/value heads of grouped-query attention)",
    "group_query_attention": "set num_query_groups below num_attention_heads (no switch)",
    "encoder_seq_length": "seq_length",
    "max_position_embeddings": "the learned position table has seq_length rows: set seq_length",
    "use_rotary_position_embeddings": "position_embedding_type='rotary'",
    "use_flash_attn": "attention_backend='flash'",
    "recompute_activations": "checkpoint_activations",
    "recompute_granularity": "checkpoint_activations (whole layers)",
    "tokenizer_type": "GPT-2 BPE is the default; tokenizer_file for a Hugging Face tokenizer.json",
    "vocab_file": "GPT-2 BPE is the default; tokenizer_file for a Hugging Face tokenizer.json",
    "merge_file": "GPT-2 BPE is the default; tokenizer_file for a Hugging Face tokenizer.json",
    "data_parallel_size": "the data-parallel size is the number of processes / "
    "(tensor_model_parallel_size x pipeline_model_parallel_size)",
    # BigScience's scripts' own (config/tr*.py follow them), whose closest key by spelling is another setting
    "sync_tp_duplicated_parameters": "tp_replica_check_interval=N with tp_replica_resync: every N iterations "
    "TP rank 0's copies of the replicated weights are copied over where they differ (as tr11's config does)",
    "pad_vocab_size_to": "make_vocab_size_divisible_by (the vocabulary is padded to a multiple of it x TP; "
    "vocab_size stays the tokenizer's)",
    "data_impl": "Megatron's mmap .bin/.idx is the one format here: drop the flag (data_path names the prefix)",
    "tensorboard_queue_size": "the events are written as they come: drop the flag (tensorboard_dir says where)",
    "train_weighted_split_paths_path": "data_path (a prefix or a blend 'w1 prefix1 w2 prefix2 ...', which split "
    "divides into train and validation)",
    "deepspeed_config": "deepspeed=True: DeepSpeed's config is made from this config's keys (zero_stage, bf16, "
    "clip_grad, micro_batch_size), no JSON file is read",
    # the layout's and precision's flags whose closest key by spelling changes another thing: the pipeline's
    # stages for its virtual chunks, the model's depth for recomputation's, a scale for its power of two
    "virtual_pipeline_model_parallel_size": _NO_VIRTUAL_STAGES,
    "num_layers_per_virtual_pipeline_stage": _NO_VIRTUAL_STAGES,
    "pipeline_model_parallel_split_rank": "an encoder-decoder's split; a GPT is one stack, cut into "
    "pipeline_model_parallel_size stages (pp_partition_method)",
    "checkpoint_num_layers": _RECOMPUTE_ONE_LAYER,
    "recompute_num_layers": _RECOMPUTE_ONE_LAYER,
    "recompute_method": _RECOMPUTE_ONE_LAYER,
    "partition_activations": _WHOLE_ACTIVATIONS,
    "distribute_saved_activations": _WHOLE_ACTIVATIONS,
    "distribute_checkpointed_activations": _WHOLE_ACTIVATIONS,
    "overlap_grad_reduce": "the native path (deepspeed=False, any zero_stage) always overlaps the data-parallel "
    "all-reduce with backward, in gradient buckets: drop the flag",
    "initial_scale_power": "DeepSpeed's power of two: initial_loss_scale = 2**initial_scale_power (the 104B's 12 "
    "is initial_loss_scale=4096)",
    "num_micro_batches": "global_batch_size = micro_batch_size x data-parallel size x the micro-batches of a step",
    "no_save_optim": "every checkpoint holds the optimizer state: drop the flag (no_load_optim leaves it out "
    "at a resume)",
    "cpu_optimizer": "ZeRO-Offload is not supported: the optimizer steps on the device; zero_stage=1 shards its "
    "state over the data-parallel ranks",
}


# nanoGPT's config names (and a few trainers' common ones): the closest key by spelling is often another thing
# (max_iters -> eval_iters, block_size -> vocab_size, dropout -> embed_dropout)
NANOGPT_NAMES = {
    "out_dir": "save (checkpoints, metrics.jsonl)",
    "save_dir": "save",
    "checkpoint_dir": "save",
    "init_from": "'resume' is load (a run resumes its save directory by itself); a GPT-2 is init_from_hf "
    "with the downloaded model's directory",
    "always_save_checkpoint": "save_interval (every N iterations; a run saves at its end too)",
    "wandb_log": "wandb_project (set, the run logs to it)",
    "dataset": "data_path (the prefix of a tokenized .bin/.idx: `python data.py --input FILES --output-prefix P`)",
    "batch_size": "micro_batch_size (samples per process per step) and global_batch_size (per iteration)",
    "gradient_accumulation_steps": "global_batch_size = micro_batch_size x data-parallel size x the steps",
    "block_size": "seq_length",
    "n_layer": "num_layers",
    "n_head": "num_attention_heads",
    "n_embd": "hidden_size",
    "dropout": "hidden_dropout and attention_dropout (and embed_dropout)",
    "bias": "add_bias_linear",
    "learning_rate": "lr",
    "max_iters": "train_iters",
    "train_epochs": "train_iters, train_samples or train_tokens (the data repeats as needed)",
    "beta1": "adam_beta1",
    "beta2": "adam_beta2",
    "grad_clip": "clip_grad",
    "decay_lr": "lr_decay_style (constant: no decay)",
    "warmup_iters": "the warm-up counts samples here: lr_warmup_samples = warmup_iters x global_batch_size",
    "warmup_steps": "the warm-up counts samples here: lr_warmup_samples = warmup_steps x global_batch_size",
    "dtype": "bf16 or fp16 (set: that precision; neither: fp32)",
    "backend": "the backend is NCCL on GPUs and gloo on CPU, by device",
    "distributed_backend": "the backend is NCCL on GPUs and gloo on CPU, by device",
    "num_workers": "batches are made on one background thread (loader.py): nothing to set",
}


def _unknown(key):
    if key in MEGATRON_NAMES:
        return ValueError(f"unknown config key {key!r} (a Megatron-LM flag): {MEGATRON_NAMES[key]}")
    if key in NANOGPT_NAMES:
        return ValueError(f"unknown config key {key!r} (nanoGPT's name): {NANOGPT_NAMES[key]}")
    close = difflib.get_close_matches(key, FIELDS, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else "; `python train.py --help` lists the keys"
    return ValueError(f"unknown config key {key!r}{hint}")


def _accepts_many(annotation):
    args = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    return any(typing.get_origin(a) is list for a in args)


def parse_cli(argv):
    """Split argv into (config file or None, {key: raw value}). Hyphens and underscores are the same."""
    config_file, overrides, i = None, {}, 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            usage.print_help()
            sys.exit(0)
        if not arg.startswith("--"):
            if config_file is None and arg.endswith(".py"):
                config_file = arg
                i += 1
                continue
            raise ValueError(
                f"unexpected argument {arg!r}: give one config file, then --key=value overrides"
            )
        key, eq, value = arg[2:].partition("=")
        key = key.replace("-", "_")
        if key not in FIELDS:
            raise _unknown(key)
        i += 1
        if not eq:  # --key value [value ...], or a bare --flag
            values = []
            many = _accepts_many(FIELDS[key].type)
            switch = FIELDS[key].type in (bool, bool | None)
            while i < len(argv) and not argv[i].startswith("--"):
                # a list's values end at a config file (no list takes a .py): read as a data path, the run
                # would use the default config instead of the one typed; a bare switch's value is none
                if (many or switch) and argv[i].endswith(".py"):
                    break
                values.append(argv[i])
                i += 1
                if not many:
                    break
            if not values:
                if switch:
                    value = True
                elif key == "reset_optimizer_warmup_iters":
                    value = "auto"
                else:
                    raise ValueError(f"--{key} needs a value")
            else:
                value = values if len(values) > 1 else values[0]
        overrides[key] = value
    return config_file, overrides


def load_config(argv=None):
    """Config from the config file (default config/tiny.py) and command-line overrides; prepare() checks it."""
    argv = sys.argv[1:] if argv is None else argv
    config_file, overrides = parse_cli(argv)
    implicit, config_file = config_file is None, config_file or DEFAULT_CONFIG
    # the default is the repository's, from wherever train.py is run
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        values = runpy.run_path(os.path.join(here, DEFAULT_CONFIG) if implicit else config_file)
    except FileNotFoundError:
        raise ValueError(
            f"config file {config_file!r} not found (from {os.getcwd()}); pass a file from "
            f"{os.path.join(here, 'config')} (e.g. {os.path.join(here, DEFAULT_CONFIG)})"
        ) from None
    except SyntaxError as e:
        raise ValueError(
            f"config file {config_file}, line {e.lineno}: {e.msg}; fix the file (a config is Python: "
            "key = value per line)"
        ) from None
    except Exception as e:  # a config is executed: NameError, ImportError, ... in it
        raise ValueError(
            f"config file {config_file} fails when executed ({type(e).__name__}: {e}); fix the file"
        ) from None
    settings = {}
    for key, value in values.items():
        if key.startswith("_") or isinstance(value, (types.ModuleType, types.FunctionType, type)):
            continue
        if key not in FIELDS:
            raise ValueError(
                f"{config_file}: {_unknown(key)} (a variable of the file's own: name it _{key})"
            )
        settings[key] = value
    in_file = _config(settings)
    _drop_replaced(settings, overrides)
    _drop_unread(settings, overrides, in_file)
    cfg = _config({**settings, **overrides})
    cfg.config_file = config_file
    if cfg.init_from_hf is not None:
        # the implicit default's model keys yield; a file's and the command line's are the user's
        from_hf(cfg, given=set(overrides) | (set() if implicit else set(settings)))
    return cfg


def _drop_replaced(settings, overrides):
    """Remove from the config file's `settings` each key that a key given on the command line excludes (EXCLUSIVE),
    with one printed line: the command line says what this run means, where the file's key would be refused beside
    it (train_iters beside rampup_batch_size) or would end the run in another unit first. A key set to its default
    neither replaces nor is replaced; two exclusive keys both given on the command line are left to the checks."""

    def given(key, value):
        return _convert(key, value, FIELDS[key].type) != FIELDS[key].default

    for key, value in overrides.items():
        if not given(key, value):
            continue
        for pair in (p for p in EXCLUSIVE if key in p):
            other = pair[1 - pair.index(key)]
            if other in settings and other not in overrides and given(other, settings[other]):
                _say(
                    f"{key} from the command line replaces the config file's {other} = {settings[other]!r}"
                )
                del settings[other]


def _say(line):
    if os.environ.get("RANK", "0") == "0":  # each process parses the config: one line per run
        print(line, flush=True)


def _config(settings):
    return Config(**{k: _convert(k, v, FIELDS[k].type) for k, v in settings.items()})


def _drop_unread(settings, overrides, in_file):
    """Remove from the config file's `settings` the keys read only while a switch is on (sections.SWITCHED) whose
    switch the command line turned off (--fp16=false, or --bf16 replacing the file's fp16), with one printed line:
    the file's loss-scaling keys would be refused beside it, and the fix is not the user's file. in_file: the file's
    settings alone, as a Config. A key given on the command line is left to validate(), which refuses it. A key
    left out may be a switch itself (tr11's tp_replica_check_interval, at TP=1): its keys follow it."""
    dropped_any = True
    while dropped_any:
        dropped_any = False
        for switch, keys in sections.unread(_config({**settings, **overrides})).items():
            dropped = [k for k in keys if k in settings and k not in overrides]
            if not dropped or not sections.switch_on(in_file, switch):
                continue
            given = ", ".join(f"{key} = {settings[key]!r}" for key in dropped)
            verb = "is" if len(dropped) == 1 else "are"
            _say(
                f"{switch} is off from the command line: the config file's {given} {verb} left out (read only "
                f"with {switch})"
            )
            for key in dropped:
                del settings[key]
            dropped_any = True


def from_hf(cfg, given):
    """init_from_hf: the model keys the config does not give (`given`: set by the file or the command line) come
    from the Hugging Face model; a given one that contradicts it is refused (hf.check_config), before anything is
    built. The weights are loaded by builders.build_model."""
    for key, value in hf.config_from_hf(cfg.init_from_hf).items():
        if key not in given:
            setattr(cfg, key, value)
    try:
        hf.check_config(cfg, cfg.init_from_hf)
    except ValueError as e:
        hint = (
            ""
            if cfg.config_file != DEFAULT_CONFIG
            else (
                f" ({DEFAULT_CONFIG}, the default config, describes a model of its own: start from config/finetune.py, "
                "which sets training keys only)"
            )
        )
        raise ValueError(f"{e}{hint}") from None


def check_device(cfg, local_world_size=None):
    """device=cuda where this torch has no CUDA, or with fewer GPUs than processes on the node: one message with
    the fix, before the process group or a device is touched (where torch's own error is a bare traceback).
    device=auto takes CUDA whenever torch sees a GPU, and then needs as many as device=cuda does."""
    auto = cfg.device == "auto" and torch.cuda.is_available()
    if cfg.device != "cuda" and not auto:
        return
    if not torch.cuda.is_available():
        why = (
            "this torch is a CPU-only build"
            if torch.version.cuda is None
            else f"this torch (CUDA {torch.version.cuda}) sees no GPU: check the node and CUDA_VISIBLE_DEVICES"
        )
        raise ValueError(
            f"device=cuda but {why}; install a CUDA build of torch on a GPU node (see "
            "https://pytorch.org/get-started/locally), or use --device=cpu (--device=auto takes the GPU "
            "when there is one)"
        )
    local = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count()
    # one GPU per task: GPU 0
    if gpus < local and not (gpus == 1 and "CUDA_VISIBLE_DEVICES" in os.environ):
        # NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), at the first collective
        which = "device=auto (CUDA: torch sees a GPU)" if auto else "device=cuda"
        check = (
            ", check CUDA_VISIBLE_DEVICES, or use --device=cpu"
            if auto
            else ", or check CUDA_VISIBLE_DEVICES"
        )
        raise ValueError(
            f"{which} with {local} processes on this node but {gpus} GPU(s) visible: one process per GPU; "
            f"launch torchrun --nproc_per_node {gpus}{check}"
        )


def to_dict(cfg):
    return asdict(cfg)


# -----------------------------------------------------------------------------
# Validation and derived values


def prepare(cfg, world_size=1, reads_data=True):
    """The config a run uses: validate() it, then derive() what it leaves open. Returns cfg."""
    validate(cfg, world_size, reads_data)
    return derive(cfg, world_size)


def validate(cfg, world_size=1, reads_data=True):
    """Raise ValueError with a fix for every configuration that cannot work; changes nothing. Each owner checks
    its own keys (model.GPTConfig.check, parallel.check, ...). reads_data=False: the caller feeds the model
    something else than cfg's data (bench.py's random tokens), which then need not be configured."""
    for key, value in ((k, getattr(cfg, k)) for k in FIELDS):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{key}={value} is not a finite number; give a finite value")
    # a key of a switch that is off would be ignored in silence: the run would not be the one asked for
    unread = sections.unread(cfg)
    if unread:
        raise ValueError(sections.unread_message(cfg, unread))
    for key in (
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "seq_length",
        "vocab_size",
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
    ):
        # the model's sizes and splits, before GPTConfig.check divides by them
        if getattr(cfg, key) <= 0:
            raise ValueError(f"{key}={getattr(cfg, key)} must be positive")
    data_cfg, context = section(DataConfig, cfg), section(loader.DataContext, cfg)
    loader.check(data_cfg, context, cfg.position_embedding_type, reads_data)
    GPTConfig.check(cfg)
    problem = attention_backend_problem(cfg)
    if problem:
        raise ValueError(problem)
    parallel.check(
        section(LayoutConfig, cfg),
        world_size,
        tp=cfg.tensor_model_parallel_size,
        num_layers=cfg.num_layers,
        qk_layernorm=cfg.qk_layernorm,
        eval_only=cfg.eval_only,
    )
    dp_size = world_size // (cfg.tensor_model_parallel_size * cfg.pipeline_model_parallel_size)
    schedule.check(section(ScheduleConfig, cfg), dp_size, cfg.load, cfg.seq_length)
    optim.check(cfg)
    # what DeepSpeed does not run as the native path would, before the build's import of it
    if cfg.deepspeed:
        paper = parallel.Grid(
            cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, world_size=world_size
        )
        deepspeed_engine.check(section(OptimizerConfig, cfg), cfg.zero_stage, paper)
    # "auto" under an optimizer that declares no reset count: refused here, before any work
    optim.reset_warmup_iters(section(OptimizerConfig, cfg), cfg.reset_optimizer_warmup_iters)
    checkpoint.check(section(CheckpointConfig, cfg), cfg.eval_only)
    report.check(section(LoggingConfig, cfg))
    eval_harness.check(section(EvalHarnessConfig, cfg), cfg.eval_only)
    stability_config.check(cfg, world_size)


def derive(cfg, world_size=1):
    """Fill in the values a config leaves to be derived; returns cfg. Call it on a validated config."""
    if cfg.global_batch_size is None:  # one micro-batch per data-parallel rank
        dp = world_size // (cfg.tensor_model_parallel_size * cfg.pipeline_model_parallel_size)
        cfg.global_batch_size = cfg.micro_batch_size * dp
    # Megatron's default: on with fp16, where it avoids overflows
    if cfg.apply_query_key_layer_scaling is None:
        cfg.apply_query_key_layer_scaling = cfg.fp16
    if cfg.curriculum_learning and cfg.max_difficulty is None:
        cfg.max_difficulty = cfg.seq_length
    # the optimizer by its name in the checkpoint; use_bnb_optimizer, its shortcut, agreeing
    cfg.optimizer = optim.name(cfg)
    cfg.use_bnb_optimizer = cfg.optimizer == optim.BNB
    return cfg
