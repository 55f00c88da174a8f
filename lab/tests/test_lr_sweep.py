"""lab/lr_sweep.py with its study (sweep_arms.py, sweep_report.py): the preflight refuses the old study's setup;
Wortsman et al.'s LR sensitivity, the blow-up criterion and OLMo 2's spike score on hand-made numbers; the pilot's
two runs end to end, shrunk (killed and resumed, table, PNG, finished runs skipped).
"""

import json
import math
import os
import subprocess
import sys

import pytest

import lr_sweep
import sweep_arms
import sweep_report
from helpers import ROOT

# The old study's setup (lab/stability.md before the lab had its corpus): 2 layers of 64 on GPT-2's vocabulary,
# 10 iterations of warm-up, weight decay 0.01 x LR, and the levers alone.
OLD_BASE = [
    "--num_layers=2",
    "--hidden_size=64",
    "--num_attention_heads=4",
    "--seq_length=64",
    "--micro_batch_size=2",
    "--global_batch_size=8",
    "--train_iters=none",
    "--train_tokens=61440",
    "--lr_warmup_samples=80",
    "--lr_decay_samples=960",
    "--lr_decay_style=cosine",
    "--hidden_dropout=0",
    "--attention_dropout=0",
    "--init_method_std=0.02",
    "--embed_layernorm=false",
    "--adam_beta2=0.999",
    "--weight_decay=0.01",
    "--clip_grad=1.0",
    "--log_interval=10",
    "--eval_interval=1000000",
    "--eval_iters=16",
    "--sample_tokens=0",
    "--save_interval=none",
    "--telemetry_interval=10",
]
OLD_LEVERS = {
    "default": [],
    "small_init": ["--init_method_std=small_init"],
    "embed_layernorm": ["--embed_layernorm"],
    "stable_attention": ["--stable_attention"],
    "qk_layernorm": ["--qk_layernorm"],
    "z_loss": ["--z_loss=1e-4"],
    "adam_beta2_0.95": ["--adam_beta2=0.95"],
    "bf16": ["--bf16"],
}
OLD_LRS = [3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0]


def test_preflight_refuses_the_old_study_and_passes_the_lab():
    problems = sweep_arms.preflight(
        {"old": {"args": [], "levers": OLD_LEVERS, "lrs": OLD_LRS}}, base=OLD_BASE
    )
    assert len(problems) == 6, problems
    embedding, warmup, decay, qk, z, tied = problems
    assert "97% of the parameters are the embedding (50257 x 64)" in embedding
    assert "a warm-up of 10 iterations" in warmup
    assert "weight decay 0.01 coupled to the LR" in decay and "varies 333x" in decay
    assert (
        "qk-layernorm compared without z-loss" in qk and "z-loss compared without qk-layernorm" in z
    )
    assert "z-loss compared on a tied output layer or one with weight decay" in tied
    assert sweep_arms.preflight(sweep_arms.ARMS) == []  # the lab's own study passes
    # each check alone: the lab's arm A with one thing of the old study's
    arm_a = sweep_arms.ARMS["A"]
    for extra, expected in (
        (["--lr_warmup_samples=800"], "a warm-up of 50 iterations"),
        (["--weight_decay_independent=false"], "coupled to the LR across LRs 0.001..1"),
        (
            ["--data_path=none", "--tokenizer_file=none", "--vocab_size=50257"],
            "89% of the parameters are the embedding (50257 x 128)",
        ),
    ):
        found = sweep_arms.preflight({"A": arm_a}, extra)
        assert len(found) == 1 and expected in found[0], (extra, found)
    alone = {**arm_a, "levers": {"default": [], "qk_layernorm": ["--qk_layernorm"]}}
    assert [
        "qk-layernorm compared without z-loss" in p for p in sweep_arms.preflight({"A": alone})
    ] == [True]
    arm_b = sweep_arms.ARMS["B"]
    z_alone = {**arm_b, "args": [a for a in arm_b["args"] if a != "--qk_layernorm"]}
    assert [
        "z-loss compared without qk-layernorm" in p for p in sweep_arms.preflight({"B": z_alone})
    ] == [True]
    # tied, or decayed (the default)
    for dropped in (
        "--untie_embeddings_and_output_weights",
        "--weight_decay=0",
    ):
        held = {**arm_b, "args": [a for a in arm_b["args"] if a != dropped]}
        assert [
            "z-loss compared on a tied output layer" in p for p in sweep_arms.preflight({"B": held})
        ] == [True]


def test_the_command_line_refuses_a_weak_study_before_any_run(tmp_path):
    with pytest.raises(
        SystemExit, match="cannot show what it tests:\n  - arm A .*a warm-up of 6.25 iterations"
    ):
        lr_sweep.main(["--out", str(tmp_path), "--arms", "A", "--extra=--lr_warmup_samples=100"])
    assert not os.path.exists(tmp_path / "runs")


def test_lr_sensitivity_blow_ups_and_spike_score_on_hand_made_numbers():
    l0 = 10.0
    # a NaN and a run above L0 both count as L0; the best loss is 4: (1 + 0 + 6 + 6) / 4
    assert (
        sweep_report.sensitivity({1e-3: 5.0, 1e-2: 4.0, 1e-1: float("nan"), 1.0: 12.0}, l0) == 3.25
    )
    # all diverged: flat at L0
    assert sweep_report.sensitivity({1e-3: float("inf"), 1e-2: 11.0}, l0) == 0.0
    bigram = 3.5
    # the 10-iteration loss means over 500 iterations: clearly below H2 (by 0.2) from iteration 40
    learned = [6.0, 4.0, 3.4] + [3.2] * 47
    assert not sweep_report.blew_up({"loss10": learned}, bigram, start=150)
    assert sweep_report.blew_up({"loss10": learned[:19] + [3.6]}, bigram, start=150)
    # before `start`
    assert not sweep_report.blew_up({"loss10": [6.0, 3.2, 3.8] + [3.2] * 17}, bigram, start=150)
    # never learned: not a blow-up
    assert not sweep_report.blew_up({"loss10": [6.0] * 20}, bigram, start=150)
    # hovering at H2: noise
    slow = [6.0] * 10 + [3.52, 3.45, 3.53, 3.47, 3.55, 3.44, 3.51, 3.42, 3.6, 3.4]
    assert not sweep_report.blew_up({"loss10": slow}, bigram, start=150)
    assert sweep_report.blew_up({"loss10": [6.0] * 20, "attention_logit_max": 2e4}, bigram)
    assert sweep_report.blew_up({"loss10": learned, "nan_iterations": 1}, bigram)
    # spike score: 7 sigma above the mean of the 100 values before; a NaN is a spike
    calm = [1.0 + 0.01 * (i % 2) for i in range(200)]
    assert sweep_report.spike_score(calm) == 0.0 and sweep_report.spike_score(calm[:100]) is None
    spiky = list(calm)
    spiky[150], spiky[160] = 1.2, float("nan")  # 1.2: 40 sigma above; 1 + 0.06 would be 12 sigma
    assert sweep_report.spike_score(spiky) == 2 / 100
    spiky[150] = 1.005 + 0.005 * 7.5  # 7.5 sigma (the window's mean is 1.005, its std 0.005)
    assert sweep_report.spike_score(spiky) == 2 / 100
    spiky[150] = 1.005 + 0.005 * 6.5
    assert sweep_report.spike_score(spiky) == 1 / 100
    # a diverged run: 100 NaNs, then finite values with no finite window before them (arm W's LR 1 ended so)
    lost = [1.0] * 100 + [float("nan")] * 100 + [5.0] * 50
    # the 100 NaNs; the first 5.0 is not scored, the next are calm
    assert sweep_report.spike_score(lost) == 100 / 149
    # summarize: two seeds of one lever set over two LRs
    runs = [
        (1e-2, 1, 3.2, learned),
        (1e-2, 2, 3.4, learned),
        (1.0, 1, 5.0, [6.0] * 50),
        (1.0, 2, 11.0, learned[:49] + [9]),
    ]  # up at iteration 500, after BLOWUP_FROM
    results = [
        {
            "arm": "A",
            "lever_set": "a",
            "lr": lr,
            "seed": seed,
            "val_loss": loss,
            "loss10": loss10,
            "attention_logit_max": 10.0 * seed,
        }
        for lr, seed, loss, loss10 in runs
    ]
    (row,) = sweep_report.summarize(results, "A", ["a"], [1e-2, 1.0], bigram)
    high = row["points"][1.0]
    assert (high["mean"], high["min"], high["max"], high["n"]) == (
        (5.0 + sweep_report.L0) / 2,
        5.0,
        sweep_report.L0,
        2,
    )
    assert (high["blew_up"], high["never_below"], high["diverged"]) == (1, 1, 1)
    assert row["points"][1e-2]["attention_logit_max"] == 15.0 and row["best_lr"] == 1e-2
    assert row["sensitivity"] == pytest.approx(((5.0 + sweep_report.L0) / 2 - 3.3) / 2)
    assert row["sensitivity_seeds"] == pytest.approx(((5.0 - 3.2) / 2, (sweep_report.L0 - 3.4) / 2))
    # a third seed run at LR 1 only: no run stands in for it at 1e-2, so it has no curve
    results.append({**results[2], "seed": 3, "val_loss": 4.0})
    (row,) = sweep_report.summarize(results, "A", ["a"], [1e-2, 1.0], bigram)
    assert row["points"][1.0]["n"] == 3 and row["points"][1e-2]["n"] == 2
    assert row["sensitivity_seeds"] == pytest.approx(((5.0 - 3.2) / 2, (sweep_report.L0 - 3.4) / 2))
    # an LR of the grid not run: no sensitivity (it would not compare with a whole curve's)
    (row,) = sweep_report.summarize(results, "A", ["a"], [1e-2, 1e-1, 1.0], bigram)
    assert (
        row["sensitivity"] is None
        and row["sensitivity_seeds"] is None
        and sorted(row["points"]) == [1e-2, 1.0]
    )
    # a selection of LR 1 alone (`--lrs 1`) is outside Wortsman et al.'s range: no sensitivity there, no error
    (row,) = sweep_report.summarize(results, "A", ["a"], [1.0], bigram)
    assert (
        row["ranges"]["1e-3..3e-1"] == {"lrs": [], "seeds": {}, "mean_curve": None}
        and row["sensitivity"] == 0
    )


@pytest.mark.slow
def test_lr_sweep_end_to_end_resumes_a_killed_run_writes_table_and_png_and_skips_finished_runs(
    tmp_path, capsys
):
    """The pilot's two runs, shrunk: first stopped at iteration 2 (as if killed), then resumed to the end; one of
    them against the same run uninterrupted; the tables, the figure; a third call finds everything done."""
    small = (
        "--train_iters=4 --lr_warmup_samples=16 --eval_iters=1 --telemetry_interval=2 --save_interval=2 "
        "--num_layers=2 --hidden_size=32 --seq_length=32 --micro_batch_size=8 --global_batch_size=8"
    )
    cmd = [
        sys.executable,
        "lab/lr_sweep.py",
        "--out",
        str(tmp_path / "lab"),
        "--arms",
        "A",
        "--lever_sets",
        "default",
        "--lrs",
        "1e-2,3e-1",
        "--seeds",
        "1",
        "--jobs",
        "2",
        "--allow_weak_study",
    ]
    killed = subprocess.run(
        [*cmd, f"--extra={small} --exit_interval=2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert killed.returncode == 1 and "stopped at iteration 2 of 4" in killed.stderr, killed.stderr[
        -3000:
    ]
    first = subprocess.run(
        [*cmd, f"--extra={small}"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    results = {r["lr"]: r for r in map(json.loads, open(tmp_path / "lab" / "results.jsonl"))}
    assert sorted(results) == [1e-2, 3e-1]
    for r in results.values():
        assert math.isfinite(r["val_loss"]) and r["nan_iterations"] == 0 and len(r["loss10"]) == 1
        assert r["series"]["iteration"] == [2, 4] and len(r["series"]["log_z"]) == 2
        assert r["attention_logit_max"] > 0 and 0 < r["attention_entropy_min"] < math.log(32)
        assert (
            r["grad_rms_over_eps"] > 1
            and r["final_ln_input_rms_max"] > 0
            and r["spike_score"] is None
        )
        run = sweep_arms.run_dir(str(tmp_path / "lab"), "A", "default", r["lr"], 1)
        # the checkpoints are gone
        assert not [n for n in os.listdir(run) if n.startswith("global_step")]
    # the resumed run equals the run made in one go
    whole = lr_sweep.execute(str(tmp_path / "whole"), "A", "default", 1e-2, 1, small.split())
    assert (
        whole["val_loss"] == results[1e-2]["val_loss"]
        and whole["loss10"] == results[1e-2]["loss10"]
    )
    table = open(tmp_path / "lab" / "results.md").read()
    assert (
        "WARNING: this study cannot show what it tests" in table
        and "a warm-up of 2 iterations" in table
    )
    assert (
        "pilot: arm A's default at LR 0.01 ends at" in table
        and "### Arm A" in table
        and "| default |" in table
    )
    png = (tmp_path / "lab" / "lr_sweep.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) < 200_000
    import matplotlib.image

    assert matplotlib.image.imread(str(tmp_path / "lab" / "lr_sweep.png")).ndim == 3
    result_file = os.path.join(
        sweep_arms.run_dir(str(tmp_path / "lab"), "A", "default", 1e-2, 1), "result.json"
    )
    stamp = os.path.getmtime(result_file)
    # the calls that start no run: main in this process (the command line's code, its exit a
    # SystemExit), without two more interpreters' start-up
    capsys.readouterr()
    lr_sweep.main([*cmd[2:], f"--extra={small}"])
    second = capsys.readouterr().out
    assert "2 finished already, 0 to run" in second, second
    assert os.path.getmtime(result_file) == stamp
    # --report: the tables of the finished runs of a wider selection, starting none
    lrs = cmd.index("--lrs") + 1
    lr_sweep.main([*cmd[2:lrs], "1e-2,3e-1,1", *cmd[lrs + 1 :], f"--extra={small}", "--report"])
    table = open(tmp_path / "lab" / "results.md").read()
    assert table.startswith("2 of the selection's 3 runs finished") and "| default |" in table
    assert not os.path.exists(sweep_arms.run_dir(str(tmp_path / "lab"), "A", "default", 1.0, 1))
    with pytest.raises(SystemExit, match="the pilot has not run"):
        lr_sweep.main(["--out", str(tmp_path / "empty"), "--arms", "A", "--report"])
