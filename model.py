"""GPT in the GPT-2 / Megatron layout, with the stability switches of the BigScience 104B/176B and OPT-175B runs.

Block: x + Attn(LN(x)), then x + MLP(LN(x)); learned position embeddings; output layer tied to the token
embedding (the defaults). The linears and the embedding come from parallel.py, so the same code runs as one
process or split over tensor- and pipeline-parallel ranks (a pipeline stage builds only its own layers).

Switches, each from a lesson of docs/lessons.md (docs/levers.md has the table):
- embed_layernorm, embed_init, embed_init_std: bitsandbytes' StableEmbedding (LayerNorm on the word embeddings,
  xavier-uniform init): it helped the tr8b-104B a lot, and that run still diverged (lessons 1, 2).
- init_method_std="small_init": sqrt(2/(5h)) from "Transformers without Tears" (lesson 3); the output layers of
  every block are further scaled by 1/sqrt(2*num_layers) as in Megatron.
- apply_query_key_layer_scaling (Megatron) and stable_attention (q and k each scaled by d^-1/4, tried on the
  104B and found not to help: an ablation, off by default). Softmax is always computed in fp32, and so are the
  LayerNorm statistics: PyTorch's kernels (CPU and CUDA) compute them in fp32 for fp16/bf16 inputs and return the
  input's dtype, which is Megatron's fused LayerNorm (tests/test_precision.py checks it).
- OPT: activation (gelu | gelu_tanh | relu), normformer, position_embedding_init (normal | sinusoidal),
  scale_embeddings, embed_dropout (OPT turned dropout off on embeddings) (lesson 15).
- position_embedding_type: "learned" (GPT-2), "alibi" (BLOOM's linear attention biases, lesson 19) or "rotary"
  (GPT-NeoX's rotary embeddings of q and k, as Megatron-DeepSpeed has them; BigScience compared all three).
- Beyond the chronicles (lesson 20): qk_layernorm (LayerNorm on each head's queries and keys, Dehghani et al.
  2023) against attention-logit growth, and z_loss (PaLM) against output-logit divergence.

- The Llama / OLMo 2 block, by Megatron's flag names: normalization="rmsnorm", swiglu (with ffn_hidden_size),
  num_query_groups (GQA and MQA; TP splits the groups), untie_embeddings_and_output_weights (an output layer of
  its own, vocab-parallel, drawn and decayed as the embedding), add_bias_linear=False, rotary_base; RMSNorm and
  SwiGLU live in layers.py. Packed documents (Megatron's reset_attention_mask, reset_position_ids, eod_mask_loss):
  forward(documents=, positions=, loss_mask=), made from the tokens by layers.packed_inputs.

A fork changes one place each: every normalization is norm(), the block's feed-forward is chosen in mlp(), a
position embedding is a POSITION_EMBEDDINGS entry plus what GPT.positions hands each layer's attention. The
parameter count and the FLOPs come from the model as built (census), and GPTConfig.check holds every rule a
model config must follow (arguments.validate asks it too, before anything is built).
"""

import contextlib
import math
import zlib
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

import cross_entropy
import layers
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
    # Megatron: padding columns in the softmax (exact repro; TP sizes differ)
    padded_vocab_in_softmax: bool = False
    hidden_dropout: float = 0.1  # dropout after attention and MLP
    attention_dropout: float = 0.1  # dropout on the attention probabilities
    attention_backend: str = "auto"  # SDPA's kernel: auto (torch's), flash, cudnn, efficient, math
    embed_dropout: float | None = None  # dropout on the embeddings; None: same as hidden_dropout
    layernorm_epsilon: float = 1e-5  # LayerNorm's epsilon
    # recompute each block's activations in backward (memory for compute)
    checkpoint_activations: bool = False
    # the Llama / OLMo 2 block's switches (Megatron's flag names)
    normalization: str = "layernorm"  # layernorm | rmsnorm (Llama, OLMo 2): every norm of the model
    # gated MLP fc2(SiLU(gate(x)) * fc1(x)) (Llama, OLMo 2); activation is then unused
    swiglu: bool = False
    # MLP width; None: 4 x hidden_size (swiglu: 2/3 of it, a multiple of 64)
    ffn_hidden_size: int | None = None
    # GQA: key/value heads, each shared by a group of query heads; None: MHA
    num_query_groups: int | None = None
    # an output layer of its own, not the word embedding
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True  # biases in the linear layers (Llama and OLMo 2 have none)
    rotary_base: float = 10000.0  # rotary's theta (Llama 3: 500000)
    # Llama 3.1's long-context rotary frequencies (transformers' rope_type llama3)
    use_rope_scaling: bool = False
    # with use_rope_scaling: the low frequencies divided by this (Llama 3.2: 32)
    rope_scaling_factor: float = 8.0
    # with use_rope_scaling: the context it scales (Llama 3's: 8192)
    original_max_position_embeddings: int = 8192
    # -- levers: the stability switches of the 104B, 176B and OPT-175B runs (docs/levers.md) --
    # gelu (exact, erf) | gelu_tanh (GPT-2, Megatron's fused bias-GeLU) | relu (OPT)
    activation: str = "gelu"
    # std of the init, or "small_init" = sqrt(2/(5*hidden_size))
    init_method_std: float | str = 0.02
    embed_init: str = "normal"  # word embedding init: normal | xavier_uniform
    embed_init_std: float | None = None  # std of the normal embedding init; None: init_method_std
    # LayerNorm on the word embeddings (bitsandbytes' StableEmbedding)
    embed_layernorm: bool = False
    # learned (GPT-2) | alibi (BLOOM, lesson 19) | rotary (GPT-NeoX)
    position_embedding_type: str = "learned"
    position_embedding_init: str = "normal"  # normal | sinusoidal
    scale_embeddings: bool = False  # multiply the word embeddings by sqrt(hidden_size)
    # scale attention scores by 1/layer number; None: on with fp16
    apply_query_key_layer_scaling: bool | None = None
    # Megatron's explicit attention (B*H*T^2 scores): bit-level repro of 2021 runs
    unfused_attention: bool = False
    stable_attention: bool = False  # scale q and k each by head_size^-1/4 before their product
    # LayerNorm over head_dim on each head's q and k before q k^T (lesson 20)
    qk_layernorm: bool = False
    # PaLM's auxiliary loss: z_loss * mean of log(Z)^2 of the output softmax (1e-4; lesson 20)
    z_loss: float = 0.0
    normformer: bool = False  # NormFormer's extra LayerNorms and head scales
    # -- parallel --
    # TP: split each layer over this many ranks (pads the vocabulary too)
    tensor_model_parallel_size: int = 1

    # keys read only while a switch is on (sections.py): a key nothing reads would train as if it were not given
    SWITCHED = {
        "position_embedding_type=rotary": ("rotary_base", "use_rope_scaling"),
        "use_rope_scaling": ("rope_scaling_factor", "original_max_position_embeddings"),
        "position_embedding_type=learned": ("position_embedding_init",),
        "embed_init=normal": ("embed_init_std",),
        "swiglu=False": ("activation",),  # the gated MLP's is SiLU
    }

    @property
    def padded_vocab_size(self):
        """Vocabulary padded to a multiple of make_vocab_size_divisible_by * TP (lesson 16), for even TP splits."""
        multiple = self.make_vocab_size_divisible_by * self.tensor_model_parallel_size
        return -(-self.vocab_size // multiple) * multiple

    @property
    def ffn_size(self):
        """The MLP's width: ffn_hidden_size, or Megatron's default for the block (4h; 2/3 of it with swiglu)."""
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        return (
            layers.swiglu_ffn_hidden_size(self.hidden_size) if self.swiglu else 4 * self.hidden_size
        )

    @property
    def query_groups(self):
        """Key/value heads: num_query_groups, or one per query head (multi-head attention)."""
        return self.num_attention_heads if self.num_query_groups is None else self.num_query_groups

    @property
    def std(self):
        if self.init_method_std == "small_init":
            return math.sqrt(2 / (5 * self.hidden_size))
        return float(self.init_method_std)

    def num_parameters(self, padded=False):
        """Exact parameter count of the whole model (all stages, all TP ranks, a tied head counted once), as
        built (census). Without switches it is lesson 16's n*(12h^2 + 13h) + v*h + s*h + 2h."""
        return census(self)["padded parameters" if padded else "parameters"]

    def flops_per_iteration(self, batch, seqlen):
        """Megatron's count (lesson 23), what the log line's TFLOPs divide: 24 f B s n h^2 (1 + s/6h + V/16nh),
        f = 4 with recomputed activations, else 3. Its 24 n h^2 is twice the blocks' matmul weights (12 n h^2
        in this block), counted as built: a fork's MLP brings its own."""
        f = 4 if self.checkpoint_activations else 3
        n, h, v = self.num_layers, self.hidden_size, self.padded_vocab_size
        dense = 2 * census(self)["block matmul weights"]
        return f * batch * seqlen * dense * (1 + seqlen / (6 * h) + v / (16 * n * h))

    def model_flops_per_iteration(self, batch, seqlen):
        """The model's own FLOPs, what MFU divides (PaLM's 6N + 12 n h s per token): forward and backward of every
        matmul weight once, the output layer's full vocabulary included (vocab_size: the loss computes no padding
        columns), plus q k^T and its product with v over the whole s x s (as the kernels compute it). No
        recomputation (activation checkpointing's)."""
        n, h = self.num_layers, self.hidden_size
        weights = census(self)["block matmul weights"] + self.vocab_size * h
        return batch * seqlen * (6 * weights + 12 * n * h * seqlen)

    def check(self, tp_size=None):
        """Every rule a model config must follow, with its fix: here once, asked by GPT and by arguments.validate
        (before anything is built). tp_size: the TP ranks the model is split over (default: the config's)."""
        tp = self.tensor_model_parallel_size if tp_size is None else tp_size
        # all groups are built before any raises: the first broken rule, in this order, is reported
        problems = (
            self._shape_problems(tp)
            + self._layer_problems()
            + self._position_problems()
            + self._rotary_problems()
            + self._switch_problems(tp)
        )
        for ok, message in problems:
            if not ok:
                raise ValueError(message)

    def _shape_problems(self, tp):
        """(ok, message) of heads, query groups and FFN width against each other and TP."""
        h, heads, groups = self.hidden_size, self.num_attention_heads, self.query_groups
        return [
            (
                h % heads == 0,
                f"hidden_size ({h}) must be divisible by num_attention_heads ({heads})",
            ),
            (
                heads % tp == 0,
                f"num_attention_heads ({heads}) must be divisible by tensor_model_parallel_size ({tp})",
            ),
            (
                0 < groups <= heads and heads % groups == 0,
                f"num_query_groups ({groups}) must divide "
                f"num_attention_heads ({heads}): each key/value head serves a group of as many query heads",
            ),
            (
                groups % tp == 0,
                f"num_query_groups ({groups}) must be divisible by tensor_model_parallel_size ({tp}): "
                "each TP rank computes whole groups (their key/value heads are not replicated); use a TP size that "
                "divides it",
            ),
            (
                self.ffn_size > 0 and self.ffn_size % tp == 0,
                f"ffn_hidden_size ({self.ffn_size}) must be positive "
                f"and divisible by tensor_model_parallel_size ({tp})",
            ),
            (
                self.make_vocab_size_divisible_by >= 1,
                f"make_vocab_size_divisible_by={self.make_vocab_size_divisible_by} must be at least 1 "
                "(1: no padding; Megatron's 128)",
            ),
        ]

    def _layer_problems(self):
        """(ok, message) of the block's kernels: attention backend, normalization, NormFormer."""
        return [
            (
                self.attention_backend in ATTENTION_BACKENDS,
                f"attention_backend="
                f"{self.attention_backend!r} is not one of {', '.join(ATTENTION_BACKENDS)}",
            ),
            (
                self.normalization in NORMALIZATIONS,
                f"normalization={self.normalization!r} is not one of {', '.join(NORMALIZATIONS)}",
            ),
            (
                not (self.swiglu and self.normformer),
                "normformer with swiglu: NormFormer's FFN LayerNorm belongs to "
                "the plain MLP; turn one of them off",
            ),
        ]

    def _position_problems(self):
        """(ok, message) of the position embeddings: type and init, rotary's head size."""
        h, heads = self.hidden_size, self.num_attention_heads
        return [
            (
                self.position_embedding_type in POSITION_EMBEDDINGS,
                f"position_embedding_type="
                f"{self.position_embedding_type!r} is not one of {', '.join(POSITION_EMBEDDINGS)}",
            ),
            (
                self.position_embedding_init in ("normal", "sinusoidal"),
                f"position_embedding_init={self.position_embedding_init!r} is not 'normal' or 'sinusoidal'",
            ),
            (
                self.position_embedding_type != "rotary" or (h // heads) % 2 == 0,
                f"rotary embeddings turn pairs of q and k features: the head size ({h // heads}) must be even",
            ),
        ]

    def _rotary_problems(self):
        """(ok, message) of rotary's keys in range. A key its switch leaves unread (SWITCHED) is a new run's
        config error, refused by arguments.validate; a saved model with one still builds."""
        return [
            (
                self.rotary_base > 0,
                f"rotary_base={self.rotary_base} must be positive (10000; Llama 3: 500000)",
            ),
            (
                self.rope_scaling_factor >= 1,
                f"rope_scaling_factor={self.rope_scaling_factor} must be at least 1 "
                "(Llama 3.1: 8, Llama 3.2: 32)",
            ),
            (
                self.original_max_position_embeddings > 0,
                "original_max_position_embeddings="
                f"{self.original_max_position_embeddings} must be positive (Llama 3's: 8192)",
            ),
        ]

    def _switch_problems(self, tp):
        """(ok, message) of the other switches: dropout rates, init_method_std, activation, the norms' epsilon,
        embed_init, NormFormer in TP, z_loss."""
        dropouts = {
            key: getattr(self, key)
            for key in ("hidden_dropout", "attention_dropout", "embed_dropout")
            if getattr(self, key) is not None
        }
        std = self.init_method_std
        return [
            (
                0 <= p < 1,
                f"{key}={p} must be in [0, 1): the probability of dropping an activation "
                "(0: off; Megatron's 0.1)",
            )
            for key, p in dropouts.items()
        ] + [
            (
                std == "small_init"
                or (isinstance(std, (int, float)) and not isinstance(std, bool) and std > 0),
                f"init_method_std={std!r} must be a positive number (0.02; the 176B: 0.0048) or "
                "'small_init' (sqrt(2/(5*hidden_size)))",
            ),
            (
                self.activation in ACTIVATIONS,
                f"activation={self.activation!r} is not one of {sorted(ACTIVATIONS)}",
            ),
            (
                # a negative one makes every normalized value NaN: a run of dropped steps
                self.layernorm_epsilon > 0,
                f"layernorm_epsilon={self.layernorm_epsilon} must be positive (1e-5; Llama's rmsnorm: 1e-5 "
                "or 1e-6)",
            ),
            (
                self.embed_init_std is None or self.embed_init_std > 0,
                f"embed_init_std={self.embed_init_std} must be positive, or None for init_method_std's",
            ),
            (
                self.embed_init in ("normal", "xavier_uniform"),
                f"embed_init={self.embed_init!r} is not 'normal' or 'xavier_uniform'",
            ),
            (
                not (self.normformer and tp > 1),
                "normformer with tensor_model_parallel_size > 1 is not supported (its "
                "FFN LayerNorm would need statistics across TP ranks); use TP=1 or turn normformer off",
            ),
            (
                self.z_loss >= 0,
                f"z_loss={self.z_loss} is negative: it is the coefficient of log(Z)^2 (PaLM used 1e-4)",
            ),
        ]


POSITION_EMBEDDINGS = ("learned", "alibi", "rotary")
NORMALIZATIONS = ("layernorm", "rmsnorm")
_CENSUS = {}


def census(model_cfg):
    """{"parameters", "padded parameters", "block matmul weights"} of the whole model, counted on the model itself
    built on the meta device for one process (no memory, no formula to keep in step with the code)."""
    key = tuple(getattr(model_cfg, f.name) for f in fields(GPTConfig))
    if key not in _CENSUS:
        whole = GPTConfig(**{f.name: getattr(model_cfg, f.name) for f in fields(GPTConfig)})
        with torch.device("meta"):
            gpt = GPT(whole, grid=parallel.Grid(1, 1, world_size=1, rank=0))
        padded = sum(p.numel() for p in gpt.parameters())
        # each with its padding rows
        vocab_tables = 2 if whole.untie_embeddings_and_output_weights else 1
        padding = (whole.padded_vocab_size - whole.vocab_size) * whole.hidden_size * vocab_tables
        _CENSUS[key] = {
            "parameters": padded - padding,
            "padded parameters": padded,
            "block matmul weights": sum(
                p.numel()
                for name, p in gpt.named_parameters()
                if name.startswith("blocks.") and p.ndim >= 2
            ),
        }
    return _CENSUS[key]


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
    # j - i, <= 0 on and below the diagonal
    distance = (pos.view(1, -1) - pos.view(-1, 1)).to(dtype)
    bias = slopes.to(device=device, dtype=dtype).view(-1, 1, 1) * distance
    return bias.masked_fill(distance > 0, float("-inf"))


def rotary_cos_sin(
    seq_len,
    head_dim,
    dtype=torch.float32,
    device=None,
    base=10000.0,
    scaling_factor=None,
    original_context=None,
):
    """cos and sin, (seq, head_dim), of rotary embeddings (Su et al. 2021) as GPT-NeoX and Megatron-DeepSpeed
    lay them out: position t times the frequencies base^(-2i/d), i < d/2, the list written twice (feature i and
    i + d/2 turn together). Computed in `dtype` (fp32 at least) on `device`, for every layer at once.
    scaling_factor (and original_context, default Llama 3's): Llama 3.1's frequencies (llama3_frequencies)."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, device=device, dtype=dtype) / head_dim)
    if scaling_factor is not None:
        inv_freq = llama3_frequencies(inv_freq, scaling_factor, original_context)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=dtype), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def llama3_frequencies(inv_freq, factor, original=None):
    """Llama 3.1's rotary frequencies for long contexts (Megatron's --use-rope-scaling, transformers' rope_type
    "llama3", with Llama 3's LLAMA3_ROPE frequency factors): wavelengths shorter than original / high_freq_factor
    kept, those longer than original / low_freq_factor stretched `factor` times, the ones between interpolated.
    original: the original context (original_max_position_embeddings; None: Llama 3's 8192)."""
    low, high = LLAMA3_ROPE["low_freq_factor"], LLAMA3_ROPE["high_freq_factor"]
    original = original or LLAMA3_ROPE["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, smoothed, scaled)


def apply_rotary(x, cos, sin):
    """x (batch, heads, seq, head_dim) with each feature pair (i, i + d/2) turned by its position's angle, in x's
    dtype (Megatron-DeepSpeed rotates in the compute dtype). Per head and position: TP's head split is exact."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


# attention_backend's names for torch's SDPA kernels (Megatron's key); None: torch's own choice
# among those that take the call. One named is taken, or the run is refused saying so before the
# build (check_attention_backend; no silent fall-back); tools/gpu_probe.py backends times each.
ATTENTION_BACKENDS = {
    "auto": None,
    "flash": "FLASH_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
}


def attention_backend_problem(model_cfg):
    """The message of an attention_backend this model cannot run with on any device, or None: a new run's check
    (arguments.validate), before the build, where the kernel would refuse it at the first step or never be
    called. Which kernel takes which call otherwise depends on the device, dtype and head size: checked on the
    device (check_attention_backend)."""
    backend = model_cfg.attention_backend
    if backend != "auto" and model_cfg.unfused_attention:
        return (
            f"attention_backend={backend} does nothing with unfused_attention (Megatron's explicit path, no SDPA "
            "kernel): drop one of them"
        )
    if backend == "flash" and model_cfg.position_embedding_type == "alibi":
        return (
            "attention_backend=flash takes no bias, and ALiBi's is one: use attention_backend=efficient (CUDA) "
            "or auto"
        )
    return None


def check_attention_backend(model_cfg, device, dtype, documents=False):
    """Raise the first step's ValueError (_backend_refused) before the build, which takes minutes at scale: where
    attention_backend's kernel does not take this model's attention on this device, in this dtype. One call at the
    run's sequence length, forward and backward, of one query group's heads laid out as Attention lays them out,
    with a bias where the model has one (ALiBi; documents: the dense mask of packed documents). Its dropout draws
    from a forked stream: the run's RNG states are left as they were."""
    backend = model_cfg.attention_backend
    if backend == "auto" or model_cfg.unfused_attention:
        return
    T, head_dim = model_cfg.seq_length, model_cfg.hidden_size // model_cfg.num_attention_heads
    group = model_cfg.num_attention_heads // model_cfg.query_groups

    def heads(n):
        return (
            torch.ones(1, T, n, head_dim, device=device, dtype=dtype)
            .transpose(1, 2)
            .requires_grad_()
        )

    q, k, v = heads(group), heads(1), heads(1)
    bias = None
    if model_cfg.position_embedding_type == "alibi" or documents:
        causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
        bias = torch.zeros(group, T, T, device=device).masked_fill(~causal, float("-inf")).to(dtype)
    dropout, cuda = model_cfg.attention_dropout, [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        y = core_attention(q, k, v, dropout, model_cfg.stable_attention, None, bias, False, backend)
        try:
            y.sum().backward()
        except RuntimeError as e:  # a kernel with a forward and no backward for this call
            raise _backend_refused(backend, q, dropout, bias, e) from e


def sdpa_backend(name):
    """The sdpa_kernel context of attention_backend `name` (a nullcontext for auto)."""
    if ATTENTION_BACKENDS[name] is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, ATTENTION_BACKENDS[name])])


def core_attention(
    q,
    k,
    v,
    dropout_p=0.0,
    stable=False,
    layer_scaling=None,
    bias=None,
    unfused=False,
    backend="auto",
):
    """Causal softmax(q k^T / sqrt(d) + bias) v with the softmax in fp32; q, k, v are (batch, heads, seq,
    head_dim), bias (heads, seq, seq) is ALiBi's (alibi_bias, causal mask included, in q's dtype) or None.

    Every variant goes through scaled_dot_product_attention: on CUDA the flash kernel (no bias) or the
    memory-efficient one (ALiBi's bias; no flash kernel takes an arbitrary bias), neither of which materialises
    the B*H*T^2 scores. stable=True is the "stable" variant of the 104B chronicle: q and k each multiplied by
    d^-1/4 before their product, with no later scaling. layer_scaling (Megatron's apply_query_key_layer_scaling)
    is the same function in exact arithmetic: it scales the fp16 scores down by the layer number so that they
    cannot overflow before the fp32 softmax scales them back up, and the fused kernels accumulate q k^T in fp32,
    where that overflow cannot happen; so it changes nothing here. unfused=True (config unfused_attention)
    takes Megatron's explicit path instead, which rounds as the 2021 runs did (unfused_attention).
    backend: the SDPA kernel (ATTENTION_BACKENDS); one that cannot take the call raises ValueError.
    """
    if unfused:
        return unfused_attention(q, k, v, dropout_p, stable, layer_scaling, bias)
    scale, gqa = None, k.shape[1] != q.shape[1]
    if stable:
        s = q.shape[-1] ** -0.25
        q, k, scale = q * s, k * s, 1.0
    # packed documents on CUDA: no dense mask (no dropout there)
    if isinstance(bias, layers.DocumentBlockMask):
        return bias.attend(q, k, v, scale, gqa)
    if backend == "auto":
        return _sdpa(q, k, v, bias, dropout_p, scale, gqa)
    try:
        with sdpa_backend(backend):
            return _sdpa(q, k, v, bias, dropout_p, scale, gqa)
    except RuntimeError as e:  # torch's "No available kernel"; its reasons came as warnings
        raise _backend_refused(backend, q, dropout_p, bias, e) from e


def _sdpa(q, k, v, bias, dropout_p, scale, gqa):
    """torch's scaled_dot_product_attention, causal without a bias, else with the bias as its mask."""
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=bias,
        dropout_p=dropout_p,
        is_causal=bias is None,
        scale=scale,
        enable_gqa=gqa,
    )


def _backend_refused(backend, q, dropout_p, bias, error):
    """The ValueError, with its fix, of an attention_backend whose kernel does not take this call."""
    what = f"{q.device.type}, {q.dtype}, head_dim {q.shape[-1]}, dropout {dropout_p}"
    return ValueError(
        f"attention_backend={backend}: torch's {backend} kernel does not take "
        f"this attention ({what}, {'a bias' if bias is not None else 'causal'}): "
        f"{error}; use --attention_backend=auto (torch's choice)"
    )


def unfused_attention(q, k, v, dropout_p=0.0, stable=False, layer_scaling=None, bias=None):
    """Megatron's explicit path: baddbmm in the input dtype, softmax in fp32 over the whole B*H*T^2 scores; the
    reference for SDPA, and what config unfused_attention runs. bias is added in fp32 (any dtype is taken)."""
    B, H, T, D = q.shape
    if k.shape[1] != H:  # GQA: each key/value head serves H / groups consecutive query heads
        k, v = (t.repeat_interleave(H // k.shape[1], dim=1) for t in (k, v))
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
    def __init__(self, model_cfg: GPTConfig, layer_number: int, grid: parallel.Grid):
        super().__init__()
        h, heads = model_cfg.hidden_size, model_cfg.num_attention_heads
        self.head_dim = h // heads
        self.local_heads = parallel.divide(heads, grid.tp_size, "num_attention_heads")
        self.local_groups = parallel.divide(
            model_cfg.query_groups, grid.tp_size, "num_query_groups"
        )
        self.q_per_group = heads // model_cfg.query_groups
        self.tp_size = grid.tp_size
        # One fused projection laid out group by group, [groups, q_per_group + 2, head_dim]: a group's query heads,
        # then its key and its value head (Megatron's GQA layout; [heads, 3, head_dim] without GQA), so that a
        # contiguous TP slice of the output features is a set of whole groups.
        width = (heads + 2 * model_cfg.query_groups) * self.head_dim
        self.qkv = ColumnParallelLinear(h, width, bias=model_cfg.add_bias_linear, grid=grid)
        self.proj = RowParallelLinear(h, h, bias=model_cfg.add_bias_linear, grid=grid)
        self.proj.weight.is_output_layer = True
        self.head_scale = None
        if model_cfg.normformer:  # NormFormer's learned per-head scaling of the attention output
            self.head_scale = nn.Parameter(torch.ones(self.local_heads))
            self.head_scale.tp_dim = 0
        # qk-layernorm as in Dehghani et al. 2023 (ViT-22B) and Wortsman et al. 2023: over head_dim, one weight and
        # bias shared by all heads. OLMo 2 normalizes the whole q (all heads at once), whose statistics would
        # span TP ranks. Replicated over TP, but each rank applies them to its own heads only: their gradients
        # are partial sums, which parallel.reduce_gradients adds up over TP (`tp_partial`).
        self.q_norm = self.k_norm = None
        if model_cfg.qk_layernorm:
            self.q_norm = norm(model_cfg, self.head_dim)
            self.k_norm = norm(model_cfg, self.head_dim)
            for p in (*self.q_norm.parameters(), *self.k_norm.parameters()):
                p.tp_partial = True
        self.dropout = model_cfg.attention_dropout
        self.stable = model_cfg.stable_attention
        scaling = model_cfg.apply_query_key_layer_scaling
        self.layer_scaling = float(layer_number) if scaling else None
        self.unfused = model_cfg.unfused_attention
        self.backend = model_cfg.attention_backend
        self.probe = None  # telemetry.py sets it on the iterations it records: probe(q, k)

    def forward(self, x, bias=None, rotary=None):
        """bias: ALiBi's (heads, seq, seq) scores bias; rotary: the (cos, sin) that turn q and k (GPT.positions)."""
        return self.project(self.attend(*self.heads(x, rotary), bias))

    def heads(self, x, rotary=None):
        """q (batch, heads, seq, head_dim), k and v (batch, groups, seq, head_dim) of this rank's heads."""
        B, T, _ = x.shape
        qkv = self.qkv(x).view(B, T, self.local_groups, self.q_per_group + 2, self.head_dim)
        q, k, v = qkv.split((self.q_per_group, 1, 1), dim=3)
        q, k, v = q.reshape(B, T, self.local_heads, self.head_dim), k.squeeze(3), v.squeeze(3)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.q_norm is not None:  # statistics in fp32, as every LayerNorm (lesson 6)
            q, k = self.q_norm(q), self.k_norm(k)
        # after qk-layernorm, as OLMo 2: the norm sees the features, not their rotation
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        # the softmax's q and k (after qk-layernorm and rotary; not ALiBi's bias)
        if self.probe is not None:
            self.probe(q, k.repeat_interleave(self.q_per_group, dim=1))
        return q, k, v

    def forks(self):
        """Whether attend() swaps in the model-parallel stream in training: TP > 1 with attention dropout. With
        TP the heads' dropout masks come from that stream (lesson 22), so that the heads of different ranks do
        not share masks; with one TP rank there is nothing to tell apart: the default stream, and no swap."""
        return bool(self.dropout) and self.tp_size > 1

    def attend(self, q, k, v, bias=None):
        """Attention of this rank's heads, their dropout from the model-parallel stream where forks()."""
        dropout = self.dropout if self.training else 0.0
        with rng.fork(q.device) if dropout and self.forks() else contextlib.nullcontext():
            return core_attention(
                q, k, v, dropout, self.stable, self.layer_scaling, bias, self.unfused, self.backend
            )

    def project(self, y):
        """The heads' outputs, (batch, heads, seq, head_dim), through the output projection."""
        B, _, T, _ = y.shape
        if self.head_scale is not None:
            y = y * self.head_scale.view(1, -1, 1, 1)
        return self.proj(y.transpose(1, 2).reshape(B, T, self.local_heads * self.head_dim))


# -----------------------------------------------------------------------------
# MLP and block


def norm(model_cfg: GPTConfig, size: int):
    """Every normalization of the model (blocks, embedding, final, qk-layernorm, NormFormer's): LayerNorm, whose
    statistics PyTorch computes in fp32 for half inputs (lesson 6), or RMSNorm (layers.py, fp32 too). A fork's
    norm is a class in layers.py and a line here."""
    if model_cfg.normalization == "rmsnorm":
        return layers.RMSNorm(size, eps=model_cfg.layernorm_epsilon)
    return nn.LayerNorm(size, eps=model_cfg.layernorm_epsilon)


def mlp(model_cfg: GPTConfig, grid: parallel.Grid):
    """The block's feed-forward: MLP, or the gated SwiGLU (layers.py). A fork's MLP is a class in layers.py and a
    line here; the parameter count and FLOPs follow from the model as built."""
    return layers.SwiGLU(model_cfg, grid) if model_cfg.swiglu else MLP(model_cfg, grid)


ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class MLP(nn.Module):
    def __init__(self, model_cfg: GPTConfig, grid: parallel.Grid):
        super().__init__()
        h, ffn, bias = model_cfg.hidden_size, model_cfg.ffn_size, model_cfg.add_bias_linear
        self.fc1 = ColumnParallelLinear(h, ffn, bias=bias, grid=grid)
        self.fc2 = RowParallelLinear(ffn, h, bias=bias, grid=grid)
        self.fc2.weight.is_output_layer = True
        self.act = ACTIVATIONS[model_cfg.activation]
        # NormFormer's LayerNorm after the activation. Its statistics would span TP ranks: model.py refuses TP>1.
        self.ln = norm(model_cfg, ffn) if model_cfg.normformer else None

    def forward(self, x):
        x = self.act(self.fc1(x))
        if self.ln is not None:
            x = self.ln(x)
        return self.fc2(x)


class Block(nn.Module):
    def __init__(self, model_cfg: GPTConfig, layer_number: int, grid: parallel.Grid):
        super().__init__()
        h = model_cfg.hidden_size
        self.ln_1 = norm(model_cfg, h)
        self.attn = Attention(model_cfg, layer_number, grid)
        self.ln_attn = norm(model_cfg, h) if model_cfg.normformer else None
        self.ln_2 = norm(model_cfg, h)
        self.mlp = mlp(model_cfg, grid)
        self.dropout = nn.Dropout(model_cfg.hidden_dropout)

    def forward(self, x, attn_bias=None, rotary=None):
        return self.after_attention(
            x, self.attn.attend(*self.before_attention(x, rotary), attn_bias)
        )

    # The two sides of the attention core, compiled on their own where it swaps generators (GPT.compile_blocks)

    def before_attention(self, x, rotary=None):
        return self.attn.heads(self.ln_1(x), rotary)

    def after_attention(self, x, y):
        a = self.attn.project(y)
        if self.ln_attn is not None:
            a = self.ln_attn(a)
        x = x + self.dropout(a)
        return x + self.dropout(self.mlp(self.ln_2(x)))


# -----------------------------------------------------------------------------
# Embedding and the whole model


class Embedding(nn.Module):
    """Word + learned position embeddings (none with ALiBi or rotary); the optional LayerNorm acts on the word
    embeddings only, after the TP all-reduce, so its result does not depend on how the vocabulary is split
    (lesson 1)."""

    def __init__(self, model_cfg: GPTConfig, grid: parallel.Grid):
        super().__init__()
        s, h = model_cfg.seq_length, model_cfg.hidden_size
        self.word = VocabParallelEmbedding(model_cfg.padded_vocab_size, h, grid=grid)
        learned = model_cfg.position_embedding_type == "learned"
        # drawn by init_weights, as the word table
        self.position = nn.Embedding(s, h, _weight=torch.empty(s, h)) if learned else None
        self.norm = norm(model_cfg, model_cfg.hidden_size) if model_cfg.embed_layernorm else None
        self.scale = math.sqrt(model_cfg.hidden_size) if model_cfg.scale_embeddings else 1.0
        p = model_cfg.hidden_dropout if model_cfg.embed_dropout is None else model_cfg.embed_dropout
        self.dropout = nn.Dropout(p)

    def forward(self, ids, positions=None):
        """positions: (batch, seq) position ids (documents' own, reset_position_ids), default 0..seq-1."""
        x = self.word(ids)
        if self.norm is not None:
            x = self.norm(x)
        if self.scale != 1.0:
            x = x * self.scale
        if self.position is not None:
            x = x + self.position(
                torch.arange(ids.shape[1], device=ids.device) if positions is None else positions
            )
        return self.dropout(x)


class GPT(nn.Module):
    """The whole model, or one pipeline stage of it: layers [first, last) plus the embedding on the first stage
    and the final LayerNorm and (tied) output layer on the last. Block names keep their global layer number, so
    a parameter has the same name, and hence the same initial value, whatever the TP/PP layout.

    grid: the TP rank whose shapes and initial slices to build (default: this process's, parallel.grid);
    estimate.py passes a grid on paper to size every stage of a large layout on the meta device. The forward
    pass always communicates over parallel.grid. The vocabulary is padded for the config's
    tensor_model_parallel_size, which may differ from the grid's (a TP=4 model gathered into one process).
    seed: of the initial weights (init_weights), drawn on the CPU whatever the device the model is built on."""

    # ((T, dtype, device), what positions() returns for them); see positions()
    positions_cache = (None, None)

    def __init__(
        self,
        model_cfg: GPTConfig,
        layers=None,
        pre_process=True,
        post_process=True,
        grid=None,
        seed=1234,
    ):
        super().__init__()
        grid = parallel.grid if grid is None else grid
        model_cfg.check(grid.tp_size)
        self.config, self.grid = model_cfg, grid
        # ALiBi: this TP rank's heads are a contiguous slice of all heads, and so are their slopes.
        self.alibi_heads = None
        # compile_blocks: where FlexAttention runs fused (packed documents on CUDA)
        self.compiled = False
        if model_cfg.position_embedding_type == "alibi":
            local = model_cfg.num_attention_heads // grid.tp_size
            self.alibi_heads = range(grid.tp_rank * local, (grid.tp_rank + 1) * local)
        layers = range(model_cfg.num_layers) if layers is None else layers
        self.pre_process, self.post_process = pre_process, post_process
        self.embed = Embedding(model_cfg, grid) if pre_process else None
        self.blocks = nn.ModuleDict({str(i): Block(model_cfg, i + 1, grid) for i in layers})
        self.ln_f = norm(model_cfg, model_cfg.hidden_size) if post_process else None
        # A last stage without the embedding keeps its own copy of the word embedding for the tied output layer;
        # parallel.py all-reduces the two copies' gradients every step (lesson 11).
        self.output_weight = self.output_layer = None
        # the z-loss of the training micro-batches since pop_z_loss()
        self.z_loss_sum = self.z_loss_count = 0
        rows = model_cfg.padded_vocab_size // grid.tp_size  # vocab-parallel: this TP rank's rows
        if post_process and model_cfg.untie_embeddings_and_output_weights:
            self.output_layer = nn.Parameter(torch.empty(rows, model_cfg.hidden_size))
            self.output_layer.tp_dim = 0
        elif post_process and not pre_process:
            self.output_weight = nn.Parameter(torch.empty(rows, model_cfg.hidden_size))
            self.output_weight.tp_dim = 0
            self.output_weight.init_name = "embed.word.weight"
        # telemetry.py sets it on the iterations it records: probe(log Z, hidden, weight)
        self.logits_probe = None
        # once, here (nothing is drawn for a model built on the meta device)
        self.init_weights(seed)

    def word_embedding_weight(self):
        """This stage's copy of the tied word embedding (this TP rank's rows): the embedding table on the first
        stage, the output layer's own copy on a last stage without the embedding, None on a middle stage. The
        one place that knows the layout: the output layer, the optimizer (32-bit state for bitsandbytes) and the
        reduction of the two copies' gradients (parallel.reduce_gradients) all ask here."""
        if self.embed is not None:
            return self.embed.word.weight
        return self.output_weight

    def output_layer_weight(self):
        """The output layer's weight on the last stage (this TP rank's rows): the untied output layer, or the
        word embedding's."""
        return self.word_embedding_weight() if self.output_layer is None else self.output_layer

    # -- initialisation ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def init_weights(self, seed=1234):
        """Every parameter from a generator seeded by (seed, its name), as if its full tensor were drawn at once
        on the CPU and this TP rank's slice kept: any TP/PP layout, on any device, starts from exactly the
        single-process weights. Large tensors are drawn in chunks (draw_slice), so no rank ever holds a full one
        (BLOOM's embedding is 14 GiB); each chunk is copied to the parameter's device. Every scratch tensor is
        made on the CPU explicitly: the ambient device (torch.device(...) around this call) changes nothing."""
        model_cfg = self.config
        for name, p in self.named_parameters():
            if p.is_meta:
                continue
            name = getattr(p, "init_name", name)
            tp_dim = getattr(p, "tp_dim", None)
            full_shape = list(p.shape)
            if tp_dim is not None:
                full_shape[tp_dim] *= self.grid.tp_size
            # The CPU's generator (32-bit seeds) whatever the device, so CPU and GPU runs start identical.
            gen = torch.Generator(device="cpu").manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
            if name.endswith("bias"):
                p.zero_()
            elif p.ndim == 1:  # LayerNorm gains, NormFormer head scales
                p.fill_(1.0)
            # an untied output layer is drawn as the embedding
            elif name in (
                "embed.word.weight",
                "output_layer",
            ):
                # Only the real rows are drawn (xavier's bound counts them, not the padding), and the padded rows
                # are zeros: every padding, hence every TP size, starts from the same model. Padded rows are
                # never looked up and are masked out of the softmax, so they get no gradient and stay zero.
                # Megatron's softmax over the padding (padded_vocab_in_softmax) draws every row, as Megatron does.
                rows = full_shape[0] if model_cfg.padded_vocab_in_softmax else model_cfg.vocab_size
                # bitsandbytes StableEmbedding's xavier
                bound = math.sqrt(6.0 / (rows + full_shape[1]))
                std = model_cfg.embed_init_std
                std = model_cfg.std if std is None else std

                def draw(t):
                    if model_cfg.embed_init == "xavier_uniform":
                        return t.uniform_(-bound, bound, generator=gen)
                    return t.normal_(0.0, std, generator=gen)

                draw_slice(p, full_shape, tp_dim, self.grid.tp_rank, draw, rows=rows)
            elif (
                name == "embed.position.weight"
                and model_cfg.position_embedding_init == "sinusoidal"
            ):
                p.copy_(parallel.shard(sinusoidal_positions(*full_shape), tp_dim, self.grid))
            else:
                std = model_cfg.std
                if getattr(p, "is_output_layer", False):
                    std = std / math.sqrt(2.0 * model_cfg.num_layers)
                draw_slice(
                    p,
                    full_shape,
                    tp_dim,
                    self.grid.tp_rank,
                    lambda t: t.normal_(0.0, std, generator=gen),
                )

    # -- forward ----------------------------------------------------------------------------------------------

    def forward(self, x, targets=None, documents=None, positions=None, loss_mask=None):
        """x: token ids (B, T) on the first stage, hidden states (B, T, H) on the others. Packed documents (Megatron's
        data flags; layers.packed_inputs makes these from the input tokens, and every stage needs them):
        documents, (B, T) index of each token's document, attends within a document only (reset_attention_mask);
        positions, (B, T) position ids, replace 0..T-1 for learned positions and rotary (reset_position_ids);
        loss_mask, (B, T) weights of the tokens' losses, gives sum(loss * mask) / sum(mask) (eod_mask_loss).

        Returns hidden states on a non-last stage; on the last, the mean lm loss if targets are given, otherwise
        this TP rank's slice of the logits. In training with z_loss > 0 the lm loss's gradient includes the
        z-loss (cross_entropy.linear_cross_entropy), whose value is kept for pop_z_loss(); evaluation
        reports the lm loss alone."""
        if self.pre_process:
            x = self.embed(x, positions)
        bias, rotary = self.positions(x)
        if documents is not None:
            bias = self.separate_documents(documents, bias, x.dtype)
        # each token's angles at its position in its document
        if positions is not None and rotary is not None:
            rotary = tuple(t[positions].unsqueeze(1) for t in rotary)
        for block in self.blocks.values():
            if self.config.checkpoint_activations and self.training:
                # recomputed with both dropout streams replayed (lesson 22)
                x = rng.checkpoint(block, x, bias, rotary)
            else:
                x = block(x, bias, rotary)
        if not self.post_process:
            return x
        x, weight = parallel.copy_to_tp(self.ln_f(x)), self.output_layer_weight()
        if targets is None:
            return F.linear(x, weight)
        z_loss = self.config.z_loss if self.training else 0.0
        # the output layer and the loss in one, never holding the (tokens x vocabulary) logits, its gradient
        # computed in the forward (the mean: backward only scales it)
        # the padding columns are left out of the softmax (every padding, so every TP size, is the same model),
        # unless padded_vocab_in_softmax asks for Megatron's softmax over all of them (docs/lessons.md, lesson 16)
        vocab = None if self.config.padded_vocab_in_softmax else self.config.vocab_size
        if loss_mask is None:
            loss, log_z = cross_entropy.linear_cross_entropy(
                x, weight, targets, vocab, z_loss, reduction="mean"
            )
        else:  # Megatron's count: the masked tokens' mean (per-token losses: backward computes the logits again)
            loss, log_z = cross_entropy.linear_cross_entropy(x, weight, targets, vocab, z_loss)
            # a batch of eods only: 0, not NaN
            loss = (loss * loss_mask).sum() / loss_mask.sum().clamp(min=1)
        if self.logits_probe is not None:
            self.logits_probe(log_z, x, weight)
        if z_loss:
            # stays on the device: no sync
            self.z_loss_sum = self.z_loss_sum + z_loss * log_z.square().mean()
            self.z_loss_count += 1
        return loss

    def positions(self, x):
        """(ALiBi's bias, rotary's (cos, sin)) for every layer's attention, None where the type has none (learned
        positions are added to the embeddings). Built once per sequence length, dtype and device, in fp32 at least
        (fp64 for an fp64 model), then cast once to the compute dtype, in which every layer uses them (the
        explicit attention path takes ALiBi's bias in fp32); the last one is kept, so a curriculum's new length
        frees the old (H, T, T) bias."""
        key = (x.shape[1], x.dtype, x.device)
        if self.positions_cache[0] != key:
            self.positions_cache = (key, self.build_positions(*key))
        return self.positions_cache[1]

    def separate_documents(self, documents, bias, dtype):
        """The attention bias of packed documents: the causal mask cut block-diagonal, (B, 1 or heads, T, T), added to
        the scores (ALiBi's relative bias needs no reset: i - j is the same within a document). On CUDA with compiled
        blocks, without attention dropout or the explicit path, a FlexAttention block mask instead
        (layers.DocumentBlockMask): no T x T tensor in attention; elsewhere the mask is materialised, and SDPA takes
        it as attn_mask (eager flex_attention would materialise the scores)."""
        head_dim = self.config.hidden_size // self.config.num_attention_heads
        if (
            layers.flex_documents(documents.device, self.compiled, head_dim)
            and not self.config.unfused_attention
            and not self.config.attention_dropout
        ):
            slopes = (
                None
                if self.alibi_heads is None
                else alibi_slopes(
                    self.config.num_attention_heads, self.alibi_heads, documents.device
                ).float()
            )
            return layers.DocumentBlockMask(documents, slopes)
        mask = layers.document_mask(documents)
        if bias is None:
            bias = torch.zeros(
                mask.shape, dtype=torch.promote_types(dtype, torch.float32), device=mask.device
            )
        bias = bias.masked_fill(~mask, float("-inf"))
        return bias if self.config.unfused_attention else bias.to(dtype)

    def build_positions(self, T, compute_dtype, device):
        dtype = torch.promote_types(compute_dtype, torch.float32)
        if self.alibi_heads is not None:
            slopes = alibi_slopes(self.config.num_attention_heads, self.alibi_heads, device)
            bias = alibi_bias(slopes, T, dtype, device)
            return (bias if self.config.unfused_attention else bias.to(compute_dtype)), None
        if self.config.position_embedding_type == "rotary":
            head_dim = self.config.hidden_size // self.config.num_attention_heads
            scaling = (
                {
                    "scaling_factor": self.config.rope_scaling_factor,
                    "original_context": self.config.original_max_position_embeddings,
                }
                if self.config.use_rope_scaling
                else {}
            )
            cos, sin = rotary_cos_sin(
                T, head_dim, dtype, device, base=self.config.rotary_base, **scaling
            )
            return None, (cos.to(compute_dtype), sin.to(compute_dtype))
        return None, None

    def compile_blocks(self, **kwargs):
        """torch.compile each block in place (config compile): one graph per layer, reused by every layer of the
        same shapes, with activation checkpointing and the pipeline schedule outside the compiled region (so its
        recomputation replays the dropout masks as in eager mode); with TP and attention dropout, two graphs, the
        sides of the attention core, which swaps generators (rng.fork). kwargs go to torch.compile (a backend)."""
        for block in self.blocks.values():
            # rng.fork's generator swap cannot be traced: the core stays outside
            if block.attn.forks():
                block.before_attention = torch.compile(block.before_attention, **kwargs)
                block.after_attention = torch.compile(block.after_attention, **kwargs)
            else:
                block.compile(**kwargs)
        self.compiled = True
        return self

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
            raise ValueError(
                "generate() needs the whole model on one rank (pipeline_model_parallel_size=1)"
            )
        for _ in range(max_new_tokens):
            logits = parallel.gather_from_tp(self(idx[:, -self.config.seq_length :]))
            # never sample padding ids
            logits = logits[:, -1, : self.config.vocab_size].float() / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, [-1]]
                logits[logits < kth] = float("-inf")
            probs = logits.softmax(dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return idx


INIT_CHUNK_NUMEL = 2**24  # values drawn at a time by draw_slice: 64 MiB of fp32 on the host


def draw_slice(out, full_shape, tp_dim, tp_rank, draw, rows=None, chunk_numel=None):
    """Fill `out`, TP rank tp_rank's slice along tp_dim (0, 1 or None) of a 2-D tensor of full_shape, with the
    values that draw(t) -- an in-place normal_/uniform_ on a CPU generator -- gives the full tensor's first `rows`
    rows (default all; the rows after them are zeros), drawn chunk_numel values at a time (default
    INIT_CHUNK_NUMEL).

    The full tensor is drawn on the CPU a chunk of rows at a time, in order, and only this rank's part of each
    chunk is copied to out's device: the host holds one chunk, never the full tensor. The bits are those of one
    draw of the whole tensor, because the CPU's normal_ turns its uniforms into normals 16 at a time counted from
    the tensor's start (and redraws the last 16 when the size is not a multiple of 16), and uniform_ draws one
    number per element: chunks that start at multiples of 16 elements and a last chunk of at least 16 elements
    consume the generator exactly as the whole tensor does (tests/test_device.py checks it)."""
    R, C = full_shape
    rows = R if rows is None else rows
    chunk_numel = chunk_numel or INIT_CHUNK_NUMEL
    # where this rank's slice starts in the full tensor
    r0 = tp_rank * out.shape[0] if tp_dim == 0 else 0
    c0 = tp_rank * out.shape[1] if tp_dim == 1 else 0
    r1 = r0 + out.shape[0]
    out[max(0, min(rows - r0, out.shape[0])) :].zero_()
    # rows whose values are a multiple of 16: chunks start at such boundaries
    align = 16 // math.gcd(C, 16)
    step = max(align, chunk_numel // C // align * align)  # rows per chunk
    starts = list(range(0, rows, step))
    if len(starts) > 1 and (rows - starts[-1]) * C < 16:
        # a last chunk of fewer than 16 values would be drawn another way: join it to the one before
        starts.pop()
    for a, b in zip(starts, starts[1:] + [rows]):
        if a >= r1:
            # nothing of ours further on (this parameter's generator is used for nothing else)
            break
        chunk = draw(torch.empty(b - a, C, dtype=torch.float32, device="cpu"))
        lo, hi = max(a, r0), min(b, r1)
        if lo < hi:
            out[lo - r0 : hi - r0].copy_(chunk[lo - a : hi - a, c0 : c0 + out.shape[1]])


def sinusoidal_positions(num_positions, dim):
    """The fixed sin/cos table of "Attention is all you need", used by OPT as the init of learned positions (on the
    CPU, whatever the ambient device)."""
    cpu = torch.device("cpu")
    pos = torch.arange(num_positions, dtype=torch.float64, device=cpu).unsqueeze(1)
    freq = torch.exp(
        torch.arange(0, dim, 2, dtype=torch.float64, device=cpu) * (-math.log(10000.0) / dim)
    )
    table = torch.zeros(num_positions, dim, dtype=torch.float64, device=cpu)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)[:, : dim // 2]
    return table.float()


# -----------------------------------------------------------------------------
# The pipeline stages' layers, as a run's log names them


def describe_partition(num_layers, pp, method):
    """'pipeline stages (type:transformer|embedding): 0: embedding + layers 0-4 | 1: layers 5-10 |
    ...': num_layers over pp stages by pp_partition_method `method`."""
    parts = []
    stages = parallel.partition_layers(num_layers, pp, method)
    for stage, held in enumerate(stages):  # not `layers`: the module of that name
        what = [f"layers {held.start}-{held.stop - 1}" if len(held) > 1 else f"layer {held.start}"]
        what = what if held else []
        what = (["embedding"] if stage == 0 else []) + what + (["head"] if stage == pp - 1 else [])
        parts.append(f"{stage}: {' + '.join(what)}")
    return f"pipeline stages ({method}): " + " | ".join(parts)
