//! single: one prompt, prefill, greedy decode. On the dense backend this is the reference
//! itself; on the paged backend it is the first thing a pool must get right.

use super::{CaseOutput, Harness, Live, Prompt, case, decode_all, prefill};
use crate::error::Result;
use crate::kv::Backend;

pub fn run(h: &mut Harness, backend: Backend, prompts: &[Prompt]) -> Result<Vec<CaseOutput>> {
    let mut out = Vec::new();
    for p in prompts {
        let reference = h.reference(&p.ids)?;
        let mut kv = h.kv(backend)?;
        let mut live = Live::new(kv.create(0)?, &reference, h.settings.max_tokens);
        prefill(h.model, kv.as_mut(), &mut live, &p.ids)?;
        let mut lives = [live];
        decode_all(h.model, kv.as_mut(), &mut lives)?;
        let [live] = lives;
        out.push(case(kv.as_ref(), "plain", p, vec![live.trace]));
    }
    Ok(out)
}
