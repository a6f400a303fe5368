"""CP methods: what a method is, as data (`CPMethod`, returned by an inner wrapper), the one
registry of methods and model adapters (`registry.py`), and the `@inner_wrapper` marker with the
short wrapper names a plan may use (`names.py`)."""
from .method import CONTIGUOUS, HEAD_TAIL, CPMethod
from .names import (
    allow_wrapper_module, import_marked_target, inner_wrapper, is_inner_wrapper, lookup_registered,
    register_inner_wrapper, registered_names,
)
from .registry import (
    AdapterSpec, MethodSpec, core_module_kind, method_spec, methods_of_core, region_for, register_adapter,
    register_method,
)

__all__ = [
    "CONTIGUOUS", "HEAD_TAIL", "AdapterSpec", "CPMethod", "MethodSpec", "allow_wrapper_module", "core_module_kind",
    "import_marked_target", "inner_wrapper", "is_inner_wrapper", "lookup_registered", "method_spec",
    "methods_of_core", "region_for", "register_adapter", "register_inner_wrapper", "register_method",
    "registered_names",
]
