# Gated DeltaNet, 1.3B class (1.32B weights): flash-linear-attention's GDN 1.3B shape.
# Shape: flame's configs/gated_deltanet_1B.json and the Gated DeltaNet paper's 1.3B model
# (Yang, Kautz & Hatamizadeh, ICLR 2025): hidden 2048, 21 layers, MLP 8/3 x width (5632),
# vocab 32000, keys 0.75 x D = 1536 and values 1.5 x D = 3072 (expand_v = 2). flame splits the
# keys into 6 heads of 256; here 8 of 192 (n_head must divide n_embd for the hybrid's attention),
# the same as config/gdn_340m.py. Every projection has fla's width, so the count is fla's:
# 1.387B untied, 1.322B with the tied embeddings used here as at 130M.
# Recipe: the paper's 1.3B run (NVlabs/GatedDeltaNet pretrain.py): 100B tokens, AdamW peak lr
# 4e-4, cosine to lr / 10, warmup 1% of the tokens, betas (0.9, 0.95), weight decay 0.1, grad clip
# 1.0, 4096 context; flame's 0.5M-token batches (128 x 4096). 1e11 / 524288 = 190735 iters,
# warmup 1907. A shorter run: set max_iters and lr_decay_iters together (e.g. 20480 = 10.7B).
# Memory: 16 bytes per weight for fp32 weights + grads + AdamW = 21 GB before activations;
# use --fsdp=True on GPUs under 80 GB (BENCHMARKS.md's memory table, estimated).
# Micro-batch 2 x 4096: fits 80 GB GPUs with --fsdp=True, 141 GB ones with DDP (estimated).
# gradient_accumulation_steps is global: on N GPUs each does 64 / N micro-steps.
out_dir = "out/gdn_1b3"
dataset = "slimpajama"

mixer = "gdn"
n_layer = 21
n_embd = 2048
n_head = 8
head_dim = 192
expand_v = 2.0
vocab_size = 32000
block_size = 4096
tie_embeddings = True

batch_size = 2
gradient_accumulation_steps = 64
max_iters = 190735
lr_decay_iters = 190735
warmup_iters = 1907
learning_rate = 4e-4
min_lr = 4e-5
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
compile = True
eval_interval = 1000
eval_iters = 20
log_interval = 10
