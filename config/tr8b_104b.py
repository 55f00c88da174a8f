# tr8b-104B, Embed-Norm experiment 1 of its chronicle: 64 layers of width 11600 with the embedding LayerNorm
# (lesson 1), the formulaic small init (lesson 3), beta2 0.95 and fp16 with DeepSpeed's loss scaler (lesson 5).
# Follows bigscience-workshop/bigscience train/tr8b-104B/tr8b-104B-emb-norm-64n.slurm (commit 699b2af9) key by key,
# Megatron-DeepSpeed's defaults where it sets nothing; tests/test_configs.py pins every value.
#   torchrun --nnodes 64 --nproc_per_node 4 train.py config/tr8b_104b.py --data_path ...   # 256 V100s: DP 2
# The script's last state also rolls back over the bad stretches of Embed-Norm experiments 2-4 (which did not help,
# lesson 9); the launch had no skip, so neither has this file: add it to a resumed run if you want it.
#   --skip-train-iteration-range 13251-14000 16651-19500
# Differences that stay: data and tokenizer are the user's (the run: OSCAR-en, GPT-2 BPE, split 949,50,1);
# the script's `--loss-scale 12` is Megatron's static scale, which --deepspeed ignores (the DeepSpeed config's
# dynamic scaler below ran: the log shows "loss scale: 4096.0"); DeepSpeed ZeRO-1 is our native ZeRO-1.
num_layers = 64
hidden_size = 11600
num_attention_heads = 80
seq_length = 2048
# Megatron's fused bias-GeLU (the default, --no-bias-gelu-fusion unset) is tanh-GeLU
activation = "gelu_tanh"
hidden_dropout = 0.1  # Megatron's defaults: the script sets no dropout
attention_dropout = 0.1

micro_batch_size = 1
global_batch_size = 2048
# the log's batch sizes 80 @ 216960 and 528 @ 1519744 samples
rampup_batch_size = [16, 16, 6_000_000]
train_samples = 300_000_000

lr = 6e-5
min_lr = 6e-6
lr_decay_style = "cosine"
lr_warmup_samples = 216_320
lr_decay_samples = 126_953_125
weight_decay = 0.1
adam_beta1 = 0.9
adam_beta2 = 0.95
adam_eps = 1e-8
clip_grad = 1.0
# the script's; "small_init" would give sqrt(2 / (5 * 11600)) = 0.00587 (lesson 3)
init_method_std = 0.006
embed_layernorm = True
fp16 = True
# DeepSpeed's fp16 block: "initial_scale_power": 12, "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1
initial_loss_scale = 4096
loss_scale_window = 500
hysteresis = 2
min_loss_scale = 1
checkpoint_activations = True
seed = 43

tensor_model_parallel_size = 4
pipeline_model_parallel_size = 32
# Megatron-DeepSpeed's fixed choice then: equal layers per stage
pp_partition_method = "type:transformer"
zero_stage = 1

log_interval = 1
eval_interval = 1000
eval_iters = 5
save = "checkpoints/tr8b-104B"
load = "checkpoints/tr8b-104B"
save_interval = 300
# 20-hour SLURM jobs (lesson 17); the launch had 1190, then "longer safety margin"
exit_duration_in_mins = 1185
