"""Cross-entropy of a linear head without its logits: `sum_t CE(hidden_t @ weight.T, target_t)`
computed a chunk of tokens at a time, so that at most one chunk's `[chunk, vocab]` logits exist.

A language model's logits are the largest tensor of a training step at long context: tokens x
vocabulary (151 936 for Qwen) in the compute dtype, again in float32 for the loss, and their
gradient. `linear_cross_entropy_sum` never forms them whole:

- forward, per chunk of valid tokens: the chunk's logits, their log-sum-exp and the target's
  logit; what it keeps for the backward is the log-sum-exp (one float a token), nothing of size
  vocab;
- backward, per chunk: the logits again, the softmax from the kept log-sum-exp, minus the target's
  one-hot, times the incoming gradient: the chunk's logit gradient, which gives the chunk's rows of
  `grad_hidden` and is added into `grad_weight` (accumulated in float32 at least).

Why a custom `autograd.Function` and not `torch.utils.checkpoint` around each chunk's
`F.cross_entropy`: the checkpoint's recompute runs the whole forward again (matmul and
log-sum-exp) and then autograd's backward keeps `log_softmax`'s output and the float32 logit
gradient alive beside the logits: about two more `[chunk, vocab]` float32 buffers and one more
reduction over them per chunk. Here the backward recomputes only the matmul and turns the logits
into their gradient in place. Computing the gradients already in the forward (and only scaling
them in the backward) would save that one recomputed matmul, but would keep a float32
`[vocab, hidden]` weight gradient alive through the whole backward of the model; the recompute
keeps nothing of size vocab.

Rows whose target is `ignore_index` (-100) are skipped before chunking: they cost nothing and
chunks hold valid tokens only. Numbers: the logits are computed in the inputs' dtype and the loss
in float32 (float64 for float64 inputs), as `F.cross_entropy(logits.float(), ...)` of the whole
logits would be; only the summation order differs.

Not a `torch.library` custom op: the loss itself is never traced by Dynamo. With `compile_backend`
(the trainer passes its layers' backend), the per-chunk elementwise work is two small functions
compiled with that backend instead of the in-place ATen sequence: the log-sum-exp with the
target's logit, and the logit gradient. Inductor makes each one pass over the chunk's logits in
the matmul's dtype, in float32 registers, with no float32 copy: on an H200 at 32K tokens the eager
sequence (cast, max, subtract, exp, sum; again in the backward, then the one-hot, the scale and
the cast back) took about a tenth of the training step
(benchmarks/results/trainer_profile_2026-12-03_NVIDIA-H200.md). Without `compile_backend` on CUDA the
same two passes run as Triton kernels (`kernels/loss/triton_chunk.py`), so eager layers get them too;
float64 and the CPU keep the ATen sequence.
"""
from __future__ import annotations

import functools

import torch

IGNORE_INDEX = -100


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                             chunk_tokens: int, softcap: float | None = None,
                             compile_backend: str | None = None) -> torch.Tensor:
    """`F.cross_entropy(hidden @ weight.T, targets, ignore_index=-100, reduction="sum")` over
    `hidden [tokens, dim]`, `weight [vocab, dim]`, `targets [tokens]`, in chunks of at most
    `chunk_tokens` valid tokens; with `softcap`, the logits are `softcap * tanh(logits / softcap)`
    first (Gemma's final logit soft-capping). A scalar in float32 (float64 for float64 inputs);
    0 with a zero gradient when no target is valid. `compile_backend`: a `torch.compile` backend
    for each chunk's elementwise work (module doc), None for eager in-place ATen ops."""
    _check_inputs(hidden, weight, targets, chunk_tokens, softcap)
    if compile_backend is not None and not _is_compile_backend(compile_backend):
        raise ValueError(f"linear_cross_entropy_sum: compile_backend {compile_backend!r} is not a torch.compile "
                         "backend (torch.compiler.list_backends(exclude_tags=()))")
    return _LinearCrossEntropySum.apply(hidden, weight, targets, chunk_tokens, softcap, compile_backend)


def _check_inputs(hidden, weight, targets, chunk_tokens, softcap) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy_sum: hidden [tokens, dim] and weight [vocab, dim] must share dim, "
                         f"got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"linear_cross_entropy_sum: targets must be [tokens] = {tuple(hidden.shape[:1])}, "
                         f"got {tuple(targets.shape)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"linear_cross_entropy_sum: hidden is {hidden.dtype} but weight is {weight.dtype}: the "
                         "head's matmul needs one dtype")
    if type(chunk_tokens) is not int or chunk_tokens < 1:
        raise ValueError(f"linear_cross_entropy_sum: chunk_tokens must be a positive integer, got {chunk_tokens!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"linear_cross_entropy_sum: softcap must be positive or None, got {softcap!r}")


def loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the loss is taken in: float32 at least, float64 for float64 logits."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def valid_rows(targets: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices of the rows with a target, those targets); a target outside [0, vocab) other than
    -100 is a `ValueError` naming it (a gather would fail obscurely, or on CUDA asynchronously)."""
    rows = (targets != IGNORE_INDEX).nonzero().squeeze(1)
    chosen = targets.index_select(0, rows)
    if chosen.numel():
        low, high = torch.aminmax(chosen)
        low, high = int(low), int(high)
        if low < 0 or high >= vocab:
            bad = low if low < 0 else high
            raise ValueError(f"linear_cross_entropy_sum: target {bad} is outside the vocabulary [0, {vocab}) and "
                             f"is not the ignore index {IGNORE_INDEX}")
    return rows, chosen


def uses_triton_chunk_work(device_type: str, float64: bool) -> bool:
    """Uncompiled chunk work on CUDA runs the Triton kernels (`kernels/loss/`); float64 and the CPU
    keep the ATen sequence (also what the trainer's memory estimate counts)."""
    return device_type == "cuda" and not float64


def _uses_triton(hidden: torch.Tensor) -> bool:
    return uses_triton_chunk_work(hidden.device.type, hidden.dtype == torch.float64)


def triton_chunk():
    """The kernels' module, imported at first use (importing cpcompile never imports triton)."""
    from .kernels.loss import triton_chunk as module

    return module


@functools.cache
def _is_compile_backend(name: str) -> bool:
    """Asked once a name, not every step (the loss is called each step with the same backend)."""
    return name in torch.compiler.list_backends(exclude_tags=())


def _head_logits(hidden, weight, rows):
    """The chunk's logits as the head's matmul gives them, in the inputs' dtype."""
    return torch.mm(hidden.index_select(0, rows), weight.t())


def _chunk_logits(hidden, weight, rows, dtype, softcap):
    """The chunk's logits in the loss dtype (soft-capped), and with a soft-cap the tanh it went
    through (its derivative is needed by the backward), else None."""
    logits = _head_logits(hidden, weight, rows).to(dtype)
    if softcap is None:
        return logits, None
    squashed = logits.div_(softcap).tanh_()
    return squashed * softcap, squashed


class _LinearCrossEntropySum(torch.autograd.Function):

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_tokens, softcap, compile_backend):
        dtype = loss_dtype(hidden.dtype)
        rows, chosen = valid_rows(targets, weight.shape[0])
        log_sum_exp = torch.empty(rows.numel(), dtype=dtype, device=hidden.device)
        total = torch.zeros((), dtype=dtype, device=hidden.device)
        for start in range(0, rows.numel(), chunk_tokens):
            part = slice(start, start + chunk_tokens)
            if compile_backend is None and _uses_triton(hidden):
                logits = _head_logits(hidden, weight, rows[part])
                log_sum_exp[part], target_logits = triton_chunk().loss_terms(logits, chosen[part], softcap)
            elif compile_backend is None:
                logits = _chunk_logits(hidden, weight, rows[part], dtype, softcap)[0]
                target_logits = logits.gather(1, chosen[part].unsqueeze(1)).squeeze(1)
                log_sum_exp[part] = _log_sum_exp_in_place(logits)
            else:
                logits = _head_logits(hidden, weight, rows[part])
                log_sum_exp[part], target_logits = _compiled(_fused_loss_terms, compile_backend)(
                    logits, chosen[part], softcap)
            total += (log_sum_exp[part] - target_logits).sum()
            del logits
        ctx.save_for_backward(hidden, weight, rows, chosen, log_sum_exp)
        ctx.chunk_tokens, ctx.softcap, ctx.compile_backend = chunk_tokens, softcap, compile_backend
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, rows, chosen, log_sum_exp = ctx.saved_tensors
        scale = grad_total.to(log_sum_exp.dtype)
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        # float32 at least: a bfloat16 sum over chunks would round each chunk's share away
        grad_weight = torch.zeros_like(weight, dtype=loss_dtype(weight.dtype)) if ctx.needs_input_grad[1] else None
        for start in range(0, rows.numel(), ctx.chunk_tokens):
            part = slice(start, start + ctx.chunk_tokens)
            if ctx.compile_backend is None and _uses_triton(hidden):
                grad_logits = triton_chunk().logit_gradient_(_head_logits(hidden, weight, rows[part]), chosen[part],
                                                             log_sum_exp[part], scale, ctx.softcap)
            elif ctx.compile_backend is None:
                grad_logits = _chunk_logit_gradient(hidden, weight, rows[part], chosen[part], log_sum_exp[part],
                                                    scale, ctx.softcap).to(hidden.dtype)
            else:
                logits = _head_logits(hidden, weight, rows[part])
                grad_logits = _compiled(_fused_logit_gradient, ctx.compile_backend)(
                    logits, chosen[part], log_sum_exp[part], scale, ctx.softcap)
                del logits
            if grad_hidden is not None:
                grad_hidden.index_copy_(0, rows[part], torch.mm(grad_logits, weight))
            if grad_weight is not None:
                _add_product(grad_weight, grad_logits.t(), hidden.index_select(0, rows[part]))
            del grad_logits
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def _log_sum_exp_in_place(logits: torch.Tensor) -> torch.Tensor:
    """Each row's log-sum-exp, overwriting `logits` (torch.logsumexp would allocate another
    `[chunk, vocab]` buffer for the shifted exponentials)."""
    largest = logits.amax(dim=1, keepdim=True)
    return logits.sub_(largest).exp_().sum(dim=1).log_().add_(largest.squeeze(1))


def _add_product(into: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """`into += a @ b`, without a temporary when the dtypes agree."""
    if into.dtype == a.dtype:
        into.addmm_(a, b)
    else:
        into.add_(torch.mm(a, b))


def _chunk_logit_gradient(hidden, weight, rows, chosen, log_sum_exp, grad_total, softcap) -> torch.Tensor:
    """d(sum of the chunk's losses)/d(logits) x grad_total, in the loss dtype, built in place in the
    recomputed logits' buffer: softmax - one-hot (times the soft-cap's derivative 1 - tanh^2)."""
    logits, squashed = _chunk_logits(hidden, weight, rows, log_sum_exp.dtype, softcap)
    grad = logits.sub_(log_sum_exp.unsqueeze(1)).exp_()
    grad[torch.arange(rows.numel(), device=grad.device), chosen] -= 1
    if squashed is not None:
        grad.mul_(1 - squashed.square_())
    return grad.mul_(grad_total)


# ------------------------------------------------------------ the compiled chunk work (compile_backend)


@functools.cache
def _compiled(fn, backend: str):
    """`fn` compiled with `backend`, once a process. Dynamo guards on shapes, dtypes and the
    soft-cap: a run compiles each function once for full chunks and once more for the shorter last
    one (whose length it then takes as dynamic). Not `fullgraph`: a process that runs past Dynamo's
    recompile limit (8 variants a function: many dtypes and soft-caps, as the test suite does) runs
    the same function eagerly, with Dynamo's warning, where `fullgraph` would raise. That both
    compile as one graph is tested (tests/train/test_linear_cross_entropy.py)."""
    return torch.compile(fn, backend=backend)


def _capped(logits: torch.Tensor, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunk's logits in the loss dtype, soft-capped, and the tanh they went through (None
    without a soft-cap), out of place: compiled, nothing here is stored."""
    logits = logits.to(loss_dtype(logits.dtype))
    if softcap is None:
        return logits, None
    squashed = torch.tanh(logits / softcap)
    return squashed * softcap, squashed


def _fused_loss_terms(logits: torch.Tensor, chosen: torch.Tensor, softcap: float | None):
    """(each row's log-sum-exp, the target's logit) of a chunk's logits in the matmul's dtype."""
    capped, _ = _capped(logits, softcap)
    return torch.logsumexp(capped, dim=1), capped.gather(1, chosen.unsqueeze(1)).squeeze(1)


def _fused_logit_gradient(logits: torch.Tensor, chosen: torch.Tensor, log_sum_exp: torch.Tensor,
                          grad_total: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """`_chunk_logit_gradient` out of place, in the logits' dtype: (softmax - one-hot) x the
    soft-cap's derivative x grad_total, computed in the loss dtype."""
    capped, squashed = _capped(logits, softcap)
    grad = torch.exp(capped - log_sum_exp.unsqueeze(1))
    columns = torch.arange(grad.shape[1], device=grad.device)
    grad = torch.where(columns == chosen.unsqueeze(1), grad - 1, grad)
    if squashed is not None:
        grad = grad * (1 - squashed * squashed)
    return (grad * grad_total).to(logits.dtype)
