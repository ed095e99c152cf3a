"""SGLang's ``--watchdog-timeout`` (``StepWatchdog`` in the scheduler process): a step that runs
past the timeout ends the process with ``EXIT_WATCHDOG`` after writing every thread's stack; a
step within it, or time between steps, never does."""

from __future__ import annotations

import subprocess
import sys
import time

from radixlm.srt.config import config_from_kwargs
from radixlm.srt.managers.scheduler_process import EXIT_WATCHDOG, StepWatchdog
from radixlm.srt.server.process.supervisor import describe_exit


def test_only_a_step_past_the_timeout_fires() -> None:
    fired: list[float] = []
    dog = StepWatchdog(0.2, on_timeout=lambda: fired.append(time.monotonic()))
    dog.begin()  # a first step compiles kernels: ten times as long allowed
    time.sleep(0.4)
    dog.end()
    dog.num_steps = StepWatchdog.FIRST_STEPS
    for _ in range(3):  # steps within the timeout, then idle time: nothing
        dog.begin()
        time.sleep(0.05)
        dog.end()
    time.sleep(0.5)
    assert not fired
    dog.begin()
    start = time.monotonic()
    deadline = start + 5
    while not fired and time.monotonic() < deadline:
        time.sleep(0.02)
    assert fired and 0.2 <= fired[0] - start < 2.0
    assert not StepWatchdog(0).fired  # off: no thread


def test_a_hung_step_ends_the_process_with_its_stacks() -> None:
    code = (
        "import time\n"
        "from radixlm.srt.managers.scheduler_process import StepWatchdog\n"
        "dog = StepWatchdog(0.3)\n"
        "dog.num_steps = dog.FIRST_STEPS\n"
        "dog.begin()\n"
        "time.sleep(30)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == EXIT_WATCHDOG, done.stderr[-2000:]
    assert "(--watchdog-timeout 0.3 s)" in done.stderr and "in <module>" in done.stderr  # stacks
    assert "watchdog-timeout" in describe_exit("scheduler", EXIT_WATCHDOG)


def test_the_flag_defaults_to_sglangs_300_s() -> None:
    assert config_from_kwargs().watchdog_timeout == 300.0
    assert config_from_kwargs(watchdog_timeout=0).watchdog_timeout == 0
