"""Optional packages behind extras: import one, or stop with one line naming the extra."""

from __future__ import annotations

import importlib
from typing import Any

from scse_dist.typed_yaml import ConfigError


def require_extra(module: str, extra: str, what: str) -> Any:
    """`module` imported; if it is missing, ConfigError: `<what> needs the '<package>' package:
    pip install 'scse-dist[<extra>]'`."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"{what} needs the {module.split('.')[0]!r} package: "
                          f"pip install 'scse-dist[{extra}]'") from None
