import os

# Triton kernels run under the interpreter on the CPU (set before anything imports triton).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from support import STORIES, NodeProcess, require_shared  # noqa: E402


@pytest.fixture(scope="session")
def stories_node():
    """One stories260k node shared by the API tests (float32, one CPU device)."""
    require_shared()
    node = NodeProcess("--model", str(STORIES))
    yield node
    node.close()
