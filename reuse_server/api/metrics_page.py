"""What GET /metrics serves, as the API sees it: the server builds the Prometheus metrics and wires them to the
engine (server/metrics.py, a layer above this one) and hands them to create_app."""
from __future__ import annotations

from typing import Protocol


class MetricsPage(Protocol):
    def render(self) -> bytes: ...  # the Prometheus text exposition of every metric
