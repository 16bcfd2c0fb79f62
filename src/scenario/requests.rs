//! The request-level scenarios: what to send a server, when, and which requests each report
//! row judges. A schedule is run on one server (a [`RequestPath`]); every measured request is
//! compared with the reference path's answer to the same prompt sent alone ([`References`]).
//!
//! - `single`: one request alone.
//! - `batch2`: `same` (the prompt twice at once: any difference between the two is the
//!   batch), `ragged` (the prompt next to one of another length, at once).
//! - `concurrent`: N requests; request j arrives once a clock request has streamed
//!   `arrivals[j]` tokens, so arrival points are repeatable in tokens, not in wall time.
//!   Lengths are staggered too, so requests leave the batch at different steps.
//! - `lengths`: the first prompt cut or repeated to lengths across tile/block/chunk bounds.
//! - `prefix`: a request, then (after it finished) one whose prompt extends it: `extends`
//!   continues after the first request's answer (a cache hit on the whole earlier sequence),
//!   `trimmed` continues the first prompt only (the cached sequence must be cut back).
//! - `repeat`: the same request twice in a row: `uncached` and `cached`.

use std::collections::HashMap;

use super::{CaseOutput, Outcome};
pub use crate::engine::openai::Sent;
use crate::engine::openai::{Completion, CompletionRequest, Metrics, Reply, RequestError, RequestPath, When};
use crate::vocab::{Prompt, PromptCut, RequestPrompt, RequestScript, RequestWhen, Scenario, Settings};

/// One report row: the requests it judges (the worst speaks for it).
#[derive(Debug, Clone, PartialEq)]
pub struct RowPlan {
    pub prompt: String,
    pub case: String,
    pub measured: Vec<usize>,
    pub notes: Vec<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    pub requests: Vec<CompletionRequest>,
    pub rows: Vec<RowPlan>,
}

/// What a plan may know: the settings, whether streamed answers carry logprobs, and the
/// reference's tokens for a prompt (the `prefix` scenario continues after them).
pub struct Inputs<'a> {
    pub settings: &'a Settings,
    pub stream_logprobs: bool,
    pub reference_tokens: &'a dyn Fn(&[u32]) -> Option<Vec<u32>>,
}

fn now(ids: &[u32], max_tokens: usize) -> CompletionRequest {
    CompletionRequest { ids: ids.to_vec(), max_tokens, when: When::Now, stream: false }
}

fn row(prompt: &Prompt, case: &str, measured: Vec<usize>) -> RowPlan {
    RowPlan { prompt: prompt.name.clone(), case: case.into(), measured, notes: Vec::new() }
}

pub fn plan(scenario: Scenario, prompts: &[Prompt], inp: &Inputs) -> Vec<Schedule> {
    let n = inp.settings.max_tokens;
    match scenario {
        Scenario::Single => prompts
            .iter()
            .map(|p| Schedule { requests: vec![now(&p.ids, n)], rows: vec![row(p, "alone", vec![0])] })
            .collect(),
        Scenario::Batch2 => batch2(prompts, n),
        Scenario::Concurrent => concurrent(prompts, inp).into_iter().collect(),
        Scenario::Lengths => lengths(prompts, inp.settings),
        Scenario::Prefix => prefix(prompts, inp),
        Scenario::Repeat => prompts
            .iter()
            .map(|p| {
                let mut second = now(&p.ids, n);
                second.when = When::AfterDone { of: 0 };
                Schedule {
                    requests: vec![now(&p.ids, n), second],
                    rows: vec![row(p, "uncached", vec![0]), row(p, "cached", vec![1])],
                }
            })
            .collect(),
        // Step-level scenarios are refused for this engine when the suite is read.
        _ => Vec::new(),
    }
}

fn batch2(prompts: &[Prompt], n: usize) -> Vec<Schedule> {
    let mut out = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        out.push(Schedule { requests: vec![now(&p.ids, n), now(&p.ids, n)], rows: vec![row(p, "same", vec![0, 1])] });
        if let Some(j) = super::ragged_partner(prompts, i) {
            let other = &prompts[j];
            let mut r = row(p, "ragged", vec![1]);
            r.notes.push(format!("sent with {} ({} tokens)", other.name, other.ids.len()));
            out.push(Schedule { requests: vec![now(&other.ids, n), now(&p.ids, n)], rows: vec![r] });
        }
    }
    out
}

/// One schedule for all requests. The clock is request 0 itself when streamed answers carry
/// logprobs; otherwise an unmeasured copy of request 0 sent with it, streamed. Where streams
/// carry logprobs every request streams, so each is visibly under way from its first token to
/// its last; where not, the pacer streams twice as long as any request, so a server that runs
/// them together answers every one while it still streams (the evidence that it does).
fn concurrent(prompts: &[Prompt], inp: &Inputs) -> Option<Schedule> {
    let c = &inp.settings.concurrent;
    let n = inp.settings.max_tokens;
    if prompts.is_empty() || c.requests == 0 || c.arrivals.is_empty() {
        return None;
    }
    // The clock is request 0 of the schedule either way.
    let (mut requests, clock) = (Vec::new(), 0);
    if !inp.stream_logprobs {
        requests.push(CompletionRequest { stream: true, ..now(&prompts[0].ids, 2 * n) });
    }
    let offset = requests.len();
    let mut rows = Vec::new();
    // The step-level scenario's schedule: arrivals in the clock's tokens, staggered lengths.
    for (j, a) in c.schedule(n).into_iter().enumerate() {
        let p = &prompts[j % prompts.len()];
        let when = if j == 0 || a.at == 0 { When::Now } else { When::AfterTokens { of: clock, tokens: a.at } };
        let stream = inp.stream_logprobs;
        requests.push(CompletionRequest { ids: p.ids.clone(), max_tokens: a.steps, when, stream });
        let mut r = row(p, &format!("req{j}"), vec![offset + j]);
        r.notes.push(format!("arrives after {} streamed tokens, {} steps", a.at, a.steps));
        rows.push(r);
    }
    Some(Schedule { requests, rows })
}

/// The lengths to send: the suite's, else one below, at and above each boundary.
pub fn boundary_lengths(s: &Settings) -> Vec<usize> {
    if let Some(l) = &s.lengths {
        return l.clone();
    }
    let mut out: Vec<usize> = [s.tile, s.block_size, s.chunk]
        .iter()
        .flat_map(|&b| [b.saturating_sub(1), b, b + 1])
        .filter(|&l| l > 0)
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

fn lengths(prompts: &[Prompt], s: &Settings) -> Vec<Schedule> {
    let Some(p) = prompts.first() else { return Vec::new() };
    boundary_lengths(s)
        .into_iter()
        .map(|len| {
            // The row keeps the prompt's name; the case says the length.
            let ids: Vec<u32> = p.ids.iter().copied().cycle().take(len).collect();
            Schedule { requests: vec![now(&ids, s.max_tokens)], rows: vec![row(p, &format!("len{len}"), vec![0])] }
        })
        .collect()
}

fn prefix(prompts: &[Prompt], inp: &Inputs) -> Vec<Schedule> {
    let n = inp.settings.max_tokens;
    let mut out = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        // What follows the shared part: the next prompt's tokens (a new turn), or this one's.
        let tail = &prompts[(i + 1) % prompts.len()].ids;
        let then =
            |ids: Vec<u32>| CompletionRequest { ids, max_tokens: n, when: When::AfterDone { of: 0 }, stream: false };
        if let Some(answer) = (inp.reference_tokens)(&p.ids) {
            let ids: Vec<u32> = p.ids.iter().chain(&answer).chain(tail).copied().collect();
            let mut r = row(p, "extends", vec![1]);
            r.notes.push(format!(
                "prompt {} = earlier prompt {} + its answer {} + {}",
                ids.len(),
                p.ids.len(),
                answer.len(),
                tail.len()
            ));
            out.push(Schedule { requests: vec![now(&p.ids, n), then(ids)], rows: vec![r] });
        }
        let ids: Vec<u32> = p.ids.iter().chain(tail).copied().collect();
        let mut r = row(p, "trimmed", vec![1]);
        r.notes.push(format!("prompt {} = earlier prompt {} + {}", ids.len(), p.ids.len(), tail.len()));
        out.push(Schedule { requests: vec![now(&p.ids, n), then(ids)], rows: vec![r] });
    }
    out
}

/// Answers to prompts sent alone on the reference path, by prompt ids: what every measured
/// request is compared with. An error is why that prompt has no reference.
pub type References = HashMap<Vec<u32>, Result<Completion, String>>;

/// The reference path's answer to a prompt sent alone (computed the first time it is asked
/// for); `None` when there is none to give.
pub type AnswerAlone<'a> = dyn FnMut(&[u32]) -> Option<Result<Completion, String>> + 'a;

/// Send each of `prompts` not yet answered alone on the reference path, `max_tokens` long.
pub fn answer_alone(path: &mut dyn RequestPath, prompts: &[Vec<u32>], max_tokens: usize, out: &mut References) {
    for ids in prompts {
        if out.contains_key(ids) {
            continue;
        }
        let alone = CompletionRequest { ids: ids.clone(), max_tokens, when: When::Now, stream: false };
        let answer = path.send(&[alone]).remove(0).result.map_err(|e| match path.ended_after_failure() {
            Some(how) => format!("{e}; the reference server {how}"),
            None => e.to_string(),
        });
        out.insert(ids.clone(), answer);
    }
}

/// What a request-level case measured: each measured request's answer, in the order its row
/// plan lists them.
#[derive(Debug, Clone)]
pub struct Answers {
    pub requests: Vec<Answer>,
    /// How many requests the schedule sent (the batch a divergence sits in).
    pub sent: usize,
    /// How the server ended, when it died during the schedule.
    pub server_ended: Option<String>,
    /// When each request of the schedule (measured or not) was sent and answered, in seconds
    /// since the schedule began; `None` for one that failed.
    pub timeline: Vec<Option<Sent>>,
    /// The server's counters before and after the schedule (where the suite names an
    /// endpoint), or why they could not be read.
    pub metrics: Option<Result<(Metrics, Metrics), String>>,
}

/// Each request's [`Sent`] where it was answered at all (a request that failed before the
/// server took it says nothing about overlap).
fn timeline(answers: &[Reply]) -> Vec<Option<Sent>> {
    answers
        .iter()
        .map(|a| match &a.result {
            Err(RequestError::Status { .. } | RequestError::Transport(_)) => None,
            _ => Some(a.sent),
        })
        .collect()
}

impl Answers {
    pub fn unsent(sent: usize) -> Self {
        Answers { requests: Vec::new(), sent, server_ended: None, timeline: Vec::new(), metrics: None }
    }
}

/// One measured request, what came back, and the reference it is compared with (`None`: no
/// reference was computed for its prompt).
#[derive(Debug, Clone)]
pub struct Answer {
    /// Its index in the schedule (a divergence's batch row).
    pub index: usize,
    pub request: CompletionRequest,
    pub result: Result<Completion, RequestError>,
    pub reference: Option<Result<Completion, String>>,
}

/// Run `schedules` in order on one path: each row plan becomes a case, its answers beside their
/// `references`. Once the server has died, later schedules are not sent; their cases say why.
pub fn run(schedules: &[Schedule], path: &mut dyn RequestPath, references: &References) -> Vec<CaseOutput<Answers>> {
    let mut out = Vec::new();
    let mut dead: Option<String> = None;
    for s in schedules {
        if let Some(why) = &dead {
            // Said once, on the row that saw the server die; these only say they did not run.
            out.extend(
                s.rows
                    .iter()
                    .map(|r| CaseOutput { notes: Vec::new(), ..unsent(s, r, format!("not run: the server {why}")) }),
            );
            continue;
        }
        let before = path.metrics();
        let answers = path.send(&s.requests);
        let timeline = timeline(&answers);
        let answers: Vec<_> = answers.into_iter().map(|a| a.result).collect();
        let ended = if answers.iter().any(|a| a.is_err()) { path.ended_after_failure() } else { None };
        let metrics = match (before, if ended.is_none() { path.metrics() } else { None }) {
            (Some(Ok(a)), Some(Ok(b))) => Some(Ok((a, b))),
            (Some(Err(e)), _) | (_, Some(Err(e))) => Some(Err(e)),
            (Some(_), None) => Some(Err("the server ended before its counters could be read again".into())),
            (None, _) => None,
        };
        for r in &s.rows {
            let requests = r
                .measured
                .iter()
                .map(|&m| Answer {
                    index: m,
                    request: s.requests[m].clone(),
                    result: answers[m].clone(),
                    reference: references.get(&s.requests[m].ids).cloned(),
                })
                .collect();
            let measured = Answers {
                requests,
                sent: s.requests.len(),
                server_ended: ended.clone(),
                timeline: timeline.clone(),
                metrics: metrics.clone(),
            };
            out.push(CaseOutput {
                notes: r.notes.clone(),
                ..CaseOutput::new(&r.case, &prompt(s, r), measured, Outcome::Ran)
            });
        }
        dead = ended;
    }
    out
}

/// Every row plan of `schedules` as a case that never ran, because of `why`.
pub fn not_run(schedules: &[Schedule], why: &str) -> Vec<CaseOutput<Answers>> {
    schedules.iter().flat_map(|s| s.rows.iter().map(|r| unsent(s, r, why.to_string()))).collect()
}

fn unsent(s: &Schedule, r: &RowPlan, why: String) -> CaseOutput<Answers> {
    let measured = Answers::unsent(s.requests.len());
    CaseOutput { notes: r.notes.clone(), ..CaseOutput::new(&r.case, &prompt(s, r), measured, Outcome::NotRun(why)) }
}

/// The row's prompt: its name, and the ids its measured requests send (the same for each, so
/// one reference serves the row).
fn prompt(s: &Schedule, r: &RowPlan) -> Prompt {
    let ids = r.measured.first().map(|&m| s.requests[m].ids.clone()).unwrap_or_default();
    Prompt { name: r.prompt.clone(), ids }
}

/// A request script as one schedule on `path` (a fresh server), its requests one case named
/// `name`: every request measured, each beside the reference answer to its prompt alone.
/// `reference` answers a prompt alone on the reference path (computing it the first time); an
/// `r0 + answer` request reads the answer from there. A request that names one no longer in
/// the script (shrinking removed it) is passed over, so any subsequence of a script is a script.
/// `stream_logprobs`: streamed answers carry logprobs; where they do not, a request that others
/// wait on by its streamed tokens is sent twice, the copy streamed as the clock and not measured.
pub fn run_script(
    script: &RequestScript,
    prompts: &[Prompt],
    max_tokens: usize,
    stream_logprobs: bool,
    path: &mut dyn RequestPath,
    reference: &mut AnswerAlone,
    name: &str,
) -> CaseOutput<Answers> {
    let mut ids: Vec<Option<Vec<u32>>> = Vec::new();
    let mut requests: Vec<CompletionRequest> = Vec::new();
    // Schedule index of each script request that is sent (and of its clock copy, if any).
    let mut index: Vec<Option<usize>> = Vec::new();
    let mut clock: Vec<Option<usize>> = Vec::new();
    let find = |n: &str| script.requests.iter().position(|r| r.name == n);
    for r in &script.requests {
        let earlier = |n: &str, ids: &[Option<Vec<u32>>]| find(n).and_then(|j| ids.get(j).cloned().flatten());
        let prompt = match &r.prompt {
            RequestPrompt::Prompt(p) => cut(prompts, p),
            RequestPrompt::Back { of, cut } => earlier(of, &ids).map(|e| e[..(*cut).min(e.len())].to_vec()),
            RequestPrompt::Extends { of, then } => earlier(of, &ids).and_then(|e| {
                let answer = reference(&e)?.ok()?.trace.tokens;
                let more = match then {
                    Some(p) => cut(prompts, p)?,
                    None => Vec::new(),
                };
                Some(e.iter().chain(&answer).chain(&more).copied().collect())
            }),
        };
        let when = match &r.when {
            RequestWhen::Now => Some(When::Now),
            RequestWhen::After(of) => find(of).and_then(|j| index[j]).map(|of| When::AfterDone { of }),
            RequestWhen::At(of, tokens) => find(of).and_then(|j| index[j].map(|_| j)).map(|j| {
                // The clock: the request itself, streamed, where streams carry logprobs; else a
                // streamed copy sent with it.
                let of = match clock[j] {
                    Some(c) => c,
                    None if stream_logprobs => {
                        let k = index[j].unwrap_or(0);
                        requests[k].stream = true;
                        clock[j] = Some(k);
                        k
                    }
                    None => {
                        let k = index[j].unwrap_or(0);
                        requests.push(CompletionRequest { stream: true, ..requests[k].clone() });
                        clock[j] = Some(requests.len() - 1);
                        requests.len() - 1
                    }
                };
                When::AfterTokens { of, tokens: *tokens }
            }),
        };
        match (prompt.filter(|p| !p.is_empty()), when) {
            (Some(p), Some(when)) => {
                let max_tokens = r.max_tokens.unwrap_or(max_tokens);
                requests.push(CompletionRequest { ids: p.clone(), max_tokens, when, stream: false });
                index.push(Some(requests.len() - 1));
                ids.push(Some(p));
            }
            _ => {
                index.push(None);
                ids.push(None);
            }
        }
        clock.push(None);
    }
    let first = script.requests.iter().zip(&index).find(|(_, i)| i.is_some()).map(|(r, _)| r);
    let row_prompt = match first.map(|r| &r.prompt) {
        Some(RequestPrompt::Prompt(p)) => Prompt { name: p.prompt.clone(), ids: cut(prompts, p).unwrap_or_default() },
        _ => Prompt { name: "*".into(), ids: Vec::new() },
    };
    let passed_over = index.iter().filter(|i| i.is_none()).count();
    if requests.is_empty() {
        let why = "no request of the script could be sent".to_string();
        return CaseOutput::new(name, &row_prompt, Answers::unsent(0), Outcome::Failed(why));
    }
    let answers = path.send(&requests);
    let timeline = timeline(&answers);
    let answers: Vec<_> = answers.into_iter().map(|a| a.result).collect();
    let ended = if answers.iter().any(|a| a.is_err()) { path.ended_after_failure() } else { None };
    let measured: Vec<Answer> = index
        .iter()
        .flatten()
        .map(|&m| Answer {
            index: m,
            request: requests[m].clone(),
            result: answers[m].clone(),
            reference: reference(&requests[m].ids),
        })
        .collect();
    let mut c = CaseOutput::new(
        name,
        &row_prompt,
        Answers { requests: measured, sent: requests.len(), server_ended: ended, timeline, metrics: None },
        Outcome::Ran,
    );
    if passed_over > 0 {
        c.notes.push(format!(
            "{passed_over} of {} requests named one no longer there and were passed over",
            script.requests.len()
        ));
    }
    c
}

/// `corpus` on a server: the text read teacher-forced, one request per position, each prompt
/// the text up to that position (as token ids) and `max_tokens` 1, so that the answer's top-k
/// logprobs are the next-token distribution after the position. A server cannot be stepped;
/// its prompt cache is what makes each request the decode path: it holds the previous
/// request's prompt, one token shorter, so the server computes the one new token over its
/// cached KV (the `cached` evidence checks that it did). Requests go one at a time on one
/// server; the first failure ends the read (`failed` says where and why).
#[derive(Debug, Clone, Default)]
pub struct CorpusRead {
    /// Per position read: what the server answered to the prefix ending there.
    pub answers: Vec<Completion>,
    pub failed: Option<String>,
}

/// Positions a `corpus` read of `prompt` covers: the settings' `corpus_tokens`, at most every
/// position with a next token to predict; an error for a prompt with none.
pub fn corpus_positions(settings: &Settings, prompt: &Prompt) -> Result<usize, String> {
    match settings.corpus_tokens.min(prompt.ids.len().saturating_sub(1)) {
        0 => {
            Err(format!("the {}-token prompt has no next token to predict: corpus needs at least 2", prompt.ids.len()))
        }
        n => Ok(n),
    }
}

/// Read the first `n` positions of `ids` on `path` (see [`CorpusRead`]). Each answer is
/// checked, not trusted: the server's count of the prompt must be what was sent (else it read
/// another text than the reference), and the answer must carry one step of top-k logprobs.
pub fn read_corpus(path: &mut dyn RequestPath, ids: &[u32], n: usize) -> CorpusRead {
    let mut read = CorpusRead::default();
    for i in 0..n.min(ids.len()) {
        let request = CompletionRequest { ids: ids[..=i].to_vec(), max_tokens: 1, when: When::Now, stream: false };
        let problem = match path.send(&[request]).remove(0).result {
            Err(e) => Some(match path.ended_after_failure() {
                Some(how) => format!("{e}; the server {how}"),
                None => e.to_string(),
            }),
            Ok(c) if c.prompt_tokens.is_some_and(|p| p != i + 1) => Some(format!(
                "the server counted {} prompt tokens, parity sent {}",
                c.prompt_tokens.unwrap_or_default(),
                i + 1
            )),
            Ok(c) if c.trace.steps.is_empty() => Some("the answer has no top-k logprobs".into()),
            Ok(c) => {
                read.answers.push(c);
                None
            }
        };
        if let Some(why) = problem {
            read.failed = Some(format!("position {i} (a prompt of {} tokens): {why}", i + 1));
            break;
        }
    }
    read
}

/// The `corpus` case of `prompt` on a server: `path`'s read against `reference`'s, position by
/// position ([`crate::compare::topk_position_samples`]: KL over the returned top-k), as one
/// row. Every answer is kept in `measured` (the prompt-cache evidence is judged on them).
pub fn corpus_case(prompt: &Prompt, n: usize, reference: &CorpusRead, path: CorpusRead) -> CaseOutput<Answers> {
    let n = n.min(prompt.ids.len().saturating_sub(1));
    let mut measured = Answers::unsent(path.answers.len());
    let failed = match (&reference.failed, &path.failed) {
        (Some(f), _) => Some(format!("the reference path's read failed at {f}")),
        (None, Some(f)) => Some(format!("the read failed at {f}")),
        (None, None) => None,
    };
    let top = |r: &CorpusRead| -> Vec<Vec<(u32, f64)>> { r.answers.iter().map(|c| c.trace.steps[0].clone()).collect() };
    let samples = match failed {
        Some(f) => Err(f),
        None => crate::compare::topk_position_samples(&top(reference), &top(&path), &prompt.ids[1..=n], 0)
            .map_err(|e| e.to_string()),
    };
    let k = |r: &CorpusRead| r.answers.iter().map(|c| c.trace.steps[0].len()).min().unwrap_or(0);
    let (k_ref, k_path) = (k(reference), k(&path));
    measured.requests = path
        .answers
        .into_iter()
        .enumerate()
        .map(|(i, c)| Answer {
            index: i,
            request: CompletionRequest {
                ids: prompt.ids[..=i].to_vec(),
                max_tokens: 1,
                when: When::Now,
                stream: false,
            },
            result: Ok(c),
            reference: None,
        })
        .collect();
    let outcome = match &samples {
        Err(e) => Outcome::Failed(e.clone()),
        Ok(_) => Outcome::Ran,
    };
    let mut c = CaseOutput::new("teacher-forced", prompt, measured, outcome);
    if let Ok(samples) = samples {
        let d = crate::vocab::Distribution::of(&samples, crate::compare::CORPUS_TOP_K.min(k_ref).min(k_path));
        c.notes.push(format!(
            "{} positions read teacher-forced, one request each (the text up to the position, max_tokens 1)",
            d.positions
        ));
        c.notes.push(format!(
            "KL over the reference's top-{k_ref} and the rest of the vocabulary as one bucket (the server returns \
             top-k logprobs only): a lower bound on the full KL where the path lists those tokens"
        ));
        c.distribution = Some(d);
    }
    c
}

/// A prompt's ids, cut; `None` for a prompt this checkpoint does not run.
fn cut(prompts: &[Prompt], p: &PromptCut) -> Option<Vec<u32>> {
    let prompt = prompts.iter().find(|q| q.name == p.prompt)?;
    Some(prompt.ids[..p.cut.unwrap_or(prompt.ids.len()).min(prompt.ids.len())].to_vec())
}
