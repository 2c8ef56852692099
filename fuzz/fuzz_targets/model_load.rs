//! The model-loading path: bytes split into a config.json and a safetensors
//! file, each parsed and validated. Errors are fine, panics are not.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let split = data.iter().position(|&b| b == 0).unwrap_or(data.len());
    if let Ok(text) = std::str::from_utf8(&data[..split]) {
        if let Ok(cfg) = anetrain::model::config::ModelConfig::from_json(text) {
            let _ = cfg.num_params();
        }
    }
    let rest = data.get(split + 1..).unwrap_or(&[]);
    let _ = anetrain::model::tensor_file::parse(rest);
});
