//! prefix: a second request whose prompt shares a prefix with a first one adopts the first's
//! KV rows instead of recomputing them (paged: refcounted blocks, copy on write). The dense
//! backend cannot share storage and recomputes. Both must give the same tokens.
//!
//! The shared prefix ends mid-block, so the adopter's first write lands in a block the donor
//! also holds: without copy-on-write one of them overwrites the other's rows.
//!
//! - `after-finish`: the donor has finished decoding (its blocks kept as a prefix cache
//!   entry, released after adoption); the adopter is reported.
//! - `while-running`: the adopter joins while the donor is still decoding and both decode
//!   together; both are reported (`while-running` for the donor, `while-running/adopter`).

use super::{CaseOutput, Harness, Live, Prompt, case, decode_all, decode_step, prefill, record_step};
use crate::error::Result;
use crate::kv::{Backend, KvCache};
use crate::model::RowStep;

/// How many of `n` prompt rows to share with block size `bs`: the longest prefix that leaves
/// at least one token of the prompt unshared and ends mid-block.
pub fn share_len(n: usize, bs: usize) -> usize {
    let mut s = n.saturating_sub(1);
    while s > 1 && s.is_multiple_of(bs) {
        s -= 1;
    }
    s
}

pub fn run(h: &mut Harness, backend: Backend, prompts: &[Prompt]) -> Result<Vec<CaseOutput>> {
    let steps = h.settings.max_tokens;
    let mut out = Vec::new();
    for p in prompts {
        if p.ids.len() < 3 {
            continue;
        }
        let share = share_len(p.ids.len(), h.settings.block_size);
        // The adopter's own suffix: the donor's prompt reversed, so it differs right after
        // the shared rows.
        let mut ids = p.ids[..share].to_vec();
        ids.extend(p.ids.iter().rev().take(p.ids.len() - share + 2));
        let derived = Prompt { name: format!("{}/shared{share}", p.name), ids };
        let donor_ref = h.reference(&p.ids)?;
        let adopter_ref = h.reference(&derived.ids)?;

        // after-finish
        let mut kv = h.kv(backend)?;
        let mut donor = Live::new(kv.create(0)?, &donor_ref, steps);
        prefill(h.model, kv.as_mut(), &mut donor, &p.ids)?;
        let mut lives = [donor];
        decode_all(h.model, kv.as_mut(), &mut lives)?;
        let [donor] = lives;
        let adopter = adopt(h, kv.as_mut(), donor.seq, share, &derived, &adopter_ref)?;
        kv.release(donor.seq)?;
        let mut lives = [adopter];
        decode_all(h.model, kv.as_mut(), &mut lives)?;
        let [adopter] = lives;
        let mut c = case(kv.as_ref(), "after-finish", &derived, vec![adopter.trace]);
        c.notes.push(note(kv.as_ref(), share, &derived));
        out.push(c);

        // while-running
        let mut kv = h.kv(backend)?;
        let mut donor = Live::new(kv.create(0)?, &donor_ref, steps);
        prefill(h.model, kv.as_mut(), &mut donor, &p.ids)?;
        for _ in 0..2 {
            if !donor.done() {
                decode_step(h.model, kv.as_mut(), &mut [&mut donor])?;
            }
        }
        let adopter = adopt(h, kv.as_mut(), donor.seq, share, &derived, &adopter_ref)?;
        let mut lives = [donor, adopter];
        decode_all(h.model, kv.as_mut(), &mut lives)?;
        let [donor, adopter] = lives;
        let notes = note(kv.as_ref(), share, &derived);
        let mut c = case(kv.as_ref(), "while-running", p, vec![donor.trace]);
        c.notes.push(notes.clone());
        out.push(c);
        let mut c = case(kv.as_ref(), "while-running/adopter", &derived, vec![adopter.trace]);
        c.notes.push(notes);
        out.push(c);
    }
    Ok(out)
}

/// Start the adopter: share the donor's first `share` rows if the backend can, else recompute
/// them; then prefill the rest of its prompt.
fn adopt(
    h: &Harness,
    kv: &mut dyn KvCache,
    donor: crate::kv::SeqId,
    share: usize,
    p: &Prompt,
    reference: &crate::engine::Trace,
) -> Result<Live> {
    let (seq, rest) = match kv.share_prefix(donor, share)? {
        Some(seq) => (seq, &p.ids[share..]),
        None => (kv.create(0)?, &p.ids[..]),
    };
    let mut live = Live::new(seq, reference, h.settings.max_tokens);
    let logits = h.model.forward(kv, &[RowStep::new(seq, rest.to_vec())])?;
    record_step(kv, &mut [&mut live], &logits, &[p.ids.len() - 1])?;
    Ok(live)
}

fn note(kv: &dyn KvCache, share: usize, p: &Prompt) -> String {
    match kv.backend() {
        Backend::Paged => format!("shared {share} of {} prompt rows, copy-on-write", p.ids.len()),
        Backend::Dense => format!("recomputed {} prompt rows (dense cannot share)", p.ids.len()),
    }
}

#[cfg(test)]
mod tests {
    use super::share_len;

    #[test]
    fn shared_prefix_ends_mid_block_and_leaves_a_token() {
        assert_eq!(share_len(37, 32), 36);
        assert_eq!(share_len(33, 32), 31);
        assert_eq!(share_len(17, 4), 15);
        assert_eq!(share_len(9, 4), 7);
    }
}
