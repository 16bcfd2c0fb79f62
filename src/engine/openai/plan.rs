//! The request-level scenarios: what to send, when, and which requests each report row
//! judges. A schedule is run on one server; every measured request is compared with the
//! reference path's answer to the same prompt sent alone.
//!
//! - `single`: one request alone.
//! - `batch2`: `same` (the prompt twice at once: any difference between the two is the
//!   batch), `ragged` (the prompt next to one of another length, at once).
//! - `concurrent`: N requests; request j arrives once a clock request has streamed
//!   `arrivals[j]` tokens, so arrival points are repeatable in tokens, not in wall time.
//!   Lengths are staggered too, so requests leave the batch at different steps.
//! - `lengths`: the first prompt cut or repeated to lengths across tile/block/chunk bounds.
//! - `prefix`: a request, then (after it finished) one whose prompt extends it: `extends`
//!   continues after the first request's answer (a cache hit on the whole earlier sequence),
//!   `trimmed` continues the first prompt only (the cached sequence must be cut back).
//! - `repeat`: the same request twice in a row: `uncached` and `cached`.

use crate::scenario::{Prompt, Scenario, Settings};

/// When a request is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    Now,
    /// Once request `of` has streamed this many tokens (or ended).
    AfterTokens {
        of: usize,
        tokens: usize,
    },
    /// Once request `of` has ended.
    AfterDone {
        of: usize,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub struct Planned {
    pub ids: Vec<u32>,
    pub max_tokens: usize,
    pub start: Start,
    /// Streamed (the clock of later arrivals).
    pub stream: bool,
}

/// One report row: the requests it judges (the worst speaks for it).
#[derive(Debug, Clone, PartialEq)]
pub struct RowPlan {
    pub prompt: String,
    pub case: String,
    pub measured: Vec<usize>,
    pub notes: Vec<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    pub requests: Vec<Planned>,
    pub rows: Vec<RowPlan>,
}

/// What a plan may know: the settings, whether streamed answers carry logprobs, and the
/// reference's tokens for a prompt (the `prefix` scenario continues after them).
pub struct Inputs<'a> {
    pub settings: &'a Settings,
    pub stream_logprobs: bool,
    pub reference_tokens: &'a dyn Fn(&[u32]) -> Option<Vec<u32>>,
}

fn now(ids: &[u32], max_tokens: usize) -> Planned {
    Planned { ids: ids.to_vec(), max_tokens, start: Start::Now, stream: false }
}

fn row(prompt: &Prompt, case: &str, measured: Vec<usize>) -> RowPlan {
    RowPlan { prompt: prompt.name.clone(), case: case.into(), measured, notes: Vec::new() }
}

pub fn plan(scenario: Scenario, prompts: &[Prompt], inp: &Inputs) -> Vec<Schedule> {
    let n = inp.settings.max_tokens;
    match scenario {
        Scenario::Single => prompts
            .iter()
            .map(|p| Schedule { requests: vec![now(&p.ids, n)], rows: vec![row(p, "alone", vec![0])] })
            .collect(),
        Scenario::Batch2 => batch2(prompts, n),
        Scenario::Concurrent => concurrent(prompts, inp).into_iter().collect(),
        Scenario::Lengths => lengths(prompts, inp.settings),
        Scenario::Prefix => prefix(prompts, inp),
        Scenario::Repeat => prompts
            .iter()
            .map(|p| {
                let mut second = now(&p.ids, n);
                second.start = Start::AfterDone { of: 0 };
                Schedule {
                    requests: vec![now(&p.ids, n), second],
                    rows: vec![row(p, "uncached", vec![0]), row(p, "cached", vec![1])],
                }
            })
            .collect(),
        // Step-level scenarios are refused for this engine when the suite is read.
        _ => Vec::new(),
    }
}

fn batch2(prompts: &[Prompt], n: usize) -> Vec<Schedule> {
    let mut out = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        out.push(Schedule { requests: vec![now(&p.ids, n), now(&p.ids, n)], rows: vec![row(p, "same", vec![0, 1])] });
        if let Some(j) = crate::scenario::ragged_partner(prompts, i) {
            let other = &prompts[j];
            let mut r = row(p, "ragged", vec![1]);
            r.notes.push(format!("sent with {} ({} tokens)", other.name, other.ids.len()));
            out.push(Schedule { requests: vec![now(&other.ids, n), now(&p.ids, n)], rows: vec![r] });
        }
    }
    out
}

/// One schedule for all requests. The clock is request 0 itself when streamed answers carry
/// logprobs; otherwise an unmeasured copy of request 0 sent with it, streamed.
fn concurrent(prompts: &[Prompt], inp: &Inputs) -> Option<Schedule> {
    let c = &inp.settings.concurrent;
    let n = inp.settings.max_tokens;
    if prompts.is_empty() || c.requests == 0 || c.arrivals.is_empty() {
        return None;
    }
    // The clock is request 0 of the schedule either way.
    let (mut requests, clock) = (Vec::new(), 0);
    if !inp.stream_logprobs {
        requests.push(Planned { stream: true, ..now(&prompts[0].ids, n) });
    }
    let offset = requests.len();
    let mut rows = Vec::new();
    for j in 0..c.requests {
        let p = &prompts[j % prompts.len()];
        // Staggered lengths, as the step-level scenario does: rows leave at different steps.
        let steps = n.saturating_sub((j % 3) * (n / 4)).max(1);
        let arrival = c.arrivals[j % c.arrivals.len()];
        let start = if j == 0 || arrival == 0 { Start::Now } else { Start::AfterTokens { of: clock, tokens: arrival } };
        requests.push(Planned { ids: p.ids.clone(), max_tokens: steps, start, stream: inp.stream_logprobs && j == 0 });
        let mut r = row(p, &format!("req{j}"), vec![offset + j]);
        r.notes.push(format!("arrives after {arrival} streamed tokens, {steps} steps"));
        rows.push(r);
    }
    Some(Schedule { requests, rows })
}

/// The lengths to send: the suite's, else one below, at and above each boundary.
pub fn boundary_lengths(s: &Settings) -> Vec<usize> {
    if let Some(l) = &s.lengths {
        return l.clone();
    }
    let mut out: Vec<usize> = [s.tile, s.block_size, s.chunk]
        .iter()
        .flat_map(|&b| [b.saturating_sub(1), b, b + 1])
        .filter(|&l| l > 0)
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

fn lengths(prompts: &[Prompt], s: &Settings) -> Vec<Schedule> {
    let Some(p) = prompts.first() else { return Vec::new() };
    boundary_lengths(s)
        .into_iter()
        .map(|len| {
            // The row keeps the prompt's name; the case says the length.
            let ids: Vec<u32> = p.ids.iter().copied().cycle().take(len).collect();
            Schedule { requests: vec![now(&ids, s.max_tokens)], rows: vec![row(p, &format!("len{len}"), vec![0])] }
        })
        .collect()
}

fn prefix(prompts: &[Prompt], inp: &Inputs) -> Vec<Schedule> {
    let n = inp.settings.max_tokens;
    let mut out = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        // What follows the shared part: the next prompt's tokens (a new turn), or this one's.
        let tail = &prompts[(i + 1) % prompts.len()].ids;
        let then = |ids: Vec<u32>| Planned { ids, max_tokens: n, start: Start::AfterDone { of: 0 }, stream: false };
        if let Some(answer) = (inp.reference_tokens)(&p.ids) {
            let ids: Vec<u32> = p.ids.iter().chain(&answer).chain(tail).copied().collect();
            let mut r = row(p, "extends", vec![1]);
            r.notes.push(format!(
                "prompt {} = earlier prompt {} + its answer {} + {}",
                ids.len(),
                p.ids.len(),
                answer.len(),
                tail.len()
            ));
            out.push(Schedule { requests: vec![now(&p.ids, n), then(ids)], rows: vec![r] });
        }
        let ids: Vec<u32> = p.ids.iter().chain(tail).copied().collect();
        let mut r = row(p, "trimmed", vec![1]);
        r.notes.push(format!("prompt {} = earlier prompt {} + {}", ids.len(), p.ids.len(), tail.len()));
        out.push(Schedule { requests: vec![now(&p.ids, n), then(ids)], rows: vec![r] });
    }
    out
}
