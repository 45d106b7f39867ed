"""Topology: failure domains, mesh axes, and which axis is elastic (spans domains).

A spec (``slices/*.toml``) says what dies together (a TPU slice, a GPU host, one emulated
slice of CPU devices), how many devices each domain has, and how those devices form mesh
axes. The first mesh axis is the elastic one: one entry per failure domain, so losing a
domain shrinks that axis and nothing else.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import tomllib
from typing import Any, Mapping, Sequence

import numpy as np

from resilax._src.errors import TopologyError

_PLATFORMS = ("cpu", "tpu", "gpu")


@dataclasses.dataclass(frozen=True)
class Topology:
    """Failure domains and mesh layout of a run.

    Attributes:
      name: spec name (``cpu-2x4``).
      platform: ``cpu``, ``tpu`` or ``gpu``; the jax platform the devices must have.
      domain_kind: what one failure domain is (``slice``, ``host``, ``gpu``).
      num_domains: failure domains in the run.
      devices_per_domain: devices in each domain.
      axis_names: mesh axes, elastic axis first.
      axis_sizes: sizes of ``axis_names``; ``axis_sizes[0] == num_domains`` and the rest
        multiply to ``devices_per_domain``.
      bandwidth: link bandwidths in GB/s (``ici``, ``dcn``, ``host``, ``storage``) used by
        the cost model; ``bandwidth_sources`` says where each figure comes from.
      pipeline: for a job whose failure domain is one pipeline stage of one data replica
        (the spec's ``[pipeline]`` table): ``{"replicas": D, "stages": S}`` with ``D * S``
        domains, domain ``r * S + s`` holding stage ``s`` of replica ``r``
        (`resilax.PipelineExecutor` runs such jobs). Empty otherwise.
    """

    name: str
    platform: str
    domain_kind: str
    num_domains: int
    devices_per_domain: int
    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    bandwidth: Mapping[str, float] = dataclasses.field(default_factory=dict)
    bandwidth_sources: Mapping[str, str] = dataclasses.field(default_factory=dict)
    is_emulated: bool = False
    pipeline: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        where = f"resilax.Topology {self.name!r}"
        if self.platform not in _PLATFORMS:
            raise TopologyError(f"{where}: platform must be one of {_PLATFORMS}, but got {self.platform!r}")
        if not (isinstance(self.num_domains, int) and self.num_domains >= 1):
            raise TopologyError(f"{where}: num_domains must be a positive int, but got {self.num_domains!r}")
        if not (isinstance(self.devices_per_domain, int) and self.devices_per_domain >= 1):
            raise TopologyError(f"{where}: devices_per_domain must be a positive int, but got {self.devices_per_domain!r}")
        if len(self.axis_names) != len(self.axis_sizes) or not self.axis_names:
            raise TopologyError(
                f"{where}: mesh axes {list(self.axis_names)} and sizes {list(self.axis_sizes)} must be non-empty and of equal length"
            )
        if len(set(self.axis_names)) != len(self.axis_names):
            raise TopologyError(f"{where}: mesh axis names repeat: {list(self.axis_names)}")
        if self.axis_sizes[0] != self.num_domains:
            raise TopologyError(
                f"{where}: the elastic axis {self.axis_names[0]!r} (first mesh axis) must have one entry per failure "
                f"domain ({self.num_domains}), but has size {self.axis_sizes[0]}"
            )
        if self.pipeline:
            if set(self.pipeline) != {"replicas", "stages"} or not all(
                    isinstance(v, int) and v >= 1 for v in self.pipeline.values()):
                raise TopologyError(f"{where}: [pipeline] needs positive ints replicas and stages, but got "
                                    f"{dict(self.pipeline)}")
            if self.pipeline["replicas"] * self.pipeline["stages"] != self.num_domains:
                raise TopologyError(
                    f"{where}: [pipeline] {self.pipeline['replicas']} replicas x {self.pipeline['stages']} stages "
                    f"need one failure domain each, but the spec has {self.num_domains} domains")
        inner = math.prod(self.axis_sizes[1:])
        if inner != self.devices_per_domain:
            raise TopologyError(
                f"{where}: the axes inside a domain {dict(zip(self.axis_names[1:], self.axis_sizes[1:]))} hold {inner} "
                f"devices, but each domain has devices_per_domain={self.devices_per_domain}"
            )

    # ----------------------------------------------------------------- constructors
    @classmethod
    def emulated(cls, slices: int = 2, devices_per_slice: int = 4) -> "Topology":
        """CPU devices grouped into ``slices`` emulated slices; mesh axes ``data`` x ``fsdp``."""
        return cls(
            name=f"cpu-{slices}x{devices_per_slice}",
            platform="cpu",
            domain_kind="slice",
            num_domains=slices,
            devices_per_domain=devices_per_slice,
            axis_names=("data", "fsdp"),
            axis_sizes=(slices, devices_per_slice),
            bandwidth={"ici": 10.0, "dcn": 10.0, "host": 10.0, "storage": 1.0},
            bandwidth_sources={k: "emulated: CPU devices share host RAM" for k in ("ici", "dcn", "host", "storage")},
            is_emulated=True,
        )

    @classmethod
    def load(cls, spec: str | os.PathLike) -> "Topology":
        """Reads a spec: a path to a ``.toml`` file, or a name found in ``slices/``.

        Raises:
          TopologyError: the file is missing, not TOML, or its fields are malformed.
        """
        path = _find_spec(spec)
        try:
            raw = tomllib.loads(path.read_text())
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            raise TopologyError(f"resilax.Topology.load: cannot read topology spec {str(path)!r}: {e}") from e
        return cls.from_dict(raw, origin=str(path))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], origin: str = "<dict>") -> "Topology":
        where = f"resilax.Topology spec {origin}"
        try:
            mesh = raw["mesh"]
            axes = mesh["axes"]
            names = tuple(str(a) for a in axes.keys()) if isinstance(axes, Mapping) else tuple(axes)
            sizes = tuple(int(v) for v in axes.values()) if isinstance(axes, Mapping) else tuple(mesh["shape"])
            bw = dict(raw.get("bandwidth", {}))
            sources = dict(bw.pop("sources", {}))
            topo = cls(
                name=str(raw.get("name", pathlib.Path(origin).stem)),
                platform=str(raw["platform"]),
                domain_kind=str(raw.get("domain", "slice")),
                num_domains=int(raw["domains"]),
                devices_per_domain=int(raw["devices_per_domain"]),
                axis_names=names,
                axis_sizes=sizes,
                bandwidth={k: float(v) for k, v in bw.items()},
                bandwidth_sources=sources,
                is_emulated=bool(raw.get("emulated", False)),
                pipeline={k: int(v) for k, v in raw.get("pipeline", {}).items()},
            )
        except KeyError as e:
            raise TopologyError(f"{where}: missing required field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            if isinstance(e, TopologyError):
                raise TopologyError(f"{where}: {e}") from None
            raise TopologyError(f"{where}: malformed field: {e}") from None
        if raw["mesh"].get("elastic_axis", names[0]) != names[0]:
            raise TopologyError(
                f"{where}: elastic_axis {raw['mesh']['elastic_axis']!r} must be the first mesh axis ({names[0]!r})"
            )
        return topo

    # ----------------------------------------------------------------- derived
    @property
    def elastic_axis(self) -> str:
        return self.axis_names[0]

    @property
    def num_devices(self) -> int:
        return self.num_domains * self.devices_per_domain

    def domains(self, devices: Sequence[Any] | None = None) -> list[list[Any]]:
        """Groups ``devices`` (default ``jax.devices()``) into failure domains.

        Raises:
          TopologyError: the devices present do not fit this topology (count or platform).
        """
        import jax

        from resilax._src.runtime import worker

        job = worker.initialize()  # under `resilax launch`: join the job before JAX lists devices
        where = f"resilax.Topology {self.name!r}"
        if devices is None and job is not None and job.num_slots and job.num_slots != job.num_processes:
            return self._slot_domains(job, list(jax.devices()), where)
        devices = list(jax.devices() if devices is None else devices)
        platforms = sorted({d.platform for d in devices})
        if platforms != [self.platform]:
            raise TopologyError(
                f"{where} needs {self.platform} devices, but the devices present are on {platforms}"
            )
        if len(devices) != self.num_devices:
            hint = ""
            if self.platform == "cpu":
                hint = (
                    f"; request them before JAX starts with jax.config.update('jax_num_cpu_devices', {self.num_devices})"
                )
            raise TopologyError(
                f"{where} needs {self.num_devices} {self.platform} devices ({self.num_domains} {self.domain_kind}s x "
                f"{self.devices_per_domain}), but {len(devices)} are present{hint}"
            )
        slice_ids = {getattr(d, "slice_index", None) for d in devices}
        if self.platform == "tpu" and None not in slice_ids and len(slice_ids) == self.num_domains:
            order = sorted(devices, key=lambda d: (d.slice_index, d.id))
        else:
            order = sorted(devices, key=lambda d: (d.process_index, d.id))
        k = self.devices_per_domain
        return [order[i * k : (i + 1) * k] for i in range(self.num_domains)]

    def _slot_domains(self, job, devices, where) -> list[list[Any]]:
        """The domains of a `resilax launch` generation smaller than the job (its survivors
        re-formed without replacements): domain ``s`` holds the devices of the process in
        slot ``s``; the other domains are empty (dead from the start, nothing is placed on
        them), so the mesh, the virtual replicas of the bit-exact mode and the host stores
        keep the job's numbering."""
        k = self.devices_per_domain
        if job.job_processes != self.num_domains or job.devices_per_process != k:
            raise TopologyError(
                f"{where}: `resilax launch` re-formed this job as {job.num_processes} of its {job.job_processes} "
                f"processes x {job.devices_per_process} devices, which needs one {self.domain_kind} per process "
                f"({self.num_domains} x {k} here)")
        if len(devices) != job.num_processes * k:
            raise TopologyError(f"{where}: {job.num_processes} processes x {k} devices expected, but "
                                f"{len(devices)} are present")
        order = sorted(devices, key=lambda d: (d.process_index, d.id))
        out: list[list[Any]] = [[] for _ in range(self.num_domains)]
        for p, s in enumerate(job.slot_list):
            out[s] = order[p * k:(p + 1) * k]
            if {d.process_index for d in out[s]} != {p}:
                raise TopologyError(f"{where}: process {p}'s devices are not {k} of its own: "
                                    f"{[(d.id, d.process_index) for d in out[s]]}")
        return out

    def mesh(self, domains: Sequence[Sequence[Any]]):
        """A mesh over the given (surviving) domains: the elastic axis has one entry each."""
        from jax.sharding import AxisType, Mesh

        devs = np.array([list(d) for d in domains], dtype=object)
        shape = (len(domains),) + tuple(self.axis_sizes[1:])
        return Mesh(devs.reshape(shape), self.axis_names, axis_types=(AxisType.Auto,) * len(shape))


def _packaged_specs() -> pathlib.Path:
    """The specs shipped inside the package (``resilax.slices``, mapped from ``slices/``)."""
    import importlib.resources

    try:
        return pathlib.Path(str(importlib.resources.files("resilax.slices")))
    except (ModuleNotFoundError, TypeError):  # a source tree that was never installed
        return pathlib.Path(__file__).resolve().parents[3] / "slices"


def _spec_dirs() -> list[pathlib.Path]:
    dirs = [pathlib.Path.cwd() / "slices", _packaged_specs()]
    extra = os.environ.get("RESILAX_SLICES")
    if extra:
        dirs.insert(0, pathlib.Path(extra))
    return dirs


def _find_spec(spec) -> pathlib.Path:
    p = pathlib.Path(spec)
    if p.suffix == ".toml" or p.exists():
        if not p.is_file():
            raise TopologyError(f"resilax.Topology.load: no topology spec file at {str(p)!r}")
        return p
    for d in _spec_dirs():
        cand = d / f"{spec}.toml"
        if cand.is_file():
            return cand
    known = sorted({q.stem for d in _spec_dirs() if d.is_dir() for q in d.glob("*.toml")})
    raise TopologyError(f"resilax.Topology.load: no topology spec named {str(spec)!r}; known specs: {known}")


def available_specs() -> list[str]:
    return sorted({q.stem for d in _spec_dirs() if d.is_dir() for q in d.glob("*.toml")})
