"""Configuration: every knob is a field of Config, named after Megatron's flag with underscores.

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

import hf
import parallel
import schedule
import usage
from model import GPTConfig

DEFAULT_CONFIG = "config/tiny.py"


@dataclass
class Config(GPTConfig):
    """Every key of a run: the model's (model.GPTConfig), then these. The comment after a field is its `--help`
    text and a `# -- group --` comment starts a group of `--help` (usage.py reads them from this source)."""

    # -- schedule: batch size, length of training, learning rate, curriculum --
    micro_batch_size: int = 8  # samples per forward/backward on each data-parallel rank
    global_batch_size: int | None = None  # samples per iteration; None: micro_batch_size * data-parallel size
    rampup_batch_size: list[int] | None = None  # "start increment samples": Megatron's batch-size ramp-up
    train_iters: int | None = None  # stop after this many iterations (whichever of iters/samples/tokens comes first)
    train_samples: int | None = None  # stop after this many samples
    train_tokens: int | None = None  # stop after this many tokens
    lr: float = 6e-4  # peak learning rate, reached at the end of the warm-up
    min_lr: float = 0.0  # learning rate at the end of the decay
    lr_decay_style: str = "cosine"  # linear | cosine | constant
    lr_warmup_samples: int = 0  # linear warm-up from 0 over this many samples
    lr_warmup_tokens: int | None = None  # warm-up over tokens instead of samples (with a curriculum)
    lr_decay_samples: int | None = None  # decay to min_lr over this many samples; None: the whole run
    lr_decay_tokens: int | None = None  # decay over tokens instead of samples (with a curriculum)
    override_lr_scheduler: bool = False  # on resume, follow this config's LR schedule, not the checkpoint's
    curriculum_learning: bool = False  # sequence-length curriculum (DeepSpeed's fixed_linear)
    min_difficulty: int = 64  # first sequence length of the curriculum
    max_difficulty: int | None = None  # last sequence length of the curriculum; None: seq_length
    total_curriculum_step: int | None = None  # iterations until the curriculum reaches max_difficulty
    difficulty_step: int = 8  # curriculum sequence lengths are multiples of this
    # -- optimizer --
    weight_decay: float = 0.01  # AdamW's decoupled weight decay (not on biases and LayerNorms)
    weight_decay_independent: bool = False  # decay weight_decay x lr_t/lr per step, not x lr_t: same at any LR
    adam_beta1: float = 0.9  # Adam's first-moment decay
    adam_beta2: float = 0.999  # Adam's second-moment decay
    adam_eps: float = 1e-8  # Adam's epsilon
    override_adam_params: bool = False  # on resume, this config's adam_beta1/2 and adam_eps, not the checkpoint's
    clip_grad: float = 1.0  # clip the global gradient norm to this
    use_bnb_optimizer: bool = False  # bitsandbytes 8-bit AdamW; the embedding's state stays 32-bit
    # -- stability: precision, skipped steps, resets --
    fp16: bool = False  # fp16 weights and activations, fp32 master weights, dynamic loss scaling (precision.py)
    bf16: bool = False  # bf16 weights and activations, fp32 master weights and gradient accumulation
    loss_scale: float | None = None  # static fp16 loss scale; None: dynamic
    initial_loss_scale: float = 2.0**32  # first dynamic loss scale
    min_loss_scale: float = 1.0  # the dynamic loss scale never goes below this
    loss_scale_window: int = 1000  # double the loss scale after this many steps without overflow
    hysteresis: int = 2  # overflows tolerated before the loss scale is halved
    skip_grad_norm_above: float | None = None  # skip the update when the grad norm exceeds this (OPT)
    soft_skip_loss_ratio: float = 0.0  # loss > this x its trend: gradients x trend/loss before clipping (0: off)
    reset_optimizer_warmup_iters: int | str | None = None  # resume: fresh Adam, lr 0 for N iters ("auto": 5/(1-beta2))
    skip_train_iteration_range: list[str] | None = None  # discard the batches of iterations "13251-14000 ..."
    # -- data --
    data_path: list[str] | None = None  # prefix of data.py's .bin/.idx, or "w1 prefix1 w2 prefix2 ..."
    tokenizer_file: str | None = None  # a Hugging Face tokenizer.json the data was prepared with; None: GPT-2 BPE
    use_bundled_corpus: bool = False  # without data_path, train on the bundled Shakespeare (the tiny default's choice)
    split: str = "949,50,1"  # train, validation, test shares of the documents
    data_cache_dir: str | None = None  # where the sample index is cached; None: next to the data
    skip_documents: str | None = None  # a skip list (<save>/skip_documents.jsonl): no sample takes its documents
    seed: int = 1234  # initialization, data order and dropout
    # -- parallel --
    # tensor_model_parallel_size is a model.GPTConfig field: it pads the vocabulary
    pipeline_model_parallel_size: int = 1  # PP: split the layers into this many stages
    pp_partition_method: str = "type:transformer|embedding"  # or "type:transformer": the embedding not counted
    tp_replica_check_interval: int = 0  # every N iterations check that TP-replicated weights agree (0: never)
    tp_replica_resync: bool = False  # when they differ, copy TP rank 0's weights (and their Adam state) over
    deepspeed: bool = False  # data parallelism by DeepSpeed (ZeRO 1/2, bf16 weights); TP and PP stay ours
    zero_stage: int = 0  # 1: shard the optimizer state over data parallel (2, with deepspeed: gradients too)
    device: str = "auto"  # auto | cpu | cuda
    compile: bool = False  # torch.compile the model
    deterministic: bool = False  # bit-reproducible kernels (torch.use_deterministic_algorithms), whatever they cost
    tf32: bool = True  # fp32 matmuls on CUDA in TF32 (tensor cores, 10-bit mantissa); False: full fp32 matmuls
    distributed_timeout_minutes: int = 60  # how long a collective waits for the slowest rank (checkpoint writes)
    dry_run: bool = False  # size the TP x PP x DP layout and memory per GPU on the meta device, then exit
    # -- checkpoint --
    init_from_hf: str | None = None  # a local transformers GPT-2/BLOOM directory: its config and weights start the run
    save: str | None = None  # checkpoint directory; a run resumes from it when it holds a checkpoint
    load: str | None = None  # resume from this directory's `latest`; None: from save when it holds one
    save_interval: int | None = None  # save every this many iterations (and always at the end)
    async_save: bool = False  # copy the state to host memory and write it on a background thread while training goes on
    no_load_optim: bool = False  # resume without the optimizer state (fresh Adam)
    no_load_rng: bool = False  # resume without the RNG states
    exit_interval: int | None = None  # save and exit after this many iterations of this job
    exit_duration_in_mins: float | None = None  # save and exit when this job has run this long
    exit_signal_handler: bool = False  # on SIGTERM (SLURM's time limit): finish the iteration, save, exit 0
    dump_weights: bool = False  # write every rank's weights around save and load, to diff them (lesson 11)
    # -- logging: evaluation, TensorBoard, wandb, samples --
    log_interval: int = 100  # print the log line every this many iterations
    eval_interval: int = 1000  # validation loss every this many iterations (and at the end)
    eval_iters: int = 100  # global batches per validation
    eval_only: bool = False  # load the checkpoint, print the validation loss and perplexity, exit
    tensorboard_dir: str | None = None  # TensorBoard events; None: <save>/tensorboard when saving
    wandb_project: str | None = None  # log to this wandb project too (files under <save>/wandb)
    wandb_mode: str = "offline"  # offline | online | disabled (WANDB_MODE overrides it)
    sample_tokens: int = 0  # at the end, print a sample of this many tokens generated from sample_prompt
    sample_prompt: str = "ROMEO:\n"  # the prompt of that sample
    telemetry_interval: int = 0  # per-layer grad/param/update norms, activations, logits every N iterations (0: off)
    # -- stability: the spike guard (lesson 21; PaLM: ~100 steps back, 200-500 batches skipped) and fault injection --
    spike_guard: bool = False  # skip a spiking step; if it persists roll back and skip data; on a relapse lower the LR
    spike_guard_window: int = 128  # applied steps in the trailing loss / grad-norm statistics (OLMo-core: 128)
    spike_guard_min_steps: int = 16  # applied steps recorded before it judges (its own warm-up; the LR's need not end)
    spike_guard_zscore: float = 6.0  # a spike: loss or grad norm this many spreads above its trend's prediction ...
    spike_guard_ema_ratio: float = 1.1  # ... and above this multiple of the predicted value
    spike_guard_grad_norm_ratio: float = 10.0  # the grad norm's multiple: clean runs have lone 5-7x grad-norm jumps
    spike_guard_max_skips: int = 3  # spikes (or NaN/inf steps) within spike_guard_rewind iterations before a rollback
    spike_guard_rewind: int = 100  # roll back to before (first spike - this) and skip the data from there ...
    spike_guard_skip_after: int = 200  # ... to this many iterations after the last spike (PaLM: 200-500 in all)
    spike_guard_snapshot_interval: int = 50  # a CPU copy of the run every N iterations to roll back to (0: disk only)
    spike_guard_snapshot_dir: str | None = None  # node-local disk ($SLURM_TMPDIR): snapshots there, not in host memory
    spike_guard_lr_factor: float = 0.5  # on a relapse (a second rollback), multiply the LR by this from then on
    spike_guard_reset_optimizer: bool = False  # on a relapse, also reset the optimizer with the lr=0 warm-up (lesson 8)
    spike_guard_max_rollbacks: int = 3  # more would be needed: save the last good state and exit (code 3)
    spike_guard_max_skipped_iters: int = 2000  # iterations skipped by the guard in all, then save and exit (code 3)
    spike_guard_max_hardware_faults: int = 3  # transient faults on one DP rank before the run stops, naming it
    spike_guard_fp32_replay: bool = True  # fp16/bf16: replay a reproduced spike in fp32 (an fp32 copy of the weights)
    spike_guard_precursor: str | None = None  # early rung (None: off): cut the LR when this precursor passes ...
    spike_guard_precursor_threshold: float | None = None  # ... this threshold (docs/spike_guard.md, section 7)
    spike_guard_precursor_lr_factor: float = 0.5  # ... by this factor, once per crossing (spike_guard.PRECURSORS)
    inject_bad_batch_iters: list[str] | None = None  # fault injection: iterations ("40-45") given random-token batches
    inject_lr_iters: list[str] | None = None  # fault injection: iteration ranges whose LR is x inject_lr_factor
    inject_lr_factor: float = 100.0  # the LR multiplier of inject_lr_iters
    inject_bitflip_iters: list[str] | None = None  # fault injection: flip a bit of one gradient element at these iters
    inject_bitflip_rank: int = 0  # ... on this rank, after the DP all-reduce (a faulty GPU: silent data corruption)
    inject_bitflip_target: str = "grad"  # ... of a gradient ("grad"), or of a weight after the step ("weight")
    inject_numerical_iters: list[str] | None = None  # fault injection: a cancellation only half precision loses


FIELDS = {f.name: f for f in fields(Config)}


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


def _unknown(key):
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
            raise ValueError(f"unexpected argument {arg!r}: give one config file, then --key=value overrides")
        key, eq, value = arg[2:].partition("=")
        key = key.replace("-", "_")
        if key not in FIELDS:
            raise _unknown(key)
        i += 1
        if not eq:  # --key value [value ...], or a bare --flag
            values = []
            while i < len(argv) and not argv[i].startswith("--"):
                values.append(argv[i])
                i += 1
                if not _accepts_many(FIELDS[key].type):
                    break
            if not values:
                if FIELDS[key].type in (bool, bool | None):
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
    config_file = config_file or DEFAULT_CONFIG
    try:
        values = runpy.run_path(config_file)
    except FileNotFoundError:
        raise ValueError(f"config file {config_file!r} not found; pass a file from config/ (e.g. {DEFAULT_CONFIG})")
    except SyntaxError as e:
        raise ValueError(f"config file {config_file}, line {e.lineno}: {e.msg}; fix the file (a config is Python: "
                         "key = value per line)") from None
    except Exception as e:  # a config is executed: NameError, ImportError, ... in it
        raise ValueError(f"config file {config_file} fails when executed ({type(e).__name__}: {e}); "
                         "fix the file") from None
    settings = {}
    for key, value in values.items():
        if key.startswith("_") or isinstance(value, (types.ModuleType, types.FunctionType, type)):
            continue
        if key not in FIELDS:
            raise ValueError(f"{config_file}: " + str(_unknown(key)))
        settings[key] = value
    settings.update(overrides)
    cfg = Config(**{k: _convert(k, v, FIELDS[k].type) for k, v in settings.items()})
    cfg.config_file = config_file
    if cfg.init_from_hf is not None:
        from_hf(cfg, given=set(settings))
    return cfg


def from_hf(cfg, given):
    """init_from_hf: the model keys the config does not give (`given`: set by the file or the command line) come
    from the Hugging Face model; a given one that contradicts it is refused (hf.check_config), before anything is
    built. The weights are loaded by train.build_model."""
    for key, value in hf.config_from_hf(cfg.init_from_hf).items():
        if key not in given:
            setattr(cfg, key, value)
    try:
        hf.check_config(cfg, cfg.init_from_hf)
    except ValueError as e:
        hint = "" if cfg.config_file != DEFAULT_CONFIG else (
            f" ({DEFAULT_CONFIG}, the default config, describes a model of its own: start from config/finetune.py, "
            "which sets training keys only)")
        raise ValueError(f"{e}{hint}") from None


def check_device(cfg, local_world_size=None):
    """device=cuda where this torch has no CUDA, or with fewer GPUs than processes on the node: one message with
    the fix, before the process group or a device is touched (where torch's own error is a bare traceback)."""
    if cfg.device != "cuda":
        return
    if not torch.cuda.is_available():
        why = ("this torch is a CPU-only build" if torch.version.cuda is None else
               f"this torch (CUDA {torch.version.cuda}) sees no GPU: check the node and CUDA_VISIBLE_DEVICES")
        raise ValueError(f"device=cuda but {why}; install a CUDA build of torch on a GPU node (see "
                         "https://pytorch.org/get-started/locally), or use --device=cpu (--device=auto takes the GPU "
                         "when there is one)")
    local = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count()
    if gpus < local:
        raise ValueError(f"device=cuda with {local} processes on this node but {gpus} GPU(s) visible: one process per "
                         f"GPU; launch torchrun --nproc_per_node {gpus}, or check CUDA_VISIBLE_DEVICES")


def to_dict(cfg):
    return asdict(cfg)


# -----------------------------------------------------------------------------
# Validation and derived values


def prepare(cfg, world_size=1, reads_data=True):
    """The config a run uses: validate() it, then derive() what it leaves open. Returns cfg."""
    validate(cfg, world_size, reads_data)
    return derive(cfg, world_size)


def validate(cfg, world_size=1, reads_data=True):
    """Raise ValueError with a fix for every configuration that cannot work; changes nothing. The model's own
    rules are model.GPTConfig.check's. reads_data=False: the caller feeds the model something else than cfg's data
    (bench.py's random tokens), which then need not be configured."""
    def need(ok, message):
        if not ok:
            raise ValueError(message)

    for key, value in ((k, getattr(cfg, k)) for k in FIELDS):
        need(not isinstance(value, float) or math.isfinite(value),
             f"{key}={value} is not a finite number; give a finite value")
    for key in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size", "micro_batch_size",
                "global_batch_size", "train_iters", "train_samples", "train_tokens"):
        value = getattr(cfg, key)
        need(value is None or value > 0, f"{key}={value} must be positive")
    for key in ("lr", "min_lr", "weight_decay", "clip_grad", "eval_iters", "sample_tokens", "lr_warmup_samples"):
        need(getattr(cfg, key) >= 0, f"{key}={getattr(cfg, key)} must not be negative")
    need(not reads_data or cfg.data_path is not None or cfg.use_bundled_corpus,
         f"{getattr(cfg, 'config_file', 'this config')} sets no data_path: tokenize a corpus with `python data.py "
         "--input FILES --output-prefix data/NAME` and pass --data_path data/NAME (only config/tiny.py trains on "
         "the bundled Shakespeare: use_bundled_corpus)")
    need(not cfg.eval_only or not cfg.dry_run, "eval_only and dry_run are exclusive; choose one")
    GPTConfig.check(cfg)
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    need(world_size % (tp * pp) == 0,
         f"world size {world_size} is not divisible by tensor_model_parallel_size ({tp}) x "
         f"pipeline_model_parallel_size ({pp}); launch a multiple of {tp * pp} processes")
    dp = world_size // (tp * pp)
    parallel.partition_layers(cfg.num_layers, pp, cfg.pp_partition_method)  # raises if it cannot be done
    need(cfg.global_batch_size is None or cfg.global_batch_size % (cfg.micro_batch_size * dp) == 0,
         f"global_batch_size ({cfg.global_batch_size}) must be divisible by micro_batch_size ({cfg.micro_batch_size})"
         f" x data-parallel size ({dp}); change one of them")
    need(any(x is not None for x in (cfg.train_iters, cfg.train_samples, cfg.train_tokens)),
         "set the length of training: train_iters, train_samples or train_tokens")
    need(cfg.rampup_batch_size is None or cfg.train_iters is None,
         "rampup_batch_size counts samples: set train_samples (or train_tokens) instead of train_iters")
    need(cfg.rampup_batch_size is None or len(cfg.rampup_batch_size) == 3,
         f"rampup_batch_size must be 'start increment samples', got {cfg.rampup_batch_size}")
    need(not (cfg.fp16 and cfg.bf16), "fp16 and bf16 are exclusive; choose one")
    need(cfg.lr_decay_style in ("linear", "cosine", "constant"),
         f"lr_decay_style={cfg.lr_decay_style!r} is not linear, cosine or constant")
    need(cfg.min_lr <= cfg.lr, f"min_lr ({cfg.min_lr}) is larger than lr ({cfg.lr})")
    need(not (cfg.qk_layernorm and cfg.deepspeed and tp > 1),
         "qk_layernorm with deepspeed=True and tensor_model_parallel_size > 1 is not supported (the qk-layernorm "
         "gradients must be summed over TP before DeepSpeed's step); use the native path (deepspeed=False) or TP=1")
    need(cfg.zero_stage in (0, 1, 2, 3), f"zero_stage={cfg.zero_stage} is not 0, 1, 2 or 3")
    need(cfg.tp_replica_check_interval >= 0, "tp_replica_check_interval must be 0 (off) or a number of iterations")
    need(not cfg.tp_replica_resync or cfg.tp_replica_check_interval > 0,
         "tp_replica_resync acts on what the check finds: set tp_replica_check_interval too")
    need(not (cfg.tp_replica_resync and cfg.deepspeed),
         "tp_replica_resync cannot reach DeepSpeed's fp32 master weights; use deepspeed=False or only the check")
    need(cfg.device in ("auto", "cpu", "cuda"), f"device={cfg.device!r} is not auto, cpu or cuda")
    need(cfg.distributed_timeout_minutes >= 1, f"distributed_timeout_minutes={cfg.distributed_timeout_minutes} must "
         "be at least 1 (minutes a collective waits for the slowest rank)")
    need(cfg.log_interval > 0 and cfg.eval_interval > 0, "log_interval and eval_interval must be positive")
    need(cfg.save_interval is None or cfg.save_interval > 0, "save_interval must be positive")
    need(cfg.save_interval is None or cfg.save is not None, "save_interval is set but save (a directory) is not")
    need(not reads_data or cfg.tokenizer_file is None or cfg.data_path is not None,
         "tokenizer_file is set but data_path is not: the bundled corpus is GPT-2 tokens; prepare your data with "
         "`python data.py --input ... --output-prefix PREFIX --tokenizer-file FILE` and set data_path=PREFIX")
    for key in ("skip_train_iteration_range", "inject_bad_batch_iters", "inject_lr_iters", "inject_bitflip_iters",
                "inject_numerical_iters"):
        schedule.parse_iteration_ranges(getattr(cfg, key), key)
    need(cfg.inject_bitflip_target in ("grad", "weight"), "inject_bitflip_target must be 'grad' or 'weight'")
    need(cfg.reset_optimizer_warmup_iters in (None, "auto") or isinstance(cfg.reset_optimizer_warmup_iters, int),
         "reset_optimizer_warmup_iters must be a number of iterations or 'auto'")
    need(cfg.reset_optimizer_warmup_iters is None or cfg.load is not None,
         "reset_optimizer_warmup_iters resets the optimizer of a loaded checkpoint: set load too")
    need(cfg.telemetry_interval >= 0, "telemetry_interval must be >= 0 (0 turns telemetry off)")
    need(not (cfg.deepspeed and cfg.telemetry_interval), "telemetry_interval needs the gradients before the "
         "update, which DeepSpeed keeps inside its step(); set telemetry_interval=0 or deepspeed=False")
    need(not (cfg.deepspeed and cfg.spike_guard), "spike_guard judges the loss and grad norm before the update, "
         "which DeepSpeed computes inside its step(); set spike_guard=False or deepspeed=False")
    need(cfg.spike_guard_window >= 2 and 2 <= cfg.spike_guard_min_steps <= cfg.spike_guard_window,
         "spike_guard_min_steps must be in [2, spike_guard_window]")
    need(cfg.spike_guard_zscore > 0 and cfg.spike_guard_ema_ratio >= 1 and cfg.spike_guard_grad_norm_ratio >= 1,
         "spike_guard_zscore must be > 0, spike_guard_ema_ratio and spike_guard_grad_norm_ratio >= 1")
    need(cfg.spike_guard_max_skips >= 1 and cfg.spike_guard_rewind >= 0 and cfg.spike_guard_skip_after >= 0,
         "spike_guard_max_skips must be >= 1, spike_guard_rewind and spike_guard_skip_after >= 0")
    need(cfg.spike_guard_snapshot_interval >= 0, "spike_guard_snapshot_interval must be >= 0 (0: disk checkpoints)")
    need(not cfg.spike_guard or cfg.spike_guard_snapshot_interval or cfg.save,
         "spike_guard with spike_guard_snapshot_interval=0 rolls back to disk checkpoints: set save and save_interval")
    need(not cfg.spike_guard_snapshot_dir or cfg.spike_guard_snapshot_interval,
         "spike_guard_snapshot_dir holds the snapshots of spike_guard_snapshot_interval: set an interval (e.g. 50)")
    need(0 < cfg.spike_guard_lr_factor <= 1, "spike_guard_lr_factor must be in (0, 1]")
    need(cfg.soft_skip_loss_ratio == 0 or cfg.soft_skip_loss_ratio >= 1,
         f"soft_skip_loss_ratio={cfg.soft_skip_loss_ratio} must be 0 (off) or >= 1 (a multiple of the loss's trend)")
    need(not (cfg.deepspeed and cfg.soft_skip_loss_ratio), "soft_skip_loss_ratio scales the gradients before the "
         "update, which DeepSpeed keeps inside its step(); set soft_skip_loss_ratio=0 or deepspeed=False")
    need(cfg.spike_guard_max_hardware_faults >= 1, "spike_guard_max_hardware_faults must be >= 1")
    if cfg.spike_guard_precursor is not None:
        from stability import spike_guard
        names = ", ".join(spike_guard.PRECURSORS)
        need(cfg.spike_guard_precursor in spike_guard.PRECURSORS,
             f"spike_guard_precursor={cfg.spike_guard_precursor!r} is not one of {names}")
        need(cfg.spike_guard_precursor_threshold is not None and math.isfinite(cfg.spike_guard_precursor_threshold),
             "spike_guard_precursor needs spike_guard_precursor_threshold (a number: docs/spike_guard.md has the "
             "thresholds measured on the stability lab's clean runs; tools/precursors.py measures yours)")
        need(cfg.telemetry_interval > 0, "spike_guard_precursor reads the telemetry: set telemetry_interval (e.g. 10)")
    need(0 < cfg.spike_guard_precursor_lr_factor <= 1, "spike_guard_precursor_lr_factor must be in (0, 1]")
    need(not cfg.curriculum_learning or (cfg.total_curriculum_step is not None and cfg.total_curriculum_step > 0),
         "curriculum_learning needs total_curriculum_step (about train_tokens / global_batch / seq_length / 2)")


def derive(cfg, world_size=1):
    """Fill in the values a config leaves to be derived; returns cfg. Call it on a validated config."""
    if cfg.global_batch_size is None:  # one micro-batch per data-parallel rank
        dp = world_size // (cfg.tensor_model_parallel_size * cfg.pipeline_model_parallel_size)
        cfg.global_batch_size = cfg.micro_batch_size * dp
    if cfg.apply_query_key_layer_scaling is None:  # Megatron's default: on with fp16, where it avoids overflows
        cfg.apply_query_key_layer_scaling = cfg.fp16
    if cfg.curriculum_learning and cfg.max_difficulty is None:
        cfg.max_difficulty = cfg.seq_length
    return cfg
