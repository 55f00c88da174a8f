"""GPT in the GPT-2 / Megatron layout, with the stability switches of the BigScience 104B/176B and OPT-175B runs.

Block: x + Attn(LN(x)), then x + MLP(LN(x)); learned position embeddings; output layer tied to the token
embedding. The linears and the embedding come from parallel.py, so the same code runs as one process or split
over tensor- and pipeline-parallel ranks (a pipeline stage builds only its own layers).

Switches, each from a lesson of docs/lessons.md (README has the table):
- embed_layernorm, embed_init, embed_init_std: bitsandbytes' StableEmbedding (LayerNorm on the word embeddings,
  xavier-uniform init) -- the lever that tamed the tr8b-104B spikes (lessons 1, 2).
- init_method_std="small_init": sqrt(2/(5h)) from "Transformers without Tears" (lesson 3); the output layers of
  every block are further scaled by 1/sqrt(2*num_layers) as in Megatron.
- apply_query_key_layer_scaling (Megatron) and stable_attention (q and k each scaled by d^-1/4, tried on the
  104B and found not to help: an ablation, off by default). Softmax is always computed in fp32, and so are the
  LayerNorm statistics: PyTorch's kernels (CPU and CUDA) compute them in fp32 for fp16/bf16 inputs and return the
  input's dtype, which is Megatron's fused LayerNorm (tests/test_precision.py checks it).
- OPT: activation (gelu | gelu_tanh | relu), normformer, position_embedding_init (normal | sinusoidal),
  scale_embeddings, embed_dropout (OPT turned dropout off on embeddings) (lesson 15).
- position_embedding_type="alibi": BLOOM's linear attention biases instead of learned positions (lesson 19).
- Beyond the chronicles (lesson 20): qk_layernorm (LayerNorm on each head's queries and keys, Dehghani et al.
  2023) against attention-logit growth, and z_loss (PaLM) against output-logit divergence.
"""
import contextlib
import math
import zlib
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

import parallel
import rng
from parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding


@dataclass
class GPTConfig:
    # -- model --
    num_layers: int = 12  # transformer blocks
    hidden_size: int = 768  # width h
    num_attention_heads: int = 12  # attention heads (head size h / heads)
    seq_length: int = 1024  # tokens per sample
    vocab_size: int = 50257  # GPT-2 BPE; token ids in the data must be below it
    make_vocab_size_divisible_by: int = 128  # pad the vocabulary to a multiple of this x TP size
    hidden_dropout: float = 0.1  # dropout after attention and MLP
    attention_dropout: float = 0.1  # dropout on the attention probabilities
    embed_dropout: float | None = None  # dropout on the embeddings; None: same as hidden_dropout
    layernorm_epsilon: float = 1e-5  # LayerNorm's epsilon
    checkpoint_activations: bool = False  # recompute each block's activations in backward (memory for compute)
    # -- stability: the switches of the 104B, 176B and OPT-175B runs --
    activation: str = "gelu"  # gelu (Megatron, erf) | gelu_tanh (GPT-2) | relu (OPT)
    init_method_std: float | str = 0.02  # std of the init, or "small_init" = sqrt(2/(5*hidden_size))
    embed_init: str = "normal"  # word embedding init: normal | xavier_uniform
    embed_init_std: float | None = None  # std of the normal embedding init; None: init_method_std
    embed_layernorm: bool = False  # LayerNorm on the word embeddings (bitsandbytes' StableEmbedding)
    position_embedding_type: str = "learned"  # learned (GPT-2) | alibi (BLOOM: linear attention biases, lesson 19)
    position_embedding_init: str = "normal"  # normal | sinusoidal
    scale_embeddings: bool = False  # multiply the word embeddings by sqrt(hidden_size)
    apply_query_key_layer_scaling: bool | None = None  # scale attention scores by 1/layer number; None: on with fp16
    stable_attention: bool = False  # scale q and k each by head_size^-1/4 before their product
    qk_layernorm: bool = False  # LayerNorm over head_dim on each head's q and k before q k^T (lesson 20)
    z_loss: float = 0.0  # PaLM's auxiliary loss: z_loss * mean of log(Z)^2 of the output softmax (1e-4; lesson 20)
    normformer: bool = False  # NormFormer's extra LayerNorms and head scales
    # -- parallel --
    tensor_model_parallel_size: int = 1  # TP: split each layer over this many ranks (pads the vocabulary too)

    @classmethod
    def from_config(cls, cfg):
        """Pick the model's fields out of a training config (anything with matching attributes)."""
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})

    @property
    def padded_vocab_size(self):
        """Vocabulary padded to a multiple of make_vocab_size_divisible_by * TP (lesson 16), for even TP splits."""
        multiple = self.make_vocab_size_divisible_by * self.tensor_model_parallel_size
        return -(-self.vocab_size // multiple) * multiple

    @property
    def std(self):
        if self.init_method_std == "small_init":
            return math.sqrt(2 / (5 * self.hidden_size))
        return float(self.init_method_std)

    def num_parameters(self, padded=False):
        """Exact parameter count of the whole model (all stages, all TP ranks, the tied head counted once).

        Without switches this is lesson 16's formula n*(12h^2 + 13h) + v*h + s*h + 2h."""
        h, n = self.hidden_size, self.num_layers
        v = self.padded_vocab_size if padded else self.vocab_size
        per_layer = 12 * h * h + 13 * h
        if self.normformer:  # post-attention LN, FFN LN, head scales
            per_layer += 2 * h + 2 * 4 * h + self.num_attention_heads
        if self.qk_layernorm:  # weight and bias of q's and k's LayerNorm, shared by the heads
            per_layer += 4 * (h // self.num_attention_heads)
        extra = 2 * h if self.embed_layernorm else 0
        positions = self.seq_length * h if self.position_embedding_type == "learned" else 0
        return n * per_layer + v * h + positions + 2 * h + extra


# -----------------------------------------------------------------------------
# Attention


def alibi_slopes(num_heads, heads=None, device=None):
    """ALiBi's per-head slopes (Press et al.; lesson 19): 2^(-8i/n), i = 1..n, for a power-of-two n; otherwise
    the 2^(-8i/c) of the largest power of two c < n, followed by every other slope of the 2c-head sequence,
    2^(-8j/2c) for odd j (BLOOM's 112 heads: 2^(-i/8), i <= 64, then 2^(-j/16), j = 1, 3, ..., 95).
    heads: the range of head indices wanted (a TP rank's own), default all. float64, computed on `device`
    (no host-to-device copy in the forward pass)."""
    c = 2 ** math.floor(math.log2(num_heads))
    heads = range(num_heads) if heads is None else heads
    i = torch.arange(heads.start, heads.stop, device=device, dtype=torch.float64)
    return torch.exp2(-8.0 * torch.where(i < c, (i + 1) / c, (2 * (i - c) + 1) / (2 * c)))


def alibi_bias(slopes, seq_len, dtype=torch.float32, device=None):
    """(heads, seq, seq) additive attention bias: -slope * (i - j) for key j <= query i, -inf above the
    diagonal, so the causal mask travels with it. The relative form keeps the entries that matter (near the
    diagonal) small, where BLOOM's slope * j grows with the position and rounds in bf16; the softmax cannot
    tell the two apart (they differ by a constant per row)."""
    pos = torch.arange(seq_len, device=device)
    distance = (pos.view(1, -1) - pos.view(-1, 1)).to(dtype)  # j - i, <= 0 on and below the diagonal
    bias = slopes.to(device=device, dtype=dtype).view(-1, 1, 1) * distance
    return bias.masked_fill(distance > 0, float("-inf"))


def core_attention(q, k, v, dropout_p=0.0, stable=False, layer_scaling=None, bias=None):
    """Causal softmax(q k^T / sqrt(d) + bias) v with the softmax in fp32; q, k, v are (batch, heads, seq,
    head_dim), bias (heads, seq, seq) is ALiBi's (alibi_bias, causal mask included) or None.

    Fused (scaled_dot_product_attention) unless layer_scaling is given, which is Megatron's
    apply_query_key_layer_scaling: scores are computed scaled down by the layer number and scaled back up in
    fp32 inside the softmax, which only the unfused path can express. stable=True is the "stable" variant of
    the 104B chronicle: q and k are each multiplied by d^-1/4 before their product, with no later scaling.
    In exact arithmetic all variants are the same function; in fp16 they round differently. With a bias the
    fused path passes it as SDPA's float attn_mask in the input dtype (no flash kernel takes an arbitrary bias;
    the memory-efficient one does); the unfused path adds it in fp32 to the scores scaled back up.
    """
    head_dim = q.shape[-1]
    if layer_scaling is None:
        mask = None if bias is None else bias.to(q.dtype)
        scale = None
        if stable:
            s = head_dim ** -0.25
            q, k, scale = q * s, k * s, 1.0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=mask is None,
                                              scale=scale)
    return unfused_attention(q, k, v, dropout_p, stable, layer_scaling, bias)


def unfused_attention(q, k, v, dropout_p=0.0, stable=False, layer_scaling=None, bias=None):
    """Megatron's explicit path: baddbmm in the input dtype, softmax in fp32 (also the reference for SDPA)."""
    B, H, T, D = q.shape
    coeff = layer_scaling or 1.0
    norm_factor = math.sqrt(D) * coeff
    q, k = q.reshape(B * H, T, D), k.reshape(B * H, T, D)
    if stable:  # (q / sqrt(norm)) . (k / sqrt(norm)) with alpha = 1 (Megatron-DeepSpeed PR 118)
        s = 1.0 / math.sqrt(norm_factor)
        q, k, alpha = q * s, k * s, 1.0
    else:
        alpha = 1.0 / norm_factor
    scores = torch.baddbmm(q.new_empty(B * H, T, T), q, k.transpose(1, 2), beta=0.0, alpha=alpha)
    # fp32 softmax (fp64 stays fp64, so that the float64 equivalence tests are exact)
    scores = scores.view(B, H, T, T).to(torch.promote_types(scores.dtype, torch.float32)) * coeff
    if bias is None:
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    else:  # ALiBi (causal mask included), added at full scale: Megatron's beta = 1/layer_number undone
        scores = scores + bias.to(scores.dtype)
    probs = scores.softmax(dim=-1).to(v.dtype)
    probs = F.dropout(probs, dropout_p, training=dropout_p > 0)
    return probs @ v


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig, layer_number: int, grid: parallel.Grid):
        super().__init__()
        h, heads = cfg.hidden_size, cfg.num_attention_heads
        if h % heads:
            raise ValueError(f"hidden_size ({h}) is not divisible by num_attention_heads ({heads})")
        self.head_dim = h // heads
        self.local_heads = parallel.divide(heads, grid.tp_size, "num_attention_heads")
        # One fused projection laid out head by head ([heads, 3, head_dim] as in Megatron), so that a contiguous
        # TP slice of the output features is a set of whole heads.
        self.qkv = ColumnParallelLinear(h, 3 * h, grid=grid)
        self.proj = RowParallelLinear(h, h, grid=grid)
        self.proj.weight.is_output_layer = True
        self.head_scale = None
        if cfg.normformer:  # NormFormer's learned per-head scaling of the attention output
            self.head_scale = nn.Parameter(torch.ones(self.local_heads))
            self.head_scale.tp_dim = 0
        # qk-layernorm as in Dehghani et al. 2023 (ViT-22B) and Wortsman et al. 2023: over head_dim, one weight and
        # bias shared by all heads. OLMo 2 normalizes the whole q (all heads at once), whose statistics would
        # span TP ranks. Replicated over TP, but each rank applies them to its own heads only: their gradients
        # are partial sums, which parallel.reduce_gradients adds up over TP (`tp_partial`).
        self.q_norm = self.k_norm = None
        if cfg.qk_layernorm:
            self.q_norm = nn.LayerNorm(self.head_dim, eps=cfg.layernorm_epsilon)
            self.k_norm = nn.LayerNorm(self.head_dim, eps=cfg.layernorm_epsilon)
            for p in (*self.q_norm.parameters(), *self.k_norm.parameters()):
                p.tp_partial = True
        self.dropout = cfg.attention_dropout
        self.stable = cfg.stable_attention
        self.layer_scaling = float(layer_number) if cfg.apply_query_key_layer_scaling else None
        self.probe = None  # telemetry.py sets it on the iterations it records: probe(q, k)

    def forward(self, x, bias=None):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, self.local_heads, 3, self.head_dim).transpose(1, 2).unbind(dim=3)
        if self.q_norm is not None:  # in fp32 under autocast, as every LayerNorm (lesson 6)
            q, k = self.q_norm(q), self.k_norm(k)
        if self.probe is not None:  # the softmax's q and k (after qk-layernorm; ALiBi's bias not included)
            self.probe(q, k)
        dropout = self.dropout if self.training else 0.0
        # this rank's heads only: their dropout masks come from the model-parallel stream (lesson 22)
        with rng.fork(x.device) if dropout else contextlib.nullcontext():
            y = core_attention(q, k, v, dropout, self.stable, self.layer_scaling, bias)
        if self.head_scale is not None:
            y = y * self.head_scale.view(1, -1, 1, 1)
        return self.proj(y.transpose(1, 2).reshape(B, T, self.local_heads * self.head_dim))


# -----------------------------------------------------------------------------
# MLP and block


ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig, grid: parallel.Grid):
        super().__init__()
        if cfg.activation not in ACTIVATIONS:
            raise ValueError(f"activation={cfg.activation!r} is not one of {sorted(ACTIVATIONS)}")
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, 4 * cfg.hidden_size, grid=grid)
        self.fc2 = RowParallelLinear(4 * cfg.hidden_size, cfg.hidden_size, grid=grid)
        self.fc2.weight.is_output_layer = True
        self.act = ACTIVATIONS[cfg.activation]
        # NormFormer's LayerNorm after the activation. Its statistics would span TP ranks: model.py refuses TP>1.
        self.ln = nn.LayerNorm(4 * cfg.hidden_size, eps=cfg.layernorm_epsilon) if cfg.normformer else None

    def forward(self, x):
        x = self.act(self.fc1(x))
        if self.ln is not None:
            x = self.ln(x)
        return self.fc2(x)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, layer_number: int, grid: parallel.Grid):
        super().__init__()
        eps = cfg.layernorm_epsilon
        self.ln_1 = nn.LayerNorm(cfg.hidden_size, eps=eps)
        self.attn = Attention(cfg, layer_number, grid)
        self.ln_attn = nn.LayerNorm(cfg.hidden_size, eps=eps) if cfg.normformer else None
        self.ln_2 = nn.LayerNorm(cfg.hidden_size, eps=eps)
        self.mlp = MLP(cfg, grid)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, x, attn_bias=None):
        a = self.attn(self.ln_1(x), attn_bias)
        if self.ln_attn is not None:
            a = self.ln_attn(a)
        x = x + self.dropout(a)
        return x + self.dropout(self.mlp(self.ln_2(x)))


# -----------------------------------------------------------------------------
# Embedding and the whole model


class Embedding(nn.Module):
    """Word + learned position embeddings (none with ALiBi); the optional LayerNorm acts on the word embeddings
    only, after the TP all-reduce, so its result does not depend on how the vocabulary is split (lesson 1)."""

    def __init__(self, cfg: GPTConfig, grid: parallel.Grid):
        super().__init__()
        self.word = VocabParallelEmbedding(cfg.padded_vocab_size, cfg.hidden_size, grid=grid)
        learned = cfg.position_embedding_type == "learned"
        self.position = nn.Embedding(cfg.seq_length, cfg.hidden_size) if learned else None
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon) if cfg.embed_layernorm else None
        self.scale = math.sqrt(cfg.hidden_size) if cfg.scale_embeddings else 1.0
        p = cfg.hidden_dropout if cfg.embed_dropout is None else cfg.embed_dropout
        self.dropout = nn.Dropout(p)

    def forward(self, ids):
        x = self.word(ids)
        if self.norm is not None:
            x = self.norm(x)
        if self.scale != 1.0:
            x = x * self.scale
        if self.position is not None:
            x = x + self.position(torch.arange(ids.shape[1], device=ids.device))
        return self.dropout(x)


class GPT(nn.Module):
    """The whole model, or one pipeline stage of it: layers [first, last) plus the embedding on the first stage
    and the final LayerNorm and (tied) output layer on the last. Block names keep their global layer number, so
    a parameter has the same name, and hence the same initial value, whatever the TP/PP layout.

    grid: the TP rank whose shapes and initial slices to build (default: this process's, parallel.grid);
    estimate.py passes a grid on paper to size every stage of a large layout on the meta device. The forward
    pass always communicates over parallel.grid. The vocabulary is padded for the config's
    tensor_model_parallel_size, which may differ from the grid's (a TP=4 model gathered into one process)."""

    def __init__(self, cfg: GPTConfig, layers=None, pre_process=True, post_process=True, grid=None):
        super().__init__()
        grid = parallel.grid if grid is None else grid
        if cfg.normformer and grid.tp_size > 1:
            raise ValueError("normformer with tensor_model_parallel_size > 1 is not supported (its FFN LayerNorm "
                             "would need statistics across TP ranks); use TP=1 or turn normformer off")
        if cfg.position_embedding_type not in ("learned", "alibi"):
            raise ValueError(f"position_embedding_type={cfg.position_embedding_type!r} is not 'learned' or 'alibi'")
        self.cfg, self.grid = cfg, grid
        # ALiBi: this TP rank's heads are a contiguous slice of all heads, and so are their slopes.
        self.alibi_heads = None
        if cfg.position_embedding_type == "alibi":
            local = cfg.num_attention_heads // grid.tp_size
            self.alibi_heads = range(grid.tp_rank * local, (grid.tp_rank + 1) * local)
        layers = range(cfg.num_layers) if layers is None else layers
        self.pre_process, self.post_process = pre_process, post_process
        self.embed = Embedding(cfg, grid) if pre_process else None
        self.blocks = nn.ModuleDict({str(i): Block(cfg, i + 1, grid) for i in layers})
        self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon) if post_process else None
        # A last stage without the embedding keeps its own copy of the word embedding for the tied output layer;
        # parallel.py all-reduces the two copies' gradients every step (lesson 11).
        self.output_weight = None
        self.z_loss_sum = self.z_loss_count = 0  # the z-loss of the training micro-batches since pop_z_loss()
        if post_process and not pre_process:
            self.output_weight = nn.Parameter(torch.empty(cfg.padded_vocab_size // grid.tp_size,
                                                          cfg.hidden_size))
            self.output_weight.tp_dim = 0
            self.output_weight.init_name = "embed.word.weight"
        self.logits_probe = None  # telemetry.py sets it on the iterations it records: logits_probe(logits)
        self.init_weights()

    def word_embedding_weight(self):
        """This stage's copy of the tied word embedding (this TP rank's rows): the embedding table on the first
        stage, the output layer's own copy on a last stage without the embedding, None on a middle stage. The
        one place that knows the layout: the output layer, the optimizer (32-bit state for bitsandbytes) and the
        reduction of the two copies' gradients (parallel.reduce_gradients) all ask here."""
        if self.embed is not None:
            return self.embed.word.weight
        return self.output_weight

    # -- initialisation ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def init_weights(self, seed=1234):
        """Every parameter from a generator seeded by (seed, its name): the full tensor is drawn, then this TP
        rank's slice is kept, so any TP/PP layout starts from exactly the single-process weights."""
        cfg = self.cfg
        for name, p in self.named_parameters():
            if p.is_meta:
                continue
            name = getattr(p, "init_name", name)
            full_shape = list(p.shape)
            tp_dim = getattr(p, "tp_dim", None)
            if tp_dim is not None:
                full_shape[tp_dim] *= self.grid.tp_size
            # Drawn on the CPU (whose generator takes 32-bit seeds), so CPU and GPU runs start identical.
            gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
            full = torch.empty(full_shape, dtype=torch.float32)
            if name.endswith("bias"):
                full.zero_()
            elif p.ndim == 1:  # LayerNorm gains, NormFormer head scales
                full.fill_(1.0)
            elif name == "embed.word.weight":
                # Only the real rows are drawn (xavier's bound counts them, not the padding), and the padded rows
                # are zeros: every padding, hence every TP size, starts from the same model. Padded rows are
                # never looked up and are masked out of the softmax, so they get no gradient and stay zero.
                real = full[:cfg.vocab_size]
                full[cfg.vocab_size:].zero_()
                if cfg.embed_init == "xavier_uniform":  # bitsandbytes StableEmbedding
                    bound = math.sqrt(6.0 / (cfg.vocab_size + full_shape[1]))
                    real.uniform_(-bound, bound, generator=gen)
                elif cfg.embed_init == "normal":
                    real.normal_(0.0, cfg.std if cfg.embed_init_std is None else cfg.embed_init_std, generator=gen)
                else:
                    raise ValueError(f"embed_init={cfg.embed_init!r} is not 'normal' or 'xavier_uniform'")
            elif name == "embed.position.weight" and cfg.position_embedding_init == "sinusoidal":
                full.copy_(sinusoidal_positions(*full_shape))
            elif name == "embed.position.weight" and cfg.position_embedding_init != "normal":
                raise ValueError(f"position_embedding_init={cfg.position_embedding_init!r} is not 'normal' or "
                                 "'sinusoidal'")
            else:
                std = cfg.std
                if getattr(p, "is_output_layer", False):
                    std /= math.sqrt(2.0 * cfg.num_layers)
                full.normal_(0.0, std, generator=gen)
            p.copy_(parallel.shard(full, tp_dim, self.grid).to(p.device))

    # -- forward ----------------------------------------------------------------------------------------------

    def forward(self, x, targets=None):
        """x: token ids (B, T) on the first stage, hidden states (B, T, H) on the others.

        Returns hidden states on a non-last stage; on the last, the mean lm loss if targets are given, otherwise
        this TP rank's slice of the logits. In training with z_loss > 0 the lm loss's gradient includes the
        z-loss (parallel.vocab_parallel_cross_entropy), whose value is kept for pop_z_loss(); evaluation
        reports the lm loss alone."""
        if self.pre_process:
            x = self.embed(x)
        bias = None
        if self.alibi_heads is not None:  # one bias for all layers, fp32 at least (fp64 for an fp64 model)
            slopes = alibi_slopes(self.cfg.num_attention_heads, self.alibi_heads, x.device)
            bias = alibi_bias(slopes, x.shape[1], torch.promote_types(x.dtype, torch.float32), x.device)
        for block in self.blocks.values():
            if self.cfg.checkpoint_activations and self.training:
                x = rng.checkpoint(block, x, bias)  # recomputed with both dropout streams replayed (lesson 22)
            else:
                x = block(x, bias)
        if not self.post_process:
            return x
        x = self.ln_f(x)
        logits = F.linear(parallel.copy_to_tp(x), self.word_embedding_weight())
        if self.logits_probe is not None:
            self.logits_probe(logits)
        if targets is None:
            return logits
        z_loss = self.cfg.z_loss if self.training else 0.0
        loss, log_z = parallel.vocab_parallel_cross_entropy(logits, targets, self.cfg.vocab_size, z_loss)
        if z_loss:
            self.z_loss_sum = self.z_loss_sum + z_loss * log_z.square().mean()  # stays on the device: no sync
            self.z_loss_count += 1
        return loss.mean()

    def pop_z_loss(self):
        """Mean z-loss of the training micro-batches since the last call (a 0-dim tensor; 0 on a stage without
        the output layer or with z_loss = 0), for the log."""
        mean = self.z_loss_sum / max(self.z_loss_count, 1)
        self.z_loss_sum = self.z_loss_count = 0
        return torch.as_tensor(mean, dtype=torch.float32, device=next(self.parameters()).device)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):
        """Sample a continuation of idx (B, T) token by token (whole model on this rank: PP=1)."""
        if not (self.pre_process and self.post_process):
            raise ValueError("generate() needs the whole model on one rank (pipeline_model_parallel_size=1)")
        for _ in range(max_new_tokens):
            logits = parallel.gather_from_tp(self(idx[:, -self.cfg.seq_length:]))
            logits = logits[:, -1, :self.cfg.vocab_size].float() / temperature  # never sample padding ids
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, [-1]]
                logits[logits < kth] = float("-inf")
            probs = logits.softmax(dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return idx


def sinusoidal_positions(num_positions, dim):
    """The fixed sin/cos table of "Attention is all you need", used by OPT as the init of learned positions."""
    pos = torch.arange(num_positions, dtype=torch.float64).unsqueeze(1)
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float64) * (-math.log(10000.0) / dim))
    table = torch.zeros(num_positions, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)[:, : dim // 2]
    return table.float()
