"""What a torch.export program (model.pt2) says of itself, read the same way by auto-complete and by its
load: its inputs, the names of its outputs, and how large a batch it takes.

Its inputs are its graph's, one per tensor, as torch names them (`x`; a dict argument's `inputs_a`, a
tuple's `pair_0`; a keyword-only argument by its name): a request's, in that order, are put back into the
arguments forward() takes.

Its outputs are named from what forward() returns: a dict of tensors by its keys; anything else (a tensor,
a tuple or list, nested ones, a dict holding them) as OUTPUT__<i> for each tensor in it, in the order
torch flattens it, which is the order of the program's graph outputs. Its batch dimension's bound is the
`max` of the torch.export Dim it was exported with: a larger batch fails the program's guard.
"""
from __future__ import annotations

from typing import Any

from ...contract.errors import ConfigError


def input_names(program: Any) -> list[str]:
    """The names a request's inputs bind to by name, in the program's order: forward()'s own argument
    names where each argument is one tensor (torch lower-cases its graph's names: `X` is `x` there, and a
    config naming `X` and `Mask` out of order was bound by its order), else the graph's flat names. A
    constant argument (a float the program was exported with) cannot be served."""
    flat = list(program.graph_signature.user_inputs)
    if not all(isinstance(name, str) for name in flat):
        raise ConfigError(f"the program's forward() was exported with a constant argument ({flat}): only "
                          "tensors can be a request's inputs; export it with every argument a tensor")
    signature = program.module_call_graph[0].signature if program.module_call_graph else None
    forward = list(signature.forward_arg_names) if signature is not None else []
    return forward if len(forward) == len(flat) else flat


def arguments(in_spec: Any, flat: list[Any]) -> tuple[list[Any], dict[str, Any]]:
    """The positional and keyword arguments of forward() holding `flat`, the program's inputs in order."""
    from torch.utils import _pytree

    args, kwargs = _pytree.tree_unflatten(flat, in_spec)
    return list(args), dict(kwargs)


def output_names(program: Any) -> list[str]:
    """The names of the program's outputs, in the order of its graph's outputs."""
    spec = program.call_spec.out_spec
    if spec is not None and spec.type is dict and all(c.is_leaf() for c in spec.children()):
        return [str(key) for key in spec.context]
    return [f"OUTPUT__{i}" for i in range(spec.num_leaves if spec is not None else 1)]


def results(value: Any) -> Any:
    """What the program's module returned, as the backend maps it onto the outputs: a dict of tensors as
    it is, anything else as the flat list of its tensors (a lone tensor as it is)."""
    from torch.utils import _pytree

    if type(value) is dict and all(_pytree.tree_is_leaf(v) for v in value.values()):  # (as output_names)
        return {str(key): v for key, v in value.items()}
    if _pytree.tree_is_leaf(value):
        return value
    return _pytree.tree_leaves(value)


def batch_bound(program: Any) -> int | None:
    """The largest batch the program takes (the smallest upper bound of its inputs' first dimensions that
    are dynamic), or None when it sets none."""
    bounds = []
    for node in program.graph.nodes:
        value = node.meta.get("val") if node.op == "placeholder" else None
        shape = getattr(value, "shape", None)
        if node.name not in program.graph_signature.user_inputs or not shape:
            continue
        first = shape[0]
        if isinstance(first, int):
            continue
        ranges = program.range_constraints.get(first.node.expr)
        upper: Any = getattr(ranges, "upper", None)
        if getattr(upper, "is_Integer", False):  # not torch's int_oo: no bound
            bounds.append(int(upper))
    return min(bounds) if bounds else None
