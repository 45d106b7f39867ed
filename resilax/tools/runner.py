"""`resilax train` and `resilax demo`: the example model trained resiliently, with progress.

`train` is one process's run (what a crash kills and a restart resumes). `demo` shows the
promise end to end: it starts `train` in a child process, kills it with a real SIGKILL
mid-run, starts it again (it resumes from the newest good checkpoint, replays the record
log written after it and restores the saved data position), and checks the final state
bitwise against an uninterrupted run; then it loses a whole slice while a step is in flight
(state sharded over every device, recovered from the peer copies on the other slice) and
compares with the same run without the failure. Every protection is on by default
(`make_config`), so the demo needs no protection flags.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np


def configure_compilation_cache() -> None:
    """Persistent XLA compilation cache for CLI runs: a restarted process (after a crash)
    reuses the executables of the one that died instead of compiling them again.

    ``JAX_COMPILATION_CACHE_DIR`` wins; else ``$RESILAX_CACHE_DIR`` or ``~/.cache/resilax/xla``.
    Programs that compile in under 50 ms are not kept, except in a worker of `resilax launch`:
    a new generation waits for every program of its first step, and a dozen small ones
    compiled again took 0.5 s of a recovery on 2 shared cores (a cache read: ~5 ms each).
    """
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    import jax

    from resilax._src.runtime import worker

    d = os.environ.get("RESILAX_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "resilax", "xla")
    jax.config.update("jax_compilation_cache_dir", d)
    launched = worker.ENV_PREFIX + "COORDINATOR" in os.environ or worker.SPARE_ENV in os.environ
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0 if launched else 0.05)


def configure_cpu_devices(n: int) -> None:
    """Asks JAX for ``n`` CPU devices; must run before JAX initialises its backends.

    Under `resilax launch` this process joins the job instead (its share of the devices is
    ``--devices-per-process``); the job must hold ``n`` devices in all.
    """
    import jax

    from resilax._src.runtime import worker

    e = worker.initialize()
    if e is not None:
        if e.job_processes * e.devices_per_process != n:  # (a generation smaller than the job: its full size)
            import resilax

            raise resilax.TopologyError(
                f"resilax train: the topology needs {n} devices, but `resilax launch` started {e.job_processes} "
                f"processes x {e.devices_per_process} devices = {e.job_processes * e.devices_per_process}")
        return
    if jax.config.jax_platforms in (None, "", "cpu") and os.environ.get("JAX_PLATFORMS", "cpu") in ("", "cpu"):
        from resilax._src.runtime.cpu_devices import request_cpu_devices

        request_cpu_devices(n)  # (with a client thread pool that lets a call return while the last step runs)


def make_config(*, checkpoint_dir: str | None = None, checkpoint_every: int = 10, log: bool = True,
                log_mode: str | None = None, peers: bool = True, peers_every: int | None = None,
                anomaly: bool = True, deterministic: bool = False, health: bool = False):
    """The `resilax.Config` of the CLI's protection flags: every protection on unless turned
    off; checkpoints when ``checkpoint_dir`` is given (the record log then also goes to disk,
    in ``checkpoint_dir/record_log``).

    ``log_mode`` (default ``"grads"``) with ``log=False``, or ``peers_every`` with
    ``peers=False``, is a `ConfigError`: a flag for a protection that is off is a mistake.
    """
    import resilax

    if not log and log_mode is not None:
        raise resilax.ConfigError(f"--log-mode {log_mode} sets the record log's mode, but --no-log turns the log off")
    if not peers and peers_every is not None:
        raise resilax.ConfigError(f"--peers-every {peers_every} sets the peer-copy cadence, but --no-peers turns "
                                  "peer copies off")
    return resilax.Config(
        checkpoint=(resilax.CheckpointConfig(checkpoint_dir, every=checkpoint_every) if checkpoint_dir else None),
        log=resilax.LogConfig(mode=log_mode or "grads") if log else None,
        peers=resilax.PeersConfig(every=1 if peers_every is None else peers_every) if peers else None,
        anomaly=resilax.AnomalyConfig() if anomaly else None,
        deterministic=resilax.DeterministicConfig() if deterministic else None,
        health=resilax.HealthConfig() if health else None,
    )


def train(
    *,
    steps: int,
    topology: str = "cpu-2x4",
    checkpoint_dir: str | None = None,
    checkpoint_every: int = 10,
    faults: tuple[str, ...] = (),
    out: str | None = None,
    log_every: int = 10,
    progress: bool = True,
    spec=None,
    log: bool = True,
    log_mode: str | None = None,
    peers: bool = True,
    peers_every: int | None = None,
    anomaly: bool = True,
    layout: str = "fsdp",
    deterministic: bool = True,
    health: bool = True,
    curve: bool = False,
) -> dict:
    """Trains the example model to ``steps`` completed steps (resuming if checkpoints exist).

    Every protection is on unless turned off (`make_config`): the record log (on disk in
    ``checkpoint_dir/record_log`` when there is a checkpoint directory, so a restart resumes
    where it died), peer copies, NaN/spike skipping; checkpoints when ``checkpoint_dir`` is
    given.

    ``layout``: ``fsdp`` shards state within a slice (replicated across slices: the live
    replicas are the backup); ``sharded`` shards it over every device (each slice holds a
    distinct part, so resilax keeps peer copies on the next slice).

    ``deterministic`` (the default): the bit-exact elastic mode (`resilax.DeterministicConfig`):
    the run is bitwise the same whatever slices it lost and when, so a faulted run ends
    exactly where a failure-free one does. It holds the state whole in every slice (sharded
    only within one), so ``layout="sharded"`` then shards within a slice too (a line says
    so); ``deterministic=False`` is the default mode (same maths up to reduction order).
    ``health``: `resilax.HealthConfig` (the state's replicas across slices are compared
    before each step). ``curve``: the summary gets every step's loss and seconds (``curve``).

    Returns a summary dict; writes the final state to ``out`` (``.npz``, no pickle) if given.
    """
    import jax

    import resilax
    from resilax.tools import example as ex

    from resilax._src.runtime import worker

    topo = resilax.Topology.load(topology) if not isinstance(topology, resilax.Topology) else topology
    configure_cpu_devices(topo.num_devices)
    job = worker.env()
    if job is not None:
        # Under `resilax launch` a restarted generation resumes from durable state only: the
        # checkpoints (and the record log's disk sink in them: process 0 writes its inputs
        # entries, every process replays them) default to the run directory. Peer copies are
        # single-process for now; see docs/multiprocess.md.
        checkpoint_dir = checkpoint_dir or os.path.join(job.run_dir, "checkpoints")
        if peers and job.process_id == 0:
            print("resilax train under `resilax launch`: peer copies are off in multi-process runs (not yet "
                  "supported); a restart resumes from the hosts' stores or the newest checkpoint and the record log",
                  flush=True)
        peers, peers_every = False, None
        if job.in_place_wait_s > 0:  # going on in place re-forms the survivors' backends: no device log across it
            if log and job.process_id == 0:
                print("resilax train under `resilax launch --in-place`: the record log is off (going on in place "
                      "re-forms the survivors' backends; not yet supported with the log); a restart resumes from the "
                      "hosts' stores or the newest checkpoint", flush=True)
            log, log_mode = False, None
        health = False  # replica checks and the liveness watchdog read other processes' domains: one process only
    if deterministic and layout == "sharded" and not worker.env():
        print("layout sharded: the bit-exact mode (default) holds the state whole in every slice, sharded over the "
              "slice's devices; --no-deterministic shards it over every device", flush=True)
    spec = spec or ex.ExampleSpec()
    data = ex.make_iterator(spec)
    inner = topo.axis_names[1] if len(topo.axis_names) > 1 else None
    if inner == "stage":  # data x pipeline (cpu-2x4-pp): the hidden layers as a pipeline, one per stage
        state = ex.make_pipeline_state(spec, stages=topo.axis_sizes[1])
        specs = ex.pipeline_specs(state)
    else:
        state = ex.make_state(spec)
        specs = (ex.fsdp_specs(state, inner, topo.axis_sizes[1]) if layout == "fsdp" and inner
                 else ex.fsdp_specs(state, tuple(topo.axis_names), topo.num_devices))
    step = resilax.wrap(
        ex.train_step,
        topology=topo,
        state_sharding=specs,
        batch_sharding=jax.sharding.PartitionSpec(topo.elastic_axis),
        config=make_config(checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, log=log,
                           log_mode=log_mode, peers=peers, peers_every=peers_every, anomaly=anomaly,
                           deterministic=deterministic, health=health),
        faults=resilax.FaultPlan(faults),
    )
    t_start = time.perf_counter()
    with step:  # close() waits for the last checkpoint, also when something raises
        state = step.init(state, data=data)
        start_step = step.step
        if start_step:
            replayed = [e for e in step.events if e.kind == "replay"]
            src = " (checkpoint + " if any(e.kind == "restore" for e in step.events) else " ("
            how = f"{src}{replayed[-1].fields['steps']} steps replayed from the log)" if replayed else " (checkpoint)"
            hs = [e for e in step.events if e.kind == "restore" and e.fields.get("source") == "host_store"]
            if hs:
                ck = step.checkpoints.steps() if step.checkpoints else []
                how = f" (host store: {hs[-1].fields['copy']}; newest checkpoint: {ck[-1] if ck else None})"
            print(f"resumed at step {start_step}{how}, data position restored", flush=True)
        _say(step.events, resuming=True)
        if step._faults.settled:  # the same plan on a restart: what belonged before the resume is done
            print(f"faults done before this restart (not fired again): "
                  f"{', '.join(f.spec() for f in step._faults.settled)}", flush=True)
        bar = _progress(steps, start_step, progress)
        loss = acc = float("nan")
        last_t, last_s = time.perf_counter(), step.step
        preempted = False
        trace: dict = {"step": [], "loss": [], "step_s": []}
        t_prev = time.perf_counter()
        seen = len(step.events)
        while step.step < steps:
            state, metrics = step(state, next(data))
            if len(step.events) != seen:
                _say(step.events[seen:])
                seen = len(step.events)
            if curve:  # reads the loss every step (a host sync): the demo's plot, not the default
                trace["loss"].append(float(metrics["loss"]))
                now = time.perf_counter()
                trace["step"].append(step.step)
                trace["step_s"].append(now - t_prev)
                t_prev = now
            if step.step % log_every == 0 or step.step == steps:
                loss, acc = float(metrics["loss"]), float(metrics["accuracy"])
                now = time.perf_counter()
                step_s = (now - last_t) / max(step.step - last_s, 1)
                last_t, last_s = now, step.step
                bar(step.step, loss, acc, step_s)
            if step.preempted:  # SIGTERM reached some worker: all stopped after this step, and it is saved
                preempted = True
                break
        # the driver saved it already, if this run made that step; a resume at it (from the host
        # stores: the save of it broke as a process died) saves it unless it is a checkpoint
        saved = bool(checkpoint_every) and step.step % checkpoint_every == 0 and (
            step.step > start_step or step.step in (step.checkpoints.steps() if step.checkpoints else ()))
        if checkpoint_dir and not saved and not preempted and not step.checkpoints_paused:
            step.save(state)
    wall = time.perf_counter() - t_start
    if out and not preempted:
        write_state(out, state)
    summary = {
        "steps": step.step,
        "preempted": preempted,
        "resumed_from": start_step,
        "checkpoint_step": next((e.step for e in step.events if e.kind == "restore"
                                 and e.fields.get("source") == "checkpoint"), None),
        "final_loss": loss,
        "final_accuracy": acc,
        "wall_s": wall,
        "checkpoints": step.checkpoints.steps() if step.checkpoints else [],
        "checkpoint_blocking_s": step.checkpoints.blocking_s.total if step.checkpoints else 0.0,
        "events": [e.to_json() for e in step.events],
        # steps whose update was not applied (NaN/Inf or spike), recorded across restarts
        "skipped_steps": sorted(step._watch.skipped) if step._watch is not None else [],
        "faults_settled": [f.spec() for f in step._faults.settled],
    }
    hs = step._host_store
    if hs is not None:  # under `resilax launch`: what storing (and mirroring) cost the step loop
        summary["host_store"] = {"writes": hs.seconds.count, "seconds": hs.seconds.total,
                                 "median_s": hs.seconds.median(),
                                 "mirror": hs.remote, "waited_s": hs.waited.total,
                                 "mirror_error": hs.mirror_error}
    if curve:
        summary["curve"] = trace
    return summary


def write_state(out: str, state) -> None:
    """Writes the full state to ``out`` (``.npz`` of the flattened leaves by key path, no
    pickle) and its SHA-256 to ``out.sha256`` (``sha256sum -c`` format).

    In a multi-process run every process must call this (the leaves are gathered with a
    collective); process 0 alone writes.
    """
    import hashlib

    import jax

    from resilax._src.runtime import worker

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        leaves = jax.tree_util.tree_flatten_with_path(state)[0]
        local = [_whole_here(x) for _, x in leaves]
        if all(v is not None for v in local):  # this process holds all of it (the bit-exact mode): no collective
            flat = {jax.tree_util.keystr(p): v for (p, _), v in zip(leaves, local)}
        else:
            flat = {jax.tree_util.keystr(p): np.asarray(multihost_utils.process_allgather(x, tiled=True))
                    for p, x in leaves}
    else:
        from resilax.tools.example import flat_state

        flat = flat_state(state)
    if not worker.is_primary():
        return
    tmp = f"{out}.tmp.npz"
    np.savez(tmp, **flat)
    digest = hashlib.sha256(pathlib.Path(tmp).read_bytes()).hexdigest()
    os.replace(tmp, out)
    sums = f"{out}.sha256"
    pathlib.Path(f"{sums}.tmp").write_text(f"{digest}  {os.path.basename(out)}\n")
    os.replace(f"{sums}.tmp", sums)


def _say(events, *, resuming: bool = False) -> None:
    """Prints one line per failure, injected fault or recovery among ``events``
    (`messages.describe`: the words `resilax report` uses too), after its step. ``resuming``:
    the events of `init`, where the "resumed at step" line already says what was restored
    and replayed, and a warning says which checkpoints failed and which collectives changed:
    only what else went wrong on the way is added."""
    from resilax._src import messages

    for ev in events:
        e = ev.to_json()
        if resuming and (ev.kind in ("restore", "collectives_changed")
                         or (ev.kind == "replay" and not e.get("unreplayable"))):
            continue
        line = messages.describe(e)
        if line is not None:
            print(line if ev.kind in messages.OWN_STEP_KINDS else f"step {ev.step}: {line}", flush=True)


def _whole_here(x) -> np.ndarray | None:
    """``x`` assembled from this process's shards if they cover all of it, else None."""
    from resilax._src.step.sharding import local_shards

    shards, covered = local_shards(x)
    if not covered:
        return None
    out = np.empty(x.shape, x.dtype)
    for s in shards:
        out[s.index] = np.asarray(s.data)
    return out


def _progress(total: int, start: int, enabled: bool):
    """Periodic progress: a tqdm bar on a terminal, plain lines otherwise (logs, pipes)."""
    if not enabled:
        return lambda *a: None
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)

        def update(s, loss, acc, step_s):
            bar.update(s - bar.n)
            bar.set_postfix(loss=f"{loss:.4f}", acc=f"{acc:.3f}", step_ms=f"{step_s * 1e3:.1f}")
            if s >= total:
                bar.close()

        return update

    def line(s, loss, acc, step_s):
        print(f"step {s:5d}/{total}  loss {loss:.4f}  acc {acc:.3f}  {step_s * 1e3:7.1f} ms/step", flush=True)

    return line


def _child_cmd(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "resilax", "train", *args]


def demo(*, steps: int = 300, topology: str = "cpu-2x4", checkpoint_every: int = 25, workdir: str | None = None,
         kill_at: int | None = None, seed: int | None = None) -> int:
    """Train, crash with SIGKILL, resume, and compare bitwise against an uninterrupted run."""
    from resilax._src.errors import ConfigError

    rng = random.Random(seed)
    kill_at = kill_at if kill_at is not None else rng.randrange(max(steps // 3, 1), max(2 * steps // 3, 2))
    if not 1 <= kill_at < steps:
        raise ConfigError(f"resilax demo: the run is killed after step {kill_at} and resumed, so --kill-at must be "
                          f"in [1, --steps - 1] (--steps {steps})")
    own = workdir is None
    work = pathlib.Path(workdir or tempfile.mkdtemp(prefix="resilax-demo-"))
    try:
        work.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"resilax demo: cannot use --workdir {str(work)!r}: {e.strerror or e}") from None
    # every protection on (the default): the record log's disk sink (grads mode, in the
    # checkpoint directory) brings a restart back to where it died; peer copies on the next
    # slice cover the sharded layout of phase 4
    common = ["--steps", str(steps), "--topology", topology, "--checkpoint-every", str(checkpoint_every), "--log-every", "25"]
    print(f"resilax demo: an MLP on generated data, {topology} (emulated CPU slices), {steps} steps, "
          f"Orbax checkpoint every {checkpoint_every} steps; workdir {work}")
    ckpt, ref = work / "ckpt", work / "ref_ckpt"
    for d in (ckpt, ref):
        shutil.rmtree(d, ignore_errors=True)
    t0 = time.perf_counter()
    print(f"\n[1/5] training; the process will be killed with SIGKILL after step {kill_at}")
    r = subprocess.run(_child_cmd([*common, "--checkpoint-dir", str(ckpt), "--fault", f"kill_process@{kill_at}:after_step"]))
    died = r.returncode == -signal.SIGKILL
    print(f"      process exited with {'SIGKILL' if died else r.returncode}")
    if not died:
        print("demo: the training process was expected to die by SIGKILL", file=sys.stderr)
        return 1
    print("\n[2/5] starting it again: it restores the newest good checkpoint and replays the log")
    r = subprocess.run(_child_cmd([*common, "--checkpoint-dir", str(ckpt), "--out", str(work / "resumed.npz"),
                                   "--summary", str(work / "resumed.json")]))
    if r.returncode:
        return r.returncode
    print("\n[3/5] an uninterrupted reference run, for comparison")
    r = subprocess.run(_child_cmd([*common, "--checkpoint-dir", str(ref), "--out", str(work / "reference.npz"),
                                   "--log-every", str(steps)]))
    if r.returncode:
        return r.returncode
    fail_at = (3 * steps) // 4
    print(f"\n[4/5] losing a whole slice: state sharded over all {topology} devices, slice 1 fails while a step is "
          f"in flight (fault fail_slice@{fail_at}:mid_step/1)")
    # the default mode (not the bit-exact one): the state really is sharded over every device
    r = subprocess.run(_child_cmd([*common, "--layout", "sharded", "--no-deterministic", "--checkpoint-dir", str(work / "slice_ckpt"),
                                   "--fault", f"fail_slice@{fail_at}:mid_step/1", "--out", str(work / "slice.npz"),
                                   "--summary", str(work / "slice.json")]))
    if r.returncode:
        return r.returncode
    # its reference: the same program (layout, peer protection) with no failure; the run
    # above uses another program than phases 1-3, so comparing across them would measure
    # two different float trajectories, not the failure
    print("      and the same run without the failure, for comparison")
    r = subprocess.run(_child_cmd([*common, "--layout", "sharded", "--no-deterministic",
                                   "--checkpoint-dir", str(work / "slice_ref_ckpt"),
                                   "--out", str(work / "slice_ref.npz"), "--log-every", str(steps)]))
    if r.returncode:
        return r.returncode
    a, b = np.load(work / "resumed.npz", allow_pickle=False), np.load(work / "reference.npz", allow_pickle=False)
    same = sorted(a.files) == sorted(b.files) and all(np.array_equal(a[k], b[k]) for k in a.files)
    summ = json.loads((work / "resumed.json").read_text())
    print("\nsummary")
    print(f"  killed after step        {kill_at} (SIGKILL)")
    replayed = [e for e in summ["events"] if e["kind"] == "replay"]
    restored = [e for e in summ["events"] if e["kind"] == "restore"]
    print(f"  resumed at step          {summ['resumed_from']} (checkpoint {restored[0]['step'] if restored else '-'}"
          f" + {replayed[-1]['steps'] if replayed else 0} steps replayed from the log; "
          f"{kill_at - summ['resumed_from']} recomputed)")
    print(f"  final step               {summ['steps']}")
    print(f"  final loss / accuracy    {summ['final_loss']:.4f} / {summ['final_accuracy']:.3f}")
    print(f"  checkpoints kept         {summ['checkpoints']}")
    print(f"  checkpoint blocking      {summ['checkpoint_blocking_s'] * 1e3:.1f} ms in total (resumed run)")
    print(f"  final state vs uninterrupted run: {'BITWISE IDENTICAL' if same else 'DIFFERENT'} ({len(a.files)} arrays)")
    sliced = np.load(work / "slice.npz", allow_pickle=False)
    sref = np.load(work / "slice_ref.npz", allow_pickle=False)
    rel = max(float(np.linalg.norm(sliced[k].astype(np.float64) - sref[k]) / max(np.linalg.norm(sref[k].astype(np.float64)), 1e-30))
              for k in sref.files if np.issubdtype(sref[k].dtype, np.floating))
    ev = next(e for e in json.loads((work / "slice.json").read_text())["events"] if e["kind"] == "recovery")
    secs = ev["seconds"]
    print(f"  slice lost during step   {ev['target_step']} (in flight; devices {ev['failed_devices']} deleted)")
    print(f"  recovered from           {ev['source']} copies of step {ev['restored_step']}: {ev['bytes_moved']:,} "
          f"bytes moved, {ev['steps_replayed']} logged step(s) replayed, {ev['lost_steps']} step(s) recomputed "
          f"from their batch")
    print("  recovery by phase        " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in secs.items()))
    print(f"  continued on             mesh {ev['mesh']} with {ev['microbatches']} microbatches per step "
          f"(same global batch)")
    print(f"  final state vs the same run without the failure: max relative difference {rel:.1e} "
          f"(floating-point reassociation on the smaller mesh)")
    health_ok = _health_phase(work, steps, checkpoint_every)
    print(f"  wall time                {time.perf_counter() - t0:.1f} s")
    if own:  # the checkpoints go; the summaries and demo.png stay
        for d in work.iterdir():
            if d.is_dir():
                shutil.rmtree(d, ignore_errors=True)
    print(f"  run directory            {work} (demo.png: loss, step time and goodput with the events marked)")
    return 0 if same and health_ok else 1


def _health_phase(work: pathlib.Path, steps: int, checkpoint_every: int) -> bool:
    """Phase 5: four slices in the bit-exact mode with the health checks on (the CLI's
    defaults); one run loses slice 1, has a bit flipped on slice 2, gets slice 1 back and
    meets a NaN, then slice 3 hangs (found by the liveness watchdog and dropped). Compared
    bitwise with the same run with only the NaN (a skipped update is
    part of the maths). Prints the event timeline, writes demo.png."""
    s1, s2, s3, s4 = (steps * i // 5 for i in range(1, 5))
    s5 = (s4 + steps) // 2
    faults = [f"fail_slice@{s1}:mid_step/1", f"bitflip@{s2}/2", f"rejoin@{s3}/1", f"nan@{s4}", f"hang_slice@{s5}/3"]
    common = ["--steps", str(steps), "--topology", "cpu-4x2", "--checkpoint-every", str(checkpoint_every),
              "--log-every", str(steps), "--quiet", "--curve"]
    print(f"\n[5/5] slice health, 4 slices, bit-exact mode: {', '.join(faults)}; and the same run with only the NaN")
    runs = {}
    for name, fs in (("health", faults), ("health_ref", [f"nan@{s4}"])):
        args = [*common, "--checkpoint-dir", str(work / f"{name}_ckpt"), "--out", str(work / f"{name}.npz"),
                "--summary", str(work / f"{name}.json")]
        for f in fs:
            args += ["--fault", f]
        r = subprocess.run(_child_cmd(args))
        if r.returncode:
            print(f"demo: the {name} run exited with {r.returncode}", file=sys.stderr)
            return False
        runs[name] = json.loads((work / f"{name}.json").read_text())
    a, b = np.load(work / "health.npz", allow_pickle=False), np.load(work / "health_ref.npz", allow_pickle=False)
    same = sorted(a.files) == sorted(b.files) and all(np.array_equal(a[k], b[k]) for k in a.files)
    events = runs["health"]["events"]
    print("  event timeline (step: what happened)")
    from resilax._src.messages import describe

    shown = ("recovery", "bitflip", "sdc", "rejoin", "hang_slice", "hang", "anomaly")  # (not the bookkeeping)
    for e in events:
        what = describe(e) if e["kind"] in shown else None
        if what is not None:
            print(f"    {e['step']:5d}: {e['kind']:<9} {what}")
    print(f"  final state vs the same run without the failures: {'BITWISE IDENTICAL' if same else 'DIFFERENT'}")
    from resilax._src.runtime.goodput import load_goodput
    from resilax.tools.report import plot_demo

    png = plot_demo(runs["health"]["curve"], runs["health_ref"]["curve"], events,
                    load_goodput(work / "health_ckpt"), str(work / "demo.png"))
    print(f"  wrote {png}")
    return same
