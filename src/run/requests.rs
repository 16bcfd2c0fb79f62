//! A checkpoint on OpenAI-compatible servers (kind = "openai"): the protocol the seed bugs
//! were found with, made a `parity run`. The reference path's server answers every prompt
//! alone (one request at a time); then, for each cell, a fresh server runs the scenario's
//! schedules and every measured request is judged against its reference on what the API
//! returned. One server is alive at a time, and each is killed when its cell ends (or on any
//! exit).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::judge::{self, Judge};
use super::{
    Cell, Progress, Resolved, RunOptions, blanket_rows, cell_row, each_cell, encode_all, encoded_ids, unencoded_rows,
};
use crate::engine::Dirs;
use crate::engine::openai::ServerPath;
use crate::report::{CheckpointReport, CheckpointStatus, Phase, Row};
use crate::rng::Rng;
use crate::scenario::explore::{self, Budget, Spent};
use crate::scenario::requests::{self, AnswerAlone, Answers, Inputs, References, Schedule};
use crate::scenario::{CaseOutput, Outcome};
use crate::vocab::{EngineId, OpenaiSpec, Prompt, RequestScript, Scenario, Verdict};

pub(super) fn run(
    r: &Resolved,
    o: &OpenaiSpec,
    cells: &[Cell],
    opts: &RunOptions,
    progress: &dyn Progress,
    report: &mut CheckpointReport,
) -> Vec<Row> {
    let (suite, spec) = (r.suite, r.spec);
    report.max_logprob_delta_tolerance = Some(spec.tolerance.max_logprob_delta);
    report.bitwise = spec.tolerance.bitwise;
    report.engine = Some(EngineId::unnamed("openai", &o.name));
    report.reference_path = Some(o.reference.clone());
    if !opts.faults.is_empty() {
        // parity can plant faults only in its own runtime: a selftest through a server would
        // "catch" nothing and prove nothing.
        let why = format!("engine {} (kind openai) cannot plant faults", o.name);
        return blanket_rows(suite, spec, cells, opts, r.filter, Verdict::Skipped, &why);
    }

    // A server's vocabulary is its tokenizer's (config.json may pad the embedding).
    let prompts = encode_all(r, cells, r.tokenizer.vocab_size());
    report.prompt_ids = encoded_ids(&prompts);
    let good: Vec<Prompt> = prompts.values().filter_map(|p| p.as_ref().ok().cloned()).collect();

    // References: the base prompts first (the prefix scenario continues after their answers),
    // then every other prompt a schedule measures.
    let t = Instant::now();
    let suite_dir = suite.dir();
    let dirs = Dirs { checkpoint: &r.dir, suite_dir: &suite_dir };
    let start = |path: &str, label: &str| {
        let log = opts.server_logs.as_ref().map(|d| log_file(d, &spec.name, label, path));
        ServerPath::start(o, path, dirs, log, &r.tokenizer)
    };
    let mut reference = match start(&o.reference, "reference") {
        Ok(s) => s,
        Err(why) => {
            let why = format!("reference path `{}` did not start: {why}", o.reference);
            report.status = CheckpointStatus::Error;
            report.reason = Some(why.clone());
            return blanket_rows(suite, spec, cells, opts, r.filter, Verdict::Error, &why);
        }
    };
    let max_tokens = spec.settings.max_tokens;
    let mut references = References::new();
    // A corpus-only checkpoint asks the reference nothing but its corpus reads.
    let base: Vec<Vec<u32>> = if cells.iter().any(|c| c.scenario != Scenario::Corpus) {
        good.iter().map(|p| p.ids.clone()).collect()
    } else {
        Vec::new()
    };
    requests::answer_alone(&mut reference, &base, max_tokens, &mut references);
    let mut schedules: BTreeMap<(Scenario, String, Vec<usize>), Vec<Schedule>> = BTreeMap::new();
    for c in cells {
        let key = (c.scenario, c.path.clone(), c.prompts.clone());
        if schedules.contains_key(&key) {
            continue;
        }
        let mine: Vec<Prompt> = c.prompts.iter().filter_map(|p| prompts[p].as_ref().ok().cloned()).collect();
        let tokens = |ids: &[u32]| references.get(ids).and_then(|a| a.as_ref().ok()).map(|a| a.trace.tokens.clone());
        let inputs = Inputs { settings: &spec.settings, stream_logprobs: o.stream_logprobs, reference_tokens: &tokens };
        let mut planned = requests::plan(c.scenario, &mine, &inputs);
        // Under --filter, only schedules with a selected row are sent (and their references).
        planned.retain(|s| {
            s.rows.iter().any(|p| r.filter.selects_row(&cell_row(spec, c, &p.prompt, &p.case, Verdict::Identical)))
        });
        schedules.insert(key, planned);
    }
    let mut more: Vec<Vec<u32>> = Vec::new();
    for s in schedules.values().flatten() {
        for p in &s.rows {
            more.extend(p.measured.iter().map(|&m| s.requests[m].ids.clone()));
        }
    }
    requests::answer_alone(&mut reference, &more, max_tokens, &mut references);
    // The reference's reads of every corpus prompt a selected row reads, each once.
    let mut corpus_reads: BTreeMap<Vec<u32>, requests::CorpusRead> = BTreeMap::new();
    for c in cells.iter().filter(|c| c.scenario == Scenario::Corpus) {
        for p in corpus_prompts(r, c, &prompts) {
            if let Ok(n) = requests::corpus_positions(&spec.settings, &p)
                && !corpus_reads.contains_key(&p.ids)
            {
                let read = requests::read_corpus(&mut reference, &p.ids, n);
                corpus_reads.insert(p.ids.clone(), read);
            }
        }
    }
    if let Some(fp) = references.values().find_map(|a| a.as_ref().ok()?.fingerprint.clone()) {
        report.reference_engine = Some(EngineId { version: fp, ..EngineId::unnamed("openai", &o.name) });
    }
    // Scripts (explored or pinned) ask for references as they go: the reference server stays
    // up for them (idle while a path's server answers). Otherwise one server is alive at a time.
    let scripted = cells.iter().any(|c| matches!(c.scenario, Scenario::Explore | Scenario::Script));
    if !scripted {
        reference.stop();
    }
    let pinned = suite.request_scripts();
    report.phases.push(Phase { name: "reference".into(), seconds: t.elapsed().as_secs_f64() });

    let rows = each_cell(cells, opts, r.filter, progress, &mut report.phases, |cell, phases| {
        let mut rows = unencoded_rows(r, cell, &prompts);
        let judge = Judge { spec, cell, tokenizer: &r.tokenizer };
        let mine: Vec<Prompt> = cell.prompts.iter().filter_map(|p| prompts[p].as_ref().ok().cloned()).collect();
        let start_path = |label: &str| start(&cell.path, label);
        let mut answer = |ids: &[u32]| {
            requests::answer_alone(&mut reference, &[ids.to_vec()], max_tokens, &mut references);
            references.get(ids).cloned()
        };
        match cell.scenario {
            Scenario::Explore => {
                let budget = opts.explore.clone().unwrap_or_default();
                rows.extend(explore(o, &mine, &budget, &judge, &start_path, &mut answer, max_tokens));
                return rows;
            }
            Scenario::Script => {
                for (name, script) in &pinned {
                    let case = scripted_case(o, &mine, script, name, &judge, &start_path, &mut answer, max_tokens);
                    rows.push(judge.requests(&case));
                }
                return rows;
            }
            Scenario::Corpus => {
                rows.extend(corpus_cell(r, cell, &prompts, &corpus_reads, &judge, &start_path, phases));
                return rows;
            }
            _ => {}
        }
        let planned = &schedules[&(cell.scenario, cell.path.clone(), cell.prompts.clone())];
        if planned.is_empty() {
            return rows;
        }
        let judge = Judge { spec, cell, tokenizer: &r.tokenizer };
        // A fresh server for the cell: no state carried over from another scenario.
        let cases = match start(&cell.path, cell.scenario.name()) {
            Ok(mut server) => {
                phases.push(Phase { name: format!("start {}", cell.path), seconds: server.age() });
                let cases = requests::run(planned, &mut server, &references);
                server.stop();
                cases
            }
            Err(why) => requests::not_run(planned, &format!("path `{}` did not start: {why}", cell.path)),
        };
        rows.extend(cases.iter().map(|c| judge.requests(c)));
        rows
    });
    reference.stop();
    if let Some(e) = report.engine.as_mut()
        && let Some(r) = &report.reference_engine
    {
        e.version = r.version.clone();
    }
    rows
}

/// The prompts of a corpus cell that a selected row reads (all, without `--filter`).
fn corpus_prompts(r: &Resolved, c: &Cell, prompts: &BTreeMap<usize, Result<Prompt, String>>) -> Vec<Prompt> {
    c.prompts
        .iter()
        .filter_map(|p| prompts[p].as_ref().ok())
        .filter(|p| r.filter.selects_row(&cell_row(r.spec, c, &p.name, "teacher-forced", Verdict::Identical)))
        .cloned()
        .collect()
}

/// A corpus cell on a server: one fresh server of the cell's path reads each of the cell's
/// corpus prompts, one request per position, and each read is judged against the reference's
/// read of the same prompt.
fn corpus_cell<'a>(
    r: &Resolved,
    cell: &Cell,
    prompts: &BTreeMap<usize, Result<Prompt, String>>,
    reference: &BTreeMap<Vec<u32>, requests::CorpusRead>,
    judge: &Judge,
    start: &dyn Fn(&str) -> Result<ServerPath<'a>, String>,
    phases: &mut Vec<Phase>,
) -> Vec<Row> {
    let mine = corpus_prompts(r, cell, prompts);
    if mine.is_empty() {
        return Vec::new();
    }
    let not_run = |p: &Prompt, why: String| {
        let c = CaseOutput::new("teacher-forced", p, requests::Answers::unsent(0), Outcome::NotRun(why));
        judge.requests(&c)
    };
    let mut server = match start(cell.scenario.name()) {
        Ok(s) => s,
        Err(why) => {
            let why = format!("path `{}` did not start: {why}", cell.path);
            return mine.iter().map(|p| not_run(p, why.clone())).collect();
        }
    };
    phases.push(Phase { name: format!("start {}", cell.path), seconds: server.age() });
    let rows = mine
        .iter()
        .map(|p| match (requests::corpus_positions(&r.spec.settings, p), reference.get(&p.ids)) {
            (Err(why), _) => {
                let c = CaseOutput::new("teacher-forced", p, requests::Answers::unsent(0), Outcome::Failed(why));
                judge.requests(&c)
            }
            (Ok(_), None) => not_run(p, "no reference read of this prompt".into()),
            (Ok(n), Some(reference)) => {
                let read = requests::read_corpus(&mut server, &p.ids, n);
                judge.requests(&requests::corpus_case(p, n, reference, read))
            }
        })
        .collect();
    server.stop();
    rows
}

/// Explore one path of a server within `budget`: random request scripts, each on a fresh
/// server (so a finding does not hang on what an earlier schedule left in its cache), a row per
/// distinct failure, shrunk, with its reproducer; or one passing row with what was explored.
/// `answer` gives (and computes the first time) the reference path's answer to a prompt alone.
fn explore<'a>(
    o: &OpenaiSpec,
    prompts: &[Prompt],
    budget: &Budget,
    judge: &Judge,
    start: &dyn Fn(&str) -> Result<ServerPath<'a>, String>,
    answer: &mut AnswerAlone,
    max_tokens: usize,
) -> Vec<Row> {
    let settings = &judge.spec.settings;
    let label = [judge.spec.name.as_str(), judge.cell.path.as_str()];
    let mut generate = |rng: &mut Rng| explore::generate_requests(rng, prompts, settings, o.stream_logprobs, budget);
    // The engine's time: its server starting and answering; the reference's: answers alone
    // computed for the first time.
    let mut run = |s: &RequestScript, name: &str| {
        let mut reference = Duration::ZERO;
        let mut timed = |ids: &[u32]| {
            let t = Instant::now();
            let a = answer(ids);
            reference += t.elapsed();
            a
        };
        let t = Instant::now();
        let case = scripted_case(o, prompts, s, name, judge, start, &mut timed, max_tokens);
        let engine = t.elapsed().saturating_sub(reference);
        let ops = case.measured.requests.len();
        (case, Spent { ops, engine, reference })
    };
    let mut fails = |c: &CaseOutput<Answers>| judge::signature(&judge.requests(c));
    let describe = explore::Describe { items: "requests", key: "requests", len: &|s: &RequestScript| s.requests.len() };
    let explored = explore::explore_with(
        budget,
        &label,
        &mut generate,
        &mut run,
        &mut fails,
        &explore::shrink_requests,
        &describe,
    );
    if explored.findings.is_empty() {
        return vec![judge.explored_clean(budget.seed, explored.summary)];
    }
    explored
        .findings
        .iter()
        .map(|f| {
            let mut row = judge.requests(&f.case);
            row.notes.extend(f.notes.iter().cloned());
            row
        })
        .collect()
}

/// A request script as case `name`, on a fresh server of the cell's path (so nothing an earlier
/// script left in its cache decides this one).
#[allow(clippy::too_many_arguments)]
fn scripted_case<'a>(
    o: &OpenaiSpec,
    prompts: &[Prompt],
    script: &RequestScript,
    name: &str,
    judge: &Judge,
    start: &dyn Fn(&str) -> Result<ServerPath<'a>, String>,
    answer: &mut AnswerAlone,
    max_tokens: usize,
) -> CaseOutput<Answers> {
    match start(judge.cell.scenario.name()) {
        Ok(mut server) => {
            let case = requests::run_script(script, prompts, max_tokens, o.stream_logprobs, &mut server, answer, name);
            server.stop();
            case
        }
        Err(why) => {
            let why = format!("path `{}` did not start: {why}", judge.cell.path);
            let measured = Answers::unsent(0);
            CaseOutput::new(name, &Prompt { name: "*".into(), ids: Vec::new() }, measured, Outcome::NotRun(why))
        }
    }
}

/// `<dir>/<checkpoint>__<label>__<path>.log`, every part reduced to a safe file name, so a
/// suite cannot make parity write outside its reports folder.
fn log_file(dir: &Path, checkpoint: &str, label: &str, path: &str) -> PathBuf {
    let clean = |s: &str| -> String {
        s.chars().map(|c| if c.is_ascii_alphanumeric() || "-_".contains(c) { c } else { '_' }).collect()
    };
    dir.join(format!("{}__{}__{}.log", clean(checkpoint), clean(label), clean(path)))
}
