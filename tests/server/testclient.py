"""Apps for Starlette's TestClient. It sends `Host: testserver`, a name a Parley server
refuses by default (app.server.hosts: only loopback names and the bound address), so an
app under TestClient lists that name among its allowed hosts, as a deployment lists its
own."""

from __future__ import annotations

from dataclasses import replace

from app.server.app import ServerConfig

TESTSERVER = "testserver"


def for_testclient(config: ServerConfig | None = None) -> ServerConfig:
    """`config` (default: the defaults) that also answers to TestClient's Host."""
    config = config or ServerConfig()
    return replace(config, allowed_hosts=(*config.allowed_hosts, TESTSERVER))
