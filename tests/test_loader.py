"""loader.py: batches prepared on a background thread are exactly the batches computed on the spot."""

import os

import numpy as np
import pytest
import torch

import arguments
import data
import loader
from helpers import SMALL, corpus, plan_of, run_main  # noqa: F401 (corpus: a fixture)
from run_state import RunState
from sections import section


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("loader")
    rng = np.random.default_rng(0)
    # empty and short documents included
    docs = [rng.integers(0, 50257, n) for n in rng.integers(0, 90, 60)]
    data.write_indexed_dataset(str(tmp / "corpus"), docs)
    return data.GPTDataset(
        data.IndexedDataset(str(tmp / "corpus")), np.arange(60), 2000, 32, 5, "train", str(tmp)
    )


def reference(dataset, first_sample, batch_size, seqlen, mbs, dp_rank, dp_size):
    """The micro-batches as train.micro_batches built them before loader.py: np.stack of dataset[i], per sample."""
    out = []
    for k in range(batch_size // (mbs * dp_size)):
        start = first_sample + k * mbs * dp_size + dp_rank * mbs
        tokens = np.stack([dataset[start + i] for i in range(mbs)])
        out.append((tokens[:, :-1][:, :seqlen], tokens[:, 1:][:, :seqlen]))
    return out


def test_prefetched_batches_equal_direct_ones_across_rampup_curriculum_and_skips(dataset):
    cfg = arguments.load_config(
        [
            "--seq_length=32",
            "--micro_batch_size=2",
            "--global_batch_size=16",
            "--rampup_batch_size=4 4 60",
            "--train_iters=none",
            "--train_samples=400",
            "--curriculum_learning",
            "--min_difficulty=8",
            "--total_curriculum_step=12",
            "--skip_train_iteration_range",
            "4-5",
            "9-9",
            "20-21",
        ]
    )
    arguments.prepare(cfg, world_size=2)
    dp_size, mbs = 2, cfg.micro_batch_size
    plan = plan_of(cfg, dp_size)
    seen = {"batch sizes": set(), "seqlens": set(), "skipped": 0, "wrong guesses": 0}
    for dp_rank in range(dp_size):
        loads = []

        def load(key):
            loads.append(key)
            _, first, batch_size, seqlen = key
            return loader.load_tokens(
                dataset, first, batch_size // (mbs * dp_size), seqlen, mbs, dp_rank, dp_size
            )

        with loader.Prefetcher(load, plan.next_key) as prefetcher:
            iteration = samples = tokens = 0
            # the training loop's bookkeeping
            while not plan.done(RunState(iteration, samples, tokens)):
                iteration += 1
                batch_size, seqlen = plan.batch_size(samples), plan.seqlen(iteration)
                if plan.skipped(iteration):
                    seen["skipped"] += 1
                else:
                    got = loader.to_device(
                        prefetcher.get((iteration, samples, batch_size, seqlen)), "cpu"
                    )
                    want = reference(dataset, samples, batch_size, seqlen, mbs, dp_rank, dp_size)
                    assert len(got) == len(want)
                    for (x, y), (rx, ry) in zip(got, want):
                        assert x.dtype == torch.int64 and x.shape == (mbs, seqlen)
                        assert np.array_equal(x.numpy(), rx) and np.array_equal(y.numpy(), ry)
                    seen["batch sizes"].add(batch_size)
                    seen["seqlens"].add(seqlen)
                samples, tokens = samples + batch_size, tokens + batch_size * seqlen
        # every iteration that trained was loaded exactly once (ahead of time except the first): no guess was wrong
        assert len(loads) == len(set(loads)) == plan.total_iters - 5
    assert (
        seen["batch sizes"] == {4, 8, 12, 16}
        and len(seen["seqlens"]) >= 3
        and seen["skipped"] == 2 * 5
    )


def test_wrong_guesses_and_errors(dataset):
    def load(key):
        if key < 0:
            raise KeyError(f"bad key {key}")
        return key * 10

    with loader.Prefetcher(load, lambda k: k + 1 if k < 5 else None) as prefetcher:
        assert prefetcher.get(0) == 0 and prefetcher.get(1) == 10
        # not the guess (2): dropped, loaded on the spot, then 5 guessed
        assert prefetcher.get(4) == 40
        # a step back (a rollback) works too
        assert prefetcher.get(5) == 50 and prefetcher.get(3) == 30
        with pytest.raises(KeyError, match="bad key -1"):
            prefetcher.get(-1)
    # a failing guess past the end is never seen; the exception of a requested key surfaces in the caller
    with loader.Prefetcher(load, lambda k: k - 1) as prefetcher:
        assert prefetcher.get(1) == 10 and prefetcher.get(0) == 0
        with pytest.raises(KeyError, match="bad key -1"):
            prefetcher.get(-1)
    with pytest.raises(IndexError, match="requested from the train dataset"):
        loader.load_tokens(dataset, len(dataset) - 3, 4, 8, 2, 0, 1)


def test_prefetch_thread_stops_on_close_and_when_dropped():
    # its own thread, not the process's count of threads: another test's may start or end meanwhile
    prefetcher = loader.Prefetcher(lambda k: k, lambda k: k + 1)
    thread = prefetcher.thread
    assert prefetcher.get(0) == 0 and thread.is_alive()
    prefetcher.close()
    assert not thread.is_alive()
    prefetcher = loader.Prefetcher(lambda k: k, lambda k: k + 1)
    thread = prefetcher.thread
    assert thread.daemon  # never holds up the interpreter's exit
    del prefetcher
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_blended_gather_equals_getitem(dataset):
    blend = data.BlendedDataset([dataset, dataset], [0.3, 0.7], 500)
    index = np.random.default_rng(1).integers(0, len(blend), 64)
    out = np.empty((64, 20), np.int64)
    blend.gather(index, out)
    assert np.array_equal(out, np.stack([blend[i][:20] for i in index]))


# -----------------------------------------------------------------------------
# The data's keys, refused before anything is built


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--split=98:1:1"], r"^split '98:1:1' must be up to three comma-separated numbers"),
        (
            ["--split=0,100,0"],
            r"^split '0,100,0' gives training no documents; give train a share .*, or use --eval_only$",
        ),
        (
            ["--split=100,0,0", "--eval_iters=10"],
            r"^eval_iters=10 does nothing with split '100,0,0': it gives validation no documents; "
            r"give validation a share .*, or set eval_iters=0",
        ),
        (
            ["--split=100,0,0", "--eval_only"],
            r"^eval_only: no validation data \(split '100,0,0', eval_iters 10\)",
        ),
        (["--seed=-1"], r"^seed=-1 must be in \[0, 2\*\*32 - 1\]"),
        ([f"--seed={2**32}"], r"^seed=4294967296 must be in \[0, 2\*\*32 - 1\]"),
        (
            ["--data_path=data/x.bin"],
            r"^data_path gives 'data/x.bin', a file's name, not a prefix: drop the suffix \(data/x: ",
        ),
        (["--data_path=data/x.idx"], r"^data_path gives 'data/x.idx', .*drop the suffix"),
        (
            ["--data_path", "0.7", "data/a", "data/b"],
            r"^data_path .* must be one prefix or a blend",
        ),
        (
            ["--data_path", "data/a", "0.7", "data/b", "0.3"],
            r"^data_path .* must be one prefix or a blend .*\(weights first",
        ),
        (
            ["--data_path", "0.5", "data/a", "0.2", "data/b", "0.3", "./data/a"],
            r"^data_path .* gives the corpus ./data/a twice \(data/a before\): both would draw the "
            r"same samples in the same order; give it once, with the sum of its weights \(0.8\)$",
        ),
        (["--data_path", "0.5", "data/a", "0.5", "data/a"], r"gives the corpus data/a twice"),
    ],
)
def test_data_keys_that_cannot_work_are_refused_by_name_before_anything_is_built(flags, message):
    """Each failed once the model was built (a malformed split or blend, the prefix's suffix: the hint
    to re-run preprocessing with --output-prefix data/x.bin), at the first batch (no training
    documents: an AttributeError), in numpy's words (the seed), or not at all (validation dropped
    without a word): loader.check names the key, in arguments.validate."""
    cfg = arguments.load_config(["--train_iters=1", "--eval_iters=10", *flags])
    with pytest.raises(ValueError, match=message):
        arguments.validate(cfg)


def test_the_seed_is_checked_without_data_and_a_split_without_validation_passes_without_it():
    """The seed draws the initialization too: refused for a run without data (bench's random tokens). A split
    with no validation share is a run without validation when eval_iters is 0."""
    with pytest.raises(ValueError, match=r"^seed=-1 must be in"):
        arguments.validate(arguments.load_config(["--seed=-1"]), reads_data=False)
    arguments.validate(arguments.load_config(["--split=100,0,0", "--eval_iters=0"]))
    arguments.validate(arguments.load_config(["--split=0,100,0", "--eval_only"]))


def test_a_missing_prefix_is_refused_by_name_with_the_corpus_of_a_close_name(tmp_path):
    """A prefix whose files are not there, when the source opens it: the corpus beside it of the
    closest name is offered, where data.IndexedDataset said to re-run preprocessing."""
    data.write_indexed_dataset(str(tmp_path / "shakespeare-v2"), [[1, 2, 3]])
    cfg = arguments.load_config([f"--data_path={tmp_path}/shakespeare", "--train_iters=1"])
    data_cfg, context = section(loader.DataConfig, cfg), section(loader.DataContext, cfg)
    with pytest.raises(
        ValueError,
        match=rf"^{tmp_path}/shakespeare.bin/.idx not found \(did you mean "
        rf"{tmp_path}/shakespeare-v2\?\); fix data_path",
    ):
        loader.MegatronSource(data_cfg, context, (16, 0))


def test_a_run_refuses_a_missing_prefix_before_the_model_is_built(tmp_path):
    """train.py checks the files right after the config: it built the model first (minutes on every rank of a
    large model) and created the save directory. The config alone passes: it is validated where its data is
    not (the lab's preflight)."""
    from helpers import run_cli

    args = [f"--data_path={tmp_path}/typo", "--train_iters=1", f"--save={tmp_path / 'run'}"]
    arguments.prepare(arguments.load_config(args))
    proc = run_cli(*args, expect_ok=False)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"error: {tmp_path}/typo.bin/.idx not found; fix data_path, or tokenize the corpus with `python data.py "
        f"--input FILES --output-prefix {tmp_path}/typo`"
    )
    assert "Model size" not in proc.stdout and not os.path.exists(tmp_path / "run")


def test_data_the_run_cannot_read_is_refused_before_the_model_is_built(
    corpus, tmp_path, monkeypatch
):
    """An index of another format, an empty train split, an empty validation split the run evaluates on: each
    was refused after the model's build (minutes at scale), the empty train split after a warning that the run
    goes over it 4096 times. The preflight reads the index only (train.main: loader.check_files)."""
    import builders

    def build(*args, **kwargs):
        raise AssertionError("built before the refusal")

    monkeypatch.setattr(builders, "build", build)
    bad = tmp_path / "bad"
    (tmp_path / "bad.bin").write_bytes(b"\0" * 64)
    (tmp_path / "bad.idx").write_bytes(b"not an index at all")
    for flags, message in (
        ([f"--data_path={bad}"], r"bad\.idx is not a Megatron mmap index \(bad magic"),
        (
            [f"--data_path={corpus}", "--split=1,999,0"],
            r"the train split of .* is empty \(38 documents, split '1,999,0'\) but the run reads train",
        ),
        ([f"--data_path={corpus}", "--split=999,1,0"], r"the valid split of .* is empty"),
    ):
        with pytest.raises(ValueError, match=message):
            run_main(*SMALL, "--train_iters=1", *flags)
    # no validation: the empty validation split is not read
    with pytest.raises(AssertionError, match="built before the refusal"):
        run_main(
            *SMALL, "--train_iters=1", f"--data_path={corpus}", "--split=999,1,0", "--eval_iters=0"
        )
