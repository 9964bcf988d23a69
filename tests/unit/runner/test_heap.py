"""The C heap (runner/heap.py): with `keep_freed`, a large buffer freed and asked for again is
reused, not mapped and faulted in afresh; `release_freed` gives it back. Each case runs in a
child process, so this one's heap is left as it was. Page faults, not timings: they are
exact."""

from __future__ import annotations

import json
import subprocess
import sys

from mlxr.runner import heap

CHILD = """
import json, resource, sys
import numpy as np
from mlxr.runner import heap
keep, release = sys.argv[1] == "1", sys.argv[2] == "1"
kept = heap.keep_freed() if keep else None
faults = []
for i in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a = np.ones(48 << 18, dtype=np.float32)  # 48 MiB: past glibc's largest mmap threshold
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    del a
    if release and i == 1:
        heap.release_freed()
print(json.dumps({"kept": kept, "faults": faults}))
"""


def run_child(keep: bool, release: bool) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(int(keep)), str(int(release))],
                         capture_output=True, text=True, check=True, timeout=60)
    return json.loads(out.stdout)


def test_freed_buffers_are_reused_and_given_back_when_asked():
    if heap._glibc() is None:  # not glibc (macOS, musl): nothing to tune, and it says so
        assert run_child(keep=True, release=True)["kept"] is False
        return
    # Counts depend on the page size (transparent huge pages), so they are compared with the
    # first buffer's: a buffer faulted in afresh costs about as many, a reused one next to none.
    plain = run_child(keep=False, release=False)["faults"]
    afresh = plain[0]
    assert afresh > 0 and all(f > afresh / 2 for f in plain)  # every buffer mapped anew
    kept = run_child(keep=True, release=False)
    assert kept["kept"] is True
    assert kept["faults"][0] > afresh / 2 and max(kept["faults"][1:]) < afresh / 10
    released = run_child(keep=True, release=True)["faults"]
    assert released[2] > afresh / 2  # given back after the second buffer
    assert released[1] < afresh / 10 and released[3] < afresh / 10  # and kept again after


def test_without_glibc_both_are_no_ops(monkeypatch):
    monkeypatch.setattr(heap, "_glibc", lambda: None)
    assert heap.keep_freed() is False and heap.release_freed() is False
