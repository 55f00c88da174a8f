"""Time and peak memory of building a GPTDataset's index arrays at scale, on a synthetic corpus.

    python tools/bench_index.py --samples 300_000_000 --seq_length 2048 --epochs 1.0 --mean_doc_tokens 2048
    python tools/bench_index.py --samples 2_929_680 --seq_length 1024 --corpus_tokens 69_000 --mean_doc_tokens 2300

Only the document count and sizes matter to the index, not the tokens: the .idx is real (sizes drawn from a
log-normal around mean_doc_tokens), the .bin is a sparse file of the right length, so a 600B-token corpus
costs its index (20 bytes a document) on disk and nothing else. Reported: the build time (wall clock and CPU
time: on a shared machine the CPU time is the honest one), the time to save the three .npy files, and the
peak RSS of the process, which includes the .idx pages read.
"""

import argparse
import os
import resource
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import data  # noqa: E402
import files  # noqa: E402


def write_synthetic_corpus(prefix, num_docs, mean_doc_tokens, seed=0):
    """PREFIX.idx with log-normal document sizes (sigma 1, mean mean_doc_tokens) and a sparse PREFIX.bin."""
    rng = np.random.default_rng(seed)
    sigma = 1.0
    sizes = np.empty(num_docs, np.int32)
    for lo in range(0, num_docs, 1 << 24):  # in chunks: bounded temporaries
        n = min(1 << 24, num_docs - lo)
        mu = np.log(mean_doc_tokens) - sigma**2 / 2
        sizes[lo : lo + n] = np.clip(rng.lognormal(mu, sigma, n), 1, 2**31 - 1)
    with open(prefix + ".idx", "wb") as f:
        f.write(
            data.HEADER.pack(
                data.MAGIC, 1, data.DTYPE_TO_CODE[np.dtype(np.uint16)], num_docs, num_docs + 1
            )
        )
        f.write(sizes.tobytes())
        pointers = np.empty(0, np.int64)
        offset = 0
        for lo in range(0, num_docs, 1 << 24):
            chunk = sizes[lo : lo + (1 << 24)]
            pointers = np.cumsum(chunk, dtype=np.int64) - chunk + offset
            offset = int(pointers[-1]) + int(chunk[-1])
            f.write((pointers * 2).tobytes())
        for lo in range(0, num_docs + 1, 1 << 24):
            f.write(np.arange(lo, min(lo + (1 << 24), num_docs + 1), dtype=np.int64).tobytes())
    with open(prefix + ".bin", "wb") as f:
        f.truncate(2 * offset)  # sparse: no blocks on disk
    return offset


def check_args(parser, args):
    """Refuse, before the corpus is written, a size the index cannot be built of (a division by
    zero, or a benchmark of nothing) and a --dir the work cannot go in."""
    for flag, value in (
        ("--samples", args.samples),
        ("--seq_length", args.seq_length),
        ("--corpus_tokens", 1 if args.corpus_tokens is None else args.corpus_tokens),
    ):
        if value < 1:
            parser.error(f"{flag} {value} must be at least 1")
    for flag, value in (("--mean_doc_tokens", args.mean_doc_tokens), ("--epochs", args.epochs)):
        if not value > 0:
            parser.error(f"{flag} {value} must be above 0")
    if args.dir is not None:
        try:
            files.check_output_dir(args.dir, "--dir", "an existing directory")
        except ValueError as e:
            parser.error(str(e))
        # the work goes in a temporary folder inside it, removed at the end: --dir is not ours to make
        if not os.path.isdir(args.dir):
            parser.error(f"--dir {args.dir} does not exist: give an existing directory")


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=lambda s: int(s.replace("_", "")), required=True)
    parser.add_argument("--seq_length", type=int, default=2048)
    parser.add_argument("--mean_doc_tokens", type=float, default=2048)
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--epochs", type=float, default=1.0, help="corpus size in epochs of the samples asked for"
    )
    group.add_argument(
        "--corpus_tokens", type=lambda s: int(s.replace("_", "")), help="corpus size in tokens"
    )
    parser.add_argument(
        "--dir", default=None, help="where to write the corpus and the cache (default: a temp dir)"
    )
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    check_args(parser, args)

    corpus_tokens = args.corpus_tokens or int(args.epochs * args.samples * args.seq_length)
    num_docs = max(1, round(corpus_tokens / args.mean_doc_tokens))
    work = tempfile.mkdtemp(dir=args.dir)
    try:
        t0 = time.time()
        tokens = write_synthetic_corpus(
            os.path.join(work, "corpus"), num_docs, args.mean_doc_tokens
        )
        epochs = args.samples * args.seq_length / tokens
        print(
            f"corpus: {num_docs:,} documents, {tokens:,} tokens; {args.samples:,} samples x {args.seq_length} "
            f"take {epochs:,.2f} epochs of it; written in {time.time() - t0:.1f}s"
        )
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        indexed = data.IndexedDataset(os.path.join(work, "corpus"))
        documents = np.arange(num_docs, dtype=np.int32 if num_docs < 2**31 else np.int64)
        # compile (or load numba's cache) first
        data.index_arrays(indexed.sizes[:1], documents[:1], 1, 1, 0)
        t0, c0 = time.time(), time.process_time()
        arrays = data.index_arrays(
            indexed.sizes, documents, args.samples, args.seq_length, args.seed
        )
        t_build, c_build = time.time() - t0, time.process_time() - c0
        t0 = time.time()
        for name, array in zip(("doc_idx", "sample_idx", "shuffle_idx"), arrays):
            np.save(os.path.join(work, name + ".npy"), array)
        t_save = time.time() - t0
        size = sum(a.nbytes for a in arrays)
        del arrays
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(
            f"index:  built in {t_build:.1f}s ({c_build:.1f}s of CPU time), saved in {t_save:.1f}s "
            f"({size / 2**30:.2f} GiB of arrays); "
            f"peak RSS {rss / 2**20:.2f} GiB (the corpus writer alone: {rss0 / 2**20:.2f} GiB)"
        )
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
