"""The commands of the scheduler recipes in examples/, as the tests run them (no JAX here).

- `sbatch_launch`: the `resilax launch ...` of the sbatch script's one `srun` line (its
  backslash continuations joined, srun's own options, all in their ``--opt=value`` form,
  dropped), as shell text: tests run it with ``bash -c``, so the script's quoting and its
  variables (``$RUN_DIR``, ``"$@"``, ...) are what they are in the script.
- `jobset_container`: the JobSet's container (command, env, mounts), parsed with PyYAML.
"""

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SBATCH = ROOT / "examples" / "slurm" / "resilax.sbatch"
JOBSET = ROOT / "examples" / "kubernetes" / "jobset.yaml"


def sbatch_launch(path=SBATCH) -> str:
    text = pathlib.Path(path).read_text().replace("\\\n", " ")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("srun ")]
    assert len(lines) == 1, f"{path}: expected one srun line, got {lines}"
    m = re.fullmatch(r"srun(?:\s+-\S+)*\s+(resilax launch .*)", lines[0])
    assert m, f"{path}: the srun line does not run resilax launch: {lines[0]}"
    return m.group(1)


def sbatch_directives(path=SBATCH) -> list[str]:
    """The script's ``#SBATCH`` options, e.g. ``["--nodes=4", ...]``."""
    return [ln.split(None, 1)[1].strip() for ln in pathlib.Path(path).read_text().splitlines()
            if ln.startswith("#SBATCH ")]


def resilax_shim(bin_dir) -> str:
    """A ``resilax`` executable in ``bin_dir`` that runs this interpreter's ``-m resilax`` (put
    ``bin_dir`` first on PATH): the recipes call ``resilax`` by name."""
    bin_dir = pathlib.Path(bin_dir)
    bin_dir.mkdir(parents=True, exist_ok=True)
    shim = bin_dir / "resilax"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m resilax "$@"\n')
    shim.chmod(0o755)
    return str(bin_dir)


def jobset_container(path=JOBSET):
    """``(job spec, pod spec, container)`` of the JobSet's one replicated job."""
    import yaml  # PyYAML: the callers skip without it

    doc = yaml.safe_load(pathlib.Path(path).read_text())
    (rjob,) = doc["spec"]["replicatedJobs"]
    job = rjob["template"]["spec"]
    pod = job["template"]["spec"]
    (container,) = pod["containers"]
    return job, pod, container


def k8s_expand(args: list[str], env: dict) -> list[str]:
    """Kubernetes' ``$(VAR)`` expansion of a container's command with ``env``."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in args]
