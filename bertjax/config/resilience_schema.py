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
  The guard skips an update whose loss and gradient norm are both far above their recent
  values (OLMo-core's and MaxText's spike skipping, with a robust median/MAD in log space
  where they take mean and std, and both signals required where they take either: healthy
  runs trip theirs; docs/resilience.md, 'The spike guard'); the rewind after persistent
  trouble is what PaLM (Chowdhery et al. 2022, section 5.1) did by hand: restart from a
  checkpoint before the spike and skip the batches around it."""
  return ConfigDict({
      # Skip an update whose log loss and log gradient norm are both above the recent
      # accepted steps' median + this many robust standard deviations of their step-to-step
      # noise (1.4826 MAD of consecutive differences / sqrt 2) and above the highest of them,
      # or whose loss or norm is not finite (0: the guard is off, and a non-finite loss stops
      # the run).
      "spike_sigmas": 8.0,
      # ... and both at least this many times their recent median: a spike is a jump, not a
      # wobble of a series that happens to be very steady.
      "spike_min_ratio": 1.5,
      # ... and the loss above the highest the run has had, decayed by half every this many
      # accepted steps: a fine-tune's hard batch near a zero loss is below where it started.
      "spike_peak_half_life": 1000.0,
      # Keep the old parameters and optimizer state on an outlier step (False: the guard only
      # counts outliers towards the alarm, which rewinds the run; docs/resilience.md, 'What
      # the guard costs').
      "skip_spikes": True,
      # Accepted steps the median and its absolute deviation are taken over.
      "spike_history": 128,
      # Accepted steps before any finite value is judged an outlier.
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
      # Every this many steps, check the train state's bits: copies of a replicated block
      # must agree, and blocks with one copy (fsdp, tensor) must come out of the step replayed
      # on the mesh with its devices rotated the same; a difference is a hardware fault (exit
      # status 5) (0: never; on one device there is nothing to compare and nothing runs).
      "replica_check_every": 1000,
      # Hang watchdog: a step slower than this many times the p99 of the recent steps ...
      "hang_factor": 3.0,
      # ... and than this many seconds dumps every thread's stack and exits with status 6
      # (before the first steady step, distributed.step_timeout_s applies).
      "hang_floor_s": 60.0,
      # Name a host whose own work per step (input, dispatch) exceeds the fastest host's by
      # this fraction of the step time at three log steps running (0: off).
      "slow_host_fraction": 0.1,
      # The integrity check's replay of a step where blocks have one copy; it holds a second
      # train state on the devices from the step before to the check (False: compare the
      # replicas alone, and blocks with one copy go unchecked).
      "integrity_replay": True,
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
