"""The masked local attention on flash's variable-length kernel (`kernels/attention/varlen.py`).

On CPU: its segments give exactly the visibility of `layout.visible` and tile every query and key,
and the op (the kernel replaced by its float64 emulation, `naive.naive_varlen`) equals the oracle
for every CP chunk layout, padding and documents, grouped heads, several rows. The `gpu` set runs
flash itself in bf16, judged against the error of one plain SDPA call, with padded query rows and
unread keys checked to be exactly zero.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cpcompile.errors import CPConfigError, CPInputError
from cpcompile.kernels.attention import local_attention, select_kernel, varlen
from cpcompile.kernels.attention.kernels import check_kernel
from cpcompile.kernels.attention.layout import query_documents, query_positions, visible
from cpcompile.kernels.attention.naive import naive_attention, naive_varlen, naive_varlen_backward

HAS_CUDA = torch.cuda.is_available()
# (keys, chunk length, chunk starts): cp 1, AllGather ranks 0 and 2 of 4, Head-Tail rank 1 of 2
LAYOUTS = [(96, 96, [0]), (96, 24, [0]), (96, 24, [48]), (96, 24, [24, 48])]


def tags_with(length: int, seed: int, *, documents: bool, padded: bool, batch: int = 2) -> torch.Tensor:
    """Documents of 1 to ~20 tokens, padding at the start, between documents and at the end (a
    document's real tokens stay in one piece, as `varlen` needs)."""
    gen = torch.Generator().manual_seed(seed)
    tags = torch.zeros(batch, length, dtype=torch.long)
    if documents:
        tags = (torch.rand(batch, length, generator=gen) < 1 / 8).long().cumsum(1)
    if padded:
        for row in range(batch):
            first = {int(d): int((tags[row] == d).nonzero()[0]) for d in tags[row].unique()}
            ends = sorted(first.values())[1:] + [length]
            for doc_start, doc_end in zip(sorted(first.values()), ends):  # a doc's tail is padding, at random
                if torch.rand(1, generator=gen) < 0.5:
                    cut = int(torch.randint(doc_start, doc_end, (1,), generator=gen))
                    tags[row, cut:doc_end] = -tags[row, cut:doc_end] - 1
            tags[row, :3] = torch.where(tags[row, :3] >= 0, -tags[row, :3] - 1, tags[row, :3])  # left padding
    return tags


def segment_visibility(bounds_q: torch.Tensor, bounds_k: torch.Tensor, rows: int, keys: int, causal: bool):
    """`[rows, keys]` bool: what the variable-length kernel lets each query see, from its segments."""
    seen = torch.zeros(rows, keys, dtype=torch.bool)
    for q0, q1, k0, k1 in zip(bounds_q[:-1].tolist(), bounds_q[1:].tolist(), bounds_k[:-1].tolist(),
                              bounds_k[1:].tolist()):
        for r in range(q0, q1):
            last = k1 - 1 - (q1 - 1 - r) if causal else k1 - 1  # aligned at the segment's end
            seen[r, k0:last + 1] = k1 > k0
    return seen


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("documents, padded", [(False, True), (True, False), (True, True)])
@pytest.mark.parametrize("keys, chunk, starts", LAYOUTS)
def test_segments_see_what_the_layout_says_and_tile_everything(keys, chunk, starts, documents, padded, causal):
    tags = tags_with(keys, seed=keys + chunk + len(starts), documents=documents, padded=padded)
    for row in range(tags.shape[0]):
        for start in starts:
            bq, bk = varlen.segment_bounds(tags[row], start, chunk, causal)
            assert (bq[0], bq[-1], bk[0], bk[-1]) == (0, chunk, 0, keys)
            assert bool((bq.diff() >= 0).all()) and bool((bk.diff() >= 0).all())
            positions = query_positions([start], chunk, "cpu")
            want = visible(tags[row:row + 1], query_documents(tags[row:row + 1], positions), positions, keys,
                           causal)[0]
            want[tags[row, positions] < 0] = False  # padding queries see nothing here (module doc)
            assert torch.equal(segment_visibility(bq, bk, chunk, keys, causal), want)


def test_a_document_split_by_padding_is_refused():
    tags = torch.tensor([0, 0, -1, 0, 0, 1, 1])
    with pytest.raises(CPInputError, match="split by padding.*CPCOMPILE_MASKED_ATTENTION_KERNEL=flex"):
        varlen.segment_bounds(tags, 0, 7, True)


def real_queries(tags: torch.Tensor, starts: list[int], chunk: int) -> torch.Tensor:
    """`[B, S_q]` bool: the local query rows that are real tokens."""
    return tags[:, query_positions(starts, chunk * len(starts), tags.device)] >= 0


def emulated_kernel(monkeypatch):
    """Flash replaced by its float64 emulation (`naive.naive_varlen`, `naive_varlen_backward`)."""
    def forward(q, k, v, seg, causal, scale):
        return naive_varlen(q, k, v, seg.cu_q.cpu(), seg.cu_k.cpu(), causal, scale)

    def backward(grad_out, q, k, v, out, lse, seg, causal, scale):
        return naive_varlen_backward(grad_out, q, k, v, seg.cu_q.cpu(), seg.cu_k.cpu(), causal, scale)

    monkeypatch.setitem(varlen.KERNEL, "forward", forward)
    monkeypatch.setitem(varlen.KERNEL, "backward", backward)


def _grads(fn, q, k, v, grad_out):
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves)
    return out.detach(), list(torch.autograd.grad(out, leaves, grad_out))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("keys, chunk, starts", LAYOUTS)
def test_op_equals_the_oracle_with_the_kernel_emulated(monkeypatch, keys, chunk, starts, causal):
    """Chunks sliced, grouped heads handed over, several chunks' key gradients summed, outputs and
    log-sum-exp placed back, on HF's `[B, S, H, D]` storage: the same as the float64 oracle."""
    emulated_kernel(monkeypatch)
    gen = torch.Generator().manual_seed(7)
    make = lambda h, s: torch.randn(2, s, h, 16, generator=gen, dtype=torch.float64).transpose(1, 2)
    q, k, v = make(4, chunk * len(starts)), make(2, keys), make(2, keys)
    tags = tags_with(keys, seed=3, documents=True, padded=True)
    real = real_queries(tags, starts, chunk)
    # the loss gives padding rows no gradient; here their output is 0, not their document's attention
    grad_out = torch.randn(q.shape, generator=gen, dtype=torch.float64) * real[:, None, :, None]
    op = lambda q, k, v: local_attention(q, k, v, tags, starts, causal, 0.25, "cpu_flash", "varlen")
    out, grads = _grads(op, q, k, v, grad_out)
    ref, ref_grads = _grads(lambda q, k, v: naive_attention(q, k, v, starts, causal=causal, key_tags=tags,
                                                            scale=0.25), q, k, v, grad_out)
    torch.testing.assert_close(out.transpose(1, 2)[real], ref.transpose(1, 2)[real])
    assert out.transpose(1, 2)[~real].abs().max() == 0
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


def test_the_emulated_backward_is_the_emulations_gradient():
    """The oracle's own check: its hand-written backward against autograd through its forward."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(t, h, 8, generator=gen, dtype=torch.float64, requires_grad=True)
               for t, h in ((20, 4), (30, 2), (30, 2)))
    cu_q, cu_k = torch.tensor([0, 6, 6, 6, 14, 20]), torch.tensor([0, 9, 12, 12, 25, 30])
    grad_out = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    for causal in (True, False):
        want = torch.autograd.grad(naive_varlen(q, k, v, cu_q, cu_k, causal, 0.3)[0], (q, k, v), grad_out)
        got = naive_varlen_backward(grad_out, q.detach(), k.detach(), v.detach(), cu_q, cu_k, causal, 0.3)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)


def test_op_passes_opcheck(monkeypatch):
    emulated_kernel(monkeypatch)
    from cpcompile.kernels.attention.op import varlen_attention

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, s, 8, generator=gen, dtype=torch.float64, requires_grad=True)
               for h, s in ((4, 32), (2, 64), (2, 64)))
    tags = tags_with(64, seed=5, documents=True, padded=True, batch=1)
    torch.library.opcheck(varlen_attention, (q, k, v, tags, [16, 32], True, 0.3),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_kernel_choice():
    cuda = torch.device("cuda")
    assert select_kernel(cuda, torch.bfloat16, masked=True, head_dim=256) == "varlen"
    assert select_kernel(cuda, torch.bfloat16, masked=True, head_dim=128) == "flex"  # faster there (H100)
    assert select_kernel(cuda, torch.bfloat16, masked=True, head_dim=512) == "flex"
    assert select_kernel(cuda, torch.float32, masked=True, head_dim=64) == "flex"
    with pytest.raises(CPConfigError, match="'varlen' runs on cuda"):
        check_kernel("varlen", torch.device("cpu"), torch.bfloat16, masked=True)
    with pytest.raises(CPConfigError, match="'varlen' runs on cuda"):
        check_kernel("varlen", cuda, torch.float32, masked=True)
    with pytest.raises(CPConfigError, match="head sizes up to 256"):
        check_kernel("varlen", cuda, torch.bfloat16, masked=True, head_dim=320)
    with pytest.raises(CPConfigError, match="masked keys only"):
        check_kernel("varlen", cuda, torch.bfloat16)
    # per-document Head-Tail's queries at given positions: FlexAttention, and varlen named for them refused
    assert select_kernel(cuda, torch.bfloat16, masked=True, head_dim=256, chunked_queries=False) == "flex"
    with pytest.raises(CPConfigError, match="not at query_positions"):
        check_kernel("varlen", cuda, torch.bfloat16, masked=True, chunked_queries=False)


def test_queries_at_positions_are_refused():
    q = torch.zeros(1, 2, 8, 4)
    with pytest.raises(CPConfigError, match="not at query_positions"):
        local_attention(q, q, q, torch.zeros(1, 8, dtype=torch.long), [0], True, 0.5, "cpu_flash", "varlen",
                        torch.arange(8)[None])


# --------------------------------------------------------------------------- GPU (bf16)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("heads, head_dim", [((8, 2), 256), ((16, 16), 128)])
@pytest.mark.parametrize("keys, chunk, starts", [(4096, 4096, [0]), (4096, 1024, [2048]),
                                                 (4096, 1024, [1024, 2048])])
def test_gpu_varlen_bf16(heads, head_dim, keys, chunk, starts):
    """Flash's variable-length kernel against the float64 oracle on the real query rows, as accurate
    as plain SDPA on the whole causal problem; padding rows' outputs and gradients and the gradients
    of keys no query reads are exact zeros (nothing left unwritten)."""
    gen = torch.Generator().manual_seed(keys + chunk)
    make = lambda h, s: torch.randn(2, s, h, head_dim, generator=gen).to("cuda", torch.bfloat16).transpose(1, 2)
    q, k, v = make(heads[0], chunk * len(starts)), make(heads[1], keys), make(heads[1], keys)
    tags = tags_with(keys, seed=1, documents=True, padded=True).cuda()
    real = real_queries(tags, starts, chunk)
    # the loss gives padding rows no gradient; their output is 0 here, not their document's attention
    grad_out = torch.randn(q.shape, dtype=q.dtype, device="cuda") * real[:, None, :, None]
    op = lambda q, k, v: local_attention(q, k, v, tags, starts, True, head_dim ** -0.5, "cudnn", "varlen")
    out, grads = _grads(op, q, k, v, grad_out)
    ref, ref_grads = _grads(lambda q, k, v: naive_attention(q, k, v, starts, key_tags=tags), q.double(),
                            k.double(), v.double(), grad_out.double())
    full_q = torch.randn(2, heads[0], keys, head_dim, device="cuda", dtype=q.dtype)
    rows = torch.cat([torch.arange(s, s + chunk) for s in starts]).cuda()
    full_q[:, :, rows] = q
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    bound = 1.5 * _rel(sdpa(full_q, k, v)[:, :, rows], sdpa(full_q.double(), k.double(), v.double())[:, :, rows])
    rows_of = lambda x: x.transpose(1, 2)[real]
    errors = [_rel(rows_of(out), rows_of(ref))] + [_rel(g, r) for g, r in zip(grads, ref_grads)]
    print(f"varlen heads {heads} d {head_dim} starts {starts}: out/dq/dk/dv {['%.1e' % e for e in errors]}, "
          f"bound {bound:.1e}")
    assert errors[0] < bound + 1e-3 and max(errors) < 3e-2, errors
    # [B, S_kv]: keys no real query reads. Judged by dv: a key whose only reader sees that key alone
    # (a one-token document) has a dk of exactly 0 in float64 but a bf16 rounding residue here
    unread = ref_grads[2].double().abs().sum((1, 3)) == 0
    assert unread.any() and not real.all()
    assert out.transpose(1, 2)[~real].abs().max() == 0 and grads[0].transpose(1, 2)[~real].abs().max() == 0
    for g in grads[1:]:
        assert g.transpose(1, 2)[unread].abs().max() == 0
