"""Benchmarks: `python -m bench --op NAME` or `k3gen bench --op NAME` (`--list` for the names).
bench/harness.py times and writes; bench/cases/<op>.py holds the cases; results/ the newest runs."""
