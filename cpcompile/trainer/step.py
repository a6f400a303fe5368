"""One optimizer step of a rank (`Trainer.step`): this replica's rows, `shard_batch` for this CP
rank, the summed token loss (`token_loss_sum`: chunked through the model's last hidden state, or
from its logits), `global_mean_loss` over `dp x cp`, backward, the clipped global gradient norm,
AdamW and the schedule; with `train.verify`, a step of each unrewritten copy on the whole batch."""
from __future__ import annotations

import dataclasses
import time

import torch
import torch.nn.functional as F

from ..batch import IGNORE_INDEX, global_shift_labels, shard_batch
from ..loss import global_mean_loss
from .config import TrainConfig
from .data import TokenStream
from .lm_loss import chunked_loss_inputs, chunked_loss_sum, uses_chunked_loss
from .metrics import peak_memory_gib
from .optimizer import clip_gradients
from .progress import Progress
from .sdpa_backend import only_sdpa_backend


def token_loss_sum(model, batch: dict, targets: torch.Tensor) -> torch.Tensor:
    """Sum of the next-token cross-entropies over the valid `targets` (already shifted), in
    float32 at least (float64 for a float64 model): chunked when the model has the chunked loss
    installed (`use_loss`), else from the model's logits."""
    if uses_chunked_loss(model):
        return chunked_loss_sum(model, batch, targets)
    logits = model(**{**batch, "use_cache": False}).logits
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return F.cross_entropy(logits.flatten(0, 1).to(dtype), targets.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def probe_inputs(model: torch.nn.Module, sharded: dict) -> dict:
    """What CP's probe forward calls the model with: the step's own call, so that with the
    chunked loss the probe never forms the whole logits either."""
    inputs, targets = _split_targets(sharded)
    return chunked_loss_inputs(inputs, targets) if uses_chunked_loss(model) else inputs


def _split_targets(batch: dict) -> tuple[dict, torch.Tensor]:
    """(model inputs, shifted targets) of a sharded batch: the loss is computed here, not by the model."""
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "shift_labels", "num_items_in_batch")}
    return inputs, batch["shift_labels"]


@dataclasses.dataclass
class Trainer:
    """Everything one rank built; `step(i)` runs optimizer step i (0-based)."""

    config: TrainConfig
    mesh: object
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    stream: TokenStream
    replica: int
    references: dict
    gradient_scale: int
    progress: Progress

    def step(self, index: int) -> dict:
        settings = self.config.train
        cuda = settings.device == "cuda"
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        lr = self.scheduler.get_last_lr()[0]
        self.progress.at("forward", index + 1)
        batch = self.stream.batch(index, self.replica, self.config.dp_size)
        inputs, targets = _split_targets(shard_batch(batch, self.mesh, self.config.plan))
        with only_sdpa_backend(settings.sdpa_backend):  # the backward's checkpoint replays choose as the forward did
            local_sum = token_loss_sum(self.model, inputs, targets)
            loss = global_mean_loss(local_sum, (targets != IGNORE_INDEX).sum(), self.mesh)
            self.progress.at("backward")
            (loss * self.gradient_scale).backward()
        self.progress.at("optimizer")
        grad_norm = self._clip()
        record = {"step": index + 1, "loss": loss.item(), "grad_norm": grad_norm, "lr": lr}
        for name, reference in self.references.items():
            record[f"{name}_loss"] = _reference_step(reference, batch)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        record.update(seconds=seconds, tokens_per_s=settings.batch_size * settings.seq_len / seconds,
                      peak_memory_gib=peak_memory_gib(settings.device))
        return record

    def _clip(self) -> float:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        return clip_gradients(grads, self.config.train.grad_clip)


def _reference_step(reference: tuple, batch: dict) -> float:
    """One step of an unrewritten copy on the whole batch (verify): its loss."""
    model, optimizer, scheduler = reference
    targets = global_shift_labels(batch["labels"])
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    loss = token_loss_sum(model, inputs, targets) / (targets != IGNORE_INDEX).sum().clamp_min(1)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return loss.item()
