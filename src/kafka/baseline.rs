//! The baselines the guard is measured against, off the product's face
//! (the `baselines` feature): the same pipeline, copying without a guard.
//!
//! - [`Baseline::AtLeastOnce`]: an idempotent producer and offsets committed
//!   at each checkpoint, no guard. A crash duplicates what was written since
//!   the last checkpoint, as any at-least-once sink does.
//! - [`Baseline::Transactional`]: Kafka transactions committed at every
//!   checkpoint. Exactly once for `read_committed` readers, who see each
//!   output only once the checkpoint that commits it is done.
//!
//! ```no_run
//! # async fn f(config: rdkafka::ClientConfig) -> replayguard::Result<()> {
//! use replayguard::kafka::GuardedPipeline;
//! use replayguard::kafka::baseline::Baseline;
//!
//! let unguarded = GuardedPipeline::builder(config, "/tmp/baseline")
//!     .input("in")
//!     .output("out")
//!     .baseline(Baseline::AtLeastOnce)
//!     .build()
//!     .await?;
//! # let _ = unguarded;
//! # Ok(()) }
//! ```

use super::pipeline::{GuardedPipelineBuilder, Mode};
use crate::error::{Error, Result};

/// An unguarded way to copy, to measure the guard against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Baseline {
    /// A plain copy: duplicates after a crash.
    AtLeastOnce,
    /// Kafka transactions committed at every checkpoint.
    Transactional,
}

impl std::str::FromStr for Baseline {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "at-least-once" => Ok(Baseline::AtLeastOnce),
            "transactional" => Ok(Baseline::Transactional),
            other => Err(Error::Config(format!(
                "unknown baseline {other:?}: use at-least-once or transactional"
            ))),
        }
    }
}

impl GuardedPipelineBuilder {
    /// Copies without the guard, the way `baseline` says, to measure the
    /// guard against. No state is recorded but the positions.
    pub fn baseline(mut self, baseline: Baseline) -> Self {
        self.mode = match baseline {
            Baseline::AtLeastOnce => Mode::AtLeastOnce,
            Baseline::Transactional => Mode::Transactional,
        };
        self
    }

    /// Reads the output back on recovery. Default true. Turning it off
    /// reopens the window between an output's ack and its input's identity
    /// reaching disk, so a crash there duplicates the output: it exists to
    /// measure and demonstrate that window.
    pub fn reconcile_output(mut self, yes: bool) -> Self {
        self.reconcile = yes;
        self
    }
}
