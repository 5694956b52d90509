"""The module a swapped script calls ``accelerate``: anyaccel, at the Accelerate API level it follows.

The documented swap (docs/guides/accelerate.md) rewrites ``import accelerate`` into
``import anyaccel.as_accelerate as accelerate``, so the script's name ``accelerate`` is this module:

* ``accelerate.__version__`` is :data:`ACCELERATE_VERSION` (``"1.15.0"``), the Accelerate release
  whose API anyaccel implements. A version gate written for Accelerate — diffusers'
  ``if version.parse(accelerate.__version__) >= version.parse("0.16.0"):``, which registers the
  hooks that save ``unet/`` and ``unet_ema/`` — takes the branch it takes under that Accelerate.
  ``anyaccel.__version__`` stays anyaccel's own version (``0.1.0``): comparing *it* with
  Accelerate's version numbers would take the branches written for an Accelerate older than 0.16.
* Every other attribute is anyaccel's: a top-level name (``accelerate.Accelerator``) or one of
  Accelerate's module paths (``accelerate.utils.set_seed``, ``accelerate.state.is_initialized()``).

Nothing else is imported until an attribute is read; no anyaccel module imports this one. Local.
"""

from __future__ import annotations

import importlib
from typing import Any, List

from .compat.version_gate import ACCELERATE_VERSION

__all__ = ["ACCELERATE_VERSION", "__version__"]

__version__ = ACCELERATE_VERSION  #: the Accelerate release whose API anyaccel follows


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    package = importlib.import_module("anyaccel")
    try:
        return getattr(package, name)  # a top-level name: Accelerator, set_seed, ...
    except AttributeError:
        pass
    try:
        return importlib.import_module(f"anyaccel.{name}")  # a module path: utils, state, logging, ...
    except ModuleNotFoundError as exc:
        if exc.name != f"anyaccel.{name}":
            raise
    raise AttributeError(f"module 'accelerate' (anyaccel.as_accelerate: anyaccel under Accelerate {ACCELERATE_VERSION}'s "
                         f"names) has no attribute {name!r}; see docs/guides/accelerate.md for what anyaccel offers")


def __dir__() -> List[str]:
    package = importlib.import_module("anyaccel")
    return sorted(set(__all__) | set(dir(package)))
