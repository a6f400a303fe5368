"""The per-rank memory estimate of a training step (`dry_run_report.memory_estimate`, printed by `--dry-run`).

Counted from the config alone (train settings, mesh, the model's config; the parameter count), as
the peak of allocated memory (`torch.cuda.max_memory_allocated`) in a steady-state step, in GiB.
T is this rank's tokens (batch_size / dp x seq_len / cp); e, c, r the bytes of an element of the
parameters (`train.dtype`), of the compute dtype (FSDP2's `mixed_precision.param_dtype`, else e)
and of the gradient reduction (`reduce_dtype`, else c); f = max(4, c): norms, gates, the GDN
core's q/k and the loss run in float32 at least.

The peak is not the sum of the step's parts: the backward walks down the decoder stack, creating
each layer's gradients and releasing what each layer kept, so the gradients of the lower layers
and the activations of the upper ones never coexist. `total` is the largest of these moments:

- the loss's backward: parameters and AdamW's two moments (3 e P / shards: `zero_grad(set_to_none)`
  freed the gradients), the root's gathered parameters and the last layer's (FSDP2 keeps both
  after the forward), every kept activation and the loss's buffers;
- each decoder layer i's backward, from the last down: parameters and moments, the reduced
  gradients of the layers above i, the root's gathered parameters and the head's unsharded
  gradient in c (reduced only in the root's post-backward, at the end), FSDP2's buffers around
  layer i, what the layers below i keep, and everything of layer i alive at its backward's peak;
- the optimizer step: parameters, gradients, moments and foreach AdamW's one temporary
  (sqrt of the second moment): 5 e P / shards.

The terms reported beside `total` (GiB): `states` = 4 e P / shards (parameters, gradients, moments;
sharded by FSDP2 over dp_shard x cp and, as if TP split them all, over tp); `fsdp_buffers` = the
root's parameters gathered in c (for the whole step) + (3 c + r) x the largest layer's parameters
(its gathered parameters, the next layer's prefetched, its unsharded gradient in c and again in r
for the reduce-scatter); `activations` = what every layer keeps + the final norm's, at the start of
the backward; `loss` = the loss's buffers at their peak; `layer_backward` = the most a layer's
backward holds beyond what it kept.

Per token, what each decoder layer saves, keeps and holds at its backward's peak is counted in
`memory_layers.py` (its docstring says what each kind holds, and how the counts were measured);
here they are combined over the layers and the step. The loss's buffers (`loss_bytes`):

- `loss: chunked`: one chunk's logits in c while their float copy is made (or, in the backward,
  the float gradient while its c copy is made): loss_chunk_tokens x vocab x (c + f); with a
  compile backend (the layers'), the logits and their gradient, both in c, the float work fused
  away: loss_chunk_tokens x vocab x 2c; the head's
  weight gradient accumulated in float (vocab x h x f) and the hidden states' gradient (T x h x
  c); `loss: full`: the log-softmax output, its gradient and the logits' gradient, all in float
  (T x vocab x 3 f: the logits in c are gone by then). The final norm keeps (upcast + f + c) x h.

The whole estimate against the H200 peaks (docs/trainer.md): every eager row within 2.1%, the CP
rows rank by rank (rank 0 and the last, CP=2-16, 128K-1M tokens), but the last AllGather rank at
1M tokens at CP=8 and 16 (4-6% under: 1.3-1.7 GiB not found; at CP=2 within 0.3%).
`estimate(rank=None)`, what the dry run prints, is the busiest rank's (`busiest_rank`), the job's
peak.

Not counted: CUDA/NCCL/Triton workspaces outside PyTorch's allocator, the allocator's
fragmentation (reserved - allocated), an op's temporaries freed inside it (e.g. a cuDNN conv
workspace), the first step's one-off work (tracing, FSDP2's lazy init, AdamW's state creation),
the rotary embeddings (2 x rotary dim x c a token, shared by the layers), TP's split of the
activations. `torch.compile`d layers fuse some of the saved elementwise results away: their
peak was 3-7% below this eager count on the H200 (docs/trainer.md).
"""
from __future__ import annotations

import dataclasses

from ..linear_cross_entropy import uses_triton_chunk_work
from .config import TrainConfig
from .memory_layers import (
    AttentionWork, ElementSizes, attention_kernel_groups_heads, final_norm_bytes, layer_checkpointing,
    layer_kept_bytes, layer_kinds, layer_parameters, layer_peak_bytes,
)

GIB = 2.0 ** 30


def estimate(config: TrainConfig, params: int, model_config, rank: int | None = None) -> dict[str, float]:
    """The estimate of the module doc for CP rank `rank` (None: the rank with the most attention
    work, whose peak is the job's), GiB per term and `total`."""
    cp = config.plan.accelerator.cp_size
    if rank is not None and not 0 <= rank < cp:
        raise ValueError(f"rank {rank} is not a CP rank of cp_size {cp}")
    rank = busiest_rank(sdpa_method(config), cp) if rank is None else rank
    terms, moments = _terms_and_moments(config, params, model_config, rank)
    gib = {name: value / GIB for name, value in terms.items()}
    gib["total"] = max(moments.values()) / GIB
    return gib


def busiest_rank(sdpa: str, cp: int) -> int:
    """The CP rank whose attention reads the most keys at once (`attended_keys`): the last under
    AllGather (its queries follow every key), the first under Head-Tail (its tail chunk is the
    sequence's last); under Ulysses every rank alike."""
    return cp - 1 if sdpa == "all_gather" else 0


def total_at_length(config: TrainConfig, params: int, model_config, seq_len: int) -> float:
    """The estimate's `total` (GiB) for `config` with `train.seq_len` set to `seq_len`."""
    at = dataclasses.replace(config, train=dataclasses.replace(config.train, seq_len=seq_len))
    return estimate(at, params, model_config)["total"]


# where the search for the longest length stops: a bound on the search, far past what one device
# holds of any model (a length past what a model's kernels take is theirs to refuse at start-up)
LONGEST_SEARCHED = 1 << 30


def longest_seq_len(config: TrainConfig, params: int, model_config, budget_gib: float, multiple: int) -> int:
    """The longest `train.seq_len`, a multiple of `multiple` (what the plan's layout needs) up to
    `LONGEST_SEARCHED`, whose estimated `total` is within `budget_gib`; 0 when not even `multiple`
    is. Every term that depends on the length grows with it, so doubling then bisecting finds the
    boundary."""
    def fits(seq_len: int) -> bool:
        return total_at_length(config, params, model_config, seq_len) <= budget_gib

    if not fits(multiple):
        return 0
    cap = LONGEST_SEARCHED // multiple * multiple
    low, high = multiple, None  # low fits; high, once known, does not
    while high is None:
        candidate = min(2 * low, cap)
        if candidate == low:
            return low
        low, high = (candidate, None) if fits(candidate) else (low, candidate)
    while high - low > multiple:
        middle = (low + high) // 2 // multiple * multiple
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def _terms_and_moments(config: TrainConfig, params: int, model_config, rank: int) -> tuple[dict, dict]:
    """({term: bytes}, {moment of the step: bytes alive then}) of the module doc, on CP rank `rank`."""
    settings, accelerator = config.train, config.plan.accelerator
    text = model_config.get_text_config()
    sizes = ElementSizes.of(settings)
    tokens = settings.batch_size // config.dp_size * settings.seq_len // accelerator.cp_size
    shards = accelerator.dp_shard_size * accelerator.cp_size * accelerator.tp_size
    kept, peaks = _layers_bytes(config, text, sizes, tokens, rank)
    layer_fsdp = [layer_parameters(text, kind) * (3 * sizes.compute + sizes.reduce) for kind in layer_kinds(text)]
    root = root_parameters(text) * sizes.compute
    terms = {"states": 4 * params * sizes.param / shards,
             "fsdp_buffers": root + max(layer_fsdp),
             "activations": sum(kept) + final_norm_bytes(text, sizes) * tokens,
             "loss": loss_bytes(settings, text, sizes, tokens, _loss_chunk_work(settings, sizes)),
             "layer_backward": max(peak - keep for peak, keep in zip(peaks, kept))}
    resident = 3 * params * sizes.param / shards  # parameters and moments: zero_grad(set_to_none) freed the gradients
    last_layer = layer_parameters(text, layer_kinds(text)[-1]) * sizes.compute  # stays gathered after the forward
    moments = {"loss backward": resident + root + last_layer + terms["activations"] + terms["loss"]}
    base = resident + root + head_parameters(text) * sizes.compute
    for index, value in _layer_backward_moments(text, sizes, shards, base, kept, peaks, layer_fsdp):
        moments[f"layer {index} backward"] = value
    moments["optimizer step"] = 5 * params * sizes.param / shards  # foreach AdamW: one more parameter-sized temporary
    return terms, moments


def _layers_bytes(config: TrainConfig, text, sizes: "ElementSizes", tokens: int,
                  rank: int) -> tuple[list[int], list[int]]:
    """(what each decoder layer keeps, everything of it alive at its backward's peak), in bytes."""
    cp, sdpa, kinds = config.plan.accelerator.cp_size, sdpa_method(config), layer_kinds(text)
    attention = AttentionWork(rank, cp == 1 or attention_kernel_groups_heads(config.train))
    checkpointing = layer_checkpointing(config.train.ac_mode, len(kinds))
    inner, offload = config.train.gdn_checkpoint_around_core, config.train.offload_layer_inputs
    # offloaded, a checkpointed layer's input is on the host until its backward (its peak counts it)
    kept = [0 if offload and ac == "checkpointed" else
            layer_kept_bytes(text, kind, sizes, cp, sdpa, ac, gdn_inner=inner) * tokens
            for kind, ac in zip(kinds, checkpointing)]
    peaks = [layer_peak_bytes(text, kind, sizes, cp, sdpa, ac, gdn_inner=inner, attention=attention) * tokens
             for kind, ac in zip(kinds, checkpointing)]
    return kept, peaks


def _layer_backward_moments(text, sizes: "ElementSizes", shards: int, base: float, kept: list[int],
                            peaks: list[int], layer_fsdp: list[int]) -> list[tuple[int, float]]:
    """The bytes alive at each decoder layer's backward peak, from the last layer down: `base`
    (parameters, moments, the root's gathered parameters and the head's unsharded gradient), the
    reduced gradients of the layers above, FSDP2's buffers around this layer, what the layers
    below keep, and this layer's peak; -> (layer index, bytes)."""
    kinds = layer_kinds(text)
    moments, above, below = [], 0.0, sum(kept)
    for index in reversed(range(len(kinds))):
        below -= kept[index]
        moments.append((index, base + above + layer_fsdp[index] + below + peaks[index]))
        above += layer_parameters(text, kinds[index]) * sizes.param / shards
    return moments


def sdpa_method(config: TrainConfig) -> str:
    """'ulysses' when the plan runs SDPA with Ulysses, 'head_tail' with Head-Tail, else 'all_gather'
    (AllGather and the async variants; Hybrid is counted as AllGather). All but Ulysses gather K/V."""
    for override in config.plan.active_overrides():
        method = override.method
        if method is not None and method.core == "sdpa":
            for name in ("ulysses", "head_tail"):
                if name in method.name:
                    return name
    return "all_gather"


def _loss_chunk_work(settings, sizes: ElementSizes) -> str:
    """How `linear_cross_entropy_sum` runs a chunk's elementwise work: compiled, on its Triton
    kernels (uncompiled on CUDA, below float64) or as the eager ATen sequence."""
    if settings.loss_compile_backend() is not None:
        return "compiled"
    return "triton" if uses_triton_chunk_work(settings.device, sizes.compute == 8) else "eager"


def loss_bytes(settings, text, sizes: ElementSizes, tokens: int, chunk_work: str = "eager") -> int:
    """The loss's buffers at their peak, in its backward (module doc); `chunk_work`: how the
    chunked loss's elementwise work runs (`_loss_chunk_work`)."""
    f = 8 if sizes.compute == 8 else 4  # the loss runs in float32, float64 for a float64 model
    if settings.loss == "full":
        return 3 * f * tokens * text.vocab_size
    rows, vocab, hidden = min(tokens, settings.loss_chunk_tokens), text.vocab_size, text.hidden_size
    # eager: the logits in c while their float copy is made, or the reverse; compiled: the logits
    # and their gradient in c; Triton: the gradient overwrites the logits
    second = {"eager": f, "compiled": sizes.compute, "triton": 0}[chunk_work]
    chunk = rows * vocab * (sizes.compute + second)
    weight_gradient = vocab * hidden * f
    return max(chunk + weight_gradient, vocab * hidden * (f + sizes.compute)) + tokens * hidden * sizes.compute


def root_parameters(text) -> int:
    """The parameters outside the decoder layers: embeddings, an untied head, the final norm."""
    embeddings = text.vocab_size * text.hidden_size
    return embeddings * (1 if getattr(text, "tie_word_embeddings", False) else 2) + text.hidden_size


def head_parameters(text) -> int:
    """The output head's weight (the embeddings' when tied)."""
    return text.vocab_size * text.hidden_size
