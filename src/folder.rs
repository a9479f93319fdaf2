//! Checks of a state folder's path that come before opening it.

use std::path::Path;

use crate::error::{Error, Result};
use crate::store::{MARKER_FILE, is_new_folder};

/// What a state folder is about to be used for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FolderUse {
    /// A run of a guard: the folder may be new (its parent must exist).
    Run,
    /// Reading or changing an existing folder (`inspect`, `reset`): it must
    /// be a replayguard state folder already.
    Existing,
}

/// Refuses a state folder the guard would refuse, before anything else is
/// touched (a broker, say), and a path whose parent is missing: most
/// likely a typo, which would otherwise start from empty state and repeat
/// everything. Creates and changes nothing.
///
/// # Errors
///
/// [`Error::StateFolder`] for a file, a missing folder (with
/// [`FolderUse::Existing`]) or a missing parent; [`Error::ForeignState`]
/// for a non-empty folder without the marker; [`Error::Open`] when it
/// cannot be read.
pub fn check_state_folder(path: &Path, purpose: FolderUse) -> Result<()> {
    let unusable = |what: String| Error::StateFolder {
        path: path.to_owned(),
        what,
    };
    match std::fs::metadata(path) {
        Ok(m) if !m.is_dir() => Err(unusable(
            "is a file, not a replayguard state folder; give the path of a folder".into(),
        )),
        Ok(_) => {
            if path.join(MARKER_FILE).is_file() {
                return Ok(());
            }
            let new = is_new_folder(path).map_err(|source| Error::Open {
                path: path.to_owned(),
                source,
            })?;
            match purpose {
                FolderUse::Run if new => Ok(()),
                FolderUse::Existing if new => Err(unusable(
                    "is not a replayguard state folder (it is empty); check the path".into(),
                )),
                _ => Err(Error::ForeignState {
                    path: path.to_owned(),
                }),
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => match purpose {
            FolderUse::Existing => Err(unusable(
                "state folder does not exist; check the path".into(),
            )),
            FolderUse::Run => {
                let parent = match path.parent() {
                    Some(p) if !p.as_os_str().is_empty() => p,
                    _ => Path::new("."),
                };
                if parent.is_dir() {
                    Ok(())
                } else {
                    Err(unusable(
                        "its parent folder does not exist; create it, or fix the path (only the state folder itself is created)".into(),
                    ))
                }
            }
        },
        Err(source) => Err(Error::Open {
            path: path.to_owned(),
            source,
        }),
    }
}
