"""`resilax.Config`: one frozen dataclass, in groups; from Python, ml_collections or gin.

Each protection is a group: present means on, ``None`` means off. No tri-state flags and no
cross-field exclusions: every combination of groups is valid.

    Config()                                            # peers, record log, anomaly skip: all on
    Config(checkpoint=CheckpointConfig("/ckpt"))        # ... and checkpoints (+ the log on disk)
    Config(peers=None, anomaly=None)                    # only the record log (device/host)
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import gin

from resilax._src.errors import ConfigError


def _check_type(where, name, value, types):
    # bool is an int in Python; a flag given for a count is a mistake worth naming.
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
    if not ok:
        expected = " or ".join("None" if t is type(None) else t.__name__ for t in types)
        raise ConfigError(f"resilax.{where}: {name} must be {expected}, but got {type(value).__name__} {value!r}")


def _path(where, name, value, *, optional):
    _check_type(where, name, value, (str, os.PathLike, type(None)) if optional else (str, os.PathLike))
    return None if value is None else os.fspath(value)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Persistent tier: Orbax async checkpoints in ``directory``.

    Attributes:
      directory: checkpoint root (created if missing). The record log's disk sink lives in
        ``directory/record_log`` unless `LogConfig.directory` says otherwise. A
        single-process run holds it while its step is open (``directory/resilax.lock``,
        released when the step closes or the process ends): a second run there gets a
        `CheckpointError` naming the first one's pid.
      every: save every this many completed steps (0: only explicit `ResilientStep.save`).
      keep: complete checkpoints Orbax keeps.
      async_save: write in the background; the loop blocks only for the device-to-host copy.
      pack: save the leaves that share a dtype and a sharding as one array
        (docs/packed_checkpoints.md; Orbax's save costs ~2-5 ms of host Python per array,
        beside the loop: on one H200 a 110 M-parameter GPT's saves blocked its loop 89-101 ms
        packed, 669-785 ms per leaf). ``None``: on, unless the ``RESILAX_PACK_CHECKPOINTS``
        environment variable is ``0``; ``False``: one array per leaf, as plain Orbax saves.
        A restore reads either layout, whatever this says.
      compress: zstd-compress the arrays (Orbax's default). On float train state it saves
        ~10% of the disk and of the bytes written; off, a restore (what a recovery from
        storage waits for) took 0.55x the time, at about the same CPU per save
        (`benchmarks/compression_cost.py`, docs/performance.md). A restore reads either,
        whatever this says.
    """

    directory: str
    every: int = 100
    keep: int = 3
    async_save: bool = True
    pack: bool | None = None
    compress: bool = True

    def __post_init__(self):
        object.__setattr__(self, "directory", _path("CheckpointConfig", "directory", self.directory, optional=False))
        for name in ("every", "keep"):
            _check_type("CheckpointConfig", name, getattr(self, name), (int,))
        _check_type("CheckpointConfig", "async_save", self.async_save, (bool,))
        _check_type("CheckpointConfig", "pack", self.pack, (bool, type(None)))
        _check_type("CheckpointConfig", "compress", self.compress, (bool,))
        if self.every < 0:
            raise ConfigError(f"resilax.CheckpointConfig: every must be >= 0, but got {self.every}")
        if self.keep < 1:
            raise ConfigError(f"resilax.CheckpointConfig: keep must be >= 1, but got {self.keep}")


@dataclasses.dataclass(frozen=True)
class LogConfig:
    """The record log: what `resilax.record` marked, per step, for exact replay.

    Sinks: device memory with a ring copy on the next failure domain (between peer copies;
    survives a domain loss), host memory (the batches since the newest checkpoint or peer
    copy, for recompute), and disk (survives a process kill) when a directory is known.

    Attributes:
      directory: disk sink; default ``<checkpoint directory>/record_log``; with neither,
        no disk sink (nothing is written to a place a restart could not find).
      mode: what a disk entry holds: ``"grads"`` (the recorded values: replay runs only the
        update) or ``"inputs"`` (the data position: replay reruns the step on the batch;
        without a data iterator the entry holds the batch itself, copied at the call).
      budget_bytes: grads entries on disk kept within this many bytes (older steps keep their
        inputs entry); ``None``: no limit.
      max_lag: disk entries that may be in flight before a step blocks; a SIGKILL resumes
        within this many steps of where it died.
      device_bytes: cap on device memory held by logged entries between peer copies; past
        it a peer copy is made early. ``None``: no cap.
      grads_budget: in ``"grads"`` mode, the share of step time the disk writer may spend
        on grads entries (its measured CPU seconds per entry against the measured step
        time; a token bucket). A step over budget gets only its inputs entry, which a
        resume replays by rerunning the step from the data iterator: bitwise the same on the
        same mesh, just slower to replay. On a 41 MB model on 2 CPU cores a grads entry
        every step cost ~20% of the step (13.7 MB hashed, copied and written per step).
        Without a data iterator (``init(state, data=...)``) the inputs entries carry the
        step's batch (copied at the call; replayed by rerunning the step on it) when the
        batch is no larger than the recorded values; when it is larger, every step keeps its
        grads entry instead. On the tiny GPT (8 emulated CPU devices) a grads entry every
        step cost +34% of the step, an inputs entry with the batch +5%.
        ``None``: a grads entry every step.
      copy_batches: the log keeps its own copy of each host batch it retains (for a
        recompute after a domain loss, and the disk entries): the caller may then reuse its
        arrays once a call returned. ``False`` saves that copy, one host memcpy of the batch
        per step (measured here: 0.04 ms for 32 x 512 int32 tokens; 11 ms for 256 x 224 x
        224 x 3 uint8 images, 34 ms as float32), for a caller that gives every step fresh
        arrays and never changes them (grain's iterators do): a changed array would make a
        recompute or a replay run on the changed values.
    """

    directory: str | None = None
    mode: str = "grads"
    budget_bytes: int | None = 1 << 30
    max_lag: int = 2
    device_bytes: int | None = 1 << 30
    grads_budget: float | None = 0.01
    copy_batches: bool = True

    def __post_init__(self):
        object.__setattr__(self, "directory", _path("LogConfig", "directory", self.directory, optional=True))
        if self.mode not in ("grads", "inputs"):
            raise ConfigError(f"resilax.LogConfig: mode must be 'grads' or 'inputs', but got {self.mode!r}")
        for name in ("budget_bytes", "device_bytes"):
            _check_type("LogConfig", name, getattr(self, name), (int, type(None)))
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ConfigError(f"resilax.LogConfig: {name} must be >= 0 or None, but got {getattr(self, name)}")
        _check_type("LogConfig", "max_lag", self.max_lag, (int,))
        if self.max_lag < 0:
            raise ConfigError(f"resilax.LogConfig: max_lag must be >= 0, but got {self.max_lag}")
        _check_type("LogConfig", "copy_batches", self.copy_batches, (bool,))
        _check_type("LogConfig", "grads_budget", self.grads_budget, (int, float, type(None)))
        if self.grads_budget is not None and not 0 < self.grads_budget <= 1:
            raise ConfigError(f"resilax.LogConfig: grads_budget must be in (0, 1] or None, but got {self.grads_budget}")


@dataclasses.dataclass(frozen=True)
class PeersConfig:
    """Peer copies: state that lives in one failure domain only gets a copy on the next
    domain of the elastic axis (ring). State replicated across domains is its own backup.

    Attributes:
      every: copy every this many steps; between copies the record log's device entries
        (ring-copied too) cover the steps. 1 = every step (no replay needed on recovery).
        ``"auto"``: chosen from measured costs so that copies (and the log's device entries
        between them) cost at most ``budget`` of a step (see ``protect/cadence.py``): every
        step where copies are that cheap (fast interconnect, overlapped with compute), else
        the smallest cadence that fits, with or without device log entries between copies;
        a recovery then recomputes the steps since the newest copy from their batches
        (within the default mode's tolerance, bitwise in the bit-exact mode). Needs the
        record log (it keeps those batches); without it copies stay at every step.
      log_entries_between: with ``every > 1``, the record log keeps each step's recorded
        values between copies, ring-copied (a recovery replays only their update: bitwise,
        fast; costs device memory and a ring copy of the recorded values per step); False:
        a recovery recomputes those steps from their retained batches. ``"auto"`` chooses.
      budget: with ``every="auto"``, the share of step time peer copies may cost.
      max_every: with ``every="auto"``, the longest cadence (the most steps a recovery may
        have to recompute); when even that is over budget it is used and the report says
        the budget is not met.
      calibration_samples: with ``every="auto"``, timed steps per variant when calibrating
        (each blocked to completion; once per mesh, after its background compiles).
      compile_ahead: compile the executables of every mesh one more domain loss would leave,
        on a background thread (never on a step's critical path), so a recovery does not
        wait for XLA; a recovery that comes first waits for the compile in flight.
      device_memory_bytes: memory per device a degraded mesh may use; on a smaller mesh the
        gradient part runs on the global batch when its compiled program fits, else in
        microbatches. ``None``: the device's own limit (unbounded where it reports none).
    """

    every: int | str = 1
    compile_ahead: bool = True
    device_memory_bytes: int | None = None
    log_entries_between: bool = True
    budget: float = 0.01
    max_every: int = 16
    calibration_samples: int = 8

    def __post_init__(self):
        if self.every != "auto":
            _check_type("PeersConfig", "every", self.every, (int, str))
            if isinstance(self.every, str):
                raise ConfigError(f"resilax.PeersConfig: every must be an int >= 1 or 'auto', but got {self.every!r}")
        _check_type("PeersConfig", "compile_ahead", self.compile_ahead, (bool,))
        _check_type("PeersConfig", "device_memory_bytes", self.device_memory_bytes, (int, type(None)))
        if self.every != "auto" and self.every < 1:
            raise ConfigError(f"resilax.PeersConfig: every must be >= 1, but got {self.every}")
        _check_type("PeersConfig", "log_entries_between", self.log_entries_between, (bool,))
        _check_type("PeersConfig", "budget", self.budget, (int, float))
        if not 0 < self.budget <= 1:
            raise ConfigError(f"resilax.PeersConfig: budget must be in (0, 1], but got {self.budget}")
        for name, least in (("max_every", 1), ("calibration_samples", 3)):
            _check_type("PeersConfig", name, getattr(self, name), (int,))
            if getattr(self, name) < least:
                raise ConfigError(f"resilax.PeersConfig: {name} must be >= {least}, but got {getattr(self, name)}")
        if self.device_memory_bytes is not None and self.device_memory_bytes <= 0:
            raise ConfigError(
                f"resilax.PeersConfig: device_memory_bytes must be > 0 or None, but got {self.device_memory_bytes}")


@dataclasses.dataclass(frozen=True)
class AnomalyConfig:
    """Numerical anomalies, decided inside the compiled step (no host sync, no rollback):
    a step whose recorded values are not finite, or whose ``metric`` is an upward spike
    (robust z-score over the last ``spike_window`` good steps), applies no update.

    Attributes:
      on_anomaly: ``"skip"`` (the step leaves the state as it was; an event says so) or
        ``"stop"`` (raise `AnomalyError` when the host sees it, one step later).
      spike_zscore: threshold; ``None`` turns spike detection off (NaN/Inf only).
      spike_window: good steps the median and MAD are taken over.
      min_history: no spike verdict before this many good steps.
      metric: the metric spikes are looked for in.
    """

    on_anomaly: str = "skip"
    spike_zscore: float | None = 6.0
    spike_window: int = 50
    min_history: int = 10
    metric: str = "loss"

    def __post_init__(self):
        if self.on_anomaly not in ("skip", "stop"):
            raise ConfigError(f"resilax.AnomalyConfig: on_anomaly must be 'skip' or 'stop', but got {self.on_anomaly!r}")
        _check_type("AnomalyConfig", "spike_zscore", self.spike_zscore, (int, float, type(None)))
        for name in ("spike_window", "min_history"):
            _check_type("AnomalyConfig", name, getattr(self, name), (int,))
        _check_type("AnomalyConfig", "metric", self.metric, (str,))
        if self.spike_zscore is not None and not self.spike_zscore > 0:
            raise ConfigError(f"resilax.AnomalyConfig: spike_zscore must be > 0 or None, but got {self.spike_zscore}")
        if self.spike_window < 3 or not 1 <= self.min_history <= self.spike_window:
            raise ConfigError(
                f"resilax.AnomalyConfig: need spike_window >= 3 and 1 <= min_history <= spike_window, but got "
                f"spike_window={self.spike_window}, min_history={self.min_history}")


@dataclasses.dataclass(frozen=True)
class VerifyConfig:
    """Cross-check of each mesh's compiled gradient part against the same step on one
    device with no partitioning, on the first step the mesh runs (the full mesh, and a
    smaller one after a recovery): catches a sharding XLA compiles wrongly, which would
    otherwise train on silently wrong gradients (see ``protect/crosscheck.py``).

    Attributes:
      rtol: a recorded leaf differs when ``||a - b|| > tol * max(||b||, 1e-3 * ||tree||)``,
        ``tol = max(rtol, 2 * u(d) * sqrt(n(d)))`` over the float dtypes ``d`` the gradient
        part computes in (``u``: unit roundoff, bf16 ``2^-8``; ``n``: its longest reduction
        in ``d``, read from the jaxpr; derivation in ``protect/crosscheck.py``), at least 50
        ulps of the recorded dtype. A mesh of one device is not checked (an event says so).
      max_bytes: skip the check (an event says so) when state + batch exceed this many
        bytes: one device must hold them. ``None``: always check.
      on_mismatch: ``"raise"`` (`ProgramMismatchError`, before the update runs: the state
        is untouched) or ``"warn"``.
    """

    rtol: float = 1e-3
    max_bytes: int | None = 1 << 30
    on_mismatch: str = "raise"

    def __post_init__(self):
        _check_type("VerifyConfig", "rtol", self.rtol, (int, float))
        _check_type("VerifyConfig", "max_bytes", self.max_bytes, (int, type(None)))
        if not self.rtol > 0:
            raise ConfigError(f"resilax.VerifyConfig: rtol must be > 0, but got {self.rtol}")
        if self.max_bytes is not None and self.max_bytes < 0:
            raise ConfigError(f"resilax.VerifyConfig: max_bytes must be >= 0 or None, but got {self.max_bytes}")
        if self.on_mismatch not in ("raise", "warn"):
            raise ConfigError(f"resilax.VerifyConfig: on_mismatch must be 'raise' or 'warn', but got {self.on_mismatch!r}")


@dataclasses.dataclass(frozen=True)
class DeterministicConfig:
    """The bit-exact elastic mode: the trajectory is bitwise the same whatever the number of
    live failure domains (see ``step/deterministic.py`` and docs/recovery.md).

    Gradients are computed over ``replicas`` virtual replicas of ``B / replicas`` examples
    each (each with its own random stream, BatchNorm statistics per replica), each by the
    same one-domain executable, and combined in a fixed order; the state is replicated
    across failure domains (sharded only inside a domain).

    Attributes:
      replicas: virtual replicas; ``None``: the topology's number of failure domains. Must
        divide the global batch.
    """

    replicas: int | None = None

    def __post_init__(self):
        _check_type("DeterministicConfig", "replicas", self.replicas, (int, type(None)))
        if self.replicas is not None and self.replicas < 1:
            raise ConfigError(f"resilax.DeterministicConfig: replicas must be >= 1 or None, but got {self.replicas}")


@dataclasses.dataclass(frozen=True)
class HealthConfig:
    """Slice health checks (see ``protect/sdc.py`` and ``runtime/health.py``).

    Attributes:
      sdc_every: compare the checksums of the state's replicas across failure domains at
        the start of every this-many-th step, before the state is used (and before every
        checkpoint save). With 1 a domain outvoted by a strict majority is treated as failed
        and the run goes on from the good replicas. Found later (the corrupted values may
        have entered every replica's update), or with two replicas, the step is rebuilt from
        the newest checkpoint and the record log and the run goes on from that (see
        ``protect/sdc.py``); with no checkpoint to rebuild from it is a
        `SilentDataCorruptionError`. ``"auto"`` (the default): every step while the check's
        cost is measured, then the shortest cadence whose checks cost at most ``sdc_budget``
        of a step (at most ``sdc_max_every``); every step when there is no checkpoint to
        rebuild a late find from.
      sdc_budget, sdc_max_every: with ``sdc_every="auto"``, the share of step time the
        checks may cost, and the longest cadence (the most steps a find may be late).
      hang_detect_s: a failure domain that does not answer a liveness probe (a tiny
        computation on its devices) within this many seconds is hung: it is failed (its
        memory dropped) and the run goes on from the others. None: no liveness watchdog.
      probe_every_s: seconds between probe rounds (a watchdog thread, off the step's path).
      step_deadline_factor, step_deadline_min_s: a step call running longer than
        ``max(step_deadline_min_s, step_deadline_factor x median call time)`` probes every
        domain at once (so a hang that stops the step is found within deadline +
        ``hang_detect_s``).
      straggler_factor: a domain whose probe answer time is more than this many times the
        others' (their median) in each of the last ``straggler_rounds`` rounds is a
        straggler (event ``straggler``); None: not checked.
      remove_stragglers: fail a straggler like a dead domain (default: only report it).
      rejoin_answering: the watchdog keeps probing failed domains; one that answers again
        (repaired, replaced) rejoins at the next step boundary, state from its peers
        (default). False: an event ``domain_answering`` only.
    """

    sdc_every: int | str = "auto"
    sdc_budget: float = 0.01
    sdc_max_every: int = 16
    hang_detect_s: float | None = 5.0
    probe_every_s: float = 1.0
    step_deadline_factor: float = 10.0
    step_deadline_min_s: float = 5.0
    straggler_factor: float | None = 4.0
    straggler_rounds: int = 5
    remove_stragglers: bool = False
    rejoin_answering: bool = True

    def __post_init__(self):
        if self.sdc_every != "auto":
            _check_type("HealthConfig", "sdc_every", self.sdc_every, (int, str))
            if isinstance(self.sdc_every, str) or self.sdc_every < 1:
                raise ConfigError(f"resilax.HealthConfig: sdc_every must be an int >= 1 or 'auto', but got "
                                  f"{self.sdc_every!r}")
        _check_type("HealthConfig", "sdc_budget", self.sdc_budget, (int, float))
        if not 0 < self.sdc_budget <= 1:
            raise ConfigError(f"resilax.HealthConfig: sdc_budget must be in (0, 1], but got {self.sdc_budget}")
        _check_type("HealthConfig", "sdc_max_every", self.sdc_max_every, (int,))
        if self.sdc_max_every < 1:
            raise ConfigError(f"resilax.HealthConfig: sdc_max_every must be >= 1, but got {self.sdc_max_every}")
        for name, optional in (("hang_detect_s", True), ("probe_every_s", False), ("step_deadline_factor", False),
                               ("step_deadline_min_s", False), ("straggler_factor", True)):
            v = getattr(self, name)
            _check_type("HealthConfig", name, v, (int, float, type(None)) if optional else (int, float))
            if v is not None and not v > 0:
                raise ConfigError(f"resilax.HealthConfig: {name} must be > 0, but got {v}")
        if self.straggler_factor is not None and self.straggler_factor <= 1:
            raise ConfigError(f"resilax.HealthConfig: straggler_factor must be > 1, but got {self.straggler_factor}")
        _check_type("HealthConfig", "straggler_rounds", self.straggler_rounds, (int,))
        if self.straggler_rounds < 1:
            raise ConfigError(f"resilax.HealthConfig: straggler_rounds must be >= 1, but got {self.straggler_rounds}")
        _check_type("HealthConfig", "remove_stragglers", self.remove_stragglers, (bool,))
        _check_type("HealthConfig", "rejoin_answering", self.rejoin_answering, (bool,))


_GROUPS = {"checkpoint": CheckpointConfig, "log": LogConfig, "peers": PeersConfig, "anomaly": AnomalyConfig,
           "verify": VerifyConfig, "deterministic": DeterministicConfig,
           "health": HealthConfig}


@dataclasses.dataclass(frozen=True)
class Config:
    """Knobs of a resilient run. The default turns on every protection the run allows:
    peer copies (when the topology has more than one domain and some state lives in one
    domain only), the record log (device always; disk when a directory is known) and NaN /
    spike skipping; checkpoints when `checkpoint` names a directory.

    Attributes:
      checkpoint, log, peers, anomaly: the protection groups; ``None`` turns one off.
      verify: the cross-check of each mesh's compiled gradient part (`VerifyConfig`).
      deterministic: the bit-exact elastic mode (`DeterministicConfig`); ``None``: the
        default mode (the same maths on every mesh up to reduction order).
      health: slice health checks (`HealthConfig`: replica checksums against silent data
        corruption); ``None``: off.
      seed: base of the per-step RNG (``wrap(..., rng=True)``): step ``n`` gets
        ``fold_in(key(seed), n)``, so a resumed or replayed step sees the same key.
      donate_state: donate the input state to the step (saves a copy of the state).
      run_dir: where ``goodput.json`` goes; default the checkpoint directory.
    """

    checkpoint: CheckpointConfig | None = None
    log: LogConfig | None = LogConfig()
    peers: PeersConfig | None = PeersConfig()
    anomaly: AnomalyConfig | None = AnomalyConfig()
    verify: VerifyConfig | None = VerifyConfig()
    deterministic: DeterministicConfig | None = None
    health: HealthConfig | None = None
    seed: int = 0
    donate_state: bool = True
    run_dir: str | None = None

    def __post_init__(self):
        for name, cls in _GROUPS.items():
            value = getattr(self, name)
            if isinstance(value, Mapping):  # nested dicts from ml_collections or JSON
                value = _group_from_mapping(cls, value, name)
                object.__setattr__(self, name, value)
            if value is not None and not isinstance(value, cls):
                raise ConfigError(
                    f"resilax.Config: {name} must be a resilax.{cls.__name__} or None, but got {type(value).__name__} "
                    f"{value!r}")
        _check_type("Config", "seed", self.seed, (int,))
        _check_type("Config", "donate_state", self.donate_state, (bool,))
        object.__setattr__(self, "run_dir", _path("Config", "run_dir", self.run_dir, optional=True))

    @property
    def log_directory(self) -> str | None:
        """The record log's disk sink, or None (no directory known: no disk sink)."""
        if self.log is None:
            return None
        if self.log.directory is not None:
            return self.log.directory
        return os.path.join(self.checkpoint.directory, "record_log") if self.checkpoint is not None else None

    @classmethod
    def from_configdict(cls, cd: Any) -> "Config":
        """Builds a Config from an ``ml_collections.ConfigDict`` (or any mapping), groups as
        nested mappings (``{"checkpoint": {"directory": ..., "every": 50}, "peers": None}``).

        Raises:
          ConfigError: an unknown key (the message lists the known ones) or a bad value.
        """
        if hasattr(cd, "to_dict"):
            cd = cd.to_dict()
        if not isinstance(cd, Mapping):
            raise ConfigError(f"resilax.Config.from_configdict expects a ConfigDict or mapping, but got {type(cd).__name__}")
        _check_keys("Config.from_configdict", cls, cd)
        return cls(**dict(cd))

    @classmethod
    def from_gin(cls, files=(), bindings=()) -> "Config":
        """Parses gin files/bindings and returns the bound ``resilax.Config``.

        In gin: ``resilax.Config.checkpoint = @resilax.CheckpointConfig()`` and
        ``resilax.CheckpointConfig.directory = "/tmp/ckpt"``; ``resilax.Config.peers = None``.
        """
        try:
            gin.parse_config_files_and_bindings(list(files), list(bindings))
        except Exception as e:  # gin raises ValueError, SyntaxError, ParserError...
            raise ConfigError(f"resilax.Config.from_gin: could not parse gin config {list(files)} {list(bindings)}: {e}") from e
        try:
            return _gin_config()
        except TypeError as e:
            raise ConfigError(f"resilax.Config.from_gin: bad binding: {e}") from e

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """Plain nested dict (JSON-able); `from_configdict` reads it back."""
        return dataclasses.asdict(self)


def _check_keys(where, cls, mapping):
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(mapping) - known)
    if unknown:
        raise ConfigError(f"resilax.{where}: unknown key(s) {unknown} for {cls.__name__}; known keys are {sorted(known)}")


def _group_from_mapping(cls, mapping, name):
    _check_keys(f"Config.{name}", cls, mapping)
    return cls(**dict(mapping))


# gin binds `resilax.Config.<field>` and `resilax.<Group>.<field>`; the configurables are
# subclasses, so results are instances of the classes above.
_gin_config = gin.external_configurable(Config, name="Config", module="resilax")
for _cls in _GROUPS.values():
    gin.external_configurable(_cls, name=_cls.__name__, module="resilax")
