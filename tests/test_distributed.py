"""Ring and head-parallel (Ulysses) attention across processes: exact, measured, and clear when misused.

The oracle is ``F.scaled_dot_product_attention`` on the whole sequence in one process, in float64,
outputs and gradients. Multi-process tests start real process groups on this machine (gloo on the
CPU; NCCL where GPUs exist, through the ``device`` fixture). Workers fork from a server process
that imported the library once, so a process group costs about 0.1-0.3 s after the first.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

import attn_course as ac
from attn_course import distributed as dist_attn
from attn_course.distributed import runner
from attn_course.distributed.layout import block_plan, chunk_length
from attn_course.chunked import finish_partial, log_sum_exp

# Measured with these inputs: the largest |difference| from F.scaled_dot_product_attention over
# every configuration below was 1.6e-15 (outputs and gradients); the bound leaves a wide margin
# and still catches any wrong block, mask or merge (those differ by 1e-2 or more).
TOL = 1e-10


def _inputs(B, H, L, D, Dv, *, seed=0, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, L, D, generator=generator, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, H, L, Dv, generator=generator, dtype=torch.float64)
    grad_out = torch.randn(B, H, L, Dv, generator=generator, dtype=torch.float64)
    return [x.to(device) for x in (q, k, v, grad_out)]


def _padding(B, L, device="cpu"):
    """Batch 0 ends in padding; batch 1 starts with 3 padded keys, so its first queries see no key when causal."""
    keep = torch.ones(B, L, dtype=torch.bool, device=device)  # (B, L), True = real token
    keep[0, L - L // 3:] = False
    keep[1 % B, :3] = False
    return keep


def _oracle(q, k, v, grad_out, keep, is_causal):
    """F.scaled_dot_product_attention on the whole sequence: output and gradients of (out * grad_out).sum().

    k and v may have fewer heads than q (grouped-query attention): PyTorch's ``enable_gqa``.
    """
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    L = q.shape[-2]
    mask = None
    if keep is not None:
        mask = keep[:, None, None, :].expand(-1, 1, L, L)  # (B, 1, L, L)
    if is_causal:
        causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()  # (L, L)
        mask = causal if mask is None else mask & causal  # never pass a mask and is_causal together
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
    out.backward(grad_out)
    return out.detach(), (q.grad, k.grad, v.grad)


def _gqa_inputs(B, H, Hkv, L, D, Dv, *, seed=0):
    """q (B, H, L, D), k (B, Hkv, L, D), v (B, Hkv, L, Dv), grad_out (B, H, L, Dv), float64."""
    q, _, _, grad_out = _inputs(B, H, L, D, Dv, seed=seed)
    _, k, v, _ = _inputs(B, Hkv, L, D, Dv, seed=seed + 1)
    return q, k, v, grad_out


def _assert_exact(run, expected_out, expected_grads, label):
    errors = [(run.out - expected_out).abs().max().item()]
    errors += [(a - b).abs().max().item() for a, b in zip(run.grads, expected_grads)]
    assert max(errors) < TOL, f"{label}: max |difference| {max(errors):.3g} (out, dq, dk, dv: {errors})"


# --- which tokens live where -------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_positions_partition_the_sequence(world_size, layout):
    L = 4 * world_size
    positions = ac.sequence_positions(L, world_size, layout=layout)
    assert len(positions) == world_size and all(p.shape == (L // world_size,) for p in positions)
    assert torch.equal(torch.sort(torch.cat(positions)).values, torch.arange(L))


def test_zigzag_is_pytorchs_head_tail_layout():
    """PyTorch's context parallelism shards causal attention with its head-tail load balancer."""
    balancer = pytest.importorskip("torch.distributed.tensor.experimental._context_parallel._load_balancer")
    for L, W in ((16, 4), (24, 3), (8, 1), (40, 5)):
        theirs = balancer._HeadTailLoadBalancer(L, W, "cpu")._generate_indices()[0].long()  # (L,) rank-major
        assert torch.equal(torch.cat(ac.sequence_positions(L, W, layout="zigzag")), theirs), (L, W)


def test_zigzag_small_example():
    assert [p.tolist() for p in ac.sequence_positions(8, 2, layout="zigzag")] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert [p.tolist() for p in ac.sequence_positions(8, 2, layout="contiguous")] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_positions_reject_a_world_size_that_does_not_divide_the_sequence():
    with pytest.raises(ValueError, match="not divisible by world_size = 4"):
        ac.sequence_positions(10, 4, layout="contiguous")
    with pytest.raises(ValueError, match="2 \\* world_size = 4 equal chunks.*pad it to 12"):
        ac.sequence_positions(10, 2, layout="zigzag")
    with pytest.raises(ValueError, match="layout must be one of"):
        ac.sequence_positions(8, 2, layout="striped")


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_shard_and_gather_are_inverse(layout):
    x = torch.arange(2 * 3 * 24).view(2, 3, 24)  # (B, H, L) with the sequence on dim -1
    shards = [ac.shard_sequence(x, r, 3, layout=layout, dim=-1) for r in range(3)]
    assert torch.equal(ac.gather_sequence(shards, layout=layout, dim=-1), x)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_block_plan_covers_every_allowed_pair_exactly_once(world_size, layout):
    """The blocks the ring computes hold every causal pair once, and skip only pairs in the future."""
    L = 4 * world_size
    positions = ac.sequence_positions(L, world_size, layout=layout)
    covered = torch.zeros(L, L, dtype=torch.int64)  # (L, L): how often each allowed pair is computed
    for rank in range(world_size):
        for source in dist_attn.ring_schedule(world_size)[rank]:
            plan = block_plan(positions[rank], positions[source], is_causal=True,
                              max_run=chunk_length(L // world_size, layout))
            for qs, ks, causal in plan:
                rows, cols = positions[rank][qs], positions[source][ks]
                allowed = cols[None, :] <= rows[:, None] if causal is None else causal
                assert allowed.any(), "a block with nothing allowed should have been skipped"
                if causal is None:
                    assert bool(allowed.all()), "a block with future keys needs a causal mask"
                covered[rows[:, None], cols[None, :]] += allowed.long()
    assert torch.equal(covered, torch.ones(L, L, dtype=torch.int64).tril())


@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
def test_zigzag_balances_causal_work_and_contiguous_does_not(world_size):
    L = 4 * world_size
    local = L // world_size
    contiguous = dist_attn.causal_work(L, world_size, layout="contiguous")  # (W, W)
    zigzag = dist_attn.causal_work(L, world_size, layout="zigzag")
    assert contiguous.sum(1).tolist() == [(r + 1) * local**2 for r in range(world_size)]
    chunk = local // 2
    assert zigzag.tolist() == [[3 * chunk**2] + [2 * chunk**2] * (world_size - 1)] * world_size


def test_ring_schedule():
    assert dist_attn.ring_schedule(3) == [[0, 2, 1], [1, 0, 2], [2, 1, 0]]


# --- one ring step, in one process ---------------------------------------------------------


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_ring_steps_simulated_in_one_process_equal_attention(device, layout, is_causal, padded):
    """W ranks in a loop: rank r merges the block of rank (r - t) mod W at step t; forward and backward."""
    if device.type == "mps":
        pytest.skip("float64 is not available on MPS")
    B, H, L, W = 2, 3, 24, 3
    q, k, v, grad_out = _inputs(B, H, L, 8, 5, device=device)
    keep = _padding(B, L, device) if padded else None
    expected, expected_grads = _oracle(q, k, v, grad_out, keep, is_causal)
    positions = ac.sequence_positions(L, W, layout=layout)

    def shard(x, r, dim=-2):
        return ac.shard_sequence(x, r, W, layout=layout, dim=dim)

    outs, lses = [], []
    for rank in range(W):
        running = None
        for source in dist_attn.ring_schedule(W)[rank]:
            running = ac.ring_step(running, shard(q, rank), shard(k, source), shard(v, source),
                                   q_positions=positions[rank], k_positions=positions[source],
                                   key_padding_mask=None if keep is None else shard(keep, source, -1), is_causal=is_causal)
        outs.append(finish_partial(running))
        lses.append(log_sum_exp(running))  # (B, H, L/W, 1)
    assert (ac.gather_sequence(outs, layout=layout) - expected).abs().max() < TOL

    grads_q = [torch.zeros_like(shard(q, r)) for r in range(W)]
    grads_k = [torch.zeros_like(shard(k, r)) for r in range(W)]
    grads_v = [torch.zeros_like(shard(v, r)) for r in range(W)]
    for rank in range(W):
        for source in range(W):
            dq, dk, dv = ac.ring_step_backward(
                shard(q, rank), shard(k, source), shard(v, source), shard(grad_out, rank), outs[rank], lses[rank],
                q_positions=positions[rank], k_positions=positions[source],
                key_padding_mask=None if keep is None else shard(keep, source, -1), is_causal=is_causal)
            grads_q[rank] += dq
            grads_k[source] += dk
            grads_v[source] += dv
    for got, want in zip((grads_q, grads_k, grads_v), expected_grads):
        assert (ac.gather_sequence(got, layout=layout) - want).abs().max() < TOL


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_ring_steps_with_shared_key_value_heads(kv_heads):
    """Grouped-query attention (H = 4 query heads, Hkv = 1 or 2): the ring's steps, forward and backward, in one process."""
    B, H, L, W = 2, 4, 24, 3
    q, k, v, grad_out = _gqa_inputs(B, H, kv_heads, L, 8, 5)
    keep = _padding(B, L)
    expected, expected_grads = _oracle(q, k, v, grad_out, keep, True)
    positions = ac.sequence_positions(L, W)
    outs, lses = [], []
    for rank in range(W):
        running = None
        for source in dist_attn.ring_schedule(W)[rank]:
            running = ac.ring_step(running, q[..., positions[rank], :], k[..., positions[source], :],
                                   v[..., positions[source], :], q_positions=positions[rank],
                                   k_positions=positions[source], key_padding_mask=keep[:, positions[source]],
                                   is_causal=True)
        outs.append(finish_partial(running))
        lses.append(log_sum_exp(running))
    assert (ac.gather_sequence(outs) - expected).abs().max() < TOL
    grads = [torch.zeros_like(x) for x in (q, k, v)]
    for rank in range(W):
        for source in range(W):
            rows, cols = positions[rank], positions[source]
            dq, dk, dv = ac.ring_step_backward(q[..., rows, :], k[..., cols, :], v[..., cols, :], grad_out[..., rows, :],
                                               outs[rank], lses[rank], q_positions=rows, k_positions=cols,
                                               key_padding_mask=keep[:, cols], is_causal=True)
            assert dk.shape == (B, kv_heads, L // W, 8), "dk sums over the query heads that share a K/V head"
            grads[0][..., rows, :] += dq
            grads[1][..., cols, :] += dk
            grads[2][..., cols, :] += dv
    for got, want in zip(grads, expected_grads):
        assert (got - want).abs().max() < TOL


def test_ring_step_uses_global_positions_not_local_indices():
    """Rank 0 of a zig-zag pair holds positions 0,1 and 6,7: its late queries see all of rank 1's keys."""
    q, k, v, _ = _inputs(1, 1, 8, 4, 4)
    positions = ac.sequence_positions(8, 2, layout="zigzag")
    part = ac.ring_step(None, ac.shard_sequence(q, 0, 2), ac.shard_sequence(k, 1, 2), ac.shard_sequence(v, 1, 2),
                        q_positions=positions[0], k_positions=positions[1], is_causal=True)
    assert torch.isinf(part.row_max[0, 0, :2]).all(), "queries 0 and 1 see none of keys 2..5"
    assert torch.equal(part.row_sum[0, 0, 2:] > 0, torch.tensor([[True], [True]])), "queries 6 and 7 see them"


def test_ring_attention_without_a_process_group_is_single_process_attention(device):
    """No process group: W = 1, lesson 07's online softmax over the whole sequence (float32 and float16)."""
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 32, 16, generator=generator).to(device).requires_grad_(True) for _ in range(3))
    out = ac.ring_attention(q, k, v, is_causal=True)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)  # float32: measured 4e-7
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    half = ac.ring_attention(*(x.detach().half() for x in (q, k, v)), is_causal=True)
    assert half.dtype == torch.float16
    torch.testing.assert_close(half.float(), expected.detach(), rtol=1e-2, atol=1e-2)  # fp16 rounding: measured 1e-3


# --- errors that say what is wrong ---------------------------------------------------------


def test_ring_and_ulysses_reject_bad_input():
    q, k, v, _ = _inputs(1, 2, 8, 4, 4)
    with pytest.raises(ValueError, match=r"\(B, H, L/W, D\) with 4 dims"):
        ac.ring_attention(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="same number of queries and keys"):
        ac.ring_attention(q, k[..., :4, :], v[..., :4, :])
    with pytest.raises(TypeError, match="bool tensor"):
        ac.ring_attention(q, k, v, key_padding_mask=torch.ones(1, 8))
    with pytest.raises(ValueError, match=r"key_padding_mask must be \(B, Lk\) = \(1, 8\)"):
        ac.ring_attention(q, k, v, key_padding_mask=torch.ones(1, 1, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="even number of tokens"):
        ac.ring_attention(q[..., :7, :], k[..., :7, :], v[..., :7, :])
    with pytest.raises(ValueError, match="layout must be one of"):
        ac.ring_attention(q, k, v, layout="random")
    with pytest.raises(TypeError, match="share one dtype"):
        ac.ulysses_attention(q, k.float(), v)
    q3, _, _, _ = _inputs(1, 3, 8, 4, 4)
    with pytest.raises(ValueError, match=r"Hkv dividing H .*got q \(1, 3, 8, 4\), k \(1, 2, 8, 4\)"):
        ac.ring_attention(q3, k, v)


def test_ulysses_splits_or_copies_the_key_value_heads():
    """W must divide H; the K/V heads are split when W divides Hkv, copied W / Hkv times when Hkv divides W."""
    assert dist_attn.ulysses_kv_heads(8, 8, 4) == 8  # multi-head: split
    assert dist_attn.ulysses_kv_heads(8, 4, 4) == 4  # GQA, W divides Hkv: split
    assert dist_attn.ulysses_kv_heads(8, 2, 4) == 4  # GQA, Hkv divides W: each K/V head copied twice
    assert dist_attn.ulysses_kv_heads(8, 1, 8) == 8  # multi-query: one copy per rank
    with pytest.raises(ValueError, match=r"H = 6 heads over world_size = 4 ranks.*use \[1, 2, 3, 6\] ranks"):
        dist_attn.ulysses_kv_heads(6, 6, 4)
    with pytest.raises(ValueError, match="Hkv = 3 key/value heads over world_size = 2"):
        dist_attn.ulysses_kv_heads(6, 3, 2)
    q, k, v, _ = _gqa_inputs(1, 6, 3, 12, 4, 4)
    with pytest.raises(ValueError, match="Hkv = 3 key/value heads over world_size = 2"):
        ac.run_sharded_attention(q, k, v, method="ulysses", world_size=2)


def test_runner_rejects_functions_that_cannot_reach_another_process():
    def local(rank, world_size):
        return rank

    with pytest.raises(TypeError, match="must be importable"):
        ac.run_distributed(local, 2)
    with pytest.raises(TypeError, match="must be importable"):
        ac.run_distributed(lambda rank, world_size: rank, 2)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        ac.run_distributed(max, 0)
    if torch.cuda.device_count() < 64:
        with pytest.raises(ValueError, match="needs one GPU per rank"):
            ac.run_distributed(max, 64, device="cuda")


def test_sharded_run_checks_the_split_before_starting_processes():
    q, k, v, _ = _inputs(1, 6, 12, 4, 4)
    with pytest.raises(ValueError, match="H = 6 heads over world_size = 4"):
        ac.run_sharded_attention(q, k, v, method="ulysses", world_size=4)
    with pytest.raises(ValueError, match="12 is not divisible by world_size = 5"):
        ac.run_sharded_attention(q, k, v, method="ring", world_size=5, layout="contiguous")
    with pytest.raises(ValueError, match="2 \\* world_size = 8 equal chunks"):
        ac.run_sharded_attention(q, k, v, method="ring", world_size=4)
    with pytest.raises(ValueError, match="method must be one of"):
        ac.run_sharded_attention(q, k, v, method="tree", world_size=2)
    with pytest.raises(TypeError, match="unknown keys \\['causal'\\]"):
        ac.run_sharded_attention_batch([dict(q=q, k=k, v=v), dict(q=q, k=k, v=v, causal=True)], world_size=2)


# --- real process groups -------------------------------------------------------------------


def _process_device(device: torch.device) -> str:
    if device.type == "mps":
        pytest.skip("torch.distributed has no backend for MPS")
    return device.type


def test_a_worker_error_is_raised_here_naming_the_rank():
    # fn(rank, world_size) = sequence_positions(seq_len=rank, world_size): rank 0 asks for length 0.
    with pytest.raises(ValueError, match="rank 0 of 2: seq_len must be >= 1") as info:
        ac.run_distributed(ac.sequence_positions, 2)
    assert "Traceback" in str(info.value.__cause__)


def sleep_by_rank(rank, world_size):
    """Rank r sleeps 1000 r seconds: rank 0 returns, the others hang (importable: runs in the workers)."""
    time.sleep(1000 * rank)
    return rank


def test_a_hanging_worker_times_out_and_is_stopped():
    start = time.monotonic()
    # Ranks 1 and 2 never finish; rank 0 returns at once, but on a loaded machine even its start-up may
    # take longer than the 2 s, so it may be listed too.
    with pytest.raises(TimeoutError, match=r"ranks \[(0, )?1, 2\] of 3 did not finish within 2 s"):
        ac.run_distributed(sleep_by_rank, 3, timeout_s=2.0)
    assert time.monotonic() - start < 30


def test_run_distributed_returns_results_in_rank_order():
    assert ac.run_distributed(max, 3) == [3, 3, 3]  # max(rank, world_size)
    assert ac.run_distributed(divmod, 3) == [(0, 0), (0, 1), (0, 2)]  # divmod(rank, world_size)


# Head counts that every world size divides, and lengths that 2 * W divides.
SIZES = {1: (4, 12), 2: (4, 24), 3: (6, 24), 4: (4, 32), 5: (5, 40)}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_ring_and_ulysses_equal_single_process_attention(device, world_size):
    """Outputs and gradients of q, k, v, float64, to 1e-10: both layouts, causal or not, padded or not."""
    kind = _process_device(device)
    if kind == "cuda" and torch.cuda.device_count() < world_size:
        pytest.skip(f"{world_size} ranks need {world_size} GPUs")
    H, L = SIZES[world_size]
    q, k, v, grad_out = _inputs(2, H, L, 8, 6, seed=world_size)
    settings = [(method, layout, is_causal, padded)
                for method, layouts in (("ring", ("zigzag", "contiguous")), ("ulysses", ("contiguous", "zigzag")))
                for layout in layouts for is_causal in (False, True) for padded in (False, True)]
    padding = _padding(2, L)
    runs = ac.run_sharded_attention_batch(
        [dict(q=q, k=k, v=v, method=method, layout=layout, is_causal=is_causal, grad_out=grad_out,
              key_padding_mask=padding if padded else None) for method, layout, is_causal, padded in settings],
        world_size=world_size, device=kind)  # one process group runs all 16 settings
    for (method, layout, is_causal, padded), run in zip(settings, runs):
        expected, expected_grads = _oracle(q, k, v, grad_out, padding if padded else None, is_causal)
        assert run.method == method and run.layout == layout
        _assert_exact(run, expected, expected_grads, f"{method}, W={world_size}, {layout}, causal={is_causal}, "
                                                     f"padded={padded}")


# (H, Hkv) per world size for grouped-query attention: W = 2 and 3 split the K/V heads, W = 4 copies them
# (Hkv = 2 and 1 divide 4), so each rank gets one.
GQA_SIZES = {2: [(4, 2)], 3: [(6, 3)], 4: [(8, 2), (4, 1)]}


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_and_ulysses_with_shared_key_value_heads_equal_single_process_attention(world_size):
    """Grouped-query attention: fewer K/V heads than query heads; outputs and gradients to 1e-10, float64."""
    settings, inputs = [], []
    for H, kv_heads in GQA_SIZES[world_size]:
        L = 8 * world_size
        q, k, v, grad_out = _gqa_inputs(2, H, kv_heads, L, 8, 6, seed=H)
        for method in ("ring", "ulysses"):
            for is_causal, padded in ((False, False), (True, True)):
                settings.append((H, kv_heads, method, is_causal, padded))
                inputs.append((q, k, v, grad_out))
    runs = ac.run_sharded_attention_batch(
        [dict(q=q, k=k, v=v, grad_out=grad_out, method=method, is_causal=is_causal,
              key_padding_mask=_padding(2, q.shape[-2]) if padded else None)
         for (q, k, v, grad_out), (_, _, method, is_causal, padded) in zip(inputs, settings)], world_size=world_size)
    for (q, k, v, grad_out), (H, kv_heads, method, is_causal, padded), run in zip(inputs, settings, runs):
        expected, expected_grads = _oracle(q, k, v, grad_out, _padding(2, q.shape[-2]) if padded else None, is_causal)
        assert run.grads[1].shape == k.shape
        _assert_exact(run, expected, expected_grads, f"{method}, W={world_size}, H={H}, Hkv={kv_heads}, "
                                                     f"causal={is_causal}, padded={padded}")


def _ring_bytes(W, B, L, kv_heads, D, Dv, element, *, phase):
    """Per rank: W - 1 sends of a K and a V block forward; backward the same again, plus dK and dV at all W steps."""
    block = B * (L // W) * kv_heads * (D + Dv) * element
    return (W - 1) * block if phase == "forward" else (2 * W - 1) * block


def _ulysses_bytes(W, B, L, H, kv_heads, D, Dv, element):
    """Per rank and pass (forward or backward): (W - 1) / W of its q, k, v and output shards (K/V copied if Hkv < W)."""
    sent_kv = kv_heads if kv_heads % W == 0 else W
    return (W - 1) * B * (L // W) * (H * D + sent_kv * (D + Dv) + H * Dv) * element // W


@pytest.mark.parametrize("world_size", [2, 4])
def test_bytes_sent_by_ring_and_ulysses_with_and_without_shared_heads(world_size):
    """The lesson's formulas, forward and backward, multi-head and grouped-query (split and copied K/V heads)."""
    B, L, D, Dv = 1, 8 * world_size, 8, 6
    cases = [(4, 4), (4, 2), (4, 1)]  # Hkv = H, Hkv = 2 (copied at W = 4), Hkv = 1 (copied at both)
    jobs, shapes = [], []
    for H, kv_heads in cases:
        q, k, v, grad_out = _gqa_inputs(B, H, kv_heads, L, D, Dv)
        for method in ("ring", "ulysses"):
            jobs.append(dict(q=q, k=k, v=v, grad_out=grad_out, method=method, is_causal=True))
            shapes.append((method, H, kv_heads))
    runs = ac.run_sharded_attention_batch(jobs, world_size=world_size)
    for (method, H, kv_heads), run in zip(shapes, runs):
        for log in run.logs:
            forward, backward = log.bytes_sent(phase="forward"), log.bytes_sent(phase="backward")
            if method == "ring":
                assert forward == _ring_bytes(world_size, B, L, kv_heads, D, Dv, 8, phase="forward")
                assert backward == _ring_bytes(world_size, B, L, kv_heads, D, Dv, 8, phase="backward")
            else:
                assert forward == backward == _ulysses_bytes(world_size, B, L, H, kv_heads, D, Dv, 8), (H, kv_heads)


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("padded", [False, True])
def test_ring_sends_what_the_formula_says(world_size, padded):
    """Per rank and step: K and V blocks (and their padding mask) forward; again, plus dK and dV, backward."""
    B, H, L, D, Dv = 2, 4, 8 * world_size, 8, 6
    q, k, v, grad_out = _inputs(B, H, L, D, Dv)
    keep = _padding(B, L) if padded else None
    run = ac.run_sharded_attention(q, k, v, method="ring", world_size=world_size, key_padding_mask=keep,
                                   is_causal=True, grad_out=grad_out)
    local, element = L // world_size, 8  # float64
    blocks = B * H * local * (D + Dv) * element  # one K block and one V block
    mask = B * local if padded else 0  # one bool per key
    for log in run.logs:
        for step in range(world_size):
            last = step == world_size - 1
            assert log.bytes_sent(phase="forward", step=step) == (0 if last else blocks + mask)
            assert log.bytes_sent(phase="backward", step=step, what="dk, dv") == blocks
            assert log.bytes_sent(phase="backward", step=step) == (0 if last else blocks + mask) + blocks
        assert log.bytes_sent(phase="forward") == (world_size - 1) * (blocks + mask)


@pytest.mark.parametrize("world_size", [2, 4])
def test_ulysses_sends_what_the_formula_says(world_size):
    """Per rank: (W - 1) / W of its q, k, v and output shards, forward and backward; the mask once per other rank."""
    B, H, L, D, Dv = 2, 4, 8 * world_size, 8, 6
    q, k, v, grad_out = _inputs(B, H, L, D, Dv)
    run = ac.run_sharded_attention(q, k, v, method="ulysses", world_size=world_size, key_padding_mask=_padding(B, L),
                                   is_causal=True, grad_out=grad_out)
    local, element = L // world_size, 8
    shard = B * H * local * element * (world_size - 1) // world_size  # per unit of head dim
    for log in run.logs:
        assert log.bytes_sent(phase="forward") == shard * (D + D + Dv + Dv) + B * local * (world_size - 1)
        assert log.bytes_sent(phase="forward", what="key mask") == B * local * (world_size - 1)
        assert log.bytes_sent(phase="backward") == shard * (D + D + Dv + Dv)


def test_the_ring_logs_the_work_it_planned():
    """Scores computed per rank and step, as counted by the ring while it runs, equal causal_work's plan."""
    B, H, L, W = 1, 2, 32, 4
    q, k, v, _ = _inputs(B, H, L, 4, 4)
    for layout in ("zigzag", "contiguous"):
        run = ac.run_sharded_attention(q, k, v, method="ring", world_size=W, is_causal=True, layout=layout)
        measured = torch.tensor([[log.scores(phase="forward", step=s) for s in range(W)] for log in run.logs])
        assert torch.equal(measured, B * H * dist_attn.causal_work(L, W, layout=layout)), layout


def test_memory_per_rank_shrinks_as_the_world_grows():
    """Extra peak memory of forward + backward on each rank, measured; ring blocks are (L/W)^2, Ulysses holds H/W heads."""
    B, H, L = 1, 4, 1024
    q, k, v, grad_out = (x.float() for x in _inputs(B, H, L, 32, 32))
    peaks = {}
    for method, W, options in (("ring", 1, {"layout": "contiguous"}), ("ring", 4, {"layout": "contiguous"}),
                               ("ulysses", 1, {"fused": False}), ("ulysses", 4, {"fused": False})):
        run = ac.run_sharded_attention(q, k, v, method=method, world_size=W, grad_out=grad_out, measure_memory=True,
                                       **options)
        if any(p is None for p in run.peak_bytes):
            pytest.skip("no peak-memory counter on this system")
        peaks[method, W] = max(run.peak_bytes)
    # Measured here (4 repeats): ring 84.8 -> 8.7-9.5 MiB on the busiest rank (about 1/9; the score
    # blocks alone shrink 16-fold), ulysses 100.9 -> 26.8-27.0 MiB (1/3.7; the heads 4-fold).
    assert peaks["ring", 4] < peaks["ring", 1] / 6, peaks
    assert peaks["ulysses", 4] < peaks["ulysses", 1] / 2.5, peaks


def test_rank_summary_shows_a_working_collective():
    summaries = ac.run_distributed(dist_attn.rank_summary, 3)
    assert [s["rank"] for s in summaries] == [0, 1, 2]
    assert all(s["world_size"] == 3 and s["backend"] == "gloo" and s["all_reduce of rank + 1"] == 6 for s in summaries)


# --- the runner and the pictures ------------------------------------------------------------


def test_a_port_taken_between_probe_and_bind_is_retried(monkeypatch):
    """Another program may grab the free port before rank 0 binds it: the runner tries a new one."""
    import socket

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    ports = [busy.getsockname()[1]]
    real = runner._free_port
    monkeypatch.setattr(runner, "_free_port", lambda: ports.pop() if ports else real())
    try:
        assert ac.run_distributed(max, 1) == [1]
    finally:
        busy.close()
    assert not ports, "the taken port was offered first"


def test_pictures_show_the_schedule_and_who_computes_what():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure = dist_attn.plot_ring_schedule(3)
    labels = sorted(text.get_text() for text in figure.axes[0].texts)
    assert labels == sorted(f"K/V {b}" for row in dist_attn.ring_schedule(3) for b in row)
    plt.close(figure)
    figure = dist_attn.plot_causal_layout(16, 4, layout="zigzag")
    image = figure.axes[0].images[0].get_array()  # (L, L, RGBA)
    white = (image[..., :3] == 1.0).all(-1)  # skipped pairs
    opaque = (image[..., 3] == 1.0) & ~white  # computed and allowed (masked pairs are pale)
    colours = {tuple(image[i, j, :3]) for i, j in zip(*opaque.nonzero())}
    assert len(colours) == 4, "one colour per rank"
    allowed_per_rank = [int(opaque[p].sum()) for p in ac.sequence_positions(16, 4, layout="zigzag")]
    assert allowed_per_rank == [int((p + 1).sum()) for p in ac.sequence_positions(16, 4, layout="zigzag")]
    assert [t.get_text() for t in figure.axes[0].get_legend().get_texts()] == [f"rank {r}" for r in range(4)]
    plt.close(figure)


def test_the_package_is_one_module_per_concept_behind_one_public_face():
    """attn_course.distributed re-exports every public name; each module names its lesson, keeps an
    __all__, and takes from its siblings only their public names (shared checks live in _checks)."""
    import ast
    import importlib
    from pathlib import Path

    for name in dist_attn.__all__:
        assert getattr(dist_attn, name) is not None
    for name in ("ring_attention", "ring_step", "ring_step_backward", "ulysses_attention", "run_distributed",
                 "run_sharded_attention", "sequence_positions", "CommunicationLog"):
        assert getattr(ac, name) is getattr(dist_attn, name)
    folder = Path(dist_attn.__file__).parent
    for path in sorted(folder.glob("*.py")):
        tree = ast.parse(path.read_text())
        assert "lesson 12" in (ast.get_docstring(tree) or ""), path.name
        module = importlib.import_module(f"attn_course.distributed.{path.stem}" if path.stem != "__init__"
                                         else "attn_course.distributed")
        assert all(hasattr(module, name) for name in module.__all__), path.name
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level > 0 and not (node.module or "").endswith("_checks"):
                private = [alias.name for alias in node.names if alias.name.startswith("_")]
                assert not private, f"{path.name} imports {private} from {node.module}"
