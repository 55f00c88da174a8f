"""A new data source is one file and one registry line (loader.DataSource): the source below, a .npy file of token
ids, is docs/data.md's example verbatim; registered here, it is checked, loaded, prefetched, trained on, and its
documents skipped, with nothing else changed."""

import dataclasses
import os
import re

import numpy as np
import pytest
import torch

import arguments
import data
import loader
from helpers import (  # noqa: F401 (corpus, corpus_copy: fixtures)
    ROOT,
    corpus,
    corpus_copy,
    data_of,
    log_fields,
    plan_of,
    run_main,
)
from sections import section
from stability import skip_list


# -- the example of docs/data.md, "A new data source" ------------------------------------------------------------
class NpyTokens:
    """data_path: one .npy file of token ids, every document ending in data.EOD. Samples of
    seq_length + 1 tokens, one every seq_length tokens of the split's documents in file order, again
    from the start when they run out. data_cfg: the data's keys (loader.DataConfig); context: the
    model's seq_length and vocab_size (loader.DataContext)."""

    @staticmethod
    def check(data_cfg, context):
        path = data_cfg.data_path
        if not path or len(path) != 1 or not path[0].endswith(".npy"):
            raise ValueError(
                f"data_source=npy reads one .npy file of token ids, not "
                f"data_path={path}; set data_path=FILE.npy"
            )

    def __init__(self, data_cfg, context, num_samples):
        self.split, self.seq_length = data_cfg.split, context.seq_length
        self.num_samples, self.path = num_samples, data_cfg.data_path[0]
        self.tokens = np.load(self.path, mmap_mode="r")
        top = self.tokens.max()
        if top >= context.vocab_size:
            raise ValueError(
                f"{self.path} holds token id {top}, at or above vocab_size "
                f"{context.vocab_size}; set vocab_size to at least {top + 1}"
            )
        # document d is tokens[bounds[d]:bounds[d + 1]]
        self.bounds = np.concatenate([[0], np.flatnonzero(self.tokens == data.EOD) + 1])

    def documents(self):
        return [(self.path, len(self.bounds) - 1)]

    def build(self, skips):
        splits = data.split_documents(self.split, len(self.bounds) - 1)
        skip = skips[0] if skips else []
        sets = [
            Windows(
                self.path,
                self.tokens,
                self.bounds,
                np.setdiff1d(np.arange(*docs), skip),
                n,
                self.seq_length,
            )
            if n
            else None
            for docs, n in zip(splits, self.num_samples)
        ]
        return sets[0], sets[1]


class Windows:
    """A data.TokenSource: documents `ids` of `tokens` back to back; sample i is the window of seq_length + 1 tokens
    at (i mod the windows there are) * seq_length. Gathered by one numpy fancy index, no Python work per token."""

    def __init__(self, name, tokens, bounds, ids, num_samples, seq_length):
        self.name, self.ids, self.num_samples, self.seq_length = name, ids, num_samples, seq_length
        self.stream = np.concatenate([tokens[bounds[d] : bounds[d + 1]] for d in ids]).astype(
            np.int64
        )
        # of each document in stream
        self.starts = np.concatenate([[0], np.cumsum(bounds[ids + 1] - bounds[ids])])
        self.windows = (len(self.stream) - 1) // seq_length
        if self.windows < 1:
            raise ValueError(
                f"{name}: {len(ids)} documents cannot fill a sample; use more data or a larger share"
            )

    def __len__(self):
        return self.num_samples

    def gather(self, indices, out):
        indices = np.asarray(indices, dtype=np.int64)
        if len(indices) and (indices.min() < 0 or indices.max() >= len(self)):
            raise IndexError(f"samples {indices.min()}..{indices.max()} requested from {len(self)}")
        out[:] = self.stream[
            (indices % self.windows * self.seq_length)[:, None] + np.arange(out.shape[1])
        ]

    def provenance(self, index, length=None):
        start = index % self.windows * self.seq_length
        end = start + (self.seq_length + 1 if length is None else length)
        k, pieces = np.searchsorted(self.starts, start, side="right") - 1, []
        while self.starts[k] < end:  # the documents the window [start, end) overlaps
            lo, hi = max(start, self.starts[k]), min(end, self.starts[k + 1])
            pieces.append((int(self.ids[k]), int(lo - self.starts[k]), int(hi - lo)))
            k += 1
        return data.Provenance(self.name, 0, pieces)


loader.register_source("npy", NpyTokens)
# -- end of the example ------------------------------------------------------------------------------------------


SEQ = 16


@pytest.fixture(scope="module")
def npy(tmp_path_factory):
    """(path, documents) of a .npy token file: document d's tokens are d * 100 + 0, 1, 2, ..., then data.EOD, so
    every token names its document."""
    rng = np.random.default_rng(0)
    documents = [np.append(d * 100 + np.arange(rng.integers(1, 60)), data.EOD) for d in range(200)]
    path = str(tmp_path_factory.mktemp("npy") / "tokens.npy")
    np.save(path, np.concatenate(documents).astype(np.uint16))
    return path, documents


def npy_config(path, *more):
    cfg = arguments.load_config(
        [
            "--data_source=npy",
            f"--data_path={path}",
            "--split=90,10,0",
            f"--seq_length={SEQ}",
            "--micro_batch_size=2",
            "--global_batch_size=8",
            "--train_iters=20",
            "--eval_interval=10",
            "--eval_iters=2",
            *more,
        ]
    )
    return arguments.prepare(cfg)


def split_stream(documents, split, skip=()):
    """The train split's documents back to back, less the skipped ones: what its samples are cut from."""
    start, end = data.split_documents(split, len(documents))[0]
    return np.concatenate([documents[d] for d in range(start, end) if d not in skip])


def test_the_loop_loads_and_prefetches_the_new_sources_batches(npy):
    path, documents = npy
    cfg = npy_config(path)  # arguments.validate runs the source's check
    plan = plan_of(cfg)
    train, valid = data_of(cfg, plan)
    assert isinstance(train, data.TokenSource) and isinstance(valid, data.TokenSource)
    assert len(train) == plan.total_samples and len(valid) == cfg.eval_iters * cfg.global_batch_size
    stream, device = split_stream(documents, cfg.split), torch.device("cpu")
    windows = (len(stream) - 1) // SEQ
    with loader.batch_prefetcher(train, plan, device) as prefetcher:
        for iteration in range(1, plan.total_iters + 1):
            first = (iteration - 1) * cfg.global_batch_size
            batches = loader.micro_batches(train, first, 4, cfg.micro_batch_size, SEQ, device)
            prefetched = loader.to_device(
                prefetcher.get((iteration, first, cfg.global_batch_size, SEQ)), device
            )
            for k, ((x, y), (px, py)) in enumerate(zip(batches, prefetched)):
                assert torch.equal(x, px) and torch.equal(y, py)
                for row, sample in zip(x.numpy(), range(first + 2 * k, first + 2 * k + 2)):
                    start = sample % windows * SEQ
                    assert np.array_equal(row, stream[start : start + SEQ]), sample
    # the data-source contract (tests/test_token_source.py): a sample is what its provenance names
    out = np.empty((len(train), SEQ + 1), np.int64)
    train.gather(np.arange(len(train)), out)
    for index in range(len(train)):
        name, component, pieces = train.provenance(index)
        assert (name, component) == (path, 0)
        assert np.array_equal(
            out[index], np.concatenate([documents[d][o : o + n] for d, o, n in pieces])
        )


def test_skip_lists_leave_the_new_sources_documents_out(npy, tmp_path):
    path, documents = npy
    cfg = npy_config(path)
    plan = plan_of(cfg)
    train, _ = data_of(cfg, plan)
    culprits = [d for index in (3, 7) for d, _ in skip_list.sample_documents(train, index)[2]]
    skip_path = str(tmp_path / "skip_documents.jsonl")
    skip_list.append(skip_path, [{"dataset": path, "documents": culprits}])
    asked = []

    # as the skip-list callback reads the list: with the source's counts
    def documents_to_skip(
        collections,
    ):
        asked.append(collections)
        return skip_list.read(skip_path, [n for n, _ in collections], [c for _, c in collections])[
            0
        ]

    train, _ = data_of(cfg, plan, documents_to_skip)
    assert asked == [[(path, len(documents))]]
    out = np.empty((len(train), SEQ + 1), np.int64)
    train.gather(np.arange(len(train)), out)
    seen = set(np.unique(out[out != data.EOD] // 100).tolist())
    assert not seen & set(culprits) and len(seen) > 50
    stream = split_stream(documents, cfg.split, skip=set(culprits))
    assert np.array_equal(out[0], stream[: SEQ + 1])


def test_a_run_trains_on_the_new_source(npy):
    path, _ = npy
    out = run_main(
        "--num_layers=1",
        "--hidden_size=32",
        "--num_attention_heads=2",
        f"--seq_length={SEQ}",
        "--micro_batch_size=2",
        "--global_batch_size=4",
        "--train_iters=3",
        "--eval_interval=3",
        "--eval_iters=1",
        "--log_interval=1",
        "--sample_tokens=0",
        "--save=none",
        "--save_interval=none",
        "--data_source=npy",
        f"--data_path={path}",
        "--split=90,10,0",
    )
    assert sorted(log_fields(out)) == [1, 2, 3] and all(
        "lm loss" in f for f in log_fields(out).values()
    )
    assert re.search(r"validation loss at iteration 3 \| lm loss value: \S+", out)


def test_bad_sources_and_keys_are_refused_with_the_fix(npy, monkeypatch):
    path, _ = npy
    # what this test registers goes with it
    monkeypatch.setattr(loader, "SOURCES", dict(loader.SOURCES))
    with pytest.raises(
        ValueError, match=r"data_source 'nope' is not a registered data source \(megatron, npy\)"
    ):
        arguments.prepare(arguments.load_config(["--data_source=nope"]))
    with pytest.raises(ValueError, match="set data_path=FILE.npy"):
        npy_config(path.replace(".npy", ".bin"))
    with pytest.raises(ValueError, match="at or above vocab_size 512; set vocab_size to at least"):
        data_of(npy_config(path, "--vocab_size=512"), plan_of(npy_config(path)))
    with pytest.raises(
        ValueError,
        match="data_source 'npy' has no named validation sets "
        "\\(valid_weighted_split_names is set\\): drop",
    ):
        npy_config(path, "--valid_weighted_split_names=a", f"--valid_weighted_split_paths={path}")

    class Other(NpyTokens):
        pass

    with pytest.raises(ValueError, match="data_source 'npy' is NpyTokens already"):
        loader.register_source("npy", Other)

    class Bare:
        pass

    with pytest.raises(ValueError, match="Bare lacks check, documents, build of loader.DataSource"):
        loader.register_source("bare", Bare)


def test_megatron_is_the_first_source_and_the_default(corpus, corpus_copy):
    cfg = arguments.prepare(
        arguments.load_config(
            [
                f"--data_path={corpus}",
                f"--seq_length={SEQ}",
                "--train_iters=5",
                "--global_batch_size=8",
                "--micro_batch_size=2",
                "--eval_iters=1",
            ]
        )
    )
    assert cfg.data_source == "megatron" and loader.SOURCES["megatron"] is loader.MegatronSource
    data_cfg, context = section(loader.DataConfig, cfg), section(loader.DataContext, cfg)
    assert (data_cfg.data_path, context.seq_length) == ([corpus], SEQ)
    blended = dataclasses.replace(data_cfg, data_path=["0.5", corpus, "0.5", corpus_copy])
    blend = loader.MegatronSource(blended, context, (8, 0))
    # a skip list's entry per blend component
    assert [name for name, _ in blend.documents()] == [corpus, corpus_copy]
    plan = plan_of(cfg)
    train, valid = data_of(cfg, plan)
    want = data.build_datasets([corpus], cfg.split, SEQ, cfg.seed, (plan.total_samples, 8, 0))
    for got, expected in zip((train, valid), want):
        a, b = (np.empty((len(expected), SEQ + 1), np.int64) for _ in range(2))
        got.gather(np.arange(len(expected)), a)
        expected.gather(np.arange(len(expected)), b)
        assert len(got) == len(expected) and np.array_equal(a, b)


def test_the_doc_example_is_this_files_source():
    with open(os.path.join(ROOT, "docs", "data.md"), encoding="utf-8") as f:
        doc = f.read()
    section = doc[doc.index("## A new data source") :]
    example = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    with open(__file__, encoding="utf-8") as f:
        here = f.read()
    here = here[here.index("class NpyTokens:") : here.index("# -- end of the example")]
    assert example.strip() == here.strip()


def test_the_data_declares_each_key_once():
    """The sources read DataConfig, the data's keys, and a DataContext of other owners' values: no
    key of the run config is declared a second time in loader.py (#49: MegatronKeys re-declared
    11)."""
    import inspect

    data_keys = {f.name for f in dataclasses.fields(loader.DataConfig)}
    given = {f.name for f in dataclasses.fields(loader.DataContext)} - {"config_file"}
    assert given <= set(arguments.FIELDS) and not given & data_keys  # another owner's, passed in
    for name, cls in inspect.getmembers(loader, dataclasses.is_dataclass):
        if cls not in (loader.DataConfig, loader.DataContext):
            again = {f.name for f in dataclasses.fields(cls)} & set(arguments.FIELDS)
            assert not again, f"loader.{name} declares {sorted(again)} again"
