use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Args as ClapArgs;

use crate::checkpoint::{self, ModelConfig, Tokenizer};
use crate::dtype::DtypeSetting;
use crate::engine::builtin::{self, Builtin};
use crate::faults::Faults;
use crate::kv::Backend;
use crate::model::Model;
use crate::vocab::Settings;

#[derive(ClapArgs)]
pub struct Args {
    #[command(flatten)]
    pub device: super::DeviceArg,
    /// Checkpoint directory or Hugging Face repo id (resolved offline in the local HF cache).
    checkpoint: String,
    /// Prompt text.
    #[arg(long)]
    prompt: String,
    /// Render the prompt with the checkpoint's chat template.
    #[arg(long)]
    chat: bool,
    #[arg(long, default_value_t = 32)]
    max_tokens: usize,
    /// Compute dtype: float32, bfloat16, float16 or native (as stored).
    #[arg(long, default_value = "float32")]
    dtype: DtypeSetting,
    /// KV storage backend: dense or paged (`--kv` is the old spelling).
    #[arg(long, alias = "kv", default_value = "dense", value_name = "BACKEND")]
    backend: Backend,
    /// Rows per KV block (paged backend).
    #[arg(long, default_value_t = 32)]
    block_size: usize,
    /// Dequantize quantized weights at load (faster on CPU; recorded in output).
    #[arg(long)]
    dequantize: bool,
    /// Write {"prompt_ids", "tokens", "text", ...} as JSON to PATH, or to stdout with `-` or
    /// no value (as `run --json`).
    #[arg(long, value_name = "PATH", num_args = 0..=1, default_missing_value = "-")]
    json: Option<PathBuf>,
}

pub fn run(a: Args) -> Result<ExitCode> {
    let cwd = std::env::current_dir()?;
    let dir = checkpoint::resolve(&a.checkpoint, &cwd)?;
    let config = ModelConfig::load(&dir)?;
    let tokenizer = Tokenizer::load(&dir)?;
    let prompt_ids = if a.chat { tokenizer.encode_chat(&a.prompt)? } else { tokenizer.encode_raw(&a.prompt)? };
    if prompt_ids.is_empty() {
        // Say what the user did, not what the forward pass requires of a batch.
        anyhow::bail!(
            "the prompt {:?} encodes to zero tokens; give some text, or --chat to use the chat template",
            a.prompt
        );
    }
    let model = Model::load(&dir, config, a.dtype.resolve(), a.dequantize)
        .with_context(|| format!("loading {}", dir.display()))?;
    let settings = Settings { block_size: a.block_size, poison: false, ..Settings::default() };
    let mut kv = Builtin::new(&model, a.backend, &settings).kv(Faults::NONE)?;
    let (_, trace) = builtin::generate(&model, kv.as_mut(), &prompt_ids, a.max_tokens)?;
    // Garbage from NaN logits is not an answer: fail, blaming the checkpoint or runtime.
    crate::array::require_finite("logits", &trace.logits)?;
    let text = tokenizer.decode(&trace.tokens)?;
    if let Some(path) = &a.json {
        let out = serde_json::json!({
            "prompt_ids": prompt_ids,
            "tokens": trace.tokens,
            "text": text,
            "dtype": model.dtype.name(),
            "kv": a.backend.name(),
            "dequantized": model.dequantized,
            "device": crate::environment::device(),
        });
        let json = serde_json::to_string(&out)?;
        if path.as_os_str() == "-" {
            println!("{json}");
        } else {
            std::fs::write(path, json + "\n").with_context(|| format!("writing {}", path.display()))?;
            println!("{text}");
        }
    } else {
        println!("{text}");
    }
    Ok(ExitCode::SUCCESS)
}
