"""The CP ranks' expected compute imbalance, which the dry run names (issue 49).

Under CP a step lasts as long as its slowest rank. Every rank has the same tokens, so the same
matmul work (6 x the model's parameters a token, the head's included: MFU's count) and the same
GDN work (linear in the tokens; the State-P2P chain is latency, not work). Causal attention is
what differs: per attention layer a rank scores, per sequence of global length S = cp x L,

- AllGather (contiguous; Hybrid counted alike): rank r's queries see the r blocks before theirs
  and their own causal diagonal, L^2 (r + 1/2) query-key pairs: rank cp-1 has 2 cp - 1 times
  rank 0's;
- Head-Tail: chunks r and 2 cp - 1 - r of c = L / 2 tokens, c^2 (r + 1/2) + c^2 (2 cp - 1 - r + 1/2)
  = L^2 cp / 2 pairs on every rank;
- Ulysses: the whole sequence on heads / cp heads, S^2 / 2 / cp = L^2 cp / 2 pairs' worth.

A pair costs 4 x (query heads x head dim) FLOPs forward (QK^T and PV) and 10 x backward (the
recomputed scores, dV, dP, dQ, dK): 14 in all. FLOPs are not time: the attention kernels run far
nearer their peak than the rest of the step (GDN kernels, memory-bound ops). On an H200 the
slowest/fastest rank step times of the 0.57B model (SDPA AllGather + GDN State-P2P) were 4.4x, 6.3x,
5.3x and 8.3x at CP=8 / 512K, CP=8 / 1M, CP=16 / 512K and CP=16 / 1M tokens (issue 49), where the
FLOP ratios are 9.1x, 11.3x, 13.2x and 18.4x; weighing an attention FLOP as 0.235 of another FLOP
(`ATTENTION_TIME_WEIGHT`, fitted to those four) gives 4.4x, 6.5x, 5.2x and 8.3x. The dry run names
both ratios; the time ratio is that H200 fit, for other hardware or models a guess.
"""
from __future__ import annotations

from typing import NamedTuple

from .config import TrainConfig
from .memory import sdpa_method
from .memory_layers import _attention_widths, layer_kinds

ATTENTION_FLOPS_PER_PAIR = 14  # x query width: forward 4, backward 10
ATTENTION_TIME_WEIGHT = 0.235  # an attention FLOP's time in FLOPs of the rest (module doc: H200 fit)


def rank_work(config: TrainConfig, params: int, model_config, attention_weight: float = 1.0) -> list[float]:
    """Each CP rank's work in one training step (module doc), for one sequence of `train.seq_len`
    (the batch scales every rank alike): FLOPs, the attention's weighted by `attention_weight`."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    cp, seq_len = config.plan.accelerator.cp_size, config.train.seq_len
    local = seq_len / cp
    attention_layers = sum(1 for kind in layer_kinds(text) if kind == "full_attention")
    query_width = _attention_widths(text)[0] if attention_layers else 0
    per_pair = ATTENTION_FLOPS_PER_PAIR * query_width * attention_layers * attention_weight
    balanced = sdpa_method(config) != "all_gather"
    return [6 * params * local + per_pair * query_key_pairs(cp, rank, balanced) * local * local
            for rank in range(cp)]


def query_key_pairs(cp: int, rank: int, balanced: bool, causal: bool = True) -> float:
    """Query-key pairs `rank` scores per attention layer, in units of L^2 (module doc): contiguous
    causal shards r + 1/2, balanced layouts (Head-Tail, Ulysses) cp / 2, non-causal attention cp."""
    if not causal:
        return cp
    return cp / 2 if balanced else rank + 0.5


class Imbalance(NamedTuple):
    time: float  # the busiest rank's expected step time over the least busy one's
    flops: float  # the same of their FLOPs
    busiest: int
    idlest: int


def imbalance(config: TrainConfig, params: int, model_config) -> Imbalance:
    flops = rank_work(config, params, model_config)
    time = rank_work(config, params, model_config, ATTENTION_TIME_WEIGHT)
    busiest, idlest = time.index(max(time)), time.index(min(time))
    return Imbalance(time[busiest] / time[idlest], flops[busiest] / flops[idlest], busiest, idlest)


def describe_imbalance(config: TrainConfig, params: int, model_config) -> str:
    """The dry run's line: the ratios, which ranks, and why (module doc)."""
    cp = config.plan.accelerator.cp_size
    if cp == 1:
        return "rank balance: one CP rank"
    found = imbalance(config, params, model_config)
    why = {"all_gather": "SDPA AllGather: rank r's queries attend to r + 1 blocks of keys; SDPA Head-Tail "
                         "(with GDN in Head-Tail order) gives every rank the same attention work",
           "head_tail": "Head-Tail: every rank the same attention work",
           "ulysses": "Ulysses: every rank the same attention work"}[sdpa_method(config)]
    if found.busiest == found.idlest:  # every rank alike
        return f"rank balance: every CP rank the same expected step, 1.00x ({why})"
    return (f"rank balance: busiest CP rank {found.busiest} / least busy rank {found.idlest} = {found.time:.2f}x "
            f"expected step time ({found.flops:.2f}x FLOPs; the time weighs attention FLOPs as measured on an "
            f"H200, trainer/balance.py) ({why})")
