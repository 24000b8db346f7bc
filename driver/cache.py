"""The plan cache: extracted plans kept on disk as data, so a new process skips lift's successors.

`eqsat.optimize(fn)` looks a lowering up here after lifting `fn` and, on a hit, rebuilds its
`Plan` from the stored terms instead of building, saturating and extracting an e-graph (the
prepare split, a deterministic function of the plan, is recomputed from it: milliseconds).
`report()` and `stats["cache"]` say where the plan came from.

    python -m driver.cache info        # where it is, how many entries, how many bytes
    python -m driver.cache clear       # remove every entry
    eqsat cache info|clear            # the same, as the installed console script

Where: `$EQSAT_CACHE_DIR`, else `$XDG_CACHE_HOME/eqsat`, else `~/.cache/eqsat`; plans are
`plans/<key>.json`, a split plan's emitted stages `exported/*.bin` (`emit.exported`), and their
compiled executables `jax/` (JAX's persistent compilation cache, see below), and on a CUDA GPU
XLA's compiled kernels `xla-kernels/sm<capability>-jaxlib<version>.pb` (`driver.xla_kernel_cache`).
`optimize(..., cache=False)` neither reads nor writes any of them.

JAX's persistent compilation cache is on by default once a cached plan's stages run
(`use_jax_compilation_cache`, from `Lowered.executable`): in `<cache dir>/jax`, unless the user set
a folder of their own (left alone) or `EQSAT_JAX_CACHE=0`. Measured on this CPU (full-size SD 1.5
UNet step, backend "xla", `benchmarks/README.md`): XLA compiles it in 18-34 s (load 9-12) and
reads its executable back in 3.1 s, so a warm process is ready in 5.6 s instead of 28.5 s, with
outputs equal to the cold process's.
It is JAX's process-wide setting: later compiles of at least a second are cached there too.

The key (`plan_key`) is a digest of everything the plan depends on:

- the lifted program: its term DAG (the jaxpr one equation per kernel: shapes and dtypes of the
  inputs, every literal, constants by content digest), its named scopes (kernel components), and
  its payloads (loop kinds, gather/scatter/opaque primitives and parameters; payload keys are
  renumbered in lift order, so the same function lifted in another process has the same key);
- input shardings spanning more than one device (a plan does not depend on which single device);
- the device profile (every field), the rule schedule (family names and iterations; a stage
  running a user's own ruleset makes the lowering uncacheable: its rules cannot be fingerprinted),
  and the options that change the plan (node, iteration and time limits, extractor);
- the eqsat version, a digest of the source of `eqsat/`, `extract/` and `emit/` (a changed rule
  or cost model is a different key) and `FORMAT`, the layout of an entry.

An entry is JSON (never pickle: a plan is data): the plan's root terms as a node list (each node
its op and arguments, a term argument by index, a payload key by its lift-order number), each
kernel's e-class and component, and the stats of the run that planned it. An entry that does not
parse, is truncated or has another format is ignored with one `PlanCacheWarning` and rewritten.
Writers write a temporary file in the same folder and `os.replace` it: two processes storing the
same entry at once leave one complete entry.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path

FORMAT = 1
PACKAGES = ("eqsat", "extract", "emit", "driver")  # their source is part of every key


class PlanCacheWarning(UserWarning):
    """A cache entry could not be read (corrupt, truncated, another format): it is planned again and rewritten."""


class Uncacheable(Exception):
    """This lowering has no stable key (a user's own ruleset): it is planned, not cached."""


def cache_dir() -> Path:
    """`$EQSAT_CACHE_DIR`, else `$XDG_CACHE_HOME/eqsat`, else `~/.cache/eqsat`."""
    explicit = os.environ.get("EQSAT_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    return user_cache_home()


def user_cache_home() -> Path:
    """eqsat's folder under the user's cache (XDG): `$XDG_CACHE_HOME/eqsat`, else `~/.cache/eqsat`
    (also where `measure.cuda_target` keeps the H100 compile target, which `EQSAT_CACHE_DIR` does not move)."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "eqsat"


def plans_dir() -> Path:
    return cache_dir() / "plans"


def exported_dir() -> Path:
    """Where the emitted stages of cached plans are kept as serialized StableHLO (`emit.exported`)."""
    return cache_dir() / "exported"


def jax_cache_dir() -> Path:
    """Where eqsat points JAX's persistent compilation cache (`use_jax_compilation_cache`)."""
    return cache_dir() / "jax"


def xla_kernels_dir() -> Path:
    """Where XLA's compiled GPU kernels are kept, a file per GPU kind (`driver.xla_kernel_cache`)."""
    return cache_dir() / "xla-kernels"


JAX_CACHE_SWITCH = "EQSAT_JAX_CACHE"  # "0" (or off, false, no): eqsat leaves JAX's compilation cache alone
_jax_cache_set_by_eqsat: str | None = None


def jax_cache_opted_out() -> bool:
    return os.environ.get(JAX_CACHE_SWITCH, "1").strip().lower() in ("0", "off", "false", "no")


def use_jax_compilation_cache() -> str | None:
    """Turn JAX's persistent compilation cache on in `jax_cache_dir()`, so that a new process loads the
    executables of a cached plan's stages instead of compiling them again; returns the folder JAX
    caches in (None: no persistent cache).

    Left alone: a folder the user gave JAX (`jax_compilation_cache_dir`, `JAX_COMPILATION_CACHE_DIR`,
    `set_cache_dir`), and everything when `EQSAT_JAX_CACHE=0`. Once on it is JAX's process-wide
    setting: every later compile of at least `jax_persistent_cache_min_compile_time_secs` (1 s unless
    the user changed it) is written there too. When `EQSAT_CACHE_DIR` has moved since eqsat set it,
    it follows. JAX reads its cache folder once per process: it is reset to take the new one.
    """
    global _jax_cache_set_by_eqsat
    import jax

    current = jax.config.jax_compilation_cache_dir
    if current and current != _jax_cache_set_by_eqsat:
        return current  # the user's own
    if jax_cache_opted_out() or not jax.config.jax_enable_compilation_cache:
        return current
    wanted = str(jax_cache_dir())
    if current != wanted:
        from jax.experimental.compilation_cache import compilation_cache

        compilation_cache.set_cache_dir(wanted)
        compilation_cache.reset_cache()
        _jax_cache_set_by_eqsat = wanted
    return wanted


# --- the key -------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """A digest of the Python source of `PACKAGES` (computed once per process)."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.blake2b(digest_size=16)
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def eqsat_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("eqsat")
    except metadata.PackageNotFoundError:
        return "unknown"


def schedule_description(rulesets) -> list:
    """The rule schedule as data: each stage's family name and iterations (a family's rules are in
    the source digest). Raises `Uncacheable` for a stage that runs anything but a family's ruleset.
    Family names (None: all) are described as given, without building their rulesets."""
    if rulesets is None or isinstance(rulesets, str):
        return ["families", rulesets]
    if isinstance(rulesets, (list, tuple)) and rulesets and all(isinstance(r, str) for r in rulesets):
        return ["families", list(rulesets)]
    from eqsat import rules
    from eqsat.schedule import as_schedule, schedule_of

    schedule = as_schedule(schedule_of(rulesets))
    stages = []
    for stage in schedule.stages:
        family = rules.family_ruleset(stage.name) if stage.name in rules.FAMILIES else None
        if family is None or str(stage.ruleset) not in (str(family), str(family.saturate())):
            raise Uncacheable(f"stage {stage.name!r} runs a ruleset that is not an eqsat rule family")
        stages.append([stage.name, str(stage.ruleset), stage.iterations])
    return [stages, schedule.rounds]


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _describe(value) -> str:
    """A process-independent text for a payload value (no object addresses)."""
    import numpy as np

    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_describe(v)}" for k, v in sorted(value.items(), key=lambda kv: repr(kv[0]))) + "}"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(_describe(v) for v in value) + ")"
    if isinstance(value, np.ndarray):
        return f"array({value.dtype}, {value.shape}, {hashlib.blake2b(value.tobytes(), digest_size=8).hexdigest()})"
    if callable(value) and hasattr(value, "__qualname__") and not hasattr(value, "bind"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    try:
        text = str(value) if hasattr(value, "eqns") or hasattr(value, "jaxpr") else repr(value)
    except Exception:  # noqa: BLE001 - an object with a broken repr: its type must do
        text = type(value).__qualname__
    return _ADDRESS.sub("", text)


def plan_key(program, *, device, rulesets, options: dict, shardings=()) -> str:
    """The digest naming `program`'s plan under these settings (see the module docstring)."""
    payload_index = {key: i for i, key in enumerate(program.payloads)}
    nodes, _, _ = encode_terms(program.outputs, payload_index, program.components)
    description = {
        "format": FORMAT,
        "eqsat": eqsat_version(),
        "source": source_digest(),
        "program": nodes,
        "outputs": len(program.outputs),
        "effect_outputs": program.effect_outputs,
        "payloads": [_describe(value) for value in program.payloads.values()],
        "shardings": [str(s) for s in shardings],
        "device": [type(device).__name__, dataclasses.asdict(device)],
        "schedule": schedule_description(rulesets),
        "options": sorted(options.items()),
    }
    text = json.dumps(description, sort_keys=True, default=repr)
    return hashlib.blake2b(text.encode(), digest_size=20).hexdigest()


def multi_device_shardings(leaves) -> list:
    """The shardings of `leaves` that span more than one device (the only ones a key records)."""
    found = []
    for leaf in leaves:
        sharding = getattr(leaf, "sharding", None)
        devices = getattr(sharding, "device_set", None)
        if devices is not None and len(devices) > 1:
            found.append(sharding)
    return found


# --- terms as data -------------------------------------------------------------------------------


def encode_terms(roots, payload_index: dict, components: dict | None = None):
    """The DAG under `roots` as JSON-able nodes `[op, *args]`, producers first: a term argument is
    its node's index, a payload key `{"payload": n}` (its lift-order number), anything else as is;
    a node with a `components` entry carries it as a last `{"component": path}`. Returns the nodes,
    the roots' indices and term -> index."""
    from eqsat.lang import OPS
    from eqsat.term import postorder

    index: dict = {}
    nodes = []
    for term in postorder(roots):
        sorts = OPS[term.op][1]
        node: list = [term.op]
        for arg, sort in zip(term.args, sorts):
            if sort in ("Tensor", "Expr", "TensorList"):
                node.append(index[id(arg)])
            elif sort == "String" and arg in payload_index:
                node.append({"payload": payload_index[arg]})
            else:
                node.append(arg)
        if components is not None and term in components:
            node.append({"component": components[term]})
        index[id(term)] = len(nodes)
        nodes.append(node)
    return nodes, [index[id(r)] for r in roots], {term_id: i for term_id, i in index.items()}


def decode_terms(nodes, payload_keys: list) -> list:
    """The terms of `encode_terms`'s nodes (interned: the same objects as any equal term)."""
    from eqsat.lang import OPS
    from eqsat.term import Term

    terms = []
    for node in nodes:
        op, raw = node[0], node[1:]
        sorts = OPS[op][1]
        if len(raw) == len(sorts) + 1 and isinstance(raw[-1], dict) and "component" in raw[-1]:
            raw = raw[:-1]
        args = []
        for arg, sort in zip(raw, sorts):
            if sort in ("Tensor", "Expr", "TensorList"):
                if not isinstance(arg, int) or not 0 <= arg < len(terms):
                    raise ValueError(f"node {len(terms)} ({op}): bad term reference {arg!r}")
                args.append(terms[arg])
            elif isinstance(arg, dict):
                args.append(payload_keys[arg["payload"]])
            else:
                args.append(arg)
        terms.append(Term(op, *args))
    return terms


# --- entries -------------------------------------------------------------------------------------


@dataclasses.dataclass
class Entry:
    """A stored plan: its root terms (as nodes), e-classes and components of its kernels, and the
    stats of the run that planned it."""

    key: str
    nodes: list
    roots: list
    classes: list            # [node index, e-class] of every term the extraction gave a class
    class_components: dict   # e-class (as a string) -> component path
    extractor: str
    stats: dict
    warnings: list           # [category name, message] of the saturation / extraction limits

    def plan(self, program, device):
        """The `Plan` of this entry for `program` (a fresh lift of the same function)."""
        from extract.plan import Plan

        terms = decode_terms(self.nodes, list(program.payloads))
        class_of = {terms[node]: cls for node, cls in self.classes}
        components = {int(cls): path for cls, path in self.class_components.items()}
        return Plan.build([terms[i] for i in self.roots], program=program, class_of=class_of,
                          class_components=components, device=device, extractor=self.extractor,
                          plan_passes=True)


def entry_of(key: str, program, extraction, class_components: dict, stats: dict, caught: list) -> Entry:
    """The entry storing `extraction`'s plan of `program`."""
    payload_index = {k: i for i, k in enumerate(program.payloads)}
    nodes, roots, index = encode_terms(extraction.terms, payload_index)
    classes = sorted([index[id(term)], cls] for term, cls in extraction.class_of.items() if id(term) in index)
    used = {cls for _, cls in classes}
    return Entry(key, nodes, roots, classes,
                 {str(cls): path for cls, path in class_components.items() if cls in used},
                 extraction.extractor, stats, caught)


def entry_path(key: str) -> Path:
    return plans_dir() / f"{key}.json"


def load(key: str) -> Entry | None:
    """The entry under `key`, None if there is none; one `PlanCacheWarning` when it cannot be read."""
    path = entry_path(key)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as error:
        warnings.warn(f"eqsat plan cache: cannot read {path} ({error}); planning again", PlanCacheWarning,
                      stacklevel=3)
        return None
    try:
        data = json.loads(raw.decode())
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else None
            raise ValueError(f"format {found!r}, expected {FORMAT}")
        if data.get("key") != key:
            raise ValueError("it is stored under another key")
        entry = Entry(**{f.name: data[f.name] for f in dataclasses.fields(Entry)})
        if not isinstance(entry.nodes, list) or not isinstance(entry.roots, list):
            raise ValueError("no node list")
    except (ValueError, KeyError, TypeError) as error:
        warnings.warn(f"eqsat plan cache: ignoring the unreadable entry {path} ({error}); planning again and "
                      f"rewriting it", PlanCacheWarning, stacklevel=3)
        return None
    return entry


def store(entry: Entry) -> Path:
    """Write `entry` atomically (a temporary file in the same folder, then `os.replace`)."""
    path = entry_path(entry.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"format": FORMAT, "eqsat": eqsat_version(), "created": time.time(), **dataclasses.asdict(entry)}
    text = json.dumps(data, separators=(",", ":"))
    fd, temporary = tempfile.mkstemp(prefix=f".{entry.key}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise
    return path


def plan_from_entry(entry: Entry, program, device):
    """`entry.plan(program, device)`; an entry that does not fit the program (hand-edited, or a
    digest collision) is reported like a corrupt one and gives None."""
    try:
        return entry.plan(program, device)
    except (ValueError, KeyError, TypeError, IndexError) as error:
        warnings.warn(f"eqsat plan cache: ignoring the entry {entry_path(entry.key)}, it does not rebuild "
                      f"({type(error).__name__}: {error}); planning again and rewriting it", PlanCacheWarning,
                      stacklevel=3)
        return None


# --- the command line ----------------------------------------------------------------------------


def info() -> dict:
    """Where the cache is, its entries and their bytes (JAX's compilation cache in `jax_cache_dir()` included)."""
    entries = sorted(plans_dir().glob("*.json")) if plans_dir().is_dir() else []
    exported = sorted(exported_dir().glob("*.bin")) if exported_dir().is_dir() else []
    compiled = [p for p in jax_cache_dir().rglob("*") if p.is_file()] if jax_cache_dir().is_dir() else []
    kernels = sorted(xla_kernels_dir().glob("*.pb")) if xla_kernels_dir().is_dir() else []
    return {"dir": str(cache_dir()), "plans": len(entries), "exported": len(exported),
            "executables": sum(p.name.endswith("-cache") for p in compiled), "kernel_files": len(kernels),
            "bytes": sum(p.stat().st_size for p in entries + exported + compiled + kernels)}


def clear() -> int:
    """Remove every plan entry (and stray temporary files), the exported stages, JAX's compilation
    cache in `jax_cache_dir()` and XLA's kernel files in `xla_kernels_dir()`; returns how many plan
    entries went."""
    removed = 0
    if plans_dir().is_dir():
        for path in plans_dir().iterdir():
            if path.suffix in (".json", ".tmp"):
                path.unlink(missing_ok=True)
                removed += path.suffix == ".json"
    if exported_dir().is_dir():  # the emitted stages of those plans
        for path in exported_dir().iterdir():
            if path.suffix in (".bin", ".tmp"):
                path.unlink(missing_ok=True)
    if jax_cache_dir().is_dir():  # their executables (JAX's own files; the folder is eqsat's)
        import shutil

        shutil.rmtree(jax_cache_dir(), ignore_errors=True)
    if xla_kernels_dir().is_dir():  # XLA's files (and its temporary ones); the folder is eqsat's
        import shutil

        shutil.rmtree(xla_kernels_dir(), ignore_errors=True)
    return removed


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m driver.cache", description="The eqsat plan cache.")
    parser.add_argument("command", choices=("info", "clear"))
    args = parser.parse_args(argv)
    if args.command == "info":
        found = info()
        print(f"{found['dir']}: {found['plans']} plans, {found['exported']} exported stages, "
              f"{found['executables']} compiled executables (JAX's cache), {found['kernel_files']} GPU kernel files "
              f"(XLA's), {found['bytes'] / 1e6:,.2f} MB")
    else:
        print(f"removed {clear()} plans from {cache_dir()}")
    return 0


def console(argv=None) -> int:
    """The `eqsat` console script: `eqsat cache info|clear`."""
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] != "cache":
        print("usage: eqsat cache {info,clear}", file=sys.stderr)
        return 2
    return main(args[1:])


if __name__ == "__main__":
    sys.exit(main())
