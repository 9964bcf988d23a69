"""`python -m supervisor.benchmark` (also `mlxr bench`)."""

from supervisor.benchmark.cli import main

main()
