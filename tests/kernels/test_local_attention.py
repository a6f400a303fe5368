"""The SDPA CP local attention against its float64 oracle (`kernels/attention/naive.py`).

On CPU the fused CPU kernel serves the blocks and the padded tiles (float64 and fp32 here), and
FlexAttention's block mask is checked against `create_block_mask`; the `gpu` set runs every CUDA
kernel and FlexAttention in bf16, judged against the error of one plain SDPA call.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cp_harness import LargestTensor
from cpcompile.kernels.attention import local_attention, select_kernel
from cpcompile.kernels.attention.naive import naive_attention

HAS_CUDA = torch.cuda.is_available()
# (total keys, chunk length, chunk starts): AllGather ranks 0 and 2 of 4, Head-Tail rank 1 of 2,
# Hybrid's two-block span, and a chunk longer than one padded-attention tile
LAYOUTS = [(64, 16, [0]), (64, 16, [32]), (64, 16, [16, 32]), (96, 32, [64]), (1280, 640, [640])]


def _inputs(b, hq, hkv, s_q, s_kv, d, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    # HF hands attention [B, S, H, D] storage viewed as [B, H, S, D]: test that layout
    make = lambda h, s: torch.randn(b, s, h, d, generator=gen).to(device=device, dtype=dtype).transpose(1, 2)
    return make(hq, s_q), make(hkv, s_kv), make(hkv, s_kv)


def _grads(fn, q, k, v, grad_out):
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves)
    # autograd.grad, not .backward(): AccumulateGrad would restride .grad like the leaf
    return out.detach(), list(torch.autograd.grad(out, leaves, grad_out))


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _attention(starts, key_tags=None, causal=True, scale=None, kernel=None, masked_kernel=None):
    """local_attention as a function of (q, k, v); one unpadded document unless `key_tags` is given."""
    def run(q, k, v):
        tags = key_tags if key_tags is not None else torch.zeros(k.shape[0], k.shape[2], dtype=torch.long)
        return local_attention(q, k, v, tags.to(q.device), starts, causal, scale or q.shape[-1] ** -0.5,
                               kernel or select_kernel(q.device, q.dtype),
                               masked_kernel or select_kernel(q.device, q.dtype, masked=True))
    return run


def random_tags(batch: int, length: int, *, padded: bool, documents: bool, seed: int = 1) -> torch.Tensor:
    """Key tags (`kernels/attention/layout.py`): documents of random lengths (1 to 40 tokens, so some
    are shorter than a tile or a block and many cross them), padding at random places."""
    gen = torch.Generator().manual_seed(seed)
    docs = torch.zeros(batch, length, dtype=torch.long)
    if documents:
        starts = torch.rand(batch, length, generator=gen) < 1 / 20
        starts[:, 0] = False
        docs = starts.long().cumsum(1)
    if padded:
        real = torch.rand(batch, length, generator=gen) > 0.3
        real[1, :] = False  # a row whose queries see no key at all: zero output, finite gradients
        real[1, -5:] = True
        docs = torch.where(real, docs, -docs - 1)
    return docs


def _check(op, oracle, q, k, v, tol):
    grad_out = torch.randn(q.shape, dtype=q.dtype, device=q.device)
    out, grads = _grads(op, q, k, v, grad_out)
    ref, ref_grads = _grads(oracle, q.double(), k.double(), v.double(), grad_out.double())
    errors = [_rel(out, ref)] + [_rel(g, r) for g, r in zip(grads, ref_grads)]
    assert max(errors) < tol, errors
    assert all(g.is_contiguous() for g in grads), "gradients must be contiguous (they may reach a collective)"


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_unpadded_chunks_match_oracle(layout, heads, dtype, tol, causal):
    s_kv, chunk, starts = layout
    q, k, v = _inputs(2, *heads, chunk * len(starts), s_kv, 8, dtype)
    _check(_attention(starts, causal=causal), lambda q, k, v: naive_attention(q, k, v, starts, causal=causal),
           q, k, v, tol)


@pytest.mark.parametrize("padded, documents", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_masked_matches_oracle(layout, causal, padded, documents):
    s_kv, chunk, starts = layout
    q, k, v = _inputs(2, 4, 2, chunk * len(starts), s_kv, 8, torch.float64)
    tags = random_tags(2, s_kv, padded=padded, documents=documents)
    _check(_attention(starts, tags, causal, scale=0.3),
           lambda q, k, v: naive_attention(q, k, v, starts, causal=causal, key_tags=tags, scale=0.3),
           q, k, v, 1e-12)


@pytest.mark.parametrize("causal", [True, False])
def test_ops_pass_opcheck(causal):
    q, k, v = (x.detach().requires_grad_() for x in _inputs(1, 4, 2, 32, 64, 8, torch.float32))
    tags = random_tags(1, 64, padded=False, documents=True)
    torch.library.opcheck(torch.ops.cpcompile.chunk_attention.default, (q, k, v, [16, 48], causal, 0.3, "cpu_flash"))
    torch.library.opcheck(torch.ops.cpcompile.tiled_attention.default,
                          (q, k, v, tags, [16, 48], causal, 0.3, "cpu_flash"))


@pytest.mark.parametrize("causal", [True, False])
def test_one_block_takes_the_kernels_results_as_they_are(monkeypatch, causal):
    """No CP (one chunk from key 0: one block) returns the kernel's output and gradients without the
    merge buffers, the fp32 dq and the zeroed dk/dv they were summed into (issue 48 item 5): the
    same numbers, bf16 with grouped heads, as the general path gives; the ops' fake layouts hold."""
    from cpcompile.kernels.attention import unmasked

    q, k, v = _inputs(2, 4, 2, 32, 32, 8, torch.bfloat16)
    grad_out = torch.randn(q.shape, dtype=q.dtype)
    out, grads = _grads(_attention([0], causal=causal), q, k, v, grad_out)
    monkeypatch.setattr(unmasked, "one_block", lambda *args: None)
    ref, ref_grads = _grads(_attention([0], causal=causal), q, k, v, grad_out)
    assert torch.equal(out, ref) and all(torch.equal(g, r) for g, r in zip(grads, ref_grads))
    monkeypatch.undo()
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    torch.library.opcheck(torch.ops.cpcompile.chunk_attention.default, (*leaves, [0], causal, 0.3, "cpu_flash"))


@pytest.mark.parametrize("padded, documents", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("layout", [(1024, 128, [256, 640]), (1000, 500, [500]), (777, 100, [0, 400])])
def test_flex_block_mask_matches_its_elements(layout, causal, padded, documents):
    """The block table built from block statistics: every block holding a visible element is listed
    (and only those, when no query block straddles two chunks), a block listed as full is fully
    visible, and the mask function is the oracle's visibility."""
    from torch.nn.attention.flex_attention import create_mask

    from cpcompile.kernels.attention.flex import block_mask
    from cpcompile.kernels.attention.layout import query_documents, query_positions, visible

    s_kv, chunk, starts = layout
    tags = random_tags(2, s_kv, padded=padded, documents=documents)
    tags[0, 300:560] = tags[0, 300].abs()  # one long document of real keys: full blocks exist
    q_len = chunk * len(starts)
    mask = block_mask(tags, starts, q_len, causal)
    positions = query_positions(starts, q_len, "cpu")
    want = visible(tags, query_documents(tags, positions), positions, s_kv, causal)[:, None]
    assert torch.equal(create_mask(mask.mask_mod, 2, 1, q_len, s_kv, device="cpu"), want)
    def tiles(fill):  # [B, nq, 128, nk, 128]; rows and keys past the ends filled with `fill`
        padded = torch.nn.functional.pad(want[:, 0], (0, -s_kv % 128, 0, -q_len % 128), value=fill)
        return padded.unflatten(2, (-1, 128)).unflatten(1, (-1, 128))

    listed, needed = mask.to_dense()[:, 0].bool(), tiles(False).any(4).any(2)
    assert (listed | ~needed).all(), "a block with a visible element is not listed"
    if len(starts) == 1 or chunk % 128 == 0:  # query blocks within one chunk: the table is tight
        assert torch.equal(listed, needed), "a block without a visible element is listed"
    full = torch.zeros_like(listed)
    for b in range(2):
        for i in range(listed.shape[1]):
            full[b, i, mask.full_kv_indices[b, 0, i, :mask.full_kv_num_blocks[b, 0, i]].long()] = True
    assert (tiles(True).all(4).all(2) | ~full).all(), "a block listed as full is not fully visible"


def rising_positions(batch: int, q_len: int, s_kv: int, seed: int = 2) -> torch.Tensor:
    """`[B, S_q]` global query positions, a different rising subset of `0..S_kv-1` per row (the
    shape of per-document Head-Tail: pieces of many documents)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(s_kv, generator=gen)[:q_len].sort().values for _ in range(batch)])


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("q_len, s_kv", [(32, 64), (600, 1280)])
def test_query_positions_match_oracle(q_len, s_kv, causal):
    """Queries at data-dependent positions (per row): the tiled kernel, forward and backward, equals
    the oracle in float64; several tiles of 512 rows at the larger shape."""
    q, k, v = _inputs(2, 4, 2, q_len, s_kv, 8, torch.float64)
    tags = random_tags(2, s_kv, padded=False, documents=True)
    positions = rising_positions(2, q_len, s_kv)

    def run(q, k, v):
        return local_attention(q, k, v, tags, [0], causal, 0.3, "cpu_flash", "cpu_flash", positions)

    _check(run, lambda q, k, v: naive_attention(q, k, v, [0], causal=causal, key_tags=tags, scale=0.3,
                                                query_positions=positions), q, k, v, 1e-12)
    tiled = torch.ops.cpcompile.tiled_attention.default
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    torch.library.opcheck(tiled, (*leaves, tags, [0], causal, 0.3, "cpu_flash", positions))


@pytest.mark.parametrize("causal", [True, False])
def test_flex_block_mask_with_query_positions(causal):
    """The block table for queries at data-dependent positions lists every block holding a visible
    element, lists as full only fully visible blocks, and its mask function is the oracle's."""
    from torch.nn.attention.flex_attention import create_mask

    from cpcompile.kernels.attention.flex import block_mask
    from cpcompile.kernels.attention.layout import query_documents, visible

    q_len, s_kv = 384, 1000
    tags = random_tags(2, s_kv, padded=False, documents=True)
    tags[0, 300:700] = tags[0, 300]  # one long document: full blocks exist
    positions = rising_positions(2, q_len, s_kv)
    positions[0] = torch.arange(300, 300 + q_len)  # row 0: queries inside the long document
    mask = block_mask(tags, [0], q_len, causal, positions)
    want = visible(tags, query_documents(tags, positions), positions, s_kv, causal)[:, None]
    assert torch.equal(create_mask(mask.mask_mod, 2, 1, q_len, s_kv, device="cpu"), want)
    padded = torch.nn.functional.pad(want[:, 0], (0, -s_kv % 128, 0, -q_len % 128), value=True)
    blocks = padded.unflatten(2, (-1, 128)).unflatten(1, (-1, 128))  # [B, nq, 128, nk, 128]
    listed = mask.to_dense()[:, 0].bool()
    assert (listed | ~want_blocks(want, q_len, s_kv)).all(), "a block with a visible element is not listed"
    for b in range(2):
        for i in range(listed.shape[1]):
            full = mask.full_kv_indices[b, 0, i, :mask.full_kv_num_blocks[b, 0, i]].long()
            assert blocks[b, i][:, full].all(), "a block listed as full is not fully visible"
    assert mask.full_kv_num_blocks[0].sum() > 0, "no full block found in the long document"


def want_blocks(want: torch.Tensor, q_len: int, s_kv: int) -> torch.Tensor:
    """`[B, nq, nk]`: which 128 x 128 blocks of a `[B, 1, S_q, S_kv]` visibility hold a visible element."""
    padded = torch.nn.functional.pad(want[:, 0], (0, -s_kv % 128, 0, -q_len % 128), value=False)
    return padded.unflatten(2, (-1, 128)).unflatten(1, (-1, 128)).any(4).any(2)


def test_unequal_chunks_are_refused():
    q, k, v = _inputs(1, 2, 2, 15, 30, 8, torch.float32)
    with pytest.raises(ValueError, match="equal chunks"):
        _attention([0, 15])(q, k, v)


def test_kernel_choice_fails_fast():
    from cpcompile.errors import CPConfigError
    from cpcompile.kernels.attention.kernels import check_kernel

    with pytest.raises(CPConfigError, match="runs on cuda"):
        check_kernel("flash", torch.device("cpu"), torch.bfloat16)
    with pytest.raises(CPConfigError, match="does not support torch.float32"):
        check_kernel("flash", torch.device("cuda"), torch.float32)
    with pytest.raises(CPConfigError, match="takes no mask"):
        check_kernel("flash", torch.device("cuda"), torch.bfloat16, masked=True)
    with pytest.raises(CPConfigError, match="unknown attention kernel"):
        check_kernel("nope", torch.device("cpu"), torch.float32)
    with pytest.raises(CPConfigError, match="'flex' runs on cuda"):
        check_kernel("flex", torch.device("cpu"), torch.float32, masked=True)


# --------------------------------------------------------------------------- GPU (bf16)

gpu = pytest.mark.gpu


def _sdpa_bf16_error(q, k, v, s_kv, chunk, starts, grad_out):
    """Error of one plain SDPA call (the single-device path) on the whole causal problem, sliced
    to the same rows: the yardstick for a bf16 kernel."""
    full_q = torch.randn(q.shape[0], q.shape[1], s_kv, q.shape[3], device=q.device, dtype=q.dtype)
    for i, s in enumerate(starts):
        full_q[:, :, s:s + chunk] = q[:, :, i * chunk:(i + 1) * chunk]
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out = sdpa(full_q, k, v)
    ref = sdpa(full_q.double(), k.double(), v.double())
    rows = torch.cat([torch.arange(s, s + chunk) for s in starts]).to(q.device)
    return _rel(out[:, :, rows], ref[:, :, rows])


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("kernel", ["flash", "cudnn", "flex"])
@pytest.mark.parametrize("heads", [(16, 16), (16, 4)])
def test_gpu_kernels_bf16(kernel, heads):
    """Each CUDA kernel (flex: on keys with padding) against the oracle, as accurate as plain SDPA."""
    s_kv, chunk, starts = 8192, 2048, [2048, 6144]
    q, k, v = _inputs(1, *heads, chunk * len(starts), s_kv, 128, torch.bfloat16, device="cuda")
    grad_out = torch.randn(q.shape, dtype=q.dtype, device="cuda")
    tags = torch.zeros(1, s_kv, dtype=torch.long)
    if kernel == "flex":  # padding inside a block and across blocks; documents of many lengths
        tags = random_tags(1, s_kv, padded=False, documents=True)
        tags[0, 1000:1100] = -tags[0, 1000:1100] - 1
    tags = tags.cuda()
    op = _attention(starts, tags, kernel="flash", masked_kernel="flex") if kernel == "flex" else \
        _attention(starts, kernel=kernel)
    out, grads = _grads(op, q, k, v, grad_out)
    ref, ref_grads = _grads(lambda q, k, v: naive_attention(q, k, v, starts, key_tags=tags), q.double(),
                            k.double(), v.double(), grad_out.double())
    bound = 1.5 * _sdpa_bf16_error(q, k, v, s_kv, chunk, starts, grad_out) + 1e-3
    errors = [_rel(out, ref)] + [_rel(g, r) for g, r in zip(grads, ref_grads)]
    print(f"{kernel} heads {heads}: out/dq/dk/dv errors {['%.1e' % e for e in errors]}, bound {bound:.1e}")
    assert _rel(out, ref) < bound and max(errors) < 3e-2, errors


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("padded", [False, True])
def test_gpu_fp32_runs_flex(padded):
    """fp32 on CUDA: FlexAttention serves unmasked and padded keys alike."""
    s_kv, chunk, starts = 2048, 512, [512, 1536]
    q, k, v = _inputs(1, 16, 4, chunk * len(starts), s_kv, 64, torch.float32, device="cuda")
    tags = torch.zeros(1, s_kv, dtype=torch.long, device="cuda")
    if padded:
        tags[0, 100:300] = -1
    assert select_kernel(q.device, q.dtype) == "flex"
    _check(_attention(starts, tags), lambda q, k, v: naive_attention(q, k, v, starts, key_tags=tags), q, k, v, 1e-3)


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_flex_at_query_positions_bf16():
    """Per-document Head-Tail's local attention on CUDA: FlexAttention with queries at per-row
    positions (half of a 4K packed row, each row its own), bf16, against the float64 oracle; as
    accurate (1.5x + 1e-3) as the whole row attended on one device, read at the same rows."""
    s_kv, q_len = 4096, 2048
    tags = random_tags(2, s_kv, padded=False, documents=True).cuda()
    positions = rising_positions(2, q_len, s_kv).cuda()
    q_all, k, v = _inputs(2, 8, 2, s_kv, s_kv, 128, torch.bfloat16, device="cuda")
    q = q_all.gather(2, positions[:, None, :, None].expand(-1, 8, -1, 128))
    grad_out = torch.randn(q.shape, dtype=q.dtype, device="cuda")

    def run(q, k, v):
        return local_attention(q, k, v, tags, [0], True, 128 ** -0.5, "flash", "flex", positions)

    out, grads = _grads(run, q, k, v, grad_out)
    ref, ref_grads = _grads(lambda q, k, v: naive_attention(q, k, v, [0], key_tags=tags, query_positions=positions),
                            q.double(), k.double(), v.double(), grad_out.double())
    whole = _attention([0], tags, kernel="flash", masked_kernel="flex")(q_all, k, v)
    whole_ref = naive_attention(q_all.double(), k.double(), v.double(), [0], key_tags=tags)
    rows = positions[:, None, :, None].expand(-1, 8, -1, 128)
    bound = 1.5 * _rel(whole.gather(2, rows), whole_ref.gather(2, rows)) + 1e-3
    errors = [_rel(out, ref)] + [_rel(g, r) for g, r in zip(grads, ref_grads)]
    print(f"flex at query positions: out/dq/dk/dv errors {['%.1e' % e for e in errors]}, bound {bound:.1e}")
    assert _rel(out, ref) < bound and max(errors) < 3e-2, errors


def _largest_tensor(s_kv: int, padded: bool) -> int:
    """Largest tensor of one forward + backward of the op's implementation (its own aten calls) for
    a Head-Tail-like rank: two chunks of S/4 queries against S keys, one head of width 4."""
    from cpcompile.kernels.attention import tiled, unmasked

    starts = [s_kv // 4, s_kv // 2]
    q, k, v = _inputs(1, 1, 1, s_kv // 2, s_kv, 4, torch.float32)
    tags = random_tags(2, s_kv, padded=True, documents=True)[:1]
    with LargestTensor() as mode:
        if padded:
            out, lse = tiled.forward(q, k, v, tags, starts, True, 0.5, "cpu_flash")
            tiled.backward(out, q, k, v, out, lse, tags, starts, True, 0.5, "cpu_flash")
        else:
            out, lse = unmasked.forward(q, k, v, starts, True, 0.5, "cpu_flash")
            unmasked.backward(out, q, k, v, out, lse, starts, True, 0.5, "cpu_flash")
    return mode.numel


@pytest.mark.parametrize("padded", [False, True])
def test_memory_is_linear_in_sequence(padded):
    """Doubling the sequence at most doubles the largest tensor (a score or mask matrix would
    quadruple it), and nothing reaches S_q × S_kv."""
    small, large = _largest_tensor(4096, padded), _largest_tensor(8192, padded)
    assert large <= 2 * small, (small, large)
    assert large < (8192 // 2) * 8192 // 4, large
