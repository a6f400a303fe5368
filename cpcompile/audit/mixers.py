"""Coverage by behaviour: find the modules outside the CP regions that mix sequence positions.

The coverage rule of `compile` knows the cores it was told about (SDPA calls, GDN layers). Any
other module whose output at one position depends on other positions — a Mamba scan, a short
convolution, a custom kernel over the sequence — would run on each rank's slice alone under CP:
silently wrong, with a loss that barely moves. So during the probe forward each *outermost*
module outside the regions (it is not in a region, holds none, and is called by a module that
holds one) is called a second time with one token of its input changed, and its output compared
with the first call's. A position-wise module (MLP, norm, rotary, embedding, MoE) changes at that
token only; a module whose output moves anywhere else mixes positions. For such a module the
audit goes down through the modules it calls, the same way, to name the innermost one that mixes;
`compile` refuses them all with one `CoverageError`.

What the audit sees: floating-point inputs laid out batch-first, `[B, S_local, ...]`, or as
flattened tokens `[B·S_local, ...]`, where `B` and `S_local` are the local batch the first attention
core sees (`audit/tokens.py`), whatever the example's inputs are named. Until that core runs, the
calls of modules before it (embeddings) are kept and audited then. Integer inputs (token and
position ids, masks) are left as they are. Outputs without a token axis (an auxiliary loss) are
not compared. Ops a module holding a region runs itself, outside any submodule, and shifts of the
token ids are not seen here: the cut audit (`audit/cuts.py`) watches those. At one local token
there is no other position to watch: `compile` refuses the example (`CPInputError`).

On a model compiled from the meta device (`meta_params.py`) the probe's hidden states are fake:
a module the audit calls runs on seeded random stand-ins for its fake inputs and its own
parameters. Whether a module mixes positions is a property of its code, which any generic
weights show; a module reading another module's parameters is refused (`UnsupportedError`).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..errors import CPInputError
from ..meta_params import is_fake, real_stand_ins, refuse_fake_output
from .tokens import TokenBatch

# A token of the output "moved" when it changed by more than this, relative to the output's largest
# entry. A position-wise module leaves the other tokens bit for bit alone (an MoE regrouping its
# tokens moves them by rounding, ~1e-7); a mixer moves its neighbours by O(1) of the perturbation.
MOVED = 1e-5
NOISE_SEED = 20240


@dataclass
class Mixer:
    """One module found mixing positions: its FQN and class, and where its output moved."""

    fqn: str
    kind: str
    moved: str

    def describe(self) -> str:
        return f"{self.fqn or '<model>'} ({self.kind})"


@dataclass
class MixerAudit:
    """The probe's hooks for the audit, and what it found: one chain of mixing modules per
    outermost mixer, outermost first."""

    regions: frozenset[str]
    names: dict[nn.Module, str]
    tokens: TokenBatch | None = None  # known once the first core ran (`set_tokens`)
    pending: list[tuple] = field(default_factory=list)  # calls ended before that, to audit then
    found: list[list[Mixer]] = field(default_factory=list)
    audited: set[str] = field(default_factory=set)
    stack: list[nn.Module] = field(default_factory=list)
    rng: dict[nn.Module, tuple] = field(default_factory=dict)
    rerunning: bool = False

    def outside(self, fqn: str) -> bool:
        """Not a region, not inside one, holding none (the model itself holds them all)."""
        if fqn == "":
            return False
        return not any(fqn == r or fqn.startswith(r + ".") or r.startswith(fqn + ".") for r in self.regions)

    def is_candidate(self, module: nn.Module) -> bool:
        fqn = self.names.get(module)
        if fqn is None or fqn in self.audited or not self.outside(fqn):
            return False
        caller = self.names.get(self.stack[-1]) if self.stack else None
        return caller is not None and not self.outside(caller)

    def set_tokens(self, tokens: TokenBatch) -> None:
        """The local batch, from the first attention core's call (the probe's recorders)."""
        if self.tokens is not None:
            return
        if tokens.length < 2:
            raise CPInputError(
                f"the example batch has {tokens.length} local token a row: the audits of the model outside the CP "
                "regions (sequence mixing, cuts of the sequence) need at least 2; compile with example_inputs of "
                "the local length the model will be trained with")
        self.tokens = tokens

    def flush(self) -> None:
        """Audit the calls that ended before the local batch was known."""
        if self.tokens is None or self.rerunning:
            return
        while self.pending:
            self.audit_call(*self.pending.pop(0))

    def before(self, module, _args, _kwargs):
        self.flush()
        if not self.rerunning and self.is_candidate(module):
            self.rng[module] = rng_state()
        self.stack.append(module)

    def after(self, module, args, kwargs, output):
        self.stack.pop()
        state = self.rng.pop(module, None)
        if state is None or self.rerunning:
            return
        self.audited.add(self.names[module])
        if self.tokens is None:
            self.pending.append((module, args, kwargs, output, state))
            return
        self.flush()
        self.audit_call(module, args, kwargs, output, state)

    def audit_call(self, module, args, kwargs, output, state) -> None:
        fqn = self.names[module]
        self.rerunning = True
        try:
            chain = audit_module(module, fqn, args, kwargs, output, state, self.tokens)
        finally:
            self.rerunning = False
        if chain:
            self.found.append(chain)

    def report(self) -> str:
        return "; ".join(" > ".join(m.describe() for m in chain) + f" (output moved {chain[-1].moved})"
                         for chain in self.found)


@contextmanager
def mixer_audit(model: nn.Module, regions: list[str]):
    """Hooks on every module of `model` that audit the outermost modules outside `regions`
    during one forward; yields the `MixerAudit`, whose `set_tokens` the probe calls at the first
    attention core. After the forward, the calls still pending are audited."""
    names = {module: fqn for fqn, module in model.named_modules()}
    audit = MixerAudit(frozenset(regions), names)
    handles = []
    for module in names:
        handles.append(module.register_forward_pre_hook(audit.before, with_kwargs=True))
        handles.append(module.register_forward_hook(audit.after, with_kwargs=True))
    try:
        yield audit
        audit.flush()
    finally:
        for handle in handles:
            handle.remove()


def rng_state() -> tuple:
    """The random state a module's call starts from, so its second call draws the same dropout."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


@contextmanager
def replayed_rng(state: tuple):
    """Run with the random state `state`, and leave the state as it was before."""
    devices = list(range(torch.cuda.device_count())) if state[1] is not None else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state_all(state[1])
        yield


def audit_module(module: nn.Module, fqn: str, args: tuple, kwargs: dict, output, state: tuple,
                 tokens: TokenBatch) -> list[Mixer]:
    """[] when `module` is position-wise on this call; else the chain of mixing modules from it to
    the innermost mixing module it calls.

    On a model whose parameters are fake (compiled from the meta device, `meta_params.py`), the
    module runs on random stand-ins for its fake inputs and parameters (only when it has a
    token input to change: an embedding, called with token ids alone, is never given values)."""
    position = tokens.length // 2  # the middle token: a mixer looking back or forward moves a neighbour
    if not any(token_axis(leaf, tokens) is not None for leaf in pytree.tree_leaves((args, kwargs))):
        return []
    with real_stand_ins(module, fqn, args, kwargs) as (args, kwargs):
        if any(is_fake(leaf) for leaf in pytree.tree_leaves(output)):  # the probe's call ran on fake parameters
            with replayed_rng(state):
                output = module(*args, **kwargs)
            refuse_fake_output(fqn, output)
        perturbed, _ = perturb(args, kwargs, tokens, position)
        with replayed_rng(state):
            moved_output = module(*perturbed[0], **perturbed[1])
        refuse_fake_output(fqn, moved_output)
        moved = moved_tokens(output, moved_output, tokens, position)
        if moved is None:
            return []
        return [Mixer(fqn, type(module).__name__, moved)] + innermost(module, fqn, args, kwargs, state, tokens)


def innermost(module: nn.Module, fqn: str, args: tuple, kwargs: dict, state: tuple,
              tokens: TokenBatch) -> list[Mixer]:
    """Call `module` again, recording the calls of the modules it calls directly; then audit those
    (hooks removed first, so that no audit runs inside another). The chain below the first of them
    that mixes ([] when none does: the mixing is in `module`'s own code)."""
    names = {m: f"{fqn}.{name}" if fqn else name for name, m in module.named_modules() if m is not module}
    stack: list[nn.Module] = []
    calls: list[tuple] = []
    starts: dict[nn.Module, tuple] = {}

    def before(child, _args, _kwargs):
        if not stack:
            starts[child] = rng_state()
        stack.append(child)

    def after(child, child_args, child_kwargs, child_output):
        stack.pop()
        if not stack and child in starts:
            calls.append((child, child_args, child_kwargs, child_output, starts.pop(child)))

    handles = [h for m in names for h in (m.register_forward_pre_hook(before, with_kwargs=True),
                                          m.register_forward_hook(after, with_kwargs=True))]
    try:
        with replayed_rng(state):
            module(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    for child, child_args, child_kwargs, child_output, start in calls:
        chain = audit_module(child, names[child], child_args, child_kwargs, child_output, start, tokens)
        if chain:
            return chain
    return []


def token_axis(leaf, tokens: TokenBatch) -> int | None:
    """The token axis of a floating-point tensor input laid out by tokens, else None: the inputs
    the audit changes."""
    return tokens.axis(leaf) if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() else None


def perturb(args: tuple, kwargs: dict, tokens: TokenBatch, position: int) -> tuple[tuple[tuple, dict], bool]:
    """The call with token `position` of row 0 changed in every floating-point input laid out by
    tokens, and whether any input was."""
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    generator = torch.Generator().manual_seed(NOISE_SEED)
    touched = False
    changed = []
    for leaf in leaves:
        axis = token_axis(leaf, tokens)
        if axis is None:
            changed.append(leaf)
            continue
        index = position if axis == 0 else (0, position)
        token = leaf[index]
        scale = leaf.detach().float().std().nan_to_num(0.0).item() + 1.0
        noise = torch.randn(token.shape, generator=generator).mul(scale).to(leaf.device, leaf.dtype)
        copy = leaf.detach().clone()
        copy[index] = token + noise
        changed.append(copy)
        touched = True
    return pytree.tree_unflatten(changed, spec), touched


def moved_tokens(before, after, tokens: TokenBatch, position: int) -> str | None:
    """Where the output moved outside token `position` of row 0 ("3 tokens after it, 0 before"),
    or None where it did not."""
    later = earlier = other_rows = 0
    for old, new in zip(pytree.tree_leaves(before), pytree.tree_leaves(after)):
        if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and old.is_floating_point()):
            continue
        axis = tokens.axis(old)
        if axis is None or old.shape != new.shape:
            continue
        scale = tokens.per_token(old).max().item()
        change = tokens.per_token(new, minus=old)
        moved = change.nan_to_num(0.0) > MOVED * max(scale, 1e-30)
        moved[0, position] = False
        later += int(moved[0, position + 1:].sum())
        earlier += int(moved[0, :position].sum())
        other_rows += int(moved[1:].sum())
    if not (later or earlier or other_rows):
        return None
    where = f"at {later} later and {earlier} earlier token(s) of the row"
    return where + (f", and at {other_rows} token(s) of other rows" if other_rows else "")
