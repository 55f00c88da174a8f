"""Named validation sets (valid_weighted_split_names / _paths, Megatron-DeepSpeed's; BigScience's PR #97).

One run on a blend of two corpora validates four named sets: the blend itself, each component, and a corpus the
run does not train on. Each set's loss is checked against training.evaluate run by hand, at the same moment, on
that set alone built straight from data.build_datasets; the set of the whole blend against the old blended
validation of a run without names (and that run's training losses against this one's); a resumed run and
eval_only against the uninterrupted run's numbers; and bad names and paths against their messages.
"""

import os
import re

import numpy as np
import pytest

import arguments
import data
import loader
import report
import training
from helpers import (  # noqa: F401 (fixtures)
    SMALL,
    corpus,
    corpus512,
    data_of,
    log_fields,
    plan_of,
    run_cli,
    run_main,
    synthetic_corpus,
)
from sections import section

# the split, seq_length, seed; eval_iters x global batch
SPLIT, SEQ, SEED, SAMPLES = "949,50,1", 64, 1234, 2 * 8
NAMES = ["all", "shakespeare", "synthetic", "heldout"]


@pytest.fixture(scope="module")
def heldout(tmp_path_factory):
    """A third corpus, in no run's data_path: a named set reads all of its documents."""
    rng = np.random.default_rng(1)
    docs = [
        ((rng.integers(0, 512) + 3 * np.arange(rng.integers(30, 90))) % 512).astype(np.uint16)
        for _ in range(40)
    ]
    prefix = str(tmp_path_factory.mktemp("heldout") / "heldout")
    data.write_indexed_dataset(prefix, docs)
    return prefix


@pytest.fixture(scope="module")
def sets(corpus512, synthetic_corpus, heldout):
    blend = f"0.5 {corpus512} 0.5 {synthetic_corpus}"
    paths = [blend, corpus512, synthetic_corpus, heldout]
    args = [
        *SMALL,
        "--vocab_size=512",
        f"--data_path={blend}",
        f"--split={SPLIT}",
        "--train_iters=4",
        "--eval_interval=2",
    ]
    return args, ["--valid_weighted_split_names", *NAMES, "--valid_weighted_split_paths", *paths]


def metrics(directory):
    """{iteration: record} of metrics.jsonl's timeline (a resumed run appends)."""
    return report.read_metrics(os.path.join(directory, "metrics.jsonl"))


def by_hand(prefixes, split):
    """The validation samples of one set, built straight from data.py: what the set must read."""
    return data.build_datasets(prefixes, split, SEQ, SEED, (0, SAMPLES, 0))[1]


@pytest.fixture(scope="module")
def named_run(sets, corpus512, synthetic_corpus, heldout, tmp_path_factory):
    """(stdout, save directory, [(logged loss, the by-hand reference)] per evaluation) of the run with the four
    sets: each call of evaluate is followed by evaluate on its set built by hand, on the model of that moment."""
    args, named = sets
    references = [
        by_hand(["0.5", corpus512, "0.5", synthetic_corpus], SPLIT),
        by_hand([corpus512], SPLIT),
        # heldout: all its documents
        by_hand([synthetic_corpus], SPLIT),
        by_hand([heldout], "0,1,0"),
    ]
    seen, evaluate = [], training.evaluate

    def evaluate_and_the_reference(model, dataset, cfg, device):
        loss = evaluate(model, dataset, cfg, device)
        seen.append((loss, evaluate(model, references[len(seen) % len(NAMES)], cfg, device)))
        return loss

    save = tmp_path_factory.mktemp("named")
    training.evaluate = evaluate_and_the_reference  # where train.py looks it up
    try:
        out = run_main(*args, *named, f"--save={save}")
    finally:
        training.evaluate = evaluate
    return out, save, seen


def test_each_named_set_is_logged_and_equals_evaluate_on_that_set_alone(named_run):
    out, save, seen = named_run
    assert len(seen) == 2 * len(NAMES)  # iterations 2 and 4, each set once
    assert all(logged == reference for logged, reference in seen), seen
    records = metrics(save)
    for k, (iteration, name) in enumerate((i, n) for i in (2, 4) for n in NAMES):
        loss = seen[k][0]
        assert records[iteration][f"validation lm loss/{name}"] == loss
        assert records[iteration][f"validation ppl/{name}"] == pytest.approx(
            np.exp(loss), rel=1e-12
        )
        value = re.escape(f"{loss:.6E}")
        assert re.search(
            rf"^ {name} loss at iteration {iteration} \| lm loss value: {value} \| lm loss PPL: ",
            out,
            re.M,
        )
    # no blended set
    assert "validation loss at iteration" not in out and "validation lm loss" not in records[4]
    # four different sets, not one read four times
    assert len({loss for loss, _ in seen[4:]}) == len(NAMES)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(save / "tensorboard"))
    events.Reload()
    for name in NAMES:
        assert [(e.step, e.value) for e in events.Scalars(f"valid-lm-loss/{name}")] == [
            (i, pytest.approx(records[i][f"validation lm loss/{name}"], rel=1e-6)) for i in (2, 4)
        ]
    events = EventAccumulator(
        str(save / "tensorboard" / "samples")
    )  # each axis in a directory of its own
    events.Reload()
    for name in NAMES:
        assert [e.step for e in events.Scalars(f"valid-ppl/{name} vs samples")] == [16, 32]


def test_the_set_of_the_whole_blend_is_the_old_blended_validation(named_run, sets, tmp_path):
    out, save, _ = named_run
    args, _ = sets
    plain = run_main(*args, f"--save={tmp_path}")  # no names: the blended validation, as before
    old, new = metrics(tmp_path), metrics(save)
    for iteration in (2, 4):
        assert old[iteration]["validation lm loss"] == new[iteration]["validation lm loss/all"]
    assert {i: f["lm loss"] for i, f in log_fields(plain).items()} == {
        i: f["lm loss"] for i, f in log_fields(out).items()
    }


def test_a_resumed_run_evaluates_the_same_samples(named_run, sets, tmp_path):
    _, save, _ = named_run
    args, named = sets
    run_main(*args, *named, f"--save={tmp_path}", "--exit_interval=2")
    resumed = run_main(*args, *named, f"--save={tmp_path}")
    assert "resum" in resumed.lower() and sorted(log_fields(resumed)) == [3, 4]
    straight, split = metrics(save), metrics(tmp_path)
    for iteration in (2, 4):
        for name in NAMES:
            key = f"validation lm loss/{name}"
            assert split[iteration][key] == straight[iteration][key], (iteration, name)


def test_eval_only_reports_every_set(named_run, sets):
    _, save, seen = named_run
    args, named = sets
    out = run_main(*args, *named, f"--load={save}", f"--save={save}", "--eval_only")
    for name, (loss, _) in zip(NAMES, seen[4:]):
        assert re.search(
            rf"^ {name} loss at iteration 4 \| lm loss value: {re.escape(f'{loss:.6E}')} \|",
            out,
            re.M,
        )
    assert log_fields(out) == {}


def config(*more):
    return arguments.load_config([*SMALL, "--vocab_size=512", "--train_iters=2", *more])


def test_bad_names_and_paths_are_refused_with_the_fix(corpus512, heldout, tmp_path):
    for more, message in [
        (
            ["--valid_weighted_split_names", "a", "b", f"--valid_weighted_split_paths={corpus512}"],
            r"names 2 validation set\(s\) but valid_weighted_split_paths gives 1 path\(s\): give one path per name",
        ),
        (
            [f"--valid_weighted_split_paths={corpus512}"],
            r"names 0 validation set\(s\) but .* gives 1 path",
        ),
        (
            [
                "--valid_weighted_split_names",
                "a",
                "a",
                "--valid_weighted_split_paths",
                corpus512,
                heldout,
            ],
            r"'a' is given twice; give each set its own name",
        ),
        (
            ["--valid_weighted_split_names=a|b", f"--valid_weighted_split_paths={corpus512}"],
            r"'a\|b' is not a name; give each set its own name of letters",
        ),
        (
            ["--valid_weighted_split_names=a", f"--valid_weighted_split_paths={tmp_path}/nothere"],
            r"validation set 'a': .*nothere.bin/.idx not found; fix its entry in valid_weighted_split_paths",
        ),
        (
            [
                "--valid_weighted_split_names",
                "a",
                "b",
                "--valid_weighted_split_paths",
                f"0.5 {corpus512} 0.5",
                corpus512,
            ],
            r"validation set 'a': data_path .* must be one prefix or a blend",
        ),
    ]:
        with pytest.raises(ValueError, match=message):
            arguments.prepare(config(f"--data_path={corpus512}", *more))


def test_a_set_without_validation_documents_is_refused_when_opened(corpus512, heldout, tmp_path):
    data.write_indexed_dataset(str(tmp_path / "empty"), [])
    for more, message in [
        (
            [
                "--split=100,0,0",
                "--valid_weighted_split_names=a",
                f"--valid_weighted_split_paths={corpus512}",
            ],
            r"validation set 'a' has no validation documents: .* split '100,0,0' gives validation none of its 38 "
            r"documents; give validation a share of split",
        ),
        (
            ["--valid_weighted_split_names=a", f"--valid_weighted_split_paths={tmp_path}/empty"],
            r"validation set 'a' has no validation documents: .*empty holds none",
        ),
        (
            [
                "--valid_weighted_split_names",
                "a",
                "b",
                "--valid_weighted_split_paths",
                f"0.5 {corpus512} 0.5 {heldout}",
                corpus512,
            ],
            r"validation set 'a' blends corpora of data_path with others .* make them two sets",
        ),
    ]:
        cfg = arguments.prepare(config(f"--data_path={corpus512}", *more))
        with pytest.raises(ValueError, match=message):
            data_of(cfg, plan_of(cfg))


def preflight(cfg):
    """train.main's check of the data files, before the process group and the save directory."""
    loader.check_files(section(loader.DataConfig, cfg), section(loader.DataContext, cfg))


def test_the_preflight_checks_the_sets_and_not_the_validation_split_they_replace(
    corpus512, heldout, tmp_path
):
    """A set without validation documents was refused only when the data was opened: after the process group,
    with the save directory made (train.py left it behind, empty); one too short for a sample, at the build.
    With named sets, data_path's own validation split, which no set reads, was refused when empty ('but the run
    reads valid samples'), at the preflight and again at the open: the fix it gave (a larger share) took training
    documents for nothing. The preflight (loader.check_files) now checks the sets, and only them."""
    data.write_indexed_dataset(str(tmp_path / "short"), [[1, 2, 3]])
    for more, message in [
        (
            [
                "--split=100,0,0",
                "--valid_weighted_split_names=a",
                f"--valid_weighted_split_paths={corpus512}",
            ],
            r"^validation set 'a' has no validation documents: .* split '100,0,0' gives validation none",
        ),
        (
            ["--valid_weighted_split_names=a", f"--valid_weighted_split_paths={tmp_path}/short"],
            r"^validation set 'a': the valid split of .*short \(documents 0..0, 3 tokens\) cannot fill one sample",
        ),
    ]:
        with pytest.raises(ValueError, match=message):
            preflight(arguments.prepare(config(f"--data_path={corpus512}", *more)))
    # 38 documents: split 999,1,0 gives data_path's validation none, which only the blended validation reads
    cfg = arguments.prepare(
        config(
            f"--data_path={corpus512}",
            "--split=999,1,0",
            "--valid_weighted_split_names=h",
            f"--valid_weighted_split_paths={heldout}",
        )
    )
    preflight(cfg)
    _, valid = data_of(cfg, plan_of(cfg))
    assert list(valid) == ["h"] and len(valid["h"]) >= SAMPLES


def test_the_command_line_stops_with_one_line(corpus512):
    proc = run_cli(
        *SMALL,
        "--vocab_size=512",
        f"--data_path={corpus512}",
        "--valid_weighted_split_names",
        "a",
        "b",
        f"--valid_weighted_split_paths={corpus512}",
        expect_ok=False,
    )
    assert (
        proc.returncode == 2
        and "give one path per name" in proc.stderr
        and "Traceback" not in proc.stderr
    )
