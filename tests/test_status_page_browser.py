"""The control plane's status page, rendered by a real headless Chromium, shows numbers that move
under load. The screenshots are kept as test artifacts in build/artifacts/."""
from __future__ import annotations

import asyncio
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import orjson
import pytest

from .conftest import ROOT, Server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = ROOT / "build" / "artifacts"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
         "--disable-background-networking", "--disable-component-update"]

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed")


def load(url: str, seconds: float) -> None:
    async def run() -> None:
        async with httpx.AsyncClient(timeout=10) as client:
            end = time.monotonic() + seconds

            async def one() -> None:
                while time.monotonic() < end:
                    r = await client.post(url, content=orjson.dumps([0.1] * 256))
                    assert r.status_code == 200

            await asyncio.gather(*(one() for _ in range(8)))

    asyncio.run(run())


def cell(page: object, model: str, column: int) -> str:
    return page.locator(f"#models tr:has(td:text-is('{model}')) td").nth(column).inner_text()  # type: ignore[attr-defined]


def test_status_page_shows_live_numbers(serve: Callable[..., Server], example_repository: Path) -> None:
    playwright = pytest.importorskip("playwright.sync_api")
    server = serve(example_repository, wait_models=("mlp",))
    status_url = server.metrics_url.removesuffix("/metrics") + "/status"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 700})
            page.goto(status_url)
            page.wait_for_selector("#models td:text-is('mlp')", timeout=15_000)
            assert cell(page, "mlp", 2).startswith("READY")
            before = float(cell(page, "mlp", 5))
            page.screenshot(path=str(ARTIFACTS / "status-idle.png"))
            traffic = threading.Thread(target=load, args=(f"{server.url}/fn/mlp", 6.0))
            traffic.start()
            deadline = time.monotonic() + 20
            rate = before
            while time.monotonic() < deadline and rate <= 0:
                time.sleep(0.5)
                rate = float(cell(page, "mlp", 5))
            traffic.join()
            page.screenshot(path=str(ARTIFACTS / "status-under-load.png"))
            assert rate > before == 0.0                      # requests/s moved with the load
            assert cell(page, "mlp", 6) != "-"               # p50 latency now known
            assert page.locator("#models tr:has(td:text-is('mlp')) .bar").count() >= 1  # batch sizes
            assert "READY" in page.locator("#workers").inner_text()
        finally:
            browser.close()
