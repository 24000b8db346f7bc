"""`Program`: a lifted function, the data that crosses from `eqsat.lift` to the e-graph.

A program is a term DAG plus the side tables its terms refer to by key:

- `inputs`: one `Input("arg{i}", ty)` per flattened (non-static) argument leaf, in order;
- `outputs`: one Tensor term per flattened output leaf;
- `constants`: `Constant(key, ty)` -> the literal array;
- `payloads`: what `Opaque`/`Gather`/`AssignScatter`/`Loop` keys need to run (see `eqsat.lift`);
- `components`: kernel term -> the named-scope path it was traced under (`""` if none);
- `in_tree`/`out_tree`: the pytree structures of the arguments, `(dynamic args, dynamic kwargs)`,
  and of the results;
- `static_argnums`/`static_argnames`: the arguments closed over when tracing (see `eqsat.lift.lift`);
- `warnings`: messages about primitives lifted as `Opaque`;
- `argument_names`: the function's parameter names of the dynamic positional arguments, in order
  (what drawings and reports call the inputs; `args[2]` for a `*args` one);
- `effect_outputs`: how many of the last `outputs` are effect tokens, not results (the final token
  of the effects the function runs, see `eqsat.lift`); extraction computes them, `results` drops them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from eqsat.lang import KERNEL_OPS
from eqsat.term import Term, postorder


@dataclass
class Program:
    inputs: list[Term]
    outputs: list[Term]
    constants: dict[str, np.ndarray] = field(default_factory=dict)
    payloads: dict[str, object] = field(default_factory=dict)
    components: dict[Term, str] = field(default_factory=dict)
    in_tree: object = None
    out_tree: object = None
    static_argnums: tuple[int, ...] = ()
    static_argnames: tuple[str, ...] = ()
    warnings: list[str] = field(default_factory=list)
    effect_outputs: int = 0
    argument_names: tuple[str, ...] = ()  # the function's names of its dynamic positional arguments

    def kernel_terms(self) -> list[Term]:
        """Kernel Tensor terms reachable from the outputs (loop bodies included), in postorder."""
        return [term for term in postorder(self.outputs) if term.op in KERNEL_OPS]

    def naive_kernel_count(self) -> int:
        """The number of kernels of the lifted plan (one per kernel term)."""
        return len(self.kernel_terms())

    def environment(self, *args, **kwargs) -> dict[str, object]:
        """Input name -> argument leaf, for the arguments of the lifted function (static ones may be
        included or left out)."""
        import jax

        if self.static_argnums and self.in_tree is not None:
            dynamic_args = jax.tree_util.treedef_children(self.in_tree)[0]
            if len(args) != len(jax.tree_util.treedef_children(dynamic_args)):
                args = tuple(arg for i, arg in enumerate(args) if i not in self.static_argnums)
        kwargs = {name: value for name, value in kwargs.items() if name not in self.static_argnames}
        leaves, tree = jax.tree_util.tree_flatten((tuple(args), kwargs))
        if self.in_tree is not None and tree != self.in_tree:
            raise TypeError(f"arguments {tree} do not match the program's {self.in_tree}")
        if len(leaves) != len(self.inputs):
            raise TypeError(f"{len(leaves)} argument leaves for {len(self.inputs)} inputs")
        return {term.args[0]: leaf for term, leaf in zip(self.inputs, leaves)}

    def results(self, values: list):
        """The output leaves `values` (effect tokens included or not) in the function's output structure."""
        import jax

        values = list(values)
        if self.effect_outputs and len(values) == len(self.outputs):
            values = values[:len(values) - self.effect_outputs]
        return values if self.out_tree is None else jax.tree_util.tree_unflatten(self.out_tree, values)

    def component(self, term: Term) -> str:
        """The full named-scope path of `term` (`"a/a.b/a.b.c"`), `""` if unknown."""
        return self.components.get(term, "")


def module_path(component: str) -> str:
    """The innermost scope of a component path: `"down_blocks.0/down_blocks.0.resnets.1"` ->
    `"down_blocks.0.resnets.1"` (sd15 names every scope by its full dotted module path)."""
    return component.rsplit("/", 1)[-1]
