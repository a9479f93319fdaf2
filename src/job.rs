//! The job a state folder belongs to.
//!
//! A folder remembers positions and identities for one job: one consumer
//! group reading some inputs with one identity, and, for a pipeline, one
//! output. A second job pointed at it by mistake would take the first
//! one's positions and identities as its own and skip everything (a
//! silent loss), so the folder records its job in a `JOB` file on first
//! use, and every later open compares.
//!
//! Some changes are safe and are taken with a log line: adding an input
//! topic (its partitions start with no state), removing one while another
//! stays (its state is kept, unused), turning a changelog on (its first
//! assign of each partition reads the topic whole), and anything that is
//! not part of the job (retention, durability, checkpoint interval, more
//! partitions on an input). Any other change (group, output, identity,
//! another changelog or none, kind, or no input in common) is refused
//! with [`Error::JobMismatch`], unless the open re-binds the folder on
//! purpose. Even a re-bind keeps the identity: identities recorded under
//! one mean nothing under another (and two user functions' ids would
//! collide), so a new identity needs a new folder.

use std::collections::BTreeSet;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The file that holds a folder's job.
pub const JOB_FILE: &str = "JOB";
const JOB_FORMAT: u32 = 1;

/// What kind of adapter a job is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum JobKind {
    /// A guarded pipeline: inputs, a function, an output.
    Pipeline,
    /// A guarded consumer.
    Consumer,
}

/// The job a state folder belongs to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Job {
    /// Pipeline or consumer.
    pub kind: JobKind,
    /// The consumer group.
    pub group: String,
    /// The input topics.
    pub inputs: BTreeSet<String>,
    /// The output topic (a pipeline's).
    pub output: Option<String>,
    /// The identity, as [`crate::Identity::label`] names it.
    pub identity: String,
    /// The changelog topic, if any.
    pub changelog: Option<String>,
}

impl Job {
    /// A job of `kind` for `group`, reading `inputs` with `identity`.
    pub fn new(
        kind: JobKind,
        group: impl Into<String>,
        inputs: impl IntoIterator<Item = impl Into<String>>,
        identity: impl Into<String>,
    ) -> Self {
        Job {
            kind,
            group: group.into(),
            inputs: inputs.into_iter().map(Into::into).collect(),
            output: None,
            identity: identity.into(),
            changelog: None,
        }
    }

    /// The same job, writing to `output`.
    #[must_use]
    pub fn with_output(mut self, output: impl Into<String>) -> Self {
        self.output = Some(output.into());
        self
    }

    /// The same job, with a changelog topic.
    #[must_use]
    pub fn with_changelog(mut self, changelog: Option<String>) -> Self {
        self.changelog = changelog;
        self
    }

    /// Why `self` (a folder's job) cannot serve `given` as it is, if it
    /// cannot.
    fn conflict(&self, given: &Job) -> Option<String> {
        if self.kind != given.kind {
            return Some(format!(
                "it belongs to a {} and this is a {}",
                self.kind.name(),
                given.kind.name()
            ));
        }
        if self.group != given.group {
            return Some(format!(
                "its consumer group is {:?}, not {:?}",
                self.group, given.group
            ));
        }
        if self.output != given.output {
            return Some(format!(
                "its output topic is {}, not {}",
                show(self.output.as_deref()),
                show(given.output.as_deref())
            ));
        }
        if self.identity != given.identity {
            return Some(format!(
                "its identity is {:?}, not {:?}: the stored identities mean nothing under another",
                self.identity, given.identity
            ));
        }
        // From none to a topic is safe; to another topic or to none is not:
        // the changelog ends this folder recorded name the old topic.
        if self.changelog.is_some() && self.changelog != given.changelog {
            return Some(format!(
                "its changelog topic is {}, not {}",
                show(self.changelog.as_deref()),
                show(given.changelog.as_deref())
            ));
        }
        if self.inputs.is_disjoint(&given.inputs) {
            return Some(format!(
                "it reads {:?}, and this job reads none of them ({:?})",
                self.inputs, given.inputs
            ));
        }
        None
    }
}

impl JobKind {
    fn name(self) -> &'static str {
        match self {
            JobKind::Pipeline => "pipeline",
            JobKind::Consumer => "consumer",
        }
    }
}

fn show(topic: Option<&str>) -> String {
    topic.map_or_else(|| "none".to_owned(), |t| format!("{t:?}"))
}

impl std::fmt::Display for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} of group {:?} reading {:?}",
            self.kind.name(),
            self.group,
            self.inputs
        )?;
        if let Some(o) = &self.output {
            write!(f, " into {o:?}")?;
        }
        write!(f, " with identity {:?}", self.identity)?;
        if let Some(c) = &self.changelog {
            write!(f, ", changelog {c:?}")?;
        }
        Ok(())
    }
}

#[derive(Serialize, Deserialize)]
struct JobFile {
    format: u32,
    #[serde(flatten)]
    job: Job,
}

/// What binding a folder to a job did.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Binding {
    /// The folder had no job yet (new, or written before folders recorded
    /// one): it is this job's now.
    New,
    /// The folder's job is this one.
    Same,
    /// A safe change (inputs added or removed) was taken.
    Changed {
        /// The folder's job before.
        was: Job,
    },
    /// The folder was re-bound on purpose from another job.
    Rebound {
        /// The folder's job before.
        was: Job,
    },
}

/// The job recorded in the state folder `path`, if any.
///
/// # Errors
///
/// [`Error::Corrupt`] for a `JOB` file that does not parse;
/// [`Error::Open`] when it cannot be read.
pub fn recorded(path: &Path) -> Result<Option<Job>> {
    let file = path.join(JOB_FILE);
    let text = match std::fs::read_to_string(&file) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(Error::Open {
                path: path.to_owned(),
                source,
            });
        }
    };
    let parsed: JobFile = serde_json::from_str(&text).map_err(|e| Error::Corrupt {
        path: path.to_owned(),
        what: format!("its {JOB_FILE} file does not parse: {e}"),
    })?;
    if parsed.format != JOB_FORMAT {
        return Err(Error::Corrupt {
            path: path.to_owned(),
            what: format!(
                "its {JOB_FILE} file has format {}, this build reads {JOB_FORMAT}",
                parsed.format
            ),
        });
    }
    Ok(Some(parsed.job))
}

/// Binds the state folder `path` (opened, so locked, by its guard) to
/// `job`: records it when the folder has none, takes a safe change, and
/// refuses any other unless `rebind`.
///
/// # Errors
///
/// [`Error::JobMismatch`] for another job's folder; the errors of
/// [`recorded`]; [`Error::Open`] when the file cannot be written.
pub fn bind(path: &Path, job: &Job, rebind: bool) -> Result<Binding> {
    let binding = match recorded(path)? {
        None => Binding::New,
        Some(was) if was == *job => return Ok(Binding::Same),
        Some(was) => match was.conflict(job) {
            None => Binding::Changed { was },
            // The stored identities would mean nothing, or worse: two user
            // functions' ids collide. A new identity needs a new folder.
            Some(_) if rebind && was.identity == job.identity => Binding::Rebound { was },
            Some(what) => {
                return Err(Error::JobMismatch {
                    path: path.to_owned(),
                    what,
                    folder: Box::new(was),
                    given: Box::new(job.clone()),
                });
            }
        },
    };
    write(path, job).map_err(|source| Error::Open {
        path: path.to_owned(),
        source,
    })?;
    match &binding {
        Binding::New => {
            tracing::info!(path = %path.display(), %job, "state folder bound to its job")
        }
        Binding::Changed { was } => tracing::warn!(
            path = %path.display(),
            was = %was,
            now = %job,
            "the job changed in a way it can take: added inputs start with no state, removed ones keep theirs unused, and a changelog turned on is read whole at each partition's first assign"
        ),
        Binding::Rebound { was } => tracing::warn!(
            path = %path.display(),
            was = %was,
            now = %job,
            "state folder re-bound to another job"
        ),
        Binding::Same => {}
    }
    Ok(binding)
}

/// Writes the `JOB` file atomically (a temporary file, fsynced, renamed).
fn write(path: &Path, job: &Job) -> std::io::Result<()> {
    let text = serde_json::to_string_pretty(&JobFile {
        format: JOB_FORMAT,
        job: job.clone(),
    })
    .map_err(std::io::Error::other)?;
    let tmp: PathBuf = path.join(format!("{JOB_FILE}.tmp"));
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(text.as_bytes())?;
    f.write_all(b"\n")?;
    f.sync_all()?;
    std::fs::rename(&tmp, path.join(JOB_FILE))?;
    std::fs::File::open(path)?.sync_all()
}

#[cfg(test)]
mod test {
    use super::*;

    fn pipeline(group: &str, inputs: &[&str], output: &str) -> Job {
        Job::new(JobKind::Pipeline, group, inputs.iter().copied(), "content").with_output(output)
    }

    #[test]
    fn a_folder_takes_its_first_job_and_refuses_another() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let job = pipeline("g1", &["in"], "out1");
        assert_eq!(bind(dir.path(), &job, false)?, Binding::New);
        assert_eq!(bind(dir.path(), &job, false)?, Binding::Same);
        assert_eq!(recorded(dir.path())?, Some(job.clone()));
        for (other, says) in [
            (pipeline("g2", &["in"], "out1"), "consumer group"),
            (pipeline("g1", &["in"], "out2"), "output topic"),
            (pipeline("g1", &["other"], "out1"), "none of them"),
            (
                Job::new(JobKind::Pipeline, "g1", ["in"], "key").with_output("out1"),
                "identity",
            ),
            (
                Job::new(JobKind::Consumer, "g1", ["in"], "content"),
                "consumer",
            ),
        ] {
            match bind(dir.path(), &other, false) {
                Err(Error::JobMismatch { what, .. }) => assert!(what.contains(says), "{what}"),
                r => panic!("{other} should be refused, got {r:?}"),
            }
        }
        // Refusals change nothing.
        assert_eq!(recorded(dir.path())?, Some(job));
        Ok(())
    }

    #[test]
    fn a_changelog_can_be_turned_on_but_not_changed_or_turned_off() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let plain = pipeline("g1", &["in"], "out1");
        let logged = plain.clone().with_changelog(Some("log-a".into()));
        bind(dir.path(), &plain, false)?;
        assert!(matches!(
            bind(dir.path(), &logged, false)?,
            Binding::Changed { .. }
        ));
        for other in [plain, logged.with_changelog(Some("log-b".into()))] {
            match bind(dir.path(), &other, false) {
                Err(Error::JobMismatch { what, .. }) => {
                    assert!(what.contains("changelog topic is \"log-a\""), "{what}");
                }
                r => panic!("{other}: {r:?}"),
            }
        }
        Ok(())
    }

    #[test]
    fn safe_changes_are_taken_and_a_rebind_takes_anything() -> Result<()> {
        let dir = tempfile::tempdir()?;
        bind(dir.path(), &pipeline("g", &["a"], "out"), false)?;
        let more = pipeline("g", &["a", "b"], "out");
        assert!(matches!(
            bind(dir.path(), &more, false)?,
            Binding::Changed { .. }
        ));
        let fewer = pipeline("g", &["b"], "out");
        assert!(matches!(
            bind(dir.path(), &fewer, false)?,
            Binding::Changed { .. }
        ));
        let other = pipeline("h", &["c"], "elsewhere");
        assert!(bind(dir.path(), &other, false).is_err());
        assert!(matches!(
            bind(dir.path(), &other, true)?,
            Binding::Rebound { .. }
        ));
        assert_eq!(recorded(dir.path())?, Some(other.clone()));
        let keyed = Job::new(JobKind::Pipeline, "h", ["c"], "key").with_output("elsewhere");
        assert!(
            matches!(
                bind(dir.path(), &keyed, true),
                Err(Error::JobMismatch { .. })
            ),
            "a re-bind must not change the identity"
        );
        assert_eq!(recorded(dir.path())?, Some(other));
        std::fs::write(dir.path().join(JOB_FILE), "{ not json")?;
        assert!(matches!(recorded(dir.path()), Err(Error::Corrupt { .. })));
        Ok(())
    }
}
