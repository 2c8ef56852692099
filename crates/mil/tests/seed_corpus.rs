//! Runs every program of the seed reference corpus (`testdata/seed-reference/
//! seed-mil/*/`) through the parser, printer and interpreter.
//!
//! Tolerances: fp32 mode must match `_out.npy` (computed without rounding)
//! within 1e-4 of the output's largest magnitude — only summation order
//! differs. fp16 mode must match `_out_fp16emu.npy` (every op rounded to
//! fp16) within 4e-3 of the largest magnitude: a couple of fp16 ulps, since
//! rounding ties and accumulation order can flip the last bit of an op.

use std::path::PathBuf;

use mil::{Executable, Precision, Tensor};
use npy::NpyData;

/// The seed reference corpus, kept in the repository as test data
/// (`testdata/seed-reference/README.md` says what it holds).
fn corpus() -> PathBuf {
    let dir =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/seed-reference/seed-mil");
    assert!(
        dir.is_dir(),
        "reference corpus missing at {}",
        dir.display()
    );
    dir
}

fn floats(path: &std::path::Path) -> (Vec<usize>, Vec<f32>) {
    let a = npy::read(path).unwrap();
    match a.data {
        NpyData::Float(v) => (a.shape, v),
        _ => panic!("{} is not a float array", path.display()),
    }
}

fn configs(dir: &std::path::Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("config.json").exists())
        .collect();
    v.sort();
    assert!(!v.is_empty(), "no configs in {}", dir.display());
    v
}

fn kernels(cfg: &std::path::Path) -> Vec<(String, PathBuf)> {
    let mut v: Vec<(String, PathBuf)> = std::fs::read_dir(cfg)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "mil"))
        .map(|p| (p.file_stem().unwrap().to_string_lossy().into_owned(), p))
        .collect();
    v.sort();
    assert_eq!(
        v.len(),
        10,
        "expected the seed's ten kernels in {}",
        cfg.display()
    );
    v
}

#[test]
fn seed_programs_parse_validate_and_print_back_identically() {
    let dir = corpus();
    for cfg in configs(&dir) {
        for (name, path) in kernels(&cfg) {
            let text = std::fs::read_to_string(&path).unwrap();
            let p = mil::parse_and_validate(&text)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let printed = mil::print(&p);
            assert_eq!(
                printed, text,
                "{name}: printer output differs from the seed's text"
            );
            assert_eq!(
                mil::parse(&printed).unwrap(),
                p,
                "{name}: parse(print(p)) != p"
            );
        }
    }
}

fn max_rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    got.iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max)
        / scale
}

#[test]
fn seed_programs_match_reference_outputs_in_both_modes() {
    let dir = corpus();
    let mut checked = 0;
    for cfg in configs(&dir) {
        for (name, path) in kernels(&cfg) {
            let text = std::fs::read_to_string(&path).unwrap();
            let p = mil::parse_and_validate(&text).unwrap();
            let exe = Executable::from_program(&p, Some(&cfg.join("weights"))).unwrap();
            let vec = cfg.join("vectors");
            let (in_shape, input) = floats(&vec.join(format!("{name}_in.npy")));
            let x = Tensor::float(mil::DType::Fp16, in_shape, input);
            for (mode, file, tol) in [
                (Precision::Fp32, format!("{name}_out.npy"), 1e-4),
                (Precision::Fp16, format!("{name}_out_fp16emu.npy"), 4e-3),
            ] {
                let (shape, want) = floats(&vec.join(&file));
                let out = exe.run(vec![x.clone()], mode).unwrap();
                assert_eq!(out[0].shape, shape, "{name} output shape");
                let err = max_rel_err(out[0].f32s().unwrap(), &want);
                eprintln!(
                    "{}/{name} {mode:?}: max rel err {err:.2e}",
                    cfg.file_name().unwrap().to_string_lossy()
                );
                assert!(
                    err <= tol,
                    "{}/{name} {mode:?}: error {err:.3e} > {tol:e}",
                    cfg.display()
                );
                checked += 1;
            }
        }
    }
    assert!(checked >= 40);
}
