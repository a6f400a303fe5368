"""`benchmarks/trainer_vs_hf.py` on CPU at a tiny size: a row per method (transformers without
fla-core, the model's own loss; the fused loss's row says it is not installed), and its length
search (fixed lengths, then doubling until out of memory or the budget) with the attempts stubbed.
No speed claim here."""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import trainer_vs_hf  # noqa: E402
from script_ranks import run_script  # noqa: E402


def test_one_row_per_method_and_a_results_file(tmp_path):
    out = tmp_path / "result.md"
    run_script("trainer_vs_hf.py", "--small", "--device", "cpu", "--seq-lens", "256", "--warmup", "1", "--repeat", "1",
               "--out", str(out))
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]]
            for line in out.read_text().splitlines() if line.startswith("| ") and "seq len" not in line}
    for method in ("cpcompile", "hf"):
        assert rows[method][1:3] == ["256", "1/1"] and float(rows[method][3]) > 0, rows[method]
    assert "fla-core not used" in rows["hf"][8]
    fused = rows["hf_fused_ce"]
    assert "not available" in fused[3] or float(fused[3]) > 0, fused
    assert "- cpcompile: longest that ran 256" in out.read_text()


def test_the_length_search_doubles_until_out_of_memory(monkeypatch):
    tried = []

    def attempt(args, argv, spec):
        tried.append((spec["seq_len"], spec["warmup"], spec["repeat"]))
        if spec["seq_len"] >= 1024 ** 2:
            return {**spec, "note": "OOM (warm-up: ...)"}
        return {**spec, "setup_s": 1.0, "seconds": 0.01, "tokens_per_s": 1.0, "peak_gib": None, "mfu": 0.0}

    monkeypatch.setattr(trainer_vs_hf, "attempt", attempt)
    args = argparse.Namespace(seq_lens=[32768, 65536, 131072], max_seq_len=4 * 1024 ** 2, warmup=3, repeat=5)
    rows = trainer_vs_hf.run_method(args, [], "hf", budget=1000.0)
    assert tried == [(32768, 3, 5), (65536, 3, 5), (131072, 3, 5), (262144, 1, 1), (524288, 1, 1), (1048576, 1, 1)]
    assert trainer_vs_hf.longest(rows) == "- hf: longest that ran 512K; 1M: OOM (warm-up: ...)"


def test_an_attempt_predicted_past_the_budget_is_not_started(monkeypatch):
    monkeypatch.setattr(trainer_vs_hf, "attempt", lambda args, argv, spec: {
        **spec, "setup_s": 10.0, "seconds": 20.0, "tokens_per_s": 1.0, "peak_gib": None, "mfu": 0.0})
    args = argparse.Namespace(seq_lens=[32768, 65536], max_seq_len=65536, warmup=3, repeat=5)
    rows = trainer_vs_hf.run_method(args, [], "cpcompile", budget=100.0)
    # set-up 10 s + (3 warm-up + 1 measured) x 20 s x 3
    assert len(rows) == 2 and rows[1]["note"].startswith("not run: over the time budget (250 s predicted")
