//! single: one prompt, prefill, greedy decode. On the reference path this is the reference
//! itself; on any other path it is the first thing it must get right.

use super::{CaseOutput, Harness, Live, Prompt, attempt, case, decode_all, prefill};
use crate::engine::EnginePath;

pub fn run(h: &mut Harness, path: &mut dyn EnginePath, prompts: &[Prompt]) -> Vec<CaseOutput> {
    let mut out = Vec::new();
    for p in prompts {
        attempt(h, &mut out, &[(p, "plain")], |h| {
            let reference = h.reference(&p.ids)?;
            let mut s = path.session(h.faults)?;
            let mut live = Live::new(s.create(0)?, &reference, h.settings.max_tokens);
            prefill(s.as_mut(), &mut live, &p.ids)?;
            let mut lives = [live];
            decode_all(s.as_mut(), &mut lives)?;
            let [live] = lives;
            Ok(vec![case(s.as_mut(), "plain", p, vec![live.trace])?])
        });
    }
    out
}
