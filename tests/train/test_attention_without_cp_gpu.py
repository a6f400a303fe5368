"""The cp 1 attention path (`adapters/hf_attention.py`) on CUDA in bf16, judged against float64 as
`cpcompile/parity.py` judges CP: its error on logits, loss and every parameter gradient may be at
most 1.5x (+ a floor) the error of transformers' own bf16 SDPA path with its dense mask. Padded and
packed batches, at lengths that give FlexAttention full, partial and empty 128-blocks; the right-padded
batch runs the unmasked kernel (cuDNN/flash), the others FlexAttention at head size 64 and flash's
variable-length kernel at 256. The CPU proof in float64 is
`test_attention_without_cp.py`."""
from __future__ import annotations

import copy

import pytest
import torch

from cpcompile.adapters.hf_attention import route_attention_without_cp
from cpcompile.documents import causally_unmasked_keys, mark_unmasked, positions_from_starts
from cpcompile.parity import relative_error, within_precision
from cpcompile.trainer.parallelize import decoder_layers

S, VOCAB = 640, 512  # 5 blocks of 128 and a ragged end


def _model(seed: int, head_dim: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, attn_implementation="sdpa")
    return Qwen3ForCausalLM(config).cuda()


def _batch(kind: str, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, S), generator=gen)
    positions = torch.arange(S).expand(2, S).clone()
    out = {"input_ids": ids}
    if kind in ("right_padded", "left_padded"):
        mask = torch.ones(2, S, dtype=torch.long)
        cut = int(0.1 * S) + 3  # 10% padding and a ragged block edge
        if kind == "right_padded":
            mask[0, -cut:] = 0
        else:
            mask[1, :cut] = 0
        out["attention_mask"] = mask
    if kind == "packed":  # documents of 1 token to several blocks, edges on and off block bounds
        starts = torch.zeros(2, S, dtype=torch.bool)
        starts[:, 0] = True
        starts[0, [1, 128, 300, 301, 511]] = True
        starts[1, torch.randint(1, S, (9,), generator=gen)] = True
        positions = torch.stack([positions_from_starts(row) for row in starts])
    out["position_ids"] = positions
    return {k: v.cuda() for k, v in out.items()}


def _run(model, inputs: dict, unmasked: bool | None, dtype: torch.dtype):
    inputs = {k: v.clone() for k, v in inputs.items()}
    if unmasked is not None:
        mark_unmasked(inputs["position_ids"], unmasked)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float64):
        logits = model(**inputs, use_cache=False).logits
    real = inputs.get("attention_mask", torch.ones_like(inputs["input_ids"])).bool()
    loss = torch.nn.functional.cross_entropy(logits[real].double(), inputs["input_ids"][real].roll(-1))
    loss.backward()
    return [logits[real], loss.detach()] + [p.grad.clone() for p in model.parameters()]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind, head_dim", [("unpadded", 64), ("right_padded", 64), ("left_padded", 64),
                                            ("packed", 64), ("left_padded", 256), ("packed", 256)])
def test_cp1_attention_path_bf16_judged_against_float64(kind, head_dim):
    """Head size 64: the masked batches run FlexAttention; 256 (Qwen3.5's): flash's varlen kernel."""
    reference = _model(seed=11, head_dim=head_dim)
    routed = copy.deepcopy(reference)
    assert route_attention_without_cp(routed, decoder_layers(routed)) == 2
    inputs = _batch(kind, seed=len(kind))
    unmasked = causally_unmasked_keys(inputs["position_ids"], inputs.get("attention_mask"))
    truth = _run(copy.deepcopy(reference).double(), inputs, None, torch.float64)
    theirs = _run(reference, inputs, None, torch.bfloat16)
    ours = _run(routed, inputs, unmasked, torch.bfloat16)
    names = ["logits", "loss"] + [n for n, _ in reference.named_parameters()]
    for name, want, base, got in zip(names, truth, theirs, ours):
        error, single = relative_error(got, want), relative_error(base, want)
        assert within_precision(error, single), f"{kind} {name}: {error:.3e} against transformers' {single:.3e}"
