# PRISM, 1.3B class (1.35B weights): the GDN-1.3B model (config/gdn_1b3.py: shape, recipe and
# their sources) with the rank-L anchored solver write, L = 3, r = 64 (PRISM_SPEC.md §2.3).
import os
exec(open(os.path.join(os.path.dirname(__file__), "gdn_1b3.py")).read())

out_dir = "out/prism_1b3"
mixer = "prism"
solver_steps = 3
solver_rank = 64
