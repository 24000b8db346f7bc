"""The H100 compile target lives in a directory of its own, installed once and atomically."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from measure import cuda_target


@pytest.fixture
def fake_pip(monkeypatch):
    """pip, replaced: writes a fake plugin package into --target (or fails when told to)."""
    calls = []

    def run(args, **kwargs):
        calls.append(args)
        if fake_pip.fail:
            return subprocess.CompletedProcess(args, 1, "", "ERROR: No matching distribution found for jax-cuda12-pjrt")
        target = args[args.index("--target") + 1]
        (Path(target) / "jax_plugins" / "xla_cuda12").mkdir(parents=True)
        return subprocess.CompletedProcess(args, 0, "", "")

    fake_pip.fail = False
    fake_pip.calls = calls
    monkeypatch.setattr(cuda_target.subprocess, "run", run)
    monkeypatch.setattr(cuda_target, "plugin_in_environment", lambda: False)
    return fake_pip


def test_target_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("EQSAT_TARGET_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cuda_target.target_dir() == tmp_path / "xdg" / "eqsat" / f"cuda-target-jax{cuda_target.jax_version()}"
    monkeypatch.setenv("EQSAT_TARGET_DIR", str(tmp_path / "mine"))
    assert cuda_target.target_dir() == tmp_path / "mine"


def test_requirements_match_jax_exactly():
    version = cuda_target.jax_version()
    assert f"jax-cuda12-plugin=={version}" in cuda_target.requirements()
    assert f"jax-cuda12-pjrt=={version}" in cuda_target.requirements()


def test_install_once_then_reuse(fake_pip, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("EQSAT_TARGET_DIR", str(tmp_path / "target"))
    assert cuda_target.unavailable_reason() is not None and cuda_target.search_paths() == []
    assert cuda_target.ensure_installed() == [str(tmp_path / "target")]
    assert "installing the H100 compile target" in capsys.readouterr().err
    assert (tmp_path / "target" / "jax_plugins" / "xla_cuda12").is_dir()
    assert [p.name for p in tmp_path.iterdir()] == ["target"]  # no staging dir left behind
    assert cuda_target.unavailable_reason() is None
    assert cuda_target.search_paths() == [str(tmp_path / "target")]
    cuda_target.ensure_installed()
    assert len(fake_pip.calls) == 1
    assert "--no-deps" in fake_pip.calls[0] and "--target" in fake_pip.calls[0]


def test_a_target_for_another_jax_is_reinstalled(fake_pip, monkeypatch, tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / cuda_target.MARKER).write_text(json.dumps({"jax": "0.0.1"}))
    monkeypatch.setenv("EQSAT_TARGET_DIR", str(target))
    assert not cuda_target.installed_in_target_dir()
    cuda_target.ensure_installed(quiet=True)
    assert cuda_target.installed_in_target_dir() and len(fake_pip.calls) == 1


def test_a_failed_install_says_why_and_leaves_nothing(fake_pip, monkeypatch, tmp_path):
    fake_pip.fail = True
    monkeypatch.setenv("EQSAT_TARGET_DIR", str(tmp_path / "target"))
    with pytest.raises(cuda_target.TargetInstallError, match="No matching distribution"):
        cuda_target.ensure_installed(quiet=True)
    assert list(tmp_path.iterdir()) == []


def test_a_corrupt_marker_means_not_installed(monkeypatch, tmp_path):
    (tmp_path / cuda_target.MARKER).write_text("{not json")
    monkeypatch.setenv("EQSAT_TARGET_DIR", str(tmp_path))
    monkeypatch.setattr(cuda_target, "plugin_in_environment", lambda: False)
    assert not cuda_target.installed_in_target_dir()
    assert "python -m measure.cuda_target install" in cuda_target.unavailable_reason()


def test_info_command(capsys):
    assert cuda_target.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "target_dir" in out and "plugin_in_environment" in out
