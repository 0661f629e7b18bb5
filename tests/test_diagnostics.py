"""Diagnostics: entropy, captured attention weights, gradient norms, the NaN/inf finder."""

from __future__ import annotations

import math
import re
from collections import OrderedDict

import pytest
import torch
import torch.nn as nn

import attn_course as ac
from attn_course.diagnostics import (
    NonFiniteError,
    attention_entropy,
    attention_stats,
    capture_attention,
    find_nonfinite,
    format_gradient_norms,
    gradient_norms,
    track_gradient_norms,
)
from attn_course.dynamic import DynamicHeadAttention
from attn_course.grouped import GroupedQueryAttention
from attn_course.training import fit

F64 = {"atol": 1e-10, "rtol": 1e-10}


# --------------------------------------------------------------------------- entropy


def test_entropy_in_nats_and_normalised_per_row_length():
    causal = ac.causal_mask(4)  # row i may see i + 1 keys
    uniform = causal.double() / causal.sum(-1, keepdim=True)  # (L, S), uniform over the allowed keys
    entropy = attention_entropy(uniform)
    torch.testing.assert_close(entropy, torch.log(torch.arange(1.0, 5.0, dtype=torch.float64)), **F64)
    normalized = attention_entropy(uniform, causal, normalize=True)
    torch.testing.assert_close(normalized, torch.tensor([0.0, 1.0, 1.0, 1.0], dtype=torch.float64), **F64)
    torch.testing.assert_close(attention_entropy(uniform, is_causal=True, normalize=True), normalized, **F64)
    # Without the mask, row 1 (uniform over 2 of 4 keys) is judged against log 4: half as spread.
    torch.testing.assert_close(attention_entropy(uniform, normalize=True)[1], torch.tensor(0.5, dtype=torch.float64))
    one_hot = torch.eye(4, dtype=torch.float64)
    assert attention_entropy(one_hot, normalize=True).abs().max() == 0


def test_entropy_matches_categorical_and_handles_masked_rows(gen):
    scores = torch.randn(2, 3, 5, 6, generator=gen, dtype=torch.float64)
    keep = ac.padding_mask([6, 2])[:, None, None, :]  # (B, 1, 1, S)
    keep = keep & (torch.arange(5)[:, None] != 4)  # query row 4 may attend to nothing
    weights = ac.stable_softmax(scores.masked_fill(~keep, float("-inf")))
    entropy = attention_entropy(weights)
    valid = keep.expand_as(weights).any(-1)
    reference = torch.distributions.Categorical(probs=weights[valid]).entropy()
    torch.testing.assert_close(entropy[valid], reference, **F64)
    assert (entropy[~valid] == 0).all() and torch.isfinite(entropy).all()
    normalized = attention_entropy(weights, keep, normalize=True)
    torch.testing.assert_close(normalized[1, :, :4], entropy[1, :, :4] / math.log(2), **F64)
    assert ((normalized >= 0) & (normalized <= 1 + 1e-12)).all()
    # Usable as a loss: gradients stay finite through masked keys (xlogy would give NaN here).
    logits = scores.clone().requires_grad_()
    attention_entropy(ac.stable_softmax(logits.masked_fill(~keep, float("-inf"))), keep, normalize=True).sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_attention_stats_per_head():
    weights = torch.zeros(1, 2, 3, 3, dtype=torch.float64)
    weights[0, 0] = torch.tensor([[1.0, 0, 0], [0.5, 0.5, 0], [0.2, 0.3, 0.5]])  # causal, spread
    weights[0, 1] = torch.tensor([[1.0, 0, 0], [1.0, 0.0, 0], [0.0, 0.0, 1.0]])  # causal, one-hot
    stats = attention_stats(weights, is_causal=True)
    row2 = -(0.2 * math.log(0.2) + 0.3 * math.log(0.3) + 0.5 * math.log(0.5))
    # Row 0 has a single allowed key: no choice, so it is left out of the means.
    torch.testing.assert_close(stats["entropy"], torch.tensor([(math.log(2) + row2) / 2, 0.0], dtype=torch.float64))
    torch.testing.assert_close(
        stats["normalized_entropy"], torch.tensor([(1 + row2 / math.log(3)) / 2, 0.0], dtype=torch.float64)
    )
    torch.testing.assert_close(stats["min"], torch.tensor([0.2, 0.0], dtype=torch.float64))
    torch.testing.assert_close(stats["max"], torch.tensor([1.0, 1.0], dtype=torch.float64))
    lonely = attention_stats(torch.ones(1, 2, 1, 1, dtype=torch.float64), is_causal=True)
    assert torch.isnan(lonely["entropy"]).all() and (lonely["max"] == 1).all()
    with pytest.raises(ValueError, match=r"weights must be \(B, H, L, S\), got shape \(2, 3, 3\)"):
        attention_stats(weights[0])


# --------------------------------------------------------------------------- capture


class TinyEncoder(nn.Module):
    """Two attention layers of different kinds, called with positional and keyword arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16, dtype=torch.float64)
        self.layers = nn.ModuleList(
            [ac.MultiHeadAttention(16, 4, dtype=torch.float64), GroupedQueryAttention(16, 4, 2, dtype=torch.float64)]
        )
        self.cross = ac.MultiHeadAttention(16, 2, kdim=8, vdim=8, dtype=torch.float64)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = h + self.layers[0](h, mask=keep[:, None, None, :])
        h = h + self.layers[1](h, h, h, is_causal=True)
        return h + self.cross(h, x, x, mask=keep[:, None, None, :])


def test_capture_equals_need_weights(gen):
    torch.manual_seed(0)
    model = TinyEncoder()
    x = torch.randn(2, 5, 8, generator=gen, dtype=torch.float64)
    keep = ac.padding_mask([5, 3])
    with capture_attention(model) as captured:
        out = model(x, keep)
    assert captured.names == ["layers.0", "layers.1", "cross"]
    # Recompute each layer's input and ask the layer itself for its weights.
    h = model.embed(x)
    a0, w0 = model.layers[0](h, mask=keep[:, None, None, :], need_weights=True)
    h = h + a0
    a1, w1 = model.layers[1](h, h, h, is_causal=True, need_weights=True)
    h = h + a1
    a2, w2 = model.cross(h, x, x, mask=keep[:, None, None, :], need_weights=True)
    torch.testing.assert_close(out, h + a2, **F64)
    torch.testing.assert_close(captured["layers.0"], w0, **F64)
    torch.testing.assert_close(captured["layers.1"], w1, **F64)
    torch.testing.assert_close(captured["cross"], w2, **F64)
    assert captured["cross"].shape == (2, 2, 5, 5) and not captured["layers.0"].requires_grad
    # The recorded masks make the entropy normalisation per row: causal rows, padded keys.
    record = captured.records[1]
    assert record.mask.shape[-2:] == (5, 5) and not record.mask[0, 1].item()
    assert captured.records[0].mask[1, 0, 0].tolist() == [True, True, True, False, False]
    rows = captured.summary()
    assert len(rows) == 4 + 4 + 2 and rows[0]["name"] == "layers.0" and rows[-1]["head"] == 1
    assert 0 < rows[0]["normalized_entropy"] <= 1
    table = captured.table()
    assert "entropy / log(n)" in table and "layers.1" in table and len(table.splitlines()) == 2 + 10


def test_capture_dynamic_heads_with_padding(gen):
    torch.manual_seed(0)
    module = DynamicHeadAttention(16, 4, dtype=torch.float64)
    with torch.no_grad():
        module.gate.weight.normal_()
    x = torch.randn(2, 4, 16, generator=gen, dtype=torch.float64)
    keep = ac.padding_mask([4, 2])
    with capture_attention(module) as captured:
        module(x, padding_mask=keep, is_causal=True)
    _, expected = module(x, padding_mask=keep, is_causal=True, need_weights=True)
    torch.testing.assert_close(captured["(model)"], expected, **F64)
    assert captured.records[0].mask[1, 0, 3].tolist() == [True, True, False, False]


@pytest.mark.parametrize("batch_first", [True, False])
def test_capture_torch_multihead_attention(gen, batch_first):
    torch.manual_seed(0)
    module = nn.MultiheadAttention(16, 4, batch_first=batch_first, dtype=torch.float64)
    with torch.no_grad():
        module.in_proj_bias.normal_()
    x = torch.randn(2, 5, 16, generator=gen, dtype=torch.float64)
    if not batch_first:
        x = x.transpose(0, 1)  # (L, B, E)
    blocked_padding = ~ac.padding_mask([5, 3])  # nn.MultiheadAttention: True = blocked
    blocked_causal = ~ac.causal_mask(5)
    float_mask = torch.randn(5, 5, generator=gen, dtype=torch.float64)
    for kwargs in (
        {"key_padding_mask": blocked_padding},
        {"attn_mask": blocked_causal, "key_padding_mask": blocked_padding},
        {"attn_mask": float_mask, "key_padding_mask": ac.mask_to_bias(~blocked_padding, torch.float64)},
        {"attn_mask": blocked_causal.expand(2 * 4, 5, 5)},
    ):
        with capture_attention(module) as captured:
            module(x, x, x, need_weights=False, **kwargs)
        _, expected = module(x, x, x, need_weights=True, average_attn_weights=False, **kwargs)
        torch.testing.assert_close(captured["(model)"], expected, **F64)


def test_capture_inside_torch_transformer_layer(gen):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True, dtype=torch.float64)
    x = torch.randn(2, 5, 16, generator=gen, dtype=torch.float64)
    with capture_attention(layer) as captured:
        layer(x, src_mask=~ac.causal_mask(5))  # training mode: the slow path calls self_attn
    _, expected = layer.self_attn(x, x, x, attn_mask=~ac.causal_mask(5), average_attn_weights=False)
    torch.testing.assert_close(captured["self_attn"], expected, **F64)


def test_capture_records_every_call_and_removes_its_hooks(gen):
    module = ac.MultiHeadAttention(16, 4, dtype=torch.float64)
    x = torch.randn(1, 3, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    with capture_attention(module, to_cpu=True) as captured:
        module(x).sum().backward()  # autograd through the model is untouched
        module(x[:, :2])
    assert [(r.name, r.call) for r in captured.records] == [("(model)", 0), ("(model)", 1)]
    assert captured["(model)"].shape == (1, 4, 2, 2) and len(captured) == 2
    assert torch.isfinite(x.grad).all()
    module(x)
    assert len(captured) == 2 and not module._forward_hooks
    with pytest.raises(KeyError, match=r"no attention weights recorded for 'nope'"):
        captured["nope"]


def test_capture_other_subclasses_via_need_weights_or_refuses(gen):
    class Sharpened(ac.MultiHeadAttention):
        """Changes how the scores are formed: capture must not assume the parent's recipe."""

        def forward(self, query, *, mask=None, need_weights=False):
            return super().forward(3 * query, mask=mask, need_weights=need_weights)

    torch.manual_seed(0)
    module = Sharpened(8, 2, dtype=torch.float64, dropout=0.5)  # training mode: dropout active
    x = torch.randn(2, 4, 8, generator=gen, dtype=torch.float64)
    keep = ac.padding_mask([4, 2])[:, None, None, :]
    torch.manual_seed(1)
    plain = [module(x, mask=keep) for _ in range(2)]
    torch.manual_seed(1)
    with capture_attention(nn.Sequential(module)) as captured:
        observed = [module(x, mask=keep) for _ in range(2)]
    torch.testing.assert_close(observed[1], plain[1], **F64)  # the hook's extra call drew no dropout masks
    _, expected = module(x, mask=keep, need_weights=True)
    torch.testing.assert_close(captured["0"], expected, **F64)
    assert captured.records[0].mask[1, 0, 0].tolist() == [True, True, False, False]

    class Opaque(ac.MultiHeadAttention):
        def forward(self, query):
            return super().forward(query)

    with pytest.raises(TypeError, match=r"Opaque overrides forward without a need_weights argument.*attention_weights"):
        with capture_attention(nn.Sequential(Opaque(8, 2))):
            pass
    with pytest.warns(UserWarning, match=r"found no attention module in Linear"):
        with capture_attention(nn.Linear(2, 2)) as captured:
            pass
    assert len(captured) == 0
    with pytest.raises(TypeError, match=r"model must be an nn.Module, got str"):
        with capture_attention("model"):
            pass


# --------------------------------------------------------------------------- gradient norms


def test_gradient_norms_after_backward():
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(used=nn.Linear(3, 2), unused=nn.Linear(3, 2)))
    x = torch.randn(4, 3)
    model.used(x).sum().backward()
    norms = gradient_norms(model)
    assert list(norms) == ["used.weight", "used.bias", "unused.weight", "unused.bias"]
    # d(sum(W x + b))/dW = 1 (x summed over the batch) per output row; d/db = batch size.
    expected_weight = torch.linalg.vector_norm(x.sum(0).expand(2, 3)).item()
    assert norms["used.weight"] == pytest.approx(expected_weight)
    assert norms["used.bias"] == pytest.approx(math.sqrt(2) * 4)
    assert norms["unused.weight"] is None
    table = format_gradient_norms(norms)
    assert re.search(r"^unused\.bias +no grad$", table, flags=re.M)
    assert f"{math.hypot(expected_weight, math.sqrt(2) * 4):.4g}" in table.splitlines()[-1]


def test_format_gradient_norms_hides_rounding_noise_below_1e6():
    norms = {"big": 0.25, "noise": 1.731e-09, "tiny but real": 2.5e-6, "zero": 0.0, "missing": None}
    table = format_gradient_norms(norms)
    assert re.search(r"^big +0\.25$", table, flags=re.M)
    assert re.search(r"^noise +< 1e-6$", table, flags=re.M)
    assert "1.731e-09" not in table
    assert re.search(r"^tiny but real +2\.5e-06$", table, flags=re.M)
    assert re.search(r"^zero +0$", table, flags=re.M)
    assert re.search(r"^missing +no grad$", table, flags=re.M)
    assert table.splitlines()[-1].split()[-1] == "0.25"
    assert format_gradient_norms({"noise": 3e-9}).splitlines()[-1].endswith("< 1e-6")


def test_track_gradient_norms_inside_fit_sees_pre_clipping_norms():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    inputs, targets = 10 * torch.randn(32, 4), torch.randint(0, 3, (32,))
    with track_gradient_norms(model) as history:
        fit(model, inputs, targets, epochs=2, batch_size=8, grad_clip=1e-3, progress=False)
    norms = history.norms
    assert set(norms) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert all(len(values) == 8 for values in norms.values()), "one entry per backward pass (2 epochs x 4 batches)"
    assert max(norms["2.weight"]) > 1e-3, "recorded before clip_grad_norm_ shrinks the gradients"
    model[2](torch.randn(1, 8)).sum().backward()  # after the context: nothing more is recorded
    assert len(history.norms["2.weight"]) == 8
    assert set(history.last()) == set(norms)


# --------------------------------------------------------------------------- NaN / inf finder


class Block(nn.Module):
    def __init__(self, dim: int, *, dtype=None) -> None:
        super().__init__()
        layers = OrderedDict(
            up=nn.Linear(dim, 4 * dim, dtype=dtype), act=nn.ReLU(), down=nn.Linear(4 * dim, dim, dtype=dtype)
        )
        self.ffn = nn.Sequential(layers)
        self.gain = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ffn(torch.exp(self.gain * x) - 1.0)  # plain code between modules


def make_stack(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(
        OrderedDict(
            embed=nn.Linear(4, 64, dtype=dtype),
            blocks=nn.Sequential(Block(64, dtype=dtype), Block(64, dtype=dtype), Block(64, dtype=dtype)),
            head=nn.Linear(64, 2, dtype=dtype),
        )
    )


def test_finds_fp16_overflow_in_a_middle_layer():
    model = make_stack(torch.float16)
    with torch.no_grad():
        model.blocks[1].ffn.up.weight.zero_()
        model.blocks[1].ffn.up.bias.fill_(1.0)  # every hidden unit is 1 ...
        model.blocks[1].ffn.down.weight.fill_(300.0)  # ... so each output is 256 x 300 > 65504: inf in fp16
    x = 0.1 * torch.ones(2, 5, 4, dtype=torch.float16)
    with find_nonfinite(model) as tracker:
        out = model(x)
    assert not torch.isfinite(out).all()
    event = tracker.first
    assert (event.name, event.phase, event.module_type) == ("blocks.1.ffn.down", "forward", "Linear")
    assert event.shape == (2, 5, 64) and event.dtype == torch.float16 and event.where == "output"
    assert event.inf_count > 0 and "blocks.1.ffn.down" in str(event)
    assert tracker.first_backward is None


def test_finds_code_between_modules_and_bad_data():
    model = make_stack()
    model.blocks[2].gain = 1e4  # exp overflows inside Block.forward, before it calls its ffn
    with find_nonfinite(model) as tracker:
        model(torch.ones(2, 3, 4))
    assert (tracker.first.name, tracker.first.phase) == ("blocks.2.ffn", "forward input")
    assert "forward of 'blocks.2'" in str(tracker.first)
    clean = make_stack()
    bad_data = torch.ones(2, 3, 4)
    bad_data[1, 2, 0] = float("nan")
    with find_nonfinite(clean) as tracker:
        clean(bad_data)
    assert (tracker.first.name, tracker.first.phase, tracker.first.nan_count) == ("(model)", "forward input", 1)


class NaiveAttention(nn.Module):
    """The hand-written softmax of the source article: a fully-masked row gives NaN."""

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        scores = (x @ x.transpose(-2, -1)).masked_fill(~keep, float("-inf"))
        return torch.softmax(scores, dim=-1) @ x


def test_finds_nan_from_a_fully_masked_row_and_can_raise():
    model = nn.Sequential(OrderedDict(proj=nn.Linear(4, 4)))
    model.attend = NaiveAttention()
    model.out = nn.Linear(4, 4)
    keep = torch.ones(3, 3, dtype=torch.bool)
    keep[2] = False  # query 2 may attend to nothing

    def run(x):
        return model.out(model.attend(model.proj(x), keep))

    with find_nonfinite(model) as tracker:
        run(torch.randn(1, 3, 4))
    assert (tracker.first.name, tracker.first.nan_count) == ("attend", 4)
    with pytest.raises(NonFiniteError, match=r"NaN first seen in forward at module 'attend'") as info:
        with find_nonfinite(model, raise_error=True):
            run(torch.randn(1, 3, 4))
    assert info.value.event.shape == (1, 3, 4)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules()), "hooks removed"
    with find_nonfinite(model) as tracker:
        model.out(model.proj(torch.randn(1, 3, 4)))
    assert not tracker.found


class Root(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.abs().sqrt()  # finite at 0, but its derivative there is infinite


def test_backward_hooks_name_the_module_with_a_bad_gradient():
    model = nn.Sequential(OrderedDict(first=nn.Linear(3, 3), root=Root(), last=nn.Linear(3, 1)))
    with torch.no_grad():
        model.first.weight[0] = 0.0
        model.first.bias[0] = 0.0  # feature 0 is exactly 0 before the square root
    with find_nonfinite(model, backward=True) as tracker:
        loss = model(torch.randn(2, 3)).sum()
        loss.backward()
    assert tracker.first is None, "the forward pass is finite"
    assert (tracker.first_backward.name, tracker.first_backward.phase) == ("root", "backward")
    assert tracker.first_backward.where == "grad_input[0]" and tracker.first_backward.shape == (2, 3)
    assert not torch.isfinite(model.first.weight.grad).all()


def test_on_device(device):
    torch.manual_seed(0)
    model = nn.Sequential(ac.MultiHeadAttention(16, 4, device=device), nn.Linear(16, 16, device=device))
    x = torch.randn(2, 5, 16, device=device)
    with capture_attention(model) as captured, find_nonfinite(model) as tracker, track_gradient_norms(model) as history:
        model(x).sum().backward()
    assert captured["0"].device.type == device.type and captured["0"].shape == (2, 4, 5, 5)
    torch.testing.assert_close(captured["0"].sum(-1), torch.ones(2, 4, 5, device=device))
    assert not tracker.found
    assert history.last().keys() == gradient_norms(model).keys()
    assert history.last()["1.weight"] == pytest.approx(gradient_norms(model)["1.weight"], rel=1e-5)
