"""A decision (`choose.py`) written as an explicit plan: one override per module kind, each with a
comment giving its reason, and a header with each rank's expected work and memory."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import yaml

from .choose import ALL_GATHER, HEAD_TAIL_SDPA, P2P, P2P_HEAD_TAIL, ULYSSES, Choice, Decision

GDN_WRAPPERS = {P2P: "cpcompile.adapters.qwen3_5.qwen3_5_gdn_p2p_cp_wrapper",
                P2P_HEAD_TAIL: "cpcompile.adapters.qwen3_5.qwen3_5_gdn_p2p_head_tail_cp_wrapper"}
SDPA_WRAPPERS = {ALL_GATHER: "sdpa_hf", ULYSSES: "sdpa_hf_ulysses",
                 HEAD_TAIL_SDPA: {"_target_": "cpcompile.wrappers.sdpa_hf_load_balance_cp_wrapper"}}


@dataclass(frozen=True)
class Group:
    """Modules that get one override: the same core kind, method and module class."""

    match: str
    choices: tuple[Choice, ...]

    @property
    def method(self) -> str | None:
        return self.choices[0].method

    def describe(self) -> str:
        first = self.choices[0].site
        count = f"{len(self.choices)} module{'s' if len(self.choices) > 1 else ''}"
        return f"{count} {first.class_name} ({first.kind.upper()}): {self.choices[0].reason}"


def group_choices(choices: list[Choice], all_fqns: list[str]) -> list[Group]:
    """One group per (kind, method, class, fqn's last part); its match is `*.<last part>` when that
    pattern matches no other module of the model, else each module's own fqn (a group each)."""
    by_key: dict[tuple, list[Choice]] = defaultdict(list)
    for choice in choices:
        site = choice.site
        by_key[(site.kind, choice.method, site.class_name, site.name)].append(choice)
    groups = []
    for (_, _, _, name), members in by_key.items():
        same_name = [fqn for fqn in all_fqns if fqn.rsplit(".", 1)[-1] == name]
        if sorted(same_name) == sorted(c.site.fqn for c in members):
            groups.append(Group(f"*.{name}", tuple(members)))
        else:
            groups.extend(Group(c.site.fqn, (c,)) for c in members)
    return groups


def override(group: Group, gdn_backend: str) -> dict:
    method = group.method
    wrapper = SDPA_WRAPPERS.get(method) or {"_target_": GDN_WRAPPERS[method], "backend": gdn_backend}
    return {"match": group.match, "when": "cp", "region_dispatch": False, "inner_target": "self",
            "inner_wrapper": wrapper}


def plan_text(header: list[str], plan: dict, groups: list[Group]) -> str:
    """The plan as YAML, `header` and each override's reason as comments; modules no method runs
    are listed as comments where their override would be."""
    lines = [f"# {line}" for line in header]
    lines += yaml.safe_dump({"accelerator": plan["accelerator"]}, sort_keys=False).splitlines()
    lines.append("plan_overrides:")
    covered = iter(plan["plan_overrides"])
    for group in groups:
        lines.append(f"  # {group.describe()}")
        if group.method is None:
            lines.append(f"  # NOT COVERED: {group.match} (compile will refuse the model until a method runs it)")
            continue
        body = yaml.safe_dump([next(covered)], sort_keys=False).splitlines()
        lines += [f"  {line}" for line in body]
    return "\n".join(lines) + "\n"


def header_lines(source: str, decision: Decision, cp: int, seq_len: int, multiple: int,
                 memory: list[float] | str) -> list[str]:
    """What the plan is for, its layout, and each rank's expected work and memory."""
    lines = [f"Suggested by cpcompile for {source}: CP={cp}, {seq_len} tokens a sequence "
             f"({seq_len // cp} a rank). Every choice is explicit: edit it freely; compile runs only this file.",
             f"Layout: {decision.layout}" + (" (shard_batch reorders each sequence: rank r holds chunks r and "
                                              "2cp-1-r of 2cp)" if decision.layout == "head_tail" else "")]
    if seq_len % multiple:
        lines.append(f"NOTE: this layout needs the sequence length to be a multiple of {multiple}; {seq_len} is not")
    low = min(decision.rank_work)
    lines.append(f"Expected per rank (work relative to the least busy rank, trainer/balance.py; peak memory for one "
                 f"sequence, bfloat16, every layer checkpointed, trainer/memory.py):")
    for rank, work in enumerate(decision.rank_work):
        peak = f", {memory[rank]:.2f} GiB" if isinstance(memory, list) else ""
        lines.append(f"  rank {rank}: work {work / low:.2f}x{peak}")
    if isinstance(memory, str):
        lines.append(f"  memory {memory}")
    return lines
