# Hybrid, 340M class (351M weights): PRISM-340M with causal softmax attention (RoPE, 4 heads of
# 256) at layers 2, 8, 14 and 20: one attention layer per six, counted down from the last, the
# same 5:1 interleave as config/hybrid_130m.py (which has them at 5 and 11 of 12).
import os
exec(open(os.path.join(os.path.dirname(__file__), "prism_340m.py")).read())

out_dir = "out/hybrid_340m"
attn_layers = [2, 8, 14, 20]
