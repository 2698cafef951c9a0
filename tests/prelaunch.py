"""Launch-heavy fixtures started in the background when the session starts.

Most multi-process fixtures spend their time waiting (ranks sleep to emulate a GPU step, survivors wait for a
timeout or a peer's report), so two cores sit half idle while they run. A module-scoped fixture that only launches
processes and collects their results can register here (:func:`background`); if a selected test uses it, the
session's first test starts it on a background thread, and the fixture then waits for its result while the tests
before it run. Without that (the fixture's tests deselected, or a run of one file), it runs inline as before.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest

Job = Callable[[pytest.TempPathFactory], Any]

_JOBS: dict[str, Job] = {}
_STARTED: dict[str, Future] = {}


def background(job: Job) -> Job:
    """Register ``job`` (a fixture body taking ``tmp_path_factory``), named as its fixture with a leading ``_``."""
    _JOBS[job.__name__.lstrip("_")] = job
    return job


def result(job: Job, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The job's result: from its background run if one was started, else run now."""
    started = _STARTED.get(job.__name__.lstrip("_"))
    return started.result() if started is not None else job(tmp_path_factory)


def start(fixture_names: set[str], tmp_path_factory: pytest.TempPathFactory) -> threading.Thread | None:
    """Start the registered jobs among ``fixture_names``, one after the other, on one background thread."""
    wanted = [name for name in _JOBS if name in fixture_names]
    if not wanted:
        return None
    futures = {name: Future() for name in wanted}
    _STARTED.update(futures)

    def run_all() -> None:
        for name in wanted:
            try:
                futures[name].set_result(_JOBS[name](tmp_path_factory))
            except BaseException as error:  # noqa: BLE001 - pytest.fail is a BaseException: the fixture re-raises it
                futures[name].set_exception(error)

    thread = threading.Thread(target=run_all, name="prelaunch", daemon=True)
    thread.start()
    return thread
