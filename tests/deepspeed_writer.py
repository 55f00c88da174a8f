"""DeepSpeed's own writer of Megatron-DeepSpeed checkpoints, as a test fixture: a
GPTModelPipe-shaped model (the embedding with its LayerNorm and learned positions as a
TiedLayerSpec, 2 transformer layers, the final LayerNorm, the tied output layer) built as a
DeepSpeed PipelineModule, trained two steps by DeepSpeed's pipeline engine on CPU (gloo) and saved
by `engine.save_checkpoint` with Megatron's client state (args, iteration, tokens, checkpoint_info:
the bigscience fork's, without universal_checkpoint_info). What DeepSpeed's own getters
(safe_get_full_fp32_param, safe_get_full_optimizer_state) return for every parameter of every stage
at save time is recorded beside the checkpoint (reference_stageS.pt), as is the weight the module
holds.

    python tests/deepspeed_writer.py OUT_DIR NAME:DTYPE:STAGE[:info][:universal] ...

writes OUT_DIR/NAME/ (DeepSpeed's save directory: global_step2/, latest) and
OUT_DIR/NAME/reference_stageS.pt for each setting (DTYPE bf16 or fp32, STAGE the ZeRO stage, 0 or 1;
info: the client state holds microsoft's universal_checkpoint_info; universal: DeepSpeed's
ds_to_universal is run on it, into OUT_DIR/NAME/universal). Its own process tree, so that the test
process never initializes torch.distributed or imports a stand-in `megatron` package.
DS_ACCELERATOR=cpu is set here: DeepSpeed's CPU accelerator takes bf16 and fp32 (fp16 is refused on
CPU).
"""

import argparse
import enum
import math
import os
import sys
import types

import torch
import torch.nn.functional as F
from torch import nn

PP, DP = 2, 2
# VOCAB: the tokenizer's vocabulary; PADDED: Megatron's, make_vocab_size_divisible_by=128
LAYERS, HIDDEN, HEADS, SEQ, VOCAB, PADDED = 2, 16, 2, 8, 250, 256
MICRO, GLOBAL, STEPS = 2, 4, 2  # GLOBAL = MICRO x DP: one micro-batch a step


class PositionEmbeddingType(enum.Enum):  # megatron.enums's, pickled into args as Megatron does
    rotary = 1
    absolute = 2
    alibi = 3


def _megatron_enums():
    """`megatron.enums` importable in this process, so that the args pickle as a Megatron-DeepSpeed
    run's do (the import reads them without Megatron installed)."""
    enums = types.ModuleType("megatron.enums")
    PositionEmbeddingType.__module__ = "megatron.enums"
    enums.PositionEmbeddingType = PositionEmbeddingType
    sys.modules.update({"megatron": types.ModuleType("megatron"), "megatron.enums": enums})


# -----------------------------------------------------------------------------
# GPTModelPipe's layers, their parameter names as Megatron's


class VocabEmbedding(nn.Module):
    """Megatron's VocabParallelEmbedding at TP1 with bigscience's embed_layernorm (its `norm`)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(PADDED, HIDDEN) * 0.02)
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, tokens):
        return self.norm(F.embedding(tokens, self.weight))


class EmbeddingPipe(nn.Module):
    """Megatron's EmbeddingPipe: word (with its LayerNorm) and learned position embeddings. On the
    last stage the same module computes the logits (forward_fn=logits): its position embedding there
    is never used."""

    def __init__(self):
        super().__init__()
        self.word_embeddings = VocabEmbedding()
        self.position_embeddings = nn.Embedding(SEQ, HIDDEN)
        nn.init.normal_(self.position_embeddings.weight, std=0.02)

    @property
    def word_embeddings_weight(self):
        return self.word_embeddings.weight

    def forward(self, inputs):
        tokens, positions = inputs
        return self.word_embeddings(tokens) + self.position_embeddings(positions)


def logits(embedding, hidden):
    return F.linear(hidden, embedding.word_embeddings_weight)


class ParallelTransformerLayerPipe(nn.Module):
    """A pre-LayerNorm GPT block, Megatron's names; the fused QKV's output: [heads, 3, head dim]."""

    def __init__(self):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(HIDDEN)
        self.self_attention = nn.Module()
        self.self_attention.query_key_value = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.self_attention.dense = nn.Linear(HIDDEN, HIDDEN)
        self.post_attention_layernorm = nn.LayerNorm(HIDDEN)
        self.mlp = nn.Module()
        self.mlp.dense_h_to_4h = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.mlp.dense_4h_to_h = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.self_attention.query_key_value(self.input_layernorm(x)).view(
            b, s, HEADS, 3, HIDDEN // HEADS
        )
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(3))
        attention = (
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
            .transpose(1, 2)
            .reshape(b, s, HIDDEN)
        )
        x = x + self.self_attention.dense(attention)
        return x + self.mlp.dense_4h_to_h(
            F.gelu(self.mlp.dense_h_to_4h(self.post_attention_layernorm(x)), approximate="tanh")
        )


def _identity(x):  # in the places of GPTModelPipe's functions (_to_float16, the transposes, ...)
    return x


def loss_fn(output, labels):
    return F.cross_entropy(output.float().view(-1, PADDED), labels.reshape(-1))


def build(topology):
    """GPTModelPipe's list of layers: its indices are the layer files' (1 the embedding, 3.. the
    blocks, LAYERS + 4 the final LayerNorm), partitioned by 'type:transformer' as
    Megatron-DeepSpeed's default."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    specs = [
        _identity,
        TiedLayerSpec("embed", EmbeddingPipe, tied_weight_attr="word_embeddings_weight"),
        _identity,
    ]
    specs += [LayerSpec(ParallelTransformerLayerPipe) for _ in range(LAYERS)]
    specs += [
        _identity,
        LayerSpec(nn.LayerNorm, HIDDEN),
        TiedLayerSpec(
            "embed", EmbeddingPipe, forward_fn=logits, tied_weight_attr="word_embeddings_weight"
        ),
        _identity,
    ]
    return PipelineModule(
        specs, loss_fn=loss_fn, topology=topology, partition_method="type:transformer"
    )


def param_groups(module):
    """Megatron's _get_params_for_weight_decay_optimization: LayerNorms, biases without decay."""
    decay, no_decay = [], []
    for name, p in module.named_parameters():
        norm = "norm" in name or name.startswith(f"{LAYERS + 4}.")  # 6.weight: the final norm
        (no_decay if norm or name.endswith("bias") else decay).append(p)
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


# -----------------------------------------------------------------------------
# Megatron's side of the checkpoint


class AnnealingLR:
    """Megatron's AnnealingLR (linear warm-up, cosine decay, in samples), up to its state_dict."""

    def __init__(self, optimizer, max_lr=1e-3, min_lr=1e-4, warmup=4, decay=40):
        self.optimizer, self.max_lr, self.min_lr = optimizer, max_lr, min_lr
        self.warmup, self.decay = warmup, decay
        self.num_steps = 0
        self.step(0)

    def get_lr(self):
        if self.num_steps <= self.warmup:
            return self.max_lr * self.num_steps / self.warmup
        ratio = min(1.0, (self.num_steps - self.warmup) / (self.decay - self.warmup))
        return self.min_lr + (self.max_lr - self.min_lr) * 0.5 * (math.cos(math.pi * ratio) + 1.0)

    def step(self, increment=GLOBAL):
        self.num_steps += increment
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr()

    def state_dict(self):
        return {
            "max_lr": self.max_lr,
            "warmup_steps": self.warmup,
            "num_steps": self.num_steps,
            "warmup_tokens": 0,
            "num_tokens": self.num_steps * SEQ,
            "decay_style": "cosine",
            "decay_steps": self.decay,
            "min_lr": self.min_lr,
        }


def megatron_args(dtype):
    return argparse.Namespace(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=4 * HIDDEN,
        seq_length=SEQ,
        max_position_embeddings=SEQ,
        padded_vocab_size=PADDED,
        make_vocab_size_divisible_by=128,
        tokenizer_type="PretrainedFromHF",
        layernorm_epsilon=1e-5,
        init_method_std=0.02,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        apply_query_key_layer_scaling=False,
        embed_layernorm=True,
        position_embedding_type=PositionEmbeddingType.absolute,
        bias_gelu_fusion=True,
        openai_gelu=False,
        glu_activation=None,
        apply_residual_connection_post_layernorm=False,
        micro_batch_size=MICRO,
        global_batch_size=GLOBAL,
        rampup_batch_size=None,
        train_iters=10,
        train_samples=None,
        seed=1234,
        weight_decay=0.1,
        clip_grad=1.0,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_eps=1e-8,
        fp16=False,
        bf16=dtype == "bf16",
        loss_scale=None,
        initial_loss_scale=2**32,
        min_loss_scale=1.0,
        loss_scale_window=1000,
        hysteresis=2,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=PP,
        pp_partition_method=None,
        lr_decay_tokens=None,
        consumed_train_samples=STEPS * GLOBAL,
        consumed_train_tokens=STEPS * GLOBAL * SEQ,
        deepspeed=True,
    )


def _batches(seed):
    g = torch.Generator().manual_seed(seed)
    positions = torch.arange(SEQ).expand(MICRO, SEQ)
    while True:
        tokens = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=g)
        yield (tokens[:, :-1], positions), tokens[:, 1:]


def reference(engine):
    """{name: {"weight", "fp32", "exp_avg", "exp_avg_sq"}} of this stage: the module's parameter and
    DeepSpeed's own getters (collectives over the data-parallel group: every rank calls them)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    # DeepSpeedZeroOptimizer links the getters to Adam's state after its first group's first step,
    # when the second group's (torch Adam's lazily made) state does not exist yet: linked again, by
    # its own code
    if hasattr(engine.optimizer, "_hp_optimizer_states_linked"):
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    out = {}
    for name, p in engine.module.named_parameters():
        out[name] = {
            "weight": p.detach().clone(),
            "fp32": safe_get_full_fp32_param(p).clone(),
            "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").clone(),
            "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").clone(),
        }
    return out


# What microsoft's Megatron-DeepSpeed adds to its client state for ds_to_universal (the bigscience
# fork, which wrote tr8b-104B and tr11-176B, adds none): the tied embedding module's parameters,
# held by the first and the last stage, are taken from the first; the vocabulary's padding rows are
# dropped
UNIVERSAL_INFO = {
    "universal_checkpoint_version": 0.2,
    "original_vocab_size": VOCAB,
    "padded_vocab_size": PADDED,
    "vocabulary_parameter_patterns": [r"tied_modules.embed.word_embeddings.weight"],
    "pipeline_replicated_parameter_patterns": [
        r"tied_modules.embed.word_embeddings.weight",
        r"tied_modules.embed.word_embeddings.norm.weight",
        r"tied_modules.embed.word_embeddings.norm.bias",
        r"tied_modules.embed.position_embeddings.weight",
    ],
}


def write(out_dir, name, dtype, stage, info):
    """One setting: train STEPS steps from the same seed, save as Megatron-DeepSpeed does (info:
    with microsoft's universal_checkpoint_info), record the getters."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    torch.manual_seed(1234)
    # Megatron's topology, with a model (TP) axis: the layer files are named layer_XX-model_00-...
    module = build(PipeModelDataParallelTopology(num_pp=PP, num_mp=1, num_dp=DP))
    optimizer = torch.optim.AdamW(
        param_groups(module), lr=0.0, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1
    )
    scheduler = AnnealingLR(optimizer)
    config = {
        "train_batch_size": GLOBAL,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": dtype == "bf16"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed.initialize(
        model=module, optimizer=optimizer, lr_scheduler=scheduler, config=config
    )
    data = _batches(dist.get_rank() % DP)
    for _ in range(STEPS):
        engine.train_batch(data_iter=data)
    args = megatron_args(dtype)
    state = {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": STEPS,
        "tokens": args.consumed_train_tokens,
        "checkpoint_info": {"padded_vocab_size": PADDED, "original_vocab_size": VOCAB},
    }
    if info:
        state["universal_checkpoint_info"] = UNIVERSAL_INFO
    save_dir = os.path.join(out_dir, name)
    engine.save_checkpoint(save_dir, client_state=state)
    ref = reference(engine)
    if engine.grid.data_parallel_id == 0:
        torch.save(
            {
                "stage": engine.stage_id,
                "tensors": ref,
                "optimizer": type(engine.optimizer).__name__,
            },
            os.path.join(save_dir, f"reference_stage{engine.stage_id}.pt"),
        )
    dist.barrier()


def universal(save_dir):
    """DeepSpeed's own ds_to_universal of save_dir's latest checkpoint into save_dir/universal (and
    its latest_universal), with --inject_missing_state, which a checkpoint without
    universal_checkpoint_info (the bigscience fork's) needs and which changes nothing for one with
    it."""
    from deepspeed.checkpoint import ds_to_universal

    with open(os.path.join(save_dir, "latest")) as f:
        tag = f.read().strip()
    output = os.path.join(save_dir, "universal", f"{tag}_universal")
    ds_to_universal.main(
        argparse.Namespace(
            input_folder=os.path.join(save_dir, tag),
            output_folder=output,
            num_extract_workers=1,
            num_merge_workers=1,
            keep_temp_folder=False,
            strict=True,
            inject_missing_state=True,
        )
    )


def _worker(rank, world, port, out_dir, settings):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )
    _megatron_enums()
    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    for setting in settings:
        name, dtype, stage, *flags = setting.split(":")
        write(out_dir, name, dtype, int(stage), "info" in flags)
        if "universal" in flags and rank == 0:
            universal(os.path.join(out_dir, name))
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def main(argv):
    """OUT_DIR NAME:DTYPE:STAGE[:info][:universal] ...: each setting on PP x DP gloo processes."""
    import torch.multiprocessing as mp

    # here, not at import: a test imports the model classes and keeps its own accelerator
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out_dir, settings = argv[0], argv[1:]
    # the repository's port rule (a port chosen in the ephemeral range can be taken before rank 0 binds it)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import parallel

    mp.start_processes(
        _worker,
        args=(PP * DP, parallel.free_port(), out_dir, settings),
        nprocs=PP * DP,
        start_method="spawn",
    )


if __name__ == "__main__":
    main(sys.argv[1:])
