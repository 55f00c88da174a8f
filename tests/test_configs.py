"""The configs are the runs: every key of config/tr*.py against the BigScience launch script it names, and
config/gpt2_125m.py against GPT-3 Small, from tables kept here (values read from the scripts at the commits named),
so that an edit cannot drift from the run silently. Where a config differs on purpose, the difference is listed
here too, with the real value; the config's own comment says why. Cheap: nothing trains.

The dry runs of config/tr8b_104b.py and config/tr11_176b.py are tests/test_parallel.py's and tests/test_alibi.py's."""

import io
import os

import pytest

import arguments
import estimate
import schedule
from helpers import plan_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = "bigscience-workshop/bigscience"

# Megatron-DeepSpeed's defaults (megatron/arguments.py), which every script below inherits where it sets nothing
MEGATRON = {
    "hidden_dropout": 0.1,
    "attention_dropout": 0.1,
    "init_method_std": 0.02,
    "seed": 1234,
    "activation": "gelu_tanh",  # --no-bias-gelu-fusion unset: the fused bias-GeLU, the tanh approximation
    "apply_query_key_layer_scaling": True,  # --no-query-key-layer-scaling unset (fp16 and bf16 alike)
    "layernorm_epsilon": 1e-5,
    "make_vocab_size_divisible_by": 128,
    "loss_scale": None,
    "embed_layernorm": False,
    "position_embedding_type": "learned",
    "pp_partition_method": "type:transformer",  # the only method before --pp-partition-method (Feb 2022)
    "vocab_size": 50257,  # GPT2BPETokenizer
}
# The fp16 block of the DeepSpeed config file the four fp16 scripts write, in our keys ("initial_scale_power": 12)
DEEPSPEED_FP16 = {
    "fp16": True,
    "initial_loss_scale": 4096,
    "loss_scale_window": 500,
    "hysteresis": 2,
    "min_loss_scale": 1,
}
# What every BigScience script below sets alike
COMMON = {
    "adam_beta1": 0.9,
    "adam_eps": 1e-8,
    "clip_grad": 1.0,
    "weight_decay": 0.1,
    "lr_decay_style": "cosine",
    "checkpoint_activations": True,
    "eval_interval": 1000,
    "split": "949,50,1",
    "seq_length": 2048,
    "zero_stage": 1,
}

# config: (what it follows, commit, GPUs of the run's layout, {key: the run's value})
RUNS = {
    "tr8b_104b": (
        "train/tr8b-104B/tr8b-104B-emb-norm-64n.slurm",
        "699b2af9",
        256,
        {
            **MEGATRON,
            **DEEPSPEED_FP16,
            **COMMON,
            "num_layers": 64,
            "hidden_size": 11600,
            "num_attention_heads": 80,
            "micro_batch_size": 1,
            "global_batch_size": 2048,
            "rampup_batch_size": [16, 16, 6_000_000],
            "train_samples": 300_000_000,
            "lr": 6e-5,
            "min_lr": 6e-6,
            "lr_decay_samples": 126_953_125,
            "lr_warmup_samples": 216_320,
            "adam_beta2": 0.95,
            "init_method_std": 0.006,
            "embed_layernorm": True,
            "seed": 43,
            "exit_duration_in_mins": 1185,
            "tensor_model_parallel_size": 4,
            "pipeline_model_parallel_size": 32,
            "log_interval": 1,
            "save_interval": 300,
            "eval_iters": 5,
            "skip_train_iteration_range": ["13251-14000", "16651-19500"],
        },
    ),
    "tr8_104b": (
        "train/tr8-104B-wide/tr8-104B.slurm",
        "1321e534",
        512,
        {
            **MEGATRON,
            **DEEPSPEED_FP16,
            **COMMON,
            "num_layers": 32,
            "hidden_size": 16384,
            "num_attention_heads": 32,
            "micro_batch_size": 1,
            "global_batch_size": 2048,
            "rampup_batch_size": [32, 32, 6_000_000],
            "train_samples": 300_000_000,
            "lr": 6e-5,
            "min_lr": 6e-6,
            "lr_decay_samples": 126_953_125,
            "lr_warmup_samples": 216_320,
            "adam_beta2": 0.95,
            "seed": 43,
            "exit_duration_in_mins": 1190,
            "tensor_model_parallel_size": 4,
            "pipeline_model_parallel_size": 32,
            "log_interval": 1,
            "save_interval": 300,
            "eval_iters": 5,
        },
    ),
    # 64 GPUs: the ramp-up ran on 16 nodes (its batches of 16 allow DP 16 at most; README)
    "tr1_13b": (
        "train/tr1-13B-base/tr1-13B-round1.slurm",
        "699b2af9",
        64,
        {
            **MEGATRON,
            **DEEPSPEED_FP16,
            **COMMON,
            "num_layers": 40,
            "hidden_size": 5120,
            "num_attention_heads": 32,
            "micro_batch_size": 1,
            "global_batch_size": 1024,
            "rampup_batch_size": [16, 16, 5_000_000],
            "train_samples": 300_000_000,
            "lr": 1e-4,
            "min_lr": 1e-5,
            "lr_decay_samples": 126_953_125,
            "lr_warmup_samples": 216_320,
            "adam_beta2": 0.999,
            "seed": 42,
            "exit_duration_in_mins": 1190,
            "tensor_model_parallel_size": 2,
            "pipeline_model_parallel_size": 4,
            "log_interval": 10,
            "save_interval": 1500,
            "eval_iters": 5,
        },
    ),
    "tr3_1b3": (
        "train/tr3-1B3-baseline/tr3m-1B3-emb-norm-pile-optim-reset.slurm",
        "699b2af9",
        64,
        {
            **MEGATRON,
            **DEEPSPEED_FP16,
            **COMMON,
            "num_layers": 24,
            "hidden_size": 2048,
            "num_attention_heads": 16,
            "micro_batch_size": 1,
            "global_batch_size": 512,
            "rampup_batch_size": [32, 32, 2_000_000],
            "train_samples": 5_000_000,
            "lr": 2e-4,
            "min_lr": 1e-5,
            "lr_decay_samples": 73_242_187,
            "lr_warmup_samples": 183_105,
            "adam_beta2": 0.95,
            "embed_layernorm": True,
            "exit_duration_in_mins": 1190,
            "tensor_model_parallel_size": 1,
            "pipeline_model_parallel_size": 2,
            "log_interval": 1,
            "save_interval": 1500,
            "eval_iters": 100,
        },
    ),  # ROUND=2
    # 384 GPUs: 48 nodes as launched (the script's last commits ran on 24)
    "tr11_176b": (
        "train/tr11-176B-ml/tr11-176B-ml.slurm",
        "dc8d99ff",
        384,
        {
            **MEGATRON,
            **COMMON,
            "num_layers": 70,
            "hidden_size": 14336,
            "num_attention_heads": 112,
            "position_embedding_type": "alibi",
            "embed_layernorm": True,
            "vocab_size": 250_680,
            "bf16": True,
            "fp16": False,
            "micro_batch_size": 2,
            "global_batch_size": 2048,
            "rampup_batch_size": [192, 16, 9_765_625],
            "train_samples": 220_000_000,
            "lr": 6e-5,
            "min_lr": 6e-6,
            "lr_decay_samples": 200_000_000,
            "lr_warmup_samples": 183_105,
            "adam_beta2": 0.95,
            "init_method_std": 0.0048,
            "seed": 42,
            "exit_duration_in_mins": 5990,
            "tensor_model_parallel_size": 4,
            "pipeline_model_parallel_size": 12,
            "pp_partition_method": "type:transformer|embedding",
            "zero_stage": 0,
            "log_interval": 1,
            "save_interval": 100,
            "eval_iters": 1,
        },
    ),
    # not a script: GPT-3 Small, arXiv 2005.14165 Table 2.1 and Appendix B (batch 0.5M tokens, 375M warm-up tokens)
    "gpt2_125m": (
        "GPT-3 Small (arXiv 2005.14165",
        None,
        1,
        {
            "num_layers": 12,
            "hidden_size": 768,
            "num_attention_heads": 12,
            "activation": "gelu_tanh",
            "seq_length": 2048,
            "global_batch_size": 256,
            "lr": 6e-4,
            "min_lr": 6e-5,
            "lr_decay_style": "cosine",
            "lr_warmup_samples": 375_000_000 // 2048,
            "adam_beta1": 0.9,
            "adam_beta2": 0.95,
            "adam_eps": 1e-8,
            "clip_grad": 1.0,
            "weight_decay": 0.1,
            "init_method_std": 0.02,
        },
    ),  # GPT-2's init, which GPT-3 keeps
}

# config: {key: our value} where it differs from the run on purpose (the config's comment says why)
DIFFERENCES = {
    # the last state of the script rolls back over Embed-Norm experiments 2-4; the launch had no skip
    "tr8b_104b": {"skip_train_iteration_range": None},
    "tr8_104b": {},
    "tr1_13b": {},
    "tr3_1b3": {},
    # micro batch 1 until the global batch reached 784; ZeRO "stage 0" with BF16_Optimizer's own sharding = ZeRO-1
    "tr11_176b": {"zero_stage": 1},
    # GPT-2's context of 1024 (the batch keeps 0.5M tokens and the warm-up 375M tokens); our init levers
    "gpt2_125m": {
        "seq_length": 1024,
        "global_batch_size": 512,
        "lr_warmup_samples": 375_000_000 // 1024,
        "init_method_std": "small_init",
    },
}


def load(name):
    return arguments.load_config([os.path.join(ROOT, "config", f"{name}.py")])


@pytest.mark.parametrize("name", RUNS)
def test_config_is_the_run(name):
    script, commit, gpus, run = RUNS[name]
    # derive() fills apply_query_key_layer_scaling
    cfg = arguments.prepare(load(name), gpus, reads_data=False)
    ours = DIFFERENCES[name]
    drift = {
        key: (getattr(cfg, key), ours.get(key, real))
        for key, real in run.items()
        if getattr(cfg, key) != ours.get(key, real)
    }
    assert not drift, (
        f"config/{name}.py drifted from {script} ({{key: (config, expected)}}): {drift}"
    )
    stale = [key for key, value in ours.items() if run[key] == value]
    assert not stale, f"listed as differences but equal to the run: {stale}"
    with open(os.path.join(ROOT, "config", f"{name}.py"), encoding="utf-8") as f:
        header = "".join(f.readlines()[:6])
    assert script in header and (commit is None or commit in header), (
        f"config/{name}.py must name {script}"
    )


@pytest.mark.parametrize("name", ["tr3_1b3", "tr1_13b", "tr8_104b", "tr11_176b"])
def test_the_ramp_up_fits_the_runs_layout(name):
    """Every batch size of the ramp-up is a multiple of micro batch x DP on the GPUs the run used."""
    _, _, gpus, _ = RUNS[name]
    cfg = load(name)
    dp = gpus // (cfg.tensor_model_parallel_size * cfg.pipeline_model_parallel_size)
    # raises if not
    schedule.RampupBatchSize(cfg.rampup_batch_size, cfg.global_batch_size, cfg.micro_batch_size, dp)


@pytest.mark.parametrize("name", ["tr3_1b3", "tr1_13b", "tr8_104b", "gpt2_125m"])
def test_dry_run_of_the_runs_layout(name):
    _, _, gpus, _ = RUNS[name]
    cfg, out = load(name), io.StringIO()
    report = estimate.dry_run(cfg, world_size=gpus, file=out)
    assert report["dp"] == gpus // (
        cfg.tensor_model_parallel_size * cfg.pipeline_model_parallel_size
    )
    assert len(report["stages"]) == cfg.pipeline_model_parallel_size
    assert f"= {gpus} GPUs" in out.getvalue() and "estimated total per GPU" in out.getvalue()


def test_length_of_training_is_megatron_s():
    """The iteration totals the chronicles' logs print ("iteration 17060/ 159576"; BLOOM's "12695/ 115311"),
    and tr3m's "this will run iterations till iteration 19686" for its 5M samples."""
    totals = {}
    for name in ("tr8b_104b", "tr11_176b", "tr3_1b3"):
        cfg = load(name)
        totals[name] = plan_of(cfg).total_iters
    assert totals == {"tr8b_104b": 159_576, "tr11_176b": 115_311, "tr3_1b3": 19_686}


def test_the_default_config_is_the_repository_s_from_any_directory(tmp_path, monkeypatch):
    """`python /path/to/train.py` from another directory read config/tiny.py from there: not found, with a message
    that named config/ as if it were the current directory's."""
    monkeypatch.chdir(tmp_path)
    cfg = arguments.load_config([])
    assert (cfg.config_file, cfg.num_layers, cfg.train_iters) == ("config/tiny.py", 4, 300)
    with pytest.raises(ValueError) as e:
        arguments.load_config(["config/tr1_13b.py"])
    assert str(e.value) == (
        f"config file 'config/tr1_13b.py' not found (from {tmp_path}); pass a file from {ROOT}/config (e.g. "
        f"{ROOT}/config/tiny.py)"
    )
