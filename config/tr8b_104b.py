# tr8b-104B: 64 layers of width 11600 with the levers of its chronicle (lessons 1-14): embedding LayerNorm,
# the formulaic small init, beta2 0.95, fp16 with loss scaling, ZeRO-1.
#   torchrun --nnodes 64 --nproc_per_node 4 train.py config/tr8b_104b.py
# Rolling back over a bad stretch of data (emb-norm experiments 2-4) is one more flag:
#   --skip-train-iteration-range 13251-14000 16652-18500
num_layers = 64
hidden_size = 11600
num_attention_heads = 80
seq_length = 2048

micro_batch_size = 1
global_batch_size = 2048
rampup_batch_size = [16, 16, 6_000_000]  # the log's batch sizes 80 @ 216960 and 528 @ 1519744 samples
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
init_method_std = 0.006  # sqrt(2 / (5 * 11600)) = 0.00587 (lesson 3); same as "small_init"
embed_layernorm = True
fp16 = True
checkpoint_activations = True

tensor_model_parallel_size = 4
pipeline_model_parallel_size = 32
pp_partition_method = "type:transformer"  # Megatron-DeepSpeed's fixed choice then: equal layers per stage
zero_stage = 1

log_interval = 1
eval_interval = 1000
eval_iters = 5
save = "checkpoints/tr8b-104B"
load = "checkpoints/tr8b-104B"
save_interval = 300
