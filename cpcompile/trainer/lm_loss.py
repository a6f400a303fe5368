"""The trainer's chunked loss (`train.loss: chunked`): a Hugging Face causal LM's token loss
without its `[tokens, vocabulary]` logits.

`use_chunked_loss(model, chunk_tokens)` checks that the model's head can be taken apart and
installs a forward on the model that, given the targets, returns this rank's loss sum: the inner
base model's last hidden state (the decoder stack and its final norm, as the model's own forward
computes it), then `linear_cross_entropy_sum` with the head's weight, a chunk of tokens at a time
(`cpcompile/linear_cross_entropy.py`). Called without targets, the model is what it was.

Why the loss runs inside the model's own call, and not as `model.model(...)` then
`model.lm_head.weight` from outside: FSDP2's `fully_shard(model)` gathers the root's parameters
(embeddings, final norm, head; one parameter when the embeddings are tied) in the root module's
forward pre-hook and lazily initialises its state there, and the CP rewrite and the GDN document
feed read the call's `position_ids` in pre-hooks on the root too. Outside the root's call the
head's weight is a sharded DTensor and those hooks never run.

What is refused (`PlanError` on `train.loss`, naming the cause; `train.loss: full` keeps the
model's logits path): a head that is not a plain `nn.Linear` without bias, and a model whose
forward does anything between its base model's last hidden state and the head's output other
than Gemma's `final_logit_softcapping` (which is applied here): logit scaling (Cohere, Granite),
bias, vocabulary slicing. That is checked, not guessed from the config, by running the model's
forward once with its base model replaced by a stub returning known hidden states.
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from ..errors import PlanError
from ..linear_cross_entropy import linear_cross_entropy_sum

TARGETS_KEYWORD = "cpcompile_loss_targets"  # the keyword the installed forward takes the targets by
MARK = "_cpcompile_chunked_loss"
# the hidden states of the head check make the largest logit this many soft-caps (or units) large,
# so that a soft-cap the model applies, or one it lacks, shows
CHECK_LOGIT_SCALE = 8.0


def use_loss(model: nn.Module, settings, compile_backend: str | None = None) -> None:
    """Install `train.loss: chunked` on a freshly built model (`full` needs nothing);
    `compile_backend`: `settings.loss_compile_backend()`, what `linear_cross_entropy_sum` compiles its
    chunk work with."""
    if settings.loss == "chunked":
        use_chunked_loss(model, settings.loss_chunk_tokens, compile_backend)


def use_chunked_loss(model: nn.Module, chunk_tokens: int, compile_backend: str | None = None) -> None:
    """Install the chunked loss on `model` (before CP, TP and FSDP2): afterwards
    `chunked_loss_sum(model, inputs, targets)` is this rank's loss sum; `compile_backend` as
    `linear_cross_entropy_sum` takes it."""
    if uses_chunked_loss(model):
        raise RuntimeError(f"use_chunked_loss: {type(model).__name__} has the chunked loss already")
    softcap = check_head_takes_chunked_loss(model)
    plain_forward = model.forward

    @functools.wraps(plain_forward)
    def forward(*args, **kwargs):
        targets = kwargs.pop(TARGETS_KEYWORD, None)
        if targets is None:
            return plain_forward(*args, **kwargs)
        if args:
            raise TypeError("the chunked loss takes the model's inputs by keyword (input_ids=..., ...)")
        return loss_sum(model, kwargs, targets, chunk_tokens, softcap, compile_backend)

    model.forward = forward
    setattr(model, MARK, chunk_tokens)


def uses_chunked_loss(model: nn.Module) -> bool:
    return hasattr(model, MARK)


def chunked_loss_sum(model: nn.Module, inputs: dict, targets: torch.Tensor) -> torch.Tensor:
    """The sum of the next-token cross-entropies over the valid `targets` (already shifted, this
    rank's shard), computed inside the model's call (so FSDP2 gathers the head), in float32 at
    least (float64 for a float64 model)."""
    if not uses_chunked_loss(model):
        raise RuntimeError("chunked_loss_sum: call use_chunked_loss(model, chunk_tokens) first")
    return model(**chunked_loss_inputs(inputs, targets))


def chunked_loss_inputs(inputs: dict, targets: torch.Tensor) -> dict:
    """The keywords a model with the chunked loss is called with to return its loss sum."""
    return {**inputs, TARGETS_KEYWORD: targets}


def check_head_takes_chunked_loss(model: nn.Module) -> float | None:
    """Refuse (`PlanError`) a model whose head the chunked loss cannot stand in for; -> its logit soft-cap."""
    softcap = logit_softcap(model)
    check_forward_only_applies_the_head(model, plain_linear_head(model), softcap)
    return softcap


def logit_softcap(model: nn.Module) -> float | None:
    return getattr(model.config.get_text_config(), "final_logit_softcapping", None)


def loss_sum(model, inputs: dict, targets, chunk_tokens: int, softcap: float | None,
             compile_backend: str | None) -> torch.Tensor:
    """This rank's loss sum from the base model's last hidden state (`inputs`: the model's keywords).
    Under autocast (a Hugging Face Trainer's `bf16=True`; the trainer itself computes in FSDP2's
    dtype, without it) the head's operands are cast as autocast would cast them for the head's
    matmul, and the loss's own kernels run outside it."""
    keep = inputs.pop("logits_to_keep", 0)
    if not (isinstance(keep, int) and keep == 0):
        raise PlanError("train.loss", f"chunked: the batch asks for logits_to_keep={keep!r}, but the loss needs every "
                                      "position's hidden state (logits_to_keep is for generation)")
    hidden = base_model(model)(**{**inputs, "use_cache": False}).last_hidden_state
    weight = model.get_output_embeddings().weight
    if hasattr(weight, "device_mesh"):
        raise RuntimeError("chunked loss: the head's weight is a DTensor (sharded): the loss must run inside the "
                           "model's own call, where FSDP2 gathers it (use chunked_loss_sum), and a tensor-parallel "
                           "head is not supported")
    hidden, device = hidden.reshape(-1, hidden.shape[-1]), hidden.device.type
    if not torch.is_autocast_enabled(device):
        return linear_cross_entropy_sum(hidden, weight, targets.reshape(-1), chunk_tokens, softcap, compile_backend)
    dtype = torch.get_autocast_dtype(device)
    with torch.autocast(device, enabled=False):
        return linear_cross_entropy_sum(hidden.to(dtype), weight.to(dtype), targets.reshape(-1), chunk_tokens,
                                        softcap, compile_backend)


def base_model(model: nn.Module) -> nn.Module:
    """The model's inner base model (decoder stack + final norm): what its forward calls first."""
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    if not isinstance(base, nn.Module) or base is model:
        raise PlanError("train.loss", f"chunked: {type(model).__name__} has no inner base model (the "
                                      f"base_model_prefix attribute) whose last hidden state feeds the head; set "
                                      "train.loss: full")
    return base


def plain_linear_head(model: nn.Module) -> nn.Linear:
    """The model's output head, when it is an `nn.Linear` (not a subclass with its own forward)
    without bias; else a `PlanError` naming what it is."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    name = type(model).__name__
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        raise PlanError("train.loss", f"chunked: {name}'s output head is {type(head).__name__}, not a plain "
                                      "torch.nn.Linear: the chunked loss multiplies the hidden states by its weight "
                                      "itself; set train.loss: full")
    if head.bias is not None:
        raise PlanError("train.loss", f"chunked: {name}'s output head has a bias, which the chunked loss does not "
                                      "add; set train.loss: full")
    return head


def check_forward_only_applies_the_head(model: nn.Module, head: nn.Linear, softcap: float | None) -> None:
    """Run the model's forward with its base model stubbed to return known hidden states, and
    refuse the model unless its logits are `hidden @ head.weight.T` (soft-capped by `softcap`):
    the chunked loss computes exactly that, so any other step (a scale, a bias, a slice) would be
    silently lost."""
    name = type(model).__name__
    with _real_head_weight(head):
        hidden = _check_hidden_states(head.weight, softcap)
        try:
            with torch.no_grad(), _base_model_replaced(model, _ReturnsHiddenStates(hidden)):
                ids = torch.zeros(hidden.shape[:2], dtype=torch.long, device=hidden.device)
                logits = type(model).forward(model, input_ids=ids, use_cache=False).logits
        except Exception as exc:  # noqa: BLE001 -- any failure means the check cannot vouch for the model
            raise PlanError("train.loss", f"chunked: could not check what {name}.forward does after its base model "
                                          f"({type(exc).__name__}: {exc}); set train.loss: full") from exc
        with torch.no_grad():
            dtype = _check_dtype(head.weight)
            expected = _capped(hidden.to(dtype) @ head.weight.detach().to(dtype).t(), softcap).double()
    if logits is None or logits.shape != expected.shape or \
            (logits.double() - expected).abs().max() > 1e-2 * expected.abs().max():
        does = f"soft-caps them at {softcap} and " if softcap is not None else ""
        raise PlanError("train.loss", f"chunked: {name}.forward does more to the last hidden state than the chunked "
                                      f"loss, which {does}multiplies them by the head's weight (e.g. it scales, "
                                      "biases or slices the logits); set train.loss: full")


@contextlib.contextmanager
def _real_head_weight(head: nn.Linear):
    """A model built on the meta device (its weights are loaded after FSDP2) has no head values to
    check with: a random stand-in of the same shape takes the weight's place for the check."""
    weight = head.weight
    if not weight.is_meta:
        yield
        return
    generator = torch.Generator().manual_seed(0)
    head.weight = nn.Parameter(torch.randn(weight.shape, generator=generator), requires_grad=False)
    try:
        yield
    finally:
        head.weight = weight


def _check_hidden_states(weight: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """`[1, 4, dim]` hidden states (from a fixed seed: the global random stream is left alone)
    scaled so that the largest logit is `CHECK_LOGIT_SCALE` soft-caps (or units) large."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 4, weight.shape[1], generator=generator, dtype=torch.float64)
    dtype = _check_dtype(weight)
    with torch.no_grad():
        largest = (hidden.to(device=weight.device, dtype=dtype) @ weight.detach().to(dtype).t()).abs().max().item()
    if largest > 0:
        hidden *= CHECK_LOGIT_SCALE * (softcap or 1.0) / largest
    return hidden.to(device=weight.device, dtype=weight.dtype)


def _check_dtype(weight: torch.Tensor) -> torch.dtype:
    """What the check multiplies by the head's weight in: its dtype, at least float32, where it is.
    Not a float64 copy: the head is vocabulary x hidden, on a model built on the meta device a
    random stand-in (`_real_head_weight`), and the check's tolerance (1e-2) needs no more."""
    return torch.promote_types(weight.dtype, torch.float32)


def _capped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


class _ReturnsHiddenStates(nn.Module):
    """Stands in for the base model in the head check: answers any call with `hidden`."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden

    def forward(self, *args, **kwargs):
        return _BaseModelOutput(self.hidden)


class _BaseModelOutput:
    """What a forward reads of its base model's output: `last_hidden_state` (also as item 0); any
    other field (the cache, all hidden states, attentions, rope deltas) is None."""

    def __init__(self, hidden: torch.Tensor):
        self.last_hidden_state = hidden

    def __getitem__(self, index):
        return (self.last_hidden_state,)[index]

    def __getattr__(self, name):  # only called for the fields not set above
        return None


@contextlib.contextmanager
def _base_model_replaced(model: nn.Module, stand_in: nn.Module):
    prefix = model.base_model_prefix
    real = base_model(model)
    setattr(model, prefix, stand_in)
    try:
        yield
    finally:
        setattr(model, prefix, real)
