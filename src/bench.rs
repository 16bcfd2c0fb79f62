//! `parity bench`: prefill and decode speed and KV memory of both backends (and both attention
//! modes), in the same process and run, warm-up excluded, median and spread over repetitions.
//! Absolute times on a shared machine are noise; the ratios are the figures to read.

use std::time::Instant;

use serde::Serialize;

use crate::engine::builtin::Builtin;
use crate::error::Result;
use crate::faults::Faults;
use crate::kv::{Backend, KvCache, KvStats};
use crate::model::{AttentionMode, Model, RowStep};
use crate::vocab::{BuiltinPath, Settings};

/// Prompt ids shared with `ci/bench_mlx_lm.py`, so both runtimes do the same computation.
pub fn prompt_ids(len: usize, vocab: usize) -> Vec<u32> {
    (0..len)
        .map(|i| if vocab >= 21_000 { 1000 + (i * 7919) % 20_000 } else { 3 + (i * 7919) % (vocab - 3) } as u32)
        .collect()
}

/// Ragged prompt lengths for a batch: row 0 has `prompt_len`, later rows down to about half.
pub fn ragged_lengths(prompt_len: usize, batch: usize) -> Vec<usize> {
    (0..batch).map(|b| (prompt_len - b * prompt_len / (2 * batch)).max(1)).collect()
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    pub fn of(mut xs: Vec<f64>) -> Spread {
        xs.sort_by(|a, b| a.total_cmp(b));
        let n = xs.len();
        let median = if n == 0 {
            0.0
        } else if n % 2 == 1 {
            xs[n / 2]
        } else {
            (xs[n / 2 - 1] + xs[n / 2]) / 2.0
        };
        Spread { median, min: xs.first().copied().unwrap_or(0.0), max: xs.last().copied().unwrap_or(0.0) }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct BenchRow {
    /// `dense`, `paged` (batched attention) or `dense-rowwise`, `paged-rowwise`.
    pub path: String,
    pub backend: Backend,
    pub attention: AttentionMode,
    pub batch: usize,
    pub prompt_lengths: Vec<usize>,
    pub prefill_tps: Spread,
    pub decode_tps: Spread,
    pub ttft_ms: Spread,
    /// KV memory after the last decode step of a repetition.
    pub kv: KvStats,
    /// Greedy tokens of every batch row (first repetition), to check all paths computed the same.
    pub tokens: Vec<Vec<u32>>,
}

#[derive(Debug, Clone, Copy)]
pub struct BenchOptions {
    pub prompt_len: usize,
    pub decode: usize,
    pub reps: usize,
    pub block_size: usize,
}

/// Prefill tok/s, decode tok/s, TTFT ms, KV stats after decode, every row's tokens.
type Sample = (f64, f64, f64, KvStats, Vec<Vec<u32>>);

/// One repetition: prefill every row in one forward (left-padded to the longest, the pads
/// masked, as mlx-lm's batch_generate does), then `decode` batched greedy steps, pipelined as
/// mlx-lm's generators are: step n + 1 is built on step n's argmax, still on the device, and
/// queued before step n's tokens are read, so the host builds a graph while the last one runs.
fn once(model: &Model, kv: &mut dyn KvCache, lengths: &[usize], decode: usize, mode: AttentionMode) -> Result<Sample> {
    let vocab = model.config.vocab_size;
    let longest = lengths.iter().copied().max().unwrap_or(0);
    let mut seqs = Vec::with_capacity(lengths.len());
    let mut prompts = Vec::with_capacity(lengths.len());
    for &len in lengths {
        let pads = longest - len;
        seqs.push(kv.create(pads)?);
        let mut tokens = vec![0; pads];
        tokens.extend(prompt_ids(len, vocab));
        prompts.push(tokens);
    }
    let rows: Vec<RowStep> = seqs.iter().zip(prompts).map(|(&s, tokens)| RowStep::new(s, tokens)).collect();
    let t = Instant::now();
    let mut next = argmax(&model.forward_mode(kv, &rows, mode)?)?;
    let mut tokens: Vec<Vec<u32>> = host(&next)?.into_iter().map(|x| vec![x]).collect();
    let prefill_secs = t.elapsed().as_secs_f64();
    let t = Instant::now();
    for step in 0..decode {
        let following = argmax(&model.decode_next(kv, &seqs, &next, mode)?)?;
        mlx_rs::transforms::async_eval([&following])?;
        if step > 0 {
            push(&mut tokens, &next)?;
        }
        next = following;
    }
    if decode > 0 {
        push(&mut tokens, &next)?;
    }
    let decode_secs = t.elapsed().as_secs_f64();
    let total: usize = lengths.iter().sum();
    let stats = kv.stats();
    Ok((total as f64 / prefill_secs, (lengths.len() * decode) as f64 / decode_secs, prefill_secs * 1e3, stats, tokens))
}

fn argmax(logits: &mlx_rs::Array) -> Result<mlx_rs::Array> {
    Ok(mlx_rs::ops::indexing::argmax_axis(logits, -1, false)?)
}

/// Wait for `ids` and bring them to the host.
fn host(ids: &mlx_rs::Array) -> Result<Vec<u32>> {
    ids.eval()?;
    Ok(ids.as_slice::<u32>().to_vec())
}

fn push(tokens: &mut [Vec<u32>], ids: &mlx_rs::Array) -> Result<()> {
    for (row, x) in tokens.iter_mut().zip(host(ids)?) {
        row.push(x);
    }
    Ok(())
}

pub fn bench(model: &Model, paths: &[BuiltinPath], batches: &[usize], o: BenchOptions) -> Result<Vec<BenchRow>> {
    let settings = Settings { block_size: o.block_size, poison: false, ..Settings::default() };
    let builtin = |path: BuiltinPath| Builtin::new(model, path, &settings);
    let mut rows = Vec::new();
    for &batch in batches {
        let lengths = ragged_lengths(o.prompt_len, batch);
        // Warm-up: first-touch allocation and MLX's lazy initialisation, not measured.
        for &path in paths {
            once(model, builtin(path).kv(Faults::NONE)?.as_mut(), &lengths, o.decode.min(4), path.attention)?;
        }
        // Repetitions alternate the paths, so drift in a shared machine's speed lands on all
        // sides of a ratio instead of on one.
        let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); paths.len()];
        for _ in 0..o.reps.max(1) {
            for (i, &path) in paths.iter().enumerate() {
                let mut kv = builtin(path).kv(Faults::NONE)?;
                samples[i].push(once(model, kv.as_mut(), &lengths, o.decode, path.attention)?);
            }
        }
        for (&path, s) in paths.iter().zip(samples) {
            let kv = s.last().map(|x| x.3).unwrap_or_default();
            let tokens = s.first().map(|x| x.4.clone()).unwrap_or_default();
            rows.push(BenchRow {
                path: path.name(),
                backend: path.backend,
                attention: path.attention,
                batch,
                prompt_lengths: lengths.clone(),
                prefill_tps: Spread::of(s.iter().map(|x| x.0).collect()),
                decode_tps: Spread::of(s.iter().map(|x| x.1).collect()),
                ttft_ms: Spread::of(s.iter().map(|x| x.2).collect()),
                kv,
                tokens,
            });
        }
    }
    Ok(rows)
}

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

pub fn render(rows: &[BenchRow]) -> String {
    let mut s = String::new();
    s += &format!(
        "{:<13} {:>5} {:>22} {:>22} {:>10} {:>10} {:>10} {:>10}\n",
        "path",
        "batch",
        "prefill tok/s (min-max)",
        "decode tok/s (min-max)",
        "TTFT ms",
        "KV live",
        "KV in use",
        "reserved"
    );
    for r in rows {
        s += &format!(
            "{:<13} {:>5} {:>8.1} ({:>5.1}-{:>5.1}) {:>8.1} ({:>5.1}-{:>5.1}) {:>10.1} {:>8.2}Mi {:>8.2}Mi {:>8.2}Mi\n",
            r.path,
            r.batch,
            r.prefill_tps.median,
            r.prefill_tps.min,
            r.prefill_tps.max,
            r.decode_tps.median,
            r.decode_tps.min,
            r.decode_tps.max,
            r.ttft_ms.median,
            mib(r.kv.bytes_live),
            mib(r.kv.bytes_in_use),
            mib(r.kv.bytes_reserved),
        );
    }
    let mut batches: Vec<usize> = rows.iter().map(|r| r.batch).collect();
    batches.dedup();
    let same = |a: &BenchRow, b: &BenchRow| if a.tokens == b.tokens { "identical" } else { "DIFFER" };
    for b in batches {
        let find =
            |k: Backend, m: AttentionMode| rows.iter().find(|r| r.batch == b && r.backend == k && r.attention == m);
        for m in [AttentionMode::Batched, AttentionMode::RowByRow] {
            if let (Some(d), Some(p)) = (find(Backend::Dense, m), find(Backend::Paged, m)) {
                s += &format!(
                    "batch {b}, {}: paged/dense decode {:.3}, prefill {:.3}, KV in use {:.2}x; tokens {}\n",
                    m.name(),
                    p.decode_tps.median / d.decode_tps.median,
                    p.prefill_tps.median / d.prefill_tps.median,
                    p.kv.bytes_in_use as f64 / d.kv.bytes_in_use.max(1) as f64,
                    same(d, p)
                );
            }
        }
        for k in [Backend::Dense, Backend::Paged] {
            if let (Some(fast), Some(rowwise)) = (find(k, AttentionMode::Batched), find(k, AttentionMode::RowByRow)) {
                s += &format!(
                    "batch {b}, {}: batched/row-by-row decode {:.3}, prefill {:.3}; tokens {}\n",
                    k.name(),
                    fast.decode_tps.median / rowwise.decode_tps.median,
                    fast.prefill_tps.median / rowwise.prefill_tps.median,
                    same(fast, rowwise)
                );
            }
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_formula_matches_the_mlx_lm_script() {
        assert_eq!(prompt_ids(3, 49_152), vec![1000, 8919, 16838]);
        assert_eq!(prompt_ids(2, 320), vec![3, 3 + 7919 % 317]);
    }

    #[test]
    fn ragged_lengths_span_full_to_about_half() {
        assert_eq!(ragged_lengths(128, 1), vec![128]);
        assert_eq!(ragged_lengths(128, 4), vec![128, 112, 96, 80]);
    }

    #[test]
    fn spread_median() {
        let s = Spread::of(vec![3.0, 1.0, 2.0]);
        assert_eq!((s.median, s.min, s.max), (2.0, 1.0, 3.0));
    }
}
