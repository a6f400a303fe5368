"""The debug dump's folder: one that cannot be written is a `CPConfigError` naming it, before any
module changes (issue 12, item 8); in a job of more than one process each rank writes its own,
`<dump_dir>/rank<r>` (issue 51); `inspect` points from a job's folder to its per-rank ones."""
from __future__ import annotations

import json
import os

import pytest

from cp_harness import outcome_of, sdpa_plan, tiny_qwen3
from dist_utils import run_distributed


def _compile_into(rank: int, world: int, dump_dir: str, fake_rank: int = 0):
    """`compile` on one process playing rank `fake_rank` of a 2-rank job (the fake process group)."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import cpcompile

    dist.init_process_group("fake", store=FakeStore(), rank=fake_rank, world_size=2)
    plan = cpcompile.load_plan(sdpa_plan(2))
    mesh = cpcompile.build_mesh(plan.accelerator, device_type="cpu")
    model = tiny_qwen3(0)
    local = {"input_ids": torch.randint(0, 96, (1, 8)), "position_ids": torch.arange(8)[None], "use_cache": False}
    outcome = outcome_of(lambda: cpcompile.compile(model, mesh, plan, example_inputs=local, dump_dir=dump_dir))
    untouched = all("forward" not in vars(m) for m in model.modules())
    dist.destroy_process_group()
    return outcome, untouched


def test_a_dump_dir_that_cannot_be_made_is_a_config_error(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    dump_dir = str(blocker / "dump")
    ((outcome, untouched),) = run_distributed(_compile_into, 1, dump_dir, init_pg=False, timeout=300)
    assert outcome is not None and outcome[0] == "CPConfigError", outcome
    assert f"dump_dir {os.path.join(dump_dir, 'rank0')!r}" in outcome[1] and "cannot" in outcome[1], outcome
    assert untouched


def test_each_rank_of_a_job_writes_its_own_folder(tmp_path):
    """Rank 1 of a 2-rank job given dump_dir=D writes D/rank1, never D itself (where every rank's
    summary.json would land on the others')."""
    ((outcome, _),) = run_distributed(_compile_into, 1, str(tmp_path), 1, init_pg=False, timeout=300)
    assert outcome is None, outcome
    assert json.loads((tmp_path / "rank1" / "summary.json").read_text())["regions"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank1"]


def test_one_rule_for_the_dump_folder(tmp_path, monkeypatch):
    """`resolve_dump_dir`, which `compile` and `cpcompile train` both follow: the folder itself with
    one process, `rank<r>` inside it with more; `CPCOMPILE_DUMP_DIR` when no dump_dir is given."""
    from cpcompile.dump import ENV_VAR, resolve_dump_dir

    monkeypatch.delenv(ENV_VAR, raising=False)
    assert resolve_dump_dir(None, 0, 1) is None
    assert resolve_dump_dir(tmp_path, 0, 1) == tmp_path
    assert resolve_dump_dir(tmp_path, 3, 4) == tmp_path / "rank3"
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "env"))
    assert resolve_dump_dir(None, 1, 2) == tmp_path / "env" / "rank1"
    assert resolve_dump_dir(None) == tmp_path / "env"  # no process group: one process


def test_inspect_of_a_job_folder_names_its_rank_folders(tmp_path):
    from cpcompile.dump import inspect

    for rank in range(2):
        (tmp_path / f"rank{rank}").mkdir()
        (tmp_path / f"rank{rank}" / "summary.json").write_text(json.dumps({"regions": []}))
    with pytest.raises(FileNotFoundError) as info:
        inspect(tmp_path)
    assert str(tmp_path / "rank0") in str(info.value) and str(tmp_path / "rank1") in str(info.value)
