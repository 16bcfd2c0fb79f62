//! `parity bench CHECKPOINT`: both decode paths side by side (and mlx-lm, given its JSON).

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Args as ClapArgs;

use crate::bench::BenchRow;
use crate::bench::{self, BenchOptions};
use crate::checkpoint::{self, ModelConfig};
use crate::dtype::DtypeSetting;
use crate::kv::Backend;
use crate::model::Model;
use crate::vocab::BuiltinPath;

#[derive(ClapArgs)]
pub struct Args {
    #[command(flatten)]
    pub device: super::DeviceArg,
    /// Checkpoint directory or Hugging Face repo id.
    checkpoint: String,
    /// Paths to measure, repeatable or comma separated, as `parity run --backend` names them:
    /// dense, paged (batched attention), dense-rowwise, paged-rowwise (row by row).
    #[arg(long = "backend", value_name = "PATH", default_value = "dense,paged", value_delimiter = ',',
          value_parser = parse_path)]
    backends: Vec<BuiltinPath>,
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
    /// Measure this machine's memory read bandwidth (1 GiB on transparent huge pages where the
    /// kernel gives them, one thread and every core, best of five) and print each row's decode
    /// as a fraction of the rate it allows.
    #[arg(long)]
    limit: bool,
    /// Also time one decode step operation by operation for every path and batch (STEPS
    /// steps, each operation waited for), with the bandwidth each matmul reaches.
    #[arg(long, value_name = "STEPS", num_args = 0..=1, default_missing_value = "16")]
    profile: Option<usize>,
    /// JSON written by `ci/bench-mlx-lm` on the same checkpoint, prompt and decode length,
    /// dtype, dequantization and batch sizes: print parity vs mlx-lm.
    #[arg(long)]
    mlx_lm: Option<PathBuf>,
}

/// A builtin path name. `both` was bench's own spelling of "dense and paged"; `run` never had
/// it, so it is refused with the names that mean it (one flag, one meaning everywhere).
fn parse_path(s: &str) -> Result<BuiltinPath, String> {
    if s == "both" {
        return Err("`both` is not a path; name the paths: --backend dense,paged (the default)".into());
    }
    s.parse()
}

pub fn run(a: Args) -> Result<ExitCode> {
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
        crate::environment::mlx_version(),
        model.dtype.name(),
        if a.dequantize { " (dequantized at load)" } else { "" },
        crate::environment::device(),
        a.prompt_len,
        a.decode,
        a.reps,
        load_secs
    );
    let blas = crate::environment::blas();
    if let Some(b) = &blas {
        println!("BLAS {b}");
    }
    if let Some(m) = crate::environment::allocator() {
        println!("malloc {m}");
    }
    if let Some(j) = crate::environment::mlx_jit() {
        println!("MLX JIT {j}");
    }
    // The mlx-lm baseline is checked before measuring: a side-by-side figure is only worth
    // printing for the same computation.
    let mlx_lm: Option<serde_json::Value> = match &a.mlx_lm {
        None => None,
        Some(p) => {
            let text = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            let v: serde_json::Value =
                serde_json::from_str(&text).with_context(|| format!("parsing {}", p.display()))?;
            check_baseline(&v, &a, model.dtype.name(), blas.as_deref())
                .with_context(|| format!("{} does not match this run", p.display()))?;
            Some(v)
        }
    };
    let mut paths: Vec<BuiltinPath> = Vec::new();
    for p in &a.backends {
        if !paths.contains(p) {
            paths.push(*p);
        }
    }
    let rows = bench::bench(&model, &paths, &a.batch, opts)?;
    print!("{}", bench::render(&rows));
    // What a step at each batch reads of the weights: the float32 matrices, or their packed
    // twins where the BLAS reads those (batches up to Twin::max_rows).
    let weight_bytes = |batch: usize| -> u64 { model.matmul_bytes(batch).iter().map(|b| b.1).sum() };
    // Measured after the decode runs, not beside them: a bandwidth read while MLX's threads
    // run would be shared with them.
    let bandwidth = match a.limit {
        false => None,
        true => Some(limits(&rows, &weight_bytes)?),
    };
    let mut profiles = Vec::new();
    if let Some(steps) = a.profile {
        for &b in &a.batch {
            for &p in &paths {
                let prof = bench::profile(&model, p, b, a.prompt_len, steps, a.block_size)?;
                print!("{}", bench::render_profile(&prof));
                profiles.push(prof);
            }
        }
    }

    let tokens_differ = match &mlx_lm {
        Some(v) => compare_mlx_lm(v, &rows),
        None => false,
    };
    if let Some(p) = &a.json {
        let out = serde_json::json!({
            "checkpoint": dir.display().to_string(),
            "mlx_version": crate::environment::mlx_version(),
            "device": crate::environment::device(),
            "blas": blas,
            "dtype": model.dtype.name(),
            "dequantized": a.dequantize,
            "prompt_len": a.prompt_len,
            "decode": a.decode,
            "reps": a.reps,
            "block_size": a.block_size,
            "load_seconds": load_secs,
            "rows": rows,
            "bandwidth": bandwidth,
            "profiles": profiles,
            "mlx_lm": mlx_lm,
        });
        std::fs::write(p, serde_json::to_string_pretty(&out)?).with_context(|| format!("writing {}", p.display()))?;
    }
    if tokens_differ {
        eprintln!("error: parity and mlx-lm produced different greedy tokens for the same prompts");
        return Ok(ExitCode::from(super::EXIT_FAIL));
    }
    Ok(ExitCode::SUCCESS)
}

/// The memory read bandwidth of the device this run decoded on, and each row's decode as a
/// fraction of the rate it allows; the figures as JSON. Measured after the decode runs, never
/// beside them: a bandwidth read while MLX's threads run would be shared with them.
fn limits(rows: &[BenchRow], weight_bytes: &dyn Fn(usize) -> u64) -> Result<serde_json::Value> {
    // The float32 weights: what a step reads wherever no packed twin is read.
    let full = weight_bytes(usize::MAX);
    let (bandwidth, how) = if crate::environment::device() == "gpu" {
        let b = bench::device_read_bandwidth(1 << 30, 5)?;
        println!(
            "device read bandwidth (MLX's sum over 1 GiB, best of 5): {:.1} GB/s; weights read a decode step {:.1} MB",
            b / 1e9,
            full as f64 / 1e6
        );
        (b, serde_json::json!({ "device": b }))
    } else {
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        let one = bench::read_bandwidth(1 << 30, 1, 5);
        let all = bench::read_bandwidth(1 << 30, cores, 5);
        println!(
            "memory read bandwidth (1 GiB on huge pages where the kernel gives them, best of 5): {:.1} GB/s on one thread, {:.1} GB/s on {cores}; weights read a decode step {:.1} MB",
            one / 1e9,
            all / 1e9,
            full as f64 / 1e6
        );
        (all.max(one), serde_json::json!({ "one_thread": one, "all_threads": all, "threads": cores }))
    };
    let mut twinned = Vec::new();
    for r in rows {
        let limit = bench::decode_limit(full, r.kv.bytes_live, r.batch, bandwidth);
        print!(
            "  {} B={}: decode {:.1} tok/s of a {:.1} tok/s bandwidth limit ({:.0}%)",
            r.path,
            r.batch,
            r.decode_tps.median,
            limit,
            100.0 * r.decode_tps.median / limit
        );
        // Through packed twins a step reads less than the float32 weights, and the limit those
        // bytes allow is said beside the float32 one, never in its place: the float32 limit is
        // what the same products cost read as floats.
        let read = weight_bytes(r.batch);
        if read < full {
            let packed = bench::decode_limit(read, r.kv.bytes_live, r.batch, bandwidth);
            print!(
                "; through packed twins a step reads {:.1} MB, a {packed:.1} tok/s limit ({:.0}%)",
                read as f64 / 1e6,
                100.0 * r.decode_tps.median / packed
            );
            twinned.push(serde_json::json!({ "batch": r.batch, "weight_bytes": read }));
        }
        println!();
    }
    let mut v = how;
    v["bytes_per_second"] = serde_json::json!(bandwidth);
    v["weight_bytes"] = serde_json::json!(full);
    v["packed_twins"] = serde_json::json!(twinned);
    Ok(v)
}

/// A baseline is comparable only if it measured the same computation: prompt and decode
/// length, dtype, dequantization, device (a GPU baseline against a CPU run would compare
/// machines, not engines) and, for every batch size benched here, the same ragged lengths.
fn check_baseline(v: &serde_json::Value, a: &Args, dtype: &str, blas: Option<&str>) -> Result<()> {
    let device = crate::environment::device();
    let dequantized = v["dequantized"].as_bool().unwrap_or(false);
    if v["prompt_len"].as_u64() != Some(a.prompt_len as u64)
        || v["decode"].as_u64() != Some(a.decode as u64)
        || v["dtype"].as_str() != Some(dtype)
        || dequantized != a.dequantize
        || v["device"].as_str() != Some(device.as_str())
    {
        anyhow::bail!(
            "measured with prompt_len {}, decode {}, dtype {}, dequantized {dequantized}, device {}; this run uses {}, {}, {dtype}, {}, {device}",
            v["prompt_len"],
            v["decode"],
            v["dtype"],
            v["device"],
            a.prompt_len,
            a.decode,
            a.dequantize
        );
    }
    // The same BLAS kernel too: the generic one is 2-3x slower, so a ratio across kernels
    // measures OpenBLAS's CPU detection, not the engines. A baseline that names only the
    // library (older bench_mlx_lm.py) is checked for the library.
    let theirs = v["blas"].as_str().unwrap_or("");
    if let Some(ours) = blas {
        let differs = if theirs.starts_with("OpenBLAS") { theirs != ours } else { theirs == "netlib" };
        if differs {
            anyhow::bail!(
                "measured on BLAS `{theirs}`, this run uses `{ours}` (set OPENBLAS_CORETYPE the same for both)"
            );
        }
    }
    for &b in &a.batch {
        let theirs = batch_entry(v, b).ok_or_else(|| {
            anyhow::anyhow!("it has no batch_generate run at batch {b} (ci/bench-mlx-lm --batch {b})")
        })?;
        let lengths: Vec<u64> = theirs["prompt_lengths"]
            .as_array()
            .map(|l| l.iter().filter_map(|x| x.as_u64()).collect())
            .unwrap_or_default();
        let ours: Vec<u64> = bench::ragged_lengths(a.prompt_len, b).into_iter().map(|x| x as u64).collect();
        if lengths != ours {
            anyhow::bail!("batch {b} was measured with prompt lengths {lengths:?}, this run uses {ours:?}");
        }
    }
    Ok(())
}

fn batch_entry(v: &serde_json::Value, batch: usize) -> Option<&serde_json::Value> {
    v["batch_generate"].as_array()?.iter().find(|e| e["batch"].as_u64() == Some(batch as u64))
}

fn tokens_of(v: &serde_json::Value) -> Option<Vec<u32>> {
    v.as_array().map(|t| t.iter().filter_map(|x| x.as_u64()).map(|x| x as u32).collect())
}

/// Print parity against mlx-lm for every batch size; true when greedy tokens differ.
fn compare_mlx_lm(v: &serde_json::Value, rows: &[BenchRow]) -> bool {
    let version = v["mlx_lm_version"].as_str().unwrap_or("?");
    let median = |x: &serde_json::Value| x["median"].as_f64().unwrap_or(f64::NAN);
    let mut differ = false;
    let mut batches: Vec<usize> = rows.iter().map(|r| r.batch).collect();
    batches.dedup();
    for b in batches {
        let ours: Vec<&BenchRow> = rows.iter().filter(|r| r.batch == b).collect();
        let Some(theirs) = batch_entry(v, b) else { continue };
        let their_rows: Option<Vec<Vec<u32>>> =
            theirs["greedy_tokens"].as_array().map(|rs| rs.iter().filter_map(tokens_of).collect());
        let (decode, prefill) = (median(&theirs["decode_tps"]), median(&theirs["prefill_tps"]));
        let mut line =
            format!("vs mlx-lm {version} batch_generate B={b}: decode {decode:.1} tok/s, prefill {prefill:.1} tok/s;");
        for r in &ours {
            line += &format!(" {} {:.2}/{:.2}", r.path, r.decode_tps.median / decode, r.prefill_tps.median / prefill);
        }
        let same = their_rows.as_ref().map(|t| ours.iter().all(|r| &r.tokens == t));
        differ |= same == Some(false);
        line += &format!(" (parity/mlx-lm decode/prefill); greedy tokens {}", verdict(same));
        println!("{line}");
        if b == 1 {
            // mlx-lm's single-sequence generator, pipelined as parity's bench decode is; its
            // synchronous loop (the reference-check script) must give the same tokens.
            let Some(ours) = ours.iter().find(|r| r.backend == Backend::Dense) else { continue };
            let step = &v["generate_step"];
            let decode = median(&step["decode_tps"]);
            let checks: Vec<bool> = [tokens_of(&step["greedy_tokens"]), tokens_of(&v["greedy_tokens"])]
                .into_iter()
                .flatten()
                .map(|t| ours.tokens.first() == Some(&t))
                .collect();
            let same = (!checks.is_empty()).then(|| checks.iter().all(|&x| x));
            differ |= same == Some(false);
            println!(
                "vs mlx-lm {version} generate_step (B=1): decode {:.1} vs {decode:.1} tok/s (parity/mlx-lm {:.2}); greedy tokens {} (generate_step and its synchronous loop)",
                ours.decode_tps.median,
                ours.decode_tps.median / decode,
                verdict(same)
            );
        }
    }
    differ
}

fn verdict(same: Option<bool>) -> &'static str {
    match same {
        Some(true) => "identical",
        Some(false) => "DIFFER",
        None => "not compared",
    }
}
