"""`create` with `quantize`: MLX affine quantization through mlx-lm in a child process; the
result loads with mlx_lm, generates, and reports its quantization level."""

from __future__ import annotations

import asyncio

import pytest

from mlxr.shared.errors import InvalidRequest
from mlxr.supervisor.store.create import CreateRequest, create_model
from mlxr.supervisor.store.store import Store
from tests.integration.test_store_registry import greedy_tokens


def create(store: Store, body: dict) -> list[dict]:
    async def collect() -> list[dict]:
        return [x async for x in create_model(store, CreateRequest.from_json(body))]
    return asyncio.run(collect())


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Store:
    s = Store(tmp_path_factory.mktemp("quant") / "models")
    create(s, {"model": "tiny", "random": {"preset": "tiny", "seed": 1},
               "parameters": {"temperature": 0.2}})
    return s


def test_q4_from_a_model_loads_runs_and_reports_q4(store):
    progress = create(store, {"model": "tiny:q4", "from": "tiny", "quantize": "Q4"})
    assert progress[1]["status"] == "quantizing F32 model to Q4 (MLX 4-bit, group size 64)"
    assert progress[-1] == {"status": "success"}
    base, rec = store.resolve("tiny"), store.resolve("tiny:q4")
    assert rec.config["file_type"] == "Q4"
    assert rec.config["quantization"] == {"bits": 4, "group_size": 64, "mode": "affine"}
    assert rec.config["model_type"] == base.config["model_type"]  # same parameter count
    assert rec.params == {"temperature": 0.2}
    assert rec.model_info["general.description"].startswith("random test model")
    weights = lambda r: sum(x["size"] for x in r.manifest["layers"]  # noqa: E731
                            if x.get("name", "").endswith(".safetensors"))
    assert weights(rec) < weights(base) * 0.2
    tokens = greedy_tokens(store.runner_dir(rec))
    assert len(tokens) == 8 and tokens == greedy_tokens(store.runner_dir(rec))
    # The tokenizer files are shared with the base model, not copied.
    shared = {x["digest"] for x in base.manifest["layers"] if x.get("name", "").startswith("tok")}
    assert shared <= {x["digest"] for x in rec.manifest["layers"]}

    with pytest.raises(InvalidRequest, match="already quantized"):
        create(store, {"model": "tiny:q4q8", "from": "tiny:q4", "quantize": "q8"})


def test_q8_straight_from_a_random_preset(store):
    create(store, {"model": "tiny:q8", "random": {"preset": "tiny", "seed": 1}, "quantize": "q8"})
    rec = store.resolve("tiny:q8")
    assert rec.config["file_type"] == "Q8" and rec.config["random"]["seed"] == 1
    assert len(greedy_tokens(store.runner_dir(rec))) == 8
