"""Lesson 01's tasks (01.stable_softmax, 01.attention, 01.additive_attention): fair to other correct solutions.

``test_grading_catalogue.py`` proves, for every task, that each catalogued bug is rejected (by two
cases, or it says why only one can) and that the judges survive the batch grader's round trip.
These tests prove the other side: correct code written differently from the reference still
scores full marks, building blocks stay allowed while the task's own concept does not, and odd
return values fail with a message.
"""

from __future__ import annotations

import math

import pytest
import torch

import attn_course as ac
from attn_course.grading import TASKS, grade_function

OURS = [task_id for task_id in TASKS if task_id.startswith("01.")]


def _softmax_where(x):
    m = x.amax(-1, keepdim=True)
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    e = (x - m).exp()
    s = e.sum(-1, keepdim=True)
    return torch.where(s > 0, e / s, torch.zeros_like(e))


def _softmax_logsumexp(x):
    # torch.logsumexp is a building block, not a softmax: allowed.
    return torch.nan_to_num(torch.exp(x - torch.logsumexp(x, -1, keepdim=True)))


def _attention_einsum(q, k, v):
    scores = torch.einsum("...ld,...sd->...ls", q, k) * q.shape[-1] ** -0.5  # (..., L, S)
    return torch.einsum("...ls,...sd->...ld", torch.softmax(scores, -1), v)  # (..., L, Dv)


def _attention_logsumexp(q, k, v):
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5  # (..., L, S)
    return torch.exp(scores - scores.logsumexp(dim=-1, keepdim=True)) @ v  # (..., L, Dv)


def _additive_einsum(q, k, v, w_q, w_k, w):
    qa = torch.einsum("...ld,ad->...la", q, w_q)  # (..., L, A)
    ka = torch.einsum("...sd,ad->...sa", k, w_k)  # (..., S, A)
    scores = torch.einsum("...lsa,a->...ls", torch.tanh(qa[..., :, None, :] + ka[..., None, :, :]), w)  # (..., L, S)
    return torch.softmax(scores, dim=-1) @ v  # (..., L, Dv)


def _additive_loop_over_queries(q, k, v, w_q, w_k, w):
    """One query at a time: (..., S, A) per step instead of (..., L, S, A)."""
    ka = k @ w_k.T  # (..., S, A)
    rows = []
    for i in range(q.shape[-2]):
        qi = q[..., i : i + 1, :] @ w_q.T  # (..., 1, A)
        scores = torch.tanh(qi + ka) @ w  # (..., S)
        rows.append(torch.softmax(scores, dim=-1).unsqueeze(-2) @ v)  # (..., 1, Dv)
    return torch.cat(rows, dim=-2)  # (..., L, Dv)


ALTERNATIVES = {
    "01.stable_softmax": [_softmax_where, _softmax_logsumexp],
    "01.attention": [_attention_einsum, _attention_logsumexp],
    "01.additive_attention": [_additive_einsum, _additive_loop_over_queries],
}
ALTERNATIVE_CASES = [(task_id, i) for task_id, fns in ALTERNATIVES.items() for i in range(len(fns))]


def test_every_task_of_lesson_01_has_alternatives():
    assert set(ALTERNATIVES) == set(OURS)


@pytest.mark.parametrize("task_id,index", ALTERNATIVE_CASES, ids=[f"{t}:{i}" for t, i in ALTERNATIVE_CASES])
def test_other_correct_solutions_score_full_marks(task_id, index):
    result = grade_function(TASKS[task_id], ALTERNATIVES[task_id][index])
    assert result.score == result.max_score, result.report()


def test_a_function_returning_garbage_fails_with_a_message():
    for task_id in OURS:
        result = grade_function(TASKS[task_id], lambda *args: "not a tensor")
        assert result.score == 0
        assert "should return a torch.Tensor" in result.feedback


def test_any_route_to_a_softmax_gives_stable_softmax_zero():
    routes = {
        "torch.softmax": lambda x: torch.nan_to_num(torch.softmax(x, -1)),
        "the Tensor method": lambda x: torch.nan_to_num(x.softmax(-1)),
        "nn.Softmax": lambda x: torch.nan_to_num(torch.nn.Softmax(dim=-1)(x)),
        "torch.special.softmax": lambda x: torch.nan_to_num(torch.special.softmax(x, -1)),
    }
    for name, fn in routes.items():
        result = grade_function(TASKS["01.stable_softmax"], fn)
        assert result.score == 0, name
        assert "you called" in result.feedback and "softmax" in result.feedback, (name, result.feedback)


def test_attention_may_use_torch_softmax_and_its_own_softmax():
    """A softmax is a building block of attention: only attention implementations are off limits."""
    def attention(q, k, v):
        return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v

    result = grade_function(TASKS["01.attention"], attention)
    assert result.score == result.max_score, result.report()


def test_additive_attention_is_a_stretch_task_and_says_so():
    task = TASKS["01.additive_attention"]
    assert task.stretch and not TASKS["01.attention"].stretch
    assert "stretch" in grade_function(task, task.reference).report()


def test_additive_hint_explains_why_the_tanh_matters():
    """Without the tanh, every query gets the same weights: the hint says why, the values prove it."""
    task = TASKS["01.additive_attention"]
    fn = task.wrong["no tanh"].fn
    q, k, v, w_q, w_k, w = task.make_cases()[0].args
    weights_per_query = torch.softmax(((q @ w_q.T).unsqueeze(-2) + (k @ w_k.T).unsqueeze(-3)) @ w, dim=-1)  # (B, L, S)
    torch.testing.assert_close(weights_per_query, weights_per_query[:, :1].expand_as(weights_per_query))
    outputs = fn(q, k, v, w_q, w_k, w)  # (B, L, Dv): one row repeated
    torch.testing.assert_close(outputs, outputs[:, :1].expand_as(outputs))
    assert "same weights" in grade_function(task, fn).feedback


def _identity(x):
    return torch.eye(x.shape[-1], dtype=x.dtype)  # (S, S): values that turn attention weights into outputs


def _pos(n):
    return torch.arange(n)


# Each route computes the right values (or nearly): only the no-delegation rule can reject it.
LIBRARY_ROUTES = {
    "01.attention": {
        "ac.chunked_attention": lambda q, k, v: ac.chunked_attention(q, k, v),
        "ac.chunked_attention, small chunks": lambda q, k, v: ac.chunked_attention(q, k, v, query_chunk_size=2,
                                                                                   key_chunk_size=2),
        "ac.query_chunked_attention": lambda q, k, v: ac.query_chunked_attention(q, k, v),
        "ac.partial_attention + finish_partial": lambda q, k, v: ac.finish_partial(
            ac.partial_attention(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), v)),
        "ac.sparse_attention, one block": lambda q, k, v: ac.sparse_attention(q, k, v, pattern="block",
                                                                              size=max(q.shape[-2], k.shape[-2])),
        "ac.grouped_attention": lambda q, k, v: ac.grouped_attention(q, k, v),
        "ac.ring_step": lambda q, k, v: ac.finish_partial(ac.ring_step(None, q, k, v, q_positions=_pos(q.shape[-2]),
                                                                       k_positions=_pos(k.shape[-2]))),
    },
    "01.stable_softmax": {
        "ac.partial_attention, identity values": lambda x: ac.finish_partial(ac.partial_attention(x, _identity(x))),
        "ac.chunked_attention, identity values": lambda x: ac.chunked_attention(x, _identity(x), _identity(x), scale=1.0),
        "F.scaled_dot_product_attention, identity values": lambda x: torch.nan_to_num(
            torch.nn.functional.scaled_dot_product_attention(x, _identity(x), _identity(x), scale=1.0)),
    },
}
ROUTES = [(task_id, name) for task_id, routes in LIBRARY_ROUTES.items() for name in routes]


@pytest.mark.parametrize("task_id,name", ROUTES, ids=[f"{t}:{n}" for t, n in ROUTES])
def test_every_attention_of_the_library_is_off_limits(task_id, name):
    """Review of lessons 00-03: ac.chunked_attention and partial_attention + finish_partial scored 5/5 on 01.attention."""
    result = grade_function(TASKS[task_id], LIBRARY_ROUTES[task_id][name])
    assert result.score == 0, result.report()
    assert "you called attn_course." in result.feedback or "you called torch." in result.feedback, result.report()


def test_the_empty_row_hint_teaches_without_writing_the_code():
    """The hint names the idea (shift by 0, no 0 / 0), not the lines that, pasted together, are the answer."""
    result = grade_function(TASKS["01.stable_softmax"], TASKS["01.stable_softmax"].wrong["NaN on an all -inf row"].fn)
    assert "shift" in result.feedback.lower() and "0 / 0" in result.feedback
    for code in ("torch.where", "isfinite", "clamp_min", "tiny"):
        assert code not in result.feedback, code


def test_a_value_mismatch_says_how_far_how_much_is_allowed_and_that_it_looks_like_float32():
    """Issue 20: "at index (1, 3, 0) you return 1.16967, expected 1.16967" could not guide a fix."""
    import torch

    from attn_course.grading import TASKS, grade_function

    def attention_in_float32(q, k, v):
        q32, k32, v32 = q.float(), k.float(), v.float()
        weights = torch.softmax(q32 @ k32.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1)  # (..., L, S)
        return (weights @ v32).to(q.dtype)

    feedback = grade_function(TASKS["01.attention"], attention_in_float32).feedback
    assert "Largest error" in feedback and "absolute" in feedback and "relative" in feedback
    assert "allowed: |yours - expected| <= 1e-09 + 1e-07 * |expected|" in feedback
    assert "float32 rounding" in feedback
    import re

    index, row = re.search(r"at index \(([\d, ]+)\) \(row \(([\d, ]+)\)", feedback).groups()
    assert index.split(", ")[:-1] == row.split(", ")  # the row is the index's own


def test_a_float64_answer_off_by_an_eps_is_not_told_it_ran_in_float32():
    """Every step in float64, one eps added: as small an error as float32's, but the hint must not say float32 did it."""
    import torch

    from attn_course.grading import TASKS, grade_function

    def attention_with_an_eps(q, k, v):
        weights = torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1)  # (..., L, S)
        return weights @ v / (1 + 1e-6)

    feedback = grade_function(TASKS["01.attention"], attention_with_an_eps).feedback
    assert "Largest error" in feedback
    assert "float32 rounding" not in feedback and "every value you return is a float32 number" not in feedback
    assert "a small constant (an eps) added or left out" in feedback


def test_nan_entries_are_counted_not_left_out_of_the_error():
    """A learner saw "Largest error 4.44e-16 absolute" for an answer whose empty rows were NaN."""
    import pytest
    import torch

    from attn_course.grading.core import Fail
    from attn_course.grading.judging import expect_close

    expected = torch.zeros(3, 4, dtype=torch.float64)
    got = expected.clone()
    got[1] = float("nan")  # one row of 4 NaN where zeros are expected
    got[0, 0] = 4e-16
    with pytest.raises(Fail) as failed:
        expect_close(got, expected, what="output", atol=1e-12, rtol=1e-12)
    message = str(failed.value)
    assert "4 entries are NaN or infinite where the expected value is finite" in message, message
    assert "you return nan" in message
    with pytest.raises(Fail) as failed:
        expect_close(torch.full_like(expected, float("inf")), expected, what="output")
    assert "Every entry is non-finite" in str(failed.value)
