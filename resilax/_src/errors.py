"""The error tree. Every message names the API, what was expected and what was received."""

from __future__ import annotations

import errno
import shutil


class ResilaxError(Exception):
    """Base of every error resilax raises on purpose."""


class ConfigError(ResilaxError, ValueError):
    """A malformed `resilax.Config`, ConfigDict or gin binding."""


class TopologyError(ResilaxError, ValueError):
    """A topology spec that is malformed or does not fit the devices present."""


class WrapError(ResilaxError, TypeError):
    """Bad arguments to `resilax.wrap` or to a `ResilientStep` call."""


class StepBrokenError(WrapError):
    """A `ResilientStep` called again after a call of it failed: not its configuration (under
    `resilax launch` the job is restarted, not ended as a refused configuration)."""


class PipelineError(ResilaxError, ValueError):
    """Bad arguments to `resilax.pipeline`, or a pipeline that does not fit the mesh."""


class CheckpointError(ResilaxError):
    """A checkpoint could not be saved or restored."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint exists but its bytes do not match the checksums written with it."""


class StorageError(CheckpointError, OSError):
    """The storage under a checkpoint or log failed (full disk, permissions, I/O error)."""


class ReplayLogError(ResilaxError):
    """A replay-log entry is missing, truncated or fails its checksum."""


class StateLostError(ResilaxError):
    """No surviving copy (live, peer, log, checkpoint) can restore some state."""


class ProgramMismatchError(ResilaxError):
    """A mesh's compiled step disagrees with the same step on one device beyond rounding."""


class SilentDataCorruptionError(ResilaxError):
    """Replicas of the state that must be bitwise equal differ, and which one is right cannot
    be decided (two replicas): nothing is saved from them; restart from the newest checkpoint."""


class Preempted(SystemExit):
    """Raised by a `ResilientStep` call after the job was preempted (under ``resilax
    launch``: SIGTERM reached some worker, every worker stopped after the same step and a
    checkpoint of it was saved; ``ResilientStep.preempted`` was set by that step's call).
    A ``SystemExit`` with code 0: a loop that does not catch it ends the process cleanly,
    and relaunching resumes from that checkpoint. Attribute ``step``."""

    def __init__(self, msg, *, step: int):
        super().__init__(0)
        self.msg = msg
        self.step = step

    def __str__(self):
        return self.msg


def _is_disk_full(e: BaseException) -> bool:
    """ENOSPC anywhere in the chain: an OSError, or tensorstore's RESOURCE_EXHAUSTED text."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        text = str(e)
        if "No space left on device" in text or "os_error_code='28'" in text:
            return True
        e = e.__cause__ or e.__context__
    return False


def storage_error(what, directory, e) -> StorageError:
    """The `StorageError` for ``what`` failing in ``directory`` (``e`` its cause): a full disk
    is named so, with the bytes left."""
    if _is_disk_full(e):
        try:
            free = shutil.disk_usage(directory).free
        except OSError:
            free = 0
        return StorageError(
            errno.ENOSPC,
            f"resilax checkpoints: {what} in {str(directory)!r} failed: the disk is full ({free} bytes free); "
            f"committed checkpoints are intact",
        )
    from resilax._src.messages import short_reason  # (tensorstore's errors end in pages of spec JSON)

    return StorageError(f"resilax checkpoints: {what} in {str(directory)!r} failed: "
                        f"{short_reason(f'{type(e).__name__}: {e}', 1000)}")
