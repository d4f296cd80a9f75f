"""One rank of tests/distributed/test_launch.py: how support/launch.py started it, and how it ends.

    --mode report   write what a script sees at its start (argv, sys.path[0], its session, stdin, the launch's
                    environment variables) as `<out>/rank<r>.json`
    --mode fail     rank 1 raises (the launch must name it and show its traceback); rank 0 waits to be killed
    --mode hang     start a grandchild (its pid in `<out>/grandchild<r>`) and sleep past any timeout
    --mode exit     end by `sys.exit(<--code>)`, or by SIGKILL with --code kill
    --mode echo     print the arguments after --echo on stdout, "to stderr" on stderr (support.launch.run_python)
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "OMP_NUM_THREADS", "PYTHONPATH", "ZB_TEST_SPLIT_DIR")


def report(out: str, rank: int) -> None:
    from support.launch import write_results   # here only: the other modes start in milliseconds, cold too

    null, stdin = os.stat(os.devnull), os.fstat(0)
    write_results(out, rank, dict(
        argv=sys.argv, path0=sys.path[0], name=__name__, own_session=os.getsid(0) == os.getpid(),
        stdin_is_null=(stdin.st_dev, stdin.st_ino) == (null.st_dev, null.st_ino),
        env={k: os.environ.get(k) for k in ENV}, stdout_is_log=os.path.realpath("/proc/self/fd/1").endswith(
            f"rank{rank}.log")))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--mode", required=True)
    ap.add_argument("--code", default="0")
    ap.add_argument("--echo", nargs="*", default=())
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    print(f"rank {rank} started", flush=True)
    if args.mode == "report":
        report(args.out, rank)
    elif args.mode == "fail":
        if rank == 1:
            raise RuntimeError("rank 1 gives up on purpose")
        time.sleep(120)
    elif args.mode == "hang":
        child = subprocess.Popen(["sleep", "300"])
        with open(os.path.join(args.out, f"grandchild{rank}"), "w") as fh:
            fh.write(str(child.pid))
        time.sleep(300)
    elif args.mode == "echo":
        print(" ".join(args.echo), os.getcwd())
        print("to stderr", file=sys.stderr)
    elif args.mode == "exit":
        if args.code == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        sys.exit(int(args.code) if args.code.lstrip("-").isdigit() else args.code)


if __name__ == "__main__":
    main()
