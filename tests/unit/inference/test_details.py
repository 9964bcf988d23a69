"""Ollama's details in the inference layer, without processes: option types, truncation,
think values in templates, continuing a final assistant message."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxr.shared.errors import InvalidRequest
from mlxr.supervisor.inference.options import check_options
from mlxr.supervisor.inference.prepare import resolve_think
from mlxr.supervisor.inference.prompt import GoRenderer, JinjaRenderer
from mlxr.supervisor.inference.truncate import Fits, fit_messages


def test_integer_options_are_truncated_and_types_checked():
    assert check_options({"num_predict": 2.9, "num_ctx": -1.5, "top_p": 1}) == {
        "num_predict": 2, "num_ctx": -1, "top_p": 1}
    for options, message in (({"num_keep": True}, 'option "num_keep" must be of type integer'),
                             ({"typical_p": "x"}, 'option "typical_p" must be of type float32'),
                             ({"use_mmap": 0}, 'option "use_mmap" must be of type boolean'),
                             ({"stop": 3}, 'option "stop" must be of type array')):
        with pytest.raises(InvalidRequest, match=message):
            check_options(options)
    assert check_options({"unknown": object}) == {"unknown": object}


def test_think_levels_stay_levels():
    caps = ["completion", "thinking"]
    assert resolve_think("m", caps, None) is True
    assert resolve_think("m", caps, "low") == "low"
    assert resolve_think("m", ["completion"], False) is False
    with pytest.raises(InvalidRequest, match="does not support thinking"):
        resolve_think("m", ["completion"], "high")


def test_jinja_gets_enable_thinking_and_reasoning_effort():
    r = JinjaRenderer("{{ enable_thinking }}/{{ reasoning_effort | default('unset') }}", {})
    assert r.chat([{"role": "user", "content": "x"}], None, "high") == "True/high"
    assert r.chat([{"role": "user", "content": "x"}], None, True) == "True/unset"
    assert r.chat([{"role": "user", "content": "x"}], None, False) == "False/unset"


def test_a_final_assistant_message_is_continued():
    jinja = JinjaRenderer("{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}"
                          "{% if add_generation_prompt %}<assistant>{% endif %}", {})
    chat = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}]
    assert jinja.chat(chat) == "<user>Count</s><assistant>1, 2,"
    legacy = GoRenderer("U:{{ .Prompt }} A:{{ .Response }}</s>")
    assert legacy.chat(chat) == "U:Count A:1, 2,"
    assert legacy.chat(chat[:1]) == "U:Count A:"


def test_truncation_keeps_system_messages_and_the_last_user_turn(tmp_path: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    render = lambda msgs: " ".join(m["content"] for m in msgs)  # noqa: E731
    chat = [{"role": "system", "content": "sys"}]
    for i in range(5):
        chat += [{"role": "user", "content": f"u{i} " * 5}, {"role": "assistant", "content": "a " * 5}]
    kept = fit_messages(chat, render, 20, tmp_path, False)
    assert kept[0] == chat[0] and kept[-1] == chat[-1]
    assert len(render(kept).split()) < 20 < len(render(chat).split())
    assert fit_messages(chat, render, 1000, tmp_path, False) == chat
    tiny = fit_messages(chat, render, 2, tmp_path, False)  # too long even so: the last turn stays
    assert tiny == [chat[0], chat[-2], chat[-1]]
    for num_ctx in range(3, 40):  # the fewest oldest messages dropped, as one at a time would
        kept = fit_messages(chat, render, num_ctx, tmp_path, False)
        fewest = next((chat[:1] + chat[start:] for start in range(1, len(chat) - 1)
                       if len(render(chat[:1] + chat[start:]).split()) < num_ctx), tiny)
        assert kept == fewest, num_ctx


def test_a_prompt_of_fewer_bytes_than_num_ctx_is_not_encoded():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # one token a character
    fits = Fits(tok, False, 20)
    assert fits("a" * 11) and fits.encoded == 0  # 11 bytes + 8 slack < 20: no encoding
    assert fits("a" * 19) and fits.encoded == 1  # past the bound: encoded, and 19 < 20
    assert not fits("a" * 20) and fits.encoded == 2
    # The bound is on the normalized text's bytes, so a normalizer that lengthens the text
    # cannot slip a long prompt past it: NFKC makes the 3-byte U+FDFA 18 characters.
    tok.normalizer = normalizers.NFKC()
    assert len(tok.encode("\ufdfa").ids) == 18
    assert not Fits(tok, False, 15)("\ufdfa")
