"""What makes a runner's start short, through a real server.

The spare runner (supervisor/runners/spare.py, `python -m mlxr.runner --spare`): the server
starts one ahead of any load; a load takes it, and it serves the model's own tokens; the next
spare is made after that load; none outlives the server. A spare started by hand exits when
its input ends, and refuses (status 1, never an abort) settings that are not one JSON object or
name a BLAS it was not started with.

The probes' verdicts (runner/probe_verdicts.py): kept under the server's cache directory
after a load, read by the next load of the same files, which serves the same tokens."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from tests.harness.server import pid_alive, start_server, wait_for


def spares(server) -> list[int]:
    """The server's children started as spares (a taken one keeps its command line)."""
    found = []
    for child in psutil.Process(server.proc.pid).children():
        try:
            if child.cmdline()[-1:] == ["--spare"] and pid_alive(child.pid):
                found.append(child.pid)
        except psutil.NoSuchProcess:
            pass
    return found


def given(server) -> list[int]:
    return [int(pid) for pid in re.findall(r"gave the spare runner pid (\d+)", server.log())]


def test_a_load_takes_the_spare_which_serves_mlx_lms_tokens_and_a_new_one_follows(
        tmp_path, subprocess_env, tiny_model, reference):
    server = start_server(tmp_path, subprocess_env, MLXR_SPARE_RUNNER="1")
    try:
        client = server.client()
        assert client.create(model="tiny", from_=str(tiny_model)).status == "success"
        assert wait_for(lambda: len(spares(server)) == 1, timeout=30), server.log()[-2000:]
        first = spares(server)[0]
        prompt = "The spare runner reads this prompt"
        reply = client.generate(model="tiny", prompt=prompt, raw=True, stream=False,
                                options={"temperature": 0, "num_predict": 12})
        assert given(server) == [first]
        tokens = reference.tokenizer.encode(prompt)
        assert reply.eval_count == 12 and reply.prompt_eval_count == len(tokens)
        assert reply.response == reference.tokenizer.decode(reference(tokens, 12))
        # The next load's spare, made once this load was done.
        assert wait_for(lambda: len(spares(server)) == 2, timeout=30), server.log()[-2000:]
        second = next(pid for pid in spares(server) if pid != first)
        client.generate(model="tiny", prompt="", keep_alive=0)  # unload: its runner ends
        assert wait_for(lambda: not pid_alive(first), timeout=15)
        again = client.generate(model="tiny", prompt=prompt, raw=True, stream=False,
                                options={"temperature": 0, "num_predict": 12})
        assert given(server) == [first, second]
        assert again.response == reply.response
        assert wait_for(lambda: len(spares(server)) == 2, timeout=30)  # the one in use + next
        children = spares(server)
    finally:
        server.stop()
    assert wait_for(lambda: not any(pid_alive(pid) for pid in children), timeout=10)


def test_without_the_setting_no_spare_is_started(tmp_path, subprocess_env, tiny_model):
    server = start_server(tmp_path, subprocess_env)  # MLXR_SPARE_RUNNER=0 (conftest)
    try:
        client = server.client()
        assert client.create(model="tiny", from_=str(tiny_model)).status == "success"
        client.generate(model="tiny", prompt="hi", options={"num_predict": 2})
        assert spares(server) == [] and given(server) == []
        assert len(server.runner_pids()) == 1
    finally:
        server.stop()


def spare_by_hand(subprocess_env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mlxr.runner", "--spare"],
                            env=subprocess_env, stdin=subprocess.PIPE, stderr=subprocess.PIPE)


def test_a_spare_exits_when_its_input_ends(subprocess_env):
    proc = spare_by_hand(subprocess_env)
    proc.stdin.close()
    assert proc.wait(60) == 0


def test_a_spare_refuses_settings_that_are_not_a_json_object(subprocess_env):
    proc = spare_by_hand(subprocess_env)
    _, err = proc.communicate(b"model_dir=/tmp\n", timeout=60)
    assert proc.returncode == 1
    assert b"a spare runner's settings must be one JSON object" in err


def test_a_spare_refuses_settings_for_another_blas(subprocess_env):
    proc = spare_by_hand(subprocess_env)
    settings = {"model_dir": "/tmp", "blas": "/nowhere/libopenblas.so.0"}
    _, err = proc.communicate(json.dumps(settings).encode() + b"\n", timeout=60)
    assert proc.returncode == 1
    assert b"a spare runner was started without the BLAS /nowhere/libopenblas.so.0" in err


def test_the_next_load_of_a_model_reads_its_probes_verdicts(tmp_path, subprocess_env,
                                                            tiny_model, reference):
    # (debug: the runners' own lines reach the log; the server's cache directory is the
    # default one, where the BLAS verdicts and the built kernels are: an empty one would
    # probe and build them for a minute)
    server = start_server(tmp_path, subprocess_env, MLXR_DEBUG="1")
    try:
        client = server.client()
        assert client.create(model="tiny", from_=str(tiny_model)).status == "success"
        prompt = "Kept verdicts"
        tokens = reference.tokenizer.encode(prompt)
        want = reference.tokenizer.decode(reference(tokens, 10))
        options = {"temperature": 0, "num_predict": 10}
        first = client.generate(model="tiny", prompt=prompt, raw=True, options=options,
                                keep_alive=0)
        assert first.response == want
        assert wait_for(lambda: server.runner_pids() == [], timeout=15)
        # Rows of different lengths in one batch: what a kept verdict skips must not change
        # how they attend (the rows probe also routed the attention, once).
        prompts = [prompt] + [f"Another prompt, {'longer ' * i}than the first" for i in range(4)]
        with ThreadPoolExecutor(len(prompts)) as pool:
            replies = list(pool.map(lambda text: client.generate(
                model="tiny", prompt=text, raw=True, options=options).response, prompts))
        assert replies == [reference.tokenizer.decode(reference(
            reference.tokenizer.encode(text), 10)) for text in prompts]
        # (the first load may have read them too: the same blobs, loaded by another test)
        found = re.findall(r"probes: (\d+) verdicts kept from an earlier load of these "
                           r"files \((\S+\.json)\)", server.log())
        assert found, server.log()[-3000:]
        count, path = found[-1]
        verdicts = json.loads(Path(path).read_text())["verdicts"]
        assert int(count) == len(verdicts) >= 5
        assert verdicts["rows"] is True and verdicts["split"] is True
    finally:
        server.stop()
