"""lab/design_sixth.py on the fifth campaign's own records: its reading of them agrees with what the campaign's
report counts (lab/campaign/fifth/report.md: 2 of 100 clean runs with a decision, 34 harmful trials, 32 detected),
and with the decision lines themselves (the rule, cause and action each names); the narrowed candidate removes
trial 19's false positive and no harmful trial's detection."""

import design_sixth as ds


def test_the_fifth_campaign_read_as_its_report_reads_it_and_the_candidates_counted():
    rows = [
        ("fifth", name, run, kind, ds.decisions_of(run)) for name, run, kind in ds.trials("fifth")
    ]
    cleans = [r for r in rows if r[3] == "clean"]
    harmful = [r for r in rows if r[3] == "harmful"]
    assert len(cleans) == 100 and sum(bool(r[4]) for r in cleans) == 2
    assert (
        len(harmful) == 34
        and sum(any(d["iteration"] >= r[2]["start"] for d in r[4]) for r in harmful) == 32
    )
    nineteen = next(r[4] for r in cleans if r[1] == "19-clean")
    assert [(d["iteration"], d["rule"], d["cause"], d["action"]) for d in nineteen] == [
        (20, "grad norm only", "data", "skip")
    ]
    assert (
        nineteen[0]["signals"].startswith("loss 5.403 1.07x")
        and "grad norm 79.72 131x" in nineteen[0]["signals"]
    )
    twenty = next(r[4] for r in cleans if r[1] == "20-clean")
    assert [(d["iteration"], d["cause"], d["action"], d["lr"]) for d in twenty] == [
        (45, "optimizer", "rollback", 0.5)
    ]
    found, cuts = ds.count(rows)
    narrowed = found["1': the same, only where the diagnosis is data"]
    assert narrowed["removed"] == ["fifth 19-clean (random tokens, 4x128)"]
    assert narrowed["lost"] == narrowed["possible"] == narrowed["harmless"] == []
    # unnarrowed, it would not see two half-precision cancellations, each seen by its grad norm alone
    assert found["1: no action on a grad-norm-only outlier under clip_grad"]["harmless"] == [
        "fifth 66-guarded (numerical fp16, 2x64) all",
        "fifth 77-guarded (numerical bf16, 2x64) all",
    ]
    assert cuts["clean"] == ["fifth 20-clean (lost optimizer state, 2x64)"]
