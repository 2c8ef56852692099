//! What the crate's setup refuses: a chip family, an environment variable,
//! a saved device profile or a rule id it cannot use. (A device's own
//! failures are [`crate::DeviceError`]s.) Each displays as one line that
//! names what was wrong and what to use instead.

use std::fmt;
use std::path::PathBuf;

/// A setting the crate cannot use.
#[derive(Clone, Debug, PartialEq)]
pub enum Error {
    /// A name that is not a chip family (`m1` … `m5`).
    UnknownFamily { given: String },
    /// An environment variable whose value is refused for `reason`.
    Variable {
        var: &'static str,
        reason: Box<Error>,
    },
    /// A variable that should hold an axis cap (a whole number of at
    /// least 16).
    NotADimension { var: &'static str, value: String },
    /// A saved device profile that cannot be read or written.
    Profile { path: PathBuf, problem: String },
    /// A rule id no rule has.
    UnknownRule {
        id: String,
        known: Vec<&'static str>,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::UnknownFamily { given } => write!(
                f,
                "'{given}' is not a chip family (use one of m1, m2, m3, m4, m5)"
            ),
            Error::Variable { var, reason } => write!(f, "{var}: {reason}"),
            Error::NotADimension { var, value } => write!(
                f,
                "{var}={value:?} is not a dimension limit (a whole number of at least 16)"
            ),
            Error::Profile { path, problem } => write!(f, "{}: {problem}", path.display()),
            Error::UnknownRule { id, known } => {
                write!(f, "unknown ANE rule '{id}' (known: {})", known.join(", "))
            }
        }
    }
}

impl std::error::Error for Error {}
