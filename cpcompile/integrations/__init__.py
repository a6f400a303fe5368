"""cpcompile inside other people's training loops.

`cpcompile.integrations.transformers.context_parallel(trainer, plan=...)`: CP for a Hugging Face
`Trainer` (or any subclass: TRL's `SFTTrainer`) launched by `torchrun`; docs/hf_trainer.md.
Nothing here is imported by `import cpcompile`: transformers and accelerate stay optional.
"""
