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
use super::{CaseOutput, Sequences, Setup};
use crate::engine::{EnginePath, PathInfo};
use crate::rng::Rng;
use crate::vocab::{Op, Prompt, PromptCut, Request, RequestPrompt, RequestScript, RequestWhen, Script, Settings};

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

/// A failure explore found: the schedule as generated, shrunk, and the shrunk one's case. `S`
/// is the kind of script ([`Script`] for a stepped path, [`RequestScript`] for a server), `M`
/// what its case measured.
#[derive(Debug, Clone)]
pub struct Finding<S, M> {
    /// Which schedule of the path (its index for the seed).
    pub schedule: usize,
    pub generated: S,
    pub shrunk: S,
    /// The shrunk script's case, as it ran last.
    pub case: CaseOutput<M>,
    /// What its row says besides the verdict: the reproducer, the TOML to pin it, where it came
    /// from ([`notes`]).
    pub notes: Vec<String>,
    /// How the failure reads, the same before and after shrinking.
    pub signature: String,
    pub replays: usize,
}

/// What exploring one path did.
#[derive(Debug, Clone)]
pub struct Explored<S, M> {
    pub schedules: usize,
    /// Operations (requests, for a server) the generated schedules applied; shrinking's
    /// replays not counted.
    pub ops: usize,
    pub findings: Vec<Finding<S, M>>,
    pub seconds: f64,
    /// Of `seconds`: inside the path's engine, on the reference path, judging cases, and
    /// shrinking (replays included, so it overlaps the first two).
    pub engine_seconds: f64,
    pub reference_seconds: f64,
    pub judge_seconds: f64,
    pub shrink_seconds: f64,
    /// What a row says of a path that found nothing ([`summary`]).
    pub summary: String,
}

/// How a kind of script is named in a row's notes: its items (`operations`, `requests`), the
/// `[[scripts]]` key it pins under (`ops`, `requests`), how many items a script has.
pub struct Describe<'a, S> {
    pub items: &'a str,
    pub key: &'a str,
    pub len: &'a dyn Fn(&S) -> usize,
}

/// What one run of a script cost: operations applied, time inside the engine, time on the
/// reference path.
#[derive(Debug, Clone, Copy, Default)]
pub struct Spent {
    pub ops: usize,
    pub engine: Duration,
    pub reference: Duration,
}

/// Runs a script as the case it names, and says how many of its operations applied.
pub type RunScript<'a, S, M> = dyn FnMut(&S, &str) -> (CaseOutput<M>, Spent) + 'a;

/// Shrinks a script while a replay says it still fails, within a number of replays; gives the
/// smallest and the replays it took ([`shrink`], [`shrink_requests`]).
pub type Shrink<S> = dyn Fn(&S, &mut dyn FnMut(&S) -> bool, usize) -> (S, usize);

/// The loop both kinds of engine explore with: schedule `k` generated from its own seeded
/// stream, run, judged by `fails` (its failure signature, or `None` when it passes); a failure
/// not seen before on this path is shrunk while it fails the same way, then run once more as
/// printed, so the row's failure names what the reproducer has. `run` returns the case and how
/// many operations applied. Stops at the budget's schedules, time or findings.
pub fn explore_with<S: Clone + std::fmt::Display, M>(
    budget: &Budget,
    label: &[&str],
    generate: &mut dyn FnMut(&mut Rng) -> S,
    run: &mut RunScript<S, M>,
    fails: &mut dyn FnMut(&CaseOutput<M>) -> Option<String>,
    shrink: &Shrink<S>,
    describe: &Describe<S>,
) -> Explored<S, M> {
    let started = Instant::now();
    let mut out = Explored {
        schedules: 0,
        ops: 0,
        findings: Vec::new(),
        seconds: 0.0,
        engine_seconds: 0.0,
        reference_seconds: 0.0,
        judge_seconds: 0.0,
        shrink_seconds: 0.0,
        summary: String::new(),
    };
    let mut judge = |c: &CaseOutput<M>, out: &mut Explored<S, M>| {
        let t = Instant::now();
        let verdict = fails(c);
        out.judge_seconds += t.elapsed().as_secs_f64();
        verdict
    };
    let limit = budget.schedules.unwrap_or(if budget.time.is_some() { usize::MAX } else { 100 });
    for k in 0..limit {
        if budget.time.is_some_and(|t| started.elapsed() >= t) || out.findings.len() >= budget.findings {
            break;
        }
        let (seed, index) = (budget.seed.to_string(), k.to_string());
        let parts: Vec<&str> =
            [seed.as_str()].into_iter().chain(label.iter().copied()).chain([index.as_str()]).collect();
        let generated = generate(&mut Rng::from_parts(&parts));
        let name = format!("s{k}");
        let (case, spent) = run(&generated, &name);
        out.schedules += 1;
        out.ops += spent.ops;
        out.engine_seconds += spent.engine.as_secs_f64();
        out.reference_seconds += spent.reference.as_secs_f64();
        let Some(signature) = judge(&case, &mut out) else { continue };
        if out.findings.iter().any(|f| f.signature == signature) {
            continue;
        }
        let t = Instant::now();
        let mut last = case;
        let mut replay = |s: &S| {
            let (c, spent) = run(s, &name);
            out.engine_seconds += spent.engine.as_secs_f64();
            out.reference_seconds += spent.reference.as_secs_f64();
            let same = judge(&c, &mut out).as_deref() == Some(signature.as_str());
            if same {
                last = c;
            }
            same
        };
        let (shrunk, mut replays) = shrink(&generated, &mut replay, budget.shrink_replays);
        replays += 1;
        replay(&shrunk);
        out.shrink_seconds += t.elapsed().as_secs_f64();
        out.findings.push(Finding {
            schedule: k,
            generated,
            shrunk,
            case: last,
            notes: Vec::new(),
            signature,
            replays,
        });
    }
    out.seconds = started.elapsed().as_secs_f64();
    out.summary = summary(&out, describe.items);
    let notes: Vec<Vec<String>> = out.findings.iter().map(|f| notes(f, &out, describe)).collect();
    for (f, n) in out.findings.iter_mut().zip(notes) {
        f.notes = n;
    }
    out
}

/// Explore a stepped `path` within `budget`: [`explore_with`] over random [`Script`]s.
/// `context`: the longest stream the checkpoint can hold; `label` names the path for the seeds.
#[allow(clippy::too_many_arguments)]
pub fn explore(
    setup: &mut Setup,
    path: &mut dyn EnginePath,
    prompts: &[Prompt],
    budget: &Budget,
    context: usize,
    label: &[&str],
    fails: &mut dyn FnMut(&CaseOutput) -> Option<String>,
) -> Explored<Script, Sequences> {
    let info = path.info().clone();
    let settings = setup.settings.clone();
    let mut generate = |rng: &mut Rng| generate(rng, prompts, &settings, &info, budget, context);
    let mut run = |s: &Script, name: &str| {
        let (case, ran) = script::run_counted(setup, path, s, prompts, name);
        (case, Spent { ops: ran.applied, engine: ran.engine, reference: ran.reference })
    };
    let describe = Describe { items: "operations", key: "ops", len: &|s: &Script| s.ops.len() };
    explore_with(budget, label, &mut generate, &mut run, fails, &shrink, &describe)
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
            // Past the pads of every row: logits inside a masked prefix are never compared.
            let least = names.iter().map(|&i| (live[i].masked + 1).saturating_sub(live[i].written)).max().unwrap_or(1);
            if least > most {
                continue;
            }
            let n = length(rng, s, most, &[live[a].to_boundary(bs), live[a].to_boundary(bs) + 1]).max(least);
            for &i in &names {
                live[i].written += n;
            }
            ops.push(Op::Feed { seqs: names.iter().map(|&i| live[i].name.clone()).collect(), rows: n });
        } else if roll < 75 && !feedable.is_empty() {
            // A batched decode step over a random subset (rows join and leave), of sequences
            // past their pads.
            let steppable: Vec<usize> =
                feedable.iter().copied().filter(|&i| live[i].written >= live[i].masked).collect();
            let Some(&one) = rng.pick(&steppable) else { continue };
            let mut names: Vec<usize> = steppable.iter().copied().filter(|_| rng.chance(0.7)).collect();
            if names.is_empty() {
                names.push(one);
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

/// The smallest script `still_fails` keeps failing that removing operations or making one
/// smaller can reach, within `most` replays; and how many replays it took. Sequences are
/// renamed a, b, c in the order they appear, so reproducers read the same way.
pub fn shrink(script: &Script, still_fails: &mut dyn FnMut(&Script) -> bool, most: usize) -> (Script, usize) {
    let (ops, replays) =
        shrink_list(&script.ops, &smaller, &mut |ops: &[Op]| still_fails(&Script { ops: ops.to_vec() }), most);
    (renamed(&Script { ops }), replays)
}

/// [`shrink`] for a request script: requests removed, prompts cut shorter, fewer tokens asked
/// for, arrivals made plainer; requests renamed r0, r1, ... in order.
pub fn shrink_requests(
    script: &RequestScript,
    still_fails: &mut dyn FnMut(&RequestScript) -> bool,
    most: usize,
) -> (RequestScript, usize) {
    let (requests, replays) = shrink_list(
        &script.requests,
        &smaller_request,
        &mut |r: &[Request]| still_fails(&RequestScript { requests: r.to_vec() }),
        most,
    );
    (renamed_requests(&RequestScript { requests }), replays)
}

/// The shortest list `still_fails` keeps failing, by removing items in halves, then quarters,
/// down to one at a time (a script with an item gone is still a script: what no longer applies
/// is passed over), then replacing items with the smaller forms `smaller` offers, until
/// nothing changes or `most` replays are spent.
fn shrink_list<T: Clone + PartialEq>(
    items: &[T],
    smaller: &dyn Fn(&T) -> Vec<T>,
    still_fails: &mut dyn FnMut(&[T]) -> bool,
    most: usize,
) -> (Vec<T>, usize) {
    let mut best = items.to_vec();
    let mut replays = 0usize;
    let mut try_it = |candidate: Vec<T>, best: &mut Vec<T>, replays: &mut usize| -> bool {
        if *replays >= most || candidate.is_empty() || candidate == *best {
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
        let mut chunk = best.len().div_ceil(2).max(1);
        loop {
            let mut start = 0;
            while start < best.len() {
                let mut c = best.clone();
                let end = (start + chunk).min(c.len());
                c.drain(start..end);
                if !try_it(c, &mut best, &mut replays) {
                    start += chunk;
                }
            }
            if chunk == 1 {
                break;
            }
            chunk = chunk.div_ceil(2).min(chunk - 1).max(1);
        }
        for i in 0..best.len() {
            for value in smaller(&best[i]) {
                let mut c = best.clone();
                c[i] = value;
                if try_it(c, &mut best, &mut replays) {
                    break;
                }
            }
        }
        if best == before || replays >= most {
            break;
        }
    }
    (best, replays)
}

/// Counts made smaller, smallest first: 1, half, one less.
fn down(n: usize) -> Vec<usize> {
    let mut v: Vec<usize> = [1, n / 2, n.saturating_sub(1)].into_iter().filter(|&m| m >= 1 && m < n).collect();
    v.dedup();
    v
}

fn cut_down(p: &PromptCut) -> Vec<PromptCut> {
    p.cut.map_or_else(Vec::new, |n| down(n).into_iter().map(|m| PromptCut { cut: Some(m), ..p.clone() }).collect())
}

/// The operation made smaller, smallest first: a row of a batch gone, then its counts (rows,
/// cuts, pads) smaller.
fn smaller(op: &Op) -> Vec<Op> {
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
        Op::Feed { seqs, rows } => {
            let mut out: Vec<Op> = (0..seqs.len())
                .filter(|_| seqs.len() > 1)
                .map(|j| {
                    let mut fewer = seqs.clone();
                    fewer.remove(j);
                    Op::Feed { seqs: fewer, rows: *rows }
                })
                .collect();
            out.extend(down(*rows).into_iter().map(|r| Op::Feed { seqs: seqs.clone(), rows: r }));
            out
        }
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

/// The request made smaller: fewer tokens asked for, a shorter prompt, a plainer arrival.
fn smaller_request(r: &Request) -> Vec<Request> {
    let with = |prompt: RequestPrompt| Request { prompt, ..r.clone() };
    let mut out: Vec<Request> = r
        .max_tokens
        .map_or_else(Vec::new, |n| down(n).into_iter().map(|m| Request { max_tokens: Some(m), ..r.clone() }).collect());
    match &r.prompt {
        RequestPrompt::Prompt(p) => out.extend(cut_down(p).into_iter().map(|c| with(RequestPrompt::Prompt(c)))),
        RequestPrompt::Back { of, cut } => {
            out.extend(down(*cut).into_iter().map(|c| with(RequestPrompt::Back { of: of.clone(), cut: c })))
        }
        RequestPrompt::Extends { of, then: Some(p) } => {
            out.push(with(RequestPrompt::Extends { of: of.clone(), then: None }));
            out.extend(cut_down(p).into_iter().map(|c| with(RequestPrompt::Extends { of: of.clone(), then: Some(c) })));
        }
        RequestPrompt::Extends { then: None, .. } => {}
    }
    match &r.when {
        RequestWhen::At(of, t) => {
            out.push(Request { when: RequestWhen::After(of.clone()), ..r.clone() });
            out.extend(down(*t).into_iter().map(|t| Request { when: RequestWhen::At(of.clone(), t), ..r.clone() }));
        }
        RequestWhen::After(_) => out.push(Request { when: RequestWhen::Now, ..r.clone() }),
        RequestWhen::Now => {}
    }
    out
}

/// The request script with its requests named r0, r1, ... in order.
fn renamed_requests(script: &RequestScript) -> RequestScript {
    let names: Vec<&str> = script.requests.iter().map(|r| r.name.as_str()).collect();
    let to = |n: &str| format!("r{}", names.iter().position(|m| *m == n).unwrap_or(0));
    let requests = script
        .requests
        .iter()
        .map(|r| Request {
            name: to(&r.name),
            prompt: match &r.prompt {
                RequestPrompt::Prompt(p) => RequestPrompt::Prompt(p.clone()),
                RequestPrompt::Extends { of, then } => RequestPrompt::Extends { of: to(of), then: then.clone() },
                RequestPrompt::Back { of, cut } => RequestPrompt::Back { of: to(of), cut: *cut },
            },
            when: match &r.when {
                RequestWhen::Now => RequestWhen::Now,
                RequestWhen::After(of) => RequestWhen::After(to(of)),
                RequestWhen::At(of, t) => RequestWhen::At(to(of), *t),
            },
            max_tokens: r.max_tokens,
        })
        .collect();
    RequestScript { requests }
}

/// One random request schedule: 2 to `budget.sequences + 1` requests, each a prompt cut
/// toward a boundary, or a relation to an earlier one (its prompt and answer extended, its
/// prompt cut back, the same prompt again), sent at once, after an earlier one ended, or once
/// an earlier one has streamed some tokens (only where streamed answers carry logprobs, so the
/// clock is a request parity measures; elsewhere `after` stands in).
pub fn generate_requests(
    rng: &mut Rng,
    prompts: &[Prompt],
    s: &Settings,
    stream_logprobs: bool,
    budget: &Budget,
) -> RequestScript {
    let n = 2 + rng.below(budget.sequences.max(1));
    let mut requests: Vec<Request> = Vec::new();
    // Each request's prompt length, as far as the generator can tell (an answer is taken as
    // max_tokens long; the runner cuts back to what is there).
    let mut lengths: Vec<usize> = Vec::new();
    for i in 0..n {
        let name = format!("r{i}");
        let fresh = |rng: &mut Rng| -> Option<(RequestPrompt, usize)> {
            let p = rng.pick(prompts)?;
            let len = length(rng, s, p.ids.len(), &[]);
            Some((
                RequestPrompt::Prompt(PromptCut { prompt: p.name.clone(), cut: (len < p.ids.len()).then_some(len) }),
                len,
            ))
        };
        let (prompt, len) = if i == 0 || rng.chance(0.35) {
            match fresh(rng) {
                Some(x) => x,
                None => break,
            }
        } else {
            let j = rng.below(i);
            let of = requests[j].name.clone();
            let roll = rng.below(100);
            if roll < 45 {
                let then = if rng.chance(0.5) {
                    rng.pick(prompts)
                        .map(|p| PromptCut { prompt: p.name.clone(), cut: Some(1 + rng.below(p.ids.len().min(4))) })
                } else {
                    None
                };
                let extra = then.as_ref().and_then(|t| t.cut).unwrap_or(0);
                (RequestPrompt::Extends { of, then }, lengths[j] + s.max_tokens + extra)
            } else if roll < 80 && lengths[j] > 1 {
                let cut = length(rng, s, lengths[j] - 1, &[]);
                (RequestPrompt::Back { of, cut }, cut)
            } else {
                (requests[j].prompt.clone(), lengths[j])
            }
        };
        let when = if i == 0 {
            RequestWhen::Now
        } else {
            let of = requests[rng.below(i)].name.clone();
            match rng.below(100) {
                0..40 => RequestWhen::Now,
                40..85 => RequestWhen::After(of),
                _ if stream_logprobs => RequestWhen::At(of, 1 + rng.below(s.max_tokens.max(1))),
                _ => RequestWhen::After(of),
            }
        };
        let max_tokens = rng.chance(0.3).then(|| 1 + rng.below(s.max_tokens.max(1)));
        requests.push(Request { name, prompt, when, max_tokens });
        lengths.push(len);
    }
    RequestScript { requests }
}

/// What a run of explore reports for a path that found nothing: the numbers behind "clean".
fn summary<S, M>(e: &Explored<S, M>, what: &str) -> String {
    format!("{} schedules, {} {what}, no failure; {}", e.schedules, e.ops, time(e, what))
}

/// Where the time went: the rate, and the shares inside the engine, on the reference path,
/// judging, and the rest (generating, parity's own bookkeeping between operations).
fn time<S, M>(e: &Explored<S, M>, what: &str) -> String {
    let total = e.seconds.max(1e-9);
    let share = |x: f64| 100.0 * x / total;
    let rest = (e.seconds - e.engine_seconds - e.reference_seconds - e.judge_seconds).max(0.0);
    format!(
        "{:.1}s, {:.1} {what}/s; engine {:.0}%, reference {:.0}%, judging {:.0}%, the rest {:.0}%",
        e.seconds,
        e.ops as f64 / total,
        share(e.engine_seconds),
        share(e.reference_seconds),
        share(e.judge_seconds),
        share(rest)
    )
}

/// Notes for a finding's row: the reproducer, ready to pin, and where it came from.
fn notes<S: std::fmt::Display, M>(f: &Finding<S, M>, e: &Explored<S, M>, d: &Describe<S>) -> Vec<String> {
    let (what, key) = (d.items, d.key);
    let quoted = f.shrunk.to_string().replace('\\', "\\\\").replace('"', "\\\"");
    vec![
        format!("reproducer: {}", f.shrunk),
        format!("pin it: [[scripts]] name = \"s{}\" {key} = \"{quoted}\"", f.schedule),
        format!(
            "schedule s{} of {} {what} shrunk to {} in {} replays; {} schedules, {} {what} explored; {}",
            f.schedule,
            (d.len)(&f.generated),
            (d.len)(&f.shrunk),
            f.replays,
            e.schedules,
            e.ops,
            time(e, what)
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
