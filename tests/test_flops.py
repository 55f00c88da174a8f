"""The FLOPs bench.py and the log line divide, against torch's FlopCounterMode on a real forward and backward:
Megatron's formula (TFLOPs, recomputation included) and the model's own FLOPs (MFU), each within 2%."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from model import GPT, GPTConfig

B, T = 2, 64


def counted(checkpoint_activations):
    """FLOPs of one forward and backward as run. The math attention backend, whose matmuls FlopCounterMode sees
    (it has no formula for the CPU flash kernel); over the whole T x T, as Megatron's formula and the fused kernels."""
    cfg = GPTConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        seq_length=T,
        vocab_size=50257,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        checkpoint_activations=checkpoint_activations,
    )
    gpt = GPT(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        gpt(ids, targets=ids).backward()
    return cfg, counter.get_total_flops()  # the loss computes the logits once (cross_entropy.py)


def test_model_flops_equal_the_counted_flops_without_recomputation():
    cfg, flops = counted(checkpoint_activations=False)
    assert abs(cfg.model_flops_per_iteration(B, T) / flops - 1) < 0.02


def test_megatron_flops_equal_the_counted_flops_with_recomputation():
    cfg, flops = counted(checkpoint_activations=True)
    assert abs(cfg.flops_per_iteration(B, T) / flops - 1) < 0.02
    # and the recomputation is what the two differ by: 4/3 of the blocks
    assert cfg.flops_per_iteration(B, T) > 1.01 * cfg.model_flops_per_iteration(B, T)


@pytest.mark.parametrize(
    "name,expected", [("gpt2_125m", 6 * (12 * 12 * 768**2 + 50257 * 768) + 12 * 12 * 768 * 1024)]
)
def test_model_flops_per_token_of_gpt2(name, expected):
    # PaLM's count for GPT-2 small: 6 x (12 layers of 12 h^2 weights + the 50257-way output layer) + attention
    cfg = GPTConfig(num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=1024)
    per_token = cfg.model_flops_per_iteration(1, 1024) / 1024
    assert per_token == expected
