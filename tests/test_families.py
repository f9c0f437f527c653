"""Every model family the installed transformers routes through its
experts-implementation interface, offloaded: a tiny random model of each
(tests/hf_families.py) with a cache of a third of its experts' bytes gives
the untouched model's greedy tokens, and with a cache of a whole layer's
(no layer then runs in pieces, so the model's own implementation runs on
the same bytes) its logits, bit for bit; a family that does not generate
(an encoder) compares its forward instead. A family that cannot be
offloaded must raise NotImplementedError at offload. Each family's result
is recorded; the last test checks that docs/families.md, the table the
README links, says what this run found for the installed release
(tools/family_table.py writes that table)."""
import copy
import json
import os
import pathlib

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from prefetch.hf_blocks import ExpertsLayout, experts_blocks  # noqa: E402
from prefetch.integration import offload_moe_experts  # noqa: E402
from tests.hf_families import FAMILIES, build_tiny, unsupported_reason  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
TABLE = ROOT / "docs" / "families.md"
RESULTS: dict = {}  # family -> (status, detail), filled by test_family


def _generate(model, ids, steps):
    # Seeded: a block-diffusion family's generate draws from torch's global
    # generator even when greedy (its masks), so both models draw the same.
    torch.manual_seed(1234)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                         pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences, out.logits


def _forward(model, ids):
    torch.manual_seed(1234)  # as _generate
    with torch.no_grad():
        return model(ids).logits


def _record(family, status, detail=""):
    RESULTS[family] = (status, detail)
    out = os.environ.get("PREFETCH_FAMILY_RESULTS")
    if out:  # tools/family_table.py collects these
        path = pathlib.Path(out)
        data = json.loads(path.read_text()) if path.exists() else {}
        data.setdefault(transformers.__version__, {})[family] = [status, detail]
        path.write_text(json.dumps(data, indent=1, sort_keys=True))


@pytest.mark.parametrize("family", FAMILIES)
def test_family(family):
    try:
        status, detail = _offload_and_compare(family)
    except Exception as err:
        _record(family, "failed", f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
        raise
    _record(family, status, detail)


def _offload_and_compare(family) -> tuple[str, str]:
    ref = build_tiny(family, seed=0)
    blocks = experts_blocks(ref)
    layout = ExpertsLayout(blocks[0][1])
    gen = torch.Generator().manual_seed(len(family))
    vocab = min(ref.config.get_text_config().vocab_size, 100)
    prompt = torch.randint(1, vocab, (1, 6), generator=gen)
    # A third of the model's experts' bytes (at least a decode step's two
    # experts): layers evict each other, and where that is less than a
    # layer's experts a prompt's layer runs in pieces.
    third = max(len(blocks) * layout.num_experts // 3, 2) * layout.slot_bytes
    # Every expert of a layer and one more: no layer ever runs in pieces, so
    # the model's own implementation runs on the same bytes as the untouched
    # model's, and the logits must be the same bits.
    whole_layer = (layout.num_experts + 1) * layout.slot_bytes
    for budget, check in ((third, "tokens"), (whole_layer, "logits")):
        model = copy.deepcopy(ref)
        try:
            ctl = offload_moe_experts(model, device_budget_bytes=budget, backend="host", progress=False)
        except NotImplementedError as err:
            assert str(err), "a NotImplementedError must say what is missing"
            return "NotImplementedError", str(err).splitlines()[0]
        try:
            if not ref.can_generate():  # an encoder (unsupported_reason says which): its forward instead
                assert unsupported_reason(family) is not None
                want, got = _forward(ref, prompt), _forward(model, prompt)
                assert torch.equal(got.argmax(-1), want.argmax(-1)) if check == "tokens" else torch.equal(got, want)
                continue
            want, want_logits = _generate(ref, prompt, 5)
            got, got_logits = _generate(model, prompt, 5)
            assert torch.equal(got, want), f"{family}: tokens differ from the untouched model ({check} budget)"
            if check == "logits":
                if want_logits is None:  # a generate that keeps no logits (block diffusion): the forward's
                    want_logits, got_logits = [_forward(ref, prompt)], [_forward(model, prompt)]
                for step, (a, b) in enumerate(zip(got_logits, want_logits)):
                    assert torch.equal(a, b), f"{family}: logits of step {step} differ ({(a - b).abs().max()})"
            report = ctl.report()
            assert report["layers_run"] > 0 and report["copies"] > 0, report
        finally:
            ctl.close()
    note = "" if ref.can_generate() else " (forward only: the family does not generate)"
    return "passes", layout.describe() + note


def test_the_family_table_says_what_this_run_found():
    """docs/families.md holds, per family, the status on each tested
    transformers release; the column of the installed release must match
    what test_family found in this session (run after it)."""
    if len(RESULTS) != len(FAMILIES):
        pytest.skip("test_family did not run for every family in this session")
    text = TABLE.read_text(encoding="utf-8")
    version = transformers.__version__
    header = next(line for line in text.splitlines() if line.startswith("| family"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert version in columns, f"docs/families.md has no column for transformers {version}: run tools/family_table.py"
    col = columns.index(version)
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| `") and len(cells) == len(columns):
            rows[cells[0].strip("`")] = cells[col]
    missing = sorted(set(FAMILIES) - set(rows))
    assert not missing, f"docs/families.md lacks {missing}: run tools/family_table.py"
    wrong = {f: (rows[f], status) for f, (status, _) in RESULTS.items() if not rows[f].startswith(status)}
    assert not wrong, f"docs/families.md disagrees with this run (table, found): {wrong}"
    # README.md's list: the installed release's line names every family under what this run found.
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    line = next((x for x in readme.splitlines() if x.startswith(f"- transformers {version}: ")), None)
    assert line is not None, f"README.md lists no families for transformers {version}: run tools/family_table.py"
    listed = {}
    for part in line.split(": ", 1)[1].split("; "):
        status = part.split(": ", 1)[0].split(" ", 1)[1]
        for name in part.split(": ", 1)[1].split(", "):
            listed[name.strip("`")] = status
    assert listed == {f: status for f, (status, _) in RESULTS.items()}, "README.md's family list disagrees"
