"""Math answer checking on known-good and known-bad replies (what a scripted agent would say)."""

from __future__ import annotations

from fractions import Fraction

import pytest

from workflows.math.reward import check, extract_answer, is_formatted, parse_number

GOOD = [
    ("7 + 5 = 12\nAnswer: 12", "12", True),
    ("**Answer:** 12", "12", True),
    ("Answer: 12.", "12", True),
    ("The answer is 12.", "12", False),
    ("We add them and get 12", "12", False),
    ("Answer: 1,200", "1200", True),
    ("so the total is \\boxed{12}", "12", False),
    ("Answer: -3", "-3", True),
    ("Answer: 0.5", "1/2", True),
    ("First 3, then 9. The answer is 12 apples.", "12", False),
    ("Answer: 7\nWait, the answer is 12", "12", False),
]
BAD = [
    ("7 + 5 = 12\nAnswer: 13", "12", True),
    ("The answer is 12, no wait 11 \n Answer: 11", "12", True),
    ("12 is close but the total is 14", "12", False),
    ("I do not know.", "12", False),
    ("", "12", False),
    ("Answer: 13\nThen 3 more makes 12", "12", False),
]


@pytest.mark.parametrize(("reply", "gold", "formatted"), GOOD)
def test_right_answers_score_in_any_format(reply: str, gold: str, formatted: bool) -> None:
    result = check(reply, gold)
    assert result.correct is True
    assert result.formatted is formatted
    assert result.reward(0.0) == 1.0
    assert result.reward(0.1) == pytest.approx(0.9 + 0.1 * formatted)


@pytest.mark.parametrize(("reply", "gold", "formatted"), BAD)
def test_wrong_answers_score_only_their_format(reply: str, gold: str, formatted: bool) -> None:
    result = check(reply, gold)
    assert result.correct is False
    assert result.formatted is formatted
    assert result.reward(0.0) == 0.0
    assert result.reward(0.25) == pytest.approx(0.25 * formatted)


def test_the_explicit_answer_beats_later_numbers() -> None:
    assert extract_answer("Answer: 12\nThen 3 more makes 15") == "12"
    assert extract_answer("the answer is 12. Check: 5 + 7") == "12"
    assert extract_answer("the answer is the sum, 12. Check: 5 + 7") == "7"  # no number after "is": last number
    assert extract_answer("no numbers here") is None


def test_format_needs_the_last_line() -> None:
    assert is_formatted("work\n\nAnswer: 4\n\n") is True
    assert is_formatted("Answer: 4 apples") is False
    assert is_formatted("Answer: 4\nDone.") is False


def test_numbers_compare_exactly() -> None:
    assert parse_number("$1,234.50") == Fraction(246900, 200)
    assert parse_number("3/4") == Fraction(3, 4)
    assert parse_number("7.") == 7
    assert parse_number("seven") is None
    assert parse_number("1/0") is None


def test_format_weight_must_be_a_fraction() -> None:
    with pytest.raises(ValueError, match="format_weight"):
        check("Answer: 1", "1").reward(1.5)


@pytest.mark.agents
def test_symbolic_answers_go_to_math_verify() -> None:
    assert check("so \\boxed{\\frac{1}{2}}", "0.5").correct is True
    assert check("Answer: 2", "\\frac{4}{2}").correct is True
    assert check("so \\boxed{\\frac{1}{3}}", "0.5").correct is False
