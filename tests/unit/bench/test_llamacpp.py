"""`mlxr bench --against llamacpp` without the binary: its command line, the end-token bias
that keeps llama.cpp's replies as long as the others', the request body, and the error that
says how to build the peer when it is missing."""

import asyncio
import json
import stat
from types import SimpleNamespace

import httpx
import pytest
from tokenizers import Tokenizer

from mlxr.shared.assets import write_qwen3_tokenizer
from mlxr.supervisor.bench import cli, peers
from mlxr.supervisor.bench.metrics import RequestRecord
from mlxr.supervisor.bench.targets import OpenAITarget, Sampling, reply_ids


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    write_qwen3_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tokenizer(qwen3_dir):
    return Tokenizer.from_file(str(qwen3_dir / "tokenizer.json"))


def test_command_line_has_slots_continuous_batching_threads_and_context(tmp_path):
    args = peers.llama_server_args(tmp_path / "llama-server", tmp_path / "m.gguf", port=4321,
                                   num_parallel=16, threads=2, ctx_per_slot=384)
    assert args[0] == str(tmp_path / "llama-server")
    pairs = dict(zip(args[1::], args[2::]))
    assert pairs["-m"] == str(tmp_path / "m.gguf")
    assert (pairs["--host"], pairs["--port"]) == ("127.0.0.1", "4321")
    assert (pairs["-np"], pairs["-t"], pairs["-tb"]) == ("16", "2", "2")
    assert pairs["-c"] == str(16 * 384)  # llama.cpp splits -c among the slots
    assert "--cont-batching" in args


def test_end_token_bias_covers_every_token_llamacpp_stops_on(tokenizer):
    bias = peers.end_token_bias(tokenizer)
    # </s>, <|endoftext|>, <|im_end|>, <|fim_pad|>, <|repo_name|>, <|file_sep|>
    assert set(bias) == {"128247", "151643", "151645", "151662", "151663", "151664"}
    assert all(v <= -100 for v in bias.values())


def test_requests_send_min_p_zero_and_the_bias_and_count_llamacpp_events():
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.update(json.loads(request.content))
        events = [{"choices": [{"text": t, "index": 0, "finish_reason": None}]}
                  for t in ("a", "b", "c")]
        # llama.cpp's last event of /v1/completions has a choice AND the usage
        events.append({"choices": [{"text": "", "index": 0, "finish_reason": "length"}],
                       "usage": {"completion_tokens": 3}})
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    target = OpenAITarget("llama.cpp F32", "http://peer", "m.gguf",
                          {"logit_bias": {"151662": -100.0}})
    record = RequestRecord(start_s=0.0)

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await target.stream(client, "hello", 3, Sampling(), record)

    asyncio.run(go())
    assert seen["min_p"] == 0.0 and seen["temperature"] == 0.0
    assert seen["logit_bias"] == {"151662": -100.0}
    assert seen["stream"] is True and seen["max_tokens"] == 3
    assert len(record.token_times_s) == 3


def test_missing_binary_says_how_to_build_it(tmp_path, monkeypatch):
    with pytest.raises(peers.PeerNotFound, match="build_llama_server.sh.*PERFORMANCE.md"):
        peers.find_llama_server(str(tmp_path / "nope"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(peers.PeerNotFound, match="not found on PATH.*build_llama_server.sh"):
        peers.find_llama_server("")
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    assert peers.find_llama_server("") == binary
    assert peers.find_llama_server(str(binary)) == binary


def test_bench_refuses_before_starting_anything(qwen3_dir, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(cli, "Tokenizer", SimpleNamespace(from_file=lambda path: tokenizer))
    started = []
    monkeypatch.setattr(peers, "start_supervisor", lambda *a, **k: started.append(a))
    argv = ["--model", str(qwen3_dir), "--against", "mlx_lm,llamacpp",
            "--output", str(tmp_path / "out")]
    with pytest.raises(SystemExit, match="llama-server not found.*MLXR_LLAMA_SERVER"):
        cli.main(argv + ["--llama-server", ""])
    with pytest.raises(SystemExit, match="unknown peers vllm"):
        cli.main(["--model", str(qwen3_dir), "--against", "vllm",
                  "--output", str(tmp_path / "out")])
    assert started == []


def test_greedy_replies_compare_equal_whether_or_not_a_peer_drops_the_leading_space(tokenizer):
    # mlx_lm.server's streaming detokenizer returns " features features" as "features
    # features": the same tokens, and re-encoded they differ from the first one on.
    ours, theirs = " features features", "features features"
    assert tokenizer.encode(ours).ids[0] != tokenizer.encode(theirs).ids[0]
    assert reply_ids(tokenizer, ours) == reply_ids(tokenizer, theirs)
    assert reply_ids(tokenizer, " features") != reply_ids(tokenizer, " feature")


def test_bench_removes_its_work_folder_and_keeps_it_when_a_server_fails(
        qwen3_dir, tokenizer, tmp_path, monkeypatch, capsys):
    # The work folder holds the supervisor's store, a copy of the model (555 MB a run for the
    # medium model): a finished run removes it; a failed one keeps it for the servers' logs.
    monkeypatch.setattr(cli, "Tokenizer", SimpleNamespace(from_file=lambda path: tokenizer))
    works = []

    def mkdtemp(prefix):
        works.append(tmp_path / f"work{len(works)}")
        (works[-1] / "models").mkdir(parents=True)
        return str(works[-1])

    monkeypatch.setattr(cli.tempfile, "mkdtemp", mkdtemp)
    stopped = []
    server = SimpleNamespace(url="http://127.0.0.1:9", stop=lambda: stopped.append(1),
                             extra={"model": "m", "blas": {"path": "", "config": ""}})
    monkeypatch.setattr(peers, "start_supervisor", lambda *a, **k: server)

    async def no_peers(ours, others, tokenizer):
        return {}

    monkeypatch.setattr(cli, "check_greedy", no_peers)
    argv = ["--model", str(qwen3_dir), "--concurrency", "", "--scenarios", "",
            "--against", "", "--output", str(tmp_path / "out")]
    cli.main(argv)
    assert stopped == [1] and not works[0].exists()
    assert json.loads((tmp_path / "out" / "bench.json").read_text())["results"] == {}

    def fails(*a, **k):
        raise RuntimeError("mlxr exited")

    monkeypatch.setattr(peers, "start_supervisor", fails)
    with pytest.raises(RuntimeError, match="mlxr exited"):
        cli.main(argv)
    assert (works[1] / "models").is_dir()
    assert f"logs are kept in {works[1]}" in capsys.readouterr().err
