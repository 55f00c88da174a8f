# tr1-13B: BigScience's first 13B English baseline (the 104B runs were sized against it, lesson 16).
# Follows bigscience-workshop/bigscience train/tr1-13B-base/tr1-13B-round1.slurm (commit 699b2af9) key by key,
# Megatron-DeepSpeed's defaults where it sets nothing; tests/test_configs.py pins every value.
#   torchrun --nnodes 16 --nproc_per_node 4 train.py config/tr1_13b.py --data_path ...   # 64 V100s: DP 8
# (16 nodes through the ramp-up, whose batches of 16 allow DP 16 at most; then 64, the last three weeks 128: README)
# Differences that stay: data and tokenizer are the user's (the run: OSCAR-en, GPT-2 BPE, split 949,50,1);
# the script's `--loss-scale 12` is Megatron's static scale, which --deepspeed ignores (the DeepSpeed config's
# dynamic scaler below ran); DeepSpeed ZeRO-1 is our native ZeRO-1.
num_layers = 40
hidden_size = 5120
num_attention_heads = 32
seq_length = 2048
# Megatron's fused bias-GeLU (the default, --no-bias-gelu-fusion unset) is tanh-GeLU
activation = "gelu_tanh"
hidden_dropout = 0.1  # Megatron's defaults: the script sets no dropout
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
# DeepSpeed's fp16 block: "initial_scale_power": 12, "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1
initial_loss_scale = 4096
loss_scale_window = 500
hysteresis = 2
min_loss_scale = 1
checkpoint_activations = True
seed = 42

tensor_model_parallel_size = 2
pipeline_model_parallel_size = 4
# Megatron-DeepSpeed's fixed choice then: equal layers per stage
pp_partition_method = "type:transformer"
zero_stage = 1

log_interval = 10
eval_interval = 1000
eval_iters = 5
save = "checkpoints/tr1-13B"
load = "checkpoints/tr1-13B"
save_interval = 1500
exit_duration_in_mins = 1190  # 20-hour SLURM jobs (lesson 17)
