"""Building a transformers model from its checkpoint folder with its experts
left on the meta device, for offload_moe_experts(..., checkpoint=folder):
load_without_experts.

Note [Loading without the experts]
from_pretrained builds the model on the meta device, loads the checkpoint's
tensors into it (with its own renames and per-expert -> fused
conversions), then gives every parameter it did not load an empty tensor
on the load device and initializes it, along with every non-persistent
buffer (the rotary embedding's inv_freq is recomputed from the config
there). A model built on meta with load_state_dict(assign=True) for its
other weights skips that last part and keeps those buffers on meta.
load_without_experts lets from_pretrained do all of it, on a state dict of
every checkpoint tensor but the experts' (safetensors slices, read as they
are loaded), while torch's global parameter and buffer registration hooks
put a meta tensor in place of each expert part from_pretrained registers:
the empty tensor it made for a missing expert part is dropped before
anything writes to it, and its initialization then runs on meta, where it
does nothing. The expert tensors left out are those offload_moe_experts
reads (Note [Experts from the checkpoint] in
prefetch/checkpoint_experts.py), checked against the model (every expert
there, its shapes and dtype) before anything is loaded.
"""
from __future__ import annotations

import contextlib
import logging
import os
import warnings

import torch
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_parameter_registration_hook,
)

from prefetch.checkpoint import index_checkpoint
from prefetch.checkpoint_experts import expert_locations, expert_tensor_names
from prefetch.errors import CheckpointError, InvalidArgumentError
from prefetch.hf_blocks import ExpertsLayout, experts_names, find_hf_moe_blocks

__all__ = ["load_without_experts"]


def load_without_experts(folder, *, dtype: torch.dtype | None = None, device=None, **from_pretrained_kwargs):
    """A transformers causal LM from its checkpoint folder (written by
    save_pretrained, or a hub snapshot), every weight loaded by
    transformers' from_pretrained except the MoE experts', which stay on
    the meta device for `offload_moe_experts(model, ..., checkpoint=folder)`
    to read from the checkpoint (Note [Loading without the experts]).

    `dtype`: the model's dtype (default: the config's); the checkpoint's
    expert tensors must have it, as offload_moe_experts reads their bytes
    as they are. `device`: where the other weights go (default: the CPU);
    the model cannot be moved with model.to(...) before it is offloaded
    (its experts have no data). Other keyword arguments go to
    from_pretrained (experts_implementation, attn_implementation, ...).
    Raises CheckpointError for a folder that is not a model checkpoint,
    lacks an expert tensor or holds one of another shape or dtype, or lacks
    any other weight (from_pretrained would initialize it at random).
    Registration hooks are process-wide: another thread building modules
    of the model's experts class during the load gets meta parts too."""
    import transformers
    from safetensors import safe_open

    folder = os.fspath(folder)
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise CheckpointError(f"{folder}: not a transformers model folder (no config.json)")
    for key in ("state_dict", "device_map", "output_loading_info"):
        if key in from_pretrained_kwargs:
            raise InvalidArgumentError(f"load_without_experts sets from_pretrained's {key} itself")
    config = transformers.AutoConfig.from_pretrained(folder)
    model_class = transformers.MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if model_class is None:
        raise InvalidArgumentError(f"{folder}: {config.model_type!r} is not a model AutoModelForCausalLM builds")
    dtype = _model_dtype(config, dtype)
    index = index_checkpoint(folder)
    parts, left_out, expert_params = _experts(config, dtype, index)
    with contextlib.ExitStack() as files:
        opened, state = {}, {}
        for name, loc in index.items():
            if name in left_out:
                continue
            if loc.path not in opened:
                opened[loc.path] = files.enter_context(safe_open(loc.path, framework="pt", device="cpu"))
            state[name] = opened[loc.path].get_slice(name)
        with _experts_on_meta(parts), _quiet_loading_report():
            model, info = model_class.from_pretrained(None, config=config, state_dict=state, dtype=dtype,
                                                      output_loading_info=True, **from_pretrained_kwargs)
    _check_loaded(model, info, expert_params, folder)
    if model.can_generate() and os.path.isfile(os.path.join(folder, "generation_config.json")):
        model.generation_config = transformers.GenerationConfig.from_pretrained(folder)
    model.config.name_or_path = folder
    if device is not None:
        model._apply(lambda t: t if t.is_meta else t.to(device))
    return model


def _model_dtype(config, dtype):
    if dtype is None:
        dtype = getattr(config, "dtype", None) or torch.get_default_dtype()
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgumentError(f"dtype must be a torch.dtype, got {dtype!r}")
    return dtype


def _experts(config, dtype, index: dict):
    """From the model built on meta: {experts class: its part names}, the
    checkpoint's expert tensor names (checked against the model: every
    expert present, its shapes and dtype) and the experts' parameter
    names in the model."""
    import transformers

    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    blocks = find_hf_moe_blocks(skeleton)
    layout = ExpertsLayout(blocks[0][1])
    names = experts_names(skeleton, blocks)
    expert_locations(index, names, [range(layout.num_experts)] * len(blocks), layout)
    parts = {type(experts): frozenset(ExpertsLayout(experts).names) for _, experts, _ in blocks}
    params = {f"{name}.{part}" for name in names for part in layout.names}
    return parts, expert_tensor_names(index, names, layout), params


@contextlib.contextmanager
def _experts_on_meta(parts: dict):
    """While it is open, a parameter or buffer of an experts module named
    as one of its parts is registered as a meta tensor of the same shape
    and dtype (Note [Loading without the experts])."""

    def to_meta(module, name, value):
        if value is None or value.device.type == "meta" or name not in parts.get(type(module), ()):
            return None
        empty = torch.empty(value.shape, dtype=value.dtype, device="meta")
        if isinstance(value, torch.nn.Parameter):
            return torch.nn.Parameter(empty, requires_grad=value.requires_grad)
        return empty

    hooks = [register_module_parameter_registration_hook(to_meta), register_module_buffer_registration_hook(to_meta)]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


@contextlib.contextmanager
def _quiet_loading_report():
    """from_pretrained's loading report would list the experts as missing
    and "newly initialized": they are neither (_check_loaded reports what
    it should)."""
    logger = logging.getLogger("transformers.modeling_utils")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _check_loaded(model, info: dict, expert_params: set, folder: str) -> None:
    import transformers

    missing = sorted(set(info.get("missing_keys") or ()) - expert_params)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"{folder}: the checkpoint lacks {shown} (from_pretrained would initialize "
                              "them at random)")
    unexpected = sorted(info.get("unexpected_keys") or ())
    if unexpected:
        warnings.warn(f"{folder}: the model does not use {len(unexpected)} checkpoint tensor(s): "
                      f"{', '.join(unexpected[:5])}", stacklevel=3)
    for _, experts, _ in find_hf_moe_blocks(model):
        for name in ExpertsLayout(experts).names:
            if getattr(experts, name).device.type != "meta":
                raise RuntimeError(f"transformers {transformers.__version__} loaded the experts' "
                                   f"{name}: load_without_experts does not support this release")
