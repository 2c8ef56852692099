//! The stand-in catches what a real runtime would crash on or what departs
//! from the references' call pattern: a test double that accepted anything
//! would prove nothing about the device that drives it.

use std::ffi::CString;

use ane_standin::*;

/// The stand-in's state is the process's: one test at a time reads it.
static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn violations() -> Vec<String> {
    let r: serde_json::Value = serde_json::from_str(&report()).unwrap();
    r["violations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect()
}

/// Runs `f` and returns the violations it added.
fn caught(f: impl FnOnce()) -> Vec<String> {
    let before = violations().len();
    f();
    violations()[before..].to_vec()
}

fn number(v: i64) -> usize {
    // SAFETY: a kCFNumberSInt64Type value.
    unsafe { CFNumberCreate(0, 4, &v as *const i64 as *const _) }
}

fn string(s: &str) -> usize {
    // SAFETY: a valid byte slice.
    unsafe { CFStringCreateWithBytes(0, s.as_ptr(), s.len() as isize, 0x0800_0100, 0) }
}

fn dict(pairs: &[(usize, usize)]) -> usize {
    let keys: Vec<usize> = pairs.iter().map(|p| p.0).collect();
    let vals: Vec<usize> = pairs.iter().map(|p| p.1).collect();
    // SAFETY: n keys and values; the kCFType callbacks.
    unsafe {
        CFDictionaryCreate(
            0,
            keys.as_ptr(),
            vals.as_ptr(),
            pairs.len() as isize,
            &kCFTypeDictionaryKeyCallBacks as *const _ as usize,
            &kCFTypeDictionaryValueCallBacks as *const _ as usize,
        )
    }
}

/// A flat byte surface as the references create it.
fn surface(bytes: i64) -> usize {
    let n = number(bytes);
    let (one, zero) = (number(1), number(0));
    let props = dict(&[
        (kIOSurfaceWidth, n),
        (kIOSurfaceHeight, one),
        (kIOSurfaceBytesPerElement, one),
        (kIOSurfaceBytesPerRow, n),
        (kIOSurfaceAllocSize, n),
        (kIOSurfacePixelFormat, zero),
    ]);
    let s = IOSurfaceCreate(props);
    for h in [props, n, one, zero] {
        CFRelease(h);
    }
    s
}

fn sel(name: &str) -> usize {
    let c = CString::new(name).unwrap();
    // SAFETY: a C string.
    unsafe { sel_registerName(c.as_ptr()) }
}

fn class(name: &str) -> usize {
    let c = CString::new(name).unwrap();
    // SAFETY: a C string.
    unsafe { objc_getClass(c.as_ptr()) }
}

#[test]
fn misuses_are_recorded() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let s = surface(65536);
    assert_ne!(s, 0);
    assert_eq!(IOSurfaceGetAllocSize(s), 65536);

    let v = caught(|| {
        IOSurfaceGetBaseAddress(s);
    });
    assert!(v[0].contains("while unlocked"), "{v:?}");

    let v = caught(|| {
        IOSurfaceUnlock(s, 0, std::ptr::null_mut());
    });
    assert!(v[0].contains("not locked"), "{v:?}");

    let v = caught(|| {
        IOSurfaceLock(s, 1, std::ptr::null_mut());
        let p = IOSurfaceGetBaseAddress(s) as *mut u8;
        // SAFETY: the surface holds 65536 bytes.
        unsafe { *p = 7 };
        IOSurfaceUnlock(s, 1, std::ptr::null_mut());
    });
    assert!(v[0].contains("written under a read-only lock"), "{v:?}");

    let v = caught(|| {
        IOSurfaceLock(s, 0, std::ptr::null_mut());
        IOSurfaceUnlock(s, 1, std::ptr::null_mut());
    });
    assert!(v[0].contains("of a lock taken with"), "{v:?}");

    // A surface the references would not create.
    let v = caught(|| {
        let n = number(100);
        let props = dict(&[(kIOSurfaceWidth, n)]);
        assert_eq!(IOSurfaceCreate(props), 0);
        CFRelease(props);
        CFRelease(n);
    });
    assert!(
        v[0].contains("not the references' flat byte surface"),
        "{v:?}"
    );

    // The MIL text as a string, not NSData (Orion §9).
    let v = caught(|| {
        let pool = objc_autoreleasePoolPush();
        let text = string("program(1.3)");
        // SAFETY: modelWithMILText:weights:optionsPlist: takes three ids.
        let desc = unsafe {
            objc_msgSend(
                class("_ANEInMemoryModelDescriptor"),
                sel("modelWithMILText:weights:optionsPlist:"),
                text,
                0,
                0,
                0,
                0,
                0,
                0,
            )
        };
        assert_eq!(desc, 0);
        CFRelease(text);
        objc_autoreleasePoolPop(pool);
    });
    assert!(v[0].contains("must be NSData"), "{v:?}");

    // Nil weights (Orion docs/ane_api_reference.md: "must be a dictionary,
    // not nil"), even for a program without any.
    let v = caught(|| {
        let pool = objc_autoreleasePoolPush();
        let text = b"program(1.3)";
        // SAFETY: the bytes outlive the call.
        let mil = unsafe { CFDataCreate(0, text.as_ptr(), text.len() as isize) };
        // SAFETY: modelWithMILText:weights:optionsPlist: takes three ids.
        let desc = unsafe {
            objc_msgSend(
                class("_ANEInMemoryModelDescriptor"),
                sel("modelWithMILText:weights:optionsPlist:"),
                mil,
                0,
                0,
                0,
                0,
                0,
                0,
            )
        };
        assert_eq!(desc, 0);
        CFRelease(mil);
        objc_autoreleasePoolPop(pool);
    });
    assert!(v[0].contains("weights is nil"), "{v:?}");

    // Autoreleasing with no pool leaks; releasing twice is an over-release.
    let v = caught(|| {
        NSTemporaryDirectory();
    });
    assert!(v[0].contains("no autorelease pool"), "{v:?}");
    let v = caught(|| {
        let n = number(3);
        CFRelease(n);
        CFRelease(n);
    });
    assert!(v[0].contains("over-release"), "{v:?}");

    // Freed while locked.
    let v = caught(|| {
        IOSurfaceLock(s, 0, std::ptr::null_mut());
        CFRelease(s);
    });
    assert!(v[0].contains("freed while locked"), "{v:?}");

    let r: serde_json::Value = serde_json::from_str(&report()).unwrap();
    assert_eq!(r["locked_surfaces"], 0, "{r}");
}

/// A model's temporary directory left behind once the model is gone is a
/// violation of the exit report (the references remove it on failure and
/// on free: maderix/ANE training/ane_runtime.h, Orion core/ane_runtime.m).
#[test]
fn a_temporary_directory_outliving_its_model_is_reported() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let dir = {
        let pool = objc_autoreleasePoolPush();
        let text = b"program(1.3)\n{\n}\n";
        // SAFETY: the bytes outlive the call.
        let mil = unsafe { CFDataCreate(0, text.as_ptr(), text.len() as isize) };
        let weights = dict(&[]);
        let send = |recv: usize, name: &str, a: usize| {
            // SAFETY: selectors of one or no object argument.
            unsafe { objc_msgSend(recv, sel(name), a, 0, 0, 0, 0, 0, 0) }
        };
        // SAFETY: modelWithMILText:weights:optionsPlist: takes three ids.
        let desc = unsafe {
            objc_msgSend(
                class("_ANEInMemoryModelDescriptor"),
                sel("modelWithMILText:weights:optionsPlist:"),
                mil,
                weights,
                0,
                0,
                0,
                0,
                0,
            )
        };
        assert_ne!(desc, 0);
        let model = send(
            class("_ANEInMemoryModel"),
            "inMemoryModelWithDescriptor:",
            desc,
        );
        let hex = send(model, "hexStringIdentifier", 0);
        let mut buf = [0 as std::ffi::c_char; 128];
        // SAFETY: 128 writable bytes.
        let copied = unsafe { CFStringGetCString(hex, buf.as_mut_ptr(), 128, 0x0800_0100) };
        assert_eq!(copied, 1);
        // SAFETY: NUL-terminated by CFStringGetCString.
        let hex = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        let dir = std::path::Path::new(&ane::temporary_directory()).join(hex);
        std::fs::create_dir_all(dir.join("weights")).unwrap();
        CFRelease(mil);
        CFRelease(weights);
        // The pool releases the descriptor and the model; the directory stays.
        objc_autoreleasePoolPop(pool);
        dir
    };
    assert!(
        violations()
            .iter()
            .any(|v| v.contains("outlived its model") && v.contains(dir.to_str().unwrap())),
        "{:?}",
        violations()
    );
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(!violations()
        .iter()
        .any(|v| v.contains(dir.to_str().unwrap())));
}
