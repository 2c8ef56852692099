//! Intel MKL's `cblas_sgemm`, loaded at run time when present, so the build
//! never depends on it. MKL is looked up as `$ANETRAIN_MKL` (a path to
//! `libmkl_rt.so.*`) or by the loader under its usual names (for example
//! after `pip install mkl`, with the environment's `lib` directory on
//! `LD_LIBRARY_PATH`). It is switched to its sequential threading layer
//! before any other call: the pool's threads each run one part of a
//! product (see `in_parts`), so MKL never starts a second thread pool.

use super::CblasSgemm;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::OnceLock;

extern "C" {
    fn dlopen(filename: *const c_char, flags: c_int) -> *mut c_void;
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
}

const RTLD_NOW: c_int = 2;
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

/// Opens one library and resolves what we call.
fn open(name: &str) -> Result<CblasSgemm, String> {
    let c_name = CString::new(name).map_err(|_| "the path contains a NUL byte".to_string())?;
    // SAFETY: dlopen with a valid C string; running the library's
    // initialisers is what loading it means.
    let handle = unsafe { dlopen(c_name.as_ptr(), RTLD_NOW) };
    if handle.is_null() {
        return Err("cannot be loaded (expected a path to libmkl_rt.so.*)".into());
    }
    let symbol = |s: &CStr| {
        // SAFETY: a valid handle and C string.
        let p = unsafe { dlsym(handle, s.as_ptr()) };
        (!p.is_null())
            .then_some(p)
            .ok_or_else(|| format!("has no {}", s.to_string_lossy()))
    };
    let layer = symbol(c"MKL_Set_Threading_Layer")?;
    let sgemm = symbol(c"cblas_sgemm")?;
    // SAFETY: both symbols are MKL's documented C functions with these
    // signatures; the threading layer is set before any other MKL call.
    unsafe {
        let set_layer: unsafe extern "C" fn(c_int) -> c_int = std::mem::transmute(layer);
        set_layer(THREADING_SEQUENTIAL);
        Ok(std::mem::transmute::<*mut c_void, CblasSgemm>(sgemm))
    }
}
