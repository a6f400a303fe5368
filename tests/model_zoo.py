"""Tiny random-weight transformers causal LMs of many architectures, built from configs (no download).

`build(name, seed, **config)` returns a fresh model; `**config` overrides config fields. Every
model has 2 layers (hybrids: one of each kind where the architecture allows), hidden size 32,
vocabulary `cp_harness.VOCAB`, SDPA attention, so that CP=2 runs of every one of them fit the
2-core CI box.
"""
from __future__ import annotations

import torch

from cp_harness import VOCAB

ATTENTION = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
MAMBA = dict(mamba_d_state=8, mamba_d_conv=4, mamba_expand=2)
MAMBA2 = dict(MAMBA, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_chunk_size=8)


def _configs() -> dict:
    """name -> (config class, model class, config fields)."""
    import transformers as T

    return {
        "llama": (T.LlamaConfig, T.LlamaForCausalLM, dict(ATTENTION)),
        "mistral": (T.MistralConfig, T.MistralForCausalLM, dict(ATTENTION, head_dim=8, sliding_window=None)),
        "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, dict(ATTENTION)),
        "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, dict(ATTENTION, head_dim=8)),
        "gemma3": (T.Gemma3TextConfig, T.Gemma3ForCausalLM,
                   dict(ATTENTION, head_dim=8, sliding_window=64, layer_types=["sliding_attention", "full_attention"])),
        "phi3": (T.Phi3Config, T.Phi3ForCausalLM, dict(ATTENTION, pad_token_id=0)),
        "gpt_neox": (T.GPTNeoXConfig, T.GPTNeoXForCausalLM,
                     dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, attn_implementation="sdpa")),
        "falcon": (T.FalconConfig, T.FalconForCausalLM,  # multi-query: one KV head
                   dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        multi_query=True, new_decoder_architecture=False, attn_implementation="sdpa")),
        "qwen3_moe": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM,
                      dict(ATTENTION, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
        "jamba": (T.JambaConfig, T.JambaForCausalLM,
                  dict(ATTENTION, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                       expert_layer_offset=1, num_experts=2, num_experts_per_tok=1, mamba_dt_rank=4, **MAMBA)),
        "bamba": (T.BambaConfig, T.BambaForCausalLM, dict(ATTENTION, attn_layer_indices=[1], **MAMBA2)),
        "falcon_h1": (T.FalconH1Config, T.FalconH1ForCausalLM, dict(ATTENTION, head_dim=8, mamba_d_ssm=64, **MAMBA2)),
        "lfm2": (T.Lfm2Config, T.Lfm2ForCausalLM, dict(ATTENTION, layer_types=["conv", "full_attention"])),
        "qwen3_next": (T.Qwen3NextConfig, T.Qwen3NextForCausalLM,
                       dict(ATTENTION, head_dim=8, layer_types=["linear_attention", "full_attention"],
                            linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                            linear_num_value_heads=4, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=32, shared_expert_intermediate_size=32)),
        # multi-head latent attention: value head 16, query/key head 16 + 8 (rope part)
        "deepseek_v3": (T.DeepseekV3Config, T.DeepseekV3ForCausalLM,
                        dict(ATTENTION, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                             qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                             topk_group=1, moe_intermediate_size=16, first_k_dense_replace=1)),
        "llama4": (T.Llama4TextConfig, T.Llama4ForCausalLM,
                   dict(ATTENTION, head_dim=8, intermediate_size_mlp=64, num_local_experts=2,
                        no_rope_layer_interval=2, attention_chunk_size=None, attn_temperature_tuning=False)),
    }


def import_architectures() -> None:
    """Import every architecture's transformers modules now (conftest: forked ranks inherit them)."""
    _configs()


def build(name: str, seed: int, dtype=torch.float32, **config) -> torch.nn.Module:
    config_class, model_class, fields = _configs()[name]
    torch.manual_seed(seed)
    return model_class(config_class(**{**fields, **config})).to(dtype)
