"""The transformers releases prefetch supports, and what a user meets at offload: a release whose experts
interface differs from what the integration expects is refused at offload
with a RuntimeError naming the installed version and the tested range,
never an AttributeError inside a forward; one outside the range whose
interface looks right is offloaded with a warning; experts dispatched
through an interface of their own are refused with NotImplementedError."""
import copy
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import transformers.integrations.moe as moe  # noqa: E402

import prefetch.hf_blocks as hf_blocks  # noqa: E402
from prefetch.hf_blocks import TRANSFORMERS_TESTED, ExpertsLayout, find_hf_moe_blocks  # noqa: E402
from prefetch.integration import offload_moe_experts, offloaded_experts  # noqa: E402

RANGE = f"{TRANSFORMERS_TESTED[0]} to {TRANSFORMERS_TESTED[1]}"


def tiny():
    cfg = transformers.OlmoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=24, num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def budget(model):
    return 4 * ExpertsLayout(find_hf_moe_blocks(model)[0][1]).slot_bytes


def test_the_installed_release_is_in_the_tested_range_and_the_extra_says_the_same():
    import pathlib
    import re

    key = hf_blocks._version_key
    assert key(TRANSFORMERS_TESTED[0]) <= key(transformers.__version__) <= key(TRANSFORMERS_TESTED[1])
    text = (pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text()
    extra = re.search(r'^hf = \[(.*)\]$', text, re.M)
    lo, hi = TRANSFORMERS_TESTED
    assert extra is not None and extra.group(1) == f'"transformers>={lo},<={hi}"'



def test_a_release_without_the_interface_is_refused_naming_the_version_and_the_range(monkeypatch):
    model = tiny()
    blocks_before = [id(e) for _, e, _ in find_hf_moe_blocks(model)]
    monkeypatch.delattr(moe, "ALL_EXPERTS_FUNCTIONS")
    with pytest.raises(RuntimeError) as err:
        offload_moe_experts(model, device_budget_bytes=budget(model), backend="host", progress=False)
    assert transformers.__version__ in str(err.value) and RANGE in str(err.value)
    monkeypatch.undo()
    assert not offloaded_experts(model) and [id(e) for _, e, _ in find_hf_moe_blocks(model)] == blocks_before


def test_an_interface_that_is_not_the_mapping_prefetch_expects_is_refused(monkeypatch):
    model = tiny()
    monkeypatch.setattr(moe, "ALL_EXPERTS_FUNCTIONS", object())
    with pytest.raises(RuntimeError, match=f"transformers {transformers.__version__}.*{RANGE}"):
        offload_moe_experts(model, device_budget_bytes=budget(model), backend="host", progress=False)


def test_a_dispatcher_prefetch_does_not_know_is_refused_at_offload(monkeypatch):
    # The decorator's flags are there, but the forward is a wrapper whose
    # interface prefetch cannot find: refused at once, not an error mid-forward.
    model = tiny()
    _, experts, _ = find_hf_moe_blocks(model)[0]
    cls = type(experts)

    def forward(self, *args, **kwargs):
        return cls.forward.__wrapped__(self, *args, **kwargs)

    forward.__wrapped__ = cls.forward.__wrapped__
    monkeypatch.setattr(cls, "forward", forward)
    with pytest.raises(RuntimeError, match=f"{cls.__name__}.*transformers {transformers.__version__}.*{RANGE}"):
        offload_moe_experts(model, device_budget_bytes=budget(model), backend="host", progress=False)
    assert not offloaded_experts(model)


def test_experts_with_an_interface_of_their_own_are_not_implemented(monkeypatch):
    # Quantized experts (FP8) dispatch through their own interface: refused
    # with NotImplementedError saying so.
    model = tiny()
    _, experts, _ = find_hf_moe_blocks(model)[0]
    cls = type(experts)
    own = moe.ExpertsInterface()
    decorated = moe.use_experts_implementation(type("OwnExperts", (torch.nn.Module,), {
        "__init__": lambda self, config: torch.nn.Module.__init__(self),
        "forward": lambda self, h, i, w: h}), experts_interface=own)
    monkeypatch.setattr(cls, "forward", decorated.forward)
    with pytest.raises(NotImplementedError, match="experts interface of its own"):
        offload_moe_experts(model, device_budget_bytes=budget(model), backend="host", progress=False)
    assert not offloaded_experts(model)


def test_a_release_outside_the_range_with_the_expected_interface_warns_once_and_runs(monkeypatch):
    ref = tiny()
    model = copy.deepcopy(ref)
    # sys.modules': transformers' lazy module may have replaced the object imported above
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "9.0.0")
    monkeypatch.setattr(hf_blocks, "_warned_versions", set())
    with pytest.warns(UserWarning, match=f"tested with transformers {RANGE}; 9.0.0 is installed"):
        ctl = offload_moe_experts(model, device_budget_bytes=budget(model), backend="host", progress=False)
    try:
        ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(0))
        kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=0)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # said once, not again at every forward
            assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))
    finally:
        ctl.close()


def test_a_model_whose_controller_was_closed_says_so_and_how_to_start_again():
    model = tiny()
    ctl = offload_moe_experts(model, device_budget_bytes=budget(model), backend="host", progress=False)
    ctl.close()
    ids = torch.randint(0, 64, (1, 4), generator=torch.Generator().manual_seed(0))
    import prefetch

    with pytest.raises(prefetch.HandleClosedError, match="controller that is now closed.*offload it anew"):
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False, pad_token_id=0)
    with pytest.raises(prefetch.InvalidArgumentError, match="by a controller that is closed"):
        offload_moe_experts(model, device_budget_bytes=budget(model), backend="host", progress=False)
