//! One completion request over the OpenAI-compatible API (`POST /v1/completions`), plain or
//! streamed (server-sent events), and what came back: per step the server's top-k logprobs,
//! the text, the usage counts.
//!
//! Quirks handled here (verified on mlx_lm.server 0.32.2): `top_logprobs` entries are not
//! sorted, and the entry presented as the chosen token is the first of them, not necessarily
//! the token generated. parity therefore sorts each step's list itself and takes its most
//! probable token as the greedy choice (the request is temperature 0); the presented token is
//! kept only to report how often it disagrees. Streamed chunks may carry no logprobs at all
//! (mlx_lm.server), so only a server that returns them (`stream_logprobs`) has its streamed
//! requests measured.

use std::io::{BufRead, BufReader};
use std::time::Instant;

use serde_json::{Map, Value, json};

use crate::checkpoint::Tokenizer;
use crate::vocab::{LogprobTrace, OpenaiPath, OpenaiSpec, PromptForm};

/// Why a request gave nothing to compare: each is a clear error on the rows it affects.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum RequestError {
    #[error("HTTP {status} from the server: {body}")]
    Status { status: u16, body: String },
    #[error("request failed: {0}")]
    Transport(String),
    #[error("malformed response: {0}")]
    Malformed(String),
    #[error("no logprobs in the response ({0}); the server must return top_logprobs for every generated token")]
    NoLogprobs(String),
}

/// What one request returned.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Completion {
    /// Per step: the top-k sorted most probable first; `tokens` are their first entries.
    pub trace: LogprobTrace,
    /// Per step, the token the server presented as chosen (where it said).
    pub presented: Vec<Option<u32>>,
    pub text: String,
    pub prompt_tokens: Option<usize>,
    pub cached_tokens: Option<usize>,
    pub finish_reason: Option<String>,
    /// `system_fingerprint`: the server's build, as reports record the engine's version.
    pub fingerprint: Option<String>,
    /// Wall time of the exchange, and the part of it parity spent (encoding, parsing).
    pub seconds: f64,
    pub parity_seconds: f64,
}

/// A path's view of its server: where it is and what every request carries.
pub struct Client<'a> {
    pub agent: ureq::Agent,
    pub base: String,
    pub spec: &'a OpenaiSpec,
    pub path: &'a OpenaiPath,
    pub tokenizer: &'a Tokenizer,
}

impl Client<'_> {
    /// The request body: greedy, `max_tokens`, logprobs asked for, then the suite's and the
    /// path's own fields.
    pub fn body(&self, ids: &[u32], max_tokens: usize, stream: bool) -> Result<Value, RequestError> {
        let prompt = match self.spec.prompt {
            PromptForm::Ids => json!(ids),
            PromptForm::Text => json!(self.tokenizer.decode(ids).map_err(|e| RequestError::Transport(e.to_string()))?),
        };
        let mut body = Map::new();
        body.insert("prompt".into(), prompt);
        body.insert("max_tokens".into(), json!(max_tokens));
        body.insert("temperature".into(), json!(0.0));
        body.insert("logprobs".into(), json!(true));
        body.insert("top_logprobs".into(), json!(self.spec.top_logprobs));
        body.insert("stream".into(), json!(stream));
        if stream {
            body.insert("stream_options".into(), json!({"include_usage": true}));
        }
        for (k, v) in self.spec.request.iter().chain(&self.path.request) {
            body.insert(k.clone(), v.clone());
        }
        Ok(Value::Object(body))
    }

    /// Send one request. `on_token` is called with the number of tokens streamed so far (a
    /// streamed request is the clock later arrivals wait on).
    pub fn complete(
        &self,
        ids: &[u32],
        max_tokens: usize,
        stream: bool,
        on_token: &mut dyn FnMut(usize),
    ) -> Result<Completion, RequestError> {
        let t0 = Instant::now();
        let body = self.body(ids, max_tokens, stream)?.to_string();
        let mut parity = t0.elapsed().as_secs_f64();
        let url = format!("{}/v1/completions", self.base);
        let mut resp = self
            .agent
            .post(&url)
            .header("content-type", "application/json")
            .send(body.as_bytes())
            .map_err(|e| RequestError::Transport(e.to_string()))?;
        let status = resp.status().as_u16();
        let mut acc = Accum::default();
        if status != 200 || !stream {
            let text = resp
                .body_mut()
                .with_config()
                .limit(64 << 20)
                .read_to_string()
                .map_err(|e| RequestError::Transport(format!("reading the response: {e}")))?;
            if status != 200 {
                return Err(RequestError::Status { status, body: excerpt(&text) });
            }
            let t = Instant::now();
            let v: Value = serde_json::from_str(&text)
                .map_err(|e| RequestError::Malformed(format!("not JSON ({e}): {}", excerpt(&text))))?;
            acc.absorb(&v, self.tokenizer)?;
            parity += t.elapsed().as_secs_f64();
        } else {
            let reader = BufReader::new(resp.body_mut().as_reader());
            for line in reader.lines() {
                let line = line.map_err(|e| RequestError::Transport(format!("reading the stream: {e}")))?;
                // SSE: `data: {...}` events; comments (`: keepalive`) and blank lines skipped.
                let Some(data) = line.strip_prefix("data:").map(str::trim) else { continue };
                if data == "[DONE]" {
                    break;
                }
                let t = Instant::now();
                let v: Value = serde_json::from_str(data).map_err(|e| {
                    RequestError::Malformed(format!("stream event is not JSON ({e}): {}", excerpt(data)))
                })?;
                let before = (acc.entries.len(), acc.chunks);
                acc.absorb(&v, self.tokenizer)?;
                parity += t.elapsed().as_secs_f64();
                if (acc.entries.len(), acc.chunks) != before {
                    // Tokens streamed so far: logprob entries when the server streams them,
                    // else text chunks (one per token once the text is printable).
                    on_token(acc.entries.len().max(acc.chunks));
                }
            }
        }
        let t = Instant::now();
        let mut c = acc.finish(stream)?;
        c.parity_seconds = parity + t.elapsed().as_secs_f64();
        c.seconds = t0.elapsed().as_secs_f64();
        Ok(c)
    }
}

impl Client<'_> {
    /// GET the server's Prometheus text at `at` and read its samples.
    pub fn metrics(&self, at: &str) -> Result<super::Metrics, String> {
        let url = format!("{}{at}", self.base);
        let mut resp = self.agent.get(&url).call().map_err(|e| format!("GET {at}: {e}"))?;
        let text = resp
            .body_mut()
            .with_config()
            .limit(16 << 20)
            .read_to_string()
            .map_err(|e| format!("GET {at}: reading the response: {e}"))?;
        Ok(prometheus(&text))
    }
}

/// Prometheus text exposition: `name{labels} value [timestamp]` per line, `#` lines comments.
/// Samples of one name are summed over their label sets; lines that do not parse are passed
/// over (a counter a path must move is then absent, which the judge says).
fn prometheus(text: &str) -> super::Metrics {
    let mut out = super::Metrics::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
        let (name, rest) = match line.find(['{', ' ']) {
            Some(i) if line.as_bytes()[i] == b'{' => match line[i..].find('}') {
                Some(j) => (&line[..i], &line[i + j + 1..]),
                None => continue,
            },
            Some(i) => (&line[..i], &line[i..]),
            None => continue,
        };
        if let Some(v) = rest.split_whitespace().next().and_then(|v| v.parse::<f64>().ok()) {
            *out.entry(name.to_string()).or_insert(0.0) += v;
        }
    }
    out
}

/// One step as the server returned it: its top-k `(token, logprob)` sorted most probable
/// first, and the token the API presented as chosen (if it could be read).
type Entry = (Vec<(u32, f64)>, Option<u32>);

/// What the response (or the stream so far) said.
#[derive(Default)]
struct Accum {
    entries: Vec<Entry>,
    text: String,
    chunks: usize,
    prompt_tokens: Option<usize>,
    cached_tokens: Option<usize>,
    finish_reason: Option<String>,
    fingerprint: Option<String>,
}

impl Accum {
    /// Take in one response object or stream event.
    fn absorb(&mut self, v: &Value, tok: &Tokenizer) -> Result<(), RequestError> {
        if let Some(err) = v.get("error") {
            return Err(RequestError::Malformed(format!(
                "the server reported an error: {}",
                excerpt(&err.to_string())
            )));
        }
        if let Some(f) = v.get("system_fingerprint").and_then(Value::as_str) {
            self.fingerprint = Some(f.to_string());
        }
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            self.prompt_tokens = u.get("prompt_tokens").and_then(Value::as_u64).map(|n| n as usize);
            self.cached_tokens =
                u.pointer("/prompt_tokens_details/cached_tokens").and_then(Value::as_u64).map(|n| n as usize);
        }
        // llama.cpp's own account, where a build reports no usage details: prompt tokens
        // taken from the slot's cache.
        if self.cached_tokens.is_none()
            && let Some(n) = v.pointer("/timings/cache_n").and_then(Value::as_u64)
        {
            self.cached_tokens = Some(n as usize);
        }
        let choices = v
            .get("choices")
            .and_then(Value::as_array)
            .ok_or_else(|| RequestError::Malformed(format!("no `choices` array: {}", excerpt(&v.to_string()))))?;
        // The usage event of a stream has no choices.
        let Some(choice) = choices.first() else { return Ok(()) };
        if let Some(t) = choice.get("text").and_then(Value::as_str) {
            self.text.push_str(t);
            if !t.is_empty() {
                self.chunks += 1;
            }
        }
        if let Some(f) = choice.get("finish_reason").and_then(Value::as_str) {
            self.finish_reason = Some(f.to_string());
        }
        let Some(content) = choice.pointer("/logprobs/content").and_then(Value::as_array) else { return Ok(()) };
        for entry in content {
            let step = self.entries.len();
            let top =
                entry.get("top_logprobs").and_then(Value::as_array).filter(|t| !t.is_empty()).ok_or_else(|| {
                    RequestError::NoLogprobs(format!(
                        "step {step} has no top_logprobs: {}",
                        excerpt(&entry.to_string())
                    ))
                })?;
            let mut list = Vec::with_capacity(top.len());
            for t in top {
                let id = token_id(t, tok).map_err(|m| RequestError::Malformed(format!("step {step}: {m}")))?;
                let lp = t.get("logprob").and_then(Value::as_f64).ok_or_else(|| {
                    RequestError::Malformed(format!("step {step}: a top_logprobs entry has no number `logprob`"))
                })?;
                list.push((id, lp));
            }
            // Most probable first; among exact ties the lower id, as an argmax picks it.
            list.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            self.entries.push((list, token_id(entry, tok).ok()));
        }
        Ok(())
    }

    fn finish(self, stream: bool) -> Result<Completion, RequestError> {
        if self.entries.is_empty() {
            let how = if stream { "streamed" } else { "plain" };
            return Err(RequestError::NoLogprobs(format!("{how} response, text {:?}", excerpt(&self.text))));
        }
        let mut trace = LogprobTrace::default();
        let mut presented = Vec::new();
        for (list, shown) in self.entries {
            trace.tokens.push(list[0].0);
            trace.steps.push(list);
            presented.push(shown);
        }
        Ok(Completion {
            trace,
            presented,
            text: self.text,
            prompt_tokens: self.prompt_tokens,
            cached_tokens: self.cached_tokens,
            finish_reason: self.finish_reason,
            fingerprint: self.fingerprint,
            ..Completion::default()
        })
    }
}

/// A logprobs entry's token id: `id` where the server gives it, else its `token` string
/// mapped through parity's tokenizer of the checkpoint.
fn token_id(entry: &Value, tok: &Tokenizer) -> Result<u32, String> {
    if let Some(id) = entry.get("id").and_then(Value::as_u64) {
        return u32::try_from(id).map_err(|_| format!("token id {id} is out of range"));
    }
    let s = entry.get("token").and_then(Value::as_str).ok_or("a logprobs entry has neither `id` nor `token`")?;
    tok.token_to_id(s).ok_or_else(|| format!("token {s:?} is not in the checkpoint's tokenizer"))
}

pub fn excerpt(s: &str) -> String {
    let s = s.trim();
    if s.len() <= 300 {
        return s.to_string();
    }
    let mut cut = 300;
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{} [... {} bytes]", &s[..cut], s.len())
}

#[cfg(test)]
mod tests {
    use super::prometheus;

    /// Counters a suite names are summed over label sets; comments, timestamps and lines that
    /// do not parse do not disturb the others.
    #[test]
    fn prometheus_samples_are_summed_by_name() {
        let text = "# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.\n\
                    # TYPE llamacpp:prompt_tokens_total counter\n\
                    llamacpp:prompt_tokens_total 1234\n\
                    launches_total{kernel=\"paged\",gpu=\"0\"} 7 1700000000\n\
                    launches_total{kernel=\"dense\"} 3\n\
                    broken{unclosed 5\n\
                    nan_gauge NaN\n";
        let m = prometheus(text);
        assert_eq!(m.get("llamacpp:prompt_tokens_total"), Some(&1234.0));
        assert_eq!(m.get("launches_total"), Some(&10.0));
        assert!(!m.contains_key("broken"));
        assert!(m["nan_gauge"].is_nan());
    }
}
