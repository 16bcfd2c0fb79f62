//! explore: random scripts against the reference, and the failing ones shrunk to a minimal
//! reproducer. No fixed scenario is involved: a seed makes schedules of creates (masked
//! prefixes where the path has them), chunked prefills, batched steps over subsets of the live
//! sequences (rows joining and leaving), trims, shared prefixes and releases, with lengths and
//! cut points drawn towards the boundaries that matter (block size, tile, chunk, each plus or
//! minus one). Each schedule is a [`Script`] run as the `script` scenario runs a pinned one,
//! so a reproducer printed here is a row of `parity run` once a suite pins it.
//!
//! Everything is deterministic for a seed: schedule `k` of path `p` on checkpoint `c` comes
//! from its own stream seeded by (seed, c, p, k), whatever ran before it.

use std::time::{Duration, Instant};

use super::script;
use super::{CaseOutput, Setup};
use crate::engine::{EnginePath, PathInfo};
use crate::rng::Rng;
use crate::vocab::{Op, Prompt, PromptCut, Script, Settings};

/// How much to explore on each path, and the shape of the schedules.
#[derive(Debug, Clone, PartialEq)]
pub struct Budget {
    pub seed: u64,
    /// Stop after this many schedules...
    pub schedules: Option<usize>,
    /// ...or once this much time has gone (whichever comes first; neither: 100 schedules).
    pub time: Option<Duration>,
    /// Operations per schedule.
    pub ops: usize,
    /// Most sequences live at once.
    pub sequences: usize,
    /// Stop a path after this many distinct failures (each shrunk).
    pub findings: usize,
    /// Most replays one shrink may take.
    pub shrink_replays: usize,
}

impl Default for Budget {
    fn default() -> Self {
        Budget { seed: 0, schedules: None, time: None, ops: 16, sequences: 4, findings: 3, shrink_replays: 400 }
    }
}

/// A failure explore found: the schedule as generated, shrunk, and the shrunk one's case.
#[derive(Debug, Clone)]
pub struct Finding {
    /// Which schedule of the path (its index for the seed).
    pub schedule: usize,
    pub generated: Script,
    pub shrunk: Script,
    /// The shrunk script's case, as it ran last.
    pub case: CaseOutput,
    /// How the failure reads, the same before and after shrinking.
    pub signature: String,
    pub replays: usize,
}

/// What exploring one path did.
#[derive(Debug, Clone, Default)]
pub struct Explored {
    pub schedules: usize,
    /// Operations applied by the generated schedules (shrinking's replays not counted).
    pub ops: usize,
    pub findings: Vec<Finding>,
    pub seconds: f64,
    /// Of which: replaying candidates while shrinking.
    pub shrink_seconds: f64,
}

/// Explore `path` within `budget`. `fails` judges a case: its failure signature (what kind of
/// failure it is, so shrinking keeps the same one), or `None` when it passes. `context`: the
/// longest stream the checkpoint can hold. `label` names the path for the seeds.
#[allow(clippy::too_many_arguments)]
pub fn explore(
    setup: &mut Setup,
    path: &mut dyn EnginePath,
    prompts: &[Prompt],
    budget: &Budget,
    context: usize,
    label: &[&str],
    fails: &mut dyn FnMut(&CaseOutput) -> Option<String>,
) -> Explored {
    let started = Instant::now();
    let info = path.info().clone();
    let mut out = Explored::default();
    let limit = budget.schedules.unwrap_or(if budget.time.is_some() { usize::MAX } else { 100 });
    for k in 0..limit {
        if budget.time.is_some_and(|t| started.elapsed() >= t) || out.findings.len() >= budget.findings {
            break;
        }
        let seed = budget.seed.to_string();
        let index = k.to_string();
        let mut parts = vec![seed.as_str()];
        parts.extend_from_slice(label);
        parts.push(&index);
        let mut rng = Rng::from_parts(&parts);
        let generated = generate(&mut rng, prompts, &setup.settings, &info, budget, context);
        let (case, ran) = script::run_counted(setup, path, &generated, prompts, &format!("s{k}"));
        out.schedules += 1;
        out.ops += ran.applied;
        let Some(signature) = fails(&case) else { continue };
        if out.findings.iter().any(|f| f.signature == signature) {
            continue;
        }
        let t = Instant::now();
        let mut last = case;
        let mut replay = |s: &Script| {
            let (c, _) = script::run_counted(setup, path, s, prompts, &format!("s{k}"));
            let same = fails(&c).as_deref() == Some(signature.as_str());
            if same {
                last = c;
            }
            same
        };
        let (shrunk, mut replays) = shrink(&generated, &mut replay, budget.shrink_replays);
        // Once more as printed (sequences renamed), so the row's failure names the operations
        // the reproducer has.
        replays += 1;
        replay(&shrunk);
        out.shrink_seconds += t.elapsed().as_secs_f64();
        out.findings.push(Finding { schedule: k, generated, shrunk, case: last, signature, replays });
    }
    out.seconds = started.elapsed().as_secs_f64();
    out
}

/// The lengths worth hitting: each boundary minus one, at, plus one.
fn boundaries(s: &Settings) -> Vec<usize> {
    let mut out: Vec<usize> = [s.block_size, 2 * s.block_size, s.tile, s.chunk]
        .iter()
        .flat_map(|&b| [b.saturating_sub(1), b, b + 1])
        .chain([1, 2, 3])
        .filter(|&n| n > 0)
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// A length in `1..=most`, drawn towards the boundaries (and towards `toward`, the length that
/// would end on one where the sequence stands).
fn length(rng: &mut Rng, s: &Settings, most: usize, toward: &[usize]) -> usize {
    let pool: Vec<usize> =
        boundaries(s).into_iter().chain(toward.iter().copied()).filter(|&n| n >= 1 && n <= most).collect();
    let n = if rng.chance(0.7) { rng.pick(&pool).copied() } else { None };
    n.unwrap_or_else(|| 1 + rng.below(most.max(1)))
}

/// What the generator knows of a sequence it made: its stream's length and what it has fed.
struct Sim {
    name: String,
    stream: usize,
    masked: usize,
    written: usize,
}

impl Sim {
    fn left(&self) -> usize {
        (self.masked + self.stream).saturating_sub(self.written)
    }
    /// Rows that would bring the sequence to the next block boundary.
    fn to_boundary(&self, block: usize) -> usize {
        block - self.written % block.max(1)
    }
}

/// One random schedule: `budget.ops` operations, every one valid where it stands (the paths
/// `info` describes can do each of them).
pub fn generate(
    rng: &mut Rng,
    prompts: &[Prompt],
    s: &Settings,
    info: &PathInfo,
    budget: &Budget,
    context: usize,
) -> Script {
    let mut ops = Vec::new();
    let mut live: Vec<Sim> = Vec::new();
    let mut next = 0usize;
    let max_batch = info.capabilities.max_batch.unwrap_or(usize::MAX).min(budget.sequences);
    let bs = s.block_size.max(1);
    let cut = |rng: &mut Rng, p: &Prompt, most: usize| -> PromptCut {
        let n = length(rng, s, p.ids.len().min(most).max(1), &[]);
        PromptCut { prompt: p.name.clone(), cut: (n < p.ids.len()).then_some(n) }
    };
    while ops.len() < budget.ops && !prompts.is_empty() {
        let feedable: Vec<usize> = (0..live.len()).filter(|&i| live[i].left() > 0).collect();
        let fed: Vec<usize> = (0..live.len()).filter(|&i| live[i].written > live[i].masked).collect();
        let roll = rng.below(100);
        if live.is_empty() || (roll < 15 && live.len() < budget.sequences) {
            let Some(p) = rng.pick(prompts) else { break };
            let stream = cut(rng, p, context.saturating_sub(s.max_tokens));
            let masked = if info.capabilities.masked_prefix && rng.chance(0.25) { 1 + rng.below(3) } else { 0 };
            let name = seq_name(next);
            next += 1;
            let len = stream.cut.unwrap_or(p.ids.len());
            live.push(Sim { name: name.clone(), stream: len + s.max_tokens, masked, written: 0 });
            ops.push(Op::Create { seq: name, stream, masked });
        } else if roll < 45 && !feedable.is_empty() {
            // A prefill chunk, sometimes of two sequences at once (same length each).
            let a = feedable[rng.below(feedable.len())];
            let mut names = vec![a];
            if max_batch >= 2 && feedable.len() >= 2 && rng.chance(0.3) {
                let b = feedable[rng.below(feedable.len())];
                if b != a {
                    names.push(b);
                }
            }
            let most = names.iter().map(|&i| live[i].left()).min().unwrap_or(1);
            let n = length(rng, s, most, &[live[a].to_boundary(bs), live[a].to_boundary(bs) + 1]);
            for &i in &names {
                live[i].written += n;
            }
            ops.push(Op::Feed { seqs: names.iter().map(|&i| live[i].name.clone()).collect(), rows: n });
        } else if roll < 75 && !feedable.is_empty() {
            // A batched decode step over a random subset (rows join and leave).
            let mut names: Vec<usize> = feedable.iter().copied().filter(|_| rng.chance(0.7)).collect();
            if names.is_empty() {
                names.push(feedable[rng.below(feedable.len())]);
            }
            names.truncate(max_batch);
            for &i in &names {
                live[i].written += 1;
            }
            ops.push(Op::Feed { seqs: names.iter().map(|&i| live[i].name.clone()).collect(), rows: 1 });
        } else if roll < 85 && !fed.is_empty() {
            let i = fed[rng.below(fed.len())];
            let most = live[i].written - live[i].masked;
            let n = length(rng, s, most, &[live[i].written % bs, live[i].written % bs + 1, s.lookahead]);
            live[i].written -= n;
            ops.push(Op::Trim { seq: live[i].name.clone(), rows: n });
        } else if roll < 95 && info.capabilities.share_prefix && !fed.is_empty() && live.len() < budget.sequences {
            let d = fed[rng.below(fed.len())];
            let (masked, written) = (live[d].masked, live[d].written);
            let toward = [bs, bs - 1, bs + 1, written, written - 1, 2 * bs];
            let rows = masked + length(rng, s, written - masked, &toward.map(|n| n.saturating_sub(masked)));
            let Some(p) = rng.pick(prompts) else { break };
            let then = cut(rng, p, 4);
            let then_len = then.cut.unwrap_or(p.ids.len());
            if rows - masked + then_len + s.max_tokens > context {
                continue;
            }
            let name = seq_name(next);
            next += 1;
            ops.push(Op::Share { seq: name.clone(), donor: live[d].name.clone(), rows, then });
            live.push(Sim { name, stream: rows - masked + then_len + s.max_tokens, masked, written: rows });
        } else if !live.is_empty() && live.len() > 1 {
            let i = rng.below(live.len());
            ops.push(Op::Release { seq: live.remove(i).name });
        }
    }
    Script { ops }
}

/// `a`, `b`, ..., `z`, `a1`, `b1`, ...
fn seq_name(i: usize) -> String {
    let letter = (b'a' + (i % 26) as u8) as char;
    if i < 26 { letter.to_string() } else { format!("{letter}{}", i / 26) }
}

/// The smallest script `still_fails` keeps failing that removing an operation, a row of a
/// batch, or making a number smaller can reach, within `most` replays; and how many replays it
/// took. Operations are removed in halves, then quarters, down to one at a time (a script
/// with an operation gone is still a script: what no longer applies is passed over), then
/// rows of batches, then counts (to one, halved, one less). Sequences are renamed a, b, c in
/// the order they appear, so reproducers read the same way.
pub fn shrink(script: &Script, still_fails: &mut dyn FnMut(&Script) -> bool, most: usize) -> (Script, usize) {
    let mut best = script.clone();
    let mut replays = 0usize;
    let mut try_it = |candidate: Script, best: &mut Script, replays: &mut usize| -> bool {
        if *replays >= most || candidate == *best {
            return false;
        }
        *replays += 1;
        if still_fails(&candidate) {
            *best = candidate;
            true
        } else {
            false
        }
    };
    loop {
        let before = best.clone();
        // Whole chunks of operations, largest first.
        let mut chunk = best.ops.len().div_ceil(2).max(1);
        while chunk >= 1 {
            let mut start = 0;
            while start < best.ops.len() {
                let mut c = best.clone();
                let end = (start + chunk).min(c.ops.len());
                c.ops.drain(start..end);
                if c.ops.is_empty() || !try_it(c, &mut best, &mut replays) {
                    start += chunk;
                }
            }
            if chunk == 1 {
                break;
            }
            chunk = chunk.div_ceil(2).max(1).min(chunk - 1).max(1);
        }
        // Rows of a batched forward.
        for i in 0..best.ops.len() {
            let mut j = 0;
            while let Some(Op::Feed { seqs, .. }) = best.ops.get(i) {
                if j >= seqs.len() || seqs.len() < 2 {
                    break;
                }
                let mut c = best.clone();
                if let Op::Feed { seqs, .. } = &mut c.ops[i] {
                    seqs.remove(j);
                }
                if !try_it(c, &mut best, &mut replays) {
                    j += 1;
                }
            }
        }
        // Counts: rows, cuts, pads.
        for i in 0..best.ops.len() {
            for value in smaller(&best.ops[i]) {
                let mut c = best.clone();
                c.ops[i] = value;
                if try_it(c, &mut best, &mut replays) {
                    break;
                }
            }
        }
        if best == before || replays >= most {
            break;
        }
    }
    (renamed(&best), replays)
}

/// The operation with one of its counts made smaller, smallest first.
fn smaller(op: &Op) -> Vec<Op> {
    let down = |n: usize| -> Vec<usize> {
        let mut v: Vec<usize> = [1, n / 2, n.saturating_sub(1)].into_iter().filter(|&m| m >= 1 && m < n).collect();
        v.dedup();
        v
    };
    let cut_down = |p: &PromptCut| -> Vec<PromptCut> {
        p.cut.map_or_else(Vec::new, |n| down(n).into_iter().map(|m| PromptCut { cut: Some(m), ..p.clone() }).collect())
    };
    match op {
        Op::Create { seq, stream, masked } => {
            let mut out: Vec<Op> =
                (0..*masked).map(|m| Op::Create { seq: seq.clone(), stream: stream.clone(), masked: m }).collect();
            out.extend(cut_down(stream).into_iter().map(|c| Op::Create {
                seq: seq.clone(),
                stream: c,
                masked: *masked,
            }));
            out
        }
        Op::Share { seq, donor, rows, then } => {
            let mut out: Vec<Op> = down(*rows)
                .into_iter()
                .map(|r| Op::Share { seq: seq.clone(), donor: donor.clone(), rows: r, then: then.clone() })
                .collect();
            out.extend(cut_down(then).into_iter().map(|t| Op::Share {
                seq: seq.clone(),
                donor: donor.clone(),
                rows: *rows,
                then: t,
            }));
            out
        }
        Op::Feed { seqs, rows } => down(*rows).into_iter().map(|r| Op::Feed { seqs: seqs.clone(), rows: r }).collect(),
        Op::Trim { seq, rows } => down(*rows).into_iter().map(|r| Op::Trim { seq: seq.clone(), rows: r }).collect(),
        Op::Release { .. } => Vec::new(),
    }
}

/// The script with its sequences named a, b, c... in order of appearance.
fn renamed(script: &Script) -> Script {
    let mut names: Vec<String> = Vec::new();
    for op in &script.ops {
        for n in op.names() {
            if !names.iter().any(|m| m == n) {
                names.push(n.to_string());
            }
        }
    }
    let to = |n: &String| seq_name(names.iter().position(|m| m == n).unwrap_or(0));
    let ops = script
        .ops
        .iter()
        .map(|op| match op {
            Op::Create { seq, stream, masked } => Op::Create { seq: to(seq), stream: stream.clone(), masked: *masked },
            Op::Share { seq, donor, rows, then } => {
                Op::Share { seq: to(seq), donor: to(donor), rows: *rows, then: then.clone() }
            }
            Op::Feed { seqs, rows } => Op::Feed { seqs: seqs.iter().map(to).collect(), rows: *rows },
            Op::Trim { seq, rows } => Op::Trim { seq: to(seq), rows: *rows },
            Op::Release { seq } => Op::Release { seq: to(seq) },
        })
        .collect();
    Script { ops }
}

/// What a run of explore reports for a path that found nothing: the numbers behind "clean".
pub fn summary(e: &Explored) -> String {
    format!(
        "{} schedules, {} operations, no failure ({:.1}s, {:.0} operations/s)",
        e.schedules,
        e.ops,
        e.seconds,
        e.ops as f64 / e.seconds.max(1e-9)
    )
}

/// Notes for a finding's row: the reproducer, ready to pin, and where it came from.
pub fn notes(f: &Finding, e: &Explored) -> Vec<String> {
    vec![
        format!("reproducer: {}", f.shrunk),
        format!(
            "pin it: [[scripts]] name = \"s{}\" ops = \"{}\"",
            f.schedule,
            f.shrunk.to_string().replace('"', "\\\"")
        ),
        format!(
            "schedule s{} of {} operations shrunk to {} in {} replays; {} schedules, {} operations explored",
            f.schedule,
            f.generated.ops.len(),
            f.shrunk.ops.len(),
            f.replays,
            e.schedules,
            e.ops
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shrinker keeps what the failure needs and nothing else: here the failure is "b is
    /// trimmed after a feed", buried in noise.
    #[test]
    fn shrinking_keeps_only_what_the_failure_needs() {
        let script: Script = "a = p; b = q[:9]; prefill a 5; step a; prefill b 7; c = a@3 + q; step a,b,c; \
                              release a; trim b 4; step c"
            .parse()
            .expect("parses");
        let mut fails = |s: &Script| {
            let mut fed = false;
            s.ops.iter().any(|op| match op {
                Op::Feed { seqs, .. } if seqs.iter().any(|n| n == "b") => {
                    fed = true;
                    false
                }
                Op::Trim { seq, .. } => seq == "b" && fed,
                _ => false,
            }) && s.ops.iter().any(|op| matches!(op, Op::Create { seq, .. } if seq == "b"))
        };
        let (shrunk, replays) = shrink(&script, &mut fails, 400);
        assert_eq!(shrunk.to_string(), "a = q[:1]; step a; trim a 1", "{replays} replays");
    }

    #[test]
    fn the_replay_budget_is_kept() {
        let script: Script = format!("a = p; prefill a 5{}", "; step a".repeat(18)).parse().expect("parses");
        let mut calls = 0;
        let (_, replays) = shrink(
            &script,
            &mut |_| {
                calls += 1;
                true
            },
            3,
        );
        assert_eq!((replays, calls), (3, 3));
    }
}
