"""Where a model's attention cores run, found by running it once (never guessed from names).

The suggestion needs what `compile` will need: every module whose forward calls SDPA, and every
GDN layer, with the facts a method's choice depends on (heads, causality, a declared window).
The model runs once on a short batch with its cores answered by zeros (`cores_answered_with_zeros`),
on stand-in parameters when it was built on the meta device (`meta_params.fake_parameters`), so a
large model costs nothing to look at.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..adapters.qwen3_5 import is_gdn_layer
from ..adapters.sdpa import declared_window
from ..capture import call_model, cores_answered_with_zeros, forked_rng, module_stack_hooks
from ..errors import CPInputError
from ..meta_params import fake_parameters, has_meta_parameters

SDPA, GDN = "sdpa", "gdn"
PROBE_TOKENS = 16


@dataclass(frozen=True)
class CoreSite:
    """One module that holds an attention core: the innermost module around an SDPA call, or a
    GDN layer. `q_heads`/`kv_heads`: query and key heads as the core sees them (GDN: value and
    key heads); `window`: a sliding window the module declares."""

    kind: str
    fqn: str
    class_name: str
    q_heads: int
    kv_heads: int
    head_dim: int
    causal: bool = True
    window: int | None = None
    conv_halo: int = 0  # GDN: the tokens its short convolution reads before each token

    @property
    def name(self) -> str:
        """The fqn's last part (`self_attn`): what a plan's `*.<name>` pattern matches."""
        return self.fqn.rsplit(".", 1)[-1]


def find_core_sites(model: nn.Module, example: Any = None) -> list[CoreSite]:
    """Every module of `model` that holds an attention core, in call order, each once."""
    example = example if example is not None else probe_example(model)
    modules = dict(model.named_modules())
    stack: list[str] = []
    found: dict[str, CoreSite] = {}
    params = fake_parameters(model, torch.device("cpu")) if has_meta_parameters(model) else contextlib.nullcontext()
    with forked_rng(), torch.no_grad(), params, module_stack_hooks(model, stack, []), cores_answered_with_zeros(model), \
            _SdpaCalls(stack, modules, found):
        for fqn, module in modules.items():
            if is_gdn_layer(module):
                found.setdefault(fqn, _gdn_site(fqn, module))
        call_model(model, example)
    return sorted(found.values(), key=lambda site: list(modules).index(site.fqn))


def probe_example(model: nn.Module) -> dict:
    """A Hugging Face model's short batch of token ids and positions, on the CPU."""
    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    if embeddings is None:
        raise CPInputError("suggest_plan: pass example= (one short batch the model takes): only a Hugging Face "
                           "model's batch can be made for it")
    ids = torch.randint(0, embeddings.num_embeddings, (1, PROBE_TOKENS), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "position_ids": torch.arange(PROBE_TOKENS)[None], "use_cache": False}


def _gdn_site(fqn: str, module: nn.Module) -> CoreSite:
    return CoreSite(GDN, fqn, type(module).__name__, module.num_v_heads, module.num_k_heads, module.head_v_dim,
                    conv_halo=module.conv_kernel_size - 1)


class _SdpaCalls(TorchFunctionMode):
    """Records, for each SDPA call, the innermost module around it and the call's heads and causality
    (the call itself then goes on to the zeros of `cores_answered_with_zeros`)."""

    def __init__(self, stack: list[str], modules: dict[str, nn.Module], found: dict[str, CoreSite]):
        super().__init__()
        self.stack, self.modules, self.found = stack, modules, found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self._record(*_sdpa_arguments(args, kwargs))
        return func(*args, **kwargs)

    def _record(self, query: torch.Tensor, key: torch.Tensor, causal: bool) -> None:
        fqn = self.stack[-1] if self.stack else ""
        module = self.modules[fqn]
        causal = causal or getattr(module, "is_causal", False) is True
        site = CoreSite(SDPA, fqn, type(module).__name__, query.shape[1], key.shape[1], query.shape[-1], causal,
                        declared_window(module))
        self.found.setdefault(fqn, site)


def _sdpa_arguments(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(query, key, causal) of an SDPA call. Causal by the call's `is_causal`; where transformers
    passes the causal mask itself (`_record` then reads the module's own `is_causal`)."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    bound = {**dict(zip(names, args)), **kwargs}
    return bound["query"], bound["key"], bool(bound.get("is_causal"))
