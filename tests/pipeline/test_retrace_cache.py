"""The per-region cache of traced graphs (issue 12, item 5): every new sequence length traces each
region again; the cache is bounded (least recently used graph dropped first), and repeated
re-tracing is logged once per compiled model at WARNING, pointing at padding to a few lengths.

One child process, rank 0 of a fake process group of 2 (tracing communicates nothing but the
agreement check, which the fake group answers with this rank's own digest).
"""
from __future__ import annotations

import logging

import torch

from cp_harness import sdpa_plan, tiny_qwen3
from dist_utils import run_distributed

LENGTHS = range(9, 18)  # 9 new local lengths (the example has 8), one step each
_outcomes: dict = {}


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def _steps(model, lengths) -> None:
    with torch.no_grad():
        for length in lengths:  # rank 0 of a contiguous layout: global positions 0..length-1
            model(input_ids=torch.randint(0, 96, (1, length)), position_ids=torch.arange(length)[None], use_cache=False)


def _run(rank: int, world: int, env_size: str | None) -> dict:
    import os

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import cpcompile

    if env_size is not None:
        os.environ["CPCOMPILE_TRACE_CACHE_SIZE"] = env_size
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    handler = Records()
    logging.getLogger("cpcompile").addHandler(handler)
    plan = cpcompile.load_plan(sdpa_plan(2))
    mesh = cpcompile.build_mesh(plan.accelerator, device_type="cpu")
    example = {"input_ids": torch.randint(0, 96, (1, 8)), "position_ids": torch.arange(8)[None], "use_cache": False}
    out = {}
    for name, size in (("default", None), ("argument", 3)):
        handler.records.clear()
        model = cpcompile.compile(tiny_qwen3(0, layers=2), mesh, plan, example_inputs=example, trace_cache_size=size)
        _steps(model, LENGTHS)
        _steps(model, LENGTHS[-1:])  # the most recent length again: still cached
        regions = [layer.self_attn.forward.__self__ for layer in model.model.layers]
        out[name] = {
            "cached": [len(region.programs) for region in regions],
            "traced": [region.traces for region in regions],
            "warnings": [r.getMessage() for r in handler.records if r.levelno == logging.WARNING],
        }
    out["bad_size"] = None
    try:
        cpcompile.compile(tiny_qwen3(0, layers=1), mesh, plan, example_inputs=example, trace_cache_size=0)
    except Exception as exc:  # noqa: BLE001 - the parent asserts on it
        out["bad_size"] = (type(exc).__name__, str(exc))
    dist.destroy_process_group()
    return out


def outcome(env_size: str | None = None) -> dict:
    if env_size not in _outcomes:
        (_outcomes[env_size],) = run_distributed(_run, 1, env_size, init_pg=False, timeout=600)
    return _outcomes[env_size]


def test_cache_is_bounded_and_keeps_the_most_recent_signature():
    result = outcome()
    traces = 1 + len(LENGTHS)  # the example batch, then one per new length; the repeat is a hit
    assert result["default"]["traced"] == [traces, traces]
    assert result["default"]["cached"] == [8, 8]
    assert result["argument"]["traced"] == [traces, traces]
    assert result["argument"]["cached"] == [3, 3]


def test_repeated_retracing_warns_once_per_model():
    result = outcome()
    for name in ("default", "argument"):
        (warning,) = result[name]["warnings"]
        for word in ("model.layers.0.self_attn", "5 input signatures", "pad", "docs/batch.md", "trace_cache_size"):
            assert word in warning, (word, warning)


def test_cache_size_from_the_environment():
    result = outcome(env_size="2")
    assert result["default"]["cached"] == [2, 2]
    assert result["argument"]["cached"] == [3, 3]  # the argument wins over the environment


def test_cache_size_must_be_positive():
    kind, message = outcome()["bad_size"]
    assert kind == "CPConfigError" and "trace_cache_size" in message and "0" in message
