#![no_main]
//! See parity::fuzzing::config for the oracle.
libfuzzer_sys::fuzz_target!(|data: &[u8]| parity::fuzzing::config(data));
