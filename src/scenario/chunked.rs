//! chunked: prefill in chunks of C tokens, each chunk a forward that continues the sequence
//! (causal attention aligned to the chunk's offset), then decode.

use super::{CaseOutput, Harness, Live, Prompt, case, decode_all, record_step};
use crate::error::{Error, Result};
use crate::kv::Backend;
use crate::model::RowStep;

pub fn run(h: &mut Harness, backend: Backend, prompts: &[Prompt]) -> Result<Vec<CaseOutput>> {
    let c = h.settings.chunk;
    if c == 0 {
        return Err(Error::Invalid("chunk must be positive".into()));
    }
    let mut out = Vec::new();
    for p in prompts {
        let reference = h.reference(&p.ids)?;
        let mut kv = h.kv(backend)?;
        let mut live = Live::new(kv.create(0)?, &reference, h.settings.max_tokens);
        let chunks: Vec<&[u32]> = p.ids.chunks(c).collect();
        let last = chunks.len() - 1;
        for (k, chunk) in chunks.iter().enumerate() {
            let logits = h.model.forward(kv.as_mut(), &[RowStep::new(live.seq, chunk.to_vec())])?;
            if k == last {
                record_step(kv.as_ref(), &mut [&mut live], &logits, &[p.ids.len() - 1])?;
            }
        }
        let mut lives = [live];
        decode_all(h.model, kv.as_mut(), &mut lives)?;
        let [live] = lives;
        let mut out_case = case(kv.as_ref(), format!("c{c}"), p, vec![live.trace]);
        let sizes: Vec<String> = chunks.iter().map(|ch| ch.len().to_string()).collect();
        out_case.notes.push(format!("chunks {}", sizes.join("+")));
        out.push(out_case);
    }
    Ok(out)
}
