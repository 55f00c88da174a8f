"""hf.py: a transformers GPT2LMHeadModel or BloomForCausalLM directory (random init, saved locally; nothing is
downloaded) imported into stablegpt computes HF's logits within 1e-5 at TP1 and at TP2 (2 gloo processes), with
GPT-2's real vocabulary of 50257 (padded to 50304 for TP1, 50432 for TP2); the files as the Hub has them
(sharded, .bin without the "transformer." prefix, GPT-2's mask buffers) import the same; HF -> a TP2 x PP2
checkpoint -> tools/export_hf.py -> HF is weight-identical; a config contradicting the model and a missing or
corrupt directory are refused with one message each. A run started with init_from_hf (train.py) has transformers'
loss at its first step, trains, and resumes bit-exactly from its checkpoint, which then wins over the model."""

import json
import math
import os
import sys

import pytest
import torch

import arguments
import hf
import launch
import loader
import parallel
from helpers import (  # noqa: F401
    ROOT,
    assert_same,
    build_tokenizer_file,
    corpus,
    data_of,
    final_state,
    losses,
    plan_of,
    play_corpus,
    run_cli,
    run_main,
    spawn,
    write_checkpoint,
)
from model import GPT, GPTConfig

transformers = pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(ROOT, "tools"))
import export_hf  # noqa: E402

SHAPE = dict(n_layer=2, n_head=4)


def save_gpt2(directory, vocab_size=50257, seed=0):
    """A random GPT-2 (tiny, GPT-2's vocabulary), every weight away from its init (a LayerNorm or bias mapped to
    the wrong place would not show at ones and zeros), saved with save_pretrained."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        **SHAPE,
        n_embd=32,
        n_positions=24,
        vocab_size=vocab_size,
        activation_function="gelu_new",
        layer_norm_epsilon=1e-5,
    )
    return _perturbed_and_saved(transformers.GPT2LMHeadModel(config), directory)


def save_bloom(directory, vocab_size=300, seed=1):
    torch.manual_seed(seed)
    config = transformers.BloomConfig(
        **SHAPE, hidden_size=32, vocab_size=vocab_size, layer_norm_epsilon=1e-6
    )
    return _perturbed_and_saved(transformers.BloomForCausalLM(config), directory)


def _perturbed_and_saved(model, directory):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.eval().save_pretrained(directory)
    return model


def ours(directory, tp=1, **overrides):
    cfg = GPTConfig(
        **{**hf.config_from_hf(directory), **overrides},
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
    )
    model = GPT(cfg).eval()
    hf.load_into(model, directory)
    return model


def ids(vocab_size, length=24, seed=0):
    """Token ids from all over the vocabulary, its last id and the ids of both TP=2 halves included."""
    out = torch.randint(0, vocab_size, (3, length), generator=torch.Generator().manual_seed(seed))
    out[0, :3] = torch.tensor([vocab_size - 1, 0, vocab_size // 2])
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf")
    gpt2, bloom = save_gpt2(str(tmp / "gpt2")), save_bloom(str(tmp / "bloom"))
    return {"gpt2": (str(tmp / "gpt2"), gpt2), "bloom": (str(tmp / "bloom"), bloom)}


def test_config_from_the_model(models):
    assert hf.config_from_hf(models["gpt2"][0]) == dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=24,
        vocab_size=50257,
        layernorm_epsilon=1e-5,
        activation="gelu_tanh",
        position_embedding_type="learned",
        embed_layernorm=False,
    )
    assert hf.config_from_hf(models["bloom"][0]) == dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=300,
        layernorm_epsilon=1e-6,
        # ALiBi: any seq_length
        activation="gelu_tanh",
        position_embedding_type="alibi",
        embed_layernorm=True,
    )


@pytest.mark.parametrize("kind", ["gpt2", "bloom"])
def test_logits_match_transformers_at_tp1(models, kind):
    directory, reference = models[kind]
    x = ids(reference.config.vocab_size)
    model = ours(directory)
    with torch.no_grad():
        diff = (
            (model(x)[..., : reference.config.vocab_size] - reference(x).logits).abs().max().item()
        )
    assert diff <= 1e-5, diff


def _tp2_logits(cases):
    for directory, x, expected in cases:
        model = ours(directory, tp=2)
        # this rank's half
        assert model.embed.word.weight.shape[0] * 2 == model.config.padded_vocab_size
        with torch.no_grad():
            logits = parallel.gather_from_tp(model(x))[..., : expected.shape[-1]]
        diff = (logits - expected).abs().max().item()
        assert diff <= 1e-5, (
            f"{directory} at TP=2, rank {parallel.grid.tp_rank}: logits differ by {diff}"
        )


def test_logits_match_transformers_at_tp2(models):
    cases = []
    for directory, reference in models.values():
        x = ids(reference.config.vocab_size, seed=1)
        with torch.no_grad():
            cases.append((directory, x, reference(x).logits))
    assert GPTConfig(vocab_size=50257, tensor_model_parallel_size=2).padded_vocab_size == 50432
    spawn(_tp2_logits, 2, 2, 1, cases)


def test_hub_files_import_the_same(models, tmp_path):
    """Sharded safetensors with an index; a .bin written from the bare model (no "transformer." prefix) with the
    causal-mask buffers older GPT-2 files carry and the tied lm_head."""
    directory, reference = models["gpt2"]
    expected = {n: p.clone() for n, p in ours(directory).named_parameters()}
    reference.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert os.path.exists(tmp_path / "sharded" / "model.safetensors.index.json")
    hub = tmp_path / "bin"
    reference.config.save_pretrained(hub)
    state = {k.removeprefix("transformer."): v for k, v in reference.state_dict().items()}
    for i in range(reference.config.n_layer):
        state[f"h.{i}.attn.bias"] = torch.ones(1, 1, 24, 24).tril()
        state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    torch.save(state, hub / "pytorch_model.bin")
    for variant in (tmp_path / "sharded", hub):
        got = dict(ours(str(variant)).named_parameters())
        assert all(torch.equal(got[n], expected[n]) for n in expected), variant


@pytest.mark.parametrize("kind, layout", [("gpt2", (2, 2)), ("bloom", (2, 1))])
def test_hf_to_checkpoint_to_hf_is_weight_identical(models, kind, layout, tmp_path):
    """Imported straight into the ranks of a TP x PP layout, saved, exported by tools/export_hf.py (which gathers
    the layout back into one process): every tensor and the config's shapes as they were."""
    directory, reference = models[kind]
    tp, pp = layout
    keys = hf.config_from_hf(directory)
    write_checkpoint(
        str(tmp_path / "ckpt"),
        [
            *(f"--{k}={v}" for k, v in keys.items()),
            f"--tensor_model_parallel_size={tp}",
            f"--pipeline_model_parallel_size={pp}",
        ],
        fill=lambda stage: hf.load_into(stage, directory),
    )
    diff, exported, _ = export_hf.export(str(tmp_path / "ckpt"), str(tmp_path / "back"))
    assert diff <= 1e-5
    from safetensors.torch import load_file

    before, after = reference.state_dict(), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert set(after) == set(before) - {"lm_head.weight"}  # tied: transformers does not save it
    for name, tensor in after.items():
        assert torch.equal(tensor, before[name]), name
    saved, original = json.load(open(tmp_path / "back" / "config.json")), reference.config.to_dict()
    for key in (
        "n_layer",
        "n_head",
        "vocab_size",
        "layer_norm_epsilon",
        "n_embd",
        "hidden_size",
        "n_positions",
        "activation_function",
        "tie_word_embeddings",
    ):
        assert saved.get(key) == original.get(key), key


# -----------------------------------------------------------------------------
# Refusals


def test_config_that_contradicts_the_model_is_refused(models):
    directory = models["gpt2"][0]
    keys = hf.config_from_hf(directory)
    with pytest.raises(
        ValueError,
        match=r"num_layers 4 \(config\) vs 2 \(model\), hidden_size 64 \(config\) vs "
        r"32 \(model\)",
    ):
        hf.check_config(GPTConfig(**{**keys, "num_layers": 4, "hidden_size": 64}), directory)
    with pytest.raises(ValueError, match=r"embed_layernorm True \(config\) vs False \(model\)"):
        hf.check_config(GPTConfig(**{**keys, "embed_layernorm": True}), directory)
    with pytest.raises(ValueError, match=r"seq_length 48 \(config\) vs 24 \(model\)"):
        hf.check_config(GPTConfig(**{**keys, "seq_length": 48}), directory)
    with pytest.raises(ValueError, match=r"contradicts .*: normformer=True: neither"):
        hf.check_config(GPTConfig(**{**keys, "normformer": True}), directory)
    hf.check_config(
        GPTConfig(
            **{**keys, "seq_length": 16, "hidden_dropout": 0.3, "z_loss": 1e-4},
            attention_backend="math",  # the kernel, not the function: was refused, "neither has it"
        ),
        directory,
    )
    short = ours(directory, seq_length=16)  # the first 16 of GPT-2's 24 positions
    assert torch.equal(short.embed.position.weight, models["gpt2"][1].transformer.wpe.weight[:16])
    with pytest.raises(ValueError, match=r"activation 'gelu' \(config\) vs 'gelu_tanh' \(model\)"):
        ours(directory, activation="gelu")  # load_into checks the model it is given too


def test_models_stablegpt_cannot_compute_are_refused(tmp_path):
    transformers.GPT2Config(
        **SHAPE, n_embd=32, vocab_size=50, scale_attn_by_inverse_layer_idx=True
    ).save_pretrained(tmp_path / "scaled")
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx=true"):
        hf.config_from_hf(str(tmp_path / "scaled"))
    transformers.GPT2Config(
        **SHAPE, n_embd=32, vocab_size=50, tie_word_embeddings=False
    ).save_pretrained(tmp_path / "untied")
    with pytest.raises(ValueError, match="tie_word_embeddings=false"):
        hf.config_from_hf(str(tmp_path / "untied"))
    # (LlamaForCausalLM is imported: tests/test_llama.py; GPT-NeoX is not)
    transformers.GPTNeoXConfig().save_pretrained(tmp_path / "neox")
    with pytest.raises(
        ValueError, match="model of type 'gpt_neox'; stablegpt imports GPT2LMHeadModel, Bloom"
    ):
        hf.config_from_hf(str(tmp_path / "neox"))


def test_missing_or_corrupt_directory(models, tmp_path):
    with pytest.raises(
        FileNotFoundError, match="does not exist; nothing is downloaded: fetch the model first"
    ):
        hf.config_from_hf(str(tmp_path / "gpt2"))
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        hf.config_from_hf(str(tmp_path))
    directory, reference = models["gpt2"]
    broken = tmp_path / "broken"
    reference.config.save_pretrained(broken)
    model = GPT(GPTConfig(**hf.config_from_hf(str(broken))))
    with pytest.raises(
        FileNotFoundError, match="holds no weights: none of model.safetensors, pytorch_model.bin"
    ):
        hf.load_into(model, str(broken))
    data = open(os.path.join(directory, "model.safetensors"), "rb").read()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])  # an interrupted download
    with pytest.raises(ValueError, match=r"model.safetensors cannot be read .* download it again"):
        hf.load_into(model, str(broken))
    (broken / "config.json").write_text("{")
    with pytest.raises(ValueError, match=r"config.json cannot be read"):
        hf.config_from_hf(str(broken))


# -----------------------------------------------------------------------------
# A run started from the model: train.py --init_from_hf=DIR (config/finetune.py: training keys only)

RUN = [
    "config/finetune.py",
    "--bf16=false",
    "--micro_batch_size=2",
    "--global_batch_size=4",
    "--log_interval=1",
    "--eval_iters=0",
    "--lr_warmup_samples=0",
    "--lr=1e-3",
    "--lr_decay_samples=40",
    "--save_interval=none",
]


def first_batch_loss(reference, argv):
    """transformers' mean loss over the micro-batches of the run's first iteration (train.py's own data path)."""
    cfg = arguments.prepare(arguments.load_config(argv))
    train = data_of(cfg, plan_of(cfg))[0]
    batches = loader.micro_batches(
        train, 0, 2, cfg.micro_batch_size, cfg.seq_length, torch.device("cpu")
    )
    with torch.no_grad():
        return sum(
            torch.nn.functional.cross_entropy(reference(x).logits.flatten(0, 1), y.flatten()).item()
            for x, y in batches
        ) / len(batches)


@pytest.mark.parametrize("kind", ["gpt2", "bloom"])
def test_run_from_the_model_starts_at_its_loss_trains_and_resumes_exactly(
    models, kind, corpus, tmp_path
):
    """GPT-2's real vocabulary on the bundled corpus; BLOOM with a tokenizer of 280 tokens and 300 embedding rows
    (as bloom-560m: 250680 and 250880), on a play tokenized with it."""
    directory, reference = models[kind]
    if kind == "gpt2":
        data_args = [f"--data_path={corpus}"]
    else:
        tokenizer = build_tokenizer_file(tmp_path / "tokenizer.json", vocab_size=280)
        data_args = [
            f"--data_path={play_corpus(tokenizer, tmp_path)}",
            f"--tokenizer_file={tokenizer}",
            "--seq_length=32",
        ]
    argv = [*RUN, f"--init_from_hf={directory}", *data_args]
    straight = run_main(*argv, "--train_iters=4", f"--save={tmp_path / 'a'}")
    assert f"initialised from the Hugging Face model in {directory}" in straight
    loss = losses(straight)
    expected = first_batch_loss(reference, [*argv, "--train_iters=4"])
    assert math.isclose(float(loss[1]), expected, rel_tol=2e-6), (loss[1], expected)
    assert float(loss[4]) < float(loss[1])
    run_main(*argv, "--train_iters=2", f"--save={tmp_path / 'b'}")
    resumed = run_main(*argv, "--train_iters=4", f"--save={tmp_path / 'b'}")
    assert "not loaded: resuming from the checkpoint" in resumed
    assert losses(resumed) == {i: loss[i] for i in (3, 4)}
    (_, model_a, rank_a), (_, model_b, rank_b) = (
        final_state(tmp_path / "a"),
        final_state(tmp_path / "b"),
    )
    assert_same(model_a["model"], model_b["model"], "model")
    assert_same(rank_a["optimizer"], rank_b["optimizer"], "optimizer")


def test_run_config_that_contradicts_the_model_stops_with_one_message(models):
    """config/tiny.py named on the command line has a model of its own: refused before anything is built, exit 2.
    (Left implicit, its model keys yield to the model: tests/test_llama.py.)"""
    proc = run_cli(
        "config/tiny.py", f"--init_from_hf={models['gpt2'][0]}", "--save=none", expect_ok=False
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count("error:") == 1
    assert (
        "num_layers 4 (config) vs 2 (model)" in proc.stderr
        and "start from config/finetune.py" in proc.stderr
    )


def test_weights_their_config_does_not_describe_are_refused_before_the_run_builds(
    models, corpus, tmp_path, monkeypatch
):
    """A config.json whose vocab_size is not the embedding's rows: the "vocab" step padded the 50257 rows to
    50300 with zero rows in silence. Refused from the files' headers, before the data and the model are built
    (init_from_hf read the weights only in the build)."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in os.listdir(models["gpt2"][0]):
        (broken / name).write_bytes(open(os.path.join(models["gpt2"][0], name), "rb").read())
    settings = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**settings, "vocab_size": 50300}))
    message = (
        "wte.weight in {} has 50257 rows where its config.json says vocab_size 50300: the config does "
        "not describe the weights; download the model again"
    )
    with pytest.raises(ValueError, match=message.format(".*")):
        hf.load_into(GPT(GPTConfig(**hf.config_from_hf(str(broken)))), str(broken))
    proc = run_cli(
        *RUN, f"--init_from_hf={broken}", f"--data_path={corpus}", "--train_iters=2",
        "--save=none", expect_ok=False,
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.count("error:") == 1 and message.format(broken) in proc.stderr
    argv = [*RUN, f"--init_from_hf={broken}", f"--data_path={corpus}", "--train_iters=2"]

    def started(*args, **kwargs):
        raise AssertionError("a process group started before the weights were checked")

    monkeypatch.setattr(launch, "start", started)
    with pytest.raises(ValueError, match=message.format(".*")):
        run_main(*argv, "--save=none")
