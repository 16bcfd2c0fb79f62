//! `parity bench`: prefill and decode speed and KV memory of both backends (and both attention
//! modes), in the same process and run, warm-up excluded, median and spread over repetitions.
//! Absolute times on a shared machine are noise; the ratios are the figures to read.

use std::time::Instant;

use serde::Serialize;

use crate::engine::builtin::Builtin;
use crate::error::Result;
use crate::faults::Faults;
use crate::kv::{Backend, KvCache, KvStats, SeqId};
use crate::model::{AttentionMode, Model, RowStep, Taps};
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

/// Rows a prefill forward takes at most: mlx-lm's `BatchGenerator` default
/// (`prefill_batch_size`), so both engines pad a group to its own longest row and compute the
/// same tokens. One forward for all of a large ragged batch would pad every row to the
/// batch's longest: 23% of a B=16 prefill spent on pads here.
pub const PREFILL_GROUP: usize = 8;

/// Prefill the rows in groups of [`PREFILL_GROUP`], each group one forward left-padded to its
/// longest with the pads masked (as mlx-lm's batch_generate does): the sequences and the first
/// greedy tokens, still on the device.
fn prefill(
    model: &Model,
    kv: &mut dyn KvCache,
    lengths: &[usize],
    mode: AttentionMode,
) -> Result<(Vec<SeqId>, mlx_rs::Array)> {
    prefill_traced(model, kv, lengths, mode, None)
}

fn prefill_traced(
    model: &Model,
    kv: &mut dyn KvCache,
    lengths: &[usize],
    mode: AttentionMode,
    taps: Option<&Taps>,
) -> Result<(Vec<SeqId>, mlx_rs::Array)> {
    let vocab = model.config.vocab_size;
    let mut seqs = Vec::with_capacity(lengths.len());
    let mut firsts = Vec::new();
    for group in lengths.chunks(PREFILL_GROUP) {
        let longest = group.iter().copied().max().unwrap_or(0);
        let mut rows = Vec::with_capacity(group.len());
        for &len in group {
            let pads = longest - len;
            let seq = kv.create(pads)?;
            seqs.push(seq);
            let mut tokens = vec![0; pads];
            tokens.extend(prompt_ids(len, vocab));
            rows.push(RowStep::new(seq, tokens));
        }
        firsts.push(argmax(&model.forward_traced(kv, &rows, mode, taps)?)?);
    }
    let next = match firsts.len() {
        1 => firsts.remove(0),
        _ => mlx_rs::ops::concatenate(&firsts.iter().collect::<Vec<_>>(), 0)?,
    };
    Ok((seqs, next))
}

/// One repetition: the prefill, then `decode` batched greedy steps, pipelined as mlx-lm's
/// generators are: step n + 1 is built on step n's argmax, still on the device, and queued
/// before step n's tokens are read, so the host builds a graph while the last one runs.
fn once(model: &Model, kv: &mut dyn KvCache, lengths: &[usize], decode: usize, mode: AttentionMode) -> Result<Sample> {
    let t = Instant::now();
    let (seqs, mut next) = prefill(model, kv, lengths, mode)?;
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

/// Memory read bandwidth in bytes a second: `threads` threads each summing its share of one
/// buffer of `bytes`, best of `reps`. A B=1 decode step reads every weight once, so this over
/// the weights' bytes is the step rate no engine on this machine can pass.
///
/// The buffer asks for transparent huge pages: on 4 KiB pages the same sum read 26 GB/s where
/// it reads 31.5 on 2 MiB ones (a 2-core Xeon VM, where the kernel gives huge pages only on
/// request), and an engine may place its weights on them, so the smaller figure would be a
/// limit engines can pass.
pub fn read_bandwidth(bytes: usize, threads: usize, reps: usize) -> f64 {
    let mut words: Vec<u64> = Vec::with_capacity(bytes / 8);
    advise_huge_pages(&words);
    words.extend((0..bytes / 8).map(|i| i as u64));
    let threads = threads.max(1);
    let share = words.len().div_ceil(threads);
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        let sum = std::thread::scope(|scope| {
            let parts: Vec<_> = words
                .chunks(share)
                .map(|part| scope.spawn(move || part.iter().fold(0u64, |a, &x| a.wrapping_add(x))))
                .collect();
            parts.into_iter().map(|p| p.join().unwrap_or(0)).fold(0u64, u64::wrapping_add)
        });
        std::hint::black_box(sum);
        best = best.min(t.elapsed().as_secs_f64());
    }
    (words.len() * 8) as f64 / best
}

/// Ask the kernel to back `v`'s allocation with huge pages before it is first touched. Advice
/// only: where it is refused (transparent huge pages off, another OS) the pages stay small.
fn advise_huge_pages(v: &Vec<u64>) {
    #[cfg(target_os = "linux")]
    {
        // The system's page, not 4 KiB: on a 16 or 64 KiB-page kernel (aarch64) a 4 KiB-aligned
        // range is refused and the advice would be silently lost.
        // SAFETY: sysconf reads a system constant.
        let page = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
            p if p > 0 => p as usize,
            _ => return,
        };
        let start = (v.as_ptr() as usize).next_multiple_of(page);
        let end = (v.as_ptr() as usize + v.capacity() * 8) / page * page;
        if end > start {
            // SAFETY: the range lies inside `v`'s own allocation and is page-aligned; madvise
            // changes how its pages are backed, never their contents or the mapping.
            unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = v;
}

/// Read bandwidth of MLX's own reduction over a `bytes` float32 array on the default device,
/// best of `reps`: on a GPU the rate its kernels reach in device memory (host threads would
/// measure the wrong memory); on the CPU MLX reduces on one thread, so [`read_bandwidth`] is the
/// machine's figure there.
pub fn device_read_bandwidth(bytes: usize, reps: usize) -> Result<f64> {
    let n = (bytes / 4) as i32;
    let a = mlx_rs::ops::ones::<f32>(&[n])?;
    a.eval()?;
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) + 1 {
        let t = Instant::now();
        a.sum(None)?.eval()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(n as f64 * 4.0 / best)
}

/// The decode rate memory bandwidth allows a batch: each step reads every weight once and every
/// row's live K/V once, whatever the batch.
pub fn decode_limit(weight_bytes: u64, kv_bytes: u64, batch: usize, bandwidth: f64) -> f64 {
    batch as f64 * bandwidth / (weight_bytes + kv_bytes) as f64
}

/// Where a decode step's time goes.
#[derive(Debug, Clone, Serialize)]
pub struct Profile {
    pub path: String,
    pub batch: usize,
    pub steps: usize,
    /// A step as bench decodes (pipelined: the next step is queued before this one's tokens
    /// reach the host).
    pub pipelined_ms: f64,
    /// A step built, then waited for, before the next is built.
    pub synchronous_ms: f64,
    /// The host's share of a synchronous step: building the graph, before MLX runs any of it.
    pub build_ms: f64,
    /// A step evaluated tap by tap (every operation waited for): the sum of `ops`.
    pub timed_ms: f64,
    pub ops: Vec<OpCost>,
    /// The batch's prefill of `prompt_tokens` real tokens (one forward, left-padded, waited
    /// for), and a second on a fresh cache tap by tap.
    pub prompt_tokens: usize,
    pub prefill_ms: f64,
    pub prefill_timed_ms: f64,
    pub prefill_ops: Vec<OpCost>,
}

/// Add a timed pass's spans to `ops` (one entry per operation name, in first-seen order);
/// the pass's total seconds.
fn add_spans(ops: &mut Vec<OpCost>, spans: Vec<crate::model::Span>, bytes: &[(&str, u64)]) -> f64 {
    let mut total = 0.0;
    for span in spans {
        total += span.seconds;
        match ops.iter_mut().find(|o| o.op == span.op) {
            Some(o) => {
                o.ms += span.seconds;
                o.calls += 1;
            }
            None => ops.push(OpCost {
                weight_bytes: bytes.iter().find(|b| b.0 == span.op).map(|b| b.1),
                op: span.op,
                ms: span.seconds,
                calls: 1,
            }),
        }
    }
    total
}

/// One operation's share of a timed step, summed over the layers.
#[derive(Debug, Clone, Serialize)]
pub struct OpCost {
    pub op: String,
    pub ms: f64,
    /// Timed spans a step ending at this tap (one per layer, or one).
    pub calls: usize,
    /// Weight bytes its matmul reads a step, where it ends in one.
    pub weight_bytes: Option<u64>,
}

/// Profile `steps` decode steps of `path` at `batch` after a ragged prefill of `prompt_len` and
/// a few untimed steps: pipelined, synchronous (with the graph building apart) and tap by tap.
pub fn profile(
    model: &Model,
    path: BuiltinPath,
    batch: usize,
    prompt_len: usize,
    steps: usize,
    block_size: usize,
) -> Result<Profile> {
    let settings = Settings { block_size, poison: false, ..Settings::default() };
    let builtin = Builtin::new(model, path, &settings);
    let mut kv = builtin.kv(Faults::NONE)?;
    let mode = path.attention;
    let lengths = ragged_lengths(prompt_len, batch);
    let t = Instant::now();
    let (seqs, mut next) = prefill(model, kv.as_mut(), &lengths, mode)?;
    next.eval()?;
    let prefill_secs = t.elapsed().as_secs_f64();
    let steps = steps.max(1);
    for _ in 0..4 {
        next = argmax(&model.decode_next(kv.as_mut(), &seqs, &next, mode)?)?;
    }
    next.eval()?;
    let t = Instant::now();
    for _ in 0..steps {
        let following = argmax(&model.decode_next(kv.as_mut(), &seqs, &next, mode)?)?;
        mlx_rs::transforms::async_eval([&following])?;
        next = following;
    }
    next.eval()?;
    let pipelined = t.elapsed().as_secs_f64() / steps as f64;
    let (mut build, mut synchronous) = (0.0, 0.0);
    for _ in 0..steps {
        let t = Instant::now();
        let following = argmax(&model.decode_next(kv.as_mut(), &seqs, &next, mode)?)?;
        build += t.elapsed().as_secs_f64();
        following.eval()?;
        synchronous += t.elapsed().as_secs_f64();
        next = following;
    }
    let mut ops: Vec<OpCost> = Vec::new();
    let mut timed = 0.0;
    let bytes = model.matmul_bytes(batch);
    for _ in 0..steps {
        let rows: Vec<RowStep> = seqs.iter().zip(host(&next)?).map(|(&s, id)| RowStep::new(s, vec![id])).collect();
        let taps = Taps::timed();
        let logits = model.forward_traced(kv.as_mut(), &rows, mode, Some(&taps))?;
        next = argmax(&logits)?;
        taps.tap(None, "argmax", &next);
        timed += add_spans(&mut ops, taps.into_spans()?, &bytes);
    }
    let per_step = |secs: f64| secs * 1e3 / steps as f64;
    for o in &mut ops {
        o.ms = per_step(o.ms);
        o.calls /= steps;
    }
    drop(kv);
    let mut kv = builtin.kv(Faults::NONE)?;
    let taps = Taps::timed();
    let (_, first) = prefill_traced(model, kv.as_mut(), &lengths, mode, Some(&taps))?;
    taps.tap(None, "argmax", &first);
    let mut prefill_ops = Vec::new();
    let prefill_timed = add_spans(&mut prefill_ops, taps.into_spans()?, &bytes);
    for o in &mut prefill_ops {
        o.ms *= 1e3;
    }
    Ok(Profile {
        path: path.name(),
        batch,
        steps,
        pipelined_ms: pipelined * 1e3,
        synchronous_ms: per_step(synchronous),
        build_ms: per_step(build),
        timed_ms: per_step(timed),
        ops,
        prompt_tokens: lengths.iter().sum(),
        prefill_ms: prefill_secs * 1e3,
        prefill_timed_ms: prefill_timed * 1e3,
        prefill_ops,
    })
}

pub fn render_profile(p: &Profile) -> String {
    let mut s = format!(
        "profile: {}, batch {}, {} steps: a decode step pipelined {:.2} ms, synchronous {:.2} ms (building the graph {:.2} ms of it), op by op {:.2} ms\n",
        p.path, p.batch, p.steps, p.pipelined_ms, p.synchronous_ms, p.build_ms, p.timed_ms
    );
    s += &op_table(&p.ops, p.timed_ms, "ms/step");
    s += &format!(
        "prefill: {}, batch {} ({} tokens): {:.2} ms, op by op {:.2} ms\n",
        p.path, p.batch, p.prompt_tokens, p.prefill_ms, p.prefill_timed_ms
    );
    s += &op_table(&p.prefill_ops, p.prefill_timed_ms, "ms");
    s
}

fn op_table(ops: &[OpCost], total_ms: f64, unit: &str) -> String {
    let mut s = format!(
        "  {:<14} {:>9} {:>7} {:>6} {:>11} {:>8}\n",
        "op (ends at)", unit, "share", "calls", "weights MB", "GB/s"
    );
    for o in ops {
        let (mb, gbs) = match o.weight_bytes {
            Some(b) => (format!("{:.1}", b as f64 / 1e6), format!("{:.1}", b as f64 / (o.ms / 1e3) / 1e9)),
            None => (String::new(), String::new()),
        };
        s += &format!(
            "  {:<14} {:>9.3} {:>6.1}% {:>6} {:>11} {:>8}\n",
            o.op,
            o.ms,
            100.0 * o.ms / total_ms.max(f64::MIN_POSITIVE),
            o.calls,
            mb,
            gbs
        );
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
