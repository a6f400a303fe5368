"""Build the model and parallelize it, in this order: tensor parallelism, CP rewrite,
activation checkpointing, `torch.compile`, input offload, FSDP2 (`parallelize_model` owns it).

- **TP** (`tp_size > 1`, SDPA models): PyTorch's own `parallelize_module` over the `tp`
  dimension of the cpcompile mesh, Megatron style: `ColwiseParallel` on q/k/v and the MLP's
  gate/up, `RowwiseParallel` on o and down (their default layouts, the ones a CP region can
  trace: cpcompile/tp.py). It comes first, as `cpcompile.compile` requires. The config requires
  cp_size > 1 with it, so that every attention is a rewritten CP region (coverage): a plain
  replicated parameter applied to the local heads (Qwen3's q_norm, k_norm) gets its full
  gradient only there.
- **CP** (`cpcompile.compile`): the plan's regions are rewritten in place on the full,
  unsharded model, from a probe forward on the first batch (with pretrained weights the model's
  parameters are still on the meta device: compile probes and traces it with fake ones).
  Each rewritten region reads its parameters from the live module at call time, so FSDP2 may
  shard them afterwards.
- **GDN layers outside CP** (`use_cpcompile_gdn`, `train.gdn_backend`): run by cpcompile's statement
  of the layer, as the rewritten ones are; before checkpointing, which wraps what they became.
- **Activation checkpointing** (activation_checkpointing.py): the decoder layers `train.activation_checkpointing`
  picks (all, every k-th, or all with the `selective` op policy) run under
  `torch.utils.checkpoint` (non-reentrant). The recompute replays the layer's forward, so the
  rewritten regions inside issue their forward collectives a second time (`selective`: only
  those whose outputs it does not save, none of the functional ones), during the backward,
  in the same order on every rank (every rank recomputes the same layers at the same point of
  its backward; the regions' graphs are cached per input signature, so no rank re-traces or
  re-agrees alone).
- **torch.compile** (`compile_backend`): each decoder layer's forward on its own, its
  checkpointing and CP regions inside: one compiled graph per layer, without a break
  (`cpcompile.compiled.compile_around_regions`: a new input signature runs eagerly first, so the
  regions trace it). Compiling the whole model around checkpointed layers makes the recompute
  take another graph than the forward, which `torch.utils.checkpoint` refuses.
- **Input offload** (`train.offload_layer_inputs`): the checkpointed layers' inputs wait in host
  memory for their backward, around the compiled forward (activation_checkpointing.py).
- **FSDP2** (`fully_shard`): each decoder layer, then the root, shard over the flattened
  `dp_shard x cp` mesh, replicated over `dp_replicate` (HSDP) when that is > 1. With TP, the
  FSDP mesh is cut from the same root mesh as the `tp` mesh (FSDP2 requires one parent for 2-D
  parallelism): a TP parameter becomes a DTensor sharded over (dp_shard_cp, tp), the others over
  dp_shard_cp; the tp ranks of one data slot hold the same replicated parameters and gradients.
  The loss contract (`cpcompile.loss.global_mean_loss`) gives each rank its share of the global mean, so
  gradients must be summed; FSDP2 averages them over all its ranks (a divide factor of 1 would
  need PREMUL_SUM, which gloo lacks), so the loop scales the backward by that rank count
  (`gradient_scale`).
"""
from __future__ import annotations

import types
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from ..adapters.hf_attention import route_attention_without_cp
from ..adapters.qwen3_5 import gdn_layer_forward, is_gdn_layer
from ..compiled import compile_around_regions
from ..documents import DocumentFeed
from ..errors import PlanError
from ..kernels.gdn.common import CHUNK_SIZE
from ..mesh import CPMesh
from ..pipeline import compile as cp_compile
from ..installed_region import MARKER as REWRITTEN_MARK  # set on every module whose forward CP rewrote
from . import weights
from .activation_checkpointing import EVERY_LAYER, ACMode, checkpoint_layers, offload_layer_inputs
from .config_sections import DTYPES, TrainSettings
from .hf_config import model_config, transformers_module
from .progress import Progress

if TYPE_CHECKING:
    from .config import TrainConfig


def parallelize_model(model: torch.nn.Module, mesh: CPMesh, config: "TrainConfig", example: Any,
                      progress: Progress | None = None) -> DeviceMesh:
    """Parallelize the built model in place, in the module doc's order; `example` is what the CP
    rewrite's probe forward calls the model with (the first step's inputs, `step.probe_inputs`);
    `progress` hears when the rewrite starts and ends. -> the mesh FSDP2 shards over (for
    `gradient_scale`)."""
    settings = config.train
    if config.plan.accelerator.tp_size > 1:
        apply_tensor_parallel(model, mesh)
    if progress is not None:
        progress.at("compile")
    cp_compile(model, mesh, config.plan, dump_dir=settings.dump_dir, example_inputs=example)
    if progress is not None:
        progress.at("start")
    if config.plan.cp_size == 1 and settings.sdpa_backend is None and settings.device in ("cuda", "cpu"):
        # the CP regions' attention kernels without CP: no S x S mask (adapters/hf_attention.py); a pinned
        # SDPA backend (train.sdpa_backend) keeps transformers' own SDPA call, which that setting names, and
        # devices without those kernels (npu) keep it too
        route_attention_without_cp(model, decoder_layers(model))
    routed = use_cpcompile_gdn(model, settings.gdn_backend, config.data.packing, settings.gdn_checkpoint_around_core)
    if settings.gdn_checkpoint_around_core and not routed:
        raise PlanError("train.gdn_checkpoint_around_core", f"{type(model).__name__} has no GDN layer run outside CP: "
                                                            "nothing to checkpoint around")
    apply_activation_checkpointing(model, settings.ac_mode)
    if (backend := settings.layer_compile_backend()) is not None:
        compile_layers(model, backend)
    if settings.offload_layer_inputs:
        apply_input_offload(model, settings.ac_mode, pin_memory=settings.device == "cuda")
    sharding = fsdp_mesh(mesh)
    apply_fsdp(model, sharding, settings)
    return sharding


def build_model(raw_model_config: dict, settings: TrainSettings, parameters_on_meta: bool = False) -> torch.nn.Module:
    """The same randomly initialised causal LM on every rank (seeded), SDPA attention. With
    `parameters_on_meta`, its parameters stay on the meta device (weights.py: FSDP2 shards them
    there, and the load fills the shards) and only its buffers are real."""
    transformers = transformers_module()
    config = model_config(raw_model_config)
    config._attn_implementation = "sdpa"
    torch.manual_seed(settings.seed)
    if parameters_on_meta:
        with weights.parameters_on_meta():
            model = transformers.AutoModelForCausalLM.from_config(config)
        # the buffers as the real build has them, on the device the CP rewrite's probe runs on
        model.to(dtype=DTYPES[settings.dtype])
        weights.buffers_to(model, settings.device)
        return model
    model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to(device=settings.device, dtype=DTYPES[settings.dtype])


def meta_model(raw_model_config: dict) -> torch.nn.Module:
    """The model on the meta device: its parameter names and shapes, at no cost (start-up checks)."""
    transformers = transformers_module()
    config = model_config(raw_model_config)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def use_cpcompile_gdn(model: torch.nn.Module, backend: str | None, packing: bool = False,
                      checkpoint_around_core: bool = False) -> int:
    """Route every GDN layer that CP did not rewrite through cpcompile's statement of the layer
    with the `backend` core (the same algorithm as the rewritten layers); -> how many.

    With `packing`, those layers reset their state and conv at every document start, read from the
    model call's `position_ids` (a GDN layer's own call lacks them); transformers' path (no
    `backend`) would run across documents, so it is refused here. `checkpoint_around_core`: each
    layer's ops before and after its core run under checkpoints of their own (`gdn_layer_forward`)."""
    layers = [m for m in model.modules() if is_gdn_layer(m) and not hasattr(m, REWRITTEN_MARK)]
    if packing and layers and backend is None:
        raise PlanError("train.gdn_backend", f"data.packing: {len(layers)} GDN layer(s) run outside CP, and "
                                             f"transformers' GDN path does not reset its state at document "
                                             f"starts; set gdn_backend: eager or triton")
    if backend is None:
        return 0
    documents = DocumentFeed(marked_only=False).follow(model) if packing else None

    def forward(self, hidden_states, attention_mask=None, **_):
        positions = documents.positions if documents is not None else None
        return gdn_layer_forward(self, hidden_states, attention_mask, positions, chunk_size=CHUNK_SIZE,
                                 backend=backend, checkpoint_around_core=checkpoint_around_core)

    for layer in layers:
        layer.forward = types.MethodType(forward, layer)
    return len(layers)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's stack of decoder layers (the largest `layers` ModuleList)."""
    stacks = [m for name, m in model.named_modules()
              if isinstance(m, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers"]
    if not stacks:
        raise PlanError("model", f"{type(model).__name__} has no `layers` ModuleList: the trainer wraps decoder "
                                 "layers for activation checkpointing and FSDP")
    return max(stacks, key=len)


# the Megatron-style split of a decoder layer: {child module: {its linear: TP style}}
TP_LAYOUT = {"self_attn": {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise"},
             "mlp": {"gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"}}


def apply_tensor_parallel(model: torch.nn.Module, mesh: CPMesh) -> None:
    """PyTorch TP over `mesh.root["tp"]` on every decoder layer's attention and MLP (`TP_LAYOUT`).
    A layer that does not have that shape is a `PlanError` on `accelerator.tp_size` naming it
    (GDN models are refused earlier, by the config)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    tp_size = mesh.accelerator.tp_size
    plan = {}
    layers = decoder_layers(model)
    prefix = next(name for name, m in model.named_modules() if m is layers)
    for index, layer in enumerate(layers):
        where = f"{prefix}.{index}"
        for part, linears in TP_LAYOUT.items():
            owner = getattr(layer, part, None)
            missing = [n for n in linears if not isinstance(getattr(owner, n, None), torch.nn.Linear)]
            if missing:
                raise PlanError("accelerator.tp_size", f"is {tp_size}, but {where} has no {part} with the nn.Linear "
                                                       f"{', '.join(missing)}: the trainer's tensor parallelism splits "
                                                       "q/k/v/o_proj and gate/up/down_proj (Llama / Qwen3 style)")
            plan.update({f"{where}.{part}.{name}": styles[style]() for name, style in linears.items()})
    parallelize_module(model, mesh.root["tp"], plan)


def apply_activation_checkpointing(model: torch.nn.Module, mode: ACMode = EVERY_LAYER) -> list[int]:
    """The decoder layers `mode` picks under non-reentrant `torch.utils.checkpoint` (activation_checkpointing.py);
    -> their indices."""
    return checkpoint_layers(decoder_layers(model), mode)


def apply_input_offload(model: torch.nn.Module, mode: ACMode, pin_memory: bool) -> list[int]:
    """The inputs of the decoder layers `mode` checkpoints kept in host memory until their backward
    (activation_checkpointing.py `offload_layer_inputs`; after `compile_layers`, around the compiled forward);
    -> their indices."""
    return offload_layer_inputs(decoder_layers(model), mode, pin_memory)


def compile_layers(model: torch.nn.Module, backend) -> None:
    """`torch.compile` every decoder layer's forward (after activation checkpointing, before FSDP2):
    one graph per layer, its checkpoint and CP regions included; a call of a new input signature
    runs eagerly first, so that its regions trace their graphs (`cpcompile.compiled`). The forward,
    not the module's call: FSDP2's hooks around it stay eager, outside the graph."""
    for layer in decoder_layers(model):
        layer.forward = compile_around_regions(layer.forward, backend)


def fsdp_mesh(mesh: CPMesh) -> DeviceMesh:
    """The mesh FSDP2 runs over: `dp_shard x cp` flattened from the root mesh (so that, with TP,
    it shares the tp mesh's parent, as FSDP2 requires), with `dp_replicate` in front (HSDP) when
    it is > 1 (built as its own 2-D mesh: the root is pp x dp_replicate x dp_shard x cp x tp with
    pp = tp = 1, since the config refuses HSDP + TP, so the ranks are in the same order)."""
    accelerator, options = mesh.accelerator, mesh.group_options()  # the run's collective timeout
    if accelerator.dp_replicate_size == 1:
        return mesh.root[("dp_shard", "cp")]._flatten("dp_shard_cp", backend_override=options)
    shape = (accelerator.dp_replicate_size, accelerator.dp_shard_size * accelerator.cp_size)
    names = ("dp_replicate", "dp_shard_cp")
    return init_device_mesh(mesh.device_type, shape, mesh_dim_names=names,
                            backend_override={name: options for name in names} if options is not None else None)


def apply_fsdp(model: torch.nn.Module, mesh: DeviceMesh, settings: TrainSettings) -> None:
    """`fully_shard` every decoder layer, then the root (gradients averaged: see `gradient_scale`)."""
    param_dtype, reduce_dtype = settings.precision_policy()
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    layers = decoder_layers(model)
    for index, layer in enumerate(layers):
        # the last layer's parameters are needed again at once by the backward: keep them gathered
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=index < len(layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def gradient_scale(mesh: DeviceMesh) -> int:
    """What the backward's loss is multiplied by so that FSDP2's average of the ranks' gradient
    shares is their sum: its number of ranks (every dimension of its mesh)."""
    return mesh.size()


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def rewritten_regions(model: torch.nn.Module) -> list[tuple[str, str]]:
    """(module FQN, method) of every region CP rewrote: the plan's coverage."""
    regions = []
    for name, module in model.named_modules():
        mark = getattr(module, REWRITTEN_MARK, None)
        if mark is not None:
            regions.append((name, str(mark["method"])))
    return regions


def is_rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0
