"""The benchmarks: each writes bench/results/NAME.json; the parts, commands and current table are in bench/README.md."""
