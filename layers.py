"""The blocks model.py chooses between by config, beside its own GPT-2 ones: RMSNorm and the gated SwiGLU MLP of
Llama and OLMo 2 (`normalization=rmsnorm`, `swiglu`), and the inputs of packed documents made from the tokens
(packed_inputs: Megatron's reset_attention_mask, reset_position_ids, eod_mask_loss). A fork's norm or
feed-forward is a class here plus its line in model.norm() or
model.mlp(); nothing else changes (the parameter count and FLOPs follow from the model as built).

Not here: the attention (model.py), the parallel linears these are made of (parallel.py).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel import ColumnParallelLinear, RowParallelLinear


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight (Zhang & Sennrich 2019), as Llama and OLMo 2 have it: the statistics and
    the normalisation in fp32 for half inputs (as every norm here, lesson 6), cast back to the input's dtype, then
    the gain (transformers' LlamaRMSNorm, so that an imported model computes what transformers does)."""

    def __init__(self, size, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x):
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


class SwiGLU(nn.Module):
    """Shazeer's gated feed-forward, fc2(SiLU(gate(x)) * fc1(x)) (Megatron's --swiglu, Llama's gate/up/down).
    gate and fc1 (up) are two column-parallel layers, each split by output features over TP, so that a rank's
    slice of one multiplies the same features' slice of the other: no communication until fc2, as in the plain
    MLP, and any TP size computes the one-process function."""

    def __init__(self, model_cfg, grid):
        super().__init__()
        h, ffn, bias = model_cfg.hidden_size, model_cfg.ffn_size, model_cfg.add_bias_linear
        self.gate = ColumnParallelLinear(h, ffn, bias=bias, grid=grid)
        self.fc1 = ColumnParallelLinear(h, ffn, bias=bias, grid=grid)
        self.fc2 = RowParallelLinear(ffn, h, bias=bias, grid=grid)
        self.fc2.weight.is_output_layer = True

    def forward(self, x):
        return self.fc2(F.silu(self.gate(x)) * self.fc1(x))


def swiglu_ffn_hidden_size(hidden_size):
    """Megatron's default width with --swiglu: 2/3 of 4h (two input matrices instead of one keep the parameter
    count of the 4h MLP), rounded down to a multiple of 64."""
    return int(4 * hidden_size * 2 / 3 / 64) * 64


# -----------------------------------------------------------------------------
# Packed documents that do not see each other (Megatron's reset_attention_mask and reset_position_ids)


def document_ids(tokens, eod):
    """(batch, seq) index of each token's document within its sample: a document ends with its end-of-document
    token (which belongs to it, as in Megatron's get_ltor_masks_and_position_ids), the next starts after it."""
    ends = (tokens == eod).long()
    return ends.cumsum(dim=1) - ends


def document_positions(documents):
    """Positions restarting at 0 at the first token of each document (reset_position_ids), (batch, seq)."""
    B, T = documents.shape
    index = torch.arange(T, device=documents.device).expand(B, T)
    first = torch.ones(B, 1, dtype=torch.bool, device=documents.device)
    starts = torch.cat((first, documents[:, 1:] != documents[:, :-1]), dim=1)
    return index - torch.where(starts, index, 0).cummax(dim=1).values


def document_mask(documents):
    """(batch, 1, seq, seq) bool: query i sees key j <= i of its own document (reset_attention_mask)."""
    T = documents.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=documents.device).tril()
    return ((documents[:, :, None] == documents[:, None, :]) & causal).unsqueeze(1)


class DocumentBlockMask:
    """Packed documents' attention without their scores: FlexAttention's block-sparse mask of the block-diagonal
    causal pattern (blocks wholly outside every document skipped; attention holds no (B, 1 or heads, T, T) mask or
    bias, though create_block_mask, run eagerly once per forward, evaluates one (B, T, T) boolean to build it) and
    ALiBi's bias as a score modification. What the model hands core_attention on CUDA with
    compiled blocks (the default there: flex_attention is a fused kernel under compile); SDPA with
    document_mask's dense mask elsewhere, and with attention dropout, which flex_attention has not."""

    def __init__(self, documents, slopes=None):
        from torch.nn.attention.flex_attention import create_block_mask

        B, T = documents.shape

        def causal_within_document(b, h, q, kv):
            return (kv <= q) & (documents[b, q] == documents[b, kv])

        self.block_mask = create_block_mask(
            causal_within_document, B, None, T, T, device=documents.device
        )
        self.slopes = slopes  # ALiBi's, this rank's heads (fp32), or None

    def attend(self, q, k, v, scale=None, enable_gqa=False):
        from torch.nn.attention.flex_attention import flex_attention

        score_mod = None
        if self.slopes is not None:
            slopes = self.slopes

            # alibi_bias's -slope * (i - j), in the scores' fp32
            def score_mod(score, b, h, q_idx, kv_idx):
                return score + slopes[h] * (kv_idx - q_idx)

        return flex_attention(
            q,
            k,
            v,
            score_mod=score_mod,
            block_mask=self.block_mask,
            scale=scale,
            enable_gqa=enable_gqa,
        )


def flex_documents(device, compiled, head_dim):
    """Does attention over packed documents run through DocumentBlockMask? On CUDA under compile (the default
    there), where flex_attention is one fused kernel; eager, it materialises the scores. Not for heads narrower
    than 16: inductor's flex_attention kernel refuses them (NotImplementedError at the first compile; torch 2.11,
    H200), so they take the dense mask. Tests force it on CPU."""
    return device.type == "cuda" and compiled and head_dim >= 16


def packed_inputs(
    tokens, eod, reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False
):
    """The model's keyword inputs for a micro-batch of input tokens (B, T) under Megatron's data flags, as
    get_ltor_masks_and_position_ids makes them, computed on the tokens' device in a few vectorised ops (no loop
    over samples or documents, no host sync): documents (the block-diagonal mask, reset_attention_mask), positions
    (restarting after each end-of-document token, reset_position_ids) and loss_mask (0 where the *input* token is
    the end-of-document: no loss on predicting the first token of the next document, eod_mask_loss). Any
    combination, as in Megatron: reset positions alone still attend across documents."""
    inputs = {}
    if reset_position_ids or reset_attention_mask:
        documents = document_ids(tokens, eod)
        if reset_attention_mask:
            inputs["documents"] = documents
        if reset_position_ids:
            inputs["positions"] = document_positions(documents)
    if eod_mask_loss:
        inputs["loss_mask"] = (tokens != eod).float()
    return inputs
