"""Skip lists: documents that no sample takes -- the culprits of a data-driven spike (docs/spike_guard.md).

The spike guard appends the samples behind a data-driven spike to SAVE/skip_documents.jsonl (diagnosis.name_samples),
one JSON line a sample:

    {"iteration": 30, "sample": 239, "loss": 6.645, "dataset": "data/shakespeare-v2", "dataset_index": 0,
     "documents": [17, 18], "tokens": [60, 5]}

dataset: the data_path prefix of the blend component the sample came from (dataset_index: its place in the blend);
documents: the ids (in PREFIX.idx) of the documents whose tokens the sample holds, tokens: how many of each. Only
"dataset" and "documents" are read, so a list written by hand needs no more; delete a line to keep its documents.

`skip_documents=FILE` hands the list to data.py, which leaves those documents out when it builds the sample index
(data.index_arrays): each epoch's document order is drawn as without a list and the listed documents are taken
out, so the others keep their order. The samples, cut from the shorter stream, change: a run resumed with another
list goes on in another sample order, as with another seed; the index cache is named after the list, never reused
across lists.
"""

import json
import os
from dataclasses import dataclass

import numpy as np

import data
import training
from report import print0


@dataclass
class SkipListConfig:  # SkipList
    # -- stability: the skip list --
    # a skip list (<save>/skip_documents.jsonl): no sample takes its documents
    skip_documents: str | None = None


class SkipList(training.Callback):
    """skip_documents=FILE: the data leaves out the documents the list names (training.Callback.documents_to_skip).
    loader.build_data hands the data source's collections as (name, number of documents) pairs
    (loader.DataSource.documents): a list written for collections of other sizes is refused, whatever the source."""

    name = "skip_list"

    Config = SkipListConfig  # its section: stability.build_callbacks builds it with it

    def __init__(self, skip_list_cfg, shared=None):
        self.path = skip_list_cfg.skip_documents

    def documents_to_skip(self, collections):
        names, counts = [name for name, _ in collections], [count for _, count in collections]
        print0(summary(self.path, names, counts))
        return read(self.path, names, counts)[0]


def sample_documents(dataset, index, length=None):
    """(prefix, blend component, [(document id, tokens)]) of sample `index` of a data.TokenSource: the documents its
    first `length` tokens (seq_length + 1 by default) come from, in order -- its provenance without the offsets."""
    prefix, component, pieces = dataset.provenance(index, length)
    return prefix, component, [(d, n) for d, _, n in pieces]


def append(path, records):
    """Append culprit records (the format above) to the skip list at `path`, one JSON line each."""
    with open(path, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))


def missing(path):
    """The message of a skip_documents file that is not there: at the config's check, before the build, and at
    the read (a file removed meanwhile)."""
    return (
        f"skip_documents file {path} not found; point skip_documents at a skip list (the spike guard writes "
        "SAVE/skip_documents.jsonl) or unset it"
    )


def read(path, prefixes, num_documents=None):
    """(the ids the list names for each of `prefixes`, sorted and unique, as int64 arrays; the datasets it names that
    are none of them). Prefixes are matched by absolute path. num_documents: how many documents each prefix has, for
    a source that is not PREFIX.bin/.idx files (by default PREFIX.idx's count), to refuse a list written for others."""
    if not os.path.isfile(path):
        raise FileNotFoundError(missing(path))
    wanted = {os.path.abspath(p): i for i, p in enumerate(prefixes)}
    found, others = [set() for _ in prefixes], set()
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                prefix, ids = record["dataset"], record["documents"]
                ok = isinstance(prefix, str) and isinstance(ids, list)
                ok = ok and all(
                    isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in ids
                )
            except (json.JSONDecodeError, KeyError, TypeError):
                ok = False
            if not ok:
                raise ValueError(
                    f'{path}:{lineno}: expected a JSON object with "dataset" (a data_path prefix) and '
                    '"documents" (a list of document ids), like {"dataset": "data/corpus", '
                    '"documents": [17]}; fix or delete that line'
                )
            if os.path.abspath(prefix) in wanted:
                found[wanted[os.path.abspath(prefix)]].update(ids)
            else:
                others.add(prefix)
    skips = [np.asarray(sorted(ids), dtype=np.int64) for ids in found]
    counts = num_documents or [
        len(data.IndexedDataset(p)) if len(ids) else 0 for p, ids in zip(prefixes, skips)
    ]
    for prefix, ids, n in zip(prefixes, skips, counts):
        if len(ids) and ids[-1] >= n:
            raise ValueError(
                f"skip_documents file {path} names document {ids[-1]} of {prefix}, which has {n} "
                "documents: the list was written for other data"
            )
    return skips, sorted(others)


def summary(path, prefixes, num_documents=None):
    """What a skip list takes out of this run's data, in one line (read's checks included); the tokens counted for
    PREFIX.bin/.idx files (num_documents None)."""
    skips, others = read(path, prefixes, num_documents)
    parts = [
        f"{len(ids)} of {prefix}"
        + (
            ""
            if num_documents
            else f" ({int(data.IndexedDataset(prefix).sizes[ids].sum(dtype=np.int64)):,} tokens)"
        )
        for prefix, ids in zip(prefixes, skips)
        if len(ids)
    ]
    return (
        f"skip_documents {path}: documents never sampled: {', '.join(parts) or 'none'}"
        + (
            f"; entries for datasets not in data_path ignored: {', '.join(others)}"
            if others
            else ""
        )
        + ". The sample order is this list's: a run resumed with another list goes on in another order (as "
        "with another seed)"
    )
