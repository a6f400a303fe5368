"""The `triton` backend of the GDN CP wrappers (Ulysses, State-P2P) against the eager CP=1 reference.

On a CPU machine the Triton kernels run in Triton's interpreter (`TRITON_INTERPRET=1`, set here
before `cpcompile.kernels.gdn.triton` is first imported; the forked ranks inherit it, and each
rank checks that its kernels really are interpreted) at a tiny shape. With CUDA the `gpu` set
runs bf16 at T = 4K per rank: the layer-level ops on one GPU, CP on two (NCCL).
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()  # without it, tests/conftest.py chose Triton's CPU interpreter

pytest.importorskip("triton")

from cp_harness import rel  # noqa: E402
from dist_utils import run_distributed  # noqa: E402
from gdn_harness import DECAY_GRADS, LayerHolder, gdn_plan, parameter_grad_errors  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
cpu_only = pytest.mark.skipif(not INTERPRET, reason="CPU interpreter tests (TRITON_INTERPRET=1, no CUDA)")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs CUDA (and no TRITON_INTERPRET)")
needs_two_gpus = pytest.mark.skipif(
    not HAS_CUDA or INTERPRET or torch.cuda.device_count() < 2 or not torch.distributed.is_nccl_available(),
    reason="needs 2 CUDA devices with NCCL")

CHUNK = 64  # the only chunk size the Triton kernels take
# Tiny Qwen3.5 GDN layer the Triton kernels accept (head dims 16); grouped heads (2 K : 4 V).
TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_conv_kernel_dim=4)
# Qwen3.5's GDN head shape (K = V = 128, 2 V heads per K head), fewer heads.
GPU_SIZE = dict(TINY, hidden_size=256, linear_key_head_dim=128, linear_value_head_dim=128,
                linear_num_key_heads=2, linear_num_value_heads=4)
TINY_LOCAL_LEN = 80  # P2P: one full chunk and a partial one per rank; Ulysses: 160 tokens = 2.5 chunks
GPU_LOCAL_LEN = 4096


def gdn_layer(config: dict, seed: int, dtype, device="cpu"):
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    torch.manual_seed(seed)
    return LayerHolder(Qwen3_5GatedDeltaNet(Qwen3_5TextConfig(**config), layer_idx=0)).to(device=device, dtype=dtype)


def use_core(holder: LayerHolder, backend: str) -> LayerHolder:
    """Run the layer through cpcompile's statement of it with the given core backend (CP=1)."""
    import types

    from cpcompile.adapters.qwen3_5 import gdn_layer_forward

    def forward(self, hidden_states, attention_mask=None, **_):
        return gdn_layer_forward(self, hidden_states, attention_mask, chunk_size=CHUNK, backend=backend)

    holder.layer.forward = types.MethodType(forward, holder.layer)
    return holder


def _interpreted_kernels() -> bool:
    from cpcompile.kernels.gdn.triton import prepare

    return type(prepare.gdn_fwd_prepare_kernel).__name__ == "InterpretedFunction"


def layer_cp_errors(rank: int, world: int, method: str, config: dict, local_len: int, dtype, seed: int,
                    device_type: str, compile_backend: str | None = None) -> dict:
    """Layer output, input gradient and parameter gradients: CP (triton) vs CP=1 (eager)."""
    import cpcompile

    device = torch.device(device_type, rank if device_type == "cuda" else 0) if device_type == "cuda" else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(device)
    batch, length, hidden_size = 2, local_len * world, config["hidden_size"]
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, length, hidden_size, generator=gen).to(device=device, dtype=dtype)
    weight = torch.randn(batch, length, hidden_size, generator=gen).to(device=device, dtype=dtype)
    block = slice(rank * local_len, (rank + 1) * local_len)

    def eager_run(run_dtype):
        model = use_core(gdn_layer(config, seed, run_dtype, device), "eager")
        inputs = hidden.to(run_dtype).clone().requires_grad_()
        output = model(inputs)
        (output * weight.to(run_dtype)).sum().backward()
        return model, inputs, output

    reference, ref_in, ref_out = eager_run(dtype)
    truth = eager_run(torch.float64)[0] if dtype == torch.float32 else reference

    plan = cpcompile.load_plan(gdn_plan(world, method, match="layer", chunk_size=CHUNK, backend="triton"))
    mesh = cpcompile.build_mesh(plan.accelerator, device_type=device_type)
    local_in = hidden[:, block].clone().requires_grad_()
    dump = tempfile.mkdtemp(prefix=f"gdn_triton_{method}_{rank}_")
    model = cpcompile.compile(gdn_layer(config, seed, dtype, device), mesh, plan, example_inputs=(local_in,),
                              dump_dir=dump)
    out = (torch.compile(model, backend=compile_backend) if compile_backend else model)(local_in)
    (out * weight[:, block]).sum().backward()
    return {
        "output": rel(out, ref_out[:, block]),
        "input_grad": rel(local_in.grad, ref_in.grad[:, block]),
        **parameter_grad_errors(model, reference, truth),  # truth: a float64 eager run (fp32 runs)
        "finite": bool(torch.isfinite(out).all() and all(torch.isfinite(p.grad).all() for p in model.parameters())),
        "interpreted": _interpreted_kernels() if device_type == "cpu" else None,
        "notes": json.load(open(os.path.join(dump, f"rank{rank}", "summary.json")))["regions"][0]["notes"],
    }


def _cpu_body(rank: int, world: int, seed: int, methods=("p2p", "ulysses"), compile_backend=None) -> dict:
    return {method: layer_cp_errors(rank, world, method, TINY, TINY_LOCAL_LEN, torch.float32, seed, "cpu",
                                    compile_backend) for method in methods}


def _worst(result: dict) -> float:
    return max([result["output"], result["input_grad"], *result["grads"].values()])


@cpu_only
def test_cp_triton_matches_eager_reference_in_interpreter():
    """P2P and Ulysses, 2 gloo ranks, fp32, against the eager CP=1 run (criterion: `_check_interpreted`)."""
    results = run_distributed(_cpu_body, 2, random.randrange(1 << 30), timeout=300,
                              env={"TRITON_INTERPRET": "1"})
    _check_interpreted(results)


def _cpu_body_on_triton_conv(rank: int, world: int, seed: int) -> dict:
    """`_cpu_body`'s State-P2P with the region's conv (F.conv1d on the halo-filled history, made a
    `causal_conv` call) on the Triton conv, as on CUDA once `TRITON_CONV_ON_GPU` is on; counted."""
    import cpcompile.kernels.gdn.conv as conv_module

    taken = []
    conv_module.triton_conv_applies = lambda x, backend: (
        backend == "triton" and not torch.compiler.is_compiling() and not taken.append(backend))
    result = _cpu_body(rank, world, seed, methods=("p2p",))
    assert taken, "the region's conv never took the Triton conv"
    return result


@cpu_only
def test_cp_triton_on_the_triton_conv_matches_eager_reference_in_interpreter():
    """As above, State-P2P with the CP region's conv (its halo from the previous rank) on the Triton conv."""
    _check_interpreted(run_distributed(_cpu_body_on_triton_conv, 2, random.randrange(1 << 30), timeout=300,
                                       env={"TRITON_INTERPRET": "1"}))


def _check_interpreted(results: list[dict]) -> None:
    """fp32: within 1e-4 of the eager CP=1 run, except the decay parameters' gradients, which must
    be as close to a float64 run as the eager CP=1 run is (they sum many cancelling terms)."""
    for result in results:
        for method, r in result.items():
            assert r["interpreted"], "the ranks' Triton kernels were not built for the interpreter"
            assert r["finite"], (method, r)
            others = [r["output"], r["input_grad"]] + [v for n, v in r["grads"].items() if n not in DECAY_GRADS]
            assert max(others) <= 1e-4, (method, r)
            for name in DECAY_GRADS:
                assert r["grads_vs_truth"][name] <= 10 * r["reference_vs_truth"][name] + 1e-6, (method, name, r)
            if method == "p2p":  # the fused executor, not the eager graph chain
                assert any("cpcompile::gdn_p2p_chunk" in note for note in r["notes"]), r["notes"]


@cpu_only
def test_cp_triton_p2p_three_ranks_in_interpreter():
    """A middle rank receives and sends in both directions: State-P2P on 3 gloo ranks, the layer
    under torch.compile (aot_eager), where the executor op is one opaque node forward and backward."""
    results = run_distributed(_cpu_body, 3, random.randrange(1 << 30), ("p2p",), "aot_eager", timeout=300,
                              env={"TRITON_INTERPRET": "1"})
    _check_interpreted(results)


def _p2p_op_body(rank: int, world: int, seed: int, local_len: int) -> dict:
    """`cpcompile::gdn_p2p_chunk` on this rank's segment vs the eager core on the whole sequence.
    Weak decay and small write strengths keep the segments' transition products far from zero, so
    a wrong state or state gradient crossing a rank boundary shows in every later rank's numbers."""
    import torch.distributed as dist

    ops = torch.ops.cpcompile
    q, k, v, _, _, _ = _op_inputs(1, local_len * world, 1, 2, 16, 16, torch.float32, "cpu", seed)
    gen = torch.Generator().manual_seed(seed + 1)
    g = -0.02 * torch.rand(v.shape[:3], generator=gen)
    beta = 0.1 * torch.rand(v.shape[:3], generator=gen)
    d_o = torch.randn(v.shape, generator=gen)
    block = slice(rank * local_len, (rank + 1) * local_len)
    full = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    o_ref = ops.gdn_chunk(*full, None, 0.25, CHUNK, "eager")
    (o_ref * d_o).sum().backward()
    local = [x[:, block].clone().requires_grad_() for x in (q, k, v, g, beta)]
    o, h_in = ops.gdn_p2p_chunk(*local, 0.25, CHUNK, dist.group.WORLD.group_name, rank, world)
    (o * d_o[:, block]).sum().backward()
    errors = {"o": rel(o, o_ref[:, block])}
    errors.update({f"d{n}": rel(a.grad, b.grad[:, block]) for n, a, b in zip(("q", "k", "v", "g", "beta"), local, full)})
    # every rank runs the same opcheck sequence, so each of its calls' sends meets its receive
    torch.library.opcheck(ops.gdn_p2p_chunk.default, (*local, 0.25, CHUNK, dist.group.WORLD.group_name, rank, world))
    return errors


@cpu_only
def test_p2p_op_chain_matches_whole_sequence_in_interpreter():
    """4 gloo ranks: outputs and every input gradient of each segment equal the whole-sequence core;
    the op passes `torch.library.opcheck` (schema, fake, autograd registration, AOT dispatch)."""
    # 40 local tokens: one partial chunk a rank (the loopback test below runs two chunks a rank)
    results = run_distributed(_p2p_op_body, 4, random.randrange(1 << 30), 40, timeout=300,
                              env={"TRITON_INTERPRET": "1"})
    for rank, errors in enumerate(results):
        assert max(errors.values()) <= 1e-4, (rank, errors)


def _packed_body(rank: int, world: int, seed: int, triton_conv: bool) -> dict:
    """A tiny Qwen3.5 (GDN head dims 16) on the packed row of test_gdn_packed, its GDN layers on
    triton State-P2P, Ulysses, State-P2P (SDPA AllGather), against the unrewritten model (eager GDN
    core) on each document alone: logits, loss and every gradient. `triton_conv`: the regions' conv
    (the packed taps made one `causal_conv` call, passes/gdn/conv_taps.py) runs the Triton conv, as
    on CUDA once `TRITON_CONV_ON_GPU` is on; the calls that took it are counted."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    import cpcompile.kernels.gdn.conv as conv_module

    taken = []
    if triton_conv:  # what `triton_conv_applies` says on CUDA with the switch on, here on CPU tensors
        conv_module.triton_conv_applies = lambda x, backend: (
            backend == "triton" and not torch.compiler.is_compiling() and not taken.append(backend))

    from cp_harness import cp_outputs, each_document_alone
    from gdn_harness import TEXT, decay_vs_truth, gdn_wrapper, use_reference_gdn
    from test_gdn_packed import packed_batch

    def make(dtype=torch.float32):
        torch.manual_seed(seed)
        config = Qwen3_5TextConfig(**dict(TEXT, linear_key_head_dim=16, linear_value_head_dim=16),
                                   attn_implementation="sdpa")
        return Qwen3_5ForCausalLM(config).to(dtype)

    batch, spans = packed_batch(seed, world)
    want = each_document_alone(use_reference_gdn(make()), batch, spans)
    truth = each_document_alone(use_reference_gdn(make(torch.float64)), batch, spans)
    overrides = [{"match": f"model.layers.{i}.linear_attn", "when": "cp", "region_dispatch": False,
                  "inner_target": "self", "inner_wrapper": gdn_wrapper(method, chunk_size=CHUNK, backend="triton")}
                 for i, method in enumerate(("p2p", "ulysses", "p2p"))]
    overrides.append({"match": "*.self_attn", "when": "cp", "region_dispatch": False, "inner_wrapper": "sdpa_hf"})
    got = cp_outputs(make, batch, {"accelerator": {"cp_size": world}, "plan_overrides": overrides})
    grads = {n: rel(got["grads"][n], g) for n, g in want["grads"].items()}
    return {"logits": rel(got["logits"], want["logits"]), "loss": rel(got["loss"], want["loss"]), "grads": grads,
            "decay_vs_truth": decay_vs_truth(got["grads"], want["grads"], truth["grads"]),
            "interpreted": _interpreted_kernels(), "triton_conv_calls": len(taken)}


@cpu_only
@pytest.mark.parametrize("triton_conv", [False, True], ids=["torch_conv", "triton_conv"])
def test_packed_cp_triton_equals_each_document_alone_in_interpreter(triton_conv):
    """Packed documents (odd lengths, one crossing the rank boundary, some shorter than the conv)
    through triton State-P2P and Ulysses on 2 gloo ranks, fp32: logits, loss and gradients within
    1e-4 of each document run alone, the decay parameters' gradients as close to a float64 run as
    the fp32 reference is (as the eager backend's packed test); also with the regions' conv on the
    Triton conv (off on GPUs until a GPU run has checked it: kernels/gdn/conv.py)."""
    from gdn_harness import DECAY_PARAMS, assert_decay_as_close_as_reference

    for result in run_distributed(_packed_body, 2, random.randrange(1 << 30), triton_conv, timeout=600,
                                  env={"TRITON_INTERPRET": "1"}):
        assert result["interpreted"], result
        assert (result["triton_conv_calls"] > 0) == triton_conv, result
        rest = [e for n, e in result["grads"].items() if not n.endswith(DECAY_PARAMS)]
        assert max([result["logits"], result["loss"], *rest]) <= 1e-4, result
        assert_decay_as_close_as_reference(result["decay_vs_truth"])


# ----------------------------------------------------------------------------- the ops themselves


def _op_inputs(B, T, Hk, Hv, K, V, dtype, device, seed):
    """Inputs as the Qwen3.5 layer hands them to the core: q/k L2-normalised fp32, v/beta in the
    model dtype, g fp32 (log decay)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, Hk, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, Hk, K, generator=gen), dim=-1)
    v = torch.randn(B, T, Hv, V, generator=gen).to(dtype)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, Hv, generator=gen) + 2.0)
    beta = torch.sigmoid(torch.randn(B, T, Hv, generator=gen)).to(dtype)
    h0 = torch.randn(B, Hv, K, V, generator=gen)
    return [x.to(device) for x in (q, k, v, g, beta, h0)]


def _op_errors(B, T, Hk, Hv, K, V, dtype, device, seed) -> dict:
    """gdn_chunk with an initial state, forward and every gradient: triton vs eager on the same
    inputs (the eager op computes in fp32)."""
    inputs = _op_inputs(B, T, Hk, Hv, K, V, dtype, device, seed)
    d_o = torch.randn(B, T, Hv, V, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    runs = {}
    for backend in ("triton", "eager"):
        leaves = [x.clone().requires_grad_() for x in inputs]
        o = torch.ops.cpcompile.gdn_chunk(*leaves, K ** -0.5, CHUNK, backend)
        (o * d_o).sum().backward()
        runs[backend] = dict(o=o, grads=[x.grad for x in leaves], dtypes=[o.dtype, *(x.grad.dtype for x in leaves)])
    t, e = runs["triton"], runs["eager"]
    errors = {"o": rel(t["o"], e["o"])}
    errors.update({f"d{n}": rel(a, b) for n, a, b in zip(("q", "k", "v", "g", "beta", "h0"), t["grads"], e["grads"])})
    assert t["dtypes"] == e["dtypes"], (t["dtypes"], e["dtypes"])
    return errors


@cpu_only
@pytest.mark.parametrize("T", [100, 64])
def test_triton_ops_match_eager(T):
    errors = _op_errors(1, T, 1, 2, 16, 32, torch.float32, "cpu", seed=T)
    assert max(errors.values()) <= 1e-4, errors


@cpu_only
def test_opcheck_triton_paths():
    ops = torch.ops.cpcompile
    q, k, v, g, beta, h0 = _op_inputs(1, 40, 1, 2, 16, 16, torch.float32, "cpu", seed=3)
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta, h0)]
    torch.library.opcheck(ops.gdn_chunk.default, (*leaves, 0.25, CHUNK, "triton"))
    torch.library.opcheck(ops.gdn_chunk.default, (*leaves[:5], None, 0.25, CHUNK, "triton"))
    det = [x.detach() for x in leaves]
    d_o = torch.randn(1, 40, 2, 16)
    torch.library.opcheck(ops.gdn_chunk_backward.default, (d_o, *det, 0.25, CHUNK, "triton"))
    torch.library.opcheck(ops.gdn_chunk_backward.default, (d_o, *det[:5], None, 0.25, CHUNK, "triton"))


def test_summary_op_refuses_the_triton_backend():
    """The triton State-P2P path is the executor op; a triton `gdn_summary` would be a second,
    untested way to the same numbers."""
    k, v, g, beta = _op_inputs(1, 8, 1, 1, 16, 16, torch.float32, "cpu", seed=0)[1:5]
    with pytest.raises(ValueError, match="gdn_summary runs the eager backend only.*gdn_p2p_chunk"):
        torch.ops.cpcompile.gdn_summary(k, v, g, beta, CHUNK, "triton")


def test_triton_backend_without_interpreter_fails_at_compile():
    """On a CPU machine (no CUDA device) without TRITON_INTERPRET, `compile` refuses the triton
    backend, naming the capability; nothing falls back to eager."""
    code = (
        "import torch, cpcompile\n"
        "from cpcompile.adapters.qwen3_5 import qwen3_5_gdn_p2p_cp_wrapper\n"
        "from cpcompile.adapters.qwen3_5 import GdnRegion\n"
        "import sys\n"
        "try:\n"
        "    GdnRegion(qwen3_5_gdn_p2p_cp_wrapper(backend='triton'))\n"
        "except Exception as e:\n"
        "    print(type(e).__name__, e); sys.exit(0)\n"
        "sys.exit('no error')\n"
    )
    if HAS_CUDA:
        pytest.skip("a CUDA device is visible: the device capability holds")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
    assert "GDNCapabilityError GDN triton backend: unsupported device" in res.stdout, res.stdout
    assert "TRITON_INTERPRET=1" in res.stdout


# ----------------------------------------------------------------------------- GPU set


@gpu
@needs_cuda
def test_gpu_triton_ops_match_eager_bf16():
    """gdn_chunk forward and backward through Triton vs the eager op (fp32 math) at T = 4K, bf16
    v/beta, Qwen3.5's head shape."""
    errors = _op_errors(1, 4096, 2, 4, 128, 128, torch.bfloat16, "cuda", seed=1)
    print("gdn_chunk triton vs eager, T=4096 bf16:", {k: f"{v:.1e}" for k, v in errors.items()})
    assert max(errors.values()) <= 2e-2, errors


@gpu
@needs_cuda
def test_gpu_layer_triton_matches_eager_bf16():
    """One GPU, CP=1: a bf16 Qwen3.5 GDN layer (T = 8K = 2 ranks x 4K) with the triton core, judged
    as CP is on a GPU: against the layer in fp32 (eager core), within 1.5x the error of the bf16
    layer with the eager core (+1e-3), for the output, the input gradient and every parameter —
    except the decay parameters, held to 2x: the triton kernels' decay gradient is the known
    accuracy gap (H200, 2026-12-01: A_log 1.15e-2 against eager bf16's 6.9e-3; the GDN kernel
    issue asks for it to reach fla-core's)."""
    from cpcompile.parity import within_precision

    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(2, 2 * GPU_LOCAL_LEN, GPU_SIZE["hidden_size"], generator=gen).to("cuda", torch.bfloat16)
    weight = torch.randn(hidden.shape, generator=gen).to("cuda", torch.bfloat16)
    runs = {}
    for name, backend, dtype in (("triton", "triton", torch.bfloat16), ("eager", "eager", torch.bfloat16),
                                 ("fp32", "eager", torch.float32)):
        model = use_core(gdn_layer(GPU_SIZE, 7, torch.bfloat16, "cuda").to(dtype), backend)
        x = hidden.to(dtype).clone().requires_grad_()  # a fresh leaf per run
        out = model(x)
        (out * weight.to(dtype)).sum().backward()
        runs[name] = {"output": out, "input_grad": x.grad,
                      **{n: p.grad for n, p in model.named_parameters() if p.grad is not None}}
    errors = {run: {k: rel(v, runs["fp32"][k]) for k, v in runs[run].items()} for run in ("triton", "eager")}
    print("layer vs fp32, T=8192, triton / eager bf16:",
          {k: f"{errors['triton'][k]:.1e}/{errors['eager'][k]:.1e}" for k in errors["eager"]})
    failing = {k: (errors["triton"][k], errors["eager"][k]) for k in errors["eager"]
               if not within_precision(errors["triton"][k], errors["eager"][k], factor=_gpu_layer_factor(k))}
    assert not failing, failing


def _gpu_layer_factor(name: str) -> float:
    """How far the triton layer's error may exceed the eager bf16 layer's (see the test above)."""
    return 2.0 if name.endswith(("A_log", "dt_bias")) else 1.5


class LoopbackRing:
    """One process plays every rank of a ring in turn (forward 0..P-1, backward P-1..0): what a rank
    sends is what its neighbour's next receive returns. Runs the executor's own code path on one
    device, where a multi-rank NCCL run needs several."""

    class Done:
        def wait(self):
            pass

    def __init__(self, world: int):
        self.world, self.rank, self.mailbox = world, 0, {}

    def post_recv(self, like, offset):
        sender = self.rank + offset
        if not 0 <= sender < self.world:
            return None
        return self.mailbox.pop((sender, self.rank)), self.Done()

    def send(self, tensor, offset):
        if not 0 <= self.rank + offset < self.world:
            return None
        self.mailbox[(self.rank, self.rank + offset)] = tensor.float().clone()
        return self.Done()


# Qwen3.5's GDN head size (K = V = 128: several value-column blocks in every state kernel, STATE_BV)
# with 2 value heads per key head; the GPU runs take its 2 key heads, the interpreter one (each
# head is a program of its own: a second one is the same path at twice the interpreter's time).
GPU_LOOPBACK_HEADS, CPU_LOOPBACK_HEADS = (2, 4), (1, 2)


def loopback_p2p_errors(T: int, world: int, dtype, device: str, seed: int, ring=None,
                        heads: tuple[int, int] = GPU_LOOPBACK_HEADS) -> dict:
    """The executor over `world` segments of one sequence vs the triton core on the whole of it
    (``ring``: a ``LoopbackRing`` of ``world`` ranks, default a new one; ``heads``: key, value heads)."""
    from cpcompile.kernels.gdn.triton.p2p_executor import p2p_backward, p2p_forward

    q, k, v, _, _, _ = _op_inputs(1, T, *heads, 128, 128, dtype, device, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    g = (-0.05 * torch.rand(v.shape[:3], generator=gen)).to(device)
    beta = (0.2 * torch.rand(v.shape[:3], generator=gen)).to(device, dtype)
    d_o = torch.randn(v.shape, generator=gen).to(device, dtype)
    scale = 128 ** -0.5
    full = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    o_ref = torch.ops.cpcompile.gdn_chunk(*full, None, scale, CHUNK, "triton")
    (o_ref.float() * d_o.float()).sum().backward()
    ring, cut = ring or LoopbackRing(world), T // world
    segments = [[x[:, r * cut:(r + 1) * cut].detach() for x in (q, k, v, g, beta)] for r in range(world)]
    outs, states, grads = [], [], [None] * world
    for ring.rank in range(world):
        o, h_in = p2p_forward(*segments[ring.rank], scale, CHUNK, ring)
        outs.append(o)
        states.append(h_in)
    for ring.rank in reversed(range(world)):
        r = ring.rank
        grads[r] = p2p_backward(d_o[:, r * cut:(r + 1) * cut], *segments[r], states[r], scale, CHUNK, ring)
    errors = {"o": rel(torch.cat(outs, 1), o_ref)}
    for i, name in enumerate(("q", "k", "v", "g", "beta")):
        errors[f"d{name}"] = rel(torch.cat([gr[i] for gr in grads], 1), full[i].grad)
    return errors


@cpu_only
def test_p2p_executor_loopback_in_interpreter():
    errors = loopback_p2p_errors(3 * 70, 3, torch.float32, "cpu", seed=5, heads=CPU_LOOPBACK_HEADS)
    assert max(errors.values()) <= 1e-4, errors


class WaitLoggingRing(LoopbackRing):
    """Logs ("wait", rank) when a rank waits for the state gradient from r+1 (a backward receive)."""

    def __init__(self, world: int, log: list):
        super().__init__(world)
        self.log = log

    def post_recv(self, like, offset):
        posted = super().post_recv(like, offset)
        if posted is None or offset != +1:
            return posted
        log, rank = self.log, self.rank

        class Work:
            def wait(self):
                log.append(("wait", rank))

        return posted[0], Work()


@cpu_only
def test_p2p_backward_rank0_fills_its_wait_and_the_others_send_first(monkeypatch):
    """Rank 0 has no summary and nothing waits on it: the finish's state pass from H_in runs before
    its wait. Ranks > 0 keep only the summary before their wait, which also precedes their send."""
    from cpcompile.kernels.gdn.triton import launch

    log: list = []
    ring = WaitLoggingRing(3, log)
    for name in ("p2p_bwd_summary", "p2p_bwd_states"):
        def logged(*args, _real=getattr(launch, name), _name=name, **kwargs):
            log.append((_name, ring.rank))
            return _real(*args, **kwargs)
        monkeypatch.setattr(launch, name, logged)
    errors = loopback_p2p_errors(3 * 40, 3, torch.float32, "cpu", seed=8, ring=ring,  # the order, not the chunking
                                 heads=CPU_LOOPBACK_HEADS)
    assert max(errors.values()) <= 1e-4, errors
    assert log == [("p2p_bwd_summary", 2), ("p2p_bwd_summary", 1), ("wait", 1), ("p2p_bwd_states", 0), ("wait", 0)]


def _gpu_body(rank: int, world: int, seed: int) -> dict:
    return {method: layer_cp_errors(rank, world, method, GPU_SIZE, GPU_LOCAL_LEN, torch.bfloat16, seed, "cuda")
            for method in ("p2p", "ulysses")}


@gpu
@needs_cuda
@pytest.mark.parametrize("T", [4096, 16384])
def test_gpu_p2p_executor_loopback_bf16(T):
    """The State-P2P executor's kernels and state exchange on one GPU, 4 segments of a bf16
    sequence (q/k fp32 as the layer hands them over) against the triton core on the whole of it."""
    errors = loopback_p2p_errors(T, 4, torch.bfloat16, "cuda", seed=T)
    print(f"P2P executor (loopback, 4 segments) vs whole-sequence core, T={T} bf16:",
          {k: f"{v:.1e}" for k, v in errors.items()})
    assert max(errors.values()) <= 2e-2, errors


@gpu
@needs_two_gpus
def test_gpu_cp_triton_matches_eager_reference_bf16():
    results = run_distributed(_gpu_body, 2, random.randrange(1 << 30), timeout=600, backend="nccl",
                              start_method="spawn")
    for result in results:
        for method, r in result.items():
            assert r["finite"], (method, r)
            assert _worst(r) <= 1e-2, (method, r)
