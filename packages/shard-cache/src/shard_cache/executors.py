"""Run a build's shard tasks: on Ray workers in parallel, or one after another in the calling process."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from shard_cache.processor import BatchProcessor
from shard_cache.worker import ShardTask, process_shard

# Inputs up to this many bytes in all are tokenized in the calling process when the build is left to choose.
# Tokenizing in-process costs about 0.3 CPU seconds a MiB (32 MiB of jsonl: 10.2 s, the tests' byte-level BPE, one
# core), so 4 MiB is about a second, well under a local Ray's start (5-10 s on two cores). Above a few MiB a run's
# background build shares the training process's GIL and a core with its start: the default nano config's 12 MB
# reached step 1 in 76-95 s in-process against 32-50 s with Ray's two workers, on a loaded machine.
IN_PROCESS_MAX_BYTES = 4 * 2**20
TASK_STOP_WAIT_S = 10.0  # how long a stop waits for the shard tasks it interrupted to end


class MessageSink(Protocol):
    """Where an executor hands each shard task's messages, in the order that task yields them."""

    def deliver(self, shard: int, message: dict[str, Any]) -> None:
        """Commit one message of shard `shard`'s task."""

    def tick(self, idle: bool) -> None:
        """Write the ledger and beat the lock when due; `idle`: no task is running, so write now if dirty."""


def choose_in_process(in_process: bool | None, ray_address: str | None, sizes: list[int | None]) -> bool:
    """Whether to build in this process: as forced, else when no Ray address was given and the inputs' `sizes`
    total at most IN_PROCESS_MAX_BYTES (an input of unknown size, such as an hf: dataset, means Ray)."""
    if in_process is not None:
        return in_process
    if ray_address:
        return False
    return all(size is not None for size in sizes) and sum(s or 0 for s in sizes) <= IN_PROCESS_MAX_BYTES


def run_in_process(
    pending: list[int],
    make_task: Callable[[int], ShardTask],
    processor: BatchProcessor,
    sink: MessageSink,
    stop: threading.Event,
) -> None:
    """Process the `pending` shards one after another in this process, checking `stop` between chunks."""
    for shard in pending:
        if stop.is_set():
            return
        messages = process_shard(make_task(shard), processor)
        try:
            for message in messages:
                if message.get("done"):
                    message["node"] = "this process"  # the one host at work, as a Ray node id counts one
                sink.deliver(shard, message)
                if stop.is_set():
                    return  # the chunks not yet handed over are redone by the next build of this cache
                # The ledger is written before the next chunk is tokenized: nothing else runs here to write it
                # while that chunk takes its time, and readers must see the chunks committed so far.
                sink.tick(idle=True)
        finally:
            messages.close()


def run_on_ray(
    pending: list[int],
    make_task: Callable[[int], ShardTask],
    processor: BatchProcessor,
    sink: MessageSink,
    stop: threading.Event,
    *,
    ray_address: str | None,
    num_workers: int | None,
) -> None:
    """Process the `pending` shards as Ray tasks, at most `num_workers` (default: the cluster's CPUs) at a time."""
    from shard_cache.ray_runtime import ensure_ray
    from shard_cache.worker import process_shard_in_worker

    ray = ensure_ray(ray_address)
    remote = ray.remote(num_returns="streaming", num_cpus=1)(process_shard_in_worker)
    processor_ref = [ray.put(processor)]  # shipped once, deserialised once per worker
    workers = num_workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
    pending = list(pending)
    running: dict[Any, int] = {}
    try:
        while (pending or running) and not stop.is_set():
            while pending and len(running) < workers:
                shard = pending.pop(0)
                running[remote.remote(make_task(shard), processor_ref)] = shard
            ready, _ = ray.wait(list(running), num_returns=1, timeout=0.5)
            for generator in ready:
                shard = running[generator]
                try:
                    message = ray.get(next(generator))
                except StopIteration:
                    del running[generator]
                    continue
                except ray.exceptions.RayTaskError:
                    # Its task has ended, by raising: force-cancelling an ended task races Ray's own
                    # bookkeeping, which can abort the driver ("Tried to complete task that was not pending").
                    del running[generator]
                    raise
                sink.deliver(shard, message)
            sink.tick(idle=not running)
    finally:
        # Stopped early or failed: what the stopped tasks had not handed over is redone by the next build.
        _stop_tasks(ray, running)


def _stop_tasks(ray: Any, generators: Iterable[Any], timeout: float = TASK_STOP_WAIT_S) -> None:
    """Ask the running shard tasks to stop and wait (at most `timeout`) for them to end.

    Never a force-cancel: Ray 2.60 could then abort this process at exit (`task_manager.cc` "Check failed"). The
    owner's bookkeeping of a streaming generator whose worker is killed mid-stream is a known source of such races
    upstream (ray-project/ray#44197 marks a cancelled stream's end; ray-project/ray#62537, a failed stream's end
    skipped). A plain cancel raises KeyboardInterrupt in the task, which then ends through Ray's normal path; a
    task that does not end in time is left to `ray.shutdown()`.
    """
    generators = list(generators)
    if not generators:
        return
    for generator in generators:
        ray.cancel(generator, force=False)
    with contextlib.suppress(Exception):  # a task that ended by failing is as ended as one that returned
        ray.wait([g.completed() for g in generators], num_returns=len(generators), timeout=timeout)
