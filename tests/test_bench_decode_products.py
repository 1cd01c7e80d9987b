"""benchmarks/decode_products.py: one decode step's products, weights from memory and from cache."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from hybridrl.models.tiny import build_tiny_model  # noqa: E402
from hybridrl.rollout import cpu_kernels  # noqa: E402

kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernels is None or not kernels.dense_supported,
                                reason="the fused kernels' dense products need an AVX-512 or AVX2 build")


def test_a_step_counts_every_weight_of_the_model_once():
    import decode_products

    model = build_tiny_model(preset="tiny")
    # the bytes a decode step reads: every Linear of the decoder layers and the LM head, fp32
    linears = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    weights = linears + model.lm_head.weight.numel()
    results = decode_products.main(["--model", "tiny", "--rows", "3,8", "--reps", "2", "--rates", "off"])
    assert [r["rows"] for r in results] == [3, 8]
    for result in results:
        assert result["bytes"] == 4 * weights
        assert result["layer_bytes"] == 4 * linears
        assert result["flops"] == 2 * result["rows"] * weights
        assert result["memory_s"] > 0 and result["cache_s"] > 0
        assert set(result["products_s"]) == {"qkv", "o", "gate_up", "down", "lm_head"}
        assert all(s > 0 for s in result["products_s"].values())


def test_the_report_puts_the_step_against_both_bounds():
    import decode_products

    result = {"rows": 16, "memory_s": 0.05, "cache_s": 0.025, "bytes": 500e6, "layer_bytes": 400e6,
              "flops": 4e9, "products_s": {"qkv": 0.01}}
    text = decode_products.report(result, bandwidth=10e9, peak=200e9)
    # reading 50 ms, arithmetic 20 ms: the step (50 ms) is at the larger bound; no overlap: 25 + 40 ms
    assert "reading 50.0 ms (10.0 GB/s), arithmetic 20.0 ms (200 GFLOP/s)" in text
    assert "at 100% of the larger bound" in text
    assert "no overlap at all would take 65.0 ms" in text
    assert "10.0 GB/s, 80 GFLOP/s" in text
