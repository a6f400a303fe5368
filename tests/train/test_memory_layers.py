"""`trainer/memory_layers.py`'s per-token counts against what one bfloat16 layer of the 0.57B
Qwen3.5-shaped model of benchmarks/trainer_gpu.py holds on CPU (benchmarks/layer_memory.py: a
live-storage tracker; the GDN core on cpcompile's Triton launch code with its kernels skipped, so
its buffers are the GPU's). Within 1%: what is left are per-row and per-head vectors (rsqrt, the
gates) that memory_layers.py rounds."""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

# two lengths that are no width of the model (a tensor of a parameter's shape is not counted)
SHORT, LONG = 768, 1280


@pytest.fixture(scope="module")
def text():
    from layer_memory import text_config
    from trainer_gpu import MODEL

    return text_config(MODEL)


@pytest.fixture(scope="module")
def bf16():
    from cpcompile.trainer.memory_layers import ElementSizes

    return ElementSizes(param=4, compute=2, reduce=4)


def _measured(text, kind: str, checkpointing: str) -> dict[str, float]:
    from layer_memory import measure_layer, per_token

    return per_token(lambda tokens: measure_layer(text, kind, checkpointing, tokens), SHORT, LONG)


@pytest.mark.parametrize("kind", ["linear_attention", "full_attention"])
@pytest.mark.parametrize("checkpointing", ["checkpointed", "selective", "off"])
def test_a_layers_kept_bytes_and_backward_peak_are_what_it_holds(text, kind, checkpointing):
    from layer_memory import expected_layer_bytes

    got, want = _measured(text, kind, checkpointing), expected_layer_bytes(text, kind, checkpointing)
    assert got["kept"] == pytest.approx(want["kept"], rel=0.01), (got, want)
    assert got["peak"] == pytest.approx(want["peak"], rel=0.01), (got, want)


def test_the_gdn_core_backward_buffers_are_the_triton_launch_codes(text, bf16):
    """The core's moment, which the MLP's outgrows at these widths, counted on its own: the
    buffers the launchers in kernels/gdn/triton/ allocate, and all the layer holds meanwhile."""
    from cpcompile.trainer import memory_layers

    got = _measured(text, "linear_attention", "checkpointed")
    assert got["core_buffers"] == pytest.approx(memory_layers.gdn_core_backward_bytes(text, bf16), rel=0.01)
    at_core = memory_layers._core_backward_bytes(text, "linear_attention", bf16, 1, "all_gather") + text.hidden_size * 2
    assert got["at_core"] == pytest.approx(at_core, rel=0.01)
    assert got["at_core"] < got["peak"]


def test_the_final_norm_keeps_its_float_copies_and_its_output(text, bf16):
    from layer_memory import measure_final_norm, per_token

    from cpcompile.trainer.memory_layers import final_norm_bytes

    got = per_token(lambda tokens: {"kept": measure_final_norm(text, tokens)}, SHORT, LONG)["kept"]
    assert got == pytest.approx(final_norm_bytes(text, bf16), rel=0.01)


def test_the_chunked_losss_peak_is_one_chunks_logits_twice_and_the_float_weight_gradient(bf16):
    from layer_memory import measure_loss

    from cpcompile.trainer.memory import loss_bytes

    tokens, vocab, hidden, chunk = 1024, 8192, 256, 256
    got = measure_loss(tokens, vocab, hidden, chunk)
    settings = SimpleNamespace(loss="chunked", loss_chunk_tokens=chunk)
    want = loss_bytes(settings, SimpleNamespace(vocab_size=vocab, hidden_size=hidden), bf16, tokens)
    assert got["backward"] == pytest.approx(want, rel=0.01), got
    assert got["forward"] < got["backward"]


@pytest.mark.parametrize("checkpointing", ["checkpointed", "off"])
def test_a_gdn_layer_checkpointed_around_its_core_holds_what_memory_py_counts(text, checkpointing):
    """`train.gdn_checkpoint_around_core`: the ops before and after the core under checkpoints of
    their own. Its backward holds only the core's inputs and output of them (measured 170 -> 110 KB
    a token checkpointed: the core's moment is then the larger), and memory_layers.py counts that within 1%."""
    from layer_memory import expected_layer_bytes

    def measured(inner: bool) -> dict:
        from layer_memory import measure_layer, per_token

        return per_token(lambda t: measure_layer(text, "linear_attention", checkpointing, t, gdn_inner=inner),
                         SHORT, LONG)

    got, plain = measured(True), measured(False)
    want = expected_layer_bytes(text, "linear_attention", checkpointing, gdn_inner=True)
    assert got["peak"] == pytest.approx(want["peak"], rel=0.01), (got, want)
    assert got["kept"] == pytest.approx(want["kept"], rel=0.01), (got, want)
    assert got["peak"] < plain["peak"] - 50 * 1024, (got, plain)  # the conv's, q/k's and the norm's copies
