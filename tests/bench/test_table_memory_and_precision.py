"""bench/table_memory.py and bench/lev_precision.py at small sizes: they run, and what they compare holds."""

from __future__ import annotations

import re

from tests.bench import load_bench


def test_table_memory_variants_give_identical_gradients(capsys):
    bench = load_bench("table_memory")
    code = bench.main(["--vocab", "3000", "--hidden", "32", "--micro-batches", "3", "--micro-batch-tokens", "64",
                       "--repeats", "1"])
    out = capsys.readouterr().out
    assert code == 0 and "bit-identical" in out
    assert "one fp32 gradient buffer" in out and "dense V x D gradient per micro-batch" in out


def test_lev_precision_orders_the_variants(capsys):
    bench = load_bench("lev_precision")
    assert bench.main(["--vocab", "5000", "--hidden", "64", "--ids", "512", "--init-sample", "4096"]) == 0
    units = {m.group(1): float(m.group(2)) for m in re.finditer(r"^\| (.+?) \| \S+ \| ([\d.]+) \|$",
                                                                  capsys.readouterr().out, re.M)}
    assert units["fp32 (the layer)"] < 0.01
    assert units["tf32 projection"] < units["bf16 projection"]
    assert units["bf16 TP partials (TP=2)"] > 0.1
    assert units["bf16 projection, W already bf16"] < units["bf16 projection"]
    assert set(units) == {"fp32 (the layer)", "tf32 projection", "bf16 projection", "bf16 TP partials (TP=2)",
                          "coordinates in tf32", "bf16 projection, W already bf16"}


def test_tf32_rounding_keeps_ten_mantissa_bits():
    import torch

    bench = load_bench("lev_precision")
    x = torch.tensor([1.0 + 2.0 ** -10, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 3.0])
    assert bench.tf32(x).tolist() == [1.0 + 2.0 ** -10, 1.0, 1.0 + 2.0 ** -9, 3.0]
