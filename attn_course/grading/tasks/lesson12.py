"""Graded tasks for lesson 12 (attention across devices): the zig-zag layout, one ring step, and (stretch) its backward."""

from __future__ import annotations

import math

import torch

from ...chunked import PartialAttention, _log_sum_exp, finish_partial, merge_partials, partial_attention
from ...distributed import ring_step as library_ring_step
from ...distributed import ring_step_backward as library_ring_step_backward
from ...distributed import sequence_positions
from ..core import Case, Fail, Task
from ..judging import Checklist, expect_close, expect_dtype, expect_finite, expect_shape
from ._common import returned, seeded_randn
from ._variants import distinct_match

__all__ = ["ZIGZAG_POSITIONS", "RING_STEP", "RING_STEP_BACKWARD"]


# --- 12.zigzag_positions -------------------------------------------------------------------
# The learner writes zigzag_positions(seq_len, world_size) -> a list of world_size integer
# tensors: cut the sequence into 2W equal chunks; rank r holds chunk r, then chunk 2W - 1 - r.
# It raises ValueError when 2W does not divide seq_len.

_ZIGZAG_SIZES = [(16, 4), (24, 3), (8, 1), (12, 2)]
_ZIGZAG_BAD = [(10, 4), (12, 4)]  # 12 is a multiple of 4 but not of 8


def _zigzag_cases() -> list[Case]:
    return [Case(f"zigzag_positions({L}, {W})", (L, W)) for L, W in _ZIGZAG_SIZES + _ZIGZAG_BAD]


def _positions_of(outcome, case: Case) -> list[torch.Tensor]:
    """The learner's per-rank positions as int64 tensors; Fail with a teaching message otherwise."""
    L, W = case.args
    value = outcome.returned
    if outcome.not_implemented or outcome.error is not None:
        returned(outcome, what=case.name)  # raises the Fail that explains the error
    if not isinstance(value, (list, tuple)) or len(value) != W:
        got = f"a {type(value).__name__}" + (f" of length {len(value)}" if isinstance(value, (list, tuple)) else "")
        raise Fail(f"{case.name} should return a list with one tensor of positions per rank ({W} of them), got {got}.")
    ranks = []
    for rank, item in enumerate(value):
        try:
            positions = torch.as_tensor(item)
        except Exception:
            raise Fail(f"{case.name}: rank {rank}'s entry is a {type(item).__name__}, not a tensor of positions.") from None
        if positions.dim() != 1 or positions.numel() != L // W:
            raise Fail(
                f"{case.name}: rank {rank} holds {tuple(positions.shape)}, expected {L // W} token positions (a 1-D "
                "tensor). Return the positions of the tokens, e.g. 0, 1, 14, 15 for rank 0 of 4 at L = 16, not the "
                "chunk numbers."
            )
        if positions.is_floating_point() or positions.dtype == torch.bool:
            raise Fail(f"{case.name}: rank {rank}'s positions have dtype {positions.dtype}; use an integer tensor "
                       "(torch.arange gives int64).")
        ranks.append(positions.long())
    return ranks


def _causal_load(ranks: list[torch.Tensor]) -> list[int]:
    """Causal query-key pairs per rank: a query at position p sees p + 1 keys."""
    return [int((positions + 1).sum()) for positions in ranks]


def _judge_zigzag(cases, outcomes):
    checklist = Checklist()
    good = [(case, outcome) for case, outcome in zip(cases, outcomes) if tuple(case.args) in _ZIGZAG_SIZES]
    bad = [(case, outcome) for case, outcome in zip(cases, outcomes) if tuple(case.args) in _ZIGZAG_BAD]

    def answered() -> list[tuple[Case, list[torch.Tensor]]]:
        """The good cases the function answered; if it answered none, fail with the first one's error."""
        results = []
        for case, outcome in good:
            if outcome.error is None and not outcome.not_implemented:
                results.append((case, _positions_of(outcome, case)))
        if not results:
            _positions_of(good[0][1], good[0][0])
        return results

    with checklist.check("one tensor of L/W token positions per rank"):
        answered()
    with checklist.check("every position on exactly one rank"):
        for case, ranks in answered():
            L, _ = case.args
            every = torch.sort(torch.cat(ranks)).values
            if not torch.equal(every, torch.arange(L)):
                missing = sorted(set(range(L)) - set(every.tolist()))
                raise Fail(
                    f"{case.name}: the ranks together should hold 0..{L - 1} once each; "
                    + (f"position {missing[0]} is on no rank" if missing else "some position is on two ranks")
                    + ". The late chunk of rank r is chunk 2W - 1 - r: tokens (2W - 1 - r) c .. (2W - r) c - 1 "
                    "with c = L / 2W."
                )
    with checklist.check("causal work is the same on every rank"):
        for case, ranks in answered():
            load = _causal_load(ranks)
            if len(set(load)) > 1:
                low, high = load.index(min(load)), load.index(max(load))
                hint = ""
                if torch.equal(torch.cat(ranks), torch.arange(case.args[0])):
                    hint = " This is the contiguous split: the last rank's queries see the whole sequence, the first's only their own block."
                raise Fail(
                    f"{case.name}: with a causal mask rank {high} would compute {load[high]} query-key pairs and rank "
                    f"{low} only {load[low]}: the ring waits for the slowest rank at every step.{hint} Pair an early "
                    "chunk with the matching late one: chunk r with chunk 2W - 1 - r."
                )
    with checklist.check("rank r holds chunk r, then chunk 2W - 1 - r"):
        for case, ranks in answered():
            L, W = case.args
            for rank, (got, want) in enumerate(zip(ranks, sequence_positions(L, W, layout="zigzag"))):
                if not torch.equal(got, want):
                    hint = ""
                    half = L // W // 2
                    if torch.equal(torch.cat([got[half:], got[:half]]), want):
                        hint = " Same tokens, but put the early chunk first and the late chunk second."
                    elif torch.equal(torch.sort(got).values, torch.sort(want).values):
                        hint = " Keep each chunk in increasing order: early chunk first, then late chunk."
                    raise Fail(f"{case.name}: rank {rank} holds {got.tolist()}, expected {want.tolist()}.{hint}")
    with checklist.check("raises ValueError when 2 * world_size does not divide seq_len"):
        for case, outcome in bad:
            L, W = case.args
            if outcome.not_implemented:
                returned(outcome, what=case.name)
            if outcome.error is None:
                raise Fail(
                    f"{case.name} returned instead of raising: {L} tokens cannot be cut into 2 * world_size = {2 * W} "
                    "equal chunks. Check seq_len % (2 * world_size) (not only % world_size) and raise a ValueError that "
                    "says so, instead of silently dropping tokens."
                )
            if not outcome.error.startswith("ValueError"):
                raise Fail(f"{case.name} should raise ValueError, but raised {outcome.error}")
    return checklist.results


def _zigzag_reference(seq_len, world_size):
    return sequence_positions(seq_len, world_size, layout="zigzag")


def _zigzag_chunks(seq_len, world_size, *, late=lambda r, W: 2 * W - 1 - r, late_first=False, check=True):
    if check and seq_len % (2 * world_size):
        raise ValueError(f"{seq_len} is not divisible by {2 * world_size}")
    c = seq_len // (2 * world_size)
    ranks = []
    for r in range(world_size):
        early, later = torch.arange(r * c, (r + 1) * c), torch.arange(late(r, world_size) * c, (late(r, world_size) + 1) * c)
        ranks.append(torch.cat([later, early] if late_first else [early, later]))
    return ranks


def _zigzag_contiguous(seq_len, world_size):
    return sequence_positions(seq_len, world_size, layout="contiguous")


def _zigzag_strided_pair(seq_len, world_size):
    return _zigzag_chunks(seq_len, world_size, late=lambda r, W: r + W)


def _zigzag_late_first(seq_len, world_size):
    return _zigzag_chunks(seq_len, world_size, late_first=True)


def _zigzag_off_by_one(seq_len, world_size):
    return _zigzag_chunks(seq_len, world_size, late=lambda r, W: (2 * W - r) % (2 * W))


def _zigzag_chunk_numbers(seq_len, world_size):
    if seq_len % (2 * world_size):
        raise ValueError("not divisible")
    return [torch.tensor([r, 2 * world_size - 1 - r]) for r in range(world_size)]


def _zigzag_never_raises(seq_len, world_size):
    return _zigzag_chunks(seq_len, world_size, check=False)


def _zigzag_checks_world_size_only(seq_len, world_size):
    if seq_len % world_size:
        raise ValueError(f"{seq_len} is not divisible by {world_size}")
    return _zigzag_chunks(seq_len, world_size, check=False)


ZIGZAG_POSITIONS = Task(
    id="12.zigzag_positions",
    title="The zig-zag layout: which tokens each rank holds",
    function_name="zigzag_positions",
    make_cases=_zigzag_cases,
    judge=_judge_zigzag,
    reference=_zigzag_reference,
    wrong={
        "contiguous split": (_zigzag_contiguous, "contiguous split"),
        "pairs chunk r with chunk r + W": (_zigzag_strided_pair, "chunk r with chunk 2W - 1 - r"),
        "late chunk first": (_zigzag_late_first, "put the early chunk first"),
        "late chunk off by one (2W - r)": (_zigzag_off_by_one, "chunk 2W - 1 - r: tokens"),
        "chunk numbers instead of token positions": (_zigzag_chunk_numbers, "not the chunk numbers"),
        "no error when 2W does not divide L": (_zigzag_never_raises, "returned instead of raising"),
        "checks only L % W": (_zigzag_checks_world_size_only, "seq_len % (2 * world_size)"),
    },
)


# --- 12.ring_step --------------------------------------------------------------------------
# The learner writes ring_step(running, q, k, v, q_positions, k_positions, key_padding_mask=None,
# is_causal=False) -> (acc, row_max, row_sum): this rank's queries q (B, H, Lq, D) against the
# K/V block that just arrived (B, H, Lk, D/Dv), merged into running (None at the first step)
# with the online softmax of lesson 07. The causal mask compares global positions; the padding
# mask (B, Lk), True = real key, came with the block. Scale 1 / sqrt(D).


def _partial(q, k, v, q_positions, k_positions, key_padding_mask=None, is_causal=False, running=None):
    return tuple(library_ring_step(running, q, k, v, q_positions=q_positions, k_positions=k_positions,
                                   key_padding_mask=key_padding_mask, is_causal=is_causal))


def _ring_step_cases() -> list[Case]:
    randn = seeded_randn(1212)
    B, H, D, Dv = 2, 2, 8, 6
    L, W = 12, 2  # a zig-zag pair: rank 0 holds positions 0-2 and 9-11, rank 1 holds 3-8
    zig = sequence_positions(L, W, layout="zigzag")
    q, k, v = randn(B, H, L, D), randn(B, H, L, D), randn(B, H, L, Dv)
    shard = {r: (q[..., zig[r], :], k[..., zig[r], :], v[..., zig[r], :]) for r in range(W)}
    (q0, k0, v0), (_, k1, v1) = shard[0], shard[1]
    # A running partial whose scores are much larger for some rows, so a merge without rescaling shows.
    boosted = 4 * randn(B, H, 6, D)
    running_big = _partial(q0, boosted, randn(B, H, 6, Dv), zig[0], zig[1])
    keep = torch.ones(B, 6, dtype=torch.bool)  # (B, Lk), True = real key
    keep[0, 4:] = False  # batch 0: the block's last two keys are padding
    keep[1, :] = False  # batch 1: the whole block is padding
    running_own = _partial(q0, k0, v0, zig[0], zig[0], is_causal=True)  # step 0: the rank's own block
    # The last step of a 3-rank ring (zig-zag, L = 18): rank 1 has merged steps 0 and 1 already.
    zig3 = sequence_positions(18, 3, layout="zigzag")
    q3, k3, v3 = randn(1, 2, 18, D), randn(1, 2, 18, D), randn(1, 2, 18, Dv)
    running_two = None
    for source in (1, 0):  # steps 0 and 1 of rank 1 hold the blocks of ranks 1 and 0
        running_two = _partial(q3[..., zig3[1], :], k3[..., zig3[source], :], v3[..., zig3[source], :],
                               zig3[1], zig3[source], is_causal=True, running=running_two)
    last = (running_two, q3[..., zig3[1], :], k3[..., zig3[2], :], v3[..., zig3[2], :])

    def case(name, running, qq, kk, vv, q_positions, k_positions, key_padding_mask=None, is_causal=False):
        return Case(name, (running, qq, kk, vv), dict(q_positions=q_positions, k_positions=k_positions,
                                                     key_padding_mask=key_padding_mask, is_causal=is_causal))

    return [
        case("first step (running=None): q (2, 2, 6, 8) against a block of 6 keys, not causal, float64",
             None, q0, k1, v1, zig[0], zig[1]),
        case("second step: merge a block into a running partial whose maxima are larger, not causal",
             running_big, q0, k1, v1, zig[0], zig[1]),
        case("causal, zig-zag: rank 0 (positions 0-2, 9-11) receives rank 1's block (positions 3-8)",
             running_own, q0, k1, v1, zig[0], zig[1], is_causal=True),
        case("causal, zig-zag: rank 0's own block at step 0 (positions 0-2, 9-11 against themselves)",
             None, q0, k0, v0, zig[0], zig[0], is_causal=True),
        case("padding mask of the arriving block: batch 0 ends in 2 padded keys, batch 1 is all padding",
             None, q0, k1, v1, zig[0], zig[1], key_padding_mask=keep),
        case("a block entirely in the future (queries 0-2 against keys 3-8, causal, running=None)",
             None, q0[..., :3, :], k1, v1, zig[0][:3], zig[1], is_causal=True),
        case("the last step of a 3-rank ring (L = 18, causal): finishing gives attention over the whole sequence",
             *last, zig3[1], zig3[2], is_causal=True),
    ]


_FIRST, _MERGE, _CAUSAL_OTHER, _CAUSAL_OWN, _PADDED, _FUTURE, _LAST = range(7)


def _when(condition: bool, make):
    """A variant that exists only in some cases (e.g. a flipped mask needs a mask); raising means 'no match'."""
    def variant():
        if not condition:
            raise LookupError("this variant does not apply to this case")
        return make()

    return variant


def _expected_step(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    running, q, k, v = case.args
    return _partial(q, k, v, running=running, **case.kwargs)


def _step_variant(case: Case, **change) -> tuple[torch.Tensor, ...]:
    running, q, k, v = case.args
    options = {**case.kwargs, **change}
    running = options.pop("running", running)
    scale = options.pop("scale", None)
    return tuple(library_ring_step(running, q, k, v, scale=scale, **options))


def _added_without_rescaling(case: Case) -> tuple[torch.Tensor, ...]:
    running = case.args[0]
    new = _step_variant(case, running=None)
    if running is None:
        return new
    return running[0] + new[0], torch.maximum(running[1], new[1]), running[2] + new[2]


def _diagnose_step(got_acc: torch.Tensor, case: Case) -> str | None:
    running, q, k, v = case.args
    kwargs = case.kwargs
    expected = _expected_step(case)
    local = torch.arange(q.shape[-2]), torch.arange(k.shape[-2])
    keep = kwargs["key_padding_mask"]
    return distinct_match(got_acc, expected[0], [
        (lambda: _step_variant(case, running=None)[0],
         "you returned only the new block's partial: merge it into `running` (lesson 07's merge_partials), or the "
         "blocks of earlier steps are lost."),
        (lambda: _added_without_rescaling(case)[0],
         "you added the new block's acc to the running acc as they are. Each is relative to its own max: rescale both "
         "to the common max m = max(m1, m2) first."),
        (lambda: _step_variant(case, q_positions=local[0], k_positions=local[1])[0],
         "your causal mask compares local indices within the block (a plain tril). The block comes from another "
         "rank: compare the global positions, key position <= query position."),
        (lambda: _step_variant(case, k_positions=kwargs["k_positions"] + 1)[0],
         "your causal mask is off by one: a query at position p may attend to the key at position p itself "
         "(key position <= query position, not <)."),
        (lambda: _step_variant(case, is_causal=False)[0],
         "no causal mask: with is_causal=True a query must not see keys at later positions."),
        (_when(keep is not None, lambda: _step_variant(case, key_padding_mask=~keep)[0]),
         "the padding mask is used the wrong way round: True = a real key that may be attended to."),
        (_when(keep is not None, lambda: _step_variant(case, key_padding_mask=None)[0]),
         "the padding mask is ignored: set the scores of padded keys (mask False) to -inf before the exp."),
        (lambda: _step_variant(case, scale=1.0)[0],
         "the scores are not scaled: multiply q @ k^T by 1 / sqrt(D)."),
        (lambda: finish_partial(PartialAttention(*expected)),
         "you returned acc / row_sum, the finished output. Keep acc unnormalised until the last step."),
    ])


def _judge_ring_step(cases, outcomes):
    checklist = Checklist()

    def parts(index):
        case, outcome = cases[index], outcomes[index]
        got = tuple(returned(outcome, what=case.name, index=i) for i in range(3))
        expected = _expected_step(case)
        for value, want, label in zip(got, expected, ("acc", "row_max", "row_sum")):
            expect_shape(value, want.shape, what=f"{case.name}: {label}",
                         hint="acc is (B, H, Lq, Dv); row_max and row_sum are (B, H, Lq, 1), as in lesson 07.")
        return case, got, expected

    def ran() -> list[int]:
        indices = [i for i, outcome in enumerate(outcomes) if outcome.error is None]
        if not indices:
            parts(0)  # raises the Fail that explains the error (or "not implemented yet")
        return indices

    def compare(index):
        case, (acc, row_max, row_sum), (want_acc, want_max, want_sum) = parts(index)
        for value, label in ((acc, "acc"), (row_sum, "row_sum")):
            if torch.isnan(value).any():
                raise Fail(f"{case.name}: NaN in {label}. A row with no allowed key has max -inf, and exp(-inf - (-inf)) "
                           "= exp(nan): shift by 0 where the max is -inf (lesson 07's partial_attention and merge_partials do).")
        hint = _diagnose_step(acc, case) or ""
        expect_close(acc, want_acc, what=f"{case.name}: acc", atol=1e-9, rtol=1e-7, hint=hint)
        expect_close(row_sum, want_sum, what=f"{case.name}: row_sum", atol=1e-9, rtol=1e-7, hint=hint)
        if not torch.equal(row_max.double(), want_max.double()) and not torch.allclose(row_max.double(), want_max.double(),
                                                                                        atol=1e-9, rtol=1e-7):
            raise Fail(f"{case.name}: row_max should be the largest allowed score per row so far (max of the running "
                       "max and the block's, -inf where no key was allowed).")

    with checklist.check("returns (acc, row_max, row_sum) with the shapes and dtype of lesson 07's partials"):
        for index in ran():
            case, got, expected = parts(index)
            for value, want, label in zip(got, expected, ("acc", "row_max", "row_sum")):
                expect_dtype(value, want.dtype, what=f"{case.name}: {label}")
    for title, indices in (
        ("first step: the block's own partial", (_FIRST,)),
        ("merges into the running partial with the online softmax", (_MERGE,)),
        ("causal mask from the global positions, not the local indices", (_CAUSAL_OTHER, _CAUSAL_OWN)),
        ("the padding mask of the arriving block", (_PADDED,)),
        ("rows with no allowed key stay finite (running=None, block in the future)", (_FUTURE,)),
    ):
        with checklist.check(title):
            for index in indices:
                compare(index)
    with checklist.check("after the last step, acc / row_sum is attention over the whole sequence"):
        case, (acc, _, row_sum), _ = parts(_LAST)
        expected = finish_partial(PartialAttention(*_expected_step(case)))  # equals SDPA over all 18 tokens
        got = acc / torch.where(row_sum == 0, torch.ones_like(row_sum), row_sum)
        expect_close(got, expected, what=f"{case.name}: acc / row_sum", atol=1e-9, rtol=1e-7,
                     hint=_diagnose_step(acc, case) or "")
    with checklist.check("leaves running, q, k and v unchanged"):
        for index in ran():
            case, outcome = cases[index], outcomes[index]
            before, after = case.args, outcome.args_after
            running_before, running_after = before[0], after[0] if after else None
            if running_before is not None:
                if running_after is None or not all(torch.equal(b, a) for b, a in zip(running_before, running_after)):
                    raise Fail(f"{case.name}: your function changed `running` in place (e.g. acc *= ...). Build new "
                               "tensors: the caller still holds the old partial.")
            for name, b, a in zip(("q", "k", "v"), before[1:], after[1:]):
                if not torch.equal(b, a):
                    raise Fail(f"{case.name}: your function changed {name} in place; the block travels on to the next rank.")
    return checklist.results


def _ring_step_reference(running, q, k, v, q_positions, k_positions, key_padding_mask=None, is_causal=False):
    return tuple(library_ring_step(running, q, k, v, q_positions=q_positions, k_positions=k_positions,
                                   key_padding_mask=key_padding_mask, is_causal=is_causal))


def _by_hand(running, q, k, v, q_positions, k_positions, key_padding_mask=None, is_causal=False, *,
             local=False, strict=False, flip=False, ignore_mask=False, scale=None, merge="online", nan=False,
             in_place=False, finish=False):
    """One ring step written out, with one classic mistake switched on."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale  # (B, H, Lq, Lk)
    allowed = torch.ones(scores.shape[-2:], dtype=torch.bool)
    if is_causal:
        qp, kp = (torch.arange(q.shape[-2]), torch.arange(k.shape[-2])) if local else (q_positions, k_positions)
        allowed = kp[None, :] < qp[:, None] if strict else kp[None, :] <= qp[:, None]  # (Lq, Lk)
    if key_padding_mask is not None and not ignore_mask:
        keep = ~key_padding_mask if flip else key_padding_mask
        allowed = allowed & keep[:, None, None, :]  # (B, 1, Lq, Lk)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if nan:
        row_max = scores.amax(-1, keepdim=True)
        exps = torch.exp(scores - row_max)
        new = (exps @ v, row_max, exps.sum(-1, keepdim=True))
    else:
        new = tuple(partial_attention(scores, v))
    if running is None:
        result = new
    elif merge == "online":
        result = tuple(merge_partials(PartialAttention(*running), PartialAttention(*new)))
    elif merge == "add":
        result = (running[0] + new[0], torch.maximum(running[1], new[1]), running[2] + new[2])
    else:  # "replace"
        result = new
    if in_place and running is not None:
        running[0].copy_(result[0])
        running[2].copy_(result[2])
        result = (running[0].clone(), result[1], running[2].clone())
    if finish:
        return finish_partial(PartialAttention(*result)), result[1], result[2]
    return result


def _wrong(**mistake):
    def step(running, q, k, v, q_positions, k_positions, key_padding_mask=None, is_causal=False):
        return _by_hand(running, q, k, v, q_positions, k_positions, key_padding_mask, is_causal, **mistake)

    return step


RING_STEP = Task(
    id="12.ring_step",
    title="One step of ring attention: merge the arriving K/V block",
    function_name="ring_step",
    make_cases=_ring_step_cases,
    judge=_judge_ring_step,
    reference=_ring_step_reference,
    wrong={
        "ignores the running partial": (_wrong(merge="replace"), "returned only the new block's partial"),
        "adds without rescaling": (_wrong(merge="add"), "rescale both"),
        "causal mask from local indices": (_wrong(local=True), "compare the global positions"),
        "causal mask off by one (<)": (_wrong(strict=True), "off by one"),
        "padding mask polarity flipped": (_wrong(flip=True), "wrong way round"),
        "padding mask ignored": (_wrong(ignore_mask=True), "padding mask is ignored"),
        "no 1/sqrt(D) scale": (_wrong(scale=1.0), "not scaled"),
        "NaN for rows with no allowed key": (_wrong(nan=True), "exp(nan)"),
        "returns the finished output": (_wrong(finish=True), "Keep acc unnormalised"),
        "updates running in place": (_wrong(in_place=True), "changed `running` in place"),
    },
)


# --- 12.ring_step_backward (stretch) -------------------------------------------------------
# The learner writes ring_step_backward(q, k, v, grad_out, out, lse, q_positions, k_positions,
# key_padding_mask=None, is_causal=False) -> (dq_part, dk, dv): one block's share of the
# gradients, FlashAttention's backward with the *final* out and lse of the queries.


def _backward_cases() -> list[Case]:
    randn = seeded_randn(1213)
    B, H, D, Dv = 2, 2, 8, 5
    cases = []
    # Queries of rank 0 and all keys of a 3-rank zig-zag ring (L = 18): out and lse over every key.
    L, W = 18, 3
    zig = sequence_positions(L, W, layout="zigzag")
    q, k, v = randn(B, H, L, D), randn(B, H, L, D), randn(B, H, L, Dv)
    grad_out = randn(B, H, L, Dv)
    keep = torch.ones(B, L, dtype=torch.bool)  # (B, L), True = real key
    keep[0, 13:] = False
    keep[1, :3] = False  # batch 1: queries 0-2 see no key at all when causal (lse = -inf)
    for name, source, is_causal, mask in (
        ("not causal: rank 0's 6 queries against rank 1's block of 6 keys (out and lse over all 18 keys)", 1, False, None),
        ("causal, zig-zag: rank 0 (positions 0-2, 15-17) against rank 2's block (positions 6-11)", 2, True, None),
        ("causal and padded: rank 0's own block; batch 1's first queries see no key at all (lse = -inf)", 0, True, keep),
    ):
        running = None
        for block in range(W):  # the final out and lse of rank 0's queries, over all three blocks
            running = library_ring_step(running, q[..., zig[0], :], k[..., zig[block], :], v[..., zig[block], :],
                                        q_positions=zig[0], k_positions=zig[block], is_causal=is_causal,
                                        key_padding_mask=None if mask is None else mask[:, zig[block]])
        out, lse = finish_partial(running), _log_sum_exp(running)
        cases.append(Case(name, (q[..., zig[0], :], k[..., zig[source], :], v[..., zig[source], :],
                                 grad_out[..., zig[0], :], out, lse),
                          dict(q_positions=zig[0], k_positions=zig[source],
                               key_padding_mask=None if mask is None else mask[:, zig[source]], is_causal=is_causal)))
    # Fewer queries than keys, so a transposed product cannot have the right shape by accident.
    q4, k4, v4, g4 = randn(1, 1, 3, D), randn(1, 1, 7, D), randn(1, 1, 7, Dv), randn(1, 1, 3, Dv)
    positions_q, positions_k = torch.arange(7, 10), torch.arange(7)
    running = library_ring_step(None, q4, k4, v4, q_positions=positions_q, k_positions=positions_k)
    cases.append(Case("3 queries against a block of 7 keys (Lq != Lk), not causal, out and lse from this block alone",
                      (q4, k4, v4, g4, finish_partial(running), _log_sum_exp(running)),
                      dict(q_positions=positions_q, k_positions=positions_k, key_padding_mask=None, is_causal=False)))
    return cases


_BW_PLAIN, _BW_CAUSAL, _BW_PADDED, _BW_RECT = range(4)
_SHAPE_HINTS = [(needle, "two shapes do not fit in a matmul (the block has fewer queries than keys here): dv = P^T @ "
                 "grad_out (transpose the weights), dk = dS^T @ q, dq_part = dS @ k.")
                for needle in ("size", "cannot be multiplied")]


def _expected_backward(case: Case):
    return library_ring_step_backward(*case.args, **case.kwargs)


def _diagnose_backward(label: str, got: torch.Tensor, case: Case) -> str | None:
    q, k, v, grad_out, out, lse = case.args
    kwargs = case.kwargs
    index = {"dq": 0, "dk": 1, "dv": 2}[label]
    expected = _expected_backward(case)
    scale = 1 / math.sqrt(q.shape[-1])
    block_only = PartialAttention(*library_ring_step(None, q, k, v, **kwargs))
    keep = kwargs["key_padding_mask"]

    def variant(**change):
        args = dict(zip(("q", "k", "v", "grad_out", "out", "lse"), case.args))
        options = {**kwargs}
        for key, value in change.items():
            (args if key in args else options)[key] = value
        return library_ring_step_backward(*args.values(), **options)[index]

    return distinct_match(got, expected[index], [
        (lambda: variant(lse=_log_sum_exp(block_only)),
         "you recomputed the softmax over this block only. The weights are exp(scores - lse) with the *final* lse "
         "of each query over every key of the sequence: use the lse you are given."),
        (lambda: variant(out=torch.zeros_like(out)),
         "delta is missing: dS = P * (dP - delta) with delta = (grad_out * out).sum(-1, keepdim=True), the "
         "softmax's correction for every weight of the row."),
        (lambda: variant(out=torch.ones_like(out)),
         "delta is (grad_out * out).sum(-1, keepdim=True): the product with the output, not grad_out alone."),
        (lambda: expected[index] / scale,
         "missing a 1/sqrt(D): the scores were q @ k^T * scale, so dS carries the scale into dq and dk once."),
        (lambda: expected[index] * scale,
         "the scale is applied twice (e.g. dS scaled and q scaled again): dk = dS^T q * scale, dq = dS k * scale."),
        (_when(kwargs["is_causal"], lambda: variant(is_causal=False)),
         "the causal mask is missing in the backward pass: recompute the scores with the same mask as forward."),
        (_when(keep is not None, lambda: variant(key_padding_mask=None)),
         "the padding mask is missing in the backward pass: padded keys get zero weight, and zero gradient."),
    ])


def _judge_backward(cases, outcomes):
    checklist = Checklist()

    def parts(index):
        case, outcome = cases[index], outcomes[index]
        got = tuple(returned(outcome, what=case.name, index=i, hints=_SHAPE_HINTS) for i in range(3))
        expected = _expected_backward(case)
        hints = ("dq_part has q's shape (B, H, Lq, D).", "dk has k's shape (B, H, Lk, D): dS^T @ q.",
                 "dv has v's shape (B, H, Lk, Dv): P^T @ grad_out (transpose the weights).")
        for value, want, label, hint in zip(got, expected, ("dq_part", "dk", "dv"), hints):
            expect_shape(value, want.shape, what=f"{case.name}: {label}", hint=hint)
            expect_dtype(value, want.dtype, what=f"{case.name}: {label}")
        return case, got, expected

    def ran() -> list[int]:
        indices = [i for i, outcome in enumerate(outcomes) if outcome.error is None]
        if not indices:
            parts(0)
        return indices

    def compare(index, labels=("dq", "dk", "dv")):
        case, got, expected = parts(index)
        for label, value, want in zip(("dq", "dk", "dv"), got, expected):
            if label not in labels:
                continue
            expect_finite(value, what=f"{case.name}: {label}", hint=(
                "A row with no allowed key has lse = -inf; its scores are -inf too, so use lse = 0 there and every "
                "weight is exp(-inf) = 0."))
            expect_close(value, want, what=f"{case.name}: {label}", atol=1e-9, rtol=1e-7,
                         hint=_diagnose_backward(label, value, case) or "")

    with checklist.check("returns (dq_part, dk, dv) shaped like q, k and v"):
        for index in ran():
            parts(index)
    with checklist.check("dv = P^T grad_out, with P from the final lse"):
        compare(_BW_PLAIN, ("dv",))
        compare(_BW_RECT, ("dv",))
    with checklist.check("dq_part and dk, with delta and the scale"):
        compare(_BW_PLAIN, ("dq", "dk"))
        compare(_BW_RECT, ("dq", "dk"))
    with checklist.check("causal blocks: the forward pass's mask, from global positions"):
        compare(_BW_CAUSAL)
    with checklist.check("padding, and rows with no allowed key (lse = -inf) stay finite"):
        compare(_BW_PADDED)
    with checklist.check("leaves its inputs unchanged"):
        for index in ran():
            case, outcome = cases[index], outcomes[index]
            for name, before, after in zip(("q", "k", "v", "grad_out", "out", "lse"), case.args, outcome.args_after):
                if not torch.equal(before, after):
                    raise Fail(f"{case.name}: your function changed {name} in place; work on new tensors.")
    return checklist.results


def _backward_reference(q, k, v, grad_out, out, lse, q_positions, k_positions, key_padding_mask=None, is_causal=False):
    return library_ring_step_backward(q, k, v, grad_out, out, lse, q_positions=q_positions, k_positions=k_positions,
                                      key_padding_mask=key_padding_mask, is_causal=is_causal)


def _backward_by_hand(q, k, v, grad_out, out, lse, q_positions, k_positions, key_padding_mask=None, is_causal=False, *,
                      block_lse=False, delta="right", scale_times=1, causal=True, padding=True, transpose_dv=False,
                      guard=True):
    """FlashAttention's backward for one block, written out, with one classic mistake switched on."""
    scale = 1 / math.sqrt(q.shape[-1])
    scores = q @ k.transpose(-2, -1) * scale  # (B, H, Lq, Lk)
    allowed = torch.ones(scores.shape[-2:], dtype=torch.bool)
    if is_causal and causal:
        allowed = k_positions[None, :] <= q_positions[:, None]  # (Lq, Lk)
    if key_padding_mask is not None and padding:
        allowed = allowed & key_padding_mask[:, None, None, :]  # (B, 1, Lq, Lk)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if block_lse:
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    if guard:
        lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    weights = torch.exp(scores - lse)  # (B, H, Lq, Lk)
    grad_v = (weights if transpose_dv else weights.transpose(-2, -1)) @ grad_out  # (B, H, Lk, Dv)
    grad_weights = grad_out @ v.transpose(-2, -1)  # (B, H, Lq, Lk)
    row = {"right": (grad_out * out).sum(-1, keepdim=True), "none": 0.0, "grad_only": grad_out.sum(-1, keepdim=True)}
    grad_scores = weights * (grad_weights - row[delta]) * scale**scale_times  # (B, H, Lq, Lk)
    return grad_scores @ k, grad_scores.transpose(-2, -1) @ q, grad_v


def _backward_wrong(**mistake):
    def backward(q, k, v, grad_out, out, lse, q_positions, k_positions, key_padding_mask=None, is_causal=False):
        return _backward_by_hand(q, k, v, grad_out, out, lse, q_positions, k_positions, key_padding_mask, is_causal,
                                 **mistake)

    return backward


RING_STEP_BACKWARD = Task(
    id="12.ring_step_backward",
    title="Stretch: one block's gradients for the ring's backward pass",
    function_name="ring_step_backward",
    make_cases=_backward_cases,
    judge=_judge_backward,
    reference=_backward_reference,
    wrong={
        "softmax over this block only": (_backward_wrong(block_lse=True), "final lse"),
        "no delta": (_backward_wrong(delta="none"), "is missing: dS = P * (dP - delta)"),
        "delta from grad_out alone": (_backward_wrong(delta="grad_only"), "not grad_out alone"),
        "no scale in dS": (_backward_wrong(scale_times=0), "a 1/sqrt(D): the scores were"),
        "scale applied twice": (_backward_wrong(scale_times=2), "applied twice"),
        "causal mask forgotten in backward": (_backward_wrong(causal=False), "causal mask is missing"),
        "padding mask forgotten in backward": (_backward_wrong(padding=False), "padding mask is missing"),
        "dv without the transpose": (_backward_wrong(transpose_dv=True), "transpose the weights"),
        "NaN for rows with no allowed key": (_backward_wrong(guard=False), "lse = 0 there"),
    },
)
