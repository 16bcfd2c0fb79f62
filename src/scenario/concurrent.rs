//! concurrent: continuous batching. Requests arrive at given steps, join the running batch
//! (prefilled on arrival) while there is room, decode together, and leave when done; a
//! finished paged row releases its blocks and later rows reuse them. Every request is
//! compared with its own dense single reference. Same schedule, same result.

use super::{CaseOutput, ForcedSeq, Outcome, Prompt, Setup, Watched, case, decode_step, need_batch, prefill};
use crate::engine::{EnginePath, Session};
use crate::error::{Error, Result};
use crate::vocab::Trace;

/// One request of the schedule, and (once it has run) what it decoded.
pub(super) struct Request {
    pub index: usize,
    pub prompt: Prompt,
    pub arrival: usize,
    pub joined: Option<usize>,
    pub live: ForcedSeq,
}

/// One run of the schedule: its session (for the case's books and counters) and every
/// request, finished, in request order.
pub(super) struct Ran<'p> {
    pub session: Watched<'p>,
    pub requests: Vec<Request>,
    pub peak_batch: usize,
}

impl Request {
    /// When it came and how long it stayed: the row's note.
    pub fn note(&self, peak_batch: usize) -> String {
        format!(
            "arrived step {}, joined step {}, {} steps, peak batch {peak_batch}",
            self.arrival,
            self.joined.unwrap_or(self.arrival),
            self.live.steps
        )
    }
}

/// One schedule for all prompts: if it cannot run, every prompt's row says why.
pub fn run(setup: &mut Setup, path: &mut dyn EnginePath, prompts: &[Prompt]) -> Vec<CaseOutput> {
    // One schedule: it runs whole if any of its requests' rows is wanted.
    if !wanted(setup, prompts) {
        return Vec::new();
    }
    cases(setup, path, prompts).unwrap_or_else(|e| CaseOutput::for_every_prompt(prompts, Outcome::of(e)))
}

/// Whether any row of the schedule (`req0`, `req1`, ...) is wanted.
pub(super) fn wanted(setup: &Setup, prompts: &[Prompt]) -> bool {
    let n = setup.settings.concurrent.requests;
    !prompts.is_empty() && (0..n).any(|j| setup.wants(&prompts[j % prompts.len()].name, &format!("req{j}")))
}

fn cases(setup: &mut Setup, path: &mut dyn EnginePath, prompts: &[Prompt]) -> Result<Vec<CaseOutput>> {
    let references = references(setup, path, prompts)?;
    let Ran { mut session, requests, peak_batch } = drive(setup, path, prompts, &references, false)?;
    requests
        .into_iter()
        .map(|r| {
            let note = r.note(peak_batch);
            let mut c =
                case(&mut session, format!("req{}", r.index), &r.prompt, &references[r.index], vec![r.live.trace])?;
            c.notes.push(note);
            Ok(c)
        })
        .collect()
}

/// The reference of every request of the schedule, once the schedule is known to run here.
pub(super) fn references(setup: &mut Setup, path: &dyn EnginePath, prompts: &[Prompt]) -> Result<Vec<Trace>> {
    let s = setup.settings.concurrent.clone();
    if prompts.is_empty() || s.requests == 0 || s.max_batch == 0 || s.arrivals.is_empty() {
        return Err(Error::Invalid("concurrent needs prompts, requests > 0, max_batch > 0 and arrivals".into()));
    }
    need_batch(path.info(), s.max_batch.min(s.requests))?;
    (0..s.requests).map(|j| setup.reference(&prompts[j % prompts.len()].ids)).collect()
}

/// Run the schedule once on a fresh session of `path`, every request fed `references`'
/// tokens (teacher forcing), so two runs of it are fed the same inputs step for step;
/// `computed`: every forward computed, none served from an earlier session's.
pub(super) fn drive<'p>(
    setup: &mut Setup,
    path: &'p mut dyn EnginePath,
    prompts: &[Prompt],
    references: &[Trace],
    computed: bool,
) -> Result<Ran<'p>> {
    let s = setup.settings.concurrent.clone();
    let max_tokens = setup.settings.max_tokens;
    let mut session = if computed { setup.open_computed(path)? } else { setup.open(path)? };
    let mut pending = Vec::new();
    for ((j, arrival), reference) in s.schedule(max_tokens).into_iter().enumerate().zip(references) {
        let prompt = prompts[j % prompts.len()].clone();
        let live = ForcedSeq::new(session.create(0)?, reference, arrival.steps);
        pending.push(Request { index: j, prompt, arrival: arrival.at, joined: None, live });
    }
    // Requests keep their creation order among equal arrivals.
    pending.sort_by_key(|r| (r.arrival, r.index));
    let mut pending = std::collections::VecDeque::from(pending);
    let mut active: Vec<Request> = Vec::new();
    let mut finished: Vec<Request> = Vec::new();
    let mut step = 0;
    let mut peak_batch = 0;
    while !pending.is_empty() || !active.is_empty() {
        while active.len() < s.max_batch && pending.front().is_some_and(|r| r.arrival <= step) {
            let Some(mut r) = pending.pop_front() else {
                break;
            };
            prefill(&mut session, &mut r.live, &r.prompt.ids)?;
            r.joined = Some(step);
            active.push(r);
        }
        retire(&mut session, &mut active, &mut finished)?;
        if active.is_empty() {
            if let Some(next) = pending.front() {
                step = step.max(next.arrival);
            }
            continue;
        }
        peak_batch = peak_batch.max(active.len());
        let mut lives: Vec<&mut ForcedSeq> = active.iter_mut().map(|r| &mut r.live).collect();
        decode_step(&mut session, &mut lives)?;
        retire(&mut session, &mut active, &mut finished)?;
        step += 1;
    }
    finished.sort_by_key(|r| r.index);
    Ok(Ran { session, requests: finished, peak_batch })
}

/// Finished rows leave the batch and give their storage back.
fn retire(session: &mut dyn Session, active: &mut Vec<Request>, finished: &mut Vec<Request>) -> Result<()> {
    let mut i = 0;
    while i < active.len() {
        if active[i].live.done() {
            let r = active.remove(i);
            session.release(r.live.seq)?;
            finished.push(r);
        } else {
            i += 1;
        }
    }
    Ok(())
}
