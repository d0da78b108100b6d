"""The web UI that ``kvflow serve`` ships: a chat playground and a live view of the engine
(see ``routes``)."""

from kvflow.entrypoints.web.routes import METRICS_PATHS, PUBLIC_PATHS, register

__all__ = ["METRICS_PATHS", "PUBLIC_PATHS", "register"]
