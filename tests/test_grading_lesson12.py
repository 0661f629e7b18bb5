"""Lesson 12's tasks: the stretch task, no delegation, and a ring step graded on the size of what it builds.

``test_grading_catalogue.py`` proves, for every task, that each catalogued bug is rejected (by two
cases, or says why one), that its kind is what it says, and that the other correct solutions in
``Task.accepted`` score full marks. These tests pin what is particular to lesson 12: what each task
forbids (its own concept, not lesson 07's building blocks), the largest tensors the form check sees,
and the feedback the lesson shows for its wrong attempt.
"""

from __future__ import annotations

import torch

import attn_course as ac
from attn_course.grading import TASKS, grade_function, run_cases
from attn_course.grading.probes import _import_dotted

OURS = sorted(task_id for task_id in TASKS if task_id.startswith("12."))


def test_lesson_12_has_two_tasks_and_a_stretch_task():
    assert OURS == ["12.ring_step", "12.ring_step_backward", "12.zigzag_positions"]
    assert [TASKS[t].stretch for t in OURS] == [False, True, False]


def test_each_task_forbids_its_own_concept_and_none_of_lesson_07s_building_blocks():
    forbidden = {t: {_import_dotted(name) for name in TASKS[t].forbidden} for t in OURS}
    assert forbidden == {
        "12.zigzag_positions": {ac.sequence_positions},
        "12.ring_step": {ac.ring_step, ac.ring_attention},
        "12.ring_step_backward": {ac.ring_step_backward},
    }
    for task_id in OURS:  # every reference is written out, on lesson 07's partial_attention / merge_partials
        outcomes = run_cases(TASKS[task_id].reference, TASKS[task_id].make_cases(), forbidden=TASKS[task_id].forbidden)
        assert all(outcome.probe["forbidden_calls"] == [] for outcome in outcomes), task_id


def test_a_call_into_the_library_by_any_route_scores_zero():
    from attn_course.distributed.layout import shard_sequence
    from attn_course.distributed.ring import ring_step as imported

    def by_import(running, q, k, v, q_positions, k_positions, key_padding_mask=None, is_causal=False):
        return tuple(imported(running, q, k, v, q_positions=q_positions, k_positions=k_positions,
                              key_padding_mask=key_padding_mask, is_causal=is_causal))

    def by_sharding(seq_len, world_size):  # shard_sequence calls sequence_positions
        return [shard_sequence(torch.arange(seq_len), r, world_size, dim=0) for r in range(world_size)]

    for task_id, fn, name in (("12.ring_step", by_import, "attn_course.ring_step"),
                              ("12.zigzag_positions", by_sharding, "attn_course.sequence_positions")):
        result = grade_function(TASKS[task_id], fn)
        assert result.score == 0 and f"you called {name}" in result.feedback, result.report()


def test_the_form_check_sees_the_block_the_whole_sequence_mask_and_the_broadcast_product():
    """On the 4-rank cases (L = 64, B = H = 2, 16 queries and keys, D = 8) the limit is the block's scores."""
    task = TASKS["12.ring_step"]
    cases = task.make_cases()
    wide = [i for i, case in enumerate(cases) if case.name.startswith("4 ranks")]
    assert len(wide) == 2
    largest = {}
    for name, fn in (("reference", task.reference),
                     ("whole mask", task.wrong["causal mask cut out of an (L, L) mask of the whole sequence"].fn),
                     ("broadcast", task.wrong["scores as a broadcast (Lq, Lk, D) product"].fn),
                     *(("accepted", fn) for fn in task.accepted.values())):
        outcomes = run_cases(fn, [cases[i] for i in wide], measure=task.measure)
        largest.setdefault(name, set()).update((o.probe["largest_numel"], o.probe["largest_shape"]) for o in outcomes)
    block = 2 * 2 * 16 * 16  # (B, H, Lq, Lk)
    assert {numel for numel, _ in largest["reference"] | largest["accepted"]} == {block}  # (B, H, Lq, Lk) or (B H, Lq, Lk)
    assert largest["whole mask"] == {(64 * 64, "64 x 64")}  # 4 times the block
    assert largest["broadcast"] == {(block * 8, "2 x 2 x 16 x 16 x 8")}  # D times the block


def test_the_wrong_attempt_the_lesson_shows_gets_its_hint():
    def zigzag_positions_first_attempt(seq_len, world_size):
        per_rank = seq_len // world_size
        return [torch.arange(r * per_rank, (r + 1) * per_rank) for r in range(world_size)]

    result = grade_function(TASKS["12.zigzag_positions"], zigzag_positions_first_attempt)
    assert 0 < result.score < result.max_score
    assert "This is the contiguous split" in result.feedback and "returned instead of raising" in result.feedback


def test_merge_partials_takes_any_acc_row_max_row_sum_tuple():
    """Issue 20: `ac.merge_partials` on the `running` the grader passed raised "'tuple' object has no attribute"."""
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 3, 4, 5, generator=g, dtype=torch.float64)  # (B, H, L, S)
    v = torch.randn(2, 3, 5, 6, generator=g, dtype=torch.float64)  # (B, H, S, Dv)
    first = ac.partial_attention(scores[..., :2], v[..., :2, :])
    second = ac.partial_attention(scores[..., 2:], v[..., 2:, :])
    expected = ac.merge_partials(first, second)
    for a, b in ((tuple(first), tuple(second)), (list(first), second), (first, tuple(second))):
        merged = ac.merge_partials(a, b)
        assert isinstance(merged, ac.PartialAttention)
        assert all(torch.equal(x, y) for x, y in zip(merged, expected))
    try:
        ac.merge_partials(first, (second.acc, second.row_max))
    except TypeError as error:
        assert "(acc, row_max, row_sum)" in str(error) and "length 2" in str(error)
    else:
        raise AssertionError("a 2-tuple must raise TypeError")


def test_ring_step_gets_running_as_a_partial_attention_and_lesson_07s_helpers_score_full_marks():
    task = TASKS["12.ring_step"]
    runnings = [case.args[0] for case in task.make_cases() if case.args[0] is not None]
    assert runnings and all(isinstance(r, ac.PartialAttention) for r in runnings)

    def with_helpers_on_a_plain_tuple(running, q, k, v, q_positions, k_positions, key_padding_mask=None,
                                      is_causal=False):
        scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5  # (B, H, Lq, Lk)
        allowed = torch.ones(scores.shape[-2:], dtype=torch.bool)
        if is_causal:
            allowed = k_positions[None, :] <= q_positions[:, None]
        if key_padding_mask is not None:
            allowed = allowed & key_padding_mask[:, None, None, :]
        block = ac.partial_attention(scores.masked_fill(~allowed, float("-inf")), v)
        return tuple(block) if running is None else tuple(ac.merge_partials(tuple(running), block))

    result = grade_function(task, with_helpers_on_a_plain_tuple)
    assert result.score == result.max_score, result.report()
