"""Stage 2 of the pipeline: the device mesh and the named CP communication groups.

`build_mesh(accelerator)` returns a `CPMesh`: the 5-D root mesh
``(pp, dp_replicate, dp_shard, cp, tp)`` (size-1 dimensions kept, so every name always exists),
the 1-D `cp` mesh (attention collectives) and the flattened `dp_cp` mesh (global loss / token
counts). Hybrid CP's Ulysses and ring sub-groups come from `CPMesh.cp_subgroups(u)`: built once,
collectively, and cached - never created inside a forward.

Process group: if none is initialised, `build_mesh` initialises the default one with the backend of
the device type (cuda->nccl, npu->hccl, cpu->gloo) from the `env://` variables torchrun sets; a job
of world size 1 started without those variables gets a private single-rank group. An already
initialised default group (any backend, including the fake one) is used as it is.

Timeout: `build_mesh(..., timeout=timedelta)` gives every group it makes that collective timeout:
the default group it initialises, each mesh dimension's group and the flattened `dp_cp` group
(through DeviceMesh's `backend_override` options), and the Hybrid sub-groups; a collective that
waits longer fails (gloo raises in the waiting rank; NCCL's watchdog ends the process). Without
it, PyTorch's defaults hold (30 minutes for gloo, 10 for NCCL). An already initialised default
group keeps its own timeout.

Structure tests: `build_mesh(..., device_type="cpu")` works directly under the fake process group
(`torch.testing._internal.distributed.fake_pg`): init it with
``dist.init_process_group("fake", store=FakeStore(), rank=r, world_size=n)`` first. No helper needed.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .errors import CPConfigError
from .plan import AcceleratorConfig, Plan

MESH_DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
DP_CP_DIMS = ("dp_replicate", "dp_shard", "cp")
BACKEND_FOR_DEVICE = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class HybridGroups(NamedTuple):
    """Hybrid CP sub-groups of this rank: Ulysses (A2A) and ring (K/V AllGather)."""

    ulysses: dist.ProcessGroup
    ring: dist.ProcessGroup


@dataclass
class CPMesh:
    """The root mesh plus the named sub-meshes CP needs. Build it with `build_mesh`."""

    root: DeviceMesh
    cp: DeviceMesh
    dp_cp: DeviceMesh
    device_type: str
    accelerator: AcceleratorConfig
    timeout: datetime.timedelta | None = None  # of every group this mesh made; None: PyTorch's default
    _hybrid_groups: dict[int, HybridGroups] = field(default_factory=dict, repr=False)

    def group_options(self):
        """DeviceMesh's `backend_override` for a group with this mesh's timeout; None without one."""
        return group_options(self.device_type, self.timeout)

    @property
    def cp_size(self) -> int:
        return self.cp.size()

    @property
    def cp_rank(self) -> int:
        return self.cp.get_local_rank()

    @property
    def cp_group(self) -> dist.ProcessGroup:
        return self.cp.get_group()

    @property
    def cp_group_name(self) -> str:
        return self.cp_group.group_name

    @property
    def dp_cp_group(self) -> dist.ProcessGroup:
        return self.dp_cp.get_group()

    def cp_ranks_all(self) -> list[list[int]]:
        """Global ranks of every cp group of the job, in one order identical on all ranks."""
        cp_dim = MESH_DIM_NAMES.index("cp")
        return self.root.mesh.movedim(cp_dim, -1).reshape(-1, self.cp_size).tolist()

    def cp_subgroups(self, ulysses_degree: int) -> HybridGroups:
        """This rank's (ulysses_group, ring_group) for Hybrid CP with `ulysses_degree` = u.

        Inside each cp group of cp-local ranks 0..cp-1, the Ulysses groups are the blocks of u
        consecutive cp ranks and the ring groups take the ranks with the same position inside
        their block (cp rank r: Ulysses rank r % u, ring rank r // u).

        COLLECTIVE: the first call for a given u creates process groups with `dist.new_group`,
        so every rank of the job must make it, with the same u, in the same order relative to
        other group creations. Later calls return the cached groups.
        """
        u, cp = ulysses_degree, self.cp_size
        if type(u) is not int:
            raise CPConfigError(f"ulysses_degree must be an int, got {u!r}")
        if not 1 < u < cp:
            raise CPConfigError(
                f"Hybrid CP needs 1 < ulysses_degree < cp_size, got ulysses_degree={u}, cp_size={cp} "
                "(u = cp is pure Ulysses, u = 1 is pure AllGather: use those wrappers)"
            )
        if cp % u:
            raise CPConfigError(f"cp_size={cp} is not divisible by ulysses_degree={u}")
        if u not in self._hybrid_groups:
            self._hybrid_groups[u] = _new_hybrid_groups(self.cp_ranks_all(), u, dist.get_rank(), self.timeout)
        return self._hybrid_groups[u]


def _new_hybrid_groups(cp_groups: list[list[int]], u: int, my_rank: int,
                       timeout: datetime.timedelta | None) -> HybridGroups:
    # Every rank walks every cp group in the same order: new_group is collective over the job.
    ulysses = ring = None
    for ranks in cp_groups:
        for start in range(0, len(ranks), u):
            members = ranks[start:start + u]
            group = dist.new_group(members, timeout=timeout, group_desc="cp_ulysses")
            if my_rank in members:
                ulysses = group
    for ranks in cp_groups:
        for position in range(u):
            members = ranks[position::u]
            group = dist.new_group(members, timeout=timeout, group_desc="cp_ring")
            if my_rank in members:
                ring = group
    assert ulysses is not None and ring is not None, "this rank is in no cp group"
    return HybridGroups(ulysses=ulysses, ring=ring)


def build_mesh(accelerator: AcceleratorConfig | Plan, device_type: str | None = None, *,
               timeout: datetime.timedelta | None = None) -> CPMesh:
    """Build the device mesh for `accelerator` (or a Plan's accelerator); see the module doc.
    `timeout`: the collective timeout of every group it makes (None: PyTorch's defaults)."""
    if isinstance(accelerator, Plan):
        accelerator = accelerator.accelerator
    if not isinstance(accelerator, AcceleratorConfig):
        raise TypeError(f"build_mesh expects an AcceleratorConfig, got {type(accelerator).__name__}")
    accelerator.validate()
    device_type = _resolve_device_type(device_type)
    created = _ensure_process_group(device_type, timeout)
    world = dist.get_world_size()
    if world != accelerator.world_size:
        if created:  # leave the process the way we found it
            dist.destroy_process_group()
        raise CPConfigError(
            f"the process group has world size {world} but the accelerator config needs "
            f"world_size = pp x dp_replicate x dp_shard x cp x tp = {accelerator.world_size} "
            f"({accelerator.world_size_formula()})"
        )
    shape = tuple(getattr(accelerator, f"{name}_size") for name in MESH_DIM_NAMES)
    options = group_options(device_type, timeout)
    overrides = {name: options for name in MESH_DIM_NAMES} if options is not None else None
    root = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIM_NAMES, backend_override=overrides)
    # Keep the flattened mesh object itself: slicing a flattened name back out of the root
    # mesh (root["dp_cp"]) is deprecated since torch 2.11.
    dp_cp = root[DP_CP_DIMS]._flatten("dp_cp", backend_override=options)
    return CPMesh(root=root, cp=root["cp"], dp_cp=dp_cp, device_type=device_type, accelerator=accelerator,
                  timeout=timeout)


def group_options(device_type: str, timeout: datetime.timedelta | None):
    """The backend options DeviceMesh takes (`backend_override`) to give its groups `timeout`
    (DeviceMesh reads the timeout from them; gloo reads nothing else). None without a timeout; for
    HCCL, whose options class is torch_npu's: its sub-groups keep their default timeout; and under
    the fake process group, whose sub-groups are fake too and refuse another backend's options
    (nothing they run can wait, so there is no timeout to give)."""
    if timeout is None or device_type not in ("cpu", "cuda") or _fake_default_group():
        return None
    options = dist.ProcessGroupNCCL.Options() if device_type == "cuda" else dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    return options


def _fake_default_group() -> bool:
    return dist.is_initialized() and dist.get_backend() == "fake"


def _resolve_device_type(device_type: str | None) -> str:
    if device_type is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device_type not in BACKEND_FOR_DEVICE:
        raise CPConfigError(
            f"unsupported device_type {device_type!r}; supported: {', '.join(BACKEND_FOR_DEVICE)}"
        )
    if device_type == "npu":
        try:
            import torch_npu  # noqa: F401  (registers the npu device and the hccl backend)
        except ImportError as exc:
            raise CPConfigError(
                "device_type 'npu' needs the torch_npu package (pip install torch_npu), "
                f"which cannot be imported: {exc}"
            ) from exc
    if device_type == "cuda" and not torch.cuda.is_available():
        raise CPConfigError("device_type 'cuda' requested but torch.cuda.is_available() is False")
    return device_type


def _ensure_process_group(device_type: str, timeout: datetime.timedelta | None = None) -> bool:
    """Initialise the default process group if needed (with `timeout` when given); True when this
    call created it."""
    if dist.is_initialized():
        return False
    backend = BACKEND_FOR_DEVICE[device_type]
    if device_type in ("cuda", "npu"):
        # Pick the device before the communicator exists (NCCL/HCCL bind to it); without
        # torchrun's LOCAL_RANK this is a one-rank job on the current device.
        device_module = getattr(torch, device_type)
        local_rank = os.environ.get("LOCAL_RANK")
        device_module.set_device(int(local_rank) if local_rank is not None else device_module.current_device())
    if all(name not in os.environ for name in _TORCHRUN_ENV):
        # Plain `python train.py`: a private one-rank group; a larger job must come from torchrun.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return True
    missing = [name for name in _TORCHRUN_ENV if name not in os.environ]
    if missing:
        raise CPConfigError(
            f"cannot initialise the process group: environment variables {', '.join(missing)} "
            "are not set (launch with torchrun, or call torch.distributed.init_process_group first)"
        )
    dist.init_process_group(backend, init_method="env://", timeout=timeout)
    return True


def release_process_group() -> None:
    """End a run's default process group: every rank at a barrier first, then destroy it.

    A rank that destroys the group (or exits) while a peer's last gloo work is still in flight
    aborts that peer ("terminate called without an active exception"), about one torchrun run in
    six on the 2-core CI box. Call it after the last collective of a run that succeeded; on an
    error, destroy without the barrier (a failed peer would never reach it)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
