"""The H100 compile target, kept outside the user's Python environment.

`measure.xla_target` compiles for an H100 without a GPU through JAX's CUDA plugin
(`jax-cuda12-plugin`, `jax-cuda12-pjrt`), and `benchmarks.ptx` reads registers and spills with the
`ptxas` of `nvidia-cuda-nvcc-cu12`. Installed into the user's environment, that plugin changes what
every unrelated JAX program prints on a machine without a GPU (absl `cudart_stub` lines at
`import jax`, a "Jax plugin configuration error" traceback at the first array). So eqsat installs
them once into a directory of their own and puts it on the path of its compile subprocess only:

    python -m measure.cuda_target install     # once (also done on first use, with a message)
    python -m measure.cuda_target info        # where it is, what is in it

The directory is `$EQSAT_TARGET_DIR`, else `$XDG_CACHE_HOME/eqsat/cuda-target-jax<version>` (default
`~/.cache/eqsat/...`), one per JAX version since the plugin must match jax exactly. It is written
into a temporary sibling and renamed, so an interrupted install leaves nothing half-made and two
processes installing at once leave one complete copy. A plugin installed into the environment
itself (the `cuda-target` extra, or a GPU machine's own `jax[cuda12]`) is used as it is.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PLUGIN_DISTRIBUTIONS = ("jax-cuda12-pjrt", "jax-cuda12-plugin")
PTXAS_DISTRIBUTION = "nvidia-cuda-nvcc-cu12>=12.9,<13"  # Triton's PTX is ISA 8.8: ptxas 12.9 or later
MARKER = "eqsat-cuda-target.json"


class TargetInstallError(RuntimeError):
    """The target directory could not be installed (no package index, no disk space, ...)."""


def jax_version() -> str:
    return importlib.metadata.version("jax")


def requirements() -> list[str]:
    version = jax_version()
    return [f"{dist}=={version}" for dist in PLUGIN_DISTRIBUTIONS] + [PTXAS_DISTRIBUTION]


def target_dir() -> Path:
    """Where the target lives (whether or not it is installed yet)."""
    if os.environ.get("EQSAT_TARGET_DIR"):
        return Path(os.environ["EQSAT_TARGET_DIR"]).expanduser()
    from driver.cache import user_cache_home

    return user_cache_home() / f"cuda-target-jax{jax_version()}"


def installed_in_target_dir() -> bool:
    marker = target_dir() / MARKER
    try:
        return json.loads(marker.read_text()).get("jax") == jax_version()
    except (OSError, ValueError):
        return False


def plugin_in_environment() -> bool:
    """The plugin is importable from the environment's own `sys.path` (not from the target dir)."""
    target = str(target_dir().resolve())
    paths = [p for p in sys.path if os.path.abspath(p or os.curdir) != target]
    package = importlib.machinery.PathFinder.find_spec("jax_plugins", paths)
    if package is None or package.submodule_search_locations is None:
        return False
    pjrt = importlib.machinery.PathFinder.find_spec("xla_cuda12", list(package.submodule_search_locations))
    kernels = importlib.machinery.PathFinder.find_spec("jax_cuda12_plugin", paths)
    return pjrt is not None and kernels is not None


def search_paths() -> list[str]:
    """Paths the compile subprocess needs in front of its own to find the plugin and ptxas."""
    if plugin_in_environment() or not installed_in_target_dir():
        return []
    return [str(target_dir())]


def unavailable_reason() -> str | None:
    """Why no target is at hand without installing one, or None (cheap: no import, no network)."""
    if plugin_in_environment() or installed_in_target_dir():
        return None
    return (f"the H100 compile target is not installed in {target_dir()}; "
            f"run `python -m measure.cuda_target install` (or let eqsat install it on first use)")


def ensure_installed(quiet: bool = False) -> list[str]:
    """Install the target if neither the environment nor the target dir has it; the subprocess's paths.

    Raises `TargetInstallError` with pip's last lines when the install fails."""
    if plugin_in_environment():
        return []
    if not installed_in_target_dir():
        install(quiet=quiet)
    return [str(target_dir())]


def install(quiet: bool = False) -> Path:
    destination = target_dir()
    packages = requirements()
    if not quiet:
        print(f"eqsat: installing the H100 compile target ({', '.join(packages)}; ~600 MB) into {destination} "
              f"once; it stays out of this Python environment", file=sys.stderr, flush=True)
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=destination.name + ".partial-", dir=destination.parent))
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "--disable-pip-version-check",
             "--quiet", "--target", str(staging), *packages],
            capture_output=True, text=True)
        if done.returncode != 0:
            lines = (done.stderr or done.stdout).strip().splitlines()[-8:]
            raise TargetInstallError(f"pip could not install {' '.join(packages)} into {destination}:\n" + "\n".join(lines))
        (staging / MARKER).write_text(json.dumps({"jax": jax_version(), "requirements": packages}))
        if installed_in_target_dir():  # another process finished first
            return destination
        if destination.exists():
            shutil.rmtree(destination)
        os.replace(staging, destination)
        return destination
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def ptxas_candidates() -> list[Path]:
    """`ptxas` of nvidia-cuda-nvcc-cu12 in the environment and in the target dir, in that order."""
    found = []
    spec = None
    try:
        import importlib.util

        spec = importlib.util.find_spec("nvidia.cuda_nvcc")
    except (ImportError, ValueError):
        pass
    if spec is not None and spec.submodule_search_locations:
        found += [Path(p) / "bin" / "ptxas" for p in spec.submodule_search_locations]
    found.append(target_dir() / "nvidia" / "cuda_nvcc" / "bin" / "ptxas")
    return found


def describe() -> dict:
    return {"target_dir": str(target_dir()), "installed_in_target_dir": installed_in_target_dir(),
            "plugin_in_environment": plugin_in_environment(), "requirements": requirements(),
            "ptxas": next((str(p) for p in ptxas_candidates() if p.is_file()), None)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m measure.cuda_target", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["install", "info", "path", "remove"])
    parser.add_argument("--force", action="store_true",
                        help="install into the target dir even when the environment has the plugin")
    args = parser.parse_args(argv)
    if args.command == "install":
        if plugin_in_environment() and not args.force:
            print("the CUDA plugin is installed in this Python environment: eqsat uses it (nothing to install)")
            return 0
        try:
            print(install() if args.force else ensure_installed() and target_dir())
        except TargetInstallError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
    elif args.command == "info":
        for key, value in describe().items():
            print(f"{key:24} {value}")
    elif args.command == "path":
        print(target_dir())
    else:
        shutil.rmtree(target_dir(), ignore_errors=True)
        print(f"removed {target_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
