"""The thinking budget's choice of forced tokens (host logic, no MLX)."""

import pytest

from mlxr.runner.think_budget import ThinkBudget
from mlxr.shared.errors import InvalidRequest
from mlxr.shared.protocol import CompletionRequest

PROMPT = [1, 2, 3]
TAG = [90, 91]


def test_the_tag_is_forced_once_the_budget_is_spent_then_choices_are_free():
    budget = ThinkBudget(3, TAG, len(PROMPT))
    out = []
    for token in (10, 11, 12):
        assert budget.next_forced(PROMPT + out) is None
        out.append(token)
    assert budget.next_forced(PROMPT + out) == 90
    out.append(90)
    assert budget.next_forced(PROMPT + out) == 91
    out.append(91)
    assert [budget.next_forced(PROMPT + out + [5] * i) for i in range(3)] == [None] * 3


def test_a_model_that_ends_its_thinking_in_time_is_never_forced():
    budget = ThinkBudget(4, TAG, len(PROMPT))
    out = [10, 90, 91]
    assert budget.next_forced(PROMPT + out) is None
    assert budget.next_forced(PROMPT + out + [7, 8, 9]) is None  # past the budget, answered


def test_the_tag_in_the_prompt_does_not_count():
    budget = ThinkBudget(1, TAG, 2)
    assert budget.next_forced([90, 91, 10]) == 90


OPEN = 89


def test_output_that_opens_its_thinking_is_forced_at_the_budget():
    budget = ThinkBudget(3, TAG, len(PROMPT), opening=OPEN)
    out = [OPEN, 10, 11]
    assert [budget.next_forced(PROMPT + out[:i]) for i in range(3)] == [None] * 3
    assert budget.next_forced(PROMPT + out) == 90


def test_output_that_does_not_open_its_thinking_is_never_forced():
    budget = ThinkBudget(2, TAG, len(PROMPT), opening=OPEN)
    out = [10, 11, 12, 13]  # an answer straight away: no thinking to end
    assert [budget.next_forced(PROMPT + out[:i]) for i in range(5)] == [None] * 5


def test_the_opening_tag_goes_on_the_wire_with_a_budget_or_a_format():
    for extra in ({"think_budget": 8, "think_end": "</think>"},
                  {"format": "json", "format_after": "</think>"}):
        req = CompletionRequest.from_dict({"prompt": "x", "think_open": "<think>", **extra})
        assert CompletionRequest.from_dict(req.to_dict()).think_open == "<think>"
    alone = CompletionRequest.from_dict({"prompt": "x", "think_open": "<think>"})
    assert alone.think_open is None and "think_open" not in alone.to_dict()
    with pytest.raises(InvalidRequest):
        CompletionRequest.from_dict({"prompt": "x", "think_open": 5, "format": "json",
                                     "format_after": "</think>"})


def test_the_wire_carries_both_fields_or_neither():
    req = CompletionRequest.from_dict({"prompt": "x", "think_budget": 8, "think_end": "</think>"})
    assert CompletionRequest.from_dict(req.to_dict()).think_budget == 8
    assert "think_budget" not in CompletionRequest.from_dict({"prompt": "x"}).to_dict()
    for bad in ({"think_budget": 8}, {"think_end": "</think>"},
                {"think_budget": -1, "think_end": "x"}, {"think_budget": 2, "think_end": ""}):
        with pytest.raises(InvalidRequest):
            CompletionRequest.from_dict({"prompt": "x", **bad})
