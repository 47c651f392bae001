"""XLA flags of every test process: simulated host devices, collective timeouts sized for a
2-core machine, one thread per device, and a cheap CPU compile.

XLA:CPU aborts the whole process (SIGABRT, exit 134) when the devices of one program do not all
reach a collective within `xla_cpu_collective_call_terminate_timeout_seconds` (40 s by default).
With 8 simulated devices sharing 2 cores a loaded machine slows every device thread; the longer
limit keeps the abort for a real deadlock. The three CI aborts in the 2x2x2 RTD step
(2026-11-25 to -27) were one: executables loaded from the persistent compilation cache ran
their collectives in different orders per device; conftest.py turns the cache off in the test
processes (docs/results/2026-11-27-cpu-cache-collective-deadlock.md).

Eigen's intra-op thread pool is off (`xla_cpu_multi_thread_eigen=false`): each simulated
device computes on its own thread; with 8 devices on 2 cores the pool adds no parallelism, and
the tests time the same or faster without it (docs/results/2026-11-27-suite-cpu-flags.md).

The suite compiles over a thousand tiny programs that then run for milliseconds: most of its
CPU time was XLA compiling them. The cheap compile: the backend optimisation level and LLVM's
expensive passes off (they change only the machine code: the optimised HLO of the tiny BERT and
GPT train steps is the same text either way); XLA:CPU's older elemental fusion emitters instead
of the MLIR fusion emitters (`xla_cpu_use_fusion_emitters=false`); one LLVM module per program
instead of several compiled on threads this machine does not have
(`xla_cpu_parallel_codegen_split_count=1`). Every test passes under them; tests that compare
runs compare runs started under the same flags; the README's commands run under them too,
except where a command sets XLA_FLAGS itself. The measurements are in docs/results/.
"""

COLLECTIVE_TIMEOUTS = ("--xla_cpu_collective_call_warn_stuck_timeout_seconds=60 "
                       "--xla_cpu_collective_call_terminate_timeout_seconds=300")
ONE_THREAD_PER_DEVICE = "--xla_cpu_multi_thread_eigen=false"
CHEAP_COMPILE = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                 "--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1")
TEST_FLAGS = f"{COLLECTIVE_TIMEOUTS} {ONE_THREAD_PER_DEVICE} {CHEAP_COMPILE}"


def xla_flags(devices: int) -> str:
  """XLA_FLAGS for a process with `devices` simulated CPU devices."""
  return f"--xla_force_host_platform_device_count={devices} {TEST_FLAGS}"
