//! A checkpoint on an OpenAI-compatible server: the protocol the seed bugs were found with,
//! made a `parity run`. The reference path's server answers every prompt alone (one request
//! at a time); then, for each scenario x path, a fresh server runs the scenario's schedules
//! and every measured request is compared with its reference on what the API returned. One
//! server is alive at a time, and each is killed when its unit ends (or on any exit).

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::time::Instant;

use super::client::{Client, Completion};
use super::plan::{self, Inputs, Planned, Schedule, Start};
use super::server::{self, Places, Server};
use super::{Checkpoint, rows};
use crate::compare::Verdict;
use crate::engine::EngineId;
use crate::report::{CheckpointReport, CheckpointStatus, Phase, Row};
use crate::run::{Progress, RunOptions, Unit, blanket_rows, empty_row, encode, selected};
use crate::scenario::{Prompt, Scenario};

/// Answers to prompts sent alone on the reference path, by prompt ids.
pub type References = HashMap<Vec<u32>, Result<Completion, String>>;

pub(crate) fn run_checkpoint(
    cx: &Checkpoint,
    units: &[Unit],
    opts: &RunOptions,
    progress: &dyn Progress,
    report: &mut CheckpointReport,
) -> Vec<Row> {
    let (spec, o) = (cx.spec, cx.openai);
    report.max_logprob_delta_tolerance = Some(spec.tolerance.max_logprob_delta);
    report.bitwise = spec.tolerance.bitwise;
    report.engine = Some(EngineId { kind: "openai".into(), name: o.name.clone(), version: String::new() });
    report.reference_path = Some(o.reference.clone());
    report.noise_floor.clear();
    if !opts.faults.is_empty() {
        // parity can plant faults only in its own runtime: a selftest through a server would
        // "catch" nothing and prove nothing.
        let why = format!("engine {} (kind openai) cannot plant faults", o.name);
        return blanket_rows(cx.suite, spec, units, opts, Verdict::Skipped, &why);
    }

    // Prompts, encoded once; one that cannot be fails its own rows only.
    let mut prompts: BTreeMap<usize, Result<Prompt, String>> = BTreeMap::new();
    for u in units {
        for &p in &u.prompts {
            prompts.entry(p).or_insert_with(|| {
                let vocab = cx.tokenizer.vocab_size();
                encode(&cx.suite.prompts[p], cx.tokenizer, cx.config, vocab, spec.settings.max_tokens)
                    .map_err(|e| e.to_string())
            });
        }
    }
    report.prompt_ids = crate::run::encoded_ids(&prompts);
    let good: Vec<Prompt> = prompts.values().filter_map(|p| p.as_ref().ok().cloned()).collect();

    // References: the base prompts first (the prefix scenario continues after their answers),
    // then every other prompt a schedule measures.
    let t = Instant::now();
    let mut reference = match start(cx, &o.reference, "reference", opts) {
        Ok(s) => s,
        Err(why) => {
            let why = format!("reference path `{}` did not start: {why}", o.reference);
            report.status = CheckpointStatus::Error;
            report.reason = Some(why.clone());
            return blanket_rows(cx.suite, spec, units, opts, Verdict::Error, &why);
        }
    };
    let mut references = References::new();
    let base: Vec<Vec<u32>> = good.iter().map(|p| p.ids.clone()).collect();
    compute_references(cx, &mut reference, &base, &mut references);
    let mut schedules: BTreeMap<(Scenario, String, Vec<usize>), Vec<Schedule>> = BTreeMap::new();
    for u in units {
        let key = (u.scenario, u.path.clone(), u.prompts.clone());
        if schedules.contains_key(&key) {
            continue;
        }
        let mine: Vec<Prompt> = u.prompts.iter().filter_map(|p| prompts[p].as_ref().ok().cloned()).collect();
        let tokens = |ids: &[u32]| references.get(ids).and_then(|r| r.as_ref().ok()).map(|c| c.trace.tokens.clone());
        let inputs = Inputs { settings: &spec.settings, stream_logprobs: o.stream_logprobs, reference_tokens: &tokens };
        let mut planned = plan::plan(u.scenario, &mine, &inputs);
        // Under --filter, only schedules with a selected row are sent (and their references).
        planned.retain(|s| {
            s.rows
                .iter()
                .any(|r| selected(opts, &empty_row(spec, &r.prompt, u.scenario, &r.case, &u.path, Verdict::Identical)))
        });
        schedules.insert(key, planned);
    }
    let mut more: Vec<Vec<u32>> = Vec::new();
    for s in schedules.values().flatten() {
        for r in &s.rows {
            more.extend(r.measured.iter().map(|&m| s.requests[m].ids.clone()));
        }
    }
    compute_references(cx, &mut reference, &more, &mut references);
    if let Some(fp) = references.values().find_map(|r| r.as_ref().ok()?.fingerprint.clone()) {
        report.reference_engine = Some(EngineId { kind: "openai".into(), name: o.name.clone(), version: fp });
    }
    reference.stop();
    report.phases.push(Phase { name: "reference".into(), seconds: t.elapsed().as_secs_f64() });

    let mut out = Vec::new();
    for u in units {
        let label = format!("{} {}", u.scenario.name(), u.path);
        progress.unit(&label);
        let t = Instant::now();
        for &p in &u.prompts {
            if let Err(why) = &prompts[&p] {
                let mut row = empty_row(spec, &cx.suite.prompts[p].name, u.scenario, "*", &u.path, Verdict::Error);
                row.failure = Some(why.clone());
                if selected(opts, &row) {
                    out.push(row);
                }
            }
        }
        let planned = &schedules[&(u.scenario, u.path.clone(), u.prompts.clone())];
        let first = out.len();
        if !planned.is_empty() {
            out.extend(run_unit(cx, u, planned, &references, opts, report));
        }
        report.phases.push(Phase { name: label, seconds: t.elapsed().as_secs_f64() });
        progress.unit_done(&out[first..]);
    }
    if let Some(e) = report.engine.as_mut()
        && let Some(r) = &report.reference_engine
    {
        e.version = r.version.clone();
    }
    out
}

/// Start a path's server, its log named after the checkpoint, the unit and the path.
fn start(cx: &Checkpoint, path: &str, unit: &str, opts: &RunOptions) -> Result<Server, String> {
    let p = cx.openai.path(path).ok_or_else(|| format!("no path `{path}`"))?;
    let log = opts.server_logs.as_ref().map(|d| log_file(d, &cx.spec.name, unit, path));
    let places = Places { checkpoint: cx.dir, suite_dir: &cx.suite.dir(), log };
    Server::start(cx.openai, p, &places)
}

/// `<dir>/<checkpoint>__<unit>__<path>.log`, every part reduced to a safe file name, so a
/// suite cannot make parity write outside its reports folder.
pub fn log_file(dir: &std::path::Path, checkpoint: &str, unit: &str, path: &str) -> PathBuf {
    let clean = |s: &str| -> String {
        s.chars().map(|c| if c.is_ascii_alphanumeric() || "-_".contains(c) { c } else { '_' }).collect()
    };
    dir.join(format!("{}__{}__{}.log", clean(checkpoint), clean(unit), clean(path)))
}

fn client<'a>(cx: &'a Checkpoint, server: &Server, path: &'a str) -> Option<Client<'a>> {
    Some(Client {
        agent: server::agent(cx.openai.timeout),
        base: server.base.clone(),
        spec: cx.openai,
        path: cx.openai.path(path)?,
        tokenizer: cx.tokenizer,
    })
}

/// Each prompt not yet answered, sent alone on the reference server.
fn compute_references(cx: &Checkpoint, server: &mut Server, prompts: &[Vec<u32>], out: &mut References) {
    let Some(c) = client(cx, server, &cx.openai.reference) else { return };
    for ids in prompts {
        if out.contains_key(ids) {
            continue;
        }
        let alone =
            Planned { ids: ids.clone(), max_tokens: cx.spec.settings.max_tokens, start: Start::Now, stream: false };
        let answer = super::exec::run(&c, &[alone]).remove(0).map_err(|e| match server.ended_after_failure() {
            Some(how) => format!("{e}; the reference server {how}"),
            None => e.to_string(),
        });
        out.insert(ids.clone(), answer);
    }
}

/// One scenario on one path: a fresh server, its schedules in order, a row per row plan.
fn run_unit(
    cx: &Checkpoint,
    u: &Unit,
    planned: &[Schedule],
    references: &References,
    opts: &RunOptions,
    report: &mut CheckpointReport,
) -> Vec<Row> {
    let spec = cx.spec;
    let error_rows = |why: &str| -> Vec<Row> {
        planned
            .iter()
            .flat_map(|s| &s.rows)
            .map(|r| {
                let mut row = empty_row(spec, &r.prompt, u.scenario, &r.case, &u.path, Verdict::Error);
                row.failure = Some(why.to_string());
                row.notes = r.notes.clone();
                row
            })
            .collect()
    };
    let mut server = match start(cx, &u.path, u.scenario.name(), opts) {
        Ok(s) => s,
        Err(why) => return error_rows(&format!("path `{}` did not start: {why}", u.path)),
    };
    report.phases.push(Phase { name: format!("start {}", u.path), seconds: server.age() });
    let Some(c) = client(cx, &server, &u.path) else { return error_rows("no such path") };
    let mut out = Vec::new();
    let mut dead: Option<String> = None;
    for s in planned {
        if let Some(why) = &dead {
            out.extend(s.rows.iter().map(|r| {
                let mut row = empty_row(spec, &r.prompt, u.scenario, &r.case, &u.path, Verdict::Error);
                row.failure = Some(format!("not run: the server {why}"));
                row
            }));
            continue;
        }
        let answers = super::exec::run(&c, &s.requests);
        let ended = if answers.iter().any(|a| a.is_err()) { server.ended_after_failure() } else { None };
        for r in &s.rows {
            out.push(rows::row(cx, u, s, r, &answers, references, ended.as_deref()));
        }
        dead = ended;
    }
    server.stop();
    out
}
