"""BM6's output (bench/generate.py): why a figure is null, the table, the plot."""
from __future__ import annotations

from bench.lib.common import finish_panel, fmt, save_panels
from bench.lib.generate_modes import ENGINE_ROWS, FIGURES, SHARE_ROWS


def why_null(row: str, key: str, cuda: bool, share) -> str:
    """Why a figure of a row that ran is null."""
    resident = row.startswith("resident")
    if key in ("hit_rate", "bytes_moved", "copies", "prefill_bytes") and resident:
        return "every expert is resident: nothing is cached or moved"
    if key == "hit_rate" and row == "accelerate-cpu-offload":
        return "no cache: every call copies all of its layer's experts"
    if key == "copies" and row == "accelerate-cpu-offload":
        return "not counted: a layer's experts move as one module per call"
    if key in ("hit_rate", "bytes_moved", "copies") and row in ENGINE_ROWS:
        return "the engine's counters were not readable"
    if key in ("precision", "recall"):
        return "no predictions scored for this row" if row in ENGINE_ROWS else "no predictor in this row"
    if key == "x_paired":
        return "not measured: --paired 0, or no second resident copy (the block's twin_reason)"
    if key in ("x_adjacent", "x_adjacent_best") and row == "resident":
        return "the reference row"
    if key == "host_us_per_layer":
        if row in ENGINE_ROWS:
            return "the controller's report() has no host_us_per_layer"
        return "not measured for this row"
    if key in ("io_floor_ms", "floor_ms", "over_floor"):
        if share is None:
            return "no cache budget: no IO floor"
        if not cuda:
            return "no CUDA: no H2D bandwidth measured"
    return "not measured for this row"


def explain_nulls(rows, cuda: bool):
    for r in rows:
        for key in (*FIGURES, "io_floor_ms", "floor_ms"):
            r.setdefault(key, None)
        if r.get("reason"):
            continue
        reasons = {key: why_null(r["row"], key, cuda, r["share"])
                   for key in (*FIGURES, "io_floor_ms", "floor_ms") if r[key] is None}
        if reasons:
            r["null_reasons"] = reasons


# ------------------------------------------------------------------ output


def format_table(rows) -> str:
    head = (f"{'model':<16}{'b':>3}{'share':>6}  {'row':<26}{'p50 ms':>9}{'p90 ms':>9}{'x res':>7}{'x adj':>7}"
            f"{'x best':>7}{'x pair':>7}{'equal':>6}"
            f"{'hit':>6}{'GB moved':>9}{'host us':>8}{'ttft ms':>9}{'x ttft fl':>10}{'x floor':>8}  reason")
    lines = [head]
    for r in rows:
        gb = None if r.get("bytes_moved") is None else r["bytes_moved"] / 1e9
        share = "-" if r["share"] is None else f"{r['share']:.0%}"
        eq = "null" if r.get("tokens_equal") is None else str(r["tokens_equal"])
        lines.append(
            f"{r['model']:<16}{r['batch']:>3}{share:>6}  {r['row']:<26}{fmt(r.get('p50_ms')):>9}"
            f"{fmt(r.get('p90_ms')):>9}{fmt(r.get('x_resident')):>7}{fmt(r.get('x_adjacent')):>7}"
            f"{fmt(r.get('x_adjacent_best')):>7}{fmt(r.get('x_paired')):>7}{eq:>6}"
            f"{fmt(r.get('hit_rate')):>6}"
            f"{fmt(gb, 3):>9}{fmt(r.get('host_us_per_layer'), 0):>8}{fmt(r.get('ttft_ms')):>9}"
            f"{fmt(r.get('ttft_over_floor')):>10}{fmt(r.get('over_floor')):>8}  {r.get('reason') or ''}")
    return "\n".join(lines)


def plot(rows, path) -> str | None:
    """ms/token p50 per row against the share, one panel per model and batch;
    share-free rows as horizontal lines. Returns why not, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"matplotlib not importable ({exc})"
    groups = sorted({(r["model"], r["batch"]) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4.2), squeeze=False)
    for ax, (model, batch) in zip(axes[0], groups):
        sub = [r for r in rows if r["model"] == model and r["batch"] == batch and r.get("p50_ms") is not None]
        for name in SHARE_ROWS:
            pts = sorted((r["share"] * 100, r["p50_ms"]) for r in sub if r["row"] == name)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        for name, style in (("resident", "k-"), ("resident-eager", "k:"), ("accelerate-cpu-offload", "r--")):
            for r in sub:
                if r["row"] == name:
                    ax.axhline(r["p50_ms"], color=style[0], linestyle=style[1:], linewidth=1, label=name)
        floors = sorted({(r["share"] * 100, r["floor_ms"]) for r in sub if r.get("floor_ms") and r["share"]})
        if floors:
            ax.plot([f[0] for f in floors], [f[1] for f in floors], "k--", alpha=0.5, label="max(resident, IO floor)")
        finish_panel(ax, f"{model}, batch {batch}", "device cache share of expert bytes (%)",
                     "decode ms/token (p50)")
    save_panels(fig, axes, path)
    return None
