"""Fixtures shared by the demo's tests."""

import pytest

from extproc.tools.demo import runner


class _Spawned(Exception):
    pass


@pytest.fixture
def pool_argv(tmp_path):
    """The argv runner.start_pool would start a pool's simulator with (stopped at the spawn)."""
    def argv_of(*args, **kwargs) -> list[str]:
        argv: list[str] = []

        class FakeStack:
            workdir = tmp_path

            def spawn(self, name, args):
                argv.extend(args)
                raise _Spawned

        with pytest.raises(_Spawned):
            runner.start_pool(FakeStack(), *args, **kwargs)
        return argv
    return argv_of
