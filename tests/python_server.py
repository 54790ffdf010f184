"""The tests' Python, started once per `ctest` run with the libraries already imported.

The golden values of memrt's tests come from torch, transformers, PEFT, bitsandbytes and torchao,
run at test time by the reference scripts under tests/. Importing them costs 2-9 s of one core per
Python process, and the suite starts a few hundred such processes: more than the work they do.
This server imports them once; each script then runs in a process forked from it, which starts
with everything imported in a few milliseconds.

    python_server.py start NAME LOG   (a CTest fixture's setup) starts the server in the background,
                                      listening on the abstract Unix socket NAME, logging to LOG;
                                      it ends with the process that started this command (CTest)
    python_server.py stop NAME        (the fixture's cleanup) ends it

The tests run Python as MEMRT_PYTHON, the client (tests/python_client.py.in), which hands the
server its command line, working directory, environment and standard streams (the file
descriptors themselves), and exits with the script's exit status. The server forks a process for
the request; that process takes the client's streams, directory and environment, runs the script
as `python SCRIPT ARGS`, `python -c CODE ARGS`, `python -m MODULE ARGS` or `python - ARGS` would,
and exits. A client that is killed (a test's timeout) closes its socket, and the server kills the
script's process group. With no server listening, the client runs the real interpreter itself:
the server saves time, it decides nothing.

What differs from a fresh interpreter, and why it does not matter to the references: modules are
imported before the script runs (their import-time warnings go to LOG; a script's own filters and
stand-in modules still apply to everything it imports later); the intra-op thread count is the
client's OMP_NUM_THREADS, or else the server's default; the hash seed is the server's.
"""
import json
import os
import runpy
import selectors
import signal
import socket
import struct
import sys
import traceback

PRELOAD = ("numpy", "torch", "safetensors.torch", "tokenizers", "sentencepiece", "transformers", "peft",
           "peft.optimizers", "bitsandbytes", "bitsandbytes.functional", "torchao.optim")
# transformers loads its model classes on first use; these are the ones the references use.
TRANSFORMERS_NAMES = ("AutoTokenizer", "AutoModelForCausalLM", "BitsAndBytesConfig", "GPT2Config", "GPT2LMHeadModel",
                      "LlamaConfig", "LlamaForCausalLM", "Qwen2Config", "Qwen2ForCausalLM", "TrainingArguments")
HEADER = struct.Struct("<I")
STATUS = struct.Struct("<i")


def fail(message):
    print(f"python_server.py: {message}", file=sys.stderr)
    sys.exit(1)


# ---------------------------------------------------------------------------------------------
# start / stop


def start(name, log):
    """Starts the server in the background and returns once it listens (its imports go on)."""
    watched = os.getppid()
    os.makedirs(os.path.dirname(os.path.abspath(log)), exist_ok=True)
    ready_r, ready_w = os.pipe()
    if os.fork() == 0:
        os.close(ready_r)
        os.setsid()
        if os.fork() != 0:
            os._exit(0)
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.closerange(3, ready_w)
            os.closerange(ready_w + 1, 1 << 16)
            serve(name, watched, ready_w)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    os.close(ready_w)
    os.wait()  # the first child, gone once the server is detached
    with os.fdopen(ready_r) as ready:
        answer = ready.read().strip()
    if answer == "listening":
        print(f"the tests' Python server listens; its log: {log}")
    elif answer == "in use":
        print("a server for this build tree is running already: the tests use it")
    else:
        fail(f"the server did not start ({answer or 'no answer'}); its log: {log}")


def stop(name):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect("\0" + name)
    except OSError:
        print("no server was running")
        return
    payload = json.dumps({"stop": True}).encode()
    s.sendall(HEADER.pack(len(payload)) + payload)
    s.recv(STATUS.size)
    print("the tests' Python server stopped")


# ---------------------------------------------------------------------------------------------
# the server


def serve(name, watched, ready_w):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind("\0" + name)
    except OSError:
        os.write(ready_w, b"in use")
        return
    listener.listen(256)  # clients wait here while the imports below run
    watch = os.pidfd_open(watched)
    os.write(ready_w, b"listening")
    os.close(ready_w)

    threads = preload()
    base_path = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    sys.stdout.flush()
    sys.stderr.flush()

    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, ("accept",))
    selector.register(watch, selectors.EVENT_READ, ("watched",))
    running = {}  # pid -> (client socket, pidfd)
    while True:
        for key, _ in selector.select():
            what = key.data
            if what[0] == "accept":
                client, _ = listener.accept()
                request, fds = receive(client)
                if request is None:
                    client.close()
                    continue
                if request.get("stop"):
                    client.sendall(STATUS.pack(0))
                    return
                sys.stdout.flush()  # or the script's streams would get the server's buffered lines
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:  # the server's descriptors are not the script's
                    for s in [listener, client] + [c for c, _ in running.values()]:
                        s.close()
                    for fd in [watch] + [p for _, p in running.values()]:
                        os.close(fd)
                    selector.close()
                    run(request, fds, threads, base_path)  # never returns
                for fd in fds:
                    os.close(fd)
                try:
                    os.setpgid(pid, pid)  # also done by the child: whichever runs first
                except OSError:
                    pass
                pidfd = os.pidfd_open(pid)
                running[pid] = (client, pidfd)
                selector.register(client, selectors.EVENT_READ, ("client", pid))
                selector.register(pidfd, selectors.EVENT_READ, ("script", pid))
            elif what[0] == "client":  # the client is gone (killed by its test's timeout)
                try:
                    os.killpg(what[1], signal.SIGKILL)
                except ProcessLookupError:
                    pass
                selector.unregister(running[what[1]][0])
            elif what[0] == "script":
                pid = what[1]
                client, pidfd = running.pop(pid)
                _, status = os.waitpid(pid, 0)
                code = os.waitstatus_to_exitcode(status)  # -N: killed by signal N
                try:
                    selector.unregister(client)
                except KeyError:
                    pass
                selector.unregister(pidfd)
                os.close(pidfd)
                try:
                    client.sendall(STATUS.pack(code))
                except OSError:
                    pass
                client.close()
            else:  # the process that started the server (CTest) has ended: so do its scripts
                for pid in running:
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                return


def preload():
    """Imports the references' libraries; returns the intra-op thread count a fresh process would use."""
    import importlib
    for module in PRELOAD:
        try:
            importlib.import_module(module)
        except Exception as e:  # a script that imports it meets the same error, in its own output
            print(f"not preloaded: {module}: {e!r}")
    threads = None
    if "torch" in sys.modules:
        import torch
        threads = torch.get_num_threads()
        # No parallel region before fork: GNU OpenMP's thread pool does not survive one.
        torch.set_num_threads(1)
    if "transformers" in sys.modules:
        import transformers
        for attr in TRANSFORMERS_NAMES:
            try:
                getattr(transformers, attr)
            except Exception as e:
                print(f"not preloaded: transformers.{attr}: {e!r}")
    return threads


def receive(client):
    """A request: its JSON and the client's standard streams (three file descriptors)."""
    client.settimeout(30)
    try:
        data, fds, _, _ = socket.recv_fds(client, 1 << 16, 3)
        while len(data) < HEADER.size or len(data) < HEADER.size + HEADER.unpack_from(data)[0]:
            chunk = client.recv(1 << 16)
            if not chunk:
                raise ConnectionError("the client closed its request early")
            data += chunk
        request = json.loads(data[HEADER.size:HEADER.size + HEADER.unpack_from(data)[0]])
    except (OSError, ValueError, struct.error) as e:
        print(f"a request could not be read: {e!r}")
        return None, []
    client.settimeout(None)
    if not request.get("stop") and len(fds) != 3:
        print(f"a request came with {len(fds)} file descriptors, not 3")
        for fd in fds:
            os.close(fd)
        return None, []
    return request, fds


# ---------------------------------------------------------------------------------------------
# one script, in a forked process


def run(request, fds, threads, base_path):
    code = 1
    try:
        os.setpgid(0, 0)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if "torch" in sys.modules:
            import torch
            env_threads = os.environ.get("OMP_NUM_THREADS", "")
            torch.set_num_threads(int(env_threads) if env_threads.isdigit() and int(env_threads) > 0 else threads)
        code = execute(request["argv"], base_path)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def execute(argv, base_path):
    """Runs `python ARGV...` in this process and returns its exit status, as the interpreter would."""
    import atexit
    import threading
    pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    mode, target, rest = (argv[0], argv[1], argv[2:]) if argv[0] in ("-c", "-m") else (None, argv[0], argv[1:])
    if mode == "-c":
        sys.argv, first = ["-c"] + rest, ""
    elif mode == "-m":
        sys.argv, first = [target] + rest, os.getcwd()
    elif target == "-":
        sys.argv, first = ["-"] + rest, ""
    else:
        sys.argv, first = [target] + rest, os.path.dirname(os.path.abspath(target))
    sys.path[:] = [first] + pythonpath + base_path
    try:
        if mode == "-c":
            exec(compile(target, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        elif mode == "-m":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        elif target == "-":
            exec(compile(sys.stdin.read(), "<stdin>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            runpy.run_path(target, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = exit_code(e.code)
    except BaseException as e:  # the traceback a fresh interpreter prints: from the script's frame on
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        code = 1
    threading._shutdown()  # the interpreter joins non-daemon threads, then runs the atexit handlers
    atexit._run_exitfuncs()
    return code


def exit_code(value):
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "start":
        start(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 3 and sys.argv[1] == "stop":
        stop(sys.argv[2])
    else:
        sys.exit(__doc__)
