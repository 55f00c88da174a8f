"""tokenizer_file: a Hugging Face tokenizer.json (here a small BPE trained by the test on one play) for data.py
preprocessing and the trainer's sample, its end-of-document id, and the vocabulary check."""

import json
import subprocess
import sys

import numpy as np
import pytest

import data
import tokenizer
from helpers import ROOT, build_tokenizer_file, play_corpus, run_main

pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    return build_tokenizer_file(tmp_path_factory.mktemp("tok") / "tokenizer.json")


def test_tokenizer_file_round_trip_and_eod(tokenizer_file, tmp_path):
    tok = data.get_tokenizer(tokenizer_file)
    assert tok.n_vocab == 400 and tok.eot_token == 2  # "</s>", BLOOM's end of document
    text = "ROMEO:\nBut soft, what light through yonder window breaks?"
    ids = tok.encode_ordinary(text)
    assert tok.decode(ids) == text and max(ids) < 400 and tok.eot_token not in ids
    other = build_tokenizer_file(tmp_path / "neox.json", eod="<|endoftext|>")
    assert data.get_tokenizer(other).eot_token == 2
    assert data.get_tokenizer().eot_token == data.EOD == 50256  # GPT-2 stays the default


def test_bad_tokenizer_files_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer_file .*missing.json not found"):
        tokenizer.TokenizerFile(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not a Hugging Face tokenizer.json"):
        tokenizer.TokenizerFile(str(tmp_path / "bad.json"))
    no_eod = build_tokenizer_file(tmp_path / "no_eod.json", eod="<sep>")
    with pytest.raises(ValueError, match="none of the end-of-document tokens"):
        tokenizer.TokenizerFile(no_eod)


def test_preprocess_with_tokenizer_file(tokenizer_file, tmp_path):
    docs = ["Now is the winter of our discontent", "Made glorious summer by this sun of York;"]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    proc = subprocess.run(
        [
            sys.executable,
            "data.py",
            "--input",
            str(tmp_path / "in.jsonl"),
            "--output-prefix",
            str(tmp_path / "out"),
            "--workers",
            "1",
            "--tokenizer-file",
            tokenizer_file,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    ds = data.IndexedDataset(str(tmp_path / "out"))
    tok = data.get_tokenizer(tokenizer_file)
    for i, d in enumerate(docs):
        assert ds.get(i).tolist() == tok.encode_ordinary(d) + [tok.eot_token]
    assert data.token_dtype(250_680) == np.int32 and data.token_dtype(50257) == np.uint16


TINY = [
    "--num_layers=2",
    "--hidden_size=32",
    "--num_attention_heads=4",
    "--seq_length=32",
    "--micro_batch_size=4",
    "--global_batch_size=4",
    "--train_iters=3",
    "--log_interval=1",
    "--eval_iters=0",
    "--device=cpu",
    "--position_embedding_type=alibi",
    "--embed_layernorm",
    "--save=none",
    "--save_interval=none",
]


def test_training_refuses_a_vocabulary_mismatch(tokenizer_file, tmp_path):
    with pytest.raises(
        ValueError, match=r"has 400 tokens but vocab_size is 50257; set vocab_size=400"
    ):
        run_main(*TINY, f"--tokenizer_file={tokenizer_file}", f"--data_path={tmp_path}/x")
    with pytest.raises(ValueError, match="tokenizer_file is set but data_path is not"):
        run_main(*TINY, f"--tokenizer_file={tokenizer_file}", "--vocab_size=400")


def test_training_samples_with_the_tokenizer_file(tokenizer_file, tmp_path):
    out = run_main(
        *TINY,
        f"--tokenizer_file={tokenizer_file}",
        "--vocab_size=400",
        f"--data_path={play_corpus(tokenizer_file, tmp_path)}",
        "--sample_tokens=12",
        "--split=1,0,0",
    )
    sample = out.split(" sample ")[1].split("\n", 1)[1]
    assert sample.startswith("ROMEO:\n") and len(sample) > len("ROMEO:\n")
