"""prefetch.load_without_experts: a transformers model built from its
checkpoint folder (save_pretrained's), every weight but the experts' loaded
by from_pretrained, the experts left on the meta device; offloaded with
checkpoint=folder it decodes the untouched model's greedy tokens and
logits (Qwen3-MoE, OLMoE, Mixtral, gpt-oss). A folder that is not a model,
or lacks experts or other weights, is refused with a CheckpointError."""
from __future__ import annotations

import shutil

import pytest
import torch

import prefetch
from prefetch.hf_blocks import ExpertsLayout
from prefetch.integration import find_hf_moe_blocks, offload_moe_experts

pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from test_integration import assert_same_decode, build, expert_bytes, family_configs  # noqa: E402


def expert_parts(model) -> dict:
    """{parameter or buffer name: tensor} of every experts module's parts."""
    names = {id(m): n for n, m in model.named_modules()}
    return {f"{names[id(experts)]}.{part}": getattr(experts, part)
            for _, experts, _ in find_hf_moe_blocks(model) for part in ExpertsLayout(experts).names}


@pytest.mark.parametrize("family,impl", [("qwen3_moe", "grouped_mm"), ("olmoe", "batched_mm"),
                                         ("mixtral", "eager"), ("gpt_oss", "grouped_mm")])
def test_a_model_loaded_without_its_experts_gives_the_models_tokens(family, impl, tmp_path):
    ref = build(family_configs()[family], experts_implementation=impl)
    ref.save_pretrained(tmp_path)
    model = prefetch.load_without_experts(tmp_path, device="cpu", experts_implementation=impl)
    experts = expert_parts(model)
    assert experts and all(t.device.type == "meta" for t in experts.values())
    assert {n: (t.shape, t.dtype) for n, t in experts.items()} == {
        n: (t.shape, t.dtype) for n, t in expert_parts(ref).items()}
    # every other weight and buffer is the saved model's: loaded, or (the
    # rotary embedding's inv_freq) computed as from_pretrained computes it
    theirs = dict(ref.named_parameters()) | dict(ref.named_buffers())
    ours = dict(model.named_parameters()) | dict(model.named_buffers())
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        if name not in experts:
            assert tensor.device.type == "cpu" and torch.equal(tensor, theirs[name]), name
    assert not model.training
    per, num_experts = expert_bytes(ref)
    ctl = offload_moe_experts(model, device_budget_bytes=(num_experts + 3) * (per + 512), backend="host",
                              checkpoint=tmp_path)
    try:
        ids = torch.randint(0, ref.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(3))
        assert_same_decode(ref, model, ids)
    finally:
        ctl.close()


def test_folders_that_are_not_a_whole_model_are_refused(tmp_path):
    ref = build(family_configs()["qwen3_moe"])
    folder = tmp_path / "ok"
    ref.save_pretrained(folder)
    on_disk = safetensors_torch.load_file(str(folder / "model.safetensors"))

    def variant(name, change):
        d = tmp_path / name
        d.mkdir()
        shutil.copy(folder / "config.json", d / "config.json")
        tensors = dict(on_disk)
        change(tensors)
        safetensors_torch.save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        return d

    def refused(where, match, **kwargs):
        with pytest.raises(prefetch.CheckpointError, match=match):
            prefetch.load_without_experts(where, **kwargs)

    refused(tmp_path / "nowhere", "not a transformers model folder")
    (tmp_path / "weights_only").mkdir()
    shutil.copy(folder / "model.safetensors", tmp_path / "weights_only" / "model.safetensors")
    refused(tmp_path / "weights_only", r"no config\.json")
    (tmp_path / "config_only").mkdir()
    shutil.copy(folder / "config.json", tmp_path / "config_only" / "config.json")
    refused(tmp_path / "config_only", r"no \*\.safetensors")
    refused(variant("no_experts", lambda t: [t.pop(k) for k in list(t) if ".experts." in k]), "no expert tensor")
    expert = "model.layers.1.mlp.experts.2.up_proj.weight"
    refused(variant("one_missing", lambda t: t.pop(expert)), r"experts\.2\.up_proj\.weight' is not in")
    norm = "model.layers.0.post_attention_layernorm.weight"
    refused(variant("no_norm", lambda t: t.pop(norm)), rf"lacks {norm} \(from_pretrained would initialize")
    refused(folder, "is F32 .* needs BF16", dtype=torch.bfloat16)  # the experts are read as they are
    with pytest.raises(prefetch.InvalidArgumentError, match="sets from_pretrained's device_map itself"):
        prefetch.load_without_experts(folder, device_map="cpu")
