"""/v2/health/ready: whether the server is ready, as Triton's --strict-readiness says."""
from __future__ import annotations

from ..contract.catalog import LOADED, UNLOADED
from .models import ModelView


def server_ready(view: ModelView, strict: bool) -> bool:
    """Connected, the control plane has published the catalog, and every model asked to load has settled.
    Strict (Triton's default): every version it loads is READY, so one still loading or one whose load
    failed keeps the server not ready, until the model loads (as Triton's, an unload of the model leaves a
    failed load's record, and the server not ready). Not strict: it has a READY version, or every version
    failed to load."""
    if not view.connected or not view.published:
        return False
    for name, m in view.models.items():
        e = m.entry
        if e.target != LOADED:  # unloaded, or scaled to zero: a request wakes it
            # (an ensemble's failures are its steps', not a load of its own)
            failed = m.ensemble is None and any(v in e.failed for v in e.versions)
            if strict and e.target == UNLOADED and failed:
                return False
            continue
        if e.state != "READY":  # its config cannot be used, or the store kept it from being read
            if strict:
                return False
            continue
        if m.ensemble is not None:  # ready when its steps are, which this loop looks at themselves
            continue
        versions = [v for v in e.versions if v not in e.retiring]
        if strict:  # every version READY on some live worker
            up = view.ready.get(name, set())
            if not all(v in up for v in versions):
                return False
        elif not view.ready.get(name) and not all(v in e.failed for v in versions):
            return False  # (not strict: one READY version, or every one failed)
    return True
