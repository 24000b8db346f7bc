"""Which axes of a plan are batch-like: each device can compute its shard of them alone.

Every axis of every tensor and expression in a plan is a node of a union-find; each op joins the
axes of its operands to the output axes they become (`Load` and elementwise ops: the same axis;
`Transpose`, `Broadcast`, shape-preserving `Reshape` axes; a matmul's batch and free axes, a conv's
batch axis, attention's batch, head and query axes; a reduction's kept axes). An axis class is
*blocked* when some op needs the whole axis on one device: a reduction or contraction over it, a
slice, concat, pad or iota along it, two axes of one tensor in the class, an opaque primitive, a
gather, a scatter or a loop (every axis they touch). A class that is not blocked and reaches an
output is a batch class: sharding its axes over mesh axes splits every kernel that touches it into
independent per-device kernels of the same kind on smaller shapes (`local_terms`).

Leaves that read no memory (`Lit`, `Acc`, `Iota`) are keyed by their occurrence (parent, argument
index), not by the interned term, so one literal shared by unrelated kernels joins nothing.

    classes = AxisClasses(plan.outputs)
    classes.batch_class(input_term, 0)     # the class id of the input's axis 0, or None if blocked
    terms = local_terms(plan.outputs, classes, {class_id: 4})   # old term -> term on per-device shapes
"""

from __future__ import annotations

import math

from eqsat.conv_params import ConvParams
from eqsat.term import Term, list_items, postorder
from eqsat.types import ints, parse_type, with_shape

OCCURRENCE_LEAVES = frozenset({"Lit", "Acc", "Iota"})
OPAQUE_KERNELS = frozenset({"Gather", "AssignDynamic", "AssignScatter", "Opaque", "Loop", "LoopArg", "Constant"})
SAME_SHAPE_EXPRS = frozenset({"Load", "Unary", "Binary", "Select"})


def child_key(parent: Term, index: int, child: Term):
    """The union-find key of `child` as argument `index` of `parent`."""
    return (parent, index) if child.op in OCCURRENCE_LEAVES else child


def shape_of(term: Term) -> tuple[int, ...]:
    return parse_type(term.ty).shape


class AxisClasses:
    """The axis classes of the terms reachable from `roots` (see the module docstring)."""

    def __init__(self, roots, leaves=()):
        self.parent: dict = {}
        self.shapes: dict = {}          # key -> shape
        self._blocked: list = []
        self.roots = list(roots)
        for term in postorder([*self.roots, *leaves]):
            if term.sort == "TensorList" or term.op in OCCURRENCE_LEAVES:
                continue
            self._add(term, term)
            for index, child in enumerate(term.args):
                if isinstance(child, Term) and child.sort != "TensorList":
                    self._add(child_key(term, index, child), child)
                    if child.op == "Iota":
                        self.block((term, index), child.args[0])
            self._relate(term)
        self.blocked = {self.find(node) for node in self._blocked}
        self.members: dict = {}
        for node in self.parent:
            self.members.setdefault(self.find(node), []).append(node)
        for cls, nodes in self.members.items():  # a class holding two axes of one tensor cannot be sharded
            keys = [key for key, _ in nodes]
            if len(set(keys)) != len(keys):
                self.blocked.add(cls)
        self.outputs = {self.find((root, axis)) for root in self.roots for axis in range(len(self.shapes[root]))}

    # --- union-find ---------------------------------------------------------------------------

    def _add(self, key, term: Term) -> None:
        if key not in self.shapes:
            shape = shape_of(term)
            self.shapes[key] = shape
            for axis in range(len(shape)):
                self.parent[(key, axis)] = (key, axis)

    def find(self, node):
        root = node
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[node] != root:
            self.parent[node], node = root, self.parent[node]
        return root

    def join(self, a, b) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[ra] = rb

    def block(self, key, axis) -> None:
        self._blocked.append((key, axis))

    def block_all(self, key) -> None:
        for axis in range(len(self.shapes[key])):
            self.block(key, axis)

    def same_axes(self, a, b) -> None:
        """`a` and `b` are read at the same index: axis i of one is axis i of the other."""
        if self.shapes[a] != self.shapes[b]:
            self.block_all(a)
            self.block_all(b)
            return
        for axis in range(len(self.shapes[a])):
            self.join((a, axis), (b, axis))

    # --- queries ------------------------------------------------------------------------------

    def class_of(self, key, axis):
        return self.find((key, axis))

    def batch_class(self, key, axis):
        """The class of `key`'s `axis` when it is a batch class, else None."""
        cls = self.find((key, axis))
        return cls if cls not in self.blocked and cls in self.outputs else None

    # --- what each op relates -----------------------------------------------------------------

    def _relate(self, t: Term) -> None:
        op = t.op
        kids = {i: child_key(t, i, a) for i, a in enumerate(t.args) if isinstance(a, Term) and a.sort != "TensorList"}
        if op in SAME_SHAPE_EXPRS or op == "Pointwise":
            for key in kids.values():
                self.same_axes(t, key)
        elif op in ("Lit", "Acc", "Input"):
            pass
        elif op == "Reshape":
            self._reshape(t, kids[0])
        elif op == "Transpose":
            for out_axis, in_axis in enumerate(ints(t.args[1])):
                self.join((t, out_axis), (kids[0], in_axis))
        elif op == "Broadcast":
            x = kids[0]
            for in_axis, out_axis in enumerate(ints(t.args[1])):
                if self.shapes[x][in_axis] == self.shapes[t][out_axis]:
                    self.join((x, in_axis), (t, out_axis))
        elif op in ("Slice", "DynamicSlice"):  # a reversed slice's tile i reads the operand's mirrored tile
            self._along(t, [kids[0]], t.args[1], always_block=op == "Slice" and t.args[4] < 0)
            if op == "DynamicSlice":
                self.block_all(kids[2])
        elif op == "Concat":
            self._along(t, [kids[0], kids[1]], t.args[2], always_block=True)
        elif op == "Pad":
            self._pad(t, kids[0], kids[1])
        elif op in ("Reduce", "RowReduce", "EpilogueReduce"):
            self._reduce(t, kids)
        elif op == "Matmul":
            self._matmul(t, kids)
        elif op == "Conv":
            self._conv(t, kids)
        elif op == "Attention":
            self._attention(t, kids)
        elif op == "AssignStatic":
            self.same_axes(t, kids[0])
            value = kids[2]
            for axis, size in enumerate(self.shapes[value]):
                if size == self.shapes[t][axis]:
                    self.join((value, axis), (t, axis))
                else:
                    self.block(value, axis)
                    self.block(t, axis)
        else:  # opaque to axis analysis (OPAQUE_KERNELS and anything new): every axis it touches is whole
            self._block_opaque(t)

    def _block_opaque(self, t: Term) -> None:
        self.block_all(t)
        for index, arg in enumerate(t.args):
            if not isinstance(arg, Term):
                continue
            if arg.sort != "TensorList":
                self.block_all(child_key(t, index, arg))
                continue
            inside = postorder(list_items(arg)) if t.op == "Loop" and index == 2 else list_items(arg)
            for node in inside:  # operands stay whole, and every term of a loop body
                if node.sort == "TensorList" or node.op in OCCURRENCE_LEAVES:
                    continue
                self._add(node, node)
                self.block_all(node)

    def _reshape(self, t: Term, x) -> None:
        """Row-major reshape: an axis survives when its size and the product before it are unchanged."""
        before = {}
        prefix = 1
        for axis, size in enumerate(self.shapes[x]):
            before[(prefix, size)] = axis
            prefix *= size
        prefix = 1
        kept_in = set()
        kept_out = set()
        for axis, size in enumerate(self.shapes[t]):
            in_axis = before.get((prefix, size))
            if in_axis is not None and size > 1:
                self.join((x, in_axis), (t, axis))
                kept_in.add(in_axis)
                kept_out.add(axis)
            prefix *= size
        for axis in range(len(self.shapes[x])):
            if axis not in kept_in:
                self.block(x, axis)
        for axis in range(len(self.shapes[t])):
            if axis not in kept_out:
                self.block(t, axis)

    def _along(self, t: Term, operands, axis: int, always_block: bool = False) -> None:
        """Ops acting along one `axis` (slice, concat): the other axes pass through."""
        for x in operands:
            for other in range(len(self.shapes[t])):
                if other != axis:
                    self.join((x, other), (t, other))
            if always_block or self.shapes[x][axis] != self.shapes[t][axis]:
                self.block(x, axis)
                self.block(t, axis)
            else:
                self.join((x, axis), (t, axis))

    def _pad(self, t: Term, x, value) -> None:
        config = [tuple(ints(part)) for part in t.args[2].split(";")] if t.args[2] else []
        for axis, widths in enumerate(config):
            if all(w == 0 for w in widths):
                self.join((x, axis), (t, axis))
            else:
                self.block(x, axis)
                self.block(t, axis)
        self.block_all(value)

    def _reduce(self, t: Term, kids) -> None:
        if t.op == "EpilogueReduce":
            body, axes, epilogue = kids[2], ints(t.args[3]), None
        elif t.op == "RowReduce":
            body, axes, epilogue = kids[1], (t.args[2],), kids[3]
        else:
            body, axes, epilogue = kids[1], ints(t.args[2]), kids[3]
        offset = 1 if t.args[1 if t.op == "EpilogueReduce" else 0] == "moments" else 0
        kept = [a for a in range(len(self.shapes[body])) if a not in axes]
        if len(self.shapes[t]) != len(kept) + offset:
            self.block_all(t)
            self.block_all(body)
        else:
            for out_axis, in_axis in enumerate(kept, start=offset):
                self.join((body, in_axis), (t, out_axis))
            for axis in axes:
                self.block(body, axis)
            for axis in range(offset):
                self.block(t, axis)
        if epilogue is not None:
            self.same_axes(epilogue, t)

    def _matmul(self, t: Term, kids) -> None:
        lhs, rhs, epilogue = kids[0], kids[1], kids[3]
        lc, rc, lb, rb = (ints(part) for part in t.args[2].split(";"))
        batch = len(lb)
        for i, (a, b) in enumerate(zip(lb, rb)):
            self.join((lhs, a), (t, i))
            self.join((rhs, b), (t, i))
        lhs_free = [a for a in range(len(self.shapes[lhs])) if a not in lc and a not in lb]
        rhs_free = [a for a in range(len(self.shapes[rhs])) if a not in rc and a not in rb]
        for j, a in enumerate(lhs_free):
            self.join((lhs, a), (t, batch + j))
        for j, a in enumerate(rhs_free):
            self.join((rhs, a), (t, batch + len(lhs_free) + j))
        for a, b in zip(lc, rc):
            self.block(lhs, a)
            self.block(rhs, b)
        self.same_axes(epilogue, t)

    def _conv(self, t: Term, kids) -> None:
        lhs, rhs, epilogue = kids[0], kids[1], kids[3]
        params = ConvParams.parse(t.args[2])
        self.block_all(rhs)
        for key, spec in ((lhs, params.lhs_spec), (t, params.out_spec)):
            for axis in spec[1:]:
                self.block(key, axis)
        if params.batch_groups == 1:
            self.join((lhs, params.lhs_spec[0]), (t, params.out_spec[0]))
        else:
            self.block(lhs, params.lhs_spec[0])
        self.same_axes(epilogue, t)

    def _attention(self, t: Term, kids) -> None:
        q, k, v, bias, epilogue = kids[0], kids[1], kids[2], kids[3], kids[5]
        if not all(len(self.shapes[key]) == 4 for key in (q, k, v, bias, t)):
            for key in (q, k, v, bias, t):
                self.block_all(key)
            return
        for axis in (0, 1):  # batch, heads
            for key in (q, k, v, bias):
                self.join((key, axis), (t, axis))
        self.join((q, 2), (t, 2))  # queries are independent
        self.join((bias, 2), (t, 2))
        self.join((v, 3), (t, 3))
        for key, axis in ((k, 2), (v, 2), (bias, 3), (q, 3), (k, 3)):  # keys and head_dim are contracted
            self.block(key, axis)
        self.same_axes(epilogue, t)


def local_shape(classes: AxisClasses, key, splits: dict) -> tuple[int, ...]:
    """`key`'s shape on one device: each axis of a split class divided by its split."""
    return tuple(size // splits.get(classes.find((key, axis)), 1) for axis, size in enumerate(classes.shapes[key]))


def local_terms(roots, classes: AxisClasses, splits: dict) -> dict:
    """Every term reachable from `roots` rewritten on per-device shapes: `splits` maps batch class
    ids to the number of shards of their axes. Terms no split touches map to themselves."""
    rewritten: dict = {}
    for term in postorder(roots):
        args = []
        for index, arg in enumerate(term.args):
            if not isinstance(arg, Term):
                args.append(arg)
            elif arg.op in OCCURRENCE_LEAVES:
                args.append(_with_local_type(arg, local_shape(classes, (term, index), splits)))
            else:
                args.append(rewritten[arg])
        if term.sort != "TensorList" and term.op not in OCCURRENCE_LEAVES:
            shape = local_shape(classes, term, splits)
            args[-1] = with_shape(term.ty, shape)
            if term.op == "Slice" and shape[term.args[1]] != classes.shapes[term][term.args[1]]:
                args[3] = shape[term.args[1]]  # a whole-axis slice of a split axis: stop at the shard's end
            if term.op == "DynamicSlice":
                args[3] = shape[term.args[1]]
        rewritten[term] = Term(term.op, *args)
    return rewritten


def _with_local_type(leaf: Term, shape) -> Term:
    return Term(leaf.op, *leaf.args[:-1], with_shape(leaf.ty, shape))


def split_count(mesh_shape: dict, mesh_axes) -> int:
    return math.prod(mesh_shape[name] for name in mesh_axes)
