# tr11-176B-ml (BLOOM, lesson 19): the final 176B training. 70 layers of width 14336 with 112 heads, ALiBi
# instead of position embeddings, the embedding LayerNorm that tamed the 104B (lesson 1), bf16 (lesson 6).
#   torchrun --nnodes 48 --nproc_per_node 8 train.py config/tr11_176b.py     # 384 A100-80GB: TP 4 x PP 12 x DP 8
#   WORLD_SIZE=384 python train.py config/tr11_176b.py --dry_run
num_layers = 70
hidden_size = 14336
num_attention_heads = 112
seq_length = 2048
position_embedding_type = "alibi"
embed_layernorm = True
activation = "gelu_tanh"
hidden_dropout = 0.0  # the released BLOOM config: no dropout
attention_dropout = 0.0
vocab_size = 250_680  # BLOOM's multilingual BPE; padded to 250,880 = 490 x 128 x TP
make_vocab_size_divisible_by = 128
tokenizer_file = "data/bloom/tokenizer.json"  # BLOOM's public tokenizer.json (bigscience/bloom)
data_path = ["data/bloom/roots"]  # python data.py --input ... --output-prefix data/bloom/roots --tokenizer-file ...
init_method_std = 0.0048

micro_batch_size = 2
global_batch_size = 2048
rampup_batch_size = [192, 16, 9_765_625]  # main-5 (lesson 12): 192 fills the pipeline from the start
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

tensor_model_parallel_size = 4
pipeline_model_parallel_size = 12
pp_partition_method = "type:transformer|embedding"  # 70 layers + embedding + head = 72 = 12 stages x 6
# BLOOM's DeepSpeed config said ZeRO stage 0, but with bf16 its BF16_Optimizer sharded the fp32 master weights and
# Adam moments over DP: ZeRO-1 (the dry run: 66.8 GiB of model states per GPU without, 27.8 GiB with).
zero_stage = 1

log_interval = 1
eval_interval = 1000
eval_iters = 5
save = "checkpoints/tr11-176B-ml"
load = "checkpoints/tr11-176B-ml"
save_interval = 100
