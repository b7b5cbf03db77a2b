"""The user's code named on the command line: ``--model package.module:function``, the
function and the model it returns."""

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


def load_model(spec: str, *, choices: str = "") -> tuple[Any, Any]:
    """The model (and sample, or None) that ``package.module:function`` returns.

    Raises:
        ConfigError: the module cannot be imported, has no such name, the name is not a
            function, or what it returns is not a model.
    """
    from torch import nn  # here: the commands that load no model start without torch

    made = load_function(spec, returning="the model", choices=choices)()
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module):
        return made[0], made[1]
    if isinstance(made, nn.Module):
        return made, None
    raise ConfigError(f"--model {spec} returned a {type(made).__name__}; return an "
                      "nn.Module, or (nn.Module, sample) with sample one batch as the model "
                      "takes it")
