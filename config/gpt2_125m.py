# GPT-2 small (124M; "125M" in the OPT/BigScience tables): the single-GPU repro size.
#   python train.py config/gpt2_125m.py --data_path=data/openwebtext
# Follows GPT-3 Small (arXiv 2005.14165, Table 2.1 and Appendix B): 12 x 768, 12 heads, batch 0.5M tokens, lr 6e-4,
# Adam (0.9, 0.95, 1e-8), clip 1.0, weight decay 0.1, 375M warm-up tokens, cosine decay to 10% of the lr;
# tests/test_configs.py pins these. Differences, on purpose: GPT-2's context of 1024 (GPT-3: 2048); ~3B tokens,
# decayed over the whole run (GPT-3: 300B tokens, decayed over 260B) and no batch-size ramp-up (GPT-3's lasts
# 4-12B tokens, longer than this run); no dropout, as nanoGPT; and three levers of docs/lessons.md instead of
# GPT-2's init and fp32: small_init (lesson 3), the embedding LayerNorm (lesson 1), bf16 (lesson 6).
num_layers = 12
hidden_size = 768
num_attention_heads = 12
seq_length = 1024
activation = "gelu_tanh"  # GPT-2's and GPT-3's GeLU is the tanh approximation
hidden_dropout = 0.0
attention_dropout = 0.0

# 32, not 16: at 16 x 1024 tokens a GPU waits on the host's kernel launches (H200, compiled, bf16: 32.8% MFU;
# 42.6% at 32, 12.0 GiB peak; docs/gpu.md "The first GPU run"). The global batch is GPT-3 Small's either way.
micro_batch_size = 32
global_batch_size = 512  # ~0.5M tokens per iteration, as GPT-3 small
train_samples = 300_000_000 // 1024 * 10  # ~3B tokens

lr = 6e-4
min_lr = 6e-5
lr_decay_style = "cosine"
lr_warmup_samples = 375_000_000 // 1024  # GPT-3: 375M warm-up tokens
weight_decay = 0.1
adam_beta1 = 0.9
adam_beta2 = 0.95
adam_eps = 1e-8
clip_grad = 1.0
init_method_std = "small_init"
embed_layernorm = True
bf16 = True

log_interval = 10
eval_interval = 500
eval_iters = 20
save = "out/gpt2_125m"
save_interval = 1000
