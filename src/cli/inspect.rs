//! `parity inspect CHECKPOINT`: describe a checkpoint and validate it. The validation is the
//! loader's own (`Model::from_weights` over a [`WeightStore`] that records every problem), so
//! `inspect` passes exactly when `generate` and `run` can load it; it adds what loading does
//! not check (non-finite weights, a tokenizer larger than the vocabulary).
//!
//! Exit 0: valid. Exit 1: problems, each listed with its tensor or file. Exit 2: not found.

use std::process::ExitCode;

use anyhow::Result;
use clap::Args as ClapArgs;

use super::EXIT_FAIL;
use crate::checkpoint::{self, ModelConfig, Tokenizer, WeightStore, weights::dtype_name};
use crate::model::Model;

#[derive(ClapArgs)]
pub struct Args {
    /// Checkpoint directory or Hugging Face repo id.
    checkpoint: String,
}

pub fn run(a: Args) -> Result<ExitCode> {
    let dir = checkpoint::resolve(&a.checkpoint, &std::env::current_dir()?)?;
    println!("checkpoint   {}", dir.display());
    let mut problems: Vec<String> = Vec::new();
    let config = ModelConfig::load(&dir);
    let weights = WeightStore::load(&dir);
    if let Ok(c) = &config {
        describe(c, weights.as_ref().ok());
    }
    let tokenizer = Tokenizer::load(&dir);
    match (&tokenizer, &config) {
        (Ok(t), Ok(c)) => {
            println!(
                "tokenizer    {} tokens, chat template: {}",
                t.vocab_size(),
                t.chat_template.as_ref().map(|ct| ct.file.display().to_string()).unwrap_or_else(|| "none".into())
            );
            if t.vocab_size() > c.vocab_size {
                problems.push(format!(
                    "tokenizer: {} tokens, but config.json `vocab_size` is {}: ids past it have no embedding row",
                    t.vocab_size(),
                    c.vocab_size
                ));
            }
        }
        (Err(e), _) => problems.push(format!("tokenizer: {e}")),
        _ => {}
    }
    match (config, weights) {
        (Err(e), _) => problems.push(e.to_string()),
        (Ok(_), Err(e)) => problems.push(e.to_string()),
        (Ok(c), Ok(mut w)) => {
            problems.extend(w.non_finite()?.iter().map(ToString::to_string));
            // The loader is the validation: every tensor the architecture needs, checked
            // against config.json, every problem recorded (see checkpoint::weights).
            let tensors = w.names().count();
            match Model::from_weights(&mut w, c, None, false) {
                Ok(_) => {}
                Err(crate::error::Error::Checkpoint { problems: p, .. }) => {
                    problems.extend(p.iter().map(ToString::to_string))
                }
                Err(e) => problems.push(e.to_string()),
            }
            let unused = w.leftovers();
            if !unused.is_empty() {
                println!("unused       {} of {tensors} tensors: {}", unused.len(), shorten(&unused));
            }
        }
    }
    if problems.is_empty() {
        println!("valid        every tensor config.json needs is present, with its shape, dtype and layout");
        return Ok(ExitCode::SUCCESS);
    }
    println!("problems     {}", problems.len());
    for p in &problems {
        println!("  - {p}");
    }
    Ok(ExitCode::from(EXIT_FAIL))
}

fn describe(c: &ModelConfig, weights: Option<&WeightStore>) {
    println!(
        "architecture {} ({} layers, hidden {}, intermediate {}, vocab {})",
        c.arch.name(),
        c.num_layers,
        c.hidden_size,
        c.intermediate_size,
        c.vocab_size
    );
    println!("attention    {} heads, {} KV heads, head_dim {}", c.num_heads, c.num_kv_heads, c.head_dim);
    if let Some(w) = c.sliding_window {
        let local = (0..c.num_layers).filter(|&l| c.layer_window(l).is_some()).count();
        println!(
            "window       {} positions on {local} of {} layers (one in {} is global), local rope theta {}",
            w.size,
            c.num_layers,
            w.pattern,
            c.rope_local_theta.unwrap_or(c.rope_theta)
        );
    }
    println!(
        "rope         theta {}, scaling {:?}, context {}",
        c.rope_theta, c.rope_scaling, c.max_position_embeddings
    );
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
    let Some(weights) = weights else { return };
    let stored = weights.dtype_of("model.norm.weight").map(dtype_name).unwrap_or("unknown");
    println!("dtype        {stored} (stored float tensors)");
    let params = parameter_count(weights, c);
    println!(
        "parameters   {:.1}M ({} tensors in {} file(s), {:.1} MB on disk)",
        params as f64 / 1e6,
        weights.names().count(),
        weights.files.len(),
        weights.stored_bytes as f64 / 1e6
    );
    let tied = c.tie_word_embeddings.unwrap_or(!weights.contains("lm_head.weight"));
    println!("embeddings   {}", if tied { "tied (output projection = embedding)" } else { "separate lm_head" });
}

fn shorten(names: &[String]) -> String {
    let shown: Vec<&str> = names.iter().take(5).map(String::as_str).collect();
    let more = names.len().saturating_sub(shown.len());
    if more > 0 { format!("{}, and {more} more", shown.join(", ")) } else { shown.join(", ") }
}

/// Logical parameters: a packed uint32 holds 32/bits weights; scales and biases are overhead,
/// not parameters.
fn parameter_count(w: &WeightStore, c: &ModelConfig) -> u64 {
    let bits = c.quantization.as_ref().map(|q| q.default.bits).unwrap_or(32).max(1) as u64;
    w.names()
        .filter(|n| !n.ends_with(".scales") && !n.ends_with(".biases"))
        .map(|n| {
            let (count, packed) = w.numel_and_packed(n);
            if packed { count * 32 / bits } else { count }
        })
        .sum()
}
