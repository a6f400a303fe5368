"""The chunked loss on Hugging Face models (cpcompile/trainer/lm_loss.py), in one process: the loss
and every parameter's gradient equal those of the model's own logits for Qwen3.5 (GDN +
attention), Qwen3 with tied embeddings and Llama, and Gemma 2's soft-capped head; no tensor of
tokens x vocabulary on a whole model's forward and backward; each refusal names its cause; the
config's two fields."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cpcompile.errors import PlanError
from cpcompile.parity import relative_error
from cpcompile.trainer.lm_loss import chunked_loss_sum, use_chunked_loss

SMALL = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8)
GDN = dict(layer_types=["linear_attention", "full_attention"], linear_key_head_dim=8, linear_value_head_dim=8,
           linear_num_key_heads=4, linear_num_value_heads=8, linear_conv_kernel_dim=4)
MODELS = {"qwen3_5_text": dict(SMALL, **GDN), "qwen3_tied": dict(SMALL, tie_word_embeddings=True),
          "llama": SMALL, "gemma2_softcapped": dict(SMALL, final_logit_softcapping=2.0)}


def _model(name: str, dtype=torch.float64, **changes):
    import transformers

    model_type = {"qwen3_tied": "qwen3", "gemma2_softcapped": "gemma2"}.get(name, name)
    config = transformers.AutoConfig.for_model(model_type, **{**MODELS.get(name, SMALL), **changes})
    config._attn_implementation = "eager" if model_type == "gemma2" else "sdpa"  # gemma2 has no SDPA path
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).to(dtype)


def _batch(vocab: int, rows: int = 2, length: int = 13) -> tuple[dict, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (rows, length), generator=generator)
    targets = torch.randint(0, vocab, (rows, length), generator=generator)
    targets[0, :4] = -100  # padding
    targets[1, -1] = -100  # a row's last token predicts nothing
    return {"input_ids": ids}, targets


def _loss_and_gradients(model, loss_of) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = loss_of(model)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _full_loss(inputs, targets):
    def loss(model):
        logits = model(**inputs, use_cache=False).logits
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        return F.cross_entropy(logits.flatten(0, 1).to(dtype), targets.flatten(), reduction="sum")
    return loss


@pytest.mark.parametrize("name", list(MODELS))
def test_loss_and_every_gradient_equal_the_models_own_logits_float64(name):
    model = _model(name, torch.float64)
    inputs, targets = _batch(model.config.vocab_size)
    want = _loss_and_gradients(model, _full_loss(inputs, targets))
    use_chunked_loss(model, 5)
    got = _loss_and_gradients(model, lambda m: chunked_loss_sum(m, inputs, targets))
    assert relative_error(got[0], want[0]) <= 1e-12, (got[0], want[0])
    names = [n for n, _ in model.named_parameters()]
    worst = max(zip((relative_error(g, w) for g, w in zip(got[1], want[1])), names))
    assert worst[0] <= 1e-12, worst
    assert model(**inputs).logits.shape[-1] == model.config.vocab_size  # without targets: the model as it was


@pytest.mark.parametrize("name", list(MODELS))
def test_float32_chunked_loss_is_as_close_to_float64_as_the_models_own(name):
    """In float32 the two losses sum in different orders, and a gradient that cancels over the tokens
    (Qwen3.5's dt_bias) differs between them by a few 1e-6 with one thread: judge both against the
    float64 model. The chunked loss's error in every gradient is at most twice the model's own loss's
    (+ 1e-7), and the loss agrees within 1e-6."""
    truth_model = _model(name, torch.float64)
    inputs, targets = _batch(truth_model.config.vocab_size)
    truth = _loss_and_gradients(truth_model, _full_loss(inputs, targets))
    model = _model(name, torch.float32)
    full = _loss_and_gradients(model, _full_loss(inputs, targets))
    use_chunked_loss(model, 5)
    got = _loss_and_gradients(model, lambda m: chunked_loss_sum(m, inputs, targets))
    assert relative_error(got[0], full[0]) <= 1e-6, (got[0], full[0])
    for (name_, _), chunked, own, exact in zip(model.named_parameters(), got[1], full[1], truth[1]):
        exact = exact.float()
        assert relative_error(chunked, exact) <= 2 * relative_error(own, exact) + 1e-7, name_
    assert model(**inputs).logits.shape[-1] == model.config.vocab_size  # without targets: the model as it was


def test_a_whole_model_step_never_allocates_tokens_x_vocabulary():
    """Counted by a dispatch mode over the forward and backward (tests/train/test_linear_cross_entropy.py):
    a one-layer Qwen3 whose vocabulary dwarfs everything else; the full path's logits are seen."""
    from test_linear_cross_entropy import LargestTensor

    model = _model("qwen3_tied", torch.float32, vocab_size=2048, num_hidden_layers=1)
    inputs, targets = _batch(2048, rows=2, length=64)
    tokens_x_vocab = targets.numel() * 2048
    use_chunked_loss(model, 16)
    for loss_of, bounded in ((lambda m: chunked_loss_sum(m, inputs, targets), True), (_full_loss(inputs, targets), False)):
        seen = LargestTensor()
        with seen.mode:
            _loss_and_gradients(model, loss_of)
        assert (seen.numel < tokens_x_vocab) == bounded, (seen.numel, tokens_x_vocab)


class _ScaledHead(torch.nn.Linear):
    def forward(self, hidden):
        return super().forward(hidden) * 2


@pytest.mark.parametrize("make, cause", [
    (lambda: _model("cohere", logit_scale=0.0625), "CohereForCausalLM.forward does more to the last hidden state"),
    (lambda: _model("granite", logits_scaling=4.0), "GraniteForCausalLM.forward does more to the last hidden state"),
    (lambda: _with_head(_model("llama"), torch.nn.Linear(32, 97, bias=True)), "output head has a bias"),
    (lambda: _with_head(_model("llama"), _ScaledHead(32, 97, bias=False)), "output head is _ScaledHead, not a plain"),
    (lambda: _with_head(_model("llama"), torch.nn.Sequential(torch.nn.Linear(32, 97))), "output head is Sequential"),
])
def test_a_head_the_chunked_loss_cannot_take_apart_is_refused(make, cause):
    with pytest.raises(PlanError) as info:
        use_chunked_loss(make(), 8)
    assert info.value.field == "train.loss" and cause in info.value.reason, info.value
    assert "set train.loss: full" in info.value.reason


def _with_head(model, head):
    model.lm_head = head.to(torch.float64)
    return model


def test_logits_to_keep_is_refused():
    model = _model("llama")
    use_chunked_loss(model, 8)
    inputs, targets = _batch(97)
    with pytest.raises(PlanError, match="logits_to_keep=1"):
        chunked_loss_sum(model, {**inputs, "logits_to_keep": 1}, targets)


@pytest.mark.parametrize("edit, reason", [
    ({"loss": "fused"}, "must be one of chunked, full"),
    ({"loss_chunk_tokens": 0}, "must be an integer >= 1"),
    ({"loss_chunk_tokens": "4096"}, "must be an integer >= 1"),
])
def test_loss_config_errors_name_the_field(edit, reason):
    from cpcompile.trainer.config import TrainSettings

    with pytest.raises(PlanError) as info:
        TrainSettings(**edit)
    assert info.value.field == f"train.{next(iter(edit))}" and reason in info.value.reason, info.value


def _tensor_parallel_head(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    model = _model("llama")
    use_chunked_loss(model, 8)
    parallelize_module(model, init_device_mesh("cpu", (world,)), {"lm_head": ColwiseParallel()})
    inputs, targets = _batch(97)
    try:
        chunked_loss_sum(model, inputs, targets)
    except RuntimeError as exc:
        return str(exc)
    return "not refused"


def test_a_sharded_head_weight_is_refused():
    """The head's weight a DTensor at the loss (here: a tensor-parallel head; FSDP2's sharded
    weight, were the loss run outside the model's call) is refused rather than multiplied."""
    from dist_utils import run_distributed

    message = run_distributed(_tensor_parallel_head, 1, timeout=60)[0]
    assert "the head's weight is a DTensor" in message, message
