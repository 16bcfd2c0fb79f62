//! The settings audit: settings that test nothing. `lookahead = 0` makes `rollback` roll back
//! nothing and the row passes; a block size no sequence crosses makes the paged backend read
//! no block boundary. A pass that checked nothing is worse than no row, so what the settings
//! alone make vacuous is a suite error, reported by the parser at the setting's
//! `file:line:col`. The same audit runs again on every row the judge weighs, so settings
//! built in code (not parsed) cannot slip through either; what depends on the prompt is
//! decided there, on the case that ran.

use std::collections::VecDeque;

use super::{ConcurrentSettings, Scenario, Settings};
use crate::kv::Backend;

/// A vacuous setting: the keys to blame (most specific first; the parser points at the first
/// one the suite actually wrote) and why.
#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    pub keys: Vec<&'static str>,
    pub message: String,
}

fn problem(keys: &[&'static str], message: String) -> Problem {
    Problem { keys: keys.to_vec(), message }
}

/// What these settings make impossible to test for the given scenarios and backends.
/// `lengths`: every prompt's length in tokens when the suite fixes them (`length` or `ids`),
/// which lets a few prompt-dependent facts be caught before anything runs.
pub fn settings_problems(
    s: &Settings,
    scenarios: &[Scenario],
    backends: &[Backend],
    lengths: Option<&[usize]>,
) -> Vec<Problem> {
    let mut out = Vec::new();
    let m = s.max_tokens;
    let has = |sc: Scenario| scenarios.contains(&sc);
    let paged = backends.contains(&Backend::Paged);
    // Padded too: its pads are trimmed after the prefill, and only a decode step reads past them.
    for sc in [Scenario::Batch2, Scenario::Concurrent, Scenario::Padded, Scenario::Rollback, Scenario::Prefix] {
        if has(sc) && m < 2 {
            out.push(problem(
                &["settings.max_tokens"],
                format!("settings.max_tokens = {m}: no decode step runs, so `{}` tests nothing", sc.name()),
            ));
        }
    }
    if has(Scenario::Rollback) && m >= 2 {
        if s.lookahead == 0 {
            out.push(problem(
                &["settings.lookahead"],
                "settings.lookahead = 0: `rollback` decodes no draft rows and trims nothing, so it tests nothing"
                    .into(),
            ));
        } else if s.rollback_every >= m {
            out.push(problem(
                &["settings.rollback_every", "settings.max_tokens"],
                format!(
                    "settings.rollback_every = {} with max_tokens = {m}: no rollback happens (the first comes once a \
                     path holds {} tokens, and paths stop at {m}); use a value below max_tokens",
                    s.rollback_every, s.rollback_every
                ),
            ));
        }
    }
    if has(Scenario::Prefix) && (2..4).contains(&m) {
        out.push(problem(
            &["settings.max_tokens"],
            format!(
                "settings.max_tokens = {m}: `prefix` while-running decodes the donor 2 steps before the adopter \
                 joins, so the donor has finished and nothing shares blocks while running; use at least 4"
            ),
        ));
    }
    if has(Scenario::Concurrent) && m >= 2 && concurrent_peak_batch(s) < 2 {
        let c = &s.concurrent;
        out.push(problem(
            concurrent_keys(c, false),
            format!(
                "settings.concurrent (requests {}, arrivals {:?}, max_batch {}) with max_tokens = {m}: no two \
                 requests are ever decoded together, so `concurrent` tests no batching",
                c.requests, c.arrivals, c.max_batch
            ),
        ));
    }
    if let Some(p) = s.pool_blocks {
        if !paged {
            out.push(problem(
                &["settings.pool_blocks"],
                format!("settings.pool_blocks = {p} has no effect: no paged backend runs"),
            ));
        } else if p.saturating_mul(s.block_size) < m {
            out.push(problem(
                &["settings.pool_blocks", "settings.block_size"],
                format!(
                    "settings.pool_blocks = {p} of block_size {}: {} rows cannot hold one sequence of max_tokens = \
                     {m}, so every paged row would exhaust the pool",
                    s.block_size,
                    p.saturating_mul(s.block_size)
                ),
            ));
        }
    }
    let Some(lengths) = lengths.filter(|l| !l.is_empty()) else {
        return out;
    };
    let longest = lengths.iter().copied().max().unwrap_or(0);
    if has(Scenario::Chunked) && longest <= s.chunk {
        out.push(problem(
            &["settings.chunk"],
            format!(
                "settings.chunk = {} is at least every prompt's length (the longest has {longest} tokens): each \
                 prompt is prefilled in one chunk, so `chunked` tests nothing",
                s.chunk
            ),
        ));
    }
    if paged {
        let rows = scenarios.iter().map(|&sc| rows_written(sc, longest, s)).max().unwrap_or(0);
        if rows <= s.block_size {
            out.push(problem(
                &["settings.block_size"],
                format!(
                    "settings.block_size = {}: no sequence crosses a block boundary (the longest writes {rows} rows), \
                     so the paged backend never reads across blocks",
                    s.block_size
                ),
            ));
        }
    }
    out
}

/// The settings to blame when no two `concurrent` requests overlap, most specific first. A
/// server (`server`) admits what it is sent, so `max_batch` is not one of them there.
fn concurrent_keys(c: &ConcurrentSettings, server: bool) -> &'static [&'static str] {
    if !server && c.max_batch < 2 {
        &["settings.concurrent.max_batch"]
    } else if c.requests < 2 {
        &["settings.concurrent.requests"]
    } else {
        &["settings.concurrent.arrivals", "settings.max_tokens"]
    }
}

/// [`settings_problems`] for a request-level engine (kind = "openai"). The server schedules
/// its own batches and keeps its own cache, so the step-level rules (decode steps of parity's
/// batch, `max_batch`, rollback, prefix while running, blocks of parity's pool) say nothing
/// about it; what remains is what the request-level scenarios read.
pub fn request_level_problems(s: &Settings, scenarios: &[Scenario]) -> Vec<Problem> {
    let mut out = Vec::new();
    let c = &s.concurrent;
    // The server, not `max_batch`, decides what runs together: replay the schedule with every
    // request admitted, as the requests are sent.
    let sent = Settings { concurrent: ConcurrentSettings { max_batch: c.requests, ..c.clone() }, ..s.clone() };
    if scenarios.contains(&Scenario::Concurrent) && (c.requests < 2 || concurrent_peak_batch(&sent) < 2) {
        out.push(problem(
            concurrent_keys(c, true),
            format!(
                "settings.concurrent (requests {}, arrivals {:?}) with max_tokens = {}: no request arrives while \
                 another is being answered, so `concurrent` tests no concurrency",
                c.requests, c.arrivals, s.max_tokens
            ),
        ));
    }
    if let Some(p) = s.pool_blocks {
        out.push(problem(
            &["settings.pool_blocks"],
            format!("settings.pool_blocks = {p} has no effect: a server keeps its own KV cache"),
        ));
    }
    out
}

/// `settings.lengths` is read by the request-level `lengths` scenario alone.
pub fn lengths_problem(s: &Settings, scenarios: &[Scenario]) -> Option<Problem> {
    (s.lengths.is_some() && !scenarios.contains(&Scenario::Lengths)).then(|| {
        problem(
            &["settings.lengths"],
            "settings.lengths has no effect: no `lengths` scenario runs (kind = \"openai\" only)".into(),
        )
    })
}

/// Most KV rows one sequence of scenario `sc` writes for an `n`-token prompt.
fn rows_written(sc: Scenario, n: usize, s: &Settings) -> usize {
    let decoded = n + s.max_tokens.saturating_sub(1);
    let tile = s.tile.max(1);
    match sc {
        // batch-left: the prompt twice, tile-padded, then decoded.
        Scenario::Padded => ((2 * n).div_ceil(tile) * tile).max(2 * n + s.max_tokens.saturating_sub(1)),
        Scenario::Rollback => decoded + s.lookahead,
        // The adopter: shared part, its own suffix (two tokens longer), then decoded.
        Scenario::Prefix => decoded + 2,
        _ => decoded,
    }
}

/// The largest number of requests `concurrent` decodes in one step with these settings: the
/// scenario's schedule ([`ConcurrentSettings::schedule`]) replayed without a model (tested
/// against the scenario's own report).
/// Stops as soon as two requests overlap, and jumps over stretches where one request runs
/// alone, so untrusted settings cannot make it loop for long.
pub fn concurrent_peak_batch(s: &Settings) -> usize {
    let c = &s.concurrent;
    if c.requests == 0 || c.max_batch == 0 || c.arrivals.is_empty() {
        return 0;
    }
    let m = s.max_tokens;
    // (arrival, index, steps), in the order the scenario admits them.
    let mut pending: Vec<(usize, usize, usize)> =
        c.schedule(m).into_iter().enumerate().map(|(j, a)| (a.at, j, a.steps)).collect();
    pending.sort();
    let mut pending = VecDeque::from(pending);
    // (tokens so far, steps) of each running request.
    let mut active: Vec<(usize, usize)> = Vec::new();
    let (mut step, mut peak) = (0usize, 0usize);
    while !pending.is_empty() || !active.is_empty() {
        while active.len() < c.max_batch && pending.front().is_some_and(|r| r.0 <= step) {
            if let Some((_, _, steps)) = pending.pop_front() {
                active.push((1, steps)); // prefill records the first token
            }
        }
        active.retain(|&(done, steps)| done < steps);
        if active.is_empty() {
            if let Some(next) = pending.front() {
                step = step.max(next.0);
            }
            continue;
        }
        peak = peak.max(active.len());
        if peak >= 2 {
            return peak;
        }
        // One request alone: advance to its end or the next arrival, whichever is first.
        let (done, steps) = active[0];
        let until_arrival = pending.front().map_or(usize::MAX, |r| r.0.saturating_sub(step).max(1));
        let advance = (steps - done).min(until_arrival);
        active[0].0 += advance;
        step += advance;
        active.retain(|&(done, steps)| done < steps);
    }
    peak
}
