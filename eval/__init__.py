"""Evaluation: eval/harness.py (lm-evaluation-harness adapter + CLI), eval/compare.py (tables)."""
