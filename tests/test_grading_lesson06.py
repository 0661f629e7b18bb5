"""The lesson 06 tasks: fair to other correct solutions, strict about the algorithm.

``test_grading_catalogue.py`` proves, for every task, that each catalogued bug is rejected (by two
cases, or says why only one can), that the judges survive the batch grader's round trip, and that
``Task.accepted`` scores full marks. These tests add the other side for lesson 06: correct code
written differently from the reference scores full marks, and the probes' limits sit where the
task modules say (honest forms at most a quarter of the largest-tensor limit, the forms each
check exists to reject at or above it).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attn_course.grading import TASKS, grade_function, run_cases
from attn_course.grading.tasks import lesson06

OURS = [task_id for task_id in TASKS if task_id.startswith("06.")]


# --- other correct solutions ---------------------------------------------------------------


def _linear_einsum(q, k, v, mask):
    phi_q, phi_k = F.elu(q) + 1, F.elu(k) + 1  # (..., L, M), (..., S, M)
    if mask is not None:
        phi_k = phi_k * mask.transpose(-2, -1).to(phi_k.dtype)  # (..., S, M), padding zeroed
    kv = torch.einsum("...sm,...sd->...md", phi_k, v)  # (..., M, Dv)
    z = phi_k.sum(-2)  # (..., M)
    num = torch.einsum("...lm,...md->...ld", phi_q, kv)  # (..., L, Dv)
    den = torch.einsum("...lm,...m->...l", phi_q, z)[..., None]  # (..., L, 1)
    return num / (den + 1e-6)


def _linear_key_chunks(q, k, v, mask, chunk=64):
    phi_q, phi_k = F.elu(q) + 1, F.elu(k) + 1  # (..., L, M), (..., S, M)
    if mask is not None:
        phi_k = phi_k * mask.transpose(-2, -1)  # (..., S, M), padding zeroed
    kv, z = 0, 0
    for start in range(0, k.shape[-2], chunk):
        part = phi_k[..., start : start + chunk, :]  # (..., c, M)
        kv = kv + part.transpose(-2, -1) @ v[..., start : start + chunk, :]  # (..., M, Dv)
        z = z + part.sum(-2)  # (..., M)
    return (phi_q @ kv) / ((phi_q * z[..., None, :]).sum(-1, keepdim=True) + 1e-6)


def _causal_rnn(q, k, v):
    phi_q, phi_k = F.elu(q) + 1, F.elu(k) + 1
    state = torch.zeros(*q.shape[:-2], q.shape[-1], v.shape[-1], dtype=q.dtype)  # (..., M, Dv)
    z = torch.zeros(*q.shape[:-2], q.shape[-1], dtype=q.dtype)  # (..., M)
    outputs = []
    for t in range(q.shape[-2]):
        state = state + phi_k[..., t, :, None] * v[..., t, None, :]
        z = z + phi_k[..., t, :]
        num = (phi_q[..., t, :, None] * state).sum(-2)  # (..., Dv)
        outputs.append(num / ((phi_q[..., t, :] * z).sum(-1, keepdim=True) + 1e-6))
    return torch.stack(outputs, dim=-2)


def _causal_einsum(q, k, v):
    phi_q, phi_k = F.elu(q) + 1, F.elu(k) + 1  # (..., L, M)
    kv = torch.einsum("...lm,...ld->...lmd", phi_k, v).cumsum(-3)  # (..., L, M, Dv)
    num = torch.einsum("...lm,...lmd->...ld", phi_q, kv)  # (..., L, Dv)
    den = torch.einsum("...lm,...lm->...l", phi_q, phi_k.cumsum(-2))[..., None]  # (..., L, 1)
    return num / (den + 1e-6)


def _causal_matmul(q, k, v):
    phi_q, phi_k = F.elu(q) + 1, F.elu(k) + 1  # (..., L, M)
    kv = (phi_k[..., :, :, None] @ v[..., :, None, :]).cumsum(-3)  # (..., L, M, Dv)
    num = (phi_q[..., :, None, :] @ kv)[..., 0, :]  # (..., L, Dv)
    den = (phi_q[..., :, None, :] @ phi_k.cumsum(-2)[..., :, :, None])[..., 0, :]  # (..., L, 1)
    return num / (den + 1e-6)


def _causal_chunked_cumsum(q, k, v, chunk=32):
    phi_q, phi_k = F.elu(q) + 1, F.elu(k) + 1  # (..., L, M)
    carry_kv, carry_z, outputs = 0, 0, []
    for start in range(0, q.shape[-2], chunk):
        pk, pq, pv = (x[..., start : start + chunk, :] for x in (phi_k, phi_q, v))  # (..., c, M or Dv)
        kv = carry_kv + (pk[..., :, :, None] * pv[..., :, None, :]).cumsum(-3)  # (..., c, M, Dv)
        z = carry_z + pk.cumsum(-2)  # (..., c, M)
        num = (pq[..., :, :, None] * kv).sum(-2)  # (..., c, Dv)
        outputs.append(num / ((pq * z).sum(-1, keepdim=True) + 1e-6))
        carry_kv, carry_z = kv[..., -1:, :, :], z[..., -1:, :]  # sums up to the chunk's end
    return torch.cat(outputs, dim=-2)


def _causal_chunkwise(q, k, v, chunk_size):
    """Task 3's chunkwise form handed in for task 2: correct, O(L c) work, several times the prefix sums' at M = 4."""
    phi_q, phi_k = F.elu(q) + 1, F.elu(k) + 1  # (..., L, M)
    state = q.new_zeros(*q.shape[:-2], q.shape[-1], v.shape[-1])  # (..., M, Dv)
    z = q.new_zeros(*q.shape[:-2], q.shape[-1], 1)  # (..., M, 1)
    outputs = []
    for start in range(0, q.shape[-2], chunk_size):
        pq, pk, pv = (x[..., start : start + chunk_size, :] for x in (phi_q, phi_k, v))  # (..., c, M or Dv)
        inside = (pq @ pk.transpose(-2, -1)).tril()  # (..., c, c)
        outputs.append((inside @ pv + pq @ state) / (inside.sum(-1, keepdim=True) + pq @ z + 1e-6))
        state = state + pk.transpose(-2, -1) @ pv
        z = z + pk.sum(-2)[..., None]
    return torch.cat(outputs, dim=-2)


def _causal_chunks_of(chunk_size):
    def causal_linear_attention(q, k, v):
        return _causal_chunkwise(q, k, v, chunk_size)

    return causal_linear_attention


def _chunkwise_ones_column(q, k, v, chunk_size):
    """Numerator and denominator in one product: append a column of ones to v, so S carries z along."""
    phi_q, phi_k = F.elu(q) + 1, F.elu(k) + 1  # (..., L, M)
    v1 = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)  # (..., L, Dv + 1)
    state = torch.zeros(*q.shape[:-2], q.shape[-1], v1.shape[-1], dtype=q.dtype)  # (..., M, Dv + 1)
    outputs = []
    for start in range(0, q.shape[-2], chunk_size):
        pq, pk, pv = (x[..., start : start + chunk_size, :] for x in (phi_q, phi_k, v1))
        c = pq.shape[-2]
        causal = torch.ones(c, c, dtype=torch.bool).tril()  # (c, c)
        both = torch.einsum("...tm,...jm->...tj", pq, pk) * causal @ pv + pq @ state  # (..., c, Dv + 1)
        outputs.append(both[..., :-1] / (both[..., -1:] + 1e-6))
        state = state + pk.transpose(-2, -1) @ pv
    return torch.cat(outputs, dim=-2)


def _chunkwise_padded_features(q, k, v, chunk_size):
    """Pad the features (not q and k: elu(0) + 1 = 1) with zero rows to whole chunks; a loop carries the state."""
    L = q.shape[-2]
    pad = (-L) % chunk_size
    phi_q, phi_k = (F.pad(F.elu(x) + 1, (0, 0, 0, pad)) for x in (q, k))  # (..., Lp, M), zero rows appended
    vp = F.pad(v, (0, 0, 0, pad))  # (..., Lp, Dv)
    kv, z, outputs = 0.0, 0.0, []
    for start in range(0, L + pad, chunk_size):
        pq, pk, pv = (x[..., start : start + chunk_size, :] for x in (phi_q, phi_k, vp))
        scores = (pq @ pk.transpose(-2, -1)).tril()  # (..., c, c)
        num = scores @ pv + pq @ kv if start else scores @ pv
        den = scores.sum(-1, keepdim=True) + (pq @ z if start else 0.0)
        outputs.append(num / (den + 1e-6))
        kv = kv + pk.transpose(-2, -1) @ pv  # (..., M, Dv)
        z = z + pk.sum(-2)[..., None]  # (..., M, 1)
    return torch.cat(outputs, dim=-2)[..., :L, :]


ALTERNATIVES = {
    "06.linear_attention": [_linear_einsum, _linear_key_chunks],
    "06.causal_linear_attention": [_causal_rnn, _causal_einsum, _causal_matmul, _causal_chunked_cumsum,
                                   *(_causal_chunks_of(c) for c in (1, 4, 16, 64, 100, 128))],
    "06.chunkwise_causal_linear_attention": [_chunkwise_ones_column, _chunkwise_padded_features],
}
ALTERNATIVE_CASES = [(task_id, i) for task_id, fns in ALTERNATIVES.items() for i in range(len(fns))]


def test_every_task_of_lesson_06_has_alternatives_and_a_stretch_task():
    assert set(ALTERNATIVES) == set(OURS)
    assert [TASKS[t].stretch for t in OURS].count(True) == 1


@pytest.mark.parametrize("task_id,index", ALTERNATIVE_CASES, ids=[f"{t}:{i}" for t, i in ALTERNATIVE_CASES])
def test_other_correct_solutions_score_full_marks(task_id, index):
    result = grade_function(TASKS[task_id], ALTERNATIVES[task_id][index])
    assert result.score == result.max_score, result.report()


# --- the probes' limits --------------------------------------------------------------------


def _largest(task_id, fn, indices):
    task = TASKS[task_id]
    cases = task.make_cases()
    outcomes = run_cases(fn, [cases[i] for i in indices], measure=task.measure, forbidden=task.forbidden)
    return [cases[i] for i in indices], [o.probe["largest_numel"] for o in outcomes]


def test_chunkwise_limits_separate_the_chunk_states_from_the_per_position_states():
    """Wide cases: the reference holds 1/4 of B·H·c·M·Dv or less (measured 0.25 and 0.23), the library's
    per-position prefix sums inside each chunk exactly the limit, task 2's prefix sums 3.75-4x it.
    Long cases: the reference holds under 1/10 of L * L, the quadratic form 4x L * L."""
    task_id = "06.chunkwise_causal_linear_attention"
    wide, long_ = (8, 9), (6, 7)

    def limit(case):
        q, _, v, chunk_size = case.args
        return lesson06._heads(q) * chunk_size * q.shape[-1] * v.shape[-1]

    cases, reference = _largest(task_id, TASKS[task_id].reference, wide)
    assert all(numel <= limit(c) / 4 for c, numel in zip(cases, reference))
    for fn in (lesson06._chunkwise_cumsum_per_chunk, lesson06._chunkwise_prefix_sums):
        assert all(numel >= limit(c) for c, numel in zip(cases, _largest(task_id, fn, wide)[1]))
    cases, reference = _largest(task_id, TASKS[task_id].reference, long_)
    assert all(numel < c.args[0].shape[-2] ** 2 / 10 for c, numel in zip(cases, reference))
    quadratic = _largest(task_id, lesson06._chunkwise_quadratic, long_)[1]
    assert all(numel >= c.args[0].shape[-2] ** 2 for c, numel in zip(cases, quadratic))


def test_causal_long_cases_keep_the_prefix_sums_at_a_quarter_of_the_limit():
    task_id = "06.causal_linear_attention"
    cases, reference = _largest(task_id, TASKS[task_id].reference, (5, 6))
    assert all(numel <= c.args[0].shape[-2] ** 2 / 4 for c, numel in zip(cases, reference))


def _work(task_id, fn, indices):
    task = TASKS[task_id]
    cases = task.make_cases()
    outcomes = run_cases(fn, [cases[i] for i in indices], measure=task.measure, forbidden=task.forbidden)
    return [o.probe["flops"] for o in outcomes]


_HONEST_CAUSAL = {
    "reference": TASKS["06.causal_linear_attention"].reference,
    "einsum": _causal_einsum,
    "matmul": _causal_matmul,
    "recurrent": lesson06._causal_recurrent,
    "rnn": _causal_rnn,
    # Chunks up to the short case's length; 80 and 90 (about L / 1.4) leave the costliest last, partial chunk.
    **{f"chunkwise, chunks of {c}": _causal_chunks_of(c) for c in (1, 4, 16, 64, 80, 90, 100, 128)},
}
_QUADRATIC_CAUSAL = ("causal mask on the quadratic form", "loop that fills an (L, L) matrix row by row",
                     "prefix sums recomputed from scratch at every position",
                     "each chunk of 16 sums its prefix again from position 0",
                     "each chunk of 64 runs the cumsum again from position 0")


@pytest.mark.parametrize("pair", lesson06._GROWTH_PAIRS, ids=["with heads", "no head axis"])
def test_causal_work_growth_separates_linear_forms_of_any_constant_from_quadratic_ones(pair):
    """8x L: every honest form (prefix sums, recurrent, chunkwise with chunks of 1 to 128, whose work is up to 26x
    the prefix sums') grows 7.9-9.7x, every quadratic one at least 20x, even each chunk summing its prefix again from
    position 0, whose L^2 term hides behind a small constant (x2.6-2.8 per doubling at L = 128): well inside and
    outside GROWTH_BAND, with a margin of 1.2x or more either way."""
    task_id = "06.causal_linear_attention"
    low, high = lesson06.GROWTH_BAND
    assert all(TASKS[task_id].make_cases()[long_].args[0].shape[-2] == lesson06.GROWTH_SPAN
               * TASKS[task_id].make_cases()[short].args[0].shape[-2] for short, long_ in lesson06._GROWTH_PAIRS)
    for name, fn in _HONEST_CAUSAL.items():
        short, long_ = _work(task_id, fn, pair)
        assert 1.2 * low < 7.9 <= long_ / short <= 9.7 < high / 1.2, name
    for name in _QUADRATIC_CAUSAL:
        short, long_ = _work(task_id, TASKS[task_id].wrong[name].fn, pair)
        assert long_ / short >= 20 > 1.2 * high, name


def test_the_causal_work_hint_tells_the_small_tensor_story_only_when_it_is_true():
    """A quadratic form with small tensors gets the 'summed from scratch' story; one with an (L, L) matrix does not
    (the memory check told it already); a chunkwise form with large chunks is not told either: it passes."""
    task = TASKS["06.causal_linear_attention"]
    work_check = next(name for name in (c.name for c in grade_function(task, task.reference).checks) if name.startswith("work"))

    def work_message(fn):
        return next(c for c in grade_function(task, fn).checks if c.name == work_check)

    scratch = work_message(task.wrong["prefix sums recomputed from scratch at every position"].fn)
    assert not scratch.passed and "summed from scratch" in scratch.message and "x61." in scratch.message
    for name in ("each chunk of 16 sums its prefix again from position 0",
                 "each chunk of 64 runs the cumsum again from position 0"):
        chunks = work_message(task.wrong[name].fn)
        assert not chunks.passed and "at every chunk, from position 0 again" in chunks.message, name
    matrix = work_message(task.wrong["causal mask on the quadratic form"].fn)
    assert not matrix.passed and "summed from scratch" not in matrix.message
    assert work_message(_causal_chunks_of(64)).passed and work_message(_causal_chunks_of(128)).passed
