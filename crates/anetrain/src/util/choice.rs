//! Enums a user picks by name (command-line values): each lists its
//! variants with the word that selects them and a one-line description, so
//! the command line can offer and explain them without the library knowing
//! how arguments are parsed.

pub trait Choice: Copy + PartialEq + Sized + 'static {
    /// Every variant: `(variant, name, description)`.
    const CHOICES: &'static [(Self, &'static str, &'static str)];

    /// Names users ask for that select nothing yet: `(name, why)`.
    const NOT_BUILT: &'static [(&'static str, &'static str)] = &[];

    /// The name that selects this variant.
    fn name(self) -> &'static str {
        Self::CHOICES
            .iter()
            .find(|(v, _, _)| *v == self)
            .map_or("", |(_, n, _)| n)
    }

    /// The variant `name` selects.
    fn from_name(name: &str) -> Option<Self> {
        Self::CHOICES
            .iter()
            .find(|(_, n, _)| *n == name)
            .map(|(v, _, _)| *v)
    }
}
