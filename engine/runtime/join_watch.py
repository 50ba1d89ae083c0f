"""A watch on a rank joining its group, run by `shard.join_group` as a script (stdlib only).

MLX's ring backend waits for every rank of the hostfile to connect, forever, and holds the
GIL while it waits: no thread of the joining process can say a word, give up, or even take a
Ctrl+C. This process can. Arguments: the joining process's pid, the seconds after which to
say what it waits for and after which to give up, and the three messages (waiting, given up,
interrupted). Its stdin is a pipe the joining process closes once it has joined (or that
closes when it dies): either ends the watch. Ctrl+C reaches the terminal's whole process
group, so this watch takes it for the rank: it ends the rank if it is still joining.
"""

import os
import select
import signal
import sys


def main() -> None:
    pid, notice_s, limit_s, waiting, gave_up, interrupted = sys.argv[1:]
    pid, notice_s, limit_s = int(pid), float(notice_s), float(limit_s)

    def joined(timeout: float) -> bool:
        return bool(select.select([sys.stdin], [], [], timeout)[0])

    def say(message: str) -> None:  # unbuffered: a Ctrl+C may come mid-notice
        os.write(sys.stderr.fileno(), (message + "\n").encode())

    def end(message: str) -> None:
        say(message)
        os.kill(pid, signal.SIGKILL)

    def on_ctrl_c(signum, frame) -> None:
        if not joined(0):
            end(interrupted)
        os._exit(0)

    signal.signal(signal.SIGINT, on_ctrl_c)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked until now (see shard)
    if joined(notice_s):
        return
    say(waiting)
    if joined(max(0.0, limit_s - notice_s)):
        return
    end(gave_up)


if __name__ == "__main__":
    main()
