"""The stability lab's corpus: the bundled Shakespeare under a 512-token byte-level BPE, and its entropies.

    python lab/bpe_corpus.py        # builds data/lab/ once (a few seconds), prints the entropies

With GPT-2's 50,257 tokens a small model is almost all embedding and learns little beyond unigram statistics
(lab/stability.md), so the lab trains on its own vocabulary: a byte-level BPE of 512 tokens (256 bytes, 255
merges, <|endoftext|>) trained with `tokenizers` on the corpus itself. DATA_DIR/lab/ then holds

    tokenizer.json          what train.py reads as tokenizer_file (data.py --tokenizer-file takes it too)
    shakespeare_bpe512.bin/.idx   the corpus under it, a play a document, <|endoftext|> after each
    entropy.json            unigram and bigram entropy of the corpus under it, in nats per token, and the
                            corpus version it was built from (CORPUS_VERSION)

built once: a complete directory of CORPUS_VERSION is reused, a partial one (a build killed half way) or one of
another version is rebuilt.

The entropies are the plug-in estimates over the whole corpus: H1 = -sum p(a) ln p(a), and the conditional
H2 = H(x_t | x_{t-1}) = -sum p(a, b) ln p(b | a) over adjacent pairs within a document. H2 is what a model that
looks only at the previous token can reach at best on this very text (held-out text costs it more), so a run
whose loss is not clearly below H2 has learned nothing that attention over the context could lose.
"""

import json
import math
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import files  # noqa: E402

VOCAB_SIZE = 512
EOD_TOKEN = "<|endoftext|>"
NAME = "shakespeare_bpe512"
# The bundled corpus as the lab's study was trained on it (data.bundled_plays): version 1, the plays' markdown. The
# plain text of version 2 makes another BPE and other tokens (2.62M instead of 2.67M; bigram entropy 3.528 instead
# of 3.509 nats), so the finished runs of lab/stability.md would no longer be this code's: a new version, a new
# study.
CORPUS_VERSION = 1


def train_tokenizer(texts, vocab_size=VOCAB_SIZE):
    """A byte-level BPE (GPT-2's pre-tokenizer and byte alphabet) of vocab_size tokens, EOD included."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def entropies(documents, vocab_size):
    """(unigram, bigram) entropy in nats per token of token documents: H(x) and H(x_t | x_{t-1}), the pairs taken
    within documents. Plug-in estimates from the counts."""
    unigram = np.zeros(vocab_size, dtype=np.int64)
    pairs = np.zeros(vocab_size * vocab_size, dtype=np.int64)
    for doc in documents:
        doc = np.asarray(doc, dtype=np.int64)
        unigram += np.bincount(doc, minlength=vocab_size)
        pairs += np.bincount(doc[:-1] * vocab_size + doc[1:], minlength=vocab_size * vocab_size)
    p = unigram[unigram > 0] / unigram.sum()
    h1 = float(-(p * np.log(p)).sum())
    pairs = pairs.reshape(vocab_size, vocab_size)
    joint = pairs / pairs.sum()
    given = pairs / np.maximum(pairs.sum(axis=1, keepdims=True), 1)  # p(b | a)
    nz = pairs > 0
    h2 = float(-(joint[nz] * np.log(given[nz])).sum())
    return h1, h2


DATA_DIR = os.path.join(ROOT, "data")


def build(data_dir=DATA_DIR):
    """Build DATA_DIR/lab/ unless complete; returns {"prefix", "tokenizer_file", "vocab_size", "tokens",
    "unigram_entropy", "bigram_entropy"} (entropy.json, written last, marks a complete build)."""
    import data

    directory = os.path.join(data_dir, "lab")
    summary_file = os.path.join(directory, "entropy.json")
    tokenizer_file, prefix = (
        os.path.join(directory, "tokenizer.json"),
        os.path.join(directory, NAME),
    )
    if os.path.exists(summary_file):
        with open(summary_file) as f:
            summary = json.load(f)
        if summary.get("corpus_version") == CORPUS_VERSION:
            return {**summary, "prefix": prefix, "tokenizer_file": tokenizer_file}
    os.makedirs(directory, exist_ok=True)
    texts = data.bundled_plays(CORPUS_VERSION)
    with files.replaced(tokenizer_file) as tmp:
        train_tokenizer(texts).save(tmp)
    tok = data.get_tokenizer(tokenizer_file)
    assert tok.n_vocab == VOCAB_SIZE, tok.n_vocab
    documents = [tok.encode_ordinary(text) + [tok.eot_token] for text in texts]
    data.write_indexed_dataset(prefix, documents, dtype=data.token_dtype(tok.n_vocab))
    h1, h2 = entropies(documents, VOCAB_SIZE)
    summary = {
        "corpus_version": CORPUS_VERSION,
        "vocab_size": VOCAB_SIZE,
        "tokens": sum(len(d) for d in documents),
        "uniform": math.log(VOCAB_SIZE),
        "unigram_entropy": h1,
        "bigram_entropy": h2,
    }
    files.write_text(json.dumps(summary, indent=1), summary_file)
    return {**summary, "prefix": prefix, "tokenizer_file": tokenizer_file}


if __name__ == "__main__":
    s = build()
    print(
        f"{s['prefix']}: {s['tokens']:,} tokens of a {s['vocab_size']}-token BPE ({s['tokenizer_file']}); "
        f"entropy per token: uniform {s['uniform']:.3f}, unigram {s['unigram_entropy']:.3f}, "
        f"bigram (given the previous token) {s['bigram_entropy']:.3f} nats"
    )
