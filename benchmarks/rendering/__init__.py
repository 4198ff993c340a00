"""The results tables of the README and docs/, one module per page (benchmarks/render.py writes them)."""
