"""``anyaccel.utils.environment``: Accelerate's helpers for environment variables. Local: they
read or change this process's ``os.environ`` only. (anyaccel's own variables are read once, in
:mod:`anyaccel.envvars`; these are for user code.)"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from typing import Any, Dict, Iterable, Iterator, List, Union

__all__ = ["patch_environment", "clear_environment", "str_to_bool", "parse_flag_from_env", "parse_choice_from_env",
           "get_int_from_env", "convert_dict_to_env_variables", "are_libraries_initialized"]

_TRUE = ("y", "yes", "t", "true", "on", "1")
_FALSE = ("n", "no", "f", "false", "off", "0")


def str_to_bool(value: str, to_bool: bool = False) -> Union[int, bool]:
    """``1``/``0`` (``True``/``False`` with ``to_bool``) for y/yes/t/true/on/1 and
    n/no/f/false/off/0 (any case); ``ValueError`` otherwise."""
    value = value.lower()
    if value in _TRUE:
        return True if to_bool else 1
    if value in _FALSE:
        return False if to_bool else 0
    raise ValueError(f"invalid truth value {value!r}; use one of {_TRUE + _FALSE}")


def parse_flag_from_env(key: str, default: bool = False) -> bool:
    """The truth value of ``os.environ[key]`` (:func:`str_to_bool`), ``default`` when unset."""
    return str_to_bool(os.environ.get(key, str(default))) == 1


def parse_choice_from_env(key: str, default: str = "no") -> str:
    """``os.environ[key]``, ``default`` when unset."""
    return os.environ.get(key, str(default))


def get_int_from_env(env_keys: Iterable[str], default: Any) -> Any:
    """The first of ``env_keys`` set to an integer >= 0, else ``default``."""
    for key in env_keys:
        value = int(os.environ.get(key, -1))
        if value >= 0:
            return value
    return default


def convert_dict_to_env_variables(current_env: Dict[str, str]) -> List[str]:
    """``["KEY=value\\n", ...]`` for the items whose key and value are non-empty and free of
    ``; \\n < >`` and spaces; the others are skipped with a warning."""
    valid = []
    for key, value in current_env.items():
        if key and value and not any(c in key + value for c in (";", "\n", "<", ">", " ")):
            valid.append(f"{key}={value}\n")
        else:
            warnings.warn(f"Skipping {key}={value}: it contains forbidden characters or misses a value", stacklevel=2)
    return valid


def are_libraries_initialized(*library_names: str) -> List[str]:
    """The names among ``library_names`` that are already imported in this process."""
    return [name for name in library_names if name in sys.modules]


@contextlib.contextmanager
def clear_environment() -> Iterator[None]:
    """Run the block with an empty ``os.environ``; the previous environment is restored after."""
    saved = os.environ.copy()
    os.environ.clear()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def patch_environment(**kwargs: Any) -> Iterator[None]:
    """Run the block with ``KEY=str(value)`` set for each keyword (keys upper-cased); afterwards
    each key has its previous value again, or is removed."""
    saved = {}
    for key, value in kwargs.items():
        key = key.upper()
        if key in os.environ:
            saved[key] = os.environ[key]
        os.environ[key] = str(value)
    try:
        yield
    finally:
        for key in kwargs:
            key = key.upper()
            if key in saved:
                os.environ[key] = saved[key]
            else:
                os.environ.pop(key, None)
