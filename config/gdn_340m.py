# Gated DeltaNet, 340M class (347M weights): flash-linear-attention's GDN shape at width 1024.
# Shape, from fla / flame and the Gated DeltaNet paper (Yang, Kautz & Hatamizadeh, ICLR 2025):
#  - 21 layers, MLP 8/3 x width (SwiGLU, rounded to 256: 2816), vocab 32000: flame's
#    configs/gated_deltanet_340M.json (hidden 1024, 21 layers, hidden_ratio 4 -> 2/3 * 4).
#    21 rather than the transformer's 24 layers: a GDN layer holds ~14 D^2 weights to
#    attention+MLP's 12 D^2, so 21 GDN layers weigh what 24 transformer layers do.
#  - key width 0.75 x D, value width 1.5 x D (expand_v = 2 per head): the paper's
#    expand_k = 0.75 / expand_v = 1.5 (NVlabs/GatedDeltaNet) and flame's 1B json (6 x 256 keys at
#    2048). flame's 340M json keeps the 1B's 6 x 256 heads at width 1024 (keys 1.5 x D), which
#    weighs 0.51B here, not 340M; the proportions are kept instead. 4 heads x 192 because
#    n_head must divide n_embd (the hybrid's attention splits n_embd by it) and 192 keeps fla's
#    large heads (256) within reach; the Triton kernels pad K to 256.
#  - tied embeddings, as the 130M configs (flame unties them: +32.8M weights, same compute).
# Recipe: flame's README 340M recipe: 0.5M-token batches (128 x 4096; flame: 8 GPUs x 65536),
# 20480 steps = 10.7B tokens, AdamW lr 1e-3 with 1024 warmup steps then cosine to 10%, grad
# clip 1.0; betas (0.9, 0.95) and weight decay 0.1 are flame's optimizer defaults. Context 4096 as
# flame's context_len. The paper's 0.4B runs take 15B tokens at lr 4e-4: --max_iters=28610
# --lr_decay_iters=28610 --learning_rate=4e-4 --min_lr=4e-5 for that.
# Micro-batch 4 x 4096: 45-62 GB per GPU with DDP for the three 340M models (BENCHMARKS.md's memory
# table, estimated). gradient_accumulation_steps is global: on N GPUs each does 32 / N micro-steps.
out_dir = "out/gdn_340m"
dataset = "slimpajama"

mixer = "gdn"
n_layer = 21
n_embd = 1024
n_head = 4
head_dim = 192
expand_v = 2.0
vocab_size = 32000
block_size = 4096
tie_embeddings = True

batch_size = 4
gradient_accumulation_steps = 32
max_iters = 20480
lr_decay_iters = 20480
warmup_iters = 1024
learning_rate = 1e-3
min_lr = 1e-4
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
compile = True
eval_interval = 500
eval_iters = 20
log_interval = 10
