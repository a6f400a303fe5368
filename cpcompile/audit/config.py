"""The model features that need CP rules of their own, read at `compile`, and how each was handled.

Each feature below is silently wrong under CP unless handled, and what cpcompile does about it is
spread over several modules; the dump names them in one place (`summary.json`'s `model.hazards`,
the head of `summary.txt`), so a run says which rules applied to its model:

- RoPE types (`rope.py`): fixed at construction (nothing to do), or chosen from the step's global
  longest position (`dynamic`, `longrope`); any other type was refused before this point;
- sliding windows and attention chunks (`passes/sdpa/fragments.py`): refused when shorter than the
  global sequence, checked at every trace, else plain causal attention;
- attention temperature tuning (Llama-4's NoPE layers): its `arange(length)` rewritten to global
  positions (`passes/local_length.py`, named in the regions' notes);
- modules outside the regions audited for mixing positions (`audit/mixers.py`), and the code outside
  the regions for numbering, shifting or mixing the local sequence (`audit/cuts.py`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import CPInputError, UnsupportedError
from ..rope import STATIC, rope_types

# why a mixture-of-experts' auxiliary loss cannot run under CP (see `refuse_router_aux_loss`)
AUX_LOSS_REASON = (
    "the MoE load-balancing loss multiplies two means over the step's tokens (the fraction routed to "
    "each expert and its mean router probability); each rank would take them over its own slice, and no "
    "sum of those products is the single process's loss")


@dataclass(frozen=True)
class Hazard:
    feature: str
    value: str
    where: str
    handling: str

    def describe(self) -> str:
        return f"{self.feature}={self.value} ({self.where}): {self.handling}"

    def as_dict(self) -> dict:
        return asdict(self)


def config_hazards(model, declared: dict, rotaries: list, mixers_audited: int, cut_values: int) -> list[Hazard]:
    """`declared`: region FQN -> its `DeclaredAttention`; `rotaries`: the call-dependent rotary modules
    (`rope.RotaryFinding`); `mixers_audited`: how many modules the mixer audit called again;
    `cut_values`: how many values the cut audit compared (audit/cuts.py)."""
    hazards = []
    step_max = {f.fqn for f in rotaries}
    for fqn, module in model.named_modules():
        for kind in rope_types(module):
            handling = ("frequencies chosen from the step's global longest position (one max all-reduce over cp "
                        "per call)" if fqn in step_max else
                        "frequencies fixed at construction: the same on every rank" if kind in STATIC else "?")
            hazards.append(Hazard("rope_type", kind, fqn or "<model>", handling))
    for fqn, attention in declared.items():
        if attention.window is not None:
            hazards.append(Hazard("sliding_window", str(attention.window), attention.window_module,
                                  "refused when shorter than the global sequence (checked at every trace), else plain "
                                  "causal attention"))
        if attention.chunk is not None:
            hazards.append(Hazard("attention_chunk_size", str(attention.chunk), attention.chunk_module,
                                  "refused when shorter than the global sequence (checked at every trace), else plain "
                                  "causal attention"))
    tuned = [fqn for fqn, module in model.named_modules()
             if getattr(module, "attn_temperature_tuning", False) is True and not getattr(module, "use_rope", True)]
    if tuned:
        hazards.append(Hazard("attn_temperature_tuning", "True", ", ".join(tuned),
                              "arange(length) rewritten to the tokens' global positions (local_length_pass; the "
                              "regions' notes)"))
    hazards.append(Hazard(
        "sequence mixers outside the regions", "none found", "<model>",
        f"{mixers_audited} outermost module(s) called again with one token changed, none moved elsewhere"))
    hazards.append(Hazard(
        "code outside the regions on a cut of the sequence", "the same", "<model>",
        f"{cut_values} region input(s) and model output(s) compared on two cuts of a window of the example "
        "(audit/cuts.py): no local numbering, shift or mixing of the sequence"))
    return hazards


def refuse_router_aux_loss(model) -> None:
    """A model configured to add its MoE auxiliary loss (`output_router_logits`) is refused at compile:
    `UnsupportedError`, the same on every rank (the configuration is)."""
    for config in (getattr(model, "config", None), getattr(getattr(model, "config", None), "text_config", None)):
        if getattr(config, "output_router_logits", False) is True:
            raise UnsupportedError(f"{type(model).__name__}: config.output_router_logits=True: {AUX_LOSS_REASON}; set "
                                   "output_router_logits=False to train under CP without the auxiliary loss")


def refuse_router_aux_loss_call(kwargs: dict) -> None:
    """The same for one call of the compiled model asking for it (`output_router_logits=True`)."""
    if kwargs.get("output_router_logits") is True:
        raise CPInputError(f"output_router_logits=True: {AUX_LOSS_REASON}; call the CP model without it")
