"""A server that has imported torch and the other libraries every train.py run imports, and forks a process for
each `python [-u] SCRIPT ARGS` asked of it, instead of a new interpreter importing them again (torch,
torch._dynamo, which torch's optimizers import on their first use, numba, TensorBoard): the suite starts ~150 runs
of train.py, and a 10-iteration run of the tests' model took 4.9 CPU-s, most of it imports. helpers.python_for
and run_python (launch, run_cli) run train.py through it (tests/test_topology.py: 129 -> 76 CPU-s on 2 cores).

The run is what `python SCRIPT ARGS` would be: a process of its own with its environment, working directory,
standard streams, sys.argv, sys.path[0] and __main__; the project's modules imported afresh (only third-party
libraries are preloaded: no test of what train.py imports can be fooled); its atexit handlers and its threads
joined at exit; its exit status, or the signal that ended it. A request the server cannot serve that way runs in
a real interpreter: any other option than -u, or an environment that differs from the server's in anything but
torchrun's per-rank variables (a library may read it at import).

The proxy (`proxy(directory)` writes it) is the executable launch runs in python's place, and torchrun as its
PYTHON_EXEC for each rank: it hands its arguments, environment, working directory and standard streams to the
server, forwards the signals it gets to the run, and ends as the run ended; killed, its run is killed; with no
server to reach, it execs python.

    python tests/zygote.py SOCKET     (helpers.py starts one per environment, per pytest process)
"""

import gc
import json
import os
import select
import signal
import socket
import struct
import sys

# Set per rank by torchrun (and PYTEST_CURRENT_TEST per test): read when the run starts, not at any import
PER_RUN = {
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "PYTEST_CURRENT_TEST",
}
# The proxy's own variables: removed before the run sees its environment
SERVER, PYTHON_EXEC = "STABLEGPT_ZYGOTE", "PYTHON_EXEC"
PRELOAD = (
    "numpy",
    "torch",
    "torch._dynamo",
    "torch.distributed",
    "torch.utils.tensorboard",
    "numba",
    "numba.cpython.unicode",
    "numba.cpython.charseq",
    "numba.np.arraymath",
)


def signature(env):
    """What of an environment the server's imports may have read."""
    return sorted(
        (k, v) for k, v in env.items() if k not in PER_RUN and not k.startswith("TORCHELASTIC_")
    )


def proxy(directory):
    """Write the proxy into directory (its first line names this interpreter); returns its path."""
    path = os.path.join(directory, "python")
    with open(path, "w") as f:
        f.write(
            f"#!{sys.executable} -S\nSERVER, PYTHON_EXEC = {SERVER!r}, {PYTHON_EXEC!r}\n{PROXY}"
        )
    os.chmod(path, 0o755)
    return path


PROXY = r"""
import json, os, signal, socket, struct, sys

argv = sys.argv[1:]
env = dict(os.environ)
address = env.pop(SERVER, None)
env.pop(PYTHON_EXEC, None)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
run, pending = None, []


def forward(sig, _):
    pending.append(sig) if run is None else os.kill(run, sig)


for sig in FORWARDED:
    signal.signal(sig, forward)


def python():
    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_DFL)
    for sig in pending:  # what the interpreter would have got at its start
        os.kill(os.getpid(), sig)
    os.execve(sys.executable, [sys.executable, *argv], env)


try:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.connect(address)
except (OSError, TypeError):
    python()
request = json.dumps({"argv": argv, "env": env, "cwd": os.getcwd()}).encode()
socket.send_fds(server, [struct.pack("!Q", len(request)) + request], [0, 1, 2])
reply = server.makefile("r")
first = reply.readline().split()
if first[:1] != ["pid"]:
    python()
run = int(first[1])
for sig in pending:
    os.kill(run, sig)
how, value = reply.readline().split()
if how == "signal":
    if int(value) not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(int(value), signal.SIG_DFL)
    os.kill(os.getpid(), int(value))
sys.exit(int(value))
"""


def _request(conn):
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    while len(data) < 8 or len(data) < 8 + struct.unpack("!Q", data[:8])[0]:
        more = conn.recv(1 << 16)
        if not more:
            raise EOFError
        data += more
    return json.loads(data[8:]), fds


def _script(argv):
    """(script, its args, unbuffered) of `python ARGV`, or None for what only an interpreter does."""
    unbuffered = False
    while argv and argv[0] == "-u":
        unbuffered, argv = True, argv[1:]
    if not argv or argv[0].startswith("-"):
        return None
    return argv[0], argv[1:], unbuffered


def _stream(fd, unbuffered):
    """sys.stdin, stdout or stderr on fd as the interpreter opens it (Python 3.9+: a non-interactive stderr is
    line-buffered; -u or PYTHONUNBUFFERED: every write goes through)."""
    import io

    raw = io.FileIO(fd, "r" if fd == 0 else "w", closefd=False)
    if fd == 0:
        return io.TextIOWrapper(io.BufferedReader(raw), encoding=sys.__stdin__.encoding)
    return io.TextIOWrapper(
        raw if unbuffered else io.BufferedWriter(raw),
        encoding=sys.__stdout__.encoding,
        errors="backslashreplace" if fd == 2 else sys.__stdout__.errors,
        write_through=unbuffered,
        line_buffering=not unbuffered and (fd == 2 or os.isatty(fd)),
    )


def _run(script, args, unbuffered, request):
    """In the forked process: become `python SCRIPT ARGS` and run it; never returns."""
    import builtins
    import importlib.machinery
    import traceback
    import types

    os.setpgid(0, 0)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    unbuffered = unbuffered or bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin, sys.stdout, sys.stderr = (_stream(fd, unbuffered) for fd in (0, 1, 2))
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    path = os.path.abspath(script)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(path)
    # __main__ as the interpreter makes it for a script: __file__ absolute, sys.argv[0] as given
    main = types.ModuleType("__main__")
    main.__dict__.update(
        __file__=path,
        __cached__=None,
        __loader__=importlib.machinery.SourceFileLoader("__main__", path),
        __builtins__=builtins,
    )
    sys.modules["__main__"] = main
    try:
        with open(path, "rb") as f:
            code = compile(f.read(), path, "exec", dont_inherit=True)
        exec(code, main.__dict__)
    except SystemExit:
        raise  # the interpreter's own handling: its code, or its message and 1
    except BaseException as e:
        # printed as the interpreter prints it: from the script's frames, not this server's
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != path:
            tb = tb.tb_next
        traceback.print_exception(type(e), e, tb or e.__traceback__)
        if isinstance(e, KeyboardInterrupt):  # Python ends such a run by SIGINT
            import atexit

            atexit._run_exitfuncs()
            sys.stdout.flush(), sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        raise SystemExit(1) from None
    raise SystemExit(0)


def serve(address):
    """Accept requests on the Unix socket `address` until the process that started this one is gone."""
    parent, environment = os.getppid(), signature(os.environ)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(64)  # requests wait in the backlog while the libraries load
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass
    # out of the collector's sight: a forked run's collections (and its exit's) would otherwise write to every
    # preloaded object, copying the server's memory page by page (~1.3 s a run)
    gc.freeze()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    runs = {}  # pid -> the proxy's connection
    while os.getppid() == parent:
        ready, _, _ = select.select([listener, wake_r, *runs.values()], [], [], 1.0)
        if wake_r in ready:
            os.read(wake_r, 4096)
        for conn in ready:
            if conn in (listener, wake_r):
                continue
            try:
                gone = not conn.recv(1, socket.MSG_PEEK)
            except OSError:
                gone = True
            if gone:  # the proxy was killed: so is its run
                os.kill(next(p for p, c in runs.items() if c is conn), signal.SIGKILL)
        while runs:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = runs.pop(pid)
            how = "signal" if os.WIFSIGNALED(status) else "exit"
            value = os.WTERMSIG(status) if how == "signal" else os.WEXITSTATUS(status)
            try:
                conn.sendall(f"{how} {value}\n".encode())
            except OSError:
                pass
            conn.close()
        if listener not in ready:
            continue
        conn, _ = listener.accept()
        try:
            request, fds = _request(conn)
        except (OSError, EOFError, ValueError):
            conn.close()
            continue
        run = _script(request["argv"])
        if run is None or signature(request["env"]) != environment or len(fds) != 3:
            conn.sendall(b"exec\n")
            conn.close()
            for fd in fds:
                os.close(fd)
            continue
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd, target in zip(fds, (0, 1, 2)):
                os.dup2(fd, target)
            for fd in fds:
                os.close(fd)
            for sock in (listener, conn, *runs.values()):
                sock.close()
            os.close(wake_r), os.close(wake_w)
            _run(*run, request)
        for fd in fds:
            os.close(fd)
        runs[pid] = conn
        conn.sendall(f"pid {pid}\n".encode())


if __name__ == "__main__":
    serve(sys.argv[1])
