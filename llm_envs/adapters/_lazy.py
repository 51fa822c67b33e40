"""Lazy imports of the adapters' third-party packages: a missing one names the extra that installs it."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]


def require(module: str, extra: str) -> ModuleType:
    """Import ``module``; when it is missing, raise an ``ImportError`` naming ``pip install 'tokengym[extra]'``.

    Example:
        >>> require("json", "none").__name__
        'json'
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(
            f"this adapter needs the package {module!r}, which is not installed: pip install 'tokengym[{extra}]'"
        ) from err
