"""The attention benchmark: structure, measured (not computed) memory, targets, table, plot, command.

Small sizes only: these tests check that the numbers are measured and reported, not the targets
themselves (those are for `attn-course bench attention` on a quiet machine).
"""

from __future__ import annotations

import json
import pytest
import torch

import attn_course as ac
from attn_course.bench import (
    VARIANTS,
    AttentionBenchConfig,
    attention_flops,
    attention_targets,
    attention_variant,
    bench_attention,
    format_attention_table,
    interleaved_times,
    measure_peak_memory,
    plot_attention_bench,
)
from attn_course.measure import fresh_page_bytes, largest_tensor_bytes

TINY = AttentionBenchConfig(lengths=(32, 96), heads=2, head_dim=8, block_size=16, chunk_size=32, rounds=2,
                            max_quadratic_length=64, measure_memory=False)


def test_every_variant_computes_attention():
    """The benchmark times the right thing: each variant agrees with dense attention (block-local with its mask)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    dense = ac.scaled_dot_product_attention(q, k, v)
    for name in ("fused", "chunked"):
        torch.testing.assert_close(attention_variant(name, TINY)(q, k, v), dense, atol=1e-10, rtol=1e-10)
    from attn_course.sparse import pattern_mask

    block = ac.scaled_dot_product_attention(q, k, v, pattern_mask(40, pattern="block", size=16))
    torch.testing.assert_close(attention_variant("block_local", TINY)(q, k, v), block, atol=1e-10, rtol=1e-10)
    assert attention_variant("linear", TINY)(q, k, v).shape == dense.shape
    with pytest.raises(ValueError, match=r"unknown variant 'sparse'"):
        attention_variant("sparse", TINY)


def test_flop_counts():
    cfg = AttentionBenchConfig(batch=2, heads=3, head_dim=4, block_size=8)
    assert attention_flops("dense", 10, cfg) == 4 * 6 * 10 * 10 * 4
    assert attention_flops("chunked", 10, cfg) == attention_flops("fused", 10, cfg) == attention_flops("dense", 10, cfg)
    assert attention_flops("block_local", 10, cfg) == 4 * 6 * 16 * 8 * 4  # 10 padded to 2 blocks of 8
    assert attention_flops("block_local", 5, cfg) == 4 * 6 * 5 * 5 * 4  # one block of the whole sequence
    assert attention_flops("linear", 10, cfg) == 4 * 6 * 10 * 4 * 5


def test_bench_structure_without_memory():
    results = bench_attention(TINY, matmul_rate=10.0)
    json.dumps(results)  # JSON-able as it is
    rows = {(p["variant"], p["length"]) for p in results["points"]}
    assert rows == {(v, 32) for v in VARIANTS} | {("block_local", 96), ("linear", 96)}  # quadratic ones stop at 64
    for point in results["points"]:
        assert point["time_s"] > 0 and point["peak_bytes"] is None
        fastest, slowest = point["time_range_s"]
        assert 0 < fastest <= point["time_s"] <= slowest  # the median round lies between the extremes
        assert isinstance(point["fresh_bytes"], float) and point["fresh_bytes"] >= 0  # counted on the CPU
        assert point["gflops"] == pytest.approx(point["flops"] / point["time_s"] / 1e9)
        assert point["fraction_of_matmul"] == pytest.approx(point["gflops"] / 10.0)
    assert results["matmul_gflops"] == 10.0 and results["config"]["lengths"] == (32, 96)
    assert [t["passed"] for t in results["targets"]] == [None] * 4  # N=8192 etc. were not measured
    table = format_attention_table(results)
    assert "block-local" in table and "n/a (not measured)" in table and "of matmul" in table


def test_interleaved_times_gives_one_sample_per_round_in_a_rotating_order():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    samples = interleaved_times(fns, device="cpu", rounds=4)
    assert set(samples) == {"a", "b", "c"} and all(len(values) == 4 for values in samples.values())
    assert all(value > 0 for values in samples.values() for value in values)
    # After one warm-up call of each, every round times each function once (a run of calls), in an
    # order that rotates, so that none always runs first.
    runs = [name for i, name in enumerate(calls[3:]) if i == 0 or calls[3 + i - 1] != name]
    assert calls[:3] == ["a", "b", "c"]
    assert runs == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    # Asked for, the fresh pages per call of every round, counted while timed: a call that writes a new
    # 64 MiB tensor each time receives fresh pages, one that allocates nothing receives none to speak of.
    fresh = {}
    interleaved_times({"new": lambda: torch.ones(16 * 2**20), "none": lambda: None}, device="cpu", rounds=3,
                      fresh_bytes=fresh)
    assert set(fresh) == {"new", "none"} and all(len(values) == 3 for values in fresh.values())
    assert min(fresh["new"]) >= 16 * 4096 and max(fresh["none"]) < min(fresh["new"]) / 4
    with pytest.raises(ValueError, match="rounds must be at least 1, got 0"):
        interleaved_times(fns, device="cpu", rounds=0)


def _synthetic(times: dict, peaks: dict) -> dict:
    points = [
        {"variant": v, "length": n, "time_s": t, "peak_bytes": peaks.get((v, n)), "gflops": 1.0,
         "fraction_of_matmul": 0.1, "flops": 1.0}
        for (v, n), t in times.items()
    ]
    return {"config": {"block_size": 128}, "points": points}


def test_targets_pass_and_fail_on_the_ratios():
    times = {("dense", 8192): 10.0, ("chunked", 8192): 12.0, ("block_local", 8192): 1.0,
             ("linear", 1024): 1.0, ("linear", 16384): 20.0}
    peaks = {("dense", 8192): 8000, ("chunked", 8192): 900}
    verdicts = [t["passed"] for t in attention_targets(_synthetic(times, peaks))]
    assert verdicts == [True, True, True, True]
    times.update({("chunked", 8192): 16.0, ("linear", 16384): 25.0, ("block_local", 8192): 2.5})
    peaks[("chunked", 8192)] = 1100
    targets = attention_targets(_synthetic(times, peaks))
    assert [t["passed"] for t in targets] == [False, False, False, False]
    assert targets[1]["value"] == pytest.approx(1.6) and targets[3]["value"] == pytest.approx(4.0)


def test_plot_writes_a_png(tmp_path):
    results = bench_attention(AttentionBenchConfig(lengths=(16, 32), heads=1, head_dim=4, rounds=1,
                                                   measure_memory=False), matmul_rate=1.0)
    path = tmp_path / "bench.png"
    figure = plot_attention_bench(results, path=path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    labelled = [line for line in figure.axes[0].lines if not line.get_label().startswith("_")]  # not the bars' caps
    assert len(figure.axes) == 2 and len(labelled) == len(VARIANTS)
    assert len(figure.axes[0].collections) == len(VARIANTS)  # one bar per variant: its fastest to slowest round


def test_fresh_page_bytes_counts_the_pages_a_new_large_tensor_touches(monkeypatch):
    import mmap

    from attn_course import measure

    kept = []
    big = fresh_page_bytes(lambda: kept.append(torch.ones(16 * 2**20)))  # 64 MiB, written: fresh from the OS
    nothing = fresh_page_bytes(lambda: None)
    # At least 16 faults even where transparent huge pages map 2 MiB per fault (32 of them here).
    assert big >= 16 * mmap.PAGESIZE and big % mmap.PAGESIZE == 0
    assert nothing < big / 4
    # Where the OS counts no page faults (Windows: no `resource` module) the call still happens, and the
    # timing harness still takes every sample, with no fresh-page counts.
    monkeypatch.setattr(measure, "resource", None)
    calls = []
    assert fresh_page_bytes(lambda: calls.append(1)) is None and calls == [1]
    fresh = {}
    samples = interleaved_times({"f": lambda: None}, device="cpu", rounds=3, fresh_bytes=fresh)
    assert len(samples["f"]) == 3 and fresh == {"f": []}


def test_largest_tensor_bytes_sees_the_score_matrix():
    q = torch.randn(1, 2, 300, 8)
    assert largest_tensor_bytes(ac.scaled_dot_product_attention, q, q, q, fused=False) >= 2 * 300 * 300 * 4
    assert largest_tensor_bytes(lambda: q.expand(1000, 2, 300, 8)) == q.untyped_storage().nbytes()  # views are free


def test_peak_memory_is_measured_in_a_child_process():
    """Dense attention's peak grows with N^2 (scores, exps, weights: about 3 * H * N^2 * 4 bytes)."""
    cfg = AttentionBenchConfig(heads=2, head_dim=16, chunk_size=256)
    small = measure_peak_memory("dense", 256, cfg)
    big = measure_peak_memory("dense", 2048, cfg)
    floor = measure_peak_memory("none", 2048, cfg)
    chunked = measure_peak_memory("chunked", 2048, cfg)
    assert big["error"] is None and big["method"].startswith("child process peak RSS")
    scores = 2 * 2048 * 2048 * 4  # one (H, N, N) float32 matrix: 32 MiB
    # Figures measured here (MiB, stable over repeated runs): small 2.9, big 96.5, floor 0.0, chunked 3.9.
    # Each bound below leaves a margin of 2x or more; none depends on time or machine load.
    assert big["bytes"] > 1.5 * scores, big  # scores + weights really were resident (measured 3.0x)
    # 8x the length: linear growth would be 8x; N^2 would be 64x, less small's fixed overhead (measured 34x).
    assert big["bytes"] > 2 * 8 * small["bytes"], (small, big)
    assert floor["bytes"] < scores / 8, floor
    assert chunked["bytes"] < big["bytes"] / 4, (chunked, big)  # measured 1/25


def test_config_validation():
    with pytest.raises(ValueError, match=r"variants must be a non-empty subset of"):
        AttentionBenchConfig(variants=("dense", "flash"))
    with pytest.raises(ValueError, match=r"dtype must be one of"):
        AttentionBenchConfig(dtype="int8")
    with pytest.raises(ValueError, match=r"lengths is empty"):
        AttentionBenchConfig(lengths=())
    with pytest.raises(ValueError, match=r"each length must be >= 1, got 0"):
        AttentionBenchConfig(lengths=(0, 8))
    with pytest.raises(TypeError, match=r"config must be an AttentionBenchConfig, got dict"):
        bench_attention({"lengths": (8,)})


def test_runs_on_device(device):
    cfg = AttentionBenchConfig(lengths=(64,), heads=2, head_dim=8, rounds=1, measure_memory=device.type == "cuda")
    results = bench_attention(cfg, device=device)  # the matmul rate is timed alongside
    assert results["device"] == str(device) and len(results["points"]) == len(VARIANTS)
    for point in results["points"]:
        assert point["matmul_gflops"] > 0
        assert point["fraction_of_matmul"] == pytest.approx(point["gflops"] / point["matmul_gflops"])
    if device.type == "cuda":
        assert all(p["peak_bytes"] is not None for p in results["points"])


def test_command_prints_table_targets_json_and_plot(tmp_path, capsys):
    """`attn-course bench attention` (in-process: a subprocess would pay torch's import again)."""
    from attn_course.cli import main

    out_json, out_png = tmp_path / "attention.json", tmp_path / "attention.png"
    code = main(["bench", "attention", "--lengths", "64", "128", "--heads", "2", "--head-dim", "8", "--rounds", "1",
                 "--no-memory", "--json", str(out_json), "--plot", str(out_png)])
    printed = capsys.readouterr().out
    assert code == 0
    assert "GFLOP/s" in printed and "targets (ratios measured in this run)" in printed
    assert "linear time t(16384) / t(1024)" in printed and "block-local" in printed
    assert "ratio ours/torch" not in printed  # that is `bench mha`'s
    figures = json.loads(out_json.read_text())
    assert figures["attention"]["config"]["lengths"] == [64, 128] and figures["attention"]["config"]["heads"] == 2
    assert {p["variant"] for p in figures["attention"]["points"]} == set(VARIANTS)
    assert out_png.read_bytes()[:4] == b"\x89PNG"


def test_saved_tensor_bytes_counts_each_saved_storage_once():
    from attn_course.measure import saved_tensor_bytes

    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    assert saved_tensor_bytes(lambda t: t * t, x) == 4 * 8 * 8  # x saved twice, counted once
    assert saved_tensor_bytes(lambda t: t.exp(), x) == 4 * 8 * 8  # exp saves its output
    assert saved_tensor_bytes(lambda t: t.exp().sin(), x) == 4 * 8 * 8  # sin saves its input: exp's saved output
    assert saved_tensor_bytes(lambda t: t.sin().cos(), x) == 2 * 4 * 8 * 8  # x and sin(x): two storages
    assert saved_tensor_bytes(lambda t: t + 1, x) == 0  # addition needs nothing for its backward
    with torch.no_grad():
        assert saved_tensor_bytes(lambda t: t * t, x) == 0
    assert saved_tensor_bytes(lambda t: t * t, x.detach()) == 0  # nothing requires a gradient
    # Dense explicit attention keeps (L, S) matrices for backward; the fused kernel keeps O(L + S).
    L, D = 64, 8
    q, k, v = (torch.randn(1, 2, L, D, requires_grad=True) for _ in range(3))
    weights = 2 * L * L * 4
    assert saved_tensor_bytes(ac.scaled_dot_product_attention, q, k, v, fused=False) >= 2 * weights
    assert saved_tensor_bytes(ac.scaled_dot_product_attention, q, k, v, fused=True) < weights


# ---------------------------------------------------------------- attn-course bench peers

PEERS_TINY = dict(linear_lengths=(128,), exact_lengths=(64,), local_length=128, block_size=64, heads=2, head_dim=8,
                  mha_batch=2, mha_length=8, mha_d_model=16, mha_heads=2, rounds=1, measure_memory=False)
SAME_FUNCTION = {"lat_exact", "mea", "flash", "fused", "local_block", "local_sliding", "torch_mha"}


def _rows_by_impl(results, work):
    return {row["impl"]: row for row in results["rows"] if row["work"] == work}


def test_peers_harness_times_every_row_with_its_exactness():
    from attn_course.bench import PeersBenchConfig, bench_peers, format_peers_table

    results = bench_peers(PeersBenchConfig(**PEERS_TINY))
    comparisons = {row["comparison"] for row in results["rows"]}
    assert len(comparisons) == 1 + 4 + 2 + 1  # linear; exact x (causal, pass); block and sliding; MHA
    assert {row["impl"] for row in results["rows"]} == {
        "ours_linear", "lat_exact", "lat_bucketed", "fused", "ours_chunked", "mea", "flash",
        "ours_block", "local_block", "ours_sliding", "local_sliding", "ours_mha", "torch_mha"}
    for row in results["rows"]:
        assert row["time_s"] > 0 and row["x_fused"] > 0, row
        if row["impl"].startswith("ours"):
            assert row["max_abs_diff"] == 0, row
        elif row["impl"] in SAME_FUNCTION and not (row["impl"] == "fused" and row["work"] in ("linear", "local")):
            assert row["max_abs_diff"] < 1e-4, row  # float32: the same function, rounded differently
        elif row["impl"] == "fused":  # softmax vs linear / local attention: a cost reference only
            assert row["max_abs_diff"] is None and row["note"], row
        else:  # the bucketed peer: another function, its row says so
            assert row["impl"] == "lat_bucketed" and "not the same function" in row["note"], row
    assert _rows_by_impl(results, "linear")["lat_bucketed"]["max_abs_diff"] > 1e-2  # another function, and it shows
    assert all(row["x_fused"] == 1.0 for row in results["rows"] if row["impl"] in ("fused", "torch_mha"))
    for name, version in results["peers"].items():
        assert version, name
    printed = format_peers_table(results)
    for text in ("causal_linear_attn(bucket_size=1)", "FlashAttentionFunction", "memory_efficient_attention",
                 "LocalAttention(look_backward=0)", "nn.MultiheadAttention", "what each comparison computes",
                 "not the same function", "targets"):
        assert text in printed, text
    targets = {t["target"]: t for t in results["targets"]}
    assert any("chunked / fastest peer, time" in t for t in targets) and any("ours / LocalAttention" in t for t in targets)
    assert all(t["value"] is not None for t in results["targets"])
    json.dumps(results)  # JSON-able


def test_peers_compute_the_same_function_as_ours_in_float64():
    """Read from their sources, matched in the harness; checked here where rounding cannot hide a difference."""
    from attn_course.bench import PeersBenchConfig, bench_peers

    results = bench_peers(PeersBenchConfig(**{**PEERS_TINY, "dtype": "float64", "works": ("linear", "exact", "local")}))
    linear, exact, local = (_rows_by_impl(results, work) for work in ("linear", "exact", "local"))
    assert linear["lat_exact"]["max_abs_diff"] < 1e-10
    assert local["local_sliding"]["max_abs_diff"] < 1e-10
    for row in results["rows"]:
        if row["impl"] in ("fused", "local_block"):
            assert row["max_abs_diff"] is None or row["max_abs_diff"] < 1e-10, row
        if row["impl"] == "mea":
            assert row["max_abs_diff"] < 1e-7, row  # it adds 1e-8 to the softmax denominator
        if row["impl"] == "flash":  # float32 running sums whatever the input: it cannot take float64
            assert row["time_s"] is None and row["note"].startswith("skipped"), row
    assert exact["mea"]["max_abs_diff"] is not None


@pytest.mark.slow
def test_peers_peak_memory_of_the_exact_rows_is_measured_in_child_processes():
    from attn_course.bench import PeersBenchConfig, bench_peers

    results = bench_peers(PeersBenchConfig(**{**PEERS_TINY, "works": ("exact", "mha"), "measure_memory": True}))
    assert results["memory_method"].startswith("child process")
    for row in results["rows"]:
        if row["work"] == "exact":
            assert isinstance(row["peak_bytes"], int) and row["peak_bytes"] >= 0, row
        else:
            assert row["peak_bytes"] is None
    assert any("peak memory" in t["target"] for t in results["targets"])


def test_bench_peers_without_the_extra_exits_2_naming_it(monkeypatch, capsys):
    import sys

    from attn_course.cli import main

    monkeypatch.setitem(sys.modules, "local_attention", None)  # import local_attention now raises ImportError
    assert main(["bench", "peers", "--quick"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert "local-attention" in err and "pip install 'attn-course[bench]'" in err


def test_bench_peers_command_quick_prints_and_writes_json(tmp_path, capsys):
    from attn_course.cli import main

    path = tmp_path / "peers.json"
    assert main(["bench", "peers", "--quick", "--works", "exact", "mha", "--json", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "exact attention, causal, forward+backward, N=128" in printed and "ours / nn.MultiheadAttention" in printed
    figures = json.loads(path.read_text())["peers"]
    assert {row["work"] for row in figures["rows"]} == {"exact", "mha"}


def test_bench_peers_refuses_a_local_length_that_is_not_whole_blocks(capsys):
    from attn_course.cli import main

    assert main(["bench", "peers", "--quick", "--works", "local", "--sizes", "100"]) == 2
    assert "multiple of block_size" in capsys.readouterr().err


def test_bench_extra_pins_the_peers_the_harness_imports():
    """The peers are imported by name (they are an extra, not runtime dependencies): the extra must list exactly them."""
    import tomllib
    from importlib import metadata
    from pathlib import Path

    from attn_course.bench import PEER_PACKAGES

    project = tomllib.loads((Path(ac.__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    pins = dict(requirement.split("==") for requirement in project["optional-dependencies"]["bench"])
    assert set(pins) == set(PEER_PACKAGES)
    runtime = " ".join(project["dependencies"])
    assert not any(name in runtime for name in PEER_PACKAGES)
    for name, version in pins.items():
        assert metadata.version(name) == version, f"{name}: installed {metadata.version(name)}, the extra pins {version}"
