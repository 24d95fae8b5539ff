"""`replicas.engine.lower_priority`: every thread of the process, and what it starts afterwards, runs at the
niceness asked for; a priority is never raised."""

import subprocess
import sys

CHILD = """
import os, subprocess, sys, threading, time
from replicas.engine import lower_priority

stop = threading.Event()
threading.Thread(target=stop.wait, daemon=True).start()  # a thread started before the call
os.setpriority(os.PRIO_PROCESS, 0, int(sys.argv[1]))  # this thread's starting niceness
print(lower_priority(int(sys.argv[2])))
print(sorted({os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")}))
print(subprocess.run([sys.executable, "-c", "import os; print(os.getpriority(os.PRIO_PROCESS, 0))"],
                     capture_output=True, text=True).stdout.strip())
"""


def run(start: int, niceness: int) -> list[str]:
    out = subprocess.run([sys.executable, "-c", CHILD, str(start), str(niceness)], capture_output=True, text=True, check=True)
    return out.stdout.split("\n")[:3]


def test_every_thread_and_a_child_process_run_at_the_niceness():
    effect, threads, child = run(0, 7)
    assert effect == "7" and threads == "[7]" and child == "7"


def test_a_lower_priority_already_in_effect_is_kept():
    effect, threads, child = run(12, 7)
    assert effect == "12" and child == "12"
    assert threads == "[7, 12]"  # the thread at 0 was lowered to 7; the one at 12 kept its lower priority
