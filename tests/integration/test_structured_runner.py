"""Structured output through the real runner subprocess on the tiny random model.

The model's free output is gibberish, so these tests bound what the grammar leaves open
(string lengths, array sizes, number ranges) to make every document close well within
`num_predict`; the grammar alone then decides the shape, and EOS (whose logit the random model
holds at exactly 0) is still chosen once the document is complete.
"""

from __future__ import annotations

import asyncio
import json
import random
import re

import httpx
import jsonschema
import pytest

from tests.integration.test_runner import complete, greedy, sentence
from tests.harness.runner_process import running

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": -1000, "maximum": 1000},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                           "geo": {"type": "array", "items": {"type": "number"},
                                   "minItems": 2, "maxItems": 2}},
            "required": ["city", "zip", "geo"],
            "additionalProperties": False,
        },
        "history": {
            "type": "array", "maxItems": 2,
            "items": {"type": "object",
                      "properties": {"year": {"type": "integer", "minimum": 1900,
                                              "maximum": 2100},
                                     "event": {"type": "string", "maxLength": 10}},
                      "required": ["year", "event"], "additionalProperties": False},
        },
    },
    "required": ["name", "age", "score", "role", "active", "tags", "address", "history"],
    "additionalProperties": False,
}
# Token ids of '":"' and '"}' in the Qwen3 vocabulary: biased so the random model closes the
# keys and strings of a free-form JSON object soon (it would ramble inside them otherwise).
CLOSE_STRING_BIAS = {"3252": 6.0, "9207": 6.0}


@pytest.fixture(scope="module")
def runner(tiny_model, subprocess_env):
    with running(tiny_model, subprocess_env, num_parallel=16, prefill_chunk=64,
                 context_length=8192) as url:
        yield url


def run_all(url: str, bodies: list[dict]) -> list[tuple]:
    async def main():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*[complete(client, url, b) for b in bodies])

    return asyncio.run(main())


def test_20_schema_requests_return_valid_json(runner):
    bodies = [{"prompt": f"Describe person number {i} as JSON:", "format": SCHEMA,
               "options": ({"temperature": 0} if i % 2 else {"temperature": 0.9, "seed": i})
               | {"num_predict": 4000}}
              for i in range(20)]
    results = run_all(runner, bodies)
    docs = []
    for _, text, final, _ in results:
        assert final["done_reason"] == "stop", text
        doc = json.loads(text)
        jsonschema.validate(doc, SCHEMA)
        docs.append(doc)
    assert len({json.dumps(d, sort_keys=True) for d in docs}) > 10, "prompts and seeds matter"


def test_json_format_gives_a_json_object(runner):
    bodies = [{"prompt": f"object {i}:", "format": "json",
               "options": {"temperature": 0.9, "seed": i, "num_predict": 800,
                           "logit_bias": CLOSE_STRING_BIAS}} for i in range(6)]
    for _, text, final, _ in run_all(runner, bodies):
        assert final["done_reason"] == "stop", text
        assert isinstance(json.loads(text), dict)


def test_regex_format_matches(runner):
    patterns = [r"[a-z]{3,8}@[a-z]{2,6}\.com", r"\d{3}-\d{4}", r"(yes|no|maybe)",
                r"[A-Z][a-z]{1,6}( [A-Z][a-z]{1,6}){1,2}"]
    bodies = [{"prompt": f"answer {i}:", "format": {"type": "regex", "pattern": p},
               "options": greedy(100)} for i, p in enumerate(patterns)]
    for pattern, (_, text, final, _) in zip(patterns, run_all(runner, bodies)):
        assert final["done_reason"] == "stop"
        assert re.fullmatch(pattern, text), (pattern, text)


def test_free_requests_in_a_batch_with_constrained_ones_are_unchanged(runner, reference):
    rng = random.Random(5)
    prompts = [sentence(rng, rng.randint(4, 60)) for _ in range(6)]
    free = [{"prompt": p, "options": greedy(40)} for p in prompts]
    constrained = [{"prompt": p, "format": SCHEMA,
                    "options": {"temperature": 0.7, "seed": i, "num_predict": 4000}}
                   for i, p in enumerate(prompts)]
    # Interleaved, so constrained and free rows share every decode step of the batch.
    bodies = [b for pair in zip(free, constrained) for b in pair]
    results = run_all(runner, bodies)
    for i, prompt in enumerate(prompts):
        tokens, _, final, _ = results[2 * i]
        assert tokens == reference(reference.tokenizer.encode(prompt), 40)
        assert final["done_reason"] == "length"
        _, text, final, _ = results[2 * i + 1]
        assert final["done_reason"] == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)


def test_a_short_num_predict_cuts_the_document_with_length(runner):
    [(tokens, text, final, _)] = run_all(runner, [{"prompt": "x", "format": SCHEMA,
                                                    "options": greedy(5)}])
    assert final["done_reason"] == "length" and len(tokens) == 5
    assert text.lstrip().startswith("{")


@pytest.mark.parametrize("fmt, reason", [
    ({"type": "object", "properties": {"a": {"type": "foo"}}}, "Invalid type: foo"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
     "Unimplemented keys"),
    ({"type": "regex", "pattern": "(abc"}, "unclosed group"),
    ({"type": "regex"}, "non-empty string pattern"),
    ("yaml", "format must be"),
])
def test_a_format_that_does_not_compile_is_a_400_with_the_reason(runner, fmt, reason):
    resp = httpx.post(runner + "/v1/completions",
                      json={"prompt": "x", "format": fmt, "options": greedy(4)}, timeout=30)
    assert resp.status_code == 400, resp.text
    assert reason in resp.json()["error"]
    assert httpx.get(runner + "/v1/status").json()["status"] == "ready"
