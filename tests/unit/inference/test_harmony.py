"""gpt-oss's harmony format (supervisor/inference/harmony.py): the output parser, tool names,
and how a request to a harmony model is prepared (the prompt, the parser, think levels,
`think: false`, a format)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from mlxr.supervisor.inference.harmony import FINAL_MESSAGE, HarmonyParser, ToolNames, is_harmony
from mlxr.supervisor.inference.prepare import prepare_chat, prepare_generate
from mlxr.supervisor.inference.tool_calls import ForcedCall, ForcedCallParser, OutputParser
from mlxr.supervisor.inference.types import ChatRequest, GenerateRequest
from mlxr.supervisor.store.small_tokenizer import write_small_tokenizer

THINK_THEN_ANSWER = ("<|channel|>analysis<|message|>The user greets. Reply briefly.<|end|>"
                     "<|start|>assistant<|channel|>final<|message|>Hello there!")
THINK_THEN_CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|>"
                   "<|start|>assistant<|channel|>commentary to=functions.get_weather "
                   '<|constrain|>json<|message|>{"city": "Paris", "days": [1, 2]}')
TOOL = {"type": "function", "function": {
    "name": "get-weather", "description": "The weather now",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "A city"},
        "unit": {"type": "string", "enum": ["c", "f"]}}}}}


def parse(text: str, step: int, parser: HarmonyParser | None = None):
    parser = parser or HarmonyParser()
    thinking, content, calls = "", "", []
    for i in range(0, len(text), step):
        a, b, c = parser.feed(text[i:i + step])
        thinking, content, calls = thinking + a, content + b, calls + c
    a, b, c = parser.finish()
    return thinking + a, content + b, calls + c


@pytest.mark.parametrize("step", [1, 2, 5, 13, 1000])
def test_thinking_and_answer_split_the_same_at_any_chunking(step):
    assert parse(THINK_THEN_ANSWER, step)[:2] == ("The user greets. Reply briefly.",
                                                  "Hello there!")


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_message_to_a_function_is_a_tool_call_with_its_json_arguments(step):
    thinking, content, calls = parse(THINK_THEN_CALL, step)
    assert (thinking, content) == ("Need the weather.", "")
    [call] = calls
    assert call["function"] == {"index": 0, "name": "get_weather",
                                "arguments": {"city": "Paris", "days": [1, 2]}}
    assert call["id"].startswith("call_")


def test_content_is_emitted_before_the_end_and_held_only_where_a_tag_may_begin():
    parser = HarmonyParser()
    assert parser.feed("<|channel|>final<|message|>Hel") == ("", "Hel", [])
    assert parser.feed("lo <|e") == ("", "lo ", [])  # "<|e" may begin <|end|>
    assert parser.feed("xtra") == ("", "<|extra", [])  # it did not
    assert parser.feed("<|end|> trailing text outside any message") == ("", "", [])
    assert parser.finish() == ("", "", [])


def test_the_parser_starts_where_the_prompt_left_off():
    # a continued answer: the prompt ended inside the final message
    prompt = "<|start|>user<|message|>hi<|end|><|start|>assistant<|channel|>final<|message|>Hel"
    assert parse("lo!", 1, HarmonyParser(prompt))[:2] == ("", "lo!")
    # `think: false`: the prompt opened the final channel itself
    assert parse("Hi.<|end|>", 1, HarmonyParser("x<|start|>assistant" + FINAL_MESSAGE)) == \
        ("", "Hi.", [])


def test_commentary_without_a_recipient_is_the_reply_and_unparsable_arguments_stay_text():
    out = "<|channel|>commentary<|message|>Looking it up.<|end|>"
    assert parse(out, 4)[:2] == ("", "Looking it up.")
    bad = "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{not json"
    assert parse(bad, 4) == ("", "{not json", [])
    listed = "<|channel|>commentary to=functions.f<|message|>[1, 2]"
    assert parse(listed, 4) == ("", "[1, 2]", [])


def test_a_harmony_template_is_known_by_its_channels():
    assert is_harmony("<|start|>{{ x }}<|channel|>final<|message|>{{ y }}<|end|>")
    assert not is_harmony("<|im_start|>{{ x }}<|im_end|>") and not is_harmony(None)


def test_tool_names_become_identifiers_and_calls_map_back():
    names = ToolNames(["get-weather", "get.weather", "9lives", "", "python", "ok_name"])
    assert names.to_harmony == {"get-weather": "get_weather", "get.weather": "get_weather_2",
                                "9lives": "_9lives", "": "unnamed", "python": "python",
                                "ok_name": "ok_name"}
    call = "<|channel|>commentary to=functions.get_weather_2 <|constrain|>json<|message|>{}"
    [made] = parse(call, 7, HarmonyParser(names=names))[2]
    assert made["function"]["name"] == "get.weather"
    history = [{"role": "assistant", "tool_calls": [{"function": {"name": "get-weather",
                                                                  "arguments": {}}}]},
               {"role": "tool", "tool_name": "get-weather", "content": "20"}]
    renamed = names.messages(history)
    assert renamed[0]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert renamed[1]["tool_name"] == "get_weather"
    assert history[1]["tool_name"] == "get-weather", "the request's own messages are untouched"


# -- preparing requests -------------------------------------------------------------------

@pytest.fixture
def store(tmp_path):
    write_small_tokenizer(tmp_path, "harmony")
    return SimpleNamespace(runner_dir=lambda record: tmp_path)


def record(**fields):
    return SimpleNamespace(capabilities=["completion", "tools", "thinking"], messages=[],
                           system=None, template=None, params={}, config={}, **fields)


def chat(store, **fields):
    req = ChatRequest(model="oss", messages=[{"role": "user", "content": "Weather?"}],
                      truncate=False, **fields)
    return prepare_chat(req, record(), store, 4096)


def test_a_harmony_chat_renders_tools_under_their_names_and_reads_the_output_as_harmony(store):
    prepared = chat(store, tools=[TOOL])
    assert prepared.prompt.startswith("<|start|>system<|message|>")
    assert "type get_weather = (_: {\n// A city\ncity: string,\nunit?: \"c\" | \"f\",\n}) => any;" \
        in prepared.prompt
    assert "get-weather" not in prepared.prompt
    assert prepared.prompt.endswith("<|start|>assistant")
    assert "Reasoning: medium" in prepared.prompt  # think unset: the model thinks, at medium
    assert isinstance(prepared.parser, HarmonyParser)
    call = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{}"
    assert parse(call, 3, prepared.parser)[2][0]["function"]["name"] == "get-weather"


@pytest.mark.parametrize("think,level", [("low", "low"), ("high", "high"), ("max", "high"),
                                         (True, "medium")])
def test_think_levels_are_the_reasoning_effort(store, think, level):
    assert f"Reasoning: {level}\n" in chat(store, think=think).prompt


def test_think_false_opens_the_final_channel_unless_tools_may_be_called(store):
    prepared = chat(store, think=False)
    assert prepared.prompt.endswith("<|start|>assistant" + FINAL_MESSAGE)
    assert parse("Hi.", 1, prepared.parser)[:2] == ("", "Hi.")
    assert chat(store, think=False, tools=[TOOL]).prompt.endswith("<|start|>assistant")


def test_a_format_holds_after_the_final_channel_opens(store):
    schema = {"type": "object"}
    thinking = chat(store, format=schema)
    assert thinking.format == schema and thinking.format_after == FINAL_MESSAGE
    direct = chat(store, format=schema, think=False)
    assert direct.format_after is None and direct.prompt.endswith(FINAL_MESSAGE)
    # raw text, and a forced tool call (constrained from the first token): no channel to wait for
    raw = prepare_generate(GenerateRequest(model="oss", prompt="{", raw=True, format=schema),
                           record(), store, 4096)
    assert raw.format == schema and raw.format_after is None
    forced = chat(store, tools=[TOOL], force_call=ForcedCall("get-weather"))
    assert forced.format_after is None and isinstance(forced.parser.tools, ForcedCallParser)


def test_generate_parses_harmony_unless_raw(store):
    prepared = prepare_generate(GenerateRequest(model="oss", prompt="hi"), record(), store, 4096)
    assert isinstance(prepared.parser, HarmonyParser)
    assert parse(THINK_THEN_ANSWER, 6, prepared.parser)[:2] == \
        ("The user greets. Reply briefly.", "Hello there!")
    raw = prepare_generate(GenerateRequest(model="oss", prompt="hi", raw=True), record(), store,
                           4096)
    assert isinstance(raw.parser, OutputParser) and raw.prompt == "hi"
    assert raw.parser.feed(THINK_THEN_ANSWER) == ("", THINK_THEN_ANSWER, [])


def test_the_history_renders_calls_results_and_only_the_last_turns_thinking(store):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "thinking": "Call it.",
         "tool_calls": [{"function": {"name": "get-weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_name": "get-weather", "content": json.dumps({"c": 20})},
    ]
    req = ChatRequest(model="oss", messages=messages, tools=[TOOL], truncate=False)
    prompt = prepare_chat(req, record(), store, 4096).prompt
    assert "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools" in prompt
    assert ("<|start|>assistant<|channel|>analysis<|message|>Call it.<|end|>"
            "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
            '<|message|>{"city": "Paris"}<|call|>'
            '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>'
            '{"c": 20}<|end|><|start|>assistant') in prompt
    later = messages + [{"role": "assistant", "content": "20 C.", "thinking": "Answer."},
                        {"role": "user", "content": "Thanks"}]
    req = ChatRequest(model="oss", messages=later, tools=[TOOL], truncate=False)
    prompt = prepare_chat(req, record(), store, 4096).prompt
    assert "Call it." not in prompt and "Answer." not in prompt  # earlier turns' thinking
    assert "<|start|>assistant<|channel|>final<|message|>20 C.<|end|>" in prompt
