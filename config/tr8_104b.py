# tr8-104B: the "go wide" 104B (hidden/layers ratio 512, lesson 16): 32 layers of width 16384, Experiment 6 of
# its chronicle (the FFN fixed to 4h, PP=32). Follows bigscience-workshop/bigscience
# train/tr8-104B-wide/tr8-104B.slurm at commit 1321e534 ("fix setup") key by key, Megatron-DeepSpeed's defaults
# where it sets nothing; tests/test_configs.py pins every value. (The file's later commits turned it into
# Experiments 7-12: 64 layers of width 11600, and from Experiment 11 on the init 0.006: config/tr8b_104b.py.)
#   torchrun --nnodes 128 --nproc_per_node 4 train.py config/tr8_104b.py --data_path ...   # 512 V100s: DP 4
# Differences that stay: data and tokenizer are the user's (the run: OSCAR-en, GPT-2 BPE, split 949,50,1);
# the script's `--loss-scale 12` is Megatron's static scale, which --deepspeed ignores (the DeepSpeed config's
# dynamic scaler below ran); DeepSpeed ZeRO-1 is our native ZeRO-1.
num_layers = 32
hidden_size = 16384
num_attention_heads = 32
seq_length = 2048
# Megatron's fused bias-GeLU (the default, --no-bias-gelu-fusion unset) is tanh-GeLU
activation = "gelu_tanh"
hidden_dropout = 0.1  # Megatron's defaults: the script sets no dropout
attention_dropout = 0.1

micro_batch_size = 1
global_batch_size = 2048
# doubled from tr1-13B's 16 "since PP=32", which the chronicle later corrected: the number of DP replicas is what
# a batch must be divisible by (Experiment 7 went back to 16 16)
rampup_batch_size = [32, 32, 6_000_000]
train_samples = 300_000_000

lr = 6e-5
min_lr = 6e-6
lr_decay_style = "cosine"
lr_warmup_samples = 216_320
lr_decay_samples = 126_953_125
weight_decay = 0.1
adam_beta1 = 0.9
# "later during experiments changed to --adam-beta2 0.95 as it proved to train faster"
adam_beta2 = 0.95
adam_eps = 1e-8
clip_grad = 1.0
# Megatron's default: the script sets none (0.006 came with Experiment 11, lesson 3)
init_method_std = 0.02
fp16 = True
# DeepSpeed's fp16 block: "initial_scale_power": 12, "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1
initial_loss_scale = 4096
loss_scale_window = 500
hysteresis = 2
min_loss_scale = 1
checkpoint_activations = True
seed = 43  # Experiment 1 ran 42 and diverged; the chronicle moved to 43

tensor_model_parallel_size = 4
pipeline_model_parallel_size = 32
# Megatron-DeepSpeed's fixed choice then: equal layers per stage
pp_partition_method = "type:transformer"
zero_stage = 1

log_interval = 1  # every iteration, to map a spike back to its samples (lesson 9)
eval_interval = 1000
eval_iters = 5
save = "checkpoints/tr8-104B"
load = "checkpoints/tr8-104B"
save_interval = 300
exit_duration_in_mins = 1190  # 20-hour SLURM jobs (lesson 17)
