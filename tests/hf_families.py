"""Tiny random-init models for every transformers MoE family that uses ``@use_experts_implementation``.

Test fixture module (no pytest needed at import time).  Nothing is downloaded: every model is built
from its config class with random weights, shrunk to hidden 64 / 4 heads / 8 routed experts, top-2,
vocab 160, 2-4 layers (at least two of them MoE; one dense layer is kept where the family has a
dense prefix), while keeping each family's own structure (shared experts, MLA, linear/mamba layers,
sliding windows, indexers, per-layer configs, ...).  Build + 4-token greedy generate takes ~0.1 s.

API
---
FAMILIES
    Sorted ``models/<name>`` directory names whose ``modeling_*.py`` decorates an experts class with
    ``@use_experts_implementation`` in the *installed* transformers (found by scanning the files, so
    families missing from an older release simply do not appear).
build_tiny(family, *, seed=0, dtype=torch.float32) -> torch.nn.Module
    Tiny model on CPU in eval mode; ``torch.manual_seed(seed)`` right before construction, so two
    builds with the same seed are identical.  Text families give their ``*ForCausalLM``; multimodal
    families give the text-only ``*ForCausalLM`` when one exists, else the conditional-generation
    class (tiny vision/audio towers), which works with text-only ``input_ids``.  ``generate()``
    returns a LongTensor ``[batch, prompt + new]`` for every family; it may stop early if the random
    model emits ``eos_token_id`` (2).  Experts run with the config's default experts implementation
    (``grouped_mm`` on torch 2.13 CPU); pass ``experts_implementation`` yourself if you need another.
unsupported_reason(family) -> str | None
    None when build_tiny + generate work; otherwise a verified reason.  Only
    ``openai_privacy_filter`` (a bidirectional token classifier with no generate()); build_tiny
    still returns its forward-only model so the experts layout can be exercised.
build_config(family)
    The shrunk config alone.

How the configs are built: ``_TEXT`` / ``_TOWER`` / ``_TOP`` are generic shrink tables applied to a
config only for keys it has (aliases in ``attribute_map`` resolved); per-layer lists are sub-sampled
jointly so every layer kind survives; ``_OVERRIDES`` holds the few family-specific fields (as data).

Experts layouts seen on the built instances (identical on 5.17 and 5.25 for the 54 shared families;
E = experts, H = hidden, I = expert intermediate).  The experts module is always the child
``experts`` of the MoE block; the router child is ``gate`` unless listed under ``router`` below.

* default: ``gate_up_proj [E, 2I, H]`` + ``down_proj [E, H, I]``, concatenated [gate; up], no bias,
  default gate -- 56 families (all not listed in the next bullets).
* ``is_transposed=True`` (``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``): aria.
* ``has_bias`` + transposed + ``is_concatenated=False`` (interleaved gate/up) + custom ``_apply_gate``
  (clamped swiglu), params ``gate_up_proj, gate_up_proj_bias [E, 2I], down_proj, down_proj_bias [E, H]``:
  gpt_oss.
* ``has_bias`` + transposed + custom ``_apply_gate`` (concatenated): openai_privacy_filter (forward only).
* ``has_gate=False`` (``up_proj`` instead of ``gate_up_proj``): nemotron_h (``up_proj [E, I, H]``,
  relu2; block also has identity ``fc1/fc2_latent_proj``), ergo (transposed: ``up_proj [E, H, I]``,
  ``down_proj [E, I, H]``; the decorator sits on base class ``ErgoExpertProjections`` and the module
  class ``ErgoExperts`` overrides ``forward`` to add a per-route norm, so ``type(m).forward`` is
  *not* the wrapper -- look for the wrapper along the MRO / use module hooks).
* ``has_post_expert_norm=True``: muse_spark (experts work in a ``moe_hidden_size`` latent between the
  block's ``pre_expert_proj`` / ``post_expert_proj``).
* custom ``_apply_gate`` only: bailing_hybrid, beam, deepseek_v4, glm5_next, hy_v4, hy_v4_vl,
  inkling2, inkling2_loop, minimax_m3_vl, step3p7.
* router attribute ``router`` (not ``gate``): afmoe, aria, diffusion_gemma, gemma4, gpt_oss,
  granitemoe, granitemoe_swa, granitemoehybrid, granitemoeshared, jamba, longcat_flash,
  openai_privacy_filter, phimoe.
* experts/router directly on the decoder layer (no MoE block; a dense ``mlp`` runs in parallel):
  gemma4, diffusion_gemma (encoder + decoder layers -> 4 experts modules).
* shared experts beside the routed ones, child of the MoE block: ``shared_experts``: afmoe, aria,
  axk1, axk2, bailing_hybrid, deepseek_ocr2, deepseek_v2, deepseek_v3, deepseek_v32, deepseek_v4,
  dots1, dots3_note, ergo, ernie4_5_moe, exaone_moe, glm4_moe, glm4_moe_lite, glm4v_moe, glm5_next,
  glm_moe_dsa, hy_v3, hy_v4, hy_v4_vl, inkling, kimi_linear, kolibri1, kolibri1_1, laguna,
  minicpm5_moe, minimax_m3_vl, mistral4, mistral_large4, nemotron_h, solar_open, step3p7,
  unlimited_ocr; ``shared_expert`` + ``shared_expert_gate``: qwen2_moe, qwen3_5_moe, qwen3_next,
  qwen4_exp; ``shared_expert``: flint, lara_mini; ``shared_mlp``: hunyuan_v1_moe.
  Elsewhere: ernie4_5_vl_moe (outer block holds ``text_moe`` / ``vision_moe`` sparse blocks, each
  with ``experts`` + ``gate``, plus ``shared_experts``), granitemoehybrid / granitemoeshared
  (``shared_mlp`` on the decoder layer).  No shared experts: the rest.
* other oddities: longcat_flash routes to ``n_routed_experts + zero_expert_num`` slots (ids >= E are
  identity "zero experts"); zaya is top-1 only; kolibri1_1 has a layer reusing another's K/V.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.util
import pathlib

import torch


def _discover_families() -> list[str]:
    """`models/<name>` dirs of the installed transformers whose modeling file uses the decorator."""
    spec = importlib.util.find_spec("transformers")
    root = pathlib.Path(spec.origin).parent / "models"
    fams = set()
    for path in root.glob("*/modeling_*.py"):
        try:
            text = path.read_text(encoding="utf-8")
        except OSError:
            continue
        if "@use_experts_implementation" in text:
            fams.add(path.parent.name)
    return sorted(fams)


FAMILIES: list[str] = _discover_families()

__all__ = ["FAMILIES", "build_config", "build_tiny", "unsupported_reason"]


def _if_set(value):
    """Shrink only when the default is truthy (None/0/False mean 'feature off')."""
    return lambda cur: value if cur else cur


def _at_most(value):
    return lambda cur: min(cur, value) if isinstance(cur, int) and not isinstance(cur, bool) else cur


# Applied to the text (decoder) config of every family, only for keys the config has.
# A plain value is always set; a callable gets the default value and returns the new one.
_TEXT = {
    "vocab_size": 160,
    "vocab_size_per_layer_input": 160,
    "unpadded_vocab_size": _if_set(150),
    "hidden_size_per_layer_input": _if_set(8),
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": _if_set(2),
    "head_dim": _if_set(16),
    "max_position_embeddings": 256,
    "moe_intermediate_size": lambda cur: [32] * len(cur) if isinstance(cur, list) else 32,
    "shared_expert_intermediate_size": _if_set(32),
    "shared_intermediate_size": _if_set(32),
    "shared_experts_intermediate_size": _if_set(32),
    "num_experts": 8,
    "n_routed_experts": 8,
    "num_local_experts": 8,
    "moe_num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "moe_k": 2,
    "top_k_experts": 2,
    "num_experts_per_token": 2,
    "n_group": _if_set(1),
    "topk_group": _if_set(1),
    "n_shared_experts": _at_most(1),
    "num_shared_experts": _at_most(1),
    "moe_num_shared_experts": _at_most(1),
    "first_k_dense_replace": _at_most(1),
    "num_dense_layers": _at_most(1),
    "decoder_sparse_step": _at_most(1),
    "mlp_only_layers": lambda cur: [0] if cur else cur,
    "moe_shared_expert_intermediate_size": _if_set(32),
    "moe_hidden_size": _if_set(32),
    "dense_intermediate_size": _if_set(64),
    "prefix_dense_intermediate_size": _if_set(64),
    "first_dense_intermediate_size": _if_set(64),
    "mlp_only_intermediate_size": _if_set(64),
    "share_expert_dim": _if_set(32),
    "expert_ffn_hidden_size": _if_set(32),
    "ffn_hidden_size": _if_set(64),
    "router_hidden_size": _if_set(16),
    "o_lora_rank": _if_set(16),
    "o_groups": _at_most(2),
    "swa_num_attention_heads": _if_set(4),
    "swa_num_key_value_heads": _if_set(2),
    "swa_head_dim": _if_set(16),
    "mamba_n_heads": _if_set(8),
    "mamba_num_heads": _if_set(8),
    "mamba_d_head": _if_set(16),
    "mamba_head_dim": _if_set(16),
    "mamba_d_state": _if_set(16),
    "ssm_state_size": _if_set(16),
    "mamba_n_groups": _if_set(1),
    "n_groups": _if_set(1),
    "mamba_chunk_size": _if_set(16),
    "chunk_size": _if_set(16),
    "mamba_dt_rank": _if_set(8),
    "linear_num_key_heads": _if_set(2),
    "linear_num_value_heads": _if_set(4),
    "linear_key_head_dim": _if_set(16),
    "linear_value_head_dim": _if_set(16),
    "linear_num_heads": _if_set(4),
    "linear_head_dim": _if_set(16),
    "q_lora_rank": _if_set(32),
    "kv_lora_rank": _if_set(16),
    "qk_nope_head_dim": _if_set(8),
    "qk_head_dim": _if_set(16),
    "v_head_dim": _if_set(16),
    "sliding_window": _if_set(8),
    "index_n_heads": _if_set(2),
    "index_head_dim": _if_set(16),
    "index_topk": _if_set(4),
    "index_kpool": _if_set(2),
    "pad_token_id": _if_set(0),
    "bos_token_id": _if_set(1),
    "eos_token_id": lambda cur: cur if cur is None else ([2] if isinstance(cur, list) else 2),
}

# Applied to every non-text sub-config (vision / audio towers) of a composite config.
_TOWER = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "depth": 1,
    "num_attention_heads": 2,
    "num_heads": 2,
    "num_key_value_heads": _if_set(2),
    "head_dim": _if_set(16),
    "out_hidden_size": 64,  # towers that project straight into the text embedding width
    "output_dim": 64,
    "d_model": 32,
    "encoder_layers": 1,
    "encoder_attention_heads": 2,
    "encoder_ffn_dim": 64,
    "downsample_hidden_size": _if_set(16),
    "mlp_dim": _if_set(64),
    "output_channels": _if_set(16),
    "downsample_channels": lambda cur: [16 * 2 ** i for i in range(len(cur))] if cur else cur,
    "projection_intermediate_size": _if_set(64),
    "position_embedding_size": _if_set(64),
    "max_image_size": _if_set(64),
    "num_position_embeddings": _if_set(16),
}

# Applied to the top level of composite (multimodal) configs.
_TOP = {
    "projector_hidden_size": 64,
}

# family -> extra config kwargs (nested dicts for sub-configs of composite configs).
_OVERRIDES: dict[str, dict] = {
    "gemma4": {"enable_moe_block": True, "global_head_dim": 32},
    "deepseek_ocr2": {"num_hidden_layers": 3, "mlp_layer_types": ["dense", "sparse", "sparse"]},
    "dots1": {"n_shared_experts": 1},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "nemotron_h": {"layers_block_type": ["linear_attention", "moe", "full_attention", "moe"]},
    "jamba": {"num_hidden_layers": 4, "attn_layer_period": 4, "attn_layer_offset": 2,
              "expert_layer_period": 2, "expert_layer_offset": 1},
    "longcat_flash": {"num_layers": 2, "zero_expert_num": 4},  # ids >= n_routed_experts are zero (identity) experts
    "granitemoeshared": {"shared_intermediate_size": 32},  # default 0 would drop the shared MLP
    "hunyuan_v1_moe": {"head_dim": 16},
    "ernie4_5_moe": {"num_hidden_layers": 3, "moe_layer_start_index": 1, "moe_layer_end_index": 2},
    "zaya": {"num_experts_per_tok": 1},  # ZAYA validates top-1 routing
    "step3p7": {"sliding_window": 8},
    "minimax": {"block_size": 16},
    # sliding layers get their own (smaller) MLA shape through these swa_* aliases
    "dots3_note": {"swa_num_attention_heads": 2, "swa_num_key_value_heads": 2, "swa_q_lora_rank": 32,
                   "swa_kv_lora_rank": 16, "swa_head_dim": 32, "swa_qk_nope_head_dim": 24, "swa_v_head_dim": 16},
    "muse_spark": {"audio_config": {"num_hidden_layers": 4, "hidden_sizes": [8, 8, 16, 16], "depths": [1, 1, 1, 1]},
                   "_top": {"out_hidden_size": 128}},
    "qwen4_exp": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
                  "indexer_compress_ratio": 2, "hc_lowrank": 16},
    # the thinker's text-only get_rope_index reads this attribute, which its config class lacks
    "qwen3_omni_moe": {"_top": {"vision_start_token_id": 151652}},
    # 5.17 has no default vision_config but its encoder always builds a vision tower
    "diffusion_gemma": {"enable_moe_block": True, "global_head_dim": 32, "_top": {"canvas_length": 4},
                        "vision_config": {"model_type": "gemma4_vision"}},
    "lfm2_moe": {"num_hidden_layers": 3, "layer_types": ["conv", "full_attention", "conv"]},
    "kolibri1_1": {  # sliding + indexed attention, layer 3 reuses layer 1's K/V, layer 0 dense
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "indexed_attention", "sliding_attention", "indexed_attention"],
        "index_layers": [1], "kv_source_layers": [0, 1, 2, 1], "mlp_only_layers": [0],
        "mlp_only_intermediate_size": 64, "index_num_heads": 2, "index_pool_size": 16, "index_compression": 4,
        "index_num_local_tokens": 4, "index_num_sink_tokens": 1,
    },
    # these mrope sections are hidden modeling defaults (not in the config), so they are spelled out
    "ernie4_5_vl_moe": {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0,
                                            "mrope_section": [3, 3, 2]}},
    "glm4v_moe": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                      "mrope_section": [2, 1, 1]}},
}


# family -> attributes set on `model.generation_config` (public GenerationConfig fields).
_GENERATION: dict[str, dict] = {
    # block diffusion: one 4-token canvas, few denoising steps, plain LongTensor output like other families
    "diffusion_gemma": {"return_dict_in_generate": False, "max_denoising_steps": 4},
}


def _is_dense_marker(v) -> bool:
    return isinstance(v, str) and v.lower() in ("dense", "mlp")


def _scale_sections(sections, new_sum):
    old_sum = sum(sections)
    out = [max(1, s * new_sum // old_sum) for s in sections]
    while sum(out) > new_sum:
        out[out.index(max(out))] -= 1
    out[0] += new_sum - sum(out)
    return out


def _scale_rope(rope, ratio):
    """Rescale any `mrope_section` inside (possibly per-layer-type) rope parameters."""
    if not isinstance(rope, dict):
        return rope
    rope = {k: _scale_rope(v, ratio) if isinstance(v, dict) else v for k, v in rope.items()}
    sec = rope.get("mrope_section")
    if isinstance(sec, list) and sec:
        rope["mrope_section"] = _scale_sections(sec, max(len(sec), round(sum(sec) * ratio)))
    return rope


def _config_kwargs(cls, table, overrides):
    """kwargs for `cls(**kwargs)`: generic shrink (`table`) of the class defaults, then `overrides`.

    Composite configs (with `sub_configs`): when `table` is _TEXT, the text sub-config gets _TEXT
    plus the flat override keys; every other sub-config gets _TOWER plus `overrides[<key>]`;
    `overrides["_top"]` (or, for towers, the remaining keys) goes to the composite itself.
    """
    subs = dict(getattr(cls, "sub_configs", None) or {})
    default = cls()
    if subs:
        text_key = next((k for k in subs if "text" in k), None) if table is _TEXT else None
        kwargs = {}
        for key in subs:
            sub = getattr(default, key, None)
            sub_ov = dict(overrides.get(key, {}))
            model_type = sub_ov.pop("model_type", None)
            if sub is None and model_type:  # no default sub-config (AutoConfig slot): build the named one
                from transformers import AutoConfig

                kwargs[key] = {"model_type": model_type,
                               **_config_kwargs(type(AutoConfig.for_model(model_type)), _TOWER, sub_ov)}
                continue
            if sub is None or not hasattr(sub, "to_dict"):
                continue
            if key == text_key:
                flat = {k: v for k, v in overrides.items() if k != "_top" and not k.endswith("_config")}
                kwargs[key] = _config_kwargs(type(sub), _TEXT, flat)
            else:
                kwargs[key] = _config_kwargs(type(sub), _TOWER, sub_ov)
        top = dict(_TOP)
        top = {k: v for k, v in top.items() if k in default.to_dict()}
        if text_key:
            top.update(overrides.get("_top", {}))
        else:
            top.update({k: v for k, v in overrides.items() if k not in subs})
        kwargs.update(top)
        return kwargs

    cur = default.to_dict()  # to_dict(): per-layer ("heterogeneous") configs refuse some getattr()s
    aliases = getattr(cls, "attribute_map", None) or {}
    kwargs = {}
    for key, val in table.items():
        key = aliases.get(key, key)
        if key in cur and key not in kwargs:
            kwargs[key] = val(cur[key]) if callable(val) else val
    heads, kv = cur.get("num_attention_heads"), cur.get("num_key_value_heads")
    if kv and kv == heads and "num_attention_heads" in kwargs:  # MHA (and MLA) stays MHA
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
    if cur.get("image_size") and cur.get("patch_size") and isinstance(cur["patch_size"], int):
        kwargs["image_size"] = cur["patch_size"] * 4
    rope_old = cur.get("qk_rope_head_dim")
    if rope_old:  # MLA: keep the head_dim / rope-dim ratio (partial rotary, head_dim == rope dim, ...)
        kwargs["qk_rope_head_dim"] = 8
        if cur.get("head_dim"):
            kwargs["head_dim"] = cur["head_dim"] * 8 // rope_old
        ratio = 8 / rope_old
    elif cur.get("head_dim") and kwargs.get("head_dim"):
        ratio = kwargs["head_dim"] / cur["head_dim"]
    elif cur.get("hidden_size") and cur.get("num_attention_heads") and "hidden_size" in kwargs:
        new_hd = kwargs["hidden_size"] / kwargs["num_attention_heads"]
        ratio = new_hd / (cur["hidden_size"] / cur["num_attention_heads"])
    else:
        ratio = None
    if ratio and isinstance(cur.get("rope_parameters"), dict) and "rope_parameters" not in overrides:
        kwargs["rope_parameters"] = _scale_rope(cur["rope_parameters"], ratio)

    # Per-layer lists (layer_types, mlp_layer_types, ...): keep a joint subset of layers that still
    # has every distinct layer kind, plus one extra layer when there is a dense prefix, so that at
    # least two layers are MoE.  Uniform lists that the config derives itself are left to it.
    n_old = cur.get("num_hidden_layers")
    n_new = overrides.get("num_hidden_layers", kwargs.get("num_hidden_layers"))
    if n_old and n_new:
        derivable = {f.name for f in dataclasses.fields(cls) if f.default is None}
        per_layer = {k: v for k, v in cur.items()
                     if isinstance(v, list) and len(v) == n_old and k not in kwargs and k not in overrides}
        has_dense = any((cur.get(k) or 0) > 0 for k in ("first_k_dense_replace", "num_dense_layers")) or bool(
            cur.get("mlp_only_layers")) or any(_is_dense_marker(x) for v in per_layer.values() for x in v)
        exact = "num_hidden_layers" in overrides
        if has_dense and not exact:
            n_new += 1
        keep = _pick_layers(list(per_layer.values()), n_old, n_new, exact)
        kwargs["num_hidden_layers"] = len(keep)
        for k, v in per_layer.items():
            if not (k in derivable and len(set(map(repr, v))) == 1):
                kwargs[k] = _subsample(v, keep)
    kwargs.update({k: v for k, v in overrides.items() if k != "_top" and not k.endswith("_config")})
    return kwargs


def _is_layer_index_list(values) -> bool:
    """e.g. `kv_source_layers`: entry i names an earlier layer (itself when it owns its K/V)."""
    return all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= i for i, v in enumerate(values))


def _pick_layers(lists, n_old, n_min, exact):
    """Indices of original layers to keep so every categorical per-layer list keeps each distinct value.

    Lists are sub-sampled jointly (so e.g. `layer_types` and `mlp_layer_types` stay aligned);
    extra layers are "typical" ones (most common value in every list).
    """
    lists = [v for v in lists if not _is_layer_index_list(v) and len(set(map(repr, v))) <= 4]
    keep = set()
    for values in lists:
        seen = set()
        for i, v in enumerate(values):
            if repr(v) not in seen:
                seen.add(repr(v))
                keep.add(i)
    common = [max(set(map(repr, v)), key=list(map(repr, v)).count) for v in lists]
    typical = [i for i in range(n_old) if i not in keep and all(repr(v[i]) == c for v, c in zip(lists, common))]
    rest = [i for i in range(n_old) if i not in keep and i not in typical]
    keep = sorted(keep)
    keep = sorted(keep + (typical + rest)[: max(0, n_min - len(keep))])
    return keep[:n_min] if exact else keep


def _subsample(values, keep):
    if _is_layer_index_list(values):  # remap layer references; a dropped source falls back to "own K/V"
        pos = {old: new for new, old in enumerate(keep)}
        return [pos.get(values[old], new) for new, old in enumerate(keep)]
    return [values[i] for i in keep]


# Verified reasons for families that cannot give a generate()-capable tiny model.
_UNSUPPORTED: dict[str, str] = {
    "openai_privacy_filter": (
        "bidirectional encoder-only token classifier (OpenAIPrivacyFilterForTokenClassification, "
        "is_causal=False, no GenerationMixin): nothing to generate() with; build_tiny() returns that "
        "forward-only model so the experts layout can still be exercised"
    ),
}


@functools.cache
def _select(family: str):
    """(config class, model class, Auto class) for `family`.

    Preference: a text-only *ForCausalLM (non-composite config), then a composite config's causal-LM
    or image-text-to-text class, then (no generate()) token-classification / base model.
    """
    import transformers
    from transformers.models.auto import configuration_auto as ca
    from transformers.models.auto import modeling_auto as ma

    if family not in FAMILIES:
        raise KeyError(f"{family!r} is not an experts family of transformers {transformers.__version__}")
    maps = (ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, ma.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
            ma.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES, ma.MODEL_MAPPING_NAMES)
    autos = ("AutoModelForCausalLM", "AutoModelForImageTextToText", "AutoModelForTokenClassification", "AutoModel")
    candidates = []
    for model_type, config_name in ca.CONFIG_MAPPING_NAMES.items():
        if ca.model_type_to_module_name(model_type) != family:
            continue
        config_cls = getattr(transformers, config_name)
        composite = bool(getattr(config_cls, "sub_configs", None))
        for rank, mapping in enumerate(maps):
            if model_type in mapping:
                key = (rank >= 2, composite, rank, model_type)
                candidates.append((*key, config_cls, autos[rank], mapping[model_type]))
    if not candidates:
        raise NotImplementedError(f"no auto model class for {family!r}")
    *_, config_cls, auto_name, model_name = min(candidates, key=lambda c: c[:4])
    return config_cls, getattr(transformers, model_name), getattr(transformers, auto_name)


def unsupported_reason(family: str) -> str | None:
    """Why `family` has no tiny generate()-capable model here (None when build_tiny + generate work)."""
    if family in _UNSUPPORTED:
        return _UNSUPPORTED[family]
    _, model_cls, _ = _select(family)
    if not model_cls.can_generate():
        return f"{model_cls.__name__} cannot generate()"
    return None


def build_config(family: str):
    """The shrunk config that build_tiny() uses for `family`."""
    ccls, _, _ = _select(family)
    return ccls(**_config_kwargs(ccls, _TEXT, copy.deepcopy(_OVERRIDES.get(family, {}))))


def build_tiny(family: str, *, seed: int = 0, dtype=torch.float32) -> torch.nn.Module:
    """Tiny random-weight model of `family` (CPU, eval mode); see the module docstring."""
    _, mcls, auto_cls = _select(family)
    config = build_config(family)
    torch.manual_seed(seed)
    # Auto*.from_config(dtype=...) honours `_keep_in_fp32_modules` (routers etc.), unlike .to(dtype)
    model = auto_cls.from_config(config, dtype=dtype)
    assert type(model) is mcls, (type(model), mcls)
    for key, val in _GENERATION.get(family, {}).items():
        setattr(model.generation_config, key, val)
    return model.eval()
