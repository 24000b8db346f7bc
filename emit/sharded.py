"""A plan run over a device mesh: each device runs the plan's kernels on its shard of the batch.

JAX is the distributed engine: this module only decides, from the shardings of the inputs, which
axes every device computes a shard of (`emit.axes`: the batch classes), rewrites the plan on the
per-device shapes (`emit.axes.local_terms`: the same kernels, smaller) and runs it per device
under the mechanism that fits where it is called:

- the inputs' shardings are visible while tracing (a mesh with `Explicit` axes, the default of
  `jax.make_mesh`; sharded arrays passed directly or under `jax.jit`): `jax.shard_map` over the
  mesh, the inputs first `jax.sharding.reshard`ed to what each device needs;
- they are not (a mesh with `Auto` axes under `jax.jit(in_shardings=...)`, or committed arrays):
  `custom_partitioning` of the whole plan, whose partition rule is the same decision, taken when
  XLA's partitioner knows the shardings;
- inside a user's `shard_map` (manual axes) the plan was traced on per-device shapes already and
  runs as is (its Pallas outputs declare how they vary: `emit.pallas.triton.pallas_call`).

A sharded input axis that is not batch-like for the plan (reduced, contracted, sliced, read by an
opaque primitive ...) is all-gathered before the plan runs: a `Collective` of the `Partitioning`,
priced like a kernel (`launch + received bytes / device.link_bandwidth`) and listed by
`report()`. The outputs are sharded along the batch classes they carry, replicated elsewhere:
what `jax.jit` gives for the same program.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from emit.axes import AxisClasses, local_terms, split_count
from eqsat.types import parse_type


@dataclass(frozen=True)
class Collective:
    """Communication the plan needs before its kernels run on shards."""

    kind: str            # "all-gather" (a non-batch axis made whole) or "reshard" (moved to another mesh axis)
    tensor: str          # the program input
    axis: int
    mesh_axes: tuple     # the mesh axes it was sharded over
    bytes: int           # received per device
    seconds: float       # modeled

    def __str__(self) -> str:
        return (f"{self.kind} {self.tensor} axis {self.axis} over {','.join(self.mesh_axes)}: "
                f"{self.bytes / 1e6:,.3f} MB per device, {self.seconds * 1e6:,.1f} µs")


@dataclass
class Partitioning:
    """How one plan runs on one mesh for one set of input shardings."""

    mesh_shape: dict                  # mesh axis name -> size
    in_specs: tuple                   # per program input: the PartitionSpec each device receives
    out_specs: tuple                  # per plan output
    collectives: list = field(default_factory=list)
    local: dict = field(default_factory=dict, repr=False)   # plan term -> term on per-device shapes
    split_classes: int = 0
    kernel_seconds: float = 0.0       # the per-device plan's kernels, modeled
    whole_seconds: float = 0.0        # the plan on one device, modeled

    @property
    def seconds(self) -> float:
        return sum(c.seconds for c in self.collectives)

    def summary(self) -> str:
        mesh = " x ".join(f"{name}={size}" for name, size in self.mesh_shape.items())
        ins = ", ".join(_spec_text(s) for s in self.in_specs)
        outs = ", ".join(_spec_text(s) for s in self.out_specs)
        lines = [f"mesh {mesh}: inputs ({ins}) -> outputs ({outs})",
                 f"  per device: {self.kernel_seconds * 1e6:,.1f} µs of kernels modeled (one device: "
                 f"{self.whole_seconds * 1e6:,.1f} µs); {len(self.collectives)} collectives"
                 + (f", {self.seconds * 1e6:,.1f} µs" if self.collectives else "")]
        lines += [f"  {c}" for c in self.collectives]
        return "\n".join(lines)


def _spec_text(spec: P) -> str:
    return "P(" + ", ".join(repr(e) if e is not None else "None" for e in spec) + ")"


def spec_axes(spec, ndim: int) -> tuple[tuple[str, ...], ...]:
    """A PartitionSpec as one tuple of mesh axis names per array axis."""
    entries = list(spec) + [None] * (ndim - len(spec))
    return tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries[:ndim])


def _entry(names: tuple) -> object:
    return None if not names else names[0] if len(names) == 1 else names


class ShardedPlan:
    """A plan's axis classes and the partitionings made of it, one per (mesh, input shardings).
    `leaves`: the terms a call passes values for (default the program's inputs; a prepared plan's
    per-call stage also takes its prepared tensors), `outputs`: the terms it returns."""

    def __init__(self, plan, device=None, leaves=None, outputs=None):
        from emit import kernel_calls
        from eqsat.cost import get_device

        self.plan = plan
        self.leaves = list(plan.program.inputs if leaves is None else leaves)
        self.outputs = list(plan.outputs if outputs is None else outputs)
        self.device = get_device(device or plan.device)
        calls = kernel_calls(plan)
        extra = [c.term for c in calls] + [h for c in calls for h in c.hosted] + self.leaves
        self.classes = AxisClasses(self.outputs, leaves=extra)
        self.partitionings: dict = {}

    def partition(self, mesh_shape: dict, input_axes) -> Partitioning:
        """The partitioning for inputs sharded as `input_axes` (per program input, per axis, a
        tuple of mesh axis names) on a mesh of `mesh_shape`; made once per distinct key."""
        key = (tuple(mesh_shape.items()), tuple(input_axes))
        if key not in self.partitionings:
            self.partitionings[key] = self._decide(dict(mesh_shape), input_axes)
        return self.partitionings[key]

    def _decide(self, mesh_shape: dict, input_axes) -> Partitioning:
        classes, inputs = self.classes, self.leaves
        assigned: dict = {}   # batch class -> mesh axes its axes are split over
        for term, axes in zip(inputs, input_axes):
            for axis, names in enumerate(axes):
                cls = classes.batch_class(term, axis) if names else None
                if cls is None or cls in assigned:
                    continue
                size = classes.shapes[term][axis]
                if size % split_count(mesh_shape, names) == 0 and not self._conflicts(cls, names, assigned):
                    assigned[cls] = names
        in_specs, collectives = [], []
        for term, axes in zip(inputs, input_axes):
            given = list(axes)
            kept = []
            for axis in range(len(classes.shapes[term])):
                cls = classes.batch_class(term, axis)
                names = assigned.get(cls, ()) if cls is not None else ()
                kept.append(names)
                had = given[axis] if axis < len(given) else ()
                if had and had != names:
                    collectives.append(self._collective("all-gather" if not names else "reshard", term, axis,
                                                        had, mesh_shape))
            in_specs.append(P(*[_entry(n) for n in kept]))
        out_specs = []
        for term in self.outputs:
            out_specs.append(P(*[_entry(assigned.get(classes.find((term, axis)), ()))
                                 for axis in range(len(classes.shapes[term]))]))
        splits = {cls: split_count(mesh_shape, names) for cls, names in assigned.items()}
        roots = [*self.outputs, *inputs]
        from emit import kernel_calls
        roots += [h for c in kernel_calls(self.plan) for h in (c.term, *c.hosted)]
        local = local_terms(roots, classes, splits)
        return Partitioning(mesh_shape, tuple(in_specs), tuple(out_specs), collectives, local, len(assigned),
                            self._seconds_per_device(local), self.plan.seconds)

    def _seconds_per_device(self, local: dict) -> float:
        """The plan's modeled time with every kernel on its per-device shapes (a loop as it is)."""
        from eqsat.cost.roofline import kernel_cost

        total = 0.0
        for kernel in self.plan.kernels:
            term = local.get(kernel.term, kernel.term)
            total += kernel.seconds if term is kernel.term or kernel.op == "Loop" else kernel_cost(term, self.device).seconds
        return total

    def _conflicts(self, cls, names, assigned) -> bool:
        """Whether some tensor of `cls` has another axis already split over one of `names`."""
        classes = self.classes
        taken = set(names)
        for key, axis in classes.members[cls]:
            for other in range(len(classes.shapes[key])):
                other_cls = classes.find((key, other))
                if other != axis and other_cls in assigned and taken & set(assigned[other_cls]):
                    return True
        return False

    def run(self, leaves, backend: str, interpret):
        return run_sharded(self, leaves, backend, interpret)

    def summary(self) -> str:
        return "\n".join(p.summary() for p in self.partitionings.values())

    def _collective(self, kind, term, axis, names, mesh_shape) -> Collective:
        ty = parse_type(term.ty)
        count = split_count(mesh_shape, names)
        received = ty.nbytes * (count - 1) // count
        seconds = self.device.launch_overhead + received / self.device.link_bandwidth
        name = term.args[0] if term.op == "Input" else f"prepared {term.op}"
        return Collective(kind, name, axis, tuple(names), received, seconds)


def run_local(sharded: "ShardedPlan", local: dict, leaves, backend: str, interpret):
    """The plan's outputs computed from per-device `leaves` by its kernels on per-device shapes."""
    from emit import kernel_calls
    from emit.pallas import EmitContext, KernelCall, run_kernels

    plan, program = sharded.plan, sharded.plan.program
    components = {local.get(term, term): path for term, path in program.components.items()}
    ctx = EmitContext({local[t]: leaf for t, leaf in zip(sharded.leaves, leaves)}, program.constants,
                      program.payloads, interpret=interpret, backend=backend, components=components)
    calls = [KernelCall(local[c.term], c.name, tuple(local[h] for h in c.hosted)) for c in kernel_calls(plan)]
    run_kernels(calls, ctx)
    return [ctx.value(local[t]) for t in sharded.outputs]


def manual_axes() -> frozenset:
    """The mesh axes a surrounding `shard_map` made manual (empty outside one)."""
    return frozenset(jax.sharding.get_abstract_mesh().manual_axes)


def explicit_mesh(leaves):
    """The (abstract) mesh the inputs' types carry (axes of type `Explicit`), or None."""
    for leaf in leaves:
        mesh = getattr(getattr(jax.typeof(leaf), "sharding", None), "mesh", None)
        if mesh is not None and not mesh.empty and jax.sharding.AxisType.Explicit in mesh.axis_types:
            return mesh
    return None


def run_sharded(sharded: "ShardedPlan", leaves, backend: str, interpret):
    """Run the plan on `leaves` (traced under the emitted function's jit) partitioned by their
    shardings (see the module docstring for which mechanism is used where)."""
    if jax.device_count() == 1 or manual_axes():
        return run_local(sharded, _identity(sharded), leaves, backend, interpret)
    mesh = explicit_mesh(leaves)
    if mesh is not None:
        axes = [spec_axes(jax.typeof(leaf).sharding.spec, jax.numpy.ndim(leaf)) for leaf in leaves]
        part = sharded.partition(dict(mesh.shape), axes)
        leaves = [jax.sharding.reshard(leaf, NamedSharding(mesh, spec)) for leaf, spec in zip(leaves, part.in_specs)]
        body = lambda *local_leaves: run_local(sharded, part.local, local_leaves, backend, interpret)  # noqa: E731
        return jax.shard_map(body, mesh=mesh, in_specs=part.in_specs, out_specs=list(part.out_specs),
                             check_vma=False)(*leaves)
    return _custom_partitioned(sharded, backend, interpret)(*leaves)


def _identity(sharded: "ShardedPlan") -> dict:
    from emit import kernel_calls
    from eqsat.term import postorder

    roots = [*sharded.outputs, *sharded.leaves] + [h for c in kernel_calls(sharded.plan) for h in (c.term, *c.hosted)]
    return {t: t for t in postorder(roots)}


def _custom_partitioned(sharded: ShardedPlan, backend: str, interpret):
    """The plan as one `custom_partitioning` op: XLA's partitioner asks it how to split itself."""
    from jax.experimental.custom_partitioning import ArrayMapping, SdyShardingRule, custom_partitioning

    plan = sharded.plan
    classes = sharded.classes
    identity = _identity(sharded)

    @custom_partitioning
    def whole(*leaves):
        return tuple(run_local(sharded, identity, leaves, backend, interpret))

    def decide(mesh, arg_shapes):
        axes = [spec_axes(getattr(s.sharding, "spec", P()), len(s.shape)) for s in arg_shapes]
        return sharded.partition(dict(mesh.shape), axes)

    def infer(mesh, arg_shapes, result_shape):
        part = decide(mesh, arg_shapes)
        return tuple(NamedSharding(mesh, spec) for spec in part.out_specs)

    def partition(mesh, arg_shapes, result_shape):
        part = decide(mesh, arg_shapes)

        def lower(*local_leaves):
            return tuple(run_local(sharded, part.local, local_leaves, backend, interpret))

        return (mesh, lower, tuple(NamedSharding(mesh, s) for s in part.out_specs),
                tuple(NamedSharding(mesh, s) for s in part.in_specs))

    factors, replicated = {}, []

    def mapping(term):
        names = []
        for axis in range(len(classes.shapes[term])):
            cls = classes.batch_class(term, axis)
            if cls is None:
                name = f"r{len(replicated)}"
                replicated.append(name)
            else:
                name = factors.setdefault(cls, f"b{len(factors)}")
            names.append(name)
        return ArrayMapping(*names)

    operands = tuple(mapping(t) for t in sharded.leaves)
    results = tuple(mapping(t) for t in sharded.outputs)
    whole.def_partition(partition=partition, infer_sharding_from_operands=infer,
                        sharding_rule=SdyShardingRule(operands, results, need_replication_factors=tuple(replicated)))
    return whole
