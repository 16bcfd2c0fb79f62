//! Combining the JSON reports of a sharded run (`--shard I/N` on several CI runners) into the
//! report of the whole suite.
//!
//! The result does not depend on the order the files are given in: reports are put in a
//! canonical order first (shard index, then content), and rows are then ordered by
//! checkpoint, scenario and backend, keeping each unit's own row order (a unit, a
//! (checkpoint, scenario) pair, always runs whole on one shard).
//!
//! Anything that would make the merged report claim more than was run is an error: different
//! suites, versions, environments or planted faults, a shard missing or given twice, or the
//! same row in two reports. A nightly job with a crashed shard must not merge into a pass.

use std::collections::{BTreeMap, BTreeSet};

use super::{CheckpointReport, CheckpointStatus, Phase, Report, Row, Summary};
use crate::vocab::{STEP_LEVEL, Scenario};

pub fn merge(reports: Vec<Report>) -> Result<Report, String> {
    let mut reports = reports;
    let Some(first) = reports.first() else {
        return Err("no reports to merge".into());
    };
    for r in &reports[1..] {
        same(first, r, "suite", |r| r.suite.clone())?;
        same(first, r, "schema", |r| r.schema.to_string())?;
        same(first, r, "suite file", |r| r.suite_file.clone())?;
        same(first, r, "parity version", |r| r.parity_version.clone())?;
        same(first, r, "environment", |r| format!("{:?}", r.environment))?;
        same(first, r, "planted faults", |r| r.faults.join(", "))?;
    }
    check_shards(&reports)?;
    // The canonical order: JSON as the last key makes it total, and two reports equal under it
    // are identical, so their relative order cannot show.
    let mut keyed: Vec<(usize, String, Report)> =
        reports.drain(..).map(|r| (r.shard.map_or(0, |s| s.index), r.to_json(), r)).collect();
    keyed.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
    let reports: Vec<Report> = keyed.into_iter().map(|(_, _, r)| r).collect();

    // Only across reports: whether one run may repeat an id is the runner's business.
    let mut seen: BTreeMap<(&str, &str, &str, &str, &str), usize> = BTreeMap::new();
    for (i, r) in reports.iter().enumerate() {
        for row in &r.rows {
            let key = (
                row.checkpoint.as_str(),
                row.prompt.as_str(),
                row.scenario.as_str(),
                row.case.as_str(),
                row.path.as_str(),
            );
            if *seen.entry(key).or_insert(i) != i {
                return Err(format!("row {} is in more than one report (the same run given twice?)", row.id()));
            }
        }
    }

    let order = checkpoint_order(&reports);
    let mut checkpoints: Vec<CheckpointReport> = Vec::new();
    for name in &order {
        let parts: Vec<&CheckpointReport> =
            reports.iter().flat_map(|r| &r.checkpoints).filter(|c| &c.name == name).collect();
        if let Some(c) = merge_checkpoint(&parts) {
            checkpoints.push(c);
        }
    }

    let mut rows: Vec<Row> = reports.iter().flat_map(|r| r.rows.iter().cloned()).collect();
    rows.sort_by_key(|r| {
        let c = order.iter().position(|n| *n == r.checkpoint).unwrap_or(usize::MAX);
        (c, scenario_rank(&r.scenario), path_rank(&r.path))
    });

    let mut summary = Summary::of(&rows);
    let changes: BTreeSet<&String> = reports.iter().flat_map(|r| &r.summary.snapshot_changes).collect();
    summary.snapshot_changes = changes.into_iter().cloned().collect();
    let new: BTreeSet<&String> = reports.iter().flat_map(|r| &r.summary.snapshot_new).collect();
    summary.snapshot_new = new.into_iter().cloned().collect();
    summary.seconds = reports.iter().fold(0.0, |t, r| t + r.summary.seconds);

    let base = &reports[0];
    Ok(Report {
        schema: base.schema,
        suite: base.suite.clone(),
        suite_file: base.suite_file.clone(),
        parity_version: base.parity_version.clone(),
        parity_commit: base.parity_commit.clone(),
        environment: base.environment.clone(),
        shard: None,
        faults: base.faults.clone(),
        checkpoints,
        rows,
        summary,
    })
}

fn same(a: &Report, b: &Report, what: &str, f: impl Fn(&Report) -> String) -> Result<(), String> {
    let (x, y) = (f(a), f(b));
    if x == y { Ok(()) } else { Err(format!("cannot merge reports with different {what}: `{x}` and `{y}`")) }
}

/// Either every report is a shard of the same split and together they are all of it, or
/// none is a shard (runs split by hand with `--filter`; duplicates are caught per row).
fn check_shards(reports: &[Report]) -> Result<(), String> {
    // Shards of one run come from one build: a merge across commits would report a
    // regression that no single build has.
    if let Some(other) = reports.iter().find(|r| r.parity_commit != reports[0].parity_commit) {
        return Err(format!(
            "cannot merge reports of different builds: parity {} and {}",
            reports[0].parity_commit, other.parity_commit
        ));
    }
    let shards: Vec<_> = reports.iter().filter_map(|r| r.shard).collect();
    if shards.is_empty() {
        return Ok(());
    }
    if shards.len() != reports.len() {
        return Err("cannot merge shard reports with unsharded ones".into());
    }
    let count = shards[0].count;
    let mut have = BTreeSet::new();
    for s in &shards {
        if s.count != count {
            return Err(format!(
                "cannot merge shards of different splits: {}/{} and {}/{count}",
                s.index, s.count, shards[0].index
            ));
        }
        if !have.insert(s.index) {
            return Err(format!("shard {}/{count} given twice", s.index));
        }
    }
    let missing: Vec<String> = (1..=count).filter(|i| !have.contains(i)).map(|i| format!("{i}/{count}")).collect();
    if missing.is_empty() { Ok(()) } else { Err(format!("missing shard report(s): {}", missing.join(", "))) }
}

/// Each report lists its checkpoints in suite order; a name not seen yet goes right after its
/// predecessor in the report that has it, which recovers the suite order whenever the shards
/// overlap enough to tell.
fn checkpoint_order(reports: &[Report]) -> Vec<String> {
    let mut order: Vec<String> = Vec::new();
    let names = |r: &Report| -> Vec<String> {
        let mut v: Vec<String> = r.checkpoints.iter().map(|c| c.name.clone()).collect();
        for row in &r.rows {
            if !v.contains(&row.checkpoint) {
                v.push(row.checkpoint.clone());
            }
        }
        v
    };
    for r in reports {
        let mut after: Option<usize> = None;
        for name in names(r) {
            let at = match order.iter().position(|n| *n == name) {
                Some(i) => i,
                None => {
                    let i = after.map_or(0, |a| a + 1);
                    order.insert(i, name);
                    i
                }
            };
            after = Some(at);
        }
    }
    order
}

/// One checkpoint seen by several shards. Status is the worst (ran < skipped < error): a
/// checkpoint missing on one runner leaves rows unjudged, and the merged report must say so.
/// The reason comes from a report with that status; resolved path and dtype from one that
/// ran (a skipped checkpoint only knows the suite's dtype). Phases with the same name (each
/// shard loads the model and computes references) are summed, as total work. Noise floors
/// are the largest per prompt: the spread of correct runs is at least what any shard saw.
fn merge_checkpoint(parts: &[&CheckpointReport]) -> Option<CheckpointReport> {
    let rank = |s: CheckpointStatus| match s {
        CheckpointStatus::Ran => 0,
        CheckpointStatus::Skipped => 1,
        CheckpointStatus::Error => 2,
    };
    let ran = parts.iter().find(|c| c.status == CheckpointStatus::Ran);
    let worst = parts.iter().max_by_key(|c| rank(c.status))?;
    let worst = parts.iter().find(|c| c.status == worst.status)?;
    let mut out = (*ran.unwrap_or(worst)).clone();
    out.status = worst.status;
    out.reason = worst.reason.clone();

    let mut phases: Vec<Phase> = Vec::new();
    let mut floors: BTreeMap<String, Option<f32>> = BTreeMap::new();
    for c in parts {
        for p in &c.phases {
            match phases.iter_mut().find(|q| q.name == p.name) {
                Some(q) => q.seconds += p.seconds,
                None => phases.push(p.clone()),
            }
        }
        for (prompt, ids) in &c.prompt_ids {
            out.prompt_ids.entry(prompt.clone()).or_insert_with(|| ids.clone());
        }
        for (prompt, f) in &c.noise_floor {
            let e = floors.entry(prompt.clone()).or_insert(None);
            *e = match (*e, *f) {
                (Some(a), Some(b)) => Some(a.max(b)),
                (a, b) => a.or(b),
            };
        }
    }
    out.phases = phases;
    out.noise_floor = floors;
    Some(out)
}

/// Scenarios in the order `parity` defines them; unknown names after, together.
fn scenario_rank(name: &str) -> usize {
    Scenario::parse(name).and_then(|s| STEP_LEVEL.iter().position(|x| *x == s)).unwrap_or(STEP_LEVEL.len())
}

fn path_rank(name: &str) -> usize {
    ["dense", "paged"].iter().position(|b| *b == name).unwrap_or(2)
}
