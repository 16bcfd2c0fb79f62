//! Every integration test, in one binary: one link instead of one per file (each was a
//! 220 MB debug binary linking MLX and every dependency), and one pool of test threads across
//! files. MLX's default device is per process: every test pins the CPU (`common::cpu`).

mod common;

mod adapter_kit;
mod chat_templates;
mod cli;
mod coverage;
mod device_parity;
mod engines;
mod explore;
mod fuzz_corpus;
mod gemma3;
mod html_report;
mod llamacpp;
mod loading;
mod lossy;
mod mlx_lm;
mod openai;
mod openai_real;
mod reference;
mod report_render;
mod scenarios;
mod selftest;
mod smollm2_scenarios;
mod suite_errors;
mod validation;
mod workflows;
