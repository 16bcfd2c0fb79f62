//! Llama family (Llama 3.x, SmolLM2, `LlamaForCausalLM`): the shared decoder as is.
//!
//! Tensor layout (Hugging Face names): `model.embed_tokens`, per layer `input_layernorm`,
//! `self_attn.{q,k,v,o}_proj`, `post_attention_layernorm`, `mlp.{gate,up,down}_proj`, then
//! `model.norm` and `lm_head` (absent when tied). RoPE may carry Llama 3 `rope_scaling`.

use super::FamilySpec;
use super::layers::{Activation, NormGain};

pub const SPEC: FamilySpec = FamilySpec {
    qk_norm: false,
    // mlx-lm's default; Llama 3.2 1B/3B and SmolLM2 say `true` explicitly, 8B says `false`.
    tie_by_default: true,
    norm_gain: NormGain::Stored,
    sandwich_norms: false,
    embed_scale: false,
    activation: Activation::Silu,
};
