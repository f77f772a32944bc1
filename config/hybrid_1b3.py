# Hybrid, 1.3B class (1.31B weights): PRISM-1.3B with causal softmax attention (RoPE, 8 heads of
# 256) at layers 2, 8, 14 and 20, the interleave of config/hybrid_340m.py.
import os
exec(open(os.path.join(os.path.dirname(__file__), "prism_1b3.py")).read())

out_dir = "out/hybrid_1b3"
attn_layers = [2, 8, 14, 20]
