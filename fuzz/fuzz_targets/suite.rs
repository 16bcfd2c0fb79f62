#![no_main]
//! See parity::fuzzing::suite for the oracle.
libfuzzer_sys::fuzz_target!(|data: &[u8]| parity::fuzzing::suite(data));
