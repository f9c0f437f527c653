"""Expert parallel over torch.distributed, on the CPU: two real processes
over gloo, each offloading its half of every layer's experts to its own host
-backend engine, tiny Qwen3-MoE and OLMoE models; greedy tokens must equal
the untouched single-process model's. A rank that fails or stops answering
must make the other fail within the group's timeout; the parent joins with a
deadline and kills what is left, so nothing here can hang CI.

Each scenario is one pair of spawned processes (python, torch and
transformers start in each: a few seconds); the scenarios that leave the
group usable share a pair."""
import copy
import multiprocessing as mp
import os
import time
import traceback
from datetime import timedelta

import numpy as np
import pytest
import torch

from prefetch.expert_parallel import activation_counts, partition_experts
from prefetch.hf import offloaded_experts
from prefetch.trace import RoutingTrace

transformers = pytest.importorskip("transformers")

from conftest import CountingHandle  # noqa: E402
from test_integration import build, expert_bytes, family_configs, greedy  # noqa: E402

WORLD = 2
JOIN_S = 90  # the parent's deadline for a pair of ranks; scenarios take a few seconds
FAMILIES = ("qwen3_moe", "olmoe", "gpt_oss")
IMPLS = ("eager", "grouped_mm", "batched_mm")
BATCHES = (1, 2)
CHECKPOINT_ENV = "PREFETCH_TEST_EP_CHECKPOINT"  # the OLMoE checkpoint folder the "tokens" ranks read
SKEWED = np.array([[9, 1, 8, 2, 7, 3, 6, 4]] * 3)  # activation counts for the "activations" placement


def prompt(cfg, batch):
    return torch.randint(0, cfg.vocab_size, (batch, 6), generator=torch.Generator().manual_seed(10 + batch))


def slots_budget(model, slots):
    per, _ = expert_bytes(model)
    return slots * (per + 512)


def top4_config():
    cfg = copy.deepcopy(family_configs()["qwen3_moe"])
    cfg.num_experts_per_tok = 4
    return cfg


# -- what each rank runs (module level: spawned processes import this file)


def _offload(model, group, slots, **kw):
    import prefetch

    # preload=False: the poison below overwrites the whole arena, so it
    # must come before any copy (a preloaded expert it overwrote came out
    # as NaN logits, in CI on a715938).
    ctl = prefetch.offload_moe_experts(model, device_budget_bytes=slots_budget(model, slots), backend="host",
                                       process_group=group, preload=False, **kw)
    # Every slot NaN until a copy fills it (0xFF bytes): a computation that
    # reads a slot it did not acquire, even times a zero routing weight,
    # shows up as NaN logits instead of passing by luck (a batched_mm rank
    # once read its last, never written slot for other ranks' experts).
    ctl.handle._debug_fill_cache(0xFF)
    return ctl


def _catch(fn):
    try:
        fn().close()
    except Exception as exc:  # the scenario records what each rank raised
        return (type(exc).__name__, str(exc))
    return None


def scenario_tokens_and_errors(rank, group):
    from prefetch.integration import NextLayerGatePredictor

    out = {"errors": {}, "runs": {}, "top4": {}}
    # Bad input first: every case fails on both ranks at offload's one
    # all_gather, so the group stays usable.
    cfg = family_configs()["qwen3_moe"]
    other = build(cfg)
    if rank == 1:
        with torch.no_grad():
            for p in other.parameters():
                p.add_(0.01)  # another checkpoint: same shapes, other weights
    out["errors"]["mismatch"] = _catch(lambda: _offload(other, group, 3))
    out["errors"]["placement differs"] = _catch(lambda: _offload(
        build(cfg), group, 3, expert_placement="activations", activation_counts=np.roll(SKEWED, rank, axis=1)))
    out["errors"]["bad counts on rank 1"] = _catch(lambda: _offload(
        build(cfg), group, 3, expert_placement="activations", activation_counts=SKEWED if rank == 0 else SKEWED[:1]))
    one = transformers.MixtralConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=48, num_local_experts=1,
                                     num_experts_per_tok=1)
    out["errors"]["one expert"] = _catch(lambda: _offload(build(one), group, 3))

    for family in FAMILIES:
        cfg = family_configs()[family]
        for impl in IMPLS:
            for batch in BATCHES:
                model = build(cfg, experts_implementation=impl)
                predictor = NextLayerGatePredictor() if impl != "eager" else None
                placement = {"expert_placement": "activations", "activation_counts": SKEWED} if batch == 2 else {}
                # 3 slots for this rank's 4 experts x 3 layers: evictions every
                # step, and the prompt's layers run in pieces.
                ctl = _offload(model, group, 3, predictor=predictor, **placement)
                try:
                    seq, _ = greedy(model, prompt(cfg, batch))
                    s = ctl.handle.stats()
                    out["runs"][(family, impl, batch)] = {
                        "seq": seq, "registered": s["registered"], "evictions": s["evictions"],
                        "pinned": s["pinned_count"], "local": ctl.expert_parallel.local.copy(),
                        "report": ctl.report()}
                finally:
                    ctl.close()
    # Top-4 in bfloat16: a rank's partial sum of its experts, all-reduced,
    # would round differently from one process's sum over the four; the
    # per-(token, k) outputs are all-reduced instead (Note [Expert
    # parallel]), and logits must be bit-equal. 8 slots: no pieces.
    # batched_mm decodes sync-free (forced, and the default per-step choice,
    # each rank its own): its experts read from the cache or host memory.
    for impl, sync_free in (("batched_mm", True), ("batched_mm", None), ("batched_mm", False),
                            ("grouped_mm", None)):
        model = build(top4_config(), dtype=torch.bfloat16, experts_implementation=impl)
        ctl = _offload(model, group, 8, sync_free=sync_free)
        try:
            seq, logits = greedy(model, prompt(model.config, 2), steps=6)
            ep = ctl.expert_parallel
            out["top4"][(impl, sync_free)] = {"seq": seq, "logits": logits, "sync_free": ctl.sync_free,
                                              "report": ctl.report(), "rows": (ep.rows_routed, ep.rows_computed)}
        finally:
            ctl.close()
    # Note [Steady pins] over a rank's slice: with room for all of its
    # experts, a second request decodes with one pin call a step, the pins
    # written back into the rows of the experts this rank owns.
    model = build(top4_config(), dtype=torch.bfloat16, experts_implementation="batched_mm")
    ctl = _offload(model, group, 16, sync_free=True)
    try:
        greedy(model, prompt(model.config, 2), steps=6)
        before = ctl.steady_steps
        seq, logits = greedy(model, prompt(model.config, 2), steps=6)
        out["steady"] = {"seq": seq, "logits": logits, "steady_steps": ctl.steady_steps - before,
                         "pinned": ctl.handle.stats()["pinned_count"]}
    finally:
        ctl.close()
    # Note [Preload] over a rank's slice: room for all of its experts, so
    # each rank queues its own at offload (no poison: it would overwrite
    # them), and the first request decodes on them.
    import prefetch

    model = build(top4_config(), dtype=torch.bfloat16, experts_implementation="batched_mm")
    ctl = prefetch.offload_moe_experts(model, device_budget_bytes=slots_budget(model, 16), backend="host",
                                       process_group=group)
    try:
        seq, logits = greedy(model, prompt(model.config, 2), steps=6)
        out["preload"] = {"seq": seq, "logits": logits, "preloaded": ctl.report()["preloaded"],
                          "registered": sum(1 for _ in ctl.prefetcher.registered_experts())}
    finally:
        ctl.close()
    # The oracle's next-use hints on sync-free steps: only this rank's
    # experts reach its engine (the others are not registered here).
    from prefetch.integration import OraclePredictor
    model = build(top4_config(), dtype=torch.bfloat16, experts_implementation="batched_mm")
    ctl = _offload(model, group, 8, sync_free=True, record_trace=True)
    try:
        greedy(model, prompt(model.config, 2), steps=6)
        trace = ctl.trace
    finally:
        ctl.close()
    model = build(top4_config(), dtype=torch.bfloat16, experts_implementation="batched_mm")
    ctl = _offload(model, group, 8, sync_free=True, predictor=OraclePredictor(trace),
                   handle_options={"eviction_policy": "next-use"})
    try:
        out["oracle_seq"], _ = greedy(model, prompt(model.config, 2), steps=6)
    finally:
        ctl.close()
    # Experts from the checkpoint the parent wrote (CHECKPOINT_ENV), the
    # model's experts on the meta device: each rank reads and holds only its
    # own slice.
    from test_checkpoint_experts import experts_on_meta

    cfg = family_configs()["olmoe"]
    model = experts_on_meta(build(cfg, experts_implementation="batched_mm"))
    ctl = _offload(model, group, 3, checkpoint=os.environ[CHECKPOINT_ENV])
    try:
        seq, _ = greedy(model, prompt(cfg, 2))
        host = ctl.host_experts
        out["checkpoint"] = {"seq": seq, "host_bytes": host.buffer.numel(), "stride": host.stride,
                             "local": ctl.expert_parallel.local.copy()}
    finally:
        ctl.close()
    # The same with the experts left on disk (Note [Experts on disk]): each
    # rank registers and reads only its slice, through a host tier of 2.
    model = experts_on_meta(build(cfg, experts_implementation="batched_mm"))
    ctl = _offload(model, group, 3, checkpoint=os.environ[CHECKPOINT_ENV],
                   host_budget_bytes=2 * 3 * (-(-out["checkpoint"]["stride"] // 4096) + 2) * 4096)
    try:
        seq, _ = greedy(model, prompt(cfg, 2))
        s = ctl.handle.stats()
        out["on_disk"] = {"seq": seq, "registered": s["registered"], "disk_reads": s["disk_reads"],
                          "host_experts": ctl.host_experts, "local": ctl.expert_parallel.local.copy()}
    finally:
        ctl.close()
    # One engine call per layer and rank: a slice's worth of slots, no pieces.
    cfg = family_configs()["qwen3_moe"]
    model = build(cfg, experts_implementation="grouped_mm")
    ctl = _offload(model, group, 5, predictor=NextLayerGatePredictor())
    real = ctl.handle
    ctl.handle = CountingHandle(real)
    calls = ctl.handle.calls
    try:
        seq, _ = greedy(model, prompt(cfg, 1), steps=3)
        out["calls"] = dict(calls)
        out["calls_seq"] = seq
    finally:
        ctl.handle = real
        ctl.close()
    return out


def scenario_rank_fails(rank, group):
    """Rank 1 raises inside its second decoder layer, before that layer's
    all-reduce: rank 0 must raise from the collective, not wait for ever."""
    cfg = family_configs()["olmoe"]
    model = build(cfg, experts_implementation="grouped_mm")
    ctl = _offload(model, group, 4)
    if rank == 1:
        def boom(*_):
            raise RuntimeError("injected failure on rank 1")
        model.model.layers[1].register_forward_pre_hook(boom)
    try:
        greedy(model, prompt(cfg, 1))
    finally:
        ctl.close()


def scenario_rank_hangs(rank, group):
    """Rank 1 offloads, then never runs the model: rank 0's first all-reduce
    must time out (the group's timeout) and raise."""
    cfg = family_configs()["qwen3_moe"]
    model = build(cfg)
    ctl = _offload(model, group, 4)
    if rank == 1:
        time.sleep(600)  # the parent kills it
    try:
        greedy(model, prompt(cfg, 1))
    finally:
        ctl.close()


SCENARIOS = {"tokens": scenario_tokens_and_errors, "fails": scenario_rank_fails, "hangs": scenario_rank_hangs}


def _rank_main(rank, scenario, init_file, result_dir, timeout_s):
    import torch.distributed as dist

    torch.set_num_threads(1)
    result = {}
    code = 0
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                                timeout=timedelta(seconds=timeout_s))
        result["value"] = SCENARIOS[scenario](rank, dist.group.WORLD)
    except BaseException as exc:
        result["error"] = (type(exc).__name__, str(exc), traceback.format_exc())
        code = 1
    torch.save(result, os.path.join(result_dir, f"rank{rank}.pt"))
    os._exit(code)  # no atexit teardown of a group whose peer may be gone


def run_ranks(tmp_path, scenario, timeout_s=30):
    """Runs `scenario` on two spawned ranks; returns ({rank: result},
    {rank: exit code}, seconds). Ranks still alive at the deadline are
    killed (their exit code is then negative)."""
    ctx = mp.get_context("spawn")
    init_file = tmp_path / "store"
    procs = [ctx.Process(target=_rank_main, args=(r, scenario, str(init_file), str(tmp_path), timeout_s))
             for r in range(WORLD)]
    start = time.monotonic()
    for p in procs:
        p.start()
    deadline = start + JOIN_S
    first_failure = None
    try:
        # Wait for every rank, but once one has failed give the others only
        # the group's timeout (plus slack) to notice, then kill them.
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if first_failure is None and any(p.exitcode not in (None, 0) for p in procs):
                first_failure = time.monotonic()
                deadline = min(deadline, first_failure + timeout_s + 3)
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
    results = {}
    for r in range(WORLD):
        path = tmp_path / f"rank{r}.pt"
        if path.exists():
            results[r] = torch.load(path, weights_only=False)
    return results, [p.exitcode for p in procs], time.monotonic() - start


def test_placement_tables():
    table = partition_experts(3, 8, 2)
    assert (table == np.repeat([0, 1], 4)).all()
    assert [list(np.bincount(row)) for row in partition_experts(2, 10, 4)] == [[3, 3, 2, 2]] * 2
    act = partition_experts(3, 8, 2, "activations", SKEWED)
    assert [np.bincount(row).tolist() for row in act] == [[4, 4]] * 3  # bytes stay balanced
    loads = [SKEWED[0][act[0] == r].sum() for r in range(2)]
    assert loads == [20, 20]  # 9 8 7 6 | 1 2 3 4 in blocks would be 30 | 10
    trace = RoutingTrace(3, 8, [[[0, 1], [2], [7]], [[0], [2, 3], [7]]])
    counts = activation_counts(trace)
    assert counts[0].tolist() == [2, 1, 0, 0, 0, 0, 0, 0] and counts[2, 7] == 2
    assert (partition_experts(3, 8, 2, "activations", trace) == partition_experts(3, 8, 2, "activations",
                                                                                   counts)).all()
    with pytest.raises(ValueError, match="at least 3 experts"):
        partition_experts(3, 2, 3)
    with pytest.raises(ValueError, match="expert_placement"):
        partition_experts(3, 8, 2, "random")
    with pytest.raises(ValueError, match="needs activation_counts"):
        partition_experts(3, 8, 2, "activations")
    with pytest.raises(ValueError, match="shape"):
        partition_experts(3, 8, 2, "activations", SKEWED[:1])
    with pytest.raises(ValueError, match="non-negative"):
        partition_experts(3, 8, 2, "activations", -SKEWED)
    with pytest.raises(ValueError, match="4 layers"):
        partition_experts(3, 8, 2, "activations", RoutingTrace(4, 8))


def test_placement_options_need_a_group():
    import prefetch

    model = build(family_configs()["olmoe"])
    with pytest.raises(ValueError, match="need a process_group"):
        prefetch.offload_moe_experts(model, device_budget_bytes=1 << 20, backend="host",
                                     expert_placement="activations", activation_counts=SKEWED)
    with pytest.raises(RuntimeError, match="not initialised"):
        prefetch.offload_moe_experts(model, device_budget_bytes=1 << 20, backend="host", process_group=object())
    assert not offloaded_experts(model)


def test_two_ranks_match_one_process(tmp_path, monkeypatch):
    build(family_configs()["olmoe"], experts_implementation="batched_mm").save_pretrained(tmp_path / "ckpt")
    monkeypatch.setenv(CHECKPOINT_ENV, str(tmp_path / "ckpt"))  # spawned ranks inherit it
    results, codes, _ = run_ranks(tmp_path, "tokens")
    for r in range(WORLD):
        assert "error" not in results.get(r, {"error": "no result"}), results[r]["error"][2]
    assert codes == [0, 0]
    got = [results[r]["value"] for r in range(WORLD)]

    errors = [g["errors"] for g in got]
    for r in range(WORLD):
        assert errors[r]["mismatch"][0] == "InvalidArgumentError" and "routers" in errors[r]["mismatch"][1]
        assert errors[r]["placement differs"][0] == "InvalidArgumentError"
        assert "placement" in errors[r]["placement differs"][1]
        assert errors[r]["one expert"][0] == "InvalidArgumentError"
        assert "at least 2 experts" in errors[r]["one expert"][1]
    assert errors[1]["bad counts on rank 1"][0] == "InvalidArgumentError"
    assert errors[0]["bad counts on rank 1"][0] == "RuntimeError"
    assert "rank(s) [1]" in errors[0]["bad counts on rank 1"][1]

    for family in FAMILIES:
        cfg = family_configs()[family]
        for impl in IMPLS:
            ref = build(cfg, experts_implementation=impl)
            for batch in BATCHES:
                seq_ref, _ = greedy(copy.deepcopy(ref), prompt(cfg, batch))
                runs = [g["runs"][(family, impl, batch)] for g in got]
                for r, run in enumerate(runs):
                    assert torch.equal(run["seq"], seq_ref), (family, impl, batch, r)
                    # Only its own share: 4 of 8 experts in each layer.
                    assert run["registered"] == run["local"].sum() == cfg.num_hidden_layers * 4
                    assert run["evictions"] > 0 and run["pinned"] == 0
                # The two ranks' shares are disjoint and cover every expert.
                assert (runs[0]["local"] ^ runs[1]["local"]).all()
                if batch == 2:  # "activations" placement: not the contiguous blocks
                    assert not (runs[0]["local"][:, :4]).all()
                # The gate guesses on synced steps only, and each rank picks a
                # step's path from its own cache's misses: where the ranks took
                # the same paths they scored the same guesses.
                same_paths = runs[0]["report"]["sync_free_steps"] == runs[1]["report"]["sync_free_steps"]
                if impl != "eager" and same_paths:
                    assert runs[0]["report"]["prediction_recall"] == runs[1]["report"]["prediction_recall"], (
                        family, impl, batch)

    refs = {}
    for impl in ("batched_mm", "grouped_mm"):
        ref = build(top4_config(), dtype=torch.bfloat16, experts_implementation=impl)
        refs[impl] = greedy(ref, prompt(ref.config, 2), steps=6)
    for g in got:
        for (impl, sync_free), run in g["top4"].items():
            seq_ref, logits_ref = refs[impl]
            assert torch.equal(run["seq"], seq_ref), (impl, sync_free)
            for a, b in zip(run["logits"], logits_ref):
                assert torch.equal(a, b), (impl, sync_free)
            assert run["sync_free"] is (sync_free is not False)
            if impl == "grouped_mm":  # needs the routing on the host: never read from host memory
                assert run["report"]["zero_copy_reads"] == 0
        assert torch.equal(g["oracle_seq"], refs["batched_mm"][0])
        steady = g["steady"]
        assert torch.equal(steady["seq"], refs["batched_mm"][0])
        for a, b in zip(steady["logits"], refs["batched_mm"][1]):
            assert torch.equal(a, b)
        assert steady["steady_steps"] > 0 and steady["pinned"] == 0
        pre = g["preload"]
        assert pre["preloaded"] == pre["registered"] > 0  # this rank's experts, all of them
        assert torch.equal(pre["seq"], refs["batched_mm"][0])
        assert all(torch.equal(a, b) for a, b in zip(pre["logits"], refs["batched_mm"][1]))
        # Synced batched_mm computes only this rank's (token, k) pairs: the
        # ranks split every layer's rows between them. Sync-free, the
        # routing is not on the host: every rank computes every row.
        routed, computed = g["top4"][("batched_mm", False)]["rows"]
        assert 0 < computed < routed
        forced_rows = g["top4"][("batched_mm", True)]["rows"]
        assert forced_rows[0] == forced_rows[1] > 0
        forced = g["top4"][("batched_mm", True)]["report"]
        # Read from host memory on the first steps (8 slots for this rank's
        # 12 experts), and only this rank's experts count.
        assert forced["zero_copy_reads"] > 0 and forced["path_switches"] == 0

    synced = [g["top4"][("batched_mm", False)]["rows"] for g in got]
    assert synced[0][0] == synced[1][0] and synced[0][1] + synced[1][1] == synced[0][0]

    cfg = family_configs()["olmoe"]
    seq_ref, _ = greedy(build(cfg, experts_implementation="batched_mm"), prompt(cfg, 2))
    for g in got:  # experts read from the checkpoint: each rank's host copy holds its own slice only
        ckpt = g["checkpoint"]
        assert torch.equal(ckpt["seq"], seq_ref)
        assert ckpt["host_bytes"] == ckpt["local"].sum() * ckpt["stride"] == 3 * 4 * ckpt["stride"]
        disk = g["on_disk"]  # experts on disk: the same tokens, this rank's slice registered and read
        assert torch.equal(disk["seq"], seq_ref) and disk["host_experts"] is None
        assert disk["registered"] == disk["local"].sum() == 3 * 4 and disk["disk_reads"] > 0

    cfg = family_configs()["qwen3_moe"]
    seq_ref, _ = greedy(build(cfg, experts_implementation="grouped_mm"), prompt(cfg, 1), steps=3)
    for g in got:
        assert torch.equal(g["calls_seq"], seq_ref)
        forwards = 3
        # One step per layer; the last layer releases what it holds (nothing
        # when none of its routed experts is this rank's).
        assert g["calls"]["exchange"] == forwards * cfg.num_hidden_layers and g["calls"]["other"] == 0
        assert 1 <= g["calls"]["release"] <= forwards


def test_a_failing_rank_fails_the_other(tmp_path):
    results, codes, _ = run_ranks(tmp_path, "fails")
    assert codes == [1, 1]
    assert "injected failure on rank 1" in results[1]["error"][1]
    name, message, _ = results[0]["error"]
    assert name in ("RuntimeError", "DistBackendError"), message


def test_a_silent_rank_times_out(tmp_path):
    results, codes, _ = run_ranks(tmp_path, "hangs", timeout_s=4)
    assert codes[0] == 1 and codes[1] != 0  # rank 1 was killed by the parent
    name, message, _ = results[0]["error"]
    assert name in ("RuntimeError", "DistBackendError"), message
    assert 1 not in results
