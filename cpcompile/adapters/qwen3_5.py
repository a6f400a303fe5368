"""Qwen3.5 adapter: identities, GDN parameter roles, the GDN layer as a traceable graph, wrappers.

Qwen3.5 mixes Gated DeltaNet linear attention (`*.linear_attn`) with full attention 3:1. The
Hugging Face GDN layer's forward changed across transformers 5.x (argument names, kernel hub
dispatch) and, traced through its torch fallback, unrolls into thousands of ATen ops. So the
adapter traces its *own* statement of the layer — same parameters, same math, checked against
the installed transformers by the tests — in which the recurrent core is one
`cpcompile::gdn_chunk` node and the causal conv's left context is one explicit pad node: the
two places a GDN CP rewrite changes.

Qwen3-Next's GatedDeltaNet (`Qwen3NextGatedDeltaNet`) is the same layer with its projections
fused otherwise: one `in_proj_qkvz` and one `in_proj_ba`, their outputs grouped per key head.
Only how q, k, v, z, b and a are read off the hidden states differs (`gdn_projections`); the
conv, the core and the gated norm are the same, and so are the wrappers and every GDN method.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..errors import CPInputError
from ..kernels.gdn import CHUNK_SIZE, check_backend, l2norm, normalising_core
from ..kernels.gdn.conv import causal_conv, conv_silu_tokens, conv_taps, triton_conv_applies
from ..kernels.gdn.layout import contiguous_when_compiled
from ..kernels.gdn.layer_ops import require_backend  # also registers the cpcompile:: ops
from ..methods import AdapterSpec, CPMethod, MethodSpec, inner_wrapper, register_adapter
from ..passes.gdn import all_gather, all_gather_head_tail, p2p, p2p_head_tail, ulysses

# Both Hugging Face identities map to this one provider.
ARCHITECTURES = {"Qwen3_5ForConditionalGeneration": "qwen3_5", "Qwen3_5ForCausalLM": "qwen3_5_text"}
MODEL_TYPES = frozenset(ARCHITECTURES.values())

# How tensor parallelism would split each GDN parameter (not used by CP; for TP planning).
GDN_PARAMETER_ROLES = {
    "in_proj_qkv": "fused_qkv",
    "in_proj_z": "colwise",
    "in_proj_b": "colwise",
    "in_proj_a": "colwise",
    "conv1d": "colwise",
    "A_log": "colwise",
    "dt_bias": "colwise",
    "out_proj": "rowwise",
}

ADAPTER = "qwen3_5_gdn"
# Call arguments that mean packed sequences or an inference cache: refused, never ignored.
PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "seq_idx", "max_length_q", "max_length_k")
CACHE_KWARGS = ("cache", "cache_params", "past_key_values")


def is_qwen3_5(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    return type(model).__name__ in ARCHITECTURES or getattr(config, "model_type", None) in MODEL_TYPES


GDN_COMMON = ("conv1d", "A_log", "dt_bias", "norm", "out_proj")
QWEN3_5_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
QWEN3_NEXT_PROJECTIONS = ("in_proj_qkvz", "in_proj_ba")  # grouped per key head


def is_gdn_layer(module: nn.Module) -> bool:
    """A Qwen3.5(-MoE) or Qwen3-Next GatedDeltaNet layer, recognised by class name and parameters."""
    return type(module).__name__.endswith("GatedDeltaNet") and all(hasattr(module, n) for n in GDN_COMMON) and (
        all(hasattr(module, n) for n in QWEN3_5_PROJECTIONS) or all(hasattr(module, n) for n in QWEN3_NEXT_PROJECTIONS)
    )


def gdn_projections(layer: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The layer's projections of `hidden_states [B, T, hidden]`: the conv input `[B, T, 2·key_dim +
    value_dim]` (q, k, v flattened, in that order), z `[B, T, V heads, V dim]`, b and a `[B, T, V heads]`.

    Qwen3.5 projects each separately. Qwen3-Next fuses them and groups the outputs per key head:
    each of its K heads holds its q and k head, then its V/K value heads and as many z heads (and
    b, a likewise), which this puts in the order Qwen3.5's layout has.
    """
    batch, length, _ = hidden_states.shape
    if hasattr(layer, "in_proj_qkv"):
        z = layer.in_proj_z(hidden_states).reshape(batch, length, -1, layer.head_v_dim)
        return layer.in_proj_qkv(hidden_states), z, layer.in_proj_b(hidden_states), layer.in_proj_a(hidden_states)
    key_heads, value_heads = layer.num_k_heads, layer.num_v_heads
    per_key = value_heads // key_heads  # value heads sharing one key head
    qkvz = layer.in_proj_qkvz(hidden_states).reshape(batch, length, key_heads, -1)
    ba = layer.in_proj_ba(hidden_states).reshape(batch, length, key_heads, 2 * per_key)
    sizes = [layer.head_k_dim, layer.head_k_dim, per_key * layer.head_v_dim, per_key * layer.head_v_dim]
    query, key, value, z = torch.split(qkvz, sizes, dim=3)
    b, a = torch.split(ba, [per_key, per_key], dim=3)
    mixed = torch.cat([x.reshape(batch, length, -1) for x in (query, key, value)], dim=-1)
    z = z.reshape(batch, length, value_heads, layer.head_v_dim)
    return mixed, z, b.reshape(batch, length, value_heads), a.reshape(batch, length, value_heads)


def gdn_layer_forward(layer: nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
                      document_positions: torch.Tensor | None = None, *, chunk_size: int,
                      backend: str, checkpoint_around_core: bool = False) -> torch.Tensor:
    """One Qwen3.5 or Qwen3-Next GDN layer (training, no cache), as the graph CP rewrites see it.

    `document_positions` (`[B or 1, T]`, a packed batch only) are the tokens' positions inside
    their documents: the state resets where they are 0, and the conv reads no token of an earlier
    document (`conv_taps`). Positions are all the layer needs, on a CP rank too: the
    halo the rewrite fills in comes from before a token only when its position says it may.

    `checkpoint_around_core` (the trainer's `train.gdn_checkpoint_around_core`, without CP) runs
    `gdn_core_inputs`, and the gated norm with out_proj after the core, each under its own
    non-reentrant checkpoint: what those ops save (the conv's input and outputs, q and k in float
    before and after their L2 norm, the gated norm's float copies) is not held during the layer's
    backward beyond their own, only the core's inputs and output; they are recomputed once more.
    """
    if getattr(layer, "activation", "silu") not in ("silu", "swish"):
        raise CPInputError(f"{type(layer).__name__}: GDN context parallelism states the layer's conv with SiLU, "
                           f"the layer has activation {layer.activation!r}")
    batch, length, _ = hidden_states.shape
    value_dim = layer.head_v_dim
    norm_in_core = normalising_core.applies(hidden_states, backend)  # eager CUDA: the norm in the core's kernels
    if checkpoint_around_core:
        def inputs(hidden):  # v as its own tensor: a view would hold the whole SiLU output alive
            query, key, value, *rest = gdn_core_inputs(layer, hidden, attention_mask, document_positions, backend,
                                                       normalise_qk=not norm_in_core)
            return query, key, value.contiguous(), *rest
        query, key, value, g, beta, z, starts = checkpoint(inputs, hidden_states, use_reentrant=False)
    else:
        query, key, value, g, beta, z, starts = gdn_core_inputs(layer, hidden_states, attention_mask,
                                                                 document_positions, backend,
                                                                 normalise_qk=not norm_in_core)
    scale = layer.head_k_dim**-0.5
    if norm_in_core:
        core = normalising_core.chunk_normalising_qk(query, key, value, g, beta, scale, chunk_size, starts)
    else:
        core = torch.ops.cpcompile.gdn_chunk(query, key, value, g, beta, None, scale, chunk_size, backend, starts)
    core = core.to(value.dtype)

    def output(core, z):  # the gated norm and out_proj
        core = layer.norm(core.reshape(-1, value_dim), z.reshape(-1, value_dim))
        return layer.out_proj(core.reshape(batch, length, -1))
    if checkpoint_around_core:
        return checkpoint(output, core, z, use_reentrant=False)
    return output(core, z)


def gdn_core_inputs(layer: nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
                    document_positions: torch.Tensor | None, backend: str = "eager",
                    normalise_qk: bool = True) -> tuple:
    """The GDN layer up to its core: -> (q, k, v, g, beta, z, document starts or None); q and k
    L2-normalised in float32 (with `normalise_qk=False` as the conv left them: the eager CUDA core
    normalises them itself, `kernels/gdn/normalising_core.py`), v `[B, T, V heads, V dim]`, z the
    output gate's projection.

    On the triton backend run eagerly on CUDA the conv and its SiLU are one Triton kernel on the
    projection's token-major output (`kernels/gdn/conv.py`); q, k and v are then views of a
    `[B, T, C]` tensor: q and k get contiguous by their float32 cast, v stays a token-strided view
    (the core copies it)."""
    if attention_mask is not None:  # padded positions contribute nothing (HF zeroes them too)
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    batch, length, _ = hidden_states.shape
    key_dim, value_dim = layer.head_k_dim, layer.head_v_dim

    mixed, z, b, a = gdn_projections(layer, hidden_states)
    positions = None if document_positions is None else document_positions.expand(batch, length)
    starts = None if positions is None else positions == 0
    weight, bias = layer.conv1d.weight, layer.conv1d.bias
    if triton_conv_applies(mixed, backend):  # eager CUDA: one kernel, token-major in and out
        mixed = conv_silu_tokens(mixed, weight, bias, positions)
    else:  # what CP rewrites and compiled layers see (traced)
        mixed = mixed.transpose(1, 2)  # [B, conv channels, T]
        history = F.pad(mixed.to(weight.dtype), (weight.shape[-1] - 1, 0))  # causal left context: CP fills it
        if positions is None:
            conv = causal_conv(history, weight, bias)
        else:
            conv = conv_taps(history, weight, bias, positions)
        mixed = F.silu(conv).to(mixed.dtype).transpose(1, 2)

    query, key, value = torch.split(mixed, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    # q/k normalisation as Qwen3.5's reference does it: in fp32, and kept in fp32
    query, key = (x.reshape(batch, length, -1, key_dim) for x in (query, key))
    if normalise_qk:
        query, key = l2norm(query.float()), l2norm(key.float())
    value = value.reshape(batch, length, -1, value_dim)
    query, key, value = (contiguous_when_compiled(x) for x in (query, key, value))  # kernels/gdn/layout.py
    beta = b.sigmoid()
    g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias)
    return query, key, value, g, beta, z, starts


class GdnRegion:
    """How cpcompile calls and traces a Qwen3.5 GDN layer under a GDN CP method."""

    def __init__(self, method: CPMethod):
        self.chunk_size = method.params["chunk_size"]
        self.backend = method.params["backend"]
        require_backend(self.backend)

    def prepare_call(self, fqn: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Map any transformers 5.x call of the layer onto (hidden_states, attention_mask)."""
        for name in CACHE_KWARGS:
            if kwargs.get(name) is not None:
                raise CPInputError(f"{fqn}: called with {name}; GDN context parallelism does not support an "
                                 "inference cache or incremental decoding (use_cache=False)")
        for name in PACKED_KWARGS:
            if kwargs.get(name) is not None:
                raise CPInputError(f"{fqn}: called with {name}; GDN context parallelism takes packed documents "
                                 "from the batch: pass position ids restarting at 0 (or cu_seq_lens) through "
                                 "cpcompile.shard_batch")
        if len(args) > 1 and args[1] is not None:  # (hidden_states, cache, attention_mask) in transformers 5.x
            raise CPInputError(f"{fqn}: called with a cache argument; GDN context parallelism does not support an "
                             "inference cache or incremental decoding (use_cache=False)")
        hidden = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(hidden, torch.Tensor):
            raise CPInputError(f"{fqn}: a GDN layer call needs hidden_states as a tensor, got {type(hidden).__name__}")
        mask = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)
        if mask is not None and mask.dim() != 2:
            raise CPInputError(f"{fqn}: GDN layers take a 2-D padding mask, got shape {tuple(mask.shape)}")
        return (hidden,), {"attention_mask": mask}

    # The layer's call has no position ids (the decoder layer keeps them): the compiled model hands
    # a packed batch's to the region as `document_positions` (`documents.DocumentFeed`).
    reads_documents = True

    def forward(self, layer: nn.Module, hidden_states: torch.Tensor, attention_mask: Any = None,
                document_positions: torch.Tensor | None = None) -> torch.Tensor:
        return gdn_layer_forward(layer, hidden_states, attention_mask, document_positions,
                                 chunk_size=self.chunk_size, backend=self.backend)


def _gdn_method(spec: MethodSpec, wrapper: str, backend: str, chunk_size: int) -> CPMethod:
    check_backend(backend)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise CPInputError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    if backend == "triton" and chunk_size != CHUNK_SIZE:
        raise CPInputError(f"the triton GDN backend supports chunk_size={CHUNK_SIZE} only, got {chunk_size}")
    return spec.cp_method(wrapper, backend=backend, chunk_size=chunk_size, adapter=ADAPTER)


@inner_wrapper
def qwen3_5_gdn_ulysses_cp_wrapper(backend: str = "eager", chunk_size: int = CHUNK_SIZE) -> CPMethod:
    """GDN Ulysses: q, k, v, g, β sequence→head all-to-all, full-sequence core on K/cp and V/cp
    heads, output head→sequence. K heads and V heads must divide by cp."""
    return _gdn_method(ulysses.ULYSSES, "qwen3_5_gdn_ulysses_cp_wrapper", backend, chunk_size)


@inner_wrapper
def qwen3_5_gdn_p2p_cp_wrapper(backend: str = "eager", chunk_size: int = CHUNK_SIZE) -> CPMethod:
    """GDN State-P2P: conv halo from rank r−1, local (M, S) summary, fp32 state chain
    rank 0 → P−1 (gradient chain P−1 → 0 in backward); every rank keeps all heads."""
    return _gdn_method(p2p.P2P, "qwen3_5_gdn_p2p_cp_wrapper", backend, chunk_size)


@inner_wrapper
def qwen3_5_gdn_all_gather_cp_wrapper(backend: str = "eager", chunk_size: int = CHUNK_SIZE) -> CPMethod:
    """GDN State-AllGather (a comparison path): all-gather every rank's (M, S), compose the
    prefix in rank order. Eager backend only."""
    if backend != "eager":
        raise CPInputError(f"GDN State-AllGather supports backend='eager' only, got {backend!r}")
    return _gdn_method(all_gather.ALL_GATHER, "qwen3_5_gdn_all_gather_cp_wrapper", backend, chunk_size)


@inner_wrapper
def qwen3_5_gdn_p2p_head_tail_cp_wrapper(backend: str = "eager", chunk_size: int = CHUNK_SIZE) -> CPMethod:
    """GDN State-P2P in Head-Tail order, beside `sdpa_hf_load_balance_cp_wrapper` (one batch order
    for the whole model): rank r holds chunks r and 2·cp−1−r; the state goes up the heads and back
    down the tails (docs/methods.md); every rank keeps all heads."""
    return _gdn_method(p2p_head_tail.P2P_HEAD_TAIL, "qwen3_5_gdn_p2p_head_tail_cp_wrapper", backend, chunk_size)


@inner_wrapper
def qwen3_5_gdn_all_gather_head_tail_cp_wrapper(backend: str = "eager", chunk_size: int = CHUNK_SIZE) -> CPMethod:
    """GDN State-AllGather in Head-Tail order (a comparison path): every rank's two (M, S) gathered,
    each fragment's prefix composed in sequence order. Eager backend only."""
    if backend != "eager":
        raise CPInputError(f"GDN State-AllGather supports backend='eager' only, got {backend!r}")
    return _gdn_method(all_gather_head_tail.ALL_GATHER_HEAD_TAIL, "qwen3_5_gdn_all_gather_head_tail_cp_wrapper",
                       backend, chunk_size)


register_adapter(AdapterSpec(ADAPTER, core="gdn", region=GdnRegion, is_core_module=is_gdn_layer))
