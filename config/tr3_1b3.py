# tr3m-1B3: the 1.3B optimizer-reset experiment of the tr8b-104B chronicle (lesson 8).
# Step 1 trains to 5M samples; step 2 is one switch instead of the chronicle's perl edits:
#   python train.py config/tr3_1b3.py --load out/tr3_1b3 --train_samples 5_563_200 --reset_optimizer_warmup_iters
num_layers = 24
hidden_size = 2048
num_attention_heads = 16
seq_length = 2048
hidden_dropout = 0.0
attention_dropout = 0.0

micro_batch_size = 4
global_batch_size = 512
train_samples = 5_000_000

lr = 2e-4
min_lr = 1e-5
lr_decay_style = "cosine"
lr_warmup_samples = 216_320
lr_decay_samples = 126_953_125
weight_decay = 0.1
adam_beta1 = 0.9
adam_beta2 = 0.95  # as the 104B run, so that the reset warm-up is 5 / (1 - 0.95) = 100 iterations
adam_eps = 1e-8
clip_grad = 1.0
init_method_std = "small_init"  # sqrt(2 / (5 * 2048)) = 0.0140
embed_layernorm = True
fp16 = True
checkpoint_activations = True

log_interval = 10
eval_interval = 1000
eval_iters = 5
save = "out/tr3_1b3"
load = "out/tr3_1b3"
save_interval = 1000
