"""leanrl.threads: the default thread count leaves out the cores that other jobs keep busy now."""

import os
import subprocess
import sys
import time

from leanrl.threads import free_cores


def test_a_job_computing_now_takes_its_core():
    cores = len(os.sched_getaffinity(0))
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)  # past the interpreter's start
        assert free_cores() <= max(1, cores - 1)
        assert free_cores(processes=cores) == 1  # shared among as many processes as cores: one each, at least
    finally:
        spinner.kill()
        spinner.wait()
