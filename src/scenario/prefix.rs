//! prefix: a second request whose prompt shares a prefix with a first one adopts the first's
//! KV rows instead of recomputing them (paged: refcounted blocks, copy on write; dense: the rows
//! copied into the adopter's own slot). Both must give the same tokens, and a path that
//! answers with no sequence (parity then recomputes) makes the row `vacuous`.
//!
//! The shared prefix ends mid-block, so the adopter's first write lands in a block the donor
//! also holds: without copy-on-write one of them overwrites the other's rows.
//!
//! - `after-finish`: the donor has finished decoding (its blocks kept as a prefix cache
//!   entry, released after adoption); the adopter is reported.
//! - `while-running`: the adopter joins while the donor is still decoding and both decode
//!   together; both are reported (`while-running` for the donor, `while-running/adopter`).

use super::{CaseOutput, ForcedSeq, Prompt, Setup, attempt, case, decode_all, decode_step, prefill, record_step};
use crate::engine::{EnginePath, PathInfo, Session, ShareMode};
use crate::error::{Error, Result};
use crate::kv::SeqId;
use crate::model::RowStep;
use crate::vocab::Trace;

/// How many of `n` prompt rows to share with block size `bs`: the longest prefix that leaves
/// at least one token of the prompt unshared and ends mid-block.
pub fn share_len(n: usize, bs: usize) -> usize {
    let mut s = n.saturating_sub(1);
    while s > 1 && s.is_multiple_of(bs) {
        s -= 1;
    }
    s
}

pub fn run(setup: &mut Setup, path: &mut dyn EnginePath, prompts: &[Prompt]) -> Vec<CaseOutput> {
    let steps = setup.settings.max_tokens;
    let mut out = Vec::new();
    for p in prompts {
        if p.ids.len() < 3 {
            continue;
        }
        let share = share_len(p.ids.len(), setup.settings.block_size);
        // The adopter's own suffix: the donor's prompt reversed, so it differs right after
        // the shared rows.
        let mut ids = p.ids[..share].to_vec();
        ids.extend(p.ids.iter().rev().take(p.ids.len() - share + 2));
        let derived = Prompt { name: format!("{}/shared{share}", p.name), ids };

        attempt(setup, &mut out, &[(&derived, "after-finish")], |setup| {
            need_share(path.info())?;
            let donor_ref = setup.reference(&p.ids)?;
            let adopter_ref = setup.reference(&derived.ids)?;
            let name = path.info().name.clone();
            let mut s = setup.open(path)?;
            let mut donor = ForcedSeq::new(s.create(0)?, &donor_ref, steps);
            prefill(&mut s, &mut donor, &p.ids)?;
            let mut lives = [donor];
            decode_all(&mut s, &mut lives)?;
            let [donor] = lives;
            let (adopter, mode) = adopt(&mut s, donor.seq, share, &derived, &adopter_ref, steps)?;
            s.release(donor.seq)?;
            let mut lives = [adopter];
            decode_all(&mut s, &mut lives)?;
            let [adopter] = lives;
            let mut c = case(&mut s, "after-finish", &derived, &adopter_ref, vec![adopter.trace])?;
            c.notes.push(note(mode, &name, share, &derived));
            Ok(vec![c])
        });

        attempt(setup, &mut out, &[(p, "while-running"), (&derived, "while-running/adopter")], |setup| {
            need_share(path.info())?;
            let donor_ref = setup.reference(&p.ids)?;
            let adopter_ref = setup.reference(&derived.ids)?;
            let name = path.info().name.clone();
            super::need_batch(path.info(), 2)?;
            let mut s = setup.open(path)?;
            let mut donor = ForcedSeq::new(s.create(0)?, &donor_ref, steps);
            prefill(&mut s, &mut donor, &p.ids)?;
            for _ in 0..2 {
                if !donor.done() {
                    decode_step(&mut s, &mut [&mut donor])?;
                }
            }
            let (adopter, mode) = adopt(&mut s, donor.seq, share, &derived, &adopter_ref, steps)?;
            let mut lives = [donor, adopter];
            decode_all(&mut s, &mut lives)?;
            let [donor, adopter] = lives;
            let notes = note(mode, &name, share, &derived);
            let mut c = case(&mut s, "while-running", p, &donor_ref, vec![donor.trace])?;
            c.notes.push(notes.clone());
            let mut d = case(&mut s, "while-running/adopter", &derived, &adopter_ref, vec![adopter.trace])?;
            d.notes.push(notes);
            Ok(vec![c, d])
        });
    }
    out
}

fn need_share(info: &PathInfo) -> Result<()> {
    if info.capabilities.share_prefix {
        Ok(())
    } else {
        Err(Error::Unsupported(format!("path `{}` cannot share a prefix (share_prefix)", info.name)))
    }
}

/// Start the adopter: share the donor's first `share` rows if the path can, else recompute
/// them; then prefill the rest of its prompt.
fn adopt(
    s: &mut dyn Session,
    donor: SeqId,
    share: usize,
    p: &Prompt,
    reference: &Trace,
    steps: usize,
) -> Result<(ForcedSeq, Option<ShareMode>)> {
    let (seq, rest, mode) = match s.share_prefix(donor, share)? {
        Some((seq, mode)) => (seq, &p.ids[share..], Some(mode)),
        None => (s.create(0)?, &p.ids[..], None),
    };
    let mut live = ForcedSeq::new(seq, reference, steps);
    let logits = s.forward(&[RowStep::new(seq, rest.to_vec())])?;
    record_step(s, &mut [&mut live], &logits, &[p.ids.len() - 1])?;
    Ok((live, mode))
}

fn note(mode: Option<ShareMode>, path: &str, share: usize, p: &Prompt) -> String {
    let n = p.ids.len();
    match mode {
        Some(ShareMode::Storage) => format!("shared {share} of {n} prompt rows, copy-on-write"),
        Some(ShareMode::Copy) => format!("copied {share} of {n} prompt rows"),
        None => format!("recomputed {n} prompt rows ({path} cannot share)"),
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
