"""Test set-up: 8 CPU devices (two or four emulated slices), requested once, before JAX starts."""

import os

# Test speed only: the suite compiles far more than it runs, and on 2 cores compiling is most
# of its time. Two XLA:CPU code-generation settings: LLVM's optimisation of the generated code
# off (the backend level), and XLA:CPU's older loop emitters instead of its MLIR fusion
# emitters, which at that level compile the same programs in less than half the CPU time
# (a flax transformer's and the example MLP's train steps: 3.7 -> 1.4-1.9 CPU-s, the steps run
# as fast). XLA's own HLO passes, which the HLO tests read, are untouched; numerics stay those
# of any XLA:CPU build without fast-math; every comparison in the suite is between runs made
# under the same flags. The processes tests start inherit them, except the few whose assertion
# is about XLA's default output (the optimised HLO; wrapped == plain jit bitwise, which
# the older emitters break by fusing the split and the whole program differently; the length
# of one compile): those run with `helpers.default_codegen_env`.
for _flag in ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false"):
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import jax  # noqa: E402

from resilax._src.runtime.cpu_devices import request_cpu_devices  # noqa: E402

# 8 devices, with an XLA:CPU client thread pool in which a call returns while the previous
# program runs (as on an accelerator; `resilax._src.runtime.cpu_devices` says why). This
# builds the CPU client now; the processes the tests start size their own.
request_cpu_devices(8)

# Test speed: the persistent-cache key leaves out the device assignment on CPU, as JAX's own
# key does on GPU, here and in every process the suite starts (tests/site/sitecustomize.py says
# why). A/B switch for measuring it: RESILAX_TEST_DEVICE_FREE_CACHE_KEY=0.
if os.environ.get("RESILAX_TEST_DEVICE_FREE_CACHE_KEY", "1") != "0":
    import importlib.util as _ilu

    _SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")
    if _SITE not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_SITE, os.environ.get("PYTHONPATH")) if p)
    # with the same key in every process, one process of a launched job compiles each
    # program of the job's mesh and the others load it (JAX's option, off by default)
    os.environ.setdefault("JAX_SHARE_BINARY_BETWEEN_HOSTS", "true")
    # a process killed while it compiles for the others leaves them waiting: 2 minutes, not
    # JAX's 20, then their compile raises and their supervisor sees a failed worker
    os.environ.setdefault("JAX_SHARE_BINARY_BETWEEN_HOSTS_TIMEOUT_MS", "120000")
    _spec = _ilu.spec_from_file_location("_resilax_test_site", os.path.join(_SITE, "sitecustomize.py"))
    _spec.loader.exec_module(_ilu.module_from_spec(_spec))

# One persistent compilation cache for this test session and the processes it starts, so the
# many restarts in crash tests do not each recompile the same programs.
_CACHE = os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.05")
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.05)


import sys  # noqa: E402

import resilax  # noqa: E402

# Test speed: in this process `PeersConfig.compile_ahead` defaults to off. On 2 cores the
# background compiles of every mesh one more loss would leave (8 of them on 8x1) took a third
# of the CPU of the in-process tests, compiling meshes most tests never recover onto; a
# recovery compiles what it needs either way (same programs, same bits). The tests of
# compile-ahead itself (test_recovery, test_record_log, test_pipeline's auto cadence) turn it
# on explicitly, and every `resilax ...` subprocess the suite starts (demo, crash, launch,
# agents, campaign) runs the library's default (on). `Config`'s own default `peers` is an
# instance built when resilax was imported, before this patch: `Config()` is given a new one
# below (until 2026-11-27 it was not, and compile-ahead ran in every in-process test that left
# `peers` out: 12% of the in-process tests' CPU, 716 -> 630 CPU-s in a whole-suite run).
_peers_init = resilax.PeersConfig.__init__


def _peers_init_for_tests(self, *args, compile_ahead=False, **kw):
    _peers_init(self, *args, compile_ahead=compile_ahead, **kw)


resilax.PeersConfig.__init__ = _peers_init_for_tests

# Test speed, as for compile-ahead: in this process `Config.verify` (the first-step
# cross-check of each mesh against one device) defaults to off. It traced, compiled and ran a
# one-device copy of the step at the first step of every run and again after every recovery:
# a quarter of the time of the in-process transformer tests. Its own tests (test_crosscheck),
# and those that assert what it records, ask for the library's default with
# `@pytest.mark.verify`; every `resilax ...` subprocess the suite starts runs the default (on),
# so every end-to-end test runs with it.
_config_init = resilax.Config.__init__
_VERIFY_BY_DEFAULT = [False]


def _config_init_for_tests(self, *args, **kw):
    if not args and "verify" not in kw and not _VERIFY_BY_DEFAULT[0]:
        kw["verify"] = None
    if not args and "peers" not in kw:  # the field's default was built at import, before the patch above
        kw["peers"] = resilax.PeersConfig()
    _config_init(self, *args, **kw)


resilax.Config.__init__ = _config_init_for_tests

import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "verify: Config() keeps the library's default VerifyConfig (the cross-check)")
    config.addinivalue_line("markers", "netns: hosts as network namespaces (root; 40-90 s each): tests/test_netns.py")


def pytest_sessionfinish(session, exitstatus):
    """Removes the network namespaces, veths and bridges this process's netns tests made and a
    killed or failed test left (their names carry this process's tag; another session's are
    left alone)."""
    import sys

    mod = sys.modules.get("resilax.tools.netns")
    if mod is not None and os.geteuid() == 0:
        mod.sweep(f"{mod.PREFIX}{os.getpid() % 10000:04d}")


_DURATIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "durations.json")


def pytest_collection_modifyitems(session, config, items):
    """Orders the tests for `--dist worksteal` by their seconds in a fresh-clone run
    (tests/durations.json; a test not in it counts as 1 s). worksteal hands each worker the
    next contiguous share of the list at the start (the i-th of n workers the next
    ``len(left) // (n - i)``) and later lets an idle worker steal the tail half of the
    longest queue. A list sorted slowest-first put every long end-to-end test in the first
    worker's share, where they ran one after another while the others took the short ones.
    So the tests are dealt slowest-first into one share per worker, each to the share with
    the fewest seconds so far (at the sizes worksteal cuts), each share slowest-first: every
    worker starts on long tests, and what is stolen at the end is short. Three workers on 2
    cores: the multi-process tests spend a third of their wall time waiting (leases,
    deadlines, netem), which a third worker's tests fill. Regenerate the file from a
    whole-suite run when the suite changes much."""
    import json

    try:
        with open(_DURATIONS) as f:
            known = json.load(f)
    except (OSError, ValueError):
        return
    secs = lambda it: known.get(it.nodeid, 1.0)  # noqa: E731
    items.sort(key=lambda it: -secs(it))  # stable: unknowns keep their order
    n = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if n <= 1:
        return
    sizes, left = [], len(items)
    for i in range(n):  # the shares worksteal cuts, in its order
        sizes.append(left // (n - i))
        left -= sizes[-1]
    shares, load = [[] for _ in range(n)], [0.0] * n
    for it in items:
        i = min((j for j in range(n) if len(shares[j]) < sizes[j]), key=lambda j: load[j])
        shares[i].append(it)
        load[i] += secs(it)
    items[:] = [it for share in shares for it in share]


def pytest_collection_finish(session):
    """Test speed: once the test modules are imported (JAX, flax, optax, Orbax and the suite's
    own), their ~10^5-10^6 long-lived objects go to the garbage collector's permanent generation
    (`gc.freeze`, after a collection: nothing that is garbage now is kept), so that every full
    collection during the session no longer walks them. test_verdicts + test_recovery in one
    process: the full collections' CPU 2.0-2.2 -> 1.3-1.5 s of ~60 CPU-s (the modules' own
    CPU moved by more than that between runs: run-to-run spread)."""
    import gc

    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _verify_default(request):
    _VERIFY_BY_DEFAULT[0] = request.node.get_closest_marker("verify") is not None
    yield
    _VERIFY_BY_DEFAULT[0] = False

from helpers import child_env as _child_env  # noqa: E402


@pytest.fixture
def child_env():
    """Environment for `python -m resilax ...` subprocesses (see helpers.child_env)."""
    return _child_env()


@pytest.fixture
def python():
    return sys.executable
