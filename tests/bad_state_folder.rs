//! A damaged, foreign, newer, busy or unwritable state folder gives a typed
//! error naming the folder, never a silent fresh start, and the state in it
//! is still there once the cause is fixed (G5).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use fjall::{Database, KeyspaceCreateOptions};
use replayguard::{Error, FORMAT_VERSION, Fingerprint, Guard, Result};

/// Records per lane in the closed epoch 0 (checkpointed) and in the open
/// epoch 1 (flushed, not checkpointed).
const CLOSED: u64 = 100;
const OPEN: u64 = 150;

fn fp(lane: i32, offset: u64) -> Fingerprint {
    Fingerprint::content(Some(&lane.to_be_bytes()), Some(&offset.to_be_bytes()))
}

fn open(dir: &Path) -> Result<Guard> {
    Guard::builder(dir).retention_epochs(1).open()
}

/// Two lanes; epoch 0 checkpointed at offset 100, epoch 1 flushed to 150.
fn populate(dir: &Path) -> Result<()> {
    let mut g = open(dir)?;
    let lanes = [g.lane("t", 0), g.lane("t", 1)];
    for (p, &lane) in lanes.iter().enumerate() {
        for o in 0..CLOSED {
            assert!(g.record(lane, Some(o), Some(fp(p as i32, o)))?.is_fresh());
        }
    }
    g.checkpoint(&[(lanes[0], CLOSED), (lanes[1], CLOSED)], b"sink".to_vec())?;
    for (p, &lane) in lanes.iter().enumerate() {
        for o in CLOSED..OPEN {
            assert!(g.record(lane, Some(o), Some(fp(p as i32, o)))?.is_fresh());
        }
    }
    g.flush()?;
    Ok(())
}

/// Everything `populate` wrote is known, and nothing else.
fn assert_intact(dir: &Path) -> Result<()> {
    let mut g = open(dir)?;
    assert_eq!(g.epoch(), 1);
    assert_eq!(g.manifest().map(|m| m.sink.clone()), Some(b"sink".to_vec()));
    for p in 0..2 {
        let lane = g.lane("t", p);
        assert_eq!(g.position(lane), Some(CLOSED));
        let offsets: Vec<u64> = g.live_offsets(lane).iter().collect();
        assert_eq!(offsets, (0..OPEN).collect::<Vec<_>>(), "lane {p}");
        for o in (0..OPEN).step_by(7) {
            assert!(!g.check(lane, None, Some(fp(p, o)))?.is_fresh(), "{p}/{o}");
        }
        assert!(g.check(lane, Some(OPEN), Some(fp(p, OPEN)))?.is_fresh());
    }
    assert_eq!(g.stats().live_fingerprints, 2 * OPEN);
    Ok(())
}

fn expect_err<T>(r: Result<T>) -> Error {
    match r {
        Ok(_) => panic!("the open succeeded on a bad folder"),
        Err(e) => e,
    }
}

/// A keyspace of the guard's database, opened with fjall directly.
fn raw_db(state: &Path) -> Result<Database> {
    Database::builder(state.join("db"))
        .open()
        .map_err(|e| Error::Config(format!("raw open: {e}")))
}

fn raw_get(state: &Path, keyspace: &str, key: &[u8]) -> Result<Vec<u8>> {
    let db = raw_db(state)?;
    let ks = db
        .keyspace(keyspace, KeyspaceCreateOptions::default)
        .map_err(|e| Error::Config(format!("{e}")))?;
    let v = ks.get(key).map_err(|e| Error::Config(format!("{e}")))?;
    v.map(|v| v.to_vec())
        .ok_or_else(|| Error::Config(format!("no key {key:?} in {keyspace}")))
}

fn raw_put(state: &Path, keyspace: &str, key: &[u8], value: &[u8]) -> Result<()> {
    let db = raw_db(state)?;
    let ks = db
        .keyspace(keyspace, KeyspaceCreateOptions::default)
        .map_err(|e| Error::Config(format!("{e}")))?;
    ks.insert(key, value)
        .map_err(|e| Error::Config(format!("{e}")))?;
    db.persist(fjall::PersistMode::SyncAll)
        .map_err(|e| Error::Config(format!("{e}")))
}

/// Moves everything from the journal into table files.
fn raw_flush_tables(state: &Path) -> Result<()> {
    let db = raw_db(state)?;
    for name in ["meta", "lanes", "chunks"] {
        db.keyspace(name, KeyspaceCreateOptions::default)
            .and_then(|ks| ks.rotate_memtable_and_wait())
            .map_err(|e| Error::Config(format!("{e}")))?;
    }
    Ok(())
}

fn chunk_key(epoch: u64, lane: u32, seq: u64) -> Vec<u8> {
    let mut k = epoch.to_be_bytes().to_vec();
    k.extend_from_slice(&lane.to_be_bytes());
    k.extend_from_slice(&seq.to_be_bytes());
    k
}

fn assert_corrupt(e: &Error, dir: &Path, mentions: &str) {
    match e {
        Error::Corrupt { path, what } => {
            assert_eq!(path, dir);
            assert!(what.contains(mentions), "{what:?} lacks {mentions:?}");
        }
        other => panic!("expected Error::Corrupt mentioning {mentions:?}, got {other:?}"),
    }
    assert!(e.to_string().contains(&dir.display().to_string()));
}

#[test]
fn a_damaged_chunk_value_is_refused_and_comes_back_when_restored() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let state = dir.path();
    populate(state)?;
    let key = chunk_key(0, 1, 0);
    let good = raw_get(state, "chunks", &key)?;
    let mut bad = good.clone();
    let mid = bad.len() / 2;
    bad[mid] ^= 0x01;
    raw_put(state, "chunks", &key, &bad)?;
    assert_corrupt(&expect_err(open(state)), state, "chunk 0/1/0");
    // Truncated, and empty.
    for bad in [&good[..good.len() - 9], &[][..]] {
        raw_put(state, "chunks", &key, bad)?;
        assert_corrupt(&expect_err(open(state)), state, "chunk 0/1/0");
    }
    raw_put(state, "chunks", &key, &good)?;
    assert_intact(state)
}

#[test]
fn a_malformed_chunk_key_is_refused() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let state = dir.path();
    populate(state)?;
    let good = raw_get(state, "chunks", &chunk_key(1, 0, 0))?;
    // A 19-byte key sorts inside epoch 1.
    let mut short = chunk_key(1, 0, 0);
    short.pop();
    raw_put(state, "chunks", &short, &good)?;
    assert_corrupt(&expect_err(open(state)), state, "chunk key");
    let db = raw_db(state)?;
    db.keyspace("chunks", KeyspaceCreateOptions::default)
        .and_then(|ks| ks.remove(short))
        .map_err(|e| Error::Config(format!("{e}")))?;
    drop(db);
    assert_intact(state)
}

#[test]
fn a_chunk_of_an_unknown_lane_is_refused() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let state = dir.path();
    populate(state)?;
    let good = raw_get(state, "chunks", &chunk_key(1, 0, 0))?;
    raw_put(state, "chunks", &chunk_key(1, 7, 0), &good)?;
    assert_corrupt(&expect_err(open(state)), state, "lane 7");
    let db = raw_db(state)?;
    db.keyspace("chunks", KeyspaceCreateOptions::default)
        .and_then(|ks| ks.remove(chunk_key(1, 7, 0)))
        .map_err(|e| Error::Config(format!("{e}")))?;
    drop(db);
    assert_intact(state)
}

#[test]
fn a_damaged_manifest_is_refused_and_comes_back_when_restored() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let state = dir.path();
    populate(state)?;
    let good = raw_get(state, "meta", b"manifest")?;
    let mut flipped = good.clone();
    let last = flipped.len() - 2;
    flipped[last] ^= 0x20;
    // A valid checksum over JSON that is not a manifest.
    let json = b"{\"epoch\":1}";
    let mut wrong_shape = xxhash_rust::xxh3::xxh3_64(json).to_le_bytes().to_vec();
    wrong_shape.extend_from_slice(json);
    for (bad, says) in [
        (flipped, "checksum"),
        (good[..5].to_vec(), "truncated"),
        (wrong_shape, "malformed"),
    ] {
        raw_put(state, "meta", b"manifest", &bad)?;
        assert_corrupt(&expect_err(open(state)), state, says);
    }
    raw_put(state, "meta", b"manifest", &good)?;
    assert_intact(state)
}

#[test]
fn a_damaged_lane_table_is_refused() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let state = dir.path();
    populate(state)?;
    let key = 1u32.to_be_bytes();
    let good = raw_get(state, "lanes", &key)?;
    raw_put(state, "lanes", &key, b"{not json")?;
    assert_corrupt(&expect_err(open(state)), state, "lane entry");
    raw_put(state, "lanes", &key, &good)?;
    assert_intact(state)
}

/// Byte offsets of `needle` in `hay`.
fn find_all(hay: &[u8], needle: &[u8]) -> Vec<usize> {
    hay.windows(needle.len())
        .enumerate()
        .filter(|(_, w)| *w == needle)
        .map(|(i, _)| i)
        .collect()
}

/// Every file under `dir` that holds `needle`, with the offsets.
fn files_holding(dir: &Path, needle: &[u8]) -> Result<Vec<(PathBuf, Vec<usize>)>> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d)? {
            let path = entry?.path();
            if path.is_dir() {
                stack.push(path);
            } else {
                let hits = find_all(&std::fs::read(&path)?, needle);
                if !hits.is_empty() {
                    out.push((path, hits));
                }
            }
        }
    }
    Ok(out)
}

fn hash_bytes(f: Fingerprint) -> Vec<u8> {
    match f {
        Fingerprint::Hash(h) => h.to_le_bytes().to_vec(),
        Fingerprint::Id(i) => i.to_le_bytes().to_vec(),
    }
}

/// Flips one byte of a stored fingerprint in the file that holds it, and
/// expects a typed error; then puts the file back and expects the state.
fn flip_stored_fingerprint(state: &Path, needle: Fingerprint, in_tables: bool) -> Result<()> {
    let holders: Vec<_> = files_holding(&state.join("db"), &hash_bytes(needle))?
        .into_iter()
        .filter(|(path, _)| path.components().any(|c| c.as_os_str() == "tables") == in_tables)
        .collect();
    assert_eq!(
        holders.len(),
        1,
        "expected one file holding it: {holders:?}"
    );
    let (file, hits) = &holders[0];
    let good = std::fs::read(file)?;
    let mut bad = good.clone();
    bad[hits[0] + 5] ^= 0x10;
    std::fs::write(file, &bad)?;
    let e = expect_err(open(state));
    match &e {
        Error::Corrupt { path, .. } => assert_eq!(path, state),
        other => panic!("expected Error::Corrupt, got {other:?}"),
    }
    std::fs::write(file, &good)?;
    assert_intact(state)
}

#[test]
fn a_flipped_byte_in_the_journal_is_refused() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let state = dir.path();
    populate(state)?;
    // Epoch 1 was flushed, not checkpointed: it lives in the journal.
    flip_stored_fingerprint(state, fp(0, 120), false)
}

#[test]
fn a_flipped_byte_in_a_table_file_is_refused() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let state = dir.path();
    populate(state)?;
    raw_flush_tables(state)?;
    // Random hashes do not compress, so they sit in the table file as they
    // are (the journal keeps its copy, which recovery no longer reads).
    flip_stored_fingerprint(state, fp(1, 42), true)
}

#[test]
fn a_foreign_folder_is_refused_and_left_untouched() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let state = dir.path();
    std::fs::write(state.join("notes.txt"), b"someone else's")?;
    std::fs::create_dir(state.join("db"))?;
    let e = expect_err(open(state));
    assert!(
        matches!(&e, Error::ForeignState { path } if path == state),
        "{e:?}"
    );
    let mut names: Vec<_> = std::fs::read_dir(state)?
        .map(|e| e.map(|e| e.file_name()))
        .collect::<std::io::Result<_>>()?;
    names.sort();
    assert_eq!(names, ["db", "notes.txt"]);
    assert_eq!(std::fs::read_dir(state.join("db"))?.count(), 0);
    assert_eq!(std::fs::read(state.join("notes.txt"))?, b"someone else's");
    Ok(())
}

#[test]
fn a_state_folder_without_its_marker_is_refused_as_foreign() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let state = dir.path();
    populate(state)?;
    let marker = state.join("REPLAYGUARD");
    let saved = std::fs::read(&marker)?;
    std::fs::remove_file(&marker)?;
    assert!(matches!(
        expect_err(open(state)),
        Error::ForeignState { .. }
    ));
    assert!(!marker.exists(), "the refused open wrote a marker");
    std::fs::write(&marker, saved)?;
    assert_intact(state)
}

#[test]
fn a_garbled_marker_is_refused() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let state = dir.path();
    populate(state)?;
    let marker = state.join("REPLAYGUARD");
    let saved = std::fs::read(&marker)?;
    std::fs::write(&marker, b"replayguard state\nformat x\n")?;
    assert_corrupt(&expect_err(open(state)), state, "format line");
    std::fs::write(&marker, b"something else\n")?;
    assert_corrupt(&expect_err(open(state)), state, "REPLAYGUARD");
    std::fs::write(&marker, saved)?;
    assert_intact(state)
}

#[test]
fn a_missing_database_is_refused_not_recreated() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let state = dir.path();
    populate(state)?;
    let aside = tempfile::tempdir()?;
    std::fs::rename(state.join("db"), aside.path().join("db"))?;
    assert_corrupt(&expect_err(open(state)), state, "database");
    assert!(
        !state.join("db").exists(),
        "the refused open created a database"
    );
    std::fs::rename(aside.path().join("db"), state.join("db"))?;
    assert_intact(state)
}

#[test]
fn an_emptied_database_folder_is_refused() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let state = dir.path();
    populate(state)?;
    let aside = tempfile::tempdir()?;
    std::fs::rename(state.join("db"), aside.path().join("db"))?;
    std::fs::create_dir(state.join("db"))?;
    assert_corrupt(&expect_err(open(state)), state, "format key is missing");
    std::fs::remove_dir_all(state.join("db"))?;
    std::fs::rename(aside.path().join("db"), state.join("db"))?;
    assert_intact(state)
}

#[test]
fn an_interrupted_creation_is_finished_on_the_next_open() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let state = dir.path();
    // What a crash right after the first step of creating a folder leaves.
    std::fs::write(
        state.join("REPLAYGUARD"),
        format!("replayguard state\nformat {FORMAT_VERSION}\ncreating\n"),
    )?;
    populate(state)?;
    assert_eq!(
        std::fs::read_to_string(state.join("REPLAYGUARD"))?,
        format!("replayguard state\nformat {FORMAT_VERSION}\n")
    );
    assert_intact(state)
}

fn assert_unsupported(e: &Error, dir: &Path, version: u32) {
    match e {
        Error::UnsupportedVersion {
            path,
            found,
            supported,
        } => {
            assert_eq!(
                (path.as_path(), *found, *supported),
                (dir, version, FORMAT_VERSION)
            );
        }
        other => panic!("expected Error::UnsupportedVersion, got {other:?}"),
    }
}

#[test]
fn a_newer_format_in_the_marker_is_refused() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let state = dir.path();
    populate(state)?;
    let marker = state.join("REPLAYGUARD");
    let saved = std::fs::read_to_string(&marker)?;
    let (now, newer) = (
        format!("format {FORMAT_VERSION}"),
        format!("format {}", FORMAT_VERSION + 1),
    );
    assert!(saved.contains(&now), "{saved:?}");
    std::fs::write(&marker, saved.replace(&now, &newer))?;
    assert_unsupported(&expect_err(open(state)), state, FORMAT_VERSION + 1);
    assert_eq!(
        std::fs::read_to_string(&marker)?,
        saved.replace(&now, &newer)
    );
    std::fs::write(&marker, saved)?;
    assert_intact(state)
}

/// Format 1 listed the live epochs in the manifest, which each checkpoint
/// wrote whole; format 2 gives each its own entry.
#[test]
fn a_folder_of_format_1_opens_intact_and_is_marked_with_the_current_format() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let state = dir.path();
    populate(state)?;
    // Made into what a format 1 build leaves: the marker, the format key,
    // the manifest with its epochs listed, and no epoch entries.
    let mut manifest = open(state)?
        .manifest()
        .cloned()
        .ok_or_else(|| Error::Config("no manifest".into()))?;
    assert!(!manifest.epochs.is_empty());
    manifest.format = 1;
    let json = serde_json::to_vec(&manifest).map_err(|e| Error::Config(e.to_string()))?;
    let mut raw = xxhash_rust::xxh3::xxh3_64(&json).to_le_bytes().to_vec();
    raw.extend_from_slice(&json);
    let mut format1 = b"RPGUARD\0".to_vec();
    format1.extend_from_slice(&1u32.to_be_bytes());
    {
        let db = raw_db(state)?;
        let meta = db
            .keyspace("meta", KeyspaceCreateOptions::default)
            .map_err(|e| Error::Config(format!("{e}")))?;
        let entries: Vec<Vec<u8>> = meta
            .prefix(b"epoch")
            .map(|g| g.key().map(|k| k.to_vec()))
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| Error::Config(format!("{e}")))?;
        assert_eq!(entries.len(), manifest.epochs.len());
        let mut b = db.batch();
        for k in entries {
            b.remove(&meta, k);
        }
        b.insert(&meta, "manifest", raw);
        b.insert(&meta, "format", format1);
        b.commit().map_err(|e| Error::Config(format!("{e}")))?;
        db.persist(fjall::PersistMode::SyncAll)
            .map_err(|e| Error::Config(format!("{e}")))?;
    }
    let marker = state.join("REPLAYGUARD");
    std::fs::write(&marker, "replayguard state\nformat 1\n")?;
    // It opens as it was, and is marked with this build's format, so that
    // a format 1 build refuses it by its version.
    assert_intact(state)?;
    assert_eq!(
        std::fs::read_to_string(&marker)?,
        format!("replayguard state\nformat {FORMAT_VERSION}\n")
    );
    let key = raw_get(state, "meta", b"format")?;
    assert_eq!(key[8..], FORMAT_VERSION.to_be_bytes());
    // Its next checkpoint writes the epochs' entries, and it opens again.
    let mut g = open(state)?;
    let lanes = [g.lane("t", 0), g.lane("t", 1)];
    g.checkpoint(&[(lanes[0], OPEN), (lanes[1], OPEN)], b"sink".to_vec())?;
    drop(g);
    let mut g = open(state)?;
    assert_eq!(g.epoch(), 2);
    assert_eq!(g.manifest().map(|m| m.format), Some(FORMAT_VERSION));
    let lane = g.lane("t", 1);
    assert!(!g.check(lane, None, Some(fp(1, CLOSED + 20)))?.is_fresh());
    Ok(())
}

#[test]
fn a_newer_format_in_the_store_is_refused() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let state = dir.path();
    populate(state)?;
    let good = raw_get(state, "meta", b"format")?;
    assert_eq!(&good[..8], b"RPGUARD\0");
    let mut newer = good.clone();
    newer[8..].copy_from_slice(&7u32.to_be_bytes());
    raw_put(state, "meta", b"format", &newer)?;
    assert_unsupported(&expect_err(open(state)), state, 7);
    // Not a replayguard magic at all.
    raw_put(state, "meta", b"format", b"SOMETHING\0\0\x01")?;
    assert_corrupt(&expect_err(open(state)), state, "magic");
    // Missing while there is state.
    raw_db(state)?
        .keyspace("meta", KeyspaceCreateOptions::default)
        .and_then(|ks| ks.remove("format"))
        .map_err(|e| Error::Config(format!("{e}")))?;
    assert_corrupt(&expect_err(open(state)), state, "format key is missing");
    raw_put(state, "meta", b"format", &good)?;
    assert_intact(state)
}

#[test]
fn a_second_guard_in_this_process_is_refused() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let state = dir.path();
    populate(state)?;
    let mut first = open(state)?;
    let e = expect_err(open(state));
    assert!(
        matches!(&e, Error::InUse { path } if path == state),
        "{e:?}"
    );
    assert!(e.to_string().contains("in use"));
    // The first guard is unaffected and keeps working.
    let lane = first.lane("t", 0);
    assert!(!first.check(lane, Some(3), None)?.is_fresh());
    assert!(first.record(lane, Some(OPEN), None)?.is_fresh());
    drop(first);
    assert_intact(state)
}

// --- A second process -------------------------------------------------------

const HOLDER_ENV: &str = "REPLAYGUARD_TEST_HOLD_STATE";
const HOLDING: &str = "replayguard-test: holding the state folder";

/// Run as a child process: opens the folder, says so, and holds it until
/// its stdin closes.
#[test]
fn holder_child() -> Result<()> {
    let Ok(state) = std::env::var(HOLDER_ENV) else {
        return Ok(());
    };
    let g = open(Path::new(&state))?;
    println!("\n{HOLDING}");
    let mut line = String::new();
    std::io::stdin().read_line(&mut line)?;
    drop(g);
    Ok(())
}

fn spawn_holder(state: &Path) -> Result<Child> {
    let mut child = Command::new(std::env::current_exe()?)
        .args(["holder_child", "--exact", "--nocapture", "--test-threads=1"])
        .env(HOLDER_ENV, state)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    let stdout = child
        .stdout
        .take()
        .ok_or(Error::Config("no stdout".into()))?;
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(stdout));
    for line in lines.by_ref() {
        if line? == HOLDING {
            // Keep draining, or the holder's last words hit a closed pipe.
            std::thread::spawn(move || lines.for_each(drop));
            return Ok(child);
        }
    }
    panic!("the holder exited before it held the folder");
}

#[test]
fn a_folder_held_by_another_process_is_refused() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let state = dir.path();
    populate(state)?;
    let mut holder = spawn_holder(state)?;
    let e = expect_err(open(state));
    assert!(
        matches!(&e, Error::InUse { path } if path == state),
        "{e:?}"
    );
    // Closing its stdin lets the holder close the guard and exit.
    drop(holder.stdin.take());
    assert!(holder.wait()?.success());
    assert_intact(state)?;
    // A holder killed with SIGKILL releases the folder too.
    let mut holder = spawn_holder(state)?;
    assert!(matches!(expect_err(open(state)), Error::InUse { .. }));
    holder.kill()?;
    holder.wait()?;
    assert_intact(state)
}

// --- Unwritable folders -----------------------------------------------------

#[test]
fn a_path_below_a_regular_file_is_refused() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("plain");
    std::fs::write(&file, b"x")?;
    let state = file.join("state");
    let e = expect_err(open(&state));
    assert!(
        matches!(&e, Error::Open { path, .. } if path == &state),
        "{e:?}"
    );
    assert!(e.to_string().contains("writable"));
    assert_eq!(std::fs::read(&file)?, b"x");
    Ok(())
}

/// Makes a folder tree unwritable for the current user, and undoes it on
/// drop. Root bypasses permission bits, so for root it sets the immutable
/// attribute, which binds root too.
struct ReadOnly {
    dir: PathBuf,
    immutable: bool,
}

impl ReadOnly {
    fn set(dir: &Path) -> Result<Option<Self>> {
        // SAFETY: geteuid has no preconditions and cannot fail.
        let root = unsafe { libc::geteuid() } == 0;
        if root {
            let ok = Command::new("chattr")
                .arg("-R")
                .arg("+i")
                .arg(dir)
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if !ok {
                return Ok(None);
            }
        } else {
            chmod_tree(dir, false)?;
        }
        Ok(Some(ReadOnly {
            dir: dir.to_owned(),
            immutable: root,
        }))
    }
}

fn chmod_tree(dir: &Path, writable: bool) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            chmod_tree(&path, writable)?;
        } else {
            let mode = if writable { 0o644 } else { 0o444 };
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))?;
        }
    }
    let mode = if writable { 0o755 } else { 0o555 };
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode))?;
    Ok(())
}

impl Drop for ReadOnly {
    fn drop(&mut self) {
        if self.immutable {
            let _ = Command::new("chattr")
                .arg("-R")
                .arg("-i")
                .arg(&self.dir)
                .status();
        } else {
            let _ = chmod_tree(&self.dir, true);
        }
    }
}

#[test]
fn a_read_only_folder_is_refused() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let state = dir.path().join("state");
    populate(&state)?;
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty)?;
    {
        let Some(_ro) = ReadOnly::set(dir.path())? else {
            eprintln!(
                "SKIPPED a_read_only_folder_is_refused: running as root and chattr +i is \
                 not available on this file system, so no folder is read-only for this user"
            );
            return Ok(());
        };
        // The check is real only if writing there fails for this user.
        assert!(std::fs::write(state.join("probe"), b"x").is_err());
        for folder in [&state, &empty] {
            let e = expect_err(open(folder));
            match &e {
                Error::Open { path, source } => {
                    assert_eq!(path, folder);
                    assert_eq!(source.kind(), std::io::ErrorKind::PermissionDenied);
                }
                other => panic!("expected Error::Open, got {other:?}"),
            }
        }
    }
    assert_eq!(std::fs::read_dir(&empty)?.count(), 0);
    assert_intact(&state)
}
