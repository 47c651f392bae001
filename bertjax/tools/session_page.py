"""The results page of a GPU session (bertjax.tools.gpu_session): Markdown made from the session's
record — the machine, the tier's tests, the table against `transformers`, the variants of our
step, and each job's profile (ours and the reference's kernels). Guide: docs/doctor.md.
"""

from __future__ import annotations

from typing import Any

from bertjax.tools import profiles


def _ms(seconds: float | None) -> str:
  return "n/a" if seconds is None else f"{seconds * 1e3:,.1f}"


def _pct(x: float | None) -> str:
  return "n/a" if x is None else f"{x:.1%}"


def _gib(x: float | None) -> str:
  return "n/a" if x is None else f"{x / 2**30:,.1f} GiB"


def _tier(tier: dict[str, Any] | None) -> list[str]:
  if not tier:
    return ["Not run in this session.", ""]
  lines = [f"`{tier.get('command', '')}`: exit code {tier.get('returncode')}, "
           f"{tier.get('seconds', 0):.1f} s" + (f" — {tier['error']}" if "error" in tier else ""),
           ""]
  tests = tier.get("tests", [])
  if tests:
    counts: dict[str, int] = {}
    for t in tests:
      counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    lines += [", ".join(f"**{n} {o}**" for o, n in sorted(counts.items())), "",
              "| test | outcome | seconds |", "|---|---|---|"]
    messages = tier.get("messages", {})
    for t in tests:
      note = f" ({messages[t['name']][:120]})" if t["name"] in messages else ""
      lines.append(f"| {t['name']} | {t['outcome']}{note} | {t['seconds']:.1f} |")
    lines.append("")
  return lines


def _table(records: list[dict[str, Any]]) -> list[str]:
  lines = ["| row | ours ms/step | transformers ms/step | ours/transformers (pairs) | "
           "MFU (measured bf16 peak) | MFU (data sheet) | our compiled memory | reference peak "
           "memory | our compile |",
           "|---|---|---|---|---|---|---|---|---|"]
  for r in records:
    name = r["job"]["row"]
    if "error" in r:
      lines.append(f"| {name} | failed: {r['error']} ||||||||")
      continue
    o, h = r["ours"], r.get("hf", {})
    pairs = ", ".join(f"{x:.3f}" for x in r.get("pairs_ratio", []))
    lines.append(
        f"| {name} | {_ms(o['step_seconds_median'])} | {_ms(h.get('step_seconds_median'))} | "
        f"**{r.get('median_ratio', float('nan')):.3f}×** ({pairs}) | "
        f"{_pct(o['mfu_vs_xla_matmul_peak'])} | {_pct(o.get('mfu_vs_nominal_peak'))} | "
        f"{_gib(o.get('compiled_peak_bytes_per_device'))} | {_gib(h.get('peak_memory_bytes'))} | "
        f"{o['compile_seconds']:.1f} s |")
  return lines + [""]


def _variants(records: list[dict[str, Any]], defaults: dict[str, dict[str, Any]],
              docs: dict[str, str]) -> list[str]:
  lines = ["| row | variant | what | ms/step | default's / this (same row) | MFU (measured "
           "peak) | compiled memory | compile |", "|---|---|---|---|---|---|---|---|"]
  for r in records:
    job = r["job"]
    if "error" in r:
      lines.append(f"| {job['row']} | {job['variant']} | failed: {r['error']} ||||||")
      continue
    o = r["ours"]
    base = defaults.get(job["row"], {}).get("ours", {}).get("step_seconds_median")
    speedup = f"{base / o['step_seconds_median']:.3f}×" if base else "n/a"
    lines.append(f"| {job['row']} | {job['variant']} | {docs.get(job['variant'], '')} | "
                 f"{_ms(o['step_seconds_median'])} | {speedup} | "
                 f"{_pct(o['mfu_vs_xla_matmul_peak'])} | "
                 f"{_gib(o.get('compiled_peak_bytes_per_device'))} | "
                 f"{o['compile_seconds']:.1f} s |")
  return lines + [""]


def render(session: dict[str, Any]) -> str:
  """The page of `session` (gpu_session.run_session's record; "variant_docs": what each
  variant of our step is)."""
  v = session["versions"]
  jobs = session.get("jobs", [])
  defaults = {r["job"]["row"]: r for r in jobs if r["job"]["variant"] == "default"
              and "error" not in r}
  lines = [f"# {session['date']}: the GPU session{' (reduced, CPU)' if session['reduced'] else ''}"
           f" on {v.get('gpu', 'unknown')}", "",
           f"jax {v.get('jax')} (jaxlib {v.get('jaxlib')}), Flax {v.get('flax')}, Optax "
           f"{v.get('optax')}, torch {v.get('torch')}, transformers {v.get('transformers')}, "
           f"Python {v.get('python')}; bertjax at {v.get('bertjax')}. "
           f"{session.get('elapsed_seconds', 0):.0f} s of a {session['seconds']:.0f} s budget.",
           "", "```bash", session.get("command", ""), "```", "", "## The accelerator tier", ""]
  lines += _tier(session.get("tier"))
  lines += ["## The GPU table", "",
            "bf16; our step alternating with `transformers` (SDPA, bf16 autocast, "
            "`torch.compile`, fused AdamW) in one process, the ratio pair by pair (our "
            "throughput over the reference's); the peaks measured in that process.", ""]
  lines += _table([r for r in jobs if r["job"]["variant"] == "default"])
  others = [r for r in jobs if r["job"]["variant"] != "default"]
  if others:
    lines += ["## Variants of our step", "",
              "Each in its own process, timed alone under the lock (not alternating with the "
              "reference); the speed-up is against the row's default job.", ""]
    lines += _variants(others, defaults, session.get("variant_docs", {}))
  lines += ["## Profiles", ""]
  for r in jobs:
    if "error" in r:
      continue
    lines += [f"### {r['job']['row']} / {r['job']['variant']}", ""]
    for key, title in (("profile", "ours"), ("hf_profile", "transformers")):
      if key in r and "error" in r[key]:
        lines += [f"**{title}**: the profile was not read ({r[key]['error']})", ""]
      elif key in r:
        lines += profiles.format_summary(r[key], title)
  return "\n".join(lines).rstrip() + "\n"
