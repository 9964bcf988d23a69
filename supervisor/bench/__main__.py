"""`python -m mlxr.supervisor.bench` (also `mlxr bench`)."""

from mlxr.supervisor.bench.cli import main

main()
