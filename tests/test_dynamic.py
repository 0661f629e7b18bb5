"""DynamicHeadAttention: uniform gate = plain MHA; a per-head oracle; padding invariance; gradients."""

from __future__ import annotations

import pytest
import torch

import attn_course as ac
from attn_course.dynamic import DynamicHeadAttention

F64 = {"atol": 1e-10, "rtol": 1e-10}


def make_pair(E=16, H=4, *, seed=0, device="cpu", dtype=torch.float64):
    """A MultiHeadAttention and a DynamicHeadAttention holding the same projections."""
    torch.manual_seed(seed)
    mha = ac.MultiHeadAttention(E, H, device=device, dtype=dtype)
    with torch.no_grad():
        for p in mha.parameters():
            if p.dim() == 1:
                p.normal_()
    dynamic = DynamicHeadAttention(E, H, device=device, dtype=dtype)
    missing, unexpected = dynamic.load_state_dict(mha.state_dict(), strict=False)
    assert sorted(missing) == ["gate.bias", "gate.weight"] and not unexpected
    return mha, dynamic


def randomize_gate(module, gen):
    with torch.no_grad():
        module.gate.weight.copy_(torch.randn(module.gate.weight.shape, generator=gen, dtype=module.gate.weight.dtype))
        module.gate.bias.copy_(torch.randn(module.gate.bias.shape, generator=gen, dtype=module.gate.bias.dtype))


def per_head_oracle(module, x, keep=None):
    """Independent reference: one head at a time, sliced out of the projections, weighted, concatenated."""
    H, D = module.num_heads, module.head_dim
    if keep is None:
        pooled = x.mean(1)
    else:
        pooled = torch.stack([x[b, keep[b]].mean(0) for b in range(x.shape[0])])
    w = H * torch.softmax(pooled @ module.gate.weight.T + module.gate.bias, dim=-1)  # (B, H)
    heads = []
    for h in range(H):
        rows = slice(h * D, (h + 1) * D)
        q = x @ module.q_proj.weight[rows].T + module.q_proj.bias[rows]  # (B, L, D)
        k = x @ module.k_proj.weight[rows].T + module.k_proj.bias[rows]
        v = x @ module.v_proj.weight[rows].T + module.v_proj.bias[rows]
        scores = q @ k.transpose(1, 2) / D**0.5  # (B, L, S)
        if keep is not None:
            scores = scores.masked_fill(~keep[:, None, :], float("-inf"))
        heads.append(torch.softmax(scores, -1) @ v * w[:, h, None, None])  # (B, L, D)
    return module.out_proj(torch.cat(heads, dim=-1)), w


@pytest.mark.parametrize("is_causal", [False, True])
def test_uniform_gate_equals_multihead_attention(gen, is_causal):
    mha, dynamic = make_pair()
    x = torch.randn(3, 6, 16, generator=gen, dtype=torch.float64)
    keep = ac.padding_mask([6, 5, 3])[:, None, None, :]
    torch.testing.assert_close(dynamic.head_weights(x), torch.ones(3, 4, dtype=torch.float64), **F64)
    expected, expected_w = mha(x, mask=keep, is_causal=is_causal, need_weights=True)
    out, weights = dynamic(x, mask=keep, is_causal=is_causal, need_weights=True)
    torch.testing.assert_close(out, expected, **F64)
    torch.testing.assert_close(weights, expected_w, **F64)
    torch.testing.assert_close(dynamic(x, mask=keep, is_causal=is_causal), expected, **F64)  # fused path
    # A gate with a bias but no weight is still uniform only if the bias is: check the test can fail.
    with torch.no_grad():
        dynamic.gate.bias.copy_(torch.tensor([1.0, 0.0, 0.0, -1.0]))
    assert not torch.allclose(dynamic(x, mask=keep, is_causal=is_causal), expected)


def test_matches_per_head_oracle_with_padding(gen):
    _, dynamic = make_pair()
    randomize_gate(dynamic, gen)
    x = torch.randn(3, 6, 16, generator=gen, dtype=torch.float64)
    keep = ac.padding_mask([6, 4, 1])  # (B, L)
    expected, expected_w = per_head_oracle(dynamic, x, keep)
    torch.testing.assert_close(dynamic.head_weights(x, padding_mask=keep), expected_w, **F64)
    torch.testing.assert_close(dynamic(x, padding_mask=keep), expected, **F64)
    expected_plain, _ = per_head_oracle(dynamic, x)
    torch.testing.assert_close(dynamic(x), expected_plain, **F64)
    assert torch.allclose(expected_w.sum(-1), torch.full((3,), 4.0, dtype=torch.float64))


def test_padding_invariance(gen):
    _, dynamic = make_pair()
    randomize_gate(dynamic, gen)
    x = torch.randn(2, 7, 16, generator=gen, dtype=torch.float64)
    keep = ac.padding_mask([7, 4])  # (B, L)
    changed = x.clone()
    changed[1, 4:] = 100 * torch.randn(3, 16, generator=gen, dtype=torch.float64)  # new padding content
    out, out_changed = dynamic(x, padding_mask=keep), dynamic(changed, padding_mask=keep)
    torch.testing.assert_close(out_changed[keep], out[keep], **F64)
    torch.testing.assert_close(
        dynamic.head_weights(changed, padding_mask=keep), dynamic.head_weights(x, padding_mask=keep), **F64
    )
    # The article's pooling (mean over every position) lets the padding leak into valid outputs.
    assert not torch.allclose(dynamic(changed)[1, :4], dynamic(x)[1, :4])
    # Even with the keys masked, pooling over padding changes the head weights.
    key_mask = keep[:, None, None, :]
    assert not torch.allclose(dynamic(changed, mask=key_mask)[1, :4], dynamic(x, mask=key_mask)[1, :4])


def test_fully_padded_sequence_pools_to_zero():
    _, dynamic = make_pair()
    with torch.no_grad():
        dynamic.gate.weight.normal_()
        dynamic.gate.bias.copy_(torch.tensor([0.5, 0.0, -0.5, 1.0]))
    x = torch.randn(2, 3, 16, dtype=torch.float64)
    keep = torch.tensor([[True, True, False], [False, False, False]])
    w = dynamic.head_weights(x, padding_mask=keep)
    torch.testing.assert_close(w[1], 4 * torch.softmax(dynamic.gate.bias, -1), **F64)
    assert torch.isfinite(dynamic(x, padding_mask=keep)).all()


def test_gradients_reach_the_gate(gen):
    _, dynamic = make_pair()  # the gate starts at zero
    x = torch.randn(2, 5, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    target = torch.randn(2, 5, 16, generator=gen, dtype=torch.float64)
    keep = ac.padding_mask([5, 3])
    (dynamic(x, padding_mask=keep) - target)[keep].square().mean().backward()  # loss on real tokens only
    for name, p in dynamic.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert dynamic.gate.weight.grad.abs().sum() > 0 and dynamic.gate.bias.grad.abs().sum() > 0
    assert x.grad[1, 3:].abs().max() == 0, "padded inputs must not influence the real tokens' outputs"
    point = torch.randn(1, 4, 16, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda inp: dynamic(inp, padding_mask=ac.padding_mask([4])), (point,))


def test_cross_attention_pools_the_query(gen):
    _, dynamic = make_pair()
    randomize_gate(dynamic, gen)
    query = torch.randn(2, 3, 16, generator=gen, dtype=torch.float64)
    memory = torch.randn(2, 5, 16, generator=gen, dtype=torch.float64)
    out, weights = dynamic(query, memory, need_weights=True)
    assert out.shape == (2, 3, 16) and weights.shape == (2, 4, 3, 5)
    # padding_mask describes the query only: it must not be applied to the 5 keys.
    keep = ac.padding_mask([3, 2])
    _, weights_padded = dynamic(query, memory, padding_mask=keep, need_weights=True)
    torch.testing.assert_close(weights_padded, weights, **F64)
    narrow = DynamicHeadAttention(16, 4, kdim=12, vdim=8, dtype=torch.float64)
    assert narrow(query, memory[..., :12], memory[..., :8], padding_mask=keep).shape == (2, 3, 16)


def test_input_errors():
    _, dynamic = make_pair()
    x = torch.randn(2, 3, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"padding_mask must be \(B, L\) = \(2, 3\), True = real token, got shape \(2, 1, 1"):
        dynamic(x, padding_mask=torch.ones(2, 1, 1, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"padding_mask must be a bool tensor \(True = real token\), got torch.int64"):
        dynamic(x, padding_mask=torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(TypeError, match=r"with padding_mask, mask must be boolean"):
        dynamic(x, mask=torch.zeros(3, 3, dtype=torch.float64), padding_mask=torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"d_model=10 is not divisible by num_heads=4"):
        DynamicHeadAttention(10, 4)
    with pytest.raises(ValueError, match=r"query must be \(B, L, E\) = \(B, L, 16\), got shape \(3, 16\)"):
        dynamic.head_weights(x[0])


def test_on_device(device):
    torch.manual_seed(0)
    dynamic = DynamicHeadAttention(32, 4, device=device)
    with torch.no_grad():
        dynamic.gate.weight.normal_()
    x = torch.randn(2, 6, 32, device=device)
    keep = ac.padding_mask([6, 2], device=device)
    out = dynamic(x, padding_mask=keep, is_causal=True)
    assert out.shape == (2, 6, 32) and torch.isfinite(out).all()
    out.sum().backward()
    assert dynamic.gate.weight.grad is not None and torch.isfinite(dynamic.gate.weight.grad).all()
