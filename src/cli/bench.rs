//! `parity bench CHECKPOINT`: both decode paths side by side (and mlx-lm, given its JSON).

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Args as ClapArgs;

use crate::bench::{self, BenchOptions};
use crate::checkpoint::{self, ModelConfig};
use crate::dtype::DtypeSetting;
use crate::kv::Backend;
use crate::model::Model;

#[derive(ClapArgs)]
pub struct Args {
    /// Checkpoint directory or Hugging Face repo id.
    checkpoint: String,
    /// dense, paged or both.
    #[arg(long, default_value = "both")]
    backend: String,
    /// Batch sizes, comma separated.
    #[arg(long, default_value = "1,2,4,8", value_delimiter = ',')]
    batch: Vec<usize>,
    /// Prompt tokens of batch row 0 (later rows are shorter: ragged lengths).
    #[arg(long, default_value_t = 128)]
    prompt_len: usize,
    /// Decode steps.
    #[arg(long, default_value_t = 64)]
    decode: usize,
    /// Measured repetitions (after one warm-up).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    #[arg(long, default_value = "float32")]
    dtype: DtypeSetting,
    /// Dequantize quantized weights at load (recorded in the output).
    #[arg(long)]
    dequantize: bool,
    #[arg(long, default_value_t = 32)]
    block_size: usize,
    /// Write results as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// JSON written by `ci/bench-mlx-lm` on the same checkpoint, prompt and decode length:
    /// print parity vs mlx-lm.
    #[arg(long)]
    mlx_lm: Option<PathBuf>,
}

pub fn run(a: Args) -> Result<ExitCode> {
    let backends = match a.backend.as_str() {
        "both" => vec![Backend::Dense, Backend::Paged],
        b => vec![b.parse::<Backend>().map_err(anyhow::Error::msg)?],
    };
    if a.batch.is_empty() || a.batch.contains(&0) || a.prompt_len == 0 {
        anyhow::bail!("--batch sizes and --prompt-len must be positive");
    }
    let dir = checkpoint::resolve(&a.checkpoint, &std::env::current_dir()?)?;
    let config = ModelConfig::load(&dir)?;
    let t = std::time::Instant::now();
    let model = Model::load(&dir, config, a.dtype.resolve(), a.dequantize)?;
    let load_secs = t.elapsed().as_secs_f64();
    let opts = BenchOptions { prompt_len: a.prompt_len, decode: a.decode, reps: a.reps, block_size: a.block_size };
    println!(
        "{} | {} | dtype {}{} | device {} | prompt {} | decode {} | {} reps | load {:.2}s",
        dir.display(),
        crate::runtime::mlx_version(),
        model.dtype.name(),
        if a.dequantize { " (dequantized at load)" } else { "" },
        crate::runtime::device(),
        a.prompt_len,
        a.decode,
        a.reps,
        load_secs
    );
    // The mlx-lm baseline is checked before measuring: a side-by-side figure is only worth
    // printing for the same computation.
    let mlx_lm: Option<serde_json::Value> = match &a.mlx_lm {
        None => None,
        Some(p) => {
            let text = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            let v: serde_json::Value =
                serde_json::from_str(&text).with_context(|| format!("parsing {}", p.display()))?;
            // A GPU baseline against a CPU run (or other lengths/dtypes) would compare machines,
            // not engines.
            let device = crate::runtime::device();
            let same_setup = v["prompt_len"].as_u64() == Some(a.prompt_len as u64)
                && v["decode"].as_u64() == Some(a.decode as u64)
                && v["dtype"].as_str() == Some(model.dtype.name())
                && v["device"].as_str() == Some(device.as_str());
            if !same_setup {
                anyhow::bail!(
                    "{} was measured with prompt_len {}, decode {}, dtype {}, device {}; this run uses {}, {}, {}, {}",
                    p.display(),
                    v["prompt_len"],
                    v["decode"],
                    v["dtype"],
                    v["device"],
                    a.prompt_len,
                    a.decode,
                    model.dtype.name(),
                    device
                );
            }
            Some(v)
        }
    };
    let rows = bench::bench(&model, &backends, &a.batch, opts)?;
    print!("{}", bench::render(&rows));

    let mut tokens_differ = false;
    if let Some(v) = &mlx_lm
        && let Some(ours) = rows.iter().find(|r| r.batch == 1 && r.backend == Backend::Dense)
    {
        let theirs = |k: &str| v[k]["median"].as_f64().unwrap_or(f64::NAN);
        let same = v["greedy_tokens"].as_array().map(|t| {
            t.iter()
                .filter_map(|x| x.as_u64())
                .map(|x| x as u32)
                .take(ours.tokens.len())
                .eq(ours.tokens.iter().copied())
        });
        tokens_differ = same == Some(false);
        println!(
            "vs mlx-lm {} (B=1): decode {:.1} vs {:.1} tok/s (parity/mlx-lm {:.2}), prefill {:.1} vs {:.1} tok/s ({:.2}); greedy tokens {}",
            v["mlx_lm_version"].as_str().unwrap_or("?"),
            ours.decode_tps.median,
            theirs("decode_tps"),
            ours.decode_tps.median / theirs("decode_tps"),
            ours.prefill_tps.median,
            theirs("prefill_tps"),
            ours.prefill_tps.median / theirs("prefill_tps"),
            match same {
                Some(true) => "identical",
                Some(false) => "DIFFER",
                None => "not compared",
            }
        );
    }
    if let Some(p) = &a.json {
        let out = serde_json::json!({
            "checkpoint": dir.display().to_string(),
            "mlx_version": crate::runtime::mlx_version(),
            "device": crate::runtime::device(),
            "dtype": model.dtype.name(),
            "dequantized": a.dequantize,
            "prompt_len": a.prompt_len,
            "decode": a.decode,
            "reps": a.reps,
            "block_size": a.block_size,
            "load_seconds": load_secs,
            "rows": rows,
            "mlx_lm": mlx_lm,
        });
        std::fs::write(p, serde_json::to_string_pretty(&out)?).with_context(|| format!("writing {}", p.display()))?;
    }
    if tokens_differ {
        eprintln!("error: parity and mlx-lm produced different greedy tokens for the same prompt");
        return Ok(ExitCode::from(super::EXIT_FAIL));
    }
    Ok(ExitCode::SUCCESS)
}
