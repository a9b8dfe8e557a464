"""Benchmarks of the pipeline on GPUs; each script writes bench/results/NAME.json (see bench/RESULTS.md)."""
