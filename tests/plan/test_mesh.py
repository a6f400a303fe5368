"""cpcompile.mesh: single-process, fake-process-group and 4-rank gloo builds."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from cpcompile.errors import CPConfigError
from cpcompile.mesh import CPMesh, build_mesh
from cpcompile.plan import AcceleratorConfig, load_plan
from dist_utils import DistributedTestError, run_distributed

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


@pytest.fixture
def no_process_group(monkeypatch):
    """Start and end each test without a default process group or torchrun variables."""
    for name in _TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    if dist.is_initialized():
        dist.destroy_process_group()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def fake_pg(no_process_group):
    # Imported here, not at module level: the spawned ranks import this module too, and
    # torch.testing._internal costs them seconds.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def init(rank: int, world_size: int):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    return init


# --------------------------------------------------------------------------- one process


def test_single_process_build_initialises_gloo(no_process_group):
    mesh = build_mesh(AcceleratorConfig(), device_type="cpu")
    assert isinstance(mesh, CPMesh)
    assert dist.get_backend() == "gloo" and dist.get_world_size() == 1
    assert mesh.root.mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    assert tuple(mesh.root.shape) == (1, 1, 1, 1, 1)
    assert (mesh.cp_size, mesh.cp_rank, mesh.dp_cp.size(), mesh.device_type) == (1, 0, 1, "cpu")
    assert isinstance(mesh.cp_group, dist.ProcessGroup)
    assert mesh.cp_group_name == mesh.cp_group.group_name and isinstance(mesh.cp_group_name, str)


def test_build_mesh_accepts_plan_and_uses_existing_group(no_process_group):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    default = dist.group.WORLD
    mesh = build_mesh(load_plan({"accelerator": {"cp_size": 1}}))
    assert dist.group.WORLD is default and mesh.cp_size == 1
    if not torch.cuda.is_available():
        assert mesh.device_type == "cpu"


def test_world_size_mismatch(no_process_group):
    with pytest.raises(CPConfigError) as info:
        build_mesh(AcceleratorConfig(cp_size=2, dp_shard_size=2), device_type="cpu")
    msg = str(info.value)
    assert "world size 1" in msg and "= 4" in msg and "pp x dp_replicate x dp_shard x cp x tp" in msg
    assert not dist.is_initialized()  # the group it created for the check is gone again


def test_world_size_mismatch_with_existing_group(fake_pg):
    fake_pg(0, 8)
    with pytest.raises(CPConfigError, match=r"world size 8 .* = 4"):
        build_mesh(AcceleratorConfig(cp_size=4), device_type="cpu")
    assert dist.is_initialized()  # not ours: left alone


def test_partial_torchrun_env_is_reported(no_process_group, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(CPConfigError, match="WORLD_SIZE, MASTER_ADDR, MASTER_PORT"):
        build_mesh(AcceleratorConfig(), device_type="cpu")


def test_unsupported_device_type(no_process_group):
    with pytest.raises(CPConfigError, match="unsupported device_type 'tpu'"):
        build_mesh(AcceleratorConfig(), device_type="tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_cuda_requested_without_cuda(no_process_group):
    with pytest.raises(CPConfigError, match="torch.cuda.is_available"):
        build_mesh(AcceleratorConfig(), device_type="cuda")


def test_npu_without_torch_npu(no_process_group):
    try:
        import torch_npu  # noqa: F401
        pytest.skip("torch_npu is installed")
    except ImportError:
        pass
    with pytest.raises(CPConfigError, match="torch_npu"):
        build_mesh(AcceleratorConfig(), device_type="npu")
    assert not dist.is_initialized()


def test_invalid_accelerator_is_rejected_before_any_group(no_process_group):
    from cpcompile.errors import PlanError
    with pytest.raises(PlanError, match="accelerator.cp_size"):
        build_mesh(AcceleratorConfig(cp_size=0), device_type="cpu")
    with pytest.raises(TypeError):
        build_mesh({"cp_size": 2})
    assert not dist.is_initialized()


# --------------------------------------------------------------------------- fake process group


@pytest.mark.parametrize("rank", [0, 5])
def test_fake_pg_structure(fake_pg, rank):
    # world 8 = dp_shard 2 x cp 4: cp groups are [0..3] and [4..7]
    fake_pg(rank, 8)
    mesh = build_mesh(AcceleratorConfig(cp_size=4, dp_shard_size=2), device_type="cpu")
    assert (mesh.cp_size, mesh.cp_rank, mesh.dp_cp.size()) == (4, rank % 4, 8)
    assert mesh.cp_ranks_all() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dist.get_process_group_ranks(mesh.cp_group) == [rank // 4 * 4 + i for i in range(4)]
    groups = mesh.cp_subgroups(2)
    base = rank // 4 * 4
    assert dist.get_process_group_ranks(groups.ulysses) == [base + (rank % 4) // 2 * 2 + i for i in range(2)]
    assert dist.get_process_group_ranks(groups.ring) == [base + rank % 2, base + rank % 2 + 2]
    assert mesh.cp_subgroups(2) is groups  # cached, built once
    with pytest.raises(CPConfigError, match="must be an int"):
        mesh.cp_subgroups(2.0)  # equal hash to 2: must not slip through the cache


def test_fake_pg_cp_between_tp_ranks(fake_pg):
    # cp=2 x tp=2: the cp dimension is strided by tp
    fake_pg(1, 4)
    mesh = build_mesh(AcceleratorConfig(cp_size=2, tp_size=2), device_type="cpu")
    assert dist.get_process_group_ranks(mesh.cp_group) == [1, 3]
    assert mesh.cp_ranks_all() == [[0, 2], [1, 3]]
    assert dist.get_process_group_ranks(mesh.dp_cp.get_group()) == [1, 3]


@pytest.mark.parametrize("cp, u, cause", [
    (4, 1, "1 < ulysses_degree < cp_size"),
    (4, 4, "1 < ulysses_degree < cp_size"),
    (6, 4, "not divisible"),
    (4, 2.0, "must be an int"),
])
def test_hybrid_degree_is_validated(fake_pg, cp, u, cause):
    fake_pg(0, cp)
    mesh = build_mesh(AcceleratorConfig(cp_size=cp), device_type="cpu")
    with pytest.raises(CPConfigError, match=cause) as info:
        mesh.cp_subgroups(u)
    assert f"cp_size={cp}" in str(info.value) or "int" in cause


# --------------------------------------------------------------------------- 4 gloo ranks


def _gather_ranks(group: dist.ProcessGroup) -> list[int]:
    """Global ranks of the members of `group`, learned through a real all_gather inside it."""
    mine = torch.tensor([dist.get_rank()])
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    return [int(t) for t in out]


def _four_rank_meshes(rank: int, world_size: int) -> dict:
    report = {}
    mesh = build_mesh(AcceleratorConfig(cp_size=4), device_type="cpu")
    hybrid = mesh.cp_subgroups(2)
    assert mesh.cp_subgroups(2) is hybrid
    report["cp4"] = dict(
        cp_rank=mesh.cp_rank, cp_size=mesh.cp_size, dp_cp=mesh.dp_cp.size(),
        cp_members=_gather_ranks(mesh.cp_group), dp_cp_members=_gather_ranks(mesh.dp_cp.get_group()),
        ulysses=_gather_ranks(hybrid.ulysses), ring=_gather_ranks(hybrid.ring),
        ulysses_rank=dist.get_rank(hybrid.ulysses), ring_rank=dist.get_rank(hybrid.ring),
    )
    mesh = build_mesh(AcceleratorConfig(cp_size=2, dp_shard_size=2), device_type="cpu")
    report["cp2_dp2"] = dict(
        cp_rank=mesh.cp_rank, cp_size=mesh.cp_size, dp_cp=mesh.dp_cp.size(),
        cp_members=_gather_ranks(mesh.cp_group), dp_cp_members=_gather_ranks(mesh.dp_cp.get_group()),
        cp_group_name=mesh.cp_group_name,
    )
    return report


def test_four_gloo_ranks():
    # init_pg=False: build_mesh itself initialises gloo from the env:// variables.
    reports = run_distributed(_four_rank_meshes, 4, init_pg=False, timeout=90)
    for rank, r in enumerate(reports):
        cp4 = r["cp4"]
        assert (cp4["cp_rank"], cp4["cp_size"], cp4["dp_cp"]) == (rank, 4, 4)
        assert cp4["cp_members"] == [0, 1, 2, 3] and cp4["dp_cp_members"] == [0, 1, 2, 3]
        # Ulysses = 2 consecutive cp ranks; ring = same position inside the Ulysses group.
        assert cp4["ulysses"] == ([0, 1] if rank < 2 else [2, 3])
        assert cp4["ring"] == ([0, 2] if rank % 2 == 0 else [1, 3])
        assert (cp4["ulysses_rank"], cp4["ring_rank"]) == (rank % 2, rank // 2)

        c = r["cp2_dp2"]
        assert (c["cp_rank"], c["cp_size"], c["dp_cp"]) == (rank % 2, 2, 4)
        assert c["cp_members"] == ([0, 1] if rank < 2 else [2, 3])
        assert c["dp_cp_members"] == [0, 1, 2, 3]
    assert reports[0]["cp2_dp2"]["cp_group_name"] == reports[1]["cp2_dp2"]["cp_group_name"]


# --------------------------------------------------------------------------- the launcher itself


def _fail_on_rank_2(rank: int, world_size: int) -> int:
    if rank == 2:
        raise CPConfigError(f"boom on rank {rank}")
    dist.barrier()  # the other ranks would wait forever without the launcher's cleanup
    return rank


def test_run_distributed_propagates_rank_exception():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_fail_on_rank_2, 3, timeout=60)
    err = info.value
    assert "rank 2" in str(err) and "boom on rank 2" in str(err) and "Traceback" in str(err)
    assert isinstance(err.exceptions[2], CPConfigError)


def _sum_args(rank: int, world_size: int, a: int, b: int) -> tuple[int, int, str]:
    t = torch.tensor([rank])
    dist.all_reduce(t)
    return rank + a + b, int(t), os.environ["RANK"]


def test_run_distributed_returns_per_rank_results():
    assert run_distributed(_sum_args, 2, 10, 100) == [(110, 1, "0"), (111, 1, "1")]


def _hang_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        import time
        time.sleep(60)
    return rank


def test_run_distributed_times_out():
    with pytest.raises(DistributedTestError, match=r"rank 1 ---\ntimed out after 2 s"):
        run_distributed(_hang_on_rank_1, 2, timeout=2)


def _die_on_rank_0(rank: int, world_size: int) -> int:
    if rank == 0:
        os._exit(3)
    return rank


def test_run_distributed_reports_dead_rank():
    with pytest.raises(DistributedTestError, match="exited with code 3 without reporting"):
        run_distributed(_die_on_rank_0, 2, timeout=30)


@pytest.mark.slow
def test_run_distributed_spawn_and_init_by_build_mesh():
    # The spawn path (fresh interpreters; fn found by import) with build_mesh initialising gloo.
    reports = run_distributed(_cp2_report, 2, start_method="spawn", init_pg=False, timeout=90)
    assert reports == [(0, 2, [0, 1]), (1, 2, [0, 1])]


def _cp2_report(rank: int, world_size: int):
    mesh = build_mesh(AcceleratorConfig(cp_size=2), device_type="cpu")
    return mesh.cp_rank, mesh.cp_size, _gather_ranks(mesh.cp_group)
