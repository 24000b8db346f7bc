"""The `sd15` command: `generate --tiny` end to end, clear errors, and the subcommand hook."""

from __future__ import annotations

import argparse
import sys
import types

import pytest
from PIL import Image

from sd15 import cli


def test_generate_tiny_writes_a_png(tmp_path, capsys):
    out = tmp_path / "images" / "tiny.png"
    argv = ["generate", "--tiny", "--prompt", "a red cube", "--steps", "2", "--size", "32", "--out", str(out)]
    assert cli.main(argv) == 0
    with Image.open(out) as image:
        assert image.format == "PNG" and image.size == (32, 32) and image.mode == "RGB"
    captured = capsys.readouterr()
    assert f"wrote {out}" in captured.out
    assert "2/2" in captured.err  # the progress bar


def test_missing_model_path_is_a_clear_error(tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    with pytest.raises(SystemExit) as caught:
        cli.main(["generate", "--model", str(missing), "--prompt", "x", "--out", str(tmp_path / "x.png")])
    assert caught.value.code == 2
    assert f"--model {missing}: no such file or folder" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_model_or_tiny_is_required(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--prompt", "x", "--out", str(tmp_path / "x.png")])
    assert "--model" in capsys.readouterr().err


def test_broken_checkpoint_is_reported_not_raised(tmp_path, capsys):
    folder = tmp_path / "model"
    (folder / "unet").mkdir(parents=True)
    (folder / "model_index.json").write_text("{}")
    assert cli.main(["generate", "--model", str(folder), "--prompt", "x", "--out", str(tmp_path / "x.png")]) == 1
    assert "sd15 generate: error:" in capsys.readouterr().err


def test_optional_subcommand_hook(monkeypatch):
    """A module in COMMAND_MODULES (like sd15/plan_cli.py) adds its subcommand without editing cli.py."""

    def add_hello_command(subparsers):
        parser = subparsers.add_parser("hello")
        parser.set_defaults(func=lambda args: 7)

    module = types.ModuleType("fake_hello_cli")
    module.add_hello_command = add_hello_command
    monkeypatch.setitem(sys.modules, "fake_hello_cli", module)
    monkeypatch.setattr(cli, "COMMAND_MODULES", (("fake_hello_cli", "add_hello_command"), ("not_a_module_at_all", "x")))
    assert cli.main(["hello"]) == 7
    subcommands = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert {"generate", "hello"} <= set(subcommands.choices)
