"""`trainer_gpu.py --simulate-cp` on CPU at a tiny size (one rank of a CP=2 job per row, under the
fake process group), and the byte counter it uses (`benchmarks/collective_bytes.py`) on a known set
of collectives, each checked against the formula of that module's doc."""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from script_ranks import run_script  # noqa: E402


def test_simulate_cp_prints_a_row_per_rank_with_bytes_sent():
    """... for SDPA Head-Tail (GDN then in Head-Tail order too: both kinds of CP collectives and the
    layout's reordering; AllGather's collectives are counted in `test_bytes_sent_match_the_formulas`), the last rank
    (its bytes include the GDN chain's sends), and, with --profile, its ops in one step more."""
    stdout = run_script("trainer_gpu.py", "--simulate-cp", "2", "--small", "--device", "cpu", "--tokens", "64",
                        "--sdpa", "head_tail", "--steps", "1", "--profile", "--ranks", "last")
    table = stdout[stdout.index("| SDPA | N |"):].split("\n\n")[0].splitlines()[2:]
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in table]
    assert [row[:5] for row in rows] == [["head_tail", "2", "64", "32", "1"]]
    for row in rows:
        sent_cp = float(row[10].split("(")[1].split()[0])
        assert sent_cp > 0, row
        assert float(row[8]) > 0 and float(row[6]) > 0, row  # compute time, memory estimate
    assert "\n| head_tail | 2 | 64 | " in stdout.split("The CP=N job")[1]  # its job line
    assert stdout.count("Self CPU time total") == 1, stdout[:3000]  # the rank's profile


def test_the_counted_step_is_never_the_first():
    from simulate_cp import counted_step

    assert [counted_step(warmup) for warmup in (1, 2, 3)] == [1, 1, 2]  # one warm-up: the first measured step
    with pytest.raises(ValueError, match="warmup"):
        counted_step(0)


@pytest.mark.parametrize("ranks, expected", [("ends", [0, 3]), ("first", [0]), ("last", [3]), ("middle", [2]),
                                              ("ends+middle", [0, 2, 3])])
def test_rows_run_the_chosen_ranks(ranks, expected):
    from simulate_cp import row_specs

    specs = row_specs([4], [128], ["all_gather"], ranks)
    assert [spec["rank"] for spec in specs] == expected


@torch.library.custom_op("test_simulate_cp::send_inside", mutates_args=())
def send_inside(x: torch.Tensor) -> torch.Tensor:
    """A send inside a custom op, as GDN State-P2P's executor sends its states."""
    dist.isend(x.contiguous(), dst=2).wait()
    return x.clone()


@pytest.fixture
def fake_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_bytes_sent_match_the_formulas(fake_group):
    """Rank 1 of 4, float32 inputs: every collective of the module doc's table, functional, c10d
    and point-to-point (one send inside a custom op, as GDN State-P2P's), counted once each."""
    from collective_bytes import CollectiveBytes

    name, n = fake_group.group_name, 4
    funcol = torch.ops._c10d_functional
    plain_send = dist.ProcessGroup.__dict__["send"]
    with CollectiveBytes() as sent:
        funcol.wait_tensor(torch.ops._c10d_functional_autograd.all_gather_into_tensor(torch.zeros(8), n, name))
        funcol.wait_tensor(funcol.reduce_scatter_tensor(torch.zeros(32), "sum", n, name))
        funcol.wait_tensor(funcol.all_to_all_single(torch.zeros(8), [2, 2, 2, 2], [1, 1, 1, 5], name))
        dist.all_gather_into_tensor(torch.empty(32), torch.zeros(8))
        dist.reduce_scatter_tensor(torch.empty(2), torch.zeros(8))
        dist.all_reduce(torch.zeros(4))
        dist.isend(torch.zeros(5), dst=2).wait()
        dist.irecv(torch.zeros(5), src=0).wait()
        send_inside(torch.zeros(6))
    expected = {
        "cp/all_gather_into_tensor": (1, (n - 1) * 32),  # its 32 bytes to 3 peers
        "cp/reduce_scatter_tensor": (1, 128 * (n - 1) // n),  # 3 of its 4 blocks of 32 bytes
        "cp/all_to_all_single": (1, 32 * 7 // 8),  # keeps its own row (split 1 of 8 rows)
        "cp/send": (2, 20 + 24),  # the receive sends nothing
        "fsdp/_allgather_base_": (1, (n - 1) * 32),
        "fsdp/_reduce_scatter_base_": (1, 32 * (n - 1) // n),
        "reductions/allreduce_": (1, 2 * 16 * (n - 1) // n),
    }
    assert sent.by_collective() == expected
    assert sent.total == sum(b for _, b in expected.values()) and not sent.unknown
    assert dist.ProcessGroup.__dict__["send"] is plain_send  # unwrapped again
