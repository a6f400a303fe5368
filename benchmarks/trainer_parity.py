"""Long-run loss parity of the trainer: FSDP2 x CP against one process without CP (issue 15).

    python benchmarks/trainer_parity.py [--steps 200] [--dtype float32] [--date 2026-12-01] [--device cpu]

Runs `cpcompile compare` on the example pair (examples/parity_qwen3_5_fsdp_cp.yaml: a tiny Qwen3.5,
GDN State-P2P + SDPA AllGather, 4 gloo ranks as dp_shard 2 x cp 2; examples/parity_qwen3_5_single.yaml:
the same in one process) for `--steps` steps in `--dtype`, each side with `cpcompile train --nproc-per-node`, and writes
the per-step table and the plot of both curves to benchmarks/results/trainer_parity_<date>_<device>.{md,png}.

The data are learnable text, not the examples' random token ids: README.md and docs/*.md of this
checkout, concatenated into a temporary file and read as `data.source: text` (blank-line separated
documents, the trainer's byte tokenizer, so `model.vocab_size` becomes 257) with `data.packing: true`
(full rows, no padding). Only the temporary copies change; the examples stay as CI uses them.
The corpus is whatever those files hold at the time, so a record is tied to its checkout (the
table gives the corpus size).

Float32 differences grow with the steps (two exact algorithms round differently and Adam follows
the gradients' signs), so the table is a record, judged at a loose `--rtol`, not a pass/fail test.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cpcompile.trainer.compare import compare_configs  # noqa: E402
from cpcompile.trainer.tokenizer import ByteTokenizer  # noqa: E402

PAIR = ("parity_qwen3_5_fsdp_cp.yaml", "parity_qwen3_5_single.yaml")
BYTE_VOCAB = ByteTokenizer.vocab_size  # 256 bytes and the end-of-document id: 257


def _corpus(folder: str) -> str:
    """The repository's own prose (README.md, docs/*.md) as one text file: no download."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    path = os.path.join(folder, "corpus.txt")
    Path(path).write_text("\n\n".join(f.read_text(encoding="utf-8") for f in files), encoding="utf-8")
    return path


def _variant(name: str, folder: str, dtype: str, steps: int, corpus: str) -> str:
    config = yaml.safe_load((ROOT / "examples" / name).read_text())
    config["train"].update(dtype=dtype, steps=steps)
    config["model"]["vocab_size"] = BYTE_VOCAB
    config["data"] = {"source": "text", "path": corpus, "packing": True}
    path = os.path.join(folder, name)
    Path(path).write_text(yaml.safe_dump(config))
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rtol", type=float, default=1e-3)
    parser.add_argument("--date", default=_dt.date.today().isoformat())
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = ROOT / "benchmarks" / "results"
    stem = f"trainer_parity_{args.date}_{args.device}"
    with tempfile.TemporaryDirectory() as folder:
        corpus = _corpus(folder)
        corpus_bytes = Path(corpus).stat().st_size
        a, b = (_variant(name, folder, args.dtype, args.steps, corpus) for name in PAIR)
        start = time.perf_counter()
        result = compare_configs(a, b, args.steps, args.rtol, os.path.join(folder, "out"), log=lambda _: None)
        seconds = time.perf_counter() - start
        if result.plot:
            shutil.copy(result.plot, results / f"{stem}.png")
    rows = result.rows
    header = [f"# Trainer loss parity: dp_shard 2 x cp 2 vs one process — {args.date}, {args.device}", "",
              f"Tiny Qwen3.5 ({PAIR[0]} vs {PAIR[1]}, vocab_size {BYTE_VOCAB}), {args.dtype}, {args.steps} steps, "
              f"AdamW (warmup 4, cosine), grad clip 1.0; data: README.md + docs/*.md ({corpus_bytes} bytes) as "
              f"`data.source: text`, byte tokens, packed (ln {BYTE_VOCAB} = {math.log(BYTE_VOCAB):.3f}); "
              f"`python benchmarks/trainer_parity.py --steps {args.steps} --dtype {args.dtype}` "
              f"({seconds:.0f} s).", "",
              f"Worst relative difference: loss {max(r['loss_rel'] for r in rows):.1e}, grad-norm "
              f"{max(r['grad_norm_rel'] for r in rows):.1e}; last loss A {rows[-1]['loss_a']:.6f}, "
              f"B {rows[-1]['loss_b']:.6f}." + (f" Plot: `{stem}.png`." if result.plot else ""), ""]
    shown = [r for r in rows if r["step"] in (1, 2, 5) or r["step"] % max(1, args.steps // 10) == 0]
    table = ["| step | loss A | loss B | rel. diff | grad-norm A | grad-norm B | rel. diff |", "|---|---|---|---|---|---|---|"]
    table += [f"| {r['step']} | {r['loss_a']:.6f} | {r['loss_b']:.6f} | {r['loss_rel']:.1e} | {r['grad_norm_a']:.5f} | "
              f"{r['grad_norm_b']:.5f} | {r['grad_norm_rel']:.1e} |" for r in shown]
    text = "\n".join(header + table) + "\n"
    (results / f"{stem}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
