# tr3m-1B3: the 1.3B optimizer-reset experiment of the tr8b-104B chronicle (lesson 8), on the Pile.
# Follows bigscience-workshop/bigscience train/tr3-1B3-baseline/tr3m-1B3-emb-norm-pile-optim-reset.slurm
# (commit 699b2af9, ROUND=2) key by key, Megatron-DeepSpeed's defaults where it sets nothing;
# tests/test_configs.py pins every value.
#   torchrun --nnodes 16 --nproc_per_node 4 train.py config/tr3_1b3.py --data_path ...   # 64 V100s: DP 32
# Step 1 trains to 5M samples ("till iteration 19686", which only the ramp-up gives); step 2 is one switch instead
# of the chronicle's perl edits (100 iterations at lr 0, then 1000 at the normal schedule):
#   ... train.py config/tr3_1b3.py --data_path ... --train_samples 5_563_200 --reset_optimizer_warmup_iters
# Differences that stay: data and tokenizer are the user's (the run: the Pile, GPT-2 BPE, split 949,50,1);
# the script's `--loss-scale 12` is Megatron's static scale, which --deepspeed ignores (the DeepSpeed config's
# dynamic scaler below ran); DeepSpeed ZeRO-1 is our native ZeRO-1.
num_layers = 24
hidden_size = 2048
num_attention_heads = 16
seq_length = 2048
# Megatron's fused bias-GeLU (the default, --no-bias-gelu-fusion unset) is tanh-GeLU
activation = "gelu_tanh"
hidden_dropout = 0.1  # Megatron's defaults: the script sets no dropout
attention_dropout = 0.1

micro_batch_size = 1
global_batch_size = 512
rampup_batch_size = [32, 32, 2_000_000]
train_samples = 5_000_000

lr = 2e-4
min_lr = 1e-5
lr_decay_style = "cosine"
lr_warmup_samples = 183_105
lr_decay_samples = 73_242_187
weight_decay = 0.1
adam_beta1 = 0.9
adam_beta2 = 0.95  # as the 104B run, so that the reset warm-up is 5 / (1 - 0.95) = 100 iterations
adam_eps = 1e-8
clip_grad = 1.0
init_method_std = 0.02  # Megatron's default: the script sets none
embed_layernorm = True
fp16 = True
# DeepSpeed's fp16 block: "initial_scale_power": 12, "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1
initial_loss_scale = 4096
loss_scale_window = 500
hysteresis = 2
min_loss_scale = 1
checkpoint_activations = True
seed = 1234

tensor_model_parallel_size = 1
pipeline_model_parallel_size = 2
# Megatron-DeepSpeed's fixed choice then: equal layers per stage
pp_partition_method = "type:transformer"
zero_stage = 1

log_interval = 1
eval_interval = 1000
eval_iters = 100
save = "out/tr3_1b3"
load = "out/tr3_1b3"
save_interval = 1500
exit_duration_in_mins = 1190  # 20-hour SLURM jobs (lesson 17)
