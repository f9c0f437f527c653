"""BM5's figures and plots (bench/e2e.py): percentiles, the copy timeline,
the latency plot, the table."""
from __future__ import annotations

import json
import os

from bench.lib.common import finish_panel, fmt, save_panels
from bench.lib.e2e_decoder import POLICIES
from bench.lib.e2e_providers import make_provider


def timeline(torch, dec, inputs, budget, path_png, path_json, eviction):
    """Profiles one next-layer-gate step (after a warm-up step) and plots GPU
    kernels against host-to-device copies on one time axis."""
    import tempfile

    provider = make_provider(dec, "next-layer-gate", budget, None, eviction)
    try:
        dec.step(inputs[0], provider)
        dec.sync()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            dec.step(inputs[1], provider)
            dec.sync()
    finally:
        provider.close()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        trace_path = f.name
    prof.export_chrome_trace(trace_path)
    with open(trace_path) as f:
        events = json.load(f).get("traceEvents", [])
    os.unlink(trace_path)
    kernels = [(e["ts"], e["dur"]) for e in events if e.get("cat") == "kernel" and "dur" in e]
    copies = [(e["ts"], e["dur"]) for e in events
              if e.get("cat") == "gpu_memcpy" and "dur" in e and "HtoD" in e.get("name", "")]
    if not kernels:
        return None
    t0 = min(t for t, _ in kernels + copies)
    summary = {"kernels": len(kernels), "copies": len(copies),
               "kernel_busy_ms": sum(d for _, d in kernels) / 1e3, "copy_busy_ms": sum(d for _, d in copies) / 1e3,
               "span_ms": (max(t + d for t, d in kernels + copies) - t0) / 1e3}
    with open(path_json, "w") as f:
        json.dump({"summary": summary, "kernels_us": [(t - t0, d) for t, d in kernels],
                   "copies_us": [(t - t0, d) for t, d in copies]}, f)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 2.8))
    ax.broken_barh([((t - t0) / 1e3, max(d / 1e3, 0.002)) for t, d in kernels], (10, 8), color="tab:blue")
    ax.broken_barh([((t - t0) / 1e3, max(d / 1e3, 0.002)) for t, d in copies], (0, 8), color="tab:orange")
    ax.set_yticks([4, 14], ["H2D copies", "compute kernels"])
    ax.set_xlabel("ms since the step's first GPU activity")
    ax.set_title(f"one decode step, {dec.spec['name']}, next-layer-gate, batch {inputs.shape[1]}")
    fig.tight_layout()
    fig.savefig(path_png, dpi=120)
    plt.close(fig)
    return summary


def plot_latency(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["model"], r["batch"]) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
    for ax, (model, batch) in zip(axes[0], groups):
        sub = [r for r in rows if r["model"] == model and r["batch"] == batch]
        for policy in POLICIES:
            pts = sorted((r["cache_share"], r["p50_ms"]) for r in sub if r["policy"] == policy and r["p50_ms"])
            if pts:
                ax.plot([p[0] * 100 for p in pts], [p[1] for p in pts], marker="o", label=policy)
        floors = sorted({(r["cache_share"], r["floor_ms"]) for r in sub if r.get("floor_ms")})
        if floors:
            ax.plot([f[0] * 100 for f in floors], [f[1] for f in floors], "k--", label="max(compute, IO floor)")
        finish_panel(ax, f"{model}, batch {batch}", "GPU cache share of expert bytes (%)", "step latency p50 (ms)")
    save_panels(fig, axes, path)


def format_table(rows) -> str:
    head = (f"{'model':<14}{'b':>3}{'share':>6}  {'policy':<16}{'p50 ms':>9}{'p90 ms':>9}{'stall':>8}"
            f"{'hit':>6}{'GB moved':>9}{'GB/s':>7}{'prec':>6}{'recall':>7}{'floor':>8}{'x floor':>8}"
            f"{'x adj':>7}{'x best':>7}{'x rnd fl':>9}")
    lines = [head]
    for r in rows:
        gb = None if r.get("bytes_moved") is None else r["bytes_moved"] / 1e9
        lines.append(
            f"{r['model']:<14}{r['batch']:>3}{r['cache_share']:>6.0%}  {r['policy']:<16}{fmt(r['p50_ms']):>9}"
            f"{fmt(r['p90_ms']):>9}{fmt(r.get('stall_ms')):>8}{fmt(r.get('hit_rate')):>6}{fmt(gb):>9}"
            f"{fmt(r.get('achieved_gbps'), 1):>7}{fmt(r.get('precision')):>6}{fmt(r.get('recall')):>7}"
            f"{fmt(r['floor_ms']):>8}{fmt(r.get('over_floor')):>8}"
            f"{fmt(r.get('x_adjacent')):>7}{fmt(r.get('x_adjacent_best')):>7}"
            f"{fmt(r.get('x_floor_adjacent')):>9}"
        )
    return "\n".join(lines)

