"""Cost model: the measured and published numbers the goodput simulator runs on.

A :class:`CostModel` is a frozen record of per-event costs (seconds), sizes
(bytes) and bandwidths (bytes/s). Every field has a default for a large run
(H100/TPU class) and a ``sources`` entry saying where its value came from:

* ``"PRIOR_ART.md: ..."`` -- published figures collected in PRIOR_ART.md;
* ``"bench:<file>:<key>"`` -- a ``resilax bench ... --json`` measurement;
* ``"topology:<file>:<key>"`` -- a bandwidth from a ``slices/*.toml`` spec;
* ``"derived: ..."`` -- computed from other fields (formula given);
* ``"assumed: ..."`` -- an engineering guess, stated so; replace it with a
  measurement when you have one.

Sizes scale with the model (:meth:`CostModel.scaled`): per-device state bytes =
``model_params * state_bytes_per_param / chips`` (state fully sharded), and
transfer times are bytes over the slowest link on the path plus a fixed cost.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping

__all__ = ["CostModel", "GB", "read_topology_bandwidths"]

GB = 1e9


def _f(default: Any, source: str) -> Any:
    return dataclasses.field(default=default, metadata={"source": source})


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Per-event costs for one training job. Seconds, bytes, bytes/s.

    Ratios (overhead, replay) come from benchmarks and carry over between
    scales; absolute sizes come from :meth:`scaled`. ``sources`` maps each
    field name to where its value came from (see module docstring).
    """

    # -- step and failure-free costs --------------------------------------
    step_s: float = _f(6.0, "assumed: Llama 3 405B-like step, 16M-token global batch "
                       "at ~400 TFLOP/s per H100 on 16,384 GPUs (6*N*tokens/FLOPs ~ 6 s); "
                       "held fixed under scaling (weak scaling)")
    overhead_ratio: float = _f(1.01, "assumed: DESIGN.md protection budget, 1% of step "
                               "time (wrapped step / plain step)")
    replay_ratio: float = _f(1 / 29, "DESIGN.md: jitted replay of an 8-layer MLP step ran "
                             "29x faster than the step")
    # -- state size -------------------------------------------------------
    model_params: float = _f(405e9, "PRIOR_ART.md: Llama 3 405B")
    chips: int = _f(16384, "PRIOR_ART.md: Llama 3 405B on 16,384 H100")
    state_bytes_per_param: float = _f(12.0, "assumed: fp32 params + Adam m and v")
    devices_per_domain: int = _f(8, "PRIOR_ART.md: 16,384 GPUs on 2,048 hosts")
    chips_per_replica: int = _f(128, "assumed: TP 8 x PP 16 per data-parallel replica "
                                "(Llama 3 405B layout); the elastic unit")
    # -- bandwidths (bytes/s) --------------------------------------------
    host_bytes_s: float = _f(25 * GB, "assumed: device->host copy per device, about half "
                             "of PCIe Gen5 x16 peak")
    ici_bytes_s: float = _f(100 * GB, "assumed: NVLink / ICI per device, well under peak")
    dcn_bytes_s: float = _f(50 * GB, "assumed: one 400 Gb/s NIC per host")
    storage_read_bytes_s: float = _f(2 * GB, "assumed: per-host read from persistent "
                                     "storage (parallel FS / object store client)")
    storage_write_bytes_s: float = _f(1 * GB, "assumed: per-host write to persistent storage")
    storage_aggregate_bytes_s: float = _f(2000 * GB, "assumed: Llama 3 paper reports ~2 TB/s "
                                          "sustained from its storage cluster (not in "
                                          "PRIOR_ART.md; unverified here)")
    # -- fixed costs (s) --------------------------------------------------
    checkpoint_fixed_s: float = _f(2.0, "assumed: barrier + metadata per async save")
    blocking_s_measured: float | None = _f(None, "bench: blocking_s (None: derived from bytes)")
    persist_s_measured: float | None = _f(None, "None: derived from bytes (persist_s)")
    restore_s_measured: float | None = _f(None, "None: derived from bytes (restore_persistent_s)")
    restore_fixed_s: float = _f(60.0, "assumed: open, metadata and barriers of a large restore")
    detection_s: float = _f(60.0, "assumed: heartbeat / liveness-probe timeout; same for "
                            "every strategy")
    restart_s: float = _f(600.0, "assumed: reschedule job, start processes, "
                          "jax.distributed init at 10k+ chips")
    compile_s: float = _f(180.0, "assumed: XLA compile of a 400B-class step after restart")
    recovery_plan_s: float = _f(1.0, "assumed: planner picks sources, builds degraded mesh")
    recovery_compile_s: float = _f(10.0, "assumed: load an ahead-of-time compiled "
                                   "executable for the degraded mesh")
    host_restart_s: float = _f(120.0, "assumed: restart one host's process after a "
                               "software fault")
    repair_s: float = _f(1800.0, "assumed: swap a failed host for a spare")
    maintenance_s: float = _f(3600.0, "assumed: planned maintenance of one host")
    peer_copy_interval_steps: int = _f(10, "assumed: cadence that fits the 1% budget")
    checksum_interval_steps: int = _f(100, "assumed: cross-replica checksum cadence")
    sdc_detection_delay_s: float = _f(7200.0, "assumed: without checksums, SDC shows up as a "
                                      "loss spike some hours later")
    persistent_interval_s: float = _f(3600.0, "assumed: persistent tier cadence for "
                                      "in-memory and resilax strategies")
    # -- whole-job costs: negligible over days, dominant over a minute --
    launch_s: float = _f(0.0, "assumed: job start (launch to first step) left out of "
                         "long-run simulations")
    shutdown_s: float = _f(0.0, "assumed: job end (final checkpoint wait, process exit) "
                           "left out of long-run simulations")
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict, compare=False)

    def __post_init__(self):
        merged = {f.name: f.metadata["source"] for f in dataclasses.fields(self)
                  if "source" in f.metadata}
        merged.update(self.sources)
        object.__setattr__(self, "sources", dict(merged))
        for name in ("step_s", "overhead_ratio", "chips", "model_params"):
            if not getattr(self, name) > 0:
                raise ValueError(f"CostModel expects {name} > 0, but got "
                                 f"{getattr(self, name)!r}")

    # -- derived sizes and times -----------------------------------------
    @property
    def state_bytes(self) -> float:
        return self.model_params * self.state_bytes_per_param

    @property
    def bytes_per_device(self) -> float:
        return self.state_bytes / self.chips

    @property
    def bytes_per_domain(self) -> float:
        return self.bytes_per_device * self.devices_per_domain

    @property
    def domains(self) -> int:
        return max(1, self.chips // self.devices_per_domain)

    @property
    def replicas(self) -> int:
        return max(1, self.chips // max(1, self.chips_per_replica))

    @property
    def checkpoint_blocking_s(self) -> float:
        """Blocking part of an async save: device->host copy plus fixed cost."""
        if self.blocking_s_measured is not None:
            return self.blocking_s_measured
        return self.checkpoint_fixed_s + self.bytes_per_device / self.host_bytes_s

    @property
    def persist_s(self) -> float:
        """Background write until a persistent checkpoint is durable."""
        if self.persist_s_measured is not None:
            return self.persist_s_measured
        return max(self.bytes_per_domain / self.storage_write_bytes_s,
                   self.state_bytes / self.storage_aggregate_bytes_s)

    @property
    def restore_persistent_s(self) -> float:
        if self.restore_s_measured is not None:
            return self.restore_s_measured
        return self.restore_fixed_s + max(
            self.bytes_per_domain / self.storage_read_bytes_s,
            self.state_bytes / self.storage_aggregate_bytes_s)

    @property
    def restore_in_memory_s(self) -> float:
        """Replacement host gets its shard from a peer's RAM over DCN; others
        read their own RAM copy."""
        return (self.checkpoint_fixed_s + self.bytes_per_domain / self.dcn_bytes_s
                + self.bytes_per_device / self.host_bytes_s)

    @property
    def in_memory_replicate_s(self) -> float:
        """Background copy of a local checkpoint to a peer host (durability delay)."""
        return self.bytes_per_domain / self.dcn_bytes_s

    @property
    def restore_peer_s(self) -> float:
        """resilax: the lost domain's state from its peer copy over DCN."""
        return self.bytes_per_domain / self.dcn_bytes_s

    @property
    def reprotect_s(self) -> float:
        """Window in which a neighbour's loss is fatal: until the next peer copy lands."""
        return self.peer_copy_interval_steps * self.step_s + self.bytes_per_domain / self.dcn_bytes_s

    @property
    def rejoin_s(self) -> float:
        return self.recovery_compile_s + self.bytes_per_domain / self.dcn_bytes_s

    def describe(self) -> dict:
        """Fields, derived times and sources as a JSON-able dict."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name != "sources"}
        for name in ("state_bytes", "bytes_per_device", "bytes_per_domain", "domains",
                     "replicas", "checkpoint_blocking_s", "persist_s",
                     "restore_persistent_s", "restore_in_memory_s", "restore_peer_s",
                     "reprotect_s", "rejoin_s"):
            out[name] = getattr(self, name)
        out["sources"] = dict(self.sources)
        return out

    # -- constructors ----------------------------------------------------
    def replace(self, _source: str | None = None, **changes: Any) -> "CostModel":
        """A copy with ``changes``; each changed field's source becomes ``_source``
        (default ``"given"``)."""
        sources = dict(self.sources)
        for k in changes:
            sources[k] = _source or "given"
        return dataclasses.replace(self, sources=sources, **changes)

    def scaled(self, model_params: float | None = None, chips: int | None = None,
               topology_bandwidths: Mapping[str, Any] | None = None) -> "CostModel":
        """Same measured ratios, new model size, chip count and link bandwidths.

        ``topology_bandwidths`` takes the keys of :func:`read_topology_bandwidths`
        (bytes/s fields plus ``devices_per_domain``) and an optional ``_file``
        used in the sources. Size-derived times follow from the properties.
        """
        changes: dict[str, Any] = {}
        if model_params is not None:
            changes["model_params"] = float(model_params)
        if chips is not None:
            changes["chips"] = int(chips)
        new = self.replace("given", **changes) if changes else self
        if topology_bandwidths:
            tb = dict(topology_bandwidths)
            origin = tb.pop("_file", "topology")
            keep = {k: v for k, v in tb.items()
                    if k in {f.name for f in dataclasses.fields(CostModel)}}
            new = new.replace(None, **keep)
            srcs = dict(new.sources)
            for k in keep:
                srcs[k] = f"topology:{origin}:{k}"
            new = dataclasses.replace(new, sources=srcs)
        # A replica cannot be larger than the job.
        if new.chips_per_replica > new.chips:
            new = new.replace("derived: capped at chips", chips_per_replica=new.chips)
        return new

    @classmethod
    def from_bench_json(cls, *paths: str | os.PathLike, base: "CostModel | None" = None
                        ) -> "CostModel":
        """Build from ``resilax bench ... --json`` outputs, over ``base`` (defaults).

        Reads, wherever they appear (top level or nested): ``ratio``, ``step_s``,
        ``blocking_s``, ``plain_blocking_s``, ``replay_s_per_step``,
        ``recovery_s_by_phase`` (detect/plan/restore/compile/replay),
        ``lost_steps``, ``recovery_steps``. Missing files or keys keep the base
        value; ``sources`` records which file and key each number came from.
        Unreadable JSON is skipped, noted in ``sources["_skipped"]``.
        """
        cm = base or cls()
        found: dict[str, tuple[Any, str]] = {}
        skipped = []
        for p in paths:
            p = os.fspath(p)
            try:
                with open(p, encoding="utf-8") as f:
                    data = json.load(f)
            except (OSError, ValueError) as e:
                skipped.append(f"{p}: {type(e).__name__}")
                continue
            for key in ("ratio", "step_s", "blocking_s", "plain_blocking_s",
                        "replay_s_per_step", "recovery_s_by_phase", "lost_steps",
                        "recovery_steps"):
                val = _find_key(data, key)
                if val is not None and key not in found:
                    found[key] = (val, f"bench:{os.path.basename(p)}:{key}")
        changes: dict[str, Any] = {}
        srcs: dict[str, str] = {}

        def take(field: str, value: Any, src: str) -> None:
            changes[field] = value
            srcs[field] = src

        if "ratio" in found and _num(found["ratio"][0]):
            take("overhead_ratio", float(found["ratio"][0]), found["ratio"][1])
        if "step_s" in found and _num(found["step_s"][0]):
            # A bench step on CPU says nothing about a 405B step: keep it only
            # as the denominator of replay_ratio, not as step_s.
            bench_step = float(found["step_s"][0])
            if "replay_s_per_step" in found and _num(found["replay_s_per_step"][0]):
                take("replay_ratio", float(found["replay_s_per_step"][0]) / bench_step,
                     f"{found['replay_s_per_step'][1]} / {found['step_s'][1]}")
        if "blocking_s" in found and _num(found["blocking_s"][0]):
            take("blocking_s_measured", float(found["blocking_s"][0]), found["blocking_s"][1])
        phases = found.get("recovery_s_by_phase")
        if phases and isinstance(phases[0], Mapping):
            ph, src = phases
            for key, field in (("detect", "detection_s"), ("detection", "detection_s"),
                               ("plan", "recovery_plan_s"), ("compile", "recovery_compile_s")):
                if key in ph and _num(ph[key]) and field not in changes:
                    take(field, float(ph[key]), f"{src}.{key}")
        if "plain_blocking_s" in found:
            srcs["_plain_blocking_s"] = f"{found['plain_blocking_s'][1]}={found['plain_blocking_s'][0]}"
        for k in ("lost_steps", "recovery_steps"):
            if k in found:
                srcs[f"_{k}"] = f"{found[k][1]}={found[k][0]}"
        if skipped:
            srcs["_skipped"] = "; ".join(skipped)
        sources = dict(cm.sources)
        sources.update(srcs)
        return dataclasses.replace(cm, sources=sources, **changes)


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _find_key(data: Any, key: str) -> Any:
    """First value stored under ``key`` in a nested JSON value (breadth first)."""
    queue = [data]
    while queue:
        cur = queue.pop(0)
        if isinstance(cur, dict):
            if key in cur:
                return cur[key]
            queue.extend(cur.values())
        elif isinstance(cur, list):
            queue.extend(cur)
    return None


# topology key -> (CostModel field, factor to bytes/s). ``*_gbps`` are gigabits
# per second (network convention); ``*_GBps`` / ``*_gbytes_s`` are gigabytes.
_TOPO_KEYS = {
    "ici": "ici_bytes_s", "dcn": "dcn_bytes_s", "host": "host_bytes_s",
    "storage": "storage_read_bytes_s", "storage_read": "storage_read_bytes_s",
    "storage_write": "storage_write_bytes_s",
    "storage_aggregate": "storage_aggregate_bytes_s",
}


def read_topology_bandwidths(path: str | os.PathLike) -> dict[str, Any]:
    """Bandwidths and domain size from a ``slices/*.toml`` spec, tolerantly.

    Reads the ``[bandwidth]`` table: ``<link>_gbps`` (gigabits/s),
    ``<link>_GBps`` or ``<link>_gbytes_s`` (gigabytes/s) for links ici, dcn,
    host, storage (storage_read, storage_write, storage_aggregate), and
    ``devices_per_domain`` / ``devices_per_slice`` / ``devices_per_host``
    anywhere in the file. Missing keys are simply absent from the result; a
    missing file raises FileNotFoundError. ``storage`` alone sets both read and
    write. Returns CostModel field names -> values, plus ``_file``.
    """
    import tomllib

    with open(path, "rb") as f:
        spec = tomllib.load(f)
    out: dict[str, Any] = {"_file": os.path.basename(os.fspath(path))}
    bw = spec.get("bandwidth", {}) if isinstance(spec.get("bandwidth"), dict) else {}
    for key, val in bw.items():
        if not _num(val) or val <= 0:
            continue
        for suffix, factor in (("_gbps", GB / 8), ("_GBps", GB), ("_gbytes_s", GB)):
            if key.endswith(suffix):
                link = key[: -len(suffix)]
                if link in _TOPO_KEYS:
                    out[_TOPO_KEYS[link]] = float(val) * factor
                    if link == "storage":
                        out.setdefault("storage_write_bytes_s", float(val) * factor)
                break
    for key in ("devices_per_domain", "devices_per_slice", "devices_per_host"):
        val = _find_key(spec, key)
        if _num(val) and val > 0:
            out["devices_per_domain"] = int(val)
            break
    return out
