"""Pytest hooks (imported by tests/conftest.py): no process a test starts outlives the session.

Every pytest process (plain, an xdist worker, the xdist controller) puts its extproc.tools.reaper token in
os.environ at configure time, so every process a test or fixture starts, by whatever helper, carries it. Then:

- a process left running when the session ends (a fixture whose setup was cut short, a teardown that raised) is
  stopped and fails the run: an error at the teardown of the last test, or, when no last teardown ran (Ctrl-C, -x),
  a failing exit status;
- a pytest process that dies first (pytest-timeout's thread method calls os._exit, a killed xdist worker) leaves
  them to its watchdog, which stops them once it is gone.

Only processes carrying this process's token are ever signalled: never one the tests did not start.
"""

from __future__ import annotations

import pytest

from extproc.tools import reaper


def pytest_configure(config) -> None:
    reaper.guard_environ()


def _controller(config) -> bool:
    """The xdist controller runs no test; its workers (which carry its token) may still be finishing."""
    return config.pluginmanager.hasplugin("dsession")


def _message(found) -> str:
    return ("processes started by this test session were still running at its end (stopped now):\n  "
            + "\n  ".join(map(str, found)))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    result = yield
    if nextitem is None and not _controller(item.config):  # every fixture, the session's too, is torn down
        found = reaper.leftovers()
        if found:
            pytest.fail(_message(found), pytrace=False)
    return result


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus) -> None:
    if _controller(session.config):
        return
    found = reaper.leftovers()
    if found:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(_message(found), red=True, bold=True)
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
