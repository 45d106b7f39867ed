"""Persistent tier: Orbax async checkpoints with checksums, and newest-good restore.

Each checkpoint is one Orbax step directory (committed atomically by Orbax: written under
a temporary name, then renamed) holding three items:

- ``state``: the train state (tensorstore arrays, sharded as they are);
- ``checksums``: per-leaf checksums computed on device when the save was dispatched;
- ``meta``: JSON with the step, RNG seed, data-iterator state and the state's signature.

On restore the newest step is read and its checksums recomputed; a checkpoint that cannot
be read or does not match is moved into ``quarantine/`` (never deleted) and the next older
one is tried, with a warning that names both.
"""

from __future__ import annotations

import base64
import dataclasses
import errno
import os
import pathlib
import shutil
import time
import warnings
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp

from resilax._src.protect.checksum import tree_checksums
from resilax._src.errors import CheckpointError, CorruptCheckpointError, StorageError

FORMAT = 1
QUARANTINE = "quarantine"


def state_signature(tree) -> list[list]:
    """``[[path, shape, dtype], ...]`` of a pytree of arrays or ShapeDtypeStructs."""
    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        out.append([jax.tree_util.keystr(path), list(np.shape(x)), str(x.dtype)])
    return out


def encode_data_state(s):
    """Iterator states are JSON dicts (grain datasets) or bytes (grain DataLoader)."""
    if s is None or isinstance(s, (dict, list, int, float, str)):
        return {"kind": "json", "value": s}
    if isinstance(s, (bytes, bytearray)):
        return {"kind": "bytes", "value": base64.b64encode(bytes(s)).decode()}
    raise CheckpointError(
        f"resilax: the data iterator's get_state() must return a JSON-able value or bytes, but got {type(s).__name__}"
    )


def decode_data_state(d):
    if d["kind"] == "bytes":
        return base64.b64decode(d["value"])
    return d["value"]


@dataclasses.dataclass(frozen=True)
class Restored:
    step: int
    state: Any
    meta: dict
    skipped: tuple[tuple[int, str], ...]  # (step, reason) of newer checkpoints that failed


class CheckpointStore:
    """Orbax ``CheckpointManager`` with checksums and newest-good restore.

    Args:
      directory: checkpoint root (created if missing).
      keep: complete checkpoints kept by Orbax.
      async_save: write in the background (the caller blocks only for the device-to-host copy).
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int = 3, async_save: bool = True):
        self.directory = pathlib.Path(directory).absolute()
        self._keep = keep
        self._async = async_save
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StorageError(f"resilax checkpoints: cannot create checkpoint_dir {str(self.directory)!r}: {e}") from e
        self._mgr = self._open()
        self.blocking_s: list[float] = []

    def _open(self):
        opts = ocp.CheckpointManagerOptions(
            max_to_keep=self._keep,
            enable_async_checkpointing=self._async,
            cleanup_tmp_directories=True,
            create=True,
        )
        return ocp.CheckpointManager(self.directory, options=opts, item_names=("state", "checksums", "meta"))

    # ------------------------------------------------------------------ save
    def save(self, step: int, state, meta: dict, *, after_dispatch: Callable[[], None] | None = None) -> float:
        """Starts saving ``state`` as checkpoint ``step``; returns the seconds the caller blocked.

        Raises:
          StorageError: the previous background save failed, or this one could not start
            (full disk, permissions). Checkpoints already committed are untouched.
        """
        t0 = time.perf_counter()
        sums = tree_checksums(state)
        meta = dict(meta, format=FORMAT, step=int(step), signature=state_signature(state))
        try:
            self._mgr.save(
                int(step),
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state),
                    checksums=ocp.args.StandardSave({"sums": sums}),
                    meta=ocp.args.JsonSave(meta),
                ),
            )
        except Exception as e:  # Orbax re-raises a failed background commit here too
            raise _storage_error(f"saving checkpoint {step}", self.directory, e) from e
        dt = time.perf_counter() - t0
        self.blocking_s.append(dt)
        if after_dispatch is not None:
            after_dispatch()
        return dt

    def wait(self):
        """Blocks until the background save (if any) is committed."""
        try:
            self._mgr.wait_until_finished()
        except Exception as e:
            raise _storage_error("finishing a checkpoint save", self.directory, e) from e

    def close(self):
        try:
            self.wait()
        finally:
            self._mgr.close()

    def steps(self) -> list[int]:
        return sorted(self._mgr.all_steps())

    # ------------------------------------------------------------------ restore
    def restore_newest(self, abstract_state) -> Restored | None:
        """Restores the newest checkpoint that reads back and matches its checksums.

        Args:
          abstract_state: pytree of ``jax.ShapeDtypeStruct`` with shardings (the target layout).

        Returns:
          ``Restored`` or ``None`` when the directory holds no checkpoint.

        Raises:
          CheckpointError: a checkpoint was written for a differently shaped state (nothing
            is moved; the caller passed the wrong state).
          CorruptCheckpointError: checkpoints exist but none is good (all were quarantined).
        """
        self._mgr.reload()
        want_sig = state_signature(abstract_state)
        skipped: list[tuple[int, str]] = []
        for step in sorted(self._mgr.all_steps(), reverse=True):
            try:
                meta = self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
                if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("step") != step:
                    raise CorruptCheckpointError(f"meta of checkpoint {step} is malformed")
            except Exception as e:
                skipped.append((step, _reason(e)))
                continue
            if meta["signature"] != want_sig:
                raise CheckpointError(_signature_mismatch(self.directory, step, meta["signature"], want_sig))
            try:
                leaves = len(want_sig)
                abs_sums = jax.ShapeDtypeStruct((leaves, 2), np.uint32, sharding=_sums_sharding())
                out = self._mgr.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(abstract_state),
                        checksums=ocp.args.StandardRestore({"sums": abs_sums}),
                    ),
                )
                state = out["state"]
                got = np.asarray(tree_checksums(state))
                saved = np.asarray(out["checksums"]["sums"])
                if got.shape != saved.shape or not np.array_equal(got, saved):
                    bad = [want_sig[i][0] for i in range(min(len(got), len(saved))) if not np.array_equal(got[i], saved[i])]
                    raise CorruptCheckpointError(f"checksum mismatch in leaves {bad[:5]}")
            except Exception as e:
                skipped.append((step, _reason(e)))
                continue
            if skipped:
                moved = self._quarantine(skipped)
                warnings.warn(
                    f"resilax: checkpoint(s) {[s for s, _ in skipped]} in {str(self.directory)!r} failed verification "
                    f"({'; '.join(f'{s}: {r}' for s, r in skipped)}); restored the previous good checkpoint {step} "
                    f"instead. The bad ones were moved to {moved}, not deleted.",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return Restored(step, state, meta, tuple(skipped))
        if skipped:
            moved = self._quarantine(skipped)
            raise CorruptCheckpointError(
                f"resilax: no good checkpoint in {str(self.directory)!r}: "
                f"{'; '.join(f'{s}: {r}' for s, r in skipped)}. They were moved to {moved}, not deleted."
            )
        return None

    def _quarantine(self, skipped) -> list[str]:
        """Moves failed step directories aside so new saves never collide with them."""
        qdir = self.directory / QUARANTINE
        qdir.mkdir(exist_ok=True)
        moved = []
        stamp = time.strftime("%Y%m%dT%H%M%S")
        for step, _ in skipped:
            src = self.directory / str(step)
            if not src.exists():
                continue
            dst = qdir / f"{step}.{stamp}"
            n = 0
            while dst.exists():
                n += 1
                dst = qdir / f"{step}.{stamp}.{n}"
            os.rename(src, dst)
            moved.append(str(dst))
        self._mgr.close()
        self._mgr = self._open()
        return moved


def _sums_sharding():
    """Where restored checksums go: one device, or replicated over every process's devices
    in a multi-process run (another process's device is not addressable here)."""
    if jax.process_count() == 1:
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("all",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _reason(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg[:200]}"


def _signature_mismatch(directory, step, saved, want) -> str:
    diffs = []
    saved_d = {p: (s, d) for p, s, d in saved}
    want_d = {p: (s, d) for p, s, d in want}
    for p in sorted(set(saved_d) | set(want_d)):
        if saved_d.get(p) != want_d.get(p):
            diffs.append(f"{p}: checkpoint {saved_d.get(p)} vs state {want_d.get(p)}")
    return (
        f"resilax: checkpoint {step} in {str(directory)!r} was written for a different state "
        f"({len(diffs)} leaves differ, e.g. {diffs[:3]}); pass the state this run was started with, "
        f"or use a new checkpoint_dir"
    )


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


def _storage_error(what, directory, e) -> StorageError:
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
    return StorageError(f"resilax checkpoints: {what} in {str(directory)!r} failed: {type(e).__name__}: {e}")
