"""Skips for tests of optional packages the README's test command installs."""
from __future__ import annotations

import importlib.util
import os

import pytest


def installed_or_skip(package: str, extra: str) -> bool:
    """True where ``package`` can be imported. Where it cannot: skip (module level) on a
    developer's machine; under CI (``CI=true``), whose test command installs ``extra``, fail,
    so that a broken install is not reported as a skip."""
    if importlib.util.find_spec(package) is not None:
        return True
    if os.environ.get("CI") == "true":
        raise ImportError(f"{package} is not installed, but CI's test command installs the {extra!r} extra")
    pytest.skip(f"needs the {package} package (the {extra} extra)", allow_module_level=True)
    return False
