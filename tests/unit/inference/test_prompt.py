"""Prompt rendering: Hugging Face chat templates (checked against transformers) and the Go
template subset of Ollama Modelfiles; keep_alive durations."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mlxr.shared.config import parse_duration
from mlxr.shared.errors import InvalidRequest
from mlxr.supervisor.inference.go_template.render import GoTemplate
from mlxr.supervisor.inference.prompt import GoRenderer, JinjaRenderer, renderer_for, to_hf_message

QWEN3 = Path(__file__).resolve().parents[3] / "shared" / "assets" / "qwen3"  # the kit's copy

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
CALL = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CONVERSATIONS = {
    "plain": [{"role": "user", "content": "Hello"}],
    "system": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    "multi_turn": [{"role": "user", "content": "1+1?"},
                   {"role": "assistant", "content": "<think>\nadd\n</think>\n\n2"},
                   {"role": "user", "content": "and 2+2?"}],
    "tool_round_trip": [{"role": "system", "content": "S"},
                        {"role": "user", "content": "Weather in Paris?"},
                        {"role": "assistant", "content": "", "tool_calls": [CALL]},
                        {"role": "tool", "content": "sunny", "tool_name": "get_weather"}],
}


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("qwen3")
    shutil.copy(QWEN3 / "tokenizer_config.json", d)
    return d


def reference(messages, tools, think):
    from transformers.utils.chat_template_utils import render_jinja_template

    config = json.loads((QWEN3 / "tokenizer_config.json").read_text())
    kwargs = {} if think is None else {"enable_thinking": think}
    rendered, _ = render_jinja_template(
        conversations=[[to_hf_message(m) for m in messages]], tools=tools,
        chat_template=config["chat_template"], add_generation_prompt=True,
        eos_token=config["eos_token"], pad_token=config["pad_token"], **kwargs)
    return rendered[0]


@pytest.mark.parametrize("think", [None, True, False])
@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_qwen3_template_matches_transformers(qwen3_dir, name, tools, think):
    renderer = renderer_for(qwen3_dir, tools=bool(tools))
    assert isinstance(renderer, JinjaRenderer)
    messages = CONVERSATIONS[name]
    assert renderer.chat(messages, tools, think) == reference(messages, tools, think)


def test_qwen3_tools_and_tool_calls_appear_in_the_prompt(qwen3_dir):
    prompt = renderer_for(qwen3_dir).chat(CONVERSATIONS["tool_round_trip"], TOOLS, False)
    assert '"name": "get_weather"' in prompt and "<tools>" in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
        in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_renderer_choice(qwen3_dir, tmp_path):
    assert isinstance(renderer_for(qwen3_dir, "{{ .Prompt }}"), GoRenderer)
    assert isinstance(renderer_for(qwen3_dir, None, "{{ .Prompt }}!"), GoRenderer)
    plain = renderer_for(tmp_path)  # no chat template at all
    assert plain.chat([{"role": "user", "content": "hi"}]) == "hi"


def test_template_errors_are_400(qwen3_dir, tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{{ raise_exception('no system messages') }}"}))
    with pytest.raises(InvalidRequest, match="no system messages"):
        renderer_for(tmp_path).chat([{"role": "user", "content": "x"}])
    with pytest.raises(InvalidRequest):
        GoTemplate("{{ define \"x\" }}{{ end }}")
    with pytest.raises(InvalidRequest):
        GoTemplate("{{ if .System }}never closed")


LLAMA3 = ("{{ if .System }}<|start_header_id|>system<|end_header_id|>\n\n{{ .System }}"
          "<|eot_id|>{{ end }}{{ if .Prompt }}<|start_header_id|>user<|end_header_id|>\n\n"
          "{{ .Prompt }}<|eot_id|>{{ end }}<|start_header_id|>assistant<|end_header_id|>\n\n"
          "{{ .Response }}<|eot_id|>")


def test_legacy_template_renders_each_turn_and_stops_at_the_last_response():
    out = GoTemplate(LLAMA3).execute([
        {"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"}, {"role": "user", "content": "again"}])
    assert out == ("<|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
                   "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
                   "<|start_header_id|>assistant<|end_header_id|>\n\nyo<|eot_id|>"
                   "<|start_header_id|>user<|end_header_id|>\n\nagain<|eot_id|>"
                   "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_template_without_response_gets_one_appended():
    t = GoTemplate("[INST] {{ .Prompt }} [/INST]")
    assert t.execute([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                      {"role": "user", "content": "c"}]) == "[INST] a [/INST]b[INST] c [/INST]"


QWEN25 = """{{- if .Messages }}
{{- if or .System .Tools }}<|im_start|>system
{{- if .System }}
{{ .System }}
{{- end }}
{{- if .Tools }}
<tools>
{{- range .Tools }}
{"type": "function", "function": {{ .Function }}}
{{- end }}
</tools>
{{- end }}<|im_end|>
{{ end }}
{{- range $i, $_ := .Messages }}
{{- $last := eq (len (slice $.Messages $i)) 1 -}}
{{- if eq .Role "user" }}<|im_start|>user
{{ .Content }}<|im_end|>
{{ else if eq .Role "assistant" }}<|im_start|>assistant
{{ if .Content }}{{ .Content }}
{{- else if .ToolCalls }}<tool_call>
{{ range .ToolCalls }}{"name": "{{ .Function.Name }}", "arguments": {{ .Function.Arguments }}}
{{ end }}</tool_call>
{{- end }}{{ if not $last }}<|im_end|>
{{ end }}
{{- else if eq .Role "tool" }}<|im_start|>user
<tool_response>
{{ .Content }}
</tool_response><|im_end|>
{{ end }}
{{- if and (ne .Role "assistant") $last }}<|im_start|>assistant
{{ end }}
{{- end }}
{{- else }}
{{- if .System }}<|im_start|>system
{{ .System }}<|im_end|>
{{ end }}{{ if .Prompt }}<|im_start|>user
{{ .Prompt }}<|im_end|>
{{ end }}<|im_start|>assistant
{{ end }}{{ .Response }}{{ if .Response }}<|im_end|>{{ end }}"""


def test_messages_template_with_tools():
    out = GoTemplate(QWEN25).execute(CONVERSATIONS["tool_round_trip"], tools=TOOLS)
    assert out == (
        "<|im_start|>system\nS\n<tools>\n"
        '{"type": "function", "function": {"name":"get_weather","description":'
        '"Get the weather for a city","parameters":{"type":"object","properties":'
        '{"city":{"type":"string"}},"required":["city"]}}}\n</tools><|im_end|>\n'
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")


def test_consecutive_messages_of_one_role_are_merged():
    t = GoTemplate("{{ range .Messages }}[{{ .Role }}:{{ .Content }}]{{ end }}")
    assert t.execute([{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                      {"role": "tool", "content": "x"}, {"role": "tool", "content": "y"}]) == \
        "[user:a\n\nb][tool:x][tool:y]"


@pytest.mark.parametrize("source,data,expected", [
    ("a  {{- 1 -}}  b", {}, "a1b"),
    ("{{/* comment */}}x{{- /* trimmed */ -}} y", {}, "xy"),
    ('{{ if eq .N 1 }}one{{ else if eq .N 2 }}two{{ else }}many{{ end }}', {"N": 2}, "two"),
    ('{{ if eq .N 1 }}one{{ else if eq .N 2 }}two{{ else }}many{{ end }}', {"N": 5}, "many"),
    ("{{ range $i, $x := .L }}{{ $i }}={{ $x }};{{ else }}empty{{ end }}", {"L": ["a", "b"]},
     "0=a;1=b;"),
    ("{{ range .L }}{{ . }}{{ else }}empty{{ end }}", {"L": []}, "empty"),
    ("{{ range .L }}{{ if eq . 2 }}{{ break }}{{ end }}{{ . }}{{ end }}", {"L": [1, 2, 3]}, "1"),
    ("{{ with .M }}{{ .k }}{{ end }}", {"M": {"k": "v"}}, "v"),
    ("{{ $x := 1 }}{{ if true }}{{ $x = 2 }}{{ end }}{{ $x }}", {}, "2"),
    ('{{ printf "%s=%d %q" "a" 3 "b" }}', {}, 'a=3 "b"'),
    ("{{ json .V }}", {"V": {"t": "<b>&"}}, '{"t":"\\u003cb\\u003e\\u0026"}'),
    ("{{ index .L 1 }} {{ len .L }} {{ slice .L 1 }}", {"L": ["x", "y", "z"]}, "y 3 [y z]"),
    ("{{ or .A .B }}|{{ and .A .B }}|{{ not .A }}", {"A": "", "B": "b"}, "b||true"),
    ('{{ "a" | print }}{{ .S | len }}', {"S": "abc"}, "a3"),
    ("{{ .Missing }}.", {}, "."),
    ("{{ .Obj.ToolName }}", {"Obj": {"tool_name": "snake"}}, "snake"),
])
def test_go_template_subset(source, data, expected):
    assert GoTemplate(source).render(data) == expected


def test_suffix_templates():
    t = GoRenderer("<PRE> {{ .Prompt }} <SUF>{{ .Suffix }} <MID>")
    assert t.supports_insert
    assert t.insert("def f():", "return x") == "<PRE> def f(): <SUF>return x <MID>"
    assert not GoRenderer("{{ .Prompt }}").supports_insert


@pytest.mark.parametrize("value,seconds", [
    (0, 0.0), (30, 30.0), (2.5, 2.5), ("0", 0.0), ("10", 10.0), ("5m", 300.0),
    ("1h30m", 5400.0), ("500ms", 0.5), ("-1", -1.0), (-5, -1.0), ("-1m", -1.0)])
def test_keep_alive_durations(value, seconds):
    assert parse_duration(value) == seconds


@pytest.mark.parametrize("value", ["forever", "5 minutes", "", True, None, [1]])
def test_bad_durations_are_400(value):
    with pytest.raises(InvalidRequest):
        parse_duration(value)
