"""`python -m mlxr.supervisor.cli ...`: the same as the `mlxr` command."""

from mlxr.supervisor.cli.main import main

main()
