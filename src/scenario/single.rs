//! single: one prompt, prefill, greedy decode. On the reference path this is the reference
//! itself; on any other path it is the first thing it must get right.

use super::{CaseOutput, ForcedSeq, Prompt, Setup, attempt, case, decode_all, prefill};
use crate::engine::EnginePath;

pub fn run(setup: &mut Setup, path: &mut dyn EnginePath, prompts: &[Prompt]) -> Vec<CaseOutput> {
    let mut out = Vec::new();
    for p in prompts {
        attempt(setup, &mut out, &[(p, "plain")], |setup| {
            let reference = setup.reference(&p.ids)?;
            let mut s = path.session(setup.faults)?;
            let mut live = ForcedSeq::new(s.create(0)?, &reference, setup.settings.max_tokens);
            prefill(s.as_mut(), &mut live, &p.ids)?;
            let mut lives = [live];
            decode_all(s.as_mut(), &mut lives)?;
            let [live] = lives;
            Ok(vec![case(s.as_mut(), "plain", p, &reference, vec![live.trace])?])
        });
    }
    out
}
