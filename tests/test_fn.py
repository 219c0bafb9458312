"""The function URL, `POST /fn/{model}[/versions/{version}]`, as a developer with curl calls it."""
from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from .conftest import Server, module_server
from .control_support import ROW, expected, mlp_folder


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Server]:
    repo = tmp_path_factory.mktemp("fn")
    mlp_folder(repo, "mlp", {1: 0, 2: 1}, extra="version_policy { all { } }")
    yield from module_server(repo, tmp_path_factory, redis_url, ("mlp",))


def test_a_version_is_called_by_its_path_as_in_v2(server: Server) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for path, seed in (("/fn/mlp", 1), ("/fn/mlp/versions/2", 1), ("/fn/mlp/versions/1", 0)):
            r = http.post(path, json=ROW)
            assert r.status_code == 200, (path, r.text)
            np.testing.assert_allclose(r.json()["y"], expected(seed), rtol=1e-5, err_msg=path)
        for path, status, words in (("/fn/mlp/versions/3", 404, "version 3"),
                                    ("/fn/mlp/versions/x", 400, "version"),
                                    ("/fn/nope/versions/1", 404, "unknown model")):
            r = http.post(path, json=ROW)
            assert r.status_code == status and words in r.json()["error"], (path, r.text)
        assert http.get("/fn/mlp/versions/1").headers["allow"] == "POST"
