# tr11-176B-ml (BLOOM, lesson 19): the final 176B training. 70 layers of width 14336 with 112 heads, ALiBi
# instead of position embeddings, the embedding LayerNorm (lesson 1), bf16 (lesson 6).
# Follows bigscience-workshop/bigscience train/tr11-176B-ml/tr11-176B-ml.slurm (commit dc8d99ff) and its README key
# by key, Megatron-DeepSpeed's defaults where it sets nothing; tests/test_configs.py pins every value.
#   torchrun --nnodes 48 --nproc_per_node 8 train.py config/tr11_176b.py     # 384 A100-80GB: TP 4 x PP 12 x DP 8
#   WORLD_SIZE=384 python train.py config/tr11_176b.py --dry_run
# (48 nodes as launched in March 2022; the script's last commits ran on 24.) Differences that stay:
# - micro batch: the run started at 1 and switched to 2 at a global batch of 784 (chronicle, 2022-03-14: MBS=1
#   filled the pipeline better while the batch was small); one micro_batch_size holds for the whole run here, 2.
# - `--sync-tp-duplicated-parameters` (from 2022-03-24 as a patch, a flag from July) all-reduces (AVG) the bf16
#   LayerNorm weights and row-parallel biases over TP in every forward, leaving the fp32 masters and Adam's state
#   apart; they drifted because BF16_Optimizer did not clip the gradients of TP ranks > 1 (lesson 18). Here every
#   TP rank clips by the same global norm, so they stay bitwise equal; what we have instead is the check below,
#   which copies TP rank 0's weights, fp32 masters and Adam moments over where they differ, every 100 iterations
#   (just before the periodic save).
# - ZeRO: the script says stage 0, but its BF16_Optimizer sharded the fp32 master weights and Adam moments over DP:
#   ZeRO-1 (the dry run: 66.8 GiB of model states per GPU without, 32.3 GiB with on the rank holding the
#   embedding's shard, 27.8 GiB an even share).
# - data: separate weighted train and valid paths of the ROOTS catalogue (29 validation sets, one batch each per
#   evaluation); here one data_path blend split by `split`. --kill-switch-path: SIGTERM with exit_signal_handler.
num_layers = 70
hidden_size = 14336
num_attention_heads = 112
seq_length = 2048
position_embedding_type = "alibi"
embed_layernorm = True
# Megatron's fused bias-GeLU (the default, --no-bias-gelu-fusion unset) is tanh-GeLU
activation = "gelu_tanh"
# "The default Megatron-LM dropout settings are inherited" (README); the HF config says 0.0
hidden_dropout = 0.1
attention_dropout = 0.1
# Megatron's default, fp16 or bf16 (ours turns it on by itself only in fp16)
apply_query_key_layer_scaling = True
# BLOOM's multilingual BPE; padded to 250,880 = 490 x 128 x TP (the script's --pad-vocab-size-to)
vocab_size = 250_680
make_vocab_size_divisible_by = 128
tokenizer_file = "data/bloom/tokenizer.json"  # BLOOM's public tokenizer.json (bigscience/bloom)
# python data.py --input ... --output-prefix data/bloom/roots --tokenizer-file ...
data_path = ["data/bloom/roots"]
init_method_std = 0.0048  # sqrt(1 / (3 * 14336)) = 0.00482, the 530B formula (lesson 3)

micro_batch_size = 2  # the run: 1 until the global batch reached 784 (see above)
global_batch_size = 2048
# main-5 (lesson 12): PP 12 x MBS 2 x DP 8 = 192 fills the pipeline
rampup_batch_size = [192, 16, 9_765_625]
train_samples = 220_000_000

lr = 6e-5
min_lr = 6e-6
lr_decay_style = "cosine"
lr_warmup_samples = 183_105
lr_decay_samples = 200_000_000
weight_decay = 0.1
adam_beta1 = 0.9
adam_beta2 = 0.95
adam_eps = 1e-8
clip_grad = 1.0
bf16 = True
checkpoint_activations = True
seed = 42

tensor_model_parallel_size = 4
pipeline_model_parallel_size = 12
# 70 layers + embedding + head = 72 = 12 stages x 6
pp_partition_method = "type:transformer|embedding"
zero_stage = 1  # see above
# see above: instead of --sync-tp-duplicated-parameters, with each periodic save
tp_replica_check_interval = 100
tp_replica_resync = True

log_interval = 1
eval_interval = 1000
eval_iters = 1
save = "checkpoints/tr11-176B-ml"
load = "checkpoints/tr11-176B-ml"
save_interval = 100
# 100-hour jobs (qos_gpu-gc): "99:50 5990=60*100-10" (README; lesson 17)
exit_duration_in_mins = 5990
