//! Chooses the matrix-multiply library: the system OpenBLAS when it is
//! installed (or the `openblas` feature forces it), else the pure-Rust
//! `gemm` crate. `ANETRAIN_BLAS=none` turns the detection off.

use std::path::Path;

const DIRS: [&str; 7] = [
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/lib",
    "/opt/homebrew/opt/openblas/lib",
    "/usr/local/opt/openblas/lib",
];

fn main() {
    println!("cargo::rustc-check-cfg=cfg(openblas)");
    println!("cargo:rerun-if-env-changed=ANETRAIN_BLAS");
    if std::env::var_os("CARGO_FEATURE_BACKENDS").is_none() {
        return; // plain loops only
    }
    let forced = std::env::var_os("CARGO_FEATURE_OPENBLAS").is_some();
    if std::env::var("ANETRAIN_BLAS").is_ok_and(|v| v == "none") && !forced {
        return;
    }
    // Re-run when this script or the library found changes (a path that
    // does not exist would make Cargo re-run the script, and rebuild this
    // crate, on every build: after installing OpenBLAS, `cargo clean --release -p linalg`).
    println!("cargo:rerun-if-changed=build.rs");
    let mut found = None;
    'search: for dir in DIRS {
        for file in ["libopenblas.so", "libopenblas.dylib"] {
            let p = Path::new(dir).join(file);
            if p.exists() {
                println!("cargo:rerun-if-changed={}", p.display());
                found = Some(dir);
                break 'search;
            }
        }
    }
    if let Some(dir) = found {
        println!("cargo:rustc-link-search=native={dir}");
    }
    if found.is_some() || forced {
        println!("cargo:rustc-link-lib=dylib=openblas");
        println!("cargo:rustc-cfg=openblas");
    }
}
