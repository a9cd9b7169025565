"""Self-check quizzes: every answer key is right, every wrong answer is refused with the explanation."""
from __future__ import annotations

import pytest

from lab_utils import quiz

ALL = [(lab, q) for lab, qs in quiz.QUESTIONS.items() for q in qs]


def _wrong(q: quiz.Question):
    if q.kind == "choice":
        return next(ltr for ltr in q.letters() if ltr != q.answer)
    return float(q.answer) * 2 + 1


def test_every_lab_of_the_syllabus_has_a_quiz():
    assert sorted(quiz.QUESTIONS) == [f"{i:02d}" for i in range(17)]
    for lab, qs in quiz.QUESTIONS.items():
        assert len(qs) >= 3, f"lab {lab} needs at least 3 questions"
        assert len({q.qid for q in qs}) == len(qs), f"lab {lab} repeats a question id"


@pytest.mark.parametrize("lab, q", ALL, ids=[f"{lab}-{q.qid}" for lab, q in ALL])
def test_answer_key(lab, q):
    if q.kind == "choice":
        assert q.answer in q.letters() and len(q.options) >= 3
    right = quiz.ask(lab, q.qid, q.answer)
    assert right.correct and bool(right) and q.explanation in str(right)
    wrong = quiz.ask(lab, q.qid, _wrong(q))
    assert not wrong.correct and not bool(wrong)
    assert wrong.explanation == q.explanation and q.explanation in str(wrong)
    assert "Not quite" in wrong.message


def test_numeric_tolerance_and_formats():
    assert quiz.ask("00", "kv_bytes", "23,040")  # learners type thousands separators
    assert quiz.ask("07", "expected_tokens", 3.36)  # within 1%
    assert not quiz.ask("07", "expected_tokens", 3.0)
    bad = quiz.ask("00", "kv_bytes", "lots")
    assert not bad and "Answer with a number" in bad.message


def test_choice_accepts_letter_case_parens_and_option_text():
    q = quiz.get("00", "ttft")
    right_text = q.options[q.letters().index(q.answer)]
    assert right_text == "TTFT"
    assert quiz.ask(0, "ttft", q.answer.upper()) and quiz.ask("00_foundations", "ttft", f"({q.answer})")
    assert quiz.ask("00", "ttft", "ttft")  # the option's text, any case
    bad = quiz.ask("00", "ttft", "z")
    assert not bad and "one of the letters" in bad.message and bad.explanation == q.explanation


def test_unknown_lab_or_question_is_a_clear_error():
    with pytest.raises(ValueError, match="no quiz for lab"):
        quiz.questions("42")
    with pytest.raises(ValueError, match="its questions: kv_bytes"):
        quiz.ask("00", "nope", 1)


def test_plain_text_when_not_interactive(capsys):
    quiz.show("02", interactive=False)
    out = capsys.readouterr().out
    q = quiz.get("02", "out_of_blocks")
    assert "quiz.ask('02'" in out and "[blocks_needed]" in out and f"({q.answer}) Preempts a sequence" in out


def test_widgets_grade_on_click():
    panel = quiz.widget("01")
    assert len(panel.children) == len(quiz.questions("01"))
    numeric = panel.children[0]  # static_util
    _prompt, inp, button, feedback = numeric.children
    inp.value = "0.4"
    button.click()
    assert "Correct" in feedback.value and "400 slot-steps" in feedback.value
    choice = panel.children[1]
    _prompt, radio, button, feedback = choice.children
    button.click()
    assert "Pick or type" in feedback.value
    q = quiz.questions("01")[1]
    radio.value = next(ltr for ltr in q.letters() if ltr != q.answer)
    button.click()
    assert "Not quite" in feedback.value and "Iteration-level" in feedback.value
    radio.value = q.answer
    button.click()
    assert "Correct" in feedback.value
