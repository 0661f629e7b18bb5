"""Every bad input gets a TypeError / ValueError that names expected and actual, with a hint."""

from __future__ import annotations

import pytest
import torch

import attn_course as ac

q4 = torch.randn(2, 4, 6, 8)  # (B, H, L, D)
k4 = torch.randn(2, 4, 7, 8)  # (B, H, S, D)
v4 = torch.randn(2, 4, 7, 8)


@pytest.mark.parametrize(
    "args,kwargs,error,pattern",
    [
        ((q4.numpy(), k4, v4), {}, TypeError, r"q must be a torch.Tensor, got ndarray"),
        ((q4, k4, v4.long()), {}, TypeError, r"v must be a floating-point tensor, got dtype torch.int64"),
        ((q4, k4.double(), v4), {}, TypeError, r"one dtype, got q torch.float32, k torch.float64"),
        ((torch.randn(3), k4, v4), {}, ValueError, r"at least 2 dims, got shape \(3\)"),
        ((q4, torch.randn(2, 4, 7, 5), v4), {}, ValueError, r"same last dim D.*\(2, 4, 6, 8\).*\(2, 4, 7, 5\)"),
        ((q4, k4, torch.randn(2, 4, 5, 8)), {}, ValueError, r"same number of keys S.*\(2, 4, 7, 8\).*\(2, 4, 5, 8\)"),
        # (B, L, H, D) given where (B, H, L, D) is expected: the hint names the transpose.
        ((q4, torch.randn(2, 7, 4, 8), torch.randn(2, 7, 4, 8)), {}, ValueError, r"transpose\(1, 2\)"),
        ((q4, k4, v4, torch.ones(6, 7, dtype=torch.int64)), {}, TypeError, r"bool \(True = may attend\).*int64.*from_blocked_mask"),
        ((q4, k4, v4, torch.ones(7, 6, dtype=torch.bool)), {}, ValueError, r"\(7, 6\) does not broadcast.*\(2, 4, 6, 7\).*swapped"),
        ((q4, k4, v4, torch.ones(2, 7, dtype=torch.bool)), {}, ValueError, r"\(B, S\) padding mask needs mask\[:, None, None, :\]"),
        ((q4, k4, v4, torch.ones(2, 6, 7, dtype=torch.bool)), {}, ValueError, r"\(B, L, S\) mask needs mask\[:, None\]"),
        ((q4, k4, v4), {"dropout_p": 1.0}, ValueError, r"dropout_p must be in \[0, 1\), got 1.0"),
        ((q4, k4, v4), {"fused": True, "need_weights": True}, ValueError, r"fused kernel never forms the weights"),
        ((q4, k4, v4, "causal"), {}, TypeError, r"mask must be a torch.Tensor or None, got str"),
    ],
    ids=[
        "numpy-input",
        "int-values",
        "dtype-mismatch",
        "1d-query",
        "head-dim-mismatch",
        "key-value-length",
        "BLHD-vs-BHLD",
        "int-mask",
        "swapped-mask",
        "padding-mask-not-expanded",
        "BLS-mask",
        "dropout-range",
        "fused-with-weights",
        "string-mask",
    ],
)
def test_sdpa_bad_inputs(args, kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        ac.scaled_dot_product_attention(*args, **kwargs)


def test_mha_constructor_errors():
    with pytest.raises(ValueError, match=r"d_model=10 is not divisible by num_heads=3.*one of \[1, 2, 5, 10\]"):
        ac.MultiHeadAttention(10, 3)
    with pytest.raises(ValueError, match=r"num_heads must be >= 1, got 0"):
        ac.MultiHeadAttention(8, 0)
    with pytest.raises(TypeError, match=r"num_heads must be an int, got float \(2.0\)"):
        ac.MultiHeadAttention(8, 2.0)  # one validator everywhere: not an int is a TypeError
    with pytest.raises(TypeError, match=r"d_model must be an int, got bool"):
        ac.MultiHeadAttention(True, 1)
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\), got 1.5"):
        ac.MultiHeadAttention(8, 2, dropout=1.5)


@pytest.mark.parametrize(
    "make_input,kwargs,error,pattern",
    [
        (lambda: torch.randn(5, 16), {}, ValueError, r"batch-first \(B, L, E\), got shape \(5, 16\).*unsqueeze\(0\)"),
        (lambda: torch.randn(2, 5, 12), {}, ValueError, r"16 features in its last dim \(B, L, 16\), got shape \(2, 5, 12\)"),
        (lambda: torch.randn(5, 16, 2), {}, ValueError, r"\(L, B, E\) or \(B, E, L\)"),
        (lambda: torch.randn(2, 5, 16, dtype=torch.float64), {}, TypeError, r"dtype torch.float64 but the module's weights are torch.float32"),
        (lambda: torch.randn(3, 5, 16), {"mask": torch.ones(3, 5, dtype=torch.bool)}, ValueError, r"padding mask use mask\[:, None, None, :\]"),
        (lambda: [[1.0]], {}, TypeError, r"query must be a torch.Tensor, got list"),
    ],
    ids=["unbatched", "wrong-E", "seq-first", "dtype", "padding-mask-BS", "list"],
)
def test_mha_forward_errors(make_input, kwargs, error, pattern):
    mha = ac.MultiHeadAttention(16, 4)
    with pytest.raises(error, match=pattern):
        mha(make_input(), **kwargs)


def test_mha_key_value_mismatch():
    mha = ac.MultiHeadAttention(16, 4)
    x = torch.randn(2, 5, 16)
    with pytest.raises(ValueError, match=r"same batch size B: got 2, 3, 3"):
        mha(x, torch.randn(3, 5, 16))
    with pytest.raises(ValueError, match=r"same length S"):
        mha(x, torch.randn(2, 5, 16), torch.randn(2, 6, 16))


@pytest.mark.parametrize(
    "call,error,pattern",
    [
        (lambda: ac.causal_mask(0), ValueError, r"L must be >= 1, got 0"),
        (lambda: ac.causal_mask(3.0), TypeError, r"L must be an int, got float"),
        (lambda: ac.padding_mask([[1, 2]]), ValueError, r"1-D with shape \(B,\), got shape \(1, 2\)"),
        (lambda: ac.padding_mask([3, 5], max_len=4), ValueError, r"a length \(5\) exceeds max_len \(4\)"),
        (lambda: ac.padding_mask([-1]), ValueError, r"lengths must be >= 0"),
        (lambda: ac.padding_mask(torch.tensor([1.5])), TypeError, r"must hold integers"),
        (lambda: ac.mask_to_bias(torch.ones(2, 2)), TypeError, r"boolean mask \(True = may attend\), got torch.float32"),
        (lambda: ac.mask_to_bias(torch.ones(2, 2, dtype=torch.bool), torch.int32), TypeError, r"floating point"),
        (
            lambda: ac.combine_masks(torch.ones(2, 3, dtype=torch.bool), torch.ones(4, 1, 1, dtype=torch.bool)[:, :, :2].expand(4, 5, 2)),
            ValueError,
            r"cannot combine masks of shapes \(2, 3\) and \(4, 5, 2\)",
        ),
        (lambda: ac.combine_masks(torch.ones(2, 2)), TypeError, r"argument 0 is torch.float32"),
        (lambda: ac.from_blocked_mask(torch.ones(2, dtype=torch.int64)), TypeError, r"got dtype torch.int64"),
        (lambda: ac.pick_device("quantum"), RuntimeError, r"quantum"),
        (lambda: ac.seed_everything("0"), TypeError, r"seed must be an int, got str"),
    ],
)
def test_helper_errors(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


def test_pick_device_unavailable_names_available():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: nothing unavailable to ask for")
    with pytest.raises(ValueError, match=r"'cuda' is not available here; available: \[.*'cpu'\]"):
        ac.pick_device("cuda")


# --- one keyword for the attention weights: need_weights (the old names were removed) ---------------


def _weights_calls():
    torch.manual_seed(0)
    q = torch.randn(2, 2, 5, 4)
    kv = torch.randn(2, 1, 5, 4)
    vit = ac.VisionTransformer(ac.ViTConfig(image_size=8, patch_size=4, in_channels=1, num_classes=3, d_model=16,
                                            depth=1, num_heads=2)).eval()
    conformer = ac.ConformerEncoder(ac.ConformerConfig(n_mels=8, d_model=16, num_heads=2, num_layers=1,
                                                       num_classes=3, conv_kernel_size=3, subsampling_channels=4)).eval()
    images, frames = torch.randn(2, 1, 8, 8), torch.randn(2, 12, 8)
    mha, tokens = ac.MultiHeadAttention(16, 2), torch.randn(2, 5, 16)
    return [
        ("scaled_dot_product_attention", lambda **kw: ac.scaled_dot_product_attention(q, q, q, **kw)),
        ("grouped_attention", lambda **kw: ac.grouped_attention(q, kv, kv, **kw)),
        ("VisionTransformer.forward", lambda **kw: vit(images, **kw)),
        ("ConformerEncoder.forward", lambda **kw: conformer(frames, **kw)),
        ("MultiHeadAttention.forward", lambda **kw: mha(tokens, **kw)),
    ]


@pytest.mark.parametrize("old", ["return_weights", "return_attention"])
def test_the_old_weights_keywords_are_gone(old):
    """One keyword asks for the weights everywhere, need_weights=; the old names are a plain TypeError."""
    for name, call in _weights_calls():
        with torch.no_grad(), pytest.raises(TypeError, match=old):
            call(**{old: True})


def test_broadcast_shapes_agrees_with_torch_and_imports_no_sympy():
    """The package's own broadcast_shapes (torch's imports sympy on first use, seconds on a first check())."""
    import subprocess
    import sys

    from attn_course._checks import broadcast_shapes

    cases = [((2, 1, 4), (3, 1)), ((), (5,)), ((1,), (0,)), ((2, 3), (2, 3), (1, 3)), ((4, 1, 1, 7), (1, 6, 5, 1)),
             (torch.Size([2, 1]), torch.Size([1, 3]))]
    for shapes in cases:
        assert broadcast_shapes(*shapes) == torch.broadcast_shapes(*shapes), shapes
    for bad in [((2,), (3,)), ((2, 3), (3, 2)), ((0,), (2,))]:
        with pytest.raises(RuntimeError):
            torch.broadcast_shapes(*bad)
        with pytest.raises(RuntimeError, match="cannot be broadcast"):
            broadcast_shapes(*bad)
    code = ("import sys, torch, attn_course as ac; q = torch.randn(2, 3, 4, 8); m = torch.ones(4, 4, dtype=torch.bool); "
            "ac.scaled_dot_product_attention(q, q, q, m); ac.linear_attention(q, q, q, is_causal=True); "
            "print('sympy' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "False", run
