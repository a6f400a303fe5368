"""The per-rank memory estimate of a training step (`loop.memory_estimate`, printed by `--dry-run`).

Counted from the config alone (train settings, mesh, the model's config; the parameter count), as
the peak of allocated memory (`torch.cuda.max_memory_allocated`) in a steady-state step, in GiB:

    total = states + fsdp_buffers + activations + max(loss, layer_backward)

Assumptions, term by term (T = this rank's tokens = batch_size / dp x seq_len / cp; e, c, r = the
bytes of an element of the parameters (`train.dtype`), of the compute dtype (FSDP2's
`mixed_precision.param_dtype`, else e) and of the gradient reduction (`reduce_dtype`, else c);
f = max(4, c): norms, gates and the loss run in float32 at least):

- `states`: parameters, gradients and AdamW's two moments, all in e, sharded by FSDP2 over
  dp_shard x cp and, as if TP split them all (its linears are most of them), over tp: 4 e P / shards.
- `fsdp_buffers`: the root's parameters (embeddings, an untied head, the final norm) gathered in c
  for the whole step (FSDP2 does not reshard the root after its forward), and around one decoder
  layer's backward: its gathered parameters and the next layer's (prefetched), its unsharded
  gradient in c and that gradient again in r for the reduce-scatter: (3 c + r) x the largest
  layer's parameters.
- `activations`: what the decoder stack keeps for the backward, layer by layer as
  `activation_checkpointing` picks them (`checkpointing.ACMode.layers`): a checkpointed layer its
  input, c h per token; a `selective` one its input and the outputs its policy saves
  (`selective_saved_bytes`: the matmuls', the attention or GDN core's, the gathered K/V); a layer
  left alone everything its backward reads (`layer_saved_bytes`); plus the final norm's saved
  tensors and its output (the loss's input).
- `loss`: the loss's own buffers, while every saved activation is alive (the start of the
  backward): with `loss: chunked` one chunk's logits in c, their float32 copy and gradient
  (`loss_chunk_tokens` x vocab x (c + 2 f)) and the head's weight gradient accumulated in float32
  (vocab x h x f); with `loss: full` the log-softmax output, its gradient and the logits' gradient,
  all in float32 (T x vocab x 3 f: the logits in c are gone by then).
- `layer_backward`: one decoder layer's backward, its checkpoint replayed: what the replay saves
  (`layer_saved_bytes`; for a selective layer what its policy recomputes, the difference to
  `selective_saved_bytes`; nothing for a layer that was not checkpointed: already in `activations`)
  plus its backward's working memory (`layer_workspace_bytes`): GDN's per-chunk fp32 states
  (Hv K V f / 64 a token), its w, u and (I + A)^-1 blocks, the fp32 q/k gradients; SDPA's fp32 dq
  and, under AllGather, the gathered keys' gradients; the MLP's gradients in flight. The largest
  layer kind counts.

`layer_saved_bytes` follows the Qwen3.5 / Qwen3 / Llama layers as transformers writes them and as
cpcompile runs their GDN core (trainer/parallelize.py `use_cpcompile_gdn`, the CP rewrites): RMSNorm
upcasts its input and keeps the float32 input and normalised value and its output in c
((2 f + c) per element); GDN keeps the conv's padded input, output and SiLU output (3 x conv
channels x c), q and k L2-normalised in float32 (their upcast copies and the results), g and beta,
the gated RMSNorm's upcasts (core output, gate, SiLU(gate)) and its two c results, and out_proj's
input; attention keeps q (and k) after their norm (Qwen3 family) and RoPE, v, the output, the
output gate and its product (Qwen3-Next / Qwen3.5: their q_proj holds the gate), and under
AllGather the other ranks' K and V (2 x KV width x c x (cp - 1) a token; Ulysses instead replicates
KV heads up to cp); the MLP keeps gate, up, SiLU(gate) and their product (4 x intermediate x c).

Not counted: CUDA/NCCL/Triton workspaces outside PyTorch's allocator, the allocator's fragmentation
(reserved - allocated), the first step's one-off work (tracing, FSDP2's lazy init), TP's split of
the activations. These per-element counts are read from the code, not measured: calibrate them
against `benchmarks/trainer_gpu.py --simulate-cp`'s measured peaks (its `est/peak` column).
"""
from __future__ import annotations

import torch

from .config import DTYPES, TrainConfig

GIB = 2.0 ** 30
GDN_CHUNK = 64  # tokens per chunk of the GDN kernels: one fp32 state per chunk in the backward


def estimate(config: TrainConfig, params: int, model_config) -> dict[str, float]:
    """The estimate of the module doc, GiB per term and `total`."""
    settings, accelerator = config.train, config.plan.accelerator
    text = model_config.get_text_config()
    sizes = _ElementSizes.of(settings)
    tokens = settings.batch_size // config.dp_size * settings.seq_len // accelerator.cp_size
    shards = accelerator.dp_shard_size * accelerator.cp_size * accelerator.tp_size
    sdpa = _sdpa_method(config)
    kinds = layer_kinds(text)
    mode = settings.ac_mode
    checkpointed = set(mode.layers(len(kinds)))

    states = 4 * params * sizes.param / shards
    fsdp = (root_parameters(text) * sizes.compute
            + max(layer_parameters(text, kind) for kind in set(kinds)) * (3 * sizes.compute + sizes.reduce))
    kept = {kind: _kept_bytes(text, kind, sizes, accelerator.cp_size, sdpa, mode.kind) for kind in set(kinds)}
    stack = sum(kept[kind] if index in checkpointed else layer_saved_bytes(text, kind, sizes, accelerator.cp_size, sdpa)
                for index, kind in enumerate(kinds)) * tokens
    final = (2 * sizes.float + 2 * sizes.compute) * text.hidden_size * tokens  # final norm + its output
    loss = loss_bytes(settings, text, sizes, tokens)
    replayed = {kinds[index] for index in checkpointed}
    layer = max((layer_saved_bytes(text, kind, sizes, accelerator.cp_size, sdpa) - kept[kind] + text.hidden_size
                 * sizes.compute if kind in replayed else 0)
                + layer_workspace_bytes(text, kind, sizes, accelerator.cp_size, sdpa)
                for kind in set(kinds)) * tokens
    terms = {"states": states, "fsdp_buffers": fsdp, "activations": stack + final, "loss": loss,
             "layer_backward": layer}
    gib = {name: value / GIB for name, value in terms.items()}
    gib["total"] = gib["states"] + gib["fsdp_buffers"] + gib["activations"] + max(gib["loss"], gib["layer_backward"])
    return gib


class _ElementSizes:
    """Bytes of an element: parameters, compute, gradient reduction, and float (float32 at least)."""

    def __init__(self, param: int, compute: int, reduce: int):
        self.param, self.compute, self.reduce = param, compute, reduce
        self.float = max(4, compute)

    @classmethod
    def of(cls, settings) -> "_ElementSizes":
        param = _bytes(DTYPES[settings.dtype])
        param_dtype, reduce_dtype = settings.precision_policy()
        compute = _bytes(param_dtype) if param_dtype is not None else param
        return cls(param, compute, _bytes(reduce_dtype) if reduce_dtype is not None else compute)


def _bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _sdpa_method(config: TrainConfig) -> str:
    """'ulysses' when the plan runs SDPA with Ulysses, else 'all_gather' (AllGather, Head-Tail and
    their async variants gather K/V; Hybrid is counted as AllGather)."""
    for override in config.plan.active_overrides():
        method = override.method
        if method is not None and method.core == "sdpa" and "ulysses" in method.name:
            return "ulysses"
    return "all_gather"


def layer_kinds(text) -> list[str]:
    """Each decoder layer's kind: 'linear_attention' (GDN) or 'full_attention'."""
    return list(getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers)


def _attention_widths(text) -> tuple[int, int, bool, bool]:
    """(query width, K or V width, q_proj holds an output gate, q/k normalised per head)."""
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    hybrid = "linear_attention" in layer_kinds(text)  # Qwen3-Next / Qwen3.5: gated attention output
    return heads * head_dim, kv_heads * head_dim, hybrid, text.model_type.startswith("qwen3")


def _gdn_widths(text) -> tuple[int, int, int]:
    """(key width, value width, value heads) of a GDN layer."""
    return (text.linear_num_key_heads * text.linear_key_head_dim,
            text.linear_num_value_heads * text.linear_value_head_dim, text.linear_num_value_heads)


def norm_bytes(width: int, sizes: _ElementSizes) -> int:
    """An RMSNorm's saved tensors a token: float input, normalised value, output in c."""
    return (2 * sizes.float + sizes.compute) * width


def layer_saved_bytes(text, kind: str, sizes: _ElementSizes, cp: int, sdpa: str) -> int:
    """What one decoder layer of `kind` keeps for its backward, per token (module doc)."""
    c, f, hidden = sizes.compute, sizes.float, text.hidden_size
    common = 2 * norm_bytes(hidden, sizes) + 4 * text.intermediate_size * c  # two norms, the MLP
    if kind == "linear_attention":
        key, value, value_heads = _gdn_widths(text)
        conv = 3 * (2 * key + value) * c
        upcast = f if c < f else 0  # q/k upcast copies: none when c is float32 already
        qk = 2 * key * (upcast + f)
        gates = 3 * value_heads * f
        gated_norm = value * (3 * f + 2 * c)
        return common + conv + qk + gates + gated_norm + value * c
    query, kv, gated, qk_norm = _attention_widths(text)
    kv_heads = kv // (query // text.num_attention_heads)
    # Ulysses with fewer KV heads than ranks copies each KV head up to one per rank before the exchange
    replicas = max(1, cp // kv_heads) if sdpa == "ulysses" else 1
    rotated = (query + kv * replicas) * c + (norm_bytes(query + kv, sizes) if qk_norm else 0)
    values = kv * c * replicas
    gathered = 2 * kv * c * (cp - 1) if sdpa == "all_gather" else 0
    output = query * c * (3 if gated else 1)  # the attention output; with a gate: sigmoid(gate), the product
    return common + rotated + values + gathered + output


def _kept_bytes(text, kind: str, sizes: _ElementSizes, cp: int, sdpa: str, mode: str) -> int:
    """What a checkpointed layer of `kind` keeps between its forward and its backward, per token."""
    if mode == "selective":
        return selective_saved_bytes(text, kind, sizes, cp, sdpa)
    return text.hidden_size * sizes.compute  # its input


def selective_saved_bytes(text, kind: str, sizes: _ElementSizes, cp: int, sdpa: str) -> int:
    """What `checkpointing.selective_policy` keeps of one layer of `kind`, per token: its input, the
    outputs of its matmuls (every projection), of the attention or GDN core, and the collectives'
    (under AllGather the other ranks' K and V); the norms, activations, RoPE and the conv are replayed."""
    c, hidden = sizes.compute, text.hidden_size
    mlp = (2 * text.intermediate_size + hidden) * c  # gate, up, down
    if kind == "linear_attention":
        key, value, value_heads = _gdn_widths(text)
        projections = (2 * key + 2 * value + 2 * value_heads) * c  # qkv, z, b, a
        return hidden * c + mlp + projections + value * c + hidden * c  # + the core's output, out_proj's
    query, kv, gated, _ = _attention_widths(text)
    projections = (query * (2 if gated else 1) + 2 * kv) * c
    gathered = 2 * kv * c * (cp - 1) if sdpa == "all_gather" else 0
    return hidden * c + mlp + projections + gathered + query * c + hidden * c  # + the core's output, o_proj's


def layer_workspace_bytes(text, kind: str, sizes: _ElementSizes, cp: int, sdpa: str) -> int:
    """One layer's backward working memory beyond what it saved, per token (module doc)."""
    c, f = sizes.compute, sizes.float
    in_flight = 2 * text.intermediate_size * c  # the MLP's activation gradients
    if kind == "linear_attention":
        key, value, value_heads = _gdn_widths(text)
        key_dim, value_dim = text.linear_key_head_dim, text.linear_value_head_dim
        states = value_heads * key_dim * value_dim * f // GDN_CHUNK
        prepared = value_heads * (key_dim + value_dim + GDN_CHUNK) * f  # w, u, (I + A)^-1 blocks
        return in_flight + states + prepared + 2 * key * f
    query, kv, _, _ = _attention_widths(text)
    keys = 2 * kv * f * (cp if sdpa == "all_gather" else 1)  # dK, dV over the keys it attended
    return in_flight + query * f + keys


def loss_bytes(settings, text, sizes: _ElementSizes, tokens: int) -> int:
    """The loss's buffers at the start of the backward (module doc)."""
    f = 8 if sizes.compute == 8 else 4  # the loss runs in float32, float64 for a float64 model
    if settings.loss == "full":
        return 3 * f * tokens * text.vocab_size
    rows = min(tokens, settings.loss_chunk_tokens)
    return rows * text.vocab_size * (sizes.compute + 2 * f) + text.vocab_size * text.hidden_size * max(f, sizes.param)


def root_parameters(text) -> int:
    """The parameters outside the decoder layers: embeddings, an untied head, the final norm."""
    embeddings = text.vocab_size * text.hidden_size
    return embeddings * (1 if getattr(text, "tie_word_embeddings", False) else 2) + text.hidden_size


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
