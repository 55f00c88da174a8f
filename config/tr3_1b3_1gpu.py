# tr3m-1B3 on one 80 GB GPU: the run's model, optimizer, precision and schedule (config/tr3_1b3.py, read
# below), the layout and memory knobs of one GPU instead of its 64 V100s' (PP=2, DP=32):
#   python train.py config/tr3_1b3_1gpu.py --data_path ...
# The same global batch (512, ramped up from 32) by gradient accumulation: the same iterations and learning rates
# as the run, 32x slower. Memory by estimate.py (WORLD_SIZE=1 python train.py config/tr3_1b3_1gpu.py --dry_run):
# model states 22.1 GiB (fp16 weights, fp32 gradients, masters, Adam: 18 B a parameter); activations 25.5 GiB
# per micro-batch of 8 x 2048 tokens without checkpointing (the fused attention keeps a log-sum-exp per query, not
# the scores Korthikanti et al. count), 2.6 GiB with. Micro-batch 8 without checkpointing (47.6 GiB in all, room
# for the loss's chunks and the allocator) skips the recomputation, a quarter of the step's FLOPs, in 64
# micro-batches a global batch of 512; micro-batch 16 would need 73.1 GiB on paper, too close to 80.
# Dropout stays the run's, 0.1 on the attention probabilities and the hidden states (tr3_1b3.py):
# the slurm script sets neither --attention-dropout nor --hidden-dropout, so Megatron-DeepSpeed's
# defaults of 0.1 ran (BLOOM-176B's 0.0 is its HF config's; its README says Megatron's defaults were
# inherited: tr11_176b.py). The dropout costs the flash kernel time (the GPU check's backend table
# prices it); --attention_dropout=0 is faster and no longer the tr3 run.
import os as _os

exec(open(_os.path.join(_os.path.dirname(__file__), "tr3_1b3.py")).read())

pipeline_model_parallel_size = 1
del pp_partition_method  # noqa: F821 (tr3_1b3.py sets it) one stage: nothing to partition
zero_stage = 0  # one data-parallel rank: nothing to shard
micro_batch_size = 8
checkpoint_activations = False
save = load = "out/tr3_1b3_1gpu"
