//! Intel MKL's `cblas_sgemm`, loaded at run time when present, so the build
//! never depends on it. MKL is looked up as `$ANETRAIN_MKL` (a path to
//! `libmkl_rt.so.*`) or by the loader under its usual names (for example
//! after `pip install mkl`, with the environment's `lib` directory on
//! `LD_LIBRARY_PATH`). It is switched to its sequential threading layer
//! before any other call: the pool's threads each run one part of a
//! product (see `in_parts`), so MKL never starts a second thread pool.

use std::ffi::c_int;
use std::sync::OnceLock;

use crate::cblas::CblasSgemm;

/// `MKL_THREADING_SEQUENTIAL` for `MKL_Set_Threading_Layer`.
const THREADING_SEQUENTIAL: c_int = 1;
/// Names the loader is asked for when `ANETRAIN_MKL` is unset.
const NAMES: [&str; 3] = ["libmkl_rt.so.3", "libmkl_rt.so.2", "libmkl_rt.so"];

static LOADED: OnceLock<Result<CblasSgemm, String>> = OnceLock::new();

/// MKL's `cblas_sgemm`, if it could be loaded.
pub fn sgemm() -> Option<CblasSgemm> {
    load().as_ref().ok().copied()
}

/// Why `ANETRAIN_MKL` could not be used, when it is set and that failed.
pub fn env_error() -> Option<String> {
    std::env::var_os("ANETRAIN_MKL")?;
    load().as_ref().err().cloned()
}

fn load() -> &'static Result<CblasSgemm, String> {
    LOADED.get_or_init(|| match std::env::var("ANETRAIN_MKL") {
        Ok(path) => open(&path).map_err(|e| format!("ANETRAIN_MKL={path}: {e}")),
        Err(_) => NAMES
            .iter()
            .find_map(|n| open(n).ok())
            .ok_or_else(|| "MKL not found".to_string()),
    })
}

/// Opens one library for the life of the process and resolves what we call.
fn open(name: &str) -> Result<CblasSgemm, String> {
    // SAFETY: loading MKL runs its initialisers, which is what using it means.
    let lib = unsafe { libloading::Library::new(name) }
        .map_err(|_| "cannot be loaded (expected a path to libmkl_rt.so.*)".to_string())?;
    let lib: &'static libloading::Library = Box::leak(Box::new(lib));
    // SAFETY: both symbols are MKL's documented C functions with these
    // signatures; the threading layer is set before any other MKL call.
    unsafe {
        let set_layer = lib
            .get::<unsafe extern "C" fn(c_int) -> c_int>(b"MKL_Set_Threading_Layer\0")
            .map_err(|_| "has no MKL_Set_Threading_Layer".to_string())?;
        let sgemm = lib
            .get::<CblasSgemm>(b"cblas_sgemm\0")
            .map_err(|_| "has no cblas_sgemm".to_string())?;
        set_layer(THREADING_SEQUENTIAL);
        Ok(*sgemm)
    }
}
