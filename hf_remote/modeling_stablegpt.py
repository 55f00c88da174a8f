"""stablegpt's GPT as a transformers model, for the architectures no transformers class computes: GPT-2 with the
embedding LayerNorm (stablegpt's flagship configs), NormFormer, qk-layernorm, embedding scaling, rotary with
LayerNorm or a plain MLP, ALiBi without the embedding LayerNorm or with another activation, the Llama block with
learned positions or ALiBi. Loaded with

    AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)

from a directory that tools/export_hf.py wrote. It computes what stablegpt's model.py computes on one process
(the same operations in the same order, so that fp32 logits agree to rounding), and depends on torch and
transformers only. The parameter names are stablegpt's under `model.` (its fused qkv laid out group by group,
[groups, query heads of the group + key + value, head_dim], Megatron's layout), the output layer is `lm_head`
(the word embedding when tied). Inference first: dropout is there for fine-tuning, there is no KV cache (each
generation step runs the whole sequence), and the sequence is at most the position table's length with learned
positions. An attention_mask with zeros (left padding) masks those keys and counts positions from the first
real token.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from .configuration_stablegpt import StableGPTConfig

ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) in fp32 for half inputs, cast back, times the gain (as LlamaRMSNorm)."""

    def __init__(self, size, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x):
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def norm(config, size):
    if config.normalization == "rmsnorm":
        return RMSNorm(size, config.layernorm_epsilon)
    return nn.LayerNorm(size, eps=config.layernorm_epsilon)


# -----------------------------------------------------------------------------
# Positions: ALiBi's bias and rotary's angles


def alibi_slopes(num_heads, device=None):
    """2^(-8i/n), i = 1..n, for a power-of-two n; otherwise those of the largest power of two c < n, then every
    other slope of 2c heads (BLOOM's). float64."""
    c = 2 ** math.floor(math.log2(num_heads))
    i = torch.arange(num_heads, device=device, dtype=torch.float64)
    return torch.exp2(-8.0 * torch.where(i < c, (i + 1) / c, (2 * (i - c) + 1) / (2 * c)))


def alibi_bias(num_heads, seq_len, dtype, device):
    """(heads, seq, seq): -slope * (i - j) for key j <= query i, -inf above the diagonal (the causal mask)."""
    pos = torch.arange(seq_len, device=device)
    distance = (pos.view(1, -1) - pos.view(-1, 1)).to(dtype)
    bias = alibi_slopes(num_heads, device).to(dtype).view(-1, 1, 1) * distance
    return bias.masked_fill(distance > 0, float("-inf"))


def rotary_frequencies(config, head_dim, dtype, device):
    """base^(-2i/d), i < d/2; with use_rope_scaling, Llama 3.1's: wavelengths longer than the original context /
    low_freq_factor divided by the factor, shorter than it / high_freq_factor kept, the ones between interpolated."""
    inv_freq = 1.0 / config.rotary_base ** (
        torch.arange(0, head_dim, 2, device=device, dtype=dtype) / head_dim
    )
    if not config.use_rope_scaling:
        return inv_freq
    factor, original = config.rope_scaling_factor, config.original_max_position_embeddings
    low, high = config.low_freq_factor, config.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, smoothed, scaled)


def rotary_cos_sin(config, seq_len, head_dim, dtype, device):
    """cos and sin, (seq, head_dim), feature i and i + d/2 turning together (GPT-NeoX's layout)."""
    angles = torch.outer(
        torch.arange(seq_len, device=device, dtype=dtype),
        rotary_frequencies(config, head_dim, dtype, device),
    )
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


# -----------------------------------------------------------------------------
# The block


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        h, heads, groups = config.hidden_size, config.num_attention_heads, config.num_query_groups
        self.heads, self.groups, self.head_dim = heads, groups, h // heads
        self.qkv = nn.Linear(h, (heads + 2 * groups) * self.head_dim, bias=config.add_bias_linear)
        self.proj = nn.Linear(h, h, bias=config.add_bias_linear)
        self.head_scale = nn.Parameter(torch.ones(heads)) if config.normformer else None
        self.q_norm = norm(config, self.head_dim) if config.qk_layernorm else None
        self.k_norm = norm(config, self.head_dim) if config.qk_layernorm else None
        self.dropout = config.attention_dropout

    def forward(self, x, bias=None, rotary=None):
        """bias: None (causal) or the (heads or 1, seq, seq) scores bias, causal mask included."""
        B, T, _ = x.shape
        qkv = self.qkv(x).view(B, T, self.groups, self.heads // self.groups + 2, self.head_dim)
        q, k, v = qkv.split((self.heads // self.groups, 1, 1), dim=3)
        q, k, v = q.reshape(B, T, self.heads, self.head_dim), k.squeeze(3), v.squeeze(3)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.q_norm is not None:  # before the rotation, as stablegpt (and OLMo 2)
            q, k = self.q_norm(q), self.k_norm(k)
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=bias,
            is_causal=bias is None,
            dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=self.groups != self.heads,
        )
        if self.head_scale is not None:
            y = y * self.head_scale.view(1, -1, 1, 1)
        return self.proj(y.transpose(1, 2).reshape(B, T, self.heads * self.head_dim))


class MLP(nn.Module):
    """fc2(act(fc1 x)) (NormFormer: a norm after the activation), or SwiGLU's fc2(SiLU(gate x) * fc1 x)."""

    def __init__(self, config):
        super().__init__()
        h, ffn, bias = config.hidden_size, config.ffn_hidden_size, config.add_bias_linear
        self.gate = nn.Linear(h, ffn, bias=bias) if config.swiglu else None
        self.fc1 = nn.Linear(h, ffn, bias=bias)
        self.fc2 = nn.Linear(ffn, h, bias=bias)
        self.act = ACTIVATIONS[config.activation]
        self.ln = norm(config, ffn) if config.normformer else None

    def forward(self, x):
        if self.gate is not None:
            return self.fc2(F.silu(self.gate(x)) * self.fc1(x))
        x = self.act(self.fc1(x))
        return self.fc2(x if self.ln is None else self.ln(x))


class Block(nn.Module):
    """x + Attn(LN(x)) (NormFormer: a norm on the attention's output), then x + MLP(LN(x))."""

    def __init__(self, config):
        super().__init__()
        self.ln_1 = norm(config, config.hidden_size)
        self.attn = Attention(config)
        self.ln_attn = norm(config, config.hidden_size) if config.normformer else None
        self.ln_2 = norm(config, config.hidden_size)
        self.mlp = MLP(config)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, x, bias=None, rotary=None):
        a = self.attn(self.ln_1(x), bias, rotary)
        x = x + self.dropout(a if self.ln_attn is None else self.ln_attn(a))
        return x + self.dropout(self.mlp(self.ln_2(x)))


class Embedding(nn.Module):
    """Word embeddings, their optional norm, then the optional sqrt(h) scale, plus learned positions."""

    def __init__(self, config):
        super().__init__()
        self.word = nn.Embedding(config.vocab_size, config.hidden_size)
        learned = config.position_embedding_type == "learned"
        self.position = nn.Embedding(config.seq_length, config.hidden_size) if learned else None
        self.norm = norm(config, config.hidden_size) if config.embed_layernorm else None
        self.scale = math.sqrt(config.hidden_size) if config.scale_embeddings else 1.0
        self.dropout = nn.Dropout(config.embed_dropout)

    def forward(self, ids, positions):
        x = self.word(ids)
        if self.norm is not None:
            x = self.norm(x)
        if self.scale != 1.0:
            x = x * self.scale
        if self.position is not None:
            x = x + self.position(positions)
        return self.dropout(x)


# -----------------------------------------------------------------------------
# The models


class StableGPTPreTrainedModel(PreTrainedModel):
    config_class = StableGPTConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]
    _supports_sdpa = True


class StableGPTModel(StableGPTPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed = Embedding(config)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.ln_f = norm(config, config.hidden_size)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed.word

    def set_input_embeddings(self, value):
        self.embed.word = value

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        """The final norm's output, (batch, seq, hidden)."""
        B, T = input_ids.shape
        padded = attention_mask is not None and not bool(attention_mask.all())
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
            if padded:  # positions count the real tokens (left padding)
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        x = self.embed(input_ids, position_ids)
        bias, rotary = self.positions(T, x.dtype, x.device, position_ids)
        if padded:
            bias = self.mask_padding(attention_mask, bias, x.dtype)
        for block in self.blocks:
            x = block(x, bias, rotary)
        return self.ln_f(x)

    def positions(self, T, dtype, device, position_ids):
        """(ALiBi's bias in the compute dtype, or None; rotary's (cos, sin) at each token's position, or None)."""
        c = self.config
        if c.position_embedding_type == "alibi":
            return alibi_bias(
                c.num_attention_heads, T, torch.promote_types(dtype, torch.float32), device
            ).to(dtype), None
        if c.position_embedding_type == "rotary":
            length = max(T, int(position_ids.max()) + 1)
            cos, sin = rotary_cos_sin(
                c,
                length,
                c.hidden_size // c.num_attention_heads,
                torch.promote_types(dtype, torch.float32),
                device,
            )
            return None, (
                cos.to(dtype)[position_ids].unsqueeze(1),
                sin.to(dtype)[position_ids].unsqueeze(1),
            )
        return None, None

    @staticmethod
    def mask_padding(attention_mask, bias, dtype):
        """The causal bias (ALiBi's or zeros) with the padding keys masked; a padding query sees itself (no row
        of -inf only). (batch, heads or 1, seq, seq)."""
        T, device = attention_mask.shape[1], attention_mask.device
        if bias is None:
            causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
            bias = torch.zeros(T, T, dtype=dtype, device=device).masked_fill(~causal, float("-inf"))
        keep = attention_mask.bool()[:, None, None, :] | torch.eye(
            T, dtype=torch.bool, device=device
        )
        return torch.where(keep, bias, float("-inf"))


class StableGPTForCausalLM(StableGPTPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed.word.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.model = StableGPTModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed.word

    def set_input_embeddings(self, value):
        self.model.embed.word = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(
        self, input_ids=None, attention_mask=None, position_ids=None, labels=None, **kwargs
    ):
        """Logits (batch, seq, vocab); with labels, the mean cross entropy of each token predicting the next
        (labels -100 ignored), as transformers' causal LMs. Cache arguments are accepted and unused."""
        logits = self.lm_head(self.model(input_ids, attention_mask, position_ids))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
            )
        return CausalLMOutput(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        """The whole sequence at every step: no KV cache."""
        return {"input_ids": input_ids, "attention_mask": attention_mask}
