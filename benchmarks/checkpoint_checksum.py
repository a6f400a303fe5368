"""What the checkpoint checksums cost (issue 47, item 3): a DCP save and load of `--gib` GiB of
tensors in one process, and the time to checksum the files it wrote, with CRC-32 (what
`cpcompile/trainer/checksums.py` uses) and, for comparison, the standard library's sha256 and
blake2b. The files are read back from the page cache (just written), as at a save; `--cold`
drops the caches first (root only) for the load side. One process hashes everything here; in a
run each rank hashes 1/world of the files.

    python benchmarks/checkpoint_checksum.py                  # 1.1 GiB (0.57B parameters in bf16)
    python benchmarks/checkpoint_checksum.py --gib 5.3        # + AdamW's two fp32 moments
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import tempfile
import time

import torch
import torch.distributed.checkpoint as dcp

from cpcompile.trainer import checksums

GIB = 2 ** 30
TENSOR_BYTES = 64 * 2 ** 20  # the state is split into tensors of this size, like a model's weights


def state_of(gib: float) -> dict:
    count = max(1, int(gib * GIB) // TENSOR_BYTES)
    return {f"w{i}": torch.randint(-2 ** 15, 2 ** 15, (TENSOR_BYTES // 2,), dtype=torch.int16).view(torch.bfloat16)
            for i in range(count)}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def digest_all(folder: str, names: list[str], algorithm: str) -> None:
    for name in names:
        path = os.path.join(folder, name)
        if algorithm == checksums.ALGORITHM:
            checksums.file_checksum(path)
        else:
            with open(path, "rb") as handle:
                hashlib.file_digest(handle, algorithm)


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w", encoding="ascii") as handle:
            handle.write("3\n")
        return True
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.1)
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary folder)")
    parser.add_argument("--cold", action="store_true", help="drop the page cache before the load-side timings")
    args = parser.parse_args()
    folder = tempfile.mkdtemp(dir=args.dir, prefix="checksum-bench-")
    try:
        state = state_of(args.gib)
        save_s = timed(lambda: dcp.save(state, checkpoint_id=folder, no_dist=True))
        names = checksums.checkpoint_files(folder)
        size = sum(os.path.getsize(os.path.join(folder, name)) for name in names)
        rows = [("dcp.save", save_s)]
        for algorithm in (checksums.ALGORITHM, "sha256", "blake2b"):
            rows.append((f"{algorithm}, after the save (page cache)", timed(lambda a=algorithm: digest_all(folder, names, a))))
        target = {key: torch.empty_like(value) for key, value in state.items()}

        def load() -> None:
            dcp.load(target, checkpoint_id=folder, no_dist=True)

        cold = args.cold and drop_caches()
        where = " (cold cache)" if cold else ""
        rows.append((f"dcp.load alone{where}", timed(load)))
        cold = args.cold and drop_caches()
        rows.append((f"{checksums.ALGORITHM} before the load{where}",
                     timed(lambda: digest_all(folder, names, checksums.ALGORITHM))))
        rows.append(("dcp.load after the checksum (its files now cached)", timed(load)))
        print(f"checkpoint: {size / GIB:.3f} GiB in {len(names)} files, {torch.get_num_threads()} threads, "
              f"{os.cpu_count()} CPUs")
        print("| step | seconds | GB/s |")
        print("|---|---|---|")
        for name, seconds in rows:
            print(f"| {name} | {seconds:.2f} | {size / seconds / 1e9:.2f} |")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
