//! single: one prompt, prefill, greedy decode. On the reference path this is the reference
//! itself; on any other path it is the first thing it must get right.

use super::{CaseOutput, ForcedSeq, Prompt, Setup, attempt, case, decode_all, prefill};
use crate::engine::{EnginePath, Session};

pub fn run(setup: &mut Setup, path: &mut dyn EnginePath, prompts: &[Prompt]) -> Vec<CaseOutput> {
    let mut out = Vec::new();
    for p in prompts {
        attempt(setup, &mut out, &[(p, "plain")], |setup| {
            let reference = setup.reference(&p.ids)?;
            let mut s = setup.open(path)?;
            let mut live = ForcedSeq::new(s.create(0)?, &reference, setup.settings.max_tokens);
            prefill(&mut s, &mut live, &p.ids)?;
            let mut lives = [live];
            decode_all(&mut s, &mut lives)?;
            let [live] = lives;
            Ok(vec![case(&mut s, "plain", p, &reference, vec![live.trace])?])
        });
    }
    out
}
