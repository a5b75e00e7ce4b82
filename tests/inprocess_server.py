"""A real uvicorn server on a loopback port, run on a thread of the test process around an AsyncEngine the
test built, for what a subprocess cannot show (a fault injected into that engine)."""
import threading
import time
from contextlib import contextmanager

import uvicorn

from reuse_server.api.app import create_app
from reuse_server.server.launcher import free_port
from reuse_server.server.metrics import wire_metrics


@contextmanager
def serving(engine, settings=None):
    """Yields the base URL once the server listens; stops it (and the engine, by the app's lifespan)."""
    port = free_port()
    app = create_app(engine, wire_metrics(engine), settings=settings)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the in-process server did not start"
        time.sleep(0.05)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(30)
