"""The natural-instability arms (N, F of lab/sweep_arms.py; lab/natural.md): the remedies' table on hand-made
numbers, and the short warm-up allowed only where an arm says why."""

import json
import os

import lr_sweep
import sweep_arms
import sweep_report


def _row(lever_set, means):
    points = {lr: {"mean": m, "n": 3} for lr, m in means.items()}
    best_lr = min(means, key=means.get)
    return {
        "lever_set": lever_set,
        "points": points,
        "best_loss": means[best_lr],
        "best_lr": best_lr,
    }


def test_the_stable_range_is_the_widest_run_of_neighbouring_lrs_within_the_margin():
    best = 3.0
    row = _row("x", {3e-3: 3.05, 1e-2: 3.5, 3e-2: 3.02, 1e-1: 3.09, 3e-1: 3.2})
    assert sweep_report.stable_range(row, best, 0.1) == (
        3e-2,
        1e-1,
        2,
    )  # not 3e-3 + 3e-2 over the gap
    assert sweep_report.stable_range(row, best, 0.6) == (3e-3, 3e-1, 5)
    assert sweep_report.stable_range(row, best, 0.01) is None
    # the run at the grid's end counts as much as one before a gap
    assert sweep_report.stable_range(_row("y", {1e-2: 3.5, 3e-2: 3.0, 1e-1: 3.0}), best, 0.1) == (
        3e-2,
        1e-1,
        2,
    )


def test_the_remedy_table_measures_each_remedy_against_the_arms_best_run():
    rows = [
        _row("none", {3e-3: 3.09, 1e-2: 3.30, 3e-2: 4.1}),
        _row("qk_layernorm", {3e-3: 3.05, 1e-2: 3.00, 3e-2: 3.08}),
    ]
    lines = sweep_report.remedy_table(rows, margin=0.1)
    assert "the best run of the arm (3.000" in lines[1]
    assert "| none | +0.090 | 3e-03..3e-03 | 1 of 3 |" in lines
    assert "| qk_layernorm | +0.000 | 3e-03..3e-02 | 3 of 3 |" in lines


def test_a_short_warmup_passes_the_preflight_only_where_the_arm_says_why():
    assert sweep_arms.preflight({k: sweep_arms.ARMS[k] for k in ("N", "F")}) == []
    unexplained = {**sweep_arms.ARMS["N"]}
    del unexplained["short_warmup"]
    problems = sweep_arms.preflight({"N": unexplained})
    assert problems and all("a warm-up of 10 iterations" in p for p in problems)


def _runs(lever_set, by_lr):
    """A row whose points hold each seed's final loss: {lr: {seed: loss}}."""
    points = {
        lr: {"seeds": list(losses), "values": list(losses.values())} for lr, losses in by_lr.items()
    }
    return {"lever_set": lever_set, "points": points}


def test_the_twin_table_compares_each_run_with_nones_at_the_same_lr_and_seed():
    none = _runs("none", {3e-3: {1: 3.0, 2: 3.1, 3: 3.2}, 1e-2: {1: 3.5, 2: 3.6, 3: 3.7}})
    # the guard never acted at 3e-3; at 1e-2 it made seed 2 worse by 0.2 and seed 3 better by 0.01
    guard = _runs("guard", {3e-3: {1: 3.0, 2: 3.1, 3: 3.2}, 1e-2: {1: 3.5, 2: 3.8, 3: 3.69}})
    # seed 3 ran at 3e-3 only in its own row (none has no seed 4); 3e-2 has no twin
    zclip = _runs("zclip", {3e-3: {3: 3.23, 4: 2.0}, 3e-2: {1: 9.0}})
    lines = sweep_report.twin_table([none, guard, zclip], margin=0.05)
    assert "| guard | 6 | 4 | 1 | 1 | +0.200 (1e-02, 2) | -0.010 (1e-02, 3) |" in lines
    assert "| zclip | 1 | 0 | 1 | 0 | +0.030 (3e-03, 3) | - |" in lines
    listed = [line for line in lines if line.startswith("- ")]
    assert listed == ["- guard at 1e-02, seed 2: 3.800 against none's 3.600 (+0.200)"]
    # nothing past the margin: said, not left blank
    assert sweep_report.twin_table([none, zclip], margin=0.05)[-1] == (
        "No run ended worse than its twin by more than 0.05 nats."
    )
    assert sweep_report.twin_table([guard, zclip]) == []  # no none row: no twins


def test_natural_md_holds_the_tables_its_records_give(tmp_path):
    """A reader can check every number of lab/natural.md's tables from lab/results.jsonl: the page rebuilt from
    the records is the page as committed."""
    committed = open(os.path.join(sweep_arms.ROOT, "lab", "natural.md")).read()
    page = tmp_path / "natural.md"
    page.write_text(committed)
    # each section of the page: its selection
    for arms, width in [("N", 64), ("N", 128), ("F", 64)]:
        lr_sweep.main(
            [
                "--report",
                "--results",
                os.path.join(sweep_arms.ROOT, "lab", "results.jsonl"),
                "--arms",
                arms,
                "--width",
                str(width),
                "--code",
                "56f212b",
                "--out",
                str(tmp_path / "report"),
                "--docs",
                str(page),
            ]
        )
    assert page.read_text() == committed


def test_a_runs_skipped_and_nan_iterations_are_summed_from_its_log_lines(tmp_path):
    """The log's counts are per line (per log interval): a run's are their sum; a cell's, its seeds' sum, unknown
    (`-`) where one record predates the count."""
    lines = [
        {
            "iteration": 1,
            "lm loss": 6.0,
            "number of skipped iterations": 0,
            "number of nan iterations": 0,
        },
        {
            "iteration": 2,
            "lm loss": 5.9,
            "number of skipped iterations": 2,
            "number of nan iterations": 1,
        },
        {
            "iteration": 3,
            "lm loss": 5.8,
            "number of skipped iterations": 1,
            "number of nan iterations": 0,
        },
        {
            "iteration": 3,
            "validation lm loss": 5.7,
        },  # the same iteration's second record adds to it
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    metrics = sweep_report.read_metrics(str(path))
    assert (metrics["skipped_iterations"], metrics["nan_iterations"]) == (3, 1)
    assert sweep_report.summarize_run(metrics, 1e-8)["skipped_iterations"] == 3
    assert (
        sweep_report.total_or_none([3, 0, 5]) == 8
        and sweep_report.total_or_none([3, None, 5]) is None
    )


# the last line of a run of arm F the spike guard stopped (the study's tree, width 64, LR 1e-1, seed 1), shortened
STOP_LINE = (
    "stability.spike_guard.SpikeGuardStop: spike guard: iteration 259: numerical: replayed: loss nan, grad norm "
    "nan, reproduced; in fp32: loss 5.01486, grad norm 0.501827, ordinary: a persistent numerical fault"
)


def _stopped_run(out):
    """A run directory of arm F as the spike guard left it: an intermediate validation loss at 250, the last
    iterations logged, the stop at the end of its log."""
    directory = sweep_arms.run_dir(out, "F", "guard", 1e-1, 1, 64)
    os.makedirs(os.path.join(directory, "global_step250"))
    with open(os.path.join(directory, "metrics.jsonl"), "w") as f:
        for it in range(1, 260):
            f.write(json.dumps({"iteration": it, "lm loss": 5.0, "grad norm": 0.5}) + "\n")
            if it == 250:
                f.write(json.dumps({"iteration": it, "validation lm loss": 4.9}) + "\n")
    with open(os.path.join(directory, "code.json"), "w") as f:
        json.dump({"code": "56f212b"}, f)
    with open(os.path.join(directory, "stdout.log"), "w") as f:
        f.write("Traceback (most recent call last):\n  ...\n" + STOP_LINE + "\n")
    return directory


def test_a_run_the_guard_stopped_is_finished_and_scores_as_a_diverged_run(tmp_path, monkeypatch):
    """A stop is the method's outcome, not a crash to retry: the run is not trained again, it has no final loss
    (not the intermediate one), it counts as L0 with its own tag, and its record keeps the iteration. Reading a
    stopped run writes nothing in its directory; the attempt that stops writes result.json."""

    def no_training(*a, **k):
        raise AssertionError("a stopped run was trained again")

    monkeypatch.setattr(lr_sweep, "run", no_training)
    out = str(tmp_path)
    directory = _stopped_run(out)
    result = lr_sweep.execute(out, "F", "guard", 1e-1, 1, width=64)
    assert result["val_loss"] is None and result["stopped_at"] == 259
    assert result["code"] == "56f212b" and "persistent numerical fault" in result["stop_message"]
    assert sorted(os.listdir(directory)) == [
        "code.json",
        "global_step250",
        "metrics.jsonl",
        "stdout.log",
    ]
    corpus = {"tokens": 1, "unigram_entropy": 5.2, "bigram_entropy": 3.5}
    record = sweep_report.record(result, corpus)
    assert record["stopped_at"] == 259 and record["val_loss"] is None
    finished = {**record, "lever_set": "none", "val_loss": 4.8}
    del finished["stopped_at"]
    rows = sweep_report.summarize([record, finished], "F", ["none", "guard"], [1e-1], 3.5)
    point = rows[1]["points"][1e-1]
    assert point["values"] == [sweep_report.L0] and point["stopped"] == 1 and point["diverged"] == 1
    table = sweep_report.markdown(
        {"F": rows}, {"F": [1e-1]}, {**corpus, "l0": sweep_report.L0}, [], width=64
    )
    assert "`stop k`: the spike guard stopped k" in table and "div 1 stop 1" in table

    # the attempt that stops: result.json written (the checkpoints gone), read back with no final loss
    fresh = str(tmp_path / "fresh")
    directory = _stopped_run(fresh)
    os.remove(os.path.join(directory, "stdout.log"))

    def stopping(command, log, env):
        log.write("Traceback (most recent call last):\n" + STOP_LINE + "\n")
        log.flush()
        return 1, 12.5

    monkeypatch.setattr(lr_sweep, "run", stopping)
    stopped = lr_sweep.execute(fresh, "F", "guard", 1e-1, 1, width=64)
    assert stopped["stopped_at"] == 259 and stopped["cpu_seconds"] == 12.5
    assert os.path.exists(os.path.join(directory, "result.json"))
    assert not os.path.exists(os.path.join(directory, "global_step250"))
    monkeypatch.setattr(lr_sweep, "run", no_training)
    # result.json read, summaries recomputed
    again = lr_sweep.execute(fresh, "F", "guard", 1e-1, 1, width=64)
    assert again["val_loss"] is None and again["stopped_at"] == 259
    assert again["stop_message"] == stopped["stop_message"]


def test_a_stopped_run_an_older_runner_resumed_is_the_stopped_run(tmp_path, monkeypatch):
    """The study's runner (a146575's) knows no stop: at its next restart it resumes a stopped run from the state
    the stop saved and, where the guard does not stop it again, finishes it and writes result.json. The run is
    still the one the guard stopped (the registration: a stopped run is finished): no final loss, the first stop's
    iteration, its summaries up to the stop; where the resume ended is kept apart."""

    def no_training(*a, **k):
        raise AssertionError("a stopped run was trained again")

    monkeypatch.setattr(lr_sweep, "run", no_training)
    out = str(tmp_path)
    directory = sweep_arms.run_dir(out, "F", "guard", 1e-1, 2, 64)
    os.makedirs(directory)
    with open(os.path.join(directory, "metrics.jsonl"), "w") as f:
        for it in range(1, 1001):
            f.write(
                json.dumps({"iteration": it, "lm loss": 7.0 if it <= 21 else 5.0, "grad norm": 0.5})
                + "\n"
            )
        f.write(json.dumps({"iteration": 1000, "validation lm loss": 4.85}) + "\n")
    with open(os.path.join(directory, "code.json"), "w") as f:
        json.dump({"code": "56f212b"}, f)
    stop = STOP_LINE.replace("259", "21")
    with open(os.path.join(directory, "stdout.log"), "w") as f:
        f.write(f"Traceback (most recent call last):\n{stop}\nresuming from global_step21\n")
    args = sweep_arms.train_args("F", "guard", 1e-1, 2, directory, (), 64)
    with open(os.path.join(directory, "result.json"), "w") as f:  # as a146575's runner writes it
        json.dump(
            {
                "arm": "F",
                "lever_set": "guard",
                "lr": 1e-1,
                "seed": 2,
                "args": args,
                "val_loss": 4.85,
            },
            f,
        )
    result = lr_sweep.execute(out, "F", "guard", 1e-1, 2, width=64)
    assert result["val_loss"] is None and result["stopped_at"] == 21
    assert result["resumed_val_loss"] == 4.85 and result["train_loss_max"] == 7.0
    assert len(result["loss10"]) == 3  # iterations 1-21: three means of up to 10
    corpus = {"tokens": 1, "unigram_entropy": 5.2, "bigram_entropy": 3.5}
    record = sweep_report.record(result, corpus)
    assert (record["stopped_at"], record["val_loss"], record["resumed_val_loss"]) == (
        21,
        None,
        4.85,
    )
    # a later stop in the resumed part does not move the run's end
    with open(os.path.join(directory, "stdout.log"), "a") as f:
        f.write(STOP_LINE + "\n")
    assert lr_sweep.guard_stop(directory)["iteration"] == 21


def test_a_run_without_a_stop_in_its_log_is_not_stopped(tmp_path):
    directory = _stopped_run(str(tmp_path))
    with open(os.path.join(directory, "stdout.log"), "w") as f:
        f.write(
            "spike guard: iteration 256: numerical: replayed: loss nan; the fp32 step applied\n"
        )
    assert lr_sweep.guard_stop(directory) is None
    assert lr_sweep.guard_stop(str(tmp_path / "nothing")) is None


# the guard as it is now on arm F (lab/natural.md, "The guard as it is now"): design runs of this code version
GUARD_NOW = "1dbe4df+dirty"


def guard_now_rows(records):
    """lab/natural.md's table of the guard as it is now, run by run: each of its arm F runs (width 64) beside
    none's and the study's guard's at the same LR and seed (code 56f212b)."""

    def cell(r):
        if r.get("stopped_at") is not None:
            return f"stopped at {r['stopped_at']}"
        return (
            "NaN"
            if r["val_loss"] is None or r["val_loss"] != r["val_loss"]
            else f"{r['val_loss']:.3f}"
        )

    def of(code, lever_set):
        return {
            (r["lr"], r["seed"]): r
            for r in records
            if (r["code"], r["arm"], r["width"], r["lever_set"]) == (code, "F", 64, lever_set)
        }

    none, study, now = of("56f212b", "none"), of("56f212b", "guard"), of(GUARD_NOW, "guard")
    rows = []
    for key in sorted(now):
        r = now[key]
        gap = r["val_loss"] - none[key]["val_loss"]
        rows.append(
            f"| {key[0]:g} | {key[1]} | {cell(none[key])} | {cell(study[key])} | {cell(r)} | "
            + ("-" if gap != gap else f"{gap:+.3f}")
            + f" | {r['train_loss']:.3f} | {r['skipped_iterations']} |"
        )
    return rows


def test_natural_md_holds_the_guard_now_runs_as_recorded():
    """Every row of the guard-as-it-is-now table in lab/natural.md is its records' (lab/results.jsonl): the 12
    arm F runs of that code version, each beside its twins of the study."""
    path = os.path.join(sweep_arms.ROOT, "lab", "results.jsonl")
    records = [json.loads(line) for line in open(path)]
    rows = guard_now_rows(records)
    assert len(rows) == 12
    page = open(os.path.join(sweep_arms.ROOT, "lab", "natural.md")).read()
    missing = [row for row in rows if row not in page]
    assert not missing, missing
