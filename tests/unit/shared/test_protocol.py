"""The completion request's and chunk's wire fields for the prompt's ids."""

from __future__ import annotations

import pytest

from mlxr.shared.errors import InvalidRequest
from mlxr.shared.protocol import Chunk, CompletionRequest


def test_add_special_and_return_prompt_tokens_round_trip_and_default_off():
    req = CompletionRequest(prompt="hi", tokens=[1, 2], add_special=False,
                            return_prompt_tokens=True)
    wire = req.to_dict()
    assert (wire["add_special"], wire["return_prompt_tokens"]) == (False, True)
    assert CompletionRequest.from_dict(wire) == req
    plain = CompletionRequest(prompt="hi").to_dict()
    assert "add_special" not in plain and "return_prompt_tokens" not in plain
    back = CompletionRequest.from_dict(plain)
    assert (back.add_special, back.return_prompt_tokens) == (None, False)
    with pytest.raises(InvalidRequest, match="add_special must be a boolean"):
        CompletionRequest.from_dict({"prompt": "hi", "add_special": "yes"})


def test_prompt_tokens_go_on_a_final_chunk_only():
    final = Chunk(done=True, done_reason="stop", prompt_tokens=[5, 6])
    assert final.to_dict()["prompt_tokens"] == [5, 6]
    assert Chunk.from_dict(final.to_dict()).prompt_tokens == [5, 6]
    assert "prompt_tokens" not in Chunk(done=True, done_reason="stop").to_dict()
    assert "prompt_tokens" not in Chunk(content="x", prompt_tokens=[5]).to_dict()
    assert Chunk.from_dict({"content": "x", "done": False, "tokens": [1]}).prompt_tokens is None
