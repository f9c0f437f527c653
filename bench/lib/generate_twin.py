"""BM6's resident twin (Note [Paired generates]): a second resident copy of
the model that each row's paired generates run against, made where the
device has room for it and dropped when a row runs out of memory beside it."""
from __future__ import annotations

import copy
import sys
from typing import TYPE_CHECKING

from bench.lib.generate_model import generate

if TYPE_CHECKING:
    from bench.lib.generate_rows import Block


def make_twin(block: Block) -> None:
    """Note [Paired generates]
    Best-of and adjacent ratios still moved by 0.1-0.3 between cells that
    should match (run 80): the H200 host's slow spells last seconds, as
    long as a row's three generates, and the resident generates that follow
    the row land in another spell. With --paired N a block keeps a second
    resident copy of the model (the twin: the same weights, never
    offloaded), and each row, after its measured and repeated generates,
    runs N pairs of --paired-tokens generates: the row's model, then the
    twin (odd pairs the twin first), each pair within a second or so. A
    pair's ratio compares two generates made in the same spell most of the
    time, and x_paired, the median of the N ratios, drops the pairs a
    spell change split. The resident row is paired with the twin too: its
    x_paired is the estimator's own bias and spread (ideally 1.00). Both
    copies are on the GPU at once, so the twin is made only where the
    device has room for it and the block's largest cache (Qwen3-30B-A3B's
    57 GiB twice and a cache of every expert do not fit a 140 GiB H200; at
    a quarter they should); without it x_paired is null with the
    reason. The room is an estimate (the saved resident experts stay on the
    GPU during a row unless --park-resident-experts frees them for the
    engine rows, Note [Parked resident experts] in bench/lib/generate_model.py,
    and a row needs more than its cache): at Qwen3-30B-A3B
    and a quarter the offloaded rows ran out of memory beside the twin (run
    85), so a row that runs out of memory while the twin exists frees it
    and runs again, and the rows from there on are unpaired (the block's
    twin_reason says which row). The twin's generated ids are checked
    against the resident row's."""
    args, torch, model = block.args, block.torch, block.model
    if not args.paired:
        return
    if block.cuda:
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        need = weights + max(args.shares, default=0) * block.state.total_bytes + (2 << 30)
        if args.park_resident_experts:  # an engine row frees them (Note [Parked resident experts])
            need -= block.state.total_bytes
        free, _ = torch.cuda.mem_get_info(block.device)
        if free < need:
            block.twin_reason = (f"not measured: a second resident copy and the largest cache need "
                                 f"{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")
            return
    block.twin = copy.deepcopy(model)
    block.twin_ids = generate(torch, block.twin, block.prompt, args.new_tokens, block.sync)[0]
    block.twin_reason = None


def drop_twin(block: Block, reason: str) -> None:
    """Frees the twin; the rows after this are not paired (`reason`)."""
    print(f"  twin {reason}", file=sys.stderr, flush=True)
    block.twin = None
    block.twin_reason = reason
    if block.cuda:
        block.torch.cuda.empty_cache()
