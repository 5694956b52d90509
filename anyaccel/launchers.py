"""``anyaccel.launchers``: Accelerate's ``accelerate.launchers`` module path
(``notebook_launcher``, ``debug_launcher``, re-exported from :mod:`anyaccel.launch.notebook`,
their home)."""

from __future__ import annotations

from .launch.notebook import debug_launcher, notebook_launcher

__all__ = ["notebook_launcher", "debug_launcher"]
