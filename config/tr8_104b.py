# tr8-104B: the "go wide" 104B (hidden/layers ratio 512, lesson 16): 32 layers of width 16384.
num_layers = 32
hidden_size = 16384
num_attention_heads = 32
seq_length = 2048

micro_batch_size = 1
global_batch_size = 2048
rampup_batch_size = [32, 32, 6_000_000]  # doubled from tr1-13B's 16: PP=32 cannot spread 16 samples
train_samples = 300_000_000

lr = 6e-5
min_lr = 6e-6
lr_decay_style = "cosine"
lr_warmup_samples = 216_320
lr_decay_samples = 126_953_125
weight_decay = 0.1
adam_beta1 = 0.9
adam_beta2 = 0.95  # "later during experiments changed to --adam-beta2 0.95 as it proved to train faster"
adam_eps = 1e-8
clip_grad = 1.0
init_method_std = 0.02
fp16 = True
checkpoint_activations = True

tensor_model_parallel_size = 4
pipeline_model_parallel_size = 32
pp_partition_method = "type:transformer"  # Megatron-DeepSpeed's fixed choice then: equal layers per stage
zero_stage = 1

log_interval = 1  # every iteration, to map a spike back to its samples (lesson 9)
eval_interval = 1000
eval_iters = 5
save = "checkpoints/tr8-104B"
load = "checkpoints/tr8-104B"
save_interval = 300
