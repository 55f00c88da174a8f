# GPT-2 small (124M; "125M" in the OPT/BigScience tables): the single-GPU repro size.
#   python train.py config/gpt2_125m.py --data_path=data/openwebtext
num_layers = 12
hidden_size = 768
num_attention_heads = 12
seq_length = 1024
hidden_dropout = 0.0
attention_dropout = 0.0

micro_batch_size = 16
global_batch_size = 512  # ~0.5M tokens per iteration, as GPT-3 small
train_samples = 300_000_000 // 1024 * 10  # ~3B tokens

lr = 6e-4
min_lr = 6e-5
lr_decay_style = "cosine"
lr_warmup_samples = 375_000_000 // 1024  # GPT-3: 375M warm-up tokens
weight_decay = 0.1
adam_beta2 = 0.95
clip_grad = 1.0
init_method_std = "small_init"
embed_layernorm = True
bf16 = True

log_interval = 10
eval_interval = 500
eval_iters = 20
save = "out/gpt2_125m"
save_interval = 1000
