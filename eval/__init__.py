"""Evaluation: eval/lm_eval.py (lm-evaluation-harness adapter + CLI), eval/compare.py (tables)."""
