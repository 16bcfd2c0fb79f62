//! The checks a suite passes before anything runs: each turns a raw value into a checked one
//! or a [`SuiteError`] at the value's line and column (positive sizes under [`MAX_COUNT`],
//! names that are file-name components, known scenarios, paths and dtypes, settings that test
//! something).

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;

use toml::Spanned;

use super::raw::{RawEngine, RawPath, RawScript, SettingsPatch, TolerancePatch};
use super::{SuiteError, line_col, openai};
use crate::dtype::DtypeSetting;
use crate::vocab::{
    BuiltinRef, CLAIMS, CheckpointSpec, EngineSpec, Op, Pinned, ProcessSpec, PromptSource, PromptSpec, REQUIREMENTS,
    ReferenceSpec, RequestPrompt, RequestScript, Scenario, Script, ScriptSpec, Settings, Tolerance, Verdict, Witness,
};

pub(super) struct Ctx<'a> {
    pub(super) file: &'a Path,
    pub(super) text: &'a str,
}

/// Largest count any size, length or step setting may hold: beyond any context parity can run,
/// and small enough that no value in a suite can make a run allocate without bound.
pub const MAX_COUNT: usize = 1 << 24;

/// Where each effective setting was written (suite level or checkpoint override), so a check
/// that involves several settings can point at the one the suite actually set.
pub(super) type SettingSpans = BTreeMap<&'static str, Range<usize>>;

impl Ctx<'_> {
    pub(super) fn err(&self, span: std::ops::Range<usize>, message: impl Into<String>) -> SuiteError {
        let (line, column) = line_col(self.text, span.start);
        SuiteError { file: self.file.to_path_buf(), line, column, message: message.into() }
    }

    pub(super) fn positive(
        &self,
        key: &str,
        v: &Option<Spanned<i64>>,
        allow_zero: bool,
    ) -> Result<Option<usize>, SuiteError> {
        let Some(v) = v else { return Ok(None) };
        let n = *v.get_ref();
        if n < 0 || (n == 0 && !allow_zero) {
            let what = if allow_zero { "must not be negative" } else { "must be positive" };
            return Err(self.err(v.span(), format!("{key}: {n} {what}")));
        }
        if n as u64 > MAX_COUNT as u64 {
            return Err(self.err(v.span(), format!("{key}: {n} is larger than the limit of {MAX_COUNT}")));
        }
        Ok(Some(n as usize))
    }

    /// A name that becomes (part of) a file name: one plain component, or an error at `span`.
    pub(super) fn file_name(&self, what: &str, name: &str, span: Range<usize>) -> Result<(), SuiteError> {
        crate::names::check_component(name).map_err(|why| {
            self.err(span, format!("{what} `{}` {why}: names become report file names", name.escape_debug()))
        })
    }

    pub(super) fn apply(
        &self,
        p: &SettingsPatch,
        s: &mut Settings,
        spans: &mut SettingSpans,
    ) -> Result<(), SuiteError> {
        let mut set = |dst: &mut usize, key: &'static str, v: &Option<Spanned<i64>>, zero: bool| {
            if let Some(n) = self.positive(key, v, zero)? {
                *dst = n;
                spans.insert(key, v.as_ref().map(|v| v.span()).unwrap_or(0..0));
            }
            Ok::<(), SuiteError>(())
        };
        set(&mut s.max_tokens, "settings.max_tokens", &p.max_tokens, false)?;
        set(&mut s.block_size, "settings.block_size", &p.block_size, false)?;
        set(&mut s.tile, "settings.tile", &p.tile, false)?;
        if let Some(t) = &p.tile
            && *t.get_ref() % 8 != 0
        {
            return Err(self.err(t.span(), format!("settings.tile: {} is not a multiple of 8", t.get_ref())));
        }
        set(&mut s.chunk, "settings.chunk", &p.chunk, false)?;
        set(&mut s.lookahead, "settings.lookahead", &p.lookahead, true)?;
        set(&mut s.rollback_every, "settings.rollback_every", &p.rollback_every, false)?;
        set(&mut s.corpus_tokens, "settings.corpus_tokens", &p.corpus_tokens, false)?;
        if let Some(b) = p.poison {
            s.poison = b;
        }
        if let Some(c) = &p.concurrent {
            set(&mut s.concurrent.requests, "settings.concurrent.requests", &c.requests, false)?;
            set(&mut s.concurrent.max_batch, "settings.concurrent.max_batch", &c.max_batch, false)?;
            if let Some(a) = &c.arrivals {
                if a.get_ref().is_empty() || a.get_ref().iter().any(|&x| x < 0 || x as u64 > MAX_COUNT as u64) {
                    return Err(self.err(
                        a.span(),
                        format!("settings.concurrent.arrivals: needs at least one step, each from 0 to {MAX_COUNT}"),
                    ));
                }
                s.concurrent.arrivals = a.get_ref().iter().map(|&x| x as usize).collect();
                spans.insert("settings.concurrent.arrivals", a.span());
            }
        }
        if let Some(n) = self.positive("settings.pool_blocks", &p.pool_blocks, false)? {
            s.pool_blocks = Some(n);
            spans.insert("settings.pool_blocks", p.pool_blocks.as_ref().map(|v| v.span()).unwrap_or(0..0));
        }
        if let Some(l) = &p.lengths {
            // Each length is a prompt sent to the server: bounded like every other count.
            if l.get_ref().is_empty() || l.get_ref().iter().any(|&x| x <= 0 || x as u64 > MAX_COUNT as u64) {
                return Err(self.err(
                    l.span(),
                    format!("settings.lengths: needs at least one length, each from 1 to {MAX_COUNT}"),
                ));
            }
            s.lengths = Some(l.get_ref().iter().map(|&x| x as usize).collect());
            spans.insert("settings.lengths", l.span());
        }
        Ok(())
    }

    /// Settings that make one of the checkpoint's scenarios test nothing (see
    /// [`crate::vocab::audit`]), reported at the first involved setting the suite wrote, else at
    /// the checkpoint.
    pub(super) fn audit(
        &self,
        c: &CheckpointSpec,
        prompts: &[PromptSpec],
        spans: &SettingSpans,
        fallback: Range<usize>,
    ) -> Result<(), SuiteError> {
        // Lengths are known before any tokenizer runs when every prompt fixes its length.
        let lengths: Option<Vec<usize>> = prompts
            .iter()
            .filter(|p| c.prompts.contains(&p.name))
            .map(|p| match (&p.length, &p.source) {
                (Some(n), _) => Some(*n),
                (None, PromptSource::Ids(ids)) => Some(ids.len()),
                _ => None,
            })
            .collect();
        let problems = c.settings_problems(lengths.as_deref());
        match problems.into_iter().next() {
            None => Ok(()),
            Some(p) => {
                let span = p.keys.iter().find_map(|k| spans.get(k).cloned()).unwrap_or(fallback);
                Err(self.err(span, format!("{} (checkpoint `{}`)", p.message, c.name)))
            }
        }
    }

    pub(super) fn tolerance(&self, p: &Option<TolerancePatch>, t: &mut Tolerance) -> Result<(), SuiteError> {
        let Some(p) = p else { return Ok(()) };
        if let Some(v) = &p.max_rel_rms {
            let x = *v.get_ref();
            if !(x.is_finite() && x >= 0.0) {
                return Err(self.err(v.span(), format!("tolerance.max_rel_rms: {x} must be a non-negative number")));
            }
            t.max_rel_rms = x as f32;
        }
        if let Some(v) = &p.max_logprob_delta {
            let x = *v.get_ref();
            if !(x.is_finite() && x >= 0.0) {
                return Err(
                    self.err(v.span(), format!("tolerance.max_logprob_delta: {x} must be a non-negative number"))
                );
            }
            t.max_logprob_delta = x as f32;
        }
        if let Some(b) = p.bitwise {
            t.bitwise = b;
        }
        let d = &mut t.distribution;
        let bounds = [
            ("kl_mean", &p.kl_mean, &mut d.kl_mean, f64::INFINITY),
            ("kl_p99", &p.kl_p99, &mut d.kl_p99, f64::INFINITY),
            ("kl_max", &p.kl_max, &mut d.kl_max, f64::INFINITY),
            ("dp_rms", &p.dp_rms, &mut d.dp_rms, 1.0),
            ("top1_agree", &p.top1_agree, &mut d.top1_agree, 1.0),
            ("topk_overlap", &p.topk_overlap, &mut d.topk_overlap, 1.0),
        ];
        for (key, v, dst, most) in bounds {
            if let Some(v) = v {
                let x = *v.get_ref();
                if !(x.is_finite() && (0.0..=most).contains(&x)) {
                    let range = if most.is_finite() { format!("from 0 to {most}") } else { "non-negative".into() };
                    return Err(self.err(v.span(), format!("tolerance.{key}: {x} must be a number {range}")));
                }
                *dst = Some(x);
            }
        }
        if let Some(strict) = p.strict {
            let vacuous = t.allow.contains(&Verdict::Vacuous);
            t.allow = if strict { vec![Verdict::Identical] } else { vec![Verdict::Identical, Verdict::NearTie] };
            if vacuous {
                t.allow.push(Verdict::Vacuous);
            }
        }
        if let Some(vacuous) = p.vacuous {
            t.allow.retain(|&v| v != Verdict::Vacuous);
            if vacuous {
                t.allow.push(Verdict::Vacuous);
            }
        }
        Ok(())
    }

    pub(super) fn dtype(&self, v: &Spanned<String>) -> Result<DtypeSetting, SuiteError> {
        v.get_ref().parse().map_err(|e: String| self.err(v.span(), format!("dtype: {e}")))
    }

    pub(super) fn scenarios(&self, list: &[Spanned<String>]) -> Result<Vec<Scenario>, SuiteError> {
        list.iter()
            .map(|s| {
                Scenario::parse(s.get_ref()).ok_or_else(|| {
                    let known = Scenario::known_names();
                    self.err(s.span(), format!("unknown scenario `{}`; known: {}", s.get_ref(), known.join(", ")))
                })
            })
            .collect()
    }

    /// Path names a checkpoint runs: each must be a path of its engine, none twice.
    pub(super) fn paths(&self, list: &[Spanned<String>], engine: &EngineSpec) -> Result<Vec<String>, SuiteError> {
        let known = engine.known_paths();
        let mut out: Vec<String> = Vec::new();
        for b in list {
            let name = b.get_ref();
            if !known.contains(name) {
                return Err(self.err(b.span(), format!("unknown path `{name}`; this engine has {}", known.join(", "))));
            }
            if out.contains(name) {
                return Err(self.err(b.span(), format!("path `{name}` is listed twice")));
            }
            out.push(name.clone());
        }
        Ok(out)
    }

    /// `[engine.witness.PATH]` of the engine a checkpoint runs on: each path one of the
    /// engine's, each claim and requirement one parity knows, counters only where the engine
    /// has a metrics endpoint to read them from.
    pub(super) fn witness(
        &self,
        raw: Option<&Spanned<RawEngine>>,
        engine: &EngineSpec,
    ) -> Result<BTreeMap<String, Witness>, SuiteError> {
        let mut out = BTreeMap::new();
        let Some(table) = raw.and_then(|r| r.get_ref().witness.as_ref()) else { return Ok(out) };
        let known = engine.known_paths();
        let metrics = matches!(engine, EngineSpec::Openai(o) if o.metrics.is_some());
        for (path, w) in table.get_ref() {
            let at = w.span();
            if !known.contains(path) {
                return Err(self.err(
                    table.span(),
                    format!("engine.witness.{path}: not a path of this engine ({})", known.join(", ")),
                ));
            }
            let w = w.get_ref();
            let mut spec = Witness::default();
            for (claim, why) in w.waive.iter().flat_map(|t| t.get_ref()) {
                if !CLAIMS.contains(&claim.as_str()) {
                    return Err(self.err(
                        w.waive.as_ref().map_or(at.clone(), |t| t.span()),
                        format!("engine.witness.{path}.waive: unknown claim `{claim}` ({})", CLAIMS.join(", ")),
                    ));
                }
                if why.get_ref().trim().is_empty() {
                    return Err(self.err(
                        why.span(),
                        format!("engine.witness.{path}.waive.{claim}: say why the path does not show it"),
                    ));
                }
                spec.waive.insert(claim.clone(), why.get_ref().clone());
            }
            for r in w.require.iter().flatten() {
                if !REQUIREMENTS.contains(&r.get_ref().as_str()) {
                    return Err(self.err(
                        r.span(),
                        format!(
                            "engine.witness.{path}.require: unknown evidence `{}` ({})",
                            r.get_ref(),
                            REQUIREMENTS.join(", ")
                        ),
                    ));
                }
                spec.require.push(r.get_ref().clone());
            }
            for (key, list, into) in [("moves", &w.moves, &mut spec.moves), ("still", &w.still, &mut spec.still)] {
                for m in list.iter().flatten() {
                    if !metrics {
                        return Err(self.err(
                            m.span(),
                            format!(
                                "engine.witness.{path}.{key}: counters are read from the server's metrics \
                                 endpoint; set engine.metrics (kind = \"openai\")"
                            ),
                        ));
                    }
                    let name = m.get_ref();
                    if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || "_:".contains(c)) {
                        return Err(self.err(
                            m.span(),
                            format!("engine.witness.{path}.{key}: `{name}` is not a Prometheus metric name"),
                        ));
                    }
                    into.push(name.clone());
                }
            }
            out.insert(path.clone(), spec);
        }
        Ok(out)
    }

    pub(super) fn engine(&self, raw: &Spanned<RawEngine>) -> Result<EngineSpec, SuiteError> {
        let e = raw.get_ref();
        let only_process = |what: &str, span: std::ops::Range<usize>| {
            self.err(span, format!("engine.{what} is only for kind = \"process\""))
        };
        let kind = e.kind.get_ref().as_str();
        if kind != "openai"
            && let Some((key, span)) = openai::openai_only_key(raw)
        {
            return Err(self.err(span, format!("engine.{key} is only for kind = \"openai\"")));
        }
        match kind {
            "openai" => openai::parse(self, raw),
            "builtin" => {
                if let Some(c) = &e.command {
                    return Err(only_process("command", c.span()));
                }
                if let Some(m) = &e.model {
                    return Err(self.err(
                        m.span(),
                        "engine.model: the builtin runs the checkpoint itself (kind = \"process\" or \"openai\" take a model file)",
                    ));
                }
                if let Some(p) = &e.paths {
                    return Err(only_process("paths", p.span()));
                }
                // A builtin engine's paths are parity's own, so its reference can only be one of
                // them too: in process (`builtin:paged`) or on a named device
                // (`builtin:dense@cpu`), which is what device parity is spelled as.
                let reference = match &e.reference {
                    None => BuiltinRef::DENSE,
                    Some(r) => match ReferenceSpec::parse_builtin(r.get_ref()) {
                        Some(Ok(b)) => b,
                        None => {
                            return Err(self.err(
                                r.span(),
                                format!(
                                    "engine.reference: `{}` is not a builtin reference; a builtin engine is compared with one of {}",
                                    r.get_ref(),
                                    ReferenceSpec::builtin_spellings()
                                ),
                            ));
                        }
                        Some(Err(m)) => {
                            return Err(self.err(r.span(), format!("engine.reference: `{}`: {m}", r.get_ref())));
                        }
                    },
                };
                Ok(EngineSpec::Builtin { reference })
            }
            "process" => {
                let command = e
                    .command
                    .as_ref()
                    .ok_or_else(|| self.err(raw.span(), "engine: kind = \"process\" needs `command` (an argv list)"))?;
                if command.get_ref().is_empty() || command.get_ref()[0].is_empty() {
                    return Err(self.err(command.span(), "engine.command: give the program and its arguments"));
                }
                let paths = e.paths.as_ref().ok_or_else(|| {
                    self.err(raw.span(), "engine: kind = \"process\" needs [engine.paths] (name = [extra arguments])")
                })?;
                if paths.get_ref().0.is_empty() {
                    return Err(self.err(paths.span(), "engine.paths: name at least one path"));
                }
                // A path name is part of report ids and file names: one plain component.
                for (name, _) in &paths.get_ref().0 {
                    if let Err(why) = crate::names::check_component(name) {
                        return Err(self.err(paths.span(), format!("engine.paths: `{name}` {why}")));
                    }
                }
                let names: Vec<&str> = paths.get_ref().0.iter().map(|(n, _)| n.as_str()).collect();
                let mut args = Vec::new();
                for (name, p) in &paths.get_ref().0 {
                    match p {
                        RawPath::Args(a) => args.push((name.clone(), a.clone())),
                        RawPath::Table { .. } => {
                            return Err(self.err(
                                paths.span(),
                                format!("engine.paths.{name}: kind = \"process\" takes a list of extra arguments"),
                            ));
                        }
                    }
                }
                let reference = match &e.reference {
                    None => ReferenceSpec::Path(names[0].to_string()),
                    Some(r) => match ReferenceSpec::parse_builtin(r.get_ref()) {
                        Some(parsed) => ReferenceSpec::Builtin(
                            parsed
                                .map_err(|m| self.err(r.span(), format!("engine.reference: `{}`: {m}", r.get_ref())))?,
                        ),
                        None if names.contains(&r.get_ref().as_str()) => ReferenceSpec::Path(r.get_ref().clone()),
                        None => {
                            return Err(self.err(
                                r.span(),
                                format!(
                                    "engine.reference: `{}` is not a path of this engine ({}) nor {}",
                                    r.get_ref(),
                                    names.join(", "),
                                    ReferenceSpec::builtin_spellings()
                                ),
                            ));
                        }
                    },
                };
                let model = match &e.model {
                    Some(m) => Some(
                        super::expand_env(m.get_ref())
                            .map_err(|msg| self.err(m.span(), format!("engine.model: {msg}")))?,
                    ),
                    None => None,
                };
                Ok(EngineSpec::Process(ProcessSpec {
                    command: command.get_ref().clone(),
                    model,
                    paths: args,
                    reference,
                    timeout: self.seconds("engine.timeout", &e.timeout, 120.0)?,
                    start_timeout: self.seconds("engine.start_timeout", &e.start_timeout, 300.0)?,
                }))
            }
            other => Err(self.err(
                e.kind.span(),
                format!("engine.kind: unknown kind `{other}`; expected builtin, process or openai"),
            )),
        }
    }

    /// The pinned scripts: names that become row ids (one plain component, none twice), ops or
    /// requests that parse, prompts the suite has.
    pub(super) fn scripts(
        &self,
        raw: &[Spanned<RawScript>],
        prompts: &[PromptSpec],
    ) -> Result<Vec<ScriptSpec>, SuiteError> {
        let mut out: Vec<ScriptSpec> = Vec::new();
        for s in raw {
            let span = s.span();
            let s = s.get_ref();
            let name = s.name.get_ref();
            self.file_name("script name", name, s.name.span())?;
            if out.iter().any(|o| &o.name == name) {
                return Err(self.err(s.name.span(), format!("script `{name}` is defined twice")));
            }
            let known = |p: &str, at: Range<usize>| -> Result<(), SuiteError> {
                if prompts.iter().any(|q| q.name == p) {
                    Ok(())
                } else {
                    Err(self.err(at, format!("script `{name}`: unknown prompt `{p}`")))
                }
            };
            let script = match (&s.ops, &s.requests) {
                (Some(ops), None) => {
                    let script: Script = ops
                        .get_ref()
                        .parse()
                        .map_err(|e: String| self.err(ops.span(), format!("script `{name}`: {e}")))?;
                    for op in &script.ops {
                        match op {
                            Op::Create { stream, .. } => known(&stream.prompt, ops.span())?,
                            Op::Share { then, .. } => known(&then.prompt, ops.span())?,
                            _ => {}
                        }
                    }
                    if !script.ops.iter().any(|op| matches!(op, Op::Create { .. })) {
                        return Err(
                            self.err(ops.span(), format!("script `{name}` creates no sequence, so it tests nothing"))
                        );
                    }
                    Pinned::Steps(script)
                }
                (None, Some(requests)) => {
                    let script: RequestScript = requests
                        .get_ref()
                        .parse()
                        .map_err(|e: String| self.err(requests.span(), format!("script `{name}`: {e}")))?;
                    for r in &script.requests {
                        match &r.prompt {
                            RequestPrompt::Prompt(p) | RequestPrompt::Extends { then: Some(p), .. } => {
                                known(&p.prompt, requests.span())?
                            }
                            _ => {}
                        }
                    }
                    Pinned::Requests(script)
                }
                _ => {
                    return Err(self.err(
                        span,
                        format!(
                            "script `{name}`: give exactly one of `ops` (a stepped engine) or `requests` (a server)"
                        ),
                    ));
                }
            };
            out.push(ScriptSpec { name: name.clone(), script });
        }
        Ok(out)
    }

    /// A scenario list naming `script` where the suite pins none tests nothing.
    pub(super) fn scripts_named(&self, list: &[Spanned<String>], scripts: &[ScriptSpec]) -> Result<(), SuiteError> {
        match list.iter().find(|s| s.get_ref() == Scenario::Script.name()) {
            Some(s) if scripts.is_empty() => {
                Err(self.err(s.span(), "scenario `script` runs the suite's [[scripts]], and it has none"))
            }
            _ => Ok(()),
        }
    }

    pub(super) fn seconds(
        &self,
        key: &str,
        v: &Option<Spanned<f64>>,
        default: f64,
    ) -> Result<std::time::Duration, SuiteError> {
        let Some(v) = v else { return Ok(std::time::Duration::from_secs_f64(default)) };
        let x = *v.get_ref();
        if !(x.is_finite() && x > 0.0 && x <= 86_400.0) {
            return Err(self.err(v.span(), format!("{key}: {x} must be a number of seconds in (0, 86400]")));
        }
        Ok(std::time::Duration::from_secs_f64(x))
    }
}
