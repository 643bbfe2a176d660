import pytest

from procs import ProcessGroup


@pytest.fixture
def procs(tmp_path):
    """A ProcessGroup whose processes are killed after the test; logs go to tmp_path/logs."""
    group = ProcessGroup(log_dir=tmp_path / "logs")
    try:
        yield group
    finally:
        group.close()
