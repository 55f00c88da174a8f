"""Batches prepared ahead: the next iterations' micro-batches are gathered on a background thread.

Which samples an iteration trains on is a pure function of (iteration, first sample, batch size, seqlen): the
"key". The training loop asks for its key with `get`; meanwhile the Prefetcher has already loaded the keys it
guessed would come next (schedule.Schedule.next_key: batch-size ramp-up, curriculum, skipped iterations). A
wrong guess (a resume, a rollback, a plan changed under it) costs one synchronous load, never a wrong batch: a
batch is only ever handed out for exactly the key it was loaded for, so the sample order and bit-exact resume
do not depend on the prefetching at all.

The gather itself (GPTDataset.gather) is compiled and releases the GIL, so the thread runs beside the training
step. On CUDA the host buffer is pinned and the copy to the device is non-blocking.

The run's data is built here too: build_data opens the source the data_source key names in a
registry of sources (DataSource: its checks, its train and validation sets, the names of its
documents for skip lists). A source reads the data's section of the config (DataConfig) and what
other owners give it (DataContext). The first is Megatron's .bin/.idx files of data_path; a new one
is one file and one registry line. Its validation is one blended set, or named sets
(valid_weighted_split_names and _paths), each evaluated apart.
"""

import collections
import dataclasses
import difflib
import functools
import os
import queue
import re
import threading
import weakref
from concurrent.futures import Future
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

import data
import files
import layers
import parallel
from report import print0


def sample_indices(
    first_sample: int, num_micro_batches: int, micro_batch_size: int, dp_rank: int, dp_size: int
):
    """[num_micro_batches, micro_batch_size] sample indices of this DP rank's share of the global batch of
    num_micro_batches * micro_batch_size * dp_size samples from first_sample, in Megatron's order: micro-batch k
    takes the samples k*mbs*dp + dp_rank*mbs + [0, mbs)."""
    k = np.arange(num_micro_batches, dtype=np.int64)[:, None]
    return (
        first_sample
        + k * micro_batch_size * dp_size
        + dp_rank * micro_batch_size
        + np.arange(micro_batch_size)
    )


def load_tokens(
    dataset,
    first_sample,
    num_micro_batches,
    seqlen,
    micro_batch_size,
    dp_rank,
    dp_size,
    pin_memory=False,
):
    """This rank's micro-batches as one int64 host tensor [num_micro_batches, micro_batch_size, seqlen + 1]:
    the first seqlen+1 tokens of each sample (inputs are [:-1], labels [1:]), pinned for a CUDA device."""
    index = sample_indices(first_sample, num_micro_batches, micro_batch_size, dp_rank, dp_size)
    tokens = torch.empty((*index.shape, seqlen + 1), dtype=torch.int64, pin_memory=pin_memory)
    dataset.gather(index.reshape(-1), tokens.numpy().reshape(index.size, seqlen + 1))
    return tokens


def to_device(tokens: torch.Tensor, device) -> list:
    """[(inputs, labels)] per micro-batch: one (non-blocking, from pinned memory) copy, then views."""
    tokens = tokens.to(device, non_blocking=True)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


class Prefetcher:
    """Runs load(key) on a daemon thread for the `depth` keys that next_key guesses will follow the last one
    asked for. get(key) returns load(key), re-raising its exception if it failed; close() stops the thread
    (so does dropping the Prefetcher). next_key(key) returns None past the end of training."""

    def __init__(self, load, next_key, depth: int = 2):
        self._next_key, self._depth = next_key, depth
        self._pending = collections.deque()  # (key, Future), in the order guessed
        self._requests = queue.SimpleQueue()
        # The thread holds only the queue and `load`, not self: dropping the Prefetcher ends it (finalize).
        thread = threading.Thread(
            target=_serve, args=(self._requests, load), name="batch-prefetch", daemon=True
        )
        thread.start()
        self._load, self.thread = load, thread
        self._finalizer = weakref.finalize(self, self._requests.put, None)

    def get(self, key):
        future = None
        while self._pending:
            guessed, f = self._pending.popleft()
            if guessed == key:
                future = f
                break
            f.cancel()  # a guess that did not come true (skipped over or superseded)
        if future is None:
            for _, f in self._pending:
                f.cancel()
            self._pending.clear()
        last = self._pending[-1][0] if self._pending else key
        while len(self._pending) < self._depth and (last := self._next_key(last)) is not None:
            f = Future()
            self._requests.put((last, f))
            self._pending.append((last, f))
        return future.result() if future is not None else self._load(key)

    def close(self):
        for _, f in self._pending:
            f.cancel()
        self._pending.clear()
        self._finalizer()
        self.thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _serve(requests, load):
    while (request := requests.get()) is not None:
        key, future = request
        if not future.set_running_or_notify_cancel():
            continue  # cancelled while queued
        try:
            future.set_result(load(key))
        # handed to whoever asks for this key (nobody, for a guess past the end)
        except BaseException as e:
            future.set_exception(e)


# -----------------------------------------------------------------------------
# The run's data: a data source, picked by the data_source key from a registry of sources


class DataSource(Protocol):
    """What the loader asks of a kind of data (torchtitan's data-source protocol): a new kind is one
    class, in one file, that register_source names; the loader, the training loop and the skip lists
    stay as they are. The Megatron source below is the first; docs/data.md ("A new data source")
    shows a second. A source reads the data's keys (data_cfg: DataConfig, where a key of its own is
    declared) and the other owners' values it is given (context: DataContext), nothing else of the
    run."""

    # Does it read valid_weighted_split_names/_paths (named validation sets)? Else they are refused.
    reads_valid_sets: bool = False

    # Refuse keys that cannot work (a ValueError naming the fix), reading no data
    @staticmethod
    def check(data_cfg, context) -> None: ...

    # Opens the data for (train, validation) samples and refuses data that cannot train (token ids beyond the
    # vocabulary). Every rank constructs one.
    def __init__(self, data_cfg, context, num_samples: tuple[int, int]): ...

    # [(name, number of documents)] of each collection of documents its samples come from, in order (a blend's
    # components), named as their data.Provenance names them: what a skip list names (its "dataset"), by ids.
    def documents(self) -> list[tuple[str, int]]: ...

    # (train, validation), each a data.TokenSource, validation None without samples. skips: per entry of documents(),
    # the ids of the documents no sample takes (a skip list), or None. Every rank builds; what is built once for
    # all (Megatron's cached sample index), rank 0 builds first.
    def build(self, skips: list | None) -> tuple: ...


SOURCES = {}  # data_source -> its DataSource class


def register_source(name: str, source: type) -> type:
    """Make `source` (a DataSource class) the data_source `name`: the one line a new source's file ends with."""
    missing = [m for m in ("check", "documents", "build") if not hasattr(source, m)]
    if missing:
        raise ValueError(
            f"data source {source.__name__} lacks {', '.join(missing)} of loader.DataSource; add it"
        )
    if SOURCES.get(name, source) is not source:
        raise ValueError(
            f"data_source {name!r} is {SOURCES[name].__name__} already; register {source.__name__} "
            "under another name"
        )
    SOURCES[name] = source
    return source


def source_class(name: str) -> type:
    if name not in SOURCES:
        raise ValueError(
            f"data_source {name!r} is not a registered data source ({', '.join(sorted(SOURCES))}): "
            "set one of those, or import the file of yours that calls loader.register_source in your "
            "config file (a config is Python; docs/data.md, 'A new data source')"
        )
    return SOURCES[name]


@dataclasses.dataclass(frozen=True)
class DataContext:
    """The other owners' values the data reads, made where the whole config is (section(DataContext,
    cfg)): the model's seq_length and vocab_size; the checkpoint's init_from_hf (an imported model's
    vocabulary is given: data of another tokenizer is refused); logging's eval keys, which count the
    validation samples; the config file's name, for messages (arguments.load_config sets it)."""

    seq_length: int
    vocab_size: int
    init_from_hf: str | None
    eval_only: bool
    eval_iters: int
    eval_interval: int
    config_file: str = "this config"


def build_data(data_cfg, context, schedule, documents_to_skip=lambda collections: None):
    """(train, validation) datasets of the run's data_source, opened with the data's keys and the
    context; documents_to_skip(collections): given the source's [(name, number of documents)]
    (DataSource.documents), the ids each collection's samples leave out (a skip list), or None."""
    source = source_class(data_cfg.data_source)
    evals = schedule.total_iters // context.eval_interval + 1
    num_samples = (
        0 if context.eval_only else schedule.total_samples,
        context.eval_iters * schedule.rampup.global_batch_size * (1 if evals else 0),
    )
    opened = source(data_cfg, context, num_samples)
    return opened.build(documents_to_skip(opened.documents()))


def validation_sets(validation) -> list:
    """[(name, TokenSource)] of build_data's validation: [(None, it)] for the one blended set, a pair per named set
    (valid_weighted_split_names), [] without validation."""
    if validation is None:
        return []
    return list(validation.items()) if isinstance(validation, dict) else [(None, validation)]


# -----------------------------------------------------------------------------
# The first source: Megatron's indexed datasets (data.py)


class MegatronSource:
    """PREFIX.bin/.idx files (Megatron's format, data.py), blended by the weights of data_path, split into train,
    validation and test documents by `split`, sampled through the cached sample index; without a data_path, the
    bundled corpus. With valid_weighted_split_names, named validation sets instead of the blended one
    (named_valid_sets)."""

    reads_valid_sets = True

    @staticmethod
    def check(data_cfg, context):
        if data_cfg.data_path is None and not data_cfg.use_bundled_corpus:
            raise ValueError(
                f"{context.config_file} sets no data_path: tokenize a corpus with `python data.py "
                "--input FILES --output-prefix data/NAME` and pass --data_path data/NAME (only "
                "config/tiny.py trains on the bundled Shakespeare: use_bundled_corpus)"
            )
        if data_cfg.tokenizer_file is not None and data_cfg.data_path is None:
            raise ValueError(
                "tokenizer_file is set but data_path is not: the bundled corpus is GPT-2 tokens; prepare your data "
                "with `python data.py --input ... --output-prefix PREFIX --tokenizer-file FILE` and set "
                "data_path=PREFIX"
            )
        if data_cfg.data_path is not None:
            # its files may not be there yet: a config is validated where its data is not (the
            # lab's preflight); __init__ refuses a missing prefix
            check_prefixes(data_cfg.data_path, "", "data_path", must_exist=False)
        check_valid_sets(data_cfg.valid_weighted_split_names, data_cfg.valid_weighted_split_paths)

    @staticmethod
    def check_files(data_cfg, context):
        """The prefixes' files, where a run reads them (check_files): each index opened (a file of
        another format refused), the splits the run reads checked (data.check_splits), and each named
        validation set's documents (named_valid_sets)."""
        if data_cfg.data_path is None:
            return
        check_prefixes(data_cfg.data_path, "", "data_path")
        named = bool(data_cfg.valid_weighted_split_names)
        # named sets replace the blended validation: data_path's own validation split is not read
        reads = (0 if context.eval_only else 1, 1 if context.eval_iters and not named else 0, 0)
        check_splits(data_cfg.data_path, data_cfg.split, context.seq_length, reads)
        if named:
            named_valid_sets(
                data_cfg, data_cfg.data_path, context.seq_length, say=lambda line: None
            )

    def __init__(self, data_cfg, context, num_samples):
        self.data_cfg, self.context, self.num_samples = data_cfg, context, num_samples
        self.data_path = bundled_corpus() if data_cfg.data_path is None else data_cfg.data_path
        check_prefixes(self.data_path, "", "data_path")
        # the bundled corpus's too, before the vocabulary's pass and the epochs' warning
        named = bool(data_cfg.valid_weighted_split_names)
        reads = (num_samples[0], 0 if named else num_samples[1], 0)
        check_splits(self.data_path, data_cfg.split, context.seq_length, reads)
        check_data(data_cfg.split, context, self.data_path, num_samples[0])
        self.valid_sets = None  # the blended validation split of data_path
        if data_cfg.valid_weighted_split_names:
            self.valid_sets = named_valid_sets(data_cfg, self.data_path, context.seq_length)
            paths = [path for _, path, _ in self.valid_sets]
            check_vocabulary(context, [p for path in paths for p in data.parse_data_path(path)[0]])

    def documents(self):
        return [
            (prefix, len(data.IndexedDataset(prefix)))
            for prefix in data.parse_data_path(self.data_path)[0]
        ]

    def build(self, skips):
        data_cfg, (train, valid) = self.data_cfg, self.num_samples
        seq_length = self.context.seq_length
        split, seed, cache = data_cfg.split, data_cfg.seed, data_cfg.data_cache_dir
        named = self.valid_sets is not None
        # Rank 0 builds and caches the index arrays first; the others then read the cache.
        for builders in (True, False):
            if (parallel.grid.rank == 0) == builders:
                datasets = data.build_datasets(
                    self.data_path,
                    split,
                    seq_length,
                    seed,
                    (train, 0 if named else valid, 0),
                    cache,
                    skips,
                )
                validation = (
                    datasets[1]
                    if not named
                    else self.build_valid_sets(valid, skips)
                    if valid
                    else None
                )
            if builders and dist.is_initialized():
                # an index build can outlast the training's timeout
                dist.barrier(group=parallel.host_group())
        return datasets[0], validation

    def build_valid_sets(self, num_samples, skips):
        """{name: TokenSource} of the named validation sets, num_samples each; a skip list of a data_path corpus
        holds for it in a set too (as it does in the blended validation)."""
        data_cfg, prefixes = self.data_cfg, data.parse_data_path(self.data_path)[0]
        skip_of = {
            os.path.realpath(p): s for p, s in zip(prefixes, skips or [None] * len(prefixes))
        }
        out = {}
        for name, path, split in self.valid_sets:
            set_skips = [skip_of.get(os.path.realpath(p)) for p in data.parse_data_path(path)[0]]
            out[name] = data.build_datasets(
                path,
                split,
                self.context.seq_length,
                data_cfg.seed,
                (0, num_samples, 0),
                data_cfg.data_cache_dir,
                set_skips,
            )[1]
        return out


register_source("megatron", MegatronSource)


def bundled_corpus():
    """[the bundled corpus's prefix], tokenized on rank 0 on first use and broadcast to the other ranks."""
    data_path = [data.default_corpus()] if parallel.grid.rank == 0 else None
    if dist.is_initialized():
        box = [data_path]
        dist.broadcast_object_list(box, src=0)
        data_path = box[0]
    return data_path


def check_splits(data_path, split, seq_length, reads):
    """Each prefix of data_path opened (an index of another format refused) and the splits the run reads
    (reads: train, valid, test samples, or 1 for some) checked: data.check_splits, the index only."""
    for prefix in data.parse_data_path(data_path)[0]:
        data.check_splits(data.IndexedDataset(prefix), split, seq_length, reads)


def check_data(split, context, data_path, train_samples):
    """Token ids within the vocabulary (else an IndexError mid-run); a warning when the data
    repeats. split: the data's key; context: a DataContext (vocab_size, seq_length, init_from_hf)
    """
    prefixes, weights = data.parse_data_path(data_path)
    check_vocabulary(context, prefixes)
    for prefix, weight in zip(prefixes, weights):
        epochs = data.train_epochs(prefix, split, context.seq_length, train_samples * weight)
        # Muennighoff et al. 2023: up to ~4 epochs of repeated data cost little, more do
        if epochs > 4:
            print0(
                f"warning: this run goes over the train split of {prefix} {epochs:.1f} times; beyond about 4 "
                "epochs repeated data stops helping (more data, or a shorter run)"
            )


def check_vocabulary(context, prefixes):
    """Refuse corpora with token ids at or above context.vocab_size (a DataContext), or negative. Rank 0
    finds each corpus's smallest and largest id (on a first run, a pass over the whole .bin; then
    data.token_id_range's cache) and the other ranks get them in one broadcast, instead of every rank
    reading the corpus at once."""
    vocab_size = context.vocab_size
    rank0 = parallel.grid.rank == 0
    ranges = [data.token_ids_to_check(p, vocab_size) if rank0 else (0, -1) for p in prefixes]
    flat = parallel.broadcast_scalars([x for r in ranges for x in r])  # float64: exact for any id
    for i, prefix in enumerate(prefixes):
        id_range = int(flat[2 * i]), int(flat[2 * i + 1])
        data.check_token_ids(prefix, context.vocab_size, id_range, context.init_from_hf)


# -----------------------------------------------------------------------------
# Named validation sets: Megatron-DeepSpeed's valid_weighted_split_names / _paths (BigScience's PR #97), so that a
# regression in one component of a blend (one language) shows instead of averaging away in the blended loss.

# in the log line between '|'s, in TensorBoard tags and metrics.jsonl keys
SET_NAME = re.compile(r"[\w.\-]+")


def check_valid_sets(names, paths):
    """Names and paths of the named validation sets that cannot work, refused with the fix, reading no data."""
    if not names and not paths:
        return
    if not names or not paths or len(names) != len(paths):
        raise ValueError(
            f"valid_weighted_split_names names {len(names or [])} validation set(s) but valid_weighted_split_paths "
            f"gives {len(paths or [])} path(s): give one path per name, in the same order (a path is a prefix, or a "
            "blend 'w1 prefix1 w2 prefix2' as one entry: one string of the list in a config file)"
        )
    for name in names:
        if not SET_NAME.fullmatch(name) or names.count(name) > 1:
            why = "given twice" if SET_NAME.fullmatch(name) else "not a name"
            raise ValueError(
                f"valid_weighted_split_names: {name!r} is {why}; give each set its own name of letters, "
                "digits, '_', '-' and '.' (e.g. valid_en)"
            )
    for name, path in zip(names, paths):
        check_prefixes(
            path, f"validation set {name!r}: ", "its entry in valid_weighted_split_paths"
        )


def check_prefixes(data_path, where, key, must_exist=True):
    """A data_path (one prefix or a blend) that cannot be opened, refused with the fix, reading no data: the blend's
    shape, a prefix given with its .bin/.idx suffix, a prefix without its two files (unless not must_exist).
    where: the message's start (naming what gave it, or ''); key: what to fix."""
    try:
        prefixes = data.parse_data_path(data_path)[0]
    except ValueError as e:
        raise ValueError(f"{where}{e}") from None
    for prefix in prefixes:
        missing = [s for s in (".bin", ".idx") if not os.path.isfile(prefix + s)]
        if not missing:
            continue
        stem, suffix = os.path.splitext(prefix)
        if suffix in (".bin", ".idx"):
            raise ValueError(
                f"{where}{key} gives {prefix!r}, a file's name, not a prefix: drop the suffix "
                f"({stem}: the prefix of {stem}.bin and {stem}.idx)"
            )
        if not must_exist:
            continue
        raise ValueError(
            f"{where}{prefix}{'/'.join(missing)} not found{_nearby(prefix)}; fix {key}, or tokenize "
            f"the corpus with `python data.py --input FILES --output-prefix {prefix}`"
        )


def _nearby(prefix):
    """' (did you mean X?)' where the directory of prefix holds a corpus of a close name, else ''."""
    directory, base = os.path.split(prefix)
    try:
        names = os.listdir(directory or ".")
    except OSError:
        return ""
    found = sorted(n[: -len(".idx")] for n in names if n.endswith(".idx"))
    close = difflib.get_close_matches(base, found, n=1)
    return f" (did you mean {os.path.join(directory, close[0])}?)" if close else ""


def named_valid_sets(data_cfg, data_path, seq_length, say=print0):
    """[(name, path, split)] of the named validation sets: each reads the documents training does not. A corpus of
    data_path gives its validation share of `split` (the blended validation's documents of it); any other corpus,
    all of its documents (Megatron-LM's valid_data_path). A set with no such document, or too few tokens for one
    sample of seq_length + 1, is refused. say: where each set's documents are told."""
    trained = {os.path.realpath(p) for p in data.parse_data_path(data_path)[0]}
    out = []
    for name, path in zip(data_cfg.valid_weighted_split_names, data_cfg.valid_weighted_split_paths):
        prefixes = data.parse_data_path(path)[0]
        inside = [os.path.realpath(p) in trained for p in prefixes]
        if any(inside) != all(inside):
            raise ValueError(
                f"validation set {name!r} blends corpora of data_path with others ({path}): the first "
                "give their validation split, the others all their documents; make them two sets"
            )
        split = data_cfg.split if all(inside) else "0,1,0"
        for prefix in prefixes:
            indexed = data.IndexedDataset(prefix)
            documents = len(indexed)
            start, end = data.split_documents(split, documents)[1]
            if end == start and not all(inside):
                raise ValueError(
                    f"validation set {name!r} has no validation documents: {prefix} holds none; "
                    "tokenize its corpus again, or drop the set"
                )
            if end == start:
                raise ValueError(
                    f"validation set {name!r} has no validation documents: {prefix} "
                    f"is in data_path, and split {data_cfg.split!r} gives validation "
                    f"none of its {documents} documents; give validation a share of "
                    "split (e.g. 949,50,1), or drop the set"
                )
            try:
                data.check_splits(indexed, split, seq_length, (0, 1, 0))
            except ValueError as e:
                raise ValueError(f"validation set {name!r}: {e}") from None
            say(
                f"validation set {name}: documents {start}-{end - 1} of {prefix} "
                f"({'its validation split' if all(inside) else 'not in data_path: all of them'})"
            )
        out.append((name, path, split))
    return out


# -----------------------------------------------------------------------------
# The tokenizer, the micro-batches, and the inputs of packed documents


def check_tokenizer(tokenizer_file, context):
    """A tokenizer_file must have the model's vocabulary (context.vocab_size, a DataContext): a
    larger one produces ids the embedding does not have, a smaller one wastes rows -- except in a
    model imported with init_from_hf, whose rows are given (BLOOM's tokenizer has 250680 tokens, its
    embedding 250880 rows). (The GPT-2 default is not checked: tests use small vocabularies.)"""
    if tokenizer_file is None:
        return
    n_vocab, vocab_size = data.get_tokenizer(tokenizer_file).n_vocab, context.vocab_size
    if n_vocab > vocab_size:
        fix = (
            "use the tokenizer of the model in init_from_hf"
            if context.init_from_hf
            else f"set vocab_size={n_vocab} (padding to a multiple is automatic)"
        )
        raise ValueError(
            f"tokenizer_file {tokenizer_file} has {n_vocab} tokens but the model's "
            f"vocab_size is {vocab_size}: its ids would not all have an embedding "
            f"row; {fix}"
        )
    if n_vocab < vocab_size and not context.init_from_hf:
        raise ValueError(
            f"tokenizer_file {tokenizer_file} has {n_vocab} tokens but vocab_size is "
            f"{vocab_size}; set vocab_size={n_vocab} (padding to a multiple is "
            "automatic)"
        )


def micro_batches(dataset, first_sample, num_micro_batches, micro_batch_size, seqlen, device):
    """This DP rank's micro-batches [(inputs, labels)] of the global batch of num_micro_batches * mbs * dp samples
    from first_sample, in Megatron's order (sample_indices), truncated to seqlen (curriculum)."""
    g = parallel.grid
    tokens = load_tokens(
        dataset,
        first_sample,
        num_micro_batches,
        seqlen,
        micro_batch_size,
        g.dp_rank,
        g.dp_size,
        pin_memory=device.type == "cuda",
    )
    return to_device(tokens, device)


def packs_documents(data_cfg):
    return data_cfg.reset_position_ids or data_cfg.reset_attention_mask or data_cfg.eod_mask_loss


def eod_token(tokenizer_file):
    """The end-of-document id that separates packed documents: the tokenizer's (GPT-2's 50256, or tokenizer_file's
    </s>, <|endoftext|>, ...), as Megatron takes tokenizer.eod."""
    return data.get_tokenizer(tokenizer_file).eot_token


def packing(data_cfg):
    """tokens -> the model's keyword inputs for Megatron's data flags (layers.packed_inputs), or None when no flag
    is set. Computed from each micro-batch's input tokens on the device, where the model runs: every pipeline stage
    reads the same micro-batches, so each computes what it needs from the tokens instead of receiving it."""
    if not packs_documents(data_cfg):
        return None
    return functools.partial(
        layers.packed_inputs,
        eod=eod_token(data_cfg.tokenizer_file),
        reset_position_ids=data_cfg.reset_position_ids,
        reset_attention_mask=data_cfg.reset_attention_mask,
        eod_mask_loss=data_cfg.eod_mask_loss,
    )


def batch_prefetcher(dataset, schedule, device):
    """Loads the micro-batches of the iterations schedule.next_key expects on a background thread."""
    g, micro_batch_size = parallel.grid, schedule.schedule_cfg.micro_batch_size

    def load(key):
        _, first_sample, _, seqlen = key
        return load_tokens(
            dataset,
            first_sample,
            schedule.rampup.num_micro_batches(first_sample),
            seqlen,
            micro_batch_size,
            g.dp_rank,
            g.dp_size,
            pin_memory=device.type == "cuda",
        )

    return Prefetcher(load, schedule.next_key)


# -----------------------------------------------------------------------------
# The data's keys and their checks (arguments.Config is made of each owner's keys)


@dataclasses.dataclass
class DataConfig:
    # -- data --
    # which registered source (loader.SOURCES) reads the data; megatron: .bin/.idx
    data_source: str = "megatron"
    # megatron: prefix of data.py's .bin/.idx, or "w1 prefix1 w2 prefix2 ..."
    data_path: list[str] | None = None
    # a Hugging Face tokenizer.json the data was prepared with; None: GPT-2 BPE
    tokenizer_file: str | None = None
    # without data_path, train on the bundled Shakespeare (the tiny default's choice)
    use_bundled_corpus: bool = False
    split: str = "949,50,1"  # train, validation, test shares of the documents
    data_cache_dir: str | None = None  # where the sample index is cached; None: next to the data
    seed: int = 1234  # initialization, data order and dropout
    # positions restart after each end-of-document token (Megatron's flag)
    reset_position_ids: bool = False
    # a token attends only within its document (packed documents apart)
    reset_attention_mask: bool = False
    # no loss where the input token is the end-of-document (Megatron's count)
    eod_mask_loss: bool = False
    # named validation sets, each logged apart, not the blend
    valid_weighted_split_names: list[str] | None = None
    # per name a prefix or "w1 p1 w2 p2" blend (docs/data.md)
    valid_weighted_split_paths: list[str] | None = None


def check_files(data_cfg, context):
    """Raise ValueError with the fix for data files a run cannot open or read its splits from, before the
    model is built (a large model's build takes minutes on every rank); context: a DataContext. Apart from
    check(): a config is validated where its data is not (the lab's preflight, a cluster's config read on a
    laptop)."""
    source_check = getattr(source_class(data_cfg.data_source), "check_files", None)
    if source_check is not None:
        source_check(data_cfg, context)


def check(data_cfg, context, position_embedding_type, reads_data=True):
    """Raise ValueError with the fix for data keys that cannot work. context: a DataContext;
    position_embedding_type: the model's (alibi has no position ids to reset). reads_data=False: the
    caller feeds the model something else than the config's data (bench.py's random tokens), which
    then need not be configured."""
    # the seed draws the initialization and dropout too, with or without data: np.random.seed's range
    seed = data_cfg.seed
    if not 0 <= seed <= 2**32 - 1:
        raise ValueError(f"seed={seed} must be in [0, 2**32 - 1] (1234)")
    if not reads_data:
        return
    source = source_class(data_cfg.data_source)
    for key in ("valid_weighted_split_names", "valid_weighted_split_paths"):
        if getattr(data_cfg, key) and not getattr(source, "reads_valid_sets", False):
            raise ValueError(
                f"data_source {data_cfg.data_source!r} has no named validation sets "
                f"({key} is set): drop {key}, or use a source that reads it "
                "(megatron)"
            )
    source.check(data_cfg, context)
    check_split(data_cfg, context)
    if data_cfg.data_cache_dir is not None:  # an index cache built before may be read-only
        files.check_output_dir(
            data_cfg.data_cache_dir,
            "data_cache_dir",
            "a directory the run can write its sample index in",
            read_only_ok=True,
        )
    if (
        data_cfg.reset_position_ids
        and position_embedding_type == "alibi"
        and not data_cfg.reset_attention_mask
    ):
        raise ValueError(
            "reset_position_ids does nothing with position_embedding_type=alibi (ALiBi has no position "
            "ids; its bias depends on i - j alone): add reset_attention_mask to keep documents apart, "
            "or drop reset_position_ids"
        )
    vocab_size = context.vocab_size
    eod = eod_token(data_cfg.tokenizer_file) if packs_documents(data_cfg) else None
    if eod is not None and eod >= vocab_size:
        raise ValueError(
            f"reset_position_ids, reset_attention_mask and eod_mask_loss find "
            f"documents by the tokenizer's end-of-document id {eod}, which is not "
            f"below vocab_size={vocab_size}: set the tokenizer_file the data was "
            "prepared with"
        )


def check_split(data_cfg, context):
    """split that cannot be parsed, or that gives a part of the run no documents (context: a
    DataContext): training none (its first batch would fail), validation none where eval_iters
    asks for it. Named validation sets read their own documents: with them, validation's share
    may be none."""
    split = data_cfg.split
    train, valid, _ = data.parse_split(split)  # its ValueError names split and the form
    if not context.eval_only and train == 0:
        raise ValueError(
            f"split {split!r} gives training no documents; give train a share (e.g. 949,50,1), "
            "or use --eval_only"
        )
    if data_cfg.valid_weighted_split_names or valid > 0:
        return
    if context.eval_only:  # training.evaluate_only's words, before the model is built
        raise ValueError(
            f"eval_only: no validation data (split {split!r}, eval_iters "
            f"{context.eval_iters}); give the validation split a share (e.g. --split "
            "0,100,0 for the whole data_path)"
        )
    # validation would be dropped without a word: the run would not be the one asked for
    if context.eval_iters > 0:
        raise ValueError(
            f"eval_iters={context.eval_iters} does nothing with split {split!r}: it gives validation "
            "no documents; give validation a share (e.g. 949,50,1), or set eval_iters=0 to train "
            "without validation"
        )
