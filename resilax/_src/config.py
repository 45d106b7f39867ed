"""`resilax.Config`: one frozen dataclass of run-time knobs, from Python, ml_collections or gin."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import gin

from resilax._src.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Config:
    """Knobs of a resilient run. Every field has a default that works on emulated CPU slices.

    Attributes:
      checkpoint_dir: directory of the persistent (Orbax) tier; ``None`` disables checkpoints.
      checkpoint_every: save every this many completed steps (0 disables periodic saves).
      checkpoint_keep: how many complete checkpoints Orbax keeps.
      async_checkpointing: write checkpoints in the background (Orbax async); the loop only
        blocks for the device-to-host copy.
      seed: base of the per-step RNG handed to a ``train_step(state, batch, rng)``; step ``n``
        gets ``fold_in(key(seed), n)``, so a resumed run sees the same keys.
      donate_state: donate the input state buffers to the step (saves a copy of the state).
      overhead_budget: failure-free overhead resilax may spend on protection, as a share of
        step time (0.01 = 1%).
      run_dir: where ``goodput.json`` (time accounting, events) is written; default
        ``checkpoint_dir``; ``None`` with no checkpoint_dir writes nothing.
      peers: keep peer copies of state that lives in one failure domain only (ring placement
        over the elastic axis) and recover from them when a domain is lost. ``None`` (default)
        = on unless ``replay_log`` is on: today the replay log and peer protection each own
        the compiled step, so only one runs (``peers=True`` with a replay log is an error).
      peer_every: make the peer copy every this many steps; 0 = choose by measuring its cost
        against ``overhead_budget`` (every step if it fits).
      compile_ahead: once the cadence is known, compile the executables of every mesh that
        losing one more domain would leave, so recovery does not wait for XLA (costs those
        compiles up front).
    """

    checkpoint_dir: str | None = None
    checkpoint_every: int = 100
    checkpoint_keep: int = 3
    async_checkpointing: bool = True
    seed: int = 0
    donate_state: bool = True
    overhead_budget: float = 0.01
    run_dir: str | None = None
    replay_log: str = "off"
    replay_log_dir: str | None = None
    log_budget_bytes: int | None = 1 << 30
    replay_max_lag: int = 2
    anomaly: bool = False
    on_anomaly: str = "skip"
    spike_zscore: float = 6.0
    spike_window: int = 50
    anomaly_metric: str = "loss"
    peers: bool | None = None
    peer_every: int = 0
    compile_ahead: bool = False

    def __post_init__(self):
        for name in ("checkpoint_dir", "run_dir"):
            _check_type(name, getattr(self, name), (str, os.PathLike, type(None)))
            if isinstance(getattr(self, name), os.PathLike):
                object.__setattr__(self, name, os.fspath(getattr(self, name)))
        for name in ("checkpoint_every", "checkpoint_keep", "seed", "peer_every"):
            _check_type(name, getattr(self, name), (int,))
        for name in ("async_checkpointing", "donate_state", "compile_ahead"):
            _check_type(name, getattr(self, name), (bool,))
        _check_type("peers", self.peers, (bool, type(None)))
        _check_type("overhead_budget", self.overhead_budget, (int, float))
        if self.checkpoint_every < 0:
            raise ConfigError(f"resilax.Config: checkpoint_every must be >= 0, but got {self.checkpoint_every}")
        if self.peer_every < 0:
            raise ConfigError(f"resilax.Config: peer_every must be >= 0 (0 = by budget), but got {self.peer_every}")
        if self.checkpoint_keep < 1:
            raise ConfigError(f"resilax.Config: checkpoint_keep must be >= 1, but got {self.checkpoint_keep}")
        _check_type("replay_log_dir", self.replay_log_dir, (str, os.PathLike, type(None)))
        if isinstance(self.replay_log_dir, os.PathLike):
            object.__setattr__(self, "replay_log_dir", os.fspath(self.replay_log_dir))
        _check_type("log_budget_bytes", self.log_budget_bytes, (int, type(None)))
        _check_type("replay_max_lag", self.replay_max_lag, (int,))
        _check_type("spike_window", self.spike_window, (int,))
        _check_type("anomaly", self.anomaly, (bool,))
        _check_type("spike_zscore", self.spike_zscore, (int, float))
        _check_type("anomaly_metric", self.anomaly_metric, (str,))
        for name, allowed in (("replay_log", ("grads", "inputs", "off")), ("on_anomaly", ("skip", "stop"))):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"resilax.Config: {name} must be one of {allowed}, but got {getattr(self, name)!r}")
        if self.log_budget_bytes is not None and self.log_budget_bytes < 0:
            raise ConfigError(f"resilax.Config: log_budget_bytes must be >= 0 or None, but got {self.log_budget_bytes}")
        if self.replay_max_lag < 0:
            raise ConfigError(f"resilax.Config: replay_max_lag must be >= 0, but got {self.replay_max_lag}")
        if self.spike_window < 3 or not self.spike_zscore > 0:
            raise ConfigError(
                f"resilax.Config: spike_window must be >= 3 and spike_zscore > 0, but got {self.spike_window} and "
                f"{self.spike_zscore}"
            )
        if self.peers and self.replay_log != "off":
            raise ConfigError(
                f"resilax.Config: peers=True and replay_log={self.replay_log!r} cannot both own the step yet; "
                "use peers=None (auto) or False with a replay log, or replay_log='off' with peers"
            )
        if self.anomaly and self.replay_log == "off":
            raise ConfigError(
                "resilax.Config: anomaly=True rolls back by replaying the log, so it needs replay_log='grads' or "
                "'inputs', but replay_log is 'off'"
            )
        if not 0 <= self.overhead_budget < 1:
            raise ConfigError(
                f"resilax.Config: overhead_budget is a share of step time in [0, 1), but got {self.overhead_budget}"
            )

    @classmethod
    def from_configdict(cls, cd: Mapping[str, Any]) -> "Config":
        """Builds a Config from an ``ml_collections.ConfigDict`` (or any mapping).

        Raises:
          ConfigError: on an unknown key (the message lists the known ones) or a bad value.
        """
        if hasattr(cd, "to_dict"):
            cd = cd.to_dict()
        if not isinstance(cd, Mapping):
            raise ConfigError(f"resilax.Config.from_configdict expects a ConfigDict or mapping, but got {type(cd).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(cd) - known)
        if unknown:
            raise ConfigError(
                f"resilax.Config.from_configdict: unknown key(s) {unknown}; known keys are {sorted(known)}"
            )
        return cls(**dict(cd))

    @classmethod
    def from_gin(cls, files=(), bindings=()) -> "Config":
        """Parses gin files/bindings and returns the bound ``resilax.Config``.

        In gin, write ``resilax.Config.checkpoint_every = 50``.
        """
        try:
            gin.parse_config_files_and_bindings(list(files), list(bindings))
        except (ValueError, SyntaxError, gin.config.ParserError if hasattr(gin.config, "ParserError") else ValueError) as e:
            raise ConfigError(f"resilax.Config.from_gin: could not parse gin config {list(files)} {list(bindings)}: {e}") from e
        try:
            return gin_config()
        except TypeError as e:
            raise ConfigError(f"resilax.Config.from_gin: bad binding: {e}") from e

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)


def _check_type(name, value, types):
    # bool is an int in Python; a flag given for a count is a mistake worth naming.
    if isinstance(value, bool) and bool not in types:
        ok = False
    else:
        ok = isinstance(value, types)
    if not ok:
        expected = " or ".join(t.__name__ for t in types)
        raise ConfigError(f"resilax.Config: {name} must be {expected}, but got {type(value).__name__} {value!r}")


# gin binds `resilax.Config.<field>`; the configurable is a subclass, so results are Configs.
gin_config = gin.external_configurable(Config, name="Config", module="resilax")
