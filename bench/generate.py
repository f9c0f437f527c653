"""BM6: transformers `generate` end to end, every row of a block in one process.

    python bench/generate.py [--models olmoe-1b-7b qwen3-30b-a3b] [--batches 1 8]
        [--shares 0.1 0.25 0.5] [--rows ROW ...] [--new-tokens 64] [--warmup-tokens 8]
        [--prompt-tokens 32] [--ttft-tokens 512] [--accelerate-tokens 4] [--vocab 32000]
        [--mpl-capacity memory|slots] [--budget-s 540] [--repeats 1] [--paired 0] [--paired-tokens 32]
        [--park-resident-experts] [--trace-in TRACE.json [--trace-from 1]] [--profile DIR [--profile-tokens 16]]
        [--ab ROW_A ROW_B [--ab-pairs 8] [--ab-lockstep 0] [--ab-control] [--ab-swap] [--ab-share S]]
        [--json PATH] [--plot PATH.png]
    python bench/generate.py --smoke-cpu [--trace-in TRACE.json] [--json PATH]

Models: transformers OlmoeConfig / Qwen3MoeConfig at the real shapes of
OLMoE-1B-7B-0924 (16 layers, 64 experts, top-8, hidden 2048, expert
intermediate 1024, 16 heads) and Qwen3-30B-A3B (48 layers, 128 experts, top-8,
hidden 2048, moe_intermediate_size 768, 32 heads, 4 kv heads, head_dim 128),
random bf16 weights initialised on the GPU (nothing is downloaded), the vocab
cut to --vocab (the output says so). A block is one model and one batch size;
the model is built once per model and every row of every block runs in this
one process. Prompts are fixed random ids; decoding is greedy with
min_new_tokens = max_new_tokens (no eos), so every row generates the same
count. Each block first runs the resident model over the measured and TTFT
lengths on other prompts (Note [Warm every sequence length] in
bench/lib/generate_model.py); each row then runs a warm-up generate on a
different prompt, the measured generate, then the time-to-first-token
generate.

--trace-in: the model routes as a real routing trace says (traces/ and
../shared/traces; Note [Forced routing] in bench/lib/generate_trace.py):
the models are then bench/lib/generate_trace.py's TRACE_MODELS of the trace's
layer and expert counts (qwen3-30b-a3b; gemma4-26b-a4b; gpt-oss-120b-narrow,
its experts a quarter as wide so that they fit), top-k from the trace, and each
generate's decode token i routes as the trace's step --trace-from + i. The
gate row's guesses then come from the random router, not from the routing
it guesses (the same holds in BM5's replays).

Rows (share = device cache budget / all expert bytes; share-free rows have none):
  resident          every expert on the GPU, transformers' default experts
                    implementation (grouped_mm in 5.17): the reference
  resident-eager    every expert on the GPU, experts_implementation "eager"
  on-demand         prefetch.offload_moe_experts, predictor=None (records the
                    routing trace the oracle replays)
  gate              ... predictor=NextLayerGatePredictor()
  oracle            ... predictor=OraclePredictor(trace of on-demand's measured
                    generate), eviction_policy "next-use"; its TTFT generate
                    replays the TTFT prompt's own routing (recorded on the
                    resident model)
                    (all three with the default sync_free=None: each step
                    picks its path, Note [Which path a step takes]; a step
                    that misses little runs without a routing sync, Note
                    [Sync-free decode]; the gate guesses only on synced
                    steps, whose routing sync carries its guesses)
  on-demand-synced / oracle-synced
                    the same with sync_free=False: every layer reads its
                    routing on the host first
  torch-by-hand     plain PyTorch a user would write: an LRU over (layer,
                    expert) of budget // expert-bytes device slots (one
                    preallocated [slots, ...] tensor per weight), experts in
                    pinned host memory (typed views of the block's one packed
                    copy, which the engine rows use too: two copies of
                    Qwen3-30B-A3B's 54 GiB do not fit a 128 GiB host),
                    copy_(non_blocking=True) per miss on a
                    side stream with events; hooked in as a transformers
                    experts implementation, computing with grouped_mm on the
                    slot tensors (expert ids remapped to slots); a layer routed
                    to more experts than slots runs in pieces
  accelerate-cpu-offload
                    accelerate.cpu_offload of each layer's experts module (what
                    device_map offload does: the whole layer's experts copied in
                    at every call); only --accelerate-tokens tokens
  moe-policylang-lru / moe-policylang-lookahead
                    the pip package moe-policylang (transformers experts
                    backend; plain copies), cache {eviction = lru}, the second
                    with prefetch {strategy = lookahead} and async transfers
                    (CUDA only: without them its prefetch moves nothing).
                    Its cache is keyed by expert id across all layers and each
                    layer keeps its own device copies of the ids it holds, so
                    its capacity C holds up to layers x C experts: --mpl-capacity
                    memory (default) sets C = budget slots // layers (the same
                    device bytes as our budget), slots sets C = min(budget
                    slots, experts). Evicting an id drops it from every layer,
                    so at C = budget slots // layers a step that routes to
                    most ids across its layers evicts each before its reuse
                    (hit 0.00 at 25 %, runs 29-95). Null with the reason
                    where the package is not importable.

Figures per row:
  p50_ms, p90_ms    decode ms/token: time between consecutive logits calls of
                    the measured generate, each read after --timer-sync's
                    wait (device, the default: torch.cuda.synchronize, every
                    stream, the engine's background copies too; stream: the
                    compute stream only), the prefill step excluded;
                    with --repeats the median of the generates' p50s
                    (p50_runs_ms; p90 and the counters are the first's)
  tokens_equal      generated ids equal to the resident row's (accelerate:
                    its first --accelerate-tokens)
  hit_rate, bytes_moved, copies
                    over the decode steps only (counters read at the first
                    logits call and at the end). Engine: its hits / (hits +
                    misses); torch-by-hand: routed (layer, expert) found in a
                    slot; moe-policylang: routed (layer, expert) needing no
                    copy at use (its prefetched experts count as copies);
                    accelerate: no cache, hit rate null
  on_demand, upgraded, declined, cancelled, wasted, spec_underruns, late, evictions
                    engine rows, over the decode steps: copies made on
                    demand, guesses upgraded to band 0 by their layer's
                    acquire, declined by admission control, cancelled
                    before their copy, copies evicted unused, the copy
                    worker's cap waits that found the link drained,
                    acquires that found their copy under way, evictions
                    (where a speculating row's copies went; BM5's engine
                    counts)
  precision, recall engine rows: the controller's prediction scores
  speculation_paused_layers
                    engine rows: layers whose guesses were held back or not
                    made (report(); over the whole row, warm-up included)
  steady_steps      engine rows on the sync-free path: steps that pinned
                    every layer in one engine call (Note [Steady pins];
                    report(); over the whole row, warm-up included)
  step_pins         engine rows on the sync-free path: steps pinned and
                    fetched by the predictor's plan of the whole step in one
                    engine call (Note [Step pins]; report(); over the whole
                    row, warm-up included)
  sync_free_steps, path_switches
                    engine rows: steps that took the sync-free path and
                    switches between it and the synced path (Note [Which
                    path a step takes]; report(); over the whole row,
                    warm-up included; null where the row has no sync-free
                    path)
  preloaded         engine rows: experts queued at offload (Note [Preload]:
                    all of them where every expert fits the budget, else 0)
  preload_wait_s    engine rows: seconds the row waited after offloading
                    for those copies to land (wait_preloaded, Note [Waiting
                    for the preload]), before its first generate
  parked_resident_experts  engine rows: whether the resident model's experts
                    were freed on the device while the row ran
                    (--park-resident-experts)
  alloc_retries     CUDA rows: {"measured": n, "paired": m}, the CUDA caching
                    allocator's retries (a full device: cached blocks freed
                    and the allocation tried again) during the measured and
                    repeated generates and during the paired ones (Note
                    [Allocator retries] in bench/lib/generate_rows.py)
  host_us_per_layer over the measured generate's decode steps (first token on):
                    engine rows: the controller's host time per offloaded
                    layer (report()'s host_us_per_layer, also
                    engine_us_per_layer and sync_us_per_layer, taken over
                    those steps); torch-by-hand: Python time in its LRU
                    (acquire and release) per layer call, the routing sync
                    and compute launches excluded; null elsewhere
  ttft_ms           a separate generate with max_new_tokens=1 on a
                    --ttft-tokens prompt per batch row, synchronised;
                    ttft_floor_ms = max(resident's TTFT (the resident
                    prefill, timed after one untimed run of that shape),
                    distinct (layer, expert) the prompt routes x expert
                    bytes / raw H2D)
  x_resident        p50_ms / resident p50_ms (the faster of the resident row
                    and its rerun after the block, as the block's
                    resident_ref_p50_ms)
  x_adjacent        median of the row's --repeats measured p50s
                    (p50_runs_ms) over the median of as many resident
                    generates run right after it (resident_adjacent_runs_ms):
                    the host's speed drifts over a block; these are seconds
                    apart
  x_adjacent_best   the fastest of the row's --repeats p50s over the fastest
                    of those resident generates (Note [Best of the repeats]
                    in bench/lib/common.py: slow spells of the host only
                    add time)
  x_paired          with --paired N: the median over N pairs of the row's
                    generate's p50 over a second resident copy's, run
                    right after or before it (Note [Paired generates] in
                    bench/lib/generate_twin.py); paired_runs_ms the pairs; the
                    resident row's own x_paired is the estimator's bias
  profile           with --profile DIR: one more generate of --profile-tokens
                    tokens after the paired ones, under torch.profiler from
                    its first logits call on (decode steps only), written to
                    DIR/<model>_b<batch>_<share>_<row>.json (Chrome trace)
                    and .txt (ops by self device time); per decode token:
                    wall ms (profiled), GPU busy, compute, host-to-device
                    and idle ms, kernels launched, and count and host us of
                    the CUDA runtime calls (bench/lib/generate_profile.py)
  steal_runs_ms     host CPU time the hypervisor gave to others during each
                    measured generate (/proc/stat; null where unreadable);
                    resident_adjacent_steal_ms likewise
  io_floor_ms       Belady's fewest loads (prefetch.integration.belady_misses
                    over the recorded routing, decode steps, capacity = budget
                    slots) x expert bytes / raw H2D GB/s / decode tokens;
                    floor_ms = max(resident ref p50, io_floor_ms); over_floor =
                    p50_ms / floor_ms
  raw H2D           bench.lib.common.raw_copy_gbps, pinned copies of expert-sized
                    rows, measured when a model is built and after its rows;
                    the faster of the two
A row that cannot run reports null figures with a reason; rows not started
before --budget-s are null with that reason. A row that fails says so with
the phase it was in ("failed: OutOfMemoryError in its paired generates:
..."); one that runs out of GPU memory also logs what holds it (torch's
counts, the largest CUDA storages and who refers to them). --json is
rewritten after every row with "partial": true (rows not settled yet: no
floors or x_resident), so a run cut short keeps what it measured; the last
write has "partial": false.
During offloaded rows the model's own GPU expert weights stay allocated (kept
to restore the model for the next row; nothing reads them) unless
--park-resident-experts frees them: device memory is not what is measured.
After each block the resident row runs again to check the model was restored.
--ab ROW_A ROW_B (engine rows; needs --paired, or --park-resident-experts
for a lean twin, Note [A lean twin]; the same row twice is the
estimator's control): after a block's rows, the
model offloaded as ROW_A and the twin as ROW_B at --ab-share, both at once,
--ab-pairs pairs of --paired-tokens generates alternating; the block's "ab"
has pairs_ms ([A, B] p50s), x_ab (the median A/B ratio), x_ab_ci (its
distribution-free confidence interval, [low, high, coverage >= 95 %];
null under 6 pairs), a_faster and sign_p (pairs with A faster; the
two-sided sign test's p), tokens_equal,
copies and hit_rates (each side's engine copies and hit rate over its
generates), pairs_detail (per pair and side: the generate's wall ms,
host steal, allocator retries, and its engine counters' change: Note
[Where a pair's time went]),
parked_resident_experts, twin ("resident" or "lean") and a reason where it did not run (Note [Two rows side by side] in
bench/lib/generate_ab.py). --ab-lockstep N adds N pairs whose two generates
run in lockstep, a token each in turn, in "lockstep": the same figures,
the same of the two prefills (prefill_pairs_ms, prefill_x_ab, ...) and
handoffs_with_copies (Note [Lockstep pairs]). --ab-control runs the
same pairs first with ROW_B on both sides, into "control": the
estimators' own bias, beside the A/B. --ab-swap runs the A/B again
with the rows on the other copies (ROW_B on the model, ROW_A on the
twin), into "swapped" (its pairs [B, A] as run), and "pooled" has both
A/Bs' pairs as [A, B] and their figures: a difference between the
model and its twin falls on each row in half of the pairs.

--smoke-cpu: tiny Qwen3-MoE, OLMoE and Mixtral configs (4 layers, 8 experts,
top-2, hidden 64) in float32 on the CPU, a few tokens, every row that can run
there (engine rows with the host backend, torch-by-hand without pinning,
accelerate and moe-policylang if importable; moe-policylang calls
torch.cuda.synchronize on the compute device, which is made a no-op for the
CPU device during its rows). It checks the logic; its timings mean nothing.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

if __package__ in (None, ""):
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.lib.common import machine_info, raw_h2d_gbps, write_json  # noqa: E402
from bench.lib.generate_ab import ab_rows, run_ab  # noqa: E402
from bench.lib.generate_figures import settle  # noqa: E402
from bench.lib.generate_model import (  # noqa: E402
    MODELS,
    SMOKE_DEFAULT,
    SMOKE_MODELS,
    ModelState,
    build_model,
    make_sync,
    moe_blocks,
    warm_lengths,
)
from bench.lib.generate_modes import (  # noqa: E402
    _HOST_EXPERTS,
    ROWS,
    SHARE_FREE_ROWS,
    SHARE_ROWS,
)
from bench.lib.generate_report import explain_nulls, format_table, plot  # noqa: E402
from bench.lib.generate_rows import Block, restore_check, run_planned_row  # noqa: E402
from bench.lib.generate_trace import FORCED_FAMILIES, TRACE_MODELS, ForcedRouting, force_routing, trace_shape  # noqa: E402
from bench.lib.generate_twin import make_twin  # noqa: E402


def build(torch, name, family, shape, args, cuda, device, dtype, trace=None):
    """The model `name` and its state, what is known of it, and the first
    raw H2D reading (CUDA only). `trace` (--trace-in): the model routes as
    it says (Note [Forced routing] in bench/lib/generate_trace.py), set up
    before the state is saved, so every row keeps it."""
    t_build = time.perf_counter()
    model = build_model(torch, family, shape, args.vocab, device, dtype)
    if trace is not None:
        force_routing(model, moe_blocks(model), ForcedRouting(trace, device, start=args.trace_from))
    state = ModelState(model)
    build_s = time.perf_counter() - t_build
    raw = [raw_h2d_gbps(torch, state.expert_bytes, torch.cuda.current_device(), count=32)] if cuda else []
    info = {"family": family, "shape": shape, "vocab": args.vocab, "dtype": str(dtype).replace("torch.", ""),
            "layers": state.num_layers, "experts": state.num_experts, "top_k": model.config.num_experts_per_tok,
            "expert_bytes": state.expert_bytes, "total_expert_bytes": state.total_bytes,
            "default_experts_implementation": state.impl, "build_s": build_s}
    print(f"{name}: expert {state.expert_bytes / 2**20:.2f} MiB, all experts {state.total_bytes / 2**30:.2f} GiB, "
          f"vocab {args.vocab}, default experts implementation {state.impl!r}, built in {build_s:.1f} s"
          + (f", raw H2D {raw[0]:.1f} GB/s" if raw else ""), file=sys.stderr, flush=True)
    return model, state, info, raw


def row_plan(args) -> list:
    """(row, share) in the order a block runs them: the share-free rows,
    then each share's rows, accelerate last (it is slow and its tokens are
    few)."""
    wanted = [r for r in ROWS if r in args.rows]
    plan = []
    for r in wanted:
        if r in SHARE_FREE_ROWS:
            plan.append((r, None))
    for share in args.shares:
        plan.extend((r, share) for r in SHARE_ROWS if r in wanted)
    plan.sort(key=lambda p: p[0] == "accelerate-cpu-offload")
    return plan


def run_model(torch, name, family, shape, args, cuda, device, dtype, started, rows, blocks, models_info,
              checkpoint=None, trace=None):
    """Every block of model `name`; `checkpoint(rows so far)`, if given, is
    called after each row (the rows not settled yet: no floors). `trace`:
    --trace-in's routing trace, which the model's routing then follows."""
    sync = make_sync(torch, cuda)
    model, state, info, raw = build(torch, name, family, shape, args, cuda, device, dtype, trace)
    models_info[name] = info
    model_rows = []
    for batch in args.batches:
        if trace is not None:
            model._forced_routing.set_batch(batch)  # before the twin is copied from the model
        block = Block(torch, model, state, batch, args, cuda, device, sync, name)
        # Note [Warm every sequence length]: the measured and TTFT shapes.
        warm_lengths(torch, model, [block.warm_prompt], args.new_tokens, sync)
        warm_lengths(torch, model, [block.warm_ttft_prompt], 1, sync)
        make_twin(block)  # Note [Paired generates]
        block_rows = []
        for row, share in row_plan(args):
            block_rows.append(run_planned_row(block, name, row, share, started))
            if checkpoint is not None:
                checkpoint(model_rows + block_rows)
        # Note [Two rows side by side] in bench/lib/generate_ab.py: uses up the twin, restores the model.
        ab = run_ab(block, name, args.ab_share, started) if args.ab else None
        blocks.append({**restore_check(block, name), **({"ab": ab} if ab is not None else {})})
        model_rows.extend(block_rows)
    if cuda:
        raw.append(raw_h2d_gbps(torch, state.expert_bytes, torch.cuda.current_device(), count=32))
    info["raw_h2d_gbps_runs"] = raw
    info["raw_h2d_gbps"] = max(raw) if raw else None
    by_block = {}
    for r in model_rows:
        by_block.setdefault(r["batch"], []).append(r)
    for batch, block_rows in by_block.items():
        block = next(b for b in blocks if b["model"] == name and b["batch"] == batch)
        settle(block_rows, block, info)
    explain_nulls(model_rows, cuda)
    rows.extend(model_rows)
    _HOST_EXPERTS.pop(model, None)  # its page-locked copy goes now, not at the next collection
    del model, state
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=None, help=f"of {list(MODELS)} (smoke: {list(SMOKE_MODELS)})")
    parser.add_argument("--batches", type=int, nargs="+", default=None)
    parser.add_argument("--shares", type=float, nargs="+", default=None)
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS),
                        help="resident always runs (every row is compared to it)")
    parser.add_argument("--new-tokens", type=int, default=None, help="measured tokens per row (default 64)")
    parser.add_argument("--warmup-tokens", type=int, default=None, help="tokens of the warm-up generate (default 8)")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="prompt length of the measured generate")
    parser.add_argument("--ttft-tokens", type=int, default=None, help="prompt length of the TTFT generate (512)")
    parser.add_argument("--accelerate-tokens", type=int, default=None, help="measured tokens of accelerate (4)")
    parser.add_argument("--vocab", type=int, default=None, help="vocab size (default 32000; the real ones are larger)")
    parser.add_argument("--mpl-capacity", choices=["memory", "slots"], default="memory",
                        help="moe-policylang capacity: budget slots // layers (same device bytes) or budget slots")
    parser.add_argument("--budget-s", type=float, default=None, help="start no row after this many seconds")
    parser.add_argument("--json")
    parser.add_argument("--plot", help="PNG of ms/token per row per share")
    parser.add_argument("--repeats", type=int, default=1,
                        help="measured generates per row, and resident generates right after it; x_adjacent is "
                             "the ratio of their medians, x_adjacent_best of their fastest (the host's speed "
                             "drifts over seconds)")
    parser.add_argument("--paired", type=int, default=0,
                        help="pairs of generates per row against a second resident copy of the model; x_paired is "
                             "the median of the pairs' ratios (Note [Paired generates] in bench/lib/generate_twin.py)")
    parser.add_argument("--paired-tokens", type=int, default=None, help="tokens of each paired generate "
                        "(default 32; smoke 4; accelerate's rows: --accelerate-tokens); a row takes about "
                        "2 x --paired x this x its ms per token more")
    parser.add_argument("--ab", nargs=2, metavar=("ROW_A", "ROW_B"), default=None,
                        help="after each block's rows, two engine rows side by side: the model offloaded as ROW_A, "
                             "the twin (--paired's resident copy, or with --park-resident-experts and no such copy a "
                             "lean one) as ROW_B, --ab-pairs pairs of generates alternating; the "
                             "block's 'ab' has the pairs and x_ab, the median A/B ratio (Note [Two rows side by "
                             "side] in bench/lib/generate_ab.py)")
    parser.add_argument("--ab-pairs", type=int, default=8, help="pairs of generates of --ab (default 8)")
    parser.add_argument("--ab-lockstep", type=int, default=0,
                        help="after --ab's alternating pairs, this many pairs in lockstep: the two sides' "
                             "generates in two threads taking turns a token at a time (Note [Lockstep pairs] in "
                             "bench/lib/generate_ab.py; default 0)")
    parser.add_argument("--ab-control", action="store_true",
                        help="before --ab's A/B, the same pairs with ROW_B on both sides (the model and the twin): "
                             "what the estimators give two sides doing the same work, in the block's "
                             "ab.control")
    parser.add_argument("--ab-swap", action="store_true",
                        help="after --ab's A/B, the same pairs with the rows on the other copies (ROW_B on the "
                             "model, ROW_A on the twin), in the block's ab.swapped, and both A/Bs' pairs "
                             "together in ab.pooled (Note [Two rows side by side] in bench/lib/generate_ab.py)")
    parser.add_argument("--ab-share", type=float, default=None,
                        help="the cache share of --ab's rows (default: the first of --shares)")
    parser.add_argument("--park-resident-experts", action="store_true",
                        help="engine rows free the resident model's expert weights on the device while they run "
                             "and copy them back from the packed host copy after (Note [Parked resident experts] "
                             "in bench/lib/generate_model.py): a cache of every expert then fits beside a second "
                             "resident copy (--paired) or a larger batch; without --paired's copy, --ab's second "
                             "side is a lean one (Note [A lean twin] in bench/lib/generate_ab.py)")
    parser.add_argument("--timer-sync", choices=["device", "stream"], default="device",
                        help="what the per-token clock waits for: every stream of the GPU (default; the engine's "
                             "background copies too) or the compute stream only (what a caller reading tokens "
                             "waits for)")
    parser.add_argument("--smoke-cpu", action="store_true",
                        help="tiny configs on the CPU in float32: checks the logic, measures nothing")
    parser.add_argument("--trace-in", metavar="TRACE.json",
                        help="route as this routing trace says (Note [Forced routing] in bench/lib/generate_trace.py): "
                             f"models from {list(TRACE_MODELS)} (smoke: smoke-qwen3-moe) with the trace's layer "
                             "and expert counts, top-k from its decode steps")
    parser.add_argument("--profile", metavar="DIR",
                        help="after each row's paired generates, one more generate under torch.profiler, its "
                             "decode steps only: Chrome traces and op tables in DIR, the row's 'profile' says "
                             "where the time went (bench/lib/generate_profile.py)")
    parser.add_argument("--profile-tokens", type=int, default=None,
                        help="tokens of the profiled generate (default 16; smoke 3)")
    parser.add_argument("--trace-from", type=int, default=1,
                        help="the trace's decode step that each generate's first decode token replays (default 1)")
    args = parser.parse_args(argv)

    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    smoke = args.smoke_cpu
    trace = None
    if args.trace_from != 1 and not args.trace_in:
        parser.error("--trace-from goes with --trace-in")
    if args.trace_in:
        from prefetch.integration import RoutingTrace

        try:
            trace = RoutingTrace.load(args.trace_in)
            ForcedRouting(trace, torch.device("cpu"), start=args.trace_from)  # refuses a bad trace or start
        except (OSError, ValueError, KeyError, TypeError) as e:
            parser.error(f"--trace-in {args.trace_in}: {e}")
        # trace_shape cannot refuse these: the counts match and ForcedRouting took the trace.
        table = {n: (family, trace_shape(shape, trace))
                 for n, (family, shape) in (SMOKE_MODELS if smoke else TRACE_MODELS).items()
                 if family in FORCED_FAMILIES and shape["num_hidden_layers"] == trace.num_layers
                 and shape["num_experts"] == trace.num_experts}
        if not table:
            parser.error(f"--trace-in {args.trace_in}: no model of this benchmark has its {trace.num_layers} layers "
                         f"of {trace.num_experts} experts (trace models: {list(TRACE_MODELS)}; smoke: "
                         f"smoke-qwen3-moe, 4 layers of 8)")
    else:
        table = SMOKE_MODELS if smoke else MODELS
    models = list(SMOKE_DEFAULT) if table is SMOKE_MODELS else list(table)
    defaults = dict(models=models, batches=[2] if smoke else [1, 8], shares=[0.5] if smoke
                    else [0.1, 0.25, 0.5], new_tokens=4 if smoke else 64, warmup_tokens=2 if smoke else 8,
                    prompt_tokens=8 if smoke else 32, ttft_tokens=32 if smoke else 512,
                    accelerate_tokens=3 if smoke else 4, vocab=128 if smoke else 32000,
                    budget_s=300 if smoke else 540, paired_tokens=4 if smoke else 32,
                    profile_tokens=3 if smoke else 16)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    unknown = [m for m in args.models if m not in table]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {list(table)}")
    if "resident" not in args.rows:
        args.rows = ["resident", *args.rows]
    if args.new_tokens < 2 or args.accelerate_tokens < 2:
        parser.error("--new-tokens and --accelerate-tokens must be >= 2 (the decode figure excludes the prefill)")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if any(b < 1 for b in args.batches):
        parser.error("--batches must be >= 1 each")
    if any(not 0 < s <= 1 for s in args.shares):
        parser.error("--shares must be in (0, 1] each (a share of all the experts' bytes)")
    if args.warmup_tokens < 1 or args.prompt_tokens < 1 or args.ttft_tokens < 1 or args.vocab < 2:
        parser.error("need --warmup-tokens, --prompt-tokens and --ttft-tokens >= 1 and --vocab >= 2")
    if args.ab is not None:
        try:
            ab_rows(args.ab)
        except ValueError as exc:
            parser.error(str(exc))
        if (args.paired < 1 and not args.park_resident_experts) or args.ab_pairs < 1 or args.ab_lockstep < 0:
            parser.error("--ab needs --paired >= 1 (its second side is the twin) or --park-resident-experts "
                         "(a lean twin), --ab-pairs >= 1 and --ab-lockstep >= 0")
        if args.ab_lockstep and args.timer_sync == "device" and not smoke:
            # Note [Lockstep pairs]: a device-wide wait would charge each side the other's copies.
            parser.error("--ab-lockstep needs --timer-sync stream (a device-wide wait would time each side "
                         "over the other side's copies too)")
        if args.ab_share is None:
            args.ab_share = args.shares[0]
        if not 0 < args.ab_share <= 1:
            parser.error(f"--ab-share must be in (0, 1], got {args.ab_share}")
    elif args.ab_control or args.ab_swap or args.ab_lockstep or args.ab_share is not None:
        parser.error("--ab-control, --ab-swap, --ab-lockstep and --ab-share go with --ab ROW_A ROW_B")
    if args.paired < 0 or args.paired_tokens < 2:
        parser.error("--paired must be >= 0 and --paired-tokens >= 2")
    if args.profile_tokens < 2:
        parser.error("--profile-tokens must be >= 2 (the profile covers decode steps only)")
    if trace is not None:
        if min(args.prompt_tokens, args.ttft_tokens) < 2:
            # Note [Forced routing]: a prefill is a call of more tokens than the batch.
            parser.error("--trace-in needs --prompt-tokens and --ttft-tokens >= 2")

    cuda = not smoke and torch.cuda.is_available()
    report = {"benchmark": "BM6 generate", "machine": machine_info(), "smoke_cpu": smoke,
              "config": {k: getattr(args, k) for k in ("models", "batches", "shares", "rows", "new_tokens",
                                                        "warmup_tokens", "prompt_tokens", "ttft_tokens",
                                                        "accelerate_tokens", "vocab", "mpl_capacity", "budget_s",
                                                        "timer_sync", "repeats", "paired", "paired_tokens",
                                                        "ab", "ab_pairs", "ab_lockstep", "ab_control", "ab_swap",
                                                        "ab_share", "trace_in", "trace_from", "profile",
                                                        "profile_tokens")},
              "transformers": transformers.__version__,
              "notes": [f"vocab reduced to {args.vocab} (the real models' are 50304 and 151936)",
                        "random weights; routing is the random model's, not a trained one's" if trace is None else
                        f"random weights; routing forced from {os.path.basename(args.trace_in)} (decode token i of "
                        f"each generate routes as its step {args.trace_from} + i; Note [Forced routing] in "
                        "bench/lib/generate_trace.py)"],
              "models": {}, "blocks": [], "rows": None}
    if not smoke and not cuda:
        print("BM6 needs a CUDA device (or --smoke-cpu): not measured", file=sys.stderr)
        if args.json:
            write_json(args.json, report)
        return 1
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    started = time.monotonic()
    rows = []
    torch.set_grad_enabled(False)

    def checkpoint(model_rows):
        # A run cut short (the device tool's time limit) keeps the rows done
        # so far: the JSON is rewritten after each row, "partial" until the end.
        if args.json:
            write_json(args.json, {**report, "rows": rows + model_rows, "partial": True,
                                   "wall_s": time.monotonic() - started})

    for name in args.models:
        family, shape = table[name]
        run_model(torch, name, family, shape, args, cuda, device, dtype, started, rows, report["blocks"],
                  report["models"], checkpoint, trace)
    report["rows"] = rows
    report["partial"] = False
    report["wall_s"] = time.monotonic() - started
    print(format_table(rows))
    if args.plot:
        why = plot(rows, args.plot)
        report["plot"] = args.plot if why is None else None
        if why:
            report["plot_reason"] = why
            print(f"plot not made: {why}", file=sys.stderr)
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
