"""What one decoder layer holds in a training step, per token, for the per-rank estimate of
`memory.py` (whose docstring defines T, e, c, r and f), and a layer's parameters.

Per token, a layer of each kind (Qwen3.5 / Qwen3 / Llama as transformers writes them, the GDN
layers as cpcompile runs them: `adapters.qwen3_5.gdn_layer_forward` on the Triton core):

- saved (`layer_saved_bytes`, what autograd keeps of a layer that is not checkpointed, and what a
  replay recomputes): each RMSNorm its input upcast to float, the normalised value (float) and its
  output in c ((upcast + f + c) x width); GDN the conv's padded input, output and SiLU output
  (3 x conv channels x c), q and k upcast and L2-normalised (2 x key width x (upcast + f)), the
  gates, the gated RMSNorm's three float copies and three results in c (value width x (3 f + 3 c),
  out_proj's input included); attention q and k's per-head RMSNorm copies (Qwen3 family), q, k
  after RoPE and v (K/V x the Ulysses replicas), under AllGather the other ranks' K and V
  (2 x KV width x c x (cp - 1)), the output and its log-sum-exp, with an output gate (Qwen3-Next /
  Qwen3.5) sigmoid(gate) and the product; the MLP gate, up, SiLU(gate) and their product
  (4 x intermediate x c); with `train.gdn_checkpoint_around_core` a GDN layer's ops before and
  after its core keep only their inputs and outputs (q and k in float, v in c, the gates; the core's
  output and z in c: `_gdn_before_core_bytes`, `_gdn_after_core_bytes`);
- kept (`layer_kept_bytes`): a checkpointed layer its input (h x c; nothing on the device with
  `train.offload_layer_inputs`, until its own backward); a `selective` one its input
  and the outputs `activation_checkpointing.selective_policy` saves (`selective_saved_bytes`: every matmul's,
  the core's — GDN's in float, q's dtype —, the gathered K/V); a layer left alone what it saved;
- peak of its backward (`layer_peak_bytes`): the larger of two moments. The MLP's backward comes
  first: every saved tensor (replayed, for a checkpointed layer) but SiLU(gate) x up, three
  intermediate-width gradients in flight and the incoming one: saved + 2 x intermediate x c +
  h x c. Then the core's: what the ops before the core saved, the gradients in flight (the GDN
  core output's in float, dz, the residual's) and the core's buffers: GDN's Triton backward
  (`gdn_core_backward_bytes`, counted from kernels/gdn/triton/ launchers: the q/k/v/do casts and
  copies, gc, w, u, the (I + A)^-1 rows, and the most of its three phases: the recomputed chunk
  states and their gradients, one K x V state in c per 64 tokens and head each, then the per
  value head dq/dk/dw, then dv and the float dq/dk; in Head-Tail order one more copy of its input
  gradients, `gdn_head_tail_backward_bytes`), attention's (`attention_core_backward_bytes`:
  dq, dk, dv of every key the rank holds, and for the largest block of keys one kernel call reads,
  the K/V repeated per query head when the kernel does not take grouped heads and the per-query-head
  dk/dv; that block depends on the CP rank, `attended_keys`: under AllGather the last rank's
  queries read every other rank's keys in one call). For this model's GDN layers the MLP's moment
  is the larger (172 KB a token in bfloat16 against 164 for the core's); for its attention layers
  under AllGather the core's on the last ranks once the gathered keys are many (on the H200: CP=8
  and CP=16 from 256K tokens). A checkpointed layer adds its kept input, a selective one also the
  down projection's saved output, which its replay stops before.

These counts are measured as well as read: `benchmarks/layer_memory.py` runs one
bfloat16 layer of each kind at the real widths on CPU under a live-storage tracker, the Triton
core's launch code allocating its buffers with its kernels skipped, and tests/train/
test_memory_layers.py holds the counts to that measurement within 1% (they differ by 0.2%: the
per-row rsqrt and per-head gate vectors, rounded here).
"""
from __future__ import annotations

import dataclasses

import torch

from ..kernels.attention.kernels import KERNELS, select_kernel
from .config_sections import DTYPES

GDN_CHUNK = 64  # tokens per chunk of the GDN kernels: one state per chunk, one (I + A)^-1 row of 64 a token


@dataclasses.dataclass(frozen=True)
class AttentionWork:
    """Whose attention backward is counted: the CP rank (`attended_keys`), and whether the local
    kernel reads grouped K/V heads as they are (`attention_kernel_groups_heads`; without CP the
    model's own SDPA runs, counted as grouped)."""

    rank: int = 0
    grouped_kernel: bool = True


class ElementSizes:
    """Bytes of an element: parameters, compute, gradient reduction, and float (float32 at least);
    `upcast`: what a copy to float costs (nothing when the compute dtype is float already)."""

    def __init__(self, param: int, compute: int, reduce: int):
        self.param, self.compute, self.reduce = param, compute, reduce
        self.float = max(4, compute)
        self.upcast = self.float if compute < self.float else 0

    @classmethod
    def of(cls, settings) -> "ElementSizes":
        param = _bytes(DTYPES[settings.dtype])
        param_dtype, reduce_dtype = settings.precision_policy()
        compute = _bytes(param_dtype) if param_dtype is not None else param
        return cls(param, compute, _bytes(reduce_dtype) if reduce_dtype is not None else compute)


def _bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def attention_kernel_groups_heads(settings) -> bool:
    """Whether the CP regions' local attention kernel reads grouped K/V heads as they are; cuDNN's
    (CUDA's default in half precision) does not, so each block's K and V are repeated per query
    head first (`kernels/attention/kernels.py:block_forward`)."""
    if settings.device not in ("cpu", "cuda"):
        return False  # no kernel of ours there: the larger count
    compute = settings.precision_policy()[0] or DTYPES[settings.dtype]
    name = select_kernel(torch.device(settings.device), compute)
    return name == "flex" or KERNELS[name].grouped_heads


def layer_kinds(text) -> list[str]:
    """Each decoder layer's kind: 'linear_attention' (GDN) or 'full_attention'."""
    return list(getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers)


def layer_checkpointing(mode, count: int) -> list[str]:
    """Each layer's checkpointing: 'off' (not checkpointed), 'checkpointed' (its input kept, its
    forward replayed) or 'selective' (`activation_checkpointing.selective_policy`)."""
    chosen = set(mode.layers(count))
    checkpointed = "selective" if mode.kind == "selective" else "checkpointed"
    return [checkpointed if index in chosen else "off" for index in range(count)]


def _attention_widths(text) -> tuple[int, int, bool, bool]:
    """(query width, K or V width, q_proj holds an output gate, q/k normalised per head)."""
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    hybrid = "linear_attention" in layer_kinds(text)  # Qwen3-Next / Qwen3.5: gated attention output
    return heads * head_dim, kv_heads * head_dim, hybrid, text.model_type.startswith("qwen3")


def _kv_replicas(text, cp: int, sdpa: str) -> int:
    """How many copies of each K/V head a rank's attention reads: Ulysses with fewer KV heads than
    ranks copies each KV head up to one per rank before the exchange."""
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    return max(1, cp // kv_heads) if sdpa == "ulysses" else 1


def _gdn_widths(text) -> tuple[int, int, int]:
    """(key width, value width, value heads) of a GDN layer."""
    return (text.linear_num_key_heads * text.linear_key_head_dim,
            text.linear_num_value_heads * text.linear_value_head_dim, text.linear_num_value_heads)


def norm_bytes(width: int, sizes: ElementSizes) -> int:
    """An RMSNorm's saved tensors a token: its input upcast to float, the normalised value (float)
    and its output in c (what the next matmul keeps)."""
    return (sizes.upcast + sizes.float + sizes.compute) * width


def final_norm_bytes(text, sizes: ElementSizes) -> int:
    """The final norm's saved tensors and its output (the loss's input), a token."""
    return norm_bytes(text.hidden_size, sizes)


def layer_saved_bytes(text, kind: str, sizes: ElementSizes, cp: int, sdpa: str, gdn_inner: bool = False) -> int:
    """What one decoder layer of `kind` keeps for its backward, per token (module doc): its token
    mixer's (the input norm's included), the second norm's and the MLP's gate, up, SiLU(gate) and
    their product."""
    if kind == "linear_attention":
        mixer = _gdn_before_core_bytes(text, sizes, gdn_inner) + _gdn_after_core_bytes(text, sizes, gdn_inner)
    else:
        mixer = _attention_before_core_bytes(text, sizes, cp, sdpa) + _attention_after_core_bytes(text, sizes)
    return mixer + norm_bytes(text.hidden_size, sizes) + 4 * text.intermediate_size * sizes.compute


def _gdn_before_core_bytes(text, sizes: ElementSizes, inner: bool = False) -> int:
    """What a GDN layer's ops before its core keep, a token: the input norm's; the conv's padded
    input, its output and SiLU's output (3 x conv channels in c); q and k upcast to float and
    L2-normalised (two float copies each); the gates g and beta. With those ops under their own
    checkpoint (`inner`: `train.gdn_checkpoint_around_core`) only the core's inputs: q and k
    normalised (float), v (its own copy, in c) and the gates."""
    key, value, value_heads = _gdn_widths(text)
    conv = (value if inner else 3 * (2 * key + value)) * sizes.compute
    qk = 2 * key * (sizes.float if inner else sizes.upcast + sizes.float)
    gates = 3 * value_heads * sizes.float
    return norm_bytes(text.hidden_size, sizes) + conv + qk + gates


def _gdn_after_core_bytes(text, sizes: ElementSizes, inner: bool = False) -> int:
    """What a GDN layer keeps after its core, a token: the gated RMSNorm's float copies (core
    output, gate, SiLU(gate)) and its three results in c, the last out_proj's input; with those
    ops under their own checkpoint (`inner`) only their inputs, the core's output and z in c."""
    _, value, _ = _gdn_widths(text)
    return 2 * value * sizes.compute if inner else value * (3 * sizes.float + 3 * sizes.compute)


def _attention_before_core_bytes(text, sizes: ElementSizes, cp: int, sdpa: str) -> int:
    """What an attention layer keeps up to its core's output, a token: the input norm's; q and k's
    RMSNorm (Qwen3 family: their float copies; their c outputs are RoPE's inputs, not kept); q, k
    after RoPE and v (K/V copied per Ulysses replica); under AllGather the other ranks' K and V;
    the attention output and its log-sum-exp."""
    c, f = sizes.compute, sizes.float
    query, kv, _, qk_norm = _attention_widths(text)
    replicas = _kv_replicas(text, cp, sdpa)
    normalised = (query + kv) * (sizes.upcast + f) if qk_norm else 0
    rotated = (query + 2 * kv * replicas) * c  # q, k after RoPE; v
    gathered = 2 * kv * c * (cp - 1) if sdpa != "ulysses" else 0
    output = query * c + text.num_attention_heads * f
    return norm_bytes(text.hidden_size, sizes) + normalised + rotated + gathered + output


def _attention_after_core_bytes(text, sizes: ElementSizes) -> int:
    """With an output gate (Qwen3-Next / Qwen3.5: q_proj holds it) sigmoid(gate) and the gated
    output, o_proj's input; without one o_proj reads the attention output itself."""
    query, _, gated, _ = _attention_widths(text)
    return 2 * query * sizes.compute if gated else 0


def layer_kept_bytes(text, kind: str, sizes: ElementSizes, cp: int, sdpa: str, checkpointing: str,
                     gdn_inner: bool = False) -> int:
    """What a layer keeps between its forward and its backward, a token (`layer_checkpointing`)."""
    if checkpointing == "off":
        return layer_saved_bytes(text, kind, sizes, cp, sdpa, gdn_inner)
    if checkpointing == "selective":
        return selective_saved_bytes(text, kind, sizes, cp, sdpa)
    return text.hidden_size * sizes.compute  # its input


def selective_saved_bytes(text, kind: str, sizes: ElementSizes, cp: int, sdpa: str) -> int:
    """What `activation_checkpointing.selective_policy` keeps of one layer of `kind`, per token: its input, the
    outputs of its matmuls (every projection), of the attention or GDN core, and the collectives'
    (under AllGather the other ranks' K and V); the norms, activations, RoPE and the conv are replayed.
    The GDN core's output is in q's dtype: float (q and k are normalised in float)."""
    c, hidden = sizes.compute, text.hidden_size
    mlp = (2 * text.intermediate_size + hidden) * c  # gate, up, down
    if kind == "linear_attention":
        key, value, value_heads = _gdn_widths(text)
        projections = (2 * key + 2 * value + 2 * value_heads) * c  # qkv, z, b, a
        return hidden * c + mlp + projections + value * sizes.float + hidden * c  # + the core's output, out_proj's
    query, kv, gated, _ = _attention_widths(text)
    projections = (query * (2 if gated else 1) + 2 * kv) * c
    gathered = 2 * kv * c * (cp - 1) if sdpa != "ulysses" else 0
    core = query * c + text.num_attention_heads * sizes.float  # the output and its log-sum-exp
    return hidden * c + mlp + projections + gathered + core + hidden * c  # + o_proj's output


def layer_peak_bytes(text, kind: str, sizes: ElementSizes, cp: int, sdpa: str, checkpointing: str,
                     gdn_inner: bool = False, attention: AttentionWork = AttentionWork()) -> float:
    """Everything of one layer alive at the peak of its backward, a token, what it kept included:
    the larger of its MLP's backward and its core's (module doc). A checkpointed layer keeps its
    input throughout; a selective one also the down projection's saved output, which its replay
    stops before (the replay ends at the last tensor the backward reads, down_proj's input)."""
    stages = max(_mlp_backward_bytes(text, kind, sizes, cp, sdpa, gdn_inner),
                 _core_backward_bytes(text, kind, sizes, cp, sdpa, gdn_inner, attention))
    own_input = text.hidden_size * sizes.compute
    return stages + {"off": 0, "checkpointed": own_input, "selective": 2 * own_input}[checkpointing]


def _mlp_backward_bytes(text, kind: str, sizes: ElementSizes, cp: int, sdpa: str, gdn_inner: bool = False) -> int:
    """The first moment of a layer's backward, its MLP's: every tensor the layer saved but
    SiLU(gate) x up (released by down_proj's backward), the gradients of that product, of
    SiLU(gate) and of up, and the incoming gradient."""
    c = sizes.compute
    saved = layer_saved_bytes(text, kind, sizes, cp, sdpa, gdn_inner)
    return saved + 2 * text.intermediate_size * c + text.hidden_size * c


def _core_backward_bytes(text, kind: str, sizes: ElementSizes, cp: int, sdpa: str, gdn_inner: bool = False,
                         attention: AttentionWork = AttentionWork()) -> float:
    """The backward of the layer's core: what the ops before it saved, the gradients in flight
    (the core output's, the gate's, the residual's) and the core's backward buffers."""
    c, hidden = sizes.compute, text.hidden_size
    if kind == "linear_attention":
        _, value, _ = _gdn_widths(text)
        in_flight = value * sizes.float + value * c + hidden * c  # d core output (float), dz, d residual
        buffers = gdn_core_backward_bytes(text, sizes) - (value * c if gdn_inner else 0)  # v contiguous: no copy
        if sdpa == "head_tail":  # one batch order: the GDN layers run in Head-Tail order too
            buffers += gdn_head_tail_backward_bytes(text, sizes)
        return _gdn_before_core_bytes(text, sizes, gdn_inner) + in_flight + buffers
    query, _, gated, _ = _attention_widths(text)
    in_flight = query * c * (2 if gated else 1) + hidden * c  # d output (and d gate), d residual
    return _attention_before_core_bytes(text, sizes, cp, sdpa) + in_flight + \
        attention_core_backward_bytes(text, sizes, cp, sdpa, attention)


def gdn_core_backward_bytes(text, sizes: ElementSizes) -> int:
    """The Triton GDN core's backward buffers at their peak, a token (kernels/gdn/triton/backend.py
    `chunk_backward`, launch.py `gdn_bwd`; State-P2P's `p2p_backward` allocates the same): q and k
    cast to the kernel dtype (c, v's), v made contiguous, the output gradient in c; prepare's gc, w,
    u and (I + A)^-1 rows (64 floats a token and head); then the most of three phases: after the
    reverse state pass (the recomputed chunk states and their gradients, one K x V state in c per
    64 tokens and head each; dvl in float; dvn), after `bwd_inter` (per value head dq, dw in c and
    dk in float) and in `bwd_prepare` (dv, dbeta, dg, and dq, dk in q's dtype: float)."""
    c, f = sizes.compute, sizes.float
    key, value, heads = _gdn_widths(text)
    per_head_keys = heads * text.linear_key_head_dim  # w, dq, dk, dw come per value head
    state = heads * text.linear_key_head_dim * text.linear_value_head_dim * c // GDN_CHUNK
    inputs = 2 * key * c + 2 * value * c
    prepared = heads * f + per_head_keys * c + value * c + heads * GDN_CHUNK * f
    after_state_pass = 2 * state + value * f + value * c
    per_head_grads = per_head_keys * (2 * c + f) + heads * f  # dq, dw; dk; dgc
    after_inter = 2 * state + value * c + per_head_grads
    in_prepare = value * c + per_head_grads + value * c + 2 * heads * f + 2 * key * f
    return inputs + prepared + max(after_state_pass, after_inter, in_prepare)


def gdn_head_tail_backward_bytes(text, sizes: ElementSizes) -> int:
    """What GDN in Head-Tail order adds to its core's backward, a token: the two fragments' input
    gradients (dq, dk in q's dtype, float; dv in c; dg, dbeta in float) beside their concatenation
    (kernels/gdn/triton/head_tail_executor.py `head_tail_backward`), one more copy of the core's
    input gradients. Counted from the code, not yet measured on a GPU."""
    f, c = sizes.float, sizes.compute
    key, value, heads = _gdn_widths(text)
    return 2 * key * f + value * c + 2 * heads * f


def attended_keys(sdpa: str, cp: int, rank: int) -> float:
    """The keys of the largest block one local attention call reads at once, in local lengths
    (kernels/attention/unmasked.py: a query chunk's prefix of fully visible keys in one call, then
    its causal diagonal in another). AllGather: rank r's prefix is the r ranks before it (rank 0:
    its diagonal, one length). Head-Tail: the tail chunk (half a length) follows 2 cp - 1 - r half
    lengths. Ulysses: one causal call over the whole sequence for the rank's share of the heads,
    one length of the rank's K/V width."""
    if sdpa == "all_gather":
        return max(rank, 1)
    if sdpa == "head_tail":
        return max(2 * cp - 1 - rank, 1) / 2
    return 1


def attention_core_backward_bytes(text, sizes: ElementSizes, cp: int, sdpa: str,
                                  work: AttentionWork = AttentionWork()) -> float:
    """The attention's backward buffers, a token (kernels/attention/unmasked.py `backward`): dq and
    the kernel's dq and float dq accumulator; dk, dv of every key the rank holds (under AllGather and
    Head-Tail every rank's; in float when two chunks' prefixes share keys, Head-Tail's); for the
    largest block (`attended_keys`) its K and V repeated per query head when the kernel does not
    read grouped heads, the kernel's per-query-head dk, dv and their sums per K/V head. Measured on
    the H200 (simulate_cp results): the last AllGather rank of 16 at 512K holds 7 GiB more than the
    first, what the repeated prefix K/V and their gradients come to."""
    c, f = sizes.compute, sizes.float
    query, kv, _, _ = _attention_widths(text)
    replicas = _kv_replicas(text, cp, sdpa)
    held = kv * (replicas if sdpa == "ulysses" else cp)
    key_grads = 2 * held * (f if sdpa == "head_tail" else c)
    block = kv * replicas * attended_keys(sdpa, cp, work.rank)
    groups = max(1, query // (kv * replicas))  # query heads per K/V head on the rank
    repeated = 0 if work.grouped_kernel or groups == 1 else 2 * block * groups * c
    block_grads = 2 * block * c * (groups + 1) if groups > 1 else 2 * block * c
    return 2 * query * c + query * f + key_grads + repeated + block_grads


def layer_parameters(text, kind: str) -> int:
    """One decoder layer's parameters, from the config (norms and the small GDN vectors included)."""
    hidden = text.hidden_size
    common = 3 * hidden * text.intermediate_size + 2 * hidden
    if kind == "linear_attention":
        key, value, value_heads = _gdn_widths(text)
        conv = 2 * key + value
        return (common + hidden * (conv + value + 2 * value_heads) + conv * text.linear_conv_kernel_dim
                + value * hidden + 2 * value_heads + text.linear_value_head_dim)
    query, kv, gated, qk_norm = _attention_widths(text)
    head_dim = query // text.num_attention_heads
    return common + hidden * (query * (2 if gated else 1) + 2 * kv) + query * hidden + (2 * head_dim if qk_norm else 0)
