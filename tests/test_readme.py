"""Every ```python block of README.md and docs/api.md runs as written (CPU
only here; the blocks use CUDA only when it is present), and does what its
comments say."""
import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parent.parent / "README.md"
API = README.parent / "docs" / "api.md"


def python_blocks(docs=(README, API)) -> list[str]:
    return [b for doc in docs for b in re.findall(r"^```python\n(.*?)^```$", doc.read_text(), re.S | re.M)]


def check_end_to_end(ns, printed):
    from prefetch.integration import offloaded_experts

    model, prompt, out = ns["model"], ns["prompt"], ns["out"]
    offloaded = offloaded_experts(model)
    assert len(offloaded) == ns["config"].num_hidden_layers  # every MoE block reads the cache
    assert torch.equal(out[:, : prompt.shape[1]], prompt)
    assert prompt.shape[1] < out.shape[1] <= prompt.shape[1] + 8
    assert "'hit_rate':" in printed and "'bytes_copied':" in printed
    copied = int(re.search(r"'bytes_copied': (\d+)", printed).group(1))
    assert copied > 0  # experts moved through the engine
    assert ns["ctl"].handle.closed


def check_by_hand(ns, printed):
    match = re.search(r"^(\d+) of (\d+) experts were in the cache when acquired$", printed, re.M)
    assert match, printed
    hits, acquires = int(match.group(1)), int(match.group(2))
    assert acquires == 2 * ns["num_layers"]  # two routed experts a layer
    assert 0 <= hits <= ns["num_layers"] - 1  # at most the prefetched ones (timing decides)
    hidden = ns["hidden"]
    assert hidden.shape == (1, ns["hidden_size"]) and torch.isfinite(hidden).all()
    assert ns["handle"].closed


CHECKS = {"offload_moe_experts": check_end_to_end, "ExpertPrefetcher(handle)": check_by_hand}


def test_the_readme_has_the_examples_this_file_checks():
    blocks = python_blocks((README,))
    for key in CHECKS:
        assert sum(key in b for b in blocks) == 1, f"no README block (or several) with {key}"


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_python_block_runs_as_written(index, capsys):
    block = python_blocks()[index]
    if "transformers" in block:
        pytest.importorskip("transformers")
    torch.manual_seed(index)
    ns = {"__name__": f"readme_block_{index}"}
    exec(compile(block, f"README.md python block {index}", "exec"), ns)
    printed = capsys.readouterr().out
    checks = [check for key, check in CHECKS.items() if key in block]
    for check in checks:
        check(ns, printed)
