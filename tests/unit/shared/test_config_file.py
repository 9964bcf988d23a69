"""The config file (shared/config_file.py) under Settings.load: defaults < file < environment
< flags; every key and type checked, with errors that name the key and the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxr.shared.config import Settings, rows_layout
from mlxr.shared.config_file import FILE_KEYS, ConfigError

FULL = """
[server]
host = "0.0.0.0:12000"
api_key = "sesame"
origins = ["https://app.example", "http://localhost:*"]
keep_alive = "10m"
shutdown_grace = 2
debug = true
blas = "off"
cache_dir = "~/cache-here"
state_dir = "/var/lib/mlxr"
allow_image_urls = true
[store]
models = "/models"
registry_timeout = "2m"
[scheduler]
max_loaded_models = 2
num_parallel = 4
max_queue = 64
context_length = 8192
load_timeout = 600
kv_layout = "padded"
prefix_cache_bytes = "512MiB"
max_load_failures = 5
load_failure_cooldown = "30s"
hostfile = "/etc/mlxr/hosts.json"
sharding = "pipeline"
remote_shell = "ssh -o BatchMode=yes"
host_attention = false
attention_buckets = true
float32_weights = "off"
spare_runner = false
[limits]
memory_margin = 2147483648
max_request_bytes = "64MiB"
"""


def load(tmp_path: Path, text: str, **env: str):
    path = tmp_path / "config.toml"
    path.write_text(text)
    return Settings.load({"MLXR_CONFIG": str(path), "HOME": str(tmp_path), **env})


def test_every_key_of_the_file_reaches_its_setting(tmp_path):
    s, sources = load(tmp_path, FULL)
    assert (s.host, s.port, s.api_key, s.origins) == \
        ("0.0.0.0", 12000, "sesame", ("https://app.example", "http://localhost:*"))
    assert (s.keep_alive_s, s.shutdown_grace_s, s.debug, s.blas) == (600.0, 2.0, True, "off")
    assert s.cache_dir == Path("~/cache-here").expanduser()
    assert (s.state_dir, s.allow_image_urls) == (Path("/var/lib/mlxr"), True)
    assert (s.models_dir, s.registry_timeout_s) == (Path("/models"), 120.0)
    assert (s.max_loaded_models, s.num_parallel, s.max_queue, s.context_length) == \
        (2, 4, 64, 8192)
    assert (s.load_timeout_s, s.kv_layout, s.prefix_cache_bytes) == (600.0, "padded", 512 << 20)
    assert (s.max_load_failures, s.load_failure_cooldown_s) == (5, 30.0)
    assert (s.hostfile, s.sharding, s.remote_shell) == \
        (Path("/etc/mlxr/hosts.json"), "pipeline", "ssh -o BatchMode=yes")
    assert s.host_attention is False and s.float32_weights == "off"
    assert s.attention_buckets is True and s.spare_runner is False
    assert (s.memory_margin_bytes, s.max_request_bytes) == (2 << 30, 64 << 20)
    fields = {field for keys in FILE_KEYS.values() for field, _ in keys.values()}
    assert set(sources) == (fields - {"host"}) | {"host", "port"}
    assert set(sources.values()) == {f"file {tmp_path / 'config.toml'}"}


def test_the_environment_overrides_the_file_and_flags_override_both(tmp_path):
    s, sources = load(tmp_path, "[scheduler]\nnum_parallel = 4\nmax_queue = 9\n",
                      MLXR_NUM_PARALLEL="6")
    assert (s.num_parallel, s.max_queue, s.max_loaded_models) == (6, 9, 3)
    assert sources["num_parallel"] == "environment" and "max_loaded_models" not in sources
    path = tmp_path / "config.toml"
    s, sources = Settings.load({"MLXR_CONFIG": str(path), "MLXR_NUM_PARALLEL": "6"},
                               num_parallel=2)
    assert s.num_parallel == 2 and sources["num_parallel"] == "flag"


@pytest.mark.parametrize("value,on", [("0", False), ("off", False), ("1", True), ("yes", True)])
def test_the_environment_turns_host_attention_off_and_on(tmp_path, value, on):
    s, _ = load(tmp_path, "[scheduler]\nhost_attention = true\n", MLXR_HOST_ATTENTION=value)
    assert s.host_attention is on


@pytest.mark.parametrize("text,value,on", [("", None, False), ("true", None, True),
                                           ("true", "0", False), ("false", "1", True)])
def test_attention_buckets_are_off_unless_the_file_or_the_environment_turns_them_on(
        tmp_path, text, value, on):
    env = {} if value is None else {"MLXR_ATTENTION_BUCKETS": value}
    s, _ = load(tmp_path, f"[scheduler]\nattention_buckets = {text}\n" if text else "", **env)
    assert s.attention_buckets is on


@pytest.mark.parametrize("value,mode", [("0", "off"), ("on", "on"), ("TRUE", "on"),
                                        ("auto", "auto")])
def test_the_environment_sets_float32_weights(tmp_path, value, mode):
    s, _ = load(tmp_path, '[scheduler]\nfloat32_weights = "off"\n', MLXR_FLOAT32_WEIGHTS=value)
    assert s.float32_weights == mode


def test_float32_weights_refuses_other_words(tmp_path):
    with pytest.raises(ValueError, match="auto, on or off"):
        Settings.from_env({"MLXR_FLOAT32_WEIGHTS": "maybe", "HOME": str(tmp_path)})
    with pytest.raises(ConfigError, match="float32_weights"):
        load(tmp_path, '[scheduler]\nfloat32_weights = "bf16"\n')


def test_an_address_in_the_environment_replaces_the_files_socket(tmp_path):
    s, _ = load(tmp_path, '[server]\nhost = "unix:///tmp/mlxr.sock"\n')
    assert s.socket_path == Path("/tmp/mlxr.sock")
    s, _ = load(tmp_path, '[server]\nhost = "unix:///tmp/mlxr.sock"\n',
                MLXR_HOST="127.0.0.1:12001")
    assert (s.socket_path, s.host, s.port) == (None, "127.0.0.1", 12001)


@pytest.mark.parametrize("text, words", [
    ("[scheduler]\nnum_paralel = 4\n", "unknown key 'num_paralel' in [scheduler]"),
    ("[sched]\nnum_parallel = 4\n", "unknown group [sched]"),
    ("num_parallel = 4\n", "unknown group [num_parallel]"),
    ('[scheduler]\nnum_parallel = "4"\n', "[scheduler] num_parallel: must be an integer"),
    ("[scheduler]\nnum_parallel = true\n", "[scheduler] num_parallel: must be an integer"),
    ('[server]\ndebug = "yes"\n', "[server] debug: must be true or false"),
    ('[server]\norigins = "https://a"\n', "[server] origins: must be a list of strings"),
    ("[server]\nkeep_alive = [1]\n", '[server] keep_alive: must be a duration ("5m"'),
    ('[server]\nkeep_alive = "soon"\n', "[server] keep_alive:"),
    ('[limits]\nmax_request_bytes = "lots"\n', "[limits] max_request_bytes: invalid size"),
    ('[scheduler]\nkv_layout = "paged"\n', "[scheduler] kv_layout:"),
    ('[server]\nhost = "nohost:99999"\n', "[server] host:"),
    ("[server\nhost = 1\n", "is not valid TOML"),
])
def test_bad_files_name_the_key_and_the_file(tmp_path, text, words):
    with pytest.raises(ConfigError) as err:
        load(tmp_path, text)
    assert words in str(err.value) and str(tmp_path / "config.toml") in str(err.value)


def test_a_missing_named_file_is_an_error_and_the_default_file_is_optional(tmp_path):
    with pytest.raises(ConfigError, match="not a file"):
        Settings.load({"MLXR_CONFIG": str(tmp_path / "nope.toml")})
    assert Settings.load({"HOME": str(tmp_path)})[1] == {}
    (tmp_path / ".mlxr").mkdir()
    (tmp_path / ".mlxr" / "config.toml").write_text("[scheduler]\nnum_parallel = 3\n")
    s, sources = Settings.load({"HOME": str(tmp_path)})
    assert s.num_parallel == 3 and sources["num_parallel"].endswith(".mlxr/config.toml")


def test_kv_layout_auto_is_the_rows_on_a_cpu_and_the_padded_batch_on_a_gpu():
    assert Settings().kv_layout == "auto"
    assert rows_layout("auto", on_cpu=True) and not rows_layout("auto", on_cpu=False)
    assert rows_layout("rows", on_cpu=False) and rows_layout("rows", on_cpu=True)
    assert not rows_layout("padded", on_cpu=True)
