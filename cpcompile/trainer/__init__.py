"""`cpcompile train`: a causal-LM trainer on PyTorch's own parts, one module per concern.

- `config`: the YAML (model, train, optimizer, data, checkpoint + the CP plan), field-path errors;
- `hf_config`: the `model:` section as a transformers config; transformers, imported when first needed;
- `data`: the global token stream, split over data-parallel replicas;
- `parallelize`: the model, then TP, CP rewrite, activation checkpointing, torch.compile, FSDP2 over dp_shard x cp;
- `weights`: pretrained weights from a local Hugging Face folder, each rank reading its own slices;
- `checkpoint`: DCP save / resume;
- `export`: a checkpoint as a Hugging Face folder (`cpcompile export`, `checkpoint.export`);
- `loop`: the run (`train`): build, resume, the steps, checkpoints; `step`: one optimizer step;
  `optimizer`: AdamW, its schedule, gradient clipping; `verify`: the unrewritten copies `train.verify`
  judges each step against; `dry_run_report`: `--dry-run` (`dry_run`), the memory estimate
  (`memory`, `memory_layers`) and the ranks' imbalance (`balance`);
- `metrics`: step lines, JSONL, summary, non-finite stop, plots;
- `compare`: two configs' runs judged step by step (`cpcompile compare`).

It needs transformers: `pip install "cpcompile[train]"`. The YAML is documented in `config.py`
and docs/trainer.md.
"""
from .config import TrainConfig, TrainSettings, load_train_config
from .hf_config import model_config
from .dry_run_report import dry_run
from .loop import train

__all__ = ["TrainConfig", "TrainSettings", "load_train_config", "model_config", "train", "dry_run"]
