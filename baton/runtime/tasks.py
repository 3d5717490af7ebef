"""Tasks nobody awaits (a KV pull, a lease release), kept until they end."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine


class BackgroundTasks:
    """Runs coroutines as tasks and holds a reference to each until it ends: asyncio keeps
    only a weak one, and a task nobody references may be collected mid-run."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coroutine: Coroutine) -> asyncio.Task:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def __len__(self) -> int:
        return len(self._tasks)
