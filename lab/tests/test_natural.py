"""lab/lr_sweep.py's natural-instability arms (N, F; lab/natural.md): the remedies' table on hand-made numbers,
and the short warm-up allowed only where an arm says why."""

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
