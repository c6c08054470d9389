"""An OpenAI-compatible HTTP server that decodes with leapdecode's methods.

`create_app` wires the parts: the middleware that refuses a request before it is read
(`middleware`), the OpenAI-style error bodies (`errors`), the Prometheus metrics (`metrics`),
the shared state with bounded admission (`worker`), the scheduler's thread that runs every
generation (`batching`), and
the routes (`routes`) that answer in the OpenAI API's format (`openai_format`).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI
from starlette.routing import Route

from leapdecode.methods import method_class, parse_method
from leapdecode.models import LoadedModel
from leapdecode.server.config import ServerConfig, default_allowed_methods, is_loopback
from leapdecode.server.errors import AsciiJSONResponse, add_error_handlers
from leapdecode.server.metrics import Metrics
from leapdecode.server.middleware import BodyLimit, Guard, allowed_hosts
from leapdecode.server.routes import router
from leapdecode.server.worker import ServerState

__all__ = ["ServerConfig", "create_app", "default_allowed_methods", "is_loopback"]

logger = logging.getLogger("leapdecode")


def create_app(lm: LoadedModel, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving `lm` under `config.model_name`."""
    served = parse_method(config.default_method)
    allowed_hosts(config.allowed_hosts)  # a malformed one fails here, not at the first request
    allowed = config.allow_methods if config.allow_methods is not None else default_allowed_methods(served)
    for name in allowed:
        method_class(name)  # unknown names fail at start, not per request
    logger.info("serving %r with %s on %s", config.model_name, served, lm.describe)
    # no redirect for a trailing slash: Starlette builds it from the request's Host header, which
    # a client sets (a 404 instead, as for any other path the server does not serve)
    app = FastAPI(title="leapdecode", version="0.1.0", default_response_class=AsciiJSONResponse, redirect_slashes=False)
    metrics = Metrics()
    app.add_middleware(BodyLimit, limit=config.max_body_bytes, timeout_s=config.body_timeout_s, metrics=metrics)
    app.add_middleware(Guard, config=config, metrics=metrics)
    server = ServerState.start(lm, config, metrics, served, allowed)
    add_error_handlers(app, metrics)
    app.include_router(router)
    metrics.routes = tuple(r for r in (*app.router.routes, *router.routes) if isinstance(r, Route))
    app.state.server = server
    return app
