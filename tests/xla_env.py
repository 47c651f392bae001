"""XLA flags of every test process: simulated host devices, collective timeouts sized for a
2-core machine, and a cheap CPU compile.

XLA:CPU aborts the whole process (SIGABRT, exit 134) when the devices of one program do not all
reach a collective within `xla_cpu_collective_call_terminate_timeout_seconds` (40 s by default).
With 8 simulated devices sharing 2 cores, a loaded CI machine can starve one device thread that
long in an otherwise healthy step (CI run of 2026-11-25: aborted inside a 2x2x2 RTD step that
takes ~35 s alone). A longer limit keeps the abort for a real deadlock, where it belongs.

The suite compiles over a thousand tiny programs that then run for milliseconds: most of its
CPU time was LLVM optimising their machine code. The backend optimisation level and LLVM's
expensive passes change only that code generation: the optimised HLO of the tiny BERT and GPT
train steps is the same text either way, and every test passes under them. Runs the tests start
compare with runs started under the same flags; the README's commands run under them too,
except where a command sets XLA_FLAGS itself. The measurements are in docs/results/.
"""

COLLECTIVE_TIMEOUTS = ("--xla_cpu_collective_call_warn_stuck_timeout_seconds=60 "
                       "--xla_cpu_collective_call_terminate_timeout_seconds=300")
CHEAP_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
TEST_FLAGS = f"{COLLECTIVE_TIMEOUTS} {CHEAP_COMPILE}"


def xla_flags(devices: int) -> str:
  """XLA_FLAGS for a process with `devices` simulated CPU devices."""
  return f"--xla_force_host_platform_device_count={devices} {TEST_FLAGS}"
