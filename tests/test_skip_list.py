"""Skip lists (skip_list.py): the documents behind a data-driven spike, written by the guard, left out by data.py."""

import json
import os
import re

import numpy as np
import pytest

import data
from helpers import log_fields, run_main, synthetic_corpus  # noqa: F401 (synthetic_corpus is a fixture)
from stability import diagnosis, skip_list


@pytest.fixture(scope="module")
def labelled(tmp_path_factory):
    """40 documents of 5-60 tokens; document d's tokens are d * 100 + 0, 1, 2, ...: every token names its document."""
    rng = np.random.default_rng(3)
    prefix = str(tmp_path_factory.mktemp("labelled") / "docs")
    data.write_indexed_dataset(
        prefix, (d * 100 + np.arange(rng.integers(5, 60)) for d in range(40)), np.int32
    )
    return prefix


def all_samples(ds):
    out = np.empty((len(ds), ds.seq_length + 1), np.int64)
    ds.gather(np.arange(len(ds)), out)
    return out


def test_a_skipped_document_is_in_no_sample_and_the_others_keep_their_order(labelled, tmp_path):
    indexed = data.IndexedDataset(labelled)
    documents = np.arange(40)
    full = data.GPTDataset(indexed, documents, 200, 16, 7, "train", str(tmp_path))
    skipped = data.GPTDataset(
        indexed, documents, 200, 16, 7, "train", str(tmp_path), skip=np.array([5, 23])
    )
    # without a skip list, the cache keeps its old name; with one, another
    names = [os.path.basename(ds.paths["doc_idx"]) for ds in (full, skipped)]
    assert "_skip" not in names[0] and "_skip" in names[1]
    seen_full, seen = np.unique(all_samples(full) // 100), np.unique(all_samples(skipped) // 100)
    assert {5, 23} <= set(seen_full) and not {5, 23} & set(seen) and len(skipped) >= 200
    # each epoch's order is drawn over all documents, then the skipped ones are taken out: the rest keep their order
    kept = np.asarray(full.doc_idx)[~np.isin(full.doc_idx, [5, 23])]
    n = min(len(kept), len(skipped.doc_idx))
    assert n >= 3 * 38 and np.array_equal(kept[:n], np.asarray(skipped.doc_idx)[:n])
    # the samples are the stream of the remaining documents, cut as always
    stream = np.concatenate([indexed.get(d) for d in skipped.doc_idx]).astype(np.int64)
    j = int(skipped.shuffle_idx[0])
    assert np.array_equal(skipped[0], stream[j * 16 : j * 16 + 17])


def test_sample_documents_names_the_documents_a_sample_is_cut_from(labelled, tmp_path):
    indexed = data.IndexedDataset(labelled)
    ds = data.GPTDataset(indexed, np.arange(40), 100, 16, 7, "train", str(tmp_path))
    for index in range(0, 100, 7):
        prefix, component, pieces = skip_list.sample_documents(ds, index)
        assert prefix == labelled and component == 0 and sum(n for _, n in pieces) == 17
        # the documents, in order
        assert [d for d, _ in pieces] == list(dict.fromkeys(ds[index] // 100))
        # a curriculum's shorter sample
        prefix, component, short = skip_list.sample_documents(ds, index, 5)
        assert [d for d, _ in short] == list(dict.fromkeys(ds[index][:5] // 100))
    other = str(tmp_path / "other")
    data.write_indexed_dataset(other, (5000 + np.arange(30) for _ in range(10)), np.int32)
    blend = data.BlendedDataset(
        [
            ds,
            data.GPTDataset(
                data.IndexedDataset(other), np.arange(10), 60, 16, 7, "train", str(tmp_path)
            ),
        ],
        [0.5, 0.5],
        100,
    )
    components = {skip_list.sample_documents(blend, i)[:2] for i in range(20)}
    assert components == {(labelled, 0), (other, 1)}


def test_build_datasets_honours_a_skip_list_and_refuses_a_bad_one(labelled, tmp_path):
    path = str(tmp_path / "skip.jsonl")
    skip_list.append(
        path,
        [{"dataset": labelled, "documents": [3, 17]}, {"dataset": "elsewhere/x", "documents": [1]}],
    )
    # any spelling
    skip_list.append(path, [{"dataset": os.path.relpath(labelled), "documents": [17, 30]}])
    skips, others = skip_list.read(path, [labelled])
    assert [list(ids) for ids in skips] == [[3, 17, 30]] and others == ["elsewhere/x"]
    train, valid, _ = data.build_datasets(
        [labelled], "100,0,0", 16, 7, (150, 0, 0), str(tmp_path), skips
    )
    assert valid is None and not {3, 17, 30} & set(np.unique(all_samples(train) // 100))
    summary = skip_list.summary(path, [labelled])
    assert re.search(
        rf"documents never sampled: 3 of {re.escape(labelled)} \(\d+ tokens\); entries for datasets not "
        r"in data_path ignored: elsewhere/x\.",
        summary,
    ), summary
    with open(path, "a") as f:
        f.write(json.dumps({"dataset": labelled, "documents": [40]}) + "\n")
    with pytest.raises(ValueError, match="names document 40 of .* which has 40 documents"):
        skip_list.read(path, [labelled])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"dataset": "a", "documents": [1]}\n{"dataset": "a", "documents": ["7"]}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected a JSON object with \"dataset\""):
        skip_list.read(str(bad), [labelled])
    with pytest.raises(FileNotFoundError, match="skip_documents file .* not found"):
        skip_list.read(str(tmp_path / "missing.jsonl"), [labelled])


GUARD = [
    "--spike_guard",
    "--spike_guard_window=20",
    "--spike_guard_min_steps=10",
    "--spike_guard_rewind=3",
    "--spike_guard_snapshot_interval=5",
]


def test_the_guard_writes_the_documents_of_a_bad_batch_to_the_skip_list_and_a_run_leaves_them_out(
    synthetic_corpus, tmp_path
):
    base = [
        "--num_layers=2",
        "--hidden_size=64",
        "--num_attention_heads=4",
        "--seq_length=64",
        "--vocab_size=512",
        "--micro_batch_size=8",
        "--global_batch_size=8",
        "--lr=2e-3",
        "--lr_warmup_samples=40",
        "--hidden_dropout=0",
        "--attention_dropout=0",
        "--log_interval=1",
        "--eval_iters=0",
        "--sample_tokens=0",
        "--save_interval=none",
        f"--data_path={synthetic_corpus}",
        "--split=100,0,0",
    ]
    save = str(tmp_path / "run")
    out = run_main(
        *base, *GUARD, "--train_iters=31", "--inject_bad_batch_iters=30-30", f"--save={save}"
    )
    path = os.path.join(save, diagnosis.SKIP_LIST)
    assert re.search(r"spike guard: iteration 30: .*data-driven", out), out[-3000:]
    assert (
        f"appended to the skip list {path}; to train without them, set skip_documents={path}" in out
    )
    records = [json.loads(line) for line in open(path)]
    # the three highest-loss samples of the batch
    assert [r["iteration"] for r in records] == [30, 30, 30]
    named = [int(x) for x in re.findall(r"spike guard: iteration 30: sample (\d+)", out)]
    assert [r["sample"] for r in records] == named and all(
        r["dataset"] == synthetic_corpus for r in records
    )
    # the documents recorded are the samples' (as the run's own index cuts them)
    train, _, _ = data.build_datasets([synthetic_corpus], "100,0,0", 64, 1234, (8 * 31, 0, 0))
    for r in records:
        assert list(map(list, zip(r["documents"], r["tokens"]))) == [
            list(p) for p in skip_list.sample_documents(train, r["sample"])[2]
        ]
    # a run with the skip list: none of the documents in any sample it takes
    culprits = sorted({d for r in records for d in r["documents"]})
    out = run_main(
        *base, "--train_iters=2", f"--skip_documents={path}", f"--save={tmp_path / 'next'}"
    )
    assert (
        f"skip_documents {path}: documents never sampled: {len(culprits)} of {synthetic_corpus}"
        in out
    )
    assert len(log_fields(out)) == 2
    skips = skip_list.read(path, [synthetic_corpus])[0]
    clean, _, _ = data.build_datasets(
        [synthetic_corpus], "100,0,0", 64, 1234, (16, 0, 0), skips=skips
    )
    assert not set(culprits) & set(np.asarray(clean.doc_idx).tolist())
