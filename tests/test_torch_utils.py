"""The client's torch pieces without a daemon: empty_parameters + load_into_module (any
mapping of tensors will do) and the attach reply's tensor table -> views."""

import pytest
import torch
from torch import nn

from weightcache import empty_parameters, load_into_module
from weightcache.client.mapping import TORCH_DTYPES, tensor_views
from weightcache.errors import BadRequest


class Rotary(nn.Module):
    """A parameter, a persistent buffer, and a non-persistent buffer computed at init
    (like a transformer's rotary frequencies): checkpoints hold the first two only."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("scale", torch.ones(8))
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.scale + self.inv_freq.repeat(2)


def test_empty_parameters_builds_parameters_on_meta_and_buffers_for_real():
    torch.manual_seed(0)
    ref = Rotary()
    with empty_parameters():
        skeleton = Rotary()
    assert skeleton.proj.weight.is_meta and skeleton.proj.bias.is_meta
    assert isinstance(skeleton.proj.weight, nn.Parameter)
    assert not skeleton.inv_freq.is_meta and torch.equal(skeleton.inv_freq, ref.inv_freq)
    assert not Rotary().proj.weight.is_meta  # the patch is gone after the block
    with empty_parameters():
        tagged = nn.Parameter(torch.ones(2), requires_grad=False)
        tagged.shard_dim = 0  # frameworks tag parameters before registering them
        holder = nn.Module()
        holder.register_parameter("w", tagged)
    assert holder.w.is_meta and holder.w.shard_dim == 0 and not holder.w.requires_grad

    weights = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    model = load_into_module(skeleton, weights)
    x = torch.randn(3, 8)
    assert torch.equal(model(x), ref(x))
    assert model.proj.weight.data_ptr() == weights["proj.weight"].data_ptr()


def test_loaded_module_refuses_load_state_dict_copies_into_its_views():
    torch.manual_seed(0)
    ref = Rotary()
    weights = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    model = load_into_module(Rotary(), weights)
    before = weights["proj.weight"].clone()
    with pytest.raises(RuntimeError, match=r"^Rotary: .*read-only"):
        model.load_state_dict(Rotary().state_dict())
    with pytest.raises(RuntimeError, match=r"^Linear: .*read-only"):
        model.proj.load_state_dict(nn.Linear(8, 8).state_dict())
    assert torch.equal(weights["proj.weight"], before)  # nothing was copied
    other = {k: v.detach().clone() for k, v in Rotary().state_dict().items()}
    model.load_state_dict(other, assign=True)  # assigning new tensors is fine
    assert model.proj.weight.data_ptr() == other["proj.weight"].data_ptr()
    load_into_module(model, weights)  # and so is loading again, without stacking hooks
    assert len(model.proj._load_state_dict_pre_hooks) == 1


def test_empty_parameters_restores_the_patch_after_an_error():
    with pytest.raises(RuntimeError, match="boom"), empty_parameters():
        raise RuntimeError("boom")
    assert not nn.Linear(2, 2).weight.is_meta


def test_load_into_module_refuses_to_leave_parameters_on_meta():
    torch.manual_seed(0)
    weights = {k: v for k, v in Rotary().state_dict().items() if k != "proj.bias"}
    with empty_parameters():
        skeleton = Rotary()
    with pytest.raises(ValueError, match=r"missing keys: \['proj\.bias'\]"):
        load_into_module(skeleton, weights)
    with pytest.raises(ValueError, match=r"left on the meta device \(not in the weights\): \['proj\.bias'\]"):
        load_into_module(skeleton, weights, strict=False)
    assert skeleton.proj.weight.is_meta  # refused before touching the module


def test_tensor_views_are_the_slices_of_the_arena():
    rows, offset = [], 0
    for i, (dtype, shape) in enumerate([("BF16", [64, 32]), ("F32", []), ("U8", [3]), ("F32", [5, 1, 2]),
                                         ("I64", [7]), ("BF16", [0, 4]), ("F8_E4M3", [9])]):
        itemsize = TORCH_DTYPES[dtype].itemsize
        offset += -offset % itemsize  # aligned, as the daemon lays arenas out
        nbytes = itemsize * torch.Size(shape).numel()
        rows.append([f"t{i}", dtype, shape, offset, nbytes])
        offset += nbytes
    slab = torch.randint(0, 256, (offset + 1,), dtype=torch.uint8)  # an odd length: views of the prefix
    views = tensor_views(slab, rows)
    for name, dtype, shape, off, nbytes in rows:
        ref = slab[off : off + nbytes].view(TORCH_DTYPES[dtype]).view(shape)
        got = views[name]
        assert got.dtype == ref.dtype and got.shape == ref.shape and got.is_contiguous()
        assert got.data_ptr() == ref.data_ptr() or nbytes == 0
        assert torch.equal(got.view(-1).view(torch.uint8), ref.view(-1).view(torch.uint8))


@pytest.mark.parametrize("row", [["x", "BF16", [2], 1, 4],      # misaligned for its dtype
                                 ["x", "BF16", [3], 0, 4],      # nbytes disagrees with the shape
                                 ["x", "F32", [2], 12, 8]])     # runs past the arena
def test_tensor_views_refuse_rows_that_do_not_fit(row):
    with pytest.raises(BadRequest, match="does not fit"):
        tensor_views(torch.zeros(16, dtype=torch.uint8), [row])


def test_key_mismatch_errors_say_the_way_out():
    torch.manual_seed(0)
    weights = {f"model.{k}": v.detach().clone() for k, v in Rotary().state_dict().items()}
    with empty_parameters():
        skeleton = Rotary()
    with pytest.raises(ValueError, match=r"differ from the module's by a prefix: pass \{k\.removeprefix\('model\.'\): v for k, v in "):
        load_into_module(skeleton, weights)
    fixed = {k.removeprefix("model."): v for k, v in weights.items()}  # what the message says
    assert load_into_module(skeleton, fixed).proj.weight.data_ptr() == weights["model.proj.weight"].data_ptr()
    nested = nn.Module()
    with empty_parameters():
        nested.body = Rotary()
    with pytest.raises(ValueError, match=r"by a prefix: pass \{'body\.' \+ k: v for k, v in "):
        load_into_module(nested, fixed)
    with empty_parameters():
        skeleton = Rotary()
    renamed = {"w": fixed["proj.weight"], "b": fixed["proj.bias"], "s": fixed["scale"]}
    with pytest.raises(ValueError, match=r"Way out: rename the weights' keys to the module's"):
        load_into_module(skeleton, renamed)
    with empty_parameters():
        skeleton = Rotary()
    with pytest.raises(ValueError, match=r"missing keys: \['scale'\]. Way out: the weights do not hold these: build the skeleton "
                                         r"from the checkpoint's own config"):
        load_into_module(skeleton, {k: v for k, v in fixed.items() if k != "scale"})
    with pytest.raises(ValueError, match=r"unexpected keys: \['extra'\]. Way out: strict=False leaves"):
        load_into_module(skeleton, {**fixed, "extra": fixed["scale"]})
    assert load_into_module(skeleton, {**fixed, "extra": fixed["scale"]}, strict=False).scale.data_ptr() == fixed["scale"].data_ptr()


def test_a_dtype_mismatch_outside_transformers_says_how_to_build_the_skeleton():
    weights = {k: v.to(torch.bfloat16) for k, v in Rotary().state_dict().items()}
    with empty_parameters():
        skeleton = Rotary()
    with pytest.raises(ValueError, match=r"proj\.weight: dtype torch\.bfloat16 in the weights, torch\.float32 in the module.*"
                                         r"Way out: build the skeleton in the checkpoint's dtype: .*module\.to\(torch\.bfloat16\)"):
        load_into_module(skeleton, weights)
