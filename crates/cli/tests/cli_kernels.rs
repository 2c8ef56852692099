//! `anetrain kernels check` and `kernels dump` end to end: every kernel of
//! Qwen3-0.6B passes its check, and a dumped program runs with `mil run`.

mod common;

use common::{bin, tmp};

use anetrain::config::ModelConfig;
use anetrain::kernels::{build, KernelKind, KernelOptions, Shape};

#[test]
fn kernels_check_passes_for_qwen3_0_6b_at_seq_256() {
    let o = bin()
        .args(["kernels", "check", "--model", "qwen3-0.6b", "--seq", "256"])
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{table}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(
        table.lines().filter(|l| l.ends_with(" ok")).count(),
        10,
        "{table}"
    );
    assert!(
        table.contains("ANE rules: every kernel meets all"),
        "{table}"
    );
}

#[test]
fn kernels_dump_writes_programs_blobs_and_layouts() {
    let dir = tmp();
    let out = dir.path().join("dump");
    let o = bin()
        .args(["kernels", "dump", "--model", "tiny", "--seq", "32", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for k in KernelKind::ALL {
        let text = std::fs::read_to_string(out.join(format!("{}.mil", k.name()))).unwrap();
        mil::parse_and_validate(&text).unwrap();
    }
    for b in ["mask.bin", "rope_cos.bin", "rope_sin.bin"] {
        assert!(out.join("weights").join(b).is_file());
    }
    let layout: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("layout.json")).unwrap()).unwrap();
    assert_eq!(
        layout["kernels"]["sdpa_forward"]["inputs"][0]["name"],
        "xnorm"
    );
    // mil run executes a dumped kernel with its blobs.
    let k = build(
        KernelKind::SdpaForward,
        &Shape::new(&ModelConfig::preset("tiny").unwrap(), 32),
        &KernelOptions::hf(&ModelConfig::preset("tiny").unwrap()),
    )
    .unwrap();
    let x = out.join("x.npy");
    std::fs::write(
        &x,
        npy::encode_f16(
            &[1, k.layout.in_channels, 1, k.layout.in_spatial],
            &vec![0.01; k.layout.input_elems()],
        ),
    )
    .unwrap();
    let o = bin()
        .args(["mil", "run"])
        .arg(out.join("sdpa_forward.mil"))
        .arg("--input")
        .arg(&x)
        .arg("--output")
        .arg(out.join("y.npy"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}
