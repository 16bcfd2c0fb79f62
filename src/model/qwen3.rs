//! Qwen3: the Llama decoder plus a per-head RMSNorm on queries and keys (`self_attn.q_norm`,
//! `self_attn.k_norm`, weight `[head_dim]`), applied after the head split and before RoPE.
//! `head_dim` is explicit in config.json (it is not hidden / heads), rope_theta defaults to
//! 1e6 and small checkpoints tie the output projection to the embedding.

use super::FamilySpec;
use super::layers::{Activation, NormGain};

pub const SPEC: FamilySpec = FamilySpec {
    qk_norm: true,
    tie_by_default: true,
    norm_gain: NormGain::Stored,
    sandwich_norms: false,
    embed_scale: false,
    activation: Activation::Silu,
};
