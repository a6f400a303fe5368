"""The model's transformers config: the `model:` section read by transformers (`model_config`), and
transformers itself, imported when a model is first asked for (`transformers_module`: the trainer's
extra, named when it is missing). The trainer's config, its tokenizers, model building and export
read both from here."""
from __future__ import annotations

import dataclasses
import difflib
import inspect

from ..errors import MissingDependencyError, PlanError, short_repr


def transformers_module():
    """transformers, or a `MissingDependencyError` naming the extra that installs it."""
    try:
        import transformers
    except ImportError as exc:
        raise MissingDependencyError(
            f"cpcompile train and bench build Hugging Face models and need transformers, which cannot be "
            f"imported ({exc}): pip install \"cpcompile[train]\""
        ) from exc
    return transformers


def model_config(raw: dict):
    """The transformers config `model:` describes: `AutoConfig.for_model(model_type, **rest)`, or
    the config.json of the local folder `path` (never the hub; `weights` is not a config key).

    A `PlanError` naming the key for a model type transformers does not know, and for a key its
    config class does not have: transformers keeps such a key as a stray attribute that no model
    reads, so a misspelt `hidden_sise` would silently train the default size. Keys transformers
    still converts (e.g. `rope_theta` into `rope_parameters`) are not kept, and pass."""
    transformers = transformers_module()
    if "path" in raw:
        try:
            return transformers.AutoConfig.from_pretrained(raw["path"], local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise PlanError("model.path", f"transformers cannot read its config.json: {exc}") from exc
    kwargs = dict(raw)
    model_type = kwargs.pop("model_type")
    if model_type not in transformers.CONFIG_MAPPING:
        raise PlanError("model.model_type", f"{short_repr(model_type)} is not a model type transformers "
                                            f"{transformers.__version__} knows")
    config_class = transformers.CONFIG_MAPPING[model_type]
    try:
        config = config_class(**kwargs)
    except (TypeError, ValueError) as exc:
        raise PlanError("model", f"transformers refused this {config_class.__name__}: {exc}") from exc
    known = _config_keys(config_class)
    for key in kwargs:
        if key not in known and key in vars(config):
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise PlanError(f"model.{key}", f"{config_class.__name__} ({model_type}) has no such key, so no "
                                            f"model would read it{hint}")
    return config


def _config_keys(config_class) -> set[str]:
    """Every key a transformers config class declares: its fields (dataclass configs), the
    parameters of its and its bases' `__init__`, and its attribute aliases."""
    keys = set(getattr(config_class, "attribute_map", {}))
    if dataclasses.is_dataclass(config_class):
        keys |= {f.name for f in dataclasses.fields(config_class)}
    for klass in config_class.__mro__:
        if "__init__" in vars(klass):
            keys |= set(inspect.signature(klass.__init__).parameters)
    return keys
