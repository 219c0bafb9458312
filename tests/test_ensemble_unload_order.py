"""Loads and unloads of an ensemble and of the models it calls, at once, in explicit mode: Triton runs them one
at a time, so each ends as if the other had come first or last, never in a mix of both (control/commands.py,
control/dependents.py)."""
from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

from despina import clock
from despina.contract.catalog import LOADED, UNLOADED
from despina.control.plane import ControlPlane
from despina.redis_client import connect
from despina.settings import Settings


def small_repository(example_repository: Path, tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    for name in ("mlp", "classify_post", "mlp_classify"):
        shutil.copytree(example_repository / name, repo / name)
    return repo


async def test_an_ensembles_load_waiting_as_a_model_it_calls_is_unloaded_succeeds(
        example_repository: Path, tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    """The ensemble's load waits for its models (no worker runs here); an unload of one of them takes the
    ensemble along: the load succeeded, and then the unload took it, as Triton's order has it. The load
    answered 503 "model 'mlp_classify' is unloaded"."""
    client = connect(redis_url)
    plane = ControlPlane(Settings(model_repository=str(small_repository(example_repository, tmp_path)),
                                  key_prefix=key_prefix, model_control_mode="explicit"), client)
    try:
        loading = asyncio.ensure_future(plane.commands.load("mlp_classify", {}, 5, wait=True))
        for _ in range(100):  # until the load has put it in the catalog, and waits
            if (e := plane.catalog.get("mlp_classify")) is not None and e.target == LOADED:
                break
            await asyncio.sleep(0.05)
        unloading = asyncio.ensure_future(plane.commands.unload("mlp", False, 0.3))
        await asyncio.gather(unloading, return_exceptions=True)  # (no worker: it waits out its time)
        await plane.lifecycle._answer(clock.now())  # a tick answers the waiters
        await loading
        e = plane.catalog.get("mlp_classify")
        assert e is not None and e.target == UNLOADED and e.with_steps
    finally:
        await client.aclose()
