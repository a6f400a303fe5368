"""global_mean_loss / all_reduce_gradients: single-process and real gloo runs vs a CP=1 reference."""
from __future__ import annotations

import os
import tempfile
import traceback
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cpcompile.loss import all_reduce_gradients, global_mean_loss


# ----------------------------------------------------------------------------- tiny launcher
# Private spawn launcher (tests/dist_utils.py did not exist when this was written).
# fn(rank, world_size, *args) runs in each gloo process; any exception fails the test.


def _worker(fn, rank, world_size, init_file, errors, args):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    except BaseException:  # noqa: BLE001 - report everything to the parent
        errors.put((rank, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def _run_distributed(fn, world_size, *args, timeout=120):
    # forkserver: torch is imported once in the server, each rank is a cheap fork of it
    # (spawn re-imports torch per rank: seconds each on a 2-core CI box).
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["torch", "torch.distributed", "torch.distributed.device_mesh", "cpcompile.batch", "cpcompile.loss"]
    )
    errors = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(target=_worker, args=(fn, rank, world_size, init_file, errors, args))
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        for p in procs:
            if p.is_alive():
                p.kill()
        failures = []
        while not errors.empty():
            failures.append(errors.get())
        if failures:
            raise AssertionError("\n".join(f"rank {r}:\n{tb}" for r, tb in sorted(failures)))
        bad = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode != 0]
        assert not bad, f"worker processes exited abnormally: {bad}"


def _fresh_seed() -> int:
    return int(torch.randint(0, 2**31 - 1, (1,)).item())


# ----------------------------------------------------------------------------- shared problem


def _problem(seed: int, world: int):
    """Global tokens split unevenly over `world` ranks; some targets ignored (-100)."""
    gen = torch.Generator().manual_seed(seed)
    d_in, vocab = 6, 5
    counts = (torch.randint(1, 9, (world,), generator=gen)).tolist()
    total = sum(counts)
    x = torch.randn(total, d_in, generator=gen)
    y = torch.randint(0, vocab, (total,), generator=gen)
    y[torch.rand(total, generator=gen) < 0.25] = -100
    model = torch.nn.Linear(d_in, vocab)
    with torch.no_grad():
        model.weight.copy_(torch.randn(vocab, d_in, generator=gen))
        model.bias.copy_(torch.randn(vocab, generator=gen))
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    return model, x, y, bounds


def _reference(model, x, y):
    ref = torch.nn.functional.cross_entropy(model(x), y, ignore_index=-100, reduction="sum")
    n = (y != -100).sum().clamp_min(1)
    ref = ref / n
    grads = torch.autograd.grad(ref, list(model.parameters()))
    return ref.detach(), grads


def _local_sum(model, x, y):
    loss_sum = torch.nn.functional.cross_entropy(model(x), y, ignore_index=-100, reduction="sum")
    return loss_sum, int((y != -100).sum())


# ----------------------------------------------------------------------------- single process


def test_global_mean_loss_single_process_is_plain_mean():
    model, x, y, _ = _problem(_fresh_seed(), 1)
    ref, ref_grads = _reference(model, x, y)
    loss_sum, n = _local_sum(model, x, y)
    loss = global_mean_loss(loss_sum, n, None)
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref, rtol=1e-6, atol=1e-7)
    for p, g in zip(model.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-6, atol=1e-7)
    all_reduce_gradients(model, None)  # world 1: a no-op


def test_global_mean_loss_no_valid_tokens_is_zero_not_nan():
    w = torch.randn(3, requires_grad=True)
    loss = global_mean_loss((w * 0).sum(), torch.tensor(0), None)
    loss.backward()
    assert loss.item() == 0.0 and torch.isfinite(w.grad).all()


# ----------------------------------------------------------------------------- gloo runs


def _check_global_mean(rank, world, seed):
    from torch.distributed.device_mesh import init_device_mesh

    if world == 4:  # DP x CP mesh; the loss domain is the flattened dp_cp
        dm = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
        mesh = types.SimpleNamespace(dp_cp=dm["dp", "cp"]._flatten("dp_cp"), cp=dm["cp"])
    else:
        dm = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_cp",))
        mesh = types.SimpleNamespace(dp_cp=dm, cp=dm)

    model, x, y, bounds = _problem(seed, world)
    ref, ref_grads = _reference(model, x, y)

    lo, hi = bounds[rank], bounds[rank + 1]
    loss_sum, n = _local_sum(model, x[lo:hi], y[lo:hi])
    loss = global_mean_loss(loss_sum, torch.tensor(n), mesh)
    torch.testing.assert_close(loss.detach(), ref, rtol=1e-6, atol=1e-7)

    loss.backward()
    # Before the sum each rank holds only the gradient of its own share.
    own = torch.autograd.grad(_local_sum(model, x[lo:hi], y[lo:hi])[0], model.weight)[0]
    torch.testing.assert_close(model.weight.grad, own / (y != -100).sum(), rtol=1e-5, atol=1e-7)

    all_reduce_gradients(model, mesh)
    for p, g in zip(model.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)

    # Ranks that disagree on which parameters have gradients are refused, by name.
    model.zero_grad(set_to_none=True)
    if rank == 0:
        model.bias.grad = torch.zeros_like(model.bias)
    try:
        all_reduce_gradients(model, mesh)
    except RuntimeError as exc:
        assert "bias" in str(exc), exc
    else:
        raise AssertionError("disagreeing gradients were not refused")


@pytest.mark.parametrize("world", [2, 4])
def test_global_mean_loss_and_gradients_match_reference(world):
    _run_distributed(_check_global_mean, world, _fresh_seed())
