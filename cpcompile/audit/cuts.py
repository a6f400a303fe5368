"""The model outside its CP regions, checked by cutting the sequence (`cut_audit`).

Under CP each rank runs the model's code outside the regions on its own slice of the sequence.
That is exact only if this code computes each token from that token's own inputs: then running it
on a cut of the batch gives the same cut of every value it hands to the regions and of the model's
outputs. Code that numbers positions from the local length (`arange(seq_len)` in a model called
without positions), shifts the tokens (`roll(tokens, -1)` before a multi-token-prediction head) or
mixes positions in a module's own code (a cumulative sum in a decoder layer's forward) does not:
each rank would compute on its own slice alone, silently wrong.

So `compile` runs the model (no gradients, eval mode, a forked random stream) on the first
`WINDOW` tokens of the example, then on that window's first half and on its second half, each cut
from the example's sequence-carrying inputs (`audit/tokens.py`: axes of the local length). The
attention cores answer with zeros, as in the probe; each region, and each rotary module that
`compile` makes step-global (`rope.py`), hands the cut runs the same cut of the outputs it gave
the whole window: what happens inside them is the rewrite's business. Compared with the whole
window's run, cut to the same tokens:

- every input of every region call that the region's traced graph reads (transformers'
  `cache_position`, which a region without a cache never reads, may number tokens locally);
- every output of the model along the sequence (a loss, with no token axis, is not compared).

A difference is refused with `CoverageError`, naming the value, the module whose own code made
it (the innermost call whose inputs still matched) and the ops of that code whose results
differ, each with its source line. The second half catches reads of the local length and looks
back; the first half catches looks ahead.

What it cannot see: paths the example does not take (a branch on a length longer than the window,
on values the window lacks); dropout (the runs are in eval mode); a difference smaller than
`TOLERANCE` of the value's largest entry. The regions' own code is audited by `local_length.py`.
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..capture import call_model, cores_answered_with_zeros, forked_rng
from ..errors import CoverageError, CPInputError, UnsupportedError
from ..meta_params import is_fake, stand_ins_while_called
from ..region import RANK_LOCAL_KWARGS
from .cut_blame import Call, OpRecorder, Run, describe_call, differing_ops, innermost_matching_caller, origin_of_outputs
from .cut_values import Cut, aligned, cut_example, kept_leaves, readable, same_cut
from .tokens import TokenBatch

WINDOW = 16  # tokens of the example the audit runs on: the verdict is about code, not length


@dataclass
class Finding:
    what: str
    cut: Cut
    culprit: str
    ops: list[str]

    def describe(self) -> str:
        ops = f"; its ops whose results differ: {'; '.join(self.ops)}" if self.ops else ""
        return (f"{self.what} differs when the model runs on {self.cut.describe()} from the same tokens of the "
                f"whole window, made by the code of {self.culprit}{ops}")


def cut_audit(model: nn.Module, example: Any, tokens: TokenBatch | None, regions: dict[str, dict[str, bool]],
              handled: set[str], kept_state) -> int:
    """Refuse (`CoverageError`) a model whose code outside the regions does not commute with cutting
    the sequence (module docstring). `regions`: each region's FQN -> which inputs (by path) its traced
    graph reads; `handled`: other modules whose outputs cpcompile makes global (step-global rotary);
    `kept_state`: a context manager restoring their state. Returns the values compared."""
    if tokens is None:
        raise CPInputError("no attention core ran in the probe forward on the example, so the audits of the code "
                           "outside the CP regions cannot tell the local sequence; compile with an example batch "
                           "that runs the model's attention")
    length = min(tokens.length, WINDOW)
    half = length // 2
    whole, first, second = Cut(0, length, length), Cut(0, length - half, length), Cut(half, length, length)
    auditor = CutAuditor(model, example, tokens, regions, set(regions) | handled, kept_state)
    reference = auditor.run(whole)
    compared = 0
    for cut in (second, first):
        part = auditor.run(cut, reference)
        found, count = auditor.first_difference(reference, part, cut)
        compared += count
        if found is not None:
            raise CoverageError(
                f"the model's code outside the CP regions is not the same on a cut of the sequence: "
                f"{auditor.explain(found, reference, part, cut).describe()}. Under CP each rank would run it on its "
                "own slice alone (silently wrong): pass the tokens' global positions (cpcompile.shard_batch gives "
                "them) where the model numbers them itself, and give a module that shifts or mixes the sequence a "
                "CP method in the plan, or remove it")
    return compared


class CutAuditor:
    """The runs of one audit and what they are compared by."""

    def __init__(self, model, example, tokens: TokenBatch, regions: dict[str, dict[str, bool]], handled: set[str],
                 kept_state):
        self.model, self.example, self.tokens = model, example, tokens
        self.regions, self.handled, self.kept_state = regions, handled, kept_state
        self.names = {module: fqn for fqn, module in model.named_modules()}
        # modules inside a region or a step-global rotary: what they do is not this audit's to watch
        self.inside = {fqn for fqn in self.names.values() if any(fqn.startswith(h + ".") for h in handled)}

    def run(self, cut: Cut, reference: Run | None = None, watch: tuple[str, int] | None = None) -> Run:
        """The model on `cut` of the example; a cut run takes the handled modules' outputs from
        `reference`; `watch` records the ops that call's own code runs."""
        run, stack, counts = Run(), [], {}
        recorder = OpRecorder(run, stack, watch)

        def before(module, args, kwargs):
            fqn = self.names[module]
            if fqn in self.inside:
                return
            index = counts.get(fqn, 0)
            counts[fqn] = index + 1
            call = Call(fqn, index, stack[-1] if stack else None, fqn in self.handled, kept_leaves((args, kwargs)))
            stack.append(run.add(call))

        def after(module, _args, _kwargs, output):
            if self.names[module] in self.inside:
                return None
            call = run.calls[stack.pop()]
            if call.handled and reference is not None:
                output = handed_cut(reference.find(call.fqn, call.index), output, cut, self.tokens.batch)
            call.outputs = [leaf for _, leaf in kept_leaves(output)]
            return output

        window = cut_example(self.example, self.tokens, cut)
        with ExitStack() as stack_of:
            for enter in (forked_rng(), torch.no_grad(), evaluating(self.model), autocast_off(self.example, self.model),
                          self.kept_state(), cores_answered_with_zeros(self.model),
                          stand_ins_while_called(self.model), recorder):
                stack_of.enter_context(enter)
            for module in self.names:
                stack_of.callback(module.register_forward_pre_hook(before, with_kwargs=True).remove)
                stack_of.callback(module.register_forward_hook(after, with_kwargs=True, always_call=True).remove)
            try:
                output = call_model(self.model, window)
            except (CoverageError, CPInputError, UnsupportedError):
                raise
            except Exception as exc:
                raise CPInputError(
                    f"the audit of the code outside the CP regions runs the model on {cut.describe()} and it failed "
                    f"there ({type(exc).__name__}: {exc}); compile with an example whose sequence-carrying inputs "
                    f"have the local length {self.tokens.length} on an axis after the batch axis, and no other input "
                    "sized by it") from exc
        run.outputs = kept_leaves(output)
        if any(is_fake(leaf) for _, leaf in run.outputs):
            raise UnsupportedError("the model's output is computed from parameters on the meta device outside any "
                                   "module's own call (a module reading another's parameters), so the audit of the "
                                   "code outside the CP regions cannot run it; compile the model with real parameters")
        return run

    def first_difference(self, reference: Run, part: Run, cut: Cut) -> tuple[tuple | None, int]:
        """The first value that differs, in call order: ('region', call position, input path) or
        ('output', path); and how many values were compared."""
        compared = 0
        batch = self.tokens.batch
        for position, call in enumerate(part.calls):
            if not call.handled:
                continue
            whole = reference.find(call.fqn, call.index)
            if whole is None or len(whole.inputs) != len(call.inputs):
                return ("calls", position, ""), compared
            reads = self.regions.get(call.fqn, {})  # a step-global rotary: every input counts
            for (path, theirs), (_, ours) in zip(whole.inputs, call.inputs):
                if isinstance(theirs, torch.Tensor) and not reads.get(path, True):
                    continue  # the region never reads it: it may count locally (transformers' cache_position)
                if readable(path) in RANK_LOCAL_KWARGS and (theirs is None) != (ours is None):
                    continue  # a mask or None, by whether the cut holds padding: each rank's call may differ so
                compared += 1
                if not same_cut(theirs, ours, cut, batch):
                    return ("region", position, path), compared
        for (path, theirs), (_, ours) in zip(reference.outputs, part.outputs):
            if isinstance(theirs, torch.Tensor) and isinstance(ours, torch.Tensor) and theirs.shape != ours.shape:
                compared += 1
                if not same_cut(theirs, ours, cut, batch):
                    return ("output", path), compared
        return None, compared

    def explain(self, found: tuple, reference: Run, part: Run, cut: Cut) -> Finding:
        batch = self.tokens.batch
        if found[0] == "calls":
            call = part.calls[found[1]]
            return Finding(f"the number of calls of region {call.fqn}", cut, describe_call(call), [])
        if found[0] == "region":
            call = part.calls[found[1]]
            kind = "region" if call.fqn in self.regions else "module"
            what = f"input {readable(found[2])} of {kind} {call.fqn} (call {call.index})"
            culprit = innermost_matching_caller(reference, part, call.parent, cut, batch)
        else:
            what = f"the model's output {found[1] or '<output>'}"
            culprit = origin_of_outputs(reference, part, cut, batch)
        watched = part.calls[culprit]
        watch = (watched.fqn, watched.index)
        ops = differing_ops(self.run(Cut(0, cut.length, cut.length), watch=watch),
                            self.run(cut, reference, watch=watch), cut, batch)
        return Finding(what, cut, describe_call(watched), ops)


def handed_cut(whole: Call | None, output: Any, cut: Cut, batch: int) -> Any:
    """A handled module's output in a cut run: the same cut of its output in the whole run."""
    leaves, spec = pytree.tree_flatten(output)
    if whole is None or len(whole.outputs) != len(leaves):
        return output
    handed = []
    for theirs, ours in zip(whole.outputs, leaves):
        cut_value = aligned(theirs, ours.shape, cut, batch) if isinstance(ours, torch.Tensor) and \
            isinstance(theirs, torch.Tensor) else None
        handed.append(cut_value.contiguous() if cut_value is not None else ours)
    return pytree.tree_unflatten(handed, spec)


@contextmanager
def autocast_off(example: Any, model: nn.Module):
    """The runs at the precision of the model's own tensors, out of any autocast the caller's step holds
    or the model's forward enters itself: at bf16 the window and its halves would round differently
    (matmuls of another length tile otherwise), which the float32 `TOLERANCE` would read as code
    mixing positions. The verdict is about code, not precision. accelerate's mixed precision (a Hugging
    Face Trainer with `bf16=True`) replaces the instance's `forward` by one inside `torch.autocast` and
    keeps the original as `_original_forward`: the runs call that one."""
    devices = {leaf.device.type for leaf in pytree.tree_leaves(example) if isinstance(leaf, torch.Tensor)}
    wrapped = "forward" in vars(model) and callable(getattr(model, "_original_forward", None))
    if wrapped:
        patched, model.forward = model.forward, model._original_forward
    try:
        with ExitStack() as stack:
            for device in sorted(devices - {"meta"}):
                stack.enter_context(torch.autocast(device, enabled=False))
            yield
    finally:
        if wrapped:
            model.forward = patched


@contextmanager
def evaluating(model: nn.Module):
    """Eval mode while inside (no dropout: the cut runs must draw alike); each module's mode restored."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training
