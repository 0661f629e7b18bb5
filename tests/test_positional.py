"""Positional encodings: sinusoidal and learned tables, Transformer-XL relative attention, RoPE."""

from __future__ import annotations

import math

import pytest
import torch

from attn_course.positional import (
    LearnedPositionalEmbedding,
    RelativePositionMultiHeadAttention,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    apply_rotary,
    rel_shift,
    relative_positions,
    rotary_angles,
    sinusoidal_encoding,
)

F64 = {"atol": 1e-10, "rtol": 1e-10}


# ---------------------------------------------------------------- sinusoidal / learned


def test_sinusoidal_matches_the_formula():
    E = 8
    table = sinusoidal_encoding(torch.arange(6, dtype=torch.float64), E)
    assert table.shape == (6, E)
    for p in range(6):
        for i in range(E // 2):
            angle = p / 10000 ** (2 * i / E)
            assert table[p, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-12)
            assert table[p, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-12)


def test_sinusoidal_dot_product_depends_only_on_offset():
    # PE[p] . PE[p + k] = sum_i cos(k w_i): the same for every p.
    table = sinusoidal_encoding(torch.arange(40, dtype=torch.float64), 16)
    dots = (table[:-5] * table[5:]).sum(-1)
    torch.testing.assert_close(dots, dots[:1].expand_as(dots), **F64)


def test_sinusoidal_module_adds_the_table(device):
    x = torch.randn(2, 5, 6, dtype=torch.float64, device=device)
    out = SinusoidalPositionalEncoding(6)(x)
    expected = x + sinusoidal_encoding(torch.arange(5, dtype=torch.float64, device=device), 6)
    torch.testing.assert_close(out, expected, **F64)
    with pytest.raises(ValueError, match="even"):
        SinusoidalPositionalEncoding(5)
    with pytest.raises(ValueError, match=r"\(B, L, E=6\)"):
        SinusoidalPositionalEncoding(6)(torch.randn(2, 5, 4))


def test_learned_positions_add_trained_rows_and_refuse_long_inputs():
    module = LearnedPositionalEmbedding(10, 4)
    x = torch.zeros(3, 7, 4)
    torch.testing.assert_close(module(x), module.weight[:7].expand(3, 7, 4))
    module(x).sum().backward()
    assert module.weight.grad[:7].abs().sum() > 0 and module.weight.grad[7:].abs().sum() == 0
    with pytest.raises(ValueError, match="exceeds max_len=10"):
        module(torch.zeros(1, 11, 4))


# ---------------------------------------------------------------- relative positions


def test_relative_positions_order():
    assert relative_positions(3).tolist() == [2, 1, 0, -1, -2]


@pytest.mark.parametrize("L", [1, 2, 5, 9])
def test_rel_shift_picks_offset_i_minus_j(L):
    scores = torch.randn(2, 3, L, 2 * L - 1, dtype=torch.float64)
    offsets = relative_positions(L)
    shifted = rel_shift(scores)
    assert shifted.shape == (2, 3, L, L)
    for i in range(L):
        for j in range(L):
            column = int((offsets == i - j).nonzero())
            assert torch.equal(shifted[..., i, j], scores[..., i, column])


def test_rel_shift_rejects_wrong_width():
    with pytest.raises(ValueError, match=r"\(\.\.\., L, 2L-1\)"):
        rel_shift(torch.randn(4, 4))


def dense_relative_attention(module: RelativePositionMultiHeadAttention, x: torch.Tensor, keep: torch.Tensor | None):
    """O(L^2) reference: one explicit relative embedding per (i, j) pair, no rel-shift, loops."""
    B, L, E = x.shape
    H, D = module.num_heads, module.head_dim
    q = module.q_proj(x).view(B, L, H, D)
    k = module.k_proj(x).view(B, L, H, D)
    v = module.v_proj(x).view(B, L, H, D)
    out = torch.zeros(B, L, H, D, dtype=x.dtype)
    weights = torch.zeros(B, H, L, L, dtype=x.dtype)
    for b in range(B):
        for h in range(H):
            for i in range(L):
                scores = []
                for j in range(L):
                    r = module.pos_proj(sinusoidal_encoding(torch.tensor(float(i - j), dtype=x.dtype), E)).view(H, D)
                    content = (q[b, i, h] + module.pos_bias_u[h]) @ k[b, j, h]
                    position = (q[b, i, h] + module.pos_bias_v[h]) @ r[h]
                    score = (content + position) / math.sqrt(D)
                    if keep is not None and not keep[b, j]:
                        score = torch.tensor(float("-inf"), dtype=x.dtype)
                    scores.append(score)
                w = torch.softmax(torch.stack(scores), dim=0)
                weights[b, h, i] = w
                out[b, i, h] = w @ v[b, :, h]
    return module.out_proj(out.reshape(B, L, E)), weights


@pytest.mark.parametrize("fused", [True, False])
def test_relative_attention_matches_dense_pairwise_computation(fused):
    torch.manual_seed(0)
    module = RelativePositionMultiHeadAttention(8, 2, fused=fused, dtype=torch.float64)
    x = torch.randn(2, 6, 8, dtype=torch.float64, requires_grad=True)
    keep = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    expected, expected_w = dense_relative_attention(module, x, keep)
    out, weights = module(x, mask=keep[:, None, None, :], need_weights=True)
    torch.testing.assert_close(out, expected, **F64)
    torch.testing.assert_close(weights, expected_w, **F64)
    out_fast = module(x, mask=keep[:, None, None, :])  # fused or explicit without weights
    torch.testing.assert_close(out_fast, expected, **F64)
    # Gradients agree too, for the input and every parameter (u, v and W_r included).
    grads = torch.autograd.grad(out_fast.square().sum(), [x, *module.parameters()])
    expected_grads = torch.autograd.grad(expected.square().sum(), [x, *module.parameters()])
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, **F64)
    assert all(g.abs().sum() > 0 for g in grads)


def test_relative_attention_sees_offsets_not_absolute_positions():
    # Start the same sequence 3 positions later (masked junk in front): every pair keeps its
    # offset, so the outputs at the real tokens do not change.
    torch.manual_seed(0)
    module = RelativePositionMultiHeadAttention(8, 2, dtype=torch.float64)
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    padded = torch.cat([torch.randn(1, 3, 8, dtype=torch.float64), x], dim=1)  # x starts at position 3
    keep = torch.tensor([[False] * 3 + [True] * 5])
    torch.testing.assert_close(module(padded, mask=keep[:, None, None, :])[:, 3:], module(x), **F64)


def test_relative_attention_checks_its_mask():
    module = RelativePositionMultiHeadAttention(8, 2)
    x = torch.randn(2, 5, 8)
    with pytest.raises(TypeError, match="bool"):
        module(x, mask=torch.ones(2, 1, 1, 5))
    with pytest.raises(ValueError, match=r"\[:, None, None, :\]"):
        module(torch.randn(3, 5, 8), mask=torch.ones(3, 5, dtype=torch.bool))


# ---------------------------------------------------------------- rotary


def test_rotary_scores_depend_only_on_the_offset():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 16, dtype=torch.float64, generator=gen)
    k = torch.randn(3, 16, dtype=torch.float64, generator=gen)
    q_pos = torch.tensor([0, 4, 11])
    k_pos = torch.tensor([7, 2, 11])

    def scores(shift):
        return (apply_rotary(q, q_pos + shift) * apply_rotary(k, k_pos + shift)).sum(-1)

    base = scores(0)
    for shift in (1, 13, 1000, -5):
        torch.testing.assert_close(scores(shift), base, **F64)
    # ... and they do depend on the offset: moving only the key changes them.
    moved = (apply_rotary(q, q_pos) * apply_rotary(k, k_pos + 1)).sum(-1)
    assert (moved - base).abs().min() > 1e-3


def test_rotary_is_a_rotation_matching_complex_multiplication():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 8, dtype=torch.float64, generator=gen)
    positions = torch.arange(5)
    rotated = apply_rotary(x, positions)
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1), **F64)
    as_complex = torch.view_as_complex(x.unflatten(-1, (4, 2)).contiguous())  # (2, 5, 4)
    phase = torch.polar(torch.ones(5, 4, dtype=torch.float64), rotary_angles(positions.double(), 8))
    expected = torch.view_as_real(as_complex * phase).flatten(-2)
    torch.testing.assert_close(rotated, expected, **F64)
    torch.testing.assert_close(apply_rotary(x, torch.zeros(5, dtype=torch.long)), x, **F64)


def test_rotary_module_rotates_queries_and_keys_with_offset(device):
    rope = RotaryEmbedding(8)
    q = torch.randn(2, 2, 4, 8, device=device)
    k = torch.randn(2, 2, 6, 8, device=device)
    rq, rk = rope(q, k, offset=3)
    torch.testing.assert_close(rq, apply_rotary(q, torch.arange(3, 7, device=device)))
    torch.testing.assert_close(rk, apply_rotary(k, torch.arange(3, 9, device=device)))
    with pytest.raises(ValueError, match=r"D=8"):
        rope(torch.randn(1, 4, 6), k)
    with pytest.raises(ValueError, match="even"):
        apply_rotary(torch.randn(2, 5), torch.arange(2))


# ---------------------------------------------------------------- low precision, long positions (issue 16)

LONG = 8193  # positions 0 .. 8192


def _reference_angles(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """float64 angles p * 10000^(-2i/dim), written out independently of the library."""
    frequencies = torch.tensor([10000.0 ** (-2 * i / dim) for i in range(dim // 2)], dtype=torch.float64)
    return positions.double()[:, None] * frequencies.to(positions.device)  # (L, dim/2)


def _angle_error(device: torch.device) -> float:
    """Extra error allowed where the library must compute angles in float32 (MPS has no float64)."""
    return LONG * 2.0**-24 if device.type == "mps" else 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_sinusoidal_table_is_right_to_the_dtypes_rounding_up_to_position_8192(device, dtype):
    """Before the fix the table was built in x.dtype: at L = 3000 the error was 2.0 (bf16) and 1.7 (fp16)."""
    E = 64
    out = SinusoidalPositionalEncoding(E)(torch.zeros(1, LONG, E, dtype=dtype, device=device))
    assert out.dtype == dtype
    angles = _reference_angles(torch.arange(LONG, device=device), E)
    expected = torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)  # (L, E)
    error = (out[0].double() - expected).abs().max().item()
    # Rounding a value in [-1, 1] to the nearest float costs at most eps / 2. Measured (CPU): 0.25 eps
    # in every dtype (2.98e-8 fp32, 2.44e-4 fp16, 1.95e-3 bf16); before the fix 1.7 (fp16), 2.0 (bf16).
    assert error <= 0.5 * torch.finfo(dtype).eps + _angle_error(device), error


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_rotary_is_right_to_the_dtypes_rounding_up_to_position_8192(device, dtype):
    """Before the fix apply_rotary computed angles, cos and sin in x.dtype: errors of 0.7-5 (fp16/bf16) at 1000."""
    gen = torch.Generator().manual_seed(0)
    D = 64
    x = torch.randn(2, LONG, D, generator=gen).to(device=device, dtype=dtype)  # (B, L, D)
    positions = torch.arange(LONG, device=device)
    got = apply_rotary(x, positions)
    assert got.dtype == dtype
    # float64 oracle: the same (already rounded) inputs times e^{i p theta}, as complex numbers.
    pairs = torch.view_as_complex(x.double().unflatten(-1, (D // 2, 2)).contiguous())  # (B, L, D/2)
    phase = torch.polar(torch.ones(LONG, D // 2, dtype=torch.float64, device=device), _reference_angles(positions, D))
    expected = torch.view_as_real(pairs * phase)  # (B, L, D/2, 2)
    error = (got.double().unflatten(-1, (D // 2, 2)) - expected).abs().amax(dim=-1)  # (B, L, D/2), per pair
    eps = torch.finfo(dtype).eps
    # Bound per pair, relative to its length (a rotation keeps it). Measured (CPU) max error / (eps |pair|):
    # 1.17 in fp32 (rotation computed in fp32), 0.50 in fp16 and bf16 (computed in fp32, rounded once).
    # Before the fix: absolute errors of 7e-4 (fp32), 4.3 (fp16), 7.7 (bf16) near position 8192.
    factor = 2.0 if dtype == torch.float32 else 0.75
    bound = (factor * eps + _angle_error(device)) * pairs.abs()
    assert (error <= bound).all(), (error / pairs.abs()).max().item() / eps
    # RotaryEmbedding rotates with the same positions, so it inherits the precision.
    rope = RotaryEmbedding(D)
    tail = x[:, -8:].unsqueeze(1)  # (B, 1, 8, D): positions 8185 .. 8192
    rq, rk = rope(tail, tail, offset=LONG - 8)
    assert torch.equal(rq, got[:, -8:].unsqueeze(1)) and torch.equal(rk, rq)


def test_sinusoidal_encoding_keeps_its_dtype_rules():
    assert sinusoidal_encoding(torch.arange(3), 4).dtype == torch.get_default_dtype()
    assert sinusoidal_encoding(torch.arange(3, dtype=torch.float64), 4).dtype == torch.float64
    assert sinusoidal_encoding(torch.arange(3), 4, dtype=torch.bfloat16).dtype == torch.bfloat16
    assert rotary_angles(torch.arange(3), 4).dtype == torch.get_default_dtype()
    with pytest.raises(TypeError, match="positions must hold integers"):
        apply_rotary(torch.randn(3, 4), torch.ones(3, dtype=torch.bool))
