# Tiny PRISM for demos on a CPU: runs end to end in about a minute, no model hub.
#   python train.py config/tiny_cpu.py
# Data: the first run builds data/pydoc/ from the English documentation that ships inside every
# Python install (pydoc_data, ~0.5 MB) through data/prepare_slimpajama.py; later runs reuse it.
# Mistral vocab (32000) so that the prepared data fits; the token table is most of the 2.2M weights.
out_dir = "out/tiny_cpu"
dataset = "pydoc"

mixer = "prism"
n_layer = 2
n_embd = 64
n_head = 2
head_dim = 32
expand_v = 2.0
solver_steps = 3
solver_rank = 16
vocab_size = 32000
block_size = 64
chunk_size = 16

device = "cpu"
dtype = "float32"
cpu_threads = 1   # tiny matmuls gain little from threads, and OpenMP threads stall badly when
                  # another process shares the cores (measured 25x slower with 2 on a busy 2-core box)
batch_size = 4
gradient_accumulation_steps = 2
max_iters = 150
lr_decay_iters = 150
warmup_iters = 10
learning_rate = 3e-3
min_lr = 3e-4
eval_interval = 50
eval_iters = 4
log_interval = 10
keep_checkpoints = 2
