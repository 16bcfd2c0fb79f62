//! `[engine] kind = "openai"` as a suite writes it: which server, how to start it per path,
//! what every request carries. Parsed by `suite.rs` (which owns spans and file:line:col
//! errors); the checks that need no span live here so they can be unit-tested.

use std::time::Duration;

use serde_json::{Map, Value};

/// The host every started server is told to bind, and the only kind of host parity contacts.
pub const LOOPBACK: &str = "127.0.0.1";

#[derive(Debug, Clone, PartialEq)]
pub struct OpenaiSpec {
    /// Engine name in reports (`mlx_lm.server`, `llama-server`).
    pub name: String,
    pub server: ServerSpec,
    /// Named configurations of the server, in the order written.
    pub paths: Vec<OpenaiPath>,
    /// The path every other is compared with.
    pub reference: String,
    /// GET this (relative to the server's root) until it answers 200: the server is ready.
    pub ready: String,
    /// Longest any one request may take.
    pub timeout: Duration,
    /// Longest from spawn to ready (model load).
    pub start_timeout: Duration,
    /// `top_logprobs` asked for on every request (as many as the server allows).
    pub top_logprobs: usize,
    /// The server returns logprobs in streamed chunks too (llama-server does, mlx_lm.server
    /// does not): the concurrent scenario's clock request is then a measured one.
    pub stream_logprobs: bool,
    /// How prompts travel.
    pub prompt: PromptForm,
    /// JSON fields added to every request (a path's own fields are added after these).
    pub request: Map<String, Value>,
}

/// Where the server comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum ServerSpec {
    /// parity starts one per checkpoint x path x scenario: an argv template (`{model}`,
    /// `{port}`, `{host}`, `{checkpoint}`, `{suite_dir}`, `{path}`), and what `{model}` is
    /// (default: the resolved checkpoint directory; `${VAR:-default}` expanded, relative to
    /// the suite).
    Command { argv: Vec<String>, model: Option<String> },
    /// A server already running (loopback only); parity starts nothing.
    Url(String),
}

#[derive(Debug, Clone, PartialEq)]
pub struct OpenaiPath {
    pub name: String,
    /// Appended to the start command.
    pub args: Vec<String>,
    /// Added to every request this path sends (e.g. `seed`, which makes mlx_lm.server serve a
    /// request on its sequential path).
    pub request: Map<String, Value>,
}

/// The prompt's form on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptForm {
    /// parity's token ids decoded to text (special tokens kept); the server tokenizes it, and
    /// `usage.prompt_tokens` is checked against parity's count.
    Text,
    /// The token ids themselves (`"prompt": [1, 2, 3]`), for servers that take them
    /// (llama-server): the server sees exactly parity's tokens.
    Ids,
}

impl PromptForm {
    pub fn parse(s: &str) -> Result<PromptForm, String> {
        match s {
            "text" => Ok(PromptForm::Text),
            "ids" => Ok(PromptForm::Ids),
            other => Err(format!("unknown prompt form `{other}`; expected text or ids")),
        }
    }
}

impl OpenaiSpec {
    pub fn path(&self, name: &str) -> Option<&OpenaiPath> {
        self.paths.iter().find(|p| p.name == name)
    }
}

/// Fields parity sets itself on every request: a suite may not override them, or the
/// comparison would silently stop being greedy or stop returning what it compares.
pub const RESERVED_FIELDS: &[&str] = &["prompt", "max_tokens", "temperature", "stream", "stream_options"];

/// A TOML table of request fields as JSON, refusing the fields parity owns.
pub fn request_fields(table: &toml::Table) -> Result<Map<String, Value>, String> {
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
