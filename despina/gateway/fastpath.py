"""The hot routes before the framework: POST .../infer and /fn/{model} go straight to their raw ASGI
endpoints (after the same path and credential checks as every route); everything else goes to the
Starlette application. On a tiny model Starlette's routing and middleware cost a sixth of a request.
"""
from __future__ import annotations

import logging
from typing import Any

from ..contract.errors import DespinaError
from . import http
from .auth import AuthPolicy, check_target, classify
from .http import Receive, Scope, Send

log = logging.getLogger("despina.gateway")

PREFIX, SUFFIX = "/v2/models/", "/infer"


class FastPath:
    def __init__(self, app: Any, infer: Any, fn: Any, policy: AuthPolicy) -> None:
        self.app, self.infer, self.fn, self.policy = app, infer, fn, policy
        self.state, self.routes = app.state, app.routes  # as the Starlette app's, for its users

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            endpoint, params = self._route(scope["path"])
            if endpoint is not None:
                try:
                    target = classify(scope["path"])
                    self.policy.check(target, scope["headers"])
                    check_target(target)
                except DespinaError as exc:
                    await http.send_error(send, exc)
                    return
                scope["path_params"] = params
                await endpoint(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _route(self, path: str) -> tuple[Any, dict[str, str]]:
        if path.startswith(PREFIX) and path.endswith(SUFFIX):
            parts = path[len(PREFIX):-len(SUFFIX)].split("/")
            if len(parts) == 1 and parts[0]:
                return self.infer, {"model": parts[0]}
            if len(parts) == 3 and parts[1] == "versions" and parts[0] and parts[2]:
                return self.infer, {"model": parts[0], "version": parts[2]}
        elif path.startswith("/fn/") and path.count("/") == 2 and len(path) > 4:
            return self.fn, {"model": path[4:]}
        return None, {}
