"""What the route handlers take by ``Depends``: the objects one app holds in ``app.state``.

The handlers are module-level functions shared by every app ``server.create_app`` builds (a
test's, a server's, Ray Serve's ingress, whose service is a ``RayService``), so what belongs to
one app is read from the request's app, never captured when the routes are declared.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request as HttpRequest

from ..serving.service import Service
from .a1111_fields import Settings


def service_of(request: HttpRequest) -> Service:
    """The service this app serves (a local :class:`Service`, or Ray Serve's ``RayService``)."""
    return request.app.state.service


def a1111_settings_of(request: HttpRequest) -> Settings:
    """The A1111 door's settings of this app (``POST /sdapi/v1/options``), for its later requests."""
    return request.app.state.a1111_settings


# a handler's parameters, as FastAPI's docs write them: ``service: ServiceDep``
ServiceDep = Annotated[Service, Depends(service_of)]
A1111SettingsDep = Annotated[Settings, Depends(a1111_settings_of)]
