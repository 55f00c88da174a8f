"""Warning before the spike: tools/precursors.py's lead times on a metrics file whose answer is known, and the
guard's precursor rung (spike_guard.precursor_rung) on and off."""

import json
import math
import os
import re
import sys
import types

import pytest

import arguments

# synthetic_corpus is a fixture
from helpers import (  # noqa: F401
    ROOT,
    log_fields,
    run_main,
    spike_guard_of,
    synthetic_corpus,
    tool_cli,
)
from stability import spike_guard

sys.path.insert(0, os.path.join(ROOT, "tools"))
import precursors  # noqa: E402


def telemetry(logit, entropy=2.0, log_z=6.0, ratio=0.01, grad_rms=1e-4, final=1.0):
    """A telemetry record (two layers) with the given precursor values."""
    return {
        "attention logit max": [logit / 2, logit],
        "attention entropy min": [entropy, 3.0],
        "log z": log_z,
        "update/param rms": [ratio, ratio / 2],
        "grad rms": [grad_rms, 2 * grad_rms],
        "final layernorm input rms": final,
    }


def write_run(directory, losses, records, every=5):
    """metrics.jsonl of a run: a loss and grad norm every iteration, telemetry every `every` (records(i))."""
    os.makedirs(directory)
    with open(os.path.join(directory, "metrics.jsonl"), "w") as f:
        for i, loss in enumerate(losses, 1):
            row = {"iteration": i, "lm loss": loss, "grad norm": 0.5 + 0.01 * (i * 7 % 5)}
            if i % every == 0:
                row["telemetry"] = records(i)
            f.write(json.dumps(row) + "\n")
    return str(directory)


def noisy(i):
    # a slow fall with a scatter: the detector's trend is defined
    return 3.0 - 0.002 * i + 0.01 * (i * 7 % 5)


def test_lead_times_thresholds_and_false_positives_on_runs_whose_answer_is_known(tmp_path):
    # clean: attention logits up to 40 -> threshold 80 (margin 2); entropy down to 1.0 -> 0.5
    clean = write_run(
        tmp_path / "clean" / "x" / "lr1-seed1",
        [noisy(i) for i in range(1, 81)],
        lambda i: telemetry(40.0 * i / 80, entropy=1.0 + 1.0 / i),
    )
    # diverged: the attention logit passes 80 at iteration 35 (telemetry every 5), the loss jumps at 50 and a
    # NaN at 60; entropy never gets under 0.5; log z goes up at 55, after the spike
    losses = [noisy(i) if i < 50 else 9.0 + i for i in range(1, 61)]
    losses[-1] = math.nan
    diverged = write_run(
        tmp_path / "div" / "x" / "lr1-seed1",
        losses,
        lambda i: telemetry(10.0 if i < 35 else 1e3, entropy=1.2, log_z=6.0 if i < 55 else 30.0),
    )
    # held out: one clean run with a logit of 90 at iteration 20 (one false positive, one record)
    held = write_run(
        tmp_path / "held" / "x" / "lr1-seed2",
        [noisy(i) for i in range(1, 41)],
        lambda i: telemetry(90.0 if i == 20 else 5.0),
    )
    steps, _ = precursors.read_run(diverged)
    assert precursors.onset(steps) == 50
    # a NaN with no spike before it is the onset too
    assert (
        precursors.onset([(i, noisy(i), 0.5) for i in range(1, 30)] + [(30, math.nan, math.nan)])
        == 30
    )
    assert precursors.onset([(i, noisy(i), 0.5) for i in range(1, 30)]) is None
    result = precursors.measure({"x/lr1-seed1": diverged}, {"c": clean}, {"h": held})
    rows = {r["precursor"]: r for r in result["rows"]}
    assert result["onsets"] == {"x/lr1-seed1": 50}
    assert rows["attention_logit_max"]["threshold"] == pytest.approx(80.0)
    assert rows["attention_logit_max"]["leads"] == {"x/lr1-seed1": 15}  # crossed at 35, onset 50
    assert (rows["attention_logit_max"]["fp_runs"], rows["attention_logit_max"]["fp_records"]) == (
        1,
        1,
    )
    assert rows["attention_entropy_min"]["threshold"] == pytest.approx((1.0 + 1.0 / 80) / 2)
    assert rows["attention_entropy_min"]["leads"] == {"x/lr1-seed1": None}  # never crossed
    assert rows["log_z"]["threshold"] == pytest.approx(6.0 + math.log(2))  # a logarithm: Z doubled
    assert rows["log_z"]["leads"] == {"x/lr1-seed1": -5}  # after the spike: no warning
    table = precursors.markdown(result)
    assert "| attention_logit_max | > 80 | +15 (@35) | 15.0 | 15 | 1 (1) |" in table
    assert "| attention_entropy_min | < 0.506 | never | 0.0 | 0 | 0 (0) |" in table
    assert "| log_z | > 6.69 | -5 (@55) | 0.0 | 0 | 0 (0) |" in table


def cfg_with(**overrides):
    return types.SimpleNamespace(
        **{
            **vars(arguments.Config()),
            "spike_guard_precursor": "attention_logit_max",
            "spike_guard_precursor_threshold": 100.0,
            **overrides,
        }
    )


def test_the_rung_cuts_the_lr_once_per_crossing_and_a_resumed_guard_remembers():
    cfg = cfg_with()
    guard = spike_guard_of(cfg)
    rung = [
        spike_guard.precursor_rung(guard, cfg, cfg.adam_eps, i, telemetry(logit))
        for i, logit in ((10, 50.0), (20, 150.0), (30, 300.0), (40, 80.0), (50, 120.0))
    ]
    assert [d and d["action"] for d in rung] == [
        None,
        "precursor",
        None,
        "precursor rearmed",
        "precursor",
    ]
    assert rung[1]["line"] == (
        "spike guard: iteration 20: attention_logit_max 150 is over its threshold 100: "
        "warning before a spike: LR x0.5 from the next iteration on"
    )
    assert guard.lr_scale == 0.25
    # a checkpoint keeps the cuts and the rung's state (above the threshold: no second cut on resume)
    resumed = spike_guard_of(cfg, saved=guard.state_dict())
    assert spike_guard.precursor_rung(resumed, cfg, cfg.adam_eps, 60, telemetry(500.0)) is None
    assert resumed.lr_scale == 0.25
    # a low-side precursor warns under its threshold; a NaN warns whatever the side
    low = cfg_with(spike_guard_precursor="grad_rms_over_eps", spike_guard_precursor_threshold=100.0)
    guard = spike_guard_of(low)
    # 1000 x eps
    assert (
        spike_guard.precursor_rung(guard, low, low.adam_eps, 10, telemetry(1.0, grad_rms=1e-5))
        is None
    )
    rung = spike_guard.precursor_rung(guard, low, low.adam_eps, 20, telemetry(1.0, grad_rms=1e-7))
    assert rung["action"] == "precursor"
    guard = spike_guard_of(cfg)
    assert (
        spike_guard.precursor_rung(guard, cfg, cfg.adam_eps, 10, telemetry(math.nan))["action"]
        == "precursor"
    )
    # off (the default): nothing, whatever the telemetry
    off = cfg_with(spike_guard_precursor=None)
    assert spike_guard.precursor_rung(guard, off, off.adam_eps, 10, telemetry(1e9)) is None


def test_rung_config_is_checked():
    def error(*argv):
        with pytest.raises(ValueError) as e:
            arguments.prepare(arguments.load_config(list(argv)))
        return str(e.value)

    assert "is not one of attention_logit_max" in error(
        "--spike_guard_precursor=loss",
        "--telemetry_interval=5",
        "--spike_guard_precursor_threshold=1",
    )
    assert "needs spike_guard_precursor_threshold" in error(
        "--spike_guard_precursor=log_z", "--telemetry_interval=5"
    )
    assert "set telemetry_interval" in error(
        "--spike_guard_precursor=log_z", "--spike_guard_precursor_threshold=12"
    )
    rung = [
        "--spike_guard_precursor=log_z",
        "--telemetry_interval=5",
        "--spike_guard_precursor_threshold=12",
    ]
    assert "must be in (0, 1]" in error(*rung, "--spike_guard_precursor_lr_factor=0")
    assert "does nothing without spike_guard_precursor" in error(
        "--spike_guard_precursor_lr_factor=0.3"
    )


def guard_lines(out):
    return [line for line in out.splitlines() if line.startswith("spike guard:")]


def test_the_rung_fires_before_an_induced_divergence_and_not_on_a_clean_run(
    synthetic_corpus, tmp_path
):
    """The 512-token synthetic corpus, 2 layers of 64, 12 iterations, telemetry every 2: at LR 3e-1 the attention
    logits pass 100 by iteration 6, and the LR is halved from then on; at 2e-3 (clean) they stay under 3, and the
    run is the run without the rung."""
    base = [
        "--num_layers=2",
        "--hidden_size=64",
        "--num_attention_heads=4",
        "--seq_length=64",
        "--vocab_size=512",
        "--micro_batch_size=8",
        "--global_batch_size=8",
        "--train_iters=12",
        "--lr_warmup_samples=40",
        "--lr_decay_samples=1600",
        "--hidden_dropout=0",
        "--attention_dropout=0",
        "--log_interval=1",
        "--eval_interval=1000",
        "--eval_iters=0",
        "--sample_tokens=0",
        "--save_interval=none",
        "--split=90,10,0",
        f"--data_path={synthetic_corpus}",
        "--telemetry_interval=2",
    ]
    rung = ["--spike_guard_precursor=attention_logit_max", "--spike_guard_precursor_threshold=100"]
    clean = run_main(*base, "--lr=2e-3", f"--save={tmp_path / 'clean'}", *rung)
    assert guard_lines(clean) == []
    without = run_main(*base, "--lr=2e-3", "--save=none")
    assert [f["lm loss"] for f in log_fields(clean).values()] == [
        f["lm loss"] for f in log_fields(without).values()
    ]
    high = run_main(*base, "--lr=0.3", f"--save={tmp_path / 'high'}", *rung)
    unguarded = run_main(*base, "--lr=0.3", "--save=none")
    (line,) = guard_lines(high)
    fired = int(line.split()[3].rstrip(":"))
    assert (
        fired <= 8
        and "attention_logit_max" in line
        and "LR x0.5 from the next iteration on" in line
    )

    def lrs(out):
        return {i: float(fields["learning rate"]) for i, fields in log_fields(out).items()}

    assert all(lrs(high)[i] == lrs(unguarded)[i] for i in range(1, fired + 1))
    # the log line prints 4 digits
    assert all(
        lrs(high)[i] == pytest.approx(0.5 * lrs(unguarded)[i], rel=2e-3)
        for i in range(fired + 1, 13)
    )
    records = [json.loads(x) for x in open(tmp_path / "high" / "metrics.jsonl")]
    (decision,) = [d for r in records for d in r.get("spike guard", [])]
    assert (
        decision["action"] == "precursor"
        and decision["iteration"] == fired
        and decision["lr_scale"] == 0.5
    )


def _one_error_line(proc, said):
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert "Traceback" not in proc.stderr and said in proc.stderr, proc.stderr


def test_out_is_checked_before_the_measurement_written_whole_and_over_its_own_tables_only(
    tmp_path, monkeypatch
):
    run = write_run(
        tmp_path / "run" / "x" / "lr1-seed1", [noisy(i) for i in range(1, 21)], telemetry
    )
    runs = ["--diverged", run, "--calibrate", run]
    notes = tmp_path / "notes.md"
    notes.write_text("a user's notes\n")

    def measure(*args):
        raise AssertionError("measured before --out was checked")

    monkeypatch.setattr(precursors, "measure", measure)
    for out, said in [
        (notes, "exists and is not a table of this tool's"),
        (notes / "x.md", "notes.md is a file, not a directory"),
        (tmp_path, "is a directory"),
    ]:
        with pytest.raises(ValueError, match=said):
            precursors.main([*runs, "--out", str(out)])
    assert notes.read_text() == "a user's notes\n"
    monkeypatch.undo()
    out = tmp_path / "table.md"
    precursors.main([*runs, "--out", str(out)])
    first = out.read_text()
    assert first.startswith(precursors.HEADER) and first.endswith(" |\n")
    precursors.main([*runs, "--out", str(out)])  # its own table: written over
    assert out.read_text() == first and sorted(os.listdir(tmp_path)) == [
        "notes.md",
        "run",
        "table.md",
    ]
    _one_error_line(
        tool_cli("precursors.py", *runs, "--out", str(notes)), "not a table of this tool's"
    )
    assert notes.read_text() == "a user's notes\n"


def test_calibration_runs_without_telemetry_are_one_error_line(tmp_path):
    run = write_run(
        tmp_path / "run" / "x" / "lr1-seed1", [noisy(i) for i in range(1, 21)], telemetry
    )
    bare = write_run(
        tmp_path / "bare" / "x" / "lr1-seed1",
        [noisy(i) for i in range(1, 21)],
        telemetry,
        every=100,
    )
    _one_error_line(
        tool_cli("precursors.py", "--diverged", run, "--calibrate", bare),
        "hold no telemetry records",
    )
    # a record without a finite value of one precursor, in every calibration run
    nan = write_run(
        tmp_path / "nan" / "x" / "lr1-seed1",
        [noisy(i) for i in range(1, 21)],
        lambda i: telemetry(1.0, log_z=math.nan),
    )
    with pytest.raises(ValueError, match="holds no finite value of log_z"):
        precursors.measure({"r": run}, {"n": nan}, {})
    _one_error_line(
        tool_cli("precursors.py", "--diverged", run, "--calibrate", str(tmp_path)), "no metrics"
    )


def test_a_margin_or_eps_without_a_threshold_and_runs_given_twice_are_refused(tmp_path):
    """--margin 0 and --adam_eps 0 were a ZeroDivisionError, --margin -1 a "math domain error"; two
    runs whose last three path parts match were merged into one label; a run given to both
    --calibrate and --clean was counted as its own false positive."""
    losses = [noisy(i) for i in range(1, 21)]
    run = write_run(tmp_path / "run" / "x" / "lr1-seed1", losses, telemetry)
    twin = write_run(tmp_path / "other" / "run" / "x" / "lr1-seed1", losses, telemetry)
    other = write_run(tmp_path / "run" / "x" / "lr1-seed2", losses, telemetry)
    runs = ["--diverged", run, "--calibrate", run]
    for flags, said in [
        (["--margin=0"], "--margin 0.0 must be at least 1: the threshold is margin x the "),
        (["--margin=-1"], "--margin -1.0 must be at least 1"),
        (["--margin=0.5"], "--margin 0.5 must be at least 1"),
        (["--adam_eps=0"], "--adam_eps 0.0 must be above 0: the runs' adam_eps"),
        (
            ["--clean", other, run],
            f"{run} given to --calibrate and --clean: a held-out clean run must not make the "
            "thresholds it is checked against",
        ),
    ]:
        with pytest.raises(ValueError, match=re.escape(said)):
            precursors.main([*runs, *flags])
    with pytest.raises(
        ValueError,
        match="^"
        + re.escape(f"--diverged: {run} and {twin} have the same label run/x/lr1-seed1 (a run's"),
    ):
        precursors.main(["--diverged", run, twin, "--calibrate", other])
    assert precursors.main([*runs, "--margin=1", "--clean", other])["clean"] == 1
