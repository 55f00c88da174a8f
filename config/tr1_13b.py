# tr1-13B: BigScience's first 13B English baseline (the 104B runs were sized against it, lesson 16).
num_layers = 40
hidden_size = 5120
num_attention_heads = 32
seq_length = 2048
hidden_dropout = 0.1
attention_dropout = 0.1

micro_batch_size = 1
global_batch_size = 1024
rampup_batch_size = [16, 16, 5_000_000]
train_samples = 300_000_000

lr = 1e-4
min_lr = 1e-5
lr_decay_style = "cosine"
lr_warmup_samples = 216_320
lr_decay_samples = 126_953_125
weight_decay = 0.1
adam_beta1 = 0.9
adam_beta2 = 0.999
adam_eps = 1e-8
clip_grad = 1.0
init_method_std = 0.02
fp16 = True
checkpoint_activations = True

tensor_model_parallel_size = 2
pipeline_model_parallel_size = 4
pp_partition_method = "type:transformer"  # Megatron-DeepSpeed's fixed choice then: equal layers per stage
zero_stage = 1

log_interval = 1
eval_interval = 1000
eval_iters = 5
save = "checkpoints/tr1-13B"
load = "checkpoints/tr1-13B"
save_interval = 300
