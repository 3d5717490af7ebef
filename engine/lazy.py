"""Package attributes imported on first use (PEP 562), so importing a package is cheap."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_attributes(package: str, locations: dict[str, str]) -> Callable[[str], object]:
    """A module `__getattr__` for `package` that imports each name of `locations` (name ->
    module) from its module the first time it is asked for."""

    def __getattr__(name: str) -> object:
        module_name = locations.get(name)
        if module_name is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module_name), name)

    return __getattr__
