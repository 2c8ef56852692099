//! Any bytes into the `.npy` reader: errors are fine, panics are not.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = npy::parse(data);
    let _ = mil::blob::decode(data, 64, 8, "fuzz");
});
