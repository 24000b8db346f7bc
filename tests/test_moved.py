"""Modules that moved in 0.2 keep their old import paths until 0.3, with a warning (`eqsat.moved`)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

import eqsat
from eqsat.moved import MOVED_MODULES


@pytest.mark.parametrize("old, new", sorted(MOVED_MODULES.items()))
def test_an_old_module_path_is_the_new_module_with_a_deprecation_warning(old, new):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert sys.modules[old] is sys.modules[new]


def test_from_import_of_an_old_path_gives_the_same_objects():
    sys.modules.pop("eqsat.cache", None)
    with pytest.warns(DeprecationWarning):
        from eqsat.cache import info as old_info
    from driver.cache import info

    assert old_info is info


def test_eqsat_optimize_stays_the_function_after_importing_the_old_module():
    sys.modules.pop("eqsat.optimize", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import eqsat.optimize  # noqa: F401  binds the (callable) module as the attribute

    fast = eqsat.optimize(lambda x: x * 2.0)
    assert float(fast(1.5)) == 3.0


@pytest.mark.parametrize("name, new", [("plan_drawing", "extract.drawing"), ("plot_memory", "extract.drawing"),
                                       ("egraph_view", "driver.egraph_view")])
def test_moved_drawing_names_resolve_from_eqsat_viz_with_a_warning(name, new):
    from eqsat import viz

    with pytest.warns(DeprecationWarning, match=f"eqsat.viz.{name} moved to {new}.{name}"):
        value = getattr(viz, name)
    assert value is getattr(importlib.import_module(new), name)
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        viz.nothing_here


def test_python_dash_m_on_an_old_path_runs_the_new_module_and_says_so():
    result = subprocess.run([sys.executable, "-m", "eqsat.cuda_target", "--help"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "usage" in result.stdout.lower()
    assert "eqsat.cuda_target moved to measure.cuda_target" in result.stderr
