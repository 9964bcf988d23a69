"""The servers a benchmark drives. Each streams one request and records token arrivals."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from mlxr.supervisor.bench.metrics import RequestRecord, add_chunk


@dataclass(slots=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @classmethod
    def named(cls, name: str) -> "Sampling":
        if name == "greedy":
            return cls()
        if name == "ollama":  # Ollama's default options
            return cls(temperature=0.8, top_k=40, top_p=0.9)
        raise ValueError(f"unknown sampling {name!r} (greedy, ollama)")


@dataclass(slots=True)
class RunnerTarget:
    """Our runner's NDJSON protocol (`--direct`)."""

    name: str
    base_url: str

    async def stream(self, client: httpx.AsyncClient, prompt: str, gen_tokens: int,
                     sampling: Sampling, record: RequestRecord) -> None:
        body = {"prompt": prompt, "options": {"num_predict": gen_tokens,
                                              "temperature": sampling.temperature,
                                              "top_k": sampling.top_k, "top_p": sampling.top_p}}
        async with client.stream("POST", self.base_url + "/v1/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                item = json.loads(line)
                if "error" in item:
                    raise RuntimeError(str(item["error"]))
                add_chunk(record, time.perf_counter(), len(item.get("tokens", [])))
                record.text += item.get("content", "")
        record.end_s = time.perf_counter()


@dataclass(slots=True)
class OpenAITarget:
    """An OpenAI-compatible `/v1/completions` stream (mlx_lm.server, llama.cpp's llama-server,
    or our supervisor). `extra` joins every request body (llama.cpp's end-token logit_bias)."""

    name: str
    base_url: str
    model: str
    extra: dict = field(default_factory=dict)

    def body(self, prompt: str, gen_tokens: int, sampling: Sampling, stream: bool) -> dict:
        # min_p 0 everywhere: llama.cpp's default is 0.05, the others' 0.
        body = {"model": self.model, "prompt": prompt, "max_tokens": gen_tokens,
                "temperature": sampling.temperature, "top_p": sampling.top_p,
                "top_k": sampling.top_k, "min_p": 0.0, **self.extra, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    async def complete(self, client: httpx.AsyncClient, prompt: str, gen_tokens: int) -> str:
        """The greedy completion's text, not streamed."""
        resp = await client.post(self.base_url + "/v1/completions",
                                 json=self.body(prompt, gen_tokens, Sampling(), stream=False))
        resp.raise_for_status()
        return resp.json()["choices"][0]["text"]

    async def stream(self, client: httpx.AsyncClient, prompt: str, gen_tokens: int,
                     sampling: Sampling, record: RequestRecord) -> None:
        body = self.body(prompt, gen_tokens, sampling, stream=True)
        counted, usage = 0, None
        async with client.stream("POST", self.base_url + "/v1/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    raise RuntimeError(str(event["error"]))
                if event.get("usage"):
                    usage = event["usage"].get("completion_tokens")
                if event.get("choices"):
                    add_chunk(record, time.perf_counter(), 1)
                    counted += 1
                    record.text += event["choices"][0].get("text") or ""
        record.end_s = time.perf_counter()
        if usage is not None and usage > counted:  # several tokens arrived as one event
            add_chunk(record, record.end_s, usage - counted)
        elif usage is not None and usage < counted:  # a final event with no new token
            del record.token_times_s[usage:]


async def greedy_agreement(reference: OpenAITarget, other: OpenAITarget, tokenizer,
                           prompts: list[str], gen_tokens: int) -> dict:
    """How far `other`'s greedy replies agree with `reference`'s: prompts whose replies are
    identical, and tokens (of the replies re-encoded) before the first difference."""
    identical = matched = 0
    async with httpx.AsyncClient(timeout=120) as client:
        for prompt in prompts:
            a = reply_ids(tokenizer, await reference.complete(client, prompt, gen_tokens))
            b = reply_ids(tokenizer, await other.complete(client, prompt, gen_tokens))
            same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            identical += a == b
            matched += min(same, gen_tokens)  # a reply's text may re-encode to more tokens
    return {"prompts": len(prompts), "identical": identical, "tokens_matched": matched,
            "tokens": len(prompts) * gen_tokens}


def reply_ids(tokenizer, text: str) -> list[int]:
    """A reply's text re-encoded, without the space it may start with: mlx_lm.server's
    streaming detokenizer for BPE vocabularies drops the first piece's leading space (the
    start-of-text convention, applied to a completion that continues its prompt), so a reply
    whose first token is " features" came back as "features", and re-encoded it differed
    from the first token on (3 of 8 prompts on the small model, with the same token ids)."""
    return tokenizer.encode(text.removeprefix(" ")).ids
