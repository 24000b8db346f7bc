"""Old import paths of modules that moved in 0.2, kept for one release with a `DeprecationWarning`.

    import eqsat.optimize        -> driver.optimize      (the driver sits above extract and emit)
    from eqsat.cache import ...  -> driver.cache
    python -m eqsat.cuda_target  -> measure.cuda_target  (measuring tools sit beside the benchmarks)

`install()` (run by `import eqsat`) puts a finder on `sys.meta_path` that answers an old name with
the module at its new path: one module object under both names, so state (caches, warnings
registries) is shared and `isinstance` checks agree. `python -m <old name>` runs the new module, with a `FutureWarning`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings

MOVED_MODULES = {
    "eqsat.optimize": "driver.optimize",
    "eqsat.cache": "driver.cache",
    "eqsat.explain": "driver.explain",
    "eqsat.differentiate": "driver.differentiate",
    "eqsat.xla_target": "measure.xla_target",
    "eqsat.cuda_target": "measure.cuda_target",
}

REMOVED_IN = "eqsat 0.3"


def deprecation_message(old: str, new: str) -> str:
    return f"{old} moved to {new}; the old path works until {REMOVED_IN}"


class _Alias(importlib.abc.Loader):
    def __init__(self, old: str, new: str):
        self.old, self.new = old, new

    def create_module(self, spec):
        warnings.warn(deprecation_message(self.old, self.new), DeprecationWarning, stacklevel=_caller_level())
        return importlib.import_module(self.new)

    def exec_module(self, module):
        pass

    def get_code(self, name):
        """`python -m <old name>` (runpy runs this code as `__main__`): the new module's code, and a
        warning the user sees (a `FutureWarning`: shown by default, unlike a `DeprecationWarning`)."""
        warnings.warn(deprecation_message(self.old, self.new), FutureWarning, stacklevel=2)
        return importlib.util.find_spec(self.new).loader.get_code(self.new)


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        new = MOVED_MODULES.get(name)
        if new is None:
            return None
        origin = importlib.util.find_spec(new).origin
        return importlib.machinery.ModuleSpec(name, _Alias(name, new), origin=origin)


def _caller_level() -> int:
    """The stack level of the first frame outside importlib, for the warning's location."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith("<frozen importlib"):
        frame, level = frame.f_back, level + 1
    return level


def moved_attribute(module: str, name: str, moved_names: dict[str, str]):
    """`module.name` for a name that moved to `moved_names[name]` (a module `__getattr__`), with a
    `DeprecationWarning`; AttributeError for any other name."""
    new = moved_names.get(name)
    if new is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    warnings.warn(deprecation_message(f"{module}.{name}", f"{new}.{name}"), DeprecationWarning, stacklevel=3)
    return getattr(importlib.import_module(new), name)


def install() -> None:
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedModuleFinder())
