"""Run with 2 processes (anyaccel launch --num_processes 2 --cpu lifetime_exit.py RANK): every rank
trains nothing and ends; rank RANK then registers an atexit handler that never returns — a
teardown that hangs after the script returned. With ANYACCEL_EXIT_TIMEOUT small, that rank must
print what it was doing with every thread's stack and exit 70, and the launcher must report it
(tests/process/test_lifetime_multiprocess.py)."""

import atexit
import sys
import time

from anyaccel import Accelerator


def a_teardown_that_never_ends() -> None:
    time.sleep(600)


def main() -> None:
    acc = Accelerator()
    acc.wait_for_everyone()
    if acc.process_index == int(sys.argv[1]):
        atexit.register(a_teardown_that_never_ends)
    acc.end_training()


if __name__ == "__main__":
    main()
