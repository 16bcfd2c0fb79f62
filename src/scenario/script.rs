//! script: a schedule of step operations ([`Script`]) run on one path, every logits row it
//! returns compared with the reference's logits for the same stream prefix. The `script`
//! scenario runs a suite's pinned scripts this way, one case each; `parity explore` runs
//! random ones ([`super::explore`]).
//!
//! The engine's own answers are checked after every operation, not only at the end: a
//! forward must move each sequence by exactly the rows written (one source of truth for
//! positions), a trim must remove exactly what it was asked to, and the store's books must
//! balance (a leak or a refcount mismatch ends the case with the blocks named). A script ends
//! as requests do: every sequence still live is released, and the books checked once more.
//!
//! An operation that cannot apply where it stands (a sequence that is not live, a feed past
//! the end of its stream, a trim longer than what was fed, a pool with no block left) is
//! passed over and counted, so any subsequence of a script is a script: shrinking depends on
//! it.

use std::collections::BTreeMap;
use std::rc::Rc;
use std::time::Duration;

use super::{CaseOutput, Decoded, Observed, Outcome, Setup, Stream, need_batch, need_masked_prefix, trim_exact};
use crate::array::{greedy, rows};
use crate::engine::{EnginePath, Session};
use crate::error::{Error, Result};
use crate::kv::SeqId;
use crate::model::RowStep;
use crate::vocab::{Op, Prompt, PromptCut, Script, StepLayout};

/// Every pinned script of the suite on `path`, one case each, named after the script.
pub fn run_all(setup: &mut Setup, path: &mut dyn EnginePath, prompts: &[Prompt]) -> Vec<CaseOutput> {
    let scripts = setup.scripts.clone();
    let mut out = Vec::new();
    for (name, script) in &scripts {
        let Some(first) = first_prompt(script, prompts) else { continue };
        if !setup.wants(&first.name, name) {
            continue;
        }
        out.push(run(setup, path, script, prompts, name));
    }
    out
}

/// The prompt a script's row is named after: its first sequence's.
pub fn first_prompt(script: &Script, prompts: &[Prompt]) -> Option<Prompt> {
    script.ops.iter().find_map(|op| match op {
        Op::Create { stream, .. } => Some(cut(prompts, stream).map_or_else(
            |_| Prompt { name: stream.prompt.clone(), ids: Vec::new() },
            |ids| Prompt { name: stream.prompt.clone(), ids },
        )),
        _ => None,
    })
}

/// What running a script did besides its case: how many operations applied, and where the
/// time went.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Ran {
    pub applied: usize,
    pub passed_over: usize,
    /// Inside the path's engine.
    pub engine: Duration,
    /// On the reference path (streams read for the first time).
    pub reference: Duration,
}

/// Run `script` on a fresh session of `path` as case `name`.
pub fn run(
    setup: &mut Setup,
    path: &mut dyn EnginePath,
    script: &Script,
    prompts: &[Prompt],
    name: &str,
) -> CaseOutput {
    run_counted(setup, path, script, prompts, name).0
}

/// [`run`], and how many operations applied or were passed over.
pub fn run_counted(
    setup: &mut Setup,
    path: &mut dyn EnginePath,
    script: &Script,
    prompts: &[Prompt],
    name: &str,
) -> (CaseOutput, Ran) {
    let prompt = first_prompt(script, prompts).unwrap_or(Prompt { name: "*".into(), ids: Vec::new() });
    let mut ran = Ran::default();
    let reference_before = setup.reference_time();
    let outcome = execute(setup, path, script, prompts, &mut ran);
    ran.reference = setup.reference_time() - reference_before;
    match outcome {
        Ok(mut c) => {
            c.case = name.to_string();
            c.prompt = prompt;
            // A script that compared nothing (every feed pads, or passed over) and broke no
            // books tested nothing: a named skip, never a pass and never a failure.
            if c.measured.is_empty() && c.audit.is_none() {
                c.outcome = Outcome::Skipped("the script compared no logits row (nothing fed past the pads)".into());
            }
            if ran.passed_over > 0 {
                c.notes.push(format!(
                    "{} of {} operations did not apply and were passed over",
                    ran.passed_over,
                    script.ops.len()
                ));
            }
            (c, ran)
        }
        Err((i, e)) => {
            let why = match i {
                Some(i) => format!("operation {} `{}`: {e}", i + 1, script.ops[i]),
                None => e.to_string(),
            };
            let outcome = match e {
                Error::Unsupported(_) => Outcome::Skipped(why),
                _ => Outcome::Failed(why),
            };
            (CaseOutput::new(name, &prompt, Vec::new(), outcome), ran)
        }
    }
}

/// A live sequence of the script: its stream, what it has been fed, what it returned.
struct Live {
    seq: SeqId,
    stream: Rc<Stream>,
    /// Left-pad rows before the stream.
    masked: usize,
    /// Rows written (pads included), as the engine counts them.
    written: usize,
    rolled_back: usize,
    decoded: Decoded,
}

impl Live {
    /// Stream tokens fed so far.
    fn fed(&self) -> usize {
        self.written.saturating_sub(self.masked)
    }

    /// Rows left to feed before the stream ends.
    fn left(&self) -> usize {
        (self.masked + self.stream.tokens.len()).saturating_sub(self.written)
    }

    /// The next `n` rows: pads first, then the stream.
    fn next_rows(&self, n: usize, pad: u32) -> Vec<u32> {
        (self.written..self.written + n)
            .map(|r| if r < self.masked { pad } else { self.stream.tokens[r - self.masked] })
            .collect()
    }
}

type Failed = (Option<usize>, Error);

fn execute(
    setup: &mut Setup,
    path: &mut dyn EnginePath,
    script: &Script,
    prompts: &[Prompt],
    ran: &mut Ran,
) -> std::result::Result<CaseOutput, Failed> {
    let at = |i: usize| move |e: Error| (Some(i), e);
    let info = path.info().clone();
    let pad = setup.pad_token;
    let mut s = setup.open(path).map_err(|e| (None, e))?;
    let mut live: BTreeMap<String, Live> = BTreeMap::new();
    let mut done: Vec<Decoded> = Vec::new();
    let mut audit = None;
    for (i, op) in script.ops.iter().enumerate() {
        let applied = match op {
            Op::Create { seq, stream, masked } => {
                if live.contains_key(seq) {
                    false
                } else {
                    if *masked > 0 {
                        need_masked_prefix(&info).map_err(at(i))?;
                    }
                    let stream = setup.stream(&cut(prompts, stream).map_err(at(i))?).map_err(at(i))?;
                    let id = s.create(*masked).map_err(at(i))?;
                    live.insert(seq.clone(), fresh(id, stream, *masked));
                    true
                }
            }
            Op::Share { seq, donor, rows, then } => match live.get(donor) {
                Some(d) if !live.contains_key(seq) && *rows <= d.written && *rows > d.masked => {
                    // The adopter's stream: the donor's first rows, then its own prompt.
                    let mut ids = d.stream.tokens[..rows - d.masked].to_vec();
                    ids.extend(cut(prompts, then).map_err(at(i))?);
                    let (donor_seq, masked) = (d.seq, d.masked);
                    let stream = setup.stream(&ids).map_err(at(i))?;
                    let id = match s.share_prefix(donor_seq, *rows).map_err(at(i))? {
                        Some((id, _)) => id,
                        // Recomputed: the adopter feeds the shared rows itself.
                        None => s.create(masked).map_err(at(i))?,
                    };
                    let mut adopter = fresh(id, stream, masked);
                    adopter.written = s.len(id).map_err(at(i))?;
                    live.insert(seq.clone(), adopter);
                    true
                }
                _ => false,
            },
            Op::Feed { seqs, rows } => {
                // A feed must reach past the pads: logits inside a masked prefix are never
                // compared, and an engine may refuse to give them (mlx-lm's BatchKVCache does).
                let names: Vec<&String> = seqs
                    .iter()
                    .filter(|n| live.get(*n).is_some_and(|l| l.left() >= *rows && l.written + rows > l.masked))
                    .collect();
                if names.is_empty() {
                    false
                } else {
                    need_batch(&info, names.len()).map_err(at(i))?;
                    match feed(&mut s, setup, &mut live, &names, *rows, pad) {
                        Ok(()) => true,
                        // A pool at its budget refusing more blocks is the engine doing its job.
                        Err(Error::PoolExhausted { .. }) => false,
                        Err(e) => return Err((Some(i), e)),
                    }
                }
            }
            Op::Trim { seq, rows } => match live.get_mut(seq) {
                Some(l) if *rows <= l.fed() => {
                    trim_exact(&mut s, l.seq, *rows).map_err(at(i))?;
                    l.written -= rows;
                    l.rolled_back += rows;
                    true
                }
                _ => false,
            },
            Op::Release { seq } => match live.remove(seq) {
                Some(l) => {
                    s.release(l.seq).map_err(at(i))?;
                    done.push(l.decoded);
                    true
                }
                None => false,
            },
        };
        if applied {
            ran.applied += 1;
        } else {
            ran.passed_over += 1;
        }
        if let Some(books) = s.audit().map_err(at(i))? {
            audit = Some(format!("after operation {} `{op}`: {books}", i + 1));
            break;
        }
    }
    // The schedule ends as requests do: every sequence still live is released, and the books
    // must balance once nothing is held (from outside an engine that is the only point where
    // a leak shows).
    if audit.is_none() {
        for l in live.values() {
            s.release(l.seq).map_err(|e| (None, e))?;
        }
        if let Some(books) = s.audit().map_err(|e| (None, e))? {
            audit = Some(format!("once every sequence was released: {books}"));
        }
    }
    done.extend(live.into_values().map(|l| l.decoded));
    done.retain(|d| !d.trace.tokens.is_empty());
    let kv = s.stats().map_err(|e| (None, e))?;
    let counters = s.counters().map_err(|e| (None, e))?;
    let live = s.live_lengths().map_err(|e| (None, e))?;
    ran.engine = s.spent;
    let mut c = CaseOutput::new("", &Prompt { name: String::new(), ids: Vec::new() }, done, Outcome::Ran);
    c.kv = kv;
    c.audit = audit;
    c.observed = Some(Observed { driven: s.driven.clone(), counters, live });
    Ok(c)
}

fn fresh(seq: SeqId, stream: Rc<Stream>, masked: usize) -> Live {
    Live {
        seq,
        stream,
        masked,
        written: 0,
        rolled_back: 0,
        decoded: Decoded { reference: Default::default(), trace: Default::default() },
    }
}

/// One forward in which each of `names` feeds its next `n` rows; each row's logits are
/// recorded against the reference's at the same stream position (none while only pads were
/// fed), and each sequence's length is checked to have moved by exactly `n`.
fn feed(
    s: &mut dyn Session,
    setup: &mut Setup,
    live: &mut BTreeMap<String, Live>,
    names: &[&String],
    n: usize,
    pad: u32,
) -> Result<()> {
    let steps: Vec<RowStep> =
        names.iter().map(|name| RowStep::new(live[*name].seq, live[*name].next_rows(n, pad))).collect();
    let logits = s.forward(&steps)?;
    let tokens = greedy(&logits)?;
    let rows = rows(&logits)?;
    let b = names.len();
    for (k, ((name, token), row)) in names.iter().zip(tokens).zip(rows).enumerate() {
        let l = live.get_mut(*name).ok_or_else(|| Error::Invalid(format!("no sequence `{name}`")))?;
        let before = l.written;
        let after = s.len(l.seq)?;
        if after != before + n {
            return Err(Error::Kv(format!(
                "a forward of {n} rows moved sequence `{name}` from {before} to {after} rows (one source of truth for positions)"
            )));
        }
        l.written = after;
        let Some(p) = (after - 1).checked_sub(l.masked) else { continue };
        let d = &mut l.decoded;
        d.trace.tokens.push(token);
        d.trace.logits.push(row);
        d.trace.layout.push(StepLayout {
            kv_row: after - 1,
            position: p,
            batch_row: k,
            batch_size: b,
            pads_trimmed: 0,
            rolled_back: l.rolled_back,
        });
        let (logits, choice) = setup.stream_at(&l.stream, p)?;
        d.reference.tokens.push(choice);
        d.reference.logits.push(logits);
    }
    Ok(())
}

/// A prompt's ids, cut.
fn cut(prompts: &[Prompt], p: &PromptCut) -> Result<Vec<u32>> {
    let prompt = prompts
        .iter()
        .find(|q| q.name == p.prompt)
        .ok_or_else(|| Error::Unsupported(format!("prompt `{}` is not run by this checkpoint", p.prompt)))?;
    let n = p.cut.unwrap_or(prompt.ids.len()).min(prompt.ids.len());
    Ok(prompt.ids[..n].to_vec())
}
