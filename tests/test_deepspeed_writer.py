"""Megatron-DeepSpeed checkpoints written by DeepSpeed itself, imported (megatron_ds.py).

tests/deepspeed_writer.py builds a GPTModelPipe-shaped model (the embedding with its LayerNorm and
learned positions as a TiedLayerSpec, 2 layers, the tied output layer) as a DeepSpeed
PipelineModule, trains it two steps with DeepSpeed 0.19's pipeline engine at PP2 x DP2 (4 gloo
processes on CPU) and saves it with `engine.save_checkpoint` and Megatron's client state, in three
settings:
- bf16 without ZeRO (BF16_Optimizer: BLOOM-176B's setup), whose engine saves param_shapes=None;
- bf16 ZeRO-1, then turned into a universal checkpoint by DeepSpeed's own ds_to_universal as the
  bigscience fork's checkpoints must be (no universal_checkpoint_info: --inject_missing_state);
- fp32 ZeRO-1 with microsoft's universal_checkpoint_info, and its universal checkpoint.
Each import holds, bit for bit, what DeepSpeed's own getters (safe_get_full_fp32_param,
safe_get_full_optimizer_state) and the module returned at save time: the weights, fp32 masters and
Adam's moments of every parameter from the stage that trains it, and Adam's step; the imported
model computes the logits the writer's model does. The universal checkpoint of the bigscience-fork
one holds the last stage's untrained copies of the position embedding and the embedding LayerNorm:
refused, naming them.
"""

import os
import runpy
import signal
import subprocess
import sys

import pytest
import torch

import arguments
import checkpoint
import deepspeed_writer
import megatron_ds
import parallel
from helpers import ROOT
from model import GPT, GPTConfig
from sections import section

PP, LAYERS, VOCAB = 2, 2, 250  # deepspeed_writer's
SETTINGS = ["bf16s0:bf16:0", "bf16z1:bf16:1:universal", "fp32z1:fp32:1:info:universal"]
TIED = "tied_modules.embed."
EMBED = {
    "word_embeddings.weight": "embed.word.weight",
    "position_embeddings.weight": "embed.position.weight",
    "word_embeddings.norm.weight": "embed.norm.weight",
    "word_embeddings.norm.bias": "embed.norm.bias",
}
BLOCK = {
    "input_layernorm": "ln_1",
    "self_attention.query_key_value": "attn.qkv",
    "self_attention.dense": "attn.proj",
    "post_attention_layernorm": "ln_2",
    "mlp.dense_h_to_4h": "mlp.fc1",
    "mlp.dense_4h_to_h": "mlp.fc2",
}
KEYS = ("fp32", "exp_avg", "exp_avg_sq")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """DeepSpeed's save directories of SETTINGS, written in a process tree of their own (the test
    process never initializes torch.distributed)."""
    root = tmp_path_factory.mktemp("deepspeed_writer")
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    command = [sys.executable, os.path.join(ROOT, "tests", "deepspeed_writer.py"), str(root)]
    # a session of its own: a hung gloo rank is ended with the whole tree, not left behind
    proc = subprocess.Popen(
        [*command, *SETTINGS],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=1200)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, f"{out[-3000:]}\n{err[-5000:]}"
    return root


def _import(source, ours):
    main = runpy.run_path(os.path.join(ROOT, "tools", "import_megatron_deepspeed.py"))["main"]
    return main(["--load", str(source), "--save", str(ours), "--vocab_size", str(VOCAB)])


def _our_name(theirs):
    """Ours of a name in DeepSpeed's PipelineModule (GPTModelPipe's indices: 3.. the blocks, LAYERS
    + 4 the final LayerNorm)."""
    if theirs.startswith(TIED):
        return EMBED[theirs[len(TIED) :]]
    layer, key = theirs.split(".", 1)
    if int(layer) == LAYERS + 4:
        return f"ln_f.{key}"
    module, what = key.rsplit(".", 1)
    return f"blocks.{int(layer) - 3}.{BLOCK[module]}.{what}"


def _references(save_dir):
    """({our name: DeepSpeed's tensors at save time}, the same of the last stage's copies of the
    tied module): each parameter from the stage that trains it, the tied embedding module from the
    first."""
    stages = [
        torch.load(os.path.join(save_dir, f"reference_stage{s}.pt"), weights_only=False)["tensors"]
        for s in range(PP)
    ]
    want = {_our_name(n): t for s in reversed(range(PP)) for n, t in stages[s].items()}
    last_copies = {_our_name(n): t for n, t in stages[-1].items() if n.startswith(TIED)}
    return want, last_copies


def _optimizer(save_dir):
    """The class of DeepSpeed's optimizer that wrote save_dir."""
    return torch.load(save_dir / "reference_stage0.pt", weights_only=False)["optimizer"]


def _our_rank(tag_dir, stage):
    """{our name: {"weight", "fp32", "exp_avg", "exp_avg_sq", "step"}} of stage `stage` of our TP1 x
    PP2 files."""
    g = parallel.Grid(1, PP, world_size=PP, rank=stage)
    model = torch.load(checkpoint.model_file(str(tag_dir), g), weights_only=False)["model"]
    rank = torch.load(checkpoint.rank_file(str(tag_dir), g), weights_only=False)["optimizer"]
    masters = rank.get("fp32_master_weights")
    out = {}
    for i, name in enumerate(
        torch.load(checkpoint.rank_file(str(tag_dir), g), weights_only=False)["param_names"]
    ):
        state = rank["state"][i]
        out[name] = {
            "weight": model[name],
            "fp32": model[name] if masters is None else masters[i],
            "exp_avg": state["exp_avg"],
            "exp_avg_sq": state["exp_avg_sq"],
            "step": int(state["step"]),
        }
    return out


def _assert_holds(ours, save_dir, dtype, universal=False):
    """Every stage of our import holds DeepSpeed's tensors bit for bit: each parameter's weight (the
    module's, in the run's dtype; a universal checkpoint's are its fp32 masters), fp32 master and
    both moments, and the step; the last stage's output layer is the tied word embedding. A
    universal checkpoint made with microsoft's universal_checkpoint_info drops the vocabulary's
    padding rows: they come back as zeros."""
    want, last_copies = _references(save_dir)
    seen = set()
    for stage in range(PP):
        for name, have in _our_rank(ours / "global_step2", stage).items():
            source = "embed.word.weight" if name == "output_weight" else name
            expected = dict(want[source])
            if universal:
                expected["weight"] = expected["fp32"].to(expected["weight"].dtype)
            for key, t in expected.items():
                if universal and source == "embed.word.weight":
                    t = torch.cat([t[:VOCAB], t.new_zeros(t.shape[0] - VOCAB, *t.shape[1:])])
                assert have[key].dtype == t.dtype and torch.equal(have[key], t), (stage, name, key)
            assert have["step"] == 2, (stage, name)
            seen.add(source)
    assert (
        seen == set(want)
        and have["weight"].dtype == {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    )
    # lesson 11 holds in DeepSpeed's checkpoint: the last stage's word embedding is the first's
    assert all(
        torch.equal(last_copies["embed.word.weight"][k], want["embed.word.weight"][k]) for k in KEYS
    )


@pytest.mark.slow
def test_bf16_without_zero_reads_its_optimizer_from_the_slice_mappings(written, tmp_path):
    """BLOOM-176B's setup (bf16, ZeRO stage 0: DeepSpeed's BF16_Optimizer, its partitions cut over
    DP2): DeepSpeed 0.19 saves param_shapes=None; the names and places come from the partitions'
    param_slice_mappings, the shapes from the layer files."""
    engine = megatron_ds.read_file(
        str(written / "bf16s0" / "global_step2" / "mp_rank_00_model_states.pt"), ""
    )
    assert engine["param_shapes"] is None  # what makes this case
    assert _optimizer(written / "bf16s0") == "BF16_Optimizer"
    _import(written / "bf16s0", tmp_path / "ours")
    _assert_holds(tmp_path / "ours", written / "bf16s0", "bf16")


def _layer(tag_dir, index):
    return torch.load(tag_dir / f"layer_{index:02d}-model_00-model_states.pt", weights_only=False)


@pytest.mark.slow
def test_the_imported_model_computes_what_the_deepspeed_model_did(written, tmp_path):
    """The writer's modules (GPTModelPipe's layers) holding the layer files' weights and our model
    holding the import's, both in fp32 on one process: the same logits (max difference 0.0 when
    measured: the same operations in the same order)."""
    _import(written / "bf16s0", tmp_path / "ours")
    source, tag = written / "bf16s0" / "global_step2", tmp_path / "ours" / "global_step2"
    embed, norm = deepspeed_writer.EmbeddingPipe(), torch.nn.LayerNorm(deepspeed_writer.HIDDEN)
    embed.load_state_dict(_layer(source, 1))
    norm.load_state_dict(_layer(source, LAYERS + 4))
    blocks = [deepspeed_writer.ParallelTransformerLayerPipe() for _ in range(LAYERS)]
    for i, block in enumerate(blocks):
        block.load_state_dict(_layer(source, 3 + i))
    weights = {}
    for stage in range(PP):
        blob = torch.load(
            checkpoint.model_file(str(tag), parallel.Grid(1, PP, PP, stage)), weights_only=False
        )
        weights.update((k, v.float()) for k, v in blob["model"].items() if k != "output_weight")
    cfg = arguments.Config(**blob["run"]["config"])
    ours = GPT(section(GPTConfig, cfg), grid=parallel.Grid(1, 1, world_size=1, rank=0))
    ours.load_state_dict(weights)
    seq = deepspeed_writer.SEQ
    tokens = torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        x = embed((tokens, torch.arange(seq).expand(2, seq)))
        for block in blocks:
            x = block(x)
        want = deepspeed_writer.logits(embed, norm(x))
        torch.testing.assert_close(ours.eval()(tokens), want, rtol=0, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name, dtype", [("bf16z1", "bf16"), ("fp32z1", "fp32")])
def test_zero1_checkpoints_of_deepspeed_import_bit_for_bit(written, tmp_path, name, dtype):
    assert _optimizer(written / name) == "DeepSpeedZeroOptimizer"
    _import(written / name, tmp_path / "ours")
    _assert_holds(tmp_path / "ours", written / name, dtype)


@pytest.mark.slow
def test_a_universal_checkpoint_with_microsofts_info_imports_bit_for_bit(written, tmp_path):
    """ds_to_universal given the pipeline-replicated parameters (microsoft's
    universal_checkpoint_info) keeps the first stage's copies: the import is DeepSpeed's state, the
    padding rows it drops aside."""
    _import(written / "fp32z1" / "universal", tmp_path / "ours")
    _assert_holds(tmp_path / "ours", written / "fp32z1", "fp32", universal=True)


@pytest.mark.slow
def test_a_universal_checkpoint_of_a_bigscience_fork_checkpoint_is_refused(written, tmp_path):
    """Without universal_checkpoint_info, ds_to_universal keeps the last stage's copy of the tied
    embedding module: its position embedding and embedding LayerNorm, never used there, untrained
    (the position embedding's fp32 value the last stage's, Adam's moments zero, where the first
    stage's trained copy has none zero). The import names them and writes nothing; the checkpoint
    ds_to_universal was given imports."""
    universal = written / "bf16z1" / "universal" / "global_step2_universal"
    zero = universal / "zero" / f"{TIED}position_embeddings.weight"
    kept = {k: torch.load(zero / f"{k}.pt", weights_only=False)["param"] for k in KEYS}
    stages = [
        torch.load(written / "bf16z1" / f"reference_stage{s}.pt", weights_only=False)["tensors"][
            f"{TIED}position_embeddings.weight"
        ]
        for s in range(PP)
    ]
    assert torch.equal(kept["fp32"], stages[-1]["fp32"]) and not kept["exp_avg_sq"].any()
    assert stages[0]["exp_avg_sq"].all() and not torch.equal(kept["fp32"], stages[0]["fp32"])
    with pytest.raises(
        ValueError,
        match=r"holds untrained copies of parameters that the first pipeline stage "
        r"trains: zero/tied_modules.embed.position_embeddings.weight \(Adam's "
        r"exp_avg_sq zero everywhere after 2 steps\), zero/tied_modules.embed."
        r"word_embeddings.norm.bias .*import the original global_stepN directory",
    ):
        _import(written / "bf16z1" / "universal", tmp_path / "ours")
    assert not (tmp_path / "ours").exists()
    _import(written / "bf16z1", tmp_path / "original")  # as the message says: the trained copy
    _assert_holds(tmp_path / "original", written / "bf16z1", "bf16")
