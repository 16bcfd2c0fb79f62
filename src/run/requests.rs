//! A checkpoint on OpenAI-compatible servers (kind = "openai"): the protocol the seed bugs
//! were found with, made a `parity run`. The reference path's server answers every prompt
//! alone (one request at a time); then, for each cell, a fresh server runs the scenario's
//! schedules and every measured request is judged against its reference on what the API
//! returned. One server is alive at a time, and each is killed when its cell ends (or on any
//! exit).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use super::judge::Judge;
use super::{
    Cell, Progress, Resolved, RunOptions, blanket_rows, cell_row, each_cell, encode_all, encoded_ids, unencoded_rows,
};
use crate::engine::Dirs;
use crate::engine::openai::ServerPath;
use crate::report::{CheckpointReport, CheckpointStatus, Phase, Row};
use crate::scenario::requests::{self, Inputs, References, Schedule};
use crate::vocab::{EngineId, OpenaiSpec, Prompt, Scenario, Verdict};

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
    report.engine = Some(EngineId { kind: "openai".into(), name: o.name.clone(), version: String::new() });
    report.reference_path = Some(o.reference.clone());
    if !opts.faults.is_empty() {
        // parity can plant faults only in its own runtime: a selftest through a server would
        // "catch" nothing and prove nothing.
        let why = format!("engine {} (kind openai) cannot plant faults", o.name);
        return blanket_rows(suite, spec, cells, r.filter, Verdict::Skipped, &why);
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
            return blanket_rows(suite, spec, cells, r.filter, Verdict::Error, &why);
        }
    };
    let max_tokens = spec.settings.max_tokens;
    let mut references = References::new();
    let base: Vec<Vec<u32>> = good.iter().map(|p| p.ids.clone()).collect();
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
    if let Some(fp) = references.values().find_map(|a| a.as_ref().ok()?.fingerprint.clone()) {
        report.reference_engine = Some(EngineId { kind: "openai".into(), name: o.name.clone(), version: fp });
    }
    reference.stop();
    report.phases.push(Phase { name: "reference".into(), seconds: t.elapsed().as_secs_f64() });

    let rows = each_cell(cells, r.filter, progress, &mut report.phases, |cell, phases| {
        let mut rows = unencoded_rows(r, cell, &prompts);
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
    if let Some(e) = report.engine.as_mut()
        && let Some(r) = &report.reference_engine
    {
        e.version = r.version.clone();
    }
    rows
}

/// `<dir>/<checkpoint>__<label>__<path>.log`, every part reduced to a safe file name, so a
/// suite cannot make parity write outside its reports folder.
fn log_file(dir: &Path, checkpoint: &str, label: &str, path: &str) -> PathBuf {
    let clean = |s: &str| -> String {
        s.chars().map(|c| if c.is_ascii_alphanumeric() || "-_".contains(c) { c } else { '_' }).collect()
    };
    dir.join(format!("{}__{}__{}.log", clean(checkpoint), clean(label), clean(path)))
}
