//! `replayguard reset`: empties a stopped instance's state folder.

use std::io::Write;

use replayguard::Guard;

use crate::cli::ResetArgs;
use crate::common::{self, Failure};

pub fn run(args: &ResetArgs) -> Result<(), Failure> {
    common::check_state(&args.state, replayguard::FolderUse::Existing)?;
    // Opening takes the folder's lock (a running instance holds it) and
    // refuses a damaged or foreign folder: only a replayguard folder nobody
    // uses is emptied.
    let guard = Guard::builder(&args.state)
        .open()
        .map_err(Failure::runtime)?;
    let job = replayguard::job::recorded(&args.state).map_err(Failure::runtime)?;
    let epoch = guard.epoch();
    if !args.yes {
        return Err(Failure::usage(format!(
            "reset removes everything state folder {} remembers (epoch {epoch}, job {}); run it again with --yes to do so",
            args.state.display(),
            job.map_or_else(|| "none recorded".to_owned(), |j| j.to_string())
        )));
    }
    drop(guard);
    let entries = std::fs::read_dir(&args.state)
        .map_err(|e| Failure::runtime(format!("cannot list {}: {e}", args.state.display())))?;
    for entry in entries {
        let entry = entry
            .map_err(|e| Failure::runtime(format!("cannot list {}: {e}", args.state.display())))?;
        let path = entry.path();
        let removed = if path.is_dir() {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
        removed.map_err(|e| Failure::runtime(format!("cannot remove {}: {e}", path.display())))?;
    }
    let _ = writeln!(
        std::io::stderr(),
        "replayguard: state folder {} emptied",
        args.state.display()
    );
    Ok(())
}
