"""Worker processes for `--jobs N` (packing seeds, replays): a pool that Ctrl-C stops at once.

Ctrl-C sends SIGINT to the whole process group. A worker interrupted while it waits on the
pool's call queue can die holding the queue's lock, and the pool's shutdown then waits for it
for ever (it hung once in 13 tries). So the workers ignore SIGINT and the parent, which gets
the KeyboardInterrupt, cancels what has not started and terminates the workers: the results of
a run stopped midway are not written anyway."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from typing import Any


def _start_worker(initializer: Callable[..., None] | None, initargs: tuple[Any, ...]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C
    # a forked worker inherits the parent's handlers: one for SIGTERM (an asyncio loop's, say)
    # would keep terminate() from stopping it
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if initializer is not None:
        initializer(*initargs)


@contextmanager
def worker_pool(workers: int, initializer: Callable[..., None] | None = None,
                initargs: tuple[Any, ...] = ()) -> Iterator[ProcessPoolExecutor]:
    """A process pool whose workers leave Ctrl-C to the parent; when the body raises (Ctrl-C, or a
    job that failed), the jobs not started are cancelled and the running ones stopped, so that
    the error reaches the user without waiting for them."""
    pool = ProcessPoolExecutor(max_workers=workers, initializer=_start_worker, initargs=(initializer, initargs))
    try:
        yield pool
    except BaseException:
        # (ProcessPoolExecutor has no public way to stop a running job before Python 3.14's
        # terminate_workers(); its `_processes` has been the worker table since 3.2, and
        # shutdown() empties it)
        processes = list((getattr(pool, "_processes", None) or {}).values())
        manager = getattr(pool, "_executor_manager_thread", None)  # shutdown(wait=False) forgets it
        pool.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            process.terminate()
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():  # (a worker still starting, its handlers not yet reset)
                process.kill()
        if manager is not None:
            # The pool's own thread joins the dead workers too. When it reaps one first, our
            # waitpid gets ECHILD and is_alive() says True until that thread, once it has the
            # GIL again, records the exit: wait for it, so that callers see the workers gone.
            manager.join(timeout=10)
        raise
    finally:
        pool.shutdown(wait=True)
