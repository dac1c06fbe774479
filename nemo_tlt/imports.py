"""Objects named by import path (``"package.module:attr"``) in configs.

The config names a user's code (a task source, a reward, a tokenizer factory) by
import path, so the framework never imports it statically. ``check_import_path``
checks only the form (config construction); ``load_object`` imports (run start).
"""
from __future__ import annotations

import importlib
import re
from typing import Any

_IMPORT_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def is_import_path(spec: Any) -> bool:
    return isinstance(spec, str) and _IMPORT_PATH.fullmatch(spec) is not None


def check_import_path(spec: Any, field_name: str) -> None:
    """``spec`` has the form ``package.module:attr`` (ValueError naming ``field_name`` otherwise)."""
    if not is_import_path(spec):
        raise ValueError(f"{field_name} must be an import path 'package.module:attr', got {spec!r}")


def load_object(spec: str, field: str) -> Any:
    """The object at import path ``package.module:attr`` (``attr`` may be dotted).

    A bad form, a module that cannot be imported or a missing attribute raise a
    ``ValueError`` naming ``field`` and ``spec``; any other error raised while
    the module runs is its own and propagates unchanged.
    """
    check_import_path(spec, field)
    module_name, attr = spec.split(":")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{field}={spec!r}: cannot import module {module_name!r} ({err})") from err
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{field}={spec!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj
