"""What an unload takes along and what a load brings back, as Triton's graph of ensembles and the models
they call: an ensemble's unload_dependents takes the models it loaded as its steps, a model's unload takes
the ensembles that call it, and those load again once every model they call is loaded."""
from __future__ import annotations

from collections.abc import Mapping

from ..contract.catalog import UNLOADED, CatalogEntry
from ..contract.ensemble import called_by, is_ensemble


def steps_loaded_for(entries: Mapping[str, CatalogEntry], name: str) -> list[str]:
    """What unload_dependents unloads with a model, as Triton does: the models its ensemble graph calls
    (through nested ensembles too) that were loaded only as its steps, and that no other ensemble still
    loaded calls."""
    going = {name}
    todo = [name]
    while todo:
        e = entries.get(todo.pop())
        for step in sorted(called_by(e.config)) if e is not None and is_ensemble(e.config) else ():
            s = entries.get(step)
            if s is None or step in going or not s.step_only or s.target == UNLOADED:
                continue
            if any(step in called_by(o.config) for o in entries.values()
                   if o.name not in going and o.target != UNLOADED and is_ensemble(o.config)):
                continue  # another ensemble still calls it
            going.add(step)
            todo.append(step)
    return sorted(going - {name})


def ensembles_calling(entries: Mapping[str, CatalogEntry], name: str) -> list[str]:
    """Ensembles with a step that calls the model, and the ensembles that call those."""
    found: set[str] = set()
    todo = [name]
    while todo:
        callee = todo.pop()
        for e in entries.values():
            if e.name not in found and e.name != name and callee in called_by(e.config):
                found.add(e.name)
                todo.append(e.name)
    return sorted(found)


def unloaded_with(entries: Mapping[str, CatalogEntry], name: str, going: list[str]) -> list[str]:
    """The loaded ensembles that a model's unload takes along (those `going` aside): Triton's unloads each
    ensemble that calls a model it unloads, directly or through other ensembles."""
    return [d for d in ensembles_calling(entries, name)
            if d not in going and (e := entries[d]).state == "READY" and e.target != UNLOADED]


def back_with(entries: Mapping[str, CatalogEntry]) -> list[str]:
    """The ensembles unloaded with a model they call (`with_steps`) whose models are all loaded now, nested
    ones with those they call: Triton's loads each again once its models are back."""
    back: list[str] = []

    def loaded(m: str) -> bool:
        s = entries.get(m)
        return m in back or (s is not None and s.loaded)

    while True:
        more = [e.name for e in entries.values() if e.with_steps and e.target == UNLOADED
                and e.name not in back and all(loaded(m) for m in called_by(e.config))]
        if not more:
            return back
        back += sorted(more)
