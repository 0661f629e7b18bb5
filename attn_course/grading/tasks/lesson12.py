"""Graded tasks for lesson 12 (attention across devices): the zig-zag layout, one ring step, and (stretch) its backward.

Each task is the library's own concept, so calling the library's implementation of it gives the
task zero (``forbidden``): ``sequence_positions`` for the layout, ``ring_step`` (or
``ring_attention``) for the ring step, ``ring_step_backward`` for its gradients. Lesson 07's
``partial_attention`` and ``merge_partials`` stay allowed: the ring step is built on them. The
ring step is also graded on its form (``measure``): a rank holds one block of scores at a time,
so nothing it builds may be larger than the block's ``(B, H, Lq, Lk)`` scores (or its inputs);
an ``(L, L)`` causal mask of the whole sequence, or scores as a broadcast ``(Lq, Lk, D)``
product, give the right values the wrong way.
"""

from __future__ import annotations

import math

import torch

from ...chunked import PartialAttention, finish_partial, log_sum_exp, merge_partials, partial_attention
from ...distributed import ring_step as library_ring_step
from ...distributed import ring_step_backward as library_ring_step_backward
from ...distributed import sequence_positions
from ..core import Case, Fail, Task, Wrong
from ..judging import Checklist, expect_close, expect_dtype, expect_finite, expect_largest_below, expect_shape
from ._common import returned, seeded_randn
from ._variants import distinct_match

__all__ = ["ZIGZAG_POSITIONS", "RING_STEP", "RING_STEP_BACKWARD"]


# --- 12.zigzag_positions -------------------------------------------------------------------
# The learner writes zigzag_positions(seq_len, world_size) -> a list of world_size integer
# tensors: cut the sequence into 2W equal chunks; rank r holds chunk r, then chunk 2W - 1 - r.
# It raises ValueError when 2W does not divide seq_len.

_ZIGZAG_SIZES = [(16, 4), (24, 3), (8, 1), (12, 2)]
_ZIGZAG_BAD = [(10, 4), (12, 4), (20, 4)]  # 12 and 20 are multiples of 4 but not of 8


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
        """Every good case's positions; a case that raised fails the check (it is a failed case, not a skipped one)."""
        return [(case, _positions_of(outcome, case)) for case, outcome in good]

    with checklist.check("one tensor of L/W token positions per rank"):
        answered()
    with checklist.check("every position on exactly one rank"):
        for case, ranks in answered():
            L, _ = case.args
            every = torch.sort(torch.cat(ranks)).values
            if not torch.equal(every, torch.arange(L)):
                missing = sorted(set(range(L)) - set(every.tolist()))
                W = case.args[1]
                chunk = torch.arange(L).view(2 * W, L // (2 * W))  # (2W, c): row i is chunk i
                too_far = [torch.cat([chunk[r], chunk[(2 * W - r) % (2 * W)]]) for r in range(W)]  # chunk 2W wraps to 0
                story = ""
                if all(torch.equal(got, want) for got, want in zip(ranks, too_far)):
                    story = (" Your late chunk is chunk 2W - r, one too far: rank r's late chunk is the one that "
                             "mirrors its early chunk, chunk 2W - 1 - r.")
                raise Fail(
                    f"{case.name}: the ranks together should hold 0..{L - 1} once each; "
                    + (f"position {missing[0]} is on no rank" if missing else "some position is on two ranks")
                    + "." + story
                )
    with checklist.check("causal work is the same on every rank"):
        for case, ranks in answered():
            load = _causal_load(ranks)
            if len(set(load)) > 1:
                low, high = load.index(min(load)), load.index(max(load))
                hint = ""
                if torch.equal(torch.cat(ranks), torch.arange(case.args[0])):
                    hint = " This is the contiguous split: the last rank's queries see the whole sequence, the first's only their own block."
                L, W = case.args
                c = L // (2 * W)
                plus_w = [torch.cat([torch.arange(r * c, (r + 1) * c), torch.arange((r + W) * c, (r + W + 1) * c)])
                          for r in range(W)]
                if all(torch.equal(got, want) for got, want in zip(ranks, plus_w)):
                    hint = (" You paired chunk r with chunk r + W: the late chunks rise with r as the early ones do, "
                            "so the imbalance stays. A rank's late chunk must fall as its early chunk rises.")
                raise Fail(
                    f"{case.name}: with a causal mask rank {high} would compute {load[high]} query-key pairs and rank "
                    f"{low} only {load[low]}: the ring waits for the slowest rank at every step.{hint}"
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
    partial_check = any(o.error is not None and o.error.startswith("ValueError") for _, o in bad)
    with checklist.check("raises ValueError when 2 * world_size does not divide seq_len"):
        for case, outcome in bad:
            L, W = case.args
            if outcome.not_implemented:
                returned(outcome, what=case.name)
            if outcome.error is None:
                if partial_check and L % W == 0:
                    raise Fail(
                        f"{case.name} returned: you refuse a length that world_size does not divide, but {L} tokens, "
                        f"though a multiple of {W}, cannot be cut into 2 * world_size = {2 * W} equal chunks. The "
                        "ValueError must come whenever the 2W chunks do not fit."
                    )
                raise Fail(
                    f"{case.name} returned instead of raising: {L} tokens cannot be cut into 2 * world_size = {2 * W} "
                    "equal chunks, and silently dropping tokens is no answer: raise a ValueError that says so."
                )
            if not outcome.error.startswith("ValueError"):
                raise Fail(f"{case.name} should raise ValueError, but raised {outcome.error}")
    return checklist.results


def _zigzag_reference(seq_len, world_size):
    """Written out: the library's sequence_positions is what this task asks for."""
    chunks = 2 * world_size
    if seq_len % chunks:
        raise ValueError(f"seq_len = {seq_len} is not divisible by 2 * world_size = {chunks}")
    chunk = torch.arange(seq_len).view(chunks, seq_len // chunks)  # (2W, L/2W): row i is chunk i
    return [torch.cat([chunk[r], chunk[chunks - 1 - r]]) for r in range(world_size)]  # W x (L/W,)


def _zigzag_lists(seq_len, world_size):
    """Correct: plain Python lists, built token by token."""
    if seq_len % (2 * world_size):
        raise ValueError("pad the sequence")
    chunk = seq_len // (2 * world_size)
    return [[r * chunk + i for i in range(chunk)] + [(2 * world_size - 1 - r) * chunk + i for i in range(chunk)]
            for r in range(world_size)]


def _zigzag_int32_chunks(seq_len, world_size):
    """Correct: int32 positions from torch.chunk, returned as a tuple."""
    if seq_len % (2 * world_size):
        raise ValueError("pad the sequence")
    chunks = torch.arange(seq_len, dtype=torch.int32).chunk(2 * world_size)
    return tuple(torch.cat([chunks[r], chunks[-1 - r]]) for r in range(world_size))


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
    per_rank = seq_len // world_size
    return [torch.arange(r * per_rank, (r + 1) * per_rank) for r in range(world_size)]


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


def _zigzag_late_index_overflows(seq_len, world_size):
    """Issue 20's mutant: the late chunk at chunks - 1 + r, right at W = 1, an IndexError for every W >= 2."""
    chunks = 2 * world_size
    if seq_len % chunks:
        raise ValueError(f"seq_len = {seq_len} is not divisible by 2 * world_size = {chunks}")
    chunk = torch.arange(seq_len).view(chunks, seq_len // chunks)  # (2W, L/2W)
    return [torch.cat([chunk[r], chunk[chunks - 1 + r]]) for r in range(world_size)]


def _zigzag_delegates(seq_len, world_size):
    import attn_course as ac

    return ac.sequence_positions(seq_len, world_size, layout="zigzag")


ZIGZAG_POSITIONS = Task(
    id="12.zigzag_positions",
    title="The zig-zag layout: which tokens each rank holds",
    function_name="zigzag_positions",
    make_cases=_zigzag_cases,
    judge=_judge_zigzag,
    reference=_zigzag_reference,
    wrong={
        "contiguous split": Wrong(_zigzag_contiguous, "contiguous split"),
        "pairs chunk r with chunk r + W": Wrong(_zigzag_strided_pair, "paired chunk r with chunk r + W"),
        "late chunk first": Wrong(_zigzag_late_first, "put the early chunk first"),
        "late chunk off by one (2W - r)": Wrong(_zigzag_off_by_one, "one too far"),
        "chunk numbers instead of token positions": Wrong(_zigzag_chunk_numbers, "not the chunk numbers"),
        "no error when 2W does not divide L": Wrong(_zigzag_never_raises, "returned instead of raising"),
        "checks only L % W": Wrong(_zigzag_checks_world_size_only, "though a multiple of"),
        "late chunk at chunks - 1 + r (IndexError for W >= 2)": Wrong(_zigzag_late_index_overflows, "raised IndexError"),
        "calls attn_course.sequence_positions": Wrong(
            _zigzag_delegates, "you called attn_course.sequence_positions", kind="algorithm"
        ),
    },
    accepted={"plain lists, token by token": _zigzag_lists, "int32 chunks in a tuple": _zigzag_int32_chunks},
    forbidden=("attn_course.distributed.layout.sequence_positions",),
)


# --- 12.ring_step --------------------------------------------------------------------------
# The learner writes ring_step(running, q, k, v, q_positions, k_positions, key_padding_mask=None,
# is_causal=False) -> (acc, row_max, row_sum): this rank's queries q (B, H, Lq, D) against the
# K/V block that just arrived (B, H, Lk, D/Dv), merged into running (None at the first step)
# with the online softmax of lesson 07. The causal mask compares global positions; the padding
# mask (B, Lk), True = real key, came with the block. Scale 1 / sqrt(D).


def _partial(q, k, v, q_positions, k_positions, key_padding_mask=None, is_causal=False, running=None):
    """The library's step, as the PartialAttention the task statement names (a named (acc, row_max, row_sum) tuple)."""
    return PartialAttention(*library_ring_step(running, q, k, v, q_positions=q_positions, k_positions=k_positions,
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
    # Four ranks, zig-zag, L = 64 (16 tokens per rank), causal and padded: large enough that an (L, L)
    # mask of the whole sequence (4096) is 4 times the block's (B, H, Lq, Lk) scores (1024).
    zig4 = sequence_positions(64, 4, layout="zigzag")
    q4, k4, v4 = randn(B, H, 64, D), randn(B, H, 64, D), randn(B, H, 64, Dv)
    keep4 = torch.ones(B, 64, dtype=torch.bool)  # (B, L), True = real token
    keep4[0, 34:40] = False  # batch 0: padding inside rank 3's block
    keep4[0, 60:] = False  # ... and at the end of the sequence, in rank 0's block
    keep4[1, :3] = False  # batch 1: queries 0-2 see no key at all when causal
    own4 = (q4[..., zig4[0], :], k4[..., zig4[0], :], v4[..., zig4[0], :])
    running_own4 = _partial(*own4, zig4[0], zig4[0], keep4[:, zig4[0]], is_causal=True)

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
        case("4 ranks, L = 64, causal and padded: rank 0's own block at step 0 (positions 0-7 and 56-63)",
             None, *own4, zig4[0], zig4[0], key_padding_mask=keep4[:, zig4[0]], is_causal=True),
        case("4 ranks, L = 64, causal and padded: rank 0 merges rank 3's block (positions 24-39) at step 1",
             running_own4, own4[0], k4[..., zig4[3], :], v4[..., zig4[3], :], zig4[0], zig4[3],
             key_padding_mask=keep4[:, zig4[3]], is_causal=True),
    ]


_FIRST, _MERGE, _CAUSAL_OTHER, _CAUSAL_OWN, _PADDED, _FUTURE, _LAST, _WIDE_OWN, _WIDE_OTHER = range(9)


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


def _close_or_diagnosed(got: torch.Tensor, expected: torch.Tensor, *, what: str, diagnose) -> None:
    """``expect_close`` (float64 tolerances); only wrong values pay for ``diagnose()``, which tries a dozen variants."""
    try:
        expect_close(got, expected, what=what, atol=1e-9, rtol=1e-7)
    except Fail:
        expect_close(got, expected, what=what, atol=1e-9, rtol=1e-7, hint=diagnose() or "")
        raise


def _block_limit(case: Case) -> int:
    """The largest tensor an honest step needs: the block's (B, H, Lq, Lk) scores, or an input's size (a copy of q)."""
    running, q, k, v = case.args
    sizes = [q[..., 0].numel() * k.shape[-2], q.numel(), k.numel(), v.numel()]
    return max(sizes + [t.numel() for t in running or ()])


def _form_advice(outcome, case: Case) -> str:
    """What a ring step never builds, and how to avoid the largest tensor this function built."""
    _, q, k, _ = case.args
    B, H, Lq, _ = q.shape
    shape = outcome.probe.get("largest_shape") if isinstance(outcome.probe, dict) else None
    dims = len(shape.split(" x ")) if isinstance(shape, str) and shape else 0
    advice = (f"a ring step holds one block of scores at a time, so nothing it builds needs to be larger than this "
              f"block's (B, H, Lq, Lk) = ({B}, {H}, {Lq}, {k.shape[-2]}) scores, or than its inputs.")
    if dims == 2:
        advice += (" The causal mask of a block depends only on the block's two position vectors, (Lq, Lk): an "
                   "(L, L) mask of the whole sequence is what splitting the sequence is meant to avoid.")
    elif dims >= 5:
        advice += (" A broadcast product over (Lq, Lk, D) holds D numbers for every score before the sum; a matrix "
                   "product holds only the scores.")
    return advice


def _judge_ring_step(cases, outcomes):
    checklist = Checklist()
    expected_of: dict[int, tuple] = {}  # the library's partial for each case, computed once

    def parts(index):
        case, outcome = cases[index], outcomes[index]
        got = tuple(returned(outcome, what=case.name, index=i) for i in range(3))
        if index not in expected_of:
            expected_of[index] = _expected_step(case)
        expected = expected_of[index]
        for value, want, label in zip(got, expected, ("acc", "row_max", "row_sum")):
            expect_shape(value, want.shape, what=f"{case.name}: {label}",
                         hint="acc is (B, H, Lq, Dv); row_max and row_sum are (B, H, Lq, 1), as in lesson 07.")
        return case, got, expected

    def ran() -> list[int]:
        """Every case: `parts(i)` fails the check for a case that raised (a failed case, not a skipped one)."""
        return list(range(len(outcomes)))

    def compare(index):
        case, (acc, row_max, row_sum), (want_acc, want_max, want_sum) = parts(index)
        for value, label in ((acc, "acc"), (row_sum, "row_sum")):
            if torch.isnan(value).any():
                raise Fail(f"{case.name}: NaN in {label}. A row with no allowed key has max -inf, and exp(-inf - (-inf)) "
                           "= exp(nan): shift by 0 where the max is -inf (lesson 07's partial_attention and merge_partials do).")
        _close_or_diagnosed(acc, want_acc, what=f"{case.name}: acc", diagnose=lambda: _diagnose_step(acc, case))
        _close_or_diagnosed(row_sum, want_sum, what=f"{case.name}: row_sum", diagnose=lambda: _diagnose_step(acc, case))
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
        ("rows with no allowed key: no NaN, acc 0, row_sum 0, row_max -inf (running=None, block in the future)",
         (_FUTURE,)),
        ("4 ranks, L = 64, causal and padded: the own block, then another rank's", (_WIDE_OWN, _WIDE_OTHER)),
    ):
        with checklist.check(title):
            for index in indices:
                compare(index)
    with checklist.check("after the last step, acc / row_sum is attention over the whole sequence"):
        case, (acc, _, row_sum), _ = parts(_LAST)
        expected = finish_partial(PartialAttention(*_expected_step(case)))  # equals SDPA over all 18 tokens
        got = acc / torch.where(row_sum == 0, torch.ones_like(row_sum), row_sum)
        _close_or_diagnosed(got, expected, what=f"{case.name}: acc / row_sum", diagnose=lambda: _diagnose_step(acc, case))
    with checklist.check("holds one block of scores at a time: nothing larger than the block's (B, H, Lq, Lk) scores"):
        for index in ran():
            case, outcome = cases[index], outcomes[index]
            parts(index)  # a number for the form only once the function returns partials of the right shapes
            expect_largest_below(outcome, _block_limit(case) + 1, what=case.name, constraint=_form_advice(outcome, case))
    with checklist.check("leaves running, q, k and v unchanged"):
        for index in ran():
            parts(index)  # a case that raised is a failed case here too
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
    """Written out on lesson 07's partial_attention and merge_partials (the library's ring_step is the task)."""
    return _by_hand(running, q, k, v, q_positions, k_positions, key_padding_mask, is_causal)


def _ring_step_with_lesson_07_helpers(running, q, k, v, q_positions, k_positions, key_padding_mask=None,
                                      is_causal=False):
    """Correct: ac.partial_attention on the masked scores, then ac.merge_partials straight on `running` as passed."""
    import attn_course as ac

    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, Lq, Lk)
    allowed = torch.ones(scores.shape[-2:], dtype=torch.bool)  # (Lq, Lk)
    if is_causal:
        allowed = k_positions[None, :] <= q_positions[:, None]  # (Lq, Lk), global positions
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask[:, None, None, :]  # (B, 1, Lq, Lk)
    block = ac.partial_attention(scores.masked_fill(~allowed, float("-inf")), v)
    return block if running is None else ac.merge_partials(running, block)


def _ring_step_from_scratch(running, q, k, v, q_positions, k_positions, key_padding_mask=None, is_causal=False):
    """Correct: written out without lesson 07's helpers, with einsum and torch.where."""
    scores = torch.einsum("bhld,bhsd->bhls", q, k) / q.shape[-1] ** 0.5  # (B, H, Lq, Lk)
    allowed = torch.ones_like(scores, dtype=torch.bool)  # (B, H, Lq, Lk)
    if is_causal:
        allowed = allowed & (k_positions.view(1, 1, 1, -1) <= q_positions.view(1, 1, -1, 1))
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask.view(q.shape[0], 1, 1, -1)
    block_max = torch.where(allowed, scores, torch.full_like(scores, -torch.inf)).amax(-1, keepdim=True)  # (B, H, Lq, 1)
    if running is None:
        running = (torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype), torch.full_like(block_max, -torch.inf),
                   torch.zeros_like(block_max))
    acc, row_max, row_sum = running
    new_max = torch.maximum(row_max, block_max)  # (B, H, Lq, 1)
    shift = torch.nan_to_num(new_max, neginf=0.0)  # 0 where no key was allowed yet
    exps = torch.exp(scores - shift) * allowed  # (B, H, Lq, Lk)
    old = torch.exp(row_max - shift)  # (B, H, Lq, 1)
    return acc * old + exps @ v, new_max, row_sum * old + exps.sum(-1, keepdim=True)


def _by_hand(running, q, k, v, q_positions, k_positions, key_padding_mask=None, is_causal=False, *,
             local=False, strict=False, flip=False, ignore_mask=False, scale=None, merge="online", nan=False,
             in_place=False, finish=False, whole_mask=False, broadcast=False):
    """One ring step written out, with one classic mistake switched on."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    if broadcast:
        scores = (q[..., :, None, :] * k[..., None, :, :]).sum(-1) * scale  # (B, H, Lq, Lk) via (B, H, Lq, Lk, D)
    else:
        scores = q @ k.transpose(-2, -1) * scale  # (B, H, Lq, Lk)
    allowed = torch.ones(scores.shape[-2:], dtype=torch.bool)
    if is_causal and whole_mask:
        L = int(torch.maximum(q_positions.max(), k_positions.max())) + 1
        everything = torch.ones(L, L, dtype=torch.bool).tril()  # (L, L): the causal mask of the whole sequence
        allowed = everything[q_positions][:, k_positions]  # (Lq, Lk)
    elif is_causal:
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


def _ring_step_delegates(running, q, k, v, q_positions, k_positions, key_padding_mask=None, is_causal=False):
    import attn_course as ac

    return tuple(ac.ring_step(running, q, k, v, q_positions=q_positions, k_positions=k_positions,
                              key_padding_mask=key_padding_mask, is_causal=is_causal))


RING_STEP = Task(
    id="12.ring_step",
    title="One step of ring attention: merge the arriving K/V block",
    function_name="ring_step",
    make_cases=_ring_step_cases,
    judge=_judge_ring_step,
    reference=_ring_step_reference,
    wrong={
        "ignores the running partial": Wrong(_wrong(merge="replace"), "returned only the new block's partial"),
        "adds without rescaling": Wrong(_wrong(merge="add"), "rescale both"),
        "causal mask from local indices": Wrong(_wrong(local=True), "compare the global positions"),
        "causal mask off by one (<)": Wrong(_wrong(strict=True), "off by one"),
        "padding mask polarity flipped": Wrong(_wrong(flip=True), "wrong way round"),
        "padding mask ignored": Wrong(_wrong(ignore_mask=True), "padding mask is ignored"),
        "no 1/sqrt(D) scale": Wrong(_wrong(scale=1.0), "not scaled"),
        "NaN for rows with no allowed key": Wrong(_wrong(nan=True), "exp(nan)"),
        "returns the finished output": Wrong(_wrong(finish=True), "Keep acc unnormalised"),
        "updates running in place": Wrong(_wrong(in_place=True), "changed `running` in place", kind="contract"),
        "causal mask cut out of an (L, L) mask of the whole sequence": Wrong(
            _wrong(whole_mask=True), "an (L, L) mask of the whole sequence", kind="algorithm"
        ),
        "scores as a broadcast (Lq, Lk, D) product": Wrong(
            _wrong(broadcast=True), "A broadcast product over (Lq, Lk, D)", kind="algorithm"
        ),
        "calls attn_course.ring_step": Wrong(_ring_step_delegates, "you called attn_course.ring_step", kind="algorithm"),
    },
    accepted={"written out without lesson 07's helpers (einsum, torch.where)": _ring_step_from_scratch,
              "ac.partial_attention, then ac.merge_partials on running as the grader passes it":
                  _ring_step_with_lesson_07_helpers},
    measure=("largest",),
    forbidden=("attn_course.distributed.ring.ring_step", "attn_course.distributed.ring.ring_attention"),
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
        out, lse = finish_partial(running), log_sum_exp(running)
        cases.append(Case(name, (q[..., zig[0], :], k[..., zig[source], :], v[..., zig[source], :],
                                 grad_out[..., zig[0], :], out, lse),
                          dict(q_positions=zig[0], k_positions=zig[source],
                               key_padding_mask=None if mask is None else mask[:, zig[source]], is_causal=is_causal)))
    # Fewer queries than keys, so a transposed product cannot have the right shape by accident.
    q4, k4, v4, g4 = randn(1, 1, 3, D), randn(1, 1, 7, D), randn(1, 1, 7, Dv), randn(1, 1, 3, Dv)
    positions_q, positions_k = torch.arange(7, 10), torch.arange(7)
    running = library_ring_step(None, q4, k4, v4, q_positions=positions_q, k_positions=positions_k)
    cases.append(Case("3 queries against a block of 7 keys (Lq != Lk), not causal, out and lse from this block alone",
                      (q4, k4, v4, g4, finish_partial(running), log_sum_exp(running)),
                      dict(q_positions=positions_q, k_positions=positions_k, key_padding_mask=None, is_causal=False)))
    # Padded, not causal: batch 1's whole sequence is padding, so every one of its rows has lse = -inf.
    empty = torch.ones(B, L, dtype=torch.bool)  # (B, L), True = real key
    empty[0, 8:12] = False  # batch 0: four padded keys inside rank 2's block (positions 6-11)
    empty[1, :] = False
    running = None
    for block in range(W):  # rank 1's queries (positions 3-5, 12-14) over the whole ring
        running = library_ring_step(running, q[..., zig[1], :], k[..., zig[block], :], v[..., zig[block], :],
                                    q_positions=zig[1], k_positions=zig[block], key_padding_mask=empty[:, zig[block]])
    cases.append(Case("padded, not causal: rank 1 against rank 2's block; batch 1 is all padding (every lse = -inf)",
                      (q[..., zig[1], :], k[..., zig[2], :], v[..., zig[2], :], grad_out[..., zig[1], :],
                       finish_partial(running), log_sum_exp(running)),
                      dict(q_positions=zig[1], k_positions=zig[2], key_padding_mask=empty[:, zig[2]], is_causal=False)))
    return cases


_BW_PLAIN, _BW_CAUSAL, _BW_PADDED, _BW_RECT, _BW_EMPTY = range(5)
_SHAPE_HINTS = [(needle, "two shapes do not fit in a matmul (the block has fewer queries than keys here): each "
                 "gradient has the shape of what it is the gradient of, dq_part like q, dk like k, dv like v.")
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
        (lambda: variant(lse=log_sum_exp(block_only)),
         "you recomputed the softmax over this block only. The weights are exp(scores - lse) with the *final* lse "
         "of each query over every key of the sequence: use the lse you are given."),
        (lambda: variant(out=torch.zeros_like(out)),
         "delta is missing: dS = P * (dP - delta) with delta = rowsum(grad_out * out), the "
         "softmax's correction for every weight of the row."),
        (lambda: variant(out=torch.ones_like(out)),
         "delta is rowsum(grad_out * out): the product with the output, not grad_out alone."),
        (lambda: expected[index] / scale,
         "missing a 1/sqrt(D): the scores were q @ k^T * scale, so dS carries the scale into dq and dk once."),
        (lambda: expected[index] * scale,
         "the scale is applied twice (e.g. dS scaled and q scaled again): dk = dS^T q * scale, dq = dS k * scale."),
        (_when(kwargs["is_causal"], lambda: variant(is_causal=False)),
         "the causal mask is missing in the backward pass: recompute the scores with the same mask as forward."),
        (_when(keep is not None, lambda: variant(key_padding_mask=None)),
         "the padding mask is missing in the backward pass: padded keys get zero weight, and zero gradient."),
        (_when(label == "dv", lambda: _backward_by_hand(
            q, k, v, grad_out, out, lse, kwargs["q_positions"], kwargs["k_positions"], keep, kwargs["is_causal"],
            transpose_dv=True)[2]),
         "your dv is P @ grad_out, the weights untransposed: dv = P^T @ grad_out, a sum over the queries for each key."),
    ])


def _judge_backward(cases, outcomes):
    checklist = Checklist()
    expected_of: dict[int, tuple] = {}  # the library's gradients for each case, computed once

    def parts(index):
        case, outcome = cases[index], outcomes[index]
        got = tuple(returned(outcome, what=case.name, index=i, hints=_SHAPE_HINTS) for i in range(3))
        if index not in expected_of:
            expected_of[index] = _expected_backward(case)
        expected = expected_of[index]
        hints = ("dq_part has q's shape (B, H, Lq, D).", "dk has k's shape (B, H, Lk, D): dS^T @ q.",
                 "dv has v's shape (B, H, Lk, Dv): one row per key.")
        for value, want, label, hint in zip(got, expected, ("dq_part", "dk", "dv"), hints):
            expect_shape(value, want.shape, what=f"{case.name}: {label}", hint=hint)
            expect_dtype(value, want.dtype, what=f"{case.name}: {label}")
        return case, got, expected

    def ran() -> list[int]:
        """Every case: `parts(i)` fails the check for a case that raised (a failed case, not a skipped one)."""
        return list(range(len(outcomes)))

    def compare(index, labels=("dq", "dk", "dv")):
        case, got, expected = parts(index)
        for label, value, want in zip(("dq", "dk", "dv"), got, expected):
            if label not in labels:
                continue
            expect_finite(value, what=f"{case.name}: {label}", hint=(
                "A row with no allowed key has lse = -inf; its scores are -inf too, so use lse = 0 there and every "
                "weight is exp(-inf) = 0."))
            _close_or_diagnosed(value, want, what=f"{case.name}: {label}",
                                diagnose=lambda: _diagnose_backward(label, value, case))

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
    with checklist.check("padding, and rows with no allowed key (lse = -inf): zeros, not NaN"):
        compare(_BW_PADDED)
        compare(_BW_EMPTY)
    with checklist.check("leaves its inputs unchanged"):
        for index in ran():
            parts(index)  # a case that raised is a failed case here too
            case, outcome = cases[index], outcomes[index]
            for name, before, after in zip(("q", "k", "v", "grad_out", "out", "lse"), case.args, outcome.args_after):
                if not torch.equal(before, after):
                    raise Fail(f"{case.name}: your function changed {name} in place; work on new tensors.")
    return checklist.results


def _backward_reference(q, k, v, grad_out, out, lse, q_positions, k_positions, key_padding_mask=None, is_causal=False):
    """Written out (the library's ring_step_backward is what this task asks for)."""
    return _backward_by_hand(q, k, v, grad_out, out, lse, q_positions, k_positions, key_padding_mask, is_causal)


def _backward_from_autograd(q, k, v, grad_out, out, lse, q_positions, k_positions, key_padding_mask=None,
                            is_causal=False):
    """Correct: dq, dk, dv by autograd through this block's share of the output instead of the formulas."""
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5  # (B, H, Lq, Lk)
    allowed = torch.ones(scores.shape[-2:], dtype=torch.bool)
    if is_causal:
        allowed = k_positions[None, :] <= q_positions[:, None]
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask[:, None, None, :]
    weights = torch.exp(scores.masked_fill(~allowed, -torch.inf) - torch.nan_to_num(lse, neginf=0.0))
    delta = (grad_out * out).sum(-1, keepdim=True)  # (B, H, Lq, 1)
    # d(out)/d(scores) through this block's weights only (lse is a constant), and d(out)/d(v).
    share = (weights * (grad_out @ v.transpose(-2, -1) - delta).detach()).sum() + (weights.detach() @ v * grad_out).sum()
    return torch.autograd.grad(share, (q, k, v))


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


def _backward_delegates(q, k, v, grad_out, out, lse, q_positions, k_positions, key_padding_mask=None, is_causal=False):
    import attn_course as ac

    return ac.ring_step_backward(q, k, v, grad_out, out, lse, q_positions=q_positions, k_positions=k_positions,
                                 key_padding_mask=key_padding_mask, is_causal=is_causal)


RING_STEP_BACKWARD = Task(
    id="12.ring_step_backward",
    title="One block's gradients for the ring's backward pass",
    function_name="ring_step_backward",
    make_cases=_backward_cases,
    judge=_judge_backward,
    reference=_backward_reference,
    wrong={
        "softmax over this block only": Wrong(_backward_wrong(block_lse=True), "recomputed the softmax over this block only"),
        "no delta": Wrong(_backward_wrong(delta="none"), "is missing: dS = P * (dP - delta)"),
        "delta from grad_out alone": Wrong(_backward_wrong(delta="grad_only"), "not grad_out alone"),
        "no scale in dS": Wrong(_backward_wrong(scale_times=0), "a 1/sqrt(D): the scores were"),
        "scale applied twice": Wrong(_backward_wrong(scale_times=2), "applied twice"),
        "causal mask forgotten in backward": Wrong(_backward_wrong(causal=False), "causal mask is missing"),
        "padding mask forgotten in backward": Wrong(_backward_wrong(padding=False), "padding mask is missing"),
        "dv without the transpose": Wrong(_backward_wrong(transpose_dv=True), "the weights untransposed"),
        "NaN for rows with no allowed key": Wrong(_backward_wrong(guard=False), "lse = 0 there"),
        "calls attn_course.ring_step_backward": Wrong(
            _backward_delegates, "you called attn_course.ring_step_backward", kind="algorithm"
        ),
    },
    accepted={"autograd through this block's share of the output": _backward_from_autograd},
    forbidden=("attn_course.distributed.ring.ring_step_backward",),
    stretch=True,
)
