# Llama-3.2-1B's shape with the Llama recipe: the block people fork for a stability experiment in 2026.
# Shape: meta-llama/Llama-3.2-1B's config.json (16 layers of 2048, 32 query heads in 8 key/value groups, SwiGLU of
# 8192, RMSNorm eps 1e-5, rope_theta 500000, the 128256-token vocabulary, tied embeddings, no biases): 1.236B
# parameters, as the model card says (tests/test_llama.py counts them).
# Recipe: Llama 2's (Touvron et al. 2023, section 2.2: AdamW beta2 0.95, eps 1e-5, weight decay 0.1, clipping 1.0,
# 2000 warm-up steps, cosine to 10% of the peak, 4M-token batches) at Llama 3's 8K context; Meta published no
# recipe of the 1B itself (pruned from Llama 3.1 8B and distilled).
#   torchrun --nproc_per_node 8 train.py config/llama_1b.py --data_path ... --tokenizer_file tokenizer.json
# Differences that stay: Llama 3's rope scaling ("llama3", for its long-context stage) is not implemented: the
# rotary embeddings are unscaled, which is what pre-training at 8K uses; the data and tokenizer are the user's.
num_layers = 16
hidden_size = 2048
num_attention_heads = 32
num_query_groups = 8
ffn_hidden_size = 8192
seq_length = 8192
vocab_size = 128256
normalization = "rmsnorm"
layernorm_epsilon = 1e-5
swiglu = True
add_bias_linear = False
position_embedding_type = "rotary"
rotary_base = 500000.0
untie_embeddings_and_output_weights = False  # Llama-3.2-1B ties them (the 8B does not)
hidden_dropout = 0.0
attention_dropout = 0.0
init_method_std = 0.02  # transformers' initializer_range for Llama

micro_batch_size = 1
global_batch_size = 512  # 4M tokens of 8192
train_tokens = 9_000_000_000_000  # "up to 9T tokens" (the model card)
lr = 3e-4  # Llama 2's for its 7B and 13B
min_lr = 3e-5
lr_decay_style = "cosine"
lr_warmup_samples = 2000 * 512
weight_decay = 0.1
adam_beta1 = 0.9
adam_beta2 = 0.95
adam_eps = 1e-5
clip_grad = 1.0
bf16 = True
checkpoint_activations = True
zero_stage = 1
