"""The data-source contract (data.TokenSource): each source's gather() is the concatenation of what its provenance()
names, and the loader, a resume and the skip lists run on any source -- here on the in-memory one (helpers.py)."""

import numpy as np
import pytest

import arguments
import data
import loader
from helpers import MemorySource, plan_of
from run_state import RunState
from stability import skip_list

SEQ = 16


def labelled(seed, n, first):
    """n documents of 0-59 tokens (empty ones included); document d's tokens are (first + d) * 100 + 0, 1, 2, ...:
    every token names its document and its place in it, so a piece one token off shows."""
    rng = np.random.default_rng(seed)
    return [(first + d) * 100 + np.arange(rng.integers(0, 60)) for d in range(n)]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """name -> (source, {provenance's source name: (blend component, its documents)})."""
    tmp = tmp_path_factory.mktemp("token_source")
    docs_a, docs_b = labelled(1, 40, 0), labelled(2, 20, 50)
    a, b = str(tmp / "a"), str(tmp / "b")
    data.write_indexed_dataset(a, docs_a, np.int32)
    # its documents are 0-19 in its files, its tokens its own
    data.write_indexed_dataset(b, docs_b, np.int32)
    gpt_a = data.GPTDataset(data.IndexedDataset(a), np.arange(40), 200, SEQ, 7, "train", str(tmp))
    gpt_b = data.GPTDataset(data.IndexedDataset(b), np.arange(20), 120, SEQ, 7, "train", str(tmp))
    return {
        "gpt": (gpt_a, {a: (0, docs_a)}),
        "blend": (
            data.BlendedDataset([gpt_a, gpt_b], [0.6, 0.4], 180),
            {a: (0, docs_a), b: (1, docs_b)},
        ),
        "memory": (MemorySource(docs_a, SEQ), {"memory": (0, docs_a)}),
    }


def assert_gather_is_what_provenance_names(source, corpus, indices, length):
    out = np.empty((len(indices), length), np.int64)
    source.gather(np.asarray(indices), out)
    for row, index in zip(out, indices):
        name, component, pieces = source.provenance(int(index), length)
        want_component, documents = corpus[name]
        assert component == want_component, (index, name, component)
        assert all(n > 0 for _, _, n in pieces) and sum(n for _, _, n in pieces) == length, (
            index,
            pieces,
        )
        named = np.concatenate([documents[d][offset : offset + n] for d, offset, n in pieces])
        assert np.array_equal(row, named), (index, pieces)


@pytest.mark.parametrize("kind", ["gpt", "blend", "memory"])
def test_gather_is_the_concatenation_of_what_provenance_names(sources, kind):
    source, corpus = sources[kind]
    assert isinstance(source, data.TokenSource)
    for length in (SEQ + 1, 5, 1):  # the full sample and a curriculum's shorter ones
        assert_gather_is_what_provenance_names(source, corpus, range(len(source)), length)
    if kind == "blend":  # both components named, each by its own prefix
        assert {source.provenance(i).component for i in range(len(source))} == {0, 1}


def test_the_contract_check_catches_a_provenance_one_token_off(sources, monkeypatch):
    source, corpus = sources["gpt"]
    right = source.provenance

    def one_off(index, length=None):
        name, component, ((d, offset, n), *rest) = right(index, length)
        return data.Provenance(name, component, [(d, offset + 1, n), *rest])

    monkeypatch.setattr(source, "provenance", one_off)
    with pytest.raises(AssertionError):
        assert_gather_is_what_provenance_names(source, corpus, range(len(source)), SEQ + 1)


def test_the_memory_source_cuts_its_documents_as_a_user_expects():
    docs = labelled(3, 30, 0)
    stream = np.concatenate(docs)
    source = MemorySource(docs, SEQ)
    assert len(source) == (len(stream) - 1) // SEQ
    out = np.empty((len(source), SEQ + 1), np.int64)
    source.gather(np.arange(len(source)), out)
    assert all(
        np.array_equal(row, stream[i * SEQ : i * SEQ + SEQ + 1]) for i, row in enumerate(out)
    )
    with pytest.raises(IndexError):
        source.gather([len(source)], out[:1])


def test_loader_and_resume_run_on_the_memory_source():
    """The training loop's batches, prefetched across batch-size ramp-up and a curriculum, are the source's
    samples in order; a run resumed from any consumed-samples point loads the very batches of an unbroken one."""
    source = MemorySource(labelled(4, 400, 0), SEQ)
    stream = np.concatenate(list(source.documents.values()))
    cfg = arguments.load_config(
        [
            f"--seq_length={SEQ}",
            "--micro_batch_size=2",
            "--global_batch_size=8",
            "--rampup_batch_size=4 2 40",
            "--train_iters=none",
            "--train_samples=160",
            "--curriculum_learning",
            "--min_difficulty=8",
            "--total_curriculum_step=6",
        ]
    )
    arguments.prepare(cfg, world_size=1)
    plan, mbs = plan_of(cfg), cfg.micro_batch_size

    def load(key):
        _, first, batch_size, seqlen = key
        return loader.load_tokens(source, first, batch_size // mbs, seqlen, mbs, 0, 1)

    def train(state):
        """{iteration: (the RunState it started from, its tokens)} from `state` to the end of training."""
        batches = {}
        with loader.Prefetcher(load, plan.next_key) as prefetcher:
            while not plan.done(state):
                iteration = state.iteration + 1
                batch_size, seqlen = plan.batch_size(state.consumed_samples), plan.seqlen(iteration)
                tokens = prefetcher.get((iteration, state.consumed_samples, batch_size, seqlen))
                batches[iteration] = state, tokens.numpy().reshape(batch_size, seqlen + 1)
                state = RunState(
                    iteration,
                    state.consumed_samples + batch_size,
                    state.consumed_tokens + batch_size * seqlen,
                )
        return batches

    unbroken = train(RunState(0, 0, 0))
    # batch sizes and sequence lengths both changed
    assert len({b.shape for _, b in unbroken.values()}) >= 3
    for start, batch in unbroken.values():
        first = start.consumed_samples
        want = [
            stream[i * SEQ : i * SEQ + batch.shape[1]] for i in range(first, first + len(batch))
        ]
        assert np.array_equal(batch, np.stack(want))
    for resume_at in (3, len(unbroken) // 2):
        resumed = train(unbroken[resume_at + 1][0])
        assert sorted(resumed) == [i for i in sorted(unbroken) if i > resume_at]
        assert all(np.array_equal(resumed[i][1], unbroken[i][1]) for i in resumed)


def test_skip_lists_and_the_naming_of_samples_run_on_the_memory_source(tmp_path):
    docs = labelled(5, 40, 0)
    source = MemorySource(docs, SEQ)
    out = np.empty((len(source), SEQ + 1), np.int64)
    source.gather(np.arange(len(source)), out)
    records = []
    for index in (2, 9):
        prefix, component, pieces = skip_list.sample_documents(source, index)
        assert (prefix, component) == ("memory", 0) and [d for d, _ in pieces] == list(
            dict.fromkeys(out[index] // 100)
        )
        short = skip_list.sample_documents(source, index, 5)[2]  # a curriculum's shorter sample
        assert [d for d, _ in short] == list(dict.fromkeys(out[index][:5] // 100))
        records.append({"dataset": prefix, "documents": [d for d, _ in pieces]})
        # the other half of the guard's naming of a sample (diagnosis.name_samples): its text
        assert data.sample_text(source, index, 4) == data.get_tokenizer().decode(
            out[index][:5].tolist()
        )
    path = str(tmp_path / "skip.jsonl")
    skip_list.append(path, records)
    (skips,), others = skip_list.read(path, ["memory"], num_documents=[len(docs)])
    assert others == [] and len(skips) >= 2
    without = MemorySource(docs, SEQ, skip=skips)
    rest = np.empty((len(without), SEQ + 1), np.int64)
    without.gather(np.arange(len(without)), rest)
    assert not set(skips.tolist()) & set(np.unique(rest // 100).tolist())
    skip_list.append(path, [{"dataset": "memory", "documents": [len(docs)]}])
    with pytest.raises(ValueError, match="written for other data"):
        skip_list.read(path, ["memory"], num_documents=[len(docs)])
