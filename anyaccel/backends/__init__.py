"""Device backends that need an optional third-party runtime.

Each submodule imports its runtime at its own import and is imported only when the resolved
environment selects that device (``from anyaccel.backends import xla`` on XLA), so this package
itself imports nothing.
"""
