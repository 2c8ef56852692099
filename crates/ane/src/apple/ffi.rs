//! The C and Objective-C entry points the Neural Engine device calls, all
//! resolved at run time with `dlopen`/`dlsym` so this code builds (and is
//! type-checked) on every platform. Each symbol's exact C signature lives
//! here once; `objc_msgSend` is cast to one exact, non-variadic prototype per
//! selector shape (on arm64 a variadic call would pass arguments on the
//! stack, where the callee does not look).

use std::ffi::{c_char, c_void};

/// Objective-C `id`, `Class`, `SEL` and CoreFoundation references are all
/// plain pointers at this level.
pub type Id = *mut c_void;
pub type Sel = *mut c_void;
pub type CfRef = *const c_void;

pub const OBJC: &str = "/usr/lib/libobjc.A.dylib";
pub const CORE_FOUNDATION: &str =
    "/System/Library/Frameworks/CoreFoundation.framework/CoreFoundation";
pub const FOUNDATION: &str = "/System/Library/Frameworks/Foundation.framework/Foundation";
pub const IOSURFACE: &str = "/System/Library/Frameworks/IOSurface.framework/IOSurface";
pub const ANE_FRAMEWORK: &str =
    "/System/Library/PrivateFrameworks/AppleNeuralEngine.framework/AppleNeuralEngine";

/// `kCFStringEncodingUTF8`.
pub const UTF8: u32 = 0x0800_0100;
/// `kCFNumberSInt64Type`.
pub const SINT64: isize = 4;
/// `kIOSurfaceLockReadOnly`.
pub const LOCK_READ_ONLY: u32 = 1;

/// A library opened with `dlopen(RTLD_NOW)` through `libloading`, never
/// closed: the process keeps the Objective-C classes it registers (see
/// [`Api::load`], which forgets the handles).
pub struct Library {
    lib: libloading::os::unix::Library,
    path: String,
}

impl Library {
    pub fn open(path: &str) -> Result<Library, String> {
        // SAFETY: loading runs the library's initialisers (for the
        // frameworks: registering their Objective-C classes), which is what
        // opening it is for.
        let lib = unsafe {
            libloading::os::unix::Library::open(Some(path), libloading::os::unix::RTLD_NOW)
        }
        .map_err(|e| format!("cannot load {path}: {e}"))?;
        Ok(Library {
            lib,
            path: path.to_string(),
        })
    }

    /// The address of symbol `name`.
    pub fn symbol(&self, name: &str) -> Result<*mut c_void, String> {
        // SAFETY: the address is only used as the type its declaration in
        // this module gives it.
        let p = unsafe { self.lib.get::<*mut c_void>(name.as_bytes()) }
            .map(|s| *s)
            .unwrap_or(std::ptr::null_mut());
        if p.is_null() {
            return Err(format!("{} has no symbol {name}", self.path));
        }
        Ok(p)
    }
}

/// Declares the function table: each entry's C prototype and the library it
/// comes from, resolved together by [`Api::load`].
macro_rules! api {
    ($( $lib:ident : $name:ident = fn($($arg:ty),*) $(-> $ret:ty)?; )*) => {
        /// Every C function the device calls.
        #[allow(non_snake_case)]
        pub struct Api {
            $( pub $name: unsafe extern "C" fn($($arg),*) $(-> $ret)?, )*
            /// `objc_msgSend`, cast per call by [`msg`].
            pub objc_msgSend: *mut c_void,
            /// Addresses of CoreFoundation's callback structs.
            pub kCFTypeDictionaryKeyCallBacks: CfRef,
            pub kCFTypeDictionaryValueCallBacks: CfRef,
            pub kCFTypeArrayCallBacks: CfRef,
            /// IOSurface property keys (the CFStrings the globals hold).
            pub surface_keys: SurfaceKeys,
        }

        impl Api {
            /// Opens the five libraries — or, given `stand_in`, that one
            /// library in place of all five — and resolves every symbol;
            /// the error names the first library or symbol that is missing.
            pub fn load(stand_in: Option<&str>) -> Result<Api, String> {
                let open = |system: &str| Library::open(stand_in.unwrap_or(system));
                let objc = open(OBJC)?;
                let cf = open(CORE_FOUNDATION)?;
                let foundation = open(FOUNDATION)?;
                let iosurface = open(IOSURFACE)?;
                // Loading registers the _ANE* classes with the runtime.
                let ane = open(ANE_FRAMEWORK)?;
                let libs = Libs { objc, cf, foundation, iosurface };
                // SAFETY: each symbol is transmuted to the prototype declared
                // for it above (from Apple's headers; see the module docs).
                let api = unsafe {
                    Api {
                        $( $name: std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($arg),*) $(-> $ret)?>(
                            libs.$lib.symbol(stringify!($name))?,
                        ), )*
                        objc_msgSend: libs.objc.symbol("objc_msgSend")?,
                        kCFTypeDictionaryKeyCallBacks: libs.cf.symbol("kCFTypeDictionaryKeyCallBacks")?,
                        kCFTypeDictionaryValueCallBacks: libs.cf.symbol("kCFTypeDictionaryValueCallBacks")?,
                        kCFTypeArrayCallBacks: libs.cf.symbol("kCFTypeArrayCallBacks")?,
                        surface_keys: SurfaceKeys::load(&libs.iosurface)?,
                    }
                };
                // The function pointers above stay valid for the process.
                std::mem::forget((libs, ane));
                Ok(api)
            }
        }
    };
}

struct Libs {
    objc: Library,
    cf: Library,
    foundation: Library,
    iosurface: Library,
}

api! {
    objc: objc_getClass = fn(*const c_char) -> Id;
    objc: sel_registerName = fn(*const c_char) -> Sel;
    objc: objc_retain = fn(Id) -> Id;
    objc: objc_release = fn(Id);
    objc: objc_autoreleasePoolPush = fn() -> *mut c_void;
    objc: objc_autoreleasePoolPop = fn(*mut c_void);
    objc: class_getClassMethod = fn(Id, Sel) -> *mut c_void;
    objc: class_getInstanceMethod = fn(Id, Sel) -> *mut c_void;
    cf: CFDataCreate = fn(CfRef, *const u8, isize) -> CfRef;
    cf: CFNumberCreate = fn(CfRef, isize, *const c_void) -> CfRef;
    cf: CFStringCreateWithBytes = fn(CfRef, *const u8, isize, u32, u8) -> CfRef;
    cf: CFStringGetLength = fn(CfRef) -> isize;
    cf: CFStringGetCString = fn(CfRef, *mut c_char, isize, u32) -> u8;
    cf: CFDictionaryCreate = fn(CfRef, *const CfRef, *const CfRef, isize, CfRef, CfRef) -> CfRef;
    cf: CFArrayCreate = fn(CfRef, *const CfRef, isize, CfRef) -> CfRef;
    cf: CFErrorCopyDescription = fn(CfRef) -> CfRef;
    cf: CFErrorGetCode = fn(CfRef) -> isize;
    cf: CFErrorGetDomain = fn(CfRef) -> CfRef;
    cf: CFRelease = fn(CfRef);
    foundation: NSTemporaryDirectory = fn() -> Id;
    iosurface: IOSurfaceCreate = fn(CfRef) -> Id;
    iosurface: IOSurfaceLock = fn(Id, u32, *mut u32) -> i32;
    iosurface: IOSurfaceUnlock = fn(Id, u32, *mut u32) -> i32;
    iosurface: IOSurfaceGetBaseAddress = fn(Id) -> *mut c_void;
    iosurface: IOSurfaceGetAllocSize = fn(Id) -> usize;
}

/// The `kIOSurface*` keys a flat one-row byte surface is created with.
pub struct SurfaceKeys {
    pub width: CfRef,
    pub height: CfRef,
    pub bytes_per_element: CfRef,
    pub bytes_per_row: CfRef,
    pub alloc_size: CfRef,
    pub pixel_format: CfRef,
}

impl SurfaceKeys {
    fn load(lib: &Library) -> Result<SurfaceKeys, String> {
        // The symbols are `extern const CFStringRef` variables: dlsym gives
        // the variable's address, which holds the string.
        let key = |name: &str| -> Result<CfRef, String> {
            let p = lib.symbol(name)? as *const CfRef;
            // SAFETY: p is the address of a CFStringRef global.
            Ok(unsafe { *p })
        };
        Ok(SurfaceKeys {
            width: key("kIOSurfaceWidth")?,
            height: key("kIOSurfaceHeight")?,
            bytes_per_element: key("kIOSurfaceBytesPerElement")?,
            bytes_per_row: key("kIOSurfaceBytesPerRow")?,
            alloc_size: key("kIOSurfaceAllocSize")?,
            pixel_format: key("kIOSurfacePixelFormat")?,
        })
    }
}

/// The `objc_msgSend` prototypes the device uses, one per selector shape.
pub mod msg {
    use super::{Id, Sel};

    /// `id (id, SEL)`
    pub type Id0 = unsafe extern "C" fn(Id, Sel) -> Id;
    /// `id (id, SEL, id)` (also `+objectWithIOSurface:` with an IOSurfaceRef)
    pub type Id1 = unsafe extern "C" fn(Id, Sel, Id) -> Id;
    /// `id (id, SEL, id, id, id)`
    pub type Id3 = unsafe extern "C" fn(Id, Sel, Id, Id, Id) -> Id;
    /// `id (id, SEL, id, id, id, id, id, id, id)`
    pub type Id7 = unsafe extern "C" fn(Id, Sel, Id, Id, Id, Id, Id, Id, Id) -> Id;
    /// `BOOL (id, SEL, unsigned int qos, id options, NSError **)`
    pub type QosOptionsError = unsafe extern "C" fn(Id, Sel, u32, Id, *mut Id) -> u8;
    /// `BOOL (id, SEL, unsigned int qos, id options, id request, NSError **)`
    pub type QosOptionsRequestError = unsafe extern "C" fn(Id, Sel, u32, Id, Id, *mut Id) -> u8;
    /// `BOOL (id, SEL, unsigned int qos, NSError **)`
    pub type QosError = unsafe extern "C" fn(Id, Sel, u32, *mut Id) -> u8;
}
