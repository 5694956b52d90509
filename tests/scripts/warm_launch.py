"""Multi-process jobs forked from a warm interpreter: a worker script on N real processes through
the public ``debug_launcher`` (``notebook_launcher`` on CPU processes, as ``--cpu`` asks), without
paying torch's imports again for each of them.

Why: a fresh interpreter costs seconds of CPU before it trains — ``import torch`` (~2.7 CPU-s on
CI's machine), Dynamo (imported by the first optimizer: torch's ``add_param_group`` is wrapped by
``torch._disable_dynamo``, ~3.3 CPU-s), DTensor and FSDP (~1 CPU-s). A 2-process ``anyaccel launch``
starts three such interpreters (the launcher and two workers) before its first step: ~20 CPU-s,
more than most of the jobs the suite launches spend training. On CI's two shared cores that is
what the suite's minutes were made of (docs/contributing/testing.md, "CI's time").

How: one **warm server** per pytest process (started on first use, ended with the session): an
interpreter that imported torch, Dynamo, DTensor, FSDP and anyaccel, and then waits. For each job
it forks a **job process** (its own session, its own stdout/stderr files, the environment the
test gave, the working directory), which calls ``debug_launcher(run_script, (SCRIPT, ARGS),
num_processes=N)``: the launcher forks the N workers (real processes, a real gloo group, the same
variables as ``anyaccel launch`` gives: :mod:`anyaccel.launch.forked`) and each runs the script as
``__main__`` with ``sys.argv = [SCRIPT, *ARGS]``. The server itself never trains, never creates a
process group and never starts a thread: every job starts from the same pristine copy, and a job
that hangs is killed with its whole session after its timeout.

What it is for: the multi-process tests whose subject is what the library computes across ranks
(N-D layouts, pipeline, sequence, expert, ties, checkpoints, fp8, ...), with ``anyaccel launch
--num_processes N --cpu SCRIPT ARGS`` and nothing else on the command line. What ``anyaccel
launch`` itself does (its options, the elastic agent, restarts, signals, preemption, the
launcher's report, exit codes, process lifetime) is tested through ``anyaccel launch`` in
tests/launch, tests/process, tests/doctor, tests/examples, tests/soak and the cluster and SLURM
suites; those never come here. ``WARM_LAUNCH=0`` sends these jobs through ``anyaccel
launch`` too (the same assertions, the CPU of fresh interpreters), to check that both paths agree;
so does a job whose environment differs from the server's in a variable an interpreter reads when it
starts. Not shown by a warm job (docs/contributing/testing.md, "The sixth pass"): the end of the
interpreter (the forked workers leave with ``os._exit``, as ``notebook_launcher``'s do), ranks that
differ from their first instruction (they share the server's hash seed and numpy's state), code that
looks at ``sys.modules`` before the first Accelerator.

    python tests/scripts/warm_launch.py serve   # what the client starts; one JSON request a line
"""

from __future__ import annotations

import atexit
import json
import os
import resource
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, Optional, Sequence

HERE = Path(__file__).resolve()
#: what the server imports before it waits (what every job's workers would otherwise import each)
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
           "torch.distributed.checkpoint", "torch.utils.data", "anyaccel", "anyaccel.launch.notebook",
           "safetensors.torch")
#: CPU seconds (user + sys) the jobs of this pytest process spent, as the server measured them (its
#: children are not this process's: tests/ci_cost adds this)
CPU: Dict[str, float] = {"jobs": 0.0}


# ---------------------------------------------------------------------------------------------
# the client: in the pytest process
# ---------------------------------------------------------------------------------------------


class _Server:
    """The warm server of this pytest process: started on first use (with ``clean_env()``, whatever
    the test's environment), restarted if it died or was stopped."""

    proc: Optional[subprocess.Popen] = None
    env: Dict[str, str] = {}
    #: CPU seconds its replies reported (its jobs and itself): once it is reaped they are in this
    #: process's children's usage and leave :data:`CPU`
    reported = 0.0
    log = os.path.join(tempfile.gettempdir(), f"anyaccel-warm-{os.getpid()}.log")

    @classmethod
    def get(cls) -> subprocess.Popen:
        if cls.proc is None or cls.proc.poll() is not None:
            cls.stop()
            from conftest import clean_env

            cls.env = clean_env()
            with open(cls.log, "a") as log:
                cls.proc = subprocess.Popen([sys.executable, str(HERE), "serve"], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, stderr=log, env=cls.env, text=True)
        return cls.proc

    @classmethod
    def stop(cls, kill: bool = False) -> None:
        """End the server (``kill``: at once; its job and the job's workers go with it: each dies
        with its parent), reaped here."""
        proc, cls.proc = cls.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            if kill:
                proc.kill()
            else:
                proc.stdin.close()  # the server's loop ends at end of input
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        CPU["jobs"] -= cls.reported  # reaped: now counted in this process's children's usage
        cls.reported = 0.0


atexit.register(_Server.stop)

#: variables an interpreter reads when it starts or loads torch's libraries (the server's are
#: clean_env()'s): a job whose environment differs in one of them goes through ``anyaccel launch``
_START_TIME = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "MALLOC_", "LD_", "TORCH", "CUDA_", "NCCL_", "GLOO_")


def _start_time_vars(env: Dict[str, str]) -> Dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_START_TIME) and k != "PYTHONPATH"}


def warm_launch(nproc: int, script, *args, env: Optional[Dict[str, str]] = None, timeout: float = 240,
                cwd=None) -> subprocess.CompletedProcess:
    """``anyaccel launch --num_processes NPROC --cpu SCRIPT ARGS`` as far as the script can tell,
    its workers forked from the warm server (the module's docstring); returns what
    ``subprocess.run(..., capture_output=True, text=True)`` would: the job's exit status (0, or 1
    when a worker failed: the launcher's report is on stderr; -9 when it ran past ``timeout`` and
    was killed), its stdout and stderr. Through ``anyaccel launch`` instead when
    ``WARM_LAUNCH=0``, or when ``env`` differs from the server's in a variable read at
    an interpreter's start (``OMP_NUM_THREADS``, ``PYTHONHASHSEED``, ``MALLOC_*``, ``TORCH_*``, ...).
    Called by one test at a time in a pytest process."""
    from conftest import anyaccel, clean_env

    env = dict(env or clean_env())
    args = [str(a) for a in args]
    cli = os.environ.get("WARM_LAUNCH", env.get("WARM_LAUNCH", "1")) == "0"
    server_env = _Server.env if _Server.proc is not None and _Server.proc.poll() is None else clean_env()
    if cli or _start_time_vars(env) != _start_time_vars(server_env):
        return anyaccel("launch", "--num_processes", nproc, "--cpu", script, *args, timeout=timeout, env=env, cwd=cwd)
    with tempfile.TemporaryDirectory(prefix="anyaccel-warm-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        request = {"id": os.urandom(8).hex(), "nproc": int(nproc), "script": os.path.abspath(str(script)),
                   "args": args, "env": env, "cwd": os.path.abspath(str(cwd or os.getcwd())), "stdout": out,
                   "stderr": err, "timeout": timeout}
        reply = _ask(request, timeout + 60)
        stdout, stderr = Path(out).read_text(errors="replace"), Path(err).read_text(errors="replace")
    if reply.get("timed_out"):
        stderr += (f"\n[warm_launch] the job ran past its timeout ({timeout} s) and was killed with its "
                   "workers\n")
    if reply.get("survivors"):
        stderr += f"\n[warm_launch] {reply['survivors']} process(es) of the job outlived it (killed)\n"
    cmd = ["warm_launch", str(nproc), str(script), *args]
    return subprocess.CompletedProcess(cmd, reply["returncode"], stdout, stderr)


def _ask(request: dict, timeout: float) -> dict:
    """Send the request and wait for its reply. Anything that interrupts the wait (pytest-timeout,
    Ctrl-C, no answer within ``timeout``) kills the server, its job and the job's workers: no later
    request can then read this job's reply."""
    proc = _Server.get()
    try:
        proc.stdin.write(json.dumps(request) + "\n")
        proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = proc.stdout.readline() if ready else ""
            if line:
                reply = json.loads(line)
                if reply.get("id") != request["id"]:
                    raise RuntimeError(f"the warm server answered another request ({reply.get('id')}, not "
                                       f"{request['id']})")
                CPU["jobs"] += reply.get("cpu", 0.0)
                _Server.reported += reply.get("cpu", 0.0)
                return reply
            raise RuntimeError(f"the warm server (tests/scripts/warm_launch.py) {'died' if ready else 'did not answer'} "
                               f"while running {request['script']}; its log: {_Server.log}")
    except BaseException:
        _Server.stop(kill=True)
        raise


# ---------------------------------------------------------------------------------------------
# the server, and the job processes it forks
# ---------------------------------------------------------------------------------------------


def run_script(script: str, args: Sequence[str]) -> None:
    """Body of every worker: SCRIPT as ``__main__`` with ``sys.argv = [SCRIPT, *ARGS]`` and the
    script's folder first on ``sys.path``, as ``python SCRIPT ARGS`` runs it."""
    import runpy

    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(script))
    runpy.run_path(script, run_name="__main__")


def _job(request: dict, reply_fd: int) -> None:
    """In the forked job process: its own session and files, the test's environment, then the
    launcher; never returns."""
    code = 1
    try:
        from anyaccel.process import lifetime

        lifetime.die_with_parent(signal.SIGKILL, parent=request["server"])  # the server gone: the job goes too
        os.setsid()
        os.close(reply_fd)
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
            opened = os.open(path, flags, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        sys.stdout.reconfigure(line_buffering=True)
        sys.stderr.reconfigure(line_buffering=True)
        os.environ.clear()
        os.environ.update(request["env"])
        paths = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:0] = [p for p in paths if p not in sys.path]
        os.chdir(request["cwd"])
        from anyaccel import debug_launcher

        debug_launcher(run_script, (request["script"], request["args"]), num_processes=request["nproc"])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _session(sid: int) -> list:
    """The live (not zombie) processes of session ``sid`` but its leader."""
    members = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == sid:
            continue
        try:
            with open(f"/proc/{name}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:
            members.append(int(name))
    return members


def _kill(pids: Sequence[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _wait(pid: int, timeout: float) -> dict:
    """The job's exit status and CPU (its workers' included). After ``timeout`` the job and every
    process of its session are killed. Once it has ended (and before it is reaped, so that its pid
    and session id cannot be reused yet) what is left of its session is counted and killed."""
    deadline, timed_out = time.monotonic() + timeout, False
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if not timed_out and time.monotonic() > deadline:
            timed_out = True
            _kill([pid, *_session(pid)])
        time.sleep(0.02)
    left = _session(pid)
    survivors = len(left)
    for _ in range(5):  # a member that forked between the scan and its kill left a child: scan again
        if not left:
            break
        _kill(left)
        time.sleep(0.05)
        left = _session(pid)
    _, status, usage = os.wait4(pid, 0)
    return {"returncode": os.waitstatus_to_exitcode(status), "timed_out": timed_out,
            "survivors": 0 if timed_out else survivors, "cpu": usage.ru_utime + usage.ru_stime}


def serve() -> None:
    """The server's loop: preload, then for each request line fork a job and answer its result."""
    import importlib
    import threading

    from anyaccel.process import lifetime

    lifetime.die_with_parent(signal.SIGKILL)  # the pytest process gone (even killed): the server goes too
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything printed here (the preload's C code included) goes to the log, never into the replies
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    counted = 0.0  # this server's own CPU seconds already reported (the first reply carries the preload)
    for line in sys.stdin:
        request = {**json.loads(line), "server": os.getpid()}
        threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else threading.active_count()
        if threads != 1:
            raise RuntimeError(f"the warm server runs {threads} threads: forking it is not safe")
        sys.stdout.flush()
        sys.stderr.flush()
        if "CI_COST_TEST" in request["env"]:  # tests/ci_cost counts this fork for the test that asked
            os.environ["CI_COST_TEST"] = request["env"]["CI_COST_TEST"]
        pid = os.fork()
        if pid == 0:
            _job(request, reply.fileno())
        result = _wait(pid, request["timeout"])
        own = resource.getrusage(resource.RUSAGE_SELF)
        result["cpu"] = round(result["cpu"] + own.ru_utime + own.ru_stime - counted, 3)
        counted = own.ru_utime + own.ru_stime
        reply.write(json.dumps({**result, "id": request.get("id")}) + "\n")
        reply.flush()


if __name__ == "__main__":
    if sys.argv[1:] != ["serve"]:
        sys.exit(f"usage: python {sys.argv[0]} serve")
    serve()
