"""The stability lab's tracked results (lab/sweep_report.py): the tables that --report --results rebuilds
from lab/results.jsonl's one line a run against the tables made from the runs' full results, the refusal to
mix code versions, the code version a run records, and the size ladder's prediction against a hand computation.
"""

import json
import math
import os
import subprocess

import pytest

import lr_sweep
import sweep_arms
import sweep_report

H2 = 3.509
CORPUS = {"tokens": 2_666_329, "unigram_entropy": 5.219, "bigram_entropy": H2}
LEARNED = [6.0, 4.0] + [3.2] * 98  # 10-iteration loss means: clearly below H2 from iteration 20 on
FLAT = [6.0] + [4.2] * 99  # never below H2
# below H2, then back above it after iteration 440: blew up
LOST = [6.0, 3.2] + [3.2] * 50 + [3.9] * 48


def _result(
    lever_set, lr, seed, loss, loss10=LEARNED, logit=50.0, code="abc1234", width=128, **more
):
    """A run's result as execute() returns it (series and all), every number distinct per run."""
    return {
        "arm": "A",
        "lever_set": lever_set,
        "lr": lr,
        "seed": seed,
        "width": width,
        "code": code,
        "val_loss": loss,
        "train_loss": loss - 0.05,
        "train_loss_max": 6.25,
        "nan_iterations": 0,
        "loss10": loss10,
        "attention_logit_max": logit,
        "attention_entropy_min": 0.1 * seed,
        "log_z": 7.0 + lr,
        "output_logit_mean": -5.0 - lr,
        "grad_rms_over_eps": 1e3 * seed,
        "final_ln_input_rms_max": 10 / lr,
        "spike_score": 0.001 * seed,
        "log_z_max": 9.0,
        "embedding_norm_max": 150.0,
        "cpu_seconds": 300.0 + seed,
        "series": {"iteration": [10, 20], "log_z": [6.2, 6.3]},
        **more,
    }


def _study(code="abc1234"):
    """Arm A: seeds 1 and 3 over the grid, seed 2 at two LRs; flat, lost, diverged and NaN runs among them."""
    results = []
    for i, lr in enumerate(sweep_arms.HALF_DECADES):
        for seed in (1, 3):
            broken = lr >= 3e-2
            results.append(
                _result(
                    "default",
                    lr,
                    seed,
                    3.2 + 0.4 * i + 0.003 * seed,
                    FLAT if broken else LEARNED,
                    logit=10 ** (1 + i) * seed,
                    code=code,
                )
            )
            results.append(
                _result(
                    "qk_layernorm",
                    lr,
                    seed,
                    3.3 + 0.05 * i + 0.002 * seed,
                    LOST if lr == 0.3 else LEARNED,
                    logit=5.0 * (i + 1),
                    code=code,
                )
            )
    results[-1]["val_loss"] = float("nan")  # qk-layernorm at LR 1, seed 3: diverged
    results[-1]["nan_iterations"] = 3
    results += [
        _result("default", 3e-2, 2, 3.95, FLAT, logit=2e4, code=code),
        _result("qk_layernorm", 3e-2, 2, 3.44, code=code),
    ]
    return results


def _tables(results, code="abc1234"):
    arms = {"A": sweep_arms.ARMS["A"]}
    rows = {
        "A": sweep_report.summarize(
            results, "A", ["default", "qk_layernorm"], sweep_arms.HALF_DECADES, H2
        )
    }
    return sweep_report.markdown(rows, {"A": arms["A"]["lrs"]}, CORPUS, [], code, 128)


def test_the_tracked_records_alone_give_the_tables_the_full_results_give(tmp_path):
    results = _study()
    path = str(tmp_path / "lab" / "results.jsonl")
    sweep_report.merge_records(path, [sweep_report.record(r, CORPUS) for r in results])
    lines = [json.loads(line) for line in open(path)]
    assert len(lines) == len(results) and all(
        "loss10" not in r and "series" not in r for r in lines
    )
    assert all(len(line) < 1000 for line in open(path))  # one short line a run
    # the flags stand for the series: the same counts of up / flat / div, the same cells, sensitivities, precursors
    reference = _tables(results)
    # the fakes exercise them
    assert "up 2" in reference and "up 1 div 1" in reference and "flat 3" in reference
    docs = tmp_path / "stability.md"
    docs.write_text(
        f"# before\n\n{sweep_report.DOCS_BEGIN}\nold tables\n{sweep_report.DOCS_END}\n\n# after\n"
    )
    lr_sweep.main(
        [
            "--report",
            "--results",
            path,
            "--arms",
            "A",
            "--out",
            str(tmp_path / "report"),
            "--docs",
            str(docs),
        ]
    )
    table = (tmp_path / "report" / "results.md").read_text()
    assert table.split("\n\n", 1)[1] == reference and table.startswith(
        "30 of the selection's 42 runs"
    )
    text = docs.read_text()
    assert text.startswith("# before\n\n" + sweep_report.DOCS_BEGIN) and text.endswith(
        sweep_report.DOCS_END + "\n\n# after\n"
    )
    assert reference.strip() in text and "old tables" not in text
    assert "Every run below ran on code abc1234" in text and "30 runs" in text
    for png in (tmp_path / "report" / "lr_sweep.png", tmp_path / "stability.png"):
        assert png.read_bytes().startswith(b"\x89PNG")
    # the same run recorded again replaces its line; the same run on other code is another line
    again = [sweep_report.record(r, CORPUS) for r in _study()[:2]]
    other = [sweep_report.record(r, CORPUS) for r in _study(code="def5678")[:2]]
    sweep_report.merge_records(path, again + other)
    assert len(sweep_report.load_records(path)) == len(results) + 2


def test_a_page_of_several_selections_gets_each_report_in_its_own_section_and_figure(tmp_path):
    path = str(tmp_path / "results.jsonl")
    sweep_report.merge_records(path, [sweep_report.record(r, CORPUS) for r in _study()])
    here, there = (
        [
            m.replace(" --docs", f" --docs --arms A --width {w}")
            for m in (sweep_report.DOCS_BEGIN, sweep_report.DOCS_END)
        ]
        for w in (128, 64)
    )
    page = tmp_path / "natural.md"
    page.write_text(
        f"# a\n{here[0]}\nold 128\n{here[1]}\n# b\n{there[0]}\nold 64\n{there[1]}\n# c\n"
    )
    report = ["--report", "--results", path, "--arms", "A", "--out", str(tmp_path / "r")]
    lr_sweep.main([*report, "--docs", str(page)])
    text = page.read_text()
    assert "old 128" not in text and _tables(_study()).strip() in text
    # the other selection's section, and the page around both, as they were
    assert text.startswith(f"# a\n{here[0]}\n\n") and text.endswith(
        f"{here[1]}\n# b\n{there[0]}\nold 64\n{there[1]}\n# c\n"
    )
    assert (tmp_path / "natural_A_w128.png").read_bytes().startswith(b"\x89PNG")
    assert not (tmp_path / "natural.png").exists()
    # no markers for it: refused, naming both forms
    page.write_text("# nothing to write into\n")
    with pytest.raises(SystemExit) as refused:
        lr_sweep.main([*report, "--docs", str(page)])
    message = str(refused.value)
    assert sweep_report.DOCS_BEGIN in message and "--arms A --width 128)" in message


def test_arm_f_is_shown_against_arm_ns_runs_at_the_same_lever_lr_and_seed(tmp_path):
    """Prediction 6 of lab/natural.md (fp16 within 0.05 nats of fp32 wherever fp32 learns), checked run by run:
    each cell of arm F against arm N's runs of the same lever set, LR and seed, on the same code and width."""
    runs = [
        _result("none", 3e-3, 1, 3.40, arm="N", width=64),
        _result("none", 3e-3, 3, 3.50, arm="N", width=64),
        _result("none", 3e-3, 2, 1.00, arm="N", width=64, code="other"),  # another code: no twin
        _result("none", 3e-3, 2, 1.00, arm="N", width=128),  # another width: no twin
        _result("none", 3e-3, 1, 3.45, arm="F", width=64),
        _result("none", 3e-3, 2, 9.00, arm="F", width=64),  # no twin in arm N
        _result("none", 3e-3, 3, 3.40, arm="F", width=64),
        _result("guard", 1e-2, 1, 3.70, arm="F", width=64),  # arm N has no guard run there
    ]
    path = str(tmp_path / "results.jsonl")
    sweep_report.merge_records(path, [sweep_report.record(r, CORPUS) for r in runs])
    out = tmp_path / "report"
    lr_sweep.main(
        ["--report", "--results", path, "--arms", "F", "--width", "64", "--out", str(out)]
    )
    lines = (out / "results.md").read_text().splitlines()
    at = lines.index(
        "Arm F against arm N, run by run (the same lever set, LR and seed): the mean over the seeds both ran "
        "of F's final loss minus N's, n the seeds paired:"
    )
    assert lines[at + 2 : at + 6] == [
        "| lever set | 3e-03 | 1e-02 | 3e-02 | 1e-01 |",
        "| --- | --- | --- | --- | --- |",
        "| none | -0.025 (n=2) |  |  |  |",  # (3.45 - 3.40 + 3.40 - 3.50) / 2
        "| guard |  |  |  |  |",
    ]
    # an arm without a reference has no such table
    lr_sweep.main(
        [
            "--report",
            "--results",
            path,
            "--arms",
            "N",
            "--width",
            "64",
            "--code",
            "abc1234",
            "--out",
            str(out),
        ]
    )
    assert "against arm" not in (out / "results.md").read_text()


def test_a_report_refuses_to_mix_code_versions_and_names_the_one_it_shows(tmp_path):
    path = str(tmp_path / "results.jsonl")
    old = [r for r in _study(code="eded072") if r["lr"] == 3e-2 and r["seed"] == 3]
    sweep_report.merge_records(path, [sweep_report.record(r, CORPUS) for r in [*_study(), *old]])
    args = ["--report", "--results", path, "--arms", "A", "--out", str(tmp_path / "report")]
    with pytest.raises(
        SystemExit, match=r"mixes runs of code abc1234 \(30 runs\), code eded072 \(2 runs\)"
    ):
        lr_sweep.main(args)
    lr_sweep.main([*args, "--code", "eded072"])
    table = (tmp_path / "report" / "results.md").read_text()
    assert (
        "Every run below ran on code eded072" in table
        and "2 runs." in table
        and table.startswith("2 of the")
    )
    assert "| default | not run | not run | not run | 4.409 (n=1) logit 1 flat 1 |" in table
    with pytest.raises(SystemExit, match="no run of the selection ran on code 0000000"):
        lr_sweep.main([*args, "--code", "0000000"])
    # and so does a report from the runs themselves: execute()'s results carry their code
    with pytest.raises(SystemExit, match="mixes runs of code"):
        sweep_report.one_code([*_study(), *old])


def test_a_run_records_its_code_version_and_is_not_resumed_on_other_code(tmp_path):
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    (repo / "lab").mkdir()
    (repo / "model.py").write_text("x = 1\n")
    (repo / "docs" / "a.md").write_text("doc\n")
    (repo / "lab" / "lr_sweep.py").write_text("# the report\n")
    (repo / "lab" / "results.jsonl").write_text("{}\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "code"], check=True)
    first = subprocess.run(
        [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    assert lr_sweep.code_version(str(repo)) == first
    # neither the docs, the report nor its records are code
    (repo / "docs" / "a.md").write_text("more doc\n")
    (repo / "lab" / "lr_sweep.py").write_text("# the report, changed\n")
    (repo / "lab" / "results.jsonl").write_text("{}\n{}\n")
    subprocess.run([*git, "commit", "-qam", "docs, report and records"], check=True)
    assert lr_sweep.code_version(str(repo)) == first
    (repo / "model.py").write_text("x = 2\n")
    assert lr_sweep.code_version(str(repo)) == first + "+dirty"
    run = tmp_path / "run"
    lr_sweep.record_code(str(run), first)
    lr_sweep.record_code(str(run), first)  # resumed on the same code
    assert lr_sweep.read_code(str(run)) == first
    with pytest.raises(
        SystemExit, match=f"started on code {first} and would resume on {first}\\+dirty"
    ):
        lr_sweep.record_code(str(run), first + "+dirty")
    assert lr_sweep.read_code(str(tmp_path / "elsewhere")) == "unrecorded"


def test_the_ladder_predicts_the_third_width_from_the_two_smallest():
    def width_runs(width, crossing):
        """Arm A at `width`, 2 seeds, the default's logit log-linear in the LR and 1e4 exactly at `crossing`."""
        runs = []
        for lr in sweep_arms.HALF_DECADES:
            for seed in (1, 2):
                # geometric mean on the line
                logit = 1e4 * (lr / crossing) ** 2 * (1.1 if seed == 1 else 1 / 1.1)
                runs.append(
                    _result("default", lr, seed, 3.2 + lr * 64 / width, logit=logit, width=width)
                )
                runs.append(_result("qk_layernorm", lr, seed, 3.3 + lr * 32 / width, width=width))
        return runs

    steps = sweep_report.ladder(
        width_runs(64, 0.08) + width_runs(128, 0.04), H2, targets=(64, 128, 256)
    )
    assert steps[64]["crossing"] == pytest.approx(0.08) and steps[128]["crossing"] == pytest.approx(
        0.04
    )
    assert steps[256]["n"] == 0 and "predicted" not in steps[128]
    guess = steps[256]["predicted"]
    # halves with each doubling
    assert guess["crossing"] == pytest.approx(0.02) and guess["from"] == (64, 128)
    # the sensitivity of each lever set: a straight line in log width through the two measured
    s64, s128 = steps[64]["sensitivity"]["default"], steps[128]["sensitivity"]["default"]
    assert guess["sensitivity"]["default"] == pytest.approx(2 * s128 - s64)
    assert s64 == pytest.approx(
        sweep_report.sensitivity({lr: 3.2 + lr for lr in sweep_arms.HALF_DECADES if lr <= 0.3})
    )
    table = sweep_report.ladder_markdown(steps)
    assert "| 256 | 0 | not run | 0.02 (from 64, 128) |" in table
    measured = sweep_report.ladder(
        width_runs(64, 0.08) + width_runs(128, 0.04) + width_runs(256, 0.015), H2
    )
    assert measured[256]["crossing"] == pytest.approx(0.015) and measured[256]["predicted"][
        "crossing"
    ] == pytest.approx(0.02)
    assert "| 256 | 28 | 0.015 | 0.02 (from 64, 128) |" in sweep_report.ladder_markdown(measured)
    # a seed not run at every width is left out of every width: like with like
    extra = [r for r in width_runs(128, 0.01) if r["seed"] == 1]
    for r in extra:
        r["seed"] = 3
    mixed = sweep_report.ladder(width_runs(64, 0.08) + width_runs(128, 0.04) + extra, H2)
    assert (
        mixed[128]["crossing"] == pytest.approx(0.04)
        and mixed[128]["n"] == 28
        and mixed[64]["seeds"] == [1, 2]
    )
    assert "over the seeds run at every width (1, 2)" in sweep_report.ladder_markdown(mixed)
    # no LR of the grid below the crossing: not extrapolated
    assert (
        sweep_report.logit_crossing(
            {
                1e-3: {"runs": {"attention_logit_max": [2e4]}},
                1e-2: {"runs": {"attention_logit_max": [3e4]}},
            }
        )
        is None
    )
    assert math.isclose(
        sweep_report.logit_crossing(
            {
                1e-3: {"runs": {"attention_logit_max": [1e3]}},
                1e-2: {"runs": {"attention_logit_max": [1e5]}},
            }
        ),
        10**-2.5,
    )


def test_a_width_of_the_ladder_runs_with_heads_of_32_in_its_own_directory():
    args = sweep_arms.train_args("A", "default", 1e-2, 1, "/x", width=256)
    cfg = sweep_arms.config_of(args)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_layers) == (256, 8, 4)
    assert (
        sweep_arms.width_of(args) == 256
        and sweep_arms.width_of(sweep_arms.train_args("A", "default", 1e-2, 1, "/x")) == 128
    )
    assert sweep_arms.run_dir("o", "A", "default", 1e-2, 1, 64) == os.path.join(
        "o", "runs", "w64", "A", "default", "lr1e-02-seed1"
    )
    assert sweep_arms.run_dir("o", "A", "default", 1e-2, 1) == os.path.join(
        "o", "runs", "A", "default", "lr1e-02-seed1"
    )
    with pytest.raises(SystemExit, match="arm C's init levers are defined at width 128"):
        sweep_arms.train_args("C", "init_0.63", 1e-2, 1, "/x", width=64)
    with pytest.raises(SystemExit, match="not a multiple of the head size 32"):
        sweep_arms.train_args("A", "default", 1e-2, 1, "/x", width=100)


def test_a_line_that_record_did_not_write_is_refused_by_its_number(tmp_path):
    path = tmp_path / "results.jsonl"
    good = json.dumps(sweep_report.record(_study()[0], CORPUS))
    path.write_text(good + "\n\n{not json\n")
    with pytest.raises(SystemExit, match=r"results.jsonl:3 is not JSON"):
        sweep_report.load_records(str(path))
    path.write_text(good + "\n" + json.dumps({"arm": "A", "lr": 0.1}) + "\n")
    with pytest.raises(
        SystemExit, match=r"results.jsonl:2 lacks lever_set, seed, width, code, val_loss, corpus"
    ):
        sweep_report.load_records(str(path))


def test_arm_w_s_short_warm_up_is_arm_a_s_default_run_and_recorded_once(tmp_path):
    # the same arguments, so the same runs: arm W reads arm A's default, never trains or records it again
    for lr in sweep_arms.HALF_DECADES:
        assert sweep_arms.train_args("W", "warmup_100", lr, 2, "/x") == sweep_arms.train_args(
            "A", "default", lr, 2, "/x"
        )
    short, long = (
        sweep_arms.config_of(sweep_arms.train_args("W", lever, 1e-2, 1, "/x"))
        for lever in ("warmup_100", "warmup_300")
    )
    assert (
        short.lr_warmup_samples // short.global_batch_size,
        long.lr_warmup_samples // long.global_batch_size,
    ) == (100, 300)
    assert (
        long.train_iters == 1000
        and long.lr_decay_samples == short.lr_decay_samples
        and long.z_loss == 1e-4
    )
    assert sweep_arms.preflight(sweep_arms.ARMS) == []
    # execute() goes to arm A's directory: a run there with other arguments is refused by its path
    taken = sweep_arms.run_dir(str(tmp_path), "A", "default", 1e-2, 1)
    # so a study skips it once finished
    assert sweep_arms.run_dir(str(tmp_path), "W", "warmup_100", 1e-2, 1) == taken
    os.makedirs(taken)
    with open(os.path.join(taken, "result.json"), "w") as f:
        json.dump({"args": ["--other"]}, f)
    with pytest.raises(
        SystemExit, match=os.path.join("runs", "A", "default", "lr1e-02-seed1") + " holds a run"
    ):
        lr_sweep.execute(str(tmp_path), "W", "warmup_100", 1e-2, 1)
    # from the tracked records: arm W's short warm-up row is arm A's default row, its runs counted once
    longer = [
        {**r, "arm": "W", "lever_set": "warmup_300", "val_loss": r["val_loss"] - 0.01}
        for r in _study()
        if r["lever_set"] == "default"
    ]
    path = str(tmp_path / "results.jsonl")
    sweep_report.merge_records(path, [sweep_report.record(r, CORPUS) for r in [*_study(), *longer]])
    lr_sweep.main(
        ["--report", "--results", path, "--arms", "A,W", "--out", str(tmp_path / "report")]
    )
    table = (tmp_path / "report" / "results.md").read_text()
    assert table.startswith("45 of the selection's 63 runs") and "at width 128: 45 runs." in table
    a, w = table.split("### Arm W")
    rows = [line.split(" | ", 1)[1] for line in a.splitlines() if line.startswith("| default |")]
    assert len(rows) == 3 and all(
        any(line == f"| warmup_100 | {row}" for line in w.splitlines()) for row in rows
    )
    assert len(sweep_report.load_records(path)) == 45  # a report writes no record
    lr_sweep.main(["--report", "--results", path, "--arms", "W", "--out", str(tmp_path / "w")])
    assert (tmp_path / "w" / "results.md").read_text().startswith("30 of the selection's 42 runs")
