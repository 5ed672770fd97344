"""The time-to-quality ladder's runs in processes of their own (--workers N):
each dies with the ladder, even a killed one; a failed run ends the ladder and the others are stopped
(SIGTERM: their train.py saves and exits) and waited for."""
import os
import signal
import sys
import time

from cli import StopFlag, brief

STOPPED = 3  # a worker's exit code when a signal stopped its run


def run_processes(jobs: list, run_one, cfg, identity: dict, stop: StopFlag) -> str | None:
    """run_one(job, cfg, identity, stop) for each job, --workers at a time, each in a spawned process;
    stop.reason is set when a signal cut one. Returns what failed (a line naming the run), or None."""
    import multiprocessing
    queue, context, running, failed = list(jobs), multiprocessing.get_context('spawn'), {}, None
    try:
        while (queue or running) and not (stop.reason or failed):
            while queue and len(running) < cfg.workers:
                job = queue.pop(0)
                process = context.Process(target=job_process, args=(run_one, job, cfg, identity, os.getpid()))
                process.start()
                running[process] = job
            time.sleep(0.2)
            for process in [p for p in running if not p.is_alive()]:
                job = running.pop(process)
                if process.exitcode == STOPPED:
                    stop.reason = stop.reason or 'a stop in a worker'
                elif process.exitcode != 0:
                    failed = (f'{job.arm.name}, seed {job.seed}: its run failed (exit code {process.exitcode}; the '
                              f'error is above)')
    finally:
        for process in running:  # their runs save and exit
            if process.is_alive():
                os.kill(process.pid, signal.SIGTERM)
        for process in running:
            process.join(60)
            if process.is_alive():
                process.kill()
    return failed


def die_with_parent(parent: int):
    """SIGTERM this process when its parent dies, even by kill -9 (Linux's parent-death signal), so that
    no orphan trains on beside a rerun; where there is none, a thread watches the parent."""
    try:
        import ctypes
        if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM) != 0:  # PR_SET_PDEATHSIG
            raise OSError
    except (OSError, AttributeError):
        import threading

        def watch():
            while os.getppid() == parent:
                time.sleep(1)
            os.kill(os.getpid(), signal.SIGTERM)
        threading.Thread(target=watch, daemon=True).start()
    if os.getppid() != parent:  # it died before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)


def job_process(run_one, job, cfg, identity: dict, parent: int):
    """A worker: one run; exit 0 when finished, STOPPED when a signal cut it, 1 with its error."""
    stop = StopFlag()
    stop.install()  # a signal before train.py installs its own handler is a stop too
    die_with_parent(parent)
    try:
        result = None if stop.reason else run_one(job, cfg, identity, stop)
    except Exception as error:
        print(f'error: {job.arm.name}, seed {job.seed}: {brief(error, 300)}', file=sys.stderr, flush=True)
        sys.exit(1)
    sys.exit(0 if result is not None and not stop.reason else STOPPED)
