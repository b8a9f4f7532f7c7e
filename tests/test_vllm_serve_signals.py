"""scripts/vllm/serve.py (`make e2e-vllm`) interrupts the command it runs under `--` with SIGINT so that pytest runs
its teardown: that must work when serve.py itself was started with SIGINT ignored (a background command of a shell
without job control, as a CI runner may start `bash .ci/run`)."""

import signal
import subprocess
import sys

from scripts.vllm.serve import take_ctrl_c

CHILD = "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"


def test_a_command_run_under_serve_takes_sigint_even_when_serve_was_started_ignoring_it():
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ignored = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True).stdout.strip()
        take_ctrl_c()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        taken = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True).stdout.strip()
    finally:
        signal.signal(signal.SIGINT, before)
    assert (ignored, taken) == ("False", "True")  # without take_ctrl_c the child inherits SIG_IGN
