"""A consolidation run as its own process, for the publish tests:

    python publish_child.py SRC OUT PER_SHARD count           # prints the calls under OUT
    python publish_child.py SRC OUT PER_SHARD kill N          # SIGKILL itself at the N-th call
    python publish_child.py SRC OUT PER_SHARD hold KIND READY # at its first KIND call in OUT
                                                              # (rename, write): create READY,
                                                              # then sleep 6 s
    python publish_child.py SRC OUT PER_SHARD cli KIND READY  # the same, through the command
                                                              # line; exits with its code
PER_SHARD is a count of test tensors per shard, or "one" for a single file.
"""

import os
import signal
import sys
import time

from offload_engine.io import faults

from helpers.publish_runs import export, shard_limit


class Plan:
    def __init__(self, out, mode, args):
        self.under = os.path.join(os.path.abspath(out), "")
        self.mode, self.args, self.count = mode, args, 0

    def hit(self, kind, path):
        if not (os.path.abspath(os.fspath(path)) + os.sep).startswith(self.under):
            return
        self.count += 1
        if self.mode == "kill" and self.count == int(self.args[0]):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.mode in ("hold", "cli") and kind == self.args[0] and not os.path.exists(self.args[1]):
            open(self.args[1], "w").close()
            time.sleep(6)


def main(src, out, per_shard, mode, *args):
    per_shard = None if per_shard == "one" else int(per_shard)
    plan = Plan(out, mode, args)
    faults.arm(plan)
    if mode == "cli":
        from offload_engine.cli.main import main as cli

        sys.exit(cli(["consolidate", src, out, "--max-shard-size", str(shard_limit(per_shard))]))
    export(src, out, per_shard)
    faults.disarm()
    print(plan.count)


if __name__ == "__main__":
    main(*sys.argv[1:])
