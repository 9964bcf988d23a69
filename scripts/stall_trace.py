"""The bench's prefill-stall scenario (supervisor/bench/scenarios.py `prefill_stall`: 8 streams
decode, a 2,000-token prompt arrives) on a runner of its own, several rounds, printing also when
the largest gaps fell. Behind docs/PERFORMANCE.md "The prefill stall (session 13)".

    LD_PRELOAD=$(.venv/bin/python -m mlxr.shared.blas --path) \\
        PYTHONPATH=. .venv/bin/python scripts/stall_trace.py [ROUNDS]
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

from tokenizers import Tokenizer

from mlxr.supervisor.bench import peers
from mlxr.supervisor.bench.cli import resolve_model
from mlxr.supervisor.bench.scenarios import prefill_stall
from mlxr.supervisor.bench.targets import RunnerTarget


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    model = resolve_model("small", Path.home() / ".cache" / "mlxr-bench")
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    runner = peers.start_runner(model, Path(tempfile.mkdtemp()), num_parallel=16)
    try:
        for _ in range(rounds):
            r = asyncio.run(prefill_stall(RunnerTarget("mlxr-runner", runner.url), tokenizer))
            gaps = ", ".join(f"{g * 1000:.0f} ms at {at:.2f} s" for g, at in r["largest_gaps_s"])
            print(f"interval {r['median_itl_before_s'] * 1000:.1f} ms, prompt read in "
                  f"{r['prefill_s']:.2f} s, max gap {r['max_gap_in_itls']:.2f} intervals "
                  f"(no prompt, as long: {r['control_max_gap_in_itls']:.2f}); "
                  f"largest: {gaps}", flush=True)
    finally:
        runner.stop()


if __name__ == "__main__":
    main()
