"""`linear_cross_entropy_sum` (cpcompile/linear_cross_entropy.py) beside its oracle, the whole
logits' `F.cross_entropy(..., reduction="sum")`: loss and both gradients, float64 (and float32
within 1e-6), at shapes where nothing divides anything, and on adversarial targets; bfloat16 judged
against float64 as cpcompile/parity.py judges CP; and the memory claim, counted: no tensor of
tokens x vocabulary elements is ever allocated, in the forward or the backward."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cpcompile.linear_cross_entropy import IGNORE_INDEX, linear_cross_entropy_sum
from cpcompile.parity import relative_error, within_precision


def _inputs(seed: int, tokens: int, dim: int, vocab: int, dtype=torch.float64, scale: float = 1.0):
    generator = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(tokens, dim, generator=generator, dtype=torch.float64) * scale).to(dtype)
    weight = torch.randn(vocab, dim, generator=generator, dtype=torch.float64).to(dtype)
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    return hidden, weight, targets


def _loss_and_grads(loss_fn, hidden, weight, targets):
    hidden, weight = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    loss = loss_fn(hidden, weight, targets)
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad


def _oracle(softcap=None):
    def loss(hidden, weight, targets):
        logits = (hidden @ weight.t()).to(torch.float64 if hidden.dtype == torch.float64 else torch.float32)
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss


def _chunked(chunk_tokens, softcap=None, compile_backend=None):
    return lambda h, w, t: linear_cross_entropy_sum(h, w, t, chunk_tokens, softcap, compile_backend)


# the chunk's elementwise work eagerly in place, and compiled (aot_eager: the same graph inductor
# would fuse, run op by op; inductor itself on a GPU, below)
BACKENDS = [None, "aot_eager"]
# also uncompiled on the Triton kernels CUDA runs (kernels/loss/; here in Triton's interpreter)
WITH_TRITON = [*BACKENDS, "triton"]


def _backend(name, monkeypatch):
    """`compile_backend` for a test's backend name; "triton": none, with the CUDA path forced."""
    if name != "triton":
        return name
    import cpcompile.linear_cross_entropy as module

    monkeypatch.setattr(module, "_uses_triton", lambda hidden: hidden.dtype != torch.float64)
    return None


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles afresh: past Dynamo's recompile limit the functions would run eagerly."""
    torch._dynamo.reset()
    yield


def test_the_compiled_chunk_work_is_one_graph_each_and_runs():
    """With a compile backend the forward's and the backward's chunk work each compile as one
    graph (no graph break), for full chunks and the shorter last one."""
    from torch._dynamo.utils import counters

    counters.clear()
    hidden, weight, targets = _inputs(3, 37, 8, 53)
    _loss_and_grads(_chunked(16, compile_backend="aot_eager"), hidden, weight, targets)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 2, dict(counters["stats"])


def _assert_same(got, want, rtol):
    for name, g, w in zip(("loss", "grad_hidden", "grad_weight"), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert relative_error(g, w) <= rtol, (name, relative_error(g, w))


def _with_ignored(targets, *spans):
    targets = targets.clone()
    for a, b in spans:
        targets[a:b] = IGNORE_INDEX
    return targets


# (tokens, dim, vocab, chunk_tokens): a prime vocabulary, chunks not dividing the tokens, one
# token a chunk, one chunk for everything, a chunk longer than the tokens
SHAPES = [(37, 8, 53, 5), (64, 16, 101, 7), (10, 4, 11, 1), (29, 8, 97, 29), (6, 8, 31, 64)]


@pytest.mark.parametrize("tokens, dim, vocab, chunk", SHAPES)
@pytest.mark.parametrize("softcap", [None, 2.5])
@pytest.mark.parametrize("backend", BACKENDS)
def test_float64_equals_the_whole_logits_cross_entropy(tokens, dim, vocab, chunk, softcap, backend):
    hidden, weight, targets = _inputs(tokens * vocab, tokens, dim, vocab)
    targets = _with_ignored(targets, (0, 2), (tokens // 2, tokens // 2 + 1))
    _assert_same(_loss_and_grads(_chunked(chunk, softcap, backend), hidden, weight, targets),
                 _loss_and_grads(_oracle(softcap), hidden, weight, targets), 1e-12)


@pytest.mark.parametrize("case", ["all_ignored", "a_whole_chunk_ignored", "only_the_last_token", "huge_logits",
                                  "target_is_the_last_id"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_adversarial_targets_and_logits(case, backend):
    tokens, dim, vocab, chunk = 40, 8, 67, 8
    hidden, weight, targets = _inputs(7, tokens, dim, vocab, scale=300.0 if case == "huge_logits" else 1.0)
    targets = {"all_ignored": _with_ignored(targets, (0, tokens)),
               "a_whole_chunk_ignored": _with_ignored(targets, (8, 24)),
               "only_the_last_token": _with_ignored(targets, (0, tokens - 1)),
               "huge_logits": targets,  # logits of ~1e3: exp overflows unless shifted by the log-sum-exp
               "target_is_the_last_id": torch.full_like(targets, vocab - 1)}[case]
    got = _loss_and_grads(_chunked(chunk, compile_backend=backend), hidden, weight, targets)
    _assert_same(got, _loss_and_grads(_oracle(), hidden, weight, targets), 1e-12)
    assert all(torch.isfinite(t).all() for t in got)
    if case == "all_ignored":  # 0, and zero gradients (not None): the step still runs
        assert got[0].item() == 0.0 and not got[1].any() and not got[2].any()


def test_tied_weights_get_the_gradient_of_both_uses():
    """The head's weight is also the embedding that made the hidden states: its gradient sums both."""
    tokens, dim, vocab = 33, 8, 41
    _, weight, targets = _inputs(3, tokens, dim, vocab)
    ids = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(4))

    def through_embedding(loss_fn):
        table = weight.detach().clone().requires_grad_()
        hidden = torch.tanh(F.embedding(ids, table))
        loss_fn(hidden, table, targets).backward()
        return table.grad

    want = through_embedding(_oracle())
    assert relative_error(through_embedding(_chunked(5)), want) <= 1e-12


@pytest.mark.parametrize("backend", WITH_TRITON)
def test_float32_within_1e_6(backend, monkeypatch):
    hidden, weight, targets = _inputs(11, 300, 32, 997, dtype=torch.float32)
    targets = _with_ignored(targets, (100, 130))
    backend = _backend(backend, monkeypatch)
    _assert_same(_loss_and_grads(_chunked(64, compile_backend=backend), hidden, weight, targets),
                 _loss_and_grads(_oracle(), hidden, weight, targets), 1e-6)


@pytest.mark.parametrize("backend", WITH_TRITON)
def test_bfloat16_is_as_accurate_as_the_whole_logits_in_bfloat16(backend, monkeypatch):
    """Judged as cpcompile/parity.py judges CP: against float64, the chunked loss's error within
    1.5x the bfloat16 whole-logits error + 1e-3, for the loss and both gradients."""
    hidden, weight, targets = _inputs(5, 256, 64, 1009, scale=0.5)
    backend = _backend(backend, monkeypatch)
    truth = _loss_and_grads(_oracle(), hidden, weight, targets)
    low = (hidden.bfloat16(), weight.bfloat16(), targets)
    chunked, whole = _loss_and_grads(_chunked(48, compile_backend=backend), *low), _loss_and_grads(_oracle(), *low)
    for name, c, w, t in zip(("loss", "grad_hidden", "grad_weight"), chunked, whole, truth):
        assert c.dtype == w.dtype, name
        assert within_precision(relative_error(c, t), relative_error(w, t)), \
            (name, relative_error(c, t), relative_error(w, t))


def test_errors_name_the_cause():
    hidden, weight, targets = _inputs(1, 8, 4, 10)
    bad_target = targets.clone()
    bad_target[3] = 10
    with pytest.raises(ValueError, match="target 10 is outside the vocabulary"):
        linear_cross_entropy_sum(hidden, weight, bad_target, 4)
    with pytest.raises(ValueError, match="hidden is torch.float32 but weight is torch.float64"):
        linear_cross_entropy_sum(hidden.float(), weight, targets, 4)
    with pytest.raises(ValueError, match="chunk_tokens must be a positive integer"):
        linear_cross_entropy_sum(hidden, weight, targets, 0)
    with pytest.raises(ValueError, match="targets must be"):
        linear_cross_entropy_sum(hidden, weight, targets[:-1], 4)
    with pytest.raises(ValueError, match="compile_backend 'inductr' is not a torch.compile backend"):
        linear_cross_entropy_sum(hidden, weight, targets, 4, compile_backend="inductr")


class LargestTensor:
    """A dispatch mode noting the most elements any op's output had (forward and backward: CPU
    autograd runs the backward on this thread, under the mode). An op's own scratch buffers are
    not seen; those of the chunked loss's ops are at most a chunk's logits too."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        largest = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in torch.utils._pytree.tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        largest.numel = max(largest.numel, t.numel())
                        largest.ops.add(str(func))
                return out

        self.numel, self.ops, self.mode = 0, set(), Mode()


def largest_tensor_of(loss_fn, *inputs) -> LargestTensor:
    seen = LargestTensor()
    with seen.mode:
        _loss_and_grads(loss_fn, *inputs)
    return seen


def test_no_tensor_of_tokens_x_vocabulary_is_ever_allocated():
    """Counted, not timed: the largest tensor the chunked loss's forward and backward make is one
    chunk's logits (chunk x vocab), while the whole-logits loss makes tokens x vocab (the count
    sees it: the probe works). dim < chunk, so the weight's gradient (vocab x dim) is smaller."""
    tokens, dim, vocab, chunk = 256, 16, 1000, 32
    inputs = _inputs(2, tokens, dim, vocab)
    chunked = largest_tensor_of(_chunked(chunk), *inputs)
    assert "aten.index_copy_.default" in chunked.ops  # grad_hidden's rows: the backward ran under the mode
    assert chunked.numel <= chunk * vocab < tokens * vocab, chunked.numel
    assert largest_tensor_of(_oracle(), *inputs).numel >= tokens * vocab


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["inductor", None])
def test_gpu_chunk_work_is_as_accurate_as_the_whole_logits_in_bfloat16(backend):
    """On CUDA with inductor (the trainer's compiled path) and uncompiled (the Triton kernels):
    bfloat16 loss and gradients judged against float64 as cpcompile/parity.py judges CP, the whole
    bfloat16 logits' error the bound."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    hidden, weight, targets = (t.cuda() for t in _inputs(5, 4096, 256, 32003, scale=0.5))
    targets = _with_ignored(targets, (100, 400))
    low = (hidden.bfloat16(), weight.bfloat16(), targets)
    for softcap in (None, 30.0):
        truth = _loss_and_grads(_oracle(softcap), hidden, weight, targets)
        chunked = _loss_and_grads(_chunked(1000, softcap, backend), *low)
        whole = _loss_and_grads(_oracle(softcap), *low)
        for name, c, w, t in zip(("loss", "grad_hidden", "grad_weight"), chunked, whole, truth):
            assert c.dtype == w.dtype, name
            assert within_precision(relative_error(c, t), relative_error(w, t)), \
                (softcap, name, relative_error(c, t), relative_error(w, t))
