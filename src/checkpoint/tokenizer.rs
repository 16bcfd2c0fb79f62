//! tokenizer.json through the `tokenizers` crate, and chat prompts rendered with the
//! checkpoint's own chat template (`chat_template.jinja`, else `tokenizer_config.json`).

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::{Error, Result};

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    pub file: PathBuf,
    pub chat_template: Option<ChatTemplate>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
}

pub struct ChatTemplate {
    pub source: String,
    pub file: PathBuf,
}

impl Tokenizer {
    pub fn load(dir: &Path) -> Result<Self> {
        let file = dir.join("tokenizer.json");
        if !file.is_file() {
            return Err(Error::Tokenizer { file, message: "missing".into() });
        }
        let inner = tokenizers::Tokenizer::from_file(&file)
            .map_err(|e| Error::Tokenizer { file: file.clone(), message: format!("cannot load: {e}") })?;
        let config_file = dir.join("tokenizer_config.json");
        let config: Option<Value> =
            if config_file.is_file() {
                let text = std::fs::read_to_string(&config_file).map_err(|e| Error::io(&config_file, e))?;
                Some(serde_json::from_str(&text).map_err(|e| Error::Tokenizer {
                    file: config_file.clone(),
                    message: format!("not valid JSON: {e}"),
                })?)
            } else {
                None
            };
        let token_field = |name: &str| -> Option<String> {
            let v = config.as_ref()?.get(name)?;
            v.as_str().map(str::to_string).or_else(|| v.get("content")?.as_str().map(str::to_string))
        };
        let jinja = dir.join("chat_template.jinja");
        let chat_template = if jinja.is_file() {
            let source = std::fs::read_to_string(&jinja).map_err(|e| Error::io(&jinja, e))?;
            Some(ChatTemplate { source, file: jinja })
        } else {
            match config.as_ref().and_then(|c| c.get("chat_template")) {
                Some(Value::String(s)) => Some(ChatTemplate { source: s.clone(), file: config_file.clone() }),
                // A list of named templates: the one called "default".
                Some(Value::Array(items)) => items
                    .iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                    .and_then(|t| t.get("template")?.as_str())
                    .map(|s| ChatTemplate { source: s.to_string(), file: config_file.clone() }),
                _ => None,
            }
        };
        Ok(Tokenizer {
            inner,
            file,
            chat_template,
            bos_token: token_field("bos_token"),
            eos_token: token_field("eos_token"),
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Raw text: special tokens added as the tokenizer's post-processor says (as mlx-lm does).
    pub fn encode_raw(&self, text: &str) -> Result<Vec<u32>> {
        self.encode(text, true)
    }

    /// A single-turn chat prompt with the generation prompt appended, rendered by the
    /// checkpoint's template and encoded without adding special tokens again.
    pub fn encode_chat(&self, user: &str) -> Result<Vec<u32>> {
        let text = self.render_chat(user)?;
        self.encode(&text, false)
    }

    pub fn render_chat(&self, user: &str) -> Result<String> {
        let tpl = self.chat_template.as_ref().ok_or_else(|| Error::Tokenizer {
            file: self.file.clone(),
            message: "no chat template (chat_template.jinja or tokenizer_config.json `chat_template`)".into(),
        })?;
        let mut env = minijinja::Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        // No `strftime_now`: Llama 3.1+ templates then use their fixed fallback date instead of
        // today's, so a prompt encodes to the same tokens every day (stable snapshots).
        env.add_template("chat", &tpl.source).map_err(|e| Error::Tokenizer {
            file: tpl.file.clone(),
            message: format!("chat template does not parse: {e}"),
        })?;
        let ctx = minijinja::context! {
            messages => vec![minijinja::context! { role => "user", content => user }],
            add_generation_prompt => true,
            bos_token => self.bos_token.clone().unwrap_or_default(),
            eos_token => self.eos_token.clone().unwrap_or_default(),
        };
        env.get_template("chat")
            .and_then(|t| t.render(ctx))
            .map_err(|e| Error::Tokenizer { file: tpl.file.clone(), message: format!("chat template failed: {e}") })
    }

    fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, add_special)
            .map_err(|e| Error::Tokenizer { file: self.file.clone(), message: format!("encode failed: {e}") })?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, false)
            .map_err(|e| Error::Tokenizer { file: self.file.clone(), message: format!("decode failed: {e}") })
    }

    /// As a server prints generated text: special tokens (`<|im_start|>`) left out.
    pub fn decode_without_special(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| Error::Tokenizer { file: self.file.clone(), message: format!("decode failed: {e}") })
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }
}
