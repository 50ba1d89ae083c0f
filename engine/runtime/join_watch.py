"""A watch on a rank joining its group, run by `shard.join_group` as a script (stdlib only).

MLX's ring backend waits for every rank of the hostfile to connect, forever, and holds the
GIL while it waits: no thread of the joining process can say a word or give up. This process
can. Arguments: the joining process's pid, the seconds after which to say what it waits for
and after which to give up, and those two messages. Its stdin is a pipe the joining process
closes once it has joined (or that closes when it dies): either ends the watch.
"""

import os
import select
import signal
import sys


def main() -> None:
    pid, notice_s, limit_s, waiting, gave_up = sys.argv[1:]
    pid, notice_s, limit_s = int(pid), float(notice_s), float(limit_s)
    if select.select([sys.stdin], [], [], notice_s)[0]:
        return
    print(waiting, file=sys.stderr, flush=True)
    if select.select([sys.stdin], [], [], max(0.0, limit_s - notice_s))[0]:
        return
    print(gave_up, file=sys.stderr, flush=True)
    os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
