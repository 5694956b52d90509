"""Accelerate's ``accelerate.utils``, module path for module path; users import it as ``anyaccel.utils``.

This package is the code; ``anyaccel/utils/__init__.py`` makes ``anyaccel.utils`` and every
``anyaccel.utils.<name>`` these very modules (:mod:`anyaccel.compat` says why).

A script migrating from Accelerate changes ``accelerate`` to ``anyaccel`` in its import lines and
nothing else: ``from anyaccel.utils import gather``, ``from anyaccel.utils.operations import
reduce``, ``from anyaccel.utils.dataclasses import DistributedType`` all work, with Accelerate's
defaults (notably ``reduce`` here averages, like ``accelerate.utils.reduce``, while
``Accelerator.reduce`` sums, like Accelerate's method).

Each submodule bears the name of Accelerate's and holds re-exports from anyaccel's own modules
(:mod:`anyaccel.ops`, :mod:`anyaccel.memory`, :mod:`anyaccel.compat.kwargs`, :mod:`anyaccel.data`, ...)
plus the Accelerate helpers that have no other home in anyaccel (nested-data helpers in
:mod:`.operations`, environment helpers in :mod:`.environment`, Accelerate's enums in
:mod:`.dataclasses`, torchao's fp8 helpers in :mod:`.ao`). What anyaccel does not do — Megatron-LM,
MS-AMP, bitsandbytes, context parallelism — is
importable under its Accelerate name but raises ``NotImplementedError`` when used, naming the
anyaccel way where there is one (:mod:`._refuse`). Names absent on purpose are listed with their
reasons in the migration guide (docs/guides/accelerate.md).
"""

from __future__ import annotations

from .ao import *  # noqa: F401,F403
from .constants import *  # noqa: F401,F403
from .dataclasses import *  # noqa: F401,F403
from .deepspeed import *  # noqa: F401,F403
from .environment import *  # noqa: F401,F403
from .fsdp_utils import *  # noqa: F401,F403
from .imports import *  # noqa: F401,F403
from .memory import *  # noqa: F401,F403
from .modeling import *  # noqa: F401,F403
from .offload import *  # noqa: F401,F403
from .operations import *  # noqa: F401,F403
from .other import *  # noqa: F401,F403
from .random import *  # noqa: F401,F403
from .tqdm import tqdm  # noqa: F401
from .versions import *  # noqa: F401,F403

from . import ao, constants, dataclasses, deepspeed, environment, fsdp_utils, imports, memory, modeling, offload
from . import operations, other, random, versions


__all__ = sorted({name for module in (ao, constants, dataclasses, deepspeed, environment, fsdp_utils, imports, memory,
                                      modeling, offload, operations, other, random, versions)
                  for name in module.__all__} | {"tqdm", "ParallelismConfig"})
