"""SpareRunner's bookkeeping (supervisor/runners/spare.py) with stand-in processes: one spare
at a time, taken only with its own BLAS, never handed out dead, given up after repeated
deaths, and ended by `close`."""

from __future__ import annotations

import asyncio
import sys

from mlxr.shared.config import Settings
from mlxr.supervisor.runners.spare import SPARE_FAILURES, SpareRunner

WAITS = [sys.executable, "-c", "import sys; print('ready', flush=True); sys.stdin.read()"]
DIES = [sys.executable, "-c", "print('cannot import mlx', flush=True)"]


def stand_in(argv: list[str], started: list | None = None):
    async def spawn(blas):
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT)
        if started is not None:
            started.append(proc)
        return proc
    return spawn


async def made(spares: SpareRunner) -> None:
    while spares._making is not None:
        await asyncio.sleep(0.01)


def test_one_spare_at_a_time_taken_with_its_own_blas_and_ended_by_close():
    async def go():
        started: list = []
        spares = SpareRunner(Settings(), stand_in(WAITS, started))
        spares.replenish("/lib/a.so")
        spares.replenish("/lib/a.so")  # one on its way already
        await made(spares)
        spares.replenish("/lib/a.so")  # one alive already
        await made(spares)
        assert len(started) == 1
        assert spares.take("/lib/b.so") is None  # another library: ended, not handed out
        assert await asyncio.wait_for(started[0].wait(), 10) is not None
        spares.replenish("/lib/a.so")
        await made(spares)
        spare = spares.take("/lib/a.so")
        assert spare is not None and spare.process is started[1]
        assert spares.take("/lib/a.so") is None  # it is no longer ours
        spares.replenish("/lib/a.so")
        await made(spares)
        await spares.close()
        assert started[2].returncode is not None
        spares.replenish("/lib/a.so")  # closed: no more
        assert spares._making is None and len(started) == 3
        spare.process.kill()
        await spare.process.wait()
    asyncio.run(go())


def test_a_dead_spare_is_never_handed_out_and_repeated_deaths_stop_them(caplog):
    async def go():
        started: list = []
        spares = SpareRunner(Settings(), stand_in(DIES, started))
        for _ in range(SPARE_FAILURES):
            spares.replenish(None)
            await made(spares)
            await started[-1].wait()
            await asyncio.sleep(0.05)  # its output read
            assert spares.take(None) is None
        spares.replenish(None)
        assert spares._making is None and len(started) == SPARE_FAILURES
    asyncio.run(go())
    assert "cannot import mlx" in caplog.text
    assert f"no more spare runners after {SPARE_FAILURES} failures" in caplog.text


def test_off_by_setting_or_with_another_runner_module():
    for settings in (Settings(spare_runner=False), Settings(runner_module="tests.fake")):
        spares = SpareRunner(settings, stand_in(WAITS))
        spares.replenish(None)
        assert spares._making is None


def test_the_setting_reads_mlxr_spare_runner():
    assert Settings.from_env({}).spare_runner is True
    assert Settings.from_env({"MLXR_SPARE_RUNNER": "0"}).spare_runner is False
    assert Settings.from_env({"MLXR_SPARE_RUNNER": "1"}).spare_runner is True
