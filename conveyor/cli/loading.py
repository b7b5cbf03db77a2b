"""The user's code named on the command line: ``--model package.module:function``."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from conveyor.errors import ConfigError

__all__: list[str] = []


def load_function(spec: str, *, returning: str, choices: str = "") -> Callable[[], Any]:
    """The function ``package.module:function`` names, imported with the current folder
    importable (as under ``python -m``).

    Args:
        spec: ``package.module:function``.
        returning: what the function returns, for the messages ("the model").
        choices: other values ``--model`` takes, for the messages ("transformer, ").

    Raises:
        ConfigError: the spec is malformed, the module cannot be imported, or the name
            is missing or not callable.
    """
    module_name, _, function_name = spec.partition(":")
    if not module_name or not function_name:
        raise ConfigError(f"--model {spec}: give {choices}package.module:function (a "
                          f"function that returns {returning})")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"--model {spec}: cannot import {module_name}: {exc}") from None
    function = getattr(module, function_name, None)
    if function is None:
        raise ConfigError(f"--model {spec}: {module_name} has no {function_name!r}")
    if not callable(function):
        raise ConfigError(f"--model {spec}: {function_name} is a {type(function).__name__}, "
                          f"not a function that returns {returning}")
    return function  # type: ignore[no-any-return]
