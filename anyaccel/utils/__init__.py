"""``anyaccel.utils``: Accelerate's ``accelerate.utils`` module path, and every submodule path under it.

The code lives in :mod:`anyaccel.compat.utils` (the Accelerate compatibility layer, which says
what each submodule holds). This package exists so that ``from anyaccel.utils import gather``,
``from anyaccel.utils.operations import reduce`` and ``import anyaccel.utils.dataclasses`` keep
working: each ``anyaccel.utils.<name>`` is registered in ``sys.modules`` as the very module object
``anyaccel.compat.utils.<name>`` (no second copy: ``mock.patch("anyaccel.utils.operations.x")``
patches what the code uses). No anyaccel module imports it.
"""

import sys

from ..compat import utils as _home
from ..compat.utils import *  # noqa: F401,F403
from ..compat.utils import (_refuse, ao, constants, dataclasses, deepspeed, environment, fsdp_utils,  # noqa: F401
                            imports, memory, modeling, offload, operations, other, random, versions)

#: the submodules of :mod:`anyaccel.compat.utils` (``tqdm``'s attribute here is the function, as in Accelerate)
_SUBMODULES = ("_refuse", "ao", "constants", "dataclasses", "deepspeed", "environment", "fsdp_utils", "imports", "memory",
              "modeling", "offload", "operations", "other", "random", "tqdm", "versions")
for _name in _SUBMODULES:
    sys.modules[f"{__name__}.{_name}"] = sys.modules[f"{_home.__name__}.{_name}"]

__all__ = list(_home.__all__)
