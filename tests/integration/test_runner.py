"""The real runner subprocess on a real tiny model, compared with mlx-lm's own generation."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from tests.harness.runner_process import running

WORDS = ("the quick brown fox jumps over a lazy dog while seven rivers run past old mountains "
         "and clouds drift above quiet towns near the sea").split()


@pytest.fixture(scope="module")
def runner(tiny_model, subprocess_env):
    with running(tiny_model, subprocess_env, num_parallel=16, prefill_chunk=64,
                 context_length=2048) as url:
        yield url


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def complete(client: httpx.AsyncClient, url: str, body: dict, stop_after: int | None = None):
    """Stream a completion; returns (tokens, text, final line, chunks seen)."""
    tokens, text, final, seen = [], "", None, 0
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            item = json.loads(line)
            assert "error" not in item, item
            tokens += item.get("tokens", [])
            text += item.get("content", "")
            seen += 1
            if item["done"]:
                final = item
            if stop_after is not None and seen >= stop_after:
                break
    return tokens, text, final, seen


def greedy(n: int, **extra) -> dict:
    return {"temperature": 0, "num_predict": n, **extra}


def test_16_concurrent_greedy_requests_match_mlx_lm_alone(runner, reference):
    rng = random.Random(7)
    prompts = [sentence(rng, rng.randint(3, 180)) for _ in range(16)]
    lengths = [rng.randint(4, 48) for _ in range(16)]

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*[
                complete(client, runner, {"prompt": p, "options": greedy(n)})
                for p, n in zip(prompts, lengths)])

    results = asyncio.run(main())
    for prompt, n, (tokens, text, final, _) in zip(prompts, lengths, results):
        expected = reference(reference.tokenizer.encode(prompt), n)
        assert tokens == expected
        assert final["done_reason"] == "length" and final["eval_count"] == n
        assert final["prompt_eval_count"] == len(reference.tokenizer.encode(prompt))
        assert text == reference.tokenizer.decode(expected, skip_special_tokens=True)


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(runner):
    body = {"prompt": "once upon a time", "options": {"seed": 1234, "num_predict": 24,
                                                       "temperature": 0.9, "top_k": 40,
                                                       "top_p": 0.9}}

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            alone = await complete(client, runner, body)
            others = [{"prompt": f"noise {i} " * (i + 1),
                       "options": {"num_predict": 30, "temperature": 1.0, "seed": i}}
                      for i in range(7)]
            batch = await asyncio.gather(complete(client, runner, body),
                                         *[complete(client, runner, o) for o in others])
            unseeded = await complete(client, runner, {"prompt": "once upon a time",
                                                       "options": {"num_predict": 24,
                                                                   "temperature": 0.9}})
            return alone, batch[0], unseeded

    alone, in_batch, unseeded = asyncio.run(main())
    assert alone[0] == in_batch[0] and len(alone[0]) == 24
    assert unseeded[0] != alone[0], "a sampled request without a seed varies"


def test_disconnected_streams_leave_the_batch_and_the_rest_complete(runner, reference):
    rng = random.Random(3)
    prompts = [sentence(rng, 20 + i) for i in range(8)]
    n = 150

    async def status(client):
        return (await client.get(runner + "/v1/status")).json()

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            keep = [asyncio.create_task(complete(client, runner,
                                                 {"prompt": p, "options": greedy(n)}))
                    for p in prompts[:4]]
            dropped = [asyncio.create_task(complete(client, runner,
                                                    {"prompt": p, "options": greedy(n)},
                                                    stop_after=5))
                       for p in prompts[4:]]
            await asyncio.gather(*dropped)
            t0 = time.monotonic()
            while (await status(client))["active"] != 4:
                assert time.monotonic() - t0 < 1.0, "cancelled requests still active after 1 s"
                await asyncio.sleep(0.02)
            results = await asyncio.gather(*keep)
            t0 = time.monotonic()
            while (await status(client))["active"] != 0:
                assert time.monotonic() - t0 < 2.0
                await asyncio.sleep(0.02)
            return results

    results = asyncio.run(main())
    for prompt, (tokens, _, final, _) in zip(prompts, results):
        assert tokens == reference(reference.tokenizer.encode(prompt), n)
        assert final["eval_count"] == n


def test_shared_prefix_is_reused_and_output_unchanged(runner, reference):
    rng = random.Random(11)
    system = sentence(rng, 300)
    first, second = system + " first question", system + " second question here"

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            a = await complete(client, runner, {"prompt": first, "options": greedy(12)})
            b = await complete(client, runner, {"prompt": second, "options": greedy(12)})
            # The exact-hit case: a prompt equal to a cached prompt plus its output.
            exact = reference.tokenizer.encode(first) + a[0]
            c = await complete(client, runner, {"tokens": exact, "options": greedy(8)})
            return a, b, c, exact

    a, b, c, exact = asyncio.run(main())
    assert a[2]["prompt_eval_cached_count"] == 0
    shared = len(reference.tokenizer.encode(system))
    assert b[2]["prompt_eval_cached_count"] >= shared - 1
    assert b[0] == reference(reference.tokenizer.encode(second), 12)
    assert c[2]["prompt_eval_cached_count"] == len(exact) - 1
    assert c[0] == reference(exact, 8)


def test_context_overflow_is_a_400_before_streaming(runner):
    resp = httpx.post(runner + "/v1/completions",
                      json={"prompt": "word " * 100, "options": {"num_ctx": 32}})
    assert resp.status_code == 400
    assert "exceeds the context length (32 tokens)" in resp.json()["error"]
    assert resp.json()["kind"] == "context_overflow"


def test_generation_stops_at_the_context_with_length_without_shift(runner):
    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            return await complete(client, runner, {"prompt": "a b c d e", "shift": False,
                                                   "options": greedy(-1, num_ctx=40)})

    tokens, _, final, _ = asyncio.run(main())
    assert final["done_reason"] == "length"
    assert final["prompt_eval_count"] + final["eval_count"] == 40


def test_context_shift_goes_on_from_the_kept_and_newest_tokens(runner, reference):
    """Ollama's shift: at num_ctx the older half after num_keep goes and the reply goes on,
    exactly as the model continues the shorter context (greedy, checked against mlx-lm)."""
    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            return await complete(client, runner, {
                "prompt": "a b c d e", "return_prompt_tokens": True,
                "options": greedy(60, num_ctx=40, num_keep=4)})

    tokens, _, final, _ = asyncio.run(main())
    assert len(tokens) == 60 and final["done_reason"] == "length"
    prompt = final["prompt_tokens"]
    before = 40 - len(prompt)  # the output that fits before the first shift
    assert tokens[:before] == reference(prompt, before)
    full = prompt + tokens[:before]
    shifted = full[:4] + full[4 + (40 - 4) // 2:]
    after = min(60 - before, 40 - len(shifted))  # up to the next shift
    assert tokens[before:before + after] == reference(shifted, after)


def test_stop_string_split_across_tokens(runner, reference):
    prompt = "the sea and the sky"
    tokenizer = reference.tokenizer
    expected = reference(tokenizer.encode(prompt), 40)
    pieces = [tokenizer.decode([t], skip_special_tokens=True) for t in expected]
    # A stop string made of the end of one token's text and the start of the next one's.
    k = next(i for i in range(5, len(pieces) - 1)
             if len(pieces[i].strip()) >= 2 and len(pieces[i + 1].strip()) >= 2)
    stop = pieces[i_end := k][-2:] + pieces[k + 1][:2]
    full = tokenizer.decode(expected, skip_special_tokens=True)
    cut = full.find(stop)

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            return await complete(client, runner, {"prompt": prompt,
                                                   "options": greedy(40, stop=[stop])})

    tokens, text, final, _ = asyncio.run(main())
    assert i_end == k and 0 <= cut
    assert text == full[:cut]
    assert stop not in text and final["done_reason"] == "stop"
    assert final["eval_count"] < 40


def test_logprobs_and_tokenize_roundtrip(runner):
    tokens = httpx.post(runner + "/v1/tokenize", json={"content": "hello world"}).json()["tokens"]
    assert httpx.post(runner + "/v1/detokenize",
                      json={"tokens": tokens}).json()["content"] == "hello world"
    lines = [json.loads(line) for line in httpx.post(
        runner + "/v1/completions", json={"tokens": tokens, "logprobs": True, "top_logprobs": 3,
                                          "options": greedy(3)}, timeout=60).text.splitlines()]
    entries = [lp for line in lines for lp in line.get("logprobs", [])]
    generated = [t for line in lines for t in line["tokens"]]
    assert [e["id"] for e in entries] == generated and len(generated) == 3
    for entry in entries:
        top = entry["top_logprobs"]
        assert len(top) == 3 and entry["logprob"] <= 0
        assert top[0]["id"] == entry["id"], "greedy picks the most likely token"
        assert top[0]["logprob"] >= top[1]["logprob"] >= top[2]["logprob"]


def test_prompt_tokens_are_the_ids_tokenizing_first_gives(runner):
    """What the supervisor sends for Ollama's `context` (the prompt as text, the given context
    as `tokens`, `add_special` explicit) makes the same ids, and so the same output, as
    tokenizing with /v1/tokenize first and sending the ids; the final line carries them. A
    short prompt is encoded on the runner's event loop, a long one in a thread: both."""
    from mlxr.runner.server import INLINE_ENCODE_CHARS

    long_text = sentence(random.Random(5), INLINE_ENCODE_CHARS // 4)
    assert len(long_text) > INLINE_ENCODE_CHARS

    def lines(body: dict) -> list[dict]:
        resp = httpx.post(runner + "/v1/completions", json={**body, "options": greedy(6)},
                          timeout=60)
        assert resp.status_code == 200, resp.text
        return [json.loads(line) for line in resp.text.splitlines()]

    def tokenize(text: str, add_special: bool) -> list[int]:
        return httpx.post(runner + "/v1/tokenize", json={"content": text,
                                                         "add_special": add_special}
                          ).json()["tokens"]

    context: list[int] = []
    for text, add_special in (("Why is the sky blue?", True), ("Why is the sky blue?", False),
                              ("And at night?", False), (long_text, False)):
        ids = context + tokenize(text, add_special and not context)
        by_ids = lines({"tokens": ids})
        by_text = lines({"tokens": context or None, "prompt": text,
                         "add_special": add_special and not context,
                         "return_prompt_tokens": True})
        assert "prompt_tokens" not in by_ids[-1]
        assert by_text[-1]["prompt_tokens"] == ids
        assert all("prompt_tokens" not in line for line in by_text[:-1])
        output = [t for line in by_text for t in line["tokens"]]
        assert output == [t for line in by_ids for t in line["tokens"]] and output
        context = ids + output


def test_bad_requests_are_4xx_not_crashes(runner):
    cases = [b"not json", json.dumps({"options": {}}).encode(),
             json.dumps({"prompt": "x", "options": {"temperature": "hot"}}).encode(),
             json.dumps({"tokens": [10 ** 9]}).encode(),
             json.dumps({"prompt": ""}).encode()]
    for body in cases:
        resp = httpx.post(runner + "/v1/completions", content=body)
        assert resp.status_code == 400, (body, resp.text)
        assert isinstance(resp.json()["error"], str)
        assert resp.json()["kind"] == "invalid_request"
    assert httpx.get(runner + "/v1/status").json()["status"] == "ready"
