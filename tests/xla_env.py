"""XLA flags of every test process: simulated host devices, and collective timeouts sized for a
2-core machine.

XLA:CPU aborts the whole process (SIGABRT, exit 134) when the devices of one program do not all
reach a collective within `xla_cpu_collective_call_terminate_timeout_seconds` (40 s by default).
With 8 simulated devices sharing 2 cores, a loaded CI machine can starve one device thread that
long in an otherwise healthy step (CI run of 2026-11-25: aborted inside a 2x2x2 RTD step that
takes ~35 s alone). A longer limit keeps the abort for a real deadlock, where it belongs.
"""

COLLECTIVE_TIMEOUTS = ("--xla_cpu_collective_call_warn_stuck_timeout_seconds=60 "
                       "--xla_cpu_collective_call_terminate_timeout_seconds=300")


def xla_flags(devices: int) -> str:
  """XLA_FLAGS for a process with `devices` simulated CPU devices."""
  return f"--xla_force_host_platform_device_count={devices} {COLLECTIVE_TIMEOUTS}"
