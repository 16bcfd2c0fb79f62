//! The real Qwen3 and Llama 3 chat templates (from ../shared/tokenizers) render through
//! minijinja the way transformers renders them.

use crate::common;

use parity::checkpoint::Tokenizer;

#[test]
fn qwen3_template_renders_a_single_user_turn() {
    let t = Tokenizer::load(&common::shared().join("tokenizers/qwen3")).unwrap();
    let text = t.render_chat("What is the capital of France?").unwrap();
    assert_eq!(text, "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n");
    let ids = t.encode_chat("What is the capital of France?").unwrap();
    assert_eq!(ids.first(), t.token_to_id("<|im_start|>").as_ref());
}

#[test]
fn llama3_template_renders_one_bos_and_the_assistant_header() {
    let t = Tokenizer::load(&common::shared().join("tokenizers/llama3")).unwrap();
    let text = t.render_chat("What is the capital of France?").unwrap();
    assert_eq!(
        text,
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat is the capital of France?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    );
    let ids = t.encode_chat("What is the capital of France?").unwrap();
    assert_eq!(
        ids.iter().filter(|&&i| Some(i) == t.token_to_id("<|begin_of_text|>")).count(),
        1,
        "BOS once, from the template"
    );
}

/// Llama 3.1+ templates print today's date when `strftime_now` exists. parity leaves it
/// undefined so the template's fixed fallback date is used: the same prompt tokens every day,
/// hence stable snapshots.
#[test]
fn date_dependent_templates_fall_back_to_their_fixed_date() {
    let dir = common::copy_checkpoint(&common::fixture("llama-tiny"), "date-template");
    std::fs::write(
        dir.join("chat_template.jinja"),
        "{%- if not date_string is defined %}{%- if strftime_now is defined %}{%- set date_string = strftime_now(\"%d %b %Y\") %}{%- else %}{%- set date_string = \"26 Jul 2024\" %}{%- endif %}{%- endif %}Today Date: {{ date_string }}\n{{ messages[0].content }}",
    )
    .unwrap();
    let t = Tokenizer::load(&dir).unwrap();
    assert_eq!(t.render_chat("hi").unwrap(), "Today Date: 26 Jul 2024\nhi");
}
