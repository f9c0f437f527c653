"""transformers' MoE blocks as prefetch sees them: which transformers
releases are supported, where a model's experts modules are, what one
expert is made of (ExpertsLayout), and the hook into transformers'
experts-implementation interface.

Note [Experts on their own module]
transformers 5 dispatches every `*Experts` module decorated with
`use_experts_implementation` through `ALL_EXPERTS_FUNCTIONS[name](self,
hidden, top_k_index, top_k_weights)`, `name` being the model's experts
implementation ("grouped_mm" by default, "batched_mm" in `generate`'s
decode on a GPU, "eager", ...). `install_experts_backend` wraps each
registered implementation once: a module that is not offloaded runs it
unchanged; an offloaded one goes through the engine and then runs the SAME
implementation on the module ITSELF, with its per-expert tensors shadowed
by views of the device cache for the length of the call (`on_slots`): an
entry in the module's instance `__dict__` wins over nn.Module's
`__getattr__`, which is where parameters are found. Everything else the
implementation reads from `self` (flags, activation, `_apply_gate`, norms,
attributes a later release adds) is the module's own, so a release that
adds an attribute or changes the inside of an implementation needs no
change here. What an expert is made of is read from the module too: every
parameter or buffer whose first dimension is the expert count (weights,
biases, scales) is a part of its packed entry, whatever its name, layout
or dtype.
"""
from __future__ import annotations

import contextlib
import inspect
import warnings

import numpy as np
import torch

from prefetch.errors import InvalidArgumentError
from prefetch.expert_prefetcher import PartLayout, _align, expert_layout, stacked_views

__all__ = ["TRANSFORMERS_TESTED", "ExpertsLayout", "check_transformers", "find_hf_moe_blocks",
           "install_experts_backend", "offloaded_experts", "on_slots", "block_names", "experts_names",
           "model_device", "routed_top_k"]

# The oldest and the newest transformers release the test suite runs on (CI
# runs the integration tests on both; the `hf` extra allows exactly this range).
TRANSFORMERS_TESTED = ("5.17.0", "5.25.0")

OFFLOAD_ATTR = "_prefetch_offload"
# Where the router of a transformers MoE block lives, by family: "gate"
# (Mixtral, Qwen, DeepSeek, ...) or "router" (gpt-oss, ...).
_ROUTER_NAMES = ("gate", "router")
_warned_versions: set = set()


def _version_key(version: str) -> tuple:
    out = []
    for piece in version.split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit()) or "0"
        out.append(int(digits))
    return tuple(out)


def _tested_range() -> str:
    return f"{TRANSFORMERS_TESTED[0]} to {TRANSFORMERS_TESTED[1]}"


def check_transformers():
    """The experts-implementation interface of the installed transformers
    (its ALL_EXPERTS_FUNCTIONS), checked for what the integration uses.
    Raises RuntimeError, naming the installed version and the tested range,
    where that interface is missing or differs; warns once for a release
    outside the tested range whose interface looks as expected."""
    import transformers

    version = getattr(transformers, "__version__", "unknown")
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, use_experts_implementation
    except ImportError as err:
        raise RuntimeError(f"transformers {version} has no experts-implementation interface "
                           f"(transformers.integrations.moe: {err}); prefetch supports transformers "
                           f"{_tested_range()}") from err
    missing = [m for m in ("keys", "__getitem__", "__setitem__", "__contains__")
               if not hasattr(ALL_EXPERTS_FUNCTIONS, m)]
    if missing or not callable(use_experts_implementation):
        raise RuntimeError(f"transformers {version}: ALL_EXPERTS_FUNCTIONS is not the mapping prefetch expects "
                           f"(no {', '.join(missing)}); prefetch supports transformers {_tested_range()}")
    key = _version_key(version)
    if not (_version_key(TRANSFORMERS_TESTED[0]) <= key <= _version_key(TRANSFORMERS_TESTED[1])) \
            and version not in _warned_versions:
        _warned_versions.add(version)
        warnings.warn(f"prefetch is tested with transformers {_tested_range()}; {version} is installed and its "
                      "experts interface looks as expected, so offloading goes ahead untested", stacklevel=3)
    return ALL_EXPERTS_FUNCTIONS


class ExpertsLayout:
    """What one expert of a transformers experts module is made of: every
    parameter or buffer of the module (not of its submodules) whose first
    dimension is the expert count, in registration order, each packed at a
    256-byte aligned offset (`parts`, the engine's layout). Shared tensors
    (first dimension not the expert count) and submodules stay on the
    module and are not offloaded."""

    def __init__(self, module: torch.nn.Module):
        stacked = [(n, t) for n, t in (*module._parameters.items(), *module._buffers.items())
                   if isinstance(t, torch.Tensor) and t.dim() >= 2]
        count = getattr(module, "num_experts", None)
        if not isinstance(count, (int, np.integer)) or isinstance(count, bool):
            counts = {int(t.shape[0]) for _, t in stacked if t.dim() == 3}
            if len(counts) != 1:
                raise NotImplementedError(f"{type(module).__name__}: cannot tell its expert count (no integer "
                                          "num_experts, and its 3-D tensors do not agree on one)")
            count = counts.pop()
        self.num_experts = int(count)
        tensors = [(n, t) for n, t in (*module._parameters.items(), *module._buffers.items())
                   if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == self.num_experts]
        if not any(t.dim() >= 3 for _, t in tensors):
            raise NotImplementedError(f"{type(module).__name__}: no stacked [experts, ...] weight to offload")
        self._set_parts(self.num_experts, {n: (tuple(t.shape[1:]), t.dtype) for n, t in tensors})

    @classmethod
    def from_shapes(cls, num_experts: int, shapes: dict) -> ExpertsLayout:
        """The layout of experts whose parts are `shapes` ({name: (shape of
        one expert's part, dtype)}, in order), without a module."""
        layout = cls.__new__(cls)
        layout._set_parts(int(num_experts), shapes)
        return layout

    def _set_parts(self, num_experts: int, shapes: dict) -> None:
        self.num_experts = num_experts
        self.names = tuple(shapes)
        # zero-stride stand-ins: shapes and dtypes, one element each (the
        # module's tensors may be on a GPU or the meta device)
        probes = {n: torch.empty_strided(shape, (0,) * len(shape), dtype=dtype) for n, (shape, dtype) in shapes.items()}
        self.parts: tuple[PartLayout, ...] = expert_layout(probes)
        self.expert_bytes = self.parts[-1].offset + self.parts[-1].nbytes  # packed, with alignment gaps
        self.data_bytes = sum(p.nbytes for p in self.parts)  # what a read of the expert moves
        self.slot_bytes = _align(self.expert_bytes)

    @property
    def key(self) -> tuple:
        """What two layouts must share to hold the same experts."""
        return (self.num_experts, tuple((p.name, p.shape, p.dtype) for p in self.parts))

    def fingerprint(self) -> str:
        return repr(tuple((p.name, p.shape, str(p.dtype)) for p in self.parts))

    def describe(self) -> str:
        return ", ".join(f"{p.name} {list(p.shape)} {str(p.dtype).replace('torch.', '')}" for p in self.parts)

    def views(self, flat: torch.Tensor, rows: int, row_bytes: int) -> dict:
        """Each part as a stacked [rows, *shape] tensor over `flat` (bytes,
        uint8, 1-D; 256-byte aligned), row r's part at r * row_bytes plus
        the part's offset: the stacked parameters an experts
        implementation reads, with row r in place of expert r."""
        return stacked_views(flat, rows, row_bytes, self.parts)


@contextlib.contextmanager
def on_slots(module: torch.nn.Module, views: dict, num_experts: int):
    """Note [Experts on their own module]: `module`'s per-expert tensors
    read as `views`, and its num_experts as `num_experts`, inside the block."""
    d = module.__dict__
    had = "num_experts" in d
    saved = d.get("num_experts")
    d.update(views)
    d["num_experts"] = num_experts
    try:
        yield module
    finally:
        for name in views:
            d.pop(name, None)
        if had:
            d["num_experts"] = saved
        else:
            d.pop("num_experts", None)


def _wrap(name: str, inner):
    """The implementation `name` (None: the module's own eager forward),
    routed through the engine for offloaded modules."""

    def experts_forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
        fn = inner if inner is not None else _dispatcher(type(self)).__wrapped__
        offload = self.__dict__.get(OFFLOAD_ATTR)
        if offload is None:
            return fn(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs)
        return offload.forward(fn, name, hidden_states, top_k_index, top_k_weights)

    experts_forward._prefetch_wrapper = True
    experts_forward.__name__ = f"prefetch_{name}_experts_forward"
    return experts_forward


def install_experts_backend() -> None:
    """Wraps every implementation registered in transformers'
    ALL_EXPERTS_FUNCTIONS (and "eager") once; idempotent. Modules that are
    not offloaded are unaffected."""
    functions = check_transformers()
    for name in [*functions.keys(), "eager"]:
        current = functions[name] if name in functions else None
        if getattr(current, "_prefetch_wrapper", False):
            continue
        functions[name] = _wrap(name, current)


def offloaded_experts(model) -> list:
    """The experts modules of `model` that prefetch has offloaded."""
    return [m for m in model.modules() if OFFLOAD_ATTR in m.__dict__]


def _dispatcher(cls):
    """use_experts_implementation's dispatching forward of `cls` or of a
    class it derives from (a family may override forward and call it
    through super()), or None."""
    for klass in cls.__mro__:
        forward = klass.__dict__.get("forward")
        if forward is not None and hasattr(forward, "__wrapped__"):
            return forward
    return None


def _dispatches_through_interface(cls, functions) -> bool | None:
    """Whether `cls`'s experts dispatcher goes through `functions`
    (transformers' ALL_EXPERTS_FUNCTIONS: True), through another interface
    (False: quantized experts have their own), or is not a dispatcher
    prefetch knows (None)."""
    forward = _dispatcher(cls)
    if forward is None:
        return None
    try:
        interface = inspect.getclosurevars(forward).nonlocals.get("experts_interface")
    except (TypeError, ValueError):
        interface = None
    if interface is None:
        return None
    return interface is functions


def _router_of(block: torch.nn.Module, experts: torch.nn.Module):
    for name in _ROUTER_NAMES:
        router = getattr(block, name, None)
        if isinstance(router, torch.nn.Module) and router is not experts:
            return router
    return None


def find_hf_moe_blocks(model):
    """(block, experts_module, router) for each transformers MoE block, in
    module order: an experts module dispatched through transformers'
    experts-implementation interface, its parent block, and the block's
    router (its `gate` or `router`; None where it has neither). Raises if
    the model is already offloaded; NotImplementedError for an experts
    module that cannot be offloaded, naming what is missing; RuntimeError
    where the installed transformers' interface is not what prefetch
    expects."""
    already = offloaded_experts(model)
    if already:
        ctl = already[0].__dict__[OFFLOAD_ATTR].controller
        state = "closed" if ctl.handle.closed else "open"
        raise InvalidArgumentError(
            f"this model's experts are already offloaded by prefetch ({len(already)} MoE layers, by a controller "
            f"that is {state}); offload a model once. To change the predictor, assign controller.predictor; to "
            "change the budget, close the controller and offload a freshly built or loaded model")
    found = experts_blocks(model)
    if found:
        layouts = [ExpertsLayout(e) for _, e, _ in found]
        if any(lay.key != layouts[0].key for lay in layouts):
            kinds = sorted({lay.describe() for lay in layouts})
            raise NotImplementedError(f"MoE layers whose experts differ in count, shape or dtype are not supported "
                                      f"(found: {'; '.join(kinds)})")
    return found


def experts_blocks(model) -> list:
    """(block, experts_module, router) for each experts module of `model`
    (offloaded or not), in module order; find_hf_moe_blocks' search,
    without its checks of the model as a whole."""
    parents = {}
    for parent in model.modules():
        for child in parent.children():
            parents.setdefault(id(child), parent)
    candidates = [m for m in model.modules() if _looks_like_experts(m)]
    functions = check_transformers() if candidates else None
    found = []
    for module in candidates:
        how = _dispatches_through_interface(type(module), functions)
        if how is None:
            import transformers

            raise RuntimeError(
                f"{type(module).__name__} holds stacked expert weights but its forward is not transformers' "
                f"experts-interface dispatcher as prefetch knows it (transformers {transformers.__version__}; "
                f"prefetch supports {_tested_range()})")
        if how is False:
            raise NotImplementedError(
                f"{type(module).__name__} dispatches through an experts interface of its own (quantized experts), "
                "which prefetch does not offload yet")
        block = parents.get(id(module))
        if block is None:
            raise NotImplementedError(f"{type(module).__name__} is the model itself, not a block's experts")
        found.append((block, module, _router_of(block, module)))
    return found


def _looks_like_experts(module) -> bool:
    """An experts module: it holds stacked 3-D weights and its class (or a
    class it derives from) was decorated with use_experts_implementation
    (the decorator's flags are set on it). Stacked weights in an
    undecorated module (a family's shared experts) stay where they are."""
    if not any(isinstance(t, torch.Tensor) and t.dim() == 3 for t in module._parameters.values()):
        return False
    return hasattr(module, "has_gate") and _dispatcher(type(module)) is not None


def block_names(model, hf_blocks) -> list:
    """The module path of each MoE block of `hf_blocks` in `model`."""
    names = {id(m): n for n, m in model.named_modules()}
    return [names.get(id(block), "") for block, _, _ in hf_blocks]


def experts_names(model, hf_blocks) -> list:
    """The module path of each experts module of `hf_blocks` in `model`."""
    names = {id(m): n for n, m in model.named_modules()}
    return [names.get(id(experts), "") for _, experts, _ in hf_blocks]


def model_device(hf_blocks, layer: int = 0) -> torch.device:
    """Where MoE layer `layer` computes: its experts' device, or, for
    experts on the meta device (read from a checkpoint), its block's."""
    block, experts, router = hf_blocks[layer]
    weight = next(iter(ExpertsLayout(experts).names))
    device = getattr(experts, weight).device
    if device.type != "meta":
        return device
    for source in (router, block):
        if source is None:
            continue
        found = next((p for p in source.parameters() if p.device.type != "meta"), None)
        if found is not None:
            return found.device
    raise InvalidArgumentError(f"the experts and the router of MoE layer {layer} are on the meta device: put the "
                               "model's other weights on their device first")


# Config fields that hold how many experts a token is routed to, by family.
_TOP_K_FIELDS = ("num_experts_per_tok", "num_experts_per_token", "top_k_experts", "moe_topk", "top_k",
                 "n_activated_experts", "moe_k", "num_selected_experts")


def routed_top_k(model, hf_blocks) -> int:
    """How many experts each token is routed to: the router's or the block's
    `top_k`, else the experts' config (a multimodal model's text config),
    else the model's."""
    block, experts, router = hf_blocks[0]
    for source in (router, block):
        k = getattr(source, "top_k", None)
        if isinstance(k, int) and k > 0:
            return k
    for config in (getattr(experts, "config", None), getattr(model, "config", None)):
        for cfg in (config, getattr(config, "text_config", None)):
            for field in _TOP_K_FIELDS:
                k = getattr(cfg, field, None)
                if isinstance(k, int) and not isinstance(k, bool) and k > 0:
                    return k
    raise NotImplementedError(f"{type(experts).__name__}: cannot tell how many experts a token is routed to "
                              f"(no top_k on the router or block, and none of {_TOP_K_FIELDS} in the config)")
