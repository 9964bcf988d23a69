"""Hypothesis strategies for hostile request bodies: any JSON value, and bodies that know each
route's fields (so most examples get past the first check and reach the later ones) while
giving every field wrong types, huge numbers and odd strings too.

`SETTINGS` is what every fuzz test runs under: derandomized (a fixed seed: the same examples
on every run of the same code, so CI is reproducible), no example database, and a deadline
per example, generous for a loaded machine, so that a hang is a failure.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

SETTINGS = settings(derandomize=True, database=None, deadline=10_000, max_examples=100,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much],
                    print_blob=True)

# The model names in the fuzzed server's store, and a few that are not there.
MODELS = ("tiny", "tiny:latest", "missing", "", "a/b/c/d", "../etc", "TINY")

BIG_INTS = st.sampled_from([2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, -(2**63), -(2**63) - 1,
                            10**30, -(10**30)])
ODD_FLOATS = st.sampled_from([1e308, -1e308, 5e-324, -0.0, 0.5, 1.5, 2.0000001, 1e19, -1.0])
# (No lone surrogates: read_json refuses them, so no parser sees one; the HTTP test sends them.)
ODD_STRINGS = st.sampled_from(["", " ", "\x00", "\uffff", "\U0010ffff", "{{", "}}",
                               "{{ .Prompt }}", "{{ range 1000000000 }}x{{ end }}", "<think>",
                               "\u202e", "a" * 200, "é" * 20, "1e999", "NaN", "-1", "0x10",
                               "sha256:" + "0" * 64, "data:image/png;base64,AAAA"])
TEXT = st.text(max_size=24) | ODD_STRINGS

SCALARS = (st.none() | st.booleans() | st.integers(min_value=-(2**64), max_value=2**64)
           | BIG_INTS | st.floats(allow_nan=True, allow_infinity=True) | ODD_FLOATS | TEXT)


def json_values(max_leaves: int = 12) -> st.SearchStrategy[Any]:
    """Any JSON-shaped value (NaN, infinities and ints past 64 bits included)."""
    return st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(TEXT, inner, max_size=4), max_leaves=max_leaves)


ANY = json_values(max_leaves=5)  # a field's wrong value: small, so examples stay fast


@st.composite
def weighted(draw, *choices: tuple[float, st.SearchStrategy[Any]]) -> Any:
    """A draw from one of `choices`, picked in proportion to its weight. (A choice of
    hypothesis's own leans to its simplest value, and `one_of` counts a repeated branch
    once, so neither can weight.)"""
    at = draw(st.integers(0, 999)) / 1000 * sum(weight for weight, _ in choices)
    for weight, strategy in choices:
        at -= weight
        if at < 0:
            return draw(strategy)
    return draw(choices[-1][1])


def either(*strategies: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """One of a field's plausible values, or (one time in ten) any value at all."""
    return weighted((9, st.one_of(*strategies)), (1, ANY))


@st.composite
def _obj(draw, required: dict[str, Any], optional: dict[str, Any]) -> dict[str, Any]:
    body = draw(st.fixed_dictionaries(required, optional=optional))
    luck = draw(st.integers(0, 999))
    if body and luck >= 750:  # one field gets a wrong value
        body[sorted(body)[luck % len(body)]] = draw(ANY)
    elif required and luck >= 650:  # a required field is missing
        body.pop(sorted(required)[luck % len(required)], None)
    elif luck >= 550:  # a field nobody knows
        body[draw(TEXT)] = draw(ANY)
    return body


def obj(optional: dict[str, st.SearchStrategy[Any]] | None = None,
        required: dict[str, st.SearchStrategy[Any]] | None = None
        ) -> st.SearchStrategy[dict[str, Any]]:
    """An object with its `required` fields and some of its `optional` ones, each drawn from
    its strategy; now and then one field has a wrong value, a required one is missing or an
    unknown one is added."""
    return _obj(required or {}, optional or {})


# -- pieces of bodies --------------------------------------------------------------------------

MODEL = weighted((6, st.just("tiny")), (3, st.sampled_from(MODELS)), (1, ANY))
SMALL_INT = st.integers(min_value=1, max_value=40) | st.sampled_from([0, -1, -3])
NUMBER = weighted((6, SMALL_INT), (1.5, st.floats(min_value=-3, max_value=3)), (1, BIG_INTS),
                  (0.5, ODD_FLOATS), (1, ANY))
FRACTION = weighted((8, st.floats(min_value=0, max_value=1)), (2, NUMBER))
COUNT = weighted((8, st.integers(min_value=1, max_value=3)), (2, NUMBER))
BOOL = either(st.booleans())
RARE = weighted((9, st.none()), (1, ANY))  # a field that refuses any value it is given
ROLE = either(st.sampled_from(["user", "assistant", "system", "tool", "developer", "USER"]))
FUNCTION = obj(required={"name": either(TEXT)},
               optional={"description": either(TEXT),
                         "parameters": either(st.just({"type": "object"}))})
TOOL = either(obj(required={"type": either(st.just("function")), "function": either(FUNCTION)}))
TOOL_CALL = obj(required={"function": either(obj(
                    required={"name": either(TEXT)},
                    optional={"arguments": either(st.just("{}"), st.just({}))}))},
                optional={"id": either(TEXT), "type": either(st.just("function"))})
OPTION_NAMES = ("num_predict", "num_ctx", "num_keep", "temperature", "top_k", "top_p", "min_p",
                "seed", "stop", "repeat_penalty", "repeat_last_n", "presence_penalty",
                "frequency_penalty", "typical_p", "num_batch", "num_gpu", "use_mmap",
                "logit_bias", "num_thread")
OPTIONS = either(obj({k: either(st.lists(TEXT, max_size=20)) if k == "stop" else NUMBER
                      for k in OPTION_NAMES}))
DURATION = either(st.sampled_from(["5m", "0", "-1", "1h30m", "nan", "inf", "1e400", "5 minutes",
                                   "-", "9" * 400 + "h"]), NUMBER)
FORMAT = either(st.sampled_from(["json", "", "xml"]),
                st.just({"type": "object", "properties": {"a": {"type": "string"}}}),
                st.just({"type": "regex", "pattern": "a+"}))
THINK = either(st.sampled_from([True, False, "high", "low", "max", "HIGH", "none"]))
IMAGES = either(st.lists(either(st.just("AAAA"), TEXT), max_size=2))
OLLAMA_MESSAGE = either(obj(
    required={"role": ROLE, "content": either(TEXT)},
    optional={"images": IMAGES, "tool_calls": either(st.lists(TOOL_CALL, max_size=2)),
              "thinking": either(TEXT), "tool_name": either(TEXT)}))


def messages(message: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return either(st.lists(message, min_size=1, max_size=3))


# -- Ollama ------------------------------------------------------------------------------------

OLLAMA_COMMON = {"format": FORMAT, "options": OPTIONS, "stream": BOOL, "keep_alive": DURATION,
                 "think": THINK, "logprobs": BOOL, "top_logprobs": NUMBER, "shift": BOOL,
                 "truncate": BOOL, "_debug_render_only": BOOL}
GENERATE = obj(required={"model": MODEL, "prompt": either(TEXT)},
               optional={**OLLAMA_COMMON, "suffix": either(TEXT), "system": either(TEXT),
                         "template": either(TEXT), "raw": BOOL,
                         "context": either(st.lists(NUMBER, max_size=4)), "images": IMAGES})
CHAT = obj(required={"model": MODEL, "messages": messages(OLLAMA_MESSAGE)},
           optional={**OLLAMA_COMMON, "tools": either(st.lists(TOOL, max_size=2))})
EMBED_INPUT = either(TEXT, st.lists(TEXT, max_size=3), st.lists(NUMBER, max_size=3),
                     st.lists(st.lists(NUMBER, max_size=3), max_size=2))
EMBED = obj(required={"model": MODEL, "input": EMBED_INPUT},
            optional={"truncate": BOOL, "dimensions": NUMBER, "options": OPTIONS,
                      "keep_alive": DURATION})
MODELFILE = either(st.sampled_from([
    "FROM tiny", "FROM tiny\nPARAMETER temperature nan", "FROM tiny\nPARAMETER num_ctx 1e99",
    'FROM tiny\nTEMPLATE """{{ if', "FROM tiny\nMESSAGE robot hi", "PARAMETER\n", '"""',
    'FROM tiny\nSYSTEM """unterminated', "FROM tiny\nPARAMETER stop a\nPARAMETER stop b",
    "FROM tiny\nADAPTER /nonexistent", "from\ttiny\nparameter\ttop_k\t9" + "9" * 30,
    'FROM tiny\nTEMPLATE "{{ range 100000000 }}{{ end }}"']), st.text(max_size=60))
CREATE = obj(required={"model": MODEL},
             optional={"name": MODEL, "from": MODEL, "template": either(TEXT),
                       "system": either(TEXT), "license": either(TEXT, st.lists(TEXT, max_size=2)),
                       "parameters": OPTIONS, "messages": messages(OLLAMA_MESSAGE),
                       "files": either(st.dictionaries(TEXT, TEXT, max_size=2)),
                       "adapters": either(st.dictionaries(TEXT, TEXT, max_size=2)),
                       "quantize": either(st.sampled_from(["q8_0", "Q4_0", "fp16", "bogus"])),
                       "modelfile": MODELFILE, "stream": BOOL})
PULL = obj(required={"model": MODEL}, optional={"name": MODEL, "insecure": BOOL, "stream": BOOL})
SHOW = obj(required={"model": MODEL}, optional={"name": MODEL, "verbose": BOOL})
COPY = obj(required={"source": MODEL, "destination": MODEL}, optional={})
# Only names that are not there (or not names): the fuzzed store keeps its models.
DELETE = obj(required={"model": either(st.sampled_from(["missing", "", "x/../y", "a b"]))},
             optional={"name": either(st.sampled_from(["missing", "bad name"]))})

# -- OpenAI ------------------------------------------------------------------------------------

OPENAI_PART = either(
    obj(required={"type": either(st.just("text")), "text": either(TEXT)}),
    obj(required={"type": either(st.just("image_url")),
                  "image_url": either(obj(required={"url": either(st.just(
                      "data:image/png;base64,AAAA"))}))}))
OPENAI_MESSAGE = either(obj(
    required={"role": ROLE},
    optional={"content": either(TEXT, st.lists(OPENAI_PART, max_size=2)),
              "name": either(TEXT), "tool_call_id": either(TEXT), "reasoning": either(TEXT),
              "tool_calls": either(st.lists(TOOL_CALL, max_size=2))}))
RESPONSE_FORMAT = either(obj(
    required={"type": either(st.sampled_from(["text", "json_object", "json_schema", "xml"]))},
    optional={"json_schema": either(obj(required={"schema": either(st.just({"type": "object"}))},
                                        optional={"strict": BOOL}))}))
OPENAI_COMMON = {
    "n": COUNT, "temperature": FRACTION, "top_p": FRACTION, "max_tokens": NUMBER,
    "presence_penalty": FRACTION, "frequency_penalty": FRACTION, "seed": NUMBER,
    "top_k": NUMBER, "min_p": FRACTION, "stop": either(TEXT, st.lists(TEXT, max_size=3)),
    "logit_bias": either(st.dictionaries(TEXT, NUMBER, max_size=2)), "stream": BOOL,
    "stream_options": either(obj({"include_usage": BOOL})), "response_format": RESPONSE_FORMAT,
    "format": FORMAT}
TOOL_CHOICE = either(st.sampled_from(["none", "auto", "required"]),
                     obj(required={"type": either(st.just("function")),
                                   "function": either(obj(required={"name": either(TEXT)}))}))
OPENAI_CHAT = obj(
    required={"model": MODEL, "messages": messages(OPENAI_MESSAGE)},
    optional={**OPENAI_COMMON, "max_completion_tokens": NUMBER, "logprobs": BOOL,
              "top_logprobs": NUMBER, "tools": either(st.lists(TOOL, max_size=2)),
              "tool_choice": TOOL_CHOICE,
              "reasoning_effort": either(st.sampled_from(["low", "none", "ultra", ""])),
              "reasoning": either(obj({"effort": either(st.sampled_from(["high", "x"]))}))})
OPENAI_COMPLETION = obj(
    required={"model": MODEL, "prompt": either(TEXT, st.lists(TEXT, min_size=1, max_size=3))},
    optional={**OPENAI_COMMON, "suffix": either(TEXT), "logprobs": NUMBER, "echo": BOOL})
OPENAI_EMBEDDINGS = obj(
    required={"model": MODEL, "input": EMBED_INPUT},
    optional={"encoding_format": either(st.sampled_from(["float", "base64", "hex"])),
              "dimensions": NUMBER, "user": either(TEXT)})

# -- Anthropic ---------------------------------------------------------------------------------

IMAGE_SOURCE = either(obj(required={"type": either(st.just("base64")),
                                    "data": either(st.sampled_from(["AAAA", "!!", ""]))},
                          optional={"media_type": either(st.just("image/png"))}))
BLOCK = either(
    obj(required={"type": either(st.just("text")), "text": either(TEXT)}),
    obj(required={"type": either(st.just("image")), "source": IMAGE_SOURCE}),
    obj(required={"type": either(st.just("tool_use")), "id": either(TEXT),
                  "name": either(TEXT)}, optional={"input": either(st.just({}))}),
    obj(required={"type": either(st.just("tool_result")), "tool_use_id": either(TEXT)},
        optional={"content": either(TEXT), "is_error": BOOL}),
    obj(required={"type": either(st.just("thinking")), "thinking": either(TEXT)}))
ANTHROPIC_MESSAGE = either(obj(
    required={"role": either(st.sampled_from(["user", "assistant"])),
              "content": either(TEXT, st.lists(BLOCK, min_size=1, max_size=3))}))
ANTHROPIC_TOOL = either(obj(
    required={"name": either(TEXT), "input_schema": either(st.just({"type": "object"}))},
    optional={"description": either(TEXT), "type": either(st.sampled_from(["custom", "bash"]))}))
ANTHROPIC = obj(
    required={"model": MODEL, "messages": messages(ANTHROPIC_MESSAGE), "max_tokens": COUNT},
    optional={
        "system": either(TEXT, st.lists(BLOCK, max_size=2)), "temperature": FRACTION,
        "top_p": FRACTION, "top_k": NUMBER, "stop_sequences": either(st.lists(TEXT, max_size=2)),
        "stream": BOOL, "metadata": either(obj({"user_id": either(TEXT)})),
        "tools": either(st.lists(ANTHROPIC_TOOL, max_size=2)),
        "tool_choice": either(obj(required={"type": either(st.sampled_from(
            ["auto", "any", "tool", "none"]))}, optional={"name": either(TEXT)})),
        "thinking": either(obj(required={"type": either(st.sampled_from(
            ["enabled", "disabled", "adaptive"]))}, optional={"budget_tokens": NUMBER})),
        "output_config": either(obj({
            "effort": either(st.sampled_from(["low", "max", "x"])),
            "format": either(obj(required={"type": either(st.just("json_schema")),
                                           "schema": either(st.just({}))}))}))})

# -- Responses ---------------------------------------------------------------------------------

RESPONSES_PART = either(
    obj(required={"type": either(st.sampled_from(["input_text", "output_text", "refusal"])),
                  "text": either(TEXT)}),
    obj(required={"type": either(st.just("input_image")),
                  "image_url": either(st.sampled_from(["data:image/png;base64,AAAA",
                                                       "https://x", "data:;base64,!"]))}))
RESPONSES_ITEM = either(
    obj(required={"type": either(st.just("message")), "role": ROLE},
        optional={"content": either(TEXT, st.lists(RESPONSES_PART, max_size=2))}),
    obj(required={"type": either(st.just("function_call")), "call_id": either(TEXT),
                  "name": either(TEXT)},
        optional={"arguments": either(st.sampled_from(["{}", "[]", "{"]))}),
    obj(required={"type": either(st.just("function_call_output")), "call_id": either(TEXT)},
        optional={"output": either(TEXT)}),
    obj(required={"type": either(st.just("reasoning"))},
        optional={"encrypted_content": either(TEXT),
                  "summary": either(st.lists(either(obj({"text": either(TEXT)})),
                                             max_size=2))}))
RESPONSES_TOOL = either(obj(
    required={"type": either(st.sampled_from(["function", "namespace"])), "name": either(TEXT)},
    optional={"parameters": either(st.just({"type": "object"})), "description": either(TEXT),
              "tools": either(st.lists(ANY, max_size=2))}))
RESPONSES = obj(
    required={"model": MODEL,
              "input": either(TEXT, st.lists(RESPONSES_ITEM, min_size=1, max_size=3))},
    optional={
        "instructions": either(TEXT), "temperature": FRACTION, "top_p": FRACTION,
        "max_output_tokens": NUMBER, "stream": BOOL,
        "tools": either(st.lists(RESPONSES_TOOL, max_size=2)),
        "tool_choice": either(st.sampled_from(["auto", "none", "required"]),
                              obj(required={"type": either(st.just("function")),
                                            "name": either(TEXT)})),
        "reasoning": either(obj({"effort": either(st.sampled_from(["low", "none", "x"])),
                                 "summary": ANY})),
        "text": either(obj({"format": either(obj(
            required={"type": either(st.sampled_from(["text", "json_object", "json_schema"]))},
            optional={"schema": either(st.just({"type": "object"})), "name": either(TEXT),
                      "strict": BOOL}))})),
        "background": BOOL, "previous_response_id": RARE, "conversation": RARE,
        "truncation": ANY, "parallel_tool_calls": ANY, "metadata": ANY})

# Route -> body strategy (every POST route that reads a JSON body and that the issue names).
BODIES: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    "/api/generate": GENERATE, "/api/chat": CHAT, "/api/embed": EMBED, "/api/create": CREATE,
    "/api/pull": PULL, "/api/show": SHOW, "/api/copy": COPY, "/api/delete": DELETE,
    "/v1/chat/completions": OPENAI_CHAT, "/v1/completions": OPENAI_COMPLETION,
    "/v1/embeddings": OPENAI_EMBEDDINGS, "/v1/messages": ANTHROPIC, "/v1/responses": RESPONSES,
}
