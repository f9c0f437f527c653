"""offload_moe_experts(..., checkpoint=folder): a transformers model's experts
read from its own safetensors checkpoint (written by save_pretrained, the
per-expert format HF checkpoints ship) into the packed host copy, the
model's expert weights left on the meta device. Greedy tokens and logits
must equal the untouched model's; a checkpoint that does not fit the model
is refused before anything changes."""
from __future__ import annotations

import copy
import os

import pytest
import torch

import prefetch
from prefetch.checkpoint import INDEX_FILE, index_checkpoint
from prefetch.hf_blocks import ExpertsLayout
from prefetch.integration import find_hf_moe_blocks, offload_moe_experts

pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from test_integration import assert_same_decode, build, expert_bytes, family_configs, greedy  # noqa: E402


def experts_on_meta(model):
    """The model's expert weights replaced by meta tensors of the same shape
    (nothing to read: an offload that touched them would fail)."""
    for _, experts, _ in find_hf_moe_blocks(model):
        for name in ExpertsLayout(experts).names:
            old = getattr(experts, name)
            setattr(experts, name, torch.nn.Parameter(torch.empty(old.shape, dtype=old.dtype, device="meta"),
                                                      requires_grad=False))
    return model


def saved(model, folder):
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("family,impl", [("qwen3_moe", "grouped_mm"), ("olmoe", "batched_mm"),
                                         ("mixtral", "eager"), ("gpt_oss", "grouped_mm"), ("gpt_oss", "eager")])
def test_experts_from_the_checkpoint_give_the_models_tokens(family, impl, tmp_path):
    ref = build(family_configs()[family], experts_implementation=impl)
    folder = saved(ref, tmp_path / "ckpt")
    model = experts_on_meta(copy.deepcopy(ref))
    per, num_experts = expert_bytes(ref)
    # a layer's experts and a few more (a smaller cache runs a layer in
    # pieces: the same tokens, logits rounded otherwise by the eager loop)
    ctl = offload_moe_experts(model, device_budget_bytes=(num_experts + 3) * (per + 512), backend="host",
                              checkpoint=folder)
    try:
        ids = torch.randint(0, ref.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(3))
        assert_same_decode(ref, model, ids)
        # the packed copy holds the modules' bytes, expert by expert
        host = ctl.host_experts
        _, experts, _ = find_hf_moe_blocks(ref)[-1]
        layer = len(find_hf_moe_blocks(ref)) - 1
        for part in host.layout:
            packed = host.expert(layer, 1)[part.offset : part.offset + part.nbytes].view(part.dtype)
            assert torch.equal(packed.view(part.shape), getattr(experts, part.name)[1].detach()), part.name
    finally:
        ctl.close()


def test_sharded_checkpoint_index_and_real_expert_weights(tmp_path):
    ref = build(family_configs()["olmoe"])
    ref.save_pretrained(tmp_path / "ckpt", max_shard_size="40KB")  # several shards and their index file
    assert len([p for p in os.listdir(tmp_path / "ckpt") if p.endswith(".safetensors")]) > 2
    index = index_checkpoint(tmp_path / "ckpt")
    model = copy.deepcopy(ref)  # real expert weights this time: they are not read either
    per, _ = expert_bytes(ref)
    ctl = offload_moe_experts(model, device_budget_bytes=4 * (per + 512), backend="host", checkpoint=index)
    try:
        ids = torch.randint(0, ref.config.vocab_size, (1, 4), generator=torch.Generator().manual_seed(4))
        assert torch.equal(greedy(model, ids)[0], greedy(ref, ids)[0])
    finally:
        ctl.close()


def _refused(model, checkpoint, match, per):
    before = [(e.gate_up_proj.shape, e.gate_up_proj.device) for _, e, _ in find_hf_moe_blocks(model)]
    with pytest.raises(prefetch.CheckpointError, match=match):
        offload_moe_experts(model, device_budget_bytes=3 * (per + 512), backend="host", checkpoint=checkpoint)
    # nothing changed: the model is not offloaded and its experts are as they were
    assert not prefetch.integration.offloaded_experts(model)
    assert [(e.gate_up_proj.shape, e.gate_up_proj.device) for _, e, _ in find_hf_moe_blocks(model)] == before


def checkpoint_variants(ref, tmp_path):
    """`ref`'s one-shard checkpoint (folder, shard name, its tensors) and a
    maker of folders holding an altered copy of those tensors."""
    folder = saved(ref, tmp_path / "ok")
    shard = next(p for p in os.listdir(folder) if p.endswith(".safetensors"))
    on_disk = safetensors_torch.load_file(os.path.join(folder, shard))

    def variant(name, change):
        d = tmp_path / name
        d.mkdir()
        tensors = dict(on_disk)
        change(tensors)
        safetensors_torch.save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        return d

    return folder, shard, on_disk, variant


def test_a_checkpoint_that_does_not_fit_is_refused(tmp_path):
    ref = build(family_configs()["qwen3_moe"])
    per, _ = expert_bytes(ref)
    folder, shard, on_disk, variant = checkpoint_variants(ref, tmp_path)
    assert "model.layers.1.mlp.experts.2.up_proj.weight" in on_disk

    missing = variant("missing", lambda t: t.pop("model.layers.1.mlp.experts.2.up_proj.weight"))
    _refused(experts_on_meta(copy.deepcopy(ref)), missing, r"experts\.2\.up_proj\.weight' is not in", per)
    half = variant("bf16", lambda t: t.update({k: v.to(torch.bfloat16) for k, v in t.items() if "experts" in k}))
    _refused(experts_on_meta(copy.deepcopy(ref)), half, r"is BF16 .* needs F32", per)
    down = "model.layers.0.mlp.experts.0.down_proj.weight"
    shape = variant("shape", lambda t: t.update({down: t[down][:, :-1].contiguous()}))
    _refused(experts_on_meta(copy.deepcopy(ref)), shape, r"down_proj\.weight' in .* needs F32", per)
    # a shard rewritten after it was indexed
    index = index_checkpoint(folder)
    path = os.path.join(folder, shard)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    _refused(experts_on_meta(copy.deepcopy(ref)), index, "changed since the checkpoint was indexed", per)
    # a shard removed after it was indexed: the read fails with the OS's error
    os.remove(path)
    with pytest.raises(prefetch.DiskReadError, match="No such file"):
        offload_moe_experts(experts_on_meta(copy.deepcopy(ref)), device_budget_bytes=3 * (per + 512),
                            backend="host", checkpoint=index)
    # no expert tensors at all (another model's checkpoint)
    other = variant("other", lambda t: [t.pop(k) for k in list(t) if "experts" in k])
    _refused(experts_on_meta(copy.deepcopy(ref)), other, "no expert tensor", per)


def test_checkpoint_is_not_taken_with_host_experts(tmp_path):
    ref = build(family_configs()["olmoe"])
    per, _ = expert_bytes(ref)
    folder = saved(ref, tmp_path / "ckpt")
    first = copy.deepcopy(ref)
    ctl = offload_moe_experts(first, device_budget_bytes=3 * (per + 512), backend="host")
    try:
        with pytest.raises(ValueError, match="not with host_experts"):
            offload_moe_experts(copy.deepcopy(ref), device_budget_bytes=3 * (per + 512), backend="host",
                                checkpoint=folder, host_experts=ctl.host_experts)
    finally:
        ctl.close()


def test_a_model_without_any_real_weight_in_its_moe_layer_is_refused(tmp_path):
    ref = build(family_configs()["olmoe"])
    per, _ = expert_bytes(ref)
    folder = saved(ref, tmp_path / "ckpt")
    model = experts_on_meta(copy.deepcopy(ref))
    router = find_hf_moe_blocks(model)[0][2]
    router.weight = torch.nn.Parameter(torch.empty(router.weight.shape, device="meta"), requires_grad=False)
    with pytest.raises(ValueError, match="on the meta device"):
        offload_moe_experts(model, device_budget_bytes=3 * (per + 512), backend="host", checkpoint=folder)
    assert not prefetch.integration.offloaded_experts(model)


@pytest.mark.gpu
def test_experts_from_the_checkpoint_on_the_gpu_bf16(tmp_path):
    # The CUDA backend: the host copy read from disk is page-locked after the
    # reads and the sync-free decode reads it over PCIe; bf16 as served.
    ref = build(family_configs()["qwen3_moe"], device="cuda", dtype=torch.bfloat16,
                experts_implementation="batched_mm")
    folder = saved(ref, tmp_path / "ckpt")
    model = experts_on_meta(copy.deepcopy(ref))
    per, num_experts = expert_bytes(ref)
    ctl = offload_moe_experts(model, device_budget_bytes=(num_experts + 3) * (per + 512), checkpoint=folder)
    try:
        assert ctl.handle.backend == "cuda" and ctl.host_experts.pinned
        ids = torch.randint(0, ref.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(3)).cuda()
        assert_same_decode(ref, model, ids)
    finally:
        ctl.close()


@pytest.mark.parametrize("family,impl", [("qwen3_moe", "grouped_mm"), ("olmoe", "batched_mm"),
                                         ("mixtral", "eager"), ("gpt_oss", "batched_mm")])
def test_experts_left_on_disk_give_the_models_tokens(family, impl, tmp_path):
    # Note [Experts on disk]: with host_budget_bytes nothing is packed; the
    # engine reads each expert from the shards through a host tier that holds
    # 4 of them (far fewer than the model's), so experts are read again and
    # again, and the tokens and logits still equal the untouched model's.
    ref = build(family_configs()[family], experts_implementation=impl)
    ref.save_pretrained(tmp_path / "ckpt", max_shard_size="40KB")  # experts spread over several shards
    model = experts_on_meta(copy.deepcopy(ref))
    per, num_experts = expert_bytes(ref)
    layers = len(find_hf_moe_blocks(ref))
    stage = 4 * (-(-per // 4096) + 2) * 4096  # an expert's extents (3 or 4), each page-aligned with a lead
    ctl = offload_moe_experts(model, device_budget_bytes=(num_experts + 3) * (per + 512), backend="host",
                              checkpoint=tmp_path / "ckpt", host_budget_bytes=4 * stage)
    try:
        assert ctl.host_experts is None and ctl.sync_free is False
        ids = torch.randint(0, ref.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(3))
        assert_same_decode(ref, model, ids)
        s = ctl.handle.stats()
        assert s["registered"] == layers * num_experts and s["disk_reads"] > layers * num_experts
        assert s["host_tier_evictions"] > 0 and s["host_tier_used_bytes"] <= s["host_tier_budget_bytes"]
        assert s["disk_errors"] == 0
    finally:
        ctl.close()


def test_experts_on_disk_options_are_checked(tmp_path):
    ref = build(family_configs()["olmoe"], experts_implementation="batched_mm")
    folder = saved(ref, tmp_path / "ckpt")
    per, num_experts = expert_bytes(ref)
    with pytest.raises(ValueError, match="needs checkpoint="):
        offload_moe_experts(copy.deepcopy(ref), device_budget_bytes=(num_experts + 3) * (per + 512),
                            backend="host", host_budget_bytes=1 << 20)
    with pytest.raises(ValueError, match="sync_free=True"):
        offload_moe_experts(experts_on_meta(copy.deepcopy(ref)), device_budget_bytes=(num_experts + 3) * (per + 512),
                            backend="host", checkpoint=folder, host_budget_bytes=1 << 20, sync_free=True)
    with pytest.raises(ValueError, match="of the host tier"):  # smaller than one expert's extents
        offload_moe_experts(experts_on_meta(copy.deepcopy(ref)), device_budget_bytes=(num_experts + 3) * (per + 512),
                            backend="host", checkpoint=folder, host_budget_bytes=8192)


@pytest.mark.gpu
def test_experts_left_on_disk_on_the_gpu(tmp_path):
    # Note [Experts on disk] on the CUDA backend: the shards read through a
    # page-locked host tier of 4 experts into the device cache; float32 so
    # that compute-sanitizer's initcheck runs it too (tox -e gpu-csan).
    ref = build(family_configs()["olmoe"], device="cuda", experts_implementation="batched_mm")
    ref.save_pretrained(tmp_path / "ckpt", max_shard_size="40KB")
    model = experts_on_meta(copy.deepcopy(ref))
    per, num_experts = expert_bytes(ref)
    stage = 3 * (-(-per // 4096) + 2) * 4096
    ctl = offload_moe_experts(model, device_budget_bytes=(num_experts + 3) * (per + 512),
                              checkpoint=tmp_path / "ckpt", host_budget_bytes=4 * stage)
    try:
        assert ctl.handle.backend == "cuda" and ctl.host_experts is None
        ids = torch.randint(0, ref.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(3)).cuda()
        assert_same_decode(ref, model, ids)
        s = ctl.handle.stats()
        assert s["disk_errors"] == 0 and s["copy_errors"] == 0
        assert s["host_tier_evictions"] > 0 and s["host_tier_used_bytes"] <= 4 * stage
    finally:
        ctl.close()


def test_a_shard_replaced_before_the_engine_opens_it_is_refused(tmp_path):
    # register_from_disk checked each shard with os.stat and then opened it:
    # a shard replaced between the two passed, and the engine (which checks
    # against the file it opened) served bytes the index never described.
    # Now the opened file itself is checked. The replacement is made inside
    # open_file, the moment the race needed.
    import json
    import struct
    import time

    import numpy as np

    from prefetch.checkpoint_experts import register_from_disk
    from prefetch.errors import CheckpointError
    from prefetch.expert_prefetcher import ExpertPrefetcher

    inter, hidden = 4, 8
    names = ("gate_proj", "up_proj", "down_proj")

    def shard(path, fill):
        header, blobs, pos = {}, [], 0
        for name, shape in zip(names, ([inter, hidden], [inter, hidden], [hidden, inter])):
            data = np.full(shape, fill, np.float32).tobytes()
            header[f"model.layers.0.mlp.experts.0.{name}.weight"] = {"dtype": "F32", "shape": shape,
                                                                      "data_offsets": [pos, pos + len(data)]}
            blobs.append(data)
            pos += len(data)
        head = json.dumps(header).encode()
        path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))

    path = tmp_path / "model.safetensors"
    shard(path, 1.0)
    index = index_checkpoint(tmp_path)
    time.sleep(0.01)  # the replacement gets another mtime

    handle = prefetch.PrefetchHandle(device_budget_bytes=1 << 16, backend="host", host_budget_bytes=1 << 16)

    class Racing:  # the handle, with the shard replaced as it is opened
        def open_file(self, p):
            new = tmp_path / "new.safetensors"
            shard(new, 7.0)
            os.replace(new, p)
            return handle.open_file(p)

        def __getattr__(self, name):
            return getattr(handle, name)

    layout = ExpertsLayout.from_shapes(1, {"gate_up_proj": ((2 * inter, hidden), torch.float32),
                                           "down_proj": ((hidden, inter), torch.float32)})
    prefetcher = ExpertPrefetcher(handle)
    try:
        with pytest.raises(CheckpointError, match="changed since the checkpoint was indexed"):
            register_from_disk(prefetcher, Racing(), index, ["model.layers.0.mlp.experts"], [[0]], layout, [0])
        assert handle.stats()["registered"] == 0
    finally:
        handle.close()


def hub_cache_layout(folder, root):
    """`folder`'s files moved to `root`/blobs under content names, and
    `root`/snapshots/rev holding a relative symlink to each: the layout of a
    Hugging Face hub cache (snapshots/<revision>/<file> -> ../../blobs/<hash>).
    Returns the snapshot folder."""
    blobs, snap = root / "blobs", root / "snapshots" / "rev"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, name in enumerate(sorted(os.listdir(folder))):
        os.rename(folder / name, blobs / f"blob{i}")
        os.symlink(os.path.join("..", "..", "blobs", f"blob{i}"), snap / name)
    return snap


@pytest.mark.parametrize("on_disk", [False, True])
def test_a_hub_cache_snapshot_of_symlinked_shards_is_read(on_disk, tmp_path):
    # What from_pretrained leaves on disk: every shard and the index file
    # are symlinks into blobs/. Packed or left on disk, the experts are
    # read through the links and give the untouched model's tokens.
    ref = build(family_configs()["olmoe"], experts_implementation="batched_mm")
    ref.save_pretrained(tmp_path / "ckpt", max_shard_size="40KB")
    snap = hub_cache_layout(tmp_path / "ckpt", tmp_path / "hub")
    shards = [p for p in os.listdir(snap) if p.endswith(".safetensors")]
    assert len(shards) > 2 and all(os.path.islink(snap / p) for p in [*shards, INDEX_FILE])
    model = experts_on_meta(copy.deepcopy(ref))
    per, num_experts = expert_bytes(ref)
    extra = {"host_budget_bytes": 4 * 3 * (-(-per // 4096) + 2) * 4096} if on_disk else {}
    ctl = offload_moe_experts(model, device_budget_bytes=(num_experts + 3) * (per + 512), backend="host",
                              checkpoint=snap, **extra)
    try:
        assert (ctl.host_experts is None) == on_disk
        ids = torch.randint(0, ref.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(5))
        assert torch.equal(greedy(model, ids)[0], greedy(ref, ids)[0])
        if on_disk:
            s = ctl.handle.stats()
            assert s["disk_reads"] > 0 and s["disk_errors"] == 0
    finally:
        ctl.close()


def test_fused_expert_tensors_that_do_not_fit_are_refused(tmp_path):
    # gpt-oss keeps its experts fused, one [experts, ...] tensor per part:
    # each is checked against the model before anything is read.
    ref = build(family_configs()["gpt_oss"])
    per, _ = expert_bytes(ref)
    _, _, on_disk, variant = checkpoint_variants(ref, tmp_path)
    bias = "model.layers.1.mlp.experts.down_proj_bias"
    assert bias in on_disk and on_disk[bias].dim() == 2

    _refused(experts_on_meta(copy.deepcopy(ref)), variant("nobias", lambda t: t.pop(bias)),
             r"down_proj_bias' is not in the checkpoint", per)
    _refused(experts_on_meta(copy.deepcopy(ref)), variant("fewer", lambda t: t.update({bias: t[bias][:-1]})),
             r"down_proj_bias' in .* needs F32", per)
