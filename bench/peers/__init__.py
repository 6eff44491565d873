"""Peers benchmarked beside moestream on the same checkpoint, in the same run (see bench/peers/compare.py)."""
