//! `[engine] kind = "openai"`: the suite's server, its paths and what every request carries,
//! with the same file:line:column errors as the rest of the suite.

use serde_json::{Map, Value};
use toml::Spanned;

use super::raw::{RawEngine, RawPath};
use super::{Ctx, SuiteError, expand_env};
use crate::vocab::{
    EngineSpec, OpenaiPath, OpenaiSpec, Pinned, PromptForm, REQUEST_LEVEL, RESERVED_FIELDS, STEP_LEVEL, Scenario,
    ScriptSpec, ServerSpec,
};

pub(super) fn parse(cx: &Ctx, raw: &Spanned<RawEngine>) -> Result<EngineSpec, SuiteError> {
    let e = raw.get_ref();
    let server = match (&e.command, &e.url) {
        (Some(c), None) => {
            if c.get_ref().is_empty() || c.get_ref()[0].is_empty() {
                return Err(cx.err(c.span(), "engine.command: give the program and its arguments"));
            }
            if !c.get_ref().iter().any(|a| a.contains("{port}")) {
                return Err(
                    cx.err(c.span(), "engine.command: pass `{port}` (parity picks a free loopback port per server)")
                );
            }
            let model = match &e.model {
                Some(m) => {
                    Some(expand_env(m.get_ref()).map_err(|msg| cx.err(m.span(), format!("engine.model: {msg}")))?)
                }
                None => None,
            };
            ServerSpec::Command { argv: c.get_ref().clone(), model }
        }
        (None, Some(u)) => {
            if let Some(m) = &e.model {
                return Err(cx.err(m.span(), "engine.model: a `url` server is already running; nothing is started"));
            }
            ServerSpec::Url(loopback_url(u.get_ref()).map_err(|m| cx.err(u.span(), format!("engine.url: {m}")))?)
        }
        _ => {
            return Err(cx.err(
                raw.span(),
                "engine: kind = \"openai\" needs exactly one of `command` (a server to start) or `url` (one running)",
            ));
        }
    };
    let raw_paths = e.paths.as_ref().ok_or_else(|| {
        cx.err(
            raw.span(),
            "engine: kind = \"openai\" needs [engine.paths] (name = [extra arguments] or {args, request})",
        )
    })?;
    if raw_paths.get_ref().0.is_empty() {
        return Err(cx.err(raw_paths.span(), "engine.paths: name at least one path"));
    }
    let mut paths = Vec::new();
    for (name, p) in &raw_paths.get_ref().0 {
        let here = |why: String| cx.err(raw_paths.span(), format!("engine.paths.{name}: {why}"));
        // A path name is part of report ids and server log names: one plain component, checked
        // as every other name that becomes a file name is.
        crate::names::check_component(name)
            .map_err(|why| cx.err(raw_paths.span(), format!("engine.paths: `{}` {why}", name.escape_debug())))?;
        let (args, request) = match p {
            RawPath::Args(a) => (a.clone(), serde_json::Map::new()),
            RawPath::Table { args, request } => (args.clone(), request_fields(request).map_err(here)?),
        };
        if matches!(server, ServerSpec::Url(_)) && !args.is_empty() {
            return Err(here("a `url` server is already running: a path can only differ by `request` fields".into()));
        }
        paths.push(OpenaiPath { name: name.clone(), args, request });
    }
    let reference = match &e.reference {
        None => paths[0].name.clone(),
        Some(r) if paths.iter().any(|p| &p.name == r.get_ref()) => r.get_ref().clone(),
        Some(r) => {
            let names: Vec<&str> = paths.iter().map(|p| p.name.as_str()).collect();
            return Err(cx.err(
                r.span(),
                format!(
                    "engine.reference: `{}` is not a path of this engine ({}); an openai engine is compared with one of its own paths",
                    r.get_ref(),
                    names.join(", ")
                ),
            ));
        }
    };
    let ready = match &e.ready {
        Some(r) if !r.get_ref().starts_with('/') => {
            return Err(cx.err(r.span(), "engine.ready: a path on the server, starting with `/` (e.g. /health)"));
        }
        Some(r) => r.get_ref().clone(),
        None => "/health".to_string(),
    };
    let metrics = match &e.metrics {
        Some(m) if !m.get_ref().starts_with('/') => {
            return Err(cx.err(m.span(), "engine.metrics: a path on the server, starting with `/` (e.g. /metrics)"));
        }
        m => m.as_ref().map(|m| m.get_ref().clone()),
    };
    let top_logprobs = match &e.top_logprobs {
        Some(k) if !(1..=1000).contains(k.get_ref()) => {
            return Err(cx.err(k.span(), format!("engine.top_logprobs: {} must be in 1..=1000", k.get_ref())));
        }
        Some(k) => *k.get_ref() as usize,
        None => 5,
    };
    let prompt = match &e.prompt {
        Some(p) => PromptForm::parse(p.get_ref()).map_err(|m| cx.err(p.span(), format!("engine.prompt: {m}")))?,
        None => PromptForm::Text,
    };
    let request = match &e.request {
        Some(r) => request_fields(r.get_ref()).map_err(|m| cx.err(r.span(), format!("engine.request: {m}")))?,
        None => serde_json::Map::new(),
    };
    Ok(EngineSpec::Openai(OpenaiSpec {
        name: e.name.clone().unwrap_or_else(|| "openai".to_string()),
        server,
        paths,
        reference,
        ready,
        metrics,
        timeout: cx.seconds("engine.timeout", &e.timeout, 300.0)?,
        start_timeout: cx.seconds("engine.start_timeout", &e.start_timeout, 300.0)?,
        top_logprobs,
        stream_logprobs: e.stream_logprobs.unwrap_or(false),
        prompt,
        request,
    }))
}

/// The scenarios a checkpoint runs on its engine. kind = "openai" sends whole requests, so
/// only the request-level scenarios exist for it (and they are its default); the step-level
/// engines cannot run `lengths` or `repeat`. `written` is the list as the suite wrote it (for
/// the error's position), `None` when the default applies.
pub(super) fn scenarios_for(
    cx: &Ctx,
    engine: &EngineSpec,
    scenarios: Vec<Scenario>,
    written: Option<&Vec<Spanned<String>>>,
    checkpoint: std::ops::Range<usize>,
    scripts: &[ScriptSpec],
) -> Result<Vec<Scenario>, SuiteError> {
    let openai = matches!(engine, EngineSpec::Openai(_));
    // Pinned scripts of this engine's kind: a server's are requests, a stepped engine's ops.
    let pinned = scripts.iter().any(|s| matches!(s.script, Pinned::Requests(_)) == openai);
    let mut scenarios = match written {
        None if openai => REQUEST_LEVEL.to_vec(),
        None => scenarios.into_iter().filter(|&s| s != Scenario::Script).collect(),
        Some(_) => scenarios,
    };
    if written.is_none() && pinned {
        scenarios.push(Scenario::Script);
    }
    let allowed: Vec<Scenario> =
        if openai { REQUEST_LEVEL } else { STEP_LEVEL }.iter().copied().chain([Scenario::Script]).collect();
    // Run only where a suite names them: a corpus is read token by token (on a server, one
    // request a position over its prompt cache); a stepped `repeat` runs the concurrent
    // schedule twice (a server's is one of its defaults).
    let allowed: Vec<Scenario> = allowed.into_iter().chain([Scenario::Corpus, Scenario::Repeat]).collect();
    if let Some(i) = scenarios.iter().position(|&s| s == Scenario::Script).filter(|_| !pinned) {
        let span = written.and_then(|w| w.get(i)).map(|w| w.span()).unwrap_or(checkpoint.clone());
        let kind = if openai { "`requests` (a server's)" } else { "`ops` (a stepped engine's)" };
        return Err(cx.err(span, format!("scenario `script`: the suite pins no {kind} scripts for this engine")));
    }
    for (i, s) in scenarios.iter().enumerate() {
        if !allowed.contains(s) {
            let span = written.and_then(|w| w.get(i)).map(|w| w.span()).unwrap_or(checkpoint);
            let names: Vec<&str> = allowed.iter().map(|s| s.name()).collect();
            let what = if openai {
                "kind = \"openai\" sends whole requests and cannot step an engine"
            } else {
                "it is a request-level scenario (kind = \"openai\" only)"
            };
            return Err(cx.err(span, format!("scenario `{}`: {what}; this engine runs {}", s.name(), names.join(", "))));
        }
    }
    Ok(scenarios)
}

/// The first key set that only kind = "openai" reads, with its span.
pub(super) fn openai_only_key(raw: &Spanned<RawEngine>) -> Option<(&'static str, std::ops::Range<usize>)> {
    let e = raw.get_ref();
    let span = |s: &Option<Spanned<String>>| s.as_ref().map(|v| v.span());
    [
        ("url", span(&e.url)),
        ("ready", span(&e.ready)),
        ("prompt", span(&e.prompt)),
        ("top_logprobs", e.top_logprobs.as_ref().map(|v| v.span())),
        ("request", e.request.as_ref().map(|v| v.span())),
        ("name", e.name.as_ref().map(|_| raw.span())),
        ("stream_logprobs", e.stream_logprobs.map(|_| raw.span())),
        ("metrics", span(&e.metrics)),
    ]
    .into_iter()
    .find_map(|(k, s)| s.map(|s| (k, s)))
}

/// A TOML table of request fields as JSON, refusing the fields parity owns.
fn request_fields(table: &toml::Table) -> Result<Map<String, Value>, String> {
    if let Some(k) = table.keys().find(|k| RESERVED_FIELDS.contains(&k.as_str())) {
        return Err(format!("`{k}` is set by parity on every request and cannot be overridden"));
    }
    match serde_json::to_value(table) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err("request fields must be a table".into()),
        Err(e) => Err(format!("cannot express as JSON: {e}")),
    }
}

/// Accept only `http://` URLs to a loopback host (`127.0.0.1`, `[::1]`, `localhost`): parity
/// never sends a prompt off the machine. Returns the URL without a trailing slash.
pub fn loopback_url(url: &str) -> Result<String, String> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| format!("`{url}`: only http:// to a loopback host (127.0.0.1, [::1], localhost) is allowed"))?;
    let authority = rest.split('/').next().unwrap_or(rest);
    if authority.contains('@') {
        return Err(format!("`{url}`: credentials in a URL are not accepted"));
    }
    let host = if let Some(v6) = authority.strip_prefix('[') {
        v6.split(']').next().map(|h| format!("[{h}]")).unwrap_or_default()
    } else {
        authority.split(':').next().unwrap_or(authority).to_string()
    };
    if !matches!(host.as_str(), "127.0.0.1" | "[::1]" | "localhost") {
        return Err(format!(
            "`{url}`: host `{host}` is not loopback; parity only contacts 127.0.0.1, [::1] or localhost"
        ));
    }
    Ok(url.trim_end_matches('/').to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_urls_are_accepted() {
        assert_eq!(loopback_url("http://127.0.0.1:8080/").as_deref(), Ok("http://127.0.0.1:8080"));
        assert!(loopback_url("http://localhost:1").is_ok());
        assert!(loopback_url("http://[::1]:8080").is_ok());
        for bad in [
            "http://10.0.0.1:8080",
            "https://127.0.0.1:8080",
            "http://example.com",
            "http://127.0.0.1.example.com:80",
            "http://user@127.0.0.1:80",
            "http://[::2]:80",
            "127.0.0.1:8080",
        ] {
            assert!(loopback_url(bad).is_err(), "{bad} was accepted");
        }
    }

    #[test]
    fn parity_owned_request_fields_are_refused() {
        let t: toml::Table = toml::from_str("seed = 0\ncache_prompt = false").expect("toml");
        let m = request_fields(&t).expect("fields");
        assert_eq!(m.get("seed"), Some(&Value::from(0)));
        let t: toml::Table = toml::from_str("temperature = 1.0").expect("toml");
        assert!(request_fields(&t).unwrap_err().contains("temperature"));
    }
}
