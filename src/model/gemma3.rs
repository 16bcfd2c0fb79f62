//! Gemma 3 (text; `gemma3_text`, as mlx-lm's `gemma3_text.py`): the shared decoder with
//!
//! - sliding-window attention on every layer but each `sliding_window_pattern`-th (a global
//!   one), the window a property of the layer's mask ([`crate::checkpoint::ModelConfig::layer_window`]),
//!   and the local layers rotated with their own RoPE base (`rope_local_base_freq`);
//! - RMSNorms that multiply by `1 + w`, q/k norms among them, and four per block: around the
//!   attention's input and output (`input_layernorm`, `post_attention_layernorm`) and the
//!   MLP's (`pre_feedforward_layernorm`, `post_feedforward_layernorm`);
//! - attention scores scaled by `query_pre_attn_scalar^-0.5`;
//! - the embedding scaled by `sqrt(hidden_size)` rounded to bfloat16 first (mlx-lm multiplies
//!   by `mx.array(hidden_size**0.5, mx.bfloat16)`: 25.25, not 25.298, for 640);
//! - a GELU (tanh) gated MLP and the output tied to the embedding unless `lm_head` exists.

use super::FamilySpec;
use super::layers::{Activation, NormGain};

pub const SPEC: FamilySpec = FamilySpec {
    qk_norm: true,
    tie_by_default: true,
    norm_gain: NormGain::OffsetFromOne,
    sandwich_norms: true,
    embed_scale: true,
    activation: Activation::GeluTanh,
};
