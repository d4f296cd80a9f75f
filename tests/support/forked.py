"""Launched ranks forked from one warm interpreter instead of started cold.

A cold `python worker.py` spends about 3.5 s of CPU importing torch, torch.distributed, export and zbcompile before
it does anything, and a test session launches some seventy ranks on two cores. So the first launch of a test
process starts a server (`serve`): a Python process that imports those modules once (PRELOAD) and then, per
request, forks a child that becomes the rank the way `python worker.py ARGS` would start it:

    its own session (process group: support/launch.py kills a rank with everything it started), the environment
    it was given, stdin from /dev/null, stdout and stderr into its log, sys.argv and sys.path[0] as for a script,
    and the worker run as __main__; its exit status as Popen gives it (a negative number: killed by that signal).

The server answers each request with the child's pid, and reports each child's exit status when it ends; `Rank`
is the launcher's handle on one child, with the part of Popen's interface `launch` uses (pid, poll, wait,
returncode). support/launch.run_python runs the CLI tests' `python -m zbcompile ...` the same way (`-m` modules,
a working directory, stderr into a file of its own).

What a fork shares that cold starts do not: the interpreter's string-hash seed (set iteration order is the same on
every rank), what the preloaded modules did at import, and what torch set up for a first split and lowering
(`_warm`: the first export, aot trace and fx codegen of a process cost about 1.5 s of CPU more than later ones;
the random state is as a cold start has it). The tests that run real torchrun (test_main_job,
test_main_job_checkpoint, test_readme) start every rank cold, and ZB_TEST_COLD_RANKS=1 starts every launched rank
cold too.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import time
import traceback

COLD = "ZB_TEST_COLD_RANKS"   # set to 1: launch every rank as a fresh interpreter
# what every worker imports first; a module that fails to import here is left to the rank (which then fails the
# same way a cold one would)
PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "torch.export", "support", "support.launch",
           "support.models", "support.ckpt", "zbcompile", "zbcompile.api", "zbcompile.compiler", "zbcompile.split",
           "zbcompile.checkpoint", "zbcompile.passes.lower", "zbcompile.passes.schedules", "transformers")
# the variables in which one rank's environment differs from another's, or one launch's from the next (pytest
# names the running test in PYTEST_CURRENT_TEST): none is read at import
PER_RANK = {"MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
            "PYTEST_CURRENT_TEST"}


# ---- the server -------------------------------------------------------------------------------------------------

def serve() -> None:
    """Preload, then serve requests (one JSON line each on stdin: argv, env, log) until stdin closes. Replies on
    stdout, one JSON line each: {"pid": P} per request in order, {"exit": P, "code": C} as each child ends."""
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass
    _warm()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)   # a child's end (SIGCHLD) wakes the select below
    signal.signal(signal.SIGCHLD, lambda *_: None)
    pending = b""
    while True:
        ready, _, _ = select.select([0, wake_r], [], [])
        if wake_r in ready:
            while _drain(wake_r):
                pass
        _reap()
        if 0 in ready:
            data = os.read(0, 1 << 16)
            if not data:   # the test process is gone: so is the server (its ranks are killed by their launch)
                return
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                pid = os.fork()
                if pid == 0:
                    os.close(wake_r)
                    os.close(wake_w)
                    _become(json.loads(line))
                _send({"pid": pid})


def _warm() -> None:
    """Split and lower a two-layer model once, so that what torch sets up on a process's first export, aot trace
    and fx codegen (about 1.5 s of CPU) is done before the fork instead of in every rank. Under the rank's view
    nothing changes: the random state is restored, the split memo is off for it, a failure is ignored."""
    import warnings

    import torch

    from support import split_memo

    was = split_memo._state["enabled"]
    try:
        from zbcompile.passes.lower import lower_all
        from zbcompile.passes.schedules import generate
        from zbcompile.split import split_model

        split_memo.enabled(False)
        with torch.random.fork_rng(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.LayerNorm(8),
                                        torch.nn.Linear(8, 4))
            example = ((torch.randn(2, 4),), (torch.randn(2, 4),))
            staged = split_model(model, torch.nn.functional.mse_loss, example, num_stages=2)
            lower_all(generate("1f1b", 2, 2), staged)
    except Exception:
        pass
    finally:
        split_memo.enabled(was)


def _drain(fd: int) -> bool:
    try:
        return bool(os.read(fd, 512))
    except BlockingIOError:
        return False


def _reap() -> None:
    """Report every child that ended."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _send(message: dict) -> None:
    data = (json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(1, data):]


def _become(request: dict) -> None:
    """In the forked child: start as `python argv[0] argv[1:]` would, with the request's environment and log, run
    the worker as __main__ and exit with its status. Never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        if request.get("cwd"):
            os.chdir(request["cwd"])
        _redirect(request["log"], request.get("stderr"))
        os.environ.clear()
        os.environ.update(request["env"])
        from support import split_memo

        split_memo.install_from_environment()   # what support/__init__.py does in a cold rank
        argv = list(request["argv"])
        if argv[0] == "-m":   # python -m MODULE ARGS: sys.path[0] the working directory, sys.argv[0] the file
            sys.argv, sys.path[0] = argv[1:], os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv, sys.path[0] = argv, os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException:
        traceback.print_exc()
    finally:
        atexit._run_exitfuncs()   # what a normal exit of a cold interpreter runs (os._exit skips it)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _redirect(log: str, stderr: str | None = None) -> None:
    """stdin from /dev/null, stdout into `log` and stderr into `stderr` or `log` too (files created anew)."""
    def create(path: str) -> int:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    null, out = os.open(os.devnull, os.O_RDONLY), create(log)
    err = create(stderr) if stderr else out
    for fd, target in ((null, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
    for fd in {null, out, err}:
        os.close(fd)


def _exit_code(code) -> int:
    """The process status of `sys.exit(code)`: None is 0, an int itself, anything else printed and 1."""
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


# ---- the launcher's side ----------------------------------------------------------------------------------------

class Rank:
    """A forked rank, as far as support/launch.py uses a Popen: pid, poll(), wait(timeout), returncode."""

    def __init__(self, server: "Server", pid: int):
        self.server, self.pid, self.returncode = server, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.server.read(0)
            self.returncode = self.server.exits.pop(self.pid, None)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            self.server.read(0.1 if left is None else min(left, 0.1))
        return self.returncode


class Server:
    """One warm interpreter (see `serve`), started with `env` (the environment of the ranks it forks, less what
    differs per rank)."""

    def __init__(self, env: dict[str, str]):
        self.env = env
        self.proc = subprocess.Popen([sys.executable, "-c", "from support.forked import serve; serve()"], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        self.pending, self.exits, self.pids = b"", {}, []

    def start(self, argv: list[str], env: dict[str, str], log, **more) -> Rank:
        """Fork `python *argv` (a script or `-m module`, and its arguments); `more`: cwd, stderr (a file of its
        own; default: into `log`)."""
        request = {"argv": argv, "env": env, "log": str(log), **{k: str(v) for k, v in more.items() if v}}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        while not self.pids:   # the first answer comes after the preload: seconds, more on a loaded machine
            if not self.read(300):
                raise RuntimeError("the warm interpreter of support/forked.py stopped answering")
        return Rank(self, self.pids.pop(0))

    def read(self, timeout: float) -> bool:
        """Take in what the server said within `timeout` seconds; False if it said nothing."""
        fd = self.proc.stdout.fileno()
        if not select.select([fd], [], [], timeout)[0]:
            return False
        data = os.read(fd, 1 << 16)
        if not data:
            raise RuntimeError("the warm interpreter of support/forked.py exited "
                               f"(status {self.proc.wait()}); run with {COLD}=1 to start ranks cold")
        *lines, self.pending = (self.pending + data).split(b"\n")
        for line in lines:
            message = json.loads(line)
            if "pid" in message:
                self.pids.append(message["pid"])
            else:
                self.exits[message["exit"]] = message["code"]
        return True

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        """End the server (closing its stdin ends its loop)."""
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


_server: Server | None = None   # this test process's, started by the first `start`


def start(argv: list[str], env: dict[str, str], log, **more) -> Rank | None:
    """Fork `python *argv` (a worker script and its arguments) as a rank with environment `env` and output into
    `log` (`more`: Server.start's); None where ranks are to start cold (ZB_TEST_COLD_RANKS=1). One server per test
    process, started anew when the environment it was started with (less the per-rank variables) is not this
    rank's."""
    global _server
    if os.environ.get(COLD) == "1":
        return None
    base = {k: v for k, v in env.items() if k not in PER_RANK}
    if _server is None or _server.env != base or not _server.alive():
        close()
        _server = Server(base)
    return _server.start(argv, env, log, **more)


def close() -> None:
    """End this process's server, if any (at exit, or before one with another environment replaces it)."""
    global _server
    if _server is not None:
        _server.close()
        _server = None


atexit.register(close)
