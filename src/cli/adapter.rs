use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Args as ClapArgs;

use crate::checkpoint::{self, ModelConfig};
use crate::dtype::DtypeSetting;
use crate::model::Model;
use crate::vocab::BuiltinPath;

/// Serve parity's own runtime over the step protocol on stdin/stdout (docs/step-protocol.md):
/// an engine adapter, used as `command = ["{parity}", "adapter", "{model}"]` in a suite.
#[derive(ClapArgs)]
pub struct Args {
    #[command(flatten)]
    pub device: super::DeviceArg,
    /// Checkpoint: a directory, a Hugging Face repo id in the local cache, or a fixture spec.
    pub checkpoint: String,
    /// The builtin path this adapter serves: a KV backend, batched or row-by-row attention.
    #[arg(long, default_value = "dense", value_name = "dense|paged|dense-rowwise|paged-rowwise")]
    pub path: BuiltinPath,
    /// Compute dtype: float32, bfloat16, float16 or native.
    #[arg(long, default_value = "float32")]
    pub dtype: DtypeSetting,
    /// Dequantize quantized weights at load (faster on MLX's CPU backend).
    #[arg(long)]
    pub dequantize: bool,
}

pub fn run(a: Args) -> Result<ExitCode> {
    let cwd = std::env::current_dir()?;
    let dir = checkpoint::resolve(&a.checkpoint, &cwd)?;
    let config = ModelConfig::load(&dir)?;
    let model = Model::load(&dir, config, a.dtype.resolve(), a.dequantize)
        .with_context(|| format!("loading {}", dir.display()))?;
    let mut engine = crate::engine::builtin::BuiltinAdapter::new(&model, a.path);
    crate::engine::adapter::serve(&mut engine, std::io::stdin().lock(), std::io::stdout().lock())
        .context("serving the step protocol")?;
    Ok(ExitCode::SUCCESS)
}
