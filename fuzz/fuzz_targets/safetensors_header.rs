#![no_main]
//! See parity::fuzzing::safetensors_header for the oracle.
libfuzzer_sys::fuzz_target!(|data: &[u8]| parity::fuzzing::safetensors_header(data));
