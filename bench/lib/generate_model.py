"""BM6's models and the generate loop (bench/generate.py): shapes, building a
random-weight model, saving and restoring its experts, timing decode steps,
recording routing."""
from __future__ import annotations

import contextlib
import sys
import time

import numpy as np

MODELS = {
    # OLMoE-1B-7B-0924's config.json: intermediate_size is the expert width.
    "olmoe-1b-7b": ("olmoe", dict(hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
                                  num_attention_heads=16, num_key_value_heads=16, num_experts=64,
                                  num_experts_per_tok=8, norm_topk_prob=False, rms_norm_eps=1e-5,
                                  max_position_embeddings=4096, rope_parameters={"rope_type": "default",
                                                                                 "rope_theta": 10000.0})),
    "qwen3-30b-a3b": ("qwen3_moe", dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                                        head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                                        rms_norm_eps=1e-6, max_position_embeddings=40960,
                                        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # gpt-oss-120b's config.json at its widths (hidden and expert width 2880, 128 experts, top-4, biased
    # experts with the clamped SwiGLU, 64 heads of 64, 8 kv heads, sliding and full attention in turn),
    # with 8 of its 36 layers: its 36 x 128 bf16 experts are 229 GB, more than the GPU machine's host
    # memory; 8 layers are 51 GB, which an H100 holds resident.
    "gpt-oss-120b-8l": ("gpt_oss", dict(hidden_size=2880, intermediate_size=2880, num_hidden_layers=8,
                                        num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                                        num_local_experts=128, num_experts_per_tok=4, sliding_window=128,
                                        layer_types=["sliding_attention", "full_attention"] * 4,
                                        rms_norm_eps=1e-5, swiglu_limit=7.0)),
}
SMOKE_MODELS = {
    "smoke-qwen3-moe": ("qwen3_moe", dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                          head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)),
    "smoke-olmoe": ("olmoe", dict(hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                                  num_key_value_heads=4, num_experts=8, num_experts_per_tok=2)),
    "smoke-mixtral": ("mixtral", dict(hidden_size=64, intermediate_size=32, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                      num_experts_per_tok=2)),
    "smoke-gpt-oss": ("gpt_oss", dict(hidden_size=64, intermediate_size=32, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
                                      num_experts_per_tok=2, sliding_window=8,
                                      layer_types=["sliding_attention", "full_attention"] * 2)),
}
# The smoke models a plain --smoke-cpu run takes (smoke-gpt-oss on request:
# its biased experts have no by-hand row).
SMOKE_DEFAULT = ("smoke-qwen3-moe", "smoke-olmoe", "smoke-mixtral")


class RowSkipped(Exception):
    """A row that cannot run here; the message is the reason."""


# ---------------------------------------------------------------- the model


def build_model(torch, family: str, shape: dict, vocab: int, device, dtype, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(family, vocab_size=vocab, eos_token_id=None, bos_token_id=None, pad_token_id=0,
                               tie_word_embeddings=False, **shape)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def moe_blocks(model):
    """(block, experts, router) per MoE layer in module order, offloaded or
    not (prefetch.hf_blocks.experts_blocks)."""
    from prefetch.hf_blocks import experts_blocks

    return experts_blocks(model)


class ModelState:
    """What a row may change, saved once: each block's experts module, its
    parameter objects and their data, and the experts implementation.
    restore() puts all of it back (no copy: the saved data tensors are the
    originals) and checks it."""

    def __init__(self, model):
        from prefetch.hf_blocks import ExpertsLayout

        self.model = model
        self.layout = ExpertsLayout(moe_blocks(model)[0][1])
        self.NAMES = self.layout.names
        self.impl = model.config._experts_implementation
        # An offload wraps the model's forward in an instance attribute (Note
        # [One forward at a time] in prefetch/integration.py) bound to this
        # model: left there, a deep copy made later (a twin) would call this
        # model's forward, not its own. restore() takes it off.
        self.forward = model.__dict__.get("forward")
        self.saved = []
        for block, experts, _ in moe_blocks(model):
            params = {n: (getattr(experts, n), getattr(experts, n).data) for n in self.NAMES}
            self.saved.append((block, experts, params, (set(block.__dict__), set(experts.__dict__)),
                               experts.forward))
        first = self.saved[0][2][self.NAMES[0]][1]
        self.num_layers = len(self.saved)
        self.num_experts = self.layout.num_experts
        self.expert_bytes = sum(p.nbytes for p in self.layout.parts)
        self.total_bytes = self.expert_bytes * self.num_experts * self.num_layers
        self.device = first.device
        self.parked = None  # Note [Parked resident experts]: the HostExperts they come back from

    def cache_bytes(self, share: float) -> int:
        """An engine cache holding `share` of every layer's experts: whole
        cache slots (an expert's slot is its parts, each 256-byte aligned,
        so a layout with a bias of 2,880 bf16 values, gpt-oss, takes a few
        hundred bytes more than its tensors): share 1.0 then holds every
        expert, where share x the tensors' bytes fell a few experts short."""
        count = self.num_layers * self.num_experts
        return max(1, int(share * count + 1e-9)) * self.layout.slot_bytes

    def park(self, host) -> None:
        """Note [Parked resident experts]
        A row keeps the resident experts on the GPU (restore() puts them
        back without a copy), so an engine row at a cache of every expert
        holds them twice: Qwen3-30B-A3B's 54 GiB of experts, its cache of
        as much and a second resident copy for paired generates did not
        fit one H200, and batch 8 ran out of memory without the copy (runs
        92 and 102). With --park-resident-experts an engine row parks them
        before it offloads: each expert weight's storage is resized to
        nothing (its device memory is freed whoever else holds the tensor;
        run 108 logged the 54 GiB freed), torch's cached blocks go back to
        the driver (the engine's cache is one torch allocation of its whole
        budget, which the freed weights' cached blocks cannot serve), and
        the modules get meta stand-ins of the same shapes, which the
        offload reads; it is given `host`, the packed host copy the engine
        rows offload from (prefetch.host_experts.HostExperts). restore()
        regrows each storage and copies the weights back from `host`, one
        layer at a time, after the row's offload is gone; a restore that
        fails part-way (out of memory) resumes at the first layer not back. Only a model whose
        every expert `host` holds, in this model's shapes, each weight in a
        storage of its own, can park."""
        device = self.device
        if self.parked is not None:
            raise RuntimeError("the resident experts are parked already")
        if (host.num_layers != self.num_layers or host.num_experts != self.num_experts or host.experts is not None
                or host.experts_layout.key != self.layout.key):
            raise ValueError("the packed host experts are not every expert of this model: cannot park")
        for _, _, params, _, _ in self.saved:
            for _, data in params.values():
                if (data.storage_offset() or not data.is_contiguous()
                        or data.untyped_storage().nbytes() != data.numel() * data.element_size()):
                    raise ValueError("an expert weight shares its storage with other tensors: cannot park")
        import torch

        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        for _, experts, params, _, _ in self.saved:
            for name, (_, data) in params.items():
                experts._parameters[name] = torch.nn.Parameter(torch.empty_like(data, device="meta"),
                                                               requires_grad=False)
                data.untyped_storage().resize_(0)
        self.parked = host
        if device.type == "cuda":
            torch.cuda.empty_cache()
            freed = before - torch.cuda.memory_allocated(device)
            print(f"  parked the resident experts: {freed / 2**30:.1f} GiB freed on {device}",
                  file=sys.stderr, flush=True)

    def _unpark(self) -> None:
        """Note [Parked resident experts]: the parked experts back on their
        device from the host copy, a layer's rows in one copy each."""
        import gc

        import torch

        host = self.parked
        device = self.device
        gc.collect()  # the row's offload and its cache, unreachable once its attributes are gone
        if device.type == "cuda":
            torch.cuda.empty_cache()
        count = self.num_experts
        for layer, (_, _, params, _, _) in enumerate(self.saved):
            if all(data.untyped_storage().nbytes() for _, data in params.values()):
                continue  # back already: a restore that failed part-way resumes after it
            first = int(host._row[layer, 0])
            if not (host._row[layer] == first + np.arange(count)).all():
                raise RuntimeError(f"layer {layer}'s experts are not in order in the host copy")
            rows = host.buffer[first * host.stride : (first + count) * host.stride].to(device).view(count, host.stride)
            for part, name in zip(host.layout, self.NAMES):
                data = params[name][1]
                data.untyped_storage().resize_(data.numel() * data.element_size())
                data.copy_(rows[:, part.offset : part.offset + part.nbytes].view(part.dtype)
                           .unflatten(1, tuple(part.shape)))
            del rows
        self.parked = None  # only now: a restore that failed part-way is resumed, not skipped

    def restore(self):
        with contextlib.suppress(ImportError):
            from accelerate.hooks import remove_hook_from_module

            for _, experts, _, _, _ in self.saved:
                remove_hook_from_module(experts, recurse=True)
        for block, experts, _, (block_attrs, experts_attrs), _ in self.saved:
            block.experts = experts
            for module, attrs in ((block, block_attrs), (experts, experts_attrs)):
                for key in [k for k in module.__dict__ if k not in attrs]:
                    delattr(module, key)  # what a row added (contexts, wrapped forwards)
        if self.parked is not None:
            self._unpark()
        for _, experts, params, _, _ in self.saved:
            for name, (param, data) in params.items():
                param.data = data
                experts._parameters[name] = param
        self.model.config._experts_implementation = self.impl
        if self.forward is None:
            self.model.__dict__.pop("forward", None)
        else:
            self.model.forward = self.forward
        self.check()

    def check(self):
        for block, experts, params, (block_attrs, experts_attrs), forward in self.saved:
            ok = block.experts is experts and experts.forward == forward
            ok = ok and set(block.__dict__) == block_attrs and set(experts.__dict__) == experts_attrs
            for name, (param, data) in params.items():
                live = experts._parameters.get(name)
                ok = ok and live is param and live.data.data_ptr() == data.data_ptr()
            if not ok:
                raise RuntimeError("the model could not be restored to its resident state")
        if self.model.config._experts_implementation != self.impl:
            raise RuntimeError("experts implementation not restored")
        if self.model.__dict__.get("forward") is not self.forward:
            raise RuntimeError("the model's forward not restored")


# ------------------------------------------------------------- generation


def gpu_memory_report(torch, device, top: int = 6) -> str:
    """What holds the device's memory, for a row that ran out of it: torch's
    allocated and reserved bytes, the driver's free bytes, and the largest
    live CUDA tensors Python can reach (shape, GiB, and what refers to
    each: the attribute or local name where one is found). Slow (walks
    every object): called only after an out-of-memory error."""
    try:
        return _gpu_memory_report(torch, device, top)
    except Exception as exc:  # noqa: BLE001 - a diagnostic never replaces the error it explains
        return f"(no memory report: {exc!r})"


def _gpu_memory_report(torch, device, top: int) -> str:
    import gc

    gc.collect()
    free, total = torch.cuda.mem_get_info(device)
    lines = [f"allocated {torch.cuda.memory_allocated(device) / 2**30:.2f} GiB, reserved "
             f"{torch.cuda.memory_reserved(device) / 2**30:.2f} GiB, free {free / 2**30:.2f} of {total / 2**30:.2f}"]
    seen = {}
    objects = gc.get_objects()
    for obj in objects:
        if isinstance(obj, torch.Tensor) and obj.is_cuda:
            with contextlib.suppress(Exception):
                storage = obj.untyped_storage()
                key = storage.data_ptr()
                if storage.nbytes() and key not in seen:
                    seen[key] = (storage.nbytes(), obj)
    del objects
    largest = sorted(seen.values(), key=lambda t: -t[0])[:top]
    ignore = {id(seen), id(largest), *(id(t) for t in seen.values())}
    for nbytes, obj in largest:
        chains = referrer_chains(obj, ignore)
        lines.append(f"{nbytes / 2**30:.2f} GiB {tuple(obj.shape)} {obj.dtype} <- {' | '.join(chains) or 'nothing'}")
    lines.append(f"{len(seen)} CUDA storages reachable, {sum(n for n, _ in seen.values()) / 2**30:.2f} GiB; "
                 "by kind:")
    lines.extend("  " + line for line in storage_kinds(seen.values(), top))
    return "\n    ".join(lines)


def storage_kinds(storages, top: int = 6) -> list:
    """(nbytes, tensor) pairs grouped by the tensor's shape, dtype and
    storage size: the `top` groups holding the most bytes, largest first,
    as "count x shape dtype (GiB each): GiB". The largest storages alone
    miss many middle-sized ones (run 109: 26 GiB of 138 not in its top
    six)."""
    groups = {}
    for nbytes, t in storages:
        key = (tuple(t.shape), str(t.dtype).replace("torch.", ""), nbytes)
        groups[key] = groups.get(key, 0) + 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[0][2] * kv[1])[:top]
    return [f"{count} x {shape} {dtype} ({nbytes / 2**30:.3f} GiB each): {count * nbytes / 2**30:.2f} GiB"
            for (shape, dtype, nbytes), count in ranked]


def referrer_chains(obj, ignore=(), depth: int = 5, width: int = 3) -> list:
    """Who keeps `obj` alive, as up to `width` chains of at most `depth`
    referrers ("list <- PrefetchHandle <- dict[handle] <- Controller"):
    each step names the referrer's type (a dict the key it holds the
    object under, a frame its function) and follows its first referrer.
    `ignore`: ids of containers not to follow (the caller's own). For
    diagnostics: an object Python cannot see the holder of ends its chain."""
    import gc
    import types

    skip = set(ignore)
    here = sys._getframe()
    skip.add(id(here))

    def describe(ref, held):
        if isinstance(ref, types.FrameType):
            return f"frame {ref.f_code.co_name}"
        if isinstance(ref, dict):
            keys = [k for k, v in ref.items() if v is held][:2]
            return f"dict[{', '.join(map(str, keys))}]"
        return type(ref).__name__

    def referrers(o):
        return [r for r in gc.get_referrers(o) if id(r) not in skip and r is not here]

    chains = []
    firsts = referrers(obj)
    skip.add(id(firsts))
    for ref in firsts[:width]:
        chain, held, seen_ids = [describe(ref, obj)], ref, {id(obj), id(ref)}
        for _ in range(depth - 1):
            nxt = [r for r in referrers(held) if id(r) not in seen_ids and r is not firsts]
            if not nxt:
                break
            chain.append(describe(nxt[0], held))
            seen_ids.add(id(nxt[0]))
            held = nxt[0]
            del nxt
        chains.append(" <- ".join(chain))
    return chains


def make_sync(torch, cuda: bool, scope: str = "device"):
    """A wait for the GPU: "device" waits for every stream (the engine's
    copy streams too, speculative copies included); "stream" waits for the
    current stream only, the compute the next token needs, which is what a
    caller reading each token (a streamer) waits for."""
    if scope not in ("device", "stream"):
        raise ValueError(f"scope must be 'device' or 'stream', not {scope!r}")
    if not cuda:
        return lambda: None
    if scope == "stream":
        return lambda: torch.cuda.current_stream().synchronize()
    return torch.cuda.synchronize


class StepTimer:
    """A logits processor that reads the clock (after `sync`, a make_sync)
    once per generated token; `on_first` runs at the first call (the
    prefill's logits)."""

    def __init__(self, sync, on_first=None, on_step=None):
        self.sync = sync
        self.on_first = on_first
        self.on_step = on_step
        self.times = []

    def __call__(self, input_ids, scores):
        self.sync()
        self.times.append(time.perf_counter())
        if len(self.times) == 1 and self.on_first is not None:
            self.on_first()
        if self.on_step is not None:
            self.on_step()
        return scores


def generate(torch, model, ids, new_tokens: int, sync, timer=None):
    """Greedy generate of exactly `new_tokens`; returns (new ids on the CPU,
    start time, end time), both after a sync."""
    from transformers import LogitsProcessorList

    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                  do_sample=False, pad_token_id=0)
    if timer is not None:
        kwargs["logits_processor"] = LogitsProcessorList([timer])
    sync()
    t0 = time.perf_counter()
    out = model.generate(ids, **kwargs)
    sync()
    t1 = time.perf_counter()
    return out[:, ids.shape[1]:].cpu(), t0, t1


def warm_lengths(torch, model, prompts, new_tokens: int, sync) -> None:
    """Note [Warm every sequence length]
    The first decode step of a process at a sequence length it has not run
    yet is slow, and so is every step after it that grows the sequence
    further: on the H200 (tools/warmup_probe.py, run 33, OLMoE-1B-7B shapes,
    batch 1) a measured generate after an 8-token warm-up ran its first 7
    tokens at 19 ms and every later one at 53, while the next generate of
    the same length ran them all at 18. (The CUDA allocator made 3 segments
    in the slow one, the SM clock stayed at 1,980 MHz: the cost follows the
    attention's new shapes.) So a benchmark process first runs, with the
    model resident, a generate of each prompt in `prompts` (other ids, same
    shapes as the measured ones) for `new_tokens`: every row then runs
    lengths the process has seen, whichever row comes first. A rank of
    expert parallel that runs no resident row needs this as much."""
    for ids in prompts:
        generate(torch, model, ids, new_tokens, sync)


class RoutingRecorder:
    """Forward hooks on the routers: keeps each call's top-k index tensor on
    its device (no sync while generating); steps() turns them into a routing
    trace (per step, per layer, sorted distinct experts)."""

    def __init__(self, model):
        self.calls = []
        self.handles = []
        for layer, (_, _, gate) in enumerate(moe_blocks(model)):
            self.handles.append(gate.register_forward_hook(
                lambda module, args, out, layer=layer: self.calls.append((layer, out[-1].detach()))))
        self.layers = len(self.handles)

    def mark(self) -> int:
        return len(self.calls)

    def distinct_accesses(self, start: int = 0, end: int | None = None) -> int:
        return sum(len(set(idx.flatten().tolist())) for _, idx in self.calls[start:end])

    def steps(self) -> list:
        out = []
        for i, (layer, idx) in enumerate(self.calls):
            if i % self.layers == 0:
                out.append([[] for _ in range(self.layers)])
            out[-1][layer] = sorted(set(idx.flatten().tolist()))
        return out

    def close(self):
        for h in self.handles:
            h.remove()
        self.handles = []


# ------------------------------------------------------------ the modes
