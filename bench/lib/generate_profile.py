"""BM6 --profile: one more generate of a row under torch.profiler, its
decode steps only, and where their time went (bench/generate.py)."""
from __future__ import annotations

import os
import re

from bench.lib.common import gpu_time_split
from bench.lib.generate_model import StepTimer, generate

# The CUDA runtime calls whose host time the profile reports (count and us
# per decode token): kernel launches, copies, the waits and the events.
RUNTIME_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cudaMemcpyAsync", "cudaStreamSynchronize",
                 "cudaEventSynchronize", "cudaEventRecord", "cudaStreamWaitEvent", "cudaEventQuery")


def profile_path(folder: str, model: str, batch: int, share, row: str) -> str:
    """The path (without extension) of a row's profile files in `folder`."""
    where = "all" if share is None else f"{round(share * 100):g}pct"
    name = f"{model}_b{batch}_{where}_{row}"
    return os.path.join(folder, re.sub(r"[^A-Za-z0-9_.-]", "_", name))


def profile_generate(block, mode, path: str, tokens: int) -> dict:
    """A generate of `tokens` new tokens on the measured prompt, profiled
    from its first logits call (the prefill's end) to its end, after the
    row's measured ones (the profiler's cost stays out of every other
    figure); the mode starts a new sequence before and after it. Writes
    `path`.json (Chrome trace) and `path`.txt (ops by self device time on
    CUDA, else self CPU time). Returns, per decode token: wall ms (median,
    profiled), the GPU's busy, compute and host-to-device ms
    (bench.lib.common.gpu_time_split; null without CUDA) and the time it was
    idle, the kernels launched, and count and host us of the CUDA runtime
    calls in RUNTIME_CALLS."""
    from torch.profiler import ProfilerActivity, profile

    torch = block.torch
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if block.cuda else [])
    prof = profile(activities=activities)
    mode.new_sequence()
    timer = StepTimer(block.timer_sync, on_first=prof.start)
    try:
        generate(torch, block.model, block.prompt, tokens, block.sync, timer)
    finally:
        if prof.profiler is not None:  # started at the first logits call
            prof.stop()
        mode.new_sequence()
    decode = [b - a for a, b in zip(timer.times, timer.times[1:])]
    if not decode:
        return {"decode_tokens": 0, "reason": "no decode step was profiled"}
    prof.export_chrome_trace(path + ".json")
    averages = prof.key_averages()
    with open(path + ".txt", "w") as f:
        f.write(averages.table(sort_by="self_device_time_total" if block.cuda else "self_cpu_time_total",
                               row_limit=40))
    n = len(decode)
    wall = sum(decode) * 1e3
    # Means over the profiled decode steps, as the GPU split below is, so
    # that wall - busy = idle holds (a median wall against mean busy did not).
    out = {"decode_tokens": n, "wall_ms_per_token": wall / n, "files": path + ".{json,txt}"}
    runtime = {}
    for ev in averages:
        if ev.key in RUNTIME_CALLS:
            runtime[ev.key] = {"calls_per_token": ev.count / n, "host_us_per_token": ev.cpu_time_total / n}
    out["runtime_calls"] = runtime
    launches = sum(runtime.get(k, {}).get("calls_per_token", 0.0) for k in ("cudaLaunchKernel", "cudaLaunchKernelExC"))
    out["kernel_launches_per_token"] = launches if block.cuda else None
    split = gpu_time_split(torch, prof) if block.cuda else None
    for key in ("busy", "compute", "h2d"):
        out[f"gpu_{key}_ms_per_token"] = split[f"{key}_us"] / 1e3 / n if split else None
    # The decode window's wall time the GPU ran nothing (kernels or copies).
    out["gpu_idle_ms_per_token"] = (wall - split["busy_us"] / 1e3) / n if split else None
    return out
