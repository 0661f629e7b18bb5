"""KV-cache decoding equals full causal recomputation, for MHA, GQA and MQA."""

from __future__ import annotations

import pytest
import torch

import attn_course as ac
from attn_course.dynamic import DynamicHeadAttention
from attn_course.grouped import GroupedQueryAttention
from attn_course.kv_cache import KVCache, decode_step, kv_cache_bytes
from attn_course.measure import measure_decoding_speed

F64 = {"atol": 1e-10, "rtol": 1e-10}


def make_module(num_kv_heads, *, E=16, H=4, seed=0, device="cpu", dtype=torch.float64):
    torch.manual_seed(seed)
    if num_kv_heads is None:
        module = ac.MultiHeadAttention(E, H, device=device, dtype=dtype)
    else:
        module = GroupedQueryAttention(E, H, num_kv_heads, device=device, dtype=dtype)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 1:
                p.normal_()
    return module.eval()


@pytest.mark.parametrize("num_kv_heads", [None, 4, 2, 1], ids=["MultiHeadAttention", "GQA-4", "GQA-2", "MQA"])
@pytest.mark.parametrize("chunks", [(1,) * 7, (3, 1, 1, 2), (7,)], ids=["one-by-one", "prefill-then-mixed", "all-at-once"])
def test_cached_decoding_equals_full_recomputation(gen, num_kv_heads, chunks):
    module = make_module(num_kv_heads)
    x = torch.randn(2, 7, 16, generator=gen, dtype=torch.float64)
    expected = module(x, is_causal=True)  # (B, 7, E)
    cache = KVCache.for_module(module, batch_size=2, max_length=8)
    outputs, start = [], 0
    with torch.no_grad():
        for size in chunks:
            outputs.append(decode_step(module, x[:, start : start + size], cache))
            start += size
    assert cache.length == 7
    torch.testing.assert_close(torch.cat(outputs, dim=1), expected, **F64)
    stored = 4 if num_kv_heads is None else num_kv_heads
    assert cache.keys.shape == (2, stored, 8, 4), "the cache holds num_kv_heads heads"


def test_top_left_causal_would_be_wrong(gen):
    """A chunk of new queries needs the bottom-right causal mask: is_causal (top-left) gives other numbers."""
    module = make_module(None)
    x = torch.randn(1, 5, 16, generator=gen, dtype=torch.float64)
    expected = module(x, is_causal=True)[:, 3:]
    with torch.no_grad():
        q = ac.split_heads(module.q_proj(x[:, 3:]), 4)
        k = ac.split_heads(module.k_proj(x), 4)
        v = ac.split_heads(module.v_proj(x), 4)
        top_left = module.out_proj(ac.merge_heads(ac.scaled_dot_product_attention(q, k, v, is_causal=True)))
        cache = KVCache.for_module(module, batch_size=1, max_length=5)
        decode_step(module, x[:, :3], cache)
        got = decode_step(module, x[:, 3:], cache)
    torch.testing.assert_close(got, expected, **F64)
    assert not torch.allclose(top_left, expected)


def test_padding_mask_is_combined(gen):
    module = make_module(2)
    x = torch.randn(2, 6, 16, generator=gen, dtype=torch.float64)
    keep = ac.padding_mask([6, 4])[:, None, None, :]  # (B, 1, 1, S); at every step a prefix of it applies
    expected = module(x, mask=keep, is_causal=True)
    cache = KVCache.for_module(module, batch_size=2, max_length=6)
    with torch.no_grad():
        first = decode_step(module, x[:, :4], cache, mask=keep[..., :4])
        rest = [decode_step(module, x[:, t : t + 1], cache, mask=keep[..., : t + 1]) for t in range(4, 6)]
    torch.testing.assert_close(torch.cat([first, *rest], dim=1), expected, **F64)


def test_buffer_is_preallocated_and_overflow_is_a_clear_error():
    module = make_module(2)
    cache = KVCache.for_module(module, batch_size=1, max_length=4)
    buffer = cache.keys.data_ptr()
    assert cache.nbytes == kv_cache_bytes(batch_size=1, seq_len=4, num_kv_heads=2, head_dim=4, dtype=torch.float64)
    x = torch.randn(1, 5, 16, dtype=torch.float64)
    with torch.no_grad():
        decode_step(module, x[:, :3], cache)
        decode_step(module, x[:, 3:4], cache)
        assert cache.keys.data_ptr() == buffer and cache.length == 4
        with pytest.raises(ValueError, match=r"KV cache is full: it holds 4 of max_length=4 positions.*take 1 more"):
            decode_step(module, x[:, 4:5], cache)
    assert cache.length == 4, "a refused append must not change the cache"
    cache.reset()
    assert cache.length == 0
    assert "length=0, max_length=4" in repr(cache)


def test_input_errors():
    module = make_module(2)
    cache = KVCache.for_module(module, batch_size=1, max_length=4)
    x = torch.randn(1, 2, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"the cache is \(B, Hkv, D\) = \(1, 2, 4\) but .* need \(1, 4, 4\)"):
        decode_step(make_module(None), x, cache)
    with pytest.raises(ValueError, match=r"k must be \(B, Hkv, T, D\) = \(1, 2, T, 4\).*got shape \(1, 4, 2, 4\)"):
        cache.append(torch.zeros(1, 4, 2, 4, dtype=torch.float64), torch.zeros(1, 4, 2, 4, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"k is torch.float32 on cpu but the cache holds torch.float64"):
        cache.append(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
    with pytest.raises(RuntimeError, match=r"KVCache is for inference.*torch.no_grad"):
        decode_step(module, x, cache)  # grad mode on, parameters require grad
    with pytest.raises(TypeError, match=r"supports MultiHeadAttention and GroupedQueryAttention, got DynamicHeadAttention"):
        decode_step(DynamicHeadAttention(16, 4, dtype=torch.float64), x, cache)
    with pytest.raises(TypeError, match=r"cache must be a KVCache, got dict"):
        decode_step(module, x, {})
    with pytest.raises(ValueError, match=r"max_length must be >= 1, got 0"):
        KVCache(1, 2, 4, 0)
    with pytest.raises(TypeError, match=r"boolean mask"):
        with torch.no_grad():
            decode_step(module, x, cache, mask=torch.zeros(1, 1, 1, 2, dtype=torch.float64))


def test_measure_decoding_speed_runs_and_agrees():
    module = make_module(2, E=32, H=4, dtype=torch.float32)
    result = measure_decoding_speed(module, prompt_length=4, new_tokens=6, repeats=1)
    assert result["full_s"] > 0 and result["cached_s"] > 0
    assert result["speedup"] == pytest.approx(result["full_s"] / result["cached_s"])
    assert result["max_abs_diff"] < 1e-5
    assert not module.training


def test_on_device(device):
    module = make_module(1, E=32, H=8, device=device, dtype=torch.float32)
    x = torch.randn(2, 6, 32).to(device)
    cache = KVCache.for_module(module, batch_size=2, max_length=6)
    assert cache.keys.device.type == device.type
    with torch.no_grad():
        expected = module(x, is_causal=True)
        steps = [decode_step(module, x[:, :2], cache)] + [decode_step(module, x[:, t : t + 1], cache) for t in range(2, 6)]
        got = torch.cat(steps, dim=1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
