//! Settings that test nothing. `lookahead = 0` makes `rollback` roll back nothing and the row
//! passes; a prompt that fits in one chunk makes `chunked` the same computation as `single`.
//! A pass that checked nothing is worse than no row, so:
//!
//! - what the settings alone make vacuous is a suite error, reported by the parser at the
//!   setting's `file:line:col` ([`settings_problems`]);
//! - what depends on the prompt is a `skipped` row with the reason ([`skip_reason`],
//!   [`absent_cases`]), never a silent pass and never a silently missing row.
//!
//! The same [`settings_problems`] also runs on every row, so settings built in code (not
//! parsed) cannot slip through either.

use std::collections::VecDeque;

use crate::kv::Backend;
use crate::scenario::{self, CaseOutput, Prompt, Scenario, Settings};

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
        let keys: &[&'static str] = if c.max_batch < 2 {
            &["settings.concurrent.max_batch"]
        } else if c.requests < 2 {
            &["settings.concurrent.requests"]
        } else {
            &["settings.concurrent.arrivals", "settings.max_tokens"]
        };
        out.push(problem(
            keys,
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
/// scenario's schedule replayed without a model (tested against the scenario's own report).
/// Stops as soon as two requests overlap, and jumps over stretches where one request runs
/// alone, so untrusted settings cannot make it loop for long.
pub fn concurrent_peak_batch(s: &Settings) -> usize {
    let c = &s.concurrent;
    if c.requests == 0 || c.max_batch == 0 || c.arrivals.is_empty() {
        return 0;
    }
    let m = s.max_tokens;
    // (arrival, index, steps): the scenario's staggered lengths.
    let mut pending: Vec<(usize, usize, usize)> = (0..c.requests)
        .map(|j| (c.arrivals[j % c.arrivals.len()], j, m.saturating_sub((j % 3) * (m / 4)).max(1)))
        .collect();
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

/// Why a case that ran tested nothing of its scenario, if it did not: the row is then
/// `skipped` with this reason instead of passing.
pub fn skip_reason(sc: Scenario, backend: Backend, case: &CaseOutput, s: &Settings) -> Option<String> {
    if let Some(p) = settings_problems(s, &[sc], &[backend], None).into_iter().next() {
        return Some(p.message);
    }
    let n = case.prompt.ids.len();
    match sc {
        Scenario::Chunked if n <= s.chunk => Some(format!(
            "the {n}-token prompt fits in one chunk of {}: prefilled in one forward, as `single` does",
            s.chunk
        )),
        // Only the cases whose point is trimming right pads; batch-left always has masked pads.
        Scenario::Padded
            if matches!(case.case.as_str(), "tile" | "batch-right")
                && case.paths.iter().all(|p| p.layout.iter().all(|l| l.pads_trimmed == 0)) =>
        {
            Some(format!("no pad rows: the {n}-token prompt fills whole tiles of {}, so nothing is trimmed", s.tile))
        }
        _ => None,
    }
}

/// Cases a scenario leaves out for a prompt (no partner of another length, a prompt too short
/// to share), as `(prompt name, case, reason)`: reported as skipped rows, not left missing.
pub fn absent_cases(sc: Scenario, prompts: &[Prompt]) -> Vec<(String, &'static str, String)> {
    let mut out = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let unpaired = scenario::ragged_partner(prompts, i).is_none();
        let why = format!("no prompt of another length than {} tokens to pair with", p.ids.len());
        match sc {
            Scenario::Batch2 if unpaired => out.push((p.name.clone(), "ragged", why)),
            Scenario::Padded if unpaired => out.push((p.name.clone(), "batch-right", why)),
            Scenario::Prefix if p.ids.len() < 3 => out.push((
                p.name.clone(),
                "*",
                format!(
                    "the {}-token prompt is too short to share: prefix needs at least 3 tokens (a shared part \
                     and an own part)",
                    p.ids.len()
                ),
            )),
            _ => {}
        }
    }
    out
}
