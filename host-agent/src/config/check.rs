//! What a configuration section's checks return: the sections live with the units that read
//! them (a watcher's under [`crate::watch`], discovery's in [`crate::discovery`]) and import
//! only this, so that [`crate::config`], which composes them, is the one that imports them.

/// A key of a section that is out of bounds; [`super::Config::validate`] adds the file name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid {
    /// Full key, `section.key`.
    pub key: String,
    pub problem: String,
}

/// `key` must lie within `lo..=hi`.
pub fn range(key: &str, v: u64, lo: u64, hi: u64) -> Result<(), Invalid> {
    if v < lo || v > hi {
        Err(Invalid {
            key: key.to_string(),
            problem: format!("must be between {lo} and {hi}, got {v}"),
        })
    } else {
        Ok(())
    }
}
