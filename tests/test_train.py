"""The trainer through its real command line: config parsing, log lines, bit-exact resume, clear errors."""

import os
import re
import subprocess

import pytest
import torch

import arguments
import data
import schedule
from helpers import (  # noqa: F401
    ROOT,
    SMALL,
    assert_same,
    corpus,
    corpus512,
    final_state,
    launch,
    losses,
    run_main,
    synthetic_corpus,
    torchrun,
)
from helpers import run_cli as run

# -- configuration ----------------------------------------------------------------------------------------------


def test_cli_forms_hyphens_underscores_bare_flags_and_lists(tmp_path):
    cfg_file = tmp_path / "c.py"
    cfg_file.write_text("num_layers = 3\nlr = 1e-3\nimport math\n_private = 1\n")
    cfg = arguments.load_config(
        [
            str(cfg_file),
            "--lr-warmup-samples",
            "216_320",
            "--lr_decay_samples=1e6",
            "--embed-layernorm",
            "--fp16",
            "false",
            "--skip-train-iteration-range",
            "13251-14000",
            "16652-18500",
            "--rampup_batch_size=16 16 9_765_625",
            "--init-method-std",
            "small_init",
            "--data-path",
            "0.3",
            "a",
            "0.7",
            "b",
        ]
    )
    assert cfg.num_layers == 3 and cfg.lr == 1e-3
    assert cfg.lr_warmup_samples == 216320 and cfg.lr_decay_samples == 1_000_000
    assert cfg.embed_layernorm is True and cfg.fp16 is False
    assert cfg.skip_train_iteration_range == ["13251-14000", "16652-18500"]
    assert cfg.rampup_batch_size == [16, 16, 9765625]
    assert cfg.init_method_std == "small_init"
    assert cfg.data_path == ["0.3", "a", "0.7", "b"]
    assert schedule.parse_iteration_ranges(cfg.skip_train_iteration_range) == [
        (13251, 14000),
        (16652, 18500),
    ]
    assert (
        arguments.load_config(["--reset_optimizer_warmup_iters"]).reset_optimizer_warmup_iters
        == "auto"
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lr_warmup_sample=5"], "did you mean 'lr_warmup_samples'"),
        (["--lr=fast"], "cannot use 'fast'"),
        (["--train_iters=1.5"], "train_iters"),
    ],
)
def test_bad_keys_and_values_name_the_problem(argv, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        arguments.load_config(argv)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["--hidden_size=100", "--num_attention_heads=3"],
            "hidden_size (100) must be divisible by num_attention_heads",
        ),
        (
            ["--global_batch_size=10", "--micro_batch_size=4"],
            "global_batch_size (10) must be divisible",
        ),
        (["--fp16", "--bf16"], "exclusive"),
        (["--train_iters=none"], "set the length of training"),
        (["--skip_train_iteration_range", "20-10"], "START-END"),
        (["--lr_decay_style=exp"], "lr_decay_style"),
        (["--rampup_batch_size=16 16 1000"], "train_samples"),
    ],
)
def test_impossible_configs_are_refused(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        arguments.validate(arguments.load_config(overrides), world_size=1)


def test_a_length_on_the_command_line_replaces_the_config_files_other_unit(capsys):
    """config/tiny.py sets train_iters, which rampup_batch_size refuses: a train_samples given on the command line
    replaces it, saying so. Both given on the command line are the user's contradiction: refused."""
    rampup = ["--rampup-batch-size", "4", "4", "64", "--micro-batch-size", "4"]
    cfg = arguments.prepare(arguments.load_config(["--train-samples", "96", *rampup]))
    assert (cfg.train_iters, cfg.train_samples) == (None, 96)
    assert capsys.readouterr().out == (
        "train_samples from the command line replaces the config file's train_iters = 300\n"
    )
    both = arguments.load_config(["--train-iters", "300", "--train-samples", "96", *rampup])
    assert capsys.readouterr().out == ""
    with pytest.raises(
        ValueError, match="set train_samples \\(or train_tokens\\) instead of train_iters"
    ):
        arguments.validate(both)


def test_a_command_line_key_replaces_only_the_exclusive_keys_the_file_set(tmp_path, capsys):
    """Samples and tokens go together (a curriculum's budget): a train_tokens on the command line replaces the
    file's train_iters and keeps its train_samples. A key at its default is not set: it neither replaces nor is
    replaced."""
    cfg_file = tmp_path / "c.py"
    cfg_file.write_text(
        "train_iters = 300\ntrain_samples = 1000\nfp16 = True\nlr_warmup_samples = 0\n"
    )
    cfg = arguments.load_config(
        [str(cfg_file), "--train-tokens", "5000", "--lr-warmup-tokens", "64", "--bf16", "no"]
    )
    assert (cfg.train_iters, cfg.train_samples, cfg.train_tokens) == (None, 1000, 5000)
    assert (cfg.fp16, cfg.bf16, cfg.lr_warmup_samples, cfg.lr_warmup_tokens) == (True, False, 0, 64)
    assert capsys.readouterr().out == (
        "train_tokens from the command line replaces the config file's train_iters = 300\n"
    )
    cfg = arguments.load_config([str(cfg_file), "--bf16"])
    assert (cfg.fp16, cfg.bf16, cfg.train_iters) == (False, True, 300)
    assert (
        capsys.readouterr().out
        == "bf16 from the command line replaces the config file's fp16 = True\n"
    )


def test_exclusive_warmups_both_on_the_command_line_are_refused():
    """Refused by the config's check, before the schedule is built."""
    with pytest.raises(
        ValueError,
        match="both lr_warmup_samples and lr_warmup_tokens are set; set only one of them",
    ):
        arguments.validate(
            arguments.load_config(["--lr-warmup-samples", "480", "--lr-warmup-tokens", "1000"])
        )


@pytest.mark.parametrize(
    "flag, message",
    [
        ("lr_decay_iters", "lr_decay_samples = lr_decay_iters x global_batch_size"),
        ("use_distributed_optimizer", "zero_stage=1"),
        ("num_key_value_heads", "num_query_groups"),
        ("use_checkpoint_lr_scheduler", "drop the flag"),
        ("sync_tp_duplicated_parameters", "tp_replica_check_interval=N with tp_replica_resync"),
        ("pad_vocab_size_to", "make_vocab_size_divisible_by"),
        ("data_impl", "drop the flag"),
        ("tensorboard_queue_size", "drop the flag"),
        ("train_weighted_split_paths_path", "data_path"),
        ("deepspeed_config", "no JSON file is read"),
        ("virtual_pipeline_model_parallel_size", "no interleaved (virtual) pipeline stages"),
        ("num_layers_per_virtual_pipeline_stage", "no interleaved (virtual) pipeline stages"),
        ("pipeline_model_parallel_split_rank", "a GPT is one stack"),
        ("checkpoint_num_layers", "checkpoint_activations recomputes every layer, one at a time"),
        ("recompute_num_layers", "checkpoint_activations recomputes every layer, one at a time"),
        ("partition_activations", "not split over the tensor-parallel ranks"),
        ("distribute_saved_activations", "not split over the tensor-parallel ranks"),
        ("overlap_grad_reduce", "always overlaps the data-parallel all-reduce"),
        ("initial_scale_power", "initial_loss_scale = 2**initial_scale_power"),
        ("num_micro_batches", "micro_batch_size x data-parallel size x the micro-batches"),
        ("no_save_optim", "every checkpoint holds the optimizer state"),
    ],
)
def test_a_megatron_flag_of_another_name_is_translated_not_misspelled(flag, message):
    """difflib's nearest key for each is another setting (lr_decay_tokens: another unit; use_bnb_optimizer:
    8-bit Adam; override_lr_scheduler: the opposite). BigScience's scripts' flags too: tr11's
    --sync-tp-duplicated-parameters was offered inject_duplicate_period (a fault injection), --pad-vocab-size-to
    vocab_size, --data-impl data_path, --tensorboard-queue-size tensorboard_dir, --train-weighted-split-paths-path
    valid_weighted_split_paths, --deepspeed_config deepspeed (whose file nothing would read). The layout's and
    precision's: the virtual pipeline's sizes and the split rank were offered pipeline_model_parallel_size (other
    stages), --checkpoint-num-layers and --recompute-num-layers num_layers (another depth), DeepSpeed's
    initial_scale_power initial_loss_scale (12 for 4096), --partition-activations and
    --distribute-saved-activations checkpoint_activations and distributed_timeout_minutes, --overlap-grad-reduce
    override_lr_scheduler, --num-micro-batches micro_batch_size, --no-save-optim no_load_optim (the opposite)."""
    with pytest.raises(
        ValueError,
        match=f"unknown config key '{flag}' \\(a Megatron-LM flag\\): .*" + re.escape(message),
    ):
        arguments.load_config([f"--{flag}=1"])


@pytest.mark.parametrize(
    "flag, message",
    [
        ("max_iters", "train_iters"),
        ("block_size", "seq_length"),
        ("warmup_iters", "lr_warmup_samples = warmup_iters x global_batch_size"),
        ("dropout", "hidden_dropout and attention_dropout"),
        ("out_dir", "save"),
        ("num_workers", "nothing to set"),
    ],
)
def test_a_nanogpt_name_is_translated_not_misspelled(flag, message):
    """difflib's nearest key for each was another setting: eval_iters, vocab_size, lr_warmup_tokens (another
    unit), embed_dropout, save_interval, num_layers."""
    with pytest.raises(
        ValueError,
        match=f"unknown config key '{flag}' \\(nanoGPT's name\\): .*" + re.escape(message),
    ):
        arguments.load_config([f"--{flag}=1"])


def test_every_nanogpt_translation_names_keys_that_exist():
    for flag, translation in arguments.NANOGPT_NAMES.items():
        assert flag not in arguments.FIELDS and flag not in arguments.MEGATRON_NAMES
        named = set(re.findall(r"[a-z][a-z0-9]*(?:_[a-z0-9]+)+", translation)) - {flag}
        assert named <= set(arguments.FIELDS), (flag, named - set(arguments.FIELDS))


def test_every_megatron_translation_names_keys_that_exist():
    for flag, translation in arguments.MEGATRON_NAMES.items():
        assert flag not in arguments.FIELDS
        named = set(re.findall(r"[a-z][a-z0-9]*(?:_[a-z0-9]+)+", translation)) - {flag}
        assert named and named <= set(arguments.FIELDS), (flag, named - set(arguments.FIELDS))


def test_a_config_file_after_a_list_key_is_the_config_file():
    """`--data_path a config/x.py` read the file as a second data path and trained the default config."""
    assert arguments.parse_cli(["--data_path", "a", "b", "config/gpt2_125m.py", "--lr=1"]) == (
        "config/gpt2_125m.py",
        {"data_path": ["a", "b"], "lr": "1"},
    )
    assert arguments.parse_cli(["--tokenizer_file", "t.py"]) == (None, {"tokenizer_file": "t.py"})


def test_a_config_file_after_a_bare_switch_is_the_config_file():
    """`--embed-layernorm config/x.py` was refused as "cannot use 'config/x.py' as bool": the bare switch took the
    file for its value."""
    assert arguments.parse_cli(["--embed-layernorm", "config/gpt2_125m.py", "--compile"]) == (
        "config/gpt2_125m.py",
        {"embed_layernorm": True, "compile": True},
    )
    assert arguments.parse_cli(["--fp16", "false"]) == (None, {"fp16": "false"})


@pytest.mark.parametrize("value", ["0", "-4", "abc", ""])
def test_a_world_size_that_is_no_count_of_processes_is_refused_by_name(value, monkeypatch):
    """WORLD_SIZE=0 ended in a ZeroDivisionError, 'abc' in int()'s words, -4 in a batch-size message."""
    import launch

    monkeypatch.setenv("WORLD_SIZE", value)
    with pytest.raises(
        ValueError, match=f"^WORLD_SIZE={value!r} must be a positive integer: torchrun sets it"
    ):
        launch.world_size()
    with pytest.raises(ValueError, match="must be a positive integer"):  # the dry run's own default
        launch.world_size(default=8)
    monkeypatch.setenv("WORLD_SIZE", "256")
    assert launch.world_size() == 256
    monkeypatch.delenv("WORLD_SIZE")
    assert (launch.world_size(), launch.world_size(default=8)) == (1, 8)


def test_a_world_size_or_rank_no_launcher_set_is_refused_with_the_fix(monkeypatch, capsys):
    """WORLD_SIZE=2 left in a shell: torch's rendezvous message naming MASTER_ADDR; a stray RANK=1 in a process
    alone: its error lines were never printed (rank 0 prints them)."""
    import launch

    for key in ("RANK", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "TORCHELASTIC_ERROR_FILE"):
        monkeypatch.delenv(key, raising=False)
    launch.check_launcher()  # one process, nothing set
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(
        ValueError, match=r"^WORLD_SIZE=2 but RANK, MASTER_ADDR, MASTER_PORT unset: .*torchrun"
    ):
        launch.check_launcher()
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ValueError, match=r"^RANK='1' is no rank of WORLD_SIZE=1"):
        launch.check_launcher()
    monkeypatch.setattr(launch, "EXIT_GRACE_SECONDS", 0)
    with pytest.raises(SystemExit):
        launch.exit_with(ValueError("the message"), 2)
    assert capsys.readouterr().err == "error: the message\n"


def test_unknown_key_in_config_file(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("num_layer = 2\n")
    with pytest.raises(
        ValueError, match=r"bad.py: unknown config key 'num_layer'; did you mean 'num_layers'"
    ):
        arguments.load_config([str(bad)])
    # a helper of the file's own arithmetic: a name with _ is not a key
    bad.write_text("n = 2\nnum_layers = n\n")
    with pytest.raises(ValueError, match=r"bad.py: unknown config key 'n'.* name it _n\)$"):
        arguments.load_config([str(bad)])
    bad.write_text("_n = 2\nnum_layers = _n\n")
    assert arguments.load_config([str(bad)]).num_layers == 2


def test_device_cuda_without_a_usable_gpu_is_one_message(monkeypatch):
    """A CPU-only torch on a GPU node, or more processes than GPUs: refused before any process group or device
    is touched (torch's own error is a traceback from inside torch.cuda)."""
    cuda = arguments.load_config(["--device=cuda"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(
        ValueError,
        match=r"device=cuda but this torch is a CPU-only build; install a CUDA build of "
        r"torch .* or use --device=cpu",
    ):
        arguments.check_device(cuda)
    arguments.check_device(arguments.load_config(["--device=auto"]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    arguments.check_device(cuda, local_world_size=2)
    with pytest.raises(
        ValueError,
        match=r"device=cuda with 4 processes on this node but 2 GPU\(s\) visible: one "
        r"process per GPU; launch torchrun --nproc_per_node 2",
    ):
        arguments.check_device(cuda, local_world_size=4)
    # the default, device=auto, is CUDA here: two ranks would share a GPU, which NCCL refuses at the first
    # collective (parallel.init gives both LOCAL_RANK % 1 = GPU 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(
        ValueError,
        match=r"^device=auto \(CUDA: torch sees a GPU\) with 2 processes on this node but 1 GPU\(s\) "
        r"visible: .*--nproc_per_node 1, check CUDA_VISIBLE_DEVICES, or use --device=cpu$",
    ):
        arguments.check_device(arguments.load_config(["--device=auto"]), local_world_size=2)
    arguments.check_device(arguments.load_config(["--device=auto"]), local_world_size=1)
    arguments.check_device(arguments.load_config(["--device=cpu"]), local_world_size=2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
def test_device_cuda_on_a_cpu_torch_through_the_command_line():
    proc = run("--device=cuda", "--save=none", expect_ok=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert (
        proc.stderr.startswith("error: device=cuda but this torch")
        and proc.stderr.count("error:") == 1
    )


@pytest.mark.slow
def test_config_error_under_torchrun_is_printed_once_and_is_the_root_cause(tmp_path):
    """Every rank has the error: rank 0 prints it; torchrun's failure summary carries it (the error file) instead of
    'To enable traceback see ...'; no traceback of ours."""
    proc = subprocess.run(
        [
            *torchrun(2),
            "train.py",
            "--lr=fast",
            "--save=none",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, WANDB_MODE="disabled"),
    )
    assert proc.returncode != 0
    message = "config key 'lr': cannot use 'fast' as float"
    ours = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert ours == [f"error: {message}"], proc.stderr[-3000:]
    root_cause = proc.stderr.split("Root Cause")[1]
    assert f"traceback : error: {message}" in root_cause and "To enable traceback" not in root_cause
    # the launcher's own stack only
    assert 'File "' + os.path.join(ROOT, "train.py") not in proc.stderr


# train.py as torchrun starts it, its teardown noted on stderr: DeepSpeed's release, the barrier and the process
# groups' destruction, each with the threads alive when it starts.
TEARDOWN_NOTED = """
import os, runpy, sys, threading
sys.path.insert(0, os.getcwd())
import torch.distributed as dist
import deepspeed_engine
def noted(owner, name):
    real = getattr(owner, name)
    def call(*args, **kwargs):
        threads = sorted(t.name for t in threading.enumerate())
        # one write: print's text and newline are two, and the other rank's line lands between them
        os.write(2, f"teardown rank {os.environ['RANK']}: {name} {threads}\\n".encode())
        return real(*args, **kwargs)
    setattr(owner, name, call)
noted(dist, "barrier")
noted(dist, "destroy_process_group")
noted(deepspeed_engine.DeepSpeedOptimizer, "close")
sys.argv[0] = "train.py"
runpy.run_path("train.py", run_name="__main__")
"""


@pytest.mark.slow
def test_deepspeed_bf16_pp2_exits_cleanly_every_time(synthetic_corpus, tmp_path):
    """A finished run exits 0 on every rank, every time (launch.shut_down): a SLURM chain of jobs
    (--dependency=afterok) stops at the first that does not. Such a run that had saved aborted at exit in 1 of 5
    tries: a rank tore its connections down while another still talked to it. Five tries miss a 1-in-5 abort one
    time in three (on a 2-core CPU they passed with the barrier and DeepSpeed's release taken out), so every time
    is checked by construction, on one run: each rank releases DeepSpeed, then, its main thread alone (the
    prefetch thread and the checkpoint writer done), waits at a barrier for every other rank, and only then
    destroys the process groups."""
    pytest.importorskip("deepspeed")
    wrapper = tmp_path / "teardown_noted.py"
    wrapper.write_text(TEARDOWN_NOTED)
    run = launch(
        tmp_path / "run",
        2,
        f"--data_path={synthetic_corpus}",
        "--deepspeed",
        "--bf16",
        "--zero_stage=0",
        "--pipeline_model_parallel_size=2",
        "--train_iters=6",
        f"--save={tmp_path / 'ckpt'}",
        expect_ok=False,
        script=str(wrapper),
    )
    proc = run.proc
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{run.err[-3000:]}"
    assert "terminate called" not in run.err and sorted(run.lines) == list(range(1, 7))
    for rank in (0, 1):
        noted = re.findall(rf"^teardown rank {rank}: (.*)$", run.err, re.M)
        assert noted[-3:] == [
            "close ['MainThread']",
            "barrier ['MainThread']",
            "destroy_process_group ['MainThread']",
        ], (rank, noted)


# -- the log line -------------------------------------------------------------------------------------------------

SEED_LINE = (
    " iteration    17060/  159576 | consumed samples:      8126688 | consumed tokens:  16643457024 | "
    "elapsed time per iteration (ms): 573125.8 | learning rate: 5.948E-05 | global batch size:  2048 | "
    "lm loss: 2.665295E+00 | loss scale: 1048576.0 | grad norm: 453082.517 | num zeros: 0.0 | "
    "number of skipped iterations:   0 | number of nan iterations:   0 | samples per second: 0.004 | "
    "TFLOPs: 23.64 |"
)


def _shape(line):
    """The line with every number replaced by its width-preserving pattern, to compare formats."""
    return re.sub(r"\d", "9", line)


def test_log_line_format_matches_the_seeds(corpus, tmp_path):
    out = run(*SMALL, "--train_iters=3", f"--save={tmp_path}").stdout
    lines = [x for x in out.splitlines() if x.startswith(" iteration")]
    assert len(lines) == 3
    # the seeds' fields, then ours: tokens/s and MFU (n/a on the CPU: no datasheet peak)
    names = [f.split(":")[0].strip() for f in SEED_LINE.split("|")[1:-1]]
    names += ["tokens per second", "MFU"]
    for line in lines:
        assert [f.split(":")[0].strip() for f in line.split("|")[1:-1]] == names
        fields = r"( [a-zA-Z ()]+: +[-+.\dE]+ \|)+"
        assert re.fullmatch(r" iteration +\d+/ +\d+ \|" + fields + r" MFU: n/a \|", line), line
    # field widths as Megatron prints them: iteration %8d, consumed %12d, batch %5d, skipped %3d
    assert re.match(
        r" iteration {8}1/ {7}3 \| consumed samples: {12}8 \| consumed tokens: {10}512 \|", lines[0]
    )
    assert "Model size:" in out and "validation loss at iteration 3" in out


# -- resume --------------------------------------------------------------------------------------------------------


def test_resume_is_bit_exact(corpus512, tmp_path):
    """SMALL (dropout on) on a 512-token vocabulary: the subject is the resume, not the vocabulary (the GPT-2
    vocabulary's output layer was most of the time of these 40 iterations). A resume that lost the RNG streams,
    the optimizer's state, the LR schedule (past its warm-up at 10) or the data position still differs."""
    small = [*SMALL, f"--data_path={corpus512}", "--vocab_size=512"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    full = losses(
        run(*small, "--train_iters=20", f"--save={straight}", "--save_interval=10").stdout
    )
    first = losses(run(*small, "--train_iters=10", f"--save={split}").stdout)
    second = run(*small, "--train_iters=20", f"--save={split}", f"--load={split}").stdout
    assert "loaded checkpoint" in second
    resumed = losses(second)
    assert sorted(full) == list(range(1, 21)) and sorted(resumed) == list(range(11, 21))
    assert {i: full[i] for i in range(1, 11)} == first
    assert {i: full[i] for i in range(11, 21)} == resumed
    tag_a, model_a, rank_a = final_state(straight)
    tag_b, model_b, rank_b = final_state(split)
    assert tag_a == tag_b == "global_step20"
    assert_same(model_a["model"], model_b["model"], "model")
    assert_same(rank_a["optimizer"], rank_b["optimizer"], "optimizer")
    assert model_a["run"]["state"] == model_b["run"]["state"]


def test_changed_lr_schedule_needs_override(corpus512, tmp_path):
    """The refusal through the command line (exit 2, the flag named, the checkpoint untouched). The run before it
    and the one after in this process (train.py's main), on a 512-token vocabulary: the subject is the LR
    schedule, not the interpreter's start-up or the vocabulary."""
    small = [*SMALL, f"--data_path={corpus512}", "--vocab_size=512"]
    run_main(*small, "--train_iters=2", f"--save={tmp_path}")
    proc = run(*small, "--train_iters=4", f"--load={tmp_path}", "--min_lr=1e-5", expect_ok=False)
    assert proc.returncode == 2
    assert "override_lr_scheduler" in proc.stderr and "minimum learning rate" in proc.stderr
    # checkpoint untouched
    assert open(os.path.join(tmp_path, "latest")).read().strip() == "global_step2"
    out = run_main(
        *small,
        "--train_iters=4",
        f"--load={tmp_path}",
        f"--save={tmp_path}",
        "--min_lr=1e-5",
        "--override_lr_scheduler",
    )
    assert " iteration        4/" in out


# -- bad input -----------------------------------------------------------------------------------------------------


def test_missing_and_corrupt_data_files_are_reported(tmp_path):
    proc = run(*SMALL, "--train_iters=2", f"--data_path={tmp_path}/nothing", expect_ok=False)
    assert proc.returncode == 2 and "nothing" in proc.stderr and "Traceback" not in proc.stderr
    prefix = str(tmp_path / "tiny")
    data.write_indexed_dataset(prefix, [list(range(1, 300))] * 20)
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(100)
    proc = run(*SMALL, "--train_iters=2", f"--data_path={prefix}", expect_ok=False)
    assert proc.returncode == 2 and "tiny.bin" in proc.stderr and "Traceback" not in proc.stderr


def test_corrupt_checkpoint_is_reported_and_left_alone(corpus512, tmp_path):
    """The report through the command line; the checkpoint it reads written in this process (train.py's main),
    on a 512-token vocabulary: the subject is the damaged file, not its size."""
    small = [*SMALL, f"--data_path={corpus512}", "--vocab_size=512"]
    run_main(*small, "--train_iters=2", f"--save={tmp_path}")
    shard = tmp_path / "global_step2" / "mp_rank_00_000_model_states.pt"
    shard.write_bytes(shard.read_bytes()[:1000])
    proc = run(
        *small, "--train_iters=4", f"--load={tmp_path}", f"--save={tmp_path}", expect_ok=False
    )
    assert (
        proc.returncode == 2
        and "corrupt" in proc.stderr
        and "mp_rank_00_000_model_states.pt" in proc.stderr
    )
    assert open(tmp_path / "latest").read().strip() == "global_step2"


# -- the end of a run ------------------------------------------------------------------------------


def test_the_end_of_run_sample_follows_the_prompt_seed_and_settings(capsys, monkeypatch):
    """training.print_sample: sample_tokens tokens after sample_prompt, top-k 200 at temperature
    0.8, drawn with a generator seeded by seed (the reference: GPT.generate called so by hand); with
    PP > 1 no rank holds the model, and the log says where to sample instead."""
    import builders
    import parallel
    import training

    cfg = arguments.load_config(
        [
            "--num_layers=1",
            "--hidden_size=32",
            "--num_attention_heads=2",
            "--sample_tokens=32",
            "--sample_prompt=ROMEO:",
            "--seed=7",
            "--init_method_std=0.5",
        ]
    )  # peaked logits: the temperature counts
    cpu = torch.device("cpu")
    model = builders.build_model(cfg, cpu)
    tok = data.get_tokenizer(cfg.tokenizer_file)
    model.train()
    sample = (cfg.sample_tokens, cfg.sample_prompt, cfg.tokenizer_file, cfg.seed)
    training.print_sample(model, cpu, *sample)
    printed = capsys.readouterr().out
    prompt = torch.tensor([tok.encode_ordinary("ROMEO:")])
    gen = torch.Generator().manual_seed(7)
    expected = model.generate(prompt, 32, temperature=0.8, top_k=200, generator=gen)[0].tolist()
    assert printed == "-" * 30 + " sample " + "-" * 30 + "\n" + tok.decode(expected) + "\n"
    assert not model.training  # dropout off while sampling
    monkeypatch.setattr(parallel.grid, "pp_size", 2)
    training.print_sample(model, cpu, *sample)
    said = capsys.readouterr().out
    assert said == (
        "no sample printed: with pipeline_model_parallel_size 2 no rank holds the "
        "whole model; sample from the checkpoint with tools/sample.py\n"
    )
    # an empty prompt (a traceback at the run's end, after its save): from the end-of-document id
    monkeypatch.setattr(parallel.grid, "pp_size", 1)
    training.print_sample(model, cpu, 8, "", cfg.tokenizer_file, cfg.seed)
    gen = torch.Generator().manual_seed(7)
    expected = model.generate(
        torch.tensor([[tok.eot_token]]), 8, temperature=0.8, top_k=200, generator=gen
    )
    assert capsys.readouterr().out.endswith(tok.decode(expected[0].tolist()) + "\n")


def test_eval_only_without_validation_data_names_the_fix():
    import builders
    import training

    cfg = arguments.load_config(["--eval_only", "--split=100,0,0", "--eval_iters=5"])
    message = (
        r"^eval_only: no validation data \(split '100,0,0', eval_iters 5\); give the "
        r"validation split a share \(e.g. --split 0,100,0 for the whole data_path\)$"
    )
    with pytest.raises(ValueError, match=message):
        training.evaluate_only(
            None, None, None, builders.step_rules(cfg), torch.device("cpu"), cfg.split
        )


def test_eval_only_with_no_validation_batches_is_refused_before_the_build():
    """eval_iters=0 left the validation data empty: evaluate_only's refusal came after the model's build."""
    with pytest.raises(
        ValueError, match=r"^eval_only: no validation data \(eval_iters 0\): set eval_iters"
    ):
        arguments.validate(arguments.load_config(["--eval_only", "--eval_iters=0"]))


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--fp16"], "deepspeed=True with fp16 is not supported"),
        (["--zero_stage=0"], "deepspeed=True with zero_stage=0 and fp32 adds nothing"),
        (
            ["--bf16", "--skip_grad_norm_above=1"],
            "skip_grad_norm_above needs the grad norm before the update",
        ),
        (
            ["--bf16", "--use_bnb_optimizer"],
            "use_bnb_optimizer with deepspeed=True is not supported",
        ),
    ],
)
def test_what_deepspeed_does_not_run_is_refused_before_the_build(flags, message):
    """deepspeed_engine.check ran inside the build, after the model was made: now in the config's check too."""
    with pytest.raises(ValueError, match=re.escape(message)):
        arguments.validate(arguments.load_config(["--deepspeed", *flags]))
