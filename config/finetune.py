# Continue pre-training a Hugging Face GPT-2, BLOOM or Llama model, downloaded beforehand (nothing is downloaded here):
#   python train.py config/finetune.py --init_from_hf=gpt2 --data_path=data/NAME
# The model's keys (layers, width, heads, vocabulary, activation, positions) come from its config.json; this file
# sets the training only, and a model key given here or on the command line must agree with the model. GPT-2's
# seq_length is its n_positions (1024); BLOOM has ALiBi and takes --seq_length=2048, the length it was trained on.
hidden_dropout = 0.0
attention_dropout = 0.0

micro_batch_size = 4
global_batch_size = 64
train_iters = 2000

# A pre-trained model wants a gentler LR than its pre-training peak (GPT-2 small: 6e-4) and a short warm-up:
# Adam's moments start from zero (lesson 8).
lr = 3e-5
min_lr = 3e-6
lr_decay_style = "cosine"
lr_warmup_samples = 64 * 100  # 100 iterations
weight_decay = 0.1
adam_beta2 = 0.95
clip_grad = 1.0
bf16 = True

log_interval = 10
eval_interval = 200
eval_iters = 20
save = "out/finetune"
save_interval = 500
