"""The seventh campaign's machinery (lab/guard_campaign.py, lab/campaign_draw.py, lab/campaign_report.py,
lab/guard_metrics.py), against references worked out by hand here or kept in the repository: the old draws
against the sixth's and the withdrawn seed-61 registration's own records; the primary metric, its bootstrap
interval, the detection's base rate and OPT's calibrated bound on hand-made records; the stratified draw's
counts; the methods' settings against the config's defaults; the records' stamps; the registration's refusal
of another tree."""

import json
import math
import os
import re
import socket
import time

import pytest

import campaign_draw as cd
import campaign_report as cr
import guard_campaign as gc
import guard_metrics as gm

CAMPAIGN = os.path.join(os.path.dirname(gc.__file__), "campaign")


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
            "grad_norm_bound": None,
            "preregister": os.path.join(out, "registration.json"),
            "draw": "seventh",
            "windows": "published",
            "window_scale": None,
            "snapshots": "on",
            "requeue": False,
            "jobs": 1,
            "minutes": 60.0,
            "long_clean": 0,
            "long_iters": 100,
            "method": "none",
            "data_path": "unused",
            **more,
        }
    )


# -- the draws ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, seed, how", [("sixth", 62, "sixth"), ("withdrawn-61", 61, "withdrawn-61")]
)
def test_the_old_draws_are_the_ones_their_records_ran(name, seed, how):
    records = [json.loads(line) for line in open(os.path.join(CAMPAIGN, name, "runs.jsonl"))]
    trials = {r["trial"]: r for r in records if "trial" in r}
    assert len(trials) >= 28
    for k, r in trials.items():
        trial = cd.DRAWS[how](seed, k, r["iters"])
        assert (trial["what"], trial["start"], trial["nproc"], trial["resume"]) == (
            r["what"],
            r["start"],
            r["nproc"],
            r.get("resume"),
        )
    assert cd.DRAWS["withdrawn-61"](61, 7, 400)["seed"] == 1234 + 7  # the training seed it had then
    assert cd.DRAWS["sixth"](61, 7, 400)["seed"] != 1234 + 7


def test_the_stratified_draw_holds_every_family_equally_and_places_its_faults():
    n = len(cd.SEVENTH)
    draws = [cd.draw_seventh(70, k, 400) for k in range(3 * n)]
    counts = {f: sum(d["family"] == f for d in draws) for f in cd.SEVENTH}
    assert counts == {
        f: 3 for f in cd.SEVENTH
    }  # 3 x 16 trials: 3 of each, the numerical ones included
    assert [d["family"] for d in draws[:n]] != sorted(
        cd.SEVENTH
    )  # an order drawn, not the alphabet
    assert cd.draw_seventh(70, 5, 400) == draws[5] and cd.draw_seventh(71, 5, 400) != draws[5]
    for d in draws:
        keys = {flag.split("=")[0] for flag in d["flags"]}
        if cd.SEVENTH[d["family"]] == "data":  # in the corpus: samples, not iterations
            assert "--inject_bad_samples" in keys and not keys & {
                "--inject_bad_batch_iters",
                "--inject_degenerate_iters",
                "--inject_repeat_iters",
            }
            first = int(d["flags"][0].split("=")[1].split("-")[0])
            assert first == (d["start"] - 1) * 8  # the first sample of the fault's first iteration
        if d["family"] == "dp bad device":
            assert f"--inject_bad_device_iter={d['start']}" in d["flags"] and d["nproc"] == 2
            assert not keys & {"--inject_bitflip_iters"}


def test_the_harm_first_draw_holds_its_families_equally_and_lengthens_the_harmless_ones():
    n = len(cd.HARM_FIRST)
    draws = [cd.draw_harm(90, k, 400) for k in range(4 * n)]
    assert {f: sum(d["family"] == f for d in draws) for f in cd.SEVENTH} == {
        f: 0 if f in cd.HARMLESS else 4 for f in cd.SEVENTH
    }
    assert cd.draw_harm(90, 7, 400) == draws[7] and cd.draw_harm(91, 7, 400) != draws[7]
    for d in draws:
        keys = dict(flag.split("=") if "=" in flag else (flag, None) for flag in d["flags"])
        if d["family"] not in cd.LONGER:  # the seventh's own range
            assert d["family"] == "dp bad device" or d["family"] in d["what"]
            continue
        least, most = cd.LONGER[d["family"]]
        if d["family"] == "lr slow persistent":
            assert (
                least <= int(keys["--inject_lr_factor"]) <= most
                and 400 // 3 <= d["start"] <= 800 // 3
            )
            continue
        ranges = keys.get("--inject_numerical_iters") or keys["--inject_bad_samples"]
        a, b = map(int, ranges.split("-"))
        length = b - a + 1 if d["family"] == "numerical fp16" else (b - a + 1) // 8
        assert least <= length <= most and 15 <= d["start"] and d["start"] + length + 10 <= 401
        if d["family"] == "numerical fp16":
            assert d["precision"] == ["--fp16"] and a == d["start"]
        else:  # in the corpus, from the first sample of the fault's first iteration
            assert (
                a == (d["start"] - 1) * 8
                and keys["--inject_bad_samples_kind"] == cd.CORPUS_KINDS[d["family"]]
            )


@pytest.mark.parametrize("jobs, first", [(1, 0), (4, 0), (4, 5)])
def test_the_screen_runs_a_family_until_it_has_its_harmful_candidates(
    tmp_path, monkeypatch, jobs, first
):
    """A fake run whose unremedied loss is harmful for the LR families always, for the data ones
    every other candidate, and never for the rest: the screen stops each family at its count, or at
    the cap, and the methods run only the screened candidates; with runs in parallel finishing late,
    or a --first inside one of the draw's rounds, the same candidates (a round waits for the rounds
    before it)."""
    monkeypatch.setattr(gc, "HARMFUL_EACH", 2)
    n = len(cd.HARM_FIRST)
    families = [cd.draw_harm(5, k, 400)["family"] for k in range(first + 6 * n)]

    def harmful(k):
        rank = families[: k + 1].count(families[k])  # its place among its family's candidates
        return families[k].startswith("lr") or (cd.SEVENTH[families[k]] == "data" and rank % 2 == 0)

    def run(out, name, parts, data, method, nproc, requeue=False):
        k = int(name.split("-")[0])
        bad = name.endswith("-unguarded") and harmful(k)
        if bad:
            time.sleep(0.02)  # in parallel, a harmful twin comes in after the candidates beside it
        return finished(name, method, 5.0 if bad else 4.0)

    monkeypatch.setattr(gc, "run_one", run)
    run_args = dict(draw="harm", first=first, trials=6 * n, iters=400, preregister=None, jobs=jobs)
    gc.campaign(args(tmp_path, method="guard", **run_args))
    runs = cr.runs_of(str(tmp_path))
    screened = {}
    for r in runs.values():
        if r["name"].endswith("-unguarded"):
            screened.setdefault(r["family"], []).append(r["trial"])
    for family in cd.HARM_FIRST:
        mine = [k for k in range(first, first + 6 * n) if families[k] == family]
        want = next(
            i + 1
            for i in range(len(mine))
            if sum(map(harmful, mine[: i + 1])) == 2 or i + 1 == len(mine)
        )
        if first == 0:  # by hand: 2 of the LR families', 4 of the data ones', all 6 of the rest
            assert want == (
                2 if family.startswith("lr") else 4 if cd.SEVENTH[family] == "data" else 6
            )
        assert sorted(screened[family]) == mine[:want], family
        assert all(f"{k}-guarded" in runs and f"{k}-clean" in runs for k in mine[:want])
    # a remedy runs the harmful screened candidates only, and screens nothing anew
    gc.campaign(args(tmp_path, method="zclip", clean_runs=0, **run_args))
    runs = cr.runs_of(str(tmp_path))
    zclip = sorted(r["trial"] for r in runs.values() if r["name"].endswith("-zclip"))
    bad = sorted(
        r["trial"] for r in runs.values() if r["name"].endswith("-unguarded") and r["valid"] > 4.5
    )
    assert bad and zclip == bad == sorted(k for ks in screened.values() for k in ks if harmful(k))


def finished(name, method, valid=4.0):
    """A fake run_one's record of a run that finished."""
    return {
        "name": name,
        "exit": 0,
        "valid": valid,
        "method": method,
        "decisions": [],
        "series": [],
    }


def fake_train(calls, cause):
    """subprocess.call for run_one: the first run stops as the guard does, with a stop record naming
    `cause` in its --save directory and exit 3; any later one resumes and ends with a validation loss."""

    def call(cmd, cwd, env, stdout, stderr):
        calls.append(cmd)
        save = next(x.split("=", 1)[1] for x in cmd if x.startswith("--save="))
        if len(calls) == 1:
            os.makedirs(save, exist_ok=True)
            with open(os.path.join(save, "stopped.json"), "w") as f:
                json.dump({"iteration": 25, "cause": cause, "dp_rank": 1}, f)
            stdout.write("error: spike guard: iteration 30: a bad device; saved and stopped\n")
            return 3
        stdout.write(" validation loss at iteration 40 | lm loss value: 4.500000E+00 |\n")
        return 0

    return call


@pytest.mark.parametrize(
    "cause, requeue", [("hardware", True), ("data", True), ("hardware", False)]
)
def test_a_device_stop_is_requeued_without_the_device_and_scored_where_it_ends(
    tmp_path, monkeypatch, cause, requeue
):
    calls = []
    monkeypatch.setattr(gc.subprocess, "call", fake_train(calls, cause))
    os.makedirs(tmp_path / "logs")
    save = f"--save={tmp_path / 'checkpoints' / '3-guarded'}"
    device = ["--inject_bad_device_iter=20", "--inject_bitflip_bit=29", "--inject_bitflip_rank=1"]
    part = ["--train_iters=40", "--inject_bad_samples=8-15", *device, "--spike_guard", save]
    record = gc.run_one(str(tmp_path), "3-guarded", [part], "corpus", "guard", 1, requeue)
    if cause != "hardware" or not requeue:  # a stop the node's removal does not answer stays a stop
        assert len(calls) == 1 and record["exit"] == 3 and "requeued" not in record
        assert cr.ending(str(tmp_path), record).startswith("stopped by the guard at iteration 30")
        return
    # the same run resumed from its save, the device's flags gone, the corpus fault kept
    assert calls[1][-1] == "--data_path=corpus" and calls[1][:-1] == [
        *calls[0][:2],
        "--train_iters=40",
        "--inject_bad_samples=8-15",
        "--spike_guard",
        save,
    ]
    assert record["exit"] == 0 and record["valid"] == 4.5
    assert record["requeued"] == {"iteration": 25, "cause": "hardware", "dp_rank": 1}
    assert cr.ending(str(tmp_path), record) == (
        "stopped by the guard at iteration 25, hardware; requeued without DP rank 1's device, finished"
    )


def test_with_requeue_the_guards_runs_save_where_they_stop_and_the_remedies_do_not(
    tmp_path, monkeypatch
):
    seen = {}

    def run(out, name, parts, data, method, nproc, requeue=False):
        seen[name] = (parts, requeue)
        return finished(name, method)

    monkeypatch.setattr(gc, "run_one", run)
    for method in ("guard", "zclip"):
        gc.campaign(args(tmp_path, method=method, requeue=True, preregister=None, clean_runs=1))
    assert seen["0-guarded"][1] and seen["0-clean"][1]  # the clean twin runs the guard too
    assert not seen["0-unguarded"][1] and not seen["0-clean-zclip"][1]
    checkpoint = os.path.join(str(tmp_path), "checkpoints")
    for name, (parts, requeue) in seen.items():
        # the last --save of a part is the one train.py takes
        last = {[x for x in part if x.startswith("--save=")][-1] for part in parts}
        assert last == {f"--save={os.path.join(checkpoint, name)}" if requeue else "--save=none"}
    assert gc.registration_of(args(tmp_path, requeue=True))["requeue"] is True
    assert "requeue" not in gc.registration_of(args(tmp_path))


def test_a_run_that_leaves_no_record_stops_the_campaign_before_the_next_one(tmp_path, monkeypatch):
    started = []

    def run(out, name, parts, data, method, nproc, requeue=False):
        started.append(name)
        # a failure of the tool itself, not of train.py (that has an exit code)
        if name == "1-unguarded":
            raise OSError("the disk is full")
        return finished(name, method)

    monkeypatch.setattr(gc, "run_one", run)
    with pytest.raises(
        SystemExit, match=r"run 1-unguarded: OSError\('the disk is full'\) failed before its record"
    ):
        gc.campaign(
            args(tmp_path, draw="harm", trials=26, iters=400, method="guard", preregister=None)
        )
    assert started == ["0-clean", "0-unguarded", "0-guarded", "1-clean", "1-unguarded"]
    assert set(cr.runs_of(str(tmp_path))) == {"0-clean", "0-unguarded", "0-guarded", "1-clean"}


def test_a_second_campaign_in_the_same_out_is_refused_before_it_runs_anything(
    tmp_path, monkeypatch
):
    """Two campaigns in one --out would run the same missing trials twice and write over each other's
    logs: while one runs, a second is refused by name before any run; the lock goes with the first."""
    started, refusals = [], []
    run_args = dict(draw="harm", trials=2, iters=400, method="guard", preregister=None)

    def run(out, name, parts, data, method, nproc, requeue=False):
        started.append(name)
        if name == "0-clean" and not started[:-1]:  # a second campaign, once, while the first runs
            try:
                gc.campaign(args(tmp_path, **run_args))
            except ValueError as e:
                refusals.append(str(e))
        return finished(name, method)

    monkeypatch.setattr(gc, "run_one", run)
    gc.campaign(args(tmp_path, **run_args))
    assert refusals == [
        f"out directory {tmp_path} is in use by another campaign (host {socket.gethostname()} pid "
        f"{os.getpid()} since {refusals[0].split(' since ')[1].split(',')[0]}, in {tmp_path / 'lock'}); "
        "wait for it to end or use another --out (delete the lock only if that campaign is gone)"
    ]
    assert started == ["0-clean", "0-unguarded", "0-guarded", "1-clean", "1-unguarded", "1-guarded"]
    assert not (tmp_path / "lock").exists()


def test_each_seventh_flag_set_passes_the_runs_own_parser_and_checks():
    import arguments

    settings = [
        {},
        {"windows": "scaled", "window_scale": 0.2},
        {"snapshots": "off"},
        {"grad_norm_bound": 0.7},
    ]
    draws = [cd.draw_seventh(70, k, 400) for k in range(len(cd.SEVENTH))]
    for trial in draws + [cd.draw_harm(90, k, 400) for k in range(len(cd.HARM_FIRST))]:
        for more in settings:
            a = args("unused", **more)
            for method in cr.METHODS:
                flags = gc.method_flags(method, a)
                if "calibrated" in " ".join(flags):
                    continue  # its bound comes from the clean runs (test_opt_bound_is...)
                for argv in gc.processes(
                    gc.base_args(trial, "2x64", 400), trial["flags"], flags, trial, "/tmp/ck"
                ):
                    cfg = arguments.load_config([*argv, "--data_path=unused"])
                    arguments.validate(cfg, world_size=trial["nproc"], reads_data=False)
                    if gc.goes_to_disk(
                        flags
                    ):  # it goes back to what it saves, saved at its cadence
                        own = [f for f in flags if f.startswith("--save_interval=")]
                        assert cfg.save == "/tmp/ck" and own == [
                            f"--save_interval={cfg.save_interval}"
                        ]


# -- the methods' one rule ---------------------------------------------------------------------


def test_every_method_the_report_scores_has_its_flags_and_no_other():
    # the report's tables list METHODS; the runs take each one's flags from REMEDIES and SETTINGS
    assert cr.METHODS == ["guard", "none", *gc.REMEDIES]
    assert set(gc.SETTINGS) == set(gc.REMEDIES) and set(gc.WINDOWS) <= set(cr.METHODS)
    assert set(cr.DETECTORS) <= set(gc.REMEDIES)


def test_published_windows_are_the_configs_defaults_and_scaled_ones_one_factor():
    import arguments

    defaults = arguments.load_config([])
    # not a config default: PaLM's skip (its switch: 0 is off) and the disk cadence (tr8-104B's)
    published_elsewhere = {"palm_restart_skip": 200, "save_interval": gc.SAVE_INTERVAL}
    for keys in gc.WINDOWS.values():
        for key, value in keys.items():
            if key in published_elsewhere:
                assert value == published_elsewhere[key]
                continue
            assert getattr(defaults, key) == value, (
                key
            )  # the guard's: its own defaults; a remedy's: its paper's
    published, scaled = args("u"), args("u", windows="scaled", window_scale=0.25)
    assert gc.method_flags("guard", published) == [
        "--spike_guard",
        "--spike_guard_window=128",
        "--spike_guard_min_steps=16",
        "--spike_guard_rewind=100",
        "--spike_guard_snapshot_interval=50",
    ]
    assert gc.method_flags("guard", scaled)[1:] == [
        "--spike_guard_window=32",
        "--spike_guard_min_steps=4",
        "--spike_guard_rewind=25",
        "--spike_guard_snapshot_interval=12",
    ]  # 12.5 to even: 12
    assert gc.method_flags("skip_step", scaled) == ["--skip_step_sigma=6", "--skip_step_window=32"]
    assert gc.method_flags("zclip", scaled) == [
        "--zclip_z=2.5",
        "--zclip_alpha=0.97",
        "--zclip_warmup=6",
    ]
    off = gc.method_flags("guard", args("u", windows="scaled", window_scale=0.25, snapshots="off"))
    assert off[-2:] == ["--spike_guard_snapshot_interval=0", "--save_interval=75"]  # 300 x 0.25
    assert gc.method_flags("guard", args("u", windows="sixth")) == gc.GUARD
    # the restarts: their spike's window, PaLM's back and skip, and the disk cadence, scaled alike
    assert gc.method_flags("palm_restart", scaled) == [
        "--restart_sigma=6",
        "--restart_window=32",
        "--palm_restart_back=25",
        "--palm_restart_skip=50",
        "--save_interval=75",
    ]
    assert gc.method_flags("opt_restart", published) == [
        "--opt_restart_lr_factor=0.25",
        "--restart_sigma=6",
        "--restart_window=128",
        "--save_interval=300",
    ]
    assert "spiky_loss" in cr.DETECTORS


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--windows", "scaled"], "--window_scale goes with --windows scaled"),
        (["--window_scale", "0.5"], "--window_scale goes with"),
        (["--windows", "scaled", "--window_scale", "0"], "must be > 0"),
        (["--windows", "sixth", "--snapshots", "off"], "--snapshots off needs"),
        (["--draw", "withdrawn-61"], "give --seed 61"),
        (["--draw", "harm", "--iters", "100"], "give --iters 185 or more"),
    ],
)
def test_a_wrong_setting_is_refused_before_any_work(tmp_path, monkeypatch, flags, named):
    def started(*_):  # a check missed: fail here rather than run a campaign
        raise AssertionError("the campaign started")

    monkeypatch.setattr(gc, "campaign", started)
    with pytest.raises(ValueError, match=named):
        gc.main(["--out", str(tmp_path / "c"), "--data_path", "unused", *flags])
    assert not os.path.exists(tmp_path / "c")


# -- the metrics on hand-made records ----------------------------------------------------------


def run(valid, exit=0, decisions=(), series=(), gap=None, seconds=10.0, snapshots=0):
    return {
        "valid": valid,
        "exit": exit,
        "decisions": list(decisions),
        "series": list(series),
        "replica_gap": gap,
        "seconds": seconds,
        "snapshots": snapshots,
    }


def test_the_share_of_damage_removed_is_what_a_skip_can_win_too():
    clean, bad = run(4.0), run(4.4)
    assert gm.damage_removed(clean, bad, run(4.2)) == pytest.approx(
        0.5
    )  # a skip that removes half the damage
    assert gm.damage_removed(clean, bad, run(4.0)) == pytest.approx(1.0)
    assert gm.damage_removed(clean, bad, run(4.4)) == pytest.approx(0.0)  # doing nothing
    assert gm.damage_removed(clean, bad, run(4.6)) == pytest.approx(
        -0.5
    )  # worse than the unremedied twin
    assert gm.damage_removed(clean, run(3.9), run(4.0)) is None  # no damage to remove
    # a run that died or was stopped counts as an untrained model: ln 512
    assert gm.damage_removed(clean, run(math.nan, exit=1), run(4.0)) == pytest.approx(1.0)
    stopped = gm.damage_removed(clean, bad, run(4.1, exit=3))
    assert stopped == pytest.approx((4.4 - math.log(512)) / 0.4)


def test_the_bootstrap_interval_resamples_the_trials():
    assert gm.bootstrap_mean([0.5] * 7) == (0.5, 0.5, 0.5)
    mean, lo, hi = gm.bootstrap_mean([0.0, 1.0])  # resampled means: 0, 0.5, 1 with 1/4, 1/2, 1/4
    assert (mean, lo, hi) == (0.5, 0.0, 1.0)
    values = [0.0] * 10 + [1.0] * 10
    mean, lo, hi = gm.bootstrap_mean(values)
    sd = math.sqrt(0.25 / 20)  # the mean's standard error; a 95% interval is about +-1.96 of it
    assert (
        mean == 0.5
        and lo == pytest.approx(0.5 - 1.96 * sd, abs=0.06)
        and hi == pytest.approx(0.5 + 1.96 * sd, abs=0.06)
    )
    assert gm.bootstrap_mean(values) == (
        mean,
        lo,
        hi,
    )  # seeded: a report rebuilt gives the same interval
    assert all(math.isnan(x) for x in gm.bootstrap_mean([]))


def test_detection_is_within_the_window_and_net_of_the_clean_base_rate():
    act = "spike guard: iteration {}: loss 9 is 2x its trend; data-driven"
    assert gm.acted_within(run(4, decisions=[act.format(119)]), 100, 20)
    assert not gm.acted_within(
        run(4, decisions=[act.format(120)]), 100, 20
    )  # the window is [100, 120)
    assert not gm.acted_within(
        run(4, decisions=[act.format(99)]), 100, 20
    )  # before the fault: no detection
    cleans = [run(4, decisions=[act.format(150)]), run(4)]
    assert (
        gm.base_rate(cleans, [100, 140], 20) == 0.25
    )  # of 4 (clean run, start) pairs one acted: 150 in [140, 160)


def test_opt_bound_is_calibrated_on_clean_runs():
    warm = [[i, 6.0, 50.0, 0] for i in range(1, 51)]  # the warm-up's large norms: left out
    a = run(4, series=warm + [[i, 5.0, float(i - 50), 0] for i in range(51, 551)])  # 1..500
    b = run(
        4,
        series=warm
        + [[i, 5.0, float(i - 50 + 500), 0] for i in range(51, 551)]
        + [[60, 5.0, 1e9, 0]],
    )
    b["series"].append(
        [70, 5.0, math.inf, 0]
    )  # a replay (second pass of 60) and a non-finite norm: left out
    assert gm.calibrated_bound([a, b]) == 999.0  # of 1..1000, the nearest-rank 99.9th
    assert gm.percentile([3, 1, 2], 50) == 2 and gm.percentile([1, 2, 3, 4], 100) == 4
    with pytest.raises(ValueError, match="run the clean twins first"):
        gm.calibrated_bound([run(4, series=warm)])


def rec(name, valid, family="random tokens", start=20, decisions=(), exit=0, gap=None, method=None):
    """(name, a hand-made run record as run_one writes it)."""
    return name, {
        "name": name,
        "valid": valid,
        "exit": exit,
        "decisions": list(decisions),
        "family": family,
        "what": family,
        "start": start,
        "trial": int(name.split("-")[0]),
        "method": method,
        "iters": 100,
        "series": [[i, 5.0, 1.0, 0] for i in range(1, 101)],
        "seconds": 10.0,
        "replica_gap": gap,
        "snapshots": 2,
        "rollbacks": 0,
    }


def test_the_primary_table_counts_by_hand():
    act, late = (
        "spike guard: iteration 25: loss 9 is 2x its trend; data-driven",
        "spike guard: iteration 60: loss 9 is 2x its trend; data-driven",
    )  # 40 after the fault: too late
    # trial 2: 0.5% over its clean twin (harmless by its loss) with its replicas apart: harmful, and
    # not in the shares
    runs = dict(
        [
            rec("0-clean", 4.0),
            rec("0-unguarded", 4.4),
            rec("0-guarded", 4.2, decisions=[act]),
            rec("1-clean", 4.0),
            rec("1-unguarded", 4.8),
            rec("1-guarded", 4.9, decisions=[late]),
            rec("2-clean", 4.0, gap=0.0),
            rec("2-unguarded", 4.02, gap=0.1),
            rec("2-guarded", 4.0, gap=0.0),
            rec("3-clean", 4.0),
            rec("3-unguarded", 4.01),
            rec("3-guarded", 4.0, decisions=[act], exit=3),
        ]
    )
    guard = cr.primary_results(runs)["guard"]
    assert guard["shares"] == pytest.approx(
        [0.5, -0.125]
    )  # trial 2 is harmful by its replicas alone: apart
    assert (guard["apart"], guard["rejoined"], guard["harmful"], guard["detected"]) == (1, 1, 3, 1)
    assert (guard["harmless"], guard["harmless_acted"], guard["harmless_stopped"]) == (1, 1, 1)
    table = cr.primary_table(runs)
    assert (
        "| guard | 0.19 (-0.13 to 0.50), n=2 | 1 | 1/1 | 1/3 - 0.00 = +0.33 | +0.0% | +0.0% | 2.0 "
        "| 1/1 / 1/1 |" in table
    )
    assert "| random tokens | 4 | 3 |" in table


def test_the_report_names_every_trial_worse_than_doing_nothing_and_how_it_ended(tmp_path):
    stop = (
        "spike guard: iteration 339: hardware/transient fault on DP rank 1: 3 faults on DP rank 1, "
        "the spike_guard_max_hardware_faults=3th: take its node out"
    )
    runs = dict(
        [
            # a device that stays bad (the seventh's own family): the guard stops it, torchrun exits 1
            rec("0-clean", 4.0, family="dp bad device", gap=0.0),
            rec("0-unguarded", 4.3, family="dp bad device", gap=0.0),
            rec("0-guarded", math.nan, family="dp bad device", exit=1, decisions=[stop]),
            # 0.5% worse than doing nothing: within the threshold, not listed
            rec("1-clean", 4.0),
            rec("1-unguarded", 4.4),
            rec("1-guarded", 4.42, decisions=["spike guard: iteration 25: data-driven"]),
            # replicas apart where doing nothing kept them equal, no log: the record's last action
            rec("2-clean", 4.0, gap=0.0),
            rec("2-unguarded", 4.0, gap=0.0),
            rec(
                "2-guarded",
                4.0,
                gap=0.2,
                exit=2,
                decisions=["spike guard: iteration 30: numerical: x"],
            ),
        ]
    )
    with open(tmp_path / "runs.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in runs.values())
    os.makedirs(tmp_path / "logs")
    (tmp_path / "logs" / "0-guarded.log").write_text(
        f"iteration 339 ...\n{stop}\nerror: {stop}; the state of iteration 339 saved in ckpt\n"
    )
    text = cr.report(str(tmp_path))
    assert "| dp bad device | 1 | 1 |" in text  # the family counted, its cause known
    listed = text.split("more than 1% worse than doing nothing")[1]
    assert (
        f"| guard | 0 | dp bad device | 4.3000 | {gm.LOSS_CAP:.4f} | - | stopped by the guard at "
        "iteration 339, hardware (exit 1) |" in listed
    )
    assert "| guard | 1 |" not in listed
    assert (
        "| guard | 2 | random tokens | 4.0000 | 6.2383 | apart | exit 2, its last action's cause "
        "numerical (no log) |" in listed
    )


def test_the_eighths_guard_is_reported_beside_the_sevenths_remedies_where_the_twins_agree(tmp_path):
    seventh, eighth = tmp_path / "seventh", tmp_path / "eighth"
    shared = [
        rec("0-clean", 4.0),
        rec("0-unguarded", 4.4),
        rec("1-clean", 4.0),
        rec("1-unguarded", 4.8),
    ]
    theirs = dict(
        shared
        + [
            rec("0-skip_step", 4.3, method="skip_step"),
            rec("1-skip_step", 4.6, method="skip_step"),
            rec("0-clean-skip_step", 4.0, method="skip_step"),
            rec("2-clean", 4.0),
            rec("2-unguarded", 4.5),
            rec("2-skip_step", 4.0, method="skip_step"),
        ]
    )
    mine = dict(
        shared
        + [
            rec("0-guarded", 4.0, method="guard"),
            rec("1-guarded", 4.4, method="guard"),
            rec("2-clean", 4.0),
            rec("2-unguarded", 4.5000001),  # not the seventh's to every digit: no baseline
            rec("2-guarded", 4.0, method="guard"),
        ]
    )
    for directory, runs in ((seventh, theirs), (eighth, mine)):
        os.makedirs(directory)
        with open(directory / "runs.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in runs.values())
    assert cr.same_twins(mine, theirs) == [0, 1]
    text = "\n".join(cr.beside_baselines(str(eighth), str(seventh)))
    assert (
        "2 of 3 trials, whose clean and unremedied runs agree" in text
        and "apart (no baseline): 2" in text
    )
    # trials 0 and 1, by hand: the guard removed 0.4 of 0.4 and 0.4 of 0.8; SkipStep 0.1 of 0.4, 0.2 of 0.8
    assert "| guard | 0.75 (0.50 to 1.00), n=2 |" in text, text
    assert "| skip_step | 0.25 (0.25 to 0.25), n=2 |" in text, text
    with pytest.raises(ValueError, match="--baselines goes with --report"):
        gc.main(["--out", str(eighth), "--baselines", str(seventh), "--data_path", "x"])


def test_a_report_scores_the_runs_as_registered():
    registered = json.load(open(os.path.join(CAMPAIGN, "seventh", "registration.json")))
    cr.check_measured(registered, registered["harm_threshold"])  # this checkout's are the same
    with pytest.raises(SystemExit, match="harm_threshold changed since a396cd6"):
        cr.check_measured(registered, 0.02)
    with pytest.raises(SystemExit, match="metrics_sha256 changed"):
        cr.check_measured({**registered, "metrics_sha256": "0" * 64}, registered["harm_threshold"])
    # the restore brings back the lab's modules of the registration's commit, however they were split then
    with pytest.raises(SystemExit, match=re.escape("git checkout a396cd6 -- ':(glob)lab/*.py'")):
        cr.check_measured(registered, 0.02)


# -- the registration and the stamps -----------------------------------------------------------


def test_every_record_is_stamped_and_a_registration_refuses_another_tree(tmp_path, monkeypatch):
    here = {
        "cpu": "AuthenticAMD family 25 model 17 (AMD EPYC)",
        "isa": "avx2",
        "capability": "AVX2",
    }
    stamp = {"commit": "c" * 40, "tree": "t" * 64, "dirty": False, "torch": "2.x", "machine": here}
    monkeypatch.setattr(gc, "code_stamp", lambda: dict(stamp))
    monkeypatch.setattr(gc, "uncommitted", lambda: "")
    monkeypatch.setattr(
        gc,
        "run_one",
        lambda out, name, parts, data, method, nproc, requeue=False: {
            "name": name,
            "exit": 0,
            "valid": 4.0,
            "method": method,
            "decisions": [],
            "series": [],
            "nproc": nproc,
        },
    )
    a = args(tmp_path)
    registration = gc.preregister(a)
    saved = json.load(open(a.preregister))
    for key in (
        "tree",
        "dirty",
        "torch",
        "machine",
        "goals",
        "metrics_sha256",
        "draw_sha256",
        "thresholds",
        "windows",
        "snapshots",
        "draw",
    ):
        assert key in saved, key
    assert saved["tree"] == "t" * 64 and saved["thresholds"]["detect_window"] == gm.DETECT_WINDOW
    gc.campaign(a, registration)
    for r in cr.runs_of(str(tmp_path)).values():
        assert {k: r[k] for k in stamp} == stamp and r["registration"] == cr.registration_id(
            registration
        )
        assert r["started"] <= r["ended"] and r["ended"].endswith("Z") and len(r["started"]) == 20
    monkeypatch.setattr(
        gc, "code_stamp", lambda: {**stamp, "tree": "u" * 64}
    )  # a file changed and committed
    with pytest.raises(SystemExit, match="is not the registered one"):
        gc.preregister(a)
    monkeypatch.setattr(
        gc, "code_stamp", lambda: {**stamp, "dirty": True}
    )  # the same commit, edited
    with pytest.raises(SystemExit, match=r"\(hash tttttttttttt, dirty\) is not the registered one"):
        gc.preregister(a)
    # the same code on another kind of CPU: its runs are not their twins' to the digit
    there = {**here, "cpu": "GenuineIntel family 6 model 143 (Intel Xeon)", "isa": "amx_fp16 avx2"}
    monkeypatch.setattr(gc, "code_stamp", lambda: {**stamp, "machine": there})
    with pytest.raises(
        SystemExit,
        match=r"this machine \(GenuineIntel family 6 model 143 .* is not the registered kind",
    ):
        gc.preregister(a)


def test_the_machine_names_the_cpu_and_the_instructions_kernels_choose_by(tmp_path):
    """A record's machine: /proc/cpuinfo's first processor (vendor, family, model, name) and its vector
    instructions (avx*, amx*, fma, f16c; not the rest of its flags), and torch's own kernel choice."""
    import torch

    info = tmp_path / "cpuinfo"
    processor = (
        "processor\t: {n}\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\n"
        "model name\t: Intel(R) Xeon(R) Platinum 8480+\n"
        "flags\t\t: fpu sse2 avx avx2 fma f16c avx512f avx512_fp16 amx_tile amx_bf16 sha_ni\n\n"
    )
    info.write_text(processor.format(n=0) + processor.format(n=1).replace("amx_bf16", ""))
    assert gc.machine(str(info)) == {
        "cpu": "GenuineIntel family 6 model 143 (Intel(R) Xeon(R) Platinum 8480+)",
        "isa": "amx_bf16 amx_tile avx avx2 avx512_fp16 avx512f f16c fma",
        "capability": torch.backends.cpu.get_cpu_capability(),
    }
    assert gc.machine(str(tmp_path / "none"))["cpu"]  # no /proc: the platform's name


def test_the_harm_first_registration_freezes_its_screen_and_reads_back_as_written(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(
        gc, "code_stamp", lambda: {"commit": "c" * 40, "tree": "t" * 64, "dirty": False}
    )
    monkeypatch.setattr(gc, "uncommitted", lambda: "")
    a = args(tmp_path, draw="harm", seed=90, iters=400)
    written = gc.preregister(a)
    assert written["families"] == cd.HARM_FIRST and written["harmful_each"] == cd.HARMFUL_EACH
    assert written["longer"]["random tokens"] == list(cd.LONGER["random tokens"])
    assert gc.preregister(a) == json.load(
        open(a.preregister)
    )  # the next run's check: the same campaign
    monkeypatch.setattr(gc, "LONGER", {**cd.LONGER, "random tokens": (4, 8)})
    with pytest.raises(SystemExit, match="differs from its registration in longer"):
        gc.preregister(a)


def test_the_tree_hash_is_the_whole_tree_but_the_campaigns_records(monkeypatch):
    listing = "100644 blob aaa\ttrain.py\n100644 blob bbb\tlab/campaign/seventh/registration.json\n"
    calls = []

    def fake(cmd, **kw):
        calls.append(cmd)
        return type("R", (), {"stdout": listing if "ls-tree" in cmd else ""})()

    monkeypatch.setattr(gc.subprocess, "run", fake)
    one = gc.tree_state()
    listing = listing.replace("bbb", "ccc")  # a registration committed: the same tree
    assert gc.tree_state() == one and one["dirty"] is False
    listing = listing.replace("aaa", "ddd")  # any other file: another tree
    assert gc.tree_state()["tree"] != one["tree"]


def test_the_subset_model_has_10m_parameters():
    import torch

    import arguments
    from builders import build_model

    cfg = arguments.prepare(
        arguments.load_config(
            [*gc.base_args(cd.draw_seventh(70, 1, 1000), "10M", 1000), "--data_path=unused"]
        )
    )
    model = build_model(cfg, torch.device("meta"))
    assert sum(p.numel() for p in model.parameters()) >= 10_000_000
