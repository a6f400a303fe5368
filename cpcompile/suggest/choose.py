"""Which CP method each kind of attention module gets, and why: the rules of a suggested plan.

A plan has one sequence layout (`plan.sequence_layout`), so the choice is made for the whole model:

1. A module no method runs is named, never skipped: a sliding window or attention chunk shorter
   than the sequence (every SDPA method refuses it, docs/limitations.md).
2. **Ulysses** for causal attention whose heads split over the CP ranks (query heads % cp == 0, and
   KV heads % cp == 0 or cp % KV heads == 0) when it sends fewer bytes than gathering K/V. A rank
   sends, per layer, forward and backward:
   - gathering K/V (AllGather, Head-Tail): K and V to cp-1 peers, then their gradients back,
     4 (cp-1) x KV heads x L x D elements (L the rank's tokens, D the head size);
   - Ulysses: Q, K, V and the output through two all-to-alls each way, 2 (cp-1)/cp x (2 Q heads
     + 2 KV heads) x L x D, KV heads counted at least cp (copied up to one a rank).
   Ulysses gives every rank the same attention work. On a tie the gather wins: its transfers overlap
   the rank's own block of attention.
3. Otherwise **Head-Tail** (AllGather's bytes; rank r holds chunks r and 2cp-1-r) when the
   contiguous layout would leave the busiest rank more than `WORTH_BALANCING` slower than the
   least busy (`trainer/balance.py`'s model: 6 FLOPs a parameter a token, causal attention's
   query-key pairs weighted as measured on an H200): contiguous AllGather's last rank scores 2cp-1
   times rank 0's pairs. Head-Tail needs causal attention, so any bidirectional attention keeps
   the contiguous layout; and GDN layers need each of its chunks (S / 2cp tokens) at least as long
   as their convolution's halo.
4. Otherwise contiguous **AllGather** (no head constraint, no reordering of the batch).
5. GDN layers: **State-P2P** (one recurrent state a rank passes to the next: bytes independent of
   the length), in Head-Tail order under the Head-Tail layout.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..methods.method import CONTIGUOUS, HEAD_TAIL
from ..trainer.balance import ATTENTION_FLOPS_PER_PAIR, ATTENTION_TIME_WEIGHT, query_key_pairs
from .sites import GDN, SDPA, CoreSite

WORTH_BALANCING = 1.05  # busiest / least busy rank's expected step above which Head-Tail is chosen

ALL_GATHER, ULYSSES, HEAD_TAIL_SDPA = "all_gather", "ulysses", "head_tail"
P2P, P2P_HEAD_TAIL = "p2p", "p2p_head_tail"


@dataclass(frozen=True)
class Choice:
    """One module kind's method (None: no method runs it) and the reason, for the plan's comment."""

    site: CoreSite
    method: str | None
    reason: str


@dataclass(frozen=True)
class Decision:
    layout: str
    choices: list[Choice]
    rank_work: list[float]  # each CP rank's expected step work, relative (the balance model)

    @property
    def imbalance(self) -> float:
        return max(self.rank_work) / min(self.rank_work)


def decide(sites: list[CoreSite], cp: int, seq_len: int, params: int) -> Decision:
    """The methods of rules 1-5 (module doc) for one site of each module kind."""
    local = seq_len / cp
    runnable = [s for s in sites if s.kind == GDN or _refusal(s, seq_len) is None]
    ulysses = {s.fqn for s in runnable if s.kind == SDPA and s.causal and _ulysses_cheaper(s, cp)}
    contiguous = _rank_work(runnable, ulysses, cp, local, params, balanced=False)
    causal_only = all(s.causal for s in runnable if s.kind == SDPA)
    gathered_causal = any(s.kind == SDPA and s.causal and s.fqn not in ulysses for s in runnable)
    unbalanced = max(contiguous) / min(contiguous) > WORTH_BALANCING
    chunks_fit = all(seq_len // (2 * cp) >= s.conv_halo for s in runnable if s.kind == GDN)
    if cp > 1 and causal_only and gathered_causal and unbalanced and chunks_fit:
        balanced = _rank_work(runnable, set(), cp, local, params, balanced=True)
        ratio = max(contiguous) / min(contiguous)
        return Decision(HEAD_TAIL, [_head_tail_choice(s, cp, seq_len, ratio) for s in sites], balanced)
    return Decision(CONTIGUOUS, [_contiguous_choice(s, cp, seq_len, ulysses, causal_only) for s in sites], contiguous)


def gather_elements(site: CoreSite, cp: int, local: float) -> float:
    """Elements a rank sends per layer gathering K/V, forward and backward (rule 2)."""
    return 4 * (cp - 1) * site.kv_heads * local * site.head_dim


def ulysses_elements(site: CoreSite, cp: int, local: float) -> float:
    """Elements a rank sends per layer under Ulysses, forward and backward (rule 2)."""
    return 2 * (cp - 1) / cp * (2 * site.q_heads + 2 * max(site.kv_heads, cp)) * local * site.head_dim


def ulysses_fits(site: CoreSite, cp: int) -> bool:
    return site.q_heads % cp == 0 and (site.kv_heads % cp == 0 or cp % site.kv_heads == 0)


def _ulysses_cheaper(site: CoreSite, cp: int) -> bool:
    return cp > 1 and ulysses_fits(site, cp) and ulysses_elements(site, cp, 1) < gather_elements(site, cp, 1)


def _refusal(site: CoreSite, seq_len: int) -> str | None:
    if site.window is not None and site.window < seq_len:
        return (f"declares a sliding window of {site.window} tokens, shorter than the sequence ({seq_len}): "
                "no CP method runs it (docs/limitations.md)")
    return None


def _head_tail_choice(site: CoreSite, cp: int, seq_len: int, ratio: float) -> Choice:
    if site.kind == GDN:
        return Choice(site, P2P_HEAD_TAIL, "State-P2P in Head-Tail order: one recurrent state a rank (two for the "
                                           "middle ranks), whatever the length; the batch's layout is Head-Tail")
    if (refused := _refusal(site, seq_len)) is not None:
        return Choice(site, None, refused)
    return Choice(site, HEAD_TAIL_SDPA, f"Head-Tail: contiguous shards would leave the busiest rank {ratio:.2f}x the "
                                        "least busy one (causal attention); Head-Tail gives every rank the same "
                                        f"work for AllGather's bytes{_ulysses_note(site, cp)}")


def _contiguous_choice(site: CoreSite, cp: int, seq_len: int, ulysses: set, causal_only: bool) -> Choice:
    if site.kind == GDN:
        return Choice(site, P2P, "State-P2P: one recurrent state a rank, whatever the length")
    if (refused := _refusal(site, seq_len)) is not None:
        return Choice(site, None, refused)
    if site.fqn in ulysses:
        local = seq_len / cp
        return Choice(site, ULYSSES, f"Ulysses: {site.q_heads} query / {site.kv_heads} KV heads split over {cp} ranks; "
                                     f"{ulysses_elements(site, cp, local) / gather_elements(site, cp, local):.2f}x the "
                                     "bytes of gathering K/V, and every rank the same attention work")
    why = ("not causal: every rank's queries see every key, the ranks are balanced" if not site.causal else
           "the ranks stay within 5% of each other with contiguous shards" if causal_only else
           "the model also has bidirectional attention, which Head-Tail cannot run")
    return Choice(site, ALL_GATHER, f"AllGather: {why}{_ulysses_note(site, cp)}")


def _ulysses_note(site: CoreSite, cp: int) -> str:
    """Why not Ulysses, for a causal SDPA module that did not get it."""
    if not site.causal or cp == 1:
        return ""
    if not ulysses_fits(site, cp):
        return f"; Ulysses cannot split {site.q_heads} query / {site.kv_heads} KV heads over {cp} ranks"
    return f"; Ulysses would send {ulysses_elements(site, cp, 1) / gather_elements(site, cp, 1):.2f}x the bytes"


def _rank_work(sites: list[CoreSite], ulysses: set, cp: int, local: float, params: int, balanced: bool) -> list[float]:
    """Each rank's expected step work (trainer/balance.py's model) for one sequence."""
    work = []
    for rank in range(cp):
        total = 6.0 * params * local
        for site in sites:
            if site.kind != SDPA:
                continue
            pairs = query_key_pairs(cp, rank, site.fqn in ulysses or balanced, site.causal)
            total += ATTENTION_FLOPS_PER_PAIR * site.q_heads * site.head_dim * pairs * local * local * \
                ATTENTION_TIME_WEIGHT
        work.append(total)
    return work

