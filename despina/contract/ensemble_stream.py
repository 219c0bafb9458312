"""Ensembles with a decoupled step (one that answers a request with any number of responses), as Triton
runs them: each response of the decoupled step goes on through the steps after it, and each time those
make the ensemble's outputs that is one response of the ensemble. The ensemble is then decoupled itself
(control/ensembles.py marks its config so): its responses stream out from /generate_stream, and its last
word is the final flag alone, once the decoupled step has sent its last and every response is through.
The first error, of any step on any response, ends the request with it.

Despina serves the shapes in which each response can go through on its own: every step after a
decoupled step reads only what the ensemble's inputs, the steps before that decoupled step, it, and the
steps after it make, and every ensemble output comes from the decoupled step or a step after it
(`problem` says why another shape is refused). Such an ensemble is run by the gateway (gateway/ensemble.py):
a worker runs only ensembles that answer once. The run is contract/ensemble_run.py's.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .ensemble import Ensemble, Step


def after(ensemble: Ensemble, step: Step) -> set[int]:
    """The indices of the steps that read, directly or not, what `step` makes."""
    return _reach(ensemble, step, forward=True)


def before(ensemble: Ensemble, step: Step) -> set[int]:
    """The indices of the steps whose tensors `step` reads, directly or not."""
    return _reach(ensemble, step, forward=False)


def _reach(ensemble: Ensemble, start: Step, forward: bool) -> set[int]:
    makers = {tensor: s for s in ensemble.steps for _, tensor in s.outputs}
    found: set[int] = set()
    todo = [start]
    while todo:
        step = todo.pop()
        if forward:
            made = {t for _, t in step.outputs}
            nxt = [s for s in ensemble.steps if any(t in made for _, t in s.inputs)]
        else:
            nxt = [makers[t] for _, t in step.inputs if t in makers]
        for s in nxt:
            if s.index not in found:
                found.add(s.index)
                todo.append(s)
    return found


def problem(ensemble: Ensemble, decoupled: list[Step]) -> str:
    """Why the ensemble cannot follow each response of its `decoupled` steps on its own ('' when it can)."""
    makers = {tensor: s for s in ensemble.steps for _, tensor in s.outputs}
    for source in decoupled:
        later, earlier = after(ensemble, source), before(ensemble, source)
        fits = later | earlier | {source.index}
        for tensor in ensemble.outputs:
            maker = makers.get(tensor)
            if maker is not None and maker.index not in later | {source.index}:
                return (f"ensemble output '{tensor}' is made by {maker}, which is not after decoupled "
                        f"{source}: each response of the ensemble carries every output, made from one "
                        "response of it")
        for step in ensemble.steps:
            if step.index not in later:
                continue
            for _, tensor in step.inputs:
                maker = makers.get(tensor)
                if maker is not None and maker.index not in fits:
                    return (f"{step} reads '{tensor}' from {maker}, which is not after decoupled {source} "
                            "(nor before it): each response of that step goes through the steps after it on "
                            "its own")
    return ""
