"""lab/lr_sweep.py's natural-instability arms (N, F; lab/natural.md): the remedies' table on hand-made numbers,
and the short warm-up allowed only where an arm says why."""

import json
import os

import lr_sweep


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
    assert lr_sweep.stable_range(row, best, 0.1) == (3e-2, 1e-1, 2)  # not 3e-3 + 3e-2 over the gap
    assert lr_sweep.stable_range(row, best, 0.6) == (3e-3, 3e-1, 5)
    assert lr_sweep.stable_range(row, best, 0.01) is None
    # the run at the grid's end counts as much as one before a gap
    assert lr_sweep.stable_range(_row("y", {1e-2: 3.5, 3e-2: 3.0, 1e-1: 3.0}), best, 0.1) == (
        3e-2,
        1e-1,
        2,
    )


def test_the_remedy_table_measures_each_remedy_against_the_arms_best_run():
    rows = [
        _row("none", {3e-3: 3.09, 1e-2: 3.30, 3e-2: 4.1}),
        _row("qk_layernorm", {3e-3: 3.05, 1e-2: 3.00, 3e-2: 3.08}),
    ]
    lines = lr_sweep.remedy_table(rows, margin=0.1)
    assert "the best run of the arm (3.000" in lines[1]
    assert "| none | +0.090 | 3e-03..3e-03 | 1 of 3 |" in lines
    assert "| qk_layernorm | +0.000 | 3e-03..3e-02 | 3 of 3 |" in lines


def test_a_short_warmup_passes_the_preflight_only_where_the_arm_says_why():
    assert lr_sweep.preflight({k: lr_sweep.ARMS[k] for k in ("N", "F")}) == []
    unexplained = {**lr_sweep.ARMS["N"]}
    del unexplained["short_warmup"]
    problems = lr_sweep.preflight({"N": unexplained})
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
    lines = lr_sweep.twin_table([none, guard, zclip], margin=0.05)
    assert "| guard | 6 | 4 | 1 | 1 | +0.200 (1e-02, 2) | -0.010 (1e-02, 3) |" in lines
    assert "| zclip | 1 | 0 | 1 | 0 | +0.030 (3e-03, 3) | - |" in lines
    listed = [line for line in lines if line.startswith("- ")]
    assert listed == ["- guard at 1e-02, seed 2: 3.800 against none's 3.600 (+0.200)"]
    # nothing past the margin: said, not left blank
    assert lr_sweep.twin_table([none, zclip], margin=0.05)[-1] == (
        "No run ended worse than its twin by more than 0.05 nats."
    )
    assert lr_sweep.twin_table([guard, zclip]) == []  # no none row: no twins


def test_natural_md_holds_the_tables_its_records_give(tmp_path):
    """A reader can check every number of lab/natural.md's tables from lab/results.jsonl: the page rebuilt from
    the records is the page as committed."""
    committed = open(os.path.join(lr_sweep.ROOT, "lab", "natural.md")).read()
    page = tmp_path / "natural.md"
    page.write_text(committed)
    for arms, width in [("N", 64), ("N", 128)]:  # each section of the page: its selection
        lr_sweep.main(
            [
                "--report",
                "--results",
                os.path.join(lr_sweep.ROOT, "lab", "results.jsonl"),
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
    metrics = lr_sweep.read_metrics(str(path))
    assert (metrics["skipped_iterations"], metrics["nan_iterations"]) == (3, 1)
    assert lr_sweep.summarize_run(metrics, 1e-8)["skipped_iterations"] == 3
    assert lr_sweep.total_or_none([3, 0, 5]) == 8 and lr_sweep.total_or_none([3, None, 5]) is None
