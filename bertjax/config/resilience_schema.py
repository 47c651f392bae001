"""The `resilience` and `faults` groups of a run config: the spike guard, rewind-and-skip, step
replay, the hang watchdog and the slow-host check (bertjax.resilience), and the fault lab that
tests them; guide: docs/resilience.md. `bertjax.config.schema.base_config` puts both in every
config.
"""

from __future__ import annotations

import ml_collections

ConfigDict = ml_collections.ConfigDict


def resilience_group() -> ConfigDict:
  """The `resilience` group: what a run does by itself about loss spikes, faults and hangs.
  The guard's rule is MaxText's and OLMo-core's (skip an update whose loss or gradient norm is
  above mean + 6 std of the recent ones); the rewind after persistent trouble is what PaLM
  (Chowdhery et al. 2022, section 5.1) did by hand: restart from a checkpoint before the spike
  and skip the batches around it."""
  return ConfigDict({
      # Skip an update whose loss or gradient norm is above mean + this many standard
      # deviations of the recent accepted steps, or is not finite (0: the guard is off, and a
      # non-finite loss stops the run).
      "spike_sigmas": 6.0,
      # Keep the old parameters and optimizer state on an outlier step (False: the guard only
      # counts outliers towards the alarm, which rewinds the run; docs/resilience.md, 'What
      # the guard costs').
      "skip_spikes": True,
      # Accepted steps the mean and standard deviation are taken over.
      "spike_history": 128,
      # Steps seen before any finite value is judged an outlier.
      "spike_min_history": 32,
      # Persistent trouble: this many skipped updates ...
      "alarm_skips": 3,
      # ... within this many steps (or one non-finite step) make the run rewind to its last
      # checkpoint before the trouble and skip the batches between there and the alarm.
      "alarm_window": 100,
      # Rewinds a run may make (in all its attempts) before it stops with one line.
      "max_rewinds": 5,
      # Before rewinding, replay the steps from that checkpoint with the same batches: trouble
      # that does not come back is a hardware fault (exit status 5, the launchers restart the
      # run elsewhere); trouble that does is the data's or the model's (rewind and skip).
      "replay": True,
      # Every this many steps, compare the bits of every copy of each replicated parameter:
      # copies that differ are a hardware fault (exit status 5) (0: never).
      "replica_check_every": 1000,
      # Hang watchdog: a step slower than this many times the p99 of the recent steps ...
      "hang_factor": 3.0,
      # ... and than this many seconds dumps every thread's stack and exits with status 6
      # (before the first steady step, distributed.step_timeout_s applies).
      "hang_floor_s": 60.0,
      # Name a host whose own work per step (input, dispatch) exceeds the fastest host's by
      # this fraction of the step time at three log steps running (0: off).
      "slow_host_fraction": 0.1,
  })


def faults_group() -> ConfigDict:
  """The `faults` group: the fault lab (bertjax.resilience.faults), for tests and drills; off
  while every key has its default. Positions are 0-based data positions (the n-th step's worth
  of batches drawn), steps 1-based."""
  return ConfigDict({
      # Comma-separated data positions whose loss is multiplied by poison_scale.
      "poison": "",
      "poison_scale": 50.0,
      # Comma-separated data positions whose loss is NaN.
      "nan": "",
      # Comma-separated steps before which one device's copy of a parameter gets a bit flipped.
      "flip_bit": "",
      # Which parameter: the first whose path holds this text (a norm's "scale": 1.0 becomes
      # infinity); empty: the largest.
      "flip_param": "",
      # Comma-separated POSITION:SECONDS: that batch comes this late.
      "data_delay": "",
      # Seconds added to every compilation of the train step.
      "compile_delay_s": 0.0,
      # SIGKILL the process right after this step (0: never).
      "kill": 0,
      # data:STEP (that step's batch never comes) or collective:STEP (the process never sends
      # that step); empty: no hang.
      "hang": "",
      # This process does slow_fraction more work per step (-1: none).
      "slow_process": -1,
      "slow_fraction": 0.2,
      # The process machine faults (bit flip, delays, kill, hang) hit (-1: every one).
      "process": -1,
      # Machine faults fire on the run's first this many attempts (a restart is clean).
      "attempts": 1,
  })
