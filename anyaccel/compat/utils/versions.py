"""``anyaccel.utils.versions``: Accelerate's version comparisons (``compare_versions``,
``is_torch_version``). Local."""

from __future__ import annotations

import importlib.metadata
import operator
from typing import Any

import torch
from torch._vendor.packaging.version import Version, parse  # torch's own copy of packaging

__all__ = ["compare_versions", "is_torch_version"]

_OPERATIONS = {">": operator.gt, ">=": operator.ge, "==": operator.eq, "!=": operator.ne, "<=": operator.le,
               "<": operator.lt}


def compare_versions(library_or_version: Any, operation: str, requirement_version: str) -> bool:
    """``library_or_version`` (an installed distribution's name, or a version) ``operation``
    (``">"``, ``">="``, ``"=="``, ``"!="``, ``"<="``, ``"<"``) ``requirement_version``. Local."""
    if operation not in _OPERATIONS:
        raise ValueError(f"compare_versions: operation={operation!r}; choose one of {sorted(_OPERATIONS)}")
    if isinstance(library_or_version, str):
        try:
            library_or_version = parse(importlib.metadata.version(library_or_version))
        except importlib.metadata.PackageNotFoundError:
            library_or_version = parse(library_or_version)
    return _OPERATIONS[operation](library_or_version, parse(requirement_version))


def is_torch_version(operation: str, version: str) -> bool:
    """Whether the running torch (without its local suffix) ``operation`` ``version``. Local."""
    return compare_versions(Version(Version(torch.__version__).base_version), operation, version)
