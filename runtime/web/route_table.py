"""What the app serves at a path: the route template (metrics' ``route`` label) and the methods
(a 405's ``Allow``), read from the app's own router before the request reaches it.

Two things the router leaves wrong for a caller outside it. Its 405 is the first matching route's
(Starlette answers the first ``Match.PARTIAL``): ``PUT /sdapi/v1/options``, served by a GET and a
POST route, listed GET alone. And FastAPI (0.16x) keeps an included router nested, so the route
it puts in ``scope["route"]`` is the sub-router's own, its template without the prefixes it was
included under (``/options`` for ``/sdapi/v1/options``); FastAPI's own routes (``/openapi.json``)
set none. Here every route is walked as FastAPI's OpenAPI document walks them
(``fastapi.routing.iter_route_contexts``: each with its full template) and matched as the router
matches: the template is the route the router would run (its first full match), else the first
whose path matches; the methods are those of every route whose path matches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from starlette.routing import BaseRoute, Match

try:
    from fastapi.routing import iter_route_contexts
except ImportError:  # FastAPI before 0.16x copied an included router's routes, prefix and all

    def iter_route_contexts(routes: Sequence[BaseRoute]) -> Sequence[BaseRoute]:
        return routes


@dataclass(frozen=True)
class Routed:
    """Where a request's path lands: ``template`` None when no route's path matches it;
    ``methods`` None when a route there takes any method (a mount)."""

    template: Optional[str]
    methods: Optional[frozenset[str]]


class RouteTable:
    """The app's routes, each with its full template, in the order the router tries them."""

    def __init__(self, routes: Sequence[BaseRoute]):
        self.routes = list(iter_route_contexts(routes))

    def at(self, request_scope: dict) -> Routed:
        """Where an HTTP request (its ASGI scope: path, root_path, method) lands."""
        # a scope of its own: matching writes nothing into the request's
        scope = {key: request_scope.get(key, "") for key in ("path", "root_path", "method")}
        scope["type"] = "http"
        full, first, methods = None, None, set()
        for route in self.routes:
            match, _ = route.matches(scope)
            if match == Match.NONE:
                continue
            template = route.path_format  # "/v1/bases/{bid}": the path without its convertors
            if match == Match.FULL and full is None:
                full = template  # the route the router runs
            first = first or template  # the one whose 405 the router would answer
            served = getattr(route, "methods", None)
            if served is None:
                methods = None  # a mount (or a route for every method): its app answers each itself
            elif methods is not None:
                methods |= served
        if first is None:
            return Routed(None, None)
        return Routed(full or first, None if methods is None else frozenset(methods))
