# PRISM, 340M class (362M weights): the GDN-340M model (config/gdn_340m.py: shape, recipe and
# their sources) with the rank-L anchored solver write, L = 3, r = 64 (PRISM_SPEC.md §2.3
# defaults, as at 130M).
import os
exec(open(os.path.join(os.path.dirname(__file__), "gdn_340m.py")).read())

out_dir = "out/prism_340m"
mixer = "prism"
solver_steps = 3
solver_rank = 64
