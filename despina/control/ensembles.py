"""Ensembles in the control plane: placed on no worker, they serve when the models they call do.

Each tick checks every ensemble against the models it calls and marks its versions failed, with the
step and the reason, while one is missing, unusable or does not fit its graph; `state` says what the
index and the load waiters see (READY, LOADING while a model it calls loads, UNAVAILABLE).
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from ..contract.catalog import IDLE, UNLOADED, CatalogEntry
from ..contract.ensemble import Ensemble, called_by, is_ensemble
from ..contract.errors import DespinaError
from ..contract.modelspec import ModelSpec
from .state import Catalog, Workers

log = logging.getLogger("despina.control")


class Ensembles:
    def __init__(self, catalog: Catalog, workers: Workers) -> None:
        self.catalog, self.workers = catalog, workers
        self.syncing = False  # the registry is being read: checked once the models they call are all in
        # parsed configs, by model: reused while the entry's config is the same object (entries are
        # replaced, never changed in place), so a tick parses only what changed
        self._specs: dict[str, tuple[dict[str, Any], ModelSpec]] = {}
        self._graphs: dict[str, tuple[dict[str, Any], Ensemble]] = {}

    def check(self) -> None:
        """Mark each ensemble's versions failed while a model it calls is missing, unusable or does not
        fit its graph (the reason says which step and why); clear the mark once it fits again."""
        if self.syncing:
            return
        for cache in (self._specs, self._graphs):
            for name in [n for n in cache if n not in self.catalog.entries]:
                del cache[name]
        for e in list(self.catalog.entries.values()):
            if e.state != "READY" or e.target == UNLOADED or not is_ensemble(e.config):
                continue  # (one unloaded with a model it calls is checked once it loads again)
            try:
                ensemble = self.graph(e)
                why = ensemble.cycle(self._parsed) or ensemble.problems(self._spec(e), self._usable) \
                    or self._pinned_versions(ensemble)
            except DespinaError as exc:
                why = exc.message
            failed = {v: why for v in e.versions} if why else {}
            config = e.config if why else self._decoupled_as_its_steps(e, ensemble)
            if failed != e.failed or config is not e.config:
                if failed != e.failed and why:
                    log.error("ensemble %s cannot serve: %s", e.name, why)
                elif failed != e.failed:
                    log.info("ensemble %s: every model it calls is there", e.name)
                self.catalog.put(replace(e, failed=failed, config=config))

    def _decoupled_as_its_steps(self, e: CatalogEntry, ensemble: Ensemble) -> dict[str, Any]:
        """The ensemble's config, decoupled when a step's model is (several responses to a request, as
        Triton marks such an ensemble; contract/ensemble_stream.py), and not when none is."""
        decoupled = any(self._streams(s.model) for s in ensemble.steps)
        policy = e.config.get("model_transaction_policy") or {}
        if bool(policy.get("decoupled", False)) == decoupled:
            return e.config
        return {**e.config, "model_transaction_policy": {**policy, "decoupled": decoupled}}

    def _streams(self, name: str, depth: int = 0) -> bool:
        """Whether a model answers a request with several responses: it is decoupled, or an ensemble
        that calls one (followed through the configs, so that an ensemble over an ensemble is marked in
        the same tick as the one it calls, whichever comes first)."""
        spec, _ = self._usable(name)
        if spec is None or depth > 8:
            return False
        if is_ensemble(spec.config):
            return any(self._streams(m, depth + 1) for m in called_by(spec.config))
        return spec.decoupled

    def _parsed(self, name: str) -> tuple[ModelSpec | None, str]:
        """A model's spec whenever its config could be read, failed or not (cycles are in the configs:
        through _usable, each ensemble of one would name the other's failure, nested one deeper each tick)."""
        e = self.catalog.get(name)
        return (self._spec(e), "") if e is not None and e.state == "READY" else (None, "")

    def _usable(self, name: str) -> tuple[ModelSpec | None, str]:
        e = self.catalog.get(name)
        if e is None:
            return None, f"model '{name}' is not in the repository (or not loaded)"
        if e.state != "READY":
            return None, f"model '{name}' is unavailable: {e.reason}"
        if e.target == UNLOADED:
            return None, f"model '{name}' is unloaded"
        current = [v for v in e.versions if v not in e.retiring]
        if current and all(v in e.failed for v in current):
            return None, f"model '{name}' failed to load: {e.failed[current[-1]]}"
        return self._spec(e), ""

    def _spec(self, e: CatalogEntry) -> ModelSpec:
        cached = self._specs.get(e.name)
        if cached is None or cached[0] is not e.config:
            cached = self._specs[e.name] = (e.config, ModelSpec.from_config(e.config))
        return cached[1]

    def graph(self, e: CatalogEntry) -> Ensemble:
        """The ensemble's steps (ConfigError when its graph cannot run)."""
        cached = self._graphs.get(e.name)
        if cached is None or cached[0] is not e.config:
            cached = self._graphs[e.name] = (e.config, Ensemble.from_config(e.config))
        return cached[1]

    def _pinned_versions(self, ensemble: Ensemble) -> str:
        """Why a step that names a version cannot call it ('' when every one can)."""
        for step in ensemble.steps:
            model = self.catalog.get(step.model)
            if step.version is not None and model is not None and step.version not in model.versions:
                loaded = ", ".join(map(str, model.versions)) or "none"
                return (f"{step}: version {step.version} of model '{step.model}' is not loaded (its "
                        f"version_policy loads {loaded})")
        return ""

    def state(self, e: CatalogEntry, v: int, depth: int = 0) -> tuple[str, str]:
        """(READY, LOADING or UNAVAILABLE, why) for an ensemble's version, from its steps' models."""
        if v in e.failed:
            return "UNAVAILABLE", e.failed[v]
        if e.target == UNLOADED:
            return "UNAVAILABLE", "unloaded"
        loading: list[str] = []
        idle: list[str] = []
        unloaded: list[str] = []
        for step in self.graph(e).steps:
            model = self.catalog.get(step.model)
            if model is None:
                return "UNAVAILABLE", f"{step}: the model is not in the repository"
            if depth > 8:
                return "UNAVAILABLE", f"{step}: ensembles nested more than 8 deep"
            if self._step_ready(model, step.version, depth):
                continue
            (idle if model.target == IDLE else unloaded if model.target == UNLOADED else loading).append(
                step.model)
        if unloaded:
            return "UNAVAILABLE", (f"model(s) {', '.join(sorted(set(unloaded)))} it calls were unloaded; it "
                                   "serves again once they are loaded")
        if loading:
            return "LOADING", f"waiting for model(s) {', '.join(sorted(set(loading)))} to load"
        cold = [m for n in sorted(set(idle)) if (m := self.catalog.get(n)) is not None and m.cold_error]
        if cold:  # (a request tries it again once its backoff is over, as one for the model does)
            first = cold[0]
            return "UNAVAILABLE", f"model '{first.name}' it calls failed its cold start: {first.cold_error}"
        if idle:
            return "UNAVAILABLE", (f"idle: model(s) {', '.join(sorted(set(idle)))} were unloaded for want "
                                   "of requests; the next request loads them")
        return "READY", ""

    def _step_ready(self, model: CatalogEntry, version: int | None, depth: int) -> bool:
        versions = [version] if version is not None else [v for v in model.versions if v not in model.failed]
        if is_ensemble(model.config):
            return any(self.state(model, v, depth + 1)[0] == "READY" for v in versions)
        return any(self.workers.ready_on(model.name, v) for v in versions)
