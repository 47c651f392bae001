"""`bertjax compile --fit`: what is searched and how the search walks it (the compiles
themselves are faked here; tests/test_aot.py compiles for real, docs/reproducing.md records
real searches)."""

from bertjax import cli
from bertjax.config import load_config
from bertjax.tools import fit, topology


def test_search_space_offers_splash_only_without_attention_dropout_and_full_only_in_fp32():
  config = load_config("gpt_tiny", [("batch_size", "16")])
  space = fit.search_space(config)
  assert {ladder[0]["model.attention"] for ladder in space} == {"xla"}
  assert [ladder[0]["model.remat_policy"] for ladder in space] == ["none", "dots", "full"]
  assert [s["grad_accum_steps"] for s in space[0]] == ["1", "2", "4", "8", "16"]
  config = load_config("gpt_tiny", [("model.attention_dropout", "0.0"),
                                    ("model.dtype", "bfloat16"), ("grad_accum_steps", "2"),
                                    ("batch_size", "8")])
  space = fit.search_space(config)
  assert [(l[0]["model.attention"], l[0]["model.remat_policy"]) for l in space] == [
      ("auto", "none"), ("auto", "dots"), ("xla", "none"), ("xla", "dots")]
  assert [s["grad_accum_steps"] for s in space[0]] == ["2", "4", "8"]


def test_search_stops_each_ladder_at_the_first_fit_skips_crashes_and_picks_the_fastest(
    monkeypatch, capsys):
  compiled = []

  def fake(config_name, overrides, setting, topology, mfu, slices):
    compiled.append(setting)
    accum, remat = int(setting["grad_accum_steps"]), setting["model.remat_policy"]
    if remat == "full":
      return fit.Trial(setting, "compiler crash")
    if accum < (4 if remat == "none" else 2):
      return fit.Trial(setting, "does not fit", 20.0)
    # Fewer micro-batches and no recomputation are faster.
    return fit.Trial(setting, "fits", 10.0, step_ms=100.0 * accum * (1.3 if remat == "dots"
                                                                        else 1.0))

  monkeypatch.setattr(fit, "_run_one", fake)
  monkeypatch.setattr(topology, "libtpu_available", lambda: True)
  assert cli.main(["compile", "--config", "gpt_tiny", "--topology", "v5e-8", "--fit",
                   "--config.batch_size=16"]) == 0
  out = capsys.readouterr().out
  # none: 1, 2 too large, 4 fits (stop); dots: 1 too large, 2 fits (stop); full: all crash.
  assert [(s["model.remat_policy"], s["grad_accum_steps"]) for s in compiled] == [
      ("none", "1"), ("none", "2"), ("none", "4"), ("dots", "1"), ("dots", "2"),
      ("full", "1"), ("full", "2"), ("full", "4"), ("full", "8"), ("full", "16")]
  assert "compiler crash" in out and "does not fit" in out
  assert ("--config.model.attention=xla --config.model.remat_policy=dots "
          "--config.grad_accum_steps=2") in out.splitlines()[-1]


def test_when_nothing_fits_it_says_why_and_exits_1(monkeypatch, capsys):
  monkeypatch.setattr(fit, "_run_one", lambda name, o, setting, *a: fit.Trial(
      setting, "does not fit", 99.0))
  monkeypatch.setattr(topology, "libtpu_available", lambda: True)
  assert cli.main(["compile", "--config", "gpt_tiny", "--topology", "v5e-8", "--fit",
                   "--config.batch_size=4"]) == 1
  err = capsys.readouterr().err
  # 3 remat policies x 3 micro-batch counts, as written and then without attention dropout.
  assert "no setting searched fits v5e-8" in err and "18 too large" in err


def test_a_fit_that_needs_the_recipe_changed_says_so(monkeypatch, capsys):
  """Nothing fits with the recipe's attention dropout; the fused kernel without it does: the
  answer names the change."""
  monkeypatch.setattr(fit, "_run_one", lambda name, o, setting, *a: fit.Trial(
      setting, *(("fits", 5.0, 50.0) if "model.attention_dropout" in setting
                 else ("does not fit", 99.0))))
  monkeypatch.setattr(topology, "libtpu_available", lambda: True)
  assert cli.main(["compile", "--config", "gpt_tiny", "--topology", "v5e-8", "--fit",
                   "--config.batch_size=4"]) == 0
  out = capsys.readouterr().out
  assert "a change of the recipe" in out
  assert "--config.model.attention_dropout=0.0 --config.model.attention=auto" in out


def test_a_setting_with_headroom_beats_a_faster_one_the_compiler_only_just_accepted(
    monkeypatch):
  def fake(config_name, overrides, setting, topology, mfu, slices):
    tight = setting["model.remat_policy"] == "none"
    return fit.Trial(setting, "fits", 16.5 if tight else 11.0,
                     step_ms=100.0 if tight else 120.0, no_headroom=tight)

  monkeypatch.setattr(fit, "_run_one", fake)
  best, trials = fit.search("gpt_tiny", [("batch_size", "4")], "v5e-8", 0.5, 1)
  assert best.overrides["model.remat_policy"] == "dots" and len(trials) == 3
