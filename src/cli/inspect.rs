use std::process::ExitCode;

use anyhow::Result;
use clap::Args as ClapArgs;

use crate::checkpoint::{self, ModelConfig, Tokenizer, WeightStore, weights::dtype_name};

#[derive(ClapArgs)]
pub struct Args {
    /// Checkpoint directory or Hugging Face repo id.
    checkpoint: String,
}

pub fn run(a: Args) -> Result<ExitCode> {
    let dir = checkpoint::resolve(&a.checkpoint, &std::env::current_dir()?)?;
    let c = ModelConfig::load(&dir)?;
    let weights = WeightStore::load(&dir)?;
    println!("checkpoint   {}", dir.display());
    println!(
        "architecture {} ({} layers, hidden {}, intermediate {}, vocab {})",
        c.arch.name(),
        c.num_layers,
        c.hidden_size,
        c.intermediate_size,
        c.vocab_size
    );
    println!("attention    {} heads, {} KV heads, head_dim {}", c.num_heads, c.num_kv_heads, c.head_dim);
    println!(
        "rope         theta {}, scaling {:?}, context {}",
        c.rope_theta, c.rope_scaling, c.max_position_embeddings
    );
    let stored = weights.dtype_of("model.norm.weight").map(dtype_name).unwrap_or("unknown");
    println!("dtype        {stored} (stored float tensors)");
    match &c.quantization {
        Some(q) => println!(
            "quantization affine, {} bits, group {}{}",
            q.default.bits,
            q.default.group_size,
            if q.overrides.is_empty() {
                String::new()
            } else {
                format!(", {} per-module overrides", q.overrides.len())
            }
        ),
        None => println!("quantization none"),
    }
    let params = parameter_count(&weights, &c);
    println!(
        "parameters   {:.1}M ({} tensors in {} file(s), {:.1} MB on disk)",
        params as f64 / 1e6,
        weights.names().count(),
        weights.files.len(),
        weights.stored_bytes as f64 / 1e6
    );
    let tied = c.tie_word_embeddings.unwrap_or(!weights.contains("lm_head.weight"));
    println!("embeddings   {}", if tied { "tied (output projection = embedding)" } else { "separate lm_head" });
    match Tokenizer::load(&dir) {
        Ok(t) => println!(
            "tokenizer    {} tokens, chat template: {}",
            t.vocab_size(),
            t.chat_template.as_ref().map(|ct| ct.file.display().to_string()).unwrap_or_else(|| "none".into())
        ),
        Err(e) => println!("tokenizer    unavailable: {e}"),
    }
    Ok(ExitCode::SUCCESS)
}

/// Logical parameters: a packed uint32 holds 32/bits weights; scales and biases are overhead,
/// not parameters.
fn parameter_count(w: &WeightStore, c: &ModelConfig) -> u64 {
    let bits = c.quantization.as_ref().map(|q| q.default.bits).unwrap_or(32) as u64;
    w.names()
        .filter(|n| !n.ends_with(".scales") && !n.ends_with(".biases"))
        .map(|n| {
            let (count, packed) = w.numel_and_packed(n);
            if packed { count * 32 / bits } else { count }
        })
        .sum()
}
