import pytest

from reuse_server.model import native


@pytest.fixture(scope="session")
def kernels_built():
    """The native kernels built for this host: a test of them fails, with the compiler's reason, where they
    cannot be (the server would fall back to torch's paths, and the test would check nothing)."""
    assert native.load() is not None, native.failure()
