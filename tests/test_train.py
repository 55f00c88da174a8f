"""The trainer through its real command line: config parsing, log lines, bit-exact resume, clear errors."""
import os
import re

import pytest
import torch

import arguments
import data
import schedule

from helpers import SMALL, corpus, losses, run_cli as run  # noqa: F401 (corpus is a fixture)


# -- configuration ----------------------------------------------------------------------------------------------


def test_cli_forms_hyphens_underscores_bare_flags_and_lists(tmp_path):
    cfg_file = tmp_path / "c.py"
    cfg_file.write_text("num_layers = 3\nlr = 1e-3\nimport math\n_private = 1\n")
    cfg = arguments.load_config([str(cfg_file), "--lr-warmup-samples", "216_320", "--lr_decay_samples=1e6",
                                 "--embed-layernorm", "--fp16", "false", "--skip-train-iteration-range",
                                 "13251-14000", "16652-18500", "--rampup_batch_size=16 16 9_765_625",
                                 "--init-method-std", "small_init", "--data-path", "0.3", "a", "0.7", "b"])
    assert cfg.num_layers == 3 and cfg.lr == 1e-3
    assert cfg.lr_warmup_samples == 216320 and cfg.lr_decay_samples == 1_000_000
    assert cfg.embed_layernorm is True and cfg.fp16 is False
    assert cfg.skip_train_iteration_range == ["13251-14000", "16652-18500"]
    assert cfg.rampup_batch_size == [16, 16, 9765625]
    assert cfg.init_method_std == "small_init"
    assert cfg.data_path == ["0.3", "a", "0.7", "b"]
    assert schedule.parse_iteration_ranges(cfg.skip_train_iteration_range) == [(13251, 14000), (16652, 18500)]
    assert arguments.load_config(["--reset_optimizer_warmup_iters"]).reset_optimizer_warmup_iters == "auto"


@pytest.mark.parametrize("argv, message", [
    (["--lr_warmup_sample=5"], "did you mean 'lr_warmup_samples'"),
    (["--lr=fast"], "cannot use 'fast'"),
    (["--train_iters=1.5"], "train_iters"),
])
def test_bad_keys_and_values_name_the_problem(argv, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        arguments.load_config(argv)


@pytest.mark.parametrize("overrides, message", [
    (["--hidden_size=100", "--num_attention_heads=3"], "hidden_size (100) must be divisible by num_attention_heads"),
    (["--global_batch_size=10", "--micro_batch_size=4"], "global_batch_size (10) must be divisible"),
    (["--fp16", "--bf16"], "exclusive"),
    (["--train_iters=none"], "set the length of training"),
    (["--skip_train_iteration_range", "20-10"], "START-END"),
    (["--lr_decay_style=exp"], "lr_decay_style"),
    (["--rampup_batch_size=16 16 1000"], "train_samples"),
])
def test_impossible_configs_are_refused(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        arguments.validate(arguments.load_config(overrides), world_size=1)


def test_unknown_key_in_config_file(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("num_layer = 2\n")
    with pytest.raises(ValueError, match=r"bad.py: unknown config key 'num_layer'; did you mean 'num_layers'"):
        arguments.load_config([str(bad)])


# -- the log line -------------------------------------------------------------------------------------------------

SEED_LINE = (" iteration    17060/  159576 | consumed samples:      8126688 | consumed tokens:  16643457024 | "
             "elapsed time per iteration (ms): 573125.8 | learning rate: 5.948E-05 | global batch size:  2048 | "
             "lm loss: 2.665295E+00 | loss scale: 1048576.0 | grad norm: 453082.517 | num zeros: 0.0 | "
             "number of skipped iterations:   0 | number of nan iterations:   0 | samples per second: 0.004 | "
             "TFLOPs: 23.64 |")


def _shape(line):
    """The line with every number replaced by its width-preserving pattern, to compare formats."""
    return re.sub(r"\d", "9", line)


def test_log_line_format_matches_the_seeds(corpus, tmp_path):
    out = run(*SMALL, "--train_iters=3", f"--save={tmp_path}").stdout
    lines = [l for l in out.splitlines() if l.startswith(" iteration")]
    assert len(lines) == 3
    names = [f.split(":")[0].strip() for f in SEED_LINE.split("|")[1:-1]]
    for line in lines:
        assert [f.split(":")[0].strip() for f in line.split("|")[1:-1]] == names
        assert re.fullmatch(r" iteration +\d+/ +\d+ \|( [a-zA-Z ()]+: +[-+.\dE]+ \|)+", line), line
    # field widths as Megatron prints them: iteration %8d, consumed %12d, batch %5d, skipped %3d
    assert re.match(r" iteration {8}1/ {7}3 \| consumed samples: {12}8 \| consumed tokens: {10}512 \|", lines[0])
    assert "Model size:" in out and "validation loss at iteration 3" in out


# -- resume --------------------------------------------------------------------------------------------------------


def _final_state(directory):
    tag = open(os.path.join(directory, "latest")).read().strip()
    model = torch.load(os.path.join(directory, tag, "mp_rank_00_000_model_states.pt"), weights_only=False)
    rank = torch.load(os.path.join(directory, tag, "rank_00000_optim_states.pt"), weights_only=False)
    return tag, model, rank


def _assert_same(a, b, path="state"):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def test_resume_is_bit_exact(corpus, tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    full = losses(run(*SMALL, "--train_iters=20", f"--save={straight}", "--save_interval=10").stdout)
    first = losses(run(*SMALL, "--train_iters=10", f"--save={split}").stdout)
    second = run(*SMALL, "--train_iters=20", f"--save={split}", f"--load={split}").stdout
    assert "loaded checkpoint" in second
    resumed = losses(second)
    assert sorted(full) == list(range(1, 21)) and sorted(resumed) == list(range(11, 21))
    assert {i: full[i] for i in range(1, 11)} == first
    assert {i: full[i] for i in range(11, 21)} == resumed
    tag_a, model_a, rank_a = _final_state(straight)
    tag_b, model_b, rank_b = _final_state(split)
    assert tag_a == tag_b == "global_step20"
    _assert_same(model_a["model"], model_b["model"], "model")
    _assert_same(rank_a["optimizer"], rank_b["optimizer"], "optimizer")
    assert model_a["run"]["state"] == model_b["run"]["state"]


def test_changed_lr_schedule_needs_override(corpus, tmp_path):
    run(*SMALL, "--train_iters=2", f"--save={tmp_path}")
    proc = run(*SMALL, "--train_iters=4", f"--load={tmp_path}", "--min_lr=1e-5", expect_ok=False)
    assert proc.returncode == 2
    assert "override_lr_scheduler" in proc.stderr and "minimum learning rate" in proc.stderr
    assert open(os.path.join(tmp_path, "latest")).read().strip() == "global_step2"  # checkpoint untouched
    out = run(*SMALL, "--train_iters=4", f"--load={tmp_path}", f"--save={tmp_path}", "--min_lr=1e-5",
              "--override_lr_scheduler").stdout
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


def test_corrupt_checkpoint_is_reported_and_left_alone(corpus, tmp_path):
    run(*SMALL, "--train_iters=2", f"--save={tmp_path}")
    shard = tmp_path / "global_step2" / "mp_rank_00_000_model_states.pt"
    shard.write_bytes(shard.read_bytes()[:1000])
    proc = run(*SMALL, "--train_iters=4", f"--load={tmp_path}", f"--save={tmp_path}", expect_ok=False)
    assert proc.returncode == 2 and "corrupt" in proc.stderr and "mp_rank_00_000_model_states.pt" in proc.stderr
    assert open(tmp_path / "latest").read().strip() == "global_step2"
