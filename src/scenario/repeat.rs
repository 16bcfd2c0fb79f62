//! repeat: the `concurrent` schedule run twice on the path, in two fresh sessions fed the same
//! tokens (the reference's, teacher-forced). Each request's second run is judged against its
//! first, and bit for bit: the judge holds these rows to a tolerance of zero whatever the
//! dtype, since nothing but nondeterminism can move them (a reduction whose order depends on
//! timing or on what an earlier request left in a workspace, a read of uninitialised rows).
//! Comparing each run with the reference alone cannot tell that from batch dependence, and a
//! result that changes between runs of one schedule cannot be bisected. mlx-lm's benchmark
//! stopped on it in bfloat16 on a GPU: "batch_generate tokens differ between repetitions".

use super::concurrent::{self, Ran};
use super::{CaseOutput, Outcome, Prompt, Setup, case};
use crate::engine::EnginePath;
use crate::error::Result;
use crate::vocab::Trace;

pub fn run(setup: &mut Setup, path: &mut dyn EnginePath, prompts: &[Prompt]) -> Vec<CaseOutput> {
    if !concurrent::wanted(setup, prompts) {
        return Vec::new();
    }
    twice(setup, path, prompts).unwrap_or_else(|e| CaseOutput::for_every_prompt(prompts, Outcome::of(e)))
}

fn twice(setup: &mut Setup, path: &mut dyn EnginePath, prompts: &[Prompt]) -> Result<Vec<CaseOutput>> {
    let references = concurrent::references(setup, path, prompts)?;
    // Both runs computed in full: a first prefill served from the first run's (what a path
    // does for sessions that begin alike) would be compared with itself. The first run is only
    // what the second is compared with: its session ends here.
    let first: Vec<Trace> = concurrent::drive(setup, path, prompts, &references, true)?
        .requests
        .into_iter()
        .map(|r| Trace { tokens: r.live.trace.tokens, logits: r.live.trace.logits })
        .collect();
    let Ran { mut session, requests, peak_batch } = concurrent::drive(setup, path, prompts, &references, true)?;
    requests
        .into_iter()
        .zip(&first)
        .map(|(r, first)| {
            let note = format!("{}; the second run against the first, bit for bit", r.note(peak_batch));
            let mut c = case(&mut session, format!("req{}", r.index), &r.prompt, first, vec![r.live.trace])?;
            c.notes.push(note);
            Ok(c)
        })
        .collect()
}
