"""cpcompile's own CP methods and model adapters, registered.

Each method registers in its own pass file (`passes/sdpa/<method>.py`, `passes/gdn/<method>.py`,
`passes/local_compute.py`) and each adapter in its adapter file (`adapters/`), when the module is
imported; the SDPA wrappers (`wrappers.py`) import the SDPA methods' files and the Qwen3.5 adapter
the GDN ones. The package imports this module (`cpcompile/__init__.py`) right after the registry,
so every lookup finds the built-ins whichever cpcompile module a caller imported first, and the
registry (`methods/registry.py`) never imports the modules that register into it.
"""
from . import adapters, wrappers  # noqa: F401  (the SDPA and GDN methods, every adapter)
from .passes import local_compute  # noqa: F401  (the `local` core's method)
