"""Which device a run loads its backbone on: in a sweep on a node with several GPUs, a GPU held for
the job's life by a lock, at most ``jobs_per_gpu`` jobs on one; torch imported only to count GPUs.

``python run.py -m hydra/launcher=local hydra.launcher.n_jobs=8 ... shard.index=0,1,...,7`` starts
8 jobs in one node's worker processes; each loads its own model, and without a device of its own
every job would load it on the first GPU. The local launcher hands a job to whichever worker is
free, so a job's number says nothing of the GPUs the running jobs hold: a job whose configured
device is ``auto`` or ``cuda`` takes the first GPU with a free slot (``CUDA_VISIBLE_DEVICES``
narrows them) by an exclusive lock on a file of this node (``LOCK_DIR``), released when the job
ends or its process dies, and waits while every slot is held. An explicit device (``cuda:3``,
``cpu``), one visible GPU, or a run outside a sweep keep the configured device as it is.
"""

from __future__ import annotations

import contextlib
import fcntl
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

SHARED_DEVICES = ("auto", "cuda")  # configured devices a job may be given a GPU of its own for
# Node-local: a node's jobs lock its GPUs, not another node's.
LOCK_DIR = Path(tempfile.gettempdir()) / "reskv-devices"
WAIT_S = 1.0  # between two looks for a free slot while every one is held


def visible_gpus() -> int:
    """CUDA devices this process sees (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@contextlib.contextmanager
def job_device(
    configured: str, sweep: bool, jobs_per_gpu: int = 1, gpus: int | None = None, lock_dir: Path | None = None
) -> Iterator[str]:
    """The device a job runs on, held until the block ends: in a ``sweep`` whose ``configured`` device
    leaves the GPU open and where several GPUs are visible (``gpus``, else ``visible_gpus``),
    ``cuda:<i>`` for the first slot free in the order every GPU's first slot, then every GPU's second
    (``jobs_per_gpu`` slots a GPU), locked exclusively in ``lock_dir`` (``LOCK_DIR``); else
    ``configured``."""
    count = visible_gpus() if gpus is None and sweep and configured in SHARED_DEVICES else gpus
    if not sweep or configured not in SHARED_DEVICES or count is None or count < 2:
        yield configured
        return
    lock_dir = lock_dir or LOCK_DIR
    lock_dir.mkdir(parents=True, exist_ok=True)
    while True:
        for slot in range(jobs_per_gpu):
            for index in range(count):
                handle = (lock_dir / f"cuda{index}.{slot}.lock").open("a")
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    handle.close()
                    continue
                try:
                    yield f"cuda:{index}"
                finally:
                    fcntl.flock(handle, fcntl.LOCK_UN)
                    handle.close()
                return
        time.sleep(WAIT_S)


def use_device(device: str) -> None:
    """Make an indexed GPU the current CUDA device of this process, so that what launches on the
    current device (Triton kernels, memory queries, CUDA graphs) runs where the model lies."""
    if device.startswith("cuda:"):
        import torch

        torch.cuda.set_device(int(device.removeprefix("cuda:")))


def release_job(device: str) -> None:
    """What a job leaves behind on ``device`` let go of: its compiled steps (whose cache holds its
    model alive, ``reskv.decoding.release_compiled``), its unreachable tensors, and on CUDA the
    allocator's cached blocks."""
    import gc

    import torch

    from reskv.decoding import release_compiled

    release_compiled()
    gc.collect()
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextlib.contextmanager
def job_on_device(configured: str, sweep: bool, jobs_per_gpu: int, threads: int | None) -> Iterator[str]:
    """A job's device for the block: held (``job_device``) and made current (``use_device``), with
    ``threads`` torch CPU threads where given; what the job leaves behind let go of when it ends
    (``release_job``), so that a worker the launcher reuses starts bare."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    with job_device(configured, sweep, jobs_per_gpu) as device:
        use_device(device)
        try:
            yield device
        finally:
            release_job(device)
