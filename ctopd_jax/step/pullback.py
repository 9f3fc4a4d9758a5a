"""A vjp carried from one compiled program to another.

The student step is compiled as three programs (step/grad.py) so that a new shape of the loss
rows recompiles only the objective, not the student's layers. The forward program returns
`jax.vjp`'s pullback as a `Pullback` pytree: the residuals the backward needs, less those that
are the forward's own arguments (the parameters, the token ids), which the backward program is
given again rather than receiving copies of them (a jit output is a new buffer).

The pullback's structure (its jaxpr) is the pytree's static aux data, the same object for
every call of one compiled forward, so the backward compiles once per forward program.
"""
from __future__ import annotations

import jax


@jax.tree_util.register_pytree_node_class
class Pullback:
    """`residuals`: the vjp's arrays that are not forward arguments; `layout`: (the vjp's
    treedef, and for each of its leaves ("argument", i) or ("residual", i))."""

    def __init__(self, residuals, layout):
        self.residuals, self.layout = list(residuals), layout

    def tree_flatten(self):
        return tuple(self.residuals), self.layout

    @classmethod
    def tree_unflatten(cls, layout, residuals):
        return cls(residuals, layout)

    def __call__(self, arguments, cotangent):
        """The vjp at `cotangent`, with the forward's `arguments` (the same pytree the forward
        named) standing in for the residuals that were arguments."""
        treedef, where = self.layout
        given = jax.tree.leaves(arguments)
        leaves = [given[i] if kind == "argument" else self.residuals[i] for kind, i in where]
        return jax.tree.unflatten(treedef, leaves)(cotangent)


def vjp(fn, primals, arguments):
    """(fn(primals), Pullback), inside a jitted forward program. `arguments`: that program's
    arguments (a pytree holding `primals` and whatever fn closes over), found among the
    residuals by identity."""
    out, f_vjp = jax.vjp(fn, primals)
    leaves, treedef = jax.tree.flatten(f_vjp)
    given = {id(x): i for i, x in enumerate(jax.tree.leaves(arguments))}
    residuals, where = [], []
    for leaf in leaves:
        if id(leaf) in given:
            where.append(("argument", given[id(leaf)]))
        else:
            where.append(("residual", len(residuals)))
            residuals.append(leaf)
    return out, Pullback(residuals, (treedef, tuple(where)))
