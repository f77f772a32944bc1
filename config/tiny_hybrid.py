# tiny_cpu.py with attention in its second layer (the hybrid path at demo size).
import os
exec(open(os.path.join(os.path.dirname(__file__), "tiny_cpu.py")).read())
out_dir = "out/tiny_hybrid"
attn_layers = [1]
