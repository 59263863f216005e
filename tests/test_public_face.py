"""`from lever_actors import Engine, ...` is the public face: its names load on first use, so
importing the package (or configuring an engine) loads no torch; the module paths from
before 0.3 still import, with a warning, as the modules that hold them now."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

import lever_actors
from lever_actors.engine.aio import AsyncEngine
from lever_actors.engine.engine import Engine
from lever_actors.errors import ConfigError
from lever_actors.options import GenerationOptions


def test_the_public_names_are_the_modules_own():
    assert lever_actors.Engine is Engine
    assert lever_actors.AsyncEngine is AsyncEngine
    assert lever_actors.GenerationOptions is GenerationOptions
    assert lever_actors.ConfigError is ConfigError
    for name in lever_actors.__all__:
        assert getattr(lever_actors, name).__name__ == name
    assert set(lever_actors.__all__) <= set(dir(lever_actors))


def test_a_name_not_in_the_face_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Engin'"):
        lever_actors.Engin  # noqa: B018


def modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"import sys; {code}; print(' '.join(sys.modules))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return set(out.split())


def test_importing_the_package_or_configuring_an_engine_loads_no_torch():
    assert "torch" not in modules_after("import lever_actors")
    configured = modules_after(
        "from lever_actors import EngineConfig, ConfigError; EngineConfig(target='t')"
    )
    assert "torch" not in configured
    assert "lever_actors.engine" not in configured
    assert "torch" in modules_after("from lever_actors import Engine")  # the check can fail


@pytest.mark.parametrize(("old", "new"), sorted(lever_actors.MOVED.items()))
def test_the_old_module_paths_import_as_the_new_with_a_warning(old, new):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert module.__spec__.name == new  # it stays itself (reload, pickling by name)


def test_an_old_path_serves_from_imports():
    sys.modules.pop("lever_actors.request", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from lever_actors.request import GenerationOptions as old

    assert old is GenerationOptions
