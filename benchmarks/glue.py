"""`python -m benchmarks.glue DUMP_DIR`: the XLA glue launches of an emitted program, one line each,
read from XLA's dump of its per-call executable (`benchmarks.kernels --dump DIR` keeps it under
`DIR/<component>/eqsat/`): what each fusion or copy computes, where its operands come from and which
kernel reads its result.

Per launch (`*.thunk_metadata.txt` names each thunk's HLO instruction, in execution order):

- `class`: the fusion's name without its number (`loop_slice_fusion`, `input_concatenate_fusion`...),
  the ops in its fused computation, and the JAX op it came from (its `op_name`'s last scope: `stack`,
  `pad`, `slice`, `gather`, `transpose`...) under the plan kernel's scope (`<component>:<kind>`);
- `from`: its sources through views (bitcasts, tuple elements): `param` (a parameter or prepared
  tensor of the per-call stage: the weights), `input` (a per-call argument), `const`, `mosaic`,
  `triton`, or `glue` (another fusion); `params only` when everything it reads traces back to
  parameters and constants: per-call work the prepare stage could do once;
- `to`: the kernels that read its result (Mosaic or Triton custom calls, by their scope), or
  `glue` / `output`.

    python -m benchmarks.glue /work/s14/dump/unet/eqsat > breakdown.txt
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import re
import sys
from pathlib import Path

from measure.xla_target import split_instruction, split_shape

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(?P<name>[\w.\-]+) = (?P<rest>.*)$")
_VIEWS = frozenset({"bitcast", "get-tuple-element", "tuple"})
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"calls=%([\w.\-]+)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')


@dataclasses.dataclass
class Instruction:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attributes: str

    @property
    def op_name(self) -> str:
        found = _OP_NAME.search(self.attributes)
        return found.group(1) if found else ""

    @property
    def scope(self) -> str:
        """The plan kernel's scope (`<component>:<kind>`) and the JAX op, from `op_name`."""
        parts = [p for p in self.op_name.split("/") if not p.startswith("jit(")]
        return "/".join(parts)

    @property
    def target(self) -> str:
        found = _TARGET.search(self.attributes)
        return found.group(1) if found else ""


@dataclasses.dataclass
class GlueLaunch:
    index: int            # thunk id
    name: str             # HLO instruction
    kind: str             # thunk kind (kCustomKernel, kCopy)
    shape: str
    fused_ops: tuple[str, ...]
    scope: str
    sources: dict[str, list[str]]   # kind -> names
    consumers: list[str]
    params_only: bool

    @property
    def family(self) -> str:
        return re.sub(r"\.\d+$", "", self.name)

    @property
    def jax_op(self) -> str:
        return self.scope.rsplit("/", 1)[-1] if "/" in self.scope else self.scope

    @property
    def kernel_scope(self) -> str:
        head = self.scope.split("/", 1)[0]
        return head


def read_module(text: str) -> tuple[dict[str, Instruction], dict[str, list[str]], dict[str, list[str]]]:
    """(ENTRY instructions by name, fused computation -> its opcodes, name -> users in ENTRY)."""
    entry: dict[str, Instruction] = {}
    computations: dict[str, list[str]] = {}
    current, in_entry = None, False
    for line in text.splitlines():
        if line.startswith("ENTRY "):
            in_entry, current = True, None
            continue
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            in_entry = False
            current = line.split(" ", 1)[0].lstrip("%")
            computations[current] = []
            continue
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        shape, after = split_shape(match["rest"])
        opcode, operands, attributes = split_instruction(after)
        if in_entry:
            entry[match["name"]] = Instruction(match["name"], shape, opcode, operands, attributes)
        elif current is not None:
            computations[current].append(opcode)
    users: dict[str, list[str]] = collections.defaultdict(list)
    for inst in entry.values():
        for operand in inst.operands:
            users[operand].append(inst.name)
    return entry, computations, users


def read_thunks(text: str) -> list[tuple[int, str, str]]:
    """`(thunk id, HLO instruction, thunk kind)` in execution order from `*.thunk_metadata.txt`."""
    out = []
    for block in text.split("thunk_metadata {")[1:]:
        name = re.search(r'profile_annotation: "([^"]*)"', block)
        ident = re.search(r"thunk_id: (\d+)", block)
        kind = re.search(r'thunk_kind: "([^"]*)"', block)
        if name and ident and kind:
            out.append((int(ident.group(1)), name.group(1), kind.group(1)))
    return out


def _source_kind(inst: Instruction) -> str:
    if inst.opcode == "parameter":
        return "input" if re.match(r"args_[1-9]", inst.name) else "param"
    if inst.opcode == "constant":
        return "const"
    if inst.opcode == "custom-call":
        return "mosaic" if inst.target.startswith("mosaic") else "triton" if "triton" in inst.target else inst.target
    if inst.opcode in ("fusion", "copy"):
        return "glue"
    return inst.opcode


def _kernel_label(inst: Instruction) -> str:
    head = inst.scope.split("/", 1)[0]
    return head or inst.name


def glue_launches(dump: Path) -> list[GlueLaunch]:
    """The glue launches (XLA fusions and copies) of the per-call executable dumped in `dump`."""
    metas = sorted(dump.glob("*jit_emitted_per_call*thunk_metadata.txt")) or sorted(
        dump.glob("*thunk_metadata.txt"), key=lambda path: path.stat().st_size)
    meta = metas[-1]  # the per-call executable's, else the largest module's
    module = meta.name[:-len("thunk_metadata.txt")]
    hlo = next(iter(sorted(dump.glob(f"{module}*gpu_after_optimizations.txt"))))
    entry, computations, users = read_module(hlo.read_text(errors="replace"))
    params_only_memo: dict[str, bool] = {}

    def sources(name: str, seen=None) -> list[Instruction]:
        inst = entry[name]
        if inst.opcode in _VIEWS:
            return [s for operand in inst.operands for s in sources(operand)]
        return [inst]

    def params_only(name: str) -> bool:
        if name not in params_only_memo:
            inst = entry[name]
            kind = _source_kind(inst)
            if inst.opcode in _VIEWS or kind == "glue":
                params_only_memo[name] = all(params_only(o) for o in inst.operands)
            else:
                params_only_memo[name] = kind in ("param", "const")
        return params_only_memo[name]

    def consumers(name: str) -> list[str]:
        out = []
        for user in users.get(name, []):
            inst = entry[user]
            if inst.opcode in _VIEWS:
                out.extend(consumers(user))
            else:
                kind = _source_kind(inst)
                out.append(f"{kind}:{_kernel_label(inst)}" if kind in ("mosaic", "triton") else f"{kind}:{user}")
        if not users.get(name):
            out.append("output")
        return out

    launches = []
    for index, name, kind in read_thunks(meta.read_text(errors="replace")):
        inst = entry.get(name)
        if inst is None or inst.opcode not in ("fusion", "copy"):
            continue
        called = _CALLS.search(inst.attributes)
        ops = computations.get(called.group(1), []) if called else [inst.opcode]
        fused = tuple(sorted(set(ops) - {"parameter", "bitcast", "constant"}))
        by_kind: dict[str, list[str]] = collections.defaultdict(list)
        for operand in inst.operands:
            for src in sources(operand):
                k = _source_kind(src)
                by_kind[k].append(_kernel_label(src) if k in ("mosaic", "triton") else src.name)
        launches.append(GlueLaunch(index, name, kind, inst.shape.split("{")[0], fused, inst.scope, dict(by_kind),
                                   consumers(name), all(params_only(o) for o in inst.operands)))
    return launches


def _classify(launch: GlueLaunch) -> str:
    """What the launch is for, in the terms of the templates (`emit/mosaic/`)."""
    op, to = launch.jax_op, " ".join(launch.consumers)
    if launch.params_only:
        return "parameters only (prepare stage)"
    if op == "stack":
        return "conv prologue vector table (conv_halo.vector_tables)"
    if op == "slice" and "mosaic" in " ".join(launch.sources):
        return "padded Mosaic output sliced back"
    if op == "pad":
        return "operand padded for a Mosaic kernel"
    return f"{op}"


def summary(launches: list[GlueLaunch]) -> str:
    lines = [f"{len(launches)} glue launches (XLA fusions and copies of the per-call executable)", ""]
    by_class = collections.Counter(_classify(l) for l in launches)
    lines.append("by purpose:")
    lines += [f"  {n:4d}  {what}" for what, n in by_class.most_common()]
    lines.append("")
    lines.append("by fusion family / JAX op / scope kind / sources -> consumers:")
    keyed = collections.Counter()
    for l in launches:
        kind = l.kernel_scope.rsplit(":", 1)[-1] if ":" in l.kernel_scope else l.kernel_scope
        src = "+".join(sorted(l.sources))
        dst = "+".join(sorted({c.split(":", 1)[0] + (":" + c.split(":", 2)[-1] if c.startswith(("mosaic", "triton"))
                                                      and ":" in c.split(":", 1)[1] else "") for c in l.consumers}))
        keyed[(l.family, l.jax_op, kind, src, dst, l.params_only)] += 1
    for (family, op, kind, src, dst, only), n in sorted(keyed.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {n:4d}  {family:32s} {op:12s} {kind:10s} {src:24s} -> {dst}{'  [params only]' if only else ''}")
    lines.append("")
    lines.append("each launch (thunk, instruction, shape, fused ops, scope, sources, consumers):")
    for l in launches:
        src = "; ".join(f"{k}: {', '.join(v[:3])}{'...' if len(v) > 3 else ''}" for k, v in l.sources.items())
        lines.append(f"  {l.index:03d} {l.name:34s} {l.shape:22s} [{','.join(l.fused_ops)}] {l.scope}"
                     f"\n        from {src}\n        to {', '.join(l.consumers)}{'  [params only]' if l.params_only else ''}")
    return "\n".join(lines)


def compare(launches: list[GlueLaunch], rows: list[dict]) -> str:
    """Per plan kernel, the glue the model charges (`modeled_glue` of a `benchmarks.kernels` row) beside
    the glue launches whose named scope is that kernel's, grouped by pattern."""
    counted: dict[str, list[str]] = collections.defaultdict(list)
    for l in launches:
        counted[l.kernel_scope].append(f"{l.family}/{l.jax_op}")
    modeled_by_name: dict[str, list[str]] = collections.defaultdict(list)
    for row in rows:  # kernels that share a name share a scope: compared together
        modeled_by_name[row["name"]] += row.get("modeled_glue") or []
    patterns = collections.Counter()
    names = set(modeled_by_name)
    for name, modeled in modeled_by_name.items():
        found = tuple(sorted(counted.get(name, [])))
        if modeled or found:
            patterns[(name.rsplit(":", 1)[-1], tuple(sorted(modeled)), found)] += 1
    lines = [f"modeled {sum(len(r.get('modeled_glue') or []) for r in rows)} glue launches, counted {len(launches)}",
             "per kernel name (kernels of one name together): n x (modeled) vs (counted in its scope):"]
    for (kind, modeled, found), n in sorted(patterns.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {n:3d} x {kind:9s} modeled {len(modeled)} {list(modeled)}\n"
                     f"        counted {len(found)} {list(found)}")
    by_kind = collections.defaultdict(lambda: [0, 0])
    for (kind, modeled, found), n in patterns.items():
        by_kind[kind][0] += n * len(modeled)
        by_kind[kind][1] += n * len(found)
    lines.append("by kernel kind, modeled / counted: " + ", ".join(f"{k} {m} / {c}" for k, (m, c) in by_kind.items()))
    orphans = {scope: found for scope, found in counted.items() if scope not in names}
    for scope, found in orphans.items():
        lines.append(f"  in no plan kernel's scope: {scope}: {found}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dump", type=Path, help="XLA's dump of the emitted per-call program")
    parser.add_argument("--report", type=Path, default=None,
                        help="a benchmarks.kernels JSON report of the same program: compare the modeled glue")
    parser.add_argument("--component", default="unet")
    args = parser.parse_args(argv)
    launches = glue_launches(args.dump)
    if args.report is not None:
        import json

        rows = json.loads(args.report.read_text())["components"][args.component]["kernels"]
        print(compare(launches, rows))
        print()
    print(summary(launches))
    return 0


if __name__ == "__main__":
    sys.exit(main())
