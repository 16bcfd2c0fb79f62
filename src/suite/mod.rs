//! The suite parser: TOML files (checkpoints, prompts, scenarios and their settings, dtype and
//! tolerances, with suite-level defaults and per-checkpoint overrides) into the checked
//! [`Suite`] of `crate::vocab`.
//!
//! Every mistake is reported with file, line and column before anything runs: unknown keys and
//! wrong types by the TOML deserializer, semantic checks (positive sizes, tile a multiple of
//! 8, known scenario names) against the span of the offending value.
//!
//! Suites are untrusted input (fuzzed: see `fuzz/`). Names become file names, so they must be
//! plain file-name components ([`crate::names`]); sizes have an upper bound, so no value can
//! make a run allocate without limit; settings that would make a scenario test nothing are
//! errors ([`crate::vocab::audit`]).

use std::path::{Path, PathBuf};

mod check;
mod openai;
mod raw;

pub use check::MAX_COUNT;
use check::{Ctx, SettingSpans};
pub use openai::loopback_url;

use raw::RawSuite;

use crate::dtype::DtypeSetting;
use crate::vocab::{
    self, CheckpointSpec, EngineSpec, PromptSource, PromptSpec, Scenario, Settings, Suite, default_tolerance,
};

#[derive(Debug, Clone, PartialEq)]
pub struct SuiteError {
    pub file: PathBuf,
    pub line: usize,
    pub column: usize,
    pub message: String,
}

impl std::fmt::Display for SuiteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}:{}: {}", self.file.display(), self.line, self.column, self.message)
    }
}

impl std::error::Error for SuiteError {}

pub fn load(file: &Path) -> Result<Suite, SuiteError> {
    let text = std::fs::read_to_string(file).map_err(|e| SuiteError {
        file: file.to_path_buf(),
        line: 0,
        column: 0,
        message: format!("cannot read: {e}"),
    })?;
    parse(file, &text)
}

pub fn parse(file: &Path, text: &str) -> Result<Suite, SuiteError> {
    let cx = Ctx { file, text };
    let raw: RawSuite = toml::from_str(text).map_err(|e| {
        let span = e.span().unwrap_or(0..0);
        cx.err(span, e.message().to_string())
    })?;

    let suite_dtype = raw.dtype.as_ref().map(|d| cx.dtype(d)).transpose()?.unwrap_or(DtypeSetting::Float32);
    let suite_engine = match &raw.engine {
        Some(e) => cx.engine(e)?,
        None => EngineSpec::Builtin { reference: crate::vocab::BuiltinRef::DENSE },
    };
    let suite_witness = cx.witness(raw.engine.as_ref(), &suite_engine)?;
    let mut suite_settings = Settings::default();
    let mut suite_spans = SettingSpans::new();
    if let Some(p) = &raw.settings {
        cx.apply(p, &mut suite_settings, &mut suite_spans)?;
    }
    let name = match &raw.name {
        Some(n) => {
            cx.file_name("suite name", n.get_ref(), n.span())?;
            n.get_ref().clone()
        }
        None => {
            let stem = file.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
            cx.file_name("suite name (from the file name; set `name`)", &stem, 0..0)?;
            stem
        }
    };

    if raw.prompts.is_empty() {
        return Err(cx.err(0..0, "no [[prompts]]: a suite needs at least one prompt"));
    }
    let mut prompts: Vec<PromptSpec> = Vec::new();
    for p in &raw.prompts {
        let span = p.span();
        let p = p.get_ref();
        let name = p.name.get_ref().clone();
        cx.file_name("prompt name", &name, p.name.span())?;
        if prompts.iter().any(|q| q.name == name) {
            return Err(cx.err(p.name.span(), format!("prompt `{name}` is defined twice")));
        }
        let source = match (&p.text, &p.chat, &p.ids, &p.file) {
            (Some(t), None, None, None) => PromptSource::Text(t.clone()),
            (None, Some(c), None, None) => PromptSource::Chat(c.clone()),
            (None, None, Some(ids), None) if !ids.is_empty() => PromptSource::Ids(ids.clone()),
            (None, None, None, Some(f)) if !f.get_ref().is_empty() => {
                let dir = file.parent().unwrap_or(std::path::Path::new("."));
                PromptSource::File(dir.join(f.get_ref()))
            }
            _ => {
                return Err(
                    cx.err(span, format!("prompt `{name}`: give exactly one of text, chat, ids or file (non-empty)"))
                );
            }
        };
        let length = cx.positive("length", &p.length, false)?;
        prompts.push(PromptSpec { name, source, length });
    }

    let scripts = cx.scripts(&raw.scripts, &prompts)?;
    // Pinned scripts run by default wherever the suite names no scenarios.
    let suite_scenarios = match &raw.scenarios {
        Some(s) => cx.scenarios(s)?,
        None if scripts.is_empty() => vocab::STEP_LEVEL.to_vec(),
        None => vocab::STEP_LEVEL.iter().copied().chain([Scenario::Script]).collect(),
    };
    if let Some(list) = &raw.scenarios {
        cx.scripts_named(list, &scripts)?;
    }

    if raw.checkpoints.is_empty() {
        return Err(cx.err(0..0, "no [[checkpoints]]: a suite needs at least one checkpoint"));
    }
    let mut checkpoints: Vec<CheckpointSpec> = Vec::new();
    for c in &raw.checkpoints {
        let span = c.span();
        let c = c.get_ref();
        let reference = match (&c.path, &c.repo) {
            (Some(p), None) => expand_env(p.get_ref()).map_err(|m| cx.err(p.span(), format!("path: {m}")))?,
            (None, Some(r)) => r.get_ref().clone(),
            _ => return Err(cx.err(span, "checkpoint: give exactly one of path or repo")),
        };
        let name = match &c.name {
            Some(n) => {
                cx.file_name("checkpoint name", n.get_ref(), n.span())?;
                n.get_ref().clone()
            }
            None => {
                let name = default_name(&reference);
                let at = c.path.as_ref().or(c.repo.as_ref()).map(|v| v.span()).unwrap_or(span.clone());
                cx.file_name("checkpoint name (from its path or repo; set `name`)", &name, at)?;
                name
            }
        };
        if checkpoints.iter().any(|k| k.name == name) {
            return Err(cx.err(span, format!("checkpoint name `{name}` is used twice; set `name`")));
        }
        let dtype = match &c.dtype {
            Some(d) => cx.dtype(d)?,
            None => suite_dtype,
        };
        let mut settings = suite_settings.clone();
        let mut spans = suite_spans.clone();
        if let Some(p) = &c.settings {
            cx.apply(p, &mut settings, &mut spans)?;
        }
        let mut tolerance = default_tolerance(dtype);
        cx.tolerance(&raw.tolerance, &mut tolerance)?;
        cx.tolerance(&c.tolerance, &mut tolerance)?;
        let prompt_names = match &c.prompts {
            Some(list) => {
                let mut names = Vec::new();
                for n in list {
                    if !prompts.iter().any(|p| &p.name == n.get_ref()) {
                        return Err(cx.err(n.span(), format!("unknown prompt `{}`", n.get_ref())));
                    }
                    names.push(n.get_ref().clone());
                }
                names
            }
            None => prompts.iter().map(|p| p.name.clone()).collect(),
        };
        let engine = match &c.engine {
            Some(e) => cx.engine(e)?,
            None => suite_engine.clone(),
        };
        // The suite's `[engine.witness]` holds for every checkpoint's paths of the same name
        // (a checkpoint's own engine table may add to it or override a path).
        let mut witness = suite_witness.clone();
        witness.retain(|path, _| engine.known_paths().contains(path));
        witness.extend(cx.witness(c.engine.as_ref(), &engine)?);
        let paths = match c.backends.as_ref().or(raw.backends.as_ref()) {
            Some(b) => cx.paths(b, &engine)?,
            None => engine.path_names(),
        };
        if let Some(list) = &c.scenarios {
            cx.scripts_named(list, &scripts)?;
        }
        let scenarios = match (&c.scenarios, &raw.scenarios) {
            (Some(s), _) => openai::scenarios_for(&cx, &engine, cx.scenarios(s)?, Some(s), span.clone(), &scripts)?,
            (None, Some(s)) => {
                openai::scenarios_for(&cx, &engine, suite_scenarios.clone(), Some(s), span.clone(), &scripts)?
            }
            (None, None) => openai::scenarios_for(&cx, &engine, suite_scenarios.clone(), None, span.clone(), &scripts)?,
        };
        let spec = CheckpointSpec {
            name,
            reference,
            dtype,
            dequantize: c.dequantize.or(raw.dequantize).unwrap_or(false),
            engine,
            paths,
            scenarios,
            settings,
            tolerance,
            prompts: prompt_names,
            witness,
            no_snapshot: match &c.no_snapshot {
                Some(w) if w.get_ref().trim().is_empty() => {
                    return Err(cx.err(w.span(), "no_snapshot: say why this checkpoint's rows are not snapshotted"));
                }
                Some(w) => Some(w.get_ref().trim().to_string()),
                None => None,
            },
        };
        cx.audit(&spec, &prompts, &spans, span)?;
        checkpoints.push(spec);
    }

    Ok(Suite { name, file: file.to_path_buf(), prompts, checkpoints, scripts })
}

/// A checkpoint's report name from its reference: the last path component or the repo name,
/// without a `.toml` extension.
fn default_name(reference: &str) -> String {
    let last = reference.trim_end_matches('/').rsplit('/').next().unwrap_or(reference);
    last.strip_suffix(".toml").unwrap_or(last).to_string()
}

/// `${VAR}` and `${VAR:-default}` in checkpoint paths, so a suite can point at a machine's
/// own copy of a model without editing the file.
pub fn expand_env(s: &str) -> Result<String, String> {
    let mut out = String::new();
    let mut rest = s;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let end = after.find('}').ok_or_else(|| format!("unterminated `${{` in `{s}`"))?;
        let inner = &after[..end];
        let (var, default) = match inner.split_once(":-") {
            Some((v, d)) => (v, Some(d)),
            None => (inner, None),
        };
        match (std::env::var(var).ok().filter(|v| !v.is_empty()), default) {
            (Some(v), _) => out.push_str(&v),
            (None, Some(d)) => out.push_str(d),
            (None, None) => {
                return Err(format!(
                    "environment variable {var} is not set (write ${{{var}:-default}} for a fallback)"
                ));
            }
        }
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// 1-based line and column of a byte offset. An offset inside a multi-byte character counts
/// from that character's start (TOML error spans are not guaranteed to fall on a boundary).
fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let mut end = offset.min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let before = &text[..end];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map(|l| l.chars().count()).unwrap_or(0) + 1;
    (line, column)
}
