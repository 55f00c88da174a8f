"""The guard campaign's report math on synthetic records, against counts and intervals worked out by hand here: the
Wilson interval (textbook values), false positives with the run as the unit beside per 1,000 iterations, detection
per fault class, right diagnoses where a method diagnoses, damage against the clean twin, the methods table; the
registration (written before any run, checked after, never mixed in a report); and one tiny trial run end to end
under --method zclip."""

import json
import math
import os
import re

import pytest

import arguments
import campaign_draw as cd
import campaign_report as cr
import guard_campaign as gc
import guard_metrics as gm
from helpers import corpus, corpus512  # noqa: F401 (fixtures)
from sections import section
from stability import detector, spike_guard


def test_wilson_matches_the_textbook_interval():
    z = 1.96
    lo, hi = cr.wilson(0, 35)  # k = 0: the upper bound is z^2 / (n + z^2)
    assert lo == 0 and hi == pytest.approx(z * z / (35 + z * z), rel=1e-12)
    lo, hi = cr.wilson(5, 6)  # Wilson (1927) for 5 of 6 at 95%: 0.4365-0.9699
    assert (round(lo, 4), round(hi, 4)) == (0.4365, 0.9699)
    assert all(math.isnan(x) for x in cr.wilson(0, 0))  # no interval over no trial


def record(
    name,
    valid,
    decisions=(),
    family="lr transient",
    start=20,
    trial=None,
    method=None,
    exit=0,
    iters=100,
):
    trial = int(name.split("-")[0]) if trial is None else trial
    return name, {
        "name": name,
        "valid": valid,
        "decisions": list(decisions),
        "family": family,
        "start": start,
        "trial": trial,
        "method": method,
        "exit": exit,
        "iters": iters,
        "rollbacks": 0,
        "what": family,
    }


def synthetic():
    """Four trials: 0-2 harmful (the unguarded run 4% over its clean twin, or dead), 3 harmless. The guard acts on
    0 and 1 (a right and a wrong cause), misses 2; ZClip acts on 0 and 2 (only after the fault on 2: an action
    before it is not a detection), ends 0 within 1% (+0.8%); its clean runs: one of two acts, 3 times."""
    act = "spike guard: iteration {}: loss 9 is 2x its trend; {}"
    zact = "remedy zclip: iteration {}: clipped: grad norm 9 to 1"
    return dict(
        [
            record("0-clean", 5.0),
            record("0-unguarded", 5.2),
            record("1-clean", 5.0, family="random tokens"),
            record("1-unguarded", 6.0, family="random tokens"),
            record("2-clean", 5.0, family="lr persistent"),
            record("2-unguarded", math.inf, family="lr persistent", exit=1),
            record("3-clean", 5.0),
            record("3-unguarded", 5.01),
            record("0-guarded", 5.02, [act.format(21, "optimizer-driven: ...")]),
            record(
                "1-guarded", 5.3, [act.format(20, "optimizer-driven: ...")], family="random tokens"
            ),
            record("2-guarded", 5.5, [], family="lr persistent"),
            record("3-guarded", 5.0),
            record("0-zclip", 5.04, [zact.format(22)], method="zclip"),
            record(
                "2-zclip",
                5.9,
                [zact.format(10), zact.format(30)],
                family="lr persistent",
                method="zclip",
            ),
            record(
                "0-clean-zclip",
                5.0,
                [zact.format(5), zact.format(50), zact.format(70)],
                method="zclip",
            ),
            record("1-clean-zclip", 5.0, [], family="random tokens", method="zclip"),
        ]
    )


def test_method_results_count_by_hand():
    results = cr.method_results(synthetic())
    guard, zclip, none = results["guard"], results["zclip"], results["none"]
    assert (guard["n"], guard["detected"], guard["diagnosed"], guard["right"]) == (3, 2, 2, 1)
    assert guard["within"] == 1 and guard["ratios"] == pytest.approx([5.02 / 5, 5.3 / 5, 5.5 / 5])
    # false positives: the guard's clean runs are the 4 clean twins, none acted
    assert (guard["clean_runs"], guard["fp_runs"], guard["clean_iters"]) == (4, 0, 400)
    # ZClip ran 2 of the 3 harmful faults; it says no cause (no diagnosis counted)
    # 5.04: +0.8%
    assert (zclip["n"], zclip["detected"], zclip["diagnosed"], zclip["within"]) == (2, 2, 0, 1)
    # detected, of, within
    assert zclip["classes"] == {"lr transient": [1, 1, 1], "lr persistent": [1, 1, 0]}
    # the run is the unit: 1 of 2 clean runs acted, with 3 actions in 200 iterations
    assert (zclip["clean_runs"], zclip["fp_runs"], zclip["fp_actions"], zclip["clean_iters"]) == (
        2,
        1,
        3,
        200,
    )
    assert none["n"] == 3 and none["detected"] == 0 and none["clean_runs"] == 0
    assert none["ratios"] == [5.2 / 5, 6.0 / 5, math.inf]


def test_the_methods_table_shows_each_rate_with_its_wilson_interval():
    table = cr.method_table(synthetic())
    damage = table[table.index("ending within 1% of the clean twin, per fault class") :]
    lo, hi = cr.wilson(0, 1)  # the guard's lr persistent run ended 10% over; ZClip's 18%
    assert (
        f"| lr persistent | 0/1 = 0% ({lo:.0%}-{hi:.0%}) | 0/1 = 0% ({lo:.0%}-{hi:.0%}) |" in damage
    )
    lo, hi = cr.wilson(1, 1)  # both lr transient runs within 1% (+0.4%, +0.8%)
    assert (
        f"| lr transient | 1/1 = 100% ({lo:.0%}-{hi:.0%}) | 1/1 = 100% ({lo:.0%}-{hi:.0%}) |"
        in damage
    )
    rows = {
        line.split(" | ")[0].strip("| "): line
        for line in table[: table.index("ending within")].splitlines()
        if line.startswith("| ")
    }  # the methods' rows and the detection per class
    lo, hi = cr.wilson(2, 3)
    assert f"| 2/3 = 67% ({lo:.0%}-{hi:.0%}) |" in rows["guard"]  # detected
    lo, hi = cr.wilson(1, 2)
    assert f"| 1/2 = 50% ({lo:.0%}-{hi:.0%}) |" in rows["zclip"]  # clean runs with an action
    lo, hi = cr.wilson(3, 200)
    # per 1,000 clean iterations
    assert f"| 15.00 ({1000 * lo:.2f}-{1000 * hi:.2f}) |" in rows["zclip"]
    lo, hi = cr.wilson(1, 2)
    # no diagnosis; damage; the
    assert rows["zclip"].endswith(f"| - | 1/2 = 50% ({lo:.0%}-{hi:.0%}) | 1.180 |")
    # upper median of 1.008 and 1.18
    lo, hi = cr.wilson(1, 1)
    assert (
        rows["lr persistent"]
        == f"| lr persistent | 0/1 = 0% (0%-79%) | 1/1 = 100% ({lo:.0%}-{hi:.0%}) |"
    )
    assert rows["random tokens"].endswith("| 1/1 = 100% (21%-100%) | - |")  # zclip never ran it


def test_the_damage_removed_per_family_is_each_familys_own_mean_share():
    """A harm-first draw's mean share mixes its families: one family's stops (each scored ln 512) outweigh the
    rest. The per-family table holds each family's own mean, over its trials harmful by their loss, by hand."""
    runs = {
        n: {**r, "series": []} for n, r in synthetic().items()
    }  # the costs read each run's log lines
    table = cr.family_table(runs)
    rows = {
        line.split(" | ")[0].strip("| "): line
        for line in table.splitlines()
        if line.startswith("| ")
    }
    assert rows["family"] == "| family | guard | zclip |"
    # trial 0: damage 0.2; the guard's 5.02 removes 0.18 of it, ZClip's 5.04 0.16
    assert rows["lr transient"] == "| lr transient | 0.90, n=1 | 0.80, n=1 |"
    # trial 2: the unremedied run died (scored ln 512); the guard's 5.5 and ZClip's 5.9 finished
    cap = gm.LOSS_CAP
    assert rows["lr persistent"] == (
        f"| lr persistent | {(cap - 5.5) / (cap - 5.0):.2f}, n=1 | {(cap - 5.9) / (cap - 5.0):.2f}, n=1 |"
    )
    assert rows["random tokens"] == "| random tokens | 0.70, n=1 | - |"  # ZClip never ran it
    # trial 3 (harmless) has no share; a table of doing nothing alone is empty
    assert (
        cr.family_table(
            {n: r for n, r in synthetic().items() if "zclip" not in n and "guarded" not in n}
        )
        == ""
    )


@pytest.mark.parametrize(
    "name, baselines",
    [
        ("fourth", None),
        ("fifth", None),
        ("sixth", None),
        ("seventh", None),
        ("eighth-disk", "seventh"),
        ("eighth", "seventh"),
        ("withdrawn-61-third", None),
        ("disk-reading-design", None),
        ("ninth", None),
    ],
)
def test_each_committed_report_is_what_its_committed_records_give(
    tmp_path, monkeypatch, name, baselines
):
    """A reader can check every number of a campaign's report.md from its runs.jsonl: this checkout's report of
    the committed records begins with the committed report, digit for digit (later checkouts add sections after
    it: the primary metric, the trials worse than doing nothing)."""
    committed = os.path.join(gc.ROOT, "lab", "campaign", name)
    os.symlink(os.path.join(committed, "runs.jsonl"), tmp_path / "runs.jsonl")
    registered = os.path.join(committed, "registration.json")
    # a registration that froze its metrics (the seventh's on) has its runs scored only as registered
    registration = json.load(open(registered)) if os.path.exists(registered) else None
    # the baselines as the report's command names them, from the repository's root
    monkeypatch.chdir(gc.ROOT)
    theirs = os.path.join("lab", "campaign", baselines) if baselines else None
    # campaign.png is no part of report.md, and drawing hundreds of trials' markers was about half
    # of each report's time here; the figure is drawn in the tiny trial's test and the replica
    # check's (cr.report whole)
    monkeypatch.setattr(cr, "figure", lambda rows, path: None)
    rebuilt = cr.report(str(tmp_path), registration=registration, baselines=theirs)
    assert rebuilt.startswith(open(os.path.join(committed, "report.md")).read())


def test_the_report_counts_the_replica_checks_own_repair_as_a_hardware_detection(tmp_path):
    """Main records the DP replica check's repair as the guard's action (guard_campaign.actions_of); the report's
    trial table read every action as a `spike guard: iteration N` line and crashed on it (a TypeError at the end of
    a re-run of eighth-disk's 64 trials). Trial 11 of eighth-disk, with the line main's re-run recorded."""
    line = (
        "DP replica check: iteration 50: DP rank 1 (global rank 1) in its weights and optimizer state differs from "
        "DP rank 0: no majority tells which is right: DP rank 0's copy taken (no snapshot of equal replicas to roll "
        "back to)"
    )
    records = []
    for text in open(os.path.join(gc.ROOT, "lab", "campaign", "eighth-disk", "runs.jsonl")):
        r = json.loads(text)
        if r["name"] == "11-guarded":
            assert r["decisions"] == []  # the registered tree did not record it
            r["decisions"] = [line]
        records.append(json.dumps(r))
    (tmp_path / "runs.jsonl").write_text("\n".join(records) + "\n")
    table = cr.report(str(tmp_path))
    (row,) = [
        x
        for x in table.splitlines()
        if x.startswith("| dp state bit flip at 41: bit 23 of exp_avg ")
    ]
    assert "| hardware |" in row, row


def test_megatron_rerun_diagnosis_is_right_when_transient_means_hardware():
    reproducible = (
        "remedy spiky_loss: iteration 5: loss 99 >= 10 x ...: reproducible (Megatron: ...)"
    )
    transient = "remedy spiky_loss: iteration 5: loss 99 >= 10 x ...: not reproducible (3.2): possible transient"
    assert cr.right_diagnosis("spiky_loss", reproducible, "random tokens")
    assert not cr.right_diagnosis("spiky_loss", transient, "random tokens")
    assert cr.right_diagnosis("spiky_loss", transient, "dp grad bit flip")
    assert (
        cr.right_diagnosis("zclip", "remedy zclip: iteration 5: clipped", "random tokens") is None
    )


def args(out, **more):
    return gc.main.__globals__["argparse"].Namespace(
        **{
            "out": str(out),
            "harm": cd.HARM,
            "seed": 5,
            "first": 0,
            "trials": 1,
            "iters": 40,
            "model": "2x64",
            "clean_runs": 1,
            "grad_norm_bound": 1.0,
            "preregister": os.path.join(out, "registration.json"),
            "draw": "seventh",
            "windows": "published",
            "window_scale": None,
            "snapshots": "on",
            "requeue": False,
            **more,
        }
    )


def test_a_registration_comes_before_the_runs_and_is_never_mixed(tmp_path, monkeypatch):
    a = args(tmp_path)
    monkeypatch.setattr(gc, "uncommitted", lambda: " M train.py")  # anywhere, not only stability/
    with pytest.raises(SystemExit, match="commit the tree first"):
        gc.preregister(a)
    monkeypatch.setattr(gc, "uncommitted", lambda: "")
    registration = gc.preregister(a)
    saved = json.load(open(a.preregister))
    assert (
        saved["stability_sha256"] == gc.stability_sha256()
        and saved["seed"] == 5
        and saved["harm_threshold"] == 0.01
    )
    assert gc.preregister(a) == saved  # the same campaign: accepted
    with pytest.raises(SystemExit, match="differs from its registration in seed"):
        gc.preregister(args(tmp_path, seed=6))
    open(tmp_path / "runs.jsonl", "w").close()
    with pytest.raises(SystemExit, match="has runs already"):
        gc.preregister(args(tmp_path, preregister=str(tmp_path / "later.json")))
    only = tmp_path / "only"
    gc.main(
        [
            "--out",
            str(only),
            "--preregister",
            str(only / "reg.json"),
            "--register_only",
            "--seed",
            "41",
        ]
    )
    assert json.load(open(only / "reg.json"))["seed"] == 41 and not os.path.exists(
        only / "runs.jsonl"
    )
    runs = dict([record("0-clean", 5.0), record("0-unguarded", 5.2)])
    runs["0-clean"]["registration"] = cr.registration_id(registration)
    runs["0-unguarded"]["registration"] = None  # a run of no registration beside one of it
    with pytest.raises(SystemExit, match="from 2 registrations"):
        cr.one_registration(runs)
    runs["0-unguarded"]["registration"] = "0123456789abcdef"
    with pytest.raises(SystemExit, match="from 2 registrations"):
        cr.one_registration(runs)
    runs["0-unguarded"]["registration"] = cr.registration_id(registration)
    cr.one_registration(runs, registration)


@pytest.mark.slow
def test_one_tiny_trial_under_zclip_keeps_every_run_losses_and_registration(
    tmp_path, corpus512, monkeypatch
):
    monkeypatch.setattr(gc, "uncommitted", lambda: "")  # a tree being edited: registered as clean
    out = tmp_path / "campaign"
    reg = tmp_path / "registration.json"
    gc.main(
        [
            "--out",
            str(out),
            "--data_path",
            corpus512,
            "--trials",
            "1",
            "--iters",
            "40",
            "--seed",
            "5",
            "--method",
            "zclip",
            "--clean_runs",
            "1",
            "--preregister",
            str(reg),
        ]
    )
    runs = cr.runs_of(str(out))
    assert {"0-clean", "0-unguarded", "0-clean-zclip"} <= set(runs)
    ident = cr.registration_id(json.load(open(reg)))
    for r in runs.values():
        assert r["registration"] == ident and r["exit"] == 0
        # every iteration's loss and grad norm
        assert [row[0] for row in r["series"]] == list(range(1, 41))
    assert runs["0-clean-zclip"]["method"] == "zclip"
    zclip_lines = [
        x
        for x in open(out / "logs" / "0-clean-zclip.log").read().splitlines()
        if x.startswith("remedy zclip:")
    ]
    assert runs["0-clean-zclip"]["decisions"] == zclip_lines
    assert os.path.exists(out / "report.md")


def test_the_records_keep_every_logged_iteration_and_the_grad_norm_skips_are_finite_ones():
    line = (
        " iteration {:8d}/      40 | consumed samples: 8 | lm loss: {} | loss scale: 1.0 | grad norm: {} | "
        "num zeros: 0.0 | number of skipped iterations: {:3d} | number of nan iterations:   0 |"
    )
    text = "\n".join(
        [
            line.format(1, "6.1E+00", "0.900", 0),
            line.format(2, "6.0E+00", "1.500", 1),
            line.format(3, "nan", "nan", 1),
            line.format(4, "5.9E+00", "0.800", 0),
        ]
    )
    series = [[int(i), float(x), float(g), int(s)] for i, x, g, s in gc.LOG.findall(text)]
    assert [row[0] for row in series] == [1, 2, 3, 4] and series[1] == [2, 6.0, 1.5, 1]
    assert gc.actions_of(text, "grad_norm_skip", series) == [
        "grad_norm_skip: iteration 2: skipped, grad norm 1.5"
    ]
    assert gc.actions_of(text + "\nremedy zclip: iteration 4: clipped", "zclip", series) == [
        "remedy zclip: iteration 4: clipped"
    ]


def test_mixed_runs_every_fourth_trial_on_the_wider_model():
    a = args("unused", model="mixed")
    assert [gc.model_of(a, k) for k in range(8)] == ["2x64"] * 3 + ["4x128"] + ["2x64"] * 3 + [
        "4x128"
    ]
    assert {gc.model_of(args("unused", model=m), 0) for m in ("2x64", "4x128")} == {"2x64", "4x128"}


# -- the fault space: its draws, their flags, and one trial of each new launch (2 processes; a resume) -----------


def first_of_each_family(seed, iters=100):
    """{family: the first k whose trial draws it} under seed."""
    found = {}
    for k in range(500):
        found.setdefault(cd.draw(seed, k, iters)["family"], k)
    return found


def test_every_family_is_drawn_and_a_draw_depends_on_seed_and_k_alone():
    found = first_of_each_family(41)
    # all in a campaign of 100 trials
    assert set(found) == set(cd.FAMILIES) and max(found.values()) < 100
    alone = cd.draw(41, 57, 100)
    for k in range(60):  # other draws before it change nothing
        cd.draw(41, k, 100)
    assert cd.draw(41, 57, 100) == alone
    assert [cd.draw(42, k, 100) for k in range(10)] != [cd.draw(41, k, 100) for k in range(10)]
    # the training seed too: trial k's clean twin must be another run under another campaign seed (with 1234 + k,
    # the sixth's first 28 clean twins repeated 16 of the fifth's bit for bit)
    seeds = {
        campaign: [cd.draw(campaign, k, 100)["seed"] for k in range(100)] for campaign in (51, 62)
    }
    assert len(set(seeds[51]) | set(seeds[62])) == 200
    # likewise
    longs = {
        campaign: [cd.long_clean_seed(campaign, j) for j in range(10)] for campaign in (51, 62)
    }
    assert len(set(longs[51]) | set(longs[62]) | set(seeds[51]) | set(seeds[62])) == 220
    assert {cd.FAMILIES[f] for f in cd.FAMILIES} <= set(cr.CAUSES)


def test_each_drawn_flag_set_passes_the_runs_own_parser_and_checks():
    import arguments

    for family, k in first_of_each_family(41).items():
        trial = cd.draw(41, k, 100)
        for model in ("2x64", "4x128"):
            base = gc.base_args(trial, model, 100)
            for method in cr.METHODS:
                parts = gc.processes(
                    base, trial["flags"], gc.method_flags(method, args("unused")), trial, "/tmp/ck"
                )
                for argv in parts:
                    cfg = arguments.load_config([*argv, "--data_path=unused"])
                    arguments.validate(cfg, world_size=trial["nproc"], reads_data=False)
                    assert cfg.global_batch_size == cfg.micro_batch_size * trial["nproc"]
                # the fault: in the last process only
                assert all(flag in parts[-1] for flag in trial["flags"])
                assert not any(flag in p for flag in trial["flags"] for p in parts[:-1])
        if trial["resume"] is not None:
            first, resumed = parts
            assert (
                f"--exit_interval={trial['resume']}" in first
                and trial["start"] == trial["resume"] + 1
            )
            assert first[0] == resumed[0] and "--exit_interval" not in " ".join(resumed)
        if family.startswith("dp "):
            assert trial["nproc"] == 2 and "--inject_bitflip_rank=1" in trial["flags"]
            assert int(trial["flags"][1].split("=")[1]) in cd.BITS


def test_the_replica_checks_decisions_are_scored_as_hardware():
    line = (
        "spike guard: iteration 20: the DP replicas differ and no majority tells the healthy one: roll back to "
        "the newest snapshot at or before iteration 15 (the last check that agreed); no data skipped, LR unchanged"
    )
    assert gc.is_decision(line) and cr.cause_of(line) == "hardware"
    assert not gc.is_decision(
        "spike guard: iteration 21: injected a lost optimizer state on rank 0: 9 moment elements"
    )


def test_the_replica_checks_own_repairs_are_the_guards_actions():
    """With snapshots off (or a majority), the DP replica check repairs alone, with a line of its own: eighth-disk's
    records missed eight such repairs of harmful bit flips. Its host lines and its hand-over to the guard's
    rollback (which the guard's own line records) are not actions."""
    log = "\n".join(
        [
            "spike guard: iteration 247: injected a bit flip into weight element 22485 on rank 1: -3.499e+36",
            "DP replica check: iteration 248: DP rank 1 is global rank 1 on host vm",
            "DP replica check: iteration 248: DP rank 1 (global rank 1) in its weights differs from DP rank 0: no "
            "majority tells which is right: DP rank 0's copy taken (no snapshot of equal replicas to roll back to)",
            "DP replica check: iteration 300: DP rank 2 (global rank 2) in its weights differs from the 3 of 4 "
            "replicas that agree: re-synced from DP rank 0",
            "DP replica check: iteration 350: DP rank 1 (global rank 1) in its weights differs from DP rank 0: no "
            "majority tells which is right",
        ]
    )
    acts = gc.actions_of(log, "guard", [])
    assert [a.split(":")[1] for a in acts] == [" iteration 248", " iteration 300"]
    assert {cr.cause_of(a) for a in acts} == {"hardware"}
    record = {"decisions": acts}
    assert cr.acts_from(record, 248) == acts and cr.acts_from(record, 249) == acts[1:]


def trial_of(family, seed=7, iters=40):
    return next(k for k in range(500) if cd.draw_seventh(seed, k, iters)["family"] == family)


def same_until(a, b, last):
    """The two runs' losses at iterations 1..last (the first pass: a rollback's replays left out)."""
    first = lambda r: {i: loss for i, loss, _, _ in reversed(r["series"])}  # noqa: E731 (the first pass wins)
    return all(first(a)[i] == first(b)[i] for i in range(1, last + 1))


@pytest.mark.slow
def test_one_trial_on_two_processes_and_one_resumed_keep_both_twins_identical_until_the_fault(
    tmp_path, corpus512
):
    """One 2-process trial (DP rank 1's device bad from the fault on) and one resumed trial (LR
    x10-100 from the resume), each as its clean twin and unguarded run: before the fault the two are
    the same run (their losses equal), after it they are not; on 2 processes the clean twin's
    replicas end identical, and the bad device corrupts every step from its onset -- rank 1's grad
    norm differs from rank 0's, so the core's agreement skips every update from then on (its
    replicas stay equal; the harm is in the loss); the resumed runs' records join both processes'
    iterations, and no checkpoint is left behind."""
    for family in ("dp bad device", "lr after resume"):
        k, out = trial_of(family), tmp_path / family.replace(" ", "-")
        gc.main(
            [
                "--out",
                str(out),
                "--data_path",
                corpus512,
                "--trials",
                "1",
                "--first",
                str(k),
                "--iters",
                "40",
                "--seed",
                "7",
                "--method",
                "none",
                "--jobs",
                "2",
            ]
        )
        runs = cr.runs_of(str(out))
        clean, bad = runs[f"{k}-clean"], runs[f"{k}-unguarded"]
        trial = cd.draw_seventh(7, k, 40)
        for r in (clean, bad):
            assert (
                r["exit"] == 0
                and r["nproc"] == trial["nproc"]
                and [x[0] for x in r["series"]] == list(range(1, 41))
            )
            assert r["processes"] == (1 if trial["resume"] is None else 2)
        assert same_until(clean, bad, trial["start"]) and not same_until(clean, bad, 40)
        log = open(out / "logs" / f"{k}-unguarded.log").read()
        assert ("on rank 1" in log) == (trial["nproc"] == 2)  # the flip on DP rank 1
        if trial["nproc"] == 2:  # every step from the onset on corrupted, every update skipped
            after = 40 - trial["start"] + 1
            assert log.count("(a bad device)") == after
            assert clean["replica_gap"] == bad["replica_gap"] == 0.0
            assert log.count("the DP replicas computed different loss / grad norm") == after
            assert cd.is_harmful(clean, bad)
        else:
            assert clean["replica_gap"] is None and bad["replica_gap"] is None
        assert ("loaded checkpoint" in log) == (trial["resume"] is not None)
        assert not os.path.exists(out / "checkpoints") or not os.listdir(out / "checkpoints")


def test_replicas_apart_at_the_end_are_harm_that_rank_0s_validation_loss_does_not_show():
    _, clean = record("0-clean", 5.0)
    _, drifted = record("0-unguarded", 5.0)
    clean["replica_gap"], drifted["replica_gap"] = 0.0, 0.07
    assert cd.is_harmful(clean, drifted)
    drifted["replica_gap"] = 0.0
    assert not cd.is_harmful(clean, drifted)
    runs = dict(
        [
            ("0-clean", clean),
            ("0-unguarded", {**drifted, "replica_gap": 0.07}),
            ("0-zclip", {**drifted, "name": "0-zclip", "method": "zclip", "replica_gap": 0.07}),
        ]
    )
    zclip = cr.method_results(runs)["zclip"]
    # the same loss, but its replicas apart: not within
    assert (zclip["n"], zclip["within"]) == (1, 0)


@pytest.mark.parametrize("name", ["ninth", "eighth-10M", "eighth"])
def test_a_campaigns_committed_records_are_its_registrations_alone(name):
    """A campaign that runs across machines has its records committed as they stand (docs/spike_guard.md,
    "Running the ninth, across machines"; eighth-10M's runs of 1,000 iterations on the 10M model, and the eighth's
    960, span sessions):
    each record is its registration's, run on the registered tree (clean) and torch, each run once -- a resume
    from another checkout, or a run recorded twice, would be refused here before the report mixes it in."""
    folder = os.path.join(gc.ROOT, "lab", "campaign", name)
    registration = json.load(open(os.path.join(folder, "registration.json")))
    names = []
    for line in open(os.path.join(folder, "runs.jsonl")):
        r = json.loads(line)
        assert r["registration"] == cr.registration_id(registration), r["name"]
        assert (r["tree"], r["dirty"], r["torch"], r.get("machine")) == (
            registration["tree"],
            False,
            registration["torch"],
            registration.get("machine"),  # registrations since 2 December name it
        ), r["name"]
        names.append(r["name"])
    assert names and len(names) == len(set(names))


@pytest.mark.parametrize(
    "name, heading, baselines",
    [
        ("ninth", "### The ninth campaign, reported whole", None),
        ("eighth", "#### The eighth, reported whole", "seventh"),
    ],
)
def test_the_docs_primary_table_is_the_reports(name, heading, baselines):
    """docs/spike_guard.md's table of a campaign reported whole (the primary metric beside the baselines) quotes
    report.md's cells, which the committed-report test rebuilds from the records; its medians and its final losses
    within 1% of the clean twin, which that table does not hold, are the records' own (the eighth's remedies are
    the seventh's runs of the same trials, as its report sets them beside its guard). A digit changed in the docs
    turns this red."""
    docs = open(os.path.join(gc.ROOT, "docs", "spike_guard.md")).read()
    section = docs[docs.index(heading) :]
    section = section[: section.index("\n#")]
    folder = os.path.join(gc.ROOT, "lab", "campaign", name)
    report = open(os.path.join(folder, "report.md")).read()

    def cells(line):
        return [c.strip() for c in line.strip().strip("|").split("|")]

    def table(head):
        text = report[report.index(head) :]
        text = text[text.index("| method | damage removed") :]
        return text[: text.index("\n\n")]

    runs = cr.runs_of(folder)
    if baselines:
        primary = table("Beside the remedies of")
        theirs = cr.runs_of(os.path.join(gc.ROOT, "lab", "campaign", baselines))
        _, runs = cr.with_baselines(runs, theirs)  # the runs the report's table scores
    else:
        primary = table("The primary metric and the costs")
    rows = {cells(x)[0].split(" ")[0]: cells(x) for x in primary.splitlines() if x.startswith("| ")}
    shares = {m: sorted(r["shares"]) for m, r in cr.primary_results(runs).items()}
    within = {m: cr.rate(r["within"], r["n"]) for m, r in cr.method_results(runs).items()}
    quoted = [cells(x) for x in section.splitlines() if x.startswith("| `")]
    assert {q[0].split("`")[1] for q in quoted} == {m for m in cr.METHODS if m != "none"}
    for q in quoted:
        method = q[0].split("`")[1]
        s = shares[method]
        median = (s[(len(s) - 1) // 2] + s[len(s) // 2]) / 2
        assert q[1:] == [
            rows[method][1],  # the mean share, its interval and n
            f"{median:.2f}",
            rows[method][2],  # worse than doing nothing
            rows[method][3],  # replicas equal
            rows[method][4],  # detected within the window, net of the clean-run base rate
            within[method],  # final loss within 1% of the clean twin
        ], method


def test_the_ninths_bad_devices_requeued_are_what_the_docs_say():
    """The ninth's 12 bad-device trials run again with --requeue (design runs, lab/campaign/ninth-requeue-design):
    each stop requeued without the device, each run on its clean twin's final loss (the ninth's record), the same
    code's unremedied twin on the ninth's; the docs' hypothetical mean share is the records'."""
    folder = os.path.join(gc.ROOT, "lab", "campaign")
    ninth, design = (
        cr.runs_of(os.path.join(folder, "ninth")),
        cr.runs_of(os.path.join(folder, "ninth-requeue-design")),
    )
    devices = sorted(
        r["trial"]
        for r in ninth.values()
        if r["name"].endswith("-guarded") and r["family"] == "dp bad device"
    )
    assert len(devices) == 12 and all(ninth[f"{k}-guarded"]["exit"] != 0 for k in devices)
    for k in devices:
        run = design[f"{k}-guarded"]
        assert run["requeued"]["cause"] == "hardware" and run["requeued"]["dp_rank"] == 1, k
        assert (run["exit"], run["valid"]) == (0, ninth[f"{k}-clean"]["valid"]), k
    assert design["1-unguarded"]["valid"] == ninth["1-unguarded"]["valid"]
    # the registered metric, with the requeued runs in place of the stopped ones
    requeued = {n: r for n, r in design.items() if n.endswith("-guarded")}
    shares = cr.primary_results({**ninth, **requeued})["guard"]["shares"]
    mean, lo, hi = gm.bootstrap_mean(shares)
    docs = open(os.path.join(gc.ROOT, "docs", "spike_guard.md")).read()
    assert (
        f"over the 109 trials would be {mean:.2f} ({lo:.2f} to {hi:.2f})" in docs
        and len(shares) == 109
    )


def docs_text(path="docs/spike_guard.md"):
    """A document of the repository (docs/spike_guard.md unless named) with its line breaks and indents as single
    spaces: a quoted sentence found wherever the text wraps it."""
    return " ".join(open(os.path.join(gc.ROOT, path)).read().split())


def test_at_10m_the_guarded_clean_twin_is_not_doing_nothing_as_the_docs_say():
    """eighth-10M's trial 1: its clean twin (guarded) acted on the 10M model's own early spike, and the same run
    with no method (design run, lab/campaign/eighth-10M-design, from the registered tree) ended higher; the docs'
    numbers are the records'. The design run is the trial's own until its fault starts, so it is that trial's
    clean run and no other."""
    folder = os.path.join(gc.ROOT, "lab", "campaign")
    registration = json.load(open(os.path.join(folder, "eighth-10M", "registration.json")))
    runs = cr.runs_of(os.path.join(folder, "eighth-10M"))
    none = cr.runs_of(os.path.join(folder, "eighth-10M-design"))["1-clean-none"]
    assert (none["commit"], none["tree"], none["dirty"]) == (
        registration["commit"],
        registration["tree"],
        False,
    )
    assert (none["method"], none["decisions"], none["exit"]) == ("none", [], 0)
    clean, bad = runs["1-clean"], runs["1-unguarded"]
    start = bad["start"]
    assert none["series"][: start - 1] == bad["series"][: start - 1] != clean["series"][: start - 1]
    spike = {it: loss for it, loss, *_ in none["series"] if 21 <= it <= 26}
    assert (round(spike[21], 2), round(spike[23], 2), round(spike[24], 2), round(spike[26], 2)) == (
        5.20,
        6.70,
        6.73,
        5.46,
    )
    first = clean["decisions"][0]
    assert first.startswith("spike guard: iteration 23: ") and "LR x0.5 from now on" in first
    docs = docs_text()
    higher = none["valid"] / clean["valid"] - 1
    over = bad["valid"] / clean["valid"] - 1
    assert (
        f"It ended at {clean['valid']:.4f}; the same run with no method at {none['valid']:.4f}, "
        f"{higher:.1%} higher" in docs
    )
    assert f"its unremedied run, {bad['valid']:.4f}, is {over:.1%} over the guarded twin" in docs
    # harmful by the registered rule, not against the run with no method
    assert over > cr.HARM and bad["valid"] < none["valid"]


def stale_verdicts(runs, suffix):
    """The names of a campaign's guard runs (ending in `suffix`) with a stale-trend verdict."""
    return {
        n
        for n, r in runs.items()
        if n.endswith(suffix)
        and r.get("method", "guard") == "guard"
        and any("the trend is stale" in d for d in r["decisions"])
    }


def test_the_stale_trend_verdict_asked_twice_is_what_the_docs_say():
    """be6b0e8 (a stale trend needs the newest snapshot's weights as far off too; not adopted) on every guarded run
    that had reached that verdict in three campaigns (design runs, lab/campaign/*-stale-design), beside the guard
    before it: each such run and no other, from clean trees; what changed and what did not is what the docs say,
    to the digit -- the ninth's two early LR faults repaired, the seventh's natural spike in trial 269 made worse
    than the same clean run with no method, eighth-disk (no snapshots) unchanged."""
    folder = os.path.join(gc.ROOT, "lab", "campaign")
    docs = docs_text()
    section = docs[docs.index("#### The stale-trend verdict, asked twice") :]
    section = section[: section.index(" ### ")]
    same = cr.same_run

    # the ninth: the change's runs beside the ninth's own (8f88a4e's guard, which 3be8e4a's repeats on them)
    ninth = cr.runs_of(os.path.join(folder, "ninth"))
    design = cr.runs_of(os.path.join(folder, "ninth-stale-design"))
    stale = stale_verdicts(ninth, "-guarded")
    assert set(design) == stale and len(stale) == 14
    assert all(r["commit"].startswith("be6b0e8") and not r["dirty"] for r in design.values())
    lr = {n for n, r in design.items() if r["family"] == "lr persistent"}
    assert lr == {"126-guarded", "158-guarded"}
    assert all(same(design[n], ninth[n]) for n in stale - lr)
    for k in (126, 158):
        run, old = design[f"{k}-guarded"], ninth[f"{k}-guarded"]
        clean, bad = ninth[f"{k}-clean"], ninth[f"{k}-unguarded"]
        assert "optimizer-driven" in run["decisions"][0] and not any(
            "the trend is stale" in d for d in run["decisions"]
        )
        over = [g["valid"] / clean["valid"] - 1 for g in (run, old, bad)]
        ended = rf"ended {over[0]:.2%} over( its clean twin)? \(was {over[1]:.2%}; unremedied {over[2]:.2%}\)"
        assert re.search(ended, section), k
        shares = [gm.damage_removed(clean, bad, g) for g in (run, old)]
        assert f"{shares[0]:.2f} (was {shares[1]:.2f})" in section, k
    # the next design's constraint: 158 used every rollback the default cap allows
    assert (
        design["158-guarded"]["rollbacks"] == 3 == spike_guard.GuardConfig.spike_guard_max_rollbacks
    )
    assert "trial 158 used all three that `spike_guard_max_rollbacks` allows" in section
    runs = {**ninth, **design}
    guard = cr.method_results(runs)["guard"]
    mean, lo, hi = gm.bootstrap_mean(cr.primary_results(runs)["guard"]["shares"])
    lo_within, hi_within = cr.wilson(guard["within"], guard["n"])
    assert (
        f"{guard['within']} of the 123 harmful trials within 1% of the clean twin "
        f"({guard['within'] / guard['n']:.0%}, {100 * lo_within:.0f}-{hi_within:.0%}; registered: 109, 82-93%)"
        in section
    )
    assert f"diagnose {guard['right']} of {guard['diagnosed']} first decisions right" in section
    assert f"over the 109 would be {mean:.2f} ({lo:.2f} to {hi:.2f})" in section

    # the seventh and eighth-disk: each run under the change and under 3be8e4a (named -before)
    seventh = cr.runs_of(os.path.join(folder, "seventh"))
    design = cr.runs_of(os.path.join(folder, "seventh-stale-design"))
    guarded = stale_verdicts(seventh, "-guarded")
    cleans = {f"{n[: -len('-clean')]}-clean-guard" for n in stale_verdicts(seventh, "-clean")}
    after = guarded | cleans | {n.replace("-guard", "-none") for n in cleans}
    assert len(guarded) == 4 and len(cleans) == 2
    assert set(design) == after | {f"{n}-before" for n in guarded | cleans}
    for n, r in design.items():
        assert not r["dirty"] and r["commit"].startswith(
            "3be8e4a" if n.endswith("-before") else "1317564"
        ), n
    mine = {
        n: seventh[n if n.endswith("-guarded") else n[: -len("-guard")]] for n in guarded | cleans
    }
    assert [n for n in sorted(mine) if not same(design[f"{n}-before"], mine[n])] == ["46-guarded"]
    changed = [n for n in sorted(guarded | cleans) if not same(design[n], design[f"{n}-before"])]
    assert changed == ["269-clean-guard", "269-guarded"]
    none, before, now = (
        design["269-clean-none"]["valid"],
        design["269-clean-guard-before"]["valid"],
        design["269-clean-guard"]["valid"],
    )
    assert now == design["269-guarded"]["valid"]
    assert (
        f"ended {before / none - 1:.2%} above the same run with no method ({before:.4f} against {none:.4f})"
        in section
    )
    assert f"ended {now / none - 1:.2%} above it ({now:.4f})" in section and now > none * (
        1 + cr.HARM
    )
    disk = cr.runs_of(os.path.join(folder, "eighth-disk"))
    design = cr.runs_of(os.path.join(folder, "eighth-disk-stale-design"))
    stale = stale_verdicts(disk, "-guarded")
    assert set(design) == stale | {f"{n}-before" for n in stale} and len(stale) == 4
    assert all(same(design[n], design[f"{n}-before"]) for n in stale)


def test_the_guards_clean_twins_are_shown_beside_the_runs_with_no_method():
    """The report's table of the guard's clean twins beside the detector's clean runs (no method), on records: the
    fifth's one clean twin the guard acted on (trial 19), and eighth-10M's trial 1 with its design run with no method
    standing in as the detector's clean run -- a fault harmful by the registered rule and not against doing
    nothing, which the table says; the numbers by hand from the records."""
    folder = os.path.join(gc.ROOT, "lab", "campaign")
    fifth = cr.runs_of(os.path.join(folder, "fifth"))
    table = cr.beside_no_method(fifth)
    rows = [x for x in table.splitlines() if x.startswith("| ") and not x.startswith("| trial")]
    twin, none, bad = fifth["19-clean"], fifth["19-clean-spiky_loss"], fifth["19-unguarded"]
    assert (
        "20 trials, the guard acted on 1 of its clean twins, 19 the same to every recorded digit"
        in table
    )
    assert rows == [
        f"| 19 | random tokens | 1 | {twin['valid']:.4f} | {none['valid']:.4f} | "
        f"{twin['valid'] / none['valid'] - 1:+.2%} | {bad['valid'] / twin['valid'] - 1:+.2%} / "
        f"{bad['valid'] / none['valid'] - 1:+.2%} |"
    ]
    runs = cr.runs_of(os.path.join(folder, "eighth-10M"))
    none = cr.runs_of(os.path.join(folder, "eighth-10M-design"))["1-clean-none"]
    runs["1-clean-spiky_loss"] = {**none, "name": "1-clean-spiky_loss", "method": "spiky_loss"}
    row = [x for x in cr.beside_no_method(runs).splitlines() if x.startswith("| 1 |")]
    twin, bad = runs["1-clean"], runs["1-unguarded"]
    assert row == [
        f"| 1 | repeated token | 2 | {twin['valid']:.4f} | {none['valid']:.4f} | "
        f"{twin['valid'] / none['valid'] - 1:+.2%} | {bad['valid'] / twin['valid'] - 1:+.2%} / "
        f"{bad['valid'] / none['valid'] - 1:+.2%} (harmful by the rule, not against doing nothing) |"
    ]
    assert cr.beside_no_method({n: r for n, r in fifth.items() if "spiky_loss" not in n}) == ""


def test_the_10m_clean_runs_grad_norms_are_what_the_docs_say():
    """The docs' reading of eighth-10M's trial 1 (an LR too high for the 10M model): the run with no method's grad
    norm past 10 at six iterations from 24 to 114, the guarded clean twin's at none after iteration 6."""
    folder = os.path.join(gc.ROOT, "lab", "campaign")
    none = cr.runs_of(os.path.join(folder, "eighth-10M-design"))["1-clean-none"]
    twin = cr.runs_of(os.path.join(folder, "eighth-10M"))["1-clean"]
    past = [it for it, _, norm, *_ in none["series"] if norm > 10 and it > 6]
    assert past == [24, 26, 32, 43, 48, 114]
    assert not [it for it, _, norm, *_ in twin["series"] if norm > 10 and it > 6]
    docs = docs_text()
    assert (
        "its grad norm past 10 at six iterations from 24 to 114, the guarded twin's at none after iteration 6"
        in docs
    )


def test_what_a_skip_can_reach_on_the_ninths_data_faults_is_what_the_docs_say():
    """Each of the ninth's data-fault trials run as its clean run with the fault skipped by hand (design runs,
    lab/campaign/ninth-oracle-skip-design, from the ninth's registered tree): the skipped iterations are the
    fault's, the tree repeats the ninth's clean run, and the docs' counts, shares and percentages are the
    records'."""
    folder = os.path.join(gc.ROOT, "lab", "campaign")
    registration = json.load(open(os.path.join(folder, "ninth", "registration.json")))
    ninth = cr.runs_of(os.path.join(folder, "ninth"))
    design = cr.runs_of(os.path.join(folder, "ninth-oracle-skip-design"))
    assert all(
        (r["commit"], r["tree"], r["dirty"], r["exit"], r["decisions"])
        == (registration["commit"], registration["tree"], False, 0, [])
        for r in design.values()
    )
    assert design.pop("24-clean-again")["valid"] == ninth["24-clean"]["valid"]
    data = ("random tokens", "repeated 8-gram", "repeated token", "ordered duplicate block")
    trials = sorted(
        r["trial"] for r in ninth.values() if r["name"].endswith("-guarded") and r["family"] in data
    )
    assert sorted(r["trial"] for r in design.values()) == trials and len(trials) == 61
    skipped, same, text = {}, {f: [] for f in data}, docs_text()
    fault = re.compile(r"at (\d+): (\d+) (?:batches|iterations repeating (\d+))")
    for k in trials:
        run, guarded = design[f"{k}-clean-oracle-skip"], ninth[f"{k}-guarded"]
        start, n, period = map(int, fault.search(run["what"]).groups(default="0"))
        # a duplicate block keeps its first period of batches: the corpus's own samples
        assert run["skipped"] == f"{start + period}-{start + n - 1}", k
        skipped[k] = run
        same[run["family"]].append(guarded["exit"] == 0 and guarded["valid"] == run["valid"])
    counts = [f"{sum(same[f])} of {len(same[f])}" for f in data[:3]]
    total = sum(sum(same[f]) for f in data[:3])
    assert f"On {total} of the {sum(len(same[f]) for f in data[:3])} random-token" in text
    assert f"to every recorded digit ({', '.join(counts[:2])}, {counts[2]})" in text
    assert not any(same["ordered duplicate block"])

    def pct(a, b):
        return 100 * (gm.final_loss(a) / gm.final_loss(b) - 1)

    assert ninth["24-guarded"]["valid"] == skipped[24]["valid"]
    assert (
        f"with its fault skipped ends {pct(skipped[24], ninth['24-clean']):.2f}% over its clean twin"
        in text
    )
    harmful = [k for k in trials if cd.is_harmful(ninth[f"{k}-clean"], ninth[f"{k}-unguarded"])]

    def shares(ks, run):
        return [gm.damage_removed(ninth[f"{k}-clean"], ninth[f"{k}-unguarded"], run(k)) for k in ks]

    best, guard = (
        gm.bootstrap_mean(shares(harmful, lambda k: skipped[k])),
        gm.bootstrap_mean(shares(harmful, lambda k: ninth[f"{k}-guarded"])),
    )
    token = [k for k in harmful if ninth[f"{k}-guarded"]["family"] == "repeated token"]
    token_best = gm.bootstrap_mean(shares(token, lambda k: skipped[k]))[0]
    assert (
        f"Over the {len(harmful)} harmful data trials a perfect skip removes a mean share of the damage of "
        f"{best[0]:.2f} ({best[1]:.2f} to {best[2]:.2f}; {token_best:.2f} on the repeated token), the guard "
        f"{guard[0]:.2f} ({guard[1]:.2f} to {guard[2]:.2f})" in text
    )
    readme = docs_text("README.md")
    assert (
        f"it ended where a perfect skip does, to every digit in {total} " in readme
        and f"mean {best[0]:.2f} of the damage ({best[1]:.2f} to {best[2]:.2f}) over the {len(harmful)} harmful data "
        f"trials and ends {pct(skipped[24], ninth['24-clean']):.1f}% over"
        in readme
    )
    run86 = ninth["86-guarded"]
    last = {it: was_skipped for it, _, _, was_skipped in run86["series"]}
    rolled = [
        tuple(map(int, m.groups()))
        for d in run86["decisions"]
        if (m := re.search(r"roll back to before iteration \d+ and skip iterations (\d+)-(\d+)", d))
    ]
    applied = [
        it
        for it in range(60, 214)
        if last.get(it) == 0 and not any(a <= it <= b for a, b in rolled)
    ]
    assert (
        f"ended {pct(run86, skipped[86]):.2f}% above its fault skipped ({pct(run86, ninth['86-clean']):.2f}% over "
        f"clean, the skip {pct(skipped[86], ninth['86-clean']):.2f}%): {len(applied)} of its 154 bad batches "
        f"(iterations {applied[0]}-{applied[-1]}) were applied" in text
    ) and applied == list(range(applied[0], applied[-1] + 1))
    block = [k for k in trials if ninth[f"{k}-guarded"]["family"] == "ordered duplicate block"]
    apart = [pct(ninth[f"{k}-guarded"], skipped[k]) for k in block]
    block_harmful = [k for k in block if k in harmful]
    assert (
        f"It ended {min(apart):+.2f}% to {max(apart):+.2f}% from the skipped run in its {len(block)} trials; on the "
        f"{len(block_harmful)} harmful ones it removed a mean share of "
        f"{gm.bootstrap_mean(shares(block_harmful, lambda k: ninth[f'{k}-guarded']))[0]:.2f}, a perfect skip "
        f"{gm.bootstrap_mean(shares(block_harmful, lambda k: skipped[k]))[0]:.2f}" in text
    )


def test_the_detector_calls_no_spike_on_the_recorded_clean_runs_the_guard_let_be():
    """The detector as it is now, fed each recorded clean run of the ninth and the seventh in which their guard did
    not act (every applied step, the campaigns' window), calls no spike: a rule added since (the joint rule's loss
    a whole bar below with the grad norm half the bar up) would have acted on none of them. Half the bar for both
    would have on three."""
    cfg = arguments.load_config(
        ["--spike_guard", "--spike_guard_window=32", "--spike_guard_min_steps=4"]
    )
    rules = section(detector.DetectorConfig, cfg)
    runs = 0
    for campaign in ("ninth", "seventh"):
        for name, run in cr.runs_of(os.path.join(gc.ROOT, "lab", "campaign", campaign)).items():
            if not name.endswith("-clean") or run["decisions"]:
                continue
            applied = [
                (i, loss, g)
                for i, loss, g, skipped in run["series"]
                if math.isfinite(g) and not skipped
            ]
            assert detector.spikes_in(applied, rules, cfg.clip_grad) == [], (campaign, name)
            runs += 1
    assert runs == 519


def test_the_joint_rules_whole_bar_below_on_the_ninth_is_what_the_docs_say():
    """Every one of the ninth's 202 trials, guarded, under 919c85d's guard (the joint rule's loss a whole bar below its
    trend with the grad norm half the bar up; design runs, lab/campaign/ninth-joint-design): trial 86 alone
    changed, onto its fault-skipped run; every other is the ninth's guarded run to every recorded digit; the docs'
    hypothetical count is the records'."""
    folder = os.path.join(gc.ROOT, "lab", "campaign")
    ninth, design = (
        cr.runs_of(os.path.join(folder, "ninth")),
        cr.runs_of(os.path.join(folder, "ninth-joint-design")),
    )
    skipped = cr.runs_of(os.path.join(folder, "ninth-oracle-skip-design"))
    assert all(r["commit"].startswith("919c85d") and not r["dirty"] for r in design.values())
    assert set(design) == {n for n in ninth if n.endswith("-guarded")} and len(design) == 202
    changed = sorted(r["trial"] for n, r in design.items() if not cr.same_run(r, ninth[n]))
    assert changed == [86]
    run, clean, bad = design["86-guarded"], ninth["86-clean"], ninth["86-unguarded"]
    assert run["valid"] == skipped["86-clean-oracle-skip"]["valid"]
    section = docs_text()
    share, was = (gm.damage_removed(clean, bad, g) for g in (run, ninth["86-guarded"]))
    assert (
        f"it changed trial {changed[0]} alone, which now ends on its fault-skipped run to every digit "
        f"({run['valid']:.4f}, {run['valid'] / clean['valid'] - 1:.2%} over clean: a share of the damage removed of "
        f"{share:.2f}, was {was:.2f})" in section
    )
    guard = cr.method_results({**ninth, **design})["guard"]
    lo, hi = cr.wilson(guard["within"], guard["n"])
    assert (
        f"would end {guard['within']} of its {guard['n']} harmful trials there ({guard['within'] / guard['n']:.0%}, "
        f"{100 * lo:.0f}-{hi:.0%}; registered: 109)" in section
    )
    assert (
        f"the other {len(design) - 1} are the ninth's guarded runs to every recorded digit"
        in section
    )
    assert (
        f"repeats {len(design) - 1} of the {len(design)} guarded runs to every recorded digit and ends the "
        f"{len(design)}nd, trial {changed[0]}, within 1%" in section
    )
    readme = docs_text("README.md")
    # 519: test_the_detector_calls_no_spike_on_the_recorded_clean_runs_the_guard_let_be
    assert (
        f"which changed no other of the ninth's {len(design)} guarded runs and calls no spike on the 519 recorded "
        "clean runs its guard let be" in readme
    )


def test_eighth_10ms_runs_from_another_machine_are_set_apart_as_the_docs_say():
    """eighth-10M's records came from two kinds of machine, one tree and one torch. On one machine a run whose
    method never acted is the run with no method to every recorded digit; every such run of the other kind
    differed from its first iterations. Those runs are set apart (other-machine.jsonl: kept, not scored, run again):
    each no-action run left in runs.jsonl equals its counterpart, each set apart differs; the docs' numbers are
    the records'. A record moved back, or one of the other kind committed as it stands, turns this red."""
    folder = os.path.join(gc.ROOT, "lab", "campaign", "eighth-10M")
    kept = cr.runs_of(folder)
    apart = {
        r["name"]: r for r in map(json.loads, open(os.path.join(folder, "other-machine.jsonl")))
    }
    # a run set apart and run again here is in both, the one in runs.jsonl made after that machine's stretch
    again = set(kept) & set(apart)
    assert apart and all(kept[n]["started"] > apart[n]["ended"] for n in again)

    def pairs(runs, refs):
        """(run, the same run with no method, from refs) where neither acted: a clean run beside the clean
        twin, a faulted run beside the unremedied one."""
        out = []
        for name, r in runs.items():
            if r.get("method") in (None, "guard", "none") or r["decisions"] or "trial" not in r:
                continue
            k = r["trial"]
            ref = refs.get(f"{k}-clean" if "-clean-" in name else f"{k}-unguarded")
            if ref is not None and not ref["decisions"]:
                out.append((r, ref))
        return out

    here, there = pairs(kept, kept), pairs(apart, kept)
    assert here and all(cr.same_run(r, ref) for r, ref in here)
    first = [next(x[0] for x, y in zip(r["series"], ref["series"]) if x != y) for r, ref in there]
    gaps = [gm.final_loss(r) / gm.final_loss(ref) - 1 for r, ref in there]
    text = docs_text()
    assert f"{len(here)} of {len(here)} such runs in eighth-10M's records" in text
    assert "11-spiky_loss" in again and cr.same_run(kept["11-spiky_loss"], kept["11-unguarded"])
    assert (
        f"The {len(apart)} runs started between 1 December "
        f"{min(r['started'] for r in apart.values())[11:16]} and "
        f"{max(r['started'] for r in apart.values())[11:16]} UTC came from another machine: each of its "
        f"{len(there)} such runs differs from its counterpart from iteration {min(first)} to {max(first)} on"
        in text
    )
    assert f"ended {min(gaps):+.2%} to {max(gaps):+.2%} from it" in text
    assert all(r["started"].startswith("2026-12-01") for r in apart.values())
    # the other 65 ran before or after that stretch, never inside it
    stretch = (min(r["started"] for r in apart.values()), max(r["ended"] for r in apart.values()))
    assert not [n for n, r in kept.items() if stretch[0] <= r["started"] <= stretch[1]]
    assert f"`lab/campaign/eighth-10M/runs.jsonl`: {len(kept)} runs" in text
    assert (
        f"({len(there)} of {len(there)} pairs; on one machine {len(here)} of {len(here)} runs the same to every "
        "digit)" in docs_text("README.md")
    )
    # on the 2x64 model every such pair of the committed campaigns is the same run
    counts = {}
    for name in ("seventh", "ninth", "fifth", "sixth", "withdrawn-61-third"):
        runs = cr.runs_of(os.path.join(gc.ROOT, "lab", "campaign", name))
        assert all(cr.same_run(r, ref) for r, ref in pairs(runs, runs)), name
        counts[name] = len(pairs(runs, runs))
    assert (
        f"the seventh's {counts['seventh']} and the ninth's {counts['ninth']} (across two sessions) are the same "
        f"to every recorded digit, as are the fifth's, the sixth's and withdrawn-61-third's "
        f"{counts['fifth'] + counts['sixth'] + counts['withdrawn-61-third']}" in text
    )


def test_a_third_kind_of_machine_differs_from_eighth_10ms_records_as_the_docs_say():
    """The probe on a third kind of machine (lab/campaign/eighth-10M-design/machine-probe.jsonl): trial 0's clean
    run by the registered runner, stopped early. It names a machine other than the records' kind, repeats the
    record for the iterations the docs say and differs from the next on; the docs' numbers are the records'."""
    folder = os.path.join(gc.ROOT, "lab", "campaign")
    (probe,) = map(
        json.loads, open(os.path.join(folder, "eighth-10M-design", "machine-probe.jsonl"))
    )
    record = cr.runs_of(os.path.join(folder, "eighth-10M"))[probe["name"]]
    assert (probe["commit"], probe["registration"]) == (record["commit"], record["registration"])
    assert probe["torch"] == record["torch"]
    assert "family 25 model 17 " not in probe["machine"]["cpu"]
    first = next(k for k, (a, b) in enumerate(zip(probe["series"], record["series"])) if a != b)
    assert probe["series"][:first] == record["series"][:first] and first >= 1
    mine, theirs = probe["series"][first], record["series"][first]
    after = probe["series"][first + 1][1], record["series"][first + 1][1]
    text = docs_text()
    assert (
        f"to every recorded digit for {first} iterations and differed from the {mine[0]}th on (loss "
        f"{mine[1]} against {theirs[1]}, then {after[0]} against {after[1]} at the {mine[0] + 1}th); stopped "
        f"by hand after {probe['series'][-1][0]} iterations" in text
    )
