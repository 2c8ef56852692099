//! Apple's Accelerate framework: `cblas_sgemm`, loaded at run time from
//! `/System/Library/Frameworks/Accelerate.framework/Accelerate`, the
//! default backend on macOS. On Apple Silicon it runs on the CPU's matrix
//! coprocessor and threads itself, so a product is one call (not split
//! into parts like MKL). `ANETRAIN_ACCELERATE` names another library
//! exporting `cblas_sgemm` instead — a testing aid, so this path runs on
//! Linux against OpenBLAS.

use std::sync::OnceLock;

use crate::cblas::CblasSgemm;

/// Where Accelerate lives on every macOS since 10.3 (a dyld shared-cache
/// path: `dlopen` finds it although no file exists there).
const FRAMEWORK: &str = "/System/Library/Frameworks/Accelerate.framework/Accelerate";

static LOADED: OnceLock<Result<CblasSgemm, String>> = OnceLock::new();

/// Accelerate's `cblas_sgemm`, if it could be loaded.
pub fn sgemm() -> Option<CblasSgemm> {
    load().as_ref().ok().copied()
}

/// Why `ANETRAIN_ACCELERATE` could not be used, when it is set and that
/// failed.
pub fn env_error() -> Option<String> {
    std::env::var_os("ANETRAIN_ACCELERATE")?;
    load().as_ref().err().cloned()
}

fn load() -> &'static Result<CblasSgemm, String> {
    LOADED.get_or_init(|| match std::env::var("ANETRAIN_ACCELERATE") {
        Ok(path) => open(&path).map_err(|e| format!("ANETRAIN_ACCELERATE={path}: {e}")),
        Err(_) => open(FRAMEWORK),
    })
}

/// Opens one library for the life of the process and resolves `cblas_sgemm`.
fn open(path: &str) -> Result<CblasSgemm, String> {
    // SAFETY: loading a BLAS runs its initialisers, which is what using it
    // means.
    let lib = unsafe { libloading::Library::new(path) }
        .map_err(|_| "cannot be loaded (expected a library exporting cblas_sgemm)".to_string())?;
    let lib: &'static libloading::Library = Box::leak(Box::new(lib));
    // SAFETY: `cblas_sgemm` has the CBLAS signature `CblasSgemm` declares.
    let f = unsafe { lib.get::<CblasSgemm>(b"cblas_sgemm\0") }
        .map_err(|_| "has no cblas_sgemm".to_string())?;
    Ok(*f)
}
