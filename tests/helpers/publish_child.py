"""A consolidation run as its own process, for the publish tests:

    python publish_child.py SRC OUT PER_SHARD count      # prints the calls under OUT
    python publish_child.py SRC OUT PER_SHARD kill N     # SIGKILL itself at the N-th call
    python publish_child.py SRC OUT PER_SHARD hold READY # at its first rename in OUT: create
                                                         # READY, then sleep 3 s (holds OUT)
PER_SHARD is a count of test tensors per shard, or "one" for a single file.
"""

import os
import signal
import sys
import time

from offload_engine.io import faults

from helpers.publish_runs import export


class Plan:
    def __init__(self, out, mode, arg):
        self.under = os.path.join(os.path.abspath(out), "")
        self.mode, self.arg, self.count = mode, arg, 0

    def hit(self, kind, path):
        if not (os.path.abspath(os.fspath(path)) + os.sep).startswith(self.under):
            return
        self.count += 1
        if self.mode == "kill" and self.count == int(self.arg):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.mode == "hold" and kind == "rename" and not os.path.exists(self.arg):
            open(self.arg, "w").close()
            time.sleep(3)


def main(src, out, per_shard, mode, arg=None):
    plan = Plan(out, mode, arg)
    faults.arm(plan)
    export(src, out, None if per_shard == "one" else int(per_shard))
    faults.disarm()
    print(plan.count)


if __name__ == "__main__":
    main(*sys.argv[1:])
